// The GEMM family's passes around the split GEMMs (gemm.h): the split of float32 matrices into fp16 pairs hi, lo scaled
// by powers of two (split_numerics.cuh), and the fix-up of outputs that non-finite values reach. Portable.
// - gemm_split_rows.cuh: a power of two per row: x by rows (launch_split_rows), a matrix's columns
//   (launch_split_columns).
// - gemm_split_chunks.cuh: a power of two per row and chunk of 64: w's split made ahead (launch_split_chunks).
// - gemm_split_nonfinite_outputs.cuh (launch_nonfinite_outputs); gemm_split_transposed_epilogue.cuh: y from a
//   transposed product (launch_transposed_epilogue).
// - This file: the host launchers (argument checks, grids, the row split's kernel by row length and alignment).
#include "common/dependent_launch.cuh"
#include "gemm.h"
#include "gemm_split_chunks.cuh"
#include "gemm_split_nonfinite_outputs.cuh"
#include "gemm_split_rows.cuh"
#include "gemm_split_transposed_epilogue.cuh"
#include "split_numerics.cuh"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <initializer_list>
#include <type_traits>

namespace kernels::gemm {

cudaError_t launch_nonfinite_outputs(const float* x, std::int64_t x_stride, std::int64_t x_element_stride,
                                     const float* w, std::int64_t w_stride,
                                     std::int64_t w_element_stride, const std::int32_t* x_exponent,
                                     const std::int32_t* w_exponent,
                                     const float* bias, float* y, std::uint8_t* positive, std::int64_t m,
                                     std::int64_t n, std::int64_t k, Epilogue epilogue,
                                     cudaStream_t stream) {
  if (m <= 0 || n <= 0) return cudaSuccess;
  const std::int64_t blocks = (m + n + kFixupRowsPerBlock - 1) / kFixupRowsPerBlock;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  return launch_dependent(nonfinite_outputs_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kFixupThreads), 0,
                          stream, x, x_stride, x_element_stride, w, w_stride, w_element_stride, x_exponent, w_exponent,
                          bias, y, positive, m, n, k, epilogue);
}

cudaError_t launch_transposed_epilogue(const float* product_t, const float* bias, float* y, std::uint8_t* positive,
                                      std::int64_t m, std::int64_t n, Epilogue epilogue,
                                      cudaStream_t stream) {
  if (epilogue.pre != nullptr) return cudaErrorNotSupported;
  if (m <= 0 || n <= 0) return cudaSuccess;
  const std::int64_t tiles = ((m + kTransposeTile - 1) / kTransposeTile) * ((n + kTransposeTile - 1) / kTransposeTile);
  const unsigned blocks = static_cast<unsigned>(tiles < (1 << 20) ? tiles : (1 << 20));
  return launch_dependent(transposed_epilogue_kernel, dim3(blocks), dim3(kTransposeThreads), 0, stream, product_t,
                          bias, y, positive, m, n, epilogue);
}

std::int64_t split_columns_workspace_bytes(std::int64_t rows, std::int64_t cols) {
  if (rows <= 0 || cols <= 0) return 0;
  return column_split_layout(rows, cols).bytes;
}

// The grid of split_columns_staged_kernel on `device` (the current one): as many blocks as its multiprocessors hold at
// once, its shared-memory limit raised once; 0 where the device takes no cooperative launch, where a multiprocessor
// holds fewer than two blocks (one block alone lost to the kernel that reads twice: NOTES.md) or a query fails.
std::int64_t staged_column_blocks(int device) {
  const std::optional<std::int64_t> blocks = once_per_device(device, [](int d) -> std::optional<std::int64_t> {
    int cooperative = 0, block_limit = 0, per_multiprocessor = 0, multiprocessors = 0;
    if (cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, d) != cudaSuccess ||
        cudaDeviceGetAttribute(&block_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, d) != cudaSuccess ||
        cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, d) != cudaSuccess) {
      (void)cudaGetLastError();  // a failed query leaves no error for a later launch's check to report
      return std::nullopt;
    }
    if (!cooperative || static_cast<std::size_t>(block_limit) < sizeof(StagedColumnShared)) return 0;
    if (raise_shared_memory_limit<split_columns_staged_kernel>(d, sizeof(StagedColumnShared)) != cudaSuccess)
      return std::nullopt;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor, split_columns_staged_kernel,
                                                      kColumnTileThreads, sizeof(StagedColumnShared)) != cudaSuccess) {
      (void)cudaGetLastError();
      return std::nullopt;
    }
    return per_multiprocessor >= 2 ? std::int64_t{per_multiprocessor} * multiprocessors : 0;
  });
  return blocks.value_or(0);
}

