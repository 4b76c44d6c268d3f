// The fp32-accurate GEMM of gemm_multiply_leaky_relu on Hopper tensor cores (gemm.h,
// launch_split_gemm_multiply_leaky_relu): y = leaky_relu((x w^T + b) * multiplier) from the fp16 split of x
// (gemm_split.cu) and the float32 weight itself, which this kernel splits in registers: three fp16 products per K
// step, fp32 promotion, the epilogue fused. It computes y^T = w x^T, so that w is wgmma's A operand, which may come
// from registers. Where w's split is given (launch_split_gemm_presplit_multiply_leaky_relu: made once by
// launch_split_chunks and kept by its owner while w is unchanged), the kernel reads it instead of splitting w: the
// same products, without the split's CUDA-core work.
//
// Roles:
// - gemm_sm90_layout.cuh: tile shapes, the shared-memory layout of the stages, named barriers, register budgets,
//   and which rows of a tile a consumer thread holds.
// - gemm_sm90_tile_scheduler.cuh: persistent CTAs and the order in which they take tiles.
// - gemm_sm90_mainloop.cuh: warp specialisation: the producer's TMA loads, the consumers' wgmma products and
//   their promotion, chunk by chunk through the stages.
// - gemm_sm90_w_split.cuh: a consumer's split of w in registers per chunk, and the promotion's scaling.
// - gemm_sm90_epilogue.cuh: unscaling, bias, multiplier and LeakyReLU; TMA stores through shared memory, or plain
//   stores; w's non-finite row flags.
// - This file: the kernel, which sets up shared memory and the barriers and runs the roles, and its host side:
//   TMA descriptors, the support check, the launch.
// The method's numerics are split_numerics.cuh's, the PTX wrappers sm90_primitives.cuh's.
//
// Requires sm_90a; built for any other target, the kernel is an empty stub, split_gemm_supported() is false and
// the caller takes its cuBLAS path.
#include "gemm.h"
#include "gemm_sm90_epilogue.cuh"
#include "gemm_sm90_layout.cuh"
#include "gemm_sm90_mainloop.cuh"
#include "gemm_sm90_tile_scheduler.cuh"
#include "gemm_sm90_w_split.cuh"
#include "sm90_primitives.cuh"
#include "split_numerics.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdlib>

namespace kernels::gemm {
namespace {

// Warpgroup 0 loads every chunk of the CTA's tiles into the stages (load_tiles); warpgroups 1 and 2 each multiply
// their 64 rows of w of a tile (multiply_tile, or multiply_tile_presplit where w's split is given: then w_map is
// w_hi's, and w_lo_map and w_exponent_map are read) and store those outputs (store_tile), tile after tile.
template <bool kTransposed, bool kPresplit>
__global__ void __launch_bounds__(kThreads, 1)
split_gemm_kernel(const __grid_constant__ CUtensorMap w_map, const __grid_constant__ CUtensorMap w_lo_map,
                  const __grid_constant__ CUtensorMap w_exponent_map, const __grid_constant__ CUtensorMap x_hi_map,
                  const __grid_constant__ CUtensorMap x_lo_map, const __grid_constant__ CUtensorMap y_map,
                  bool y_by_tma, const std::int32_t* __restrict__ x_exponent, std::int32_t* __restrict__ w_flags,
                  const float* __restrict__ bias, float* __restrict__ y, std::uint8_t* __restrict__ positive, int m,
                  int n, int k, float multiplier, float negative_slope) {
#if KERNELS_SM90A_DEVICE
  using namespace sm90;
  extern __shared__ unsigned char shared_raw[];
  unsigned char* shared = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<std::uintptr_t>(shared_raw) + 1023) & ~std::uintptr_t{1023});
  std::int32_t* exponents =
      reinterpret_cast<std::int32_t*>(shared + kStages * kStageBytes + kConsumers * kStagingBytes);
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(exponents + kStages * kBlockW);
  std::uint64_t* empty = full + kStages;

  const TileScheduler scheduler(m, n);
  const int chunks = static_cast<int>(split_row_length(k) / kBlockK);
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
    registers_decrease<kProducerRegisters>();
    if (threadIdx.x == 0)
      load_tiles<kTransposed, kPresplit>(WMaps{&w_map, &w_lo_map, &w_exponent_map}, x_hi_map, x_lo_map, shared,
                                         exponents, full, empty, scheduler, chunks);
    return;
  }

  registers_increase<kConsumerRegisters>();
  const ConsumerThread thread(warpgroup, /*paired_rows=*/kTransposed);
  const std::uint32_t shared_base = smem_address(shared);
  const EpilogueArguments epilogue_arguments{&y_map, y_by_tma, x_exponent, w_flags, bias, y,
                                             positive, m, n, multiplier, negative_slope};
  float accumulator[64], total[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) accumulator[i] = 0.0f;
  int iteration = 0;  // the CTA's chunks so far, across tiles: their stage and its phase
  for (int tile = scheduler.first(); tile < scheduler.tiles; tile = scheduler.next(tile)) {
    const int tile_x = scheduler.x_tile(tile), tile_w = scheduler.w_tile(tile);
    const bool last_tile = scheduler.is_last(tile);
    bool non_finite[2] = {false, false};  // where w's split is given, its pass flagged w's rows
    if constexpr (kPresplit)
      multiply_tile_presplit(thread, shared_base, exponents, full, empty, chunks, last_tile, iteration, accumulator,
                             total);
    else
      multiply_tile<kTransposed>(thread, shared_base, full, empty, chunks, last_tile, iteration, accumulator, total,
                                 non_finite);
    // store_tile's scratch for a part's x exponents, declared in the kernel: where the array is declared sets the
    // order in which the compiler promotes the kernel's arrays to registers, and with it ptxas's schedule.
    int row_exponents[kOutBoxRows / 8];
    store_tile(epilogue_arguments, thread, shared_base, tile_x, tile_w, total, non_finite, row_exponents);
  }
  finish_stores(epilogue_arguments);
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

