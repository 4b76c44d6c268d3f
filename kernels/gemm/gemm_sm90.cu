// The fp32-accurate GEMM of gemm_multiply_leaky_relu on Hopper tensor cores (gemm.h,
// launch_split_gemm_multiply_leaky_relu): y = activation((x w^T + b) * multiplier) from x's fp16 split (gemm_split.cu)
// and the float32 w, split in registers (or read pre-split: launch_split_gemm_presplit_multiply_leaky_relu, bitwise the
// same); three fp16 products per K step, fp32 promotion, fused epilogue. Computes y^T = w x^T so w, wgmma's A, may come
// from registers. Roles: gemm_sm90_layout.cuh (tiles, shared memory, barriers, registers), gemm_sm90_tile_scheduler.cuh
// (persistent CTAs' order of work), gemm_sm90_mainloop.cuh (TMA producer, wgmma consumers), gemm_sm90_w_split.cuh,
// gemm_sm90_epilogue.cuh, gemm_split_k_sum.cuh (split-K's sum); this file: the kernel and its host side (TMA
// descriptors, support check, split-K's slices, launch). Numerics: split_numerics.cuh; PTX: sm90_primitives.cuh.
// Requires sm_90a; for any other target the kernel is a stub, split_gemm_supported() is false and cuBLAS runs.
#include "common/dependent_launch.cuh"
#include "common/device_queries.h"
#include "common/once_per_device.h"
#include "gemm.h"
#include "gemm_sm90_epilogue.cuh"
#include "gemm_sm90_layout.cuh"
#include "gemm_sm90_mainloop.cuh"
#include "gemm_sm90_tile_scheduler.cuh"
#include "gemm_sm90_w_split.cuh"
#include "gemm_split_k_sum.cuh"
#include "sm90_primitives.cuh"
#include "split_numerics.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <optional>

namespace kernels::gemm {
namespace {

// Warpgroup 0 loads every chunk of the CTA's units into the stages (load_tiles); warpgroups 1 and 2 each multiply
// their 64 rows of w of a unit's tile (multiply_tile, or multiply_tile_presplit where w's split is given: then w_map
// is w_hi's, and w_lo_map and w_exponent_map are read) and store those outputs (store_tile), unit after unit. A unit
// is a tile over all of K (slices = 1), or over one of `slices` slices of slice_chunks chunks, or, with stream, a
// whole tile or a part of a last-round tile (gemm_sm90_tile_scheduler.cuh, StreamK); where K is split its plain
// outputs go to the partials' workspace at slice * slice_rows rows instead of y (launch_split_gemm_split_k).
template <bool kTransposed, bool kPresplit>
__global__ void __launch_bounds__(kThreads, 1)
split_gemm_kernel(const __grid_constant__ CUtensorMap w_map, const __grid_constant__ CUtensorMap w_lo_map,
                  const __grid_constant__ CUtensorMap w_exponent_map, const __grid_constant__ CUtensorMap x_hi_map,
                  const __grid_constant__ CUtensorMap x_lo_map, const __grid_constant__ CUtensorMap y_map,
                  const __grid_constant__ CUtensorMap pre_map, bool y_by_tma, bool y_transposed,
                  const std::int32_t* __restrict__ x_exponent, std::int32_t* __restrict__ w_flags,
                  const float* __restrict__ bias, float* __restrict__ y, std::uint8_t* __restrict__ positive, int m,
                  int n, int k, Epilogue epilogue, int slices, int slice_chunks, int slice_rows, bool stream) {
#if KERNELS_SM90A_DEVICE
  using namespace sm90;
  extern __shared__ unsigned char shared_raw[];
  unsigned char* shared = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<std::uintptr_t>(shared_raw) + 1023) & ~std::uintptr_t{1023});
  std::int32_t* exponents =
      reinterpret_cast<std::int32_t*>(shared + kStages * kStageBytes + kConsumers * kStagingBytes);
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(exponents + kStages * kBlockW);
  std::uint64_t* empty = full + kStages;

