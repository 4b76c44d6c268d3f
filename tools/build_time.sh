#!/usr/bin/env bash
# Where the op library's first build spends its time (device machine, repo root): a cold build with each ninja
# target's seconds, a second build once the compilers' files are in the page cache, and main.cpp (the torch side)
# compiled again without the C++ autograd Function, whose header is the heaviest one it includes, and with the
# pybind11 header a Python binding would need.
set -uo pipefail
export TORCH_EXTENSIONS_DIR=$(mktemp -d)
nproc; lscpu | grep -m1 'Model name'
python3 -c "import kernels" 2>&1 | grep built
build=$(ls -d "$TORCH_EXTENSIONS_DIR"/*/)
awk 'NR > 1 {printf "    %-14s %5.1f s\n", $4, ($2 - $1) / 1000}' "$build/.ninja_log"
TORCH_EXTENSIONS_DIR=$(mktemp -d) python3 -c "import kernels" 2>&1 | grep built

cd "$build"
flags=$(sed -n 's/^cflags = //p' build.ninja)
post=$(sed -n 's/^post_cflags = //p' build.ninja)
python3 - main.cpp <<'PY'
import sys
source = open(sys.argv[1]).read()
start, end = source.index("class LeakyReluFunction"), source.index("at::Tensor leaky_relu_autograd")
source = source[:start] + source[end:]
source = source.replace("return LeakyReluFunction::apply(x, negative_slope);", "return x;")
source = source.replace("#include <torch/csrc/autograd/custom_function.h>",
                        "#include <ATen/core/dispatch/Dispatcher.h>\n#include <ATen/core/grad_mode.h>")
open("main_without_function.cpp", "w").write(source)
open("main_with_pybind.cpp", "w").write("#include <torch/csrc/utils/pybind.h>\n" + open(sys.argv[1]).read())
PY
for file in main.cpp main_without_function.cpp main_with_pybind.cpp; do
  start=$(date +%s.%N)
  c++ $flags $post -c $file -o /tmp/probe.o 2>/dev/null
  echo "$file: $(python3 -c "print(f'{$(date +%s.%N) - $start:.1f}')") s"
done
