"""Several GPUs: every op of the library run on cuda:1 while cuda:0 is the current device (results on cuda:1, equal
to eager's there, issued on cuda:1's current stream, nothing on cuda:0), two GPUs driven from two threads at once,
no CUDA context made on a GPU the job does not use, and DistributedDataParallel training over NCCL
(tools/checks/ddp_check.py under torchrun) equal to the same model built from the reference modules. These need two
GPUs and skip otherwise, except the check that every op of the library has a case here: it reads the op list from the
library itself, so a family or op added later fails it until it is covered."""

import contextlib
import copy
import math
import os
import re
import subprocess
import sys
import threading
import time
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import assert_bitwise_equal, run_on_two_processes
from kernels import loader
from kernels.attention.attention import attention
from kernels.causal_softmax.causal_softmax import causal_softmax
from kernels.gemm.gemm import (KEPT_SPLIT_MIN_PRODUCTS, SPLIT_PATHS, FusedLinear, forced_gemm_path, gemm_path,
                               gemm_paths)
from kernels.manifest import FAMILIES
from kernels.precision import (ALLCLOSE_TOLERANCE, CUBLAS_BF16X9_ERROR_RATIO_LIMIT, SPLIT_FP16_ERROR_FLOOR,
                               gradient_atol, relative_error)
from model_new import GemmMultiplyLeakyReLUModelNew, LeakyReLUModelNew
from reference import GemmMultiplyLeakyReLUModel
from distributed_helpers import NO_NVLINK_MULTICAST, grad_output_away_from_the_kink
from gemm_helpers import split_sweep_values

pytestmark = pytest.mark.slow  # processes on two GPUs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
requires_two_gpus = pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA GPUs")

FIRST, SECOND = torch.device("cuda", 0), torch.device("cuda", 1)
PATHS_ON_SECOND = gemm_paths(SECOND) if TWO_GPUS else ["cublas"]
PATHS_ON_BOTH = [p for p in PATHS_ON_SECOND if p in gemm_paths(FIRST)] if TWO_GPUS else ["cublas"]
SPLIT_SIZED = (1024, 2048, 2048)  # M, K, N: the automatic choice takes split_fp16 here on Hopper (all >= 1024),
# and at 2^32 multiply-adds a model called again under no_grad keeps its weight's split (gemm_weight_split)

# ---- the cases: one per family, each calling the family's ops through ModelNew, the functions and the ops ----------


class LeakyReLUCase:
    """The LeakyReLU family: ModelNew forward and backward, the ops called directly (in place at an offset, with a
    multiplier and its mask, the backward), against eager, bitwise. Odd length (the tail path), -0.0, Inf and NaN."""

    family = "leaky_relu"
    ops = {"leaky_relu", "leaky_relu_", "multiply_leaky_relu_", "leaky_relu_backward"}
    slope, multiplier = -0.3, -1.5

    def __str__(self):
        return "leaky_relu"

    def build(self, device):
        pass

    def draw(self, device, generator):
        x = torch.randn(4099, device=device, generator=generator)
        x[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
        return {"x": x, "grad": torch.randn(4099, device=device, generator=generator)}

    def ours(self, x, grad):
        leaf = x.clone().requires_grad_(True)
        y = LeakyReLUModelNew(self.slope)(leaf)
        y.backward(grad)
        op_leaf = x.clone().requires_grad_(True)
        y_op = torch.ops.kernels.leaky_relu(op_leaf, self.slope)
        y_op.backward(grad)
        in_place = x.clone()
        torch.ops.kernels.leaky_relu_(in_place[1:], self.slope)
        multiplied = x.clone()
        mask = torch.ops.kernels.multiply_leaky_relu_(multiplied, self.multiplier, self.slope, True)
        backward = torch.ops.kernels.leaky_relu_backward(grad, x, self.slope, 1.0)
        grad_leaf = grad.clone().requires_grad_(True)  # a graph recorded: the C++ node
        backward_graphed = torch.ops.kernels.leaky_relu_backward(grad_leaf, x, self.slope, 1.0)
        return {"module": y.detach(), "module grad": leaf.grad, "op": y_op.detach(), "op grad": op_leaf.grad,
                "in place": in_place, "multiplied": multiplied, "mask": mask, "backward": backward,
                "backward graphed": backward_graphed.detach()}

    def eager(self, x, grad):
        leaf = x.clone().requires_grad_(True)
        y = F.leaky_relu(leaf, self.slope)
        y.backward(grad)
        in_place = x.clone()
        F.leaky_relu(in_place[1:], self.slope, inplace=True)
        product = x * self.multiplier
        backward = torch.ops.aten.leaky_relu_backward(grad, x, self.slope, False)
        return {"module": y.detach(), "module grad": leaf.grad, "op": y.detach(), "op grad": leaf.grad,
                "in place": in_place, "multiplied": F.leaky_relu(product, self.slope), "mask": product > 0,
                "backward": backward, "backward graphed": backward}

    def check(self, got, expected, inputs):
        for name in expected:
            if expected[name].dtype == torch.bool:
                assert torch.equal(got[name], expected[name]), name
            else:
                assert_bitwise_equal(got[name], expected[name])


class GeluTanhCase:
    """The GELU (tanh) family: the function forward and backward, and the backward op called directly, against the
    formula in float64 (odd length: the tail path; an offset view: the scalar path; Inf and NaN)."""

    family = "gelu_tanh"
    ops = {"gelu_tanh", "gelu_tanh_backward"}

    def __str__(self):
        return "gelu_tanh"

    def build(self, device):
        pass

    def draw(self, device, generator):
        x = torch.randn(4099, device=device, generator=generator) * 3
        x[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
        return {"x": x, "grad": torch.randn(4099, device=device, generator=generator)}

    def ours(self, x, grad):
        from kernels.functional import gelu_tanh

        leaf = x.clone().requires_grad_(True)
        y = gelu_tanh(leaf)
        y.backward(grad)
        return {"y": y.detach(), "grad": leaf.grad, "offset": gelu_tanh(x[1:]),
                "backward": torch.ops.kernels.gelu_tanh_backward(grad, x)}

    def eager(self, x, grad):
        x64 = x.double().requires_grad_(True)
        y = 0.5 * x64 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * torch.pow(x64, 3.0))))
        (g,) = torch.autograd.grad(y, x64, grad.double())
        return {"y": y.detach().float(), "grad": g.float(), "offset": y.detach()[1:].float(), "backward": g.float()}

    def check(self, got, expected, inputs):
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, equal_nan=True, msg=name)