  const int chunks = static_cast<int>(split_row_length(k) / kBlockK);
  const TileScheduler scheduler(m, n, chunks, slices, slice_chunks, stream);
  const int warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      barrier_init(&full[s], 1);
      barrier_init(&empty[s], kConsumers * 4);  // one arrival per consumer warp
    }
    barrier_init_fence();
  }
  __syncthreads();
  // Launched by launch_dependent: the set-up above (shared memory only) may overlap the previous kernel's end.
  wait_for_previous_grid();
  allow_next_grid();

  if (warpgroup == 0) {  // producer
    registers_decrease<kProducerRegisters>();
    if (threadIdx.x == 0)
      load_tiles<kTransposed, kPresplit>(WMaps{&w_map, &w_lo_map, &w_exponent_map}, x_hi_map, x_lo_map, shared,
                                         exponents, full, empty, scheduler);
    return;
  }

  registers_increase<kConsumerRegisters>();
  const ConsumerThread thread(warpgroup, /*paired_rows=*/kTransposed);
  const std::uint32_t shared_base = smem_address(shared);
  const EpilogueArguments epilogue_arguments{&y_map, y_by_tma, y_transposed,
                                             epilogue.pre != nullptr ? &pre_map : nullptr,
                                             x_exponent, w_flags, /*w_flags_set_only=*/slices > 1 || stream, bias, y,
                                             positive, m, n, slice_rows, epilogue};
  float accumulator[64], total[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) accumulator[i] = 0.0f;
  int iteration = 0;  // the CTA's chunks so far, across units: their stage and its phase
  for (int unit = scheduler.first(); unit < scheduler.units; unit = scheduler.next(unit)) {
    const int tile = scheduler.tile(unit), slice = scheduler.slice(unit), chunks = scheduler.unit_chunks(unit);
    const int tile_x = scheduler.x_tile(tile), tile_w = scheduler.w_tile(tile);
    const bool last_tile = scheduler.is_last(unit);
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
    // A tall, narrow forward computed transposed writes y itself from the kernel that splits w in its registers
    // (launch_kernel gives y_transposed to it alone).
    if constexpr (!kTransposed && !kPresplit) {
      if (y_transposed) {
        store_tile_y_transposed(epilogue_arguments, thread, shared_base, tile_x, tile_w, total, non_finite,
                                row_exponents);
        continue;
      }
    }
    // The GELUs' epilogue loops are left out of the kernel that reads the float32 w untransposed and splits it in its
    // registers (<false, false>: ptxas would spill there), launch_kernel giving it no GELU; the pre-activation's
    // stores out of both kernels that read the float32 w (ptxas would spill in <true, false>).
    store_tile<kTransposed || kPresplit, kPresplit>(epilogue_arguments, thread, shared_base, tile_x, tile_w, slice,
                                                    total, non_finite, row_exponents);
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

// The TMA map of w's chunk exponents (chunks x n int32, rows split_exponent_stride(n) apart: launch_split_chunks's
// layout), in boxes of one chunk's exponents of a tile's kBlockW rows of w (unswizzled; rows of w past n arrive as 0).
bool make_exponent_map(CUtensorMap* map, const std::int32_t* exponent, std::int64_t chunks, std::int64_t n) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(n), static_cast<cuuint64_t>(chunks)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(split_exponent_stride(n) * 4)};
  const cuuint32_t box[2] = {kBlockW, 1};
  const cuuint32_t element_strides[2] = {1, 1};
  return tensor_map_encoder()(map, CU_TENSOR_MAP_DATA_TYPE_INT32, 2, const_cast<std::int32_t*>(exponent), dims,
                              strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                              CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Where K is split (launch_split_gemm_split_k): equal slices, each of slice_chunks chunks (the last may hold fewer),
// or stream-K (then `slices` is the most parts a tile is cut into); the partials' workspace (slices x
// slice_rows rows of n floats) and its rows per slice.
struct KSlices {
  int slices = 1;
  int slice_chunks = 0;  // all of K's chunks where slices is 1
  bool stream = false;
  std::int64_t slice_rows = 0;
  float* workspace = nullptr;
  bool split() const { return slices > 1 || stream; }
};

// m rounded up to whole tiles of x: a slice's rows in the workspace, so that a tile's TMA stores past m stay in its
// own slice.
std::int64_t split_k_slice_rows(std::int64_t m) { return (m + kBlockX - 1) / kBlockX * kBlockX; }

// Stream-K's work on `processors` CTAs (StreamK), and the most parts any of its tiles has: the workspace's slices.
int stream_k_most_parts(const StreamK& streamk) {
  int most = 1;
  for (int tile = streamk.dp_tiles; tile < streamk.tiles; ++tile) most = std::max(most, streamk.parts(tile));
  return most;
}

// K's chunks taken as at most `slices` slices of whole chunks, every slice holding at least one; or, with kStreamK,
// stream-K's work where it fits (else K whole).
KSlices split_k_slices(std::int64_t m, std::int64_t n, std::int64_t k, int slices, int processors,
                       float* workspace) {
  const std::int64_t chunks = split_row_length(k) / kSplitChunk, tiles = tile_count(m, n);
  KSlices split;
  split.slice_rows = split_k_slice_rows(m);
  if (slices == kStreamK) {
    split.slice_chunks = static_cast<int>(chunks);
    // (StreamK divides by the CTAs: no multiprocessor count read, no stream-K.)
    if (processors > 0 && tiles < (std::int64_t{1} << 31)) {
      const StreamK streamk(static_cast<int>(tiles), static_cast<int>(chunks), processors);
      split.stream = streamk.fits();
      if (split.stream) split.slices = stream_k_most_parts(streamk);
    }
  } else {
    split.slice_chunks = static_cast<int>((chunks + slices - 1) / slices);
    split.slices = static_cast<int>((chunks + split.slice_chunks - 1) / split.slice_chunks);
  }
  split.workspace = split.split() ? workspace : nullptr;
  return split;
}

// The device's multiprocessors (0 where it cannot be read), asked once per device.
int multiprocessor_count(int device) {
  return once_per_device(device, [](int d) -> std::optional<int> {
    int processors = 0;
    if (cudaDeviceGetAttribute(&processors, cudaDevAttrMultiProcessorCount, d) == cudaSuccess) return processors;
    (void)cudaGetLastError();  // a failed query leaves no error for a later launch's check to report
    return std::nullopt;
  }).value_or(0);
}

// Whether KERNELS_GEMM_PLAIN_STORES is set (not "" or "0"): y by plain stores even where TMA could store it.
// compute-sanitizer's initcheck does not see TMA stores' writes (every later read of y is reported as uninitialized),
// so `tools/device_check.py sanitize` runs it on the plain stores.
bool plain_stores_forced() {
  static const bool forced = [] {
    const char* value = std::getenv("KERNELS_GEMM_PLAIN_STORES");
    return value != nullptr && value[0] != '\0' && value[0] != '0';
  }();
  return forced;
}

// Whether TMA stores an (n columns) output at `out`: rows 16-byte aligned (TMA's rule for strides and addresses).
bool stores_by_tma(std::int64_t n, const float* out) {
  return !plain_stores_forced() && n % 4 == 0 && reinterpret_cast<std::uintptr_t>(out) % 16 == 0;
}

// What the launchers share: x's maps, y's (or the workspace's, where K is split) and the pre-activation's, the
// kernel's choice and its launch, and, where K is split, the sum of the slices into y. maps[0..2]: the w operand's
// (w, or w_hi, w_lo and the exponents), made by the caller.
cudaError_t launch_kernel(CUtensorMap (&maps)[7], bool w_transposed, bool presplit, const void* x_hi,
                          const void* x_lo, const std::int32_t* x_exponent, std::int32_t* w_flags, const float* bias,
                          float* y, std::uint8_t* positive, std::int64_t m, std::int64_t n, std::int64_t k,
                          Epilogue epilogue, int device, cudaStream_t stream,
                          const KSlices& k_slices = KSlices{}, bool y_transposed = false) {
  if (reinterpret_cast<std::uintptr_t>(x_hi) % 16 != 0 || reinterpret_cast<std::uintptr_t>(x_lo) % 16 != 0)
    return cudaErrorInvalidValue;
  const std::int64_t x_row = split_row_length(k);
  if (!make_tile_map(&maps[3], CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, x_hi, m, x_row, x_row * 2, kBlockX) ||
      !make_tile_map(&maps[4], CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, x_lo, m, x_row, x_row * 2, kBlockX))
    return cudaErrorInvalidValue;
  const bool split = k_slices.split();
  // A GELU takes the kernels that read w's split or w transposed, or K split (the sum applies it).
  if (epilogue.activation != Activation::kLeakyReLU && !w_transposed && !presplit && !split)
    return cudaErrorNotSupported;
  // The kernel's outputs: y, or the slices' partials, slice after slice.
  float* const out = split ? k_slices.workspace : y;
  const std::int64_t out_rows = split ? k_slices.slices * k_slices.slice_rows : m;
  // y written transposed (n x m): by the kernel that reads w untransposed and splits it, K whole, LeakyReLU's
  // epilogue, TMA stores only.
  if (y_transposed && (w_transposed || presplit || split || epilogue.pre != nullptr ||
                       epilogue.activation != Activation::kLeakyReLU || !stores_by_tma(m, y) ||
                       !make_tile_map(&maps[5], CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, y, n, m, m * 4, kOutBoxRows)))
    return cudaErrorNotSupported;
  // y through TMA stores where it can (stores_by_tma), else plain stores.
  const bool y_by_tma =
      y_transposed ||
      (stores_by_tma(n, out) &&
       make_tile_map(&maps[5], CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, out, out_rows, n, n * 4, kOutBoxRows));
  // The pre-activation beside a GELU's output: by the kernel that reads w's split, with K whole, by TMA stores only.
  if (epilogue.pre != nullptr &&
      (!presplit || split || !y_by_tma || epilogue.activation == Activation::kLeakyReLU ||
       !stores_by_tma(n, epilogue.pre) ||
       !make_tile_map(&maps[6], CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, epilogue.pre, m, n, n * 4, kOutBoxRows)))
    return cudaErrorNotSupported;
  const auto kernel = presplit       ? split_gemm_kernel<false, true>
                      : w_transposed ? split_gemm_kernel<true, false>
                                     : split_gemm_kernel<false, false>;
  // The launch runs on `device`, the current one (the launchers read it with cudaGetDevice).
  cudaError_t err = raise_shared_memory_limit<split_gemm_kernel<false, true>, split_gemm_kernel<true, false>,
                                              split_gemm_kernel<false, false>>(device, kSharedBytes);
  if (err != cudaSuccess) return err;
  const std::int64_t tiles = tile_count(m, n), units = tiles * k_slices.slices;
  const int processors = multiprocessor_count(device);
  if (processors <= 0) return cudaErrorInvalidDevice;
  // Each slice flags the rows of w it sees: the flags start at 0 and are only set.
  if (split && w_flags != nullptr) {
    err = cudaMemsetAsync(w_flags, 0, n * sizeof(std::int32_t), stream);
    if (err != cudaSuccess) return err;
  }
  // Persistent: one CTA per multiprocessor (stream-K's shares were cut for exactly that many).
  const std::int64_t ctas = k_slices.stream || units >= processors ? processors : units;
  const int slice_chunks = split ? k_slices.slice_chunks : static_cast<int>(x_row / kSplitChunk);
  // Where K is split the slices store plain partials, and the sum applies the epilogue.
  err = launch_dependent(kernel, dim3(static_cast<unsigned>(ctas)), dim3(kThreads), kSharedBytes, stream, maps[0],
                         maps[1], maps[2], maps[3], maps[4], maps[5], maps[6], y_by_tma, y_transposed, x_exponent,
                         w_flags, split ? nullptr : bias, out, split ? nullptr : positive, static_cast<int>(m),
                         static_cast<int>(n), static_cast<int>(k), split ? Epilogue{} : epilogue,
                         k_slices.slices, slice_chunks, static_cast<int>(k_slices.slice_rows), k_slices.stream);
  if (err != cudaSuccess || !split) return err;
  const std::int64_t count = m * n, slice_stride = k_slices.slice_rows * n;
  const bool plain = bias == nullptr && is_identity_epilogue(epilogue) && positive == nullptr;
  // (Stream-K's sum reads a vector's tile from its first output: n % 4 == 0 keeps the four in one row.)
  const bool vectors = count % 4 == 0 && reinterpret_cast<std::uintptr_t>(y) % 16 == 0 &&
                       reinterpret_cast<std::uintptr_t>(out) % 16 == 0 &&  // slice_stride: whole tiles of rows
                       (!k_slices.stream || n % 4 == 0) &&
                       (plain || (n % 4 == 0 && reinterpret_cast<std::uintptr_t>(positive) % 4 == 0 &&
                                  epilogue.activation == Activation::kLeakyReLU));
  const std::int64_t needed = ((vectors ? count / 4 : count) + kSplitKSumThreads - 1) / kSplitKSumThreads;
  const std::int64_t most = static_cast<std::int64_t>(processors) * kSplitKSumBlocksPerProcessor;
  const unsigned blocks = static_cast<unsigned>(needed < most ? needed : most);
  const auto sum = plain ? (vectors ? split_k_sum_kernel<true, false> : split_k_sum_kernel<false, false>)
                         : (vectors ? split_k_sum_kernel<true, true> : split_k_sum_kernel<false, true>);
  const SplitKParts parts{k_slices.slices, k_slices.stream, n,
                          StreamK(static_cast<int>(tiles), static_cast<int>(x_row / kSplitChunk), processors),
                          static_cast<int>((m + kBlockX - 1) / kBlockX), static_cast<int>((n + kBlockW - 1) / kBlockW)};
  return launch_dependent(sum, dim3(blocks), dim3(kSplitKSumThreads), 0, stream, out, slice_stride, parts, y, count,
                          SplitKEpilogue{bias, epilogue, positive, n});
}

// Whether ptxas gave `kernel` registers enough for the roles' budgets (gemm_sm90_layout.cuh,
// register_pool_holds_budgets): it gives 168, which fill the pool exactly; a compiler that gave fewer would hang the
// kernel in setmaxnreg, so it is refused instead.
template <typename Kernel>
bool kernel_registers_hold_budgets(Kernel* kernel) {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess &&
         register_pool_holds_budgets(attributes.numRegs);
}

// Whether `device` runs the kernel: compute capability 9.0, the library's sm_90a code of it, registers for the
// roles' budgets and the driver's TMA encoder. Asked once per device, which must be the current one (kernel
// attributes are the current device's); false, and asked again, where a query fails.
bool device_runs_split_gemm(int device) {
  return once_per_device(device, [](int d) -> std::optional<bool> {
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess || current != d) {
      (void)cudaGetLastError();
      return std::nullopt;
    }
    const std::optional<int> capability = compute_capability(d);
    if (!capability) return std::nullopt;
    if (*capability != 90 || kernel_code_version(split_gemm_kernel<false, false>) != 90) return false;
    return kernel_registers_hold_budgets(split_gemm_kernel<false, false>) &&
           kernel_registers_hold_budgets(split_gemm_kernel<true, false>) &&
           kernel_registers_hold_budgets(split_gemm_kernel<false, true>) && tensor_map_encoder() != nullptr;
  }).value_or(false);
}

}  // namespace

