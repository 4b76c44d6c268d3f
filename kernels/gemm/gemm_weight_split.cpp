// Splits made beforehand. w's, kept by the caller (gemm_weight_split), with a stamp of what it was made from and for:
// usable_weight_split lets the forward read it where the stamp still matches the call. x's row split, left by the op
// that wrote x (_gemm_leave_row_split): left_row_split lets the forward read it where x is that tensor, unchanged.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

#include "gemm_internal.h"

#ifdef KERNELS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/stream_capture.h"
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
int64_t current_stream_id(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).id(); }

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
  stamp[kStampStream] = current_stream_id(weight);
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

#ifdef KERNELS_WITH_CUDA
// ---- x's row split left by the op that wrote x ------------------------------------------------------------------

// A float32 tensor's row split made by the op that wrote the tensor (the LayerNorm family's leaving ops: their kernel
// splits y as it writes it), for the split_fp16 forward whose x that tensor is. One slot a process, read once, held
// until then, until another split replaces it or until its tensor's storage is gone; matched on that storage (a weak
// reference, so its memory is not handed to another storage while held), the data address, the version counter (a
// change made through PyTorch), the element count, the row length, the device and the current stream; none is left
// or read while a CUDA graph is captured (common/stream_capture.h). Its bits are x's own row pass's.
struct LeftRowSplit {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  const void* data;
  int64_t version, numel, columns, device, stream;
  WeightSplit split;
};

// The slot and its lock, never destroyed (tensors freed at exit, after the caching allocator, would fail).
std::mutex& left_row_split_mutex() {
  static auto* mutex = new std::mutex();
  return *mutex;
}

std::optional<LeftRowSplit>& left_row_split_slot() {
  static auto* slot = new std::optional<LeftRowSplit>();
  return *slot;
}

// _gemm_leave_row_split(y, hi, lo, exponent): keeps y's row split (launch_split_rows's layout and order for
// split_fp16's kernel: hi and lo rows x split_row_length(columns) fp16, exponent rows int32) in the slot.
void gemm_leave_row_split(const at::Tensor& y, const at::Tensor& hi, const at::Tensor& lo, const at::Tensor& exponent) {
  TORCH_CHECK(y.is_cuda() && y.scalar_type() == at::kFloat && y.dim() >= 1 && y.numel() > 0 && y.is_contiguous() &&
                  !y.is_inference(),
              "kernels._gemm_leave_row_split: y must be a non-empty contiguous float32 CUDA tensor with a version "
              "counter");
  const int64_t columns = y.size(-1), rows = y.numel() / columns, length = split_row_length(columns);
  for (const at::Tensor* half : {&hi, &lo})
    TORCH_CHECK(half->scalar_type() == at::kHalf && half->device() == y.device() && half->is_contiguous() &&
                    half->dim() == 2 && half->size(0) == rows && half->size(1) == length,
                "kernels._gemm_leave_row_split: hi and lo must be contiguous float16 (", std::to_string(rows), ", ",
                std::to_string(length), ") tensors on y's device");
  TORCH_CHECK(exponent.scalar_type() == at::kInt && exponent.device() == y.device() && exponent.is_contiguous() &&
                  exponent.dim() == 1 && exponent.size(0) == rows,
              "kernels._gemm_leave_row_split: exponent must be a contiguous int32 (", std::to_string(rows),
              ") tensor on y's device");
  const std::lock_guard<std::mutex> lock(left_row_split_mutex());
  if (common::stream_capturing(y)) {  // none kept while a graph is captured (common/stream_capture.h)
    left_row_split_slot().reset();
    return;
  }
  LeftRowSplit left{y.storage().getWeakStorageImpl(), y.const_data_ptr(), static_cast<int64_t>(y._version()),
                    y.numel(), columns, y.device().index(), current_stream_id(y),
                    WeightSplit{hi, lo, exponent, at::Tensor(), /*rows=*/true}};
  left_row_split_slot() = std::move(left);
}

std::optional<WeightSplit> left_row_split(const at::Tensor& x) {
  if (!x.is_cuda() || x.is_inference() || !x.is_contiguous() || x.dim() < 1 || x.numel() == 0) return std::nullopt;
  const std::lock_guard<std::mutex> lock(left_row_split_mutex());
  std::optional<LeftRowSplit>& slot = left_row_split_slot();
  if (!slot.has_value() || common::stream_capturing(x)) return std::nullopt;  // none read while a graph is captured
  const c10::intrusive_ptr<c10::StorageImpl> storage = slot->storage.lock();
  if (!storage) {  // its tensor is gone: its split too
    slot.reset();
    return std::nullopt;
  }
  if (storage.get() != x.storage().unsafeGetStorageImpl() || x.const_data_ptr() != slot->data ||
      static_cast<int64_t>(x._version()) != slot->version || x.numel() != slot->numel ||
      x.size(-1) != slot->columns || x.device().index() != slot->device || current_stream_id(x) != slot->stream)
    return std::nullopt;
  WeightSplit split = std::move(slot->split);  // read once: the slot's memory goes back with the product's
  slot.reset();
  return split;
}
#endif

}  // namespace
}  // namespace kernels::gemm
