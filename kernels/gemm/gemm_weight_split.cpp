// w's split made beforehand and kept by the caller (gemm_weight_split), with a stamp of what it was made from and for;
// usable_weight_split lets the forward read it where the stamp still matches the call.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "gemm_internal.h"

#ifdef KERNELS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "gemm.h"
#endif

namespace kernels::gemm {
namespace {

// gemm_weight_split(x, weight): where x's forward takes a split path that splits w by a pass, [hi, lo, exponent, flags,
// stamp, weight]: w's split in that path's order (its row split, with an empty flags tensor, where the product is
// computed transposed: the product's x), a CPU int64 stamp of what it was made from and for, and an alias keeping the
// weight's storage alive; else [] (cuBLAS paths, CPU or inference tensors, transposed views, under
// kKeptSplitMinProducts), or [empty tensor] where memory ran out. Given back as weight_split, it is used only where the
// storage and whole stamp match (path, orientation, data address, version counter, sizes, strides, device, current
// stream), else w is split as without it; changes PyTorch does not count (.data) are not seen. Bitwise the same results
// either way. Memory: about the weight's own size, while the caller keeps the list.
enum StampField : int {
  kStampPath, kStampTransposed, kStampData, kStampVersion, kStampRows, kStampColumns, kStampRowStride,
  kStampColumnStride, kStampDevice, kStampStream, kStampFields
};

#ifdef KERNELS_WITH_CUDA
std::vector<int64_t> weight_stamp(Path path, bool transposed, const at::Tensor& weight) {
  std::vector<int64_t> stamp(kStampFields);
  stamp[kStampPath] = static_cast<int64_t>(path);
  stamp[kStampTransposed] = transposed;
  stamp[kStampData] = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(weight.const_data_ptr()));
  stamp[kStampVersion] = static_cast<int64_t>(weight._version());
  stamp[kStampRows] = weight.size(0);
  stamp[kStampColumns] = weight.size(1);
  stamp[kStampRowStride] = weight.stride(0);
  stamp[kStampColumnStride] = weight.stride(1);
  stamp[kStampDevice] = weight.device().index();
  stamp[kStampStream] = c10::cuda::getCurrentCUDAStream(weight.device().index()).id();
  return stamp;
}

// Whether the forward of this shape on `path` can read w's split made beforehand: a split path, the weight as it is
// (not a transposed view) and with a version counter (an inference tensor has none).
bool reads_weight_split(Path path, const ProductShape& shape, const at::Tensor& weight) {
  return is_split(path) && !shape.w_transposed && !weight.is_inference();
}
#endif

// Products below this many multiply-adds get no kept split: their calls are host-bound, and reading a kept split
// lengthens them (measured: kernels/gemm/NOTES.md). gemm.py's KEPT_SPLIT_MIN_PRODUCTS is the same number.
constexpr int64_t kKeptSplitMinProducts = int64_t{1} << 32;

std::vector<at::Tensor> gemm_weight_split(const at::Tensor& x, const at::Tensor& weight) {
  check_gemm_arguments("gemm_weight_split", x, weight, std::nullopt);
#ifdef KERNELS_WITH_CUDA
  const ProductShape shape = linear_shape(x, weight);
  const Path path = choose_path(x, shape, /*strict=*/false);
  if (!reads_weight_split(path, shape, weight) || shape.m * shape.n * shape.k < kKeptSplitMinProducts) return {};
  // A split path: CUDA tensors. The guard comes before the support check, which reads kernel attributes on the
  // current device.
  const c10::cuda::CUDAGuard guard(weight.device());
  // A product computed transposed takes the weight's row split as its x's split; others its chunk split, read by the
  // kernel that takes w's split.
  const bool transposed = split_product_transposed(path, shape.m, shape.n, shape.k);
  if (path == Path::kSplitFp16 && !transposed &&
      !split_gemm_presplit_supported(x.device().index(), shape.m, shape.n, shape.k))
    return {};
  // A split to keep is an optimization: where its memory cannot be had, the caller goes on without one.
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(weight.device().index()).stream();
  WeightSplit split;
  try {
    split = transposed ? split_w_rows(weight, stream)
                       : split_w_chunks(path, split_operand(weight), /*w_transposed=*/false, shape.n, shape.k, stream);
  } catch (const c10::OutOfMemoryError&) {
    return {at::empty({0}, at::TensorOptions().dtype(at::kLong))};  // the caller's sign to make room
  }
  const std::vector<int64_t> stamp = weight_stamp(path, transposed, weight);
  at::Tensor stamp_tensor = at::empty({kStampFields}, at::TensorOptions().dtype(at::kLong));
  std::copy(stamp.begin(), stamp.end(), stamp_tensor.mutable_data_ptr<int64_t>());
  // The weight itself (an alias, sharing its storage) goes with the split: while the split lives, the weight's
  // memory cannot be freed and handed to another tensor at the same address with a version counter that matches
  // (module.to(...) and back swaps a parameter's data and keeps its counter), and the use checks that storage.
  return {split.hi, split.lo, split.exponent, split.rows ? at::empty({0}, split.exponent.options()) : split.flags,
          stamp_tensor, weight.detach()};
#else
  return {};
#endif
}

// The split in weight_split where its stamp matches this call on `path` (see gemm_weight_split); else nullopt. A list
// that is not one gemm_weight_split made raises.
std::optional<WeightSplit> usable_weight_split(const std::optional<at::TensorList>& weight_split, Path path,
                                               const at::Tensor& x, const at::Tensor& weight) {
  if (!weight_split.has_value() || weight_split->empty()) return std::nullopt;
  const at::TensorList list = *weight_split;
  TORCH_CHECK(list.size() == 6 && list[4].defined() && list[4].device().is_cpu() &&
                  list[4].scalar_type() == at::kLong && list[4].numel() == kStampFields && list[5].defined(),
              "kernels.gemm_multiply_leaky_relu: weight_split must be a list that kernels.gemm_weight_split returned "
              "(or None)");
#ifdef KERNELS_WITH_CUDA
  const ProductShape shape = linear_shape(x, weight);
  if (!reads_weight_split(path, shape, weight) || !weight.is_cuda()) return std::nullopt;
  if (!weight.is_alias_of(list[5])) return std::nullopt;  // another storage: the weight's data was swapped
  const int64_t* stamp = list[4].const_data_ptr<int64_t>();
  const bool transposed = split_product_transposed(path, shape.m, shape.n, shape.k);
  const std::vector<int64_t> now = weight_stamp(path, transposed, weight);
  for (int field = 0; field < kStampFields; ++field)
    if (stamp[field] != now[field]) return std::nullopt;
  return transposed ? WeightSplit{list[0], list[1], list[2], at::Tensor(), /*rows=*/true}
                    : WeightSplit{list[0], list[1], list[2], list[3]};
#else
  (void)path;
  (void)x;
  return std::nullopt;
#endif
}

}  // namespace
}  // namespace kernels::gemm