bool split_gemm_writes_pre(std::int64_t n) { return !plain_stores_forced() && n % 4 == 0; }

bool split_gemm_writes_y_transposed(std::int64_t m) { return !plain_stores_forced() && m % 4 == 0; }

bool split_gemm_supported(int device, std::int64_t m, std::int64_t n, std::int64_t k, bool w_transposed) {
  if (m <= 0 || n <= 0 || k <= 0 || (w_transposed ? n : k) % 4 != 0) return false;  // TMA: 16-byte rows of w
  if (m >= (std::int64_t{1} << 31) || n >= (std::int64_t{1} << 31) || k >= (std::int64_t{1} << 31) - kSplitChunk)
    return false;
  const std::int64_t tiles = tile_count(m, n);
  if (tiles >= (std::int64_t{1} << 31) - 4096) return false;  // tile indices plus a grid stay ints
  return device_runs_split_gemm(device);
}

namespace {

// launch_split_gemm_multiply_leaky_relu, K split where k_slices says so.
cudaError_t launch_with_w(const void* x_hi, const void* x_lo, const std::int32_t* x_exponent, const float* w,
                          std::int64_t w_stride, bool w_transposed, std::int32_t* w_flags, const float* bias, float* y,
                          std::uint8_t* positive, std::int64_t m, std::int64_t n, std::int64_t k, Epilogue epilogue,
                          cudaStream_t stream, const KSlices& k_slices, bool y_transposed = false) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (!split_gemm_supported(device, m, n, k, w_transposed)) return cudaErrorNotSupported;
  if (w_stride % 4 != 0 || w_stride < (w_transposed ? n : k) || reinterpret_cast<std::uintptr_t>(w) % 16 != 0)
    return cudaErrorInvalidValue;
  CUtensorMap maps[7] = {};
  const bool w_map = w_transposed
                         ? make_tile_map(&maps[0], CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, w, k, n, w_stride * 4, kBlockK)
                         : make_tile_map(&maps[0], CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, w, n, k, w_stride * 4, kBlockW);
  if (!w_map) return cudaErrorInvalidValue;
  return launch_kernel(maps, w_transposed, /*presplit=*/false, x_hi, x_lo, x_exponent, w_flags, bias, y, positive, m,
                       n, k, epilogue, device, stream, k_slices, y_transposed);
}