// The TMA map of a (rows x columns) matrix whose rows are row_bytes apart, in boxes of box_rows rows by one
// 128-byte swizzle row.
bool make_tile_map(CUtensorMap* map, CUtensorMapDataType type, int element_bytes, const void* base,
                   std::int64_t rows, std::int64_t columns, std::int64_t row_bytes, int box_rows) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(columns), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(128 / element_bytes), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  return tensor_map_encoder()(map, type, 2, const_cast<void*>(base), dims, strides, box, element_strides,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The TMA map of w's chunk exponents (chunks x n int32, launch_split_chunks's layout), in boxes of one chunk's
// exponents of a tile's kBlockW rows of w (unswizzled; rows of w past n arrive as 0).
bool make_exponent_map(CUtensorMap* map, const std::int32_t* exponent, std::int64_t chunks, std::int64_t n) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(n), static_cast<cuuint64_t>(chunks)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(n * 4)};
  const cuuint32_t box[2] = {kBlockW, 1};
  const cuuint32_t element_strides[2] = {1, 1};
  return tensor_map_encoder()(map, CU_TENSOR_MAP_DATA_TYPE_INT32, 2, const_cast<std::int32_t*>(exponent), dims,
                              strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                              CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// What both launchers share: x's maps, y's, the kernel's choice and its launch. maps[0..2]: the w operand's (w, or
// w_hi, w_lo and the exponents), made by the caller.
cudaError_t launch_kernel(CUtensorMap (&maps)[6], bool w_transposed, bool presplit, const void* x_hi,
                          const void* x_lo, const std::int32_t* x_exponent, std::int32_t* w_flags, const float* bias,
                          float* y, std::uint8_t* positive, std::int64_t m, std::int64_t n, std::int64_t k,
                          float multiplier, float negative_slope, int device, cudaStream_t stream) {
  if (reinterpret_cast<std::uintptr_t>(x_hi) % 16 != 0 || reinterpret_cast<std::uintptr_t>(x_lo) % 16 != 0)
    return cudaErrorInvalidValue;
  const std::int64_t x_row = split_row_length(k);
  if (!make_tile_map(&maps[3], CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, x_hi, m, x_row, x_row * 2, kBlockX) ||
      !make_tile_map(&maps[4], CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, x_lo, m, x_row, x_row * 2, kBlockX))
    return cudaErrorInvalidValue;
  // y through TMA stores where its rows are 16-byte aligned (TMA's rule for strides and addresses); plain stores
  // else, or where KERNELS_GEMM_PLAIN_STORES is set (not "" or "0"): compute-sanitizer's initcheck does not see TMA
  // stores' writes (every later read of y is reported as uninitialized), so `tools/device_check.py sanitize` runs it
  // on the plain stores.
  static const bool plain_stores = [] {
    const char* value = std::getenv("KERNELS_GEMM_PLAIN_STORES");
    return value != nullptr && value[0] != '\0' && value[0] != '0';
  }();
  const bool y_by_tma = !plain_stores && n % 4 == 0 && reinterpret_cast<std::uintptr_t>(y) % 16 == 0 &&
                        make_tile_map(&maps[5], CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, y, m, n, n * 4, kOutBoxRows);
  const auto kernel = presplit       ? split_gemm_kernel<false, true>
                      : w_transposed ? split_gemm_kernel<true, false>
                                     : split_gemm_kernel<false, false>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes);
  if (err != cudaSuccess) return err;
  const std::int64_t tiles = tile_count(m, n);
  int processors = 0;
  err = cudaDeviceGetAttribute(&processors, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const std::int64_t ctas = tiles < processors ? tiles : processors;  // persistent: one CTA per multiprocessor
  kernel<<<static_cast<unsigned>(ctas), kThreads, kSharedBytes, stream>>>(
      maps[0], maps[1], maps[2], maps[3], maps[4], maps[5], y_by_tma, x_exponent, w_flags, bias, y, positive,
      static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), multiplier, negative_slope);
  return cudaGetLastError();
}