class RmsNormCase:
    """The RMSNorm family: the function forward and backward (its C++ node calls the backward op), against the formula
    in float64 (rows of 16-byte packs, odd rows of single elements, a row with an Inf)."""

    family = "rms_norm"
    ops = {"rms_norm", "rms_norm_backward"}
    eps = 1e-6

    def __str__(self):
        return "rms_norm"

    def build(self, device):
        pass

    def draw(self, device, generator):
        draws = {}
        for name, shape in (("packs", (64, 1024)), ("odd", (33, 13))):
            x = torch.randn(*shape, device=device, generator=generator) * 3
            draws[name] = x
            draws[f"{name} weight"] = torch.randn(shape[-1], device=device, generator=generator) * 0.5 + 1
            draws[f"{name} grad"] = torch.randn(*shape, device=device, generator=generator)
        draws["packs"][5, 3] = float("inf")
        return draws

    @staticmethod
    def run(fn, inputs, dtype):
        outputs = {}
        for name in ("packs", "odd"):
            # Fresh leaves: a float32 .to() would return the input itself and mark it for the next call.
            leaf = inputs[name].to(dtype, copy=True).requires_grad_(True)
            weight = inputs[f"{name} weight"].to(dtype, copy=True).requires_grad_(True)
            y = fn(leaf, weight)
            y.backward(inputs[f"{name} grad"].to(dtype))
            outputs.update({name: y.detach().float(), f"{name} grad": leaf.grad.float(),
                            f"{name} weight grad": weight.grad.float()})
        return outputs

    def ours(self, **inputs):
        from kernels.functional import rms_norm

        return self.run(lambda x, weight: rms_norm(x, weight, self.eps), inputs, torch.float32)

    def eager(self, **inputs):
        def formula(x, weight):
            return weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps))

        return self.run(formula, inputs, torch.float64)

    def check(self, got, expected, inputs):
        for name in expected:
            atol = 1e-5 * max(1.0, float(expected[name].nan_to_num().abs().max()))
            torch.testing.assert_close(got[name], expected[name], atol=atol, rtol=1e-5, equal_nan=True, msg=name)


