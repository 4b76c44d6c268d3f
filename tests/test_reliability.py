"""What long training jobs rely on, on the GPU: no host synchronisation inside any op, correct ordering with the
caller's stream, capture in a CUDA graph (forward and backward) replayed with new inputs, flat memory over many
calls, a forward's peak memory no higher than the reference's, no out-of-memory error where eager's products (and
attention) fit, and tensors of more than 2^31 elements. The tests run LeakyReLU and the GEMM family, on every GEMM
path the GPU has, and the out-of-memory case the split attention too."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import HAS_CUDA, requires_cuda
from memory_helpers import REPO
from kernels.gemm.gemm import SPLIT_PATHS, forced_gemm_path, gemm_path, gemm_paths
from model_new import GemmMultiplyLeakyReLUModelNew, LeakyReLUModelNew
from reference import GemmMultiplyLeakyReLUModel, LeakyReLUModel

pytestmark = requires_cuda
GEMM_PATHS = gemm_paths("cuda") if HAS_CUDA else ["cublas"]


def make_pair(in_features=136, out_features=72, multiplier=-1.5, slope=-0.2, seed=0):
    torch.manual_seed(seed)
    reference = GemmMultiplyLeakyReLUModel(in_features, out_features, multiplier, slope).cuda()
    torch.manual_seed(seed)
    new = GemmMultiplyLeakyReLUModelNew(in_features, out_features, multiplier, slope).cuda()
    return reference, new


# torch's notice that its sync debug mode is a prototype, once per process: what it does detect is what this asks.
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning")
@pytest.mark.parametrize("path", GEMM_PATHS)
def test_no_host_synchronisation_in_forward_or_backward(path):
    _, new = make_pair()
    x = torch.randn(40, 136, device="cuda", requires_grad=True)
    leaky = LeakyReLUModelNew(0.1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with forced_gemm_path(path):
            y = leaky(new(x))
            y.backward(torch.ones_like(y))
            with torch.no_grad():
                leaky(new(x))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("path", GEMM_PATHS)
def test_work_on_a_side_stream_is_ordered_with_it(path):
    reference, new = make_pair()
    base = torch.randn(512, 136, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), forced_gemm_path(path), torch.no_grad():
        torch.cuda._sleep(20_000_000)  # the input below is written only after this delay, on `stream`
        x = base * 3.0
        y = new(x)
        expected = reference(x)
    stream.synchronize()
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", GEMM_PATHS)
def test_forward_and_backward_replay_in_a_cuda_graph(path):
    reference, new = make_pair()
    leaky = LeakyReLUModelNew(0.3)
    static_x = torch.randn(64, 136, device="cuda", requires_grad=True)
    static_grad = torch.randn(64, 72, device="cuda")

    def step():
        y = leaky(new(static_x))
        y.backward(static_grad)
        return y

    with forced_gemm_path(path):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up outside the graph, as capture requires
                step()
        torch.cuda.current_stream().wait_stream(side)
        for t in (static_x, new.gemm.weight, new.gemm.bias):
            t.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = step()

        for seed in (1, 2):
            torch.manual_seed(seed)
            x, grad = torch.randn(64, 136, device="cuda"), torch.randn(64, 72, device="cuda")
            static_x.data.copy_(x)
            static_grad.copy_(grad)
            graph.replay()
            x_ref = x.clone().requires_grad_(True)
            reference.zero_grad(set_to_none=True)
            y_ref = F.leaky_relu(reference(x_ref), 0.3)
            y_ref.backward(grad)
            torch.testing.assert_close(static_y, y_ref, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(static_x.grad, x_ref.grad, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(new.gemm.weight.grad, reference.gemm.weight.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", GEMM_PATHS)
def test_memory_stays_flat_over_many_calls(path):
    _, new = make_pair()
    leaky = LeakyReLUModelNew(0.1)
    x = torch.randn(32, 136, device="cuda", requires_grad=True)

    def step():
        y = leaky(new(x))
        y.backward(torch.ones_like(y))

    with forced_gemm_path(path):
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for _ in range(10_000):
            step()
        torch.cuda.synchronize()
    # A leak of the smallest block (512 bytes) per call would add 5 MB over these calls. The slack is for one-time
    # allocations made by libraries after warm-up (seen once in a full-suite run: 168 KB), which do not grow.
    assert torch.cuda.memory_allocated() - before <= 256 << 10


# The allocator rounds every block up to a multiple of 512 bytes, and the split path holds a few small arrays
# besides its main temporaries (one 4-byte exponent per row of x and of W: 24 KB here); 1 MiB covers both with room,
# and is far below any per-call temporary of these sizes (32 MiB for the split of x, 64 MiB for W's).
PEAK_MEMORY_SLACK = 1 << 20


def forward_peak(forward):
    """The peak of allocated device memory during forward(), above what was allocated before it (inputs, weights,
    anything held from earlier calls), the output counted."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = forward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del y
    return peak


