"""The GEMM family's Python side: fakes and batching rules of its ops, gemm_multiply_leaky_relu(), gemm_gelu(),
linear() and FusedLinear. The ops' autograd (reverse and forward mode, to any order) is C++ (gemm_autograd.cpp);
schemas in gemm.cpp:
  gemm_multiply_leaky_relu(x, weight, bias, multiplier, negative_slope, return_mask, weight_split=None) -> (y, mask)
  gemm_gelu(x, weight, bias, approximate, weight_split=None) -> gelu(x @ weight.T + bias), the GELU in the epilogue
  gemm_weight_split(x, weight) -> the weight's split for x's split path, made ahead ([] where that path takes none)
  gemm_multiply_leaky_relu_backward(grad_y, x, weight, saved, ...) -> (grad_x, grad_weight, grad_bias), empty if unasked
  gemm_gelu_backward(grad_y, x, weight, pre, approximate, ...) -> (grad_x, grad_weight, grad_bias), likewise
  _gemm_gelu_with_pre(x, weight, bias, approximate, weight_split=None) -> (y, pre): gemm_gelu's training forward
Underscored ops are for tests and tools: the path a call takes (_gemm_multiply_leaky_relu_path), why a fast path
refuses inputs (_gemm_path_refusal), forcing a path, split_fp16's slices of K or its forward's orientation
(_gemm_force_path, _gemm_force_k_slices, _gemm_force_transposed; each returns the previous setting), _gemm_k_slices,
_gemm_fp32_path_for_capability, one split sweep alone into new tensors (_gemm_split_sweep: bench.py's split-sweep
rows).
"""

import collections
import functools
import math
import numbers
import sys
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from kernels import loader
from kernels.checks import check_float_tensor, check_same

loader.load_library()


def _gemm_multiply_leaky_relu_fake(x, weight, bias, multiplier, negative_slope, return_mask, weight_split=None):
    # The fake also runs as the op's Meta kernel, which the dispatcher picks where any tensor is on meta: a CPU or
    # CUDA x beside meta weights (a model built under torch.device("meta")) must raise here, as eager does, not
    # return an uninitialized tensor on x's device.
    _check_fake_arguments("gemm_multiply_leaky_relu", x, weight, bias)
    y = x.new_empty((*x.shape[:-1], weight.shape[0]))
    mask = x.new_empty(y.shape if return_mask else (0,), dtype=torch.bool)
    return y, mask


def _gemm_gelu_fake(x, weight, bias, approximate, weight_split=None):
    _check_fake_arguments("gemm_gelu", x, weight, bias)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _gemm_multiply_leaky_relu_backward_fake(grad_y, x, weight, saved, multiplier, negative_slope, x_grad,
                                            weight_grad, bias_grad):
    _check_same_device(grad_y, x, weight, saved)
    return (x.new_empty(x.shape if x_grad else (0,)), weight.new_empty(weight.shape if weight_grad else (0,)),
            weight.new_empty((weight.shape[0],) if bias_grad else (0,)))


def _gemm_gelu_with_pre_fake(x, weight, bias, approximate, weight_split=None):
    y = _gemm_gelu_fake(x, weight, bias, approximate)
    return y, torch.empty_like(y)


def _gemm_gelu_backward_fake(grad_y, x, weight, pre, approximate, x_grad, weight_grad, bias_grad):
    _check_same_device(grad_y, x, weight, pre)
    return (x.new_empty(x.shape if x_grad else (0,)), weight.new_empty(weight.shape if weight_grad else (0,)),
            weight.new_empty((weight.shape[0],) if bias_grad else (0,)))


def _check_same_device(*tensors):
    """Eager's own check (and message: "Tensor on device cpu is not on the expected device meta!")."""
    torch._prims_common.check_same_device(*(t for t in tensors if t is not None), allow_cpu_scalar_tensors=False)


def _check_fake_arguments(op, x, weight, bias):
    """The op's checks (gemm.cpp, check_gemm_arguments), made by its fake: under tracing and on the meta device."""
    _check_same_device(x, weight, bias)
    check_float_tensor(op, "x", x)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_float_tensor(op, name, t)
            check_same(op, name, t, "x", x)
    torch._check(weight.dim() == 2, lambda: f"kernels.{op}: weight must be 2-D (out_features, in_features), got shape "
                 f"{list(weight.shape)}")
    torch._check(x.dim() >= 1,
                 lambda: f"kernels.{op}: x must have at least 1 dimension (..., in_features), got a scalar")
    torch._check(x.shape[-1] == weight.shape[1], lambda: f"kernels.{op}: x's last dimension is {x.shape[-1]} but "
                 f"in_features is {weight.shape[1]} (x has shape {list(x.shape)}, weight {list(weight.shape)})")
    torch._check(bias is None or (bias.dim() == 1 and bias.shape[0] == weight.shape[0]), lambda: f"kernels.{op}: "
                 f"bias must have shape [out_features] = [{weight.shape[0]}], got {list(bias.shape)}")