// launch_split_gemm_presplit_multiply_leaky_relu, K split where k_slices says so.
cudaError_t launch_with_w_split(const void* x_hi, const void* x_lo, const std::int32_t* x_exponent, const void* w_hi,
                                const void* w_lo, const std::int32_t* w_exponent, const float* bias, float* y,
                                std::uint8_t* positive, std::int64_t m, std::int64_t n, std::int64_t k,
                                Epilogue epilogue, cudaStream_t stream,
                                const KSlices& k_slices) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (!split_gemm_presplit_supported(device, m, n, k)) return cudaErrorNotSupported;
  if (reinterpret_cast<std::uintptr_t>(w_hi) % 16 != 0 || reinterpret_cast<std::uintptr_t>(w_lo) % 16 != 0 ||
      reinterpret_cast<std::uintptr_t>(w_exponent) % 16 != 0)
    return cudaErrorInvalidValue;
  const std::int64_t row = split_row_length(k);
  CUtensorMap maps[7] = {};
  if (!make_tile_map(&maps[0], CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, w_hi, n, row, row * 2, kBlockW) ||
      !make_tile_map(&maps[1], CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, w_lo, n, row, row * 2, kBlockW) ||
      !make_exponent_map(&maps[2], w_exponent, row / kSplitChunk, n))
    return cudaErrorInvalidValue;
  return launch_kernel(maps, /*w_transposed=*/false, /*presplit=*/true, x_hi, x_lo, x_exponent, /*w_flags=*/nullptr,
                       bias, y, positive, m, n, k, epilogue, device, stream, k_slices);
}

