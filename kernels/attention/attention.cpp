// The torch side of the attention family of `torch.ops.kernels`: schema, argument checks, and the dispatch to the CUDA
// kernels (attention.h; float32 on sm_80 or later, head dim 64) or, in every other case (CPU, other dtypes and head
// dims), to eager's own: PyTorch's memory-efficient attention where eager's call takes it, else ATen's ops. Fakes and
// the autograd formula are registered in attention.py.
//
// Ops: attention(query, key, value, is_causal, scale) -> (output, logsumexp): softmax(query key^T * scale, causal
// mask from the top left) value for query (batch, heads, query rows, head dim) and key, value (batch, kv heads, key
// rows, head dim), head h reading kv head h / (heads / kv heads); output (batch, heads, query rows, head dim) laid out
// as (batch, query rows, heads, head dim) in memory, as PyTorch's memory-efficient attention lays out its own;
// logsumexp (batch, heads, query rows rounded up to 32, the padding's values unspecified) in the query's dtype, each
// row's log-sum-exp of its scaled scores. _attention_force_plain(plain) -> the previous setting: every head on the
// plain kernel, for tests; _attention_force_mma_sync(mma_sync) -> the previous setting: the split kernel's products
// on mma.sync (the sm_80 kernel) on Hopper too, for tests.
//
// Built with KERNELS_WITH_CUDA where torch has CUDA and a GPU is visible; without it, the library is CPU-only.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>

#include "common/out_of_memory.h"
#include "common/torch_checks.h"

#ifdef KERNELS_WITH_CUDA
#include <ATen/ops/_efficient_attention_forward.h>
#include <ATen/ops/_fused_sdp_choice.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "attention.h"
#endif

namespace kernels::attention {
namespace {

using common::check_float_tensor;
using common::check_same;
using common::shape_str;

constexpr const char* kOp = "attention";

std::atomic<bool> forced_plain{false};

bool force_plain(bool plain) { return forced_plain.exchange(plain); }

std::atomic<bool> forced_mma_sync{false};

bool force_mma_sync(bool mma_sync) { return forced_mma_sync.exchange(mma_sync); }

// attention.h's logsumexp_stride, for the CPU-only build too (that header needs CUDA's).
std::int64_t lse_stride(std::int64_t rows) { return (rows + 31) / 32 * 32; }

void check_operands(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_float_tensor(kOp, "query", q);
  check_float_tensor(kOp, "key", k);
  check_float_tensor(kOp, "value", v);
  check_same(kOp, "key", k, "query", q);
  check_same(kOp, "value", v, "query", q);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "kernels.attention: query, key and value must have 4 "
              "dimensions (batch, heads, rows, head dim), got shapes ", shape_str(q.sizes()), ", ",
              shape_str(k.sizes()), " and ", shape_str(v.sizes()));
  TORCH_CHECK(k.sizes() == v.sizes(), "kernels.attention: key and value must have the same shape, got ",
              shape_str(k.sizes()), " and ", shape_str(v.sizes()));
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), "kernels.attention: query ", shape_str(q.sizes()),
              " and key ", shape_str(k.sizes()), " must have the same batch and head dim");
  const std::int64_t heads = q.size(1), kv_heads = k.size(1);
  // No heads at all is an empty call, as eager's.
  const bool grouped = kv_heads > 0 ? heads % kv_heads == 0 : heads == 0;
  // Numbers go into messages as strings (common/torch_checks.h: streamed, they crashed the GPU machine's build).
  TORCH_CHECK(grouped, "kernels.attention: query has ", std::to_string(heads), " heads, which must be a multiple of "
              "key's ", std::to_string(kv_heads));
}

// ---- the ATen path: eager's attention, and the logsumexp from the scores -------------------------------------

std::tuple<at::Tensor, at::Tensor> attention_aten(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  bool is_causal, double scale) {
  const std::int64_t rows = q.size(2), keys = k.size(2);
  // The kernels' layout: (batch, rows, heads, head dim) in memory.
  at::Tensor laid_out = at::empty({q.size(0), rows, q.size(1), q.size(3)}, q.options()).permute({0, 2, 1, 3});
  at::Tensor lse = at::zeros({q.size(0), q.size(1), lse_stride(rows)}, q.options());
  // An empty output (no batch, heads or rows) needs no call; without heads, the group below would divide by zero.
  if (laid_out.numel() == 0) return {laid_out, lse};
  const std::int64_t group = q.size(1) / k.size(1);
  // Head h of q reads kv head h / group: q viewed as (batch, kv heads, group, rows, head dim).
  const at::Tensor grouped = q.reshape({q.size(0), k.size(1), group, rows, q.size(3)});
  at::Tensor scores = at::matmul(grouped, k.unsqueeze(2).transpose(-2, -1)).mul(scale);
  if (is_causal) {
    const at::Tensor masked = at::ones({rows, keys}, q.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(masked, -std::numeric_limits<double>::infinity());
  }
  // The output is eager's own; the scores above give the logsumexp.
  const at::Tensor out = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, is_causal, scale, group > 1);
  lse.narrow(2, 0, rows).copy_(at::logsumexp(scores, -1).reshape({q.size(0), q.size(1), rows}));
  laid_out.copy_(out);
  return {laid_out, lse};
}

