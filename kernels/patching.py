"""Any model on the library's GEMM: patch() turns a model's linear and attention layers into the library's, in place,
and fp32_gemm() sends the functional products of a block (F.linear, matmul, @, mm, addmm, einsum,
nn.MultiheadAttention's projections) to it, and its F.scaled_dot_product_attention calls to the library's attention.

    kernels.patch(model)          # nn.Linear, MultiheadAttention, LayerNorm, patchify Conv2d; Conv1D, NewGELU,
                                  # LLaMA's norms, MLP, rotary embedding, BERT's MLP and add-norms; timm's LayerNorm,
                                  # Attention, Mlp, PatchEmbed and Block; minGPT's NewGELU and attention,
                                  # nanoGPT's MLP
    with kernels.fp32_gemm():     # F.linear, torch.matmul, @, mm, addmm, einsum, multi_head_attention_forward, sdpa
        loss = model(x).sum()

A patched layer keeps its Parameters, hooks and state_dict keys and stays an instance of its class (its class becomes
a subclass of that class); the kept weight split (FusedLinear) follows the weight's version counter, which writes
through `.data` do not advance: after one, call the layer's clear_weight_split().
"""

import builtins
import contextlib
import functools
import math
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad as _forward_ad
from torch.nn.modules import module as _module_hooks
from torch.nn.utils import parametrize as _parametrize
from torch._prims_common import suggest_memory_format
from torch.overrides import TorchFunctionMode

from kernels.attention.attention import attention
from kernels.causal_softmax.causal_softmax import causal_mask_verdict, causal_softmax, without_mask_verdict
from kernels.gelu_tanh.gelu_tanh import gelu_tanh
from kernels.gemm.gemm import _NO_PLAIN_BOUND, FusedLinear, _is_compiling, _tracing_state, gemm_multiply_leaky_relu
from kernels.gemm.gemm import _has_hooks, _rewritten_uncounted, _tf32_allowed, gemm_paths, linear
from kernels.gemm.gemm import split_may_pay, plain_linear_suffices, plain_product_suffices
from kernels.layer_norm.layer_norm import add_layer_norm, layer_norm
from kernels.rms_norm.rms_norm import rms_norm
from kernels.rotary.rotary import rotary_embedding
from kernels.silu_mul.silu_mul import silu_mul

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


class _PatchifyConv2dPatch:
    """nn.Conv2d whose kernel is its stride, without padding, dilation or groups (a vision transformer's patch
    embedding): the convolution is one GEMM, each output position's patch (in channels x kernel values, in the
    weight's order) a row against the weight as an (out channels, in channels x kernel) matrix, on the library's
    GEMM where a split takes that product; its own forward otherwise. The result is eager's in eager's memory format.
    Eager's cuDNN convolution runs in TF32 by default (torch.backends.cudnn.allow_tf32); this one is fp32-accurate
    whatever that flag says."""

    def forward(self, input):
        if _patchify_takes(self, input):
            return _patchify_conv2d(input, self.weight, self.bias, self.kernel_size)
        return super().forward(input)


def _is_patchify_conv(conv):
    """Whether an nn.Conv2d's settings make it a patchify convolution: kernel equal to the stride, more than one
    value a channel (a 1 x 1 convolution is another product, left to eager), no padding, dilation or
    groups."""
    kernel = tuple(conv.kernel_size)
    return (kernel == tuple(conv.stride) and kernel != (1, 1) and conv.padding in ((0, 0), "valid")
            and tuple(conv.dilation) == (1, 1) and conv.groups == 1)


def _patchify_takes(conv, x):
    """Whether a patched nn.Conv2d runs x as one GEMM (_patchify_conv2d): a batched float32 CUDA image, plain
    parameters on its device, outside autocast (whose float16 policy eager's convolution follows) and torch.func's
    transforms, where the GEMM or a product of its backward may take a split (plain_product_suffices: the shape, the
    TF32 setting, a forced path)."""
    weight, bias = conv.weight, conv.bias
    if not (_plain(x, weight) and (bias is None or _plain(bias)) and x.is_cuda and x.dim() == 4
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.device == x.device
            and (bias is None or bias.dtype == torch.float32 and bias.device == x.device)
            and not torch.is_autocast_enabled("cuda") and not torch._C._are_functorch_transforms_active()
            and _is_patchify_conv(conv)):
        return False
    _, channels, height, width = x.shape
    kh, kw = conv.kernel_size
    if channels != weight.shape[1] or height < kh or width < kw:  # eager's conv raises its own error
        return False
    # x holds about (its element count) / (values a patch) patches, the GEMM's rows
    return not plain_product_suffices(x, weight.shape[0], channels * kh * kw, weight.requires_grad)


def _patchify_conv2d(x, weight, bias, kernel_size):
    """F.conv2d(x, weight, bias, stride=kernel_size) as one GEMM of x's patches against the weight, in the memory
    format eager's convolution gives (cuDNN's choice: channels_last where x or the weight is laid out so)."""
    batch, _, height, width = x.shape
    rows, columns = height // kernel_size[0], width // kernel_size[1]
    y = _patchify_tokens(x, weight, bias, kernel_size)
    y = y.view(batch, rows, columns, -1).permute(0, 3, 1, 2)  # laid out channels_last, without a copy
    channels_last = torch.channels_last in (suggest_memory_format(x), suggest_memory_format(weight))
    return y.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def _patchify_tokens(x, weight, bias, kernel_size):
    """The patchify convolution's output as tokens, (batch, patches in row-major order, out channels), contiguous:
    one GEMM whose rows are the image's patches (in channels x kernel values each, in the weight's order)."""
    batch, channels, height, width = x.shape
    kh, kw = kernel_size
    rows, columns = height // kh, width // kw
    # The convolution leaves out the last rows and columns that no whole patch covers.
    patches = x[:, :, :rows * kh, :columns * kw].unflatten(3, (columns, kw)).unflatten(2, (rows, kh))
    patches = patches.permute(0, 2, 4, 1, 3, 5).reshape(batch * rows * columns, channels * kh * kw)
    y = linear(patches, weight.reshape(weight.shape[0], -1), bias)
    return y.view(batch, rows * columns, -1)


class _TimmPatchEmbedPatch:
    """timm's PatchEmbed (proj, a patchify convolution; its output flattened to tokens, (batch, patches, channels);
    then norm) where proj is patched, adds nothing to its call (no hooks) and takes the one-GEMM form: that GEMM's
    rows already are the tokens, so the tokens are its output as it lies, contiguous, without the copy into the
    convolution's memory format and the transposed view its own forward returns (the same values). Its own forward
    otherwise, and for an image size its checks refuse, so that it raises their errors."""

    def forward(self, x):
        proj = self.proj
        if (getattr(self, "flatten", False) and not getattr(self, "dynamic_img_pad", False)
                and isinstance(proj, _PatchifyConv2dPatch) and not _has_hooks(proj) and _patchify_takes(proj, x)
                and _image_size_accepted(self, x)):
            return self.norm(_patchify_tokens(x, proj.weight, proj.bias, proj.kernel_size))
        return super().forward(x)


def _image_size_accepted(patch_embed, x):
    """Whether x's image size passes the checks of timm's PatchEmbed.forward without dynamic padding: the model's
    size where it is strict, else whole patches."""
    height, width = x.shape[-2:]
    img_size = getattr(patch_embed, "img_size", None)
    if img_size is None:
        return True
    if getattr(patch_embed, "strict_img_size", True):
        return (height, width) == tuple(img_size)
    return height % patch_embed.patch_size[0] == 0 and width % patch_embed.patch_size[1] == 0


class _NewGELUPatch:
    """transformers' NewGELUActivation (GPT-2's "gelu_new", 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), six
    element-wise ops in eager) in one sweep over memory, forward and backward: kernels.gelu_tanh, the same formula
    rounded once."""

    def forward(self, input):
        if _gelu_tanh_takes(input):
            return gelu_tanh(input)
        return super().forward(input)


class _MinGPTNewGELUPatch:
    """minGPT's NewGELU and the modules whose forward is its code (NewGELUActivation's formula): as _NewGELUPatch,
    under the name of minGPT's argument (a caller may name it)."""

    def forward(self, x):
        if _gelu_tanh_takes(x):
            return gelu_tanh(x)
        return super().forward(x)


_GELU_TANH_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _gelu_tanh_takes(x):
    """Whether gelu_tanh gives what the formula gives eager: x a plain tensor of a float dtype (integers: the formula
    promotes them), and no 16-bit one under autocast (whose float32 policy for pow makes eager's result float32)."""
    return type(x) is torch.Tensor and x.dtype in _GELU_TANH_DTYPES and not (
        x.dtype in (torch.float16, torch.bfloat16) and x.device.type in ("cpu", "cuda")  # the devices autocast serves
        and torch.is_autocast_enabled(x.device.type))


class _CausalSelfAttentionPatch:
    """minGPT's CausalSelfAttention and the modules whose forward is its code: the scores' scale, causal mask and
    softmax in one sweep over memory (kernels.causal_softmax: eager's three passes over the scores and their
    writes), where `bias` is the causal mask and the scores are float32 CUDA tensors outside autocast (whose float32
    policy for softmax eager follows) and tracing (the mask's check reads its values); its own forward otherwise."""

    def forward(self, x):
        if not _causal_softmax_takes(self, x):
            return super().forward(x)
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = causal_softmax(q @ k.transpose(-2, -1), 1.0 / math.sqrt(k.size(-1)))
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def __getstate__(self):
        return without_mask_verdict(self.__dict__)


_CAUSAL_SOFTMAX_DEVICE_TYPES = ("cuda",)  # where the route runs (tests add "cpu", where the op runs ATen's formula)


def _causal_softmax_takes(attention, x):
    """Whether _CausalSelfAttentionPatch's route takes attention(x): x a plain float32 CUDA tensor of (batch, tokens,
    channels) outside autocast, torch.compile, tracing and torch.func's transforms, in a process without a process
    group (whose collectives write buffers uncounted: DDP broadcasts them), and attention.bias a (1, 1, S, S) buffer
    on x's device with S >= tokens that is the causal mask (causal_mask_verdict: checked once per buffer, version
    and data; an inference tensor, a CUDA graph's capture or flagged syncs without a kept verdict run the module's
    own forward)."""
    if (_is_compiling() or _tracing_state() is not None or torch._C._are_functorch_transforms_active()
            or type(x) is not torch.Tensor or x.dtype != torch.float32
            or x.device.type not in _CAUSAL_SOFTMAX_DEVICE_TYPES or torch.is_autocast_enabled(x.device.type)
            or x.dim() != 3 or _rewritten_uncounted()):
        return False
    mask = attention._buffers.get("bias")
    return (type(mask) is torch.Tensor and mask.dim() == 4 and mask.shape[:2] == (1, 1)
            and mask.shape[2] == mask.shape[3] >= x.shape[1] and mask.device == x.device
            and causal_mask_verdict(attention, mask))