class LayerNormCase:
    """The LayerNorm family: the function forward and backward (its C++ node calls the backward op), against the
    formula in float64 (rows of 16-byte packs in groups of rows, odd rows of single elements, rows the block takes, a
    row with an Inf), and add_layer_norm on the packed rows with a residual (both outputs used: the backward adds the
    sum's gradient)."""

    family = "layer_norm"
    ops = {"layer_norm", "add_layer_norm", "layer_norm_backward", "_layer_norm_leaving_row_split",
           "_add_layer_norm_leaving_row_split"}
    eps = 1e-5

    def __str__(self):
        return "layer_norm"

    def build(self, device):
        pass

    def draw(self, device, generator):
        draws = {}
        for name, shape in (("packs", (64, 768)), ("odd", (33, 13)), ("long", (9, 4096))):
            draws[name] = torch.randn(*shape, device=device, generator=generator) * 3 + 1
            draws[f"{name} weight"] = torch.randn(shape[-1], device=device, generator=generator) * 0.5 + 1
            draws[f"{name} bias"] = torch.randn(shape[-1], device=device, generator=generator) * 0.5
            draws[f"{name} grad"] = torch.randn(*shape, device=device, generator=generator)
        draws["packs"][5, 3] = float("inf")
        draws["residual"] = torch.randn(64, 768, device=device, generator=generator)
        draws["sum grad"] = torch.randn(64, 768, device=device, generator=generator)
        return draws

    @staticmethod
    def run(fn, add_fn, inputs, dtype):
        outputs = {}
        for name in ("packs", "odd", "long"):
            leaves = [inputs[key].to(dtype, copy=True).requires_grad_(True)  # fresh leaves, as RMSNormCase's
                      for key in (name, f"{name} weight", f"{name} bias")]
            y = fn(*leaves)
            y.backward(inputs[f"{name} grad"].to(dtype))
            outputs.update({name: y.detach().float(), f"{name} grad": leaves[0].grad.float(),
                            f"{name} weight grad": leaves[1].grad.float(), f"{name} bias grad": leaves[2].grad.float()})
        # x: the residual's rows in reverse (finite rows of 768)
        leaves = [t.to(dtype, copy=True).requires_grad_(True) for t in (
            inputs["residual"].flip(0), inputs["residual"], inputs["packs weight"], inputs["packs bias"])]
        total, y = add_fn(*leaves)
        torch.autograd.backward((total, y), (inputs["sum grad"].to(dtype), inputs["packs grad"].to(dtype)))
        outputs.update({"add sum": total.detach().float(), "add y": y.detach().float(),
                        "add x grad": leaves[0].grad.float(), "add residual grad": leaves[1].grad.float(),
                        "add weight grad": leaves[2].grad.float()})
        return outputs

    def ours(self, **inputs):
        from kernels.functional import add_layer_norm, layer_norm

        outputs = self.run(lambda x, weight, bias: layer_norm(x, weight, bias, self.eps),
                           lambda x, residual, weight, bias: add_layer_norm(x, residual, weight, bias, self.eps),
                           inputs, torch.float32)
        with torch.no_grad():  # the leaving ops (their split is left on the inputs' GPU, read by no product here)
            parameters = (inputs["packs weight"], inputs["packs bias"], self.eps)
            outputs["leaving y"] = torch.ops.kernels._layer_norm_leaving_row_split(inputs["packs"], *parameters)
            outputs["leaving add sum"], outputs["leaving add y"] = (
                torch.ops.kernels._add_layer_norm_leaving_row_split(inputs["residual"].flip(0), inputs["residual"],
                                                                    *parameters))
        return outputs

    def eager(self, **inputs):
        def add_norm(x, residual, weight, bias):
            total = x + residual
            return total, F.layer_norm(total, total.shape[-1:], weight, bias, self.eps)

        outputs = self.run(lambda x, weight, bias: F.layer_norm(x, x.shape[-1:], weight, bias, self.eps), add_norm,
                           inputs, torch.float64)
        outputs["leaving y"], outputs["leaving add sum"], outputs["leaving add y"] = (
            outputs["packs"], outputs["add sum"], outputs["add y"])
        return outputs

    def check(self, got, expected, inputs):
        for name in expected:
            atol = 1e-5 * max(1.0, float(expected[name].nan_to_num().abs().max()))
            torch.testing.assert_close(got[name], expected[name], atol=atol, rtol=1e-5, equal_nan=True, msg=name)


class SiluMulCase:
    """The SwiGLU gate family: the function forward and backward (its C++ node calls the backward op), against F.silu(
    gate) * up in float64 (16-byte packs; an odd offset view: single elements)."""

    family = "silu_mul"
    ops = {"silu_mul", "silu_mul_backward"}

    def __str__(self):
        return "silu_mul"

    def build(self, device):
        pass

    def draw(self, device, generator):
        return {name: torch.randn(4097, device=device, generator=generator) * 3 for name in ("gate", "up", "grad")}

    @staticmethod
    def run(fn, gate, up, grad, dtype):
        outputs = {}
        for name, view in (("aligned", slice(0, 4096)), ("offset", slice(1, 4097))):
            g = gate[view].to(dtype).requires_grad_(True)
            u = up[view].to(dtype).requires_grad_(True)
            y = fn(g, u)
            y.backward(grad[view].to(dtype))
            outputs.update({name: y.detach().float(), f"{name} grad_gate": g.grad.float(),
                            f"{name} grad_up": u.grad.float()})
        return outputs

    def ours(self, gate, up, grad):
        from kernels.functional import silu_mul

        return self.run(silu_mul, gate, up, grad, torch.float32)

    def eager(self, gate, up, grad):
        return self.run(lambda g, u: F.silu(g) * u, gate, up, grad, torch.float64)

    def check(self, got, expected, inputs):
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)


