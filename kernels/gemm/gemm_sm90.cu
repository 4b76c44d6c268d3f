// The fp32-accurate GEMM of gemm_multiply_leaky_relu on Hopper tensor cores (gemm.h,
// launch_split_gemm_multiply_leaky_relu): y = leaky_relu((x w^T + b) * multiplier) from the fp16 splits of x and w
// (gemm_split.cu), three fp16 products per K step, fp32 promotion, the epilogue fused.
//
// Tiles: 128 x 128 of y per CTA, K in blocks of 64 (one 128-byte swizzle row of fp16). Per stage, TMA loads the
// tiles of x_hi, w_hi (and x_lo, w_lo for three products): 4 x 16 KB; 3 stages in 192 KB of shared memory.
// Warp specialisation: warpgroup 0 is the producer (one thread issues the TMA loads, waiting on each stage's
// "empty" mbarrier); warpgroups 1 and 2 are consumers, each owning 64 rows of the tile: they wait on the stage's
// "full" mbarrier, issue wgmma m64n128k16 (A and B from shared memory, both K-major), wait for them, and release
// the stage. The products go small terms first (lo_x hi_w, hi_x lo_w, hi_x hi_w) into the wgmma accumulator, which
// is added into fp32 registers and restarted every promotion_interval of K (64, 128, 256 or 512; promotion: the
// tensor cores' own accumulation over a long K loses precision). The CTAs walk M fastest, so those running together share W tiles.
// Tails of M, N and K: TMA fills out-of-range elements with zeros; the epilogue guards its stores.
//
// Requires sm_90a; built for any other target, the kernel is an empty stub, split_gemm_supported() is false and
// the caller takes its cuBLAS path.
#include "gemm.h"
#include "sm90_primitives.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

namespace kernels::gemm {
namespace {

constexpr int kBlockM = 128;
constexpr int kBlockN = 128;
constexpr int kBlockK = 64;
constexpr int kStages = 3;
constexpr int kConsumers = 2;                          // warpgroups, 64 rows of the tile each
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kTileBytes = kBlockM * kBlockK * 2;      // one fp16 operand tile, 16 KB
static_assert(kBlockM == kBlockN, "the x and w tiles share one TMA box and one size");
static_assert(kBlockK * 2 == 128, "a K block is one 128-byte swizzle row");
static_assert(kBlockM == 64 * kConsumers, "each consumer warpgroup owns 64 rows");

__host__ __device__ constexpr int operands(int products) { return products == 3 ? 4 : 2; }
__host__ __device__ constexpr int shared_bytes(int products) {
  return kStages * operands(products) * kTileBytes + 2 * kStages * 8 + 1024;  // tiles, barriers, alignment
}

// kPromoteBlocks: the accumulator is added into fp32 registers and restarted every kPromoteBlocks K blocks.
template <int kProducts, int kPromoteBlocks>
__global__ void __launch_bounds__(kThreads, 1)
split_gemm_kernel(const __grid_constant__ CUtensorMap x_hi_map, const __grid_constant__ CUtensorMap x_lo_map,
                  const __grid_constant__ CUtensorMap w_hi_map, const __grid_constant__ CUtensorMap w_lo_map,
                  const std::int32_t* __restrict__ x_exponent, const std::int32_t* __restrict__ w_exponent,
                  const float* __restrict__ bias, float* __restrict__ y, std::uint8_t* __restrict__ positive,
                  int m, int n, int k, float multiplier, float negative_slope) {
#if KERNELS_SM90A_DEVICE
  using namespace sm90;
  constexpr int kOperands = operands(kProducts);
  extern __shared__ unsigned char shared_raw[];
  unsigned char* shared = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<std::uintptr_t>(shared_raw) + 1023) & ~std::uintptr_t{1023});
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(shared + kStages * kOperands * kTileBytes);
  std::uint64_t* empty = full + kStages;

