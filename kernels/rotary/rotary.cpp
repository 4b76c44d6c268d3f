// The torch side of the rotary embedding family of `torch.ops.kernels`: schemas, argument checks, and the dispatch to
// the CUDA kernel (rotary.h, on the current stream of the tensors' own device) or to the ATen formulas of rotary_op.h
// (CPU tensors). Fake (meta) implementations are registered in rotary.py; the Autograd kernels are in
// rotary_autograd.cpp, joined after this file.
//
// Ops: rotary_embedding(q, k, cos, sin) = (q * cos + rotate_half(q) * sin, the same of k), cos and sin unsqueezed at
// dim 1 (transformers' apply_rotary_pos_emb, LLaMA's); rotary_embedding_backward(grad_q_embed, grad_k_embed, cos, sin)
// = (grad_q, grad_k). _rotary_force_generic(generic) -> the previous setting: every call on the generic kernel (any
// strides) where the packed one would take it, for tests.
//
// Built with KERNELS_WITH_CUDA where torch has CUDA and a GPU is visible; without it, the library is CPU-only.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <atomic>
#include <string>
#include <tuple>

#include "common/torch_checks.h"
#include "rotary_op.h"

#ifdef KERNELS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "rotary.h"
#endif

namespace kernels::rotary {
namespace {

using common::check_float_tensor;
using common::check_same;
using common::element_type;
using common::shape_str;

std::atomic<bool> forced_generic{false};

bool force_generic(bool generic) { return forced_generic.exchange(generic); }

// q and k (batch, heads, tokens, dim; k's heads may be fewer), cos and sin (batch or 1, tokens, dim), dim even, all
// of one dtype and device. q_name and k_name: the op's names for its two head operands.
void check_operands(const char* op, const char* q_name, const at::Tensor& q, const char* k_name, const at::Tensor& k,
                    const at::Tensor& cos, const at::Tensor& sin) {
  check_float_tensor(op, q_name, q);
  check_float_tensor(op, k_name, k);
  check_float_tensor(op, "cos", cos);
  check_float_tensor(op, "sin", sin);
  check_same(op, k_name, k, q_name, q);
  check_same(op, "cos", cos, q_name, q);
  check_same(op, "sin", sin, q_name, q);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "kernels.", op, ": ", q_name, " and ", k_name,
              " must be 4-D (batch, heads, tokens, head dim), got shapes ", shape_str(q.sizes()), " and ",
              shape_str(k.sizes()));
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.size(3) == q.size(3), "kernels.", op, ": ",
              k_name, " has shape ", shape_str(k.sizes()), " but ", q_name, " has shape ", shape_str(q.sizes()),
              " (batch, tokens and head dim must match)");
  TORCH_CHECK(q.size(3) % 2 == 0, "kernels.", op, ": the head dim must be even (its halves are rotated together), got ",
              std::to_string(q.size(3)));
  TORCH_CHECK(cos.dim() == 3 && sin.sizes() == cos.sizes() && cos.size(1) == q.size(2) && cos.size(2) == q.size(3) &&
                  (cos.size(0) == 1 || cos.size(0) == q.size(0)),
              "kernels.", op, ": cos and sin must both be (batch or 1, tokens, head dim) = (",
              std::to_string(q.size(0)), " or 1, ", std::to_string(q.size(2)), ", ", std::to_string(q.size(3)),
              "), got ", shape_str(cos.sizes()), " and ", shape_str(sin.sizes()));
}

#ifdef KERNELS_WITH_CUDA
Heads heads_of(const at::Tensor& t) {
  return Heads{t.const_data_ptr(), t.size(0), t.size(1), t.size(2), t.size(3),
               t.stride(0),        t.stride(1), t.stride(2), t.stride(3)};
}

std::tuple<at::Tensor, at::Tensor> rotate_cuda(const char* op, const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& cos, const at::Tensor& sin, bool transposed) {
  const c10::cuda::CUDAGuard guard(q.device());
  // The angles read with one set of strides: both contiguous where theirs differ.
  const at::Tensor s = sin.strides() == cos.strides() ? sin : sin.contiguous();
  const at::Tensor c = sin.strides() == cos.strides() ? cos : cos.contiguous();
  const Angles angles{c.const_data_ptr(), s.const_data_ptr(), c.size(0), c.stride(0), c.stride(1), c.stride(2)};
  // The results laid out as q and k (eager's element-wise ops keep their operands' layout, the projections' view).
  at::Tensor q_out = at::empty_like(q), k_out = at::empty_like(k);
  const cudaError_t err =
      launch_rotary_embedding(element_type(q.scalar_type()), heads_of(q), heads_of(k), angles, heads_of(q_out),
                              heads_of(k_out), transposed, forced_generic.load(),
                              c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  TORCH_CHECK(err == cudaSuccess, "kernels: the ", op, " kernel failed to launch: ", cudaGetErrorString(err));
  return {q_out, k_out};
}
#endif

std::tuple<at::Tensor, at::Tensor> rotate(const char* op, const char* q_name, const at::Tensor& q,
                                          const char* k_name, const at::Tensor& k, const at::Tensor& cos,
                                          const at::Tensor& sin, bool transposed) {
  check_operands(op, q_name, q, k_name, k, cos, sin);
#ifdef KERNELS_WITH_CUDA
  if (q.is_cuda()) return rotate_cuda(op, q, k, cos, sin, transposed);
#endif
  TORCH_CHECK(q.is_cpu() || q.is_cuda(), "kernels.", op, ": no implementation for tensors on ", q.device().str());
  return rotary_embedding_aten(q, k, cos, sin, transposed);
}

// ---- ops --------------------------------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                    const at::Tensor& sin) {
  return rotate("rotary_embedding", "q", q, "k", k, cos, sin, /*transposed=*/false);
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding_backward(const at::Tensor& grad_q_embed,
                                                             const at::Tensor& grad_k_embed, const at::Tensor& cos,
                                                             const at::Tensor& sin) {
  return rotate("rotary_embedding_backward", "grad_q_embed", grad_q_embed, "grad_k_embed", grad_k_embed, cos, sin,
                /*transposed=*/true);
}

}  // namespace
}  // namespace kernels::rotary

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  m.def("rotary_embedding(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("rotary_embedding_backward(Tensor grad_q_embed, Tensor grad_k_embed, Tensor cos, Tensor sin) -> "
        "(Tensor, Tensor)");
  m.def("_rotary_force_generic(bool generic) -> bool");
  m.impl("_rotary_force_generic",
         torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &kernels::rotary::force_generic));
}

// The same functions serve both devices: each picks the CUDA kernel or the ATen formulas by the tensors' device.
#define KERNELS_ROTARY_IMPLS(m)                                            \
  m.impl("rotary_embedding", &kernels::rotary::rotary_embedding);          \
  m.impl("rotary_embedding_backward", &kernels::rotary::rotary_embedding_backward)

TORCH_LIBRARY_IMPL(kernels, CPU, m) { KERNELS_ROTARY_IMPLS(m); }
#ifdef KERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(kernels, CUDA, m) { KERNELS_ROTARY_IMPLS(m); }
#endif
#undef KERNELS_ROTARY_IMPLS