def gemm_multiply_leaky_relu(x, weight, bias=None, multiplier=1.0, negative_slope=0.01, weight_split=None):
    """leaky_relu((x @ weight.T + bias) * multiplier, negative_slope) for x of shape (..., in_features); DTensors go
    shard by shard (_tensor_parallel). weight_split: kernels::gemm_weight_split's result for this weight, or None
    (same result either way)."""
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and
            (bias is None or isinstance(bias, torch.Tensor))):
        raise TypeError("kernels.gemm_multiply_leaky_relu: x, weight and bias must be torch.Tensors (bias may be None), "
                        f"got {type(x).__name__}, {type(weight).__name__}, {type(bias).__name__}")
    if not _is_compiling():  # Dynamo is not asked to trace the module lookup
        dtensor = _dtensor_type()
        if dtensor is not None and any(isinstance(t, dtensor) for t in (x, weight, bias)):
            return _tensor_parallel(x, weight, bias, multiplier, negative_slope)
    # The op's C++ Autograd kernel records the graph, and asks for the mask where the backward needs it. Called
    # through its C++ handle, which is all that OpOverload.__call__ does, one Python frame less; Dynamo traces the
    # OpOverload only.
    if _is_compiling():
        return torch.ops.kernels.gemm_multiply_leaky_relu.default(x, weight, bias, multiplier, negative_slope, False)[0]
    return _gemm_handle(x, weight, bias, multiplier, negative_slope, False, weight_split)[0]


def gemm_gelu(x, weight, bias=None, approximate="none", weight_split=None):
    """F.gelu(x @ weight.T + bias) in one op: on a split path the GELU runs in the GEMM's epilogue and, without a
    gradient, the pre-activation is never written. approximate "none" is nn.GELU()'s function; "tanh" is gelu_tanh()'s
    formula (the tanh approximation, rounded once). Where autograd records a gradient the op writes the pre-activation
    beside y (from the same epilogue where the split GEMM can: _gemm_gelu_with_pre) and records one node, whose
    backward makes the GELU's gradient within the split of grad_x's operand (gemm_gelu_backward); with forward-mode
    tangents it runs as its two steps. DTensors: the product shard by shard, then the activation. weight_split as
    gemm_multiply_leaky_relu's."""
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and
            (bias is None or isinstance(bias, torch.Tensor))):
        raise TypeError("kernels.gemm_gelu: x, weight and bias must be torch.Tensors (bias may be None), "
                        f"got {type(x).__name__}, {type(weight).__name__}, {type(bias).__name__}")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"kernels.gemm_gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    if _is_compiling():
        return torch.ops.kernels.gemm_gelu.default(x, weight, bias, approximate)
    dtensor = _dtensor_type()
    if dtensor is not None and any(isinstance(t, dtensor) for t in (x, weight, bias)):
        pre = gemm_multiply_leaky_relu(x, weight, bias, 1.0, 1.0)  # Shard or Replicate (_tensor_parallel)
        if approximate == "none":
            return F.gelu(pre)
        # gelu_tanh has no sharding rule; element-wise, it runs on each rank's part as it lies.
        return dtensor.from_local(_gelu_of(pre.to_local(), approximate), pre.device_mesh, pre.placements,
                                  run_check=False, shape=pre.shape, stride=pre.stride())
    return _gemm_gelu_handle(x, weight, bias, approximate, weight_split)


def _gelu_of(pre, approximate):
    """gemm_gelu's activation alone: F.gelu, or kernels.gelu_tanh for "tanh"."""
    return F.gelu(pre) if approximate == "none" else torch.ops.kernels.gelu_tanh.default(pre)


def linear(x, weight, bias=None):
    """F.linear(x, weight, bias) on the library's GEMM: gemm_multiply_leaky_relu with the identity epilogue, or
    F.linear itself where no split path can take the call (plain_linear_suffices). weight may be a transposed view of
    an (in_features, out_features) matrix, which the split path reads without a copy. A 1-D weight (F.linear's
    vector product) is F.linear's; tensors on two devices get the op's error (F.linear can return an uninitialized
    tensor for a meta weight or bias with real x)."""
    if weight.dim() != 2:
        return F.linear(x, weight, bias)
    if (x.device == weight.device and (bias is None or bias.device == x.device)
            and plain_linear_suffices(x, weight)):
        return F.linear(x, weight, bias)
    return gemm_multiply_leaky_relu(x, weight, bias, 1.0, 1.0)


# The split paths: fp32 accuracy from three fp16 tensor-core products (chosen in gemm_path.cpp). split_fp16: the Hopper
# kernel (wgmma, TMA); split_fp16_sm80: the same method on sm_80 instructions (mma.sync), any GPU from the A100 on.
SPLIT_PATHS = ("split_fp16", "split_fp16_sm80")
# The paths a float32 product takes instead of cuBLAS's IEEE SGEMM where they can: the split kernels, and
# cublas_bf16x9, cuBLAS's own FP32 emulation on bf16 tensor cores (Blackwell; gemm_cublas_bf16x9.cpp).
FAST_FP32_PATHS = SPLIT_PATHS + ("cublas_bf16x9",)


def gemm_path(x, weight):
    """The path gemm_multiply_leaky_relu takes for these inputs under the current settings: "cublas" or one of
    FAST_FP32_PATHS."""
    return torch.ops.kernels._gemm_multiply_leaky_relu_path(x, weight)


