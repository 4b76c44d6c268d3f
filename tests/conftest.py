import atexit
import os
import re
import signal
import subprocess
import shutil
import sys
import tempfile

# torch.compile's caches key on the traced graph, not on the library's code: a graph cached by an earlier version of
# the library (an op's autograd traced differently) would be replayed as it was. The tests compile afresh, in a
# folder of their own, unless one is given.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="kernels_tests_inductor_")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


# The heavy tests, by node id: builds and compiler runs, fresh processes, torch.compile, shapes at the problems' scale,
# long training loops, tensors of 2^31 elements, peak-memory probes. `pytest -m "not slow"` leaves them out for an
# edit loop; the README's command runs everything.
SLOW_TESTS = re.compile(r"test_loader\.py|test_cuda_compile\.py|test_multi_gpu\.py|test_export\.py|two_cpu_processes|"
                        r"torch_compile|aot_inductor|training|2_to_the_31|more_than_2|problem|peak_memory")


def pytest_collection_modifyitems(items):
    for item in items:
        if SLOW_TESTS.search(item.nodeid):
            item.add_marker(pytest.mark.slow)


def poison_allocator(shape, dtype, device):
    """Frees a NaN-filled block of the given size, so the allocator is likely to hand it to the next output of
    that size: an element a kernel fails to write then shows up as NaN instead of a lucky stale value."""
    torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_bitwise_equal(y, reference):
    """Same shape, dtype, values (NaN where reference has NaN) and zero signs."""
    assert y.shape == reference.shape and y.dtype == reference.dtype
    torch.testing.assert_close(y, reference, atol=0, rtol=0, equal_nan=True)
    assert torch.equal(torch.signbit(y) | y.isnan(), torch.signbit(reference) | reference.isnan())


def run_on_two_processes(script, env=None, timeout=600):
    """`script` (a path from the repository root) on two processes under torchrun, NVLink multicast off (as
    tools/ddp_check.py says why); its output, once both exited with status 0. The launcher runs in a session of its
    own, so that on a timeout it and both ranks are killed together."""
    from tools.ddp_check import NO_NVLINK_MULTICAST

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script]
    process = subprocess.Popen(command, cwd=root, env=dict(os.environ, **NO_NVLINK_MULTICAST, **(env or {})),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{script} did not finish in {timeout} s:\n{output[-6000:]}")
    assert process.returncode == 0, output[-8000:]
    return output