class RotaryCase:
    """The rotary embedding family: the function forward and backward (its C++ node calls the backward op), against
    the formula in float64 (q as the projections' transposed view, fewer kv heads, angles of one batch)."""

    family = "rotary"
    ops = {"rotary_embedding", "rotary_embedding_backward"}

    def __str__(self):
        return "rotary"

    def build(self, device):
        pass

    def draw(self, device, generator):
        draws = {"q": torch.randn(2, 33, 4, 64, device=device, generator=generator),
                 "k": torch.randn(2, 2, 33, 64, device=device, generator=generator)}
        draws.update({name: torch.randn(1, 33, 64, device=device, generator=generator) for name in ("cos", "sin")})
        draws.update({f"{name} grad": torch.randn_like(draws[name]) for name in ("q", "k")})
        return draws

    @staticmethod
    def run(fn, inputs, dtype):
        q = inputs["q"].to(dtype).transpose(1, 2).requires_grad_(True)  # (batch, heads, tokens, dim), a view
        k = inputs["k"].to(dtype, copy=True).requires_grad_(True)
        outputs = fn(q, k, inputs["cos"].to(dtype), inputs["sin"].to(dtype))
        grads = [inputs["q grad"].to(dtype).transpose(1, 2), inputs["k grad"].to(dtype)]
        torch.autograd.backward(outputs, grads)
        return {"q": outputs[0].detach().float(), "k": outputs[1].detach().float(), "q grad": q.grad.float(),
                "k grad": k.grad.float()}

    def ours(self, **inputs):
        from kernels.functional import rotary_embedding

        return self.run(rotary_embedding, inputs, torch.float32)

    def eager(self, **inputs):
        def rotate(q, k, cos, sin):
            def rotate_half(x):
                return torch.cat((-x[..., 32:], x[..., :32]), dim=-1)

            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

        return self.run(rotate, inputs, torch.float64)

    def check(self, got, expected, inputs):
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)


class GemmCase:
    """The GEMM family: ModelNew forward and backward on one path ("auto": the automatic choice), against eager fp32:
    outputs and gradients as check() says."""

    family = "gemm"

    def __init__(self, shape, multiplier, slope, path):
        self.shape, self.multiplier, self.slope, self.path = shape, multiplier, slope, path
        self.reference = self.new = None
        # The backward through autograd; from KEPT_SPLIT_MIN_PRODUCTS multiply-adds on, FusedLinear asks for the
        # weight's split from the second no_grad call on (an empty list where the path takes none).
        self.ops = {"gemm_multiply_leaky_relu", "gemm_multiply_leaky_relu_backward"}
        if math.prod(shape) >= KEPT_SPLIT_MIN_PRODUCTS:
            self.ops.add("gemm_weight_split")

    def __str__(self):
        m, k, n = self.shape
        return f"gemm {m}x{k}->{n} multiplier={self.multiplier} slope={self.slope} path={self.path}"

    def build(self, device):
        """Both models, with the same weights, on `device`. Seeds the global generator: call from one thread."""
        _, k, n = self.shape
        torch.manual_seed(0)
        self.reference = GemmMultiplyLeakyReLUModel(k, n, self.multiplier, self.slope).to(device)
        self.new = GemmMultiplyLeakyReLUModelNew(k, n, self.multiplier, self.slope).to(device)
        self.new.load_state_dict(self.reference.state_dict())

    def draw(self, device, generator):
        m, k, _ = self.shape
        x = torch.randn(m, k, device=device, generator=generator)
        with torch.no_grad():
            pre = self.reference.gemm(x) * self.multiplier
        return {"x": x, "grad": grad_output_away_from_the_kink(pre, generator)}

    @staticmethod
    def run(model, x, grad):
        model.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_(True)
        y = model(leaf)
        y.backward(grad)
        return {"y": y.detach(), "x grad": leaf.grad, "weight grad": model.gemm.weight.grad,
                "bias grad": model.gemm.bias.grad}

    def ours(self, x, grad):
        with forced_gemm_path(self.path):
            outputs = self.run(self.new, x, grad)
            with torch.no_grad():
                for _ in range(3):  # on a split path, the third call reads the weight's split kept by the second
                    outputs["y, weight split kept"] = self.new(x)
        return outputs

    def eager(self, x, grad):
        outputs = self.run(self.reference, x, grad)
        outputs["y, weight split kept"] = outputs["y"]
        return outputs

    def check(self, got, expected, inputs):
        """The outputs: allclose(1e-4) against eager's and an error against float64 no larger than eager's (or than
        the split path's floor where it is forced below its range; the forced cublas_bf16x9 path's within
        CUBLAS_BF16X9_ERROR_RATIO_LIMIT of it). The gradients: allclose against eager's at rtol 1e-4 and
        gradient_atol (kernels/precision.py: eager's own rounding scales with the gradient)."""
        tol = ALLCLOSE_TOLERANCE[torch.float32]
        for name in expected:
            atol = tol if name.startswith("y") else gradient_atol(expected[name])
            torch.testing.assert_close(got[name], expected[name], atol=atol, rtol=tol, msg=name)
        with torch.no_grad():
            y64 = copy.deepcopy(self.reference).double()(inputs["x"].double())
        ours, eager = relative_error(got["y"], y64), relative_error(expected["y"], y64)
        below_split_range = self.path in SPLIT_PATHS and min(self.shape) < 1024
        limit = max(eager, SPLIT_FP16_ERROR_FLOOR) if below_split_range else eager
        if self.path == "cublas_bf16x9":
            limit *= CUBLAS_BF16X9_ERROR_RATIO_LIMIT
        assert ours <= limit, f"error against float64 {ours:.3g}, eager's {eager:.3g}"