def gemm_paths(device):
    """Every path gemm_multiply_leaky_relu can take on `device` for float32 under the current settings, chosen
    automatically or not: "cublas", then the fast float32 paths that can run there. For tests, tools and bench."""
    probe = torch.empty(8, 64, device=device)
    return ["cublas"] + [p for p in FAST_FP32_PATHS if torch.ops.kernels._gemm_path_refusal(probe, probe, p) == ""]


class forced_gemm_path:
    """with forced_gemm_path(path): gemm_multiply_leaky_relu calls in the block take `path` ("cublas", one of
    FAST_FP32_PATHS, or "auto"); a forced fast path that cannot run raises. A class, not a generator function: the
    module must hold no exception handling (KernelBench's static check)."""

    def __init__(self, path):
        self.path = path
        self.previous = None

    def __enter__(self):
        global _forced_path
        self.previous = torch.ops.kernels._gemm_force_path(self.path)
        _forced_path = self.path
        return self

    def __exit__(self, *exc_info):
        global _forced_path
        torch.ops.kernels._gemm_force_path(self.previous)
        _forced_path = self.previous
        return False


STREAM_K = -1  # forced_k_slices's value for stream-K (gemm.h's kStreamK)


class _ForcedSetting:
    """A block with one of the ops' forced settings (_op: the op's name, which sets the value and returns the previous
    one), the previous restored after it. A class, not a generator function (KernelBench's static check)."""

    _op = None

    def __init__(self, value):
        self.value, self.previous = value, None

    def __enter__(self):
        self.previous = getattr(torch.ops.kernels, self._op)(self.value)
        return self

    def __exit__(self, *exc_info):
        getattr(torch.ops.kernels, self._op)(self.previous)
        return False


class forced_k_slices(_ForcedSetting):
    """with forced_k_slices(s): every split_fp16 product in the block splits K into at most s slices, or, with
    STREAM_K, by stream-K (K whole where it does not fit: no partial last round of tiles, or fewer of its chunks than
    the GPU has multiprocessors); 0 is the automatic choice. For tests and tools."""

    _op = "_gemm_force_k_slices"


class forced_transposed(_ForcedSetting):
    """with forced_transposed(mode): every split_fp16 forward in the block whose weight is given as it is (not a
    transposed view) is computed transposed (y^T = w x^T: the weight split by rows ahead, x in the kernel) with mode 1,
    as it is with -1; 0 is the automatic choice (m k > n k + m n). For tests (both orientations of one shape) and
    tools."""

    _op = "_gemm_force_transposed"


# The path forced_gemm_path sets ("auto" by default): part of FusedLinear's key for the weight's split, whose layout
# is the path's.
_forced_path = "auto"


_gemm_handle = torch.ops.kernels.gemm_multiply_leaky_relu.default._op
_gemm_gelu_handle = torch.ops.kernels.gemm_gelu.default._op
_is_compiling = torch.compiler.is_compiling  # Dynamo knows the function itself, whatever its name here
# torch.jit.trace's state, None outside it (Dynamo folds the call to None). Under that tracer x.numel() and x.shape
# are traced tensors: a size check would record ops (and fail on a bound beyond int64), so calls take the plain product.
_tracing_state = torch._C._get_tracing_state
_Tensor = torch.Tensor  # (a module global: one lookup less in the plain call's checks)


# split_pays_off's thresholds (gemm_path.cpp): [min_side, min_outputs, min_reduction, min_outputs_short_reduction,
# min_short_reduction].
_SPLIT_THRESHOLDS = tuple(torch.ops.kernels._gemm_split_thresholds())


def split_may_pay(m, n, k):
    """gemm_path.cpp's split_pays_off for a product (m x k) times (k x n)."""
    min_side, min_outputs, min_k, min_outputs_short_k, min_short_k = _SPLIT_THRESHOLDS
    outputs = m * n
    return m >= min_side and n >= min_side and (
        (k >= min_k and outputs >= min_outputs) or (k >= min_short_k and outputs >= min_outputs_short_k))


def plain_linear_suffices(x, weight):
    """Whether F.linear suffices for a plain linear layer (multiplier 1, slope 1): no product of the call or of its
    recorded backward can take a split path, so the call skips the op's host cost. Only plain tensors qualify; the
    checks are ordered cheapest first (most small layers are settled by the output sizes alone)."""
    n, k = weight.shape
    return plain_product_suffices(x, n, k, weight.requires_grad)


@functools.lru_cache(maxsize=1024)  # per weight shape: a parametrized weight is a new tensor on every call
def rows_below_any_split(n, k):
    """The fewest rows m of x (m x k, against a weight of n x k) at which some product of a linear call or of its
    backward may split: split_may_pay grows with each of its sizes, so below this count F.linear always suffices."""
    def any_may_pay(m):
        return split_may_pay(m, n, k) or split_may_pay(m, k, n) or split_may_pay(n, k, m)

    low, high = 0, 1 << 62  # any_may_pay(high) or none pays at all
    if not any_may_pay(high):
        return high
    while low < high:
        middle = (low + high) // 2
        if any_may_pay(middle):
            high = middle
        else:
            low = middle + 1
    return low