// The slices of a split-K launch, checked: k_slices >= 1 or kStreamK, a workspace 16-byte aligned where K is split,
// and the workspace's rows within TMA's int coordinates.
bool split_k_arguments(std::int64_t m, std::int64_t n, std::int64_t k, int k_slices, float* workspace,
                       KSlices& split) {
  if ((k_slices < 1 && k_slices != kStreamK) || m <= 0 || n <= 0 || k <= 0) return false;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  split = split_k_slices(m, n, k, k_slices, multiprocessor_count(device), workspace);
  if (!split.split()) return true;
  return workspace != nullptr && reinterpret_cast<std::uintptr_t>(workspace) % 16 == 0 &&
         split.slices * split.slice_rows < (std::int64_t{1} << 31);
}

// split_gemm_k_slices's model of a product's time, in chunk-times of one CTA (a CTA's products of one chunk): the
// units' rounds over the multiprocessors times a unit's chunks and its fixed cost (its epilogue, and its pipeline's
// start), and, where K is split, the sum's pass over the partials and y.
constexpr int kSplitKMinSliceChunks = 16;    // below this a unit's fixed cost is a large part of its time
constexpr int kSplitKMaxSlices = 16;         // bounds the workspace: at most 16 times the output's bytes
constexpr int kSplitKUnitCostChunks = 4;     // a unit's epilogue and pipeline start, in chunk-times
constexpr int kSplitKSumTilesPerChunk = 32;  // tiles of 128 x 128 floats the sum reads or writes in a chunk-time
constexpr int kStreamKMarginDivisor = 16;    // stream-K where the model gives it 1/16 less time than equal slices

