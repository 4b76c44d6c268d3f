"""The weight's split kept between calls (FusedLinear): the same bits as without it, never another weight's or
another stream's, kept only where autograd does not record the weight."""

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import poison_allocator
from distributed_helpers import NO_NVLINK_MULTICAST
from kernels.gemm.gemm import FusedLinear, forced_gemm_path, forced_transposed
from gemm_helpers import (SPLIT_KERNELS, automatic_split_path, kept_split_expected, over_split_paths,
                          slow_problem_shape)


KEPT_SPLIT_SHAPES = {  # name: (m, k, n)
    "problem": (1024, 8192, 8192),
    "tails": (1153, 4104, 1032),  # M, N not multiples of the tiles, K not of the chunk
    "n_tail": (1100, 4000, 1060),  # N not a multiple of the tile, K of half a chunk
    "n_odd": (1030, 4104, 1031),  # N % 4 != 0: the exponents' rows padded to 16 bytes, y by plain stores
    "tall_narrow": (16400, 2056, 264),  # computed transposed on split_fp16: the weight's row split kept
    "small": (1024, 1024, 1024),  # under 2^32 multiply-adds: none kept (the call's time is the host's)
}


@over_split_paths
@pytest.mark.parametrize("weights", ["randn", "non_finite_rows", "rows_times_1e-30"])
@pytest.mark.parametrize("shape", slow_problem_shape(KEPT_SPLIT_SHAPES))
def test_kept_weight_split_gives_the_same_results_bit_for_bit(shape, weights, path):
    m, k, n = KEPT_SPLIT_SHAPES[shape]
    torch.manual_seed(0)
    linear = FusedLinear(k, n).cuda()
    with torch.no_grad():
        if weights == "non_finite_rows":
            linear.weight[3, 5], linear.weight[n - 1, k - 1] = float("inf"), float("nan")
            linear.weight[n // 2, 0] = -float("inf")
        elif weights == "rows_times_1e-30":
            linear.weight[::3] *= 1e-30
    x = torch.randn(m, k, device="cuda")
    outputs = []
    with torch.no_grad(), forced_gemm_path(path):
        for _ in range(3):  # the weight seen, then split ahead and kept, then the kept split read
            poison_allocator((m, n), torch.float32, "cuda")
            outputs.append(linear(x, multiplier=2.0, negative_slope=0.1))
        expected = kept_split_expected(path, m, k, n)
        assert (linear._weight_split is not None) == expected
        y_eager = F.leaky_relu(F.linear(x, linear.weight, linear.bias) * 2.0, 0.1)
        # The op with the mask too, with and without the kept split.
        split = torch.ops.kernels.gemm_weight_split(x, linear.weight)
        assert bool(split) == expected
        y_mask = torch.ops.kernels.gemm_multiply_leaky_relu(x, linear.weight, linear.bias, 2.0, -0.3, True)
        y_mask_kept = torch.ops.kernels.gemm_multiply_leaky_relu(x, linear.weight, linear.bias, 2.0, -0.3, True, split)
    for y in outputs[1:]:
        assert torch.equal(y.view(torch.int32), outputs[0].view(torch.int32))  # NaN payloads too
    assert torch.equal(y_mask[0].view(torch.int32), y_mask_kept[0].view(torch.int32))
    assert torch.equal(y_mask[1], y_mask_kept[1])
    assert torch.equal(outputs[0].isnan(), y_eager.isnan()) and torch.equal(outputs[0].isinf(), y_eager.isinf())


@over_split_paths
def test_weight_split_of_another_weight_or_stream_is_not_used(path):
    """The op checks the split's stamp on every use: a split of another weight, of the same weight before an in-place
    change, or made on another stream is not read (the results are those of a call without it)."""
    m, k, n = 1024, 1024, 4096
    torch.manual_seed(0)
    x, weight, other = (torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda"),
                        torch.randn(n, k, device="cuda"))
    op = torch.ops.kernels.gemm_multiply_leaky_relu
    with torch.no_grad(), forced_gemm_path(path):
        expected = op(x, weight, None, 2.0, 0.1, False)[0]
        own = torch.ops.kernels.gemm_weight_split(x, weight)
        assert own  # a split is made here, so the cases below are not vacuous
        assert torch.equal(op(x, weight, None, 2.0, 0.1, False, own)[0], expected)
        assert torch.equal(op(x, weight, None, 2.0, 0.1, False, torch.ops.kernels.gemm_weight_split(x, other))[0],
                           expected)
        before = torch.ops.kernels.gemm_weight_split(x, weight)
        weight.mul_(-1.0)
        assert torch.equal(op(x, weight, None, 2.0, 0.1, False, before)[0], op(x, weight, None, 2.0, 0.1, False)[0])
        weight.mul_(-1.0)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            on_side = torch.ops.kernels.gemm_weight_split(x, weight)
        side.synchronize()
        on_side[0].zero_()  # read, it would change the output
        assert torch.equal(op(x, weight, None, 2.0, 0.1, False, on_side)[0], expected)
        # The op does read a split that matches (made after the changes above): zeroed hi halves change the output.
        fresh = torch.ops.kernels.gemm_weight_split(x, weight)
        fresh[0].zero_()
        assert not torch.equal(op(x, weight, None, 2.0, 0.1, False, fresh)[0], expected)


@pytest.mark.skipif("split_fp16" not in SPLIT_KERNELS, reason="needs the Hopper split kernel")
@pytest.mark.parametrize("n", [1024, 1030])  # y written by the kernel, and y^T through the transposed epilogue's pass
def test_weight_split_of_the_other_orientation_is_not_used(n):
    """A split made for the forward computed transposed (the weight's row split, that product's x split) is read only
    by that forward, and a split made for the forward as it is (its chunk split) only by that one."""
    m, k = 8192, 1024  # 2^33 multiply-adds: a split is made either way
    torch.manual_seed(0)
    x, weight = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
    op = torch.ops.kernels.gemm_multiply_leaky_relu
    with torch.no_grad(), forced_gemm_path("split_fp16"):
        with forced_transposed(1):
            rows = torch.ops.kernels.gemm_weight_split(x, weight)
            expected_transposed = op(x, weight, None, 2.0, 0.1, False)[0]
            assert torch.equal(op(x, weight, None, 2.0, 0.1, False, rows)[0], expected_transposed)
        with forced_transposed(-1):
            chunks = torch.ops.kernels.gemm_weight_split(x, weight)
            expected = op(x, weight, None, 2.0, 0.1, False)[0]
        assert rows and chunks and rows[3].numel() == 0 and chunks[3].numel() == n  # flags: the chunk split's only
        rows[0].zero_()  # read, they would change the output
        chunks[0].zero_()
        with forced_transposed(-1):
            assert torch.equal(op(x, weight, None, 2.0, 0.1, False, rows)[0], expected)
            assert not torch.equal(op(x, weight, None, 2.0, 0.1, False, chunks)[0], expected)
        with forced_transposed(1):
            assert torch.equal(op(x, weight, None, 2.0, 0.1, False, chunks)[0], expected_transposed)
            assert not torch.equal(op(x, weight, None, 2.0, 0.1, False, rows)[0], expected_transposed)


def test_weight_split_is_kept_only_where_autograd_does_not_record_the_weight(device):
    torch.manual_seed(0)
    linear = FusedLinear(2048, 2048).to(device)
    x = torch.randn(1024, 2048, device=device)  # in the automatic choice's range, 2^32 multiply-adds: kept
    kept_here = device == "cuda" and automatic_split_path() is not None
    for _ in range(3):
        linear(x)  # training the weight: nothing kept
    assert linear._weight_split is None
    with torch.no_grad():
        for _ in range(3):
            linear(x)
    assert (linear._weight_split is not None) == kept_here
    linear(x).sum().backward()  # a call that trains the weight drops it
    assert linear._weight_split is None
    linear.weight.requires_grad_(False)  # a frozen weight (fine-tuning around it) keeps it, grad mode or not
    for _ in range(3):
        linear(x)
    assert (linear._weight_split is not None) == kept_here
    linear.clear_weight_split()
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):  # the op casts the weight: none kept
        for _ in range(3):
            linear(x)
    assert linear._weight_split is None
    linear.cache_weight_split = False
    linear(x)
    assert linear._weight_split is None and linear._weight_split_key is None
    copy.deepcopy(linear)  # copies and pickles hold no split


