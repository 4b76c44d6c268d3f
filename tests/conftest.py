import atexit
import gc
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

# Under pytest-xdist every worker is one of several test processes on the machine's cores: Inductor's pool of compile
# processes (one per core, in every worker, each importing torch) would only add to the load.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def find_nvcc():
    """nvcc on PATH, else under torch's CUDA_HOME (or /usr/local/cuda); None where there is none."""
    from torch.utils import cpp_extension

    if shutil.which("nvcc"):
        return shutil.which("nvcc")
    candidate = os.path.join(cpp_extension.CUDA_HOME or "/usr/local/cuda", "bin", "nvcc")
    return candidate if os.path.exists(candidate) else None


NVCC = find_nvcc()
requires_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


# The tiers are explicit markers on the tests (pyproject.toml registers them): `slow` on the heavy ones (builds and
# compiler runs, fresh processes, torch.compile, shapes at the problems' scale, long training loops, tensors of 2^31
# elements, peak-memory probes), which `pytest -m "not slow"` leaves out for an edit loop; `large_gpu_memory` on the
# tests that hold GPU memory by the tens of gigabytes: under pytest-xdist's workers, which share the GPU, they take a
# file lock in turn (one per user and machine, so two test runs at once take turns too), so that two of them never
# meet on one GPU. Every other test stays under a few GB.
LARGE_GPU_MEMORY_LOCK = os.path.join(tempfile.gettempdir(), f"kernels_tests_gpu_memory_{os.getuid()}.lock")

# The slowest tests, slowest first (seconds measured on the H100 machine with 8 workers; the CPU machine ranks them
# alike). They are handed out first, one per worker, so that the run's length is not one of them started last.
SLOWEST_TESTS = [re.compile(pattern) for pattern in (
    r"aot_inductor_package_runs_in_a_fresh_process\[cpu\]",  # 220 (two packages built where the first fails)
    r"aot_inductor_package_runs_in_a_fresh_process\[cuda\]",  # 144
    r"problem_size_on_five_seeds\[leaky_relu\]",  # 114: KernelBench's inputs made on the CPU, 6.4 GB each
    r"test_leaky_relu\.py::test_torch_compile_fullgraph\[cpu\]",  # 88: Inductor's C++ builds
    r"problem_size_on_five_seeds\[gemm",  # 49
    r"execd_twice_in_one_process",  # 23-44: the candidate's build
    r"test_cpu_loops",  # 30-38: builds of the CPU loops
    r"from_a_string_in_a_fresh_process",  # 22-28
    r"test_loader\.py|test_cuda_compile\.py|two_cpu_processes|host_program",  # 5-23 each: builds, nvcc, torchrun
)]


def slowness_rank(item):
    return next((rank for rank, pattern in enumerate(SLOWEST_TESTS) if pattern.search(item.nodeid)), len(SLOWEST_TESTS))


def pytest_addoption(parser):
    parser.addoption("--cuda-only", action="store_true",
                     help="of the tests parametrized by device, the CUDA cases only: a GPU machine's check between "
                          "full runs (CI runs the CPU cases on every change)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--cuda-only"):
        on_cpu = {item for item in items
                  if getattr(item, "callspec", None) and item.callspec.params.get("device") == "cpu"}
        if on_cpu:
            config.hook.pytest_deselected(items=[item for item in items if item in on_cpu])
            items[:] = [item for item in items if item not in on_cpu]
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        # The order in which pytest-xdist hands tests out (`--maxschedchunk 1`: two to each worker to start with, then
        # one to whichever worker is down to one): the slowest first, each first paired with a quick one, so that the
        # slowest start together on different workers, each with only a quick test queued behind it.
        ranked = sorted(items, key=slowness_rank)  # stable: the collection order within a rank
        slow = [item for item in ranked if slowness_rank(item) < len(SLOWEST_TESTS)]
        quick = ranked[len(slow):]
        paired = min(workers, len(slow), len(quick))
        order = [item for pair in zip(slow[:paired], quick[:paired]) for item in pair]
        items[:] = order + slow[paired:] + quick[paired:]


