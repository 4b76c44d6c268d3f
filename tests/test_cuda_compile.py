"""nvcc compiles the CUDA sources exactly as the loader joins them, for sm_80 and sm_90a, with no register spills and
no local memory (ptxas -v): each family's unit, every family joined into one unit (as a single-file build takes
them), and each .cu alone where a family has several. Needs nvcc, not a GPU, so it runs in CI. Hopper-only code
is guarded inside the sources, so every unit compiles for both targets."""

import re
import subprocess

import pytest

from conftest import NVCC, requires_nvcc
from kernels import loader
from kernels.manifest import FAMILIES

pytestmark = pytest.mark.slow  # nvcc over every unit

ARCHS = {"sm_80": "-gencode=arch=compute_80,code=sm_80", "sm_90a": "-gencode=arch=compute_90a,code=sm_90a"}



def compile_cuda(source_text, arch, tmp_path):
    """Compiles source_text for arch and checks ptxas's report: every kernel without stack frame or spills."""
    source = tmp_path / f"unit_{arch}.cu"
    source.write_text(source_text)
    result = subprocess.run(
        [NVCC, "-std=c++17", "-O3", "-Xptxas", "-v", ARCHS[arch], "-I", loader.SOURCE_ROOT, "-c", str(source),
         "-o", str(tmp_path / f"unit_{arch}.o")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-6000:]
    usage = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
    assert usage, "ptxas printed no resource usage:\n" + result.stderr
    bad = [u for u in usage if any(int(v) for v in u)]
    assert not bad, f"{len(bad)} kernels use local memory or spill (stack, stores, loads): {bad}"


UNITS = {family.name: [family] for family in FAMILIES if family.cuda_sources}
UNITS["all families"] = [family for family in FAMILIES if family.cuda_sources]
ALONE = [path for family in FAMILIES if len(family.cuda_sources) > 1 for path in family.cuda_sources]


@requires_nvcc
@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("unit", sorted(UNITS))
def test_joined_unit_compiles_without_spills_or_local_memory(unit, arch, tmp_path):
    compile_cuda(loader.family_sources(UNITS[unit])[1], arch, tmp_path)


@requires_nvcc
@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("path", ALONE or [None])
def test_each_cuda_file_compiles_alone(path, arch, tmp_path):
    if path is None:
        pytest.skip("no family has more than one .cu file")
    compile_cuda(loader.joined_source([path]), arch, tmp_path)