  const int m_tiles = (m + kBlockM - 1) / kBlockM;
  const int tile_m = static_cast<int>(blockIdx.x % m_tiles);
  const int tile_n = static_cast<int>(blockIdx.x / m_tiles);
  const int k_blocks = (k + kBlockK - 1) / kBlockK;
  const int warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      barrier_init(&full[s], 1);
      barrier_init(&empty[s], kConsumers * 4);  // one arrival per consumer warp
    }
    barrier_init_fence();
  }
  __syncthreads();

  if (warpgroup == 0) {  // producer
    if (threadIdx.x == 0) {
      for (int block = 0; block < k_blocks; ++block) {
        const int stage = block % kStages, round = block / kStages;
        if (round > 0) barrier_wait(&empty[stage], (round - 1) & 1);
        unsigned char* tiles = shared + stage * kOperands * kTileBytes;
        barrier_arrive_expect_bytes(&full[stage], kOperands * kTileBytes);
        tma_load_2d(tiles, &x_hi_map, &full[stage], block * kBlockK, tile_m * kBlockM);
        tma_load_2d(tiles + kTileBytes, &w_hi_map, &full[stage], block * kBlockK, tile_n * kBlockN);
        if (kProducts == 3) {
          tma_load_2d(tiles + 2 * kTileBytes, &x_lo_map, &full[stage], block * kBlockK, tile_m * kBlockM);
          tma_load_2d(tiles + 3 * kTileBytes, &w_lo_map, &full[stage], block * kBlockK, tile_n * kBlockN);
        }
      }
    }
    return;
  }

  const int consumer = warpgroup - 1;
  float accumulator[64], total[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) accumulator[i] = total[i] = 0.0f;

  for (int block = 0; block < k_blocks; ++block) {
    const int stage = block % kStages, round = block / kStages;
    barrier_wait(&full[stage], round & 1);
    const unsigned char* tiles = shared + stage * kOperands * kTileBytes;
    // This consumer's 64 rows of the x tiles start 64 rows x 128 bytes in.
    const std::uint64_t x_hi = k_major_swizzle128_descriptor(tiles + consumer * 64 * 128);
    const std::uint64_t w_hi = k_major_swizzle128_descriptor(tiles + kTileBytes);
    const bool restart = block % kPromoteBlocks == 0;
    wgmma_fence();
#pragma unroll
    for (int step = 0; step < kBlockK / 16; ++step) {
      const std::uint64_t offset = step * 2;  // 16 fp16 = 32 bytes along the swizzled row, in 16-byte units
      if (kProducts == 3) {
        const std::uint64_t x_lo = k_major_swizzle128_descriptor(tiles + 2 * kTileBytes + consumer * 64 * 128);
        const std::uint64_t w_lo = k_major_swizzle128_descriptor(tiles + 3 * kTileBytes);
        wgmma_m64n128k16_f16(accumulator, x_lo + offset, w_hi + offset, !(restart && step == 0));
        wgmma_m64n128k16_f16(accumulator, x_hi + offset, w_lo + offset, true);
        wgmma_m64n128k16_f16(accumulator, x_hi + offset, w_hi + offset, true);
      } else {
        wgmma_m64n128k16_f16(accumulator, x_hi + offset, w_hi + offset, !(restart && step == 0));
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
    if (threadIdx.x % 32 == 0) barrier_arrive(&empty[stage]);  // this warp's reads of the stage are done
    if (block % kPromoteBlocks == kPromoteBlocks - 1 || block == k_blocks - 1) {
#pragma unroll
      for (int i = 0; i < 64; ++i) total[i] += accumulator[i];
    }
  }

  // Epilogue. wgmma's m64n128 layout: thread (warp w, lane l) holds rows 16 w + l / 4 (+ 8) and, in each group j
  // of 8 columns, columns 8 j + 2 (l % 4) (+ 1).
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const bool pairs = n % 2 == 0;  // two adjacent floats are then 8-byte aligned
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = tile_m * kBlockM + consumer * 64 + warp * 16 + lane / 4 + half * 8;
    if (row >= m) continue;
    const int row_exponent = x_exponent[row];
    float* y_row = y + static_cast<std::int64_t>(row) * n;
    std::uint8_t* positive_row = positive ? positive + static_cast<std::int64_t>(row) * n : nullptr;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int column = tile_n * kBlockN + j * 8 + (lane % 4) * 2;
      float out[2];
      bool is_positive[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = column + c < n ? column + c : n - 1;  // clamped reads; the store below is guarded
        float v = ldexpf(total[j * 4 + half * 2 + c], -(row_exponent + w_exponent[col]));
        if (bias) v += bias[col];
        v *= multiplier;
        is_positive[c] = v > 0.0f;
        out[c] = is_positive[c] ? v : v * negative_slope;
      }
      if (pairs && column + 1 < n) {
        *reinterpret_cast<float2*>(y_row + column) = make_float2(out[0], out[1]);
        if (positive_row) *reinterpret_cast<uchar2*>(positive_row + column) = make_uchar2(is_positive[0], is_positive[1]);
      } else {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          if (column + c >= n) continue;
          y_row[column + c] = out[c];
          if (positive_row) positive_row[column + c] = is_positive[c];
        }
      }
    }
  }
