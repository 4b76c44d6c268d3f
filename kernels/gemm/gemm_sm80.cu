// The fp32-accurate split GEMM of gemm_multiply_leaky_relu on sm_80 instructions (mma.sync, ldmatrix, cp.async;
// launch_split_gemm_sm80_multiply_leaky_relu in gemm.h), for GPUs from the A100 on whose blocks take 129 KB of shared
// memory (not sm_86, sm_89, sm_120); numerics as the Hopper kernel's (split_numerics.cuh).
// - Operands come pre-split as fp16 hi/lo pairs in k's order, rows padded to chunks of 64 (x: launch_split_rows, w:
//   launch_split_chunks): mma.sync reads registers, so splitting w here would stall every warp (kernels/gemm/NOTES.md).
// - Tiles: 128 x 128 per CTA, one chunk of K per stage, 8 warps of 64 x 32; rows swizzled for conflict-free ldmatrix.
// - Pipeline: kStages of cp.async (3 or 2, by shared memory) on per-stage full/empty mbarriers, no CTA-wide barriers.
// - Per 16 of k three m16n8k16 products, small terms first; each chunk promoted with w's powers of two, the epilogue
//   unscales by x's. Rows past m or n load as zeros; non-finite inputs are fixed up by launch_nonfinite_outputs.
#include "common/dependent_launch.cuh"
#include "common/device_queries.h"
#include "common/mma_sm80.cuh"
#include "common/once_per_device.h"
#include "gemm.h"
#include "split_numerics.cuh"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <optional>
#include <type_traits>

// The kernel's own names live in gemm::sm80: the family's .cu files are joined into one translation unit.
namespace kernels::gemm::sm80 {
namespace {

using common::sm80::copy_16_async;
using common::sm80::copy_4_async;
using common::sm80::load_matrix_x4;
using common::sm80::mma_m16n8k16;
using common::sm80::shared_address;

constexpr int kTileRows = 128;         // rows of x per CTA, and rows of w: each operand tile is 128 x 64 fp16
constexpr int kWarpsX = 2, kWarpsW = 4;
constexpr int kThreads = 32 * kWarpsX * kWarpsW;
constexpr int kWarpRowsX = kTileRows / kWarpsX;  // 64: four m16 fragments
constexpr int kWarpRowsW = kTileRows / kWarpsW;  // 32: four n8 fragments
constexpr int kFragsX = kWarpRowsX / 16, kFragsW = kWarpRowsW / 8;
constexpr int kTileBytes = kTileRows * kSplitChunk * 2;  // 16 KB
constexpr int kExponentBytes = kTileRows * 4;            // the chunk's power of two per row of w
constexpr int kStageBytes = 4 * kTileBytes + kExponentBytes;  // x_hi, x_lo, w_hi, w_lo, w's exponents
constexpr int kUnitsPerThread = kTileRows * (kSplitChunk * 2 / 16) / kThreads;  // 16-byte copies per tile
static_assert(kSplitChunk * 2 == 128, "a chunk of fp16 is one 128-byte row");
static_assert(kFragsW % 2 == 0, "w fragments are loaded in pairs (ldmatrix.x4)");

constexpr int shared_bytes(int stages) { return stages * (kStageBytes + 16); }  // the stages, then their barriers

// The byte offset of 16-byte unit `unit` of row `row` in a tile.
__device__ __forceinline__ std::uint32_t swizzled(int row, int unit) {
  return static_cast<std::uint32_t>(row * 128 + ((unit ^ (row % 8)) * 16));
}

// mbarriers (sm_80): a stage's "full" barrier completes once every thread's copies into it have landed
// (cp.async.mbarrier.arrive.noinc), its "empty" barrier once every thread has read it; both count kThreads arrivals.
// Every thread arrives on "empty" (not one lane per warp), so compute-sanitizer's racecheck sees the ordering.
__device__ __forceinline__ void barrier_init(std::uint32_t barrier, int count) {
#if KERNELS_SM80_DEVICE
  asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(barrier), "r"(count) : "memory");
#endif
}

// The barrier's arrival once this thread's cp.async copies issued so far have landed.
__device__ __forceinline__ void copies_arrive(std::uint32_t barrier) {
#if KERNELS_SM80_DEVICE
  asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(barrier) : "memory");
#endif
}