def plain_product_suffices(x, n, k, weight_requires_grad):
    """plain_linear_suffices for a weight of n x k (out x in) elements, given or not as its transpose."""
    if type(x) is not torch.Tensor or _forced_path != "auto":
        return type(x) is torch.Tensor and _forced_path == "cublas"
    if _tracing_state() is not None:  # torch.jit.trace: nn.Linear's op, as it traces nn.Linear
        return True
    m = x.numel() // k if k else 0
    least = _SPLIT_THRESHOLDS[1]  # no product of fewer outputs splits
    if m * n < least and (m * k < least and n * k < least or not (
            torch.is_grad_enabled() and (x.requires_grad or weight_requires_grad))):
        return True
    if not x.is_cuda or x.dtype != torch.float32 or _tf32_allowed():
        return True
    if split_may_pay(m, n, k):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight_requires_grad):
        return not (split_may_pay(m, k, n) or split_may_pay(n, k, m))  # grad_x's product, grad_W's
    return True


_tf32_allowed = torch._C._get_cublas_allow_tf32  # the setting gemm_path.cpp reads (allowTF32CuBLAS)


def _no_weight():
    return None


_NO_PLAIN_BOUND = (_no_weight, 0)  # FusedLinear's plain-call bound before it has seen a weight


def _has_hooks(module):
    """Whether a hook would see `module`'s call: its own, or the global module hooks."""
    hooks = torch.nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or hooks._global_forward_hooks or hooks._global_forward_pre_hooks
                or hooks._global_backward_hooks or hooks._global_backward_pre_hooks)


