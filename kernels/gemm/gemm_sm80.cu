// The fp32-accurate GEMM of gemm_multiply_leaky_relu on sm_80 tensor-core instructions (gemm.h,
// launch_split_gemm_sm80_multiply_leaky_relu), for GPUs from the A100 on whose blocks may take 129 KB of shared
// memory (not sm_86, sm_89, sm_120): the method of the Hopper kernel (split_numerics.cuh) with mma.sync, ldmatrix
// and cp.async in place of wgmma and TMA.
//
// Roles:
// - Operands: both come pre-split as fp16 hi/lo pairs in k's natural order, rows padded to whole chunks of 64:
//   x by launch_split_rows (a power of two per row), w by launch_split_chunks (a power of two per row and chunk).
//   mma.sync takes both operands from registers, loaded by ldmatrix from shared memory, so splitting w inside the
//   GEMM (as the Hopper kernel does) would put its CUDA-core work on the critical path of every warp.
// - Tiles: 128 rows of x by 128 rows of w per CTA, K one chunk (64) per pipeline stage; 8 warps, each 64 x 32 of
//   the output. A stage holds the four 128 x 64 fp16 tiles (x_hi, x_lo, w_hi, w_lo, 64 KB), each row 128 bytes with
//   16-byte unit u at u ^ (row % 8), so that ldmatrix's eight rows fall in distinct banks.
// - Pipeline: cp.async, kStages stages (3 where a block may take 193 KB of shared memory, as on Hopper; else 2,
//   129 KB, as on the A100, whose limit is 163 KB): the loads of chunk c + kStages - 1 run while chunk c's products do.
// - Products: per 16 of k, three m16n8k16 fp16 products into a fresh fp32 accumulator, small terms first (hi_x lo_w,
//   lo_x hi_w, hi_x hi_w); after each chunk the accumulator is promoted into fp32 totals with the chunk's inverse
//   power of two per row of w.
// - Epilogue: each total unscaled by its row of x's power of two, then bias, multiplier and LeakyReLU
//   (split_numerics.cuh), stored as float2 pairs where n is even.
// Tails: rows past m or n load as zeros (cp.async's zero fill) and are not stored; K tails are the splits' zero pad.
// Non-finite values were split as 0; launch_nonfinite_outputs writes the outputs they reach.
#include "gemm.h"
#include "split_numerics.cuh"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdlib>

// The kernel's own names live in gemm::sm80: the family's .cu files are joined into one translation unit.
namespace kernels::gemm::sm80 {
namespace {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define KERNELS_SM80_DEVICE 1
#else
#define KERNELS_SM80_DEVICE 0
#endif

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

constexpr int shared_bytes(int stages) { return stages * kStageBytes; }

__device__ __forceinline__ std::uint32_t shared_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// The byte offset of 16-byte unit `unit` of row `row` in a tile.
__device__ __forceinline__ std::uint32_t swizzled(int row, int unit) {
  return static_cast<std::uint32_t>(row * 128 + ((unit ^ (row % 8)) * 16));
}

__device__ __forceinline__ void copy_16_async(std::uint32_t to, const void* from, bool valid) {
#if KERNELS_SM80_DEVICE
  // src-size 0 writes 16 zero bytes and reads nothing: rows past the matrix.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(to), "l"(from), "r"(valid ? 16 : 0)
               : "memory");
#endif
}

__device__ __forceinline__ void copy_4_async(std::uint32_t to, const void* from, bool valid) {
#if KERNELS_SM80_DEVICE
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(to), "l"(from), "r"(valid ? 4 : 0) : "memory");
#endif
}