__device__ __forceinline__ void barrier_arrive(std::uint32_t barrier) {
#if KERNELS_SM80_DEVICE
  asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared.b64 state, [%0];\n}" ::"r"(barrier) : "memory");
#endif
}

// Waits until the barrier's phase of this parity has completed.
__device__ __forceinline__ void barrier_wait(std::uint32_t barrier, int parity) {
#if KERNELS_SM80_DEVICE
  std::uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(barrier), "r"(parity)
        : "memory");
  } while (!done);
  // The lanes may leave the loop in different rounds; the .aligned ldmatrix and mma.sync after a wait need the warp
  // converged, which this makes explicit rather than left to the compiler's reconvergence.
  __syncwarp();
#endif
}

// A thread's part of a stage's loads, the same for every chunk: 16-byte unit tid % 8 of rows tid / 8 + 32 i
// (i < kUnitsPerThread) of each operand tile, whose shared-memory offsets differ by 32 rows (the swizzle's row % 8 is
// the same for all of them), and the exponent of w row tid where tid < 128.
struct StageLoads {
  const __half* sources[4];      // x_hi, x_lo, w_hi, w_lo
  const std::int32_t* w_exponent;
  std::int64_t length;            // a split row's length (fp16 values)
  std::int64_t offset[2];         // x's and w's: the thread's first row's unit, from the matrix's start
  int rows_left[2];               // x's and w's: rows from the thread's first row to the matrix's end
  int n;
  int exponent_row;               // the w row of the exponent this thread loads, or -1
  std::uint32_t shared_offset;    // in a tile, of the thread's first row's unit

  __device__ __forceinline__ StageLoads(const __half* x_hi, const __half* x_lo, const __half* w_hi,
                                        const __half* w_lo, const std::int32_t* w_exponent, int m, int n,
                                        std::int64_t length, int first_x_row, int first_w_row)
      : sources{x_hi, x_lo, w_hi, w_lo}, w_exponent(w_exponent), length(length), n(n) {
    const int row = threadIdx.x / 8, unit = threadIdx.x % 8;
    offset[0] = (first_x_row + row) * length + unit * 8;
    offset[1] = (first_w_row + row) * length + unit * 8;
    rows_left[0] = m - first_x_row - row;
    rows_left[1] = n - first_w_row - row;
    exponent_row = threadIdx.x < kTileRows && first_w_row + static_cast<int>(threadIdx.x) < n
                       ? first_w_row + static_cast<int>(threadIdx.x)
                       : -1;
    shared_offset = swizzled(row, unit);
  }

  // The tiles of chunk `chunk` into `stage`: row r of a tile is row first_row + r of its matrix (rows x length
  // fp16), its 64 values from chunk * 64; then the chunk's exponents of the tile's rows of w (w_exponent: chunks x
  // n). Rows past the matrix are zero-filled.
  __device__ __forceinline__ void operator()(std::uint32_t stage, int chunk) const {
    constexpr int kRowStep = kThreads / 8;  // rows between a thread's units
    const std::int64_t column = static_cast<std::int64_t>(chunk) * kSplitChunk;
#pragma unroll
    for (int tile = 0; tile < 4; ++tile) {
      const int side = tile / 2;
#pragma unroll
      for (int i = 0; i < kUnitsPerThread; ++i) {
        const bool valid = i * kRowStep < rows_left[side];
        const __half* from = sources[tile] + (valid ? offset[side] + i * kRowStep * length + column : 0);
        copy_16_async(stage + tile * kTileBytes + shared_offset + i * kRowStep * 128, from, valid);
      }
    }
    if (threadIdx.x < kTileRows) {
      const bool valid = exponent_row >= 0;
      const std::int64_t at = static_cast<std::int64_t>(chunk) * split_exponent_stride(n) + exponent_row;
      copy_4_async(stage + 4 * kTileBytes + threadIdx.x * 4, w_exponent + (valid ? at : 0), valid);
    }
  }
};