cudaError_t launch_split_columns(const float* src, std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                                 void* hi, void* lo, std::int32_t* exponent, float* column_sums, void* workspace,
                                 cudaStream_t stream, bool staged) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const ColumnSplitLayout layout = column_split_layout(rows, cols);
  const std::int64_t items = layout.tiles * layout.slabs;
  if (2 * items > 0x7fffffff || reinterpret_cast<std::uintptr_t>(workspace) % 16 != 0 ||
      reinterpret_cast<std::uintptr_t>(hi) % 4 != 0 || reinterpret_cast<std::uintptr_t>(lo) % 4 != 0)
    return cudaErrorInvalidValue;
  cudaError_t err = cudaMemsetAsync(workspace, 0, layout.counters_bytes, stream);
  if (err != cudaSuccess) return err;
  const bool aligned =
      cols % 4 == 0 && row_stride % 4 == 0 && reinterpret_cast<std::uintptr_t>(src) % 16 == 0;
  if (staged && aligned) {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return cudaGetLastError();
    const std::int64_t blocks = staged_column_blocks(device);
    // Each tile within two rounds of the grid (enough for the kernel's waits to end), and a round of items at least
    // (under one, staging gained nothing where measured: NOTES.md).
    if (blocks > 0 && layout.slabs <= blocks && items >= blocks) {
      err = launch_dependent_as(true, split_columns_staged_kernel, dim3(static_cast<unsigned>(blocks)),
                                dim3(kColumnTileThreads), sizeof(StagedColumnShared), stream, src, rows, cols,
                                row_stride, static_cast<__half*>(hi), static_cast<__half*>(lo), exponent, column_sums,
                                static_cast<unsigned char*>(workspace));
      if (err == cudaSuccess) return err;  // else (the grid not resident at once here, say) the kernel below
    }
  }
  // B items at least a whole column tile of slabs behind A's (column_item: a B block waits only on earlier blocks).
  const std::int64_t lag = layout.slabs + kColumnLagItems, lag_items = lag < items ? lag : items;
  const auto kernel = aligned ? split_columns_kernel<true> : split_columns_kernel<false>;
  return launch_dependent(kernel, dim3(static_cast<unsigned>(2 * items)), dim3(kColumnTileThreads), 0, stream, src,
                          rows, cols, row_stride, static_cast<__half*>(hi), static_cast<__half*>(lo), exponent,
                          column_sums, static_cast<unsigned char*>(workspace), lag_items);
}

// The longest split row held in registers (split_rows_in_registers_kernel, split_chunks_in_registers_kernel).
constexpr std::int64_t kMaxRowInRegisters = kSplitThreads * 4 * 16;

// Calls split(group, packs) (integral constants) with the shape of the in-register kernels for rows of split length
// `length` <= kMaxRowInRegisters: `group` threads per row holding `packs` packs of 4 each, so that each thread has
// a few 16-byte loads in flight and a block several rows where rows are short.
template <class Split>
cudaError_t in_registers(std::int64_t length, Split split) {
  using std::integral_constant;
  if (length <= 32 * 4 * 2) return split(integral_constant<int, 32>{}, integral_constant<int, 2>{});
  if (length <= 32 * 4 * 4) return split(integral_constant<int, 32>{}, integral_constant<int, 4>{});
  if (length <= 32 * 4 * 8) return split(integral_constant<int, 32>{}, integral_constant<int, 8>{});
  if (length <= 64 * 4 * 8) return split(integral_constant<int, 64>{}, integral_constant<int, 8>{});
  if (length <= 128 * 4 * 8) return split(integral_constant<int, 128>{}, integral_constant<int, 8>{});
  if (length <= 256 * 4 * 8) return split(integral_constant<int, 256>{}, integral_constant<int, 8>{});
  return split(integral_constant<int, 256>{}, integral_constant<int, 16>{});
}