// Whether ptxas gave `kernel` registers enough for the roles' budgets (gemm_sm90_layout.cuh,
// register_pool_holds_budgets): it gives 168, which fill the pool exactly; a compiler that gave fewer would hang the
// kernel in setmaxnreg, so it is refused instead. Asked once: every sm_90 device runs the same sm_90a code.
template <typename Kernel>
bool kernel_registers_hold_budgets(Kernel* kernel) {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess &&
         register_pool_holds_budgets(attributes.numRegs);
}

}  // namespace

bool split_gemm_supported(int device, std::int64_t m, std::int64_t n, std::int64_t k, bool w_transposed) {
  if (m <= 0 || n <= 0 || k <= 0 || (w_transposed ? n : k) % 4 != 0) return false;  // TMA: 16-byte rows of w
  if (m >= (std::int64_t{1} << 31) || n >= (std::int64_t{1} << 31) || k >= (std::int64_t{1} << 31) - kSplitChunk)
    return false;
  const std::int64_t tiles = tile_count(m, n);
  if (tiles >= (std::int64_t{1} << 31) - 4096) return false;  // tile indices plus a grid stay ints
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess || major != 9 ||
      minor != 0)
    return false;
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, split_gemm_kernel<false, false>) != cudaSuccess ||
      attributes.binaryVersion != 90)
    return false;  // the library holds no sm_90a code of the kernel
  static const bool pools_hold_budgets = kernel_registers_hold_budgets(split_gemm_kernel<false, false>) &&
                                         kernel_registers_hold_budgets(split_gemm_kernel<true, false>) &&
                                         kernel_registers_hold_budgets(split_gemm_kernel<false, true>);
  return pools_hold_budgets && tensor_map_encoder() != nullptr;
}

cudaError_t launch_split_gemm_multiply_leaky_relu(const void* x_hi, const void* x_lo, const std::int32_t* x_exponent,
                                                  const float* w, std::int64_t w_stride, bool w_transposed,
                                                  std::int32_t* w_flags, const float* bias, float* y,
                                                  std::uint8_t* positive, std::int64_t m, std::int64_t n,
                                                  std::int64_t k, float multiplier, float negative_slope,
                                                  cudaStream_t stream) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (!split_gemm_supported(device, m, n, k, w_transposed)) return cudaErrorNotSupported;
  if (w_stride % 4 != 0 || w_stride < (w_transposed ? n : k) || reinterpret_cast<std::uintptr_t>(w) % 16 != 0)
    return cudaErrorInvalidValue;
  CUtensorMap maps[6] = {};
  const bool w_map = w_transposed
                         ? make_tile_map(&maps[0], CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, w, k, n, w_stride * 4, kBlockK)
                         : make_tile_map(&maps[0], CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, w, n, k, w_stride * 4, kBlockW);
  if (!w_map) return cudaErrorInvalidValue;
  return launch_kernel(maps, w_transposed, /*presplit=*/false, x_hi, x_lo, x_exponent, w_flags, bias, y, positive, m,
                       n, k, multiplier, negative_slope, device, stream);
}

bool split_gemm_presplit_supported(int device, std::int64_t m, std::int64_t n, std::int64_t k) {
  // n % 4: 16-byte rows of w's exponents for TMA; w's split has rows of whole chunks, whatever k is.
  return n % 4 == 0 && split_gemm_supported(device, m, n, split_row_length(k));
}

cudaError_t launch_split_gemm_presplit_multiply_leaky_relu(const void* x_hi, const void* x_lo,
                                                           const std::int32_t* x_exponent, const void* w_hi,
                                                           const void* w_lo, const std::int32_t* w_exponent,
                                                           const float* bias, float* y, std::uint8_t* positive,
                                                           std::int64_t m, std::int64_t n, std::int64_t k,
                                                           float multiplier, float negative_slope,
                                                           cudaStream_t stream) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (!split_gemm_presplit_supported(device, m, n, k)) return cudaErrorNotSupported;
  if (reinterpret_cast<std::uintptr_t>(w_hi) % 16 != 0 || reinterpret_cast<std::uintptr_t>(w_lo) % 16 != 0 ||
      reinterpret_cast<std::uintptr_t>(w_exponent) % 16 != 0)
    return cudaErrorInvalidValue;
  const std::int64_t row = split_row_length(k);
  CUtensorMap maps[6] = {};
  if (!make_tile_map(&maps[0], CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, w_hi, n, row, row * 2, kBlockW) ||
      !make_tile_map(&maps[1], CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, w_lo, n, row, row * 2, kBlockW) ||
      !make_exponent_map(&maps[2], w_exponent, row / kSplitChunk, n))
    return cudaErrorInvalidValue;
  return launch_kernel(maps, /*w_transposed=*/false, /*presplit=*/true, x_hi, x_lo, x_exponent, /*w_flags=*/nullptr,
                       bias, y, positive, m, n, k, multiplier, negative_slope, device, stream);
}

}  // namespace kernels::gemm