def _llama_rms_norm_forward(self, hidden_states):
    # transformers' LlamaRMSNorm.forward, token for token: a norm class whose forward compiles to this code computes
    # this formula (Mistral's, Qwen2's and others are copies of it), so patch() may put rms_norm in its place.
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


def _llama_mlp_forward(self, x):
    # transformers' LlamaMLP.forward, token for token (Mistral's, Qwen2's and others are copies of it).
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def _matmul_linear_forward(self, input):
    # transformers' FalconLinear.forward, token for token: nn.Linear's product written as a matmul and an add, which
    # FusedLinear computes as F.linear does (the bias added to the product as F.linear adds it).
    hidden_states = input @ self.weight.T
    if self.bias is None:
        return hidden_states
    return hidden_states + self.bias


def _matmul_linear_patched_forward(self, input):
    """A patched FalconLinear-style layer's forward: FusedLinear's, but under autocast its class's own matmul and add,
    whose float32 bias promotes the autocast product back to float32 (F.linear's result stays in autocast's dtype)."""
    if input.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(input.device.type):
        return _matmul_linear_forward(self, input)
    return FusedLinear.forward(self, input)


def _mingpt_new_gelu_forward(self, x):
    # minGPT's NewGELU.forward (karpathy/minGPT; KernelBench's level-3 GPT problems copy it), token for token:
    # transformers' NewGELUActivation's formula, which _MinGPTNewGELUPatch computes.
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _mingpt_causal_self_attention_forward(self, x):
    # minGPT's CausalSelfAttention.forward (KernelBench's 43_MinGPTCausalAttention, 44_MiniGPTBlock), token for token.
    B, T, C = x.size()
    q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
    k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
    att = F.softmax(att, dim=-1)
    att = self.attn_dropout(att)
    y = att @ v
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    y = self.resid_dropout(self.c_proj(y))
    return y


def _reads_real_globals(cls, *names):
    """Whether the global `names` cls.forward reads (of torch, math, F and float) are the objects the reference
    forwards read: a module that rebinds one computes something else with the same code."""
    namespace = getattr(cls.forward, "__globals__", {})
    real = {"torch": torch, "math": math, "F": F, "float": float}
    return all(namespace.get(name, getattr(builtins, name, None)) is real[name] for name in names)


def _forward_compiles_to(cls, reference):
    """Whether cls.forward is `reference`'s code: the same bytecode, constants and names."""
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    return code is not None and all(getattr(code, part) == getattr(reference.__code__, part)
                                    for part in ("co_code", "co_consts", "co_names", "co_varnames"))


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # those the norms', silu_mul's and rotary's take
_RMS_NORM_MOST_COLUMNS = 8192  # the longest rows rms_norm's kernels hold (kernels/rms_norm/rms_norm.h)
_LAYER_NORM_MOST_COLUMNS = 4096  # the longest rows layer_norm's kernels hold (kernels/layer_norm/layer_norm.h)
_LAYER_NORM_MOST_SINGLE_COLUMNS = 2048  # ... where a pointer is not 16-byte aligned (single elements a thread)
_NORM_PACK = 8  # rows of whole 16-byte packs in every dtype: the norm kernels' vectorized path


class _RMSNormPatch:
    """transformers' LlamaRMSNorm and the norms whose forward is its code, on kernels.rms_norm: one sweep over memory
    forward and one backward, at least as accurate (the mean of squares summed in double), where x and the weight are
    plain GPU tensors of one float dtype with rows the kernels hold; its own forward otherwise."""

    def forward(self, hidden_states):
        weight = self.weight
        columns = hidden_states.shape[-1] if hidden_states.dim() else 0
        if (_plain(hidden_states, weight) and hidden_states.is_cuda and hidden_states.dtype in _KERNEL_DTYPES
                and weight.dtype == hidden_states.dtype and weight.shape == (columns,)
                and 0 < columns <= _RMS_NORM_MOST_COLUMNS and columns % _NORM_PACK == 0):
            return rms_norm(hidden_states, weight, self.variance_epsilon)
        return super().forward(hidden_states)


class _LayerNormPatch:
    """nn.LayerNorm (and timm's LayerNorm, F.layer_norm where timm's fast norm is off) with a weight and a bias over
    one dimension, on kernels.layer_norm: one sweep over memory forward and one backward, at least as accurate (the
    moments and each result in double), where x and the parameters are plain float32 GPU tensors with rows the kernels
    hold, outside autocast (whose float32 policy for layer_norm eager's forward follows); its own forward otherwise
    (float16 and bfloat16 too: the family's backward is slower than eager's there)."""

    def forward(self, input):
        if _layer_norm_takes(self, input):
            return layer_norm(input, self.weight, self.bias, self.eps)
        return super().forward(input)


class _TimmLayerNormPatch(_LayerNormPatch):
    """timm's LayerNorm, whose forward names its argument x."""

    def forward(self, x):
        return _LayerNormPatch.forward(self, x)


def _layer_norm_takes(norm, input):
    """Whether a patched LayerNorm `norm` runs kernels.layer_norm on `input` (else its own forward)."""
    weight, bias = norm.weight, norm.bias
    columns = input.shape[-1] if input.dim() else 0
    return (weight is not None and bias is not None and len(norm.normalized_shape) == 1
            and not getattr(norm, "_fast_norm", False) and _plain(input, weight, bias)
            and input.is_cuda and input.dtype == torch.float32 and weight.dtype == input.dtype
            and bias.dtype == input.dtype and weight.device == input.device and bias.device == input.device
            and weight.shape == (columns,) and bias.shape == (columns,)
            and 0 < columns <= _LAYER_NORM_MOST_COLUMNS and columns % _NORM_PACK == 0
            and not torch.is_autocast_enabled("cuda")
            and (columns <= _LAYER_NORM_MOST_SINGLE_COLUMNS or _aligned(input, weight, bias)))


def _add_layer_norm_takes(norm, x, residual):
    """Whether x + residual followed by the patched LayerNorm `norm` may run as one kernels.add_layer_norm: the norm
    takes the kernel on x (its parameters on x's device), its call does no more than its forward (its call is not
    made: no hooks, no forward of the instance's own, not compiled), and the residual matches x (no broadcasting)."""
    return (isinstance(norm, _LayerNormPatch) and not _called_otherwise(norm) and _plain(residual)
            and residual.shape == x.shape and residual.dtype == x.dtype and residual.device == x.device
            and _layer_norm_takes(norm, x) and (x.shape[-1] <= _LAYER_NORM_MOST_SINGLE_COLUMNS or _aligned(residual)))


def _aligned(*tensors):
    """Whether every tensor's data starts on a 16-byte boundary (a contiguous view at an offset may not)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _is_plain_silu(module):
    """Whether `module` computes F.silu(x) and nothing else: nn.SiLU (not in place) or transformers' SiLUActivation."""
    if type(module) is nn.SiLU:
        return not module.inplace
    return type(module) is _imported_class("transformers.activations", "SiLUActivation")


class _GatedMLPPatch:
    """transformers' LlamaMLP and the MLPs whose forward is its code, with a SiLU activation: the gate's activation and
    product, act_fn(gate_proj(x)) * up_proj(x), in one sweep over memory forward and backward (kernels.silu_mul,
    computed in double and rounded once), where both are plain GPU tensors of one float dtype and shape; its own
    steps otherwise, and its own forward for any other activation or where a hook would see the activation's call.
    Its projections are layers of their own, which patch() turns as it turns every nn.Linear."""

    def forward(self, x):
        if not _is_plain_silu(self.act_fn) or _has_hooks(self.act_fn):  # the fused gate never calls act_fn
            return super().forward(x)
        gate = self.gate_proj(x)
        up = self.up_proj(x)
        if (gate.is_cuda and gate.dtype in _KERNEL_DTYPES and up.dtype == gate.dtype and up.shape == gate.shape
                and _plain(gate, up)):
            return self.down_proj(silu_mul(gate, up))
        return self.down_proj(self.act_fn(gate) * up)


def _is_plain_gelu(act):
    """Whether `act` computes F.gelu(x) (the erf form) and nothing else, with no hook to see its call: nn.GELU(),
    transformers' GELUActivation on F.gelu, timm's GELU. The tanh form stays two ops: in the GEMM's epilogue it costs
    the GEMM what its own sweep over memory costs (kernels/gemm/NOTES.md, Decisions), so GPT-2's MLP is left as it
    is."""
    if not isinstance(act, nn.Module) or _called_otherwise(act):  # a function (a config's hidden_act) included
        return False
    cls = type(act)
    if cls is nn.GELU:
        return act.approximate == "none"
    if cls is _imported_class("transformers.activations", "GELUActivation"):
        return getattr(act, "act", None) is F.gelu
    return cls is _imported_class("timm.layers.activations", "GELU")


def _called_otherwise(module):
    """Whether a call of `module` does more than its class's forward: a hook would see it, or something replaced the
    instance's forward (accelerate's offload and device-map hooks) or compiled its call (module.compile())."""
    return (_has_hooks(module) or "forward" in module.__dict__
            or getattr(module, "_compiled_call_impl", None) is not None)


def _linear_gelu(linear, act, x):
    """act(linear(x)) as one op (forward_gelu: the GELU in the GEMM's epilogue) where `linear` is the library's layer
    and `act` a plain GELU, neither called otherwise than by its class's forward; None else."""
    # FusedLinear or patch()'s nn.Linear (whose forward is FusedLinear's), not a subclass with a forward of its own.
    if type(linear).forward is not FusedLinear.forward or _called_otherwise(linear) or not _is_plain_gelu(act):
        return None
    return linear.forward_gelu(x)


def _timm_mlp_forward(self, x):
    # timm's Mlp.forward, token for token (ViT's MLP; other timm MLPs add a gate or a response norm).
    x = self.fc1(x)
    x = self.act(x)
    x = self.drop1(x)
    x = self.norm(x)
    x = self.fc2(x)
    x = self.drop2(x)
    return x


class _GeluMLPPatch:
    """timm's Mlp (ViT's: fc1, act, drop1, norm, fc2, drop2) and the modules whose forward is its code, with nn.GELU:
    fc1 and its activation in one op (_linear_gelu); its own forward otherwise."""

    def forward(self, x):
        hidden = _linear_gelu(self.fc1, self.act, x)
        if hidden is None:
            return super().forward(x)
        return self.drop2(self.fc2(self.norm(self.drop1(hidden))))


def _nanogpt_mlp_forward(self, x):
    # nanoGPT's MLP.forward (karpathy/nanoGPT, model.py), token for token.
    x = self.c_fc(x)
    x = self.gelu(x)
    x = self.c_proj(x)
    x = self.dropout(x)
    return x