#ifdef KERNELS_WITH_CUDA
bool takes_kernel(const at::Tensor& q, const at::Tensor& k) {
  return q.is_cuda() && q.scalar_type() == at::kFloat && q.numel() > 0 && k.numel() > 0 &&
         attention_supported(q.device().index(), q.size(3));
}

OperandStrides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// Whether eager's F.scaled_dot_product_attention runs this call on PyTorch's memory-efficient kernel, as its own
// dispatcher decides (inputs, layouts, the caller's sdpa_kernel choice). Grouped heads never do: that kernel takes
// none (eager's grouped calls run flash or cuDNN attention, or its math path).
bool eager_takes_efficient(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                           double scale) {
  constexpr std::int64_t kEfficientAttention = 2;  // sdp::SDPBackend::efficient_attention
  return q.is_cuda() && q.numel() > 0 && k.numel() > 0 && q.size(1) == k.size(1) &&
         at::_fused_sdp_choice(q, k, v, std::nullopt, 0.0, is_causal, scale) == kEfficientAttention;
}

// Eager's own call where eager_takes_efficient: its output and logsumexp at once, in this op's layout (the same as
// its own), with no scores in memory; else the ATen path, as eager's math path computes it.
std::tuple<at::Tensor, at::Tensor> attention_eager(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   bool is_causal, double scale) {
  if (!eager_takes_efficient(q, k, v, is_causal, scale)) return attention_aten(q, k, v, is_causal, scale);
  constexpr std::int64_t kNoMask = 0, kCausalFromTopLeft = 1;  // ATen's custom_mask_type
  const auto result = at::_efficient_attention_forward(
      q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), std::nullopt, std::nullopt, std::nullopt, std::nullopt,
      std::nullopt, 0.0, is_causal ? kCausalFromTopLeft : kNoMask, /*compute_log_sumexp=*/true, scale);
  // Its logsumexp is float32 whatever the inputs' dtype; this op's is the query's.
  return {std::get<0>(result).transpose(1, 2), std::get<1>(result).to(q.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> attention_cuda(const at::Tensor& query, const at::Tensor& key,
                                                  const at::Tensor& value, bool is_causal, double scale) {
  const c10::cuda::CUDAGuard guard(query.device());
  const AttentionShape shape{query.size(0), query.size(1), key.size(1), query.size(2), key.size(2), query.size(3)};
  // The workspace (k and v split) is memory eager's call does not take: where it cannot be had, eager's call runs
  // on the caller's tensors. It is asked for first, so that nothing of this call's is held while that runs.
  std::optional<at::Tensor> workspace = common::unless_out_of_memory(
      [&] { return at::empty({attention_workspace(shape).bytes}, query.options().dtype(at::kByte)); });
  if (!workspace.has_value()) return attention_eager(query, key, value, is_causal, scale);
  // The kernels read rows whose head dim is contiguous.
  const auto rows_of = [](const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); };
  const at::Tensor q = rows_of(query), k = rows_of(key), v = rows_of(value);
  at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options()).permute({0, 2, 1, 3});
  at::Tensor lse = at::empty({q.size(0), q.size(1), lse_stride(q.size(2))}, q.options());
  const cudaError_t err = launch_attention(
      q.const_data_ptr<float>(), strides_of(q), k.const_data_ptr<float>(), strides_of(k), v.const_data_ptr<float>(),
      strides_of(v), out.mutable_data_ptr<float>(), strides_of(out), lse.mutable_data_ptr<float>(), shape, is_causal,
      static_cast<float>(scale), forced_mma_sync.load(), forced_plain.load(), workspace->mutable_data_ptr(),
      c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  TORCH_CHECK(err == cudaSuccess, "kernels: the attention kernels failed to launch: ", cudaGetErrorString(err));
  return {out, lse};
}
#endif

// ---- ops --------------------------------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                             bool is_causal, double scale) {
  check_operands(query, key, value);
#ifdef KERNELS_WITH_CUDA
  if (takes_kernel(query, key)) return attention_cuda(query, key, value, is_causal, scale);
  if (query.is_cuda()) return attention_eager(query, key, value, is_causal, scale);
#endif
  TORCH_CHECK(query.is_cpu() || query.is_cuda(), "kernels.attention: no implementation for tensors on ",
              query.device().str());
  return attention_aten(query, key, value, is_causal, scale);
}

}  // namespace
}  // namespace kernels::attention

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  m.def("attention(Tensor query, Tensor key, Tensor value, bool is_causal, float scale) -> (Tensor, Tensor)");
  m.def("_attention_force_plain(bool plain) -> bool");
  m.impl("_attention_force_plain",
         torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &kernels::attention::force_plain));
  m.def("_attention_force_mma_sync(bool mma_sync) -> bool");
  m.impl("_attention_force_mma_sync",
         torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &kernels::attention::force_mma_sync));
}

TORCH_LIBRARY_IMPL(kernels, CPU, m) { m.impl("attention", &kernels::attention::attention); }
#ifdef KERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(kernels, CUDA, m) { m.impl("attention", &kernels::attention::attention); }
#endif
