"""Any model on the library's GEMM: patch() turns a model's linear layers into the library's, in place, and
fp32_gemm() sends the functional products of a block (F.linear, matmul, @, mm, addmm) to it, and its
F.scaled_dot_product_attention calls to the library's attention.

    kernels.patch(model)          # nn.Linear, transformers' Conv1D and NewGELUActivation; unpatch(model) undoes it
    with kernels.fp32_gemm():     # F.linear, torch.matmul, @, mm, addmm, scaled_dot_product_attention
        loss = model(x).sum()

A patched layer keeps its Parameters, hooks and state_dict keys and stays an instance of its class (its class becomes
a subclass of that class); the kept weight split (FusedLinear) follows the weight's version counter, which writes
through `.data` do not advance: after one, call the layer's clear_weight_split().
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from kernels.attention.attention import attention
from kernels.gelu_tanh.gelu_tanh import gelu_tanh
from kernels.gemm.gemm import FusedLinear, gemm_multiply_leaky_relu, plain_linear_suffices, plain_product_suffices

# The original class -> its patched subclass.
_PATCHED_CLASSES = {}


class _Conv1DPatch:
    """transformers' Conv1D (y = x @ W + b, W stored as (in, out)) on the library's GEMM: W read through its
    transposed view, without a copy; Conv1D's own forward where no split can take the call."""

    def forward(self, x):
        weight = self.weight
        k, n = weight.shape
        if plain_product_suffices(x, n, k, weight.requires_grad):
            return super().forward(x)
        return gemm_multiply_leaky_relu(x, weight.t(), self.bias, 1.0, 1.0)


class _NewGELUPatch:
    """transformers' NewGELUActivation (GPT-2's "gelu_new", 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), six
    element-wise ops in eager) in one sweep over memory, forward and backward: kernels.gelu_tanh, the same formula
    rounded once."""

    def forward(self, input):
        return gelu_tanh(input)


def _transformers_class(module_name, name):
    """A transformers class where transformers is already imported (it is never imported here), else None."""
    return getattr(sys.modules.get(module_name), name, None)


def _conv1d_class():
    return _transformers_class("transformers.pytorch_utils", "Conv1D")


def _base_for_class(cls):
    """The mixin that patches instances of `cls`, or None: nn.Linear, transformers' Conv1D and NewGELUActivation and
    the subclasses that keep their forward (a subclass with a forward of its own computes something else)."""
    if issubclass(cls, nn.Linear) and cls.forward is nn.Linear.forward:
        return FusedLinear
    for module_name, name, base in (("transformers.pytorch_utils", "Conv1D", _Conv1DPatch),
                                    ("transformers.activations", "NewGELUActivation", _NewGELUPatch)):
        original = _transformers_class(module_name, name)
        if original is not None and issubclass(cls, original) and cls.forward is original.forward:
            return base
    return None


def _patch_base(module):
    """The mixin that patches `module`'s class, or None where patch() leaves it."""
    cls = type(module)
    if cls in _PATCHED_CLASSES.values():
        return None
    return _base_for_class(cls)


def _class_name(cls):
    # A module-level name that pickle looks up here and __getattr__ rebuilds in a new process: "patched$" then the
    # class's module and qualified name, dots as "$", the two joined by "$$".
    return "patched$" + cls.__module__.replace(".", "$") + "$$" + cls.__qualname__.replace(".", "$")


def _patched_class(cls, base):
    patched = _PATCHED_CLASSES.get(cls)
    if patched is None:
        name = _class_name(cls)
        patched = type(cls.__name__, (base, cls), {"__module__": __name__, "__qualname__": name})
        _PATCHED_CLASSES[cls] = patched
        globals()[name] = patched
    return patched


def __getattr__(name):
    """Rebuilds a patched class by its name (a pickled patched model loaded in a new process)."""
    if not name.startswith("patched$") or "$$" not in name:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, qualname = name[len("patched$"):].split("$$")
    import importlib

    cls = importlib.import_module(module_name.replace("$", "."))
    for part in qualname.split("$"):
        cls = getattr(cls, part)
    base = _base_for_class(cls)
    if base is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}: {cls.__qualname__} is not patched")
    return _patched_class(cls, base)


def patch(model):
    """Turns every nn.Linear of `model` (itself included), every transformers Conv1D and NewGELUActivation into the
    library's, in place, and returns `model`. Idempotent; subclasses with a forward of their own are left as they
    are."""
    for module in model.modules():
        base = _patch_base(module)
        if base is not None:
            module.__class__ = _patched_class(type(module), base)
            if base is FusedLinear:
                module.cache_weight_split = True
                module.clear_weight_split()
    return model