class CausalSoftmaxCase:
    """The causal softmax family: the function forward and backward (its C++ node calls the backward op), against
    eager's scale, causal masked_fill and softmax, allclose(1e-5). Rows of both kernel paths (a warp's, a block's),
    NaN at a masked entry (never read)."""

    family = "causal_softmax"
    ops = {"causal_softmax", "causal_softmax_backward"}
    scale = 0.125

    def __str__(self):
        return "causal_softmax"

    def build(self, device):
        pass

    def draw(self, device, generator):
        draws = {}
        for name, shape in (("short", (2, 3, 40, 40)), ("long", (1, 9, 2000))):
            scores = torch.randn(*shape, device=device, generator=generator)
            scores[..., 0, -1] = float("nan")
            draws[name] = scores
            draws[f"{name} grad"] = torch.randn(*shape, device=device, generator=generator)
        return draws

    @staticmethod
    def run(fn, inputs, scale):
        outputs = {}
        for name in ("short", "long"):
            leaf = inputs[name].clone().requires_grad_(True)
            y = fn(leaf, scale)
            y.backward(inputs[f"{name} grad"])
            outputs[name], outputs[f"{name} grad"] = y.detach(), leaf.grad
        return outputs

    def ours(self, **inputs):
        return self.run(causal_softmax, inputs, self.scale)

    def eager(self, **inputs):
        def steps(scores, scale):
            rows, columns = scores.shape[-2:]
            masked = torch.ones(rows, columns, dtype=torch.bool, device=scores.device).triu(columns - rows + 1)
            return torch.softmax((scores * scale).masked_fill(masked, float("-inf")), dim=-1)

        return self.run(steps, inputs, self.scale)

    def check(self, got, expected, inputs):
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)


class AttentionCase:
    """The attention family: its forward without a gradient (the split kernels; one head out of range, on the plain
    path) and with one (eager's backward), against eager's F.scaled_dot_product_attention."""

    family = "attention"
    ops = {"attention"}

    def __str__(self):
        return "attention"

    def build(self, device):
        pass

    def draw(self, device, generator):
        q, k, v = (torch.randn(2, 4, 70, 64, device=device, generator=generator) for _ in range(3))
        q[1, 2, 5] *= 2.0 ** 50  # a row past the split's range: its head on the plain path
        return {"q": q, "k": k, "v": v, "grad": torch.randn(2, 4, 70, 64, device=device, generator=generator)}

    @staticmethod
    def run(fn, q, k, v, grad):
        with torch.no_grad():
            outputs = {"no_grad": fn(q, k, v), "no_grad causal": fn(q, k, v, is_causal=True)}
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        fn(*leaves, is_causal=True).backward(grad)
        outputs.update({f"{name} grad": t.grad for name, t in zip("qkv", leaves)})
        return outputs

    def ours(self, **inputs):
        return self.run(attention, **inputs)

    def eager(self, **inputs):
        return self.run(torch.nn.functional.scaled_dot_product_attention, **inputs)

    def check(self, got, expected, inputs):
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)


class SplitSweepCase:
    """The GEMM family's split sweeps alone (torch.ops.kernels._gemm_split_sweep, every sweep): the matrix each holds,
    (hi + lo) 2^-e, against the rows it split, to ~22 bits of each row's largest value."""

    family = "gemm"
    ops = {"_gemm_split_sweep"}
    sweeps = ("rows", "rows_natural", "columns", "chunks", "chunks_natural", "chunks_transposed")

    def __str__(self):
        return "split sweeps"

    def build(self, device):
        pass

    def draw(self, device, generator):
        return {"src": torch.randn(70, 136, device=device, generator=generator)}

    def ours(self, src):
        outputs = {}
        for sweep in self.sweeps:
            hi, lo, exponent, *_ = torch.ops.kernels._gemm_split_sweep(src, sweep)
            rows = src.t() if sweep in ("columns", "chunks_transposed") else src
            if sweep in ("rows", "chunks"):  # the GEMM's order within each chunk of 64, padding included: sorted
                values, _ = split_sweep_values(hi, lo, exponent, hi.shape[1])
                values = values.unflatten(1, (-1, 64)).sort(2).values
            else:
                values, _ = split_sweep_values(hi, lo, exponent, rows.shape[1])
            outputs[sweep] = values
        return outputs

    def eager(self, src):
        expected = {}
        for sweep in self.sweeps:
            rows = (src.t() if sweep in ("columns", "chunks_transposed") else src).double()
            if sweep in ("rows", "chunks"):
                rows = F.pad(rows, (0, -rows.shape[1] % 64)).unflatten(1, (-1, 64)).sort(2).values
            expected[sweep] = rows
        return expected

    def check(self, got, expected, inputs):
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=0, msg=name)