def mib(n_bytes):
    return f"{n_bytes / (1 << 20):.2f} MiB"


@pytest.mark.parametrize("path", GEMM_PATHS)
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.slow
def test_gemm_forward_peak_memory_is_no_more_than_the_reference(grad, path):
    """At a size that takes a split path, with the problem's multiplier and slope (positive: the backward saves the
    output itself, as the reference saves its pre-activation). The reference peaks at two outputs (the linear's and
    the multiply's, then the multiply's and the activation's); the split paths' temporaries must fit in that, but
    for the split of W where a pass makes it per call (4 bytes per weight element and 4 per row and chunk of 64,
    documented). Under no_grad, FusedLinear keeps the weight's split from the second call on (the same size, and 4
    bytes per row: documented); later calls must not add to it, and must peak at no more than the reference."""
    m, k, n = 2048, 4096, 4096
    reference, new = make_pair(k, n, 2.0, 0.1)
    x = torch.randn(m, k, device="cuda")
    w_split = 4 * n * k + 4 * n * (k // 64) + 4 * n if path in SPLIT_PATHS else 0
    keeps_split = not grad and path in SPLIT_PATHS
    with torch.set_grad_enabled(grad), forced_gemm_path(path):
        reference(x)  # cuBLAS's workspace, held from here on, outside the measurements
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        first_peak = forward_peak(lambda: new(x))  # nothing kept yet: the weight is split within the call
        reference_peak = forward_peak(lambda: reference(x))
        second_peak = forward_peak(lambda: new(x))  # under no_grad, splits the weight ahead and keeps it
        kept = torch.cuda.memory_allocated() - held
        third_peak = forward_peak(lambda: new(x))
        later = torch.cuda.memory_allocated() - held
    assert kept <= (w_split if keeps_split else 0) + PEAK_MEMORY_SLACK, f"the second call kept {mib(kept)}"
    assert later <= kept + PEAK_MEMORY_SLACK, f"a later call added {mib(later - kept)} to the {mib(kept)} kept"
    # W split by a pass per call: on split_fp16_sm80 always, on split_fp16 from 2048 rows of x (gemm_products.cpp,
    # kSplitWAheadRows), as here.
    per_call_split = w_split if path in SPLIT_PATHS else 0
    assert first_peak <= reference_peak + per_call_split + PEAK_MEMORY_SLACK, (
        f"ModelNew's first forward peaks {mib(first_peak)} above the memory held before it, the reference's "
        f"{mib(reference_peak)} (path {gemm_path(x, new.gemm.weight)})")
    assert second_peak <= reference_peak + max(kept, per_call_split) + PEAK_MEMORY_SLACK, (
        f"the second call peaks at {mib(second_peak)}, the reference's {mib(reference_peak)}, kept {mib(kept)}")
    assert third_peak <= reference_peak + (0 if keeps_split else per_call_split) + PEAK_MEMORY_SLACK, (
        f"a call reading the kept split peaks at {mib(third_peak)}, the reference's {mib(reference_peak)}")


# For scripts run in a fresh process each, whose caching allocator holds no segments from other tests (a limit on the
# process's memory means what it says only there): the memory a call holds, and a limit between two calls' needs.
_MEMORY_LIMIT_HELPERS = r"""
import torch

slack = 24 << 20  # the allocator's rounding of each block it reserves


# The most memory a call holds at once: the allocator frees its cached blocks and retries before it fails, so a
# limit bites on live memory, not on the reserved peak, which caching between the call's steps inflates.
def allocated_peak(call):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = call()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, result


# A limit halfway between eager's peak and the fast path's: eager's call fits with room for the allocator's rounding,
# the fast path's not. It counts the free space inside the segments still reserved, which a call's smaller blocks may
# take (the caller moves what it keeps off the GPU first).
def limit_between(eager_peak, fast_peak):
    torch.cuda.empty_cache()
    limit = torch.cuda.memory_allocated() + (eager_peak + fast_peak) // 2
    torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(0).total_memory)


def failed_allocations():
    return torch.cuda.memory_stats().get("num_ooms", 0)
"""

# Each op under a limit between eager's peak and its split's, at shapes where the split's temporaries take more than
# eager's call; prints the ops so tested, or raises.
_OUT_OF_MEMORY_SCRIPT = _MEMORY_LIMIT_HELPERS + r"""
import sys
import torch.nn.functional as F
import kernels.functional
from kernels.gemm.gemm import forced_gemm_path

path = sys.argv[1]
ops = torch.ops.kernels

tested = set()
for m, k, n in ((16384, 1024, 1024), (2048, 8192, 8192), (8192, 4096, 1024)):
    torch.manual_seed(0)
    x, grad = torch.randn(m, k, device="cuda"), torch.randn(m, n, device="cuda")
    w, b = torch.randn(n, k, device="cuda") / k ** 0.5, torch.randn(n, device="cuda")
    with forced_gemm_path("cublas"):
        y = ops.gemm_multiply_leaky_relu(x, w, b, 2.0, 0.1, False)[0]  # the LeakyReLU backward's saved output
        pre = F.linear(x, w, b)
    calls = {
        "forward": lambda: ops.gemm_multiply_leaky_relu(x, w, b, 2.0, 0.1, True),
        "gemm_gelu": lambda: (ops.gemm_gelu(x, w, b, "none"),),
        "_gemm_gelu_with_pre": lambda: ops._gemm_gelu_with_pre(x, w, b, "tanh"),
        "backward": lambda: ops.gemm_multiply_leaky_relu_backward(grad, x, w, y, 2.0, 0.1, True, True, True),
        "gemm_gelu_backward": lambda: ops.gemm_gelu_backward(grad, x, w, pre, "none", True, True, True),
    }
    for name, call in calls.items():
        case = f"{name} {m}x{k}->{n}"
        with forced_gemm_path("cublas"):
            eager_peak, eagers = allocated_peak(call)
        with forced_gemm_path(path):
            split_peak, splits = allocated_peak(call)
        peaks = f"{case}: peaks split {split_peak >> 20} MiB, eager {eager_peak >> 20} MiB"
        if split_peak <= eager_peak + 2 * slack:  # the split fits wherever eager's call does
            print(peaks, "(not tested)")
            continue
        eagers, splits = [e.cpu() for e in eagers], [s.cpu() for s in splits]
        limit_between(eager_peak, split_peak)
        failed_before = failed_allocations()
        try:
            with forced_gemm_path(path):
                got = call()
        except torch.OutOfMemoryError as error:
            raise AssertionError(f"{case} raised under the limit (split {split_peak}, eager {eager_peak})") from error
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        # The limit bit: a split's allocation failed, and the call went on without it.
        assert failed_allocations() > failed_before, peaks
        print(peaks)
        tested.add(name)
        # Each product on its own: one whose split still fits gives the split's result, the others cuBLAS's (a
        # GELU's backward whose grad_x fell back reads grad_pre from the activation's op: eager's within rounding).
        for a, e, s in zip((g.cpu() for g in got), eagers, splits):
            assert torch.equal(a, e) or torch.equal(a, s) or (
                name == "gemm_gelu_backward" and torch.allclose(a, e, rtol=1e-4, atol=1e-4 * e.abs().max().item())
            ), case
        del eagers, splits, got
    del x, grad, w, b, y, pre
print("TESTED", " ".join(sorted(tested)))
"""


@pytest.mark.parametrize("path", [p for p in GEMM_PATHS if p in SPLIT_PATHS])
@pytest.mark.slow
def test_split_products_out_of_memory_give_eagers_results(path):
    """Under a memory limit that eager's call fits but a split product's temporaries (the operands' splits) do not,
    each op runs the cuBLAS path instead of raising an out-of-memory error eager would not: the forward with its
    mask, gemm_gelu, the GELU forward that keeps its pre-activation, and both backward ops (grad_x, grad_W, grad_b),
    each result bit for bit the cuBLAS path's (or the split's, for a product whose split still fits). Each op is
    tested at a shape where its split needs more than eager's call: a tall x (its split as large as x), a wide w
    (split ahead of the GEMM, as large as w), and for the backward an x wider than grad_y (grad_W's split of x)."""
    result = subprocess.run([sys.executable, "-c", _OUT_OF_MEMORY_SCRIPT, path], cwd=REPO, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    tested = set(result.stdout.split("TESTED", 1)[1].split())
    # The Hopper kernel's backward holds no more memory than eager's call at these shapes (the printed peaks), so
    # there only the forward ops can be pushed onto the fallback.
    expected = {"forward", "gemm_gelu", "_gemm_gelu_with_pre"}
    if path == "split_fp16_sm80":
        expected |= {"backward", "gemm_gelu_backward"}
    assert expected <= tested, result.stdout


_ATTENTION_OUT_OF_MEMORY_SCRIPT = _MEMORY_LIMIT_HELPERS + r"""
import kernels.functional

for is_causal in (False, True):
    torch.manual_seed(0)
    q, k, v = (torch.randn(16, 16, 512, 64, device="cuda") for _ in range(3))
    rows = q.shape[2]
    calls = {
        "kernel": lambda: torch.ops.kernels.attention(q, k, v, is_causal, 0.125),
        "eager": lambda: torch.ops.aten._efficient_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, None, None, None, 0.0, int(is_causal),
            True, scale=0.125)[:2],
    }
    kernel_peak, kernels_result = allocated_peak(calls["kernel"])
    eager_peak, (eager_out, eager_lse) = allocated_peak(calls["eager"])
    case = f"causal {is_causal}: peaks kernel {kernel_peak >> 20} MiB, eager {eager_peak >> 20} MiB"
    assert kernel_peak > eager_peak + 2 * slack, case  # the split's workspace, as large as k and v
    eager_out, eager_lse = eager_out.transpose(1, 2).cpu(), eager_lse[..., :rows].cpu()
    del kernels_result
    limit_between(eager_peak, kernel_peak)
    failed_before = failed_allocations()
    try:
        out, lse = calls["kernel"]()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert failed_allocations() > failed_before, case  # the limit bit
    assert torch.equal(out.cpu(), eager_out) and torch.equal(lse[..., :rows].cpu(), eager_lse), case
    assert out.stride() == torch.ops.kernels.attention(q, k, v, is_causal, 0.125)[0].stride(), case
    print(case)
print("DONE")
"""


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() < (8, 0),
                    reason="the split attention kernels run from sm_80 on")
@pytest.mark.slow
def test_attention_out_of_memory_gives_eagers_result():
    """Under a memory limit that eager's memory-efficient attention fits but the split attention's workspace (k and v
    split) does not, torch.ops.kernels.attention returns eager's own output and logsumexp, bit for bit and in the
    op's layout, instead of raising an out-of-memory error eager would not; causal too."""
    result = subprocess.run([sys.executable, "-c", _ATTENTION_OUT_OF_MEMORY_SCRIPT], cwd=REPO, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DONE" in result.stdout, result.stdout


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.slow
def test_leaky_relu_forward_peak_memory_is_no_more_than_the_reference(grad):
    x = torch.randn(4096, 16384, device="cuda").requires_grad_(grad)  # 256 MiB
    new, reference = LeakyReLUModelNew(0.01), LeakyReLUModel(0.01)
    with torch.set_grad_enabled(grad):
        reference(x)
        new(x)
        reference_peak = forward_peak(lambda: reference(x))
        new_peak = forward_peak(lambda: new(x))
    assert new_peak <= reference_peak + PEAK_MEMORY_SLACK, (
        f"ModelNew's forward peaks {mib(new_peak)} above the memory held before it, the reference's "
        f"{mib(reference_peak)}")


def enough_gpu_memory(gigabytes):
    return HAS_CUDA and torch.cuda.get_device_properties(0).total_memory >= gigabytes << 30


@pytest.mark.skipif(not enough_gpu_memory(40), reason="needs 40 GB of GPU memory")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.slow
@pytest.mark.large_gpu_memory
def test_leaky_relu_on_more_than_2_to_the_31_elements(dtype):
    n = (1 << 31) + 4099
    x = torch.empty(n, dtype=dtype, device="cuda").uniform_(-2, 2)
    y = LeakyReLUModelNew(0.25)(x)
    expected = F.leaky_relu(x, 0.25)
    assert torch.equal(y, expected)  # bitwise, over every element, the last ones past 2^31 included
    del y
    x_offset = x[1:]  # misaligned: the element-wise path over the same 64-bit range
    assert torch.equal(LeakyReLUModelNew(0.25)(x_offset), expected[1:])


@pytest.mark.skipif(not enough_gpu_memory(40), reason="needs 40 GB of GPU memory")
@pytest.mark.parametrize("path", GEMM_PATHS)
@pytest.mark.slow
@pytest.mark.large_gpu_memory
def test_gemm_output_of_more_than_2_to_the_31_elements(path):
    m, k, n = 65539, 64, 32776  # m * n = 2^31 + 0.5 M
    assert m * n > 1 << 31
    reference, new = make_pair(k, n, -1.5, -0.2)
    x = torch.randn(m, k, device="cuda")
    with torch.no_grad(), forced_gemm_path(path):
        y = new(x)
    with torch.no_grad():
        expected = reference(x)
    # A sample of positions, the last row and column among them, and per-row checksums in float64.
    rows = torch.cat([torch.randint(0, m, (64,), device="cuda"), torch.tensor([0, m // 2, m - 2, m - 1], device="cuda")])
    torch.testing.assert_close(y[rows], expected[rows], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(y[:, -1], expected[:, -1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(y.sum(1, dtype=torch.float64), expected.sum(1, dtype=torch.float64),
                               atol=1e-2, rtol=1e-5)