cudaError_t launch_split_chunks(const float* src, std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                                bool transposed, bool natural_order, void* hi, void* lo,
                                std::int32_t* chunk_exponent, std::int32_t* flags, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const std::int64_t chunks = split_row_length(cols) / kSplitChunk;
  if (reinterpret_cast<std::uintptr_t>(hi) % 4 != 0 || reinterpret_cast<std::uintptr_t>(lo) % 4 != 0 ||
      (transposed && !natural_order))
    return cudaErrorInvalidValue;
  if (!transposed) {
    if (rows > 0x7fffffff || cols % 4 != 0 || row_stride % 4 != 0 || reinterpret_cast<std::uintptr_t>(src) % 16 != 0)
      return cudaErrorInvalidValue;
    const auto in_order = [&](auto natural) {
      constexpr bool kNatural = decltype(natural)::value;
      const std::int64_t length = split_row_length(cols);
      if (length > kMaxRowInRegisters) {
        return launch_dependent(split_chunks_kernel<kNatural>, dim3(static_cast<unsigned>(rows)), dim3(kSplitThreads),
                                0, stream, src, rows, cols, row_stride, static_cast<__half*>(hi),
                                static_cast<__half*>(lo), chunk_exponent, flags);
      }
      return in_registers(length, [&](auto group, auto packs) {
        constexpr int kGroup = decltype(group)::value, kPacks = decltype(packs)::value;
        constexpr std::int64_t kRowsPerBlock = kSplitThreads / kGroup;
        const unsigned blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
        return launch_dependent(split_chunks_in_registers_kernel<kGroup, kPacks, kNatural>, dim3(blocks),
                                dim3(kSplitThreads), 0, stream, src, rows, cols, row_stride, static_cast<__half*>(hi),
                                static_cast<__half*>(lo), chunk_exponent, flags);
      });
    };
    return natural_order ? in_order(std::true_type{}) : in_order(std::false_type{});
  }
  // src is w's transpose: cols x rows, rows row_stride apart.
  const std::int64_t column_blocks = (rows + kChunkColumnTile - 1) / kChunkColumnTile;
  if (column_blocks > 0x7fffffff || chunks > 65535) return cudaErrorInvalidValue;
  cudaError_t err = cudaMemsetAsync(flags, 0, rows * sizeof(std::int32_t), stream);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(column_blocks), static_cast<unsigned>(chunks));
  return launch_dependent(split_chunks_transposed_kernel, dim3(grid), dim3(kChunkColumnThreads), 0, stream, src, cols,
                          rows, row_stride, static_cast<__half*>(hi), static_cast<__half*>(lo), chunk_exponent, flags);
}

// How many packs of 4 floats split_rows_staged_kernel keeps in shared memory for rows of `packs` packs on `device` (the
// current one): as many as let two blocks share a multiprocessor where that reads at most a quarter of the row again
// (the whole row where it fits), else the whole row where a block's most holds it (one block a multiprocessor), else
// the two blocks' part again. Its limit is raised once to a block's most. 0 where a query fails (the row split then
// takes the generic kernels).
int staged_row_packs(int device, std::int64_t packs) {
  struct Limits {
    int shared_pair, whole_block;  // packs: half a multiprocessor's shared memory, and a block's most
  };
  const std::optional<Limits> limits = once_per_device(device, [](int d) -> std::optional<Limits> {
    int multiprocessor = 0, block = 0;
    if (cudaDeviceGetAttribute(&multiprocessor, cudaDevAttrMaxSharedMemoryPerMultiprocessor, d) != cudaSuccess ||
        cudaDeviceGetAttribute(&block, cudaDevAttrMaxSharedMemoryPerBlockOptin, d) != cudaSuccess) {
      (void)cudaGetLastError();  // a failed query leaves no error for a later launch's check to report
      return std::nullopt;
    }
    // Each block's reserve and static part (row_scale's) within 2 KB.
    return Limits{(multiprocessor / 2 - 2048) / 16, (block - 2048) / 16};
  });
  if (!limits || limits->shared_pair <= 0 ||
      raise_shared_memory_limit<split_rows_staged_kernel<false>, split_rows_staged_kernel<true>>(
          device, static_cast<std::size_t>(limits->whole_block) * 16) != cudaSuccess)
    return 0;
  if (packs <= limits->shared_pair) return static_cast<int>(packs);
  if (4 * (packs - limits->shared_pair) <= packs || packs > limits->whole_block) return limits->shared_pair;
  return static_cast<int>(packs);
}