# Run in a process of its own (its process group stops kept splits there): a FusedLinear keeps its weight's split,
# then, once a process group exists, drops it and keeps none under FSDP2 (one rank), called without a gradient between
# updates of its sharded weight, each call against the op on the gathered weight. Prints "name: value" lines.
SHARDED_WEIGHT_SCRIPT = """
import sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from kernels.gemm.gemm import FusedLinear, _rewritten_uncounted

device = sys.argv[1]
torch.manual_seed(0)
x = torch.randn(1024, 2048, device=device)  # 2^32 multiply-adds: kept
linear = FusedLinear(2048, 2048).to(device)
with torch.no_grad():
    for _ in range(3):
        linear(x)
print("rewritten uncounted, no process group:", _rewritten_uncounted())
print("kept without a process group:", linear._weight_split is not None)
dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
print("rewritten uncounted, a process group:", _rewritten_uncounted())
with torch.no_grad():
    linear(x)
print("kept once a process group exists:", linear._weight_split is not None)
fully_shard(linear, mesh=init_device_mesh(device, (1,)))
stale = 0
for update in range(3):
    with torch.no_grad():
        for call in range(3):
            y = linear(x)  # the root keeps its gathered parameters after a call: the call's own
            expected = torch.ops.kernels.gemm_multiply_leaky_relu(x, linear.weight, linear.bias, 1.0, 1.0, False)[0]
            stale += not torch.equal(y, expected)
        linear.reshard()  # the sharded parameters back, updated as an optimizer's step does: the next call gathers
        for parameter in linear.parameters():
            parameter.mul_(0.5)
print("kept under FSDP2:", linear._weight_split is not None)
print("calls unlike the gathered weight's:", stale)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_no_split_is_kept_where_collectives_may_rewrite_weights_uncounted(device):
    """A process group's collectives write tensors without moving their version counters (FSDP2 gathers an updated
    weight into memory it freed, often at the same address; a broadcast into a weight writes it in place), so a split
    kept across no_grad calls would give the old weight's results: with a process group none is kept."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, **NO_NVLINK_MULTICAST, PYTHONPATH=root)
    result = subprocess.run([sys.executable, "-c", SHARDED_WEIGHT_SCRIPT, device], cwd=root, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    kept_here = device == "cuda" and automatic_split_path() is not None
    assert lines["rewritten uncounted, no process group"] == "False"
    assert lines["kept without a process group"] == str(kept_here)
    assert lines["rewritten uncounted, a process group"] == "True"
    assert lines["kept once a process group exists"] == lines["kept under FSDP2"] == "False"
    assert lines["calls unlike the gathered weight's"] == "0"


def test_weight_split_list_not_from_gemm_weight_split_is_a_clear_error(device):
    x, weight = torch.randn(4, 8, device=device), torch.randn(6, 8, device=device)
    with pytest.raises(RuntimeError, match="weight_split must be a list that kernels.gemm_weight_split returned"):
        torch.ops.kernels.gemm_multiply_leaky_relu(x, weight, None, 1.0, 1.0, False, [x])
