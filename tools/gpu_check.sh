#!/usr/bin/env bash
# Everything that needs the GPU, in one run (device machine, repo root): a cold build of the op library and a warm
# import, timed; the SASS of the kernels; the full test suite; compute-sanitizer over every kernel; bench.py with its
# chart. Logs go to $OUT if set.
#   SKIP_TESTS=1 / SKIP_SANITIZE=1 / SKIP_BENCH=1 leave a part out; BENCH_ARGS are passed to bench.py; BENCH_RUNS=3
#   runs it three times (the first with the chart) and prints ModelNew's speedup per row over the runs.
# Where matplotlib is missing, wheels in .whl/ (if carried) are installed for the chart.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
export TORCH_EXTENSIONS_DIR=$(mktemp -d)  # a cold build, whatever is cached elsewhere

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
nproc

seconds() { python3 -c 'import time; print(time.time())'; }
t0=$(seconds); python3 -c "import kernels.functional"; t1=$(seconds)
python3 -c "print(f'cold build + import: {$t1 - $t0:.1f} s (includes python and torch start-up)')"
# Per library and target of the build: seconds, from ninja's log (start and end in ms). The libraries build at once.
for log in "$TORCH_EXTENSIONS_DIR"/*/.ninja_log; do
  echo "  $(basename "$(dirname "$log")")"
  awk 'NR > 1 && $4 !~ /\.so$/ {printf "    %-10s %5.1f s\n", $4, ($2 - $1) / 1000}' "$log"
done
# Again into an empty folder: the compilers' files are in the page cache now, so this shows how much of the first
# build was cold disk.
TORCH_EXTENSIONS_DIR=$(mktemp -d) python3 -c "import kernels.functional" 2>&1 | grep built
t0=$(seconds); python3 -c "import kernels.functional"; t1=$(seconds)
python3 -c "print(f'warm import in a new process: {$t1 - $t0:.2f} s (python + torch + kernels)')"
python3 -c "
import time, torch
start = time.perf_counter(); import kernels.functional
print(f'warm import of kernels alone (torch already imported): {time.perf_counter() - start:.2f} s')"

for so in "$TORCH_EXTENSIONS_DIR"/*/*.so; do cuobjdump --dump-sass "$so"; done > "$OUT/sass.txt" 2>&1
echo "SASS: vectorized fp32 forward kernel's global accesses:"
awk '/Function : .*multiply_leaky_relu_kernelIfLi4ELb0ELb0E/{p=1; next} /Function :/{p=0} p && /LDG|STG/{print "   ", $2, $3}' "$OUT/sass.txt" | sort | uniq -c

echo "SASS: HGMMA instructions per GEMM kernel:"
awk '/Function :/{name=$3} /HGMMA/{n[name]++} END {for (k in n) print "   ", n[k], k}' "$OUT/sass.txt"

# Smoke test: every kernel once on small shapes against eager, bounded in time (a pipeline that deadlocks hangs).
if ! timeout 180 python3 tools/sanitize_cases.py; then
  echo "smoke test failed or hung: stopping here"
  exit 1
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 900 python3 -m pytest -q -rs tests 2>&1 | tee "$OUT/pytest.log" | tail -25
fi
if [ "${SKIP_SANITIZE:-0}" != 1 ]; then
  bash tools/sanitize.sh
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  if ! python3 -c "import matplotlib" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  fi
  python3 bench.py ${BENCH_ARGS:-} --json "$OUT/bench.json" --plot "$OUT/bench.png" --markdown "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log"
  # More runs, tables to their logs only, then ModelNew's speedup per row across all of them.
  for run in $(seq 2 "${BENCH_RUNS:-1}"); do
    python3 bench.py ${BENCH_ARGS:-} --json "$OUT/bench$run.json" > "$OUT/bench$run.log" 2>&1
  done
  if [ "${BENCH_RUNS:-1}" -gt 1 ]; then
    # In run order (a glob's order depends on the locale: bench2.json can sort before bench.json).
    python3 tools/bench_runs.py "$OUT/bench.json" $(seq -f "$OUT/bench%g.json" 2 "$BENCH_RUNS")
  fi
fi