cudaError_t launch_split_rows(const float* src, std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                              bool natural_order, void* hi, void* lo, std::int32_t* exponent, cudaStream_t stream,
                              bool staged) {
  if (rows <= 0) return cudaSuccess;
  if (rows > 0x7fffffff || reinterpret_cast<std::uintptr_t>(hi) % 4 != 0 ||
      reinterpret_cast<std::uintptr_t>(lo) % 4 != 0)
    return cudaErrorInvalidValue;
  const bool aligned =
      cols % 4 == 0 && row_stride % 4 == 0 && reinterpret_cast<std::uintptr_t>(src) % 16 == 0;
  const std::int64_t length = split_row_length(cols);
  // Rows the in-register kernels do not take: staged (one read from DRAM) where each of the block's threads gets a
  // pack of 4 at least, else the generic kernels (short rows read the second time from L1).
  const bool stageable = staged && cols < (std::int64_t{1} << 30) &&
                         (aligned ? length > kMaxRowInRegisters : cols >= 4 * kStagedRowThreads);
  int staged_packs = 0;
  if (stageable) {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return cudaGetLastError();
    staged_packs = staged_row_packs(device, (cols + 3) / 4);
  }
  const auto in_order = [&](auto natural) {
    constexpr bool kNatural = decltype(natural)::value;
    if (staged_packs > 0) {
      return launch_dependent(split_rows_staged_kernel<kNatural>, dim3(static_cast<unsigned>(rows)),
                              dim3(kStagedRowThreads), static_cast<std::size_t>(staged_packs) * 16, stream, src, cols,
                              row_stride, staged_packs, static_cast<__half*>(hi), static_cast<__half*>(lo), exponent);
    }
    if (!aligned) {
      return launch_dependent(split_rows_unaligned_kernel<kNatural>, dim3(static_cast<unsigned>(rows)),
                              dim3(kSplitThreads), 0, stream, src, cols, row_stride, static_cast<__half*>(hi),
                              static_cast<__half*>(lo), exponent);
    }
    if (length > kMaxRowInRegisters) {
      return launch_dependent(split_rows_kernel<kNatural>, dim3(static_cast<unsigned>(rows)), dim3(kSplitThreads), 0,
                              stream, src, cols, row_stride, static_cast<__half*>(hi), static_cast<__half*>(lo),
                              exponent);
    }
    return in_registers(length, [&](auto group, auto packs) {
      constexpr int kGroup = decltype(group)::value, kPacks = decltype(packs)::value;
      constexpr std::int64_t kRowsPerBlock = kSplitThreads / kGroup;
      const unsigned blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
      return launch_dependent(split_rows_in_registers_kernel<kGroup, kPacks, kNatural, MatrixRows>, dim3(blocks),
                              dim3(kSplitThreads), 0, stream, MatrixRows{src, row_stride}, rows, cols,
                              static_cast<__half*>(hi), static_cast<__half*>(lo), exponent);
    });
  };
  return natural_order ? in_order(std::true_type{}) : in_order(std::false_type{});
}