std::int64_t split_k_cost(std::int64_t tiles, std::int64_t chunks, std::int64_t slices, int processors) {
  const std::int64_t slice_chunks = (chunks + slices - 1) / slices;
  const std::int64_t rounds = (tiles * slices + processors - 1) / processors;
  const std::int64_t sum = slices > 1 ? ((slices + 1) * tiles + kSplitKSumTilesPerChunk - 1) / kSplitKSumTilesPerChunk
                                      : 0;
  return rounds * (slice_chunks + kSplitKUnitCostChunks) + sum;
}

// The same model for stream-K: the whole rounds, then the longer of a tail tile's block 0 and a block-1 share, the
// most units a share holds, and the sum over every tile's parts.
std::int64_t stream_k_cost(const StreamK& streamk) {
  const std::int64_t share = (streamk.rest() + streamk.rest_ctas() - 1) / streamk.rest_ctas();
  const std::int64_t units = (share + streamk.rest_chunks() - 1) / streamk.rest_chunks() + 1;
  const std::int64_t sum =
      (2 * streamk.tiles + streamk.ctas - 1 + kSplitKSumTilesPerChunk - 1) / kSplitKSumTilesPerChunk;
  const std::int64_t rounds = streamk.dp_tiles / streamk.ctas;
  return rounds * (streamk.chunks + kSplitKUnitCostChunks) + std::max<std::int64_t>(streamk.head, share) +
         units * kSplitKUnitCostChunks + sum;
}

}  // namespace