class GemmGeluCase:
    """gemm_gelu on one path: the op (both GELUs; a transposed weight view, as Conv1D's) and FusedLinear.forward_gelu
    with the weight's split kept from its second call, against eager's nn.Linear then GELU at 1e-4; a training call's
    gradients (its one node: the pre-activation written beside y, the GELU's gradient made in grad_x's row split)
    against eager's at gradient_atol."""

    family = "gemm"
    ops = {"gemm_gelu", "_gemm_gelu_with_pre", "gemm_gelu_backward"}

    def __init__(self, path):
        self.path = path
        self.layer = None

    def __str__(self):
        return f"gemm_gelu path={self.path}"

    def build(self, device):
        _, k, n = SPLIT_SIZED
        torch.manual_seed(0)
        self.layer = FusedLinear(k, n).to(device)

    def draw(self, device, generator):
        m, k, _ = SPLIT_SIZED
        return {"x": torch.randn(m, k, device=device, generator=generator)}

    def ours(self, x):
        from kernels.functional import gemm_gelu

        weight, bias = self.layer.weight, self.layer.bias
        stored_transposed = weight.detach().t().contiguous()
        with forced_gemm_path(self.path), torch.no_grad():
            outputs = {"erf": gemm_gelu(x, weight, bias), "tanh": gemm_gelu(x, weight, bias, "tanh"),
                       "transposed view": gemm_gelu(x, stored_transposed.t(), bias)}
            for _ in range(3):  # on a split path, the third call reads the split kept by the second
                outputs["module, weight split kept"] = self.layer.forward_gelu(x)
        with forced_gemm_path(self.path):
            outputs.update(self.gradients(gemm_gelu, x))
        return outputs

    def gradients(self, function, x):
        leaf = x.clone().requires_grad_(True)
        y = function(leaf, self.layer.weight, self.layer.bias)
        grads = torch.autograd.grad(y, (leaf, self.layer.weight, self.layer.bias), torch.ones_like(y) / 7)
        return {"training y": y.detach(), **{f"{name} grad": g for name, g in zip(("x", "weight", "bias"), grads)}}

    def eager(self, x):
        with torch.no_grad():
            product = F.linear(x, self.layer.weight, self.layer.bias)
            erf = F.gelu(product)
            outputs = {"erf": erf, "tanh": F.gelu(product, approximate="tanh"), "transposed view": erf,
                       "module, weight split kept": erf}
        outputs.update(self.gradients(lambda *a: F.gelu(F.linear(*a)), x))
        return outputs

    def check(self, got, expected, inputs):
        tol = ALLCLOSE_TOLERANCE[torch.float32]
        for name in expected:
            atol = gradient_atol(expected[name]) if name.endswith("grad") else tol
            torch.testing.assert_close(got[name], expected[name], atol=atol, rtol=tol, msg=name)


GEMM_CASES = [GemmCase(shape, multiplier, slope, path)
              for path in PATHS_ON_SECOND
              for shape, multiplier, slope in [((40, 136, 72), -1.5, -0.2), ((40, 136, 72), 2.0, 0.1),
                                               (SPLIT_SIZED, 2.0, 0.1)]]
GEMM_CASES.append(GemmCase(SPLIT_SIZED, -1.5, -0.2, "auto"))
GEMM_CASES += [GemmGeluCase(path) for path in PATHS_ON_SECOND]
CASES = [LeakyReLUCase(), GeluTanhCase()] + GEMM_CASES + [SplitSweepCase(), CausalSoftmaxCase(), RmsNormCase(),
                                                          LayerNormCase(), SiluMulCase(), RotaryCase(),
                                                          AttentionCase()]


def ops_that_compute():
    """The name of every op the library's families define (their m.def schemas in the manifest's C++ sources, so
    ops that tests register for themselves are left out) that takes a tensor and returns or writes one: what must
    run right on any device. Settings and queries (a string result) are left out."""
    defined = set()
    for family in FAMILIES:
        for path in (*family.cpp_sources, *family.autograd_sources):
            with open(os.path.join(loader.SOURCE_ROOT, path), encoding="utf-8") as f:
                defined |= set(re.findall(r'm\.def\(\s*"(\w+)\(', f.read()))
    names = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, name = qualified.partition("::")
        name = name.split(".")[0]
        if namespace != "kernels" or name not in defined:
            continue
        packet = getattr(torch.ops.kernels, name)
        for overload in packet.overloads():
            schema = getattr(packet, overload)._schema
            takes_tensor = any("Tensor" in str(a.type) for a in schema.arguments)
            returns_tensor = any("Tensor" in str(r.type) for r in schema.returns)
            writes_tensor = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
            if takes_tensor and (returns_tensor or writes_tensor):
                names.add(name)
    return names


def test_every_family_and_op_of_the_library_has_a_case_here():
    covered = set().union(*(case.ops for case in CASES))
    assert {family.name for family in FAMILIES} <= {case.family for case in CASES}
    assert ops_that_compute() <= covered, f"ops without a multi-GPU case: {sorted(ops_that_compute() - covered)}"


# ---- one GPU's work, with another GPU current ----------------------------------------------------------------------

class RecordedOps(TorchDispatchMode):
    """Records the name of every op that reaches the dispatcher's Python key inside the block."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._schema.name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def current_stream_of(stream):
    """Makes `stream` the current stream of its device while the current device stays what it was:
    torch.cuda.stream alone would make the stream's device current too, and hide a kernel that lacks its guard."""
    device = torch.cuda.current_device()
    with torch.cuda.stream(stream), torch.cuda.device(device):
        yield