class _NanoGPTMLPPatch:
    """nanoGPT's MLP (c_fc, gelu, c_proj, dropout) and the modules whose forward is its code, with nn.GELU: c_fc and
    its activation in one op (_linear_gelu); its own forward otherwise."""

    def forward(self, x):
        hidden = _linear_gelu(self.c_fc, self.gelu, x)
        if hidden is None:
            return super().forward(x)
        return self.dropout(self.c_proj(hidden))


def _bert_intermediate_forward(self, hidden_states):
    # transformers' BertIntermediate.forward, token for token (RoBERTa's, ELECTRA's and others are copies of it).
    hidden_states = self.dense(hidden_states)
    hidden_states = self.intermediate_act_fn(hidden_states)
    return hidden_states


class _GeluIntermediatePatch:
    """transformers' BertIntermediate and the modules whose forward is its code, with F.gelu: dense and its
    activation in one op (_linear_gelu); its own forward otherwise."""

    def forward(self, hidden_states):
        hidden = _linear_gelu(self.dense, self.intermediate_act_fn, hidden_states)
        return super().forward(hidden_states) if hidden is None else hidden


def _bert_output_forward(self, hidden_states, input_tensor):
    # transformers' BertSelfOutput.forward and BertOutput.forward, token for token (RoBERTa's, ELECTRA's and others are
    # copies of them): post-norm's projection, dropout, residual add and LayerNorm.
    hidden_states = self.dense(hidden_states)
    hidden_states = self.dropout(hidden_states)
    hidden_states = self.LayerNorm(hidden_states + input_tensor)
    return hidden_states


class _AddNormOutputPatch:
    """transformers' BertSelfOutput and BertOutput and the modules whose forward is their code: the residual add and
    the LayerNorm after it as one add_layer_norm where the patched norm takes it (_add_layer_norm_takes), whose result
    a linear layer reads next (the intermediate dense, the next layer's query, the head's transform); its own forward
    otherwise."""

    def forward(self, hidden_states, input_tensor):
        hidden = self.dropout(self.dense(hidden_states))
        norm = self.LayerNorm
        if not _add_layer_norm_takes(norm, hidden, input_tensor):
            return norm(hidden + input_tensor)
        return _add_layer_norm_for_product(hidden, input_tensor, norm)[1]


