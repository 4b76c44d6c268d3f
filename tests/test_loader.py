"""The loader (kernels/loader.py): joined translation units, inlined project headers with #line, the build key, and a
second family added to a copy of the library whose names collide with the first's, built and called through the
loader. The CUDA parts need nvcc (CI has it) or a GPU, and skip without."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from torch.utils import cpp_extension

from conftest import HAS_CUDA, requires_cuda
from kernels import loader
from kernels.manifest import FAMILIES, Family

from test_cuda_compile import NVCC, compile_cuda

pytestmark = pytest.mark.slow  # builds of the op library, fresh processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The test family: its .cu reuses the LeakyReLU family's names (kThreads and a kernel called
# multiply_leaky_relu_kernel, both in an anonymous namespace, as in leaky_relu.cu) and includes a project .cuh that
# the .cpp includes too.
TWIN_FILES = {
    "twin/twin_factor.cuh": """\
// The factor of the test family; included by twin.cu and twin.cpp.
#pragma once
#ifdef __CUDACC__
#define TWIN_HOST_DEVICE __host__ __device__
#else
#define TWIN_HOST_DEVICE
#endif
namespace kernels::twin {
constexpr float kFactor = 2.0f;
TWIN_HOST_DEVICE inline float apply_factor(float v) { return v * kFactor; }
}  // namespace kernels::twin
""",
    "twin/twin.h": """\
#pragma once
#include <cstdint>
#include <cuda_runtime_api.h>
namespace kernels::twin {
cudaError_t launch_twice(const float* x, float* y, std::int64_t n, cudaStream_t stream);
}  // namespace kernels::twin
""",
    "twin/twin.cu": """\
#include "twin.h"
#include "twin_factor.cuh"
namespace kernels::twin {
namespace {
constexpr int kThreads = 128;
__global__ void multiply_leaky_relu_kernel(const float* x, float* y, std::int64_t n) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) y[i] = apply_factor(x[i]);
}
}  // namespace
cudaError_t launch_twice(const float* x, float* y, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  multiply_leaky_relu_kernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(x, y, n);
  return cudaGetLastError();
}
}  // namespace kernels::twin
""",
    "twin/twin.cpp": """\
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "common/torch_checks.h"
#include "twin_factor.cuh"
#ifdef KERNELS_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include "twin.h"
#endif

namespace kernels::twin {
namespace {
at::Tensor twice(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "_test_twin_twice takes contiguous float32");
  at::Tensor y = at::empty_like(x);
#ifdef KERNELS_WITH_CUDA
  if (x.is_cuda()) {
    TORCH_CHECK(launch_twice(x.const_data_ptr<float>(), y.mutable_data_ptr<float>(), x.numel(),
                             c10::cuda::getCurrentCUDAStream().stream()) == cudaSuccess);
    return y;
  }
#endif
  for (int64_t i = 0; i < x.numel(); ++i) y.mutable_data_ptr<float>()[i] = apply_factor(x.const_data_ptr<float>()[i]);
  return y;
}
}  // namespace
}  // namespace kernels::twin

