"""The split paths' forward (split_fp16 on Hopper, split_fp16_sm80 from sm_80 on; every test runs on each the GPU
can run): fp32 accuracy from fp16 tensor cores against eager and float64, below the automatic range, hard and
non-finite inputs, the mask and views, tall products computed transposed, the epilogue's two store paths, and a
weight changed between calls."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import NVCC, cuda_kernels_launched, poison_allocator, requires_cuda, requires_nvcc
from kernels.precision import SPLIT_FP16_ERROR_FLOOR, allclose, relative_error
from kernels.functional import gemm_gelu, gemm_multiply_leaky_relu
from kernels.gemm.gemm import SPLIT_PATHS, forced_gemm_path, forced_transposed, gemm_path
from gemm_helpers import (SPLIT_KERNELS, automatic_split_path, check_against_reference, kept_split_expected, make_pair,
                          over_split_paths, slow_problem_shape, special_inputs, split_sweep_values)


SPLIT_SHAPES = {  # name: (m, k, n)
    "problem": (1024, 8192, 8192),
    "tails": (1153, 1048, 1031),  # M, N, K not multiples of the tiles; K not a multiple of the promotion interval
    "k_one_promotion_past": (1031, 1096, 1030),
    "small_batch": (256, 1032, 4100),  # 2^20 outputs from 256 rows, with tails
    "tall_narrow": (8200, 1032, 136),  # m k > n k + m n: split_fp16 computes it transposed; tails
}


# Shapes below that range, where cuBLAS is the default: the split path, forced, must still be right, within
# max(eager's error, the split's floor).
FORCED_SPLIT_SHAPES = {
    "m1_k8_n7": (1, 8, 7),
    "small_tails": (200, 520, 300),
    "k_not_a_promotion_multiple": (129, 392, 136),
    "tall": (3000, 64, 72),
    "tall_narrow_tails": (2000, 520, 40),  # computed transposed on split_fp16
}


def at_row_scale(y, y64):
    """y divided by the root mean square of each row of the float64 result: the scale at which allclose(1e-4) means
    for rows of size 1e30 or 1e-30 what it means for rows of size 1 (at 1e30 the absolute 1e-4 is nothing, and
    elementwise 1e-4 fails wherever cancellation leaves an entry small, for eager against float64 too)."""
    finite = y64.nan_to_num(0.0, 0.0, 0.0)
    return y / finite.square().mean(-1, keepdim=True).sqrt().clamp_min(1e-300)


def check_split(x, weight, bias, multiplier=2.0, slope=0.1, path="split_fp16", forced=False, row_scale=False):
    """Split path `path` against eager fp32 and float64: allclose(1e-4) (at row scale if asked), the same non-finite
    pattern, and an error <= eager's (forced below the automatic choice's range: <= max(eager's, the split's
    floor)). Within the range, where `path` is this GPU's automatic choice, the automatic choice must take it."""
    poison_allocator((*x.shape[:-1], weight.shape[0]), torch.float32, "cuda")
    if not forced and path == automatic_split_path():
        assert gemm_path(x, weight) == path
    with torch.no_grad(), forced_gemm_path(path):
        assert gemm_path(x, weight) == path
        y = gemm_multiply_leaky_relu(x, weight, bias, multiplier, slope)
    y_eager = F.leaky_relu(F.linear(x, weight, bias) * multiplier, slope)
    y64 = F.leaky_relu(F.linear(x.double(), weight.double(), bias.double()) * multiplier, slope)
    assert torch.equal(y.isnan(), y_eager.isnan()) and torch.equal(y.isinf(), y_eager.isinf())
    if row_scale:
        y_scaled, y_eager_scaled = at_row_scale(y.double(), y64).float(), at_row_scale(y_eager.double(), y64).float()
        assert allclose(y_scaled, y_eager_scaled), (y_scaled - y_eager_scaled).abs().max()
    else:
        assert allclose(y, y_eager), (y - y_eager).abs().nan_to_num().max()
    ours, eager = relative_error(y, y64), relative_error(y_eager, y64)
    assert ours <= (max(eager, SPLIT_FP16_ERROR_FLOOR) if forced else eager), (ours, eager)
    return ours, eager


@over_split_paths
@pytest.mark.parametrize("kind", ["randn", "rand"])
@pytest.mark.parametrize("shape", slow_problem_shape(SPLIT_SHAPES))
def test_split_path_more_accurate_than_eager_fp32(shape, kind, path):
    m, k, n = SPLIT_SHAPES[shape]
    _, new = make_pair(k, n, 2.0, 0.1, "cuda")
    x = special_inputs(kind, m, k).cuda()
    ours, eager = check_split(x, new.gemm.weight.detach(), new.gemm.bias.detach(), path=path)
    if shape == "problem":
        assert ours <= 0.5 * eager, (ours, eager)