__device__ __forceinline__ void copy_commit() {
#if KERNELS_SM80_DEVICE
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int kPending>
__device__ __forceinline__ void copy_wait() {
#if KERNELS_SM80_DEVICE
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
#endif
}

__device__ __forceinline__ void load_matrix_x4(std::uint32_t address, std::uint32_t (&r)[4]) {
#if KERNELS_SM80_DEVICE
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
#endif
}

// d = a b + c, m16n8k16, fp16 operands, fp32 accumulator; kZero: c = 0 (a chunk's first product).
template <bool kZero>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                             std::uint32_t b1) {
#if KERNELS_SM80_DEVICE
  if constexpr (kZero) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

// The operand tiles of chunk `chunk` into a stage: row r of a tile is row first_row + r of its matrix (rows x
// length fp16, length = split_row_length(k)), its 64 values from chunk * 64; then the chunk's exponents of the
// tile's rows of w (w_exponent: chunks x n).
__device__ __forceinline__ void load_stage(std::uint32_t stage, const __half* x_hi, const __half* x_lo,
                                           const __half* w_hi, const __half* w_lo,
                                           const std::int32_t* w_exponent, int m, int n, std::int64_t length,
                                           int first_x_row, int first_w_row, int chunk) {
  const std::int64_t column = static_cast<std::int64_t>(chunk) * kSplitChunk;
  const __half* sources[4] = {x_hi, x_lo, w_hi, w_lo};
#pragma unroll
  for (int tile = 0; tile < 4; ++tile) {
    const int first = tile < 2 ? first_x_row : first_w_row, rows = tile < 2 ? m : n;
#pragma unroll
    for (int i = 0; i < kUnitsPerThread; ++i) {
      const int index = threadIdx.x + i * kThreads, row = index / 8, unit = index % 8;
      const bool valid = first + row < rows;
      const __half* from = sources[tile] + (valid ? (first + row) * length + column + unit * 8 : 0);
      copy_16_async(stage + tile * kTileBytes + swizzled(row, unit), from, valid);
    }
  }
  if (threadIdx.x < kTileRows) {
    const bool valid = first_w_row + static_cast<int>(threadIdx.x) < n;
    const std::int32_t* from =
        w_exponent + (valid ? static_cast<std::int64_t>(chunk) * n + first_w_row + threadIdx.x : 0);
    copy_4_async(stage + 4 * kTileBytes + threadIdx.x * 4, from, valid);
  }
}

template <int kStages>
__global__ void __launch_bounds__(kThreads, 1)
split_gemm_sm80_kernel(const __half* __restrict__ x_hi, const __half* __restrict__ x_lo,
                       const std::int32_t* __restrict__ x_exponent, const __half* __restrict__ w_hi,
                       const __half* __restrict__ w_lo, const std::int32_t* __restrict__ w_exponent,
                       const float* __restrict__ bias, float* __restrict__ y, std::uint8_t* __restrict__ positive,
                       int m, int n, int k, float multiplier, float negative_slope) {
#if KERNELS_SM80_DEVICE
  extern __shared__ __align__(128) unsigned char shared[];
  const std::uint32_t shared_base = shared_address(shared);
  const std::int64_t length = split_row_length(k);
  const int chunks = static_cast<int>(length / kSplitChunk);
  // x's tiles fastest: the CTAs running together share w's tiles (in L2), and x's split stays in L2.
  const int x_tiles = (m + kTileRows - 1) / kTileRows;
  const int first_x_row = (blockIdx.x % x_tiles) * kTileRows, first_w_row = (blockIdx.x / x_tiles) * kTileRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int warp_x = warp % kWarpsX, warp_w = warp / kWarpsX;

  for (int s = 0; s < kStages - 1; ++s) {
    if (s < chunks)
      load_stage(shared_base + s * kStageBytes, x_hi, x_lo, w_hi, w_lo, w_exponent, m, n, length, first_x_row,
                 first_w_row, s);
    copy_commit();  // a group per stage, empty or not, so that the waits below count alike
  }

  float total[kFragsX][kFragsW][4];
#pragma unroll
  for (int i = 0; i < kFragsX; ++i)
#pragma unroll
    for (int j = 0; j < kFragsW; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) total[i][j][c] = 0.0f;

  // ldmatrix addresses within a tile. x (A operand, m16 x k16): lanes 0-15 address rows 0-15 at k 0-7, lanes 16-31
  // the same rows at k 8-15. w (B operand, two n8 fragments x k16): lanes 0-7 rows 0-7 at k 0-7, 8-15 rows 0-7 at
  // k 8-15, 16-23 rows 8-15 at k 0-7, 24-31 rows 8-15 at k 8-15.
  const int x_row_in_frag = lane % 16, x_unit = lane / 16;
  const int w_row_in_pair = lane % 8 + 8 * (lane / 16), w_unit = (lane / 8) % 2;

  for (int chunk = 0; chunk < chunks; ++chunk) {
    copy_wait<kStages - 2>();  // this chunk's stage has landed (for this thread's copies)...
    __syncthreads();           // ...and everyone's; the stage the next load overwrites is no longer read
    const int next = chunk + kStages - 1;
    if (next < chunks)
      load_stage(shared_base + (next % kStages) * kStageBytes, x_hi, x_lo, w_hi, w_lo, w_exponent, m, n, length,
                 first_x_row, first_w_row, next);
    copy_commit();

    const std::uint32_t stage = shared_base + (chunk % kStages) * kStageBytes;
    float accumulator[kFragsX][kFragsW][4];
#pragma unroll
    for (int step = 0; step < kSplitChunk / 16; ++step) {
      std::uint32_t a_hi[kFragsX][4], a_lo[kFragsX][4], b_hi[kFragsW / 2][4], b_lo[kFragsW / 2][4];
#pragma unroll
      for (int i = 0; i < kFragsX; ++i) {
        const std::uint32_t offset = swizzled(warp_x * kWarpRowsX + i * 16 + x_row_in_frag, 2 * step + x_unit);
        load_matrix_x4(stage + offset, a_hi[i]);
        load_matrix_x4(stage + kTileBytes + offset, a_lo[i]);
      }
#pragma unroll
      for (int p = 0; p < kFragsW / 2; ++p) {
        const std::uint32_t offset = swizzled(warp_w * kWarpRowsW + p * 16 + w_row_in_pair, 2 * step + w_unit);
        load_matrix_x4(stage + 2 * kTileBytes + offset, b_hi[p]);
        load_matrix_x4(stage + 3 * kTileBytes + offset, b_lo[p]);
      }
      // Product by product over the 16 fragments, so that the products into one accumulator, which wait for each
      // other, are 16 instructions apart. Fragment j's k 0-7 and k 8-15 registers: b[j / 2][2 (j % 2)], + 1.
#pragma unroll
      for (int i = 0; i < kFragsX; ++i)
#pragma unroll
        for (int j = 0; j < kFragsW; ++j) {
          if (step == 0) mma_m16n8k16<true>(accumulator[i][j], a_hi[i], b_lo[j / 2][2 * (j % 2)],
                                            b_lo[j / 2][2 * (j % 2) + 1]);
          else mma_m16n8k16<false>(accumulator[i][j], a_hi[i], b_lo[j / 2][2 * (j % 2)],
                                   b_lo[j / 2][2 * (j % 2) + 1]);
        }
#pragma unroll
      for (int i = 0; i < kFragsX; ++i)
#pragma unroll
        for (int j = 0; j < kFragsW; ++j)
          mma_m16n8k16<false>(accumulator[i][j], a_lo[i], b_hi[j / 2][2 * (j % 2)], b_hi[j / 2][2 * (j % 2) + 1]);
#pragma unroll
      for (int i = 0; i < kFragsX; ++i)
#pragma unroll
        for (int j = 0; j < kFragsW; ++j)
          mma_m16n8k16<false>(accumulator[i][j], a_hi[i], b_hi[j / 2][2 * (j % 2)], b_hi[j / 2][2 * (j % 2) + 1]);
    }

    // Promotion. Accumulator element c of fragment (i, j): x row g + 8 (c / 2), w row 2 t + c % 2. Where every
    // exponent of the thread's w rows is <= 126 (all but rows below ~2^-113), each 2^-e is a float: one multiply.
    const std::int32_t* stage_exponents =
        reinterpret_cast<const std::int32_t*>(shared + (chunk % kStages) * kStageBytes + 4 * kTileBytes);
    const auto exponent = [&](int j, int c) { return stage_exponents[warp_w * kWarpRowsW + j * 8 + 2 * t + c]; };
    float inverse[kFragsW][2];
    bool single = true;
#pragma unroll
    for (int j = 0; j < kFragsW; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        single &= exponent(j, c) <= 126;
        inverse[j][c] = exact_power_of_two(-min(exponent(j, c), 126));
      }
    if (single) {
#pragma unroll
      for (int i = 0; i < kFragsX; ++i)
#pragma unroll
        for (int j = 0; j < kFragsW; ++j)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            total[i][j][c] = promote<true>(accumulator[i][j][c], {inverse[j][c % 2], 1.0f}, total[i][j][c]);
    } else {
#pragma unroll
      for (int i = 0; i < kFragsX; ++i)
#pragma unroll
        for (int j = 0; j < kFragsW; ++j)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            total[i][j][c] = promote(accumulator[i][j][c], power_of_two(-exponent(j, c % 2)), total[i][j][c]);
    }
  }
  copy_wait<0>();  // no copy (the empty groups' included) outlives the CTA

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
        const Activated first = epilogue(unscale(total[i][j][2 * half], e), column_bias[j][0], multiplier,
                                         negative_slope);
        const Activated second = epilogue(unscale(total[i][j][2 * half + 1], e), column_bias[j][1], multiplier,
                                          negative_slope);
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
#endif
}

// The pipeline depth for `device`: 3 stages where its shared memory per block takes them, else 2; 0 where not even
// 2 fit. KERNELS_GEMM_SM80_STAGES (2 or 3) asks for a depth, to measure on a Hopper GPU the depth an A100 runs.
int stages_for(int device) {
  int shared = 0;
  if (cudaDeviceGetAttribute(&shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) return 0;
  static const int asked = [] {
    const char* value = std::getenv("KERNELS_GEMM_SM80_STAGES");
    return value == nullptr ? 0 : std::atoi(value);
  }();
  const int fits = shared >= shared_bytes(3) ? 3 : shared >= shared_bytes(2) ? 2 : 0;
  return asked == 2 || asked == 3 ? (asked <= fits ? asked : 0) : fits;
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
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess || major < 8)
    return false;
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, split_gemm_sm80_kernel<2>) != cudaSuccess || attributes.binaryVersion < 80)
    return false;  // the library holds no sm_80+ code of the kernel for this GPU
  return stages_for(device) != 0;
}