TORCH_LIBRARY_FRAGMENT(kernels, m) { m.def("_test_twin_twice(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(kernels, CPU, m) { m.impl("_test_twin_twice", &kernels::twin::twice); }
#ifdef KERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(kernels, CUDA, m) { m.impl("_test_twin_twice", &kernels::twin::twice); }
#endif
""",
    # Its autograd source, as the families' autograd files are: a kernel for the family's op under another key (Meta
    # here), and an op of its own that reaches the family's op through the dispatcher only.
    "twin/twin_autograd.cpp": """\
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

namespace kernels::twin {
namespace {
at::Tensor twice_twice(const at::Tensor& x) {
  static const auto twice = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("kernels::_test_twin_twice", "")
                                .typed<at::Tensor(const at::Tensor&)>();
  return twice.call(twice.call(x));
}
at::Tensor twice_meta(const at::Tensor& x) { return at::empty_like(x); }
}  // namespace
}  // namespace kernels::twin

TORCH_LIBRARY_FRAGMENT(kernels, m) { m.def("_test_twin_twice_twice(Tensor x) -> Tensor", &kernels::twin::twice_twice); }
TORCH_LIBRARY_IMPL(kernels, Meta, m) { m.impl("_test_twin_twice", &kernels::twin::twice_meta); }
""",
}
TWIN = Family(name="twin", cpp_sources=("twin/twin.cpp",), cuda_sources=("twin/twin.cu",), python_module="")


@pytest.fixture
def library_copy(tmp_path):
    """A copy of kernels/ with the twin family added; returns its root."""
    root = tmp_path / "kernels"
    shutil.copytree(os.path.join(REPO, "kernels"), root, ignore=shutil.ignore_patterns("__pycache__"))
    for path, text in TWIN_FILES.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def test_pure_python_helpers_import_without_building():
    code = ("import sys, kernels.precision, kernels.manifest; "
            "assert 'kernels.loader' not in sys.modules, 'kernels.precision imported the loader'; "
            "assert not any(m.startswith(('kernels.leaky_relu', 'kernels.gemm', 'kernels.functional')) "
            "for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


# Registers its own exit handler first: atexit runs handlers last-registered first, so this one reports what the
# library's handler did.
EXIT_REPORT = """
import atexit, sys, torch
atexit.register(lambda: print("kept", len(sys.modules["kernels_autograd_exit"].kept),
                              "cuda initialized", torch.cuda.is_initialized()))
from kernels.loader import drain_autograd_at_exit
handlers = atexit._ncallbacks()
drain_autograd_at_exit()
drain_autograd_at_exit()
print("registered", atexit._ncallbacks() - handlers)
for device in sys.argv[1].split(","):
    x = torch.randn(8, device=device, requires_grad=True)
    (x * 2).sum().backward()
"""


@pytest.mark.parametrize("devices", ["cpu", "cuda", "cuda:0,cuda:1"])
def test_exit_handler_runs_one_backward_per_device_used(devices):
    """The exit handler (registered once however often it is asked) runs a backward on each CUDA device with a
    context, so that autograd's thread for it is done with the last one before Python finalizes; a process that
    never used CUDA is left without initializing it."""
    used = 0 if devices == "cpu" else len(devices.split(","))
    if used > torch.cuda.device_count():
        pytest.skip(f"needs {used} CUDA GPUs")
    result = subprocess.run([sys.executable, "-c", EXIT_REPORT, devices], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0 and "Exception ignored" not in result.stderr, result.stderr[-3000:]
    assert result.stdout.split() == ["registered", "1", "kept", str(used), "cuda", "initialized", str(used > 0)], \
        result.stdout


def test_headers_are_inlined_once_with_line_directives(library_copy):
    text = loader.joined_source(["twin/twin.cu", "twin/twin.cu"], root=library_copy)
    lines = text.splitlines()
    assert lines[0] == '#line 1 "kernels/twin/twin.cu"'
    assert text.count('#line 1 "kernels/twin/twin.h"') == 1
    assert text.count('#line 1 "kernels/twin/twin_factor.cuh"') == 1
    assert text.count("constexpr float kFactor") == 1  # inlined once, whatever includes it again
    assert '#include "' not in text and "#pragma once" not in text
    # After each header, a #line back into the includer at the line after its #include.
    assert '#line 2 "kernels/twin/twin.cu"' in lines and '#line 3 "kernels/twin/twin.cu"' in lines


def test_a_missing_project_header_names_file_and_line(library_copy):
    (library_copy / "twin" / "twin.cu").write_text('// one\n#include "no_such_header.cuh"\n')
    with pytest.raises(FileNotFoundError, match=r'kernels/twin/twin.cu:2: #include "no_such_header.cuh"'):
        loader.joined_source(["twin/twin.cu"], root=library_copy)


def test_editing_only_a_header_changes_the_build_key(library_copy):
    before = loader.plan_build("twin", [TWIN], root=library_copy, with_cuda=False).name
    assert loader.plan_build("twin", [TWIN], root=library_copy, with_cuda=False).name == before
    header = library_copy / "twin" / "twin_factor.cuh"
    header.write_text(header.read_text().replace("2.0f", "3.0f"))
    assert loader.plan_build("twin", [TWIN], root=library_copy, with_cuda=False).name != before
    assert loader.plan_build("twin", [TWIN], root=library_copy, with_cuda=True).name != before


def test_second_family_builds_and_runs_through_the_loader(library_copy, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "builds"))
    loader.build_and_load([loader.plan_build("twin", [TWIN], root=library_copy)])
    x = torch.randn(1000)
    torch.testing.assert_close(torch.ops.kernels._test_twin_twice(x), x * 2, rtol=0, atol=0)
    if HAS_CUDA:
        torch.testing.assert_close(torch.ops.kernels._test_twin_twice(x.cuda()).cpu(), x * 2, rtol=0, atol=0)


BUILD_TWIN_WITH_AUTOGRAD = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
from kernels import loader
from kernels.manifest import Family
twin = Family(name="twin", cpp_sources=("twin/twin.cpp",), cuda_sources=("twin/twin.cu",), python_module="",
              autograd_sources=("twin/twin_autograd.cpp",))
(build,) = loader.library_builds([twin], root=sys.argv[2])
loader.build_and_load([build])
x = torch.randn(100)
assert torch.equal(torch.ops.kernels._test_twin_twice_twice(x), x * 4)
assert torch.ops.kernels._test_twin_twice(torch.empty(7, device="meta")).shape == (7,)
"""


def test_a_family_with_an_autograd_source_builds_as_one_library_and_runs(library_copy, tmp_path):
    """The autograd file, joined after the family's C++ files, registers a kernel for the family's op and an op of
    its own that reaches the family's op through the dispatcher."""
    result = subprocess.run([sys.executable, "-c", BUILD_TWIN_WITH_AUTOGRAD, REPO, str(library_copy)],
                            capture_output=True, text=True, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize("with_cuda", [False, True])
def test_the_library_builds_hold_every_family_once(with_cuda):
    """With CUDA, one library per family in the manifest's order; CPU-only, two: the families with CPU loops (at
    -O3) and the others (at -O1). A family's C++ files (CPU loops, torch side, autograd) lie in that order in its
    library's C++ unit, each once, and families in the manifest's order; CUDA units only in a CUDA build."""
    builds = loader.library_builds(with_cuda=with_cuda)
    if with_cuda:
        assert [build.family_names for build in builds] == [(family.name,) for family in FAMILIES]
    else:
        assert [build.family_names for build in builds] == [
            tuple(f.name for f in FAMILIES if f.cpu_loop_sources),
            tuple(f.name for f in FAMILIES if not f.cpu_loop_sources)]
    held = [name for build in builds for name in build.family_names]
    assert sorted(held) == sorted(family.name for family in FAMILIES)
    for build in builds:
        families = [family for family in FAMILIES if family.name in build.family_names]
        cpp_files = [path for family in families for path in family.cpp_unit]
        starts = [build.cpp_source.find(f'#line 1 "kernels/{path}"') for path in cpp_files]
        assert all(start >= 0 for start in starts) and starts == sorted(starts), (build.label, starts)
        for path in cpp_files:
            assert build.cpp_source.count(f'#line 1 "kernels/{path}"') == 1, path
        for path in (path for family in families for path in family.cuda_sources):
            assert build.cuda_source.count(f'#line 1 "kernels/{path}"') == (1 if with_cuda else 0), path
        assert ("-O3" in build.cflags) == any(family.cpu_loop_sources for family in families), build.label
        assert build.with_cuda == with_cuda
        assert bool(build.cuda_cflags) == (with_cuda and any(family.cuda_sources for family in families))


def check_cpp_syntax(cpp, tmp_path, cflags=None):
    """g++ -fsyntax-only on a C++ unit, with `cflags` (default: the loader's flags for a CPU build)."""
    source = tmp_path / "unit.cpp"
    source.write_text(cpp)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    cflags = loader.build_flags(False)[0] if cflags is None else cflags
    result = subprocess.run([os.environ.get("CXX", "c++"), "-std=c++17", "-fsyntax-only", *cflags,
                             *includes, f"-I{sys.base_prefix}/include", str(source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]


def test_joined_cpp_of_every_family_compiles_as_one_unit(library_copy, tmp_path):
    """A single-file build (one C++ unit for all families) must see no name collide; g++ checks the syntax."""
    check_cpp_syntax(loader.family_sources([*FAMILIES, TWIN], root=library_copy)[0], tmp_path)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_joined_cuda_of_every_family_compiles_as_one_unit(library_copy, tmp_path, arch):
    _, cuda = loader.family_sources([*FAMILIES, TWIN], root=library_copy)
    compile_cuda(cuda, arch, tmp_path)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_compiler_errors_name_the_real_file_and_line(library_copy, tmp_path):
    header = library_copy / "twin" / "twin_factor.cuh"
    lines = header.read_text().splitlines()
    lines.insert(2, "this line does not compile;")  # becomes line 3 of the header
    header.write_text("\n".join(lines) + "\n")
    _, cuda = loader.family_sources([TWIN], root=library_copy)
    source = tmp_path / "cuda.cu"
    source.write_text(cuda)
    result = subprocess.run([NVCC, "-std=c++17", "-c", str(source), "-o", str(tmp_path / "out.o")],
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert "kernels/twin/twin_factor.cuh(3)" in result.stderr, result.stderr


# ---- builds that meet each other, die, or leave a broken file (each in processes of their own: a library can be
# loaded into a process only once) -----------------------------------------------------------------------------

BUILD_TWIN = """
import sys, time
sys.path.insert(0, sys.argv[1])
import torch
from kernels import loader
from kernels.manifest import Family
twin = Family(name="twin", cpp_sources=("twin/twin.cpp",), cuda_sources=("twin/twin.cu",), python_module="")
build = loader.plan_build("twin", [twin], root=sys.argv[2])
loader.build_and_load([build])
x = torch.randn(100)
assert torch.equal(torch.ops.kernels._test_twin_twice(x), x * 2)
print(build.build_dir)
"""


def start_twin_build(library_copy, builds, **env):
    return subprocess.Popen([sys.executable, "-c", BUILD_TWIN, REPO, str(library_copy)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TORCH_EXTENSIONS_DIR": str(builds), **env})


def finish(process, timeout=600):
    stdout, stderr = process.communicate(timeout=timeout)
    return process.returncode, stdout.strip(), stderr


def twin_build_dir(library_copy, builds, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(builds))
    return loader.plan_build("twin", [TWIN], root=library_copy).build_dir


def test_two_cold_builds_at_once_both_succeed_and_build_once(library_copy, tmp_path):
    builds = tmp_path / "builds"
    first, second = start_twin_build(library_copy, builds), start_twin_build(library_copy, builds)
    (rc1, dir1, err1), (rc2, dir2, err2) = finish(first), finish(second)
    assert rc1 == 0 and rc2 == 0, err1 + err2
    with open(os.path.join(dir1, ".ninja_log")) as f:
        assert sum(line.split("\t")[3] == "main.o" for line in f if not line.startswith("#")) == 1


def test_a_lock_left_by_a_killed_build_is_removed(library_copy, tmp_path, monkeypatch):
    build_dir = twin_build_dir(library_copy, tmp_path / "builds", monkeypatch)
    os.makedirs(build_dir)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with open(os.path.join(build_dir, "lock"), "w") as f:
        f.write("")
    with open(os.path.join(build_dir, "builder_pid"), "w") as f:
        f.write(str(gone.pid))
    rc, _, err = finish(start_twin_build(library_copy, tmp_path / "builds"), timeout=300)
    assert rc == 0, err
    assert "removing the lock of a build that did not finish" in err


def test_a_lock_held_too_long_is_an_error_naming_the_file(library_copy, tmp_path, monkeypatch):
    build_dir = twin_build_dir(library_copy, tmp_path / "builds", monkeypatch)
    os.makedirs(build_dir)
    with open(os.path.join(build_dir, "lock"), "w") as f:
        f.write("")  # no builder_pid: nothing tells whether its builder still runs
    process = start_twin_build(library_copy, tmp_path / "builds", KERNELS_BUILD_LOCK_TIMEOUT="2")
    rc, _, err = finish(process, timeout=120)
    assert rc != 0 and f"delete {os.path.join(build_dir, 'lock')}" in err, err


def test_a_library_file_that_cannot_be_loaded_is_built_again(library_copy, tmp_path):
    builds = tmp_path / "builds"
    rc, build_dir, err = finish(start_twin_build(library_copy, builds))
    assert rc == 0, err
    library = next(os.path.join(build_dir, n) for n in os.listdir(build_dir) if n.endswith(".so"))
    with open(library, "r+b") as f:
        f.truncate(100)  # what a link killed halfway leaves
    rc, _, err = finish(start_twin_build(library_copy, builds))
    assert rc == 0, err
    assert "cannot be loaded" in err and "building it again" in err