class FusedLinear(nn.Linear):
    """nn.Linear (same parameters, init and state_dict keys; kernels.nn.Linear) with a fusable epilogue: linear(x) is
    x @ W^T + b, linear(x, multiplier=m, negative_slope=s) is leaky_relu((x @ W^T + b) * m, s), one op call each; a
    plain call no split path takes is F.linear. Called as a module, so hooks, tensor-parallel plans and FSDP2 apply.

    cache_weight_split (default on): from a weight's second unchanged use, its fp16 split (gemm_weight_split, for
    products of KEPT_SPLIT_MIN_PRODUCTS or more) is kept and given to the op; results are bitwise the same. Kept only
    in eager calls that do not record the weight's gradient, keyed on the tensor, its address and version counter
    (the op checks the stamp again). Changes PyTorch does not count (`.data`, foreign writes) are not seen: call
    clear_weight_split(). None is kept in a process with a torch.distributed process group, whose collectives
    (FSDP's gathers, a broadcast of weights) write uncounted. Memory: ~4 bytes per weight element, within
    kept_split_budget() per GPU, LRU dropped first.
    """

    def __init__(self, *args, cache_weight_split=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.cache_weight_split = cache_weight_split
        # (a weak reference to the weight, the element count of x below which no product splits)
        self._plain_numel_below = _NO_PLAIN_BOUND
        self.clear_weight_split()

    def forward(self, input, multiplier=1.0, negative_slope=1.0):
        x = input  # nn.Linear's parameter name, for callers that pass it by keyword
        # A host-bound layer's plain call, its checks in one expression (such a call is all host time): the weight
        # noted with the bound below is the registered parameter, no instance attribute hides it or the bias, no parent
        # left a shared product, and x has fewer elements than any split needs (under torch.jit.trace numel() is a
        # traced tensor, not an int: such calls take the checks below). The bound is kept per weight object; a
        # shape changed through .data leaves it stale, which costs speed only: F.linear is always right.
        parameters, attributes = self._parameters, self.__dict__
        weight = parameters.get("weight")
        noted_weight, plain_numel = self._plain_numel_below
        if (noted_weight() is weight and weight is not None and "bias" in parameters and "weight" not in attributes
                and "bias" not in attributes and "_shared_product" not in attributes and type(x) is _Tensor
                and type(numel := x.numel()) is int and numel < plain_numel and _forced_path == "auto"
                and multiplier == 1.0 and negative_slope == 1.0):
            return F.linear(x, weight, parameters["bias"])
        # A parent that computes its sibling layers' products as one (kernels.patch) leaves, for the length of its own
        # call, (its input, a function of (this layer, x) giving this layer's part of that product or None) here for
        # this layer's first call; the part stands for a call on that same input.
        shared = attributes.get("_shared_product")  # (a get, not a pop: Dynamo traces this line)
        if shared is not None:
            attributes.pop("_shared_product", None)
            if shared[0] is x and multiplier == 1.0 and negative_slope == 1.0:
                part = shared[1](self, x)
                if part is not None:
                    return part
        weight, bias = self._weight_and_bias()
        if noted_weight() is not weight:
            self._note_plain_bound(weight)
        if multiplier == 1.0 and negative_slope == 1.0 and plain_linear_suffices(x, weight):
            return F.linear(x, weight, bias)
        # Under tracing (torch.compile, export) nothing is kept: the traced graph splits the weight on each call.
        weight_split = None if _is_compiling() or type(x) is not torch.Tensor else self._weight_split_for(x, weight)
        return gemm_multiply_leaky_relu(x, weight, bias, multiplier, negative_slope, weight_split)

    def forward_gelu(self, x, approximate="none"):
        """F.gelu(self.forward(x), approximate=approximate) (gelu_tanh()'s formula for "tanh") as one op, gemm_gelu,
        with the kept weight split as forward() keeps it; F.linear and the activation where no split path can take
        the call. This layer's hooks do not run: its callers (kernels.patch's MLPs) take it only where it has none."""
        weight, bias = self._weight_and_bias()
        noted_weight, plain_numel = self._plain_numel_below  # as in forward()
        noted_weight = noted_weight()
        if (noted_weight is weight and type(x) is _Tensor and type(numel := x.numel()) is int and numel < plain_numel
                and _forced_path == "auto"):
            return _gelu_of(F.linear(x, weight, bias), approximate)
        if noted_weight is not weight:
            self._note_plain_bound(weight)
        if plain_linear_suffices(x, weight):
            return _gelu_of(F.linear(x, weight, bias), approximate)
        weight_split = None if _is_compiling() or type(x) is not torch.Tensor else self._weight_split_for(x, weight)
        return gemm_gelu(x, weight, bias, approximate, weight_split)

    def _weight_and_bias(self):
        """self.weight and self.bias: straight from the parameters' dict (a small layer's call is all host time), through
        the attributes where something else provides them (torch.nn.utils.parametrize's properties) or an instance
        attribute hides the parameter (set by object.__setattr__, which attribute lookup finds first)."""
        parameters, attributes = self._parameters, self.__dict__
        weight = parameters.get("weight")
        if weight is None or "weight" in attributes:
            weight = self.weight
        bias = parameters["bias"] if "bias" in parameters and "bias" not in attributes else self.bias
        return weight, bias

    def _note_plain_bound(self, weight):
        """Keeps, for this weight object (by a weak reference: a parametrized weight or functional_call's tensors are
        not held), the element count of x below which F.linear suffices (not while tracing: a compiled graph checks
        the sizes itself, and torch.jit.trace's sizes are traced tensors)."""
        if not _is_compiling() and _tracing_state() is None:
            n, k = weight.shape
            self._plain_numel_below = (weakref.ref(weight), rows_below_any_split(n, k) * k)

    def clear_weight_split(self):
        """Drops the kept split of the weight (the next calls split it again)."""
        # (the weight, its data address, version and the forced path when seen; its split, None before the second
        # such call; the row counts of x for which the op made none)
        if getattr(self, "_weight_split", None) is not None:
            _kept_splits.forget(self)
        self._weight_split_key = None
        self._weight_split = None
        self._weight_split_refused_rows = ()

    def _weight_split_for(self, x, weight):
        if x.numel() * weight.shape[0] < KEPT_SPLIT_MIN_PRODUCTS:  # none is made: the call stays host-bound and lean
            return None
        rewritten = _rewritten_uncounted()
        if rewritten or not (self.cache_weight_split and _split_may_be_kept(x, weight)):
            if self._weight_split_key is not None:
                self.clear_weight_split()
            if rewritten and _kept_splits.entries:  # splits kept before the process group: none is read
                _kept_splits.drop_all()
            return None
        key = (weight, weight._version, weight.data_ptr(), _forced_path)
        seen = self._weight_split_key
        if seen is None or seen[0] is not weight or seen[1:] != key[1:]:
            # Seen for the first time: a weight used once (a training step's) is not split ahead.
            self.clear_weight_split()
            self._weight_split_key = key
            return None
        if self._weight_split is None:
            rows = x.numel() // max(x.shape[-1], 1)
            if rows in self._weight_split_refused_rows:
                return None
            split_bytes = _kept_splits.split_bytes(weight)
            if not _kept_splits.make_room(weight.device, split_bytes):
                return None
            with torch.no_grad():
                split = torch.ops.kernels.gemm_weight_split(x, weight)
            if len(split) == 1:  # out of memory: make room on that GPU, go on without one
                _kept_splits.drop_all(weight.device)
                return None
            if not split:  # this shape's path takes no split of the weight
                self._weight_split_refused_rows = (*self._weight_split_refused_rows[-15:], rows)
                return None
            self._weight_split = split
            _kept_splits.add(self, weight.device, split_bytes)
        _kept_splits.touch(self)
        return self._weight_split

    def __getstate__(self):
        # The class's own state where it makes one (a subclass patched by kernels.patch may drop or refuse things);
        # the split is not saved, pickled or copied: the copy makes its own.
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        if not isinstance(state, dict):
            return state
        state = dict(state)
        state.update(_weight_split_key=None, _weight_split=None, _weight_split_refused_rows=())
        state.pop("_plain_numel_below", None)  # a weak reference: the copy notes its own
        state.pop("_shared_product", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        if "cache_weight_split" not in state:  # a pickle without cache_weight_split (an older FusedLinear)
            self.cache_weight_split = True
            self.clear_weight_split()
        if "_plain_numel_below" not in state:
            self._plain_numel_below = _NO_PLAIN_BOUND


class _KeptSplits:
    """The weight splits FusedLinear modules keep, per GPU, within a budget of bytes: least recently used first out."""

    def __init__(self):
        self.budget_bytes = None  # None: DEFAULT_KEPT_SPLIT_BUDGET of each GPU's memory
        self.entries = collections.OrderedDict()  # id(module) -> (weakref to module, device, bytes); oldest first
        self.device_bytes = collections.Counter()

    @staticmethod
    def split_bytes(weight):
        # hi and lo (2 bytes each per element, rows padded to whole chunks of 64), 4 bytes per row (rounded up to a
        # multiple of 4) and chunk, 4 per row
        rows, columns = weight.shape
        chunks = -(-columns // 64)
        return rows * chunks * 64 * 4 + -(-rows // 4) * 4 * chunks * 4 + rows * 4

    def budget(self, device):
        if self.budget_bytes is not None:
            return self.budget_bytes
        return int(torch.cuda.get_device_properties(device).total_memory * DEFAULT_KEPT_SPLIT_BUDGET)

    def make_room(self, device, nbytes):
        """Drops the least recently used splits of `device` until `nbytes` more fit its budget; False if they cannot."""
        budget = self.budget(device)
        if nbytes > budget:
            return False
        for key in list(self.entries):
            if self.device_bytes[device] + nbytes <= budget:
                break
            module_ref, entry_device, _ = self.entries[key]
            module = module_ref()
            if entry_device == device and module is not None:
                module.clear_weight_split()
            elif module is None:
                self._remove(key)
        return self.device_bytes[device] + nbytes <= budget

    def add(self, module, device, nbytes):
        key = id(module)
        self.entries[key] = (weakref.ref(module, lambda _, key=key: self._remove(key)), device, nbytes)
        self.device_bytes[device] += nbytes

    def touch(self, module):
        if id(module) in self.entries:
            self.entries.move_to_end(id(module))

    def forget(self, module):
        self._remove(id(module))

    def _remove(self, key):
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.device_bytes[entry[1]] -= entry[2]

    def drop_all(self, device=None):
        for key, (module_ref, entry_device, _) in list(self.entries.items()):
            module = module_ref()
            if device is None or entry_device == device:
                if module is not None:
                    module.clear_weight_split()
                else:
                    self._remove(key)


_kept_splits = _KeptSplits()

# The default budget of kept weight splits: this fraction of each GPU's memory.
DEFAULT_KEPT_SPLIT_BUDGET = 0.25


def _gpu(device):
    """`device` as a torch.device with its index (the current GPU's where it names none); splits are kept on CUDA GPUs
    only."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"kernels: weight splits are kept on CUDA GPUs only, got device {device}")
    if not torch.cuda.is_available():
        raise RuntimeError("kernels: weight splits are kept on CUDA GPUs, and this torch sees none")
    return torch.device("cuda", torch.cuda.current_device()) if device.index is None else device


def kept_split_budget(device="cuda"):
    """The bytes that kept weight splits may take on `device` together (set_kept_split_budget changes it)."""
    return _kept_splits.budget(_gpu(device))


def set_kept_split_budget(nbytes):
    """Sets the bytes kept weight splits may take on each GPU (None: DEFAULT_KEPT_SPLIT_BUDGET of its memory; 0: keep
    none), and drops the least recently used splits over it now."""
    if nbytes is not None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real) or not 0 <= nbytes < math.inf:
            raise ValueError(f"kernels.set_kept_split_budget: nbytes must be None or a number >= 0, got {nbytes!r}")
        nbytes = int(nbytes)
    _kept_splits.budget_bytes = nbytes
    for device in [d for d, used in _kept_splits.device_bytes.items() if used > 0]:
        _kept_splits.make_room(device, 0)


def kept_split_bytes(device="cuda"):
    """The bytes the kept weight splits take on `device` now."""
    return _kept_splits.device_bytes[_gpu(device)]


def clear_kept_splits(device=None):
    """Drops every kept weight split (of `device`'s GPU where given): after weights were written in a way their version
    counters do not count (through `.data`, as PEFT's LoRA merge and unmerge write; by another process), so that the
    next calls split them anew."""
    _kept_splits.drop_all(None if device is None else _gpu(device))


# The multiply-adds (rows x in_features x out_features) from which kernels::gemm_weight_split makes a split to keep
# (gemm_weight_split.cpp, kKeptSplitMinProducts): below, a call's time is mostly the host's, which a kept split
# would lengthen.
KEPT_SPLIT_MIN_PRODUCTS = 1 << 32


def _split_may_be_kept(x, weight):
    """Whether a split of `weight` may be kept across calls here (an eager call): CUDA float32 tensors, autograd not
    recording the weight, no autocast, CUDA graph capture or torch.func transform."""
    # Under autocast the op casts the weight, and a split of the float32 weight would never be read.
    return (weight.is_cuda and type(weight) in (nn.Parameter, torch.Tensor) and weight.dtype == torch.float32
            and type(x) is torch.Tensor and x.dtype == torch.float32 and not torch.is_autocast_enabled("cuda")
            and not (weight.requires_grad and torch.is_grad_enabled()) and not weight.is_inference()
            and not torch._C._are_functorch_transforms_active()
            and not torch.cuda.is_current_stream_capturing())


def _rewritten_uncounted():
    """Whether weights may be rewritten between calls without their version counters moving, so that a split kept
    across calls could go stale: in a process with a torch.distributed process group, whose collectives write tensors
    uncounted (a broadcast or all-reduce into a weight, FSDP's gathers into memory it freed, often at the same address,
    DeepSpeed ZeRO-3's)."""
    distributed = sys.modules.get("torch.distributed")
    return distributed is not None and distributed.is_available() and distributed.is_initialized()


# ---- tensor parallelism (DTensor) ----------------------------------------------------------------------------------

def _dtensor_type():
    """torch.distributed.tensor.DTensor where that module is loaded (else no DTensor can exist); importing it here
    would slow every process's import."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _tensor_parallel(x, weight, bias, multiplier, negative_slope):
    """The op on DTensors over a 1-D mesh, placed as eager's nn.Linear: weight Shard(0) (Colwise) gives y Shard(-1);
    Shard(1) (Rowwise) all-reduces partial products, then bias and epilogue, y Replicate; Replicate keeps x's batch
    sharding (or replicates). Other placements and meshes raise; eager only (the op has no sharding rule)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if not isinstance(weight, DTensor) or not isinstance(x, DTensor) or (bias is not None and
                                                                          not isinstance(bias, DTensor)):
        raise RuntimeError("kernels.gemm_multiply_leaky_relu: got mixed torch.Tensor and DTensor (x "
                           f"{type(x).__name__}, weight {type(weight).__name__}, bias {type(bias).__name__}); "
                           "convert all to DTensor, as eager's nn.Linear requires")
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise NotImplementedError("kernels.gemm_multiply_leaky_relu: DTensor weights on a mesh of "
                                  f"{mesh.ndim} dimensions; only 1-D meshes (one tensor-parallel group) are supported")
    placement = weight.placements[0]
    out_shape = (*x.shape[:-1], weight.shape[0])
    out_stride = tuple(math.prod(out_shape[i + 1:]) for i in range(len(out_shape)))  # contiguous

    def local(t, target, grad_placement=None):
        if t is None:
            return None
        t = t.redistribute(mesh, [target]) if t.placements[0] != target else t
        return t.to_local(grad_placements=[grad_placement] if grad_placement is not None else None)

    if placement.is_shard(0):
        # x is used whole by every rank for a part of y: its gradient on each rank is a partial sum.
        y = gemm_multiply_leaky_relu(local(x, Replicate(), Partial()), weight.to_local(), local(bias, Shard(0)),
                                     multiplier, negative_slope)
        return DTensor.from_local(y, mesh, [Shard(len(out_shape) - 1)], run_check=False, shape=out_shape,
                                  stride=out_stride)
    if placement.is_shard(1):
        partial = gemm_multiply_leaky_relu(local(x, Shard(x.ndim - 1)), weight.to_local(), None, 1.0, 1.0)
        summed = DTensor.from_local(partial, mesh, [Partial()], run_check=False, shape=out_shape, stride=out_stride)
        y = summed.redistribute(mesh, [Replicate()]).to_local()
        if bias is not None:
            y = y + local(bias, Replicate())
        y = torch.ops.kernels.leaky_relu(y * multiplier, negative_slope)
        return DTensor.from_local(y, mesh, [Replicate()], run_check=False, shape=out_shape, stride=out_stride)
    if placement.is_replicate():
        x_placement = x.placements[0]
        if x_placement.is_shard() and x_placement.dim % x.ndim != x.ndim - 1:
            # Each rank's rows of x against the whole weight: the weight's (and bias's) gradient is a partial sum.
            batch_dim = x_placement.dim % x.ndim
            y = gemm_multiply_leaky_relu(x.to_local(), local(weight, Replicate(), Partial()),
                                         local(bias, Replicate(), Partial()), multiplier, negative_slope)
            return DTensor.from_local(y, mesh, [Shard(batch_dim)], run_check=False, shape=out_shape,
                                      stride=out_stride)
        y = gemm_multiply_leaky_relu(local(x, Replicate()), weight.to_local(), local(bias, Replicate()), multiplier,
                                     negative_slope)
        return DTensor.from_local(y, mesh, [Replicate()], run_check=False, shape=out_shape, stride=out_stride)
    raise NotImplementedError(f"kernels.gemm_multiply_leaky_relu: a weight placed as {placement}; supported are "
                              "Shard(0) (ColwiseParallel), Shard(1) (RowwiseParallel) and Replicate")


# ---- torch.func.vmap -------------------------------------------------------------------------------------------------
# Batching rules: in_dims gives each tensor's batch dimension (None where it has none); a rule returns the outputs
# and theirs.

def _batch_first(t, dim, batch_size):
    """t with its batch dimension first: moved there, or (where t has none) a broadcast view."""
    return t.movedim(dim, 0) if dim is not None else t.expand(batch_size, *t.shape)


def _member(t, dim, i):
    return t if t is None or dim is None else t.select(dim, i)


def _gemm_multiply_leaky_relu_vmap(info, in_dims, x, weight, bias, multiplier, negative_slope, return_mask,
                                   weight_split=None):
    x_dim, weight_dim, bias_dim = in_dims[:3]  # in_dims has an entry per argument, None for non-tensors
    if weight_dim is None and bias_dim is None:
        # Batched inputs, one weight: the batch is more rows of x, one call (with the weight's split, if given).
        y, mask = torch.ops.kernels.gemm_multiply_leaky_relu(_batch_first(x, x_dim, info.batch_size), weight, bias,
                                                             multiplier, negative_slope, return_mask, weight_split)
        return (y, mask), (0, 0 if return_mask else None)
    # Batched weights (an ensemble of models, torch.func.stack_module_state): one product per member.
    outputs = [torch.ops.kernels.gemm_multiply_leaky_relu(_member(x, x_dim, i), _member(weight, weight_dim, i),
                                                          _member(bias, bias_dim, i), multiplier, negative_slope,
                                                          return_mask) for i in range(info.batch_size)]
    y = torch.stack([y for y, _ in outputs])
    return (y, torch.stack([m for _, m in outputs]) if return_mask else outputs[0][1]), (0, 0 if return_mask else None)


def _per_weight_member(op, info, in_dims, x, weight, bias, *options, weight_split=None):
    """op(x, weight, bias, *options) over a batch: one call on more rows of x where the weight and the bias have no
    batch dimension (with the weight's split, if given), else one call per member; its outputs stacked."""
    x_dim, weight_dim, bias_dim = in_dims[:3]
    if weight_dim is None and bias_dim is None:
        return op(_batch_first(x, x_dim, info.batch_size), weight, bias, *options, weight_split)
    outputs = [op(_member(x, x_dim, i), _member(weight, weight_dim, i), _member(bias, bias_dim, i), *options)
               for i in range(info.batch_size)]
    if isinstance(outputs[0], torch.Tensor):
        return torch.stack(outputs)
    return tuple(torch.stack(o) for o in zip(*outputs))


def _gemm_gelu_vmap(info, in_dims, x, weight, bias, approximate, weight_split=None):
    return _per_weight_member(torch.ops.kernels.gemm_gelu, info, in_dims, x, weight, bias, approximate,
                              weight_split=weight_split), 0


def _backward_per_member(op, info, in_dims, tensors, *options):
    """A backward op per member: each member's gradients of the weight are sums over its own rows. (jacrev maps this
    over the rows of an identity.)"""
    outputs = [op(*(_member(t, d, i) for t, d in zip(tensors, in_dims)), *options) for i in range(info.batch_size)]
    return tuple(torch.stack(g) for g in zip(*outputs)), (0, 0, 0)


def _gemm_gelu_with_pre_vmap(info, in_dims, x, weight, bias, approximate, weight_split=None):
    return _per_weight_member(torch.ops.kernels._gemm_gelu_with_pre, info, in_dims, x, weight, bias, approximate,
                              weight_split=weight_split), (0, 0)


def _gemm_multiply_leaky_relu_backward_vmap(info, in_dims, grad_y, x, weight, saved, multiplier, negative_slope,
                                            x_grad, weight_grad, bias_grad):
    return _backward_per_member(torch.ops.kernels.gemm_multiply_leaky_relu_backward, info, in_dims,
                                (grad_y, x, weight, saved), multiplier, negative_slope, x_grad, weight_grad, bias_grad)


def _gemm_gelu_backward_vmap(info, in_dims, grad_y, x, weight, pre, approximate, x_grad, weight_grad, bias_grad):
    return _backward_per_member(torch.ops.kernels.gemm_gelu_backward, info, in_dims, (grad_y, x, weight, pre),
                                approximate, x_grad, weight_grad, bias_grad)


def _gemm_leave_row_split_fake(y, hi, lo, exponent):
    return None  # keeps a split for a later forward on the device; nothing to trace


def _register_fakes_and_batching_rules():
    torch.library.register_fake("kernels::gemm_multiply_leaky_relu", _gemm_multiply_leaky_relu_fake)
    torch.library.register_fake("kernels::gemm_multiply_leaky_relu_backward", _gemm_multiply_leaky_relu_backward_fake)
    torch.library.register_vmap("kernels::gemm_multiply_leaky_relu", _gemm_multiply_leaky_relu_vmap)
    torch.library.register_vmap("kernels::gemm_multiply_leaky_relu_backward", _gemm_multiply_leaky_relu_backward_vmap)
    torch.library.register_fake("kernels::gemm_gelu", _gemm_gelu_fake)
    torch.library.register_fake("kernels::_gemm_leave_row_split", _gemm_leave_row_split_fake)
    torch.library.register_vmap("kernels::gemm_gelu", _gemm_gelu_vmap)
    torch.library.register_fake("kernels::_gemm_gelu_with_pre", _gemm_gelu_with_pre_fake)
    torch.library.register_vmap("kernels::_gemm_gelu_with_pre", _gemm_gelu_with_pre_vmap)
    torch.library.register_fake("kernels::gemm_gelu_backward", _gemm_gelu_backward_fake)
    torch.library.register_vmap("kernels::gemm_gelu_backward", _gemm_gelu_backward_vmap)


loader.register_once("gemm", _register_fakes_and_batching_rules)