cudaError_t launch_split_gemm_sm80_multiply_leaky_relu(const void* x_hi, const void* x_lo,
                                                       const std::int32_t* x_exponent, const void* w_hi,
                                                       const void* w_lo, const std::int32_t* w_exponent,
                                                       const float* bias, float* y, std::uint8_t* positive,
                                                       std::int64_t m, std::int64_t n, std::int64_t k,
                                                       float multiplier, float negative_slope, cudaStream_t stream) {
  using namespace sm80;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (!split_gemm_sm80_supported(device, m, n, k)) return cudaErrorNotSupported;
  for (const void* p : {x_hi, x_lo, w_hi, w_lo})
    if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return cudaErrorInvalidValue;
  if (reinterpret_cast<std::uintptr_t>(y) % 8 != 0) return cudaErrorInvalidValue;
  const int stages = stages_for(device);
  const auto kernel = stages == 3 ? split_gemm_sm80_kernel<3> : split_gemm_sm80_kernel<2>;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes(stages));
  if (err != cudaSuccess) return err;
  const std::int64_t tiles = ((m + kTileRows - 1) / kTileRows) * ((n + kTileRows - 1) / kTileRows);
  kernel<<<static_cast<unsigned>(tiles), sm80::kThreads, shared_bytes(stages), stream>>>(
      static_cast<const __half*>(x_hi), static_cast<const __half*>(x_lo), x_exponent,
      static_cast<const __half*>(w_hi), static_cast<const __half*>(w_lo), w_exponent, bias, y, positive,
      static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), multiplier, negative_slope);
  return cudaGetLastError();
}

}  // namespace kernels::gemm