def sleep_cycles_per_second(device):
    """How many cycles of torch.cuda._sleep make a second on `device`, from one timed sleep."""
    with torch.cuda.device(device):
        torch.cuda._sleep(1 << 16)  # the first launch loads the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(1 << 26)
        end.record()
        end.synchronize()
        return (1 << 26) / (start.elapsed_time(end) / 1000)


@pytest.fixture(scope="module")
def sleep_rates():
    """The sleep rates of both GPUs, after one unjudged pass through run_on_second_gpu_with_first_busy: its first
    use in a process pays one-time host costs (about 3 s on the 2 x H200 machine) between cuda:0's sleep and cuda:1's
    work, which made the first case judged fail even for eager's own work."""
    rates = [sleep_cycles_per_second(FIRST), sleep_cycles_per_second(SECOND)]
    x = torch.ones(8, device=SECOND)
    try:
        run_on_second_gpu_with_first_busy(lambda x: {"x": x + 1}, {"x": x}, rates, 0.01, 0.05)
    except AssertionError:
        pass
    return rates


def run_on_second_gpu_with_first_busy(compute, inputs, sleep_rates, delay_s, busy_s):
    """compute(**copies of `inputs`), with cuda:0 current and a new stream current on cuda:1. The copies are
    NaN until written on that stream after a `delay_s` sleep there, so work issued on any other stream reads NaN.
    cuda:0's stream sleeps for `busy_s` meanwhile: work issued there, or a wait on it, would not be done when cuda:1
    is. Checks that cuda:0 is still asleep once cuda:1 is done (nothing waited on it), that nothing was allocated on
    it, and that cuda:0 is still the current device. Returns the outputs and the ops that ran."""
    ready = {name: torch.full_like(t, float("nan")) for name, t in inputs.items()}
    stream = torch.cuda.Stream(SECOND)
    torch.cuda.synchronize(FIRST)
    torch.cuda.synchronize(SECOND)
    held_on_first = torch.cuda.memory_allocated(FIRST)
    torch.cuda.reset_peak_memory_stats(FIRST)
    recorded = RecordedOps()
    with current_stream_of(stream):
        assert torch.cuda.current_device() == 0 and torch.cuda.current_stream(SECOND) == stream
        torch.cuda._sleep(int(busy_s * sleep_rates[0]))  # on cuda:0, the current device
        with torch.cuda.device(SECOND):
            torch.cuda._sleep(int(delay_s * sleep_rates[1]))
        with recorded:
            with torch.no_grad():
                for name, t in inputs.items():
                    ready[name].copy_(t)
            outputs = compute(**ready)
        assert torch.cuda.current_device() == 0, "an op left cuda:1 current"
    torch.cuda.synchronize(SECOND)
    first_still_asleep = not torch.cuda.current_stream(FIRST).query()
    peak_on_first = torch.cuda.max_memory_allocated(FIRST)
    torch.cuda.synchronize(FIRST)
    assert first_still_asleep, f"cuda:0 finished its {busy_s:.2f} s sleep before cuda:1 was done: something waited on it"
    assert peak_on_first == held_on_first, f"{peak_on_first - held_on_first} bytes allocated on cuda:0"
    return outputs, {name.partition("::")[2] for name in recorded.names if name.startswith("kernels::")}


@requires_two_gpus
@pytest.mark.parametrize("case", CASES, ids=str)
def test_ops_run_on_the_inputs_gpu_and_its_current_stream(case, sleep_rates):
    torch.cuda.set_device(FIRST)
    case.build(SECOND)
    inputs = case.draw(SECOND, torch.Generator(SECOND).manual_seed(1))
    if isinstance(case, GemmCase) and case.path == "auto" and "split_fp16" in PATHS_ON_SECOND:
        assert gemm_path(inputs["x"], case.new.gemm.weight) == "split_fp16"
    # Ours and eager's twice each without the sleeps: the first calls load kernels and make cuBLAS handles; the
    # second's time sizes the sleeps, so that cuda:0 sleeps well past the end of cuda:1's work.
    for _ in range(2):
        seconds = 0.0
        for compute in (case.ours, case.eager):
            start = time.perf_counter()
            compute(**inputs)
            torch.cuda.synchronize(SECOND)
            seconds = max(seconds, time.perf_counter() - start)
    delay_s, busy_s = 0.1, 0.1 + 5 * seconds + 0.25
    expected = case.eager(**inputs)
    # Eager's own work through the same harness first: if it fails there, the harness does not hold on this
    # machine, and the library cannot be judged by it.
    try:
        control, _ = run_on_second_gpu_with_first_busy(case.eager, inputs, sleep_rates, delay_s, busy_s)
    except AssertionError as error:
        pytest.skip(f"eager's own work fails this harness here: {error}")
    case.check(control, expected, inputs)
    got, ran = run_on_second_gpu_with_first_busy(case.ours, inputs, sleep_rates, delay_s, busy_s)
    assert case.ops <= ran, f"ops not reached: {sorted(case.ops - ran)}"
    assert all(t.device == SECOND for t in got.values()), {name: t.device for name, t in got.items()}
    case.check(got, expected, inputs)


# ---- two GPUs from two threads ------------------------------------------------------------------------------------