@over_split_paths
@pytest.mark.parametrize("shape", FORCED_SPLIT_SHAPES)
def test_split_path_forced_below_its_range(shape, path):
    m, k, n = FORCED_SPLIT_SHAPES[shape]
    _, new = make_pair(k, n, 2.0, 0.1, "cuda")
    x = special_inputs("randn", m, k).cuda()
    check_split(x, new.gemm.weight.detach(), new.gemm.bias.detach(), path=path, forced=True)


@over_split_paths
def test_split_path_forced_on_empty_products(path):
    """Nothing to compute: the forced path gives eager's empty output, or the bias's epilogue where K is 0."""
    weight, bias = torch.randn(16, 64, device="cuda"), torch.randn(16, device="cuda")
    with forced_gemm_path(path):
        assert gemm_multiply_leaky_relu(torch.empty(0, 64, device="cuda"), weight, bias, 2.0, 0.1).shape == (0, 16)
        assert gemm_multiply_leaky_relu(torch.randn(5, 64, device="cuda"), weight[:0], bias[:0]).shape == (5, 0)
        y = gemm_multiply_leaky_relu(torch.empty(5, 0, device="cuda"), torch.empty(16, 0, device="cuda"), bias, 2.0,
                                     0.1)
    torch.testing.assert_close(y, F.leaky_relu(bias * 2.0, 0.1).expand(5, 16))


@over_split_paths
@pytest.mark.parametrize("kind", ["rand", "rows_times_1e30", "rows_times_1e-30", "wide_range_rows", "zero_rows",
                                  "subnormal_rows"])
@pytest.mark.parametrize("operand", ["x", "weight"])
@pytest.mark.parametrize("m,k,n", [(1024, 1040, 1032), (4100, 520, 36)])  # the second computed transposed on split_fp16
def test_split_path_on_hard_inputs(kind, operand, m, k, n, path):
    _, new = make_pair(k, n, 2.0, 0.1, "cuda")
    x, weight = special_inputs("randn", m, k, seed=1).cuda(), new.gemm.weight.detach()
    if operand == "x":
        x = special_inputs(kind, m, k, seed=2).cuda()
    else:
        weight = special_inputs(kind, n, k, seed=3).cuda() / k ** 0.5
    # (the tall shape is below the automatic choice's range: forced, within max(eager's error, the split's floor))
    check_split(x, weight, new.gemm.bias.detach(), multiplier=-1.5, slope=-0.2, path=path, forced=n < 1000,
                row_scale=kind in ("rows_times_1e30", "rows_times_1e-30", "wide_range_rows"))


# A host program over split_numerics.cuh's unscaling: for every x row exponent the split makes ([-114, 162]), some
# beyond it up to the factors' border (252), and kNonFiniteRow (0 for every finite total, as ldexpf gives), and finite
# totals of every sign, binade and mantissa (random bit patterns over all binades, zeros, subnormals, the binades
# around 2^(e - 252) where the first multiply stops being exact), unscale(total, e) must be ldexpf(total, -e) bit for
# bit: the kernels' two multiplies per output replace a branch to ldexpf.
UNSCALE_CHECK = r"""
#include "gemm/split_numerics.cuh"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

static std::uint32_t bits(float v) {
  std::uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

static float from_bits(std::uint32_t b) {
  float v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

int main() {
  using kernels::gemm::unscale;
  std::mt19937 random(0);
  std::vector<int> exponents;
  for (int e = -114; e <= 162; ++e) exponents.push_back(e);
  for (int e : {200, 251, 252, kernels::gemm::kNonFiniteRow}) exponents.push_back(e);
  long checked = 0, wrong = 0;
  for (int e : exponents) {
    std::vector<float> totals = {0.0f, -0.0f, from_bits(1), from_bits(0x80000001u), 1.0f, -3.5f, 1e30f, -1e-30f};
    for (int binade = -150; binade <= 127; ++binade)  // around the border 2^(e - 252) and everywhere else
      for (int i = 0; i < 8; ++i) totals.push_back(std::ldexp(1.0f + (random() % 8388608) / 8388608.0f, binade));
    for (int i = 0; i < 20000; ++i) {
      const std::uint32_t b = random();
      totals.push_back(from_bits((b & 0x807fffffu) | ((b >> 8) % 255) << 23));  // subnormals .. 2^127
    }
    for (float total : totals) {
      for (float signed_total : {total, -total}) {
        const float ours = unscale(signed_total, e), expected = std::ldexp(signed_total, -e);
        ++checked;
        if (bits(ours) != bits(expected) && wrong++ < 5)
          std::printf("e %d total %a: unscale %a, ldexpf %a\n", e, signed_total, ours, expected);
      }
    }
  }
  std::printf("checked %ld, wrong %ld\n", checked, wrong);
  return wrong == 0 ? 0 : 1;
}
"""