template <int kStages>
__global__ void __launch_bounds__(kThreads, 1)
split_gemm_sm80_kernel(const __half* __restrict__ x_hi, const __half* __restrict__ x_lo,
                       const std::int32_t* __restrict__ x_exponent, const __half* __restrict__ w_hi,
                       const __half* __restrict__ w_lo, const std::int32_t* __restrict__ w_exponent,
                       const float* __restrict__ bias, float* __restrict__ y, std::uint8_t* __restrict__ positive,
                       int m, int n, int k, Epilogue epilogue) {
#if KERNELS_SM80_DEVICE
  wait_for_previous_grid();  // launched by launch_dependent (common/dependent_launch.cuh)
  allow_next_grid();
  extern __shared__ __align__(128) unsigned char shared[];
  const std::uint32_t shared_base = shared_address(shared);
  const std::int64_t length = split_row_length(k);
  const int chunks = static_cast<int>(length / kSplitChunk);
  // x's tiles fastest: the CTAs running together share w's tiles (in L2), and x's split stays in L2.
  const int x_tiles = (m + kTileRows - 1) / kTileRows;
  const int first_x_row = (blockIdx.x % x_tiles) * kTileRows, first_w_row = (blockIdx.x / x_tiles) * kTileRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int warp_x = warp % kWarpsX, warp_w = warp / kWarpsX;

  // The pipeline. Chunk c's stage is c % kStages. During chunk c's first step each thread issues its loads of chunk
  // c + kStages - 1, into the stage every thread released in chunk c - 1; a warp waits for a chunk's stage to be full
  // only where it first reads it, and releases it after its last read. No barrier of the whole CTA: the warps run
  // apart, so that one's loads, waits and promotion overlap the others' products.
  const auto stage_of = [&](int chunk) { return shared_base + (chunk % kStages) * kStageBytes; };
  const std::uint32_t full = shared_base + kStages * kStageBytes, empty = full + kStages * 8;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      barrier_init(full + 8 * s, kThreads);
      barrier_init(empty + 8 * s, kThreads);
    }
  }
  __syncthreads();  // the barriers are initialized before anyone arrives
  const StageLoads load_stage(x_hi, x_lo, w_hi, w_lo, w_exponent, m, n, length, first_x_row, first_w_row);
  for (int s = 0; s < kStages - 1 && s < chunks; ++s) {
    load_stage(stage_of(s), s);
    copies_arrive(full + 8 * s);
  }
  barrier_wait(full, 0);

  float total[kFragsX][kFragsW][4], accumulator[kFragsX][kFragsW][4];
#pragma unroll
  for (int i = 0; i < kFragsX; ++i)