@requires_two_gpus
@pytest.mark.parametrize("path", PATHS_ON_BOTH)
def test_two_gpus_driven_from_two_threads_at_once(path):
    """Each thread loops forward and backward of both families on its own GPU, with fresh inputs every time, each
    result checked against eager on that GPU; both start together."""
    iterations = 30
    cases = {index: [LeakyReLUCase(), GemmCase(SPLIT_SIZED, -1.5, -0.2, path)] for index in (0, 1)}
    for index, device_cases in cases.items():
        for case in device_cases:
            case.build(torch.device("cuda", index))  # seeds the global generator: here, not in the threads
    start = threading.Barrier(2)
    failures = []

    def drive(index):
        try:
            device = torch.device("cuda", index)
            with torch.cuda.device(device):
                generator = torch.Generator(device).manual_seed(index)
                start.wait(timeout=60)
                for _ in range(iterations):
                    for case in cases[index]:
                        inputs = case.draw(device, generator)
                        got = case.ours(**inputs)
                        assert all(t.device == device for t in got.values())
                        case.check(got, case.eager(**inputs), inputs)
                assert torch.cuda.current_device() == index
        except BaseException:  # reported by the main thread
            failures.append(f"cuda:{index}: {traceback.format_exc()}")

    with forced_gemm_path(path):  # one setting for the process: both threads see it
        threads = [threading.Thread(target=drive, args=(index,), daemon=True) for index in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
    assert not any(thread.is_alive() for thread in threads), "a thread still runs after 600 s: hung"
    assert not failures, "\n".join(failures)


# ---- no context on a GPU the process does not use -----------------------------------------------------------------

CONTEXT_PROBE = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torch
import torch.nn.functional as F
from kernels.functional import gemm_multiply_leaky_relu, leaky_relu
from kernels.gemm.gemm import forced_gemm_path, gemm_paths

device = torch.device("cuda", 1)
torch.manual_seed(0)
x = torch.randn(1024, 1024, device=device, requires_grad=True)
weight = (torch.randn(1024, 1024, device=device) / 32).requires_grad_(True)
bias = torch.randn(1024, device=device, requires_grad=True)
F.leaky_relu(F.linear(x, weight, bias) * 2.0, 0.1).sum().backward()
F.leaky_relu(x, -0.3).sum().backward()
torch.cuda.synchronize(device)
print("eager made a context on cuda:0:", torch._C._cuda_hasPrimaryContext(0))
x_wide, weight_wide = torch.randn(1024, 2048, device=device), torch.randn(2048, 2048, device=device)
for path in gemm_paths(device):
    with forced_gemm_path(path):
        gemm_multiply_leaky_relu(x, weight, bias, 2.0, 0.1).sum().backward()
        gemm_multiply_leaky_relu(x, weight, bias, -1.5, -0.2).sum().backward()
        torch.ops.kernels.gemm_weight_split(x_wide, weight_wide)  # 2^32 multiply-adds: a split where the path takes one
leaky_relu(x, -0.3).sum().backward()
torch.cuda.synchronize(device)
print("the library made a context on cuda:0:", torch._C._cuda_hasPrimaryContext(0))
"""


@requires_two_gpus
def test_a_process_that_uses_only_cuda_1_makes_no_context_on_cuda_0():
    """A process of a multi-GPU job that uses only its own GPU must not hold a context (hundreds of MB) on GPU 0.
    Runs in a fresh process, where nothing has touched cuda:0; eager's same work first, as the control."""
    result = subprocess.run([sys.executable, "-c", CONTEXT_PROBE, ROOT], capture_output=True, text=True,
                            timeout=600, env=dict(os.environ, **NO_NVLINK_MULTICAST))
    assert result.returncode == 0, result.stderr[-4000:]
    lines = dict(line.rsplit(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    if lines["eager made a context on cuda:0"] == "True":
        pytest.skip("this torch makes a context on cuda:0 for eager work on cuda:1 already")
    assert lines["the library made a context on cuda:0"] == "False"


# ---- DistributedDataParallel ---------------------------------------------------------------------------------------

@requires_two_gpus
def test_distributed_data_parallel_trains_like_the_reference():
    """tools/checks/ddp_check.py on two processes, one GPU each, under torchrun (python -m torch.distributed.run)."""
    output = run_on_two_processes("tools/checks/ddp_check.py")
    summaries = [line[line.index("ddp_check rank"):] for line in output.splitlines() if "ddp_check rank" in line]
    assert len(summaries) == 2 and all(line.endswith(": ok") for line in summaries), output[-6000:]


# ---- tensor parallelism and FSDP2 -----------------------------------------------------------------------------------

@requires_two_gpus
def test_tensor_parallel_and_fsdp2_on_two_gpus():
    """tools/checks/tp_check.py on two processes, one GPU each, over NCCL (tests/test_tensor_parallel.py runs it on the
    CPU): every case at a small shape and at one whose local products take the split path on each rank."""
    from test_tensor_parallel import CASES, run_tp_check

    output = run_tp_check({})
    for case in CASES:
        for shape in ("12x64->40", "1024x2048->2048"):
            assert output.count(f"{case} {shape}: ok") == 2, output[-8000:]
