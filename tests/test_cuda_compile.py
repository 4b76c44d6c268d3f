"""nvcc compiles every kernels/*.cu on its own for each architecture it supports, with no register spills and no
local memory (ptxas -v). Needs nvcc, not a GPU, so it runs in CI. A .cu whose text says `requires: sm_90a` is
Hopper-only and is compiled for sm_90a alone; the others are portable and compiled for sm_80 and sm_90a."""

import glob
import os
import re
import shutil
import subprocess

import pytest
from torch.utils import cpp_extension

KERNEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
SOURCES = sorted(glob.glob(os.path.join(KERNEL_DIR, "*.cu")))
ARCHS = {"sm_80": "-gencode=arch=compute_80,code=sm_80", "sm_90a": "-gencode=arch=compute_90a,code=sm_90a"}


def find_nvcc():
    if shutil.which("nvcc"):
        return shutil.which("nvcc")
    candidate = os.path.join(cpp_extension.CUDA_HOME or "/usr/local/cuda", "bin", "nvcc")
    return candidate if os.path.exists(candidate) else None


NVCC = find_nvcc()


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("source", SOURCES, ids=os.path.basename)
def test_compiles_without_spills_or_local_memory(source, arch, tmp_path):
    with open(source, encoding="utf-8") as f:
        if "requires: sm_90a" in f.read() and arch != "sm_90a":
            pytest.skip("Hopper-only kernel")
    result = subprocess.run(
        [NVCC, "-std=c++17", "-O3", "-Xptxas", "-v", ARCHS[arch], "-I", KERNEL_DIR, "-c", source,
         "-o", str(tmp_path / "kernel.o")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    usage = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
    assert usage, "ptxas printed no resource usage:\n" + result.stderr
    bad = [u for u in usage if any(int(v) for v in u)]
    assert not bad, f"{len(bad)} kernels use local memory or spill (stack, stores, loads): {bad}"