cudaError_t launch_split_gemm_multiply_leaky_relu(const void* x_hi, const void* x_lo, const std::int32_t* x_exponent,
                                                  const float* w, std::int64_t w_stride, bool w_transposed,
                                                  std::int32_t* w_flags, const float* bias, float* y,
                                                  std::uint8_t* positive, std::int64_t m, std::int64_t n,
                                                  std::int64_t k, Epilogue epilogue,
                                                  cudaStream_t stream, bool y_transposed) {
  return launch_with_w(x_hi, x_lo, x_exponent, w, w_stride, w_transposed, w_flags, bias, y, positive, m, n, k,
                       epilogue, stream, KSlices{}, y_transposed);
}

bool split_gemm_presplit_supported(int device, std::int64_t m, std::int64_t n, std::int64_t k) {
  // w's split has rows of whole chunks whatever k is, its exponents chunks 16-byte aligned whatever n is.
  return split_gemm_supported(device, m, n, split_row_length(k));
}

cudaError_t launch_split_gemm_presplit_multiply_leaky_relu(const void* x_hi, const void* x_lo,
                                                           const std::int32_t* x_exponent, const void* w_hi,
                                                           const void* w_lo, const std::int32_t* w_exponent,
                                                           const float* bias, float* y, std::uint8_t* positive,
                                                           std::int64_t m, std::int64_t n, std::int64_t k,
                                                           Epilogue epilogue,
                                                           cudaStream_t stream) {
  return launch_with_w_split(x_hi, x_lo, x_exponent, w_hi, w_lo, w_exponent, bias, y, positive, m, n, k, epilogue,
                             stream, KSlices{});
}