#pragma unroll
    for (int j = 0; j < kFragsW; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) total[i][j][c] = accumulator[i][j][c] = 0.0f;

  // ldmatrix addresses within a tile. x (A operand, m16 x k16): lanes 0-15 address rows 0-15 at k 0-7, lanes 16-31
  // the same rows at k 8-15. w (B operand, two n8 fragments x k16): lanes 0-7 rows 0-7 at k 0-7, 8-15 rows 0-7 at
  // k 8-15, 16-23 rows 8-15 at k 0-7, 24-31 rows 8-15 at k 8-15. Tiles of a stage: x_hi, x_lo, w_hi, w_lo.
  const int x_row_in_frag = lane % 16, x_unit = lane / 16;
  const int w_row_in_pair = lane % 8 + 8 * (lane / 16), w_unit = (lane / 8) % 2;
  using XFragments = std::uint32_t[kFragsX][4];
  using WFragments = std::uint32_t[kFragsW / 2][4];
  const auto load_x = [&](std::uint32_t stage, int tile, int step, XFragments& a) {
#pragma unroll
    for (int i = 0; i < kFragsX; ++i)
      load_matrix_x4(stage + tile * kTileBytes +
                         swizzled(warp_x * kWarpRowsX + i * 16 + x_row_in_frag, 2 * step + x_unit),
                     a[i]);
  };
  const auto load_w = [&](std::uint32_t stage, int tile, int step, WFragments& b) {
#pragma unroll
    for (int p = 0; p < kFragsW / 2; ++p)
      load_matrix_x4(stage + tile * kTileBytes +
                         swizzled(warp_w * kWarpRowsW + p * 16 + w_row_in_pair, 2 * step + w_unit),
                     b[p]);
  };
  // One product over the warp's 16 fragments, fragment by fragment, so that products into one accumulator, which
  // wait for each other, are 16 instructions apart. Fragment j's k 0-7 and k 8-15 registers: b[j / 2][2 (j % 2)], + 1.
  const auto multiply = [&](const XFragments& a, const WFragments& b) {
#pragma unroll
    for (int i = 0; i < kFragsX; ++i)
#pragma unroll
      for (int j = 0; j < kFragsW; ++j)
        mma_m16n8k16<false>(accumulator[i][j], a[i], b[j / 2][2 * (j % 2)], b[j / 2][2 * (j % 2) + 1]);
  };
  // The promotion of the chunk before into the totals (accumulator element c of fragment (i, j): x row g + 8 (c / 2),
  // w row 2 t + c % 2), each fragment's just before the first product of this chunk overwrites it. Where every
  // exponent of the warp's w rows is <= 126 (all but rows below ~2^-113), each 2^-e is a float: one multiply.
  // `exponent` holds the chunk before's exponents of the thread's w rows (zero accumulators before chunk 0).
  std::int32_t exponent[kFragsW][2] = {};
  bool single = true;
  // promote_each(then): every fragment's promotion, each followed by then(i, j) (the next chunk's first product
  // into it, or nothing after the last chunk). The branch on `single` is taken once, outside the unrolled loops.
  const auto promote_each = [&](auto then) {
    const auto promote_all = [&](auto single_multiply) {
#pragma unroll
      for (int i = 0; i < kFragsX; ++i)
#pragma unroll
        for (int j = 0; j < kFragsW; ++j) {
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int e = exponent[j][c % 2];
            total[i][j][c] =
                decltype(single_multiply)::value
                    ? promote<true>(accumulator[i][j][c], {exact_power_of_two(-e), 1.0f}, total[i][j][c])
                    : promote(accumulator[i][j][c], power_of_two(-e), total[i][j][c]);
          }
          then(i, j);
        }
    };
    if (single) promote_all(std::true_type{});
    else promote_all(std::false_type{});
  };
  const auto promote_and_multiply_first = [&](const XFragments& a, const WFragments& b) {
    promote_each([&](int i, int j) {
      mma_m16n8k16<true>(accumulator[i][j], a[i], b[j / 2][2 * (j % 2)], b[j / 2][2 * (j % 2) + 1]);
    });
  };

  // Per 16 of k, three products, small terms first: hi_x lo_w, lo_x hi_w, hi_x hi_w. Each operand's fragments are
  // loaded one product ahead of the product that first reads them, into the registers the product before freed:
  // lo_x and hi_w during hi_x lo_w, the next step's lo_w during lo_x hi_w, its hi_x during hi_x hi_w.
  XFragments a_hi;
  WFragments b_lo;
  load_x(stage_of(0), 0, 0, a_hi);
  load_w(stage_of(0), 3, 0, b_lo);
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const std::uint32_t stage = stage_of(chunk);
#pragma unroll
    for (int step = 0; step < kSplitChunk / 16; ++step) {
      XFragments a_lo;
      WFragments b_hi;
      load_x(stage, 1, step, a_lo);
      load_w(stage, 2, step, b_hi);
      if (step == 0) {
        const int ahead = chunk + kStages - 1;  // its stage was chunk - 1's
        if (ahead < chunks) {
          if (chunk > 0) barrier_wait(empty + 8 * (ahead % kStages), (ahead / kStages - 1) & 1);
          load_stage(stage_of(ahead), ahead);
          copies_arrive(full + 8 * (ahead % kStages));
        }
        promote_and_multiply_first(a_hi, b_lo);
        // This chunk's exponents, read before this warp releases the stage.
        const std::int32_t* stage_exponents = reinterpret_cast<const std::int32_t*>(
            shared + (chunk % kStages) * kStageBytes + 4 * kTileBytes);
        bool fits = true;
#pragma unroll
        for (int j = 0; j < kFragsW; ++j)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            exponent[j][c] = stage_exponents[warp_w * kWarpRowsW + j * 8 + 2 * t + c];
            fits &= exponent[j][c] <= 126;
          }
        single = __all_sync(0xffffffffu, fits);  // warp-uniform: the products inside its branches are .aligned
      } else {
        multiply(a_hi, b_lo);
      }
      std::uint32_t next_stage = stage;
      if (step == kSplitChunk / 16 - 1) {
        barrier_arrive(empty + 8 * (chunk % kStages));  // this thread's reads of the stage are done
        if (chunk + 1 < chunks) barrier_wait(full + 8 * ((chunk + 1) % kStages), ((chunk + 1) / kStages) & 1);
        // Past the last chunk, the loads below read this chunk's stage again: no copy writes it any more, and their
        // values are not used.
        if (chunk + 1 < chunks) next_stage = stage_of(chunk + 1);
      }
      const int next_step = (step + 1) % (kSplitChunk / 16);
      WFragments b_lo_next;
      load_w(next_stage, 3, next_step, b_lo_next);
      multiply(a_lo, b_hi);
      XFragments a_hi_next;
      load_x(next_stage, 0, next_step, a_hi_next);
      multiply(a_hi, b_hi);