class _MultiheadAttentionPatch:
    """nn.MultiheadAttention with its projections on the library's GEMM where a split takes its in-projection: the
    forward F.multi_head_attention_forward computes, as fp32_gemm() computes it (_multi_head_attention_route); its own
    forward, eager's fused inference path included, where no split takes it or for calls the route leaves to eager."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        weight = self.in_proj_weight if self._qkv_same_embed_dim else self.q_proj_weight
        # The cheap check first (small layers are host-bound); nested tensors: eager's fused path.
        if plain_linear_suffices(query, weight) or not _plain(query):
            return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                                   is_causal)
        arguments = (query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal)
        batched = query.dim() == 3
        if self.batch_first and batched:  # (batch, length, embed) -> (length, batch, embed)
            query, key, value = _swap_length_and_batch(query, key, value)
        out = _multi_head_attention_route(
            query, key, value, self.embed_dim, self.num_heads, self.in_proj_weight, self.in_proj_bias, self.bias_k,
            self.bias_v, self.add_zero_attn, self.dropout, self.out_proj.weight, self.out_proj.bias,
            training=self.training, key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
            use_separate_proj_weight=not self._qkv_same_embed_dim, q_proj_weight=self.q_proj_weight,
            k_proj_weight=self.k_proj_weight, v_proj_weight=self.v_proj_weight,
            average_attn_weights=average_attn_weights, is_causal=is_causal,
            transposed_back=self.batch_first and batched)
        if out is NotImplemented:
            return super().forward(*arguments)
        output, weights = out
        return (output.transpose(1, 0) if self.batch_first and batched else output), weights


class _PackedAttention(torch.autograd.Function):
    """softmax(q k^T * scale) v without a mask or dropout for q, k and v packed in one (batch, tokens, 3, heads, head
    dim) tensor (a fused qkv projection's output, viewed), on the kernels F.scaled_dot_product_attention runs for
    float32 CUDA tensors (PyTorch's memory-efficient attention, called as it calls them, on the same values: the
    same results). The output comes in (batch, tokens, heads, head dim), the layout the next projection reads, and
    the gradient in the packed layout the projection's backward reads: no transposes, and q's, k's and v's gradients
    written there by the backward kernel itself."""

    @staticmethod
    def forward(ctx, packed, scale):
        query, key, value = packed.unbind(2)
        tokens = packed.shape[1]
        out, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
            query, key, value, None, None, None, tokens, tokens, 0.0, 0, ctx.needs_input_grad[0], scale=scale)
        ctx.save_for_backward(packed, out, lse, seed, offset)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        packed, out, lse, seed, offset = ctx.saved_tensors
        query, key, value = packed.unbind(2)
        tokens = packed.shape[1]
        # shared_storage_dqdkdv: the kernel writes the three gradients into one (batch, tokens, 3, heads, head dim)
        # buffer, the packed layout, so no copy gathers them (eager stacks them, then copies the stack into it).
        grads = torch.ops.aten._efficient_attention_backward(
            grad_out.contiguous(), query, key, value, None, out, None, None, tokens, tokens, lse, 0.0, seed, offset,
            0, False, scale=ctx.scale, shared_storage_dqdkdv=True)[:3]
        return _packed_gradient(grads, packed), None


def _packed_gradient(grads, packed):
    """q's, k's and v's gradients as one tensor laid out as `packed` (contiguous): the buffer they already share
    where the backward kernel wrote them there, else a copy. Three parts that lie so span the whole buffer."""
    first = grads[0]
    item = first.element_size()
    part_strides = packed.stride()[:2] + packed.stride()[3:]  # those of packed[:, :, part]
    lies_packed = all(
        grad.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and grad.stride() == part_strides
        and grad.data_ptr() == first.data_ptr() + part * packed.stride(2) * item
        for part, grad in enumerate(grads))
    if lies_packed:
        return first.as_strided(packed.shape, packed.stride(), first.storage_offset())
    return torch.stack(grads, 2)


def _packed_split_attention(packed, scale):
    """The split attention kernels' output for a packed (batch, tokens, 3, heads, head dim) qkv tensor where
    _attention_route takes its call (no gradient to compute, heads of 64, enough keys), in (batch, tokens, heads, head
    dim); q, k and v read as they lie. None where the route leaves the call to eager's kernels."""
    query, key, value = (part.transpose(1, 2) for part in packed.unbind(2))
    out = _attention_route(query, key, value, scale=scale)
    return None if out is NotImplemented else out.transpose(1, 2)


def _packed_attention_takes(x, heads, head_dim):
    """Whether _PackedAttention computes what F.scaled_dot_product_attention would for the qkv projection of x: eager
    float32 CUDA tensors for which that function takes the memory-efficient kernels (it is enabled, head dims a
    multiple of 8 up to 128), outside autocast and torch.func's transforms, on a GPU the library runs on."""
    return (not _is_compiling() and type(x) is torch.Tensor and x.is_cuda and x.dtype == torch.float32
            and x.dim() == 3 and 0 < x.shape[0] < 65536 and x.shape[1] > 0 and head_dim % 8 == 0
            and 0 < head_dim <= 128 and 0 < heads < 65536 and torch.backends.cuda.mem_efficient_sdp_enabled()
            and not torch.is_autocast_enabled("cuda") and not torch._C._are_functorch_transforms_active()
            and _attention_runs_on(x.device))


class _TimmAttentionPatch:
    """timm's Attention (ViT's) where it runs F.scaled_dot_product_attention without a mask, dropout, gate or
    normalization: its qkv projection's output goes as it lies to the split attention kernels where the call computes
    no gradient and _attention_route takes it (more accurate than eager's), else to _PackedAttention (the results
    eager's attention computes), and the output to its proj layer as it comes; its own forward otherwise."""

    def forward(self, x, *args, **kwargs):
        # (x, attn_mask=None, is_causal=False) in timm 1.0.26 on, (x, attn_mask=None) before.
        attn_mask = args[0] if args else kwargs.get("attn_mask")
        is_causal = args[1] if len(args) > 1 else kwargs.get("is_causal", False)
        heads, head_dim = getattr(self, "num_heads", 0), getattr(self, "head_dim", 0)
        if (attn_mask is None and is_causal is False and len(args) <= 2 and kwargs.keys() <= {"attn_mask", "is_causal"}
                and _packed_attention_takes(x, heads, head_dim) and getattr(self, "fused_attn", False)
                and getattr(self, "gate", None) is None and (not self.training or self.attn_drop.p == 0.0)
                and all(type(getattr(self, name, None)) is nn.Identity and not _has_hooks(getattr(self, name))
                        for name in ("q_norm", "k_norm", "norm"))):
            batch, tokens, _ = x.shape
            packed = self.qkv(x)
            if packed.shape == (batch, tokens, 3 * heads * head_dim) and packed.is_contiguous():
                view = packed.view(batch, tokens, 3, heads, head_dim)
                out = _packed_split_attention(view, head_dim ** -0.5)
                if out is None:
                    out = _PackedAttention.apply(view, head_dim ** -0.5)
            else:  # eager's steps on the projection's output
                q, k, v = packed.reshape(batch, tokens, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
                out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
            return self.proj_drop(self.proj(out.reshape(batch, tokens, heads * head_dim)))
        return super().forward(x, *args, **kwargs)


class _TimmBlockPatch:
    """timm's ViT Block (pre-norm: x + attn(norm1(x)), then x + mlp(norm2(x))) where its norms take
    kernels.layer_norm: the first residual add and norm2 run as one add_layer_norm; the second add, where the patched
    nn.Sequential calling this block names the block it calls next (_BlockSequencePatch), runs with that block's norm1,
    whose result is handed to that block's call: it takes it where its input is this block's output, unchanged, in the
    same grad mode. The block's own forward otherwise."""

    def forward(self, x, *args, **kwargs):
        # (this block's input, its version, the grad mode, norm1 of it) from the block before (a get, not a pop: Dynamo
        # traces this)
        pending = self.__dict__.get("_pending_norm1")
        if pending is not None:
            self.__dict__.pop("_pending_norm1", None)
        following = self.__dict__.get("_next_block")  # the block the sequence calls next, set for this call alone
        if following is not None:
            self.__dict__.pop("_next_block", None)
        # (x, attn_mask=None, is_causal=False) in recent timm, fewer before: the defaults alone take this path.
        if (args or kwargs.get("attn_mask") is not None or kwargs.get("is_causal", False) is not False
                or kwargs.keys() - {"attn_mask", "is_causal"}):
            return super().forward(x, *args, **kwargs)
        if (pending is not None and pending[0] is x and pending[1] == _version_of(x)
                and pending[2] == torch.is_grad_enabled() and _outside_recomputation()):
            normed = pending[3]
        else:
            normed = self.norm1(x)
        branch = self.drop_path1(self.ls1(self.attn(normed)))
        if not _add_layer_norm_takes(self.norm2, x, branch):
            x = x + branch
            return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        x, normed = _add_layer_norm_for_product(x, branch, self.norm2)
        branch = self.drop_path2(self.ls2(self.mlp(normed)))
        # The hand-over: not under tracing, nor in activation checkpointing's runs (saved-tensor hooks on, or a
        # recomputation inside a backward), whose next call may not take it; not where this block's call or the next
        # one's does more than its forward (a hook may change the output; accelerate's forward loads the weights;
        # a compiled call is traced apart).
        if (following is None or _is_compiling() or _called_otherwise(self) or _called_otherwise(following)
                or not _outside_recomputation() or not _add_layer_norm_takes(following.norm1, x, branch)):
            return x + branch
        out, normed = _add_layer_norm_for_product(x, branch, following.norm1)
        following.__dict__["_pending_norm1"] = (out, _version_of(out), torch.is_grad_enabled(), normed)
        return out

    def __getstate__(self):
        state = self.__dict__.copy()  # the call's link and hand-over are not pickled or copied
        state.pop("_pending_norm1", None)
        state.pop("_next_block", None)
        return state


def _add_layer_norm_for_product(x, residual, norm):
    """add_layer_norm(x, residual) with the patched LayerNorm `norm`'s parameters, for a norm whose result a linear
    layer reads next (a ViT Block's qkv and fc1, BERT's add-norms). In eager calls without a gradient or a
    forward-mode tangent to compute (outside torch.func's transforms, forward AD's dual levels, torch.compile,
    torch.jit.trace and inference mode, whose tensors have no version counter), on a GPU whose GEMM reads it, where a
    product of the result's rows into 4 x its width (an MLP's first layer, its widest reader) may split, the norm's
    kernel also leaves its result's row split, which that layer's split forward then reads instead of splitting its
    input (the same bits)."""
    width = x.shape[-1] if x.dim() else 0
    if (torch.is_grad_enabled() or _forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active()
            or _is_compiling() or _tracing_state() is not None or torch.is_inference_mode_enabled() or not x.is_cuda
            or _tf32_allowed() or not width or not split_may_pay(x.numel() // width, 4 * width, width)
            or not _row_split_read_on(x.device.index)):
        return add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps)
    return torch.ops.kernels._add_layer_norm_leaving_row_split.default(x, residual, norm.weight, norm.bias,
                                                                       float(norm.eps))


@functools.lru_cache(maxsize=None)
def _row_split_read_on(device_index):
    """Whether the GEMM's forwards on this GPU read a left row split: split_fp16's (Hopper's) kernel; elsewhere a
    split left by a norm would go unread."""
    return "split_fp16" in gemm_paths(torch.device("cuda", device_index))


def _version_of(t):
    """t's version counter, None for an inference tensor (which has none: inference mode counts no writes)."""
    return None if t.is_inference() else t._version


class _BlockSequencePatch:
    """An nn.Sequential holding timm Blocks one after another (ViT's `blocks`): its own forward, but each patched Block
    whose call is its forward alone (no hooks, not compiled) that another follows is told, as it is called, which
    block it calls next (_TimmBlockPatch's hand-over); the block takes that link off as its forward starts. Copies,
    replicas and slices of the sequence link their own children; a recomputation stopped inside a block leaves no
    link behind."""

    def forward(self, input):
        modules = list(self._modules.values())
        for index, module in enumerate(modules):
            following = modules[index + 1] if index + 1 < len(modules) else None
            if (isinstance(module, _TimmBlockPatch) and isinstance(following, _TimmBlockPatch)
                    and not _called_otherwise(module) and not _is_compiling()):
                module.__dict__["_next_block"] = following
            input = module(input)
        return input


def _holds_linked_blocks(module):
    """Whether `module` is a plain nn.Sequential with two timm Blocks one after another (patched or to be)."""
    if type(module) is not nn.Sequential:
        return False
    blocks = [isinstance(child, _TimmBlockPatch) or _base_for_class(type(child)) is _TimmBlockPatch
              for child in module._modules.values()]
    return any(a and b for a, b in zip(blocks, blocks[1:]))


# transformers' apply_rotary_pos_emb and rotate_half (modeling_llama), token for token, compiled here to compare other
# modules' functions with (Mistral's, Qwen2's and other decoders' are copies of them): the same bytecode, names and
# constants (docstrings aside). The module-level `import torch` is part of the copy: the compiler reads a call on an
# imported module's attribute differently from one on another name.
_LLAMA_ROTARY_SOURCE = """
import torch


def rotate_half(x):
    \"\"\"Rotates half the hidden dims of the input.\"\"\"
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    \"\"\"Applies Rotary Position Embedding to the query and key tensors.\"\"\"
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
"""
_LLAMA_ROTARY = {}
exec(compile(_LLAMA_ROTARY_SOURCE, "<transformers' apply_rotary_pos_emb>", "exec"), _LLAMA_ROTARY)

# The global name the rebuilt forwards read in apply_rotary_pos_emb's place (set in the forward's own module).
_ROTARY_ROUTE_NAME = "_kernels_rotary_apply_rotary_pos_emb"


def _wrapper_chain(function):
    """`function` and the functions it wraps, outer first, where each is a plain function holding the next (its
    __wrapped__) in a closure cell, as decorators made with functools.wraps do; None for any other kind of wrapping."""
    chain = [function]
    while type(chain[-1]) is types.FunctionType and len(chain) < 64:
        wrapped = getattr(chain[-1], "__wrapped__", None)
        if wrapped is None:
            return chain
        if not any(_cell_holds(cell, wrapped) for cell in chain[-1].__closure__ or ()):
            return None
        chain.append(wrapped)
    return None


def _same_code(function, reference):
    """Whether `function` (a plain function, unwrapped) is `reference`'s code: the same bytecode, names, variables and
    constants, docstrings aside."""
    chain = _wrapper_chain(function) if callable(function) else None
    if chain is None:
        return False
    code, ours = chain[-1].__code__, reference.__code__
    constants = [tuple(c for c in x.co_consts if not isinstance(c, str)) for x in (code, ours)]
    return constants[0] == constants[1] and all(getattr(code, part) == getattr(ours, part)
                                                for part in ("co_code", "co_names", "co_varnames"))


def _applies_llama_rotary(cls):
    """Whether cls.forward (plain functions, however decorated) calls its module's apply_rotary_pos_emb, and that
    function and its rotate_half are LLaMA's code."""
    chain = _wrapper_chain(getattr(cls, "forward", None))
    if chain is None:
        return False
    inner = chain[-1]
    if "apply_rotary_pos_emb" not in inner.__code__.co_names:
        return False
    rotary = inner.__globals__.get("apply_rotary_pos_emb")
    if not _same_code(rotary, _LLAMA_ROTARY["apply_rotary_pos_emb"]):
        return False
    return _same_code(_wrapper_chain(rotary)[-1].__globals__.get("rotate_half"), _LLAMA_ROTARY["rotate_half"])


def _rotary_route(original):
    """apply_rotary_pos_emb as a patched attention calls it: kernels.rotary_embedding where q, k, cos and sin are plain
    GPU tensors of one float dtype in its shapes (cos and sin unsqueezed at dim 1, needing no gradient), `original`
    (transformers' function) for every other call."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if (unsqueeze_dim == 1 and _plain(q, k, cos, sin) and _rotary_runs_on(q) and q.dtype in _KERNEL_DTYPES
                and k.dtype == q.dtype and cos.dtype == q.dtype and sin.dtype == q.dtype and q.dim() == 4
                and k.dim() == 4 and cos.dim() == 3 and sin.shape == cos.shape and k.device == q.device
                and cos.device == q.device and sin.device == q.device and q.shape[3] % 2 == 0
                and k.shape[0] == q.shape[0] and k.shape[2:] == q.shape[2:] and cos.shape[1:] == q.shape[2:]
                and cos.shape[0] in (1, q.shape[0]) and not (cos.requires_grad or sin.requires_grad)):
            return rotary_embedding(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    return apply_rotary_pos_emb


def _rotary_runs_on(q):
    # Where the route takes kernels.rotary_embedding: GPUs (on the CPU eager's function keeps eager's results).
    return q.is_cuda


def _reading_route(chain):
    """The functions of a wrapper chain (_wrapper_chain, outer first) rebuilt so that the innermost reads the global
    _ROTARY_ROUTE_NAME where it read apply_rotary_pos_emb: the same code and closures (but each wrapper's cell of the
    function it wraps), the same module's global names, live; the route is set in that module once."""
    inner = chain[-1]
    names = inner.__globals__
    if _ROTARY_ROUTE_NAME not in names:
        names[_ROTARY_ROUTE_NAME] = _rotary_route(names["apply_rotary_pos_emb"])
    code = inner.__code__
    code = code.replace(co_names=tuple(_ROTARY_ROUTE_NAME if n == "apply_rotary_pos_emb" else n for n in code.co_names))
    rebuilt = _function_like(inner, code, inner.__closure__)
    for outer in reversed(chain[:-1]):
        wrapped = getattr(outer, "__wrapped__")
        closure = tuple(types.CellType(rebuilt) if _cell_holds(cell, wrapped) else cell for cell in outer.__closure__)
        rebuilt = _function_like(outer, outer.__code__, closure, wraps=rebuilt)
    return rebuilt


def _function_like(function, code, closure, wraps=None):
    """A function of `code` and `closure` with `function`'s globals, defaults, names and attributes (wraps: its
    __wrapped__)."""
    made = types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__, closure)
    made.__kwdefaults__ = function.__kwdefaults__
    made.__dict__.update(function.__dict__)
    for attribute in ("__module__", "__qualname__", "__doc__", "__annotations__"):
        setattr(made, attribute, getattr(function, attribute))
    if wraps is not None:
        made.__wrapped__ = wraps
    return made


def _cell_holds(cell, value):
    # (an empty cell equals only an empty cell, and has no contents to read)
    return not cell == types.CellType() and cell.cell_contents is value


class _RotaryAttentionPatch:
    """transformers' attention layers whose forward applies LLaMA's rotary embedding (its module's apply_rotary_pos_emb
    is LLaMA's code: _applies_llama_rotary): that forward, token for token, with q and k rotated by
    kernels.rotary_embedding in one sweep over memory forward and backward (computed in double) where they and the
    angles are plain GPU tensors of one float dtype, and by transformers' function for every other call (the CPU's
    too: eager's results there). Its projections are layers of their own, which patch() turns as it turns every
    nn.Linear."""

    @staticmethod
    def patched_namespace(cls):
        # The patched class's forward: cls's own, rebuilt to call the route where it called apply_rotary_pos_emb (a
        # plain function of the same module, as the original is, for torch.compile to trace).
        return {"forward": _reading_route(_wrapper_chain(cls.forward))}


def _imported_class(module_name, name):
    """A class of a package (transformers, timm) where that package is already imported (it is never imported here),
    else None."""
    return getattr(sys.modules.get(module_name), name, None)


def _conv1d_class():
    return _imported_class("transformers.pytorch_utils", "Conv1D")


def _base_for_class(cls):
    """The mixin that patches instances of `cls`, or None: nn.Linear, nn.MultiheadAttention, nn.LayerNorm, nn.Conv2d
    (those with a patchify convolution's settings: _patch_base), nn.Sequential (those holding timm Blocks),
    transformers' Conv1D and NewGELUActivation, timm's LayerNorm, Attention and PatchEmbed and the subclasses that
    keep their forward (a subclass with a forward of its own computes something else, but for FalconLinear's matmul
    and add), the modules whose forward is LlamaRMSNorm's, LlamaMLP's, BertIntermediate's, BertOutput's, timm's
    Mlp's, nanoGPT's MLP's, or minGPT's NewGELU's or CausalSelfAttention's code, and those whose forward applies
    LLaMA's rotary embedding."""
    if (issubclass(cls, nn.Linear) and _parameters_are_its_own(cls, nn.Linear)
            and (cls.forward is nn.Linear.forward or _forward_compiles_to(cls, _matmul_linear_forward))):
        return FusedLinear
    if issubclass(cls, nn.MultiheadAttention) and cls.forward is nn.MultiheadAttention.forward:
        return _MultiheadAttentionPatch
    if issubclass(cls, nn.LayerNorm) and cls.forward is nn.LayerNorm.forward:
        return _LayerNormPatch
    if (issubclass(cls, nn.Conv2d) and _parameters_are_its_own(cls, nn.Conv2d) and cls.forward is nn.Conv2d.forward
            and cls._conv_forward is nn.Conv2d._conv_forward):
        return _PatchifyConv2dPatch  # patch() takes those with a patchify convolution's settings (_patch_base)
    if cls is nn.Sequential:  # patch() takes those holding timm Blocks one after another (_patch_base)
        return _BlockSequencePatch
    for module_name, name, base in (("transformers.pytorch_utils", "Conv1D", _Conv1DPatch),
                                    ("transformers.activations", "NewGELUActivation", _NewGELUPatch),
                                    ("timm.layers.norm", "LayerNorm", _TimmLayerNormPatch),
                                    ("timm.layers.attention", "Attention", _TimmAttentionPatch),
                                    ("timm.layers.patch_embed", "PatchEmbed", _TimmPatchEmbedPatch),
                                    ("timm.models.vision_transformer", "Block", _TimmBlockPatch)):
        original = _imported_class(module_name, name)
        if original is not None and issubclass(cls, original) and cls.forward is original.forward:
            return base
    if issubclass(cls, nn.Module) and _forward_compiles_to(cls, _llama_rms_norm_forward):
        return _RMSNormPatch
    if issubclass(cls, nn.Module) and _forward_compiles_to(cls, _llama_mlp_forward):
        return _GatedMLPPatch
    if issubclass(cls, nn.Module) and _forward_compiles_to(cls, _timm_mlp_forward):
        return _GeluMLPPatch
    if issubclass(cls, nn.Module) and _forward_compiles_to(cls, _nanogpt_mlp_forward):
        return _NanoGPTMLPPatch
    if issubclass(cls, nn.Module) and _forward_compiles_to(cls, _bert_intermediate_forward):
        return _GeluIntermediatePatch
    if issubclass(cls, nn.Module) and _forward_compiles_to(cls, _bert_output_forward):
        return _AddNormOutputPatch
    if issubclass(cls, nn.Module) and _applies_llama_rotary(cls):
        return _RotaryAttentionPatch
    if (issubclass(cls, nn.Module) and _forward_compiles_to(cls, _mingpt_new_gelu_forward)
            and _reads_real_globals(cls, "torch", "math")):
        return _MinGPTNewGELUPatch
    if (issubclass(cls, nn.Module) and _forward_compiles_to(cls, _mingpt_causal_self_attention_forward)
            and _reads_real_globals(cls, "math", "F", "float")):
        return _CausalSelfAttentionPatch
    return None


def _parameters_are_its_own(cls, layer):
    """Whether a patch may read the weight and bias of a subclass of `layer` (nn.Linear, nn.Conv2d) from its
    parameters: no class above `layer` defines them (a property that computes them, as torch.nn.utils.parametrize's
    classes and LoRA-style subclasses do), and it is not a lazy layer (it turns itself into `layer` on its first
    call)."""
    subclasses = [c for c in cls.__mro__ if c is not layer and issubclass(c, layer)]
    return (not any("weight" in vars(c) or "bias" in vars(c) for c in subclasses)
            and not issubclass(cls, nn.modules.lazy.LazyModuleMixin))


def _patch_base(module):
    """The mixin that patches `module`'s class, or None where patch() leaves it (an nn.Sequential without timm Blocks
    one after another, and an nn.Conv2d without a patchify convolution's settings, included)."""
    cls = type(module)
    if cls in _PATCHED_CLASSES.values():
        return None
    base = _base_for_class(cls)
    if base is _BlockSequencePatch and not _holds_linked_blocks(module):
        return None
    return None if base is _PatchifyConv2dPatch and not _is_patchify_conv(module) else base


def _class_name(cls):
    # A module-level name that pickle looks up here and __getattr__ rebuilds in a new process: "patched$" then the
    # class's module and qualified name, dots as "$", the two joined by "$$".
    return "patched$" + cls.__module__.replace(".", "$") + "$$" + cls.__qualname__.replace(".", "$")


def _patched_class(cls, base):
    patched = _PATCHED_CLASSES.get(cls)
    if patched is None:
        name = _class_name(cls)
        namespace = base.patched_namespace(cls) if hasattr(base, "patched_namespace") else {}
        if base is FusedLinear and cls.forward is not nn.Linear.forward:  # FalconLinear's code (_base_for_class)
            namespace = {**namespace, "forward": _matmul_linear_patched_forward}
        patched = type(cls.__name__, (base, cls), {**namespace, "__module__": __name__, "__qualname__": name})
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


def patch(model, layers=None):
    """Turns every nn.Linear, nn.MultiheadAttention and nn.LayerNorm of `model` (itself included), every nn.Conv2d
    whose kernel is its stride (a patch embedding: _PatchifyConv2dPatch), every transformers Conv1D,
    NewGELUActivation, LlamaRMSNorm, LlamaMLP, BertIntermediate and BertOutput (or a module with one of their
    forwards), every timm LayerNorm, Attention, Mlp (by its forward), PatchEmbed and ViT Block, and every module with
    the forward of nanoGPT's MLP or minGPT's NewGELU or CausalSelfAttention into the library's,
    in place, and returns `model`; a module's linear children that read its input become one product while training
    (_ProjectionGroup), an MLP's first layer and its GELU (the erf form) one op (_linear_gelu), and a ViT Block's
    residual adds (_TimmBlockPatch; _BlockSequencePatch for an nn.Sequential of them) and BertOutput's one op each
    with the norm after them (_AddNormOutputPatch). Idempotent; subclasses with a forward of their own are left as
    they are. layers: the qualified names (model.named_modules()) of the only layers to turn, for example
    split_layer_names()'s; a name no such layer has raises ValueError."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(layers, str):
        raise TypeError("patch: layers must be a collection of layer names, not one string")
    chosen = None if layers is None else set(layers)
    if chosen is not None:
        unknown = chosen - {name for name, module in model.named_modules(remove_duplicate=False)
                            if _patch_base(module) or is_patched(module)}
        if unknown:
            raise ValueError(f"patch: no layer patch() turns is named {', '.join(sorted(map(repr, unknown)))}")
    for name, module in model.named_modules(remove_duplicate=False):
        base = _patch_base(module) if chosen is None or name in chosen else None
        if base is not None:
            module.__class__ = _patched_class(type(module), base)
            if base is FusedLinear:
                module.cache_weight_split = True
                module._plain_numel_below = _NO_PLAIN_BOUND
                module.clear_weight_split()
    for module in model.modules():
        _group_projections(module)
    return model


# ---- sibling projections: the linear layers of one parent that read its input, as one product ------------------------

# "auto": where the product of the group's weights side by side takes a split path; "always": wherever the group is
# known (tests, on any device); "never".
_fuse_projections = "auto"


class _ProjectionGroup:
    """The query, key and value projections of one parent module (patched linear children named as transformers
    names them: BERT's query, key, value; LLaMA's and most decoders' q_proj, k_proj, v_proj), whose forward reshapes
    their outputs into heads. Which of them read the parent's input is learned on the parent's first training call (a
    call with autograd recording a weight), run as it is; from then on, where two or more do, each training call
    computes their products as one product of their weights side by side (one split of the input, one GEMM over all
    their outputs, one grad_x and one grad_W product backward; transformers' own layers only, _fusable_parent)
    and gives each layer its part, a column slice of that
    product, when it is called on that same input, unchanged, in the same grad and autocast modes, within the
    parent's call. Nothing outlives the call. A call in which a member's part goes unused (its weight then gets a
    zero gradient where eager gives none) ends the grouping for later calls. A call without a gradient to compute runs
    the parent's scaled-dot-product attention on the split kernels where they are faster (_SplitAttention)."""

    def __init__(self, names, fuses):
        self.names = names  # the candidates: the parent's patched projection children
        self.fuses = fuses  # whether training calls may compute them as one product (_fusable_parent)
        self.members = None  # learned: the candidates called on the parent's input, in call order
        self.seen = None  # while learning: the names called so far
        self.parts = ()  # within a call: the parts handed out (_SharedPart)
        self.handles = ()
        self.attention_modes = []  # within a call without a gradient: the _SplitAttention entered for it


# Children's names of the projections a group takes: those whose outputs transformers' attention layers reshape into
# heads (other layers' outputs may be flattened by a view, or changed in place, which a column slice does not allow).
_PROJECTION_NAMES = (("query", "key", "value"), ("q_proj", "k_proj", "v_proj"))


def _fusable_parent(parent):
    """Whether a parent's projections may become one product: transformers' own layers (patched ones too: their
    class's), whose forwards reshape the outputs into heads and change none in place; another module with children of
    those names may flatten or edit its outputs."""
    cls = type(parent)
    original = next((c for c, patched in _PATCHED_CLASSES.items() if patched is cls), cls)
    return original.__module__.startswith("transformers.")


def _group_projections(parent):
    if "_projection_group" in parent.__dict__:
        return
    children = parent._modules
    for names in _PROJECTION_NAMES:
        if all(isinstance(children.get(name), FusedLinear) for name in names):
            group = _ProjectionGroup(names, fuses=_fusable_parent(parent))
            parent.__dict__["_projection_group"] = group
            group.handles = (parent.register_forward_pre_hook(_before_parent_call, with_kwargs=True),
                             parent.register_forward_hook(_after_parent_call, with_kwargs=True, always_call=True))
            return


def _ungroup_projections(parent):
    group = parent.__dict__.pop("_projection_group", None)
    if group is not None:
        for handle in group.handles:
            handle.remove()
        _clear_shared_products(parent, group)
        group.parts = ()


def _parent_input(args, kwargs):
    x = args[0] if args else kwargs.get("hidden_states", kwargs.get("x", kwargs.get("input")))
    return x if type(x) is torch.Tensor else None


_saved_tensors_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def _training_call(x):
    """Whether a parent's call on x is one the group learns from and fuses: eager float32 with autograd recording,
    outside autocast and torch.func's transforms, and outside activation checkpointing (its recomputation must save
    what the first run saved; the run in a backward and saved-tensor hooks mark it). An inference tensor has no version
    counter to watch, and eager could not save it: its calls run as they are."""
    # (autocast's check on the devices it serves: it raises for others, the meta device's shape runs among them)
    return (x.dtype == torch.float32 and not x.is_inference() and torch.is_grad_enabled()
            and not torch.is_inference_mode_enabled()
            and not (x.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(x.device.type))
            and not torch._C._are_functorch_transforms_active() and _outside_recomputation())


def _outside_recomputation():
    """No saved-tensor hooks on (activation checkpointing's first run sets them) and no backward running (its
    recomputation runs inside one)."""
    return (_saved_tensors_hooks is not None and _saved_tensors_hooks(False) is None
            and _graph_task_id is not None and _graph_task_id() == -1)


class _SharedPart:
    """What a parent's call leaves in a member's `_shared_product` slot (FusedLinear.forward): the input, its version
    and the modes of the parent's call; the member's part of the product, or while learning the list its name goes
    to. Called by the member with its input, it gives the part where the call is the one the part stands for."""

    __slots__ = ("version", "part", "taken", "seen", "name")

    def __init__(self, x, part=None, seen=None, name=None):
        self.version, self.part, self.taken, self.seen, self.name = x._version, part, False, seen, name

    def __call__(self, layer, x):
        if not _training_call(x) or x._version != self.version:
            return None
        if self.seen is not None:
            self.seen.append(self.name)
        self.taken = self.part is not None
        return self.part


def _before_parent_call(parent, args, kwargs):
    if _is_compiling() or _tracing_state() is not None:  # traced code computes each layer's own product
        return None
    group = parent.__dict__.get("_projection_group")
    x = _parent_input(args, kwargs)
    if group is not None and x is not None and _attention_may_split(parent, x):
        # Their calls on x run outside the mode (_projection_outside_modes), where no other mode would miss them.
        if torch._C._len_torch_function_stack() == 0:
            for name in group.names:
                child = parent._modules.get(name)
                if isinstance(child, FusedLinear):
                    child.__dict__["_shared_product"] = (x, _projection_outside_modes)
        mode = _SplitAttention()
        mode.__enter__()
        group.attention_modes.append(mode)
        return None
    if group is None or x is None or not group.fuses or _fuse_projections == "never" or not _training_call(x):
        return None
    layers = parent._modules
    if group.members is None:  # learn: each candidate records whether it is called on x
        seen = group.seen = []
        for name in group.names:
            child = layers.get(name)
            if isinstance(child, FusedLinear):
                child.__dict__["_shared_product"] = (x, _SharedPart(x, seen=seen, name=name))
        return None
    if not group.members:
        return None
    members = [layers.get(name) for name in group.members]
    weights = _fusable_weights(x, members)
    if weights is None:
        return None
    biases = [member._parameters.get("bias") for member in members]
    shares = [_SharedPart(x) for _ in members]
    weight = _SideBySide.apply(shares, *weights)
    bias = _SideBySide.apply(shares, *biases) if biases[0] is not None else None
    product = gemm_multiply_leaky_relu(x, weight, bias, 1.0, 1.0)
    for member, shared, part in zip(members, shares, product.split([w.shape[0] for w in weights], -1)):
        shared.part = part
        member.__dict__["_shared_product"] = (x, shared)
    group.parts = shares
    return None


def _projection_outside_modes(layer, x):
    """A projection's call on the parent's input inside _SplitAttention's mode (the only mode on the stack), run with
    torch function handling off: the mode would intercept each tensor call of the layer's own host work (the parent's
    attention is its only route). Plain tensors only, for which nothing else handles those calls; None (the layer's
    own call) else."""
    weight, bias = layer._weight_and_bias()
    with _torch_function_off():  # the checks too: the mode would see their tensor calls
        if weight is None or not _plain(x, weight) or (bias is not None and not _plain(bias)):
            return None
        return layer.forward(x)


_torch_function_off = torch._C.DisableTorchFunction


def _attention_may_split(parent, x):
    """Whether a parent's call on x (batch, tokens, features) may have its attention taken by the split kernels: float32
    CUDA without a gradient to compute, outside autocast and torch.func's transforms, heads of 64 (the parent's head_dim or
    attention_head_size) and enough tokens for keys (a causal parent's more); _attention_route decides per call. The
    shape is checked first, so that small calls pay no more host time than that."""
    head_dim = parent.__dict__.get("head_dim", parent.__dict__.get("attention_head_size"))
    return (head_dim == 64 and x.dim() == 3 and
            x.shape[1] >= (_CAUSAL_ATTENTION_MIN_KEYS if parent.__dict__.get("is_causal") else _ATTENTION_MIN_KEYS)
            and not torch.is_grad_enabled() and x.is_cuda and x.dtype == torch.float32
            and not torch.is_autocast_enabled("cuda") and not torch._C._are_functorch_transforms_active()
            and _attention_runs_on(x.device))


class _SideBySide(torch.autograd.Function):
    """torch.cat of the members' parameters, whose backward gives a member's parameter a gradient only where its part
    of the product was taken (as eager gives none to a layer that was not called, or not in a recording mode)."""

    @staticmethod
    def forward(ctx, shares, *tensors):
        ctx.shares, ctx.sizes = shares, [t.shape[0] for t in tensors]
        return torch.cat(tensors)

    @staticmethod
    def backward(ctx, grad):
        parts = grad.split(ctx.sizes)
        return (None, *(part if shared.taken else None for part, shared in zip(parts, ctx.shares)))


def _fusable_weights(x, members):
    """The members' weights where one product may stand for theirs: plain float32 tensors on x's device as the
    members' own (no parametrization), one of them recorded by autograd, all with a bias or none, no hook that could
    change a member's input or see its output (a forward hook may edit it in place, which a slice of one product
    refuses); else None."""
    if _module_hooks._global_forward_hooks:
        return None
    weights = []
    for member in members:
        if (not isinstance(member, FusedLinear) or member._forward_pre_hooks or member._forward_hooks
                or not {"weight", "bias"}.isdisjoint(member.__dict__)):  # an instance attribute hiding a parameter
            return None
        weight, bias = member._parameters.get("weight"), member._parameters.get("bias", False)
        if (weight is None or bias is False or not _plain(weight) or weight.dtype != torch.float32
                or weight.device != x.device or weight.dim() != 2 or weight.shape[1] != x.shape[-1]
                or (bias is not None and not (_plain(bias) and bias.dtype == torch.float32))):
            return None
        weights.append(weight)
    if len({member._parameters["bias"] is None for member in members}) != 1:
        return None
    if not any(w.requires_grad for w in weights) or x.shape[-1] == 0:
        return None
    if _fuse_projections == "auto" and plain_product_suffices(x, sum(w.shape[0] for w in weights), x.shape[-1], True):
        return None
    return weights


def _after_parent_call(parent, args, kwargs, output):
    group = None if _is_compiling() or _tracing_state() is not None else parent.__dict__.get("_projection_group")
    if group is None:
        return None
    _clear_shared_products(parent, group)
    if group.attention_modes:
        group.attention_modes.pop().__exit__(None, None, None)
        return None
    unused = any(not shared.taken for shared in group.parts)
    group.parts = ()
    if group.seen is not None:
        members = tuple(dict.fromkeys(group.seen))
        group.seen = None
        group.members = members if len(members) >= 2 else ()
    elif unused:
        group.members = ()  # a member's part went unused: its calls vary, so each computes its own from now on
    if group.members == ():  # nothing to fuse here (the group stays, as learned): back to the plain module call
        for handle in group.handles:
            handle.remove()
    return None


def _clear_shared_products(parent, group):
    for name in group.names:
        child = parent._modules.get(name)
        if child is not None:
            child.__dict__.pop("_shared_product", None)


def _split_may_take(x, n, k):
    # A float32 product of x against an n x k weight at a shape where a split may pay.
    return isinstance(x, torch.Tensor) and x.dtype == torch.float32 and k > 0 and split_may_pay(x.numel() // k, n, k)


def _patchable_layers(model, bases=None):
    # (qualified name, module) of every layer patch() turns with one of `bases` (default: the layers a split may take),
    # shared layers under each of their names.
    bases = bases or (FusedLinear, _MultiheadAttentionPatch, _Conv1DPatch, _PatchifyConv2dPatch)
    return [(name, module) for name, module in model.named_modules(remove_duplicate=False)
            if _patch_base(module) in bases]


@contextlib.contextmanager
def _probe_run(model, inputs):
    """The setting of a probe's one run of model(*inputs): no gradients, eval mode; on the way out (an exception's
    too) the model's modes and the random states of the CPU and of the GPUs it uses as they were. Yields the
    ExitStack that removes the probe's hooks then."""
    tensors = [*model.parameters(), *model.buffers(), *(t for t in inputs if isinstance(t, torch.Tensor))]
    gpus = sorted({t.device.index for t in tensors if t.is_cuda})
    modes = [(module, module.training) for module in model.modules()]

    def restore_modes():
        for module, training in modes:
            module.training = training

    with contextlib.ExitStack() as restore:
        restore.enter_context(torch.random.fork_rng(devices=gpus))
        restore.enter_context(torch.no_grad())
        restore.callback(restore_modes)
        model.eval()
        yield restore


def split_layer_names(model, *inputs):
    """The qualified names (model.named_modules()'s, shared layers under each of theirs) of the linear and attention
    layers of `model` that patch() turns and whose forward a split takes at the shapes of `inputs`: shapes only, so
    `model` and `inputs` may live on the meta device. The layers it leaves out would run PyTorch's product anyway (a
    host-bound model's small layers). It runs model(*inputs) once, without gradients and in eval mode, and leaves
    the model's modes, its hooks and the random states of the CPU and of the GPUs it uses as they were."""
    def takes(module, x):
        if isinstance(module, nn.MultiheadAttention):
            weight = module.in_proj_weight if module._qkv_same_embed_dim else module.q_proj_weight
            n, k = weight.shape
        elif isinstance(module, nn.Linear):
            n, k = module.weight.shape
        elif isinstance(module, nn.Conv2d):  # a patchify convolution: a row of in channels x kernel values a patch
            n, k = module.weight.shape[0], module.weight[0].numel()
        else:  # Conv1D: its weight stored as (in, out)
            k, n = module.weight.shape
        return _split_may_take(x, n, k)

    return _layers_taking(model, inputs, None, takes)


def fused_layer_names(model, *inputs):
    """The qualified names (as split_layer_names gives them) of the layers of `model` that patch() puts on one of the
    library's fused element-wise ops and that model(*inputs) calls on a float32 tensor: minGPT's NewGELU (gelu_tanh)
    and CausalSelfAttention (causal_softmax). One op in place of eager's several gains at any size, host-bound
    calls included. Run as split_layer_names runs it (once, no gradients, eval mode, shapes only)."""
    return _layers_taking(model, inputs, (_MinGPTNewGELUPatch, _CausalSelfAttentionPatch),
                          lambda module, x: isinstance(x, torch.Tensor) and x.dtype == torch.float32)


def _layers_taking(model, inputs, bases, takes):
    """The sorted qualified names of `model`'s layers that patch() turns with one of `bases` (_patchable_layers) and
    for which takes(layer, x) holds on a call of model(*inputs) (_probe_run's one run), x the layer's first
    argument."""
    taking = set()

    def record(name, module):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("query", kwargs.get("input", kwargs.get("x")))
            if takes(module, x):
                taking.add(name)
        return module.register_forward_pre_hook(hook, with_kwargs=True)

    with _probe_run(model, inputs) as restore:
        for name, module in _patchable_layers(model, bases):
            restore.callback(record(name, module).remove)
        model(*inputs)
    return sorted(taking)


def functional_products_split(model, *inputs):
    """Whether model(*inputs) makes a float32 product through a function fp32_gemm() routes (F.linear, matmul, @, mm,
    addmm, einsum) outside the layers patch() turns, at a shape where a split may pay: shapes only, so `model` and
    `inputs` may live on the meta device. Run as split_layer_names runs it (once, no gradients, eval mode, the
    model's modes, hooks and random states left as they were)."""
    found, depth = [], [0]

    class Probe(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if not depth[0] and split_product_operands(func, args, kwargs) is not None:
                found.append(func)
            return func(*args, **kwargs)

    def enter(module, args):
        depth[0] += 1

    def leave(module, args, output):
        depth[0] -= 1

    with _probe_run(model, inputs) as restore:
        for _, module in _patchable_layers(model):
            restore.callback(module.register_forward_pre_hook(enter).remove)
            restore.callback(module.register_forward_hook(leave).remove)
        with Probe():
            model(*inputs)
    return bool(found)


def unpatch(model):
    """Undoes patch(): every patched layer of `model` gets its own class back (and drops its kept split)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"unpatch: model must be a torch.nn.Module, got {type(model).__name__}")
    originals = {patched: cls for cls, patched in _PATCHED_CLASSES.items()}
    for module in model.modules():
        _ungroup_projections(module)
    for module in model.modules():
        cls = type(module)
        original = originals.get(cls)
        for name in ("_next_block", "_pending_norm1", "_causal_mask_verdict"):
            module.__dict__.pop(name, None)
        over_patched = (original is None and _parametrize.is_parametrized(module)
                        and any(base in originals for base in cls.__bases__))
        if original is not None or over_patched:
            if isinstance(module, FusedLinear):
                module.clear_weight_split()
                for name in ("cache_weight_split", "_weight_split_key", "_weight_split",
                             "_weight_split_refused_rows", "_plain_numel_below"):
                    module.__dict__.pop(name, None)
            if over_patched:  # a class made for this module over the patched one (parametrize's): its base goes back
                cls.__bases__ = tuple(originals.get(base, base) for base in cls.__bases__)
            else:
                module.__class__ = original
    return model


def is_patched(module):
    """Whether patch() turned `module` into the library's."""
    return type(module) in _PATCHED_CLASSES.values()


# ---- the scoped mode ------------------------------------------------------------------------------------------------

def _plain(*tensors):
    """Plain strided tensors and Parameters (a subclass such as DTensor, or a nested tensor, goes to eager, which knows
    it)."""
    return all((type(t) is torch.Tensor or type(t) is nn.Parameter) and not t.is_nested for t in tensors)


# The products' routes: each function's operands as a linear layer's (x, weight of n x k, bias or None), or None where
# the call stays with eager. They take the parameters of the torch functions they stand for, by the same names
# (keyword calls); any other argument (extra, options: one this torch's function has and the route does not know,
# such as mm's out_dtype, or a mistake) leaves the call to eager, which computes or refuses it.
def _linear_operands(input, weight, bias=None, *extra, **options):
    # A bias F.linear broadcasts (a scalar, one element) stays with eager: the library's op takes one per output.
    if not extra and not options and _plain(input, weight) and weight.dim() == 2 and input.dim() >= 1 and (
            bias is None or (_plain(bias) and bias.shape == weight.shape[:1])):
        return input, weight, bias
    return None


def _matmul_operands(input, other, *extra, **options):
    # input (..., k) times a matrix other (k x n): the linear layer of weight other^T. Batched products stay with eager.
    if not extra and not options and _plain(input, other) and other.dim() == 2 and input.dim() >= 2:
        return input, other.t(), None
    return None


def _mm_operands(input, mat2, *extra, **options):
    if not extra and not options and _plain(input, mat2) and input.dim() == 2 and mat2.dim() == 2:
        return input, mat2.t(), None
    return None


def _addmm_operands(input, mat1, mat2, *deprecated, beta=1, alpha=1, **options):
    # deprecated: torch.addmm's old positional form (beta, input, alpha, mat1, mat2), left to eager.
    if not deprecated and not options and beta == 1 and alpha == 1 and _plain(input, mat1, mat2) and (
            mat1.dim() == 2 and mat2.dim() == 2 and input.dim() == 1 and input.shape[0] == mat2.shape[1]):
        return mat1, mat2.t(), input
    return None


_EINSUM_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")  # einsum's subscripts


def _einsum_subscripts(subscripts):
    # An operand's or the output's subscripts as a list, the ellipsis one item ("..."); None where a letter repeats
    # (a diagonal or a trace) or anything but letters and one ellipsis appears.
    head, ellipsis, tail = subscripts.partition("...")
    items = [*head, *(["..."] if ellipsis else []), *tail]
    letters = [item for item in items if item != "..."]
    if "." in tail or not _EINSUM_LETTERS.issuperset(letters) or len(set(letters)) != len(letters):
        return None
    return items


def _einsum_operands(equation, *operands, **options):
    # A tensor times a matrix written as einsum ("bijl,lk->bijk", "...d,nd->...n"): the linear layer of weight the
    # matrix (n x k, or its transpose where it is k x n), where the contracted index is the tensor's last and the
    # output lists the tensor's other indices in their order, then the matrix's free one. Every other einsum (batched
    # products, more operands, reordered outputs) stays with eager.
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):  # einsum(equation, [a, b])
        operands = tuple(operands[0])
    if options or not isinstance(equation, str) or len(operands) != 2:
        return None
    x, matrix = operands
    if not (isinstance(x, torch.Tensor) and isinstance(matrix, torch.Tensor) and _plain(x, matrix)):
        return None
    squeezed = equation.replace(" ", "")
    # einsum ignores spaces between subscripts, but refuses them inside an ellipsis or an arrow
    if any(squeezed.count(token) != equation.count(token) for token in ("...", "->")):
        return None
    inputs, arrow, output = squeezed.partition("->")
    parts = inputs.split(",")
    if len(parts) != 2:
        return None
    a, b = (_einsum_subscripts(part) for part in parts)
    if a is None or b is None or len(b) != 2 or "..." in b or not a or a[-1] == "...":
        return None
    if not arrow:  # the implicit output: the ellipsis, then the letters that appear once, in alphabetical order
        once = sorted(item for item in set(a + b) if item != "..." and (a + b).count(item) == 1)
        output = "".join(["..."] * ("..." in a) + once)
    out = _einsum_subscripts(output)
    contracted = a[-1]
    if out is None or contracted not in b or contracted in out:
        return None
    free = b[1] if b[0] == contracted else b[0]
    # The ellipsis stands for any number of dimensions, none included.
    rank_fits = x.dim() >= len(a) - 1 if "..." in a else x.dim() == len(a)
    if free in a or out != a[:-1] + [free] or not rank_fits or matrix.dim() != 2:
        return None
    weight = matrix if b == [free, contracted] else matrix.t()
    if weight.shape[1] != x.shape[-1]:  # eager raises, or broadcasts a dimension of one
        return None
    return x, weight, None


_PRODUCT_OPERANDS = {
    F.linear: _linear_operands,
    torch.matmul: _matmul_operands,
    torch.Tensor.matmul: _matmul_operands,
    torch.Tensor.__matmul__: _matmul_operands,
    torch.mm: _mm_operands,
    torch.Tensor.mm: _mm_operands,
    torch.addmm: _addmm_operands,
    torch.Tensor.addmm: _addmm_operands,
    torch.einsum: _einsum_operands,
}


def split_product_operands(func, args, kwargs):
    """The operands (x, weight of n x k, bias or None) of a call of one of fp32_gemm()'s product functions, float32,
    at a shape where a split may pay; else None."""
    operands = _PRODUCT_OPERANDS.get(func)
    found = operands(*args, **kwargs) if operands is not None else None
    if found is None or found[1].dtype != torch.float32 or not _split_may_take(found[0], *found[1].shape):
        return None
    return found


def _product_route(operands):
    """A route for one of _PRODUCT_OPERANDS's functions: the library's GEMM where no plain F.linear suffices."""
    def route(*args, **kwargs):
        found = operands(*args, **kwargs)
        if found is None or plain_linear_suffices(found[0], found[1]):
            return NotImplemented
        return gemm_multiply_leaky_relu(*found, 1.0, 1.0)
    return route


_CAPABLE_DEVICES = {}  # device index -> whether the attention kernels run there


def _attention_runs_on(device):
    capable = _CAPABLE_DEVICES.get(device.index)
    if capable is None:
        capable = _CAPABLE_DEVICES[device.index] = torch.cuda.get_device_capability(device) >= (8, 0)
    return capable


# The fewest keys with which the split attention kernels beat eager's (kernels/attention/NOTES.md, Decisions): a
# causal mask halves the work but not the passes that split k and v.
_ATTENTION_MIN_KEYS = 160
_CAUSAL_ATTENTION_MIN_KEYS = 384


def _attention_route(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False, *extra, **options):
    # Float32 CUDA attention of head dim 64 over enough keys, without a mask, dropout or a gradient to compute, takes
    # the split kernels (where they are faster than eager's); the rest stays eager's.
    if extra or options:
        return NotImplemented
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


def _attention(query, key, value, is_causal=False):
    """F.scaled_dot_product_attention(query, key, value, is_causal=is_causal) inside a route, where the mode does not
    see the call: the library's attention where _attention_route takes it."""
    out = _attention_route(query, key, value, is_causal=is_causal)
    return F.scaled_dot_product_attention(query, key, value, is_causal=is_causal) if out is NotImplemented else out


def _in_projection(query, key, value, weights, bias, contiguous=True):
    """F.multi_head_attention_forward's in-projection on the library's GEMM. One packed weight: one product for
    self-attention, two where key is value, else three on its row blocks (views, no copies); three weights (kdim,
    vdim): three products. contiguous: the parts of a packed product laid out apart, as eager's (a copy); else views
    of it."""
    embed_dim = query.shape[-1]

    def apart(projection, parts):  # (..., parts * embed) -> parts tensors of (..., embed)
        if not contiguous:
            return projection.unflatten(-1, (parts, embed_dim)).unbind(-2)
        projection = projection.unflatten(-1, (parts, embed_dim)).unsqueeze(0).transpose(0, -2).squeeze(-2)
        return projection.contiguous().unbind(0)

    if len(weights) == 1 and key is value:
        weight = weights[0]
        if query is key:
            return apart(linear(query, weight, bias), 3)
        w_q, w_kv = weight.split([embed_dim, 2 * embed_dim])
        b_q, b_kv = (None, None) if bias is None else bias.split([embed_dim, 2 * embed_dim])
        return (linear(query, w_q, b_q), *apart(linear(key, w_kv, b_kv), 2))
    weights = weights if len(weights) == 3 else weights[0].chunk(3)
    biases = (None,) * 3 if bias is None else bias.chunk(3)
    return tuple(linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))


def _swap_length_and_batch(query, key, value):
    """Attention's inputs with their first two dimensions swapped (views), keeping which of them are one tensor (the
    in-projection packs its products by that)."""
    swapped_query = query.transpose(0, 1)
    swapped_key = swapped_query if key is query else key.transpose(0, 1)
    swapped_value = (swapped_key if value is key else swapped_query if value is query else value.transpose(0, 1))
    return swapped_query, swapped_key, swapped_value


def _float_mask(mask, dtype):
    """A mask as F.multi_head_attention_forward adds it: a boolean one as 0 where False and -inf where True."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


def _multi_head_attention_route(query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias,
                                bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias,
                                training=True, key_padding_mask=None, need_weights=True, attn_mask=None,
                                use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None,
                                v_proj_weight=None, static_k=None, static_v=None, average_attn_weights=True,
                                is_causal=False, *extra, transposed_back=False, **options):
    # F.multi_head_attention_forward (nn.MultiheadAttention's) dispatches its products itself, out of the mode's
    # sight: for batched inputs without bias_k / bias_v, zero attention, static keys or dropout, the same computation,
    # masks included, with its projections through linear() (the library's GEMM where a split pays) and its
    # attention through _attention where it has no mask; every other call, and every ill-formed one (eager raises),
    # is eager's. transposed_back: the caller turns the output back to batch-major (a batch_first layer), so it may
    # be a transposed view; else it is contiguous, as eager's.
    weights = (q_proj_weight, k_proj_weight, v_proj_weight) if use_separate_proj_weight else (in_proj_weight,)
    tensors = (query, key, value, out_proj_weight, *weights) + tuple(
        t for t in (in_proj_bias, out_proj_bias) if t is not None)
    if extra or options or not _plain(*tensors):
        return NotImplemented
    if (bias_k is not None or bias_v is not None or add_zero_attn or static_k is not None or static_v is not None or
            (training and dropout_p != 0.0) or query.dim() != 3 or key.dim() != 3 or value.dim() != 3):
        return NotImplemented
    tgt_len, batch, embed_dim = query.shape
    src_len = key.shape[0]
    if (embed_dim != embed_dim_to_check or embed_dim % num_heads != 0 or key.shape[1] != batch or
            (key.shape[:2] != value.shape[:2] if use_separate_proj_weight else key.shape != value.shape)):
        return NotImplemented
    # The projections' shapes eager checks (or fails on): left to eager unless they hold.
    weight_shapes = ([(embed_dim, embed_dim), (embed_dim, key.shape[-1]), (embed_dim, value.shape[-1])]
                     if use_separate_proj_weight else [(3 * embed_dim, embed_dim)])
    if ([tuple(w.shape) for w in weights] != weight_shapes or
            (in_proj_bias is not None and tuple(in_proj_bias.shape) != (3 * embed_dim,))):
        return NotImplemented
    # Masks as eager takes them: boolean or floating, key_padding_mask (batch, src_len), attn_mask (tgt_len, src_len)
    # or (batch * heads, tgt_len, src_len), both of one dtype (eager warns on a mix), is_causal with an attn_mask.
    masks = [m for m in (key_padding_mask, attn_mask) if m is not None]
    if (any(not (m.dtype == torch.bool or m.is_floating_point()) or not _plain(m) for m in masks) or
            len({m.dtype for m in masks}) > 1 or (is_causal and attn_mask is None) or
            (key_padding_mask is not None and key_padding_mask.shape != (batch, src_len)) or
            (attn_mask is not None and attn_mask.shape not in ((tgt_len, src_len),
                                                               (batch * num_heads, tgt_len, src_len)))):
        return NotImplemented
    key_padding_mask = _float_mask(key_padding_mask, query.dtype)
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # the hint alone, as eager gives it to scaled_dot_product_attention
    else:
        attn_mask = _float_mask(attn_mask, query.dtype)
        is_causal = is_causal and key_padding_mask is None
    head_dim = embed_dim // num_heads
    # Batch-major views (nn.MultiheadAttention's batch_first inputs, transposed) whose in-projection a split takes
    # (its bits are not eager's then) run batch-major: no copy of the inputs, of the packed projection or of
    # attention's output. Elsewhere eager's layout, and so eager's bits where no split takes a product.
    batch_major = (all(t.transpose(0, 1).is_contiguous() for t in (query, key, value)) and
                   not plain_product_suffices(query, *weights[0].shape, weights[0].requires_grad))
    if batch_major:  # (batch, length, embed)
        query, key, value = _swap_length_and_batch(query, key, value)
    q, k, v = _in_projection(query, key, value, weights, in_proj_bias, contiguous=not batch_major)
    if attn_mask is not None and attn_mask.dim() == 2:
        attn_mask = attn_mask.unsqueeze(0)
    if key_padding_mask is not None:  # merged into one additive mask of (batch * heads, 1 or tgt_len, src_len)
        key_padding_mask = key_padding_mask.view(batch, 1, 1, src_len).expand(-1, num_heads, -1, -1).reshape(
            batch * num_heads, 1, src_len)
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
    if batch_major:  # (batch, length, embed) -> (batch, heads, length, head_dim), views
        q, k, v = (t.unflatten(-1, (num_heads, head_dim)).transpose(1, 2) for t in (q, k, v))
    else:  # (length, batch, embed) -> (batch * heads, length, head_dim), as eager's
        q = q.reshape(tgt_len, batch * num_heads, head_dim).transpose(0, 1)
        k = k.reshape(src_len, batch * num_heads, head_dim).transpose(0, 1)
        v = v.reshape(src_len, batch * num_heads, head_dim).transpose(0, 1)

    def projected_out(heads_out):  # attention's output (batch, heads, tgt_len, head_dim) -> (tgt_len, batch, embed)
        if batch_major:
            rows = heads_out.transpose(1, 2).reshape(batch * tgt_len, embed_dim)
            out = linear(rows, out_proj_weight, out_proj_bias).view(batch, tgt_len, out_proj_weight.shape[0])
            out = out.transpose(0, 1)
            return out if transposed_back else out.contiguous()
        rows = heads_out.permute(2, 0, 1, 3).reshape(tgt_len * batch, embed_dim)
        return linear(rows, out_proj_weight, out_proj_bias).view(tgt_len, batch, out_proj_weight.shape[0])

    if need_weights:  # eager's explicit weights: softmax(q k^T / sqrt(head_dim) + mask), averaged over heads if asked
        if batch_major:
            q, k, v = (t.reshape(batch * num_heads, -1, head_dim) for t in (q, k, v))
        q_scaled = q * math.sqrt(1.0 / float(head_dim))
        scores = (torch.bmm(q_scaled, k.transpose(-2, -1)) if attn_mask is None
                  else torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1)))
        attention_weights = F.softmax(scores, dim=-1)
        out = projected_out(torch.bmm(attention_weights, v).view(batch, num_heads, tgt_len, head_dim))
        attention_weights = attention_weights.view(batch, num_heads, tgt_len, src_len)
        return out, attention_weights.mean(dim=1) if average_attn_weights else attention_weights
    if not batch_major:
        # Lengths given, not -1: an empty batch leaves -1 undetermined.
        q, k, v = (t.view(batch, num_heads, length, head_dim) for t, length in ((q, tgt_len), (k, src_len),
                                                                                 (v, src_len)))
    if attn_mask is None:
        out = _attention(q, k, v, is_causal)
    else:
        attn_mask = (attn_mask.unsqueeze(0) if attn_mask.size(0) == 1 else
                     attn_mask.view(batch, num_heads, attn_mask.size(1), src_len))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal)
    return projected_out(out), None


_ROUTES = {
    F.scaled_dot_product_attention: _attention_route,
    F.multi_head_attention_forward: _multi_head_attention_route,
    **{function: _product_route(operands) for function, operands in _PRODUCT_OPERANDS.items()},
}


class fp32_gemm(TorchFunctionMode):
    """with kernels.fp32_gemm(): float32 CUDA products in the block (F.linear, torch.matmul, @, mm, addmm, einsum, and
    F.multi_head_attention_forward's projections without bias_k / bias_v, zero attention or training dropout) take
    the library's GEMM where gemm_path.cpp's choice says it pays, and F.scaled_dot_product_attention without a mask,
    dropout or a gradient to compute (head dim 64, 160 keys or more, 384 under a causal mask) the library's
    attention; everything else, batched products included (bmm, matmul of two batched tensors), runs as without the
    mode."""

    routes = _ROUTES  # function -> its route, which returns NotImplemented for calls it leaves as they are

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = self.routes.get(func)
        if route is not None and "out" not in kwargs:
            result = route(*args, **kwargs)
            if result is not NotImplemented:
                return result
        return func(*args, **kwargs)


class _SplitAttention(fp32_gemm):
    """fp32_gemm() with only F.scaled_dot_product_attention's route: entered for an attention parent's call without a
    gradient to compute (_attention_may_split)."""

    routes = {F.scaled_dot_product_attention: _attention_route}


__all__ = ["patch", "unpatch", "is_patched", "fp32_gemm"]