int split_gemm_k_slices(int device, std::int64_t m, std::int64_t n, std::int64_t k) {
  const int processors = m > 0 && n > 0 && k > 0 ? multiprocessor_count(device) : 0;
  if (processors <= 0) return 1;
  const std::int64_t tiles = tile_count(m, n), chunks = split_row_length(k) / kSplitChunk;
  std::int64_t best = 1, best_cost = split_k_cost(tiles, chunks, 1, processors);
  for (std::int64_t slices = 2; slices <= kSplitKMaxSlices; ++slices) {
    const std::int64_t slice_chunks = (chunks + slices - 1) / slices;
    if (slice_chunks < kSplitKMinSliceChunks) break;
    if ((chunks + slice_chunks - 1) / slice_chunks != slices) continue;  // fewer slices of the same length
    const std::int64_t cost = split_k_cost(tiles, chunks, slices, processors);
    if (cost < best_cost) best = slices, best_cost = cost;
  }
  if (tiles < (std::int64_t{1} << 31)) {
    const StreamK streamk(static_cast<int>(tiles), static_cast<int>(chunks), processors);
    // Only by a margin (its block-1 shares read their chunks at staggered times, which the model leaves out), and with
    // its workspace, like equal slices', at most kSplitKMaxSlices times the output's bytes.
    if (streamk.fits() && stream_k_cost(streamk) * kStreamKMarginDivisor < best_cost * (kStreamKMarginDivisor - 1) &&
        stream_k_most_parts(streamk) <= kSplitKMaxSlices)
      return kStreamK;
  }
  return static_cast<int>(best);
}

std::int64_t split_gemm_k_workspace_bytes(int device, std::int64_t m, std::int64_t n, std::int64_t k, int k_slices) {
  if ((k_slices <= 1 && k_slices != kStreamK) || m <= 0 || n <= 0 || k <= 0) return 0;
  const KSlices split = split_k_slices(m, n, k, k_slices, multiprocessor_count(device), nullptr);
  return split.split() ? split.slices * split.slice_rows * n * static_cast<std::int64_t>(sizeof(float)) : 0;
}

cudaError_t launch_split_gemm_split_k(const void* x_hi, const void* x_lo, const std::int32_t* x_exponent,
                                      const float* w, std::int64_t w_stride, bool w_transposed, std::int32_t* w_flags,
                                      const float* bias, float* y, std::uint8_t* positive, std::int64_t m,
                                      std::int64_t n, std::int64_t k, Epilogue epilogue,
                                      int k_slices, float* workspace, cudaStream_t stream) {
  KSlices split;
  if (!split_k_arguments(m, n, k, k_slices, workspace, split)) return cudaErrorInvalidValue;
  if (split.split() && epilogue.pre != nullptr) return cudaErrorNotSupported;
  return launch_with_w(x_hi, x_lo, x_exponent, w, w_stride, w_transposed, w_flags, bias, y, positive, m, n, k,
                       epilogue, stream, split);
}

cudaError_t launch_split_gemm_presplit_split_k(const void* x_hi, const void* x_lo, const std::int32_t* x_exponent,
                                               const void* w_hi, const void* w_lo, const std::int32_t* w_exponent,
                                               const float* bias, float* y, std::uint8_t* positive, std::int64_t m,
                                               std::int64_t n, std::int64_t k, Epilogue epilogue, int k_slices,
                                               float* workspace, cudaStream_t stream) {
  KSlices split;
  if (!split_k_arguments(m, n, k, k_slices, workspace, split)) return cudaErrorInvalidValue;
  if (split.split() && epilogue.pre != nullptr) return cudaErrorNotSupported;
  return launch_with_w_split(x_hi, x_lo, x_exponent, w_hi, w_lo, w_exponent, bias, y, positive, m, n, k, epilogue,
                             stream, split);
}

}  // namespace kernels::gemm