#pragma unroll
      for (int i = 0; i < kFragsX; ++i)
#pragma unroll
        for (int r = 0; r < 4; ++r) a_hi[i][r] = a_hi_next[i][r];
#pragma unroll
      for (int p = 0; p < kFragsW / 2; ++p)
#pragma unroll
        for (int r = 0; r < 4; ++r) b_lo[p][r] = b_lo_next[p][r];
    }
  }
  // The last chunk's promotion, as every other chunk's.
  promote_each([](int, int) {});

  // Epilogue: y[x row, w row], pairs of w rows (2 t, 2 t + 1) side by side in y's row.
  float column_bias[kFragsW][2];
#pragma unroll
  for (int j = 0; j < kFragsW; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int column = first_w_row + warp_w * kWarpRowsW + j * 8 + 2 * t + c;
      column_bias[j][c] = bias && column < n ? bias[column] : 0.0f;
    }
  const bool pairs = n % 2 == 0;  // then (row * n + even column) is 8-byte aligned
  // Each activation's loop compiled apart: LeakyReLU's carries none of the GELUs' code.
  with_activation(epilogue.activation, [&](auto activation) {
    constexpr Activation kActivation = decltype(activation)::value;
#pragma unroll
    for (int i = 0; i < kFragsX; ++i) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = first_x_row + warp_x * kWarpRowsX + i * 16 + g + 8 * half;
        if (row >= m) continue;
        const int e = x_exponent[row];
#pragma unroll
        for (int j = 0; j < kFragsW; ++j) {
          const int column = first_w_row + warp_w * kWarpRowsW + j * 8 + 2 * t;
          if (column >= n) continue;
          const Activated first =
              apply_epilogue<kActivation>(unscale(total[i][j][2 * half], e), column_bias[j][0], epilogue);
          const Activated second =
              apply_epilogue<kActivation>(unscale(total[i][j][2 * half + 1], e), column_bias[j][1], epilogue);
          const std::int64_t at = static_cast<std::int64_t>(row) * n + column;
          if (pairs) {
            *reinterpret_cast<float2*>(y + at) = make_float2(first.value, second.value);
            if (positive) {
              positive[at] = first.positive;
              positive[at + 1] = second.positive;
            }
          } else {
            y[at] = first.value;
            if (positive) positive[at] = first.positive;
            if (column + 1 < n) {
              y[at + 1] = second.value;
              if (positive) positive[at + 1] = second.positive;
            }
          }
        }
      }
    }
  });
#endif
}

// The pipeline depth for `device`: 3 stages where its shared memory per block takes them, else 2; 0 where not even
// 2 fit. KERNELS_GEMM_SM80_STAGES (2 or 3) asks for a depth, to measure on a Hopper GPU the depth an A100 runs.
int stages_for(int device) {
  return once_per_device(device, [](int d) -> std::optional<int> {
    int shared = 0;
    if (cudaDeviceGetAttribute(&shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, d) != cudaSuccess) {
      (void)cudaGetLastError();  // a failed query leaves no error for a later launch's check to report
      return std::nullopt;
    }
    const char* value = std::getenv("KERNELS_GEMM_SM80_STAGES");
    const int asked = value == nullptr ? 0 : std::atoi(value);
    const int fits = shared >= shared_bytes(3) ? 3 : shared >= shared_bytes(2) ? 2 : 0;
    return asked == 2 || asked == 3 ? (asked <= fits ? asked : 0) : fits;
  }).value_or(0);
}