#endif
}

// cuTensorMapEncodeTiled from the driver, found through the runtime (no -lcuda); null where the driver lacks it.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encoder;
}

// The TMA map of a dense (rows x k) fp16 matrix, in boxes of kBlockM rows by kBlockK columns, 128-byte swizzle.
bool make_tile_map(CUtensorMap* map, const void* base, std::int64_t rows, std::int64_t k) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k) * 2};
  const cuuint32_t box[2] = {kBlockK, kBlockM};
  const cuuint32_t element_strides[2] = {1, 1};
  return tensor_map_encoder()(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, const_cast<void*>(base), dims, strides, box,
                              element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int kProducts, int kPromoteBlocks>
cudaError_t launch(const void* x_hi, const void* x_lo, const std::int32_t* x_exponent, const void* w_hi,
                   const void* w_lo, const std::int32_t* w_exponent, const float* bias, float* y,
                   std::uint8_t* positive, std::int64_t m, std::int64_t n, std::int64_t k, float multiplier,
                   float negative_slope, cudaStream_t stream) {
  CUtensorMap maps[4];
  if (!make_tile_map(&maps[0], x_hi, m, k) || !make_tile_map(&maps[1], kProducts == 3 ? x_lo : x_hi, m, k) ||
      !make_tile_map(&maps[2], w_hi, n, k) || !make_tile_map(&maps[3], kProducts == 3 ? w_lo : w_hi, n, k))
    return cudaErrorInvalidValue;
  const auto kernel = split_gemm_kernel<kProducts, kPromoteBlocks>;
  constexpr int bytes = shared_bytes(kProducts);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  const std::int64_t tiles = ((m + kBlockM - 1) / kBlockM) * ((n + kBlockN - 1) / kBlockN);
  kernel<<<static_cast<unsigned>(tiles), kThreads, bytes, stream>>>(
      maps[0], maps[1], maps[2], maps[3], x_exponent, w_exponent, bias, y, positive, static_cast<int>(m),
      static_cast<int>(n), static_cast<int>(k), multiplier, negative_slope);
  return cudaGetLastError();
}

}  // namespace

bool split_gemm_supported(int device, std::int64_t m, std::int64_t n, std::int64_t k) {
  if (m <= 0 || n <= 0 || k <= 0 || k % 8 != 0) return false;  // TMA: 16-byte row strides
  if (m >= (std::int64_t{1} << 31) || n >= (std::int64_t{1} << 31) || k >= (std::int64_t{1} << 31)) return false;
  const std::int64_t tiles = ((m + kBlockM - 1) / kBlockM) * ((n + kBlockN - 1) / kBlockN);
  if (tiles >= (std::int64_t{1} << 31)) return false;
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess || major != 9 ||
      minor != 0)
    return false;
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, split_gemm_kernel<3, 1>) != cudaSuccess || attributes.binaryVersion != 90)
    return false;  // the library holds no sm_90a code of the kernel
  return tensor_map_encoder() != nullptr;
}

cudaError_t launch_split_gemm_multiply_leaky_relu(const void* x_hi, const void* x_lo, const std::int32_t* x_exponent,
                                                  const void* w_hi, const void* w_lo, const std::int32_t* w_exponent,
                                                  const float* bias, float* y, std::uint8_t* positive,
                                                  std::int64_t m, std::int64_t n, std::int64_t k, float multiplier,
                                                  float negative_slope, int products, int promotion_interval,
                                                  cudaStream_t stream) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (!split_gemm_supported(device, m, n, k) || (products != 1 && products != 3)) return cudaErrorNotSupported;
  const auto run = [&](auto kernel_launch) {
    return kernel_launch(x_hi, x_lo, x_exponent, w_hi, w_lo, w_exponent, bias, y, positive, m, n, k, multiplier,
                         negative_slope, stream);
  };
  if (products == 1) return run(launch<1, 4>);
  switch (promotion_interval) {
    case 64: return run(launch<3, 1>);
    case 128: return run(launch<3, 2>);
    case 256: return run(launch<3, 4>);
    case 512: return run(launch<3, 8>);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace kernels::gemm