@pytest.fixture(autouse=True)
def large_gpu_memory_lock(request):
    """Holds the suite's GPU memory lock through a test marked large_gpu_memory (whatever process runs it)."""
    if request.node.get_closest_marker("large_gpu_memory") is None:
        yield
        return
    import fcntl

    with open(LARGE_GPU_MEMORY_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            # The memory goes back to the GPU before the next such test starts, whichever worker runs it: PyTorch's
            # caching allocator would keep it for this process.
            gc.collect()
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml's default): a worker per core, at most 8. Most of the suite's time is compilers
    (Inductor, nvcc, the fresh processes' builds), which spread over cores; more workers would only add CUDA contexts
    and imports."""
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def check_accuracy(got, expected, reference64, dtype, what, atol=None, narrow_close_to_exact=False,
                   float64_error=1e-13):
    """A family's result `got` against float64's `reference64`: no more error than eager's `expected`
    (kernels.precision's ERROR_RATIO_LIMIT; a small tensor one rounding's slack; in float64, where eager is the
    reference, within float64_error of it), and allclose to eager at the dtype's tolerance (atol: another); in float16 and
    bfloat16 allclose to the float64 result in got's dtype instead where narrow_close_to_exact (where eager's own
    result there is not a fair target, e.g. parameter gradients summed in the narrow type on the CPU)."""
    from kernels.precision import ALLCLOSE_TOLERANCE, ERROR_RATIO_LIMIT, relative_error

    ours, theirs = relative_error(got, reference64), relative_error(expected, reference64)
    if dtype == torch.float64:
        theirs = float64_error
    slack = torch.finfo(dtype).eps / 2 if got.numel() <= 4096 else 0.0
    assert ours <= ERROR_RATIO_LIMIT[dtype] * theirs + slack, \
        f"{what}: error against float64 {ours:.3g}, eager's {theirs:.3g}"
    tol = ALLCLOSE_TOLERANCE[dtype]
    narrow = dtype in (torch.float16, torch.bfloat16)
    close_to = reference64.to(dtype) if narrow_close_to_exact and narrow else expected
    torch.testing.assert_close(got, close_to, atol=tol if atol is None else atol, rtol=tol, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def poison_allocator(shape, dtype, device):
    """Frees a NaN-filled block of the given size, so the allocator is likely to hand it to the next output of
    that size: an element a kernel fails to write then shows up as NaN instead of a lucky stale value."""
    torch.full(shape, float("nan"), dtype=dtype, device=device)


def cuda_kernels_launched(call):
    """call()'s result and the names of the CUDA kernels it launches (torch.profiler; synchronized after the call)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        result = call()
        torch.cuda.synchronize()
    return result, [event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]


def assert_graph_replay_matches_eager(step, refill):
    """Captures step() (tensors out) in a CUDA graph after warm-up on a side stream, refills its inputs in place with
    refill(), replays, and asserts that the replay's tensors are bit for bit a new eager step()'s."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        refill()
    graph.replay()
    for got, expected in zip(captured, step()):
        assert torch.equal(got, expected)


def assert_bitwise_equal(y, reference):
    """Same shape, dtype, values (NaN where reference has NaN) and zero signs."""
    assert y.shape == reference.shape and y.dtype == reference.dtype
    torch.testing.assert_close(y, reference, atol=0, rtol=0, equal_nan=True)
    assert torch.equal(torch.signbit(y) | y.isnan(), torch.signbit(reference) | reference.isnan())


def run_on_two_processes(script, env=None, timeout=600):
    """`script` (a path from the repository root) on two processes under torchrun, NVLink multicast off
    (distributed_helpers.py says why); its output, once both exited with status 0. The launcher runs in a session of
    its own, so that on a timeout it and both ranks are killed together."""
    from distributed_helpers import NO_NVLINK_MULTICAST

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