// Whether `device` runs the kernel: compute capability 8.0 or later, the library's code of it for this GPU, and
// shared memory for 2 stages at least. Asked once per device, which must be the current one (kernel attributes are
// the current device's); false, and asked again, where a query fails.
bool device_runs_split_gemm_sm80(int device) {
  return once_per_device(device, [](int d) -> std::optional<bool> {
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess || current != d) {
      (void)cudaGetLastError();
      return std::nullopt;
    }
    const std::optional<int> capability = compute_capability(d);
    if (!capability) return std::nullopt;
    // The library's sm_80 or later code of the kernel for this GPU.
    if (*capability < 80 || kernel_code_version(split_gemm_sm80_kernel<2>).value_or(0) < 80) return false;
    const int stages = stages_for(d);
    if (stages == 0) return std::nullopt;  // unread, or not even 2 stages fit: asked again (cheap where it fails)
    return true;
  }).value_or(false);
}

}  // namespace
}  // namespace kernels::gemm::sm80

namespace kernels::gemm {

bool split_gemm_sm80_supported(int device, std::int64_t m, std::int64_t n, std::int64_t k) {
  using namespace sm80;
  if (m <= 0 || n <= 0 || k <= 0 || k % 4 != 0) return false;
  if (m >= (std::int64_t{1} << 31) - kTileRows || n >= (std::int64_t{1} << 31) - kTileRows ||
      k >= (std::int64_t{1} << 31) - kSplitChunk)
    return false;
  const std::int64_t tiles = ((m + kTileRows - 1) / kTileRows) * ((n + kTileRows - 1) / kTileRows);
  if (tiles > 0x7fffffff || split_row_length(k) / kSplitChunk > 65535) return false;  // grid; w's split's grid
  return device_runs_split_gemm_sm80(device);
}

cudaError_t launch_split_gemm_sm80_multiply_leaky_relu(const void* x_hi, const void* x_lo,
                                                       const std::int32_t* x_exponent, const void* w_hi,
                                                       const void* w_lo, const std::int32_t* w_exponent,
                                                       const float* bias, float* y, std::uint8_t* positive,
                                                       std::int64_t m, std::int64_t n, std::int64_t k,
                                                       Epilogue epilogue, cudaStream_t stream) {
  using namespace sm80;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (!split_gemm_sm80_supported(device, m, n, k) || epilogue.pre != nullptr) return cudaErrorNotSupported;
  for (const void* p : {x_hi, x_lo, w_hi, w_lo})
    if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return cudaErrorInvalidValue;
  if (reinterpret_cast<std::uintptr_t>(y) % 8 != 0) return cudaErrorInvalidValue;
  const int stages = stages_for(device);
  const auto kernel = stages == 3 ? split_gemm_sm80_kernel<3> : split_gemm_sm80_kernel<2>;
  // The current device's (cudaGetDevice above), for the depth it runs.
  err = stages == 3 ? raise_shared_memory_limit<split_gemm_sm80_kernel<3>>(device, shared_bytes(3))
                    : raise_shared_memory_limit<split_gemm_sm80_kernel<2>>(device, shared_bytes(2));
  if (err != cudaSuccess) return err;
  const std::int64_t tiles = ((m + kTileRows - 1) / kTileRows) * ((n + kTileRows - 1) / kTileRows);
  return launch_dependent(kernel, dim3(static_cast<unsigned>(tiles)), dim3(sm80::kThreads), shared_bytes(stages),
                          stream, static_cast<const __half*>(x_hi), static_cast<const __half*>(x_lo), x_exponent,
                          static_cast<const __half*>(w_hi), static_cast<const __half*>(w_lo), w_exponent, bias, y,
                          positive, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), epilogue);
}

}  // namespace kernels::gemm