def unpatch(model):
    """Undoes patch(): every patched layer of `model` gets its own class back (and drops its kept split)."""
    originals = {patched: cls for cls, patched in _PATCHED_CLASSES.items()}
    for module in model.modules():
        original = originals.get(type(module))
        if original is not None:
            if isinstance(module, FusedLinear):
                module.clear_weight_split()
                for name in ("cache_weight_split", "_weight_split_key", "_weight_split",
                             "_weight_split_refused_rows"):
                    module.__dict__.pop(name, None)
            module.__class__ = original
    return model


def is_patched(module):
    """Whether patch() turned `module` into the library's."""
    return type(module) in _PATCHED_CLASSES.values()


# ---- the scoped mode ------------------------------------------------------------------------------------------------

def _plain(*tensors):
    """Plain tensors and Parameters (a subclass such as DTensor goes to eager, which knows it)."""
    return all(type(t) is torch.Tensor or type(t) is nn.Parameter for t in tensors)


def _linear_route(x, weight, bias=None):
    if _plain(x, weight) and (bias is None or _plain(bias)) and weight.dim() == 2 and x.dim() >= 1 and (
            not plain_linear_suffices(x, weight)):
        return gemm_multiply_leaky_relu(x, weight, bias, 1.0, 1.0)
    return NotImplemented


def _matmul_route(a, b):
    # a (..., k) times a matrix b (k x n): the linear layer of weight b^T. Batched products stay with eager.
    if _plain(a, b) and b.dim() == 2 and a.dim() >= 2:
        return _linear_route(a, b.t())
    return NotImplemented


def _mm_route(a, b):
    if _plain(a, b) and a.dim() == 2 and b.dim() == 2:
        return _linear_route(a, b.t())
    return NotImplemented


def _addmm_route(bias, a, b, *, beta=1, alpha=1):
    if beta == 1 and alpha == 1 and _plain(bias, a, b) and a.dim() == 2 and b.dim() == 2 and bias.dim() == 1 and (
            bias.shape[0] == b.shape[1]):
        return _linear_route(a, b.t(), bias)
    return NotImplemented


_CAPABLE_DEVICES = {}  # device index -> whether the attention kernels run there


def _attention_runs_on(device):
    capable = _CAPABLE_DEVICES.get(device.index)
    if capable is None:
        capable = _CAPABLE_DEVICES[device.index] = torch.cuda.get_device_capability(device) >= (8, 0)
    return capable


# The fewest keys with which the split attention kernels beat eager's (kernels/attention/NOTES.md, Decisions): a
# causal mask halves the work but not the splits of q, k and v.
_ATTENTION_MIN_KEYS = 512
_CAUSAL_ATTENTION_MIN_KEYS = 2048


def _attention_route(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
    # Float32 CUDA attention of head dim 64 over enough keys, without a mask, dropout or a gradient to compute, takes
    # the split kernels (where they are faster than eager's); the rest stays eager's.
    if not (_plain(query, key, value) and attn_mask is None and dropout_p == 0.0 and query.dim() == 4 and
            key.dim() == 4 and value.shape == key.shape and query.dtype == torch.float32 and
            key.dtype == value.dtype == torch.float32 and query.is_cuda and query.shape[-1] == 64 and
            key.shape[-1] == 64 and query.shape[0] == key.shape[0] and query.shape[2] > 0 and key.shape[2] > 0 and
            key.device == query.device == value.device):
        return NotImplemented
    if key.shape[2] < (_CAUSAL_ATTENTION_MIN_KEYS if is_causal else _ATTENTION_MIN_KEYS):
        return NotImplemented
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return NotImplemented
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads != kv_heads and (not enable_gqa or heads % kv_heads != 0):
        return NotImplemented
    if not _attention_runs_on(query.device):
        return NotImplemented
    return attention(query, key, value, is_causal, scale)


_ROUTES = {
    F.scaled_dot_product_attention: _attention_route,
    F.linear: _linear_route,
    torch.matmul: _matmul_route,
    torch.Tensor.matmul: _matmul_route,
    torch.Tensor.__matmul__: _matmul_route,
    torch.mm: _mm_route,
    torch.Tensor.mm: _mm_route,
    torch.addmm: _addmm_route,
    torch.Tensor.addmm: _addmm_route,
}


class fp32_gemm(TorchFunctionMode):
    """with kernels.fp32_gemm(): float32 CUDA products in the block (F.linear, torch.matmul, @, mm, addmm) take the
    library's GEMM where gemm_path.cpp's choice says it pays, and F.scaled_dot_product_attention without a mask,
    dropout or a gradient to compute (head dim 64, 512 keys or more, 2048 under a causal mask) the library's
    attention; everything else, batched products included (bmm, matmul
    of two batched tensors), runs as without the mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = _ROUTES.get(func)
        if route is not None and "out" not in kwargs:
            result = route(*args, **kwargs)
            if result is not NotImplemented:
                return result
        return func(*args, **kwargs)


__all__ = ["patch", "unpatch", "is_patched", "fp32_gemm"]