cudaError_t launch_split_rows_and_chunks(const float* x, std::int64_t m, std::int64_t x_stride, void* x_hi, void* x_lo,
                                         std::int32_t* x_exponent, const float* w, std::int64_t n,
                                         std::int64_t w_stride, void* w_hi, void* w_lo,
                                         std::int32_t* w_chunk_exponent, std::int32_t* w_flags, std::int64_t k,
                                         bool natural_order, cudaStream_t stream) {
  const auto aligned = [](const void* p, std::int64_t stride) {
    return stride % 4 == 0 && reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
  };
  const std::int64_t length = split_row_length(k);
  if (m <= 0 || n <= 0 || k <= 0 || k % 4 != 0 || length > kMaxRowInRegisters || m > 0x7fffffff ||
      n > 0x7fffffff || !aligned(x, x_stride) || !aligned(w, w_stride))
    return cudaErrorNotSupported;
  for (const void* half : {x_hi, x_lo, w_hi, w_lo})
    if (reinterpret_cast<std::uintptr_t>(half) % 4 != 0) return cudaErrorInvalidValue;
  const auto in_order = [&](auto natural) {
    constexpr bool kNatural = decltype(natural)::value;
    return in_registers(length, [&](auto group, auto packs) {
      constexpr int kGroup = decltype(group)::value, kPacks = decltype(packs)::value;
      constexpr std::int64_t kRowsPerBlock = kSplitThreads / kGroup;
      const std::int64_t x_blocks = (m + kRowsPerBlock - 1) / kRowsPerBlock;
      const std::int64_t blocks = x_blocks + (n + kRowsPerBlock - 1) / kRowsPerBlock;
      if (blocks > 0x7fffffff) return cudaErrorNotSupported;
      return launch_dependent(split_rows_and_chunks_kernel<kGroup, kPacks, kNatural>,
                              dim3(static_cast<unsigned>(blocks)), dim3(kSplitThreads), 0, stream, x, m, x_stride,
                              static_cast<__half*>(x_hi), static_cast<__half*>(x_lo), x_exponent, w, n, w_stride,
                              static_cast<__half*>(w_hi), static_cast<__half*>(w_lo), w_chunk_exponent, w_flags, k,
                              x_blocks);
    });
  };
  return natural_order ? in_order(std::true_type{}) : in_order(std::false_type{});
}

bool split_rows_gelu_backward_supported(std::int64_t rows, std::int64_t cols, const float* grad_y,
                                        std::int64_t grad_y_stride, const float* pre, std::int64_t pre_stride) {
  const auto aligned = [](const float* p, std::int64_t stride) {
    return stride % 4 == 0 && reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
  };
  return rows > 0 && rows <= 0x7fffffff && cols > 0 && cols % 4 == 0 &&
         split_row_length(cols) <= kMaxRowInRegisters && aligned(grad_y, grad_y_stride) && aligned(pre, pre_stride);
}

cudaError_t launch_split_rows_gelu_backward(const float* grad_y, std::int64_t grad_y_stride, const float* pre,
                                            std::int64_t pre_stride, Activation gelu, std::int64_t rows,
                                            std::int64_t cols, float* grad_pre, bool natural_order, void* hi,
                                            void* lo, std::int32_t* exponent, cudaStream_t stream) {
  if (!split_rows_gelu_backward_supported(rows, cols, grad_y, grad_y_stride, pre, pre_stride))
    return cudaErrorNotSupported;
  if (gelu == Activation::kLeakyReLU || reinterpret_cast<std::uintptr_t>(grad_pre) % 16 != 0 ||
      reinterpret_cast<std::uintptr_t>(hi) % 4 != 0 || reinterpret_cast<std::uintptr_t>(lo) % 4 != 0)
    return cudaErrorInvalidValue;
  const auto launch = [&](auto natural, auto activation) {
    constexpr bool kNatural = decltype(natural)::value;
    using Source = GeluBackwardRows<decltype(activation)::value>;
    return in_registers(split_row_length(cols), [&](auto group, auto packs) {
      constexpr int kGroup = decltype(group)::value, kPacks = decltype(packs)::value;
      constexpr std::int64_t kRowsPerBlock = kSplitThreads / kGroup;
      const unsigned blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
      return launch_dependent(split_rows_in_registers_kernel<kGroup, kPacks, kNatural, Source>, dim3(blocks),
                              dim3(kSplitThreads), 0, stream, Source{grad_y, grad_y_stride, pre, pre_stride, grad_pre,
                              cols}, rows, cols, static_cast<__half*>(hi), static_cast<__half*>(lo), exponent);
    });
  };
  using Erf = std::integral_constant<Activation, Activation::kGeluErf>;
  using Tanh = std::integral_constant<Activation, Activation::kGeluTanh>;
  if (gelu == Activation::kGeluErf)
    return natural_order ? launch(std::true_type{}, Erf{}) : launch(std::false_type{}, Erf{});
  return natural_order ? launch(std::true_type{}, Tanh{}) : launch(std::false_type{}, Tanh{});
}

}  // namespace kernels::gemm