def run_host_program(tmp_path, name, text):
    """Builds `name` (a .cu or .cpp file of `text`, the library's sources on its include path) with nvcc, runs it, and
    returns its output, asserting both succeeded. nvcc hands a .cpp file to the host compiler as plain C++, with
    CUDA's headers on its include path."""
    from kernels import loader

    source = tmp_path / name
    source.write_text(text)
    program = tmp_path / source.stem
    built = subprocess.run([NVCC, "-std=c++17", "-O2", "-I", loader.SOURCE_ROOT, str(source), "-o", str(program)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-4000:]
    result = subprocess.run([str(program)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


@requires_nvcc
@pytest.mark.slow
def test_unscale_is_ldexpf_bit_for_bit_host_program(tmp_path):
    assert "wrong 0" in run_host_program(tmp_path, "unscale_check.cu", UNSCALE_CHECK)


# The Hopper GEMM's stream-K schedule (gemm_sm90_tile_scheduler.cuh) run on the host: the header's device functions
# compiled as host code, blockIdx, gridDim and threadIdx plain variables. For each (tiles, chunks, CTAs) where StreamK
# fits, every CTA walks its units as the kernel's producer and consumers do; every (tile, chunk) must be taken once,
# each tile's slices must run 0, 1, ... along K and number StreamK::parts (what the sum adds), and tile_of must invert
# the tile order.
STREAM_K_CHECK = r"""
#define __host__
#define __device__
#define __forceinline__ inline
#include <algorithm>
#include <cstdio>
#include <vector>
struct Index { unsigned x; };
static Index blockIdx, gridDim, threadIdx;
using std::min;
#include "gemm/gemm_sm90_tile_scheduler.cuh"
using namespace kernels::gemm;

static long wrong = 0;
#define EXPECT(ok, ...) do { if (!(ok) && wrong++ < 10) { std::printf(__VA_ARGS__); std::printf("\n"); } } while (0)

int main() {
  long fitted = 0;
  for (int ctas : {132, 78, 16, 3}) {
    for (int tiles = 1; tiles <= 300; ++tiles) {
      for (int chunks : {1, 2, 3, 5, 8, 16, 17, 33, 64, 197}) {
        const StreamK streamk(tiles, chunks, ctas);
        EXPECT(!(tiles % ctas == 0 && streamk.fits()), "fits without a partial round: %d tiles, %d CTAs", tiles, ctas);
        if (!streamk.fits()) continue;
        ++fitted;
        std::vector<int> slice_of(static_cast<size_t>(tiles) * chunks, -1);
        gridDim.x = ctas;
        for (int cta = 0; cta < ctas; ++cta) {
          blockIdx.x = cta;
          const TileScheduler scheduler(tiles * kBlockX, kBlockW, chunks, 1, chunks, true);  // tiles x 1 tiles
          int units = 0;
          for (int unit = scheduler.first(); unit < scheduler.units; unit = scheduler.next(unit), ++units) {
            const int tile = scheduler.tile(unit), first = scheduler.first_chunk(unit);
            const int count = scheduler.unit_chunks(unit), slice = scheduler.slice(unit);
            EXPECT(count >= 1 && first >= 0 && first + count <= chunks && tile >= 0 && tile < tiles,
                   "unit %d of CTA %d: tile %d, chunks %d + %d (%d tiles, %d chunks)", unit, cta, tile, first, count,
                   tiles, chunks);
            EXPECT(scheduler.is_last(unit) == (scheduler.next(unit) >= scheduler.units), "is_last");
            if (count < 1 || first < 0 || first + count > chunks || tile < 0 || tile >= tiles || units > tiles * chunks)
              break;
            for (int chunk = first; chunk < first + count; ++chunk) {
              int& taken = slice_of[static_cast<size_t>(tile) * chunks + chunk];
              EXPECT(taken == -1, "tile %d chunk %d taken twice (%d tiles, %d chunks, %d CTAs)", tile, chunk, tiles,
                     chunks, ctas);
              taken = slice;
            }
          }
          EXPECT(units >= 1, "CTA %d has no unit (%d tiles, %d chunks)", cta, tiles, chunks);
        }
        for (int tile = 0; tile < tiles; ++tile) {
          int expected = 0;
          for (int chunk = 0; chunk < chunks; ++chunk) {
            const int slice = slice_of[static_cast<size_t>(tile) * chunks + chunk];
            if (slice == expected + 1) ++expected;
            EXPECT(slice == expected, "tile %d chunk %d: slice %d, expected %d (%d tiles, %d chunks, %d CTAs)", tile,
                   chunk, slice, expected, tiles, chunks, ctas);
          }
          EXPECT(expected + 1 == streamk.parts(tile), "tile %d: %d slices, parts %d", tile, expected + 1,
                 streamk.parts(tile));
        }
      }
    }
  }
  for (int x_tiles = 1; x_tiles <= 24; ++x_tiles)
    for (int w_tiles = 1; w_tiles <= 24; ++w_tiles)
      for (int tile = 0; tile < x_tiles * w_tiles; ++tile)
        EXPECT(tile_of(tile_x_of(tile, x_tiles, w_tiles), tile_w_of(tile, x_tiles, w_tiles), x_tiles, w_tiles) == tile,
               "tile_of(%d) in %d x %d tiles", tile, x_tiles, w_tiles);
  std::printf("fitted %ld, wrong %ld\n", fitted, wrong);
  return wrong == 0 && fitted > 0 ? 0 : 1;
}
"""


@requires_nvcc
def test_stream_k_schedule_takes_every_chunk_once_host_program(tmp_path):
    assert "wrong 0" in run_host_program(tmp_path, "stream_k_check.cpp", STREAM_K_CHECK)


@over_split_paths
# (600, 24) and (600, 26) are computed transposed on split_fp16: y written by the kernel, and by the epilogue's pass
@pytest.mark.parametrize("rows,features", [(24, 40), (600, 24), (600, 26)])
def test_split_path_propagates_nan_and_inf_like_eager(path, rows, features):
    _, new = make_pair(264, features, 2.0, 0.1, "cuda")
    weight, bias = new.gemm.weight.detach().clone(), new.gemm.bias.detach()
    x = torch.randn(rows, 264, device="cuda")
    x[1, 3], x[2, 5], x[3, 7] = float("nan"), float("inf"), float("-inf")
    weight[4, 9], weight[5, 11] = float("inf"), float("nan")
    weight[6, :] = 0.25  # exactly representable: lo = 0, where inf * 0 must not turn into NaN
    x[7, :] = 0.5
    x[8, 17], x[9, 9] = float("inf"), float("-inf")  # meets the inf of weight row 4 in column 9
    x[10, :] = float("inf")  # a whole row: every output of it is inf or, where weight is 0, NaN
    check_split(x, weight, bias, path=path, forced=True)


@over_split_paths
def test_split_path_non_finite_rows_beyond_the_listed_positions(path):
    """Rows with more non-finite values than the fix-up kernel lists, meeting non-finite rows of the other operand."""
    k = 2056
    _, new = make_pair(k, 1032, 2.0, 0.1, "cuda")
    weight, bias = new.gemm.weight.detach().clone(), new.gemm.bias.detach()
    x = torch.randn(1030, k, device="cuda")
    x[0, :] = float("inf")
    x[1, ::2] = float("-inf")
    x[2, 5::3] = float("nan")
    weight[3, 1::2] = float("-inf")  # output (1, 3): infinities from both operands, of both signs
    weight[4, :] = float("inf")
    weight[5, 7] = 0.0
    x[6, 7] = float("inf")  # inf * 0 = NaN
    check_split(x, weight, bias, path=path)


@over_split_paths
# (200, 24) and (200, 26) computed transposed on split_fp16: y written by the kernel, and by the epilogue's pass
@pytest.mark.parametrize("rows,features", [(5, 72), (200, 24), (200, 26)])
def test_split_path_mask_and_views(path, rows, features):
    """The mask the backward uses with a negative slope, batched leading dims, and an input view at an offset."""
    _, new = make_pair(136, features, -1.5, -0.3, "cuda")
    weight, bias = new.gemm.weight.detach(), new.gemm.bias.detach()
    base = torch.randn(3 * rows * 136 + 3, device="cuda")
    x = base[3:].view(3, rows, 136)  # 12 bytes off 16-byte alignment: the path copies it
    check_split(x, weight, bias, -1.5, -0.3, path=path, forced=True)
    with forced_gemm_path(path):
        y, mask = torch.ops.kernels.gemm_multiply_leaky_relu(x, weight, bias, -1.5, -0.3, True)
    pre = F.linear(x, weight, bias) * -1.5
    agree = (mask == (pre > 0)) | (pre.abs() < 1e-4)  # rounding may flip the sign test right at zero
    assert mask.shape == y.shape and bool(agree.all())


@pytest.mark.skipif("split_fp16" not in SPLIT_KERNELS, reason="needs the Hopper split kernel")
@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events:UserWarning")  # torch's notice, once per process
@pytest.mark.parametrize("m,k,n,epilogue_pass", [(2000, 520, 40, False), (2000, 520, 42, True),
                                                 (1024, 1032, 1040, False), (1030, 1024, 1030, False)])
def test_split_fp16_writes_tall_narrow_products_from_the_kernel(m, k, n, epilogue_pass):
    """Where x has more elements than w and the output together (m k > n k + m n), split_fp16 computes y^T = w x^T;
    the kernel writes y itself where its rows are 16-byte multiples (n % 4 == 0), else it writes y^T and the
    transposed epilogue's kernel makes y from it. Elsewhere neither. The results are checked by the shape tests above
    and the epilogue cases below; this checks which way each shape goes."""
    x, weight, bias = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda"), torch.randn(n, device="cuda")
    with forced_gemm_path("split_fp16"):
        _, kernels = cuda_kernels_launched(lambda: gemm_multiply_leaky_relu(x, weight, bias, 2.0, 0.1))
    assert any("split_gemm_kernel" in name for name in kernels), kernels
    assert any("transposed_epilogue_kernel" in name for name in kernels) == epilogue_pass, kernels


@pytest.mark.skipif("split_fp16" not in SPLIT_KERNELS, reason="needs the Hopper split kernel")
@pytest.mark.parametrize("mode", [1, -1])
@pytest.mark.parametrize("m,k,n", [(1030, 520, 1032), (1030, 520, 1030), (2000, 520, 40), (600, 264, 26)])
def test_split_fp16_forward_in_either_orientation(m, k, n, mode):
    """The forward forced transposed (y^T = w x^T: y written by the kernel where n % 4 == 0, else through the
    transposed epilogue's pass) and forced as it is, whichever the automatic rule picks for the shape: within the
    contract either way, with non-finite values of both operands and the mask."""
    _, new = make_pair(k, n, -1.5, -0.3, "cuda")
    weight, bias = new.gemm.weight.detach().clone(), new.gemm.bias.detach()
    x = torch.randn(m, k, device="cuda")
    x[1, 3], x[2, 5] = float("nan"), float("inf")
    weight[4, 9] = float("-inf")
    with forced_transposed(mode):
        check_split(x, weight, bias, -1.5, -0.3, forced=True)
        with forced_gemm_path("split_fp16"):
            _, kernels = cuda_kernels_launched(lambda: gemm_multiply_leaky_relu(x, weight, bias, -1.5, -0.3))
            y, mask = torch.ops.kernels.gemm_multiply_leaky_relu(x, weight, bias, -1.5, -0.3, True)
    assert any("transposed_epilogue_kernel" in name for name in kernels) == (mode == 1 and n % 4 != 0), kernels
    pre = F.linear(x, weight, bias) * -1.5
    agree = (mask == (pre > 0)) | (pre.abs() < 1e-4)  # rounding may flip the sign test right at zero
    assert mask.shape == y.shape and bool(agree.all())


@pytest.mark.skipif("split_fp16" not in SPLIT_KERNELS, reason="needs the Hopper split kernel")
def test_split_fp16_gelu_forward_forced_transposed():
    """A GELU's forward computed transposed (its epilogue by the transposed epilogue's pass) is within the contract."""
    x, bias = torch.randn(1030, 520, device="cuda"), torch.randn(1032, device="cuda")
    weight = torch.randn(1032, 520, device="cuda") / 520 ** 0.5
    with forced_gemm_path("split_fp16"), forced_transposed(1), torch.no_grad():
        y = gemm_gelu(x, weight, bias, "none")
    y_eager = F.gelu(F.linear(x, weight, bias))
    y64 = F.gelu(F.linear(x.double(), weight.double(), bias.double()))
    assert allclose(y, y_eager), (y - y_eager).abs().max()
    assert relative_error(y, y64) <= max(relative_error(y_eager, y64), SPLIT_FP16_ERROR_FLOOR)


# The Hopper kernel's two epilogues, run in processes of their own (the kernel reads KERNELS_GEMM_PLAIN_STORES once
# per process): each case's forward with the mask, the forward from a weight split made beforehand where one is kept,
# and the three gradients, saved for the test to compare.
EPILOGUE_CASES = {  # name: (m, k, n)
    "tails": (300, 1040, 520),  # rows and columns past the tiles' ends; rows down to 2^-120 (unscale's two factors)
    "kept_split": (1100, 4000, 1060),  # the forward from w's split made beforehand (the presplit kernel)
    "w_split_ahead": (1000, 520, 2056),  # grad_W from a split made beforehand (grad_pre^T has 2056 rows)
    # K of one chunk and of two, on 320 tiles: two or three tiles per CTA, so that a CTA's stages are reused across
    # tiles within a few chunks.
    "one_chunk": (2048, 64, 2560),
    "two_chunks": (2048, 128, 2560),
    # grad_W of 1000 x 520 (40 tiles) over 4096 rows: K split (split_gemm_k_slices), the partials by either epilogue.
    "split_k": (4096, 520, 1000),
    # Rows of y that are not 16-byte multiples (n % 4 != 0: plain stores either way): n % 4 = 3 and m % 4 = 1; the
    # kept split's kernel with n % 4 = 2; a forward over few rows with K split (16 tiles over 64 chunks).
    "odd_columns": (557, 1040, 523),
    "odd_columns_kept_split": (1100, 4000, 1062),
    "odd_columns_split_k": (128, 4096, 2046),
    # Tall and narrow (m k > n k + m n), computed transposed: by TMA the kernel writes y itself, by plain stores it
    # writes y^T for the transposed epilogue's pass; with n % 4 != 0 the pass both ways, held by the script to the
    # padded forward, which the kernel writes itself.
    "tall_narrow": (2000, 520, 40),
    "tall_narrow_odd_columns": (2000, 520, 42),
}


EPILOGUE_CASES_SCRIPT = r"""
import ast
import sys
import torch
import torch.nn.functional as F
from kernels.gemm.gemm import forced_gemm_path

cases = ast.literal_eval(sys.argv[2])  # EPILOGUE_CASES
results = {}
for name, (m, k, n) in cases.items():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda"), torch.randn(n, device="cuda")
    x[::7] *= 1e-36
    x[5, 7] = float("inf")  # a row the fix-up rewrites after the epilogue
    with forced_gemm_path("split_fp16"), torch.no_grad():
        y, mask = torch.ops.kernels.gemm_multiply_leaky_relu(x, weight, bias, -1.5, -0.2, True)
        split = torch.ops.kernels.gemm_weight_split(x, weight)
        y_kept, mask_kept = torch.ops.kernels.gemm_multiply_leaky_relu(x, weight, bias, -1.5, -0.2, True, split)
        grad_y = torch.randn_like(y)
        grads = torch.ops.kernels.gemm_multiply_leaky_relu_backward(grad_y, x, weight, mask, -1.5, -0.2, True, True,
                                                                    True)
    # The kept split's results are the in-register split's, bit for bit (whichever epilogue).
    assert torch.equal(y.view(torch.int32), y_kept.view(torch.int32)) and torch.equal(mask, mask_kept), name
    if n % 4:  # y's rows not 16-byte multiples: the same columns of the product padded to n % 4 == 0 (y by TMA there)
        pad = 4 - n % 4
        with forced_gemm_path("split_fp16"), torch.no_grad():
            y_pad, mask_pad = torch.ops.kernels.gemm_multiply_leaky_relu(
                x, F.pad(weight, (0, 0, 0, pad)), F.pad(bias, (0, pad)), -1.5, -0.2, True)
        assert torch.equal(y.view(torch.int32), y_pad[:, :n].view(torch.int32)), name
        assert torch.equal(mask, mask_pad[:, :n]), name
    results[name] = [t.cpu() for t in (y, mask, y_kept, mask_kept, *grads)] + [len(split)]
torch.save(results, sys.argv[1])
"""


@pytest.mark.skipif("split_fp16" not in SPLIT_KERNELS, reason="needs the Hopper split kernel")
@pytest.mark.slow
def test_split_fp16_epilogue_by_tma_and_by_plain_stores_agree_bit_for_bit(tmp_path):
    """The Hopper kernel's TMA epilogue (outputs made in the staging buffer, then TMA stores) and its plain-stores
    epilogue (KERNELS_GEMM_PLAIN_STORES=1, what the sanitizer's initcheck runs) give the same outputs, masks and
    gradients bit for bit: forward, the forward from a kept split, grad_x and grad_W, on shapes with tails, with
    K of one and two chunks, and with rows of y that are not 16-byte multiples (plain stores in both runs: the script
    holds each to the forward with w and the bias padded by zero rows to a multiple of 4, whose y takes TMA). The
    plain-stores run also launches every kernel plainly (KERNELS_DEPENDENT_LAUNCH=0), so the dependent launches are
    held to the same bits."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = {}
    for plain in ("0", "1"):
        out = tmp_path / f"plain_{plain}.pt"
        done = subprocess.run([sys.executable, "-c", EPILOGUE_CASES_SCRIPT, str(out), repr(EPILOGUE_CASES)],
                              cwd=root, capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, KERNELS_GEMM_PLAIN_STORES=plain, KERNELS_DEPENDENT_LAUNCH=(
                                  "0" if plain == "1" else "1")))
        assert done.returncode == 0, done.stderr[-3000:]
        runs[plain] = torch.load(out)
    for name, by_tma in runs["0"].items():
        by_plain = runs["1"][name]
        assert by_tma[-1] == by_plain[-1], (name, by_tma[-1])
        # Which cases read a split of w made ahead (the presplit kernel) and which split w in registers.
        assert (by_tma[-1] > 0) == kept_split_expected("split_fp16", *EPILOGUE_CASES[name]), (name, by_tma[-1])
        for i, (a, b) in enumerate(zip(by_tma[:-1], by_plain[:-1])):
            if a.dtype == torch.float32:
                a, b = a.view(torch.int32), b.view(torch.int32)  # NaN payloads too
            assert a.shape == b.shape and torch.equal(a, b), (name, i)
        y = by_tma[0]
        assert bool(y.isinf().any()) or bool(y.isnan().any()), name  # the fix-up's rows are in the comparison


WEIGHT_CHANGE_PATHS = ["auto", *SPLIT_KERNELS]


@pytest.mark.parametrize("path", WEIGHT_CHANGE_PATHS)
@pytest.mark.parametrize("change", ["in_place", "data_copy", "new_parameter", "load_state_dict", "optimizer_step",
                                    "to", "bf16_round_trip"])
def test_weight_changes_show_in_the_next_call(device, change, path):
    if device == "cpu" and path != "auto":
        pytest.skip("the split path is CUDA only")
    # The split path at a size in its range, where its error is held to eager's and the weight's split is kept.
    features, rows = (2048, 2048) if path in SPLIT_PATHS else (64, 16)
    reference, new = make_pair(features, features - 16, 2.0, 0.1, device)
    x = torch.randn(rows, features, device=device)
    with forced_gemm_path(path):
        check_weight_change(reference, new, x, change)


def check_weight_change(reference, new, x, change):
    """After calls that leave the weight's split kept (FusedLinear, under no_grad from the second call on), the weight
    changes in one of the ways users change weights; the next calls must see it."""
    with torch.no_grad():
        for _ in range(3):
            new(x)  # anything kept from these calls would show
    if change == "in_place":
        with torch.no_grad():
            new.gemm.weight.mul_(-0.5)
    elif change == "data_copy":  # new values at nn.Linear's scale, 1 / sqrt(in_features)
        new.gemm.weight.data.copy_(torch.randn_like(new.gemm.weight) * x.shape[-1] ** -0.5)
        # A change through .data is one PyTorch's version counter does not count: FusedLinear's documented step.
        new.gemm.clear_weight_split()
    elif change == "new_parameter":
        new.gemm.weight = torch.nn.Parameter(torch.randn_like(new.gemm.weight) * x.shape[-1] ** -0.5)
    elif change == "load_state_dict":
        new.load_state_dict({k: torch.randn_like(v) * x.shape[-1] ** -0.5 for k, v in new.state_dict().items()})
    elif change == "optimizer_step":
        optimizer = torch.optim.SGD(new.parameters(), lr=0.5)
        new(x).square().mean().backward()
        optimizer.step()
    elif change == "bf16_round_trip":  # new data, the same Parameter and version counter (module._apply)
        new.to(torch.bfloat16).to(torch.float32)
    elif change == "to":
        new.to(torch.float64).to(torch.float32)
        with torch.no_grad():
            new.gemm.weight.add_(x.shape[-1] ** -0.5)
    reference.load_state_dict(new.state_dict())
    for _ in range(3):  # the first call after the change, the one that splits the weight ahead, one that reads it
        check_against_reference(reference, new, x)


# ---- the split sweeps alone (torch.ops.kernels._gemm_split_sweep) ------------------------------------------------

SWEEP_SHAPES = [(300, 200), (64, 4096), (1000, 130), (37, 77)]  # aligned and not (130, 77 columns), short rows


def _sweep_input(rows, cols):
    g = torch.Generator(device="cuda").manual_seed(rows * cols)
    src = torch.randn(rows, cols, device="cuda", generator=g)
    src[1] *= 1e-30  # rows far from 1: the scale follows each row (or chunk)
    src[2] *= 1e30
    return src


@requires_cuda
@pytest.mark.parametrize("sweep", ["rows_natural", "columns", "chunks_natural", "chunks_transposed"])
@pytest.mark.parametrize("rows,cols", SWEEP_SHAPES)
def test_split_sweep_halves_add_up_to_the_matrix(sweep, rows, cols):
    # hi + lo, unscaled, is each element to ~22 bits of its row's (or chunk's) largest; the padding is zero.
    src = _sweep_input(rows, cols)
    if sweep == "chunks_natural" and cols % 4 != 0:  # w's rows must be 16-byte aligned, as the GEMM reads them
        with pytest.raises(RuntimeError, match="multiple of 4 floats"):
            torch.ops.kernels._gemm_split_sweep(src, sweep)
        return
    matrix = src.t() if sweep in ("columns", "chunks_transposed") else src  # the rows the sweep splits
    hi, lo, exponent, *rest = torch.ops.kernels._gemm_split_sweep(src, sweep)
    assert hi.dtype == lo.dtype == torch.float16 and hi.shape == lo.shape and hi.shape[0] == matrix.shape[0]
    assert hi.shape[1] % 64 == 0 and hi.shape[1] >= matrix.shape[1]
    values, padding = split_sweep_values(hi, lo, exponent, matrix.shape[1])
    exact = matrix.double()
    if exponent.dim() == 2:
        chunk_max = F.pad(exact.abs(), (0, hi.shape[1] - exact.shape[1])).unflatten(1, (-1, 64)).amax(2)
        bound = chunk_max.repeat_interleave(64, dim=1)[:, :exact.shape[1]]
    else:
        bound = exact.abs().amax(1, keepdim=True)
    assert ((values - exact).abs() <= bound * 2.0 ** -21).all()
    assert (padding == 0).all()
    if sweep == "columns":  # the columns' sums, compensated: as close to float64's as float32 holds
        sums = rest[0]
        assert torch.allclose(sums.double(), exact.sum(1), rtol=2e-7, atol=1e-30 * rows)
    if sweep.startswith("chunks"):
        assert (rest[0] == 0).all()  # no row flagged: all finite


@requires_cuda
@pytest.mark.parametrize("rows,cols", SWEEP_SHAPES)
def test_split_sweeps_agree_with_each_other_bit_for_bit(rows, cols):
    # A column sweep is the row sweep of the transpose, a transposed chunk sweep the chunk sweep of the transpose, and
    # the GEMM's orders (rows, chunks) hold the same halves as k's order within each chunk of 64.
    src = _sweep_input(rows, cols)
    sweep = torch.ops.kernels._gemm_split_sweep
    transposed = src.t().contiguous()

    def written(split, rows_of_split):  # chunk exponents: the columns past the split's rows are padding
        return [t[:, :rows_of_split] if t.dim() == 2 and t.dtype == torch.int32 else t for t in split]

    pairs = [(sweep(src, "columns")[:3], sweep(transposed, "rows_natural"))]
    if rows % 4 == 0:
        pairs.append((written(sweep(src, "chunks_transposed"), cols),
                      written(sweep(transposed, "chunks_natural"), cols)))
    for a, b in pairs:
        for x, y in zip(a, b):
            assert torch.equal(x, y)

    def pairs_in_chunks(split):  # each element's (hi, lo) bits as one integer, sorted within each chunk of 64
        bits = lambda t: t.view(torch.int16).to(torch.int64) & 0xFFFF  # noqa: E731
        return (bits(split[0]) << 16 | bits(split[1])).unflatten(1, (-1, 64)).sort(2).values

    orders = [(sweep(src, "rows_natural"), sweep(src, "rows"))]
    if cols % 4 == 0:
        orders.append((written(sweep(src, "chunks_natural"), rows), written(sweep(src, "chunks"), rows)))
    for natural, ordered in orders:
        assert torch.equal(natural[2], ordered[2])
        assert torch.equal(pairs_in_chunks(natural), pairs_in_chunks(ordered))


@requires_cuda
@pytest.mark.parametrize("sweep", ["rows", "rows_natural"])
@pytest.mark.parametrize("cols", [77, 4099, 30522, 50257, 32000, 70001])
def test_row_split_staged_is_the_generic_one(sweep, cols):
    # Rows at each 4-byte offset from a 16-byte boundary (unaligned: a vocabulary's lengths; aligned and longer than
    # the in-register kernels hold: 32000), staged in shared memory (70001: partly, the rest read again), against the
    # generic kernels that read each row twice, bit for bit; short rows (77) take the generic kernel either way.
    g = torch.Generator(device="cuda").manual_seed(cols)
    rows = 5
    flat = torch.randn(rows * cols + 8, device="cuda", generator=g)
    flat[cols + 3: 2 * cols] *= 1e30  # a row far from 1, whose first floats are not
    flat[5 * cols // 2] = float("inf")  # row 2 holds a non-finite value: flagged
    for offset in range(4):
        src = flat[offset: offset + rows * cols].view(rows, cols)
        split = torch.ops.kernels._gemm_split_sweep(src, sweep)
        for got, want in zip(split, torch.ops.kernels._gemm_split_sweep(src, sweep + "_read_twice")):
            assert torch.equal(got, want), offset
        if sweep == "rows_natural":  # k's own order: the halves add up to the rows (but the flagged row's)
            values, padding = split_sweep_values(*split, cols)
            exact = src.double()
            finite_rows = torch.arange(rows, device="cuda") != 2
            assert split[2][2] == split[2].max()  # kNonFiniteRow, far above any row's exponent
            assert ((values - exact).abs() <= exact.abs().amax(1, keepdim=True) * 2.0 ** -21)[finite_rows].all()
            assert (padding == 0).all()


@requires_cuda
@pytest.mark.parametrize("rows,cols,row_stride", [(4096, 1024, 1024), (12608, 768, 768), (8200, 1000, 1024)])
def test_column_split_staged_is_the_read_twice_one(rows, cols, row_stride):
    # Matrices whose column tiles fit the resident grid take the staged kernel (each element read once, held in shared
    # memory between the maxima and the split): bit for bit the kernel that reads each element twice, with columns far
    # from 1, non-finite values, rows and columns past the tiles' ends (8200 x 1000) and rows further apart than
    # their length (a view of a wider matrix).
    g = torch.Generator(device="cuda").manual_seed(rows + cols)
    src = torch.randn(rows, row_stride, device="cuda", generator=g)[:, :cols]
    src[:, 1] *= 1e-30
    src[:, 130] *= 1e30
    src[rows // 2, 5] = float("inf")
    src[rows - 1, 700] = float("nan")
    split, kernels = cuda_kernels_launched(lambda: torch.ops.kernels._gemm_split_sweep(src, "columns"))
    assert any("split_columns_staged_kernel" in name for name in kernels), kernels
    twice = torch.ops.kernels._gemm_split_sweep(src, "columns_read_twice")
    for got, want in zip(split, twice):  # as bytes: the NaN column's sum is NaN in both
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    values, padding = split_sweep_values(*split[:3], rows)
    exact = src.t().double()
    finite = torch.ones(cols, dtype=torch.bool, device="cuda")
    finite[[5, 700]] = False
    assert (split[2][~finite] == split[2].max()).all()  # flagged: kNonFiniteRow
    assert ((values - exact).abs() <= exact.abs().amax(1, keepdim=True) * 2.0 ** -21)[finite].all()
    assert (padding == 0).all()


@pytest.mark.parametrize("src,sweep,message", [
    (torch.zeros(4, 8), "diagonal", "sweep must be one of"),
    (torch.zeros(2, 4, 8), "rows", "2-D float32"),
    (torch.zeros(4, 8, dtype=torch.float64), "rows", "2-D float32"),
    (torch.zeros(0, 8), "columns", "must not be empty"),
    (torch.zeros(4, 8), "rows", "CUDA"),  # a CPU tensor: the sweeps run on the GPU
])
def test_split_sweep_bad_input(src, sweep, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kernels._gemm_split_sweep(src, sweep)
