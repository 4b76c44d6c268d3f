"""The one loader: builds the op library from its sources with torch.utils.cpp_extension.load_inline and loads it.

A build is named after a hash of everything that shapes it (the sources, torch and CUDA versions, the target GPU
architectures, the flags), so it is made once per source content and found ready by later processes; builds live
under $TORCH_EXTENSIONS_DIR, or torch's default extensions folder. Where torch has no CUDA or no GPU is visible,
the library is built CPU-only, so the CPU implementations work on any machine.
"""

import hashlib
import os
import shutil
import sys
import time

import torch
from torch.utils import cpp_extension

LIBRARY_PREFIX = "kernels_ops"
LAUNCHERS_INCLUDE = '#include "launchers.h"'


def _cuda_arch_flags():
    """One -gencode per distinct visible GPU architecture; Hopper gets sm_90a so wgmma and setmaxnreg are there."""
    capabilities = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    flags = []
    for major, minor in capabilities:
        arch = f"{major}{minor}{'a' if (major, minor) == (9, 0) else ''}"
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


def _check_build_tools(with_cuda):
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("kernels: building the op library needs ninja; install it with `pip install ninja`.")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"kernels: building the op library needs a C++ compiler, and `{compiler}` was not found; "
                           "install g++ (e.g. `apt-get install g++`) or point CXX at one.")
    if with_cuda:
        nvcc = os.path.join(cpp_extension.CUDA_HOME or "", "bin", "nvcc")
        if cpp_extension.CUDA_HOME is None or not os.path.exists(nvcc):
            raise RuntimeError(
                f"kernels: a GPU is visible but the CUDA compiler nvcc was not found (CUDA_HOME="
                f"{cpp_extension.CUDA_HOME}); install the CUDA toolkit {torch.version.cuda} to match torch "
                f"{torch.__version__}, or set CUDA_HOME to it.")


def load_library(sources):
    """Builds (if needed) and loads the op library; `sources` maps file names to their text:
    ops.cpp, launchers.h and each kernel's .cu. Returns True if this call loaded it into the process, False if
    it was loaded already."""
    with_cuda = torch.version.cuda is not None and torch.cuda.is_available()
    header = sources["launchers.h"].replace("#pragma once\n", "")  # inlined once into each translation unit
    cpp_source = sources["ops.cpp"].replace(LAUNCHERS_INCLUDE, header if with_cuda else "")
    cuda_sources = [header] + [sources[name].replace(LAUNCHERS_INCLUDE, "")
                               for name in sorted(sources) if name.endswith(".cu")]
    # -fno-trapping-math (as torch itself is built) lets the CPU loops' selects vectorize; results are unchanged.
    # at::parallel_for runs its chunks on OpenMP threads only where the caller is compiled with -fopenmp; linked
    # with it too, the library shares the libgomp that torch has loaded (same soname).
    openmp = ["-fopenmp"] if torch.backends.openmp.is_available() else []
    cflags = ["-O3", "-fno-trapping-math", *openmp] + (["-DKERNELS_WITH_CUDA"] if with_cuda else [])
    cuda_cflags = ["-O3"] + (_cuda_arch_flags() if with_cuda else [])

    key = hashlib.sha256()
    for part in [cpp_source, *cuda_sources, *cflags, *cuda_cflags, torch.__version__, str(torch.version.cuda),
                 sys.version, str(with_cuda)]:
        key.update(part.encode())
        key.update(b"\0")
    name = f"{LIBRARY_PREFIX}_{'cuda' if with_cuda else 'cpu'}_{key.hexdigest()[:16]}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    build_dir = os.path.join(root, name)
    library = os.path.join(build_dir, f"{name}.so")
    if library in torch.ops.loaded_libraries:
        return False
    if os.path.exists(library):
        torch.ops.load_library(library)
        return True

    _check_build_tools(with_cuda)
    target = f"CUDA ({', '.join(f[f.rindex('=') + 1:] for f in _cuda_arch_flags())})" if with_cuda else "CPU only"
    print(f"kernels: compiling the op library for {target} (once per source version; about "
          f"{'20' if with_cuda else '10'} s) into {build_dir}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    os.makedirs(build_dir, exist_ok=True)
    # A compiler error raises here, with the compiler's own message.
    cpp_extension.load_inline(
        name=name,
        cpp_sources=[cpp_source],
        cuda_sources=cuda_sources if with_cuda else None,
        extra_cflags=cflags,
        extra_cuda_cflags=cuda_cflags,
        extra_ldflags=openmp,
        build_directory=build_dir,
        with_cuda=with_cuda,
        is_python_module=False,
        no_implicit_headers=True,
    )
    print(f"kernels: built in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return True
