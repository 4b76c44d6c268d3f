"""kernels.patch / unpatch / fp32_gemm and kernels.nn.Linear: any model on the library's GEMM. Patched models against
the same models unpatched (outputs, gradients, state_dicts, ties, pickling), the functional mode against eager, and
the product shapes real models bring (transposed weights, short reductions) against float64."""

import contextlib
import copy
import io
import itertools
import os
import pickle
import re
import subprocess
import sys
import threading
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import kernels
from kernels import patching
from conftest import HAS_CUDA, requires_cuda
from kernels.gemm.gemm import (FusedLinear, forced_gemm_path, gemm_path, kept_split_bytes, linear,
                               plain_linear_suffices, set_kept_split_budget)
from kernels.precision import ALLCLOSE_TOLERANCE, gradient_atol, relative_error

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = ALLCLOSE_TOLERANCE[torch.float32]


class ScaledLinear(nn.Linear):
    """A subclass with a forward of its own: patch() must leave it as it is."""

    def forward(self, x):
        return 2 * super().forward(x)


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), ScaledLinear(32, 32), nn.Linear(32, 8, bias=False))


def ops_called(fn):
    """The names of the ops fn() dispatches (aten's and the library's)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    names = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            names.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return names


def check_close_to_float64(ours, eager, y64):
    """The precision contract: our error against float64 at most eager's, and allclose to eager at 1e-4."""
    assert relative_error(ours, y64) <= relative_error(eager, y64) * 1.0001 + 1e-12
    assert torch.allclose(ours, eager, atol=TOL, rtol=TOL)


# ---- patch() and unpatch() --------------------------------------------------------------------------------------------

def test_patch_keeps_parameters_hooks_and_classes(device):
    model = small_model().to(device)
    parameters = {name: p for name, p in model.named_parameters()}
    calls = []
    model[0].register_forward_hook(lambda module, args, out: calls.append(out.shape))
    model[3].weight.requires_grad_(False)
    keys = list(model.state_dict())

    assert kernels.patch(model) is model
    kernels.patch(model)  # idempotent
    assert kernels.is_patched(model[0]) and kernels.is_patched(model[3]) and not kernels.is_patched(model[2])
    assert type(model[2]) is ScaledLinear  # a forward of its own: left as it is
    for layer in (model[0], model[3]):
        assert isinstance(layer, nn.Linear) and isinstance(layer, FusedLinear) and isinstance(layer, kernels.nn.Linear)
    assert all(p is parameters[name] for name, p in model.named_parameters())
    assert list(model.state_dict()) == keys and not model[3].weight.requires_grad
    assert repr(model[0]) == "Linear(in_features=16, out_features=32, bias=True)"
    model(torch.randn(4, 16, device=device))
    assert calls == [torch.Size([4, 32])]

    assert kernels.unpatch(model) is model
    assert type(model[0]) is nn.Linear and type(model[3]) is nn.Linear and type(model[2]) is ScaledLinear
    assert "_weight_split" not in model[0].__dict__
    assert all(p is parameters[name] for name, p in model.named_parameters())


def test_patched_model_matches_unpatched(device):
    """Outputs and gradients of every parameter and of x, on the CPU exactly (the same F.linear), on the GPU within
    the contract."""
    model = small_model().to(device)
    patched = kernels.patch(copy.deepcopy(model))
    x = torch.randn(5, 3, 16, device=device, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y_patched = model(x), patched(x2)
    torch.testing.assert_close(y_patched, y, atol=TOL, rtol=TOL)
    grad = torch.randn_like(y)
    y.backward(grad)
    y_patched.backward(grad)
    torch.testing.assert_close(x2.grad, x.grad, atol=TOL, rtol=TOL)
    for (name, p), q in zip(model.named_parameters(), patched.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=gradient_atol(p.grad), rtol=TOL, msg=name)


def test_patch_only_the_named_layers():
    """patch(model, layers=...) turns only the layers named (model.named_modules()'s names), none for an empty list;
    a name no patchable layer has is a clear error, and the model is left as it was."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4), nn.MultiheadAttention(4, 2)))
    kernels.patch(model, layers=["2.0", "2.1"])
    assert {name for name, m in model.named_modules() if kernels.is_patched(m)} == {"2.0", "2.1"}
    assert not any(kernels.is_patched(m) for m in kernels.patch(small_model(), layers=[]).modules())
    for bad in (["1"], ["nothing"], ["0", "2.5"]):
        fresh = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        with pytest.raises(ValueError, match="no layer patch"):
            kernels.patch(fresh, layers=bad)
        assert not any(kernels.is_patched(m) for m in fresh.modules())
    kernels.patch(model, layers=["0", "2.0"])  # patched ones may be named again: idempotent
    assert kernels.is_patched(model[0])


def test_split_layer_names_on_the_meta_device():
    """split_layer_names: the layers whose forward a split takes at the inputs' shapes (a float32 product of 2^20
    outputs over 1024), from shapes alone on the meta device; smaller or float64 products none."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 48),
                              nn.Sequential(nn.Linear(48, 1024), nn.Linear(1024, 1024)))
        attention = nn.MultiheadAttention(1024, 16, batch_first=True)
        x = torch.randn(1024, 1024)
        tokens = torch.randn(2, 512, 1024)
    assert kernels.split_layer_names(model, x) == ["0", "3.1"]
    assert kernels.split_layer_names(model, x[:8]) == []
    assert kernels.split_layer_names(model.double(), x.double()) == []
    assert kernels.split_layer_names(attention, tokens, tokens, tokens) == [""]
    assert kernels.split_layer_names(attention, tokens[:, :8], tokens[:, :8], tokens[:, :8]) == []


def test_split_layer_names_leaves_the_model_as_it_was():
    """split_layer_names runs the model once in eval mode: its modes, hooks and BatchNorm statistics, and the random
    state, are as they were, after a call that raises too; shared layers are named under each of their names, layers
    called with keywords are seen."""
    shared = nn.Linear(1024, 1024)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.again, self.norm, self.drop = shared, shared, nn.BatchNorm1d(1024), nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(self.norm(self.again(input=self.first(x))))

    net = Net().train()
    net.norm.eval()
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert kernels.split_layer_names(net, torch.randn(1024, 1024)) == ["again", "first"]
    assert net.training and not net.norm.training and net.drop.training
    assert net.norm.num_batches_tracked.item() == 0
    assert not any(m._forward_pre_hooks for m in net.modules())
    torch.manual_seed(0)
    with pytest.raises(RuntimeError):
        kernels.split_layer_names(net, torch.randn(4, 7))
    assert not any(m._forward_pre_hooks for m in net.modules()) and net.training
    assert kernels.patch(net, layers=["again"]) is net and kernels.is_patched(net.first)
    with pytest.raises(TypeError, match="not one string"):
        kernels.patch(small_model(), layers="0")
    for call in (kernels.patch, kernels.unpatch):
        with pytest.raises(TypeError, match="model must be a torch.nn.Module, got NoneType"):
            call(None)


def test_multihead_attention_batch_major_route(monkeypatch):
    """The route's batch-major branch (taken where a split takes the in-projection; forced here, on the CPU): eager's
    results within float32's tolerance, with and without weights and masks, for self and cross attention; a
    batch_first layer's output comes back batch-major and contiguous, a sequence-first one's contiguous as eager's."""
    import kernels.patching

    monkeypatch.setattr(kernels.patching, "plain_linear_suffices", lambda x, w: False)
    monkeypatch.setattr(kernels.patching, "plain_product_suffices", lambda *args: False)
    layouts, in_projection = [], kernels.patching._in_projection

    def spy(*args, contiguous=True):
        layouts.append(contiguous)
        return in_projection(*args, contiguous=contiguous)

    monkeypatch.setattr(kernels.patching, "_in_projection", spy)
    torch.manual_seed(0)
    for batch_first in (True, False):
        eager = nn.MultiheadAttention(32, 4, batch_first=batch_first).eval()
        model = kernels.patch(copy.deepcopy(eager))
        x, other = torch.randn(3, 10, 32), torch.randn(3, 12, 32)
        if not batch_first:  # batch-major tensors seen sequence-first: the route still runs batch-major
            x, other = x.transpose(0, 1), other.transpose(0, 1)
        padding = torch.rand(3, 12) > 0.7
        padding[:, 0] = False
        for inputs, options in (((x, x, x), {}), ((x, other, other), {"key_padding_mask": padding}),
                                ((x, other, other * 2), {"need_weights": False})):
            for layer in (model, eager):
                layer.zero_grad()
            (ours, ours_weights), (expected, expected_weights) = model(*inputs, **options), eager(*inputs, **options)
            torch.testing.assert_close(ours, expected, atol=TOL, rtol=TOL)
            if expected_weights is not None:
                torch.testing.assert_close(ours_weights, expected_weights, atol=TOL, rtol=TOL)
            assert ours.is_contiguous()
            ours.square().sum().backward()
            expected.square().sum().backward()
            for a, b in zip(model.parameters(), eager.parameters()):
                torch.testing.assert_close(a.grad, b.grad, atol=gradient_atol(b.grad), rtol=TOL)
    assert layouts == [False] * 6  # every call batch-major


def test_state_dicts_load_both_ways(device):
    model = small_model().to(device)
    patched = kernels.patch(small_model().to(device))
    with torch.no_grad():
        for p in patched.parameters():
            p.add_(1.0)
    model.load_state_dict(patched.state_dict())
    for p, q in zip(model.parameters(), patched.parameters()):
        assert torch.equal(p, q)
    fresh = small_model().to(device)
    patched.load_state_dict(fresh.state_dict())  # the version counter moves: a kept split would be dropped
    for p, q in zip(fresh.parameters(), patched.parameters()):
        assert torch.equal(p, q)


class LoRALinear(nn.Linear):
    """A LoRA-style subclass whose weight is a property over the registered one and a low-rank update."""

    def __init__(self):
        super().__init__(8, 6)
        self.lora_a, self.lora_b = nn.Parameter(torch.randn(2, 8)), nn.Parameter(torch.randn(6, 2))

    @property
    def weight(self):
        base, a, b = (self._parameters.get(name) for name in ("weight", "lora_a", "lora_b"))
        if base is None:  # not registered yet (nn.Module's own check while registering it)
            raise AttributeError("weight")
        return base if a is None else base + b @ a


class DropsALock(nn.Linear):
    """A subclass whose own __getstate__ leaves out what cannot be pickled."""

    def __init__(self):
        super().__init__(8, 6)
        self.lock = threading.Lock()

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("lock", None)
        return state


def test_linear_layers_patch_leaves_or_honours():
    """nn.Linear's keyword call (input=); a subclass computing its weight (LoRA-style, parametrize's) and a lazy layer
    left as they are (their parameters are not their weight yet); parametrize on a patched layer, then unpatch: the
    layer's class back to nn.Linear's once the parametrization goes; a subclass's own __getstate__ kept."""
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    layer = kernels.patch(nn.Linear(8, 6))
    torch.testing.assert_close(layer(input=x), F.linear(x, layer.weight, layer.bias))
    lora = LoRALinear()
    expected = lora(x)
    assert not kernels.is_patched(kernels.patch(lora))
    torch.testing.assert_close(lora(x), expected)
    lazy = kernels.patch(nn.LazyLinear(6))
    assert not kernels.is_patched(lazy) and lazy(x).shape == (3, 6)
    parametrized = nn.Linear(8, 6)
    torch.nn.utils.parametrize.register_parametrization(parametrized, "weight", nn.Identity())
    assert not kernels.is_patched(kernels.patch(parametrized))
    patched = kernels.patch(nn.Linear(8, 6))
    torch.nn.utils.parametrize.register_parametrization(patched, "weight", nn.Identity())
    torch.testing.assert_close(patched(x), F.linear(x, patched.weight, patched.bias))
    kernels.unpatch(patched)
    assert not isinstance(patched, FusedLinear)
    torch.nn.utils.parametrize.remove_parametrizations(patched, "weight")
    assert type(patched) is nn.Linear
    dropped = kernels.patch(DropsALock())
    assert kernels.is_patched(dropped) and not hasattr(copy.deepcopy(dropped), "lock")
    assert pickle.loads(pickle.dumps(dropped)).weight.shape == (6, 8)


def test_patched_model_pickles_into_a_new_process(tmp_path):
    model = kernels.patch(small_model())
    path = tmp_path / "model.pt"
    torch.save(model, path)
    x = torch.randn(2, 16)
    expected = model(x)
    torch.save(x, tmp_path / "x.pt")
    torch.save(expected, tmp_path / "y.pt")
    script = (f"import sys, torch; sys.path.insert(0, {REPO_ROOT!r}); sys.path.insert(0, {REPO_ROOT + '/tests'!r});"
              f"import kernels; from test_patching import ScaledLinear;"
              f"m = torch.load({str(path)!r}, weights_only=False);"
              f"assert kernels.is_patched(m[0]) and type(m[2]).__name__ == 'ScaledLinear';"
              f"y = m(torch.load({str(tmp_path / 'x.pt')!r}));"
              f"assert torch.equal(y, torch.load({str(tmp_path / 'y.pt')!r}))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert result.returncode == 0, result.stderr[-2000:]


def test_linear_with_a_list_raises_a_type_error():
    with pytest.raises(TypeError, match="torch.Tensor"):
        FusedLinear(8, 6)([[1.0] * 8])


# ---- real architectures (transformers; timm where installed) --------------------------------------------------------

def _transformers():
    return pytest.importorskip("transformers")


@pytest.mark.slow
def test_architectures_check_passes_on_the_cpu(tmp_path):
    """tools/checks/architectures_check.py (device_check.py's `architectures`), which the GPU runs at sizes where the
    library's paths engage, at tiny sizes on the CPU: every check runs, and patch() keeps eager's results there."""
    _transformers()
    archs = "llama,gpt2,bert,t5,bart,whisper,vit,clip"
    result = subprocess.run([sys.executable, "tools/checks/architectures_check.py", "--device", "cpu", "--hidden", "64",
                             "--heads", "4", "--seq", "16", "--batch", "2", "--vocab", "100", "--only", archs,
                             "--out", str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"PASS {len(archs.split(','))}" in result.stdout, result.stdout[-3000:]


def tiny_transformers_models():
    t = _transformers()
    return {
        "gpt2": (t.GPT2LMHeadModel, t.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=101, n_positions=64,
                                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "bert": (t.BertForMaskedLM, t.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                 intermediate_size=128, vocab_size=97, hidden_dropout_prob=0.0,
                                                 attention_probs_dropout_prob=0.0)),
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=103)),
        # every linear layer a FalconLinear: nn.Linear's product as a matmul and an add
        "falcon": (t.FalconForCausalLM, t.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                       num_kv_heads=2, new_decoder_architecture=True, bias=True,
                                                       vocab_size=107, hidden_dropout=0.0, attention_dropout=0.0)),
    }


def check_logits_and_gradients(model, patched, ids):
    """The patched model's logits and every parameter's gradient against the model's; returns the model's logits."""
    out, out_patched = model(input_ids=ids).logits, patched(input_ids=ids).logits
    torch.testing.assert_close(out_patched, out, atol=TOL, rtol=TOL)
    out.square().mean().backward()
    out_patched.square().mean().backward()
    for (p_name, p), q in zip(model.named_parameters(), patched.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=gradient_atol(p.grad), rtol=TOL, msg=p_name)
    return out


class Logits(nn.Module):
    """A transformers model's logits, as torch.jit.trace takes a module's output (a tensor, not a ModelOutput)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_transformers_models_trace_as_eager(name, device):
    """torch.jit.trace (its sanity check included) of a patched model, fresh or called before, traces as the model
    does and gives its logits: under the tracer, sizes are traced tensors, so no size check may enter the graph."""
    cls, config = tiny_transformers_models()[name]
    torch.manual_seed(0)
    model = cls(config).to(device).eval()
    ids = torch.randint(0, config.vocab_size, (2, 9), device=device)
    expected = model(input_ids=ids).logits
    for called_before in (False, True):
        patched = kernels.patch(copy.deepcopy(model))
        if called_before:
            patched(input_ids=ids)
        traced = torch.jit.trace(Logits(patched), (ids,))
        torch.testing.assert_close(traced(ids), expected, atol=TOL, rtol=TOL)


def test_falcon_linear_patch_follows_autocast(device):
    """FalconLinear (nn.Linear's product as a matmul and an add) under autocast: eager's product in bfloat16, its
    float32 bias promoting the sum back to float32; the patched layers give the same dtypes and values, each layer's
    output and the logits."""
    cls, config = tiny_transformers_models()["falcon"]
    torch.manual_seed(0)
    model = cls(config).to(device)
    patched = kernels.patch(copy.deepcopy(model))
    ids = torch.randint(0, config.vocab_size, (2, 9), device=device)

    def layer_outputs(m):
        seen = []
        hooks = [layer.register_forward_hook(lambda module, args, out: seen.append(out))
                 for layer in m.modules() if type(layer).__name__ == "FalconLinear"]
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = m(input_ids=ids).logits
        for hook in hooks:
            hook.remove()
        return seen, logits

    (outputs, logits), (outputs_patched, logits_patched) = layer_outputs(model), layer_outputs(patched)
    assert outputs and [t.dtype for t in outputs_patched] == [t.dtype for t in outputs]
    assert logits_patched.dtype == logits.dtype
    torch.testing.assert_close(logits_patched, logits)
    with torch.no_grad():  # outside autocast: the library's layer, eager's result
        torch.testing.assert_close(patched(input_ids=ids).logits, model(input_ids=ids).logits, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_transformers_models_patched_run_on_the_meta_device(name):
    """A model built on the meta device and patched runs a training forward there (shapes only), as eager's does."""
    cls, config = tiny_transformers_models()[name]
    with torch.device("meta"):
        model = cls(config)
        ids = torch.zeros(2, 9, dtype=torch.long)
    expected = model(input_ids=ids).logits
    patched = kernels.patch(model)
    logits = patched(input_ids=ids).logits
    assert logits.device.type == "meta" and logits.shape == expected.shape and logits.dtype == expected.dtype


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "falcon"])
def test_transformers_models_patch_round_trip(name, device):
    cls, config = tiny_transformers_models()[name]
    torch.manual_seed(0)
    model = cls(config).to(device)
    patched = kernels.patch(copy.deepcopy(model))
    conv1d = sys.modules["transformers.pytorch_utils"].Conv1D
    layers = [m for m in patched.modules() if isinstance(m, (nn.Linear, conv1d))]
    assert layers and all(kernels.is_patched(m) for m in layers)
    if name == "gpt2":  # Conv1D layers, the tied head still tied, NewGELUActivation on gelu_tanh
        assert any(isinstance(m, conv1d) for m in layers)
        assert patched.lm_head.weight is patched.transformer.wte.weight
        new_gelu = sys.modules["transformers.activations"].NewGELUActivation
        activations = [m for m in patched.modules() if isinstance(m, new_gelu)]
        assert len(activations) == config.n_layer and all(kernels.is_patched(m) for m in activations)
    if name in ("gpt2", "bert"):  # every nn.LayerNorm on layer_norm
        norms = [m for m in patched.modules() if isinstance(m, nn.LayerNorm)]
        assert norms and all(kernels.is_patched(m) for m in norms)
    if name == "bert":  # each layer's two residual adds with the norms after them: add_layer_norm on the GPU
        outputs = [m for m in patched.modules() if type(m).__name__ in ("BertSelfOutput", "BertOutput")]
        assert len(outputs) == 2 * config.num_hidden_layers and all(kernels.is_patched(m) for m in outputs)
    if name == "falcon":  # its FalconLinear layers (nn.Linear's product as a matmul and an add) patched too
        assert len(layers) == 4 * config.num_hidden_layers + 1 and type(layers[0]).__name__ == "FalconLinear"
    if name == "llama":  # every LlamaRMSNorm on rms_norm (two a layer and the last one), every LlamaMLP on silu_mul
        norms = [m for m in patched.modules() if type(m).__name__ == "LlamaRMSNorm"]
        assert len(norms) == 2 * config.num_hidden_layers + 1 and all(kernels.is_patched(m) for m in norms)
        mlps = [m for m in patched.modules() if type(m).__name__ == "LlamaMLP"]
        assert len(mlps) == config.num_hidden_layers and all(kernels.is_patched(m) for m in mlps)
    ids = torch.randint(0, config.vocab_size, (2, 24), device=device)
    check_logits_and_gradients(model, patched, ids)
    if name == "bert":
        assert fused_nodes(patched(input_ids=ids).logits) == (2 * config.num_hidden_layers if device == "cuda" else 0)
    model.load_state_dict(patched.state_dict())
    patched.load_state_dict(model.state_dict())
    kernels.unpatch(patched)
    assert not any(kernels.is_patched(m) for m in patched.modules())


def test_new_gelu_activation_patch(device):
    """transformers' NewGELUActivation on gelu_tanh: eager's formula within 1e-6 (one rounding against its six), no
    less accurate against float64, gradients alike; a pickled patched activation loads in a new process."""
    _transformers()
    from transformers.activations import NewGELUActivation

    from kernels.precision import relative_error

    activation = NewGELUActivation()
    patched = kernels.patch(copy.deepcopy(activation))
    assert kernels.is_patched(patched) and isinstance(patched, NewGELUActivation)
    x = (torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4).to(device).requires_grad_()
    y, y_patched = activation(x), patched(x)
    torch.testing.assert_close(y_patched, y, atol=1e-6, rtol=1e-6)
    y64 = activation(x.detach().double())
    assert relative_error(y_patched, y64) <= relative_error(y, y64)
    grad = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y_patched, x, grad)[0], torch.autograd.grad(y, x, grad)[0],
                               atol=1e-5, rtol=1e-5)
    kernels.unpatch(patched)
    assert type(patched) is NewGELUActivation


def test_llama_rms_norm_patch(device):
    """transformers' LlamaRMSNorm, and the norms whose forward is its code (Mistral's, Qwen2's), on rms_norm: eager's
    results within 1e-5, no less accurate against float64, gradients alike; a norm computing something else (Gemma's
    1 + weight) is left as it is."""
    _transformers()
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from kernels.precision import relative_error

    classes = [LlamaRMSNorm]
    for module_name, name in (("mistral", "MistralRMSNorm"), ("qwen2", "Qwen2RMSNorm")):
        module = pytest.importorskip(f"transformers.models.{module_name}.modeling_{module_name}")
        classes.append(getattr(module, name))
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    assert not kernels.is_patched(kernels.patch(gemma.GemmaRMSNorm(64)))
    for cls in classes:
        norm = cls(256, eps=1e-5).to(device)
        with torch.no_grad():
            norm.weight.normal_(1.0, 0.5)
        patched = kernels.patch(copy.deepcopy(norm))
        assert kernels.is_patched(patched) and isinstance(patched, cls), cls.__name__
        x = (torch.randn(4, 33, 256, generator=torch.Generator().manual_seed(0)) * 3).to(device).requires_grad_()
        y, y_patched = norm(x), patched(x)
        if device == "cuda":  # the op ran (on the CPU the module's own forward does)
            assert y_patched.grad_fn.name() == "kernels::RmsNormBackward"
        torch.testing.assert_close(y_patched, y, atol=1e-5, rtol=1e-5)
        x64, weight64 = x.detach().double(), norm.weight.detach().double()  # (the module itself computes in float32)
        y64 = weight64 * (x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-5))
        assert relative_error(y_patched, y64) <= relative_error(y, y64), cls.__name__
        grad = torch.randn_like(y)
        for got, expected in zip(torch.autograd.grad(y_patched, (x, patched.weight), grad),
                                 torch.autograd.grad(y, (x, norm.weight), grad)):
            torch.testing.assert_close(got, expected, atol=gradient_atol(expected), rtol=1e-5)
        kernels.unpatch(patched)
        assert type(patched) is cls


def test_layer_norm_patch(device):
    """nn.LayerNorm with a weight and a bias on layer_norm: eager's results within 1e-5, no less accurate against
    float64, gradients alike; without a bias or an affine transform, under autocast (whose float32 policy eager's
    forward follows), in bfloat16 and for a subclass with a forward of its own, the module's own forward."""
    from kernels.precision import relative_error

    norm = nn.LayerNorm(256, eps=1e-5).to(device)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
        norm.bias.normal_(0.0, 0.5)
    patched = kernels.patch(copy.deepcopy(norm))
    assert kernels.is_patched(patched) and isinstance(patched, nn.LayerNorm)
    x = (torch.randn(4, 33, 256, generator=torch.Generator().manual_seed(0)) * 3 + 1).to(device).requires_grad_()
    y, y_patched = norm(x), patched(x)
    if device == "cuda":  # the op ran (on the CPU the module's own forward does)
        assert y_patched.grad_fn.name() == "kernels::LayerNormBackward"
    torch.testing.assert_close(y_patched, y, atol=1e-5, rtol=1e-5)
    y64 = copy.deepcopy(norm).double()(x.detach().double())
    assert relative_error(y_patched, y64) <= relative_error(y, y64)
    grad = torch.randn_like(y)
    for got, expected in zip(torch.autograd.grad(y_patched, (x, patched.weight, patched.bias), grad),
                             torch.autograd.grad(y, (x, norm.weight, norm.bias), grad)):
        torch.testing.assert_close(got, expected, atol=gradient_atol(expected), rtol=1e-5)
    kernels.unpatch(patched)
    assert type(patched) is nn.LayerNorm
    for other in (nn.LayerNorm(256, bias=False), nn.LayerNorm(256, elementwise_affine=False), nn.LayerNorm((4, 64))):
        other = other.to(device)
        patched_other = kernels.patch(copy.deepcopy(other))
        assert kernels.is_patched(patched_other)
        assert torch.equal(patched_other(x.detach().view(4, 33, *other.normalized_shape)),
                           other(x.detach().view(4, 33, *other.normalized_shape)))
    if device == "cuda":
        patched = kernels.patch(copy.deepcopy(norm))
        half = x.detach().to(torch.bfloat16)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.equal(patched(half), norm(half)) and patched(half).dtype == torch.float32
        half_norm = copy.deepcopy(norm).to(torch.bfloat16)  # 16-bit norms: the module's own forward
        assert torch.equal(kernels.patch(copy.deepcopy(half_norm))(half), half_norm(half))

    class OwnForward(nn.LayerNorm):
        def forward(self, input):
            return super().forward(input) * 2

    assert not kernels.is_patched(kernels.patch(OwnForward(8)))


def graph_node_names(t):
    """The names of every node of t's autograd graph."""
    names, pending, seen = set(), [t.grad_fn], set()
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        pending.extend(next_node for next_node, _ in node.next_functions)
    return names


class TwoInputs(nn.Module):
    """Projections that read different tensors (cross attention's pattern): no group."""

    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x, memory):
        return self.query(x) + self.key(memory) * self.value(memory)


class Projections(nn.Module):
    """q, k and v of one input, with ways for a call to differ from the one the group learned."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(16, 24), nn.Linear(16, 24), nn.Linear(16, 24)
        self.scale_x_before_v, self.v_without_grad, self.skip_v = False, False, False

    def forward(self, x):
        q, k = self.q_proj(x), self.k_proj(x)
        if self.scale_x_before_v:
            x.mul_(2)
        if self.skip_v:
            return q * k
        with torch.set_grad_enabled(not self.v_without_grad):
            v = self.v_proj(x)
        return q * k + v


def projection_groups(model):
    return {name: m.__dict__["_projection_group"].members for name, m in model.named_modules()
            if "_projection_group" in m.__dict__}


@pytest.mark.parametrize("name,members", [("bert", ("query", "key", "value")), ("llama", ("q_proj", "k_proj", "v_proj"))])
def test_sibling_projections_are_one_product_while_training(name, members, device, monkeypatch):
    """The linear layers of one parent that read its input (BERT's query, key and value; LLaMA's q_proj, k_proj and
    v_proj) are learned on the first training call and, from the next, computed by one product of their weights side
    by side: one op call per attention layer (forced here at any size and on any device), outputs and every gradient
    as the unpatched model's; nothing is left on the layers after a call."""
    monkeypatch.setattr(patching, "_fuse_projections", "always")
    cls, config = tiny_transformers_models()[name]
    torch.manual_seed(0)
    model = cls(config).to(device)
    patched = kernels.patch(copy.deepcopy(model))
    ids = torch.randint(0, config.vocab_size, (2, 24), device=device)
    patched(input_ids=ids)  # learns
    groups = projection_groups(patched)
    assert groups and set(groups.values()) == {members}, groups
    layers = config.num_hidden_layers
    with forced_gemm_path("cublas") if device == "cuda" else contextlib.nullcontext():
        calls = ops_called(lambda: patched(input_ids=ids))
    assert calls.count("kernels.gemm_multiply_leaky_relu.default") == layers, calls
    out = check_logits_and_gradients(model, patched, ids)
    assert not any("_shared_product" in m.__dict__ for m in patched.modules())
    compiled = torch.compile(patched, fullgraph=True, backend="eager")  # traced: each layer its own product
    torch.testing.assert_close(compiled(input_ids=ids).logits, out, atol=TOL, rtol=TOL)
    with torch.no_grad():  # no training call: each layer its own product (its kept split where it has one)
        assert "kernels.gemm_multiply_leaky_relu.default" not in ops_called(lambda: patched(input_ids=ids))
    kernels.unpatch(patched)
    assert not projection_groups(patched)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in patched.modules())


def _bert_with_heads_of_64(device):
    t = _transformers()
    config = t.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                          vocab_size=97, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return t.BertForMaskedLM(config).to(device).eval(), config


def test_attention_without_a_gradient_takes_the_split_kernels(device, monkeypatch):
    """A BERT self-attention call without a gradient to compute (no_grad, inference_mode), heads of 64 over 512 tokens,
    runs its scaled-dot-product attention through fp32_gemm()'s route within the call: on a GPU the split kernels, the
    logits within the contract against the unpatched model's and float64; a call that trains, a short call and a call
    on the CPU stay eager's; no mode is left behind."""
    model, config = _bert_with_heads_of_64(device)
    patched = kernels.patch(copy.deepcopy(model))
    calls = []
    attention = patching.attention
    monkeypatch.setattr(patching, "attention", lambda *args: calls.append(args[0].shape) or attention(*args))
    ids = torch.randint(0, config.vocab_size, (2, 512), device=device)
    on_split = device == "cuda" and patching._attention_runs_on(ids.device)
    with torch.no_grad():
        y64 = copy.deepcopy(model).double()(input_ids=ids).logits
    for mode in (torch.no_grad, torch.inference_mode):
        calls.clear()
        with mode():
            eager, ours = model(input_ids=ids).logits, patched(input_ids=ids).logits
        assert len(calls) == (config.num_hidden_layers if on_split else 0), calls
        assert torch._C._len_torch_function_stack() == 0
        check_close_to_float64(ours, eager, y64)
    calls.clear()
    patched(input_ids=ids).logits.sum().backward()  # a call that trains: eager's attention
    with torch.no_grad():
        patched(input_ids=ids[:, :64])  # too few keys
    assert not calls and torch._C._len_torch_function_stack() == 0


def test_attention_mode_is_left_after_each_call(monkeypatch):
    """The mode an attention parent's call enters (forced here on the CPU, where the route leaves every call to eager)
    is left when the call returns and when it raises, and the outputs are the unpatched model's; the projections'
    calls on the parent's input run outside it (the mode sees none of their tensor calls)."""
    monkeypatch.setattr(patching, "_attention_may_split", lambda parent, x: True)
    seen = []
    route = patching._SplitAttention.__torch_function__

    def recording(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return route(self, func, types, args, kwargs)

    monkeypatch.setattr(patching._SplitAttention, "__torch_function__", recording)
    model, config = _bert_with_heads_of_64("cpu")
    patched = kernels.patch(copy.deepcopy(model))
    ids = torch.randint(0, config.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=ids).logits, model(input_ids=ids).logits, atol=TOL, rtol=TOL)
        assert torch._C._len_torch_function_stack() == 0
    assert F.scaled_dot_product_attention in seen and F.linear not in seen
    # Under a mode of the caller's, the projections' calls stay where that mode sees them, as in eager.
    counts = {}

    class CountLinear(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            counts[self] = counts.get(self, 0) + (func is F.linear)
            return func(*args, **(kwargs or {}))

    with torch.no_grad():
        eager_mode, patched_mode = CountLinear(), CountLinear()
        with eager_mode:
            model(input_ids=ids)
        with patched_mode:
            patched(input_ids=ids)
    assert counts[patched_mode] == counts[eager_mode] > 0
    with torch.no_grad():
        attention = patched.bert.encoder.layer[0].attention.self
        with pytest.raises(RuntimeError):
            attention(torch.randn(2, 24, config.hidden_size + 1))
        assert torch._C._len_torch_function_stack() == 0
        assert not attention.__dict__["_projection_group"].attention_modes


def test_sibling_projections_other_inputs_and_failed_calls(device, monkeypatch):
    """Children that read different tensors form no group (the parent's hooks are removed); a call that raises leaves
    nothing on the layers; the group follows deepcopy and pickling; patch() twice adds no second hook."""
    monkeypatch.setattr(patching, "_fuse_projections", "always")
    monkeypatch.setattr(patching, "_fusable_parent", lambda parent: True)  # TwoInputs stands in for transformers'
    torch.manual_seed(0)
    two = kernels.patch(TwoInputs().to(device))
    x, memory = torch.randn(3, 16, device=device), torch.randn(3, 16, device=device)
    expected = TwoInputs().to(device)
    expected.load_state_dict(two.state_dict())
    torch.testing.assert_close(two(x, memory), expected(x, memory), atol=TOL, rtol=TOL)
    assert projection_groups(two) == {"": ()} and not two._forward_pre_hooks and not two._forward_hooks
    cls, config = tiny_transformers_models()["bert"]
    bert = kernels.patch(kernels.patch(cls(config).to(device)))
    attention = bert.bert.encoder.layer[0].attention.self
    assert len(attention._forward_pre_hooks) == 1 and len(attention._forward_hooks) == 1
    ids = torch.randint(0, config.vocab_size, (2, 8), device=device)
    bert(input_ids=ids)
    failing = attention.value.register_forward_hook(lambda *args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        bert(input_ids=ids)
    failing.remove()
    assert not any("_shared_product" in m.__dict__ for m in bert.modules())
    for copied in (copy.deepcopy(bert), pickle.loads(pickle.dumps(bert))):
        assert set(projection_groups(copied).values()) == {("query", "key", "value")}
        torch.testing.assert_close(copied(input_ids=ids).logits, bert(input_ids=ids).logits, atol=TOL, rtol=TOL)


def test_sibling_projections_of_an_inference_tensor(device, monkeypatch):
    """A frozen model called with grad mode on, on a tensor made under inference_mode: eager's results, no group."""
    monkeypatch.setattr(patching, "_fuse_projections", "always")
    cls, config = tiny_transformers_models()["bert"]
    model = cls(config).to(device).requires_grad_(False).eval()
    expected = cls(config).to(device).requires_grad_(False).eval()
    expected.load_state_dict(model.state_dict())
    kernels.patch(model)
    with torch.inference_mode():
        ids = torch.randint(0, config.vocab_size, (2, 8), device=device)
        hidden = model.bert.embeddings(input_ids=ids)
    layer = model.bert.encoder.layer[0].attention.self
    for _ in range(2):  # the first call learns, the second would fuse
        got = layer(hidden)[0]
    torch.testing.assert_close(got, expected.bert.encoder.layer[0].attention.self(hidden)[0], atol=TOL, rtol=TOL)


class EditsItsProjections(nn.Module):
    """A user's attention-like module (not transformers'): q scaled in place, k flattened by a view."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(16, 24), nn.Linear(16, 24), nn.Linear(16, 24)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q *= 0.5
        return q * v + k.view(-1).sum()


def test_sibling_projections_of_other_modules_stay_apart(device, monkeypatch):
    """Only transformers' attention layers get one product: another module's outputs may be edited in place or
    flattened, which a column slice of one product would refuse; its training calls give eager's results."""
    monkeypatch.setattr(patching, "_fuse_projections", "always")
    torch.manual_seed(0)
    eager = EditsItsProjections().to(device)
    patched = kernels.patch(copy.deepcopy(eager))
    x = torch.randn(2, 5, 16, device=device)
    for _ in range(3):  # the first call would learn, the later ones would fuse
        out, out_patched = eager(x), patched(x)
        torch.testing.assert_close(out_patched, out, atol=TOL, rtol=TOL)
        out.sum().backward()
        out_patched.sum().backward()
    for p, q in zip(eager.parameters(), patched.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=gradient_atol(p.grad), rtol=TOL)
    assert projection_groups(patched) == {"": None}


@pytest.mark.parametrize("change", ["scale_x_before_v", "v_without_grad", "skip_v"])
def test_sibling_projections_follow_the_call(change, device, monkeypatch):
    """A member called on its input changed in place, or in another grad mode, or not called, computes its own
    product or none: eager's results and gradients (none for a weight eager gives none); a call that leaves a
    member's part unused ends the grouping."""
    monkeypatch.setattr(patching, "_fuse_projections", "always")
    monkeypatch.setattr(patching, "_fusable_parent", lambda parent: True)  # Projections stands in for transformers'
    torch.manual_seed(0)
    eager = Projections().to(device)
    patched = kernels.patch(copy.deepcopy(eager))
    x = torch.randn(5, 16, device=device)
    patched(x.clone())  # learns
    assert projection_groups(patched) == {"": ("q_proj", "k_proj", "v_proj")}
    for step in range(2):
        setattr(eager, change, True)
        setattr(patched, change, True)
        out, out_patched = eager(x.clone()), patched(x.clone())
        torch.testing.assert_close(out_patched, out, atol=TOL, rtol=TOL)
        if change == "scale_x_before_v":  # q's and k's saved input changed: eager's backward raises too
            continue
        out.sum().backward()
        out_patched.sum().backward()
        for (name, p), q in zip(eager.named_parameters(), patched.parameters()):
            assert (q.grad is None) == (p.grad is None), (step, name)
            if p.grad is not None:
                torch.testing.assert_close(q.grad, p.grad, atol=gradient_atol(p.grad), rtol=TOL, msg=name)
        eager.zero_grad(set_to_none=False)
        patched.zero_grad(set_to_none=False)
    assert projection_groups(patched) == {"": ()} and not patched._forward_pre_hooks  # v's part unused: ungrouped


def test_sibling_projections_under_activation_checkpointing(device, monkeypatch):
    """Non-reentrant checkpointing recomputes a layer in the backward, which must save what its first run saved: no
    learning or grouping in checkpointed calls, and eager's results and gradients."""
    monkeypatch.setattr(patching, "_fuse_projections", "always")
    cls, config = tiny_transformers_models()["llama"]
    torch.manual_seed(0)
    model = cls(config).to(device)
    patched = kernels.patch(copy.deepcopy(model))
    for m in (model, patched):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
    ids = torch.randint(0, config.vocab_size, (2, 24), device=device)
    for _ in range(2):
        check_logits_and_gradients(model, patched, ids)


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_sibling_projections_seen_by_forward_hooks_stay_apart(scope, device, monkeypatch):
    """A forward hook sees a projection's output and may edit it in place (activation steering), which a column slice
    of one product refuses: projections a forward hook (the layer's own or a global one) sees keep their own
    products, with eager's results and gradients."""
    monkeypatch.setattr(patching, "_fuse_projections", "always")
    cls, config = tiny_transformers_models()["bert"]
    torch.manual_seed(0)
    model = cls(config).to(device)
    patched = kernels.patch(copy.deepcopy(model))
    ids = torch.randint(0, config.vocab_size, (2, 8), device=device)

    def steer(module, args, out):
        if isinstance(module, nn.Linear) and out.shape[-1] == config.hidden_size:
            out.mul_(1.5)

    with contextlib.ExitStack() as hooks:
        if scope == "global":
            hooks.callback(nn.modules.module.register_module_forward_hook(steer).remove)
        else:
            for m in (model, patched):
                for layer in m.bert.encoder.layer:
                    hooks.callback(layer.attention.self.query.register_forward_hook(steer).remove)
        for _ in range(3):  # the first call learns, the later ones would group
            check_logits_and_gradients(model, patched, ids)
            model.zero_grad()
            patched.zero_grad()


def test_llama_mlp_patch(device):
    """transformers' LlamaMLP (and Mistral's copy of it): silu(gate_proj(x)) * up_proj(x) on silu_mul, eager's results
    and gradients within 1e-5, no less accurate against float64; an MLP of the same code with another activation
    (Gemma's GELU) keeps its own forward."""
    t = _transformers()
    from transformers.models.llama.modeling_llama import LlamaMLP

    from kernels.precision import relative_error

    mistral = pytest.importorskip("transformers.models.mistral.modeling_mistral")
    config = t.LlamaConfig(hidden_size=64, intermediate_size=160)
    for cls in (LlamaMLP, mistral.MistralMLP):
        torch.manual_seed(0)
        mlp = cls(config).to(device)
        patched = kernels.patch(copy.deepcopy(mlp))
        assert kernels.is_patched(patched) and isinstance(patched, cls)
        assert all(kernels.is_patched(getattr(patched, name)) for name in ("gate_proj", "up_proj", "down_proj"))
        x = (torch.randn(4, 33, 64, generator=torch.Generator().manual_seed(0)) * 2).to(device).requires_grad_()
        y, y_patched = mlp(x), patched(x)
        if device == "cuda":  # the op ran (on the CPU the module's own steps do)
            assert "kernels::SiluMulBackward" in graph_node_names(y_patched)
        torch.testing.assert_close(y_patched, y, atol=1e-5, rtol=1e-5)
        y64 = copy.deepcopy(mlp).double()(x.detach().double())
        assert relative_error(y_patched, y64) <= relative_error(y, y64) * 1.01 + 2.0 ** -24, cls.__name__
        grad = torch.randn_like(y)
        for got, expected in zip(torch.autograd.grad(y_patched, (x, patched.gate_proj.weight), grad),
                                 torch.autograd.grad(y, (x, mlp.gate_proj.weight), grad)):
            torch.testing.assert_close(got, expected, atol=gradient_atol(expected), rtol=1e-5)
    hooked = kernels.patch(copy.deepcopy(mlp))  # a hook on the activation sees its call: the module's own forward
    seen = []
    hooked.act_fn.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    hooked(x)
    assert seen == [(4, 33, 160)]
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    gelu_mlp = gemma.GemmaMLP(t.GemmaConfig(hidden_size=64, intermediate_size=160)).to(device)
    patched = kernels.patch(copy.deepcopy(gelu_mlp))
    x = torch.randn(3, 64, device=device)
    torch.testing.assert_close(patched(x), gelu_mlp(x), atol=1e-5, rtol=1e-5)


def test_llama_rotary_embedding_patch(device, monkeypatch):
    """transformers' attention layers whose rotary embedding is LLaMA's code (LLaMA's, Mistral's, Qwen2's; grouped kv
    heads) apply it with kernels.rotary_embedding on the GPU, in the layer's own forward otherwise unchanged: logits
    and gradients within the fp32 tolerance of eager's, no less accurate against float64; on the CPU transformers'
    own function (eager's bits), unless the route is forced there. Phi-3's partial rotary keeps its own forward; the
    patched layers still group their projections; unpatch() restores them."""
    t = _transformers()
    import transformers.models.mistral.modeling_mistral  # noqa: F401 (the classes patch() compares)
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    from kernels.precision import relative_error

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=97)
    for config in (t.LlamaConfig(**small), t.MistralConfig(**small), t.Qwen2Config(**small)):
        torch.manual_seed(0)
        model = t.AutoModelForCausalLM.from_config(config).to(device)
        patched = kernels.patch(copy.deepcopy(model))
        attention = patched.model.layers[0].self_attn
        assert kernels.is_patched(attention) and isinstance(attention, type(model.model.layers[0].self_attn))
        assert patching._fusable_parent(attention)
        ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1)).to(device)
        for forced in ((False, True) if device == "cpu" else (False,)):
            if forced:
                monkeypatch.setattr(patching, "_rotary_runs_on", lambda q: True)
            logits, logits_patched = model(ids).logits, patched(ids).logits
            rotated = "kernels::RotaryEmbeddingBackward" in graph_node_names(logits_patched)
            assert rotated == (device == "cuda" or forced), (type(config).__name__, forced)
            if not rotated:
                assert torch.equal(logits_patched, logits)
            torch.testing.assert_close(logits_patched, logits, atol=TOL, rtol=TOL)
            logits64 = copy.deepcopy(model).double()(ids).logits
            assert relative_error(logits_patched, logits64) <= relative_error(logits, logits64) * 1.01 + 2.0 ** -24
            grad = torch.randn_like(logits)
            layers = (patched.model.layers[0].self_attn, model.model.layers[0].self_attn)
            got, expected = (torch.autograd.grad(out, (layer.q_proj.weight, layer.k_proj.weight), grad)
                             for out, layer in zip((logits_patched, logits), layers))
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, atol=gradient_atol(b), rtol=TOL)
            monkeypatch.undo()
        kernels.unpatch(patched)
        assert type(patched.model.layers[0].self_attn) is type(model.model.layers[0].self_attn)
    phi3 = pytest.importorskip("transformers.models.phi3.modeling_phi3")
    assert patching._base_for_class(phi3.Phi3Attention) is None


@pytest.mark.slow
def test_llama_rotary_route_under_torch_compile(device, monkeypatch):
    """torch.compile(fullgraph=True) of a patched LlamaAttention with the route taken (forced on the CPU): the
    rebuilt forward traces whole, with eager's results and gradients within the fp32 tolerance."""
    t = _transformers()
    monkeypatch.setattr(patching, "_rotary_runs_on", lambda q: True)
    config = t.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=97)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = t.LlamaForCausalLM(config).to(device)
    attention = model.model.layers[0].self_attn
    patched = kernels.patch(copy.deepcopy(attention))
    x = torch.randn(2, 9, 64, device=device)
    positions = torch.arange(9, device=device)[None].expand(2, 9)
    angles = model.model.rotary_emb(x, positions)
    torch._dynamo.reset()
    compiled = torch.compile(lambda h: patched(h, position_embeddings=angles, attention_mask=None)[0], fullgraph=True)
    h, h_eager = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y, y_eager = compiled(h), attention(h_eager, position_embeddings=angles, attention_mask=None)[0]
    torch.testing.assert_close(y, y_eager, atol=TOL, rtol=TOL)
    grad = torch.randn_like(y)
    (got,), (expected,) = torch.autograd.grad(y, (h,), grad), torch.autograd.grad(y_eager, (h_eager,), grad)
    torch.testing.assert_close(got, expected, atol=gradient_atol(expected), rtol=TOL)


def test_timm_vit_patch_round_trip(device):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8).to(device)
    patched = kernels.patch(copy.deepcopy(model))
    norms = [m for m in patched.modules() if isinstance(m, nn.LayerNorm)]  # timm's LayerNorm: on layer_norm
    assert norms and all(kernels.is_patched(m) for m in norms)
    attentions = [m for m in patched.modules() if type(m).__name__ == "Attention"]  # on the packed attention
    assert attentions and all(kernels.is_patched(m) for m in attentions)
    assert kernels.is_patched(patched.patch_embed.proj)  # the patch embedding: one GEMM where a split takes it
    blocks = list(patched.blocks)  # each block's adds with the norms after them: add_layer_norm
    assert all(kernels.is_patched(b) for b in blocks) and kernels.is_patched(patched.blocks)
    sequences = [m for m in patched.modules() if isinstance(m, nn.Sequential)]  # only the blocks' own is patched
    assert [m for m in sequences if kernels.is_patched(m)] == [patched.blocks]
    hooked = []  # a norm with a hook is called: the block before it leaves it its own call
    hook = blocks[3].norm1.register_forward_hook(lambda module, args, out: hooked.append(out.shape))
    x = torch.randn(2, 3, 32, 32, device=device, requires_grad=True)
    out, out_patched = model(x), patched(x)
    assert len(hooked) == 1
    if device == "cuda":
        assert "_PackedAttentionBackward" in graph_node_names(out_patched)
        # Each block's first add with its norm2; its second with the next block's norm1 (not block 2's: block 3's
        # norm1 has a hook); the last block's second add stays an add.
        assert fused_nodes(out_patched) == 2 * len(blocks) - 2
    # every handed result was taken; the links lived in the call only
    assert not any("_pending_norm1" in b.__dict__ or "_next_block" in b.__dict__ for b in blocks)
    torch.testing.assert_close(out_patched, out, atol=TOL, rtol=TOL)
    grad = torch.randn_like(out)
    for got, expected in zip(torch.autograd.grad(out_patched, (x, *patched.parameters()), grad),
                             torch.autograd.grad(out, (x, *model.parameters()), grad)):
        torch.testing.assert_close(got, expected, atol=gradient_atol(expected), rtol=TOL)
    with torch.no_grad():
        torch.testing.assert_close(patched(x), model(x), atol=TOL, rtol=TOL)
    with torch.inference_mode():  # inference tensors have no version counter
        torch.testing.assert_close(patched(x), model(x), atol=TOL, rtol=TOL)
    for module in (model, patched):  # activation checkpointing: no hand-over its recomputation could miss
        module.set_grad_checkpointing(True)
    for got, expected in zip(torch.autograd.grad(patched(x), (x, *patched.parameters()), grad),
                             torch.autograd.grad(model(x), (x, *model.parameters()), grad)):
        torch.testing.assert_close(got, expected, atol=gradient_atol(expected), rtol=TOL)
    assert not any("_pending_norm1" in b.__dict__ for b in blocks)
    for module in (model, patched):
        module.set_grad_checkpointing(False)
    hook.remove()  # (a local function does not pickle)
    copied = pickle.loads(pickle.dumps(patched))
    assert kernels.is_patched(copied.blocks)
    with torch.no_grad():  # a slice of the blocks links its own (the first four here), from the patch's tokens
        tokens = model.patch_embed(x)
        tokens = model._pos_embed(tokens) if hasattr(model, "_pos_embed") else tokens
        torch.testing.assert_close(patched.blocks[:4](tokens), model.blocks[:4](tokens), atol=TOL, rtol=TOL)
    kernels.unpatch(patched)
    assert not any(kernels.is_patched(m) for m in patched.modules())



def _vit_for_leaving(large):
    """A ViT at ViT-B's width and a call of it: 16 images (rows a split product takes) or 1 (too few)."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(embed_dim=768, depth=2, num_heads=12).cuda().eval()
    x = torch.randn(16 if large else 1, 3, 224, 224, device="cuda")
    return model, lambda m: m(x)


def _bert_for_leaving(large):
    """A BERT at BERT-large's width and a call of it: 4 x 512 tokens (rows a split product takes) or 1 x 64."""
    t = _transformers()
    config = t.BertConfig(hidden_size=1024, num_hidden_layers=2, num_attention_heads=16, intermediate_size=4096,
                          vocab_size=1000, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = t.BertForMaskedLM(config).cuda().eval()
    ids = torch.randint(0, 1000, (4, 512) if large else (1, 64), device="cuda")
    return model, lambda m: m(input_ids=ids).logits


LEAVING_OP = "kernels._add_layer_norm_leaving_row_split.default"


@requires_cuda
@pytest.mark.parametrize("build", [_vit_for_leaving, _bert_for_leaving], ids=["vit", "bert"])
def test_add_norms_leave_their_row_split_for_the_next_products(build, monkeypatch):
    """Without a gradient to compute, a patched ViT Block's and BERT layer's add-norms leave their result's row split
    for the linear layer that reads it (the leaving op is called), and the model's output is the same bit for bit as
    where each layer splits its input itself; with a gradient, or rows too few for a split product, the plain op."""
    model, call = build(large=True)
    patched = kernels.patch(model)
    with torch.no_grad():
        names = ops_called(lambda: call(patched))
        leaving = call(patched)
        monkeypatch.setattr(patching, "_add_layer_norm_for_product",
                            lambda x, residual, norm: kernels.functional.add_layer_norm(x, residual, norm.weight,
                                                                                        norm.bias, norm.eps))
        splitting = call(patched)
        monkeypatch.undo()
    if patching._row_split_read_on(0):
        assert LEAVING_OP in names, names
    assert torch.equal(leaving, splitting)
    assert LEAVING_OP not in ops_called(lambda: call(patched))  # a gradient to compute
    small, small_call = build(large=False)
    patched_small = kernels.patch(small)
    with torch.no_grad():
        assert LEAVING_OP not in ops_called(lambda: small_call(patched_small))


@requires_cuda
def test_add_norm_for_product_keeps_forward_mode_tangents():
    """With a forward-mode tangent to compute, a norm's result leaves no split: the plain op, which keeps it."""
    import torch.autograd.forward_ad as fwAD

    norm = kernels.patch(nn.LayerNorm(768).cuda())
    tokens = torch.randn(16, 197, 768, device="cuda")  # rows a split product takes
    with torch.no_grad(), fwAD.dual_level():
        dual = fwAD.make_dual(tokens, torch.ones_like(tokens))
        names = ops_called(lambda: patching._add_layer_norm_for_product(dual, tokens, norm))
        tangent = fwAD.unpack_dual(patching._add_layer_norm_for_product(dual, tokens, norm)[1]).tangent
    assert LEAVING_OP not in names and tangent is not None


def test_timm_layer_norm_and_new_gelu_patches_take_their_classes_arguments(monkeypatch):
    """A patched timm LayerNorm takes its forward's keyword (x=, a stand-in module for timm.layers.norm), and a patched
    NewGELUActivation gives eager's result for dtypes gelu_tanh does not take (an integer tensor: eager's formula
    promotes it)."""
    import types

    _transformers()
    new_gelu = pytest.importorskip("transformers.activations").NewGELUActivation

    class LayerNorm(nn.LayerNorm):
        def forward(self, x):
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    module = types.ModuleType("timm.layers.norm")
    module.LayerNorm = LayerNorm
    monkeypatch.setitem(sys.modules, "timm.layers.norm", module)
    norm, activation = kernels.patch(LayerNorm(8)), kernels.patch(new_gelu())
    assert kernels.is_patched(norm) and kernels.is_patched(activation)
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x=x), F.layer_norm(x, (8,), norm.weight, norm.bias), atol=TOL, rtol=TOL)
    integers = torch.arange(-4, 5)
    torch.testing.assert_close(activation(integers), new_gelu()(integers), atol=0, rtol=0)


@pytest.mark.parametrize("signature", ["timm 1.0.26 on: (x, attn_mask, is_causal)", "before: (x, attn_mask)"])
def test_timm_attention_patch_keeps_the_forwards_signature(signature, monkeypatch):
    """Calls the patch does not take (here: CPU tensors) reach timm's own forward with the arguments given, whichever
    signature the installed timm's Attention.forward has (a stand-in module for timm.layers.attention)."""
    import types

    seen = []

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)

        if signature.startswith("before"):
            def forward(self, x, attn_mask=None):
                seen.append((attn_mask,))
                return self.proj(x)
        else:
            def forward(self, x, attn_mask=None, is_causal=False):
                seen.append((attn_mask, is_causal))
                return self.proj(x)

    module = types.ModuleType("timm.layers.attention")
    module.Attention = Attention
    monkeypatch.setitem(sys.modules, "timm.layers.attention", module)
    attention = kernels.patch(Attention())
    assert kernels.is_patched(attention)
    x, mask = torch.randn(2, 5, 8), torch.zeros(5, 5)
    attention(x)
    attention(x, mask)
    attention(x, attn_mask=mask)
    expected = [(None,), (mask,), (mask,)]
    if not signature.startswith("before"):
        attention(x, None, True)
        attention(x, is_causal=True)
        expected = [(None, False), (mask, False), (mask, False), (None, True), (None, True)]
    assert len(seen) == len(expected) and all(
        all(a is b or a == b for a, b in zip(got, want)) for got, want in zip(seen, expected)), seen
    kernels.unpatch(attention)

class StandInAttention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, attn_mask=None, is_causal=False):
        return self.proj(x).tanh()


class StandInBlock(nn.Module):
    """timm's ViT Block's code (timm.models.vision_transformer.Block) on small parts."""

    def __init__(self, dim):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), StandInAttention(dim)
        self.ls1, self.drop_path1 = nn.Identity(), nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.ls2, self.drop_path2 = nn.Identity(), nn.Identity()

    def forward(self, x, attn_mask=None, is_causal=False):
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


def stand_in_vit_blocks(monkeypatch, count=4, dim=16):
    """An nn.Sequential of `count` StandInBlocks, their class given as timm.models.vision_transformer's Block (a
    stand-in module), and the layer_norm kernels' conditions opened to CPU float32 tensors: patch()'s Block and
    sequence patches run on any machine (the ops take their ATen formulas on the CPU)."""
    import types

    module = types.ModuleType("timm.models.vision_transformer")
    module.Block = StandInBlock
    monkeypatch.setitem(sys.modules, "timm.models.vision_transformer", module)
    monkeypatch.setattr(patching, "_layer_norm_takes", lambda norm, x: x.dtype == torch.float32 and x.dim() > 0)
    torch.manual_seed(0)
    blocks = nn.Sequential(*(StandInBlock(dim) for _ in range(count)))
    for block in blocks:
        for norm in (block.norm1, block.norm2):  # parameters off their initial values
            nn.init.normal_(norm.weight, 1.0, 0.2)
            nn.init.normal_(norm.bias, 0.0, 0.2)
    return blocks


def fused_nodes(output):
    """The add_layer_norm nodes of output's graph."""
    count, pending, seen = 0, [output.grad_fn], set()
    while pending:
        node = pending.pop()
        if node is not None and node not in seen:
            seen.add(node)
            count += "AddLayerNormBackward" in node.name()
            pending.extend(next_node for next_node, _ in node.next_functions)
    return count


@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non-reentrant"])
def test_block_sequence_hand_over(monkeypatch, checkpointing):
    """The Block patch's residual adds with the norms after them, the second with the next block's norm1 handed over
    inside a patched nn.Sequential's call: outputs and every gradient eager's (float64 reference), under activation
    checkpointing too (no hand-over its recomputation could miss), no link or hand-over left after a call."""
    from torch.utils.checkpoint import checkpoint

    blocks = stand_in_vit_blocks(monkeypatch)
    patched = kernels.patch(copy.deepcopy(blocks))
    assert kernels.is_patched(patched) and all(kernels.is_patched(b) for b in patched)
    assert not any(kernels.is_patched(b.mlp) for b in patched)  # a sequence without blocks stays nn.Sequential
    x = torch.randn(3, 5, 16, requires_grad=True)
    grad = torch.randn(3, 5, 16)

    def run(model, inputs):
        if checkpointing is None:
            return model(inputs)
        use_reentrant = checkpointing == "reentrant"
        half = len(model) // 2
        middle = checkpoint(model[:half], inputs, use_reentrant=use_reentrant)
        return checkpoint(model[half:], middle, use_reentrant=use_reentrant)

    out = run(patched, x)
    if checkpointing is None:
        assert fused_nodes(out) == 2 * len(blocks) - 1  # the last block's second add stays an add
    assert not any("_next_block" in b.__dict__ or "_pending_norm1" in b.__dict__ for b in patched)
    out.backward(grad)  # (reentrant checkpointing takes no autograd.grad)
    got = [x.grad.clone(), *(p.grad for p in patched.parameters())]
    x.grad = None
    expected = run(blocks, x)
    expected.backward(grad)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for ours, eager in zip(got, [x.grad, *(p.grad for p in blocks.parameters())]):
        torch.testing.assert_close(ours, eager, atol=gradient_atol(eager), rtol=1e-4)
    assert not any("_next_block" in b.__dict__ or "_pending_norm1" in b.__dict__ for b in patched)


def test_block_sequence_hooks_copies_and_modes(monkeypatch):
    """A hook on a block or on the next block's norm1 stops the hand-over there (the hook sees the call and may change
    its output); inference mode; slices, deep copies and pickles link their own blocks and carry no link; unpatch."""
    blocks = stand_in_vit_blocks(monkeypatch)
    patched = kernels.patch(copy.deepcopy(blocks))
    x = torch.randn(3, 5, 16)
    shift = torch.randn(16)
    hooks = [patched[1].register_forward_hook(lambda module, args, out: out.add_(shift)),
             patched[2].norm1.register_forward_hook(lambda module, args, out: None)]
    blocks[1].register_forward_hook(lambda module, args, out: out.add_(shift))
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            torch.testing.assert_close(patched(x), blocks(x), atol=1e-5, rtol=1e-5)
    y = patched(x.requires_grad_(True))
    assert fused_nodes(y) == 2 * len(blocks) - 1 - 2  # none handed into block 1 nor out of it (its hook)
    for hook in hooks:
        hook.remove()
    fresh = stand_in_vit_blocks(monkeypatch, count=4)
    fresh.load_state_dict(blocks.state_dict())
    for copied in (patched[:3], copy.deepcopy(patched), pickle.loads(pickle.dumps(patched))):
        assert kernels.is_patched(copied)
        assert not any("_next_block" in b.__dict__ for b in copied)
        with torch.no_grad():
            torch.testing.assert_close(copied(x), fresh[:len(copied)](x), atol=1e-5, rtol=1e-5)
    assert "_next_block" not in copy.deepcopy(patched[0]).__dict__
    kernels.unpatch(patched)
    assert type(patched) is nn.Sequential and not any(kernels.is_patched(m) for m in patched.modules())


def test_block_sequence_leaves_calls_that_do_more_alone(monkeypatch):
    """A block whose call does more than its forward gets no hand-over and hands none: here one offloaded as
    accelerate does (its parameters on the meta device between calls, loaded by a forward set on the instance), one
    whose norm2 is so, and one compiled; the results are eager's and no link or hand-over stays behind."""
    import functools

    blocks = stand_in_vit_blocks(monkeypatch)
    patched = kernels.patch(copy.deepcopy(blocks))

    def offload(module):
        kept = {name: p.detach().clone() for name, p in module.named_parameters()}

        def place(values):
            for name, value in values.items():
                owner, _, leaf = name.rpartition(".")
                (module.get_submodule(owner) if owner else module)._parameters[leaf] = nn.Parameter(value)

        place({name: torch.empty_like(value, device="meta") for name, value in kept.items()})
        forward = module.forward

        @functools.wraps(forward)
        def loading_forward(*args, **kwargs):
            place({name: value.clone() for name, value in kept.items()})
            out = forward(*args, **kwargs)
            place({name: torch.empty_like(value, device="meta") for name, value in kept.items()})
            return out

        module.forward = loading_forward

    offload(patched[2])
    offload(patched[1].norm2)
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(patched(x), blocks(x), atol=1e-5, rtol=1e-5)
    assert not any("_next_block" in b.__dict__ or "_pending_norm1" in b.__dict__ for b in patched)
    compiled = kernels.patch(copy.deepcopy(blocks))
    for block in compiled:  # compiled calls: a graph run from the cache would not take a link off
        block.compile(backend="eager")
    for _ in range(2):
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), blocks(x), atol=1e-5, rtol=1e-5)
        assert not any("_next_block" in b.__dict__ or "_pending_norm1" in b.__dict__ for b in compiled)


@requires_cuda
@pytest.mark.parametrize("batch,tokens,heads,head_dim", [(3, 197, 12, 64), (2, 50, 4, 32), (1, 8, 2, 128)])
def test_packed_attention_is_eagers_attention(batch, tokens, heads, head_dim):
    """_PackedAttention on a packed qkv tensor gives F.scaled_dot_product_attention's output and gradient bit for bit
    (the same kernels on the same values), the output in (batch, tokens, heads, head dim)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    packed = torch.randn(batch, tokens, 3 * heads * head_dim, device="cuda", generator=g).requires_grad_()
    view = packed.view(batch, tokens, 3, heads, head_dim)
    out = patching._PackedAttention.apply(view, head_dim ** -0.5)
    q, k, v = view.permute(2, 0, 3, 1, 4).unbind(0)
    eager = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    assert out.shape == eager.shape and out.is_contiguous()
    assert torch.equal(out, eager)
    grad = torch.randn(out.shape, device="cuda", generator=g)
    # The backward kernel writes the gradients in the packed layout itself: nothing stacks them.
    with mock.patch.object(torch, "stack", side_effect=AssertionError("q's, k's and v's gradients copied")):
        ours, = torch.autograd.grad(out, packed, grad)
    theirs, = torch.autograd.grad(eager, packed, grad)
    assert torch.equal(ours, theirs)
    with torch.no_grad():
        assert torch.equal(patching._PackedAttention.apply(view, head_dim ** -0.5), eager)


@requires_cuda
def test_packed_split_attention_without_a_gradient():
    """A packed qkv tensor with heads of 64 over enough keys, with no gradient to compute, takes the split attention
    kernels, q, k and v read as they lie: kernels.attention's output bit for bit, in (batch, tokens, heads, head dim),
    no less accurate than eager's. Fewer keys, or a gradient to compute, are left to eager's kernels (None)."""
    from kernels.attention.attention import _reference, attention

    tokens = patching._ATTENTION_MIN_KEYS
    g = torch.Generator(device="cuda").manual_seed(0)
    packed = torch.randn(2, tokens, 3 * 4 * 64, device="cuda", generator=g)
    view = packed.view(2, tokens, 3, 4, 64)
    q, k, v = view.permute(2, 0, 3, 1, 4).unbind(0)
    out = patching._packed_split_attention(view, 0.125)
    assert out.shape == (2, tokens, 4, 64) and out.is_contiguous()
    assert torch.equal(out, attention(q.contiguous(), k.contiguous(), v.contiguous()).transpose(1, 2))
    y64 = _reference(q.double(), k.double(), v.double(), False, 0.125).transpose(1, 2)
    eager = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    assert relative_error(out, y64) <= relative_error(eager, y64)
    assert patching._packed_split_attention(view[:, :tokens - 1], 0.125) is None
    packed.requires_grad_()
    assert patching._packed_split_attention(packed.view(view.shape), 0.125) is None
    with torch.no_grad():
        assert torch.equal(patching._packed_split_attention(packed.view(view.shape), 0.125), out)


def test_packed_gradient_takes_the_shared_buffer_as_it_lies():
    """_packed_gradient returns the buffer q's, k's and v's gradients share where they lie in the packed layout (no
    copy), and stacks them otherwise: apart, at another offset or with other strides."""
    packed = torch.empty(2, 5, 3, 4, 8)
    buffer = torch.randn(packed.shape)
    got = patching._packed_gradient(buffer.unbind(2), packed)
    assert got.data_ptr() == buffer.data_ptr() and got.stride() == packed.stride() and torch.equal(got, buffer)
    apart = [part.clone() for part in buffer.unbind(2)]
    got = patching._packed_gradient(apart, packed)
    assert got.data_ptr() not in [part.data_ptr() for part in apart] and torch.equal(got, buffer)
    swapped = [buffer[:, :, 1], buffer[:, :, 0], buffer[:, :, 2]]
    assert torch.equal(patching._packed_gradient(swapped, packed), torch.stack(swapped, 2))
    heads_first = torch.randn(2, 5, 4, 3, 8)  # q, k, v interleaved per head: other strides
    parts = heads_first.unbind(3)
    assert torch.equal(patching._packed_gradient(parts, packed), torch.stack(parts, 2))

# ---- the functional mode ---------------------------------------------------------------------------------------------

FUNCTIONAL_CALLS = {
    "F.linear": lambda x, w, b: F.linear(x, w, b),
    "matmul": lambda x, w, b: torch.matmul(x, w.t()) + b,
    "@": lambda x, w, b: x @ w.t() + b,
    "@ contiguous": lambda x, w, b: x @ w.t().contiguous() + b,
    "mm": lambda x, w, b: torch.mm(x.flatten(0, -2), w.t()).view(*x.shape[:-1], -1) + b,
    "Tensor.mm": lambda x, w, b: x.flatten(0, -2).mm(w.t()).view(*x.shape[:-1], -1) + b,
    "addmm": lambda x, w, b: torch.addmm(b, x.flatten(0, -2), w.t()).view(*x.shape[:-1], -1),
    # The same calls by keyword, as their signatures name the arguments.
    "F.linear by keyword": lambda x, w, b: F.linear(input=x, weight=w, bias=b),
    "matmul by keyword": lambda x, w, b: torch.matmul(x, other=w.t()) + b,
    "Tensor.matmul by keyword": lambda x, w, b: x.matmul(other=w.t()) + b,
    "mm by keyword": lambda x, w, b: torch.mm(x.flatten(0, -2), mat2=w.t()).view(*x.shape[:-1], -1) + b,
    "addmm by keyword": lambda x, w, b: torch.addmm(b, mat1=x.flatten(0, -2), mat2=w.t()).view(*x.shape[:-1], -1),
    # einsum's forms of the same product: the weight n x k or k x n, an ellipsis, an implicit output, a list of
    # operands, and the sublist form (which reaches the mode as an equation).
    "einsum": lambda x, w, b: torch.einsum("bil,kl->bik", x, w) + b,
    "einsum k x n": lambda x, w, b: torch.einsum("bil,lk->bik", x, w.t()) + b,
    "einsum ellipsis": lambda x, w, b: torch.einsum("...l,kl->...k", x, w) + b,
    "einsum implicit output": lambda x, w, b: torch.einsum("bil,kl", x, w) + b,
    "einsum list": lambda x, w, b: torch.einsum("b i l, k l -> b i k", [x, w]) + b,
    "einsum sublist": lambda x, w, b: torch.einsum(x, [0, 1, 2], w, [3, 2], [0, 1, 3]) + b,
}


@pytest.mark.parametrize("batch_first", [False, True])
def test_fp32_gemm_mode_multihead_attention_of_empty_inputs_and_other_widths(batch_first, device):
    """No rows of a batch, or an empty batch, with and without weights: eager's empty output and weights; an output
    projection of another width than the embedding's: eager's."""
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first).to(device)
    for shape, need_weights in itertools.product(((5, 0, 16), (0, 3, 16), (0, 0, 16)), (True, False)):
        x = torch.randn(shape, device=device)
        expected = mha(x, x, x, need_weights=need_weights)
        with kernels.fp32_gemm():
            got = mha(x, x, x, need_weights=need_weights)
        assert got[0].shape == expected[0].shape, (shape, need_weights)
        assert (got[1] is None) == (expected[1] is None) and (got[1] is None or got[1].shape == expected[1].shape)
    # The functional form with an output projection of another width: eager's output width.
    x = torch.randn(5, 3, 16, device=device)
    in_w, in_b = torch.randn(48, 16, device=device), torch.randn(48, device=device)
    out_w, out_b = torch.randn(24, 16, device=device), torch.randn(24, device=device)
    arguments = (x, x, x, 16, 4, in_w, in_b, None, None, False, 0.0, out_w, out_b)
    expected = F.multi_head_attention_forward(*arguments, need_weights=False)[0]
    with kernels.fp32_gemm():
        torch.testing.assert_close(F.multi_head_attention_forward(*arguments, need_weights=False)[0], expected,
                                   atol=TOL, rtol=TOL)


def _outcome(call):
    """A call's result, or the type of what it raised."""
    try:
        return call()
    except Exception as error:  # noqa: BLE001 (any error eager raises is the expected outcome)
        return type(error)


def test_fp32_gemm_mode_leaves_calls_it_does_not_know_to_eager(monkeypatch):
    """With the routes' size gate open (as a split-paying CUDA call finds it): a bias F.linear broadcasts (a scalar,
    one element) and arguments a route does not know (mm's and addmm's out_dtype, a stray positional) get eager's
    result or eager's error, not the library op's."""
    monkeypatch.setattr(patching, "plain_linear_suffices", lambda x, w: False)
    x, w = torch.randn(8, 16), torch.randn(24, 16)
    calls = {
        "scalar bias": lambda: F.linear(x, w, torch.tensor(0.5)),
        "one-element bias": lambda: F.linear(x, w, torch.full((1,), 0.5)),
        "mm out_dtype": lambda: torch.mm(x, w.t(), out_dtype=torch.float32),
        "addmm out_dtype": lambda: torch.addmm(torch.randn(24), x, w.t(), out_dtype=torch.float32),
        "matmul stray argument": lambda: torch.matmul(x, w.t(), 1),
    }
    for name, call in calls.items():
        expected = _outcome(call)
        with kernels.fp32_gemm():
            got = _outcome(call)
        if isinstance(expected, torch.Tensor):
            assert isinstance(got, torch.Tensor), (name, got)
            torch.testing.assert_close(got, expected, atol=TOL, rtol=TOL, msg=name)
        else:
            assert got is expected, (name, got, expected)


@pytest.mark.parametrize("call", sorted(FUNCTIONAL_CALLS))
def test_fp32_gemm_mode_small_shapes_are_eager(call, device):
    """Shapes no split takes (and every CPU product): the mode changes nothing, bit for bit."""
    x, w, b = torch.randn(3, 5, 16, device=device), torch.randn(24, 16, device=device), torch.randn(24, device=device)
    expected = FUNCTIONAL_CALLS[call](x, w, b)
    with kernels.fp32_gemm():
        assert torch.equal(FUNCTIONAL_CALLS[call](x, w, b), expected)


@requires_cuda
@pytest.mark.parametrize("call", sorted(FUNCTIONAL_CALLS))
def test_fp32_gemm_mode_takes_the_split_path(call):
    """At a shape the split takes: the library's op runs, within the contract, with gradients."""
    if gemm_path(torch.empty(2048, 1024, device="cuda"), torch.empty(2048, 1024, device="cuda")) == "cublas":
        pytest.skip("this GPU's float32 path is cuBLAS")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 1024, 1024, device="cuda", generator=g, requires_grad=True)
    w = (torch.randn(2048, 1024, device="cuda", generator=g) / 32).requires_grad_(True)
    b = torch.randn(2048, device="cuda", generator=g).requires_grad_(True)
    eager = FUNCTIONAL_CALLS[call](x, w, b)
    with kernels.fp32_gemm():
        names = ops_called(lambda: FUNCTIONAL_CALLS[call](x, w, b))
        ours = FUNCTIONAL_CALLS[call](x, w, b)
    assert any("kernels.gemm_multiply_leaky_relu" in n for n in names), names
    y64 = FUNCTIONAL_CALLS[call](x.double(), w.double(), b.double())
    check_close_to_float64(ours, eager, y64)
    grad = torch.randn_like(eager)
    grads = torch.autograd.grad(ours, (x, w, b), grad)
    grads_eager = torch.autograd.grad(eager, (x, w, b), grad)
    for ours_g, eager_g in zip(grads, grads_eager):
        torch.testing.assert_close(ours_g, eager_g, atol=gradient_atol(eager_g), rtol=TOL)


# key and value as nn.MultiheadAttention gets them: (its kdim and vdim, the products of a forward: one packed
# in-projection for self-attention, two where key is value, three else, then the output's)
ATTENTION_INPUTS = {"self": (None, 2), "key is value": (None, 3), "cross": (None, 4), "kdim": (24, 4)}


def _count_projections(monkeypatch):
    """The weights' shapes of every product patching.py's linear() runs from now on (the test's monkeypatch undoes
    it)."""
    import kernels.patching

    projections = []
    monkeypatch.setattr(kernels.patching, "linear", lambda x, w, b=None: projections.append(w.shape) or linear(x, w, b))
    return projections


def _attention_inputs(kind, batch_first, device):
    shape = (lambda length, width: (3, length, width)) if batch_first else (lambda length, width: (length, 3, width))
    query = torch.randn(*shape(5, 32), device=device)
    width = ATTENTION_INPUTS[kind][0] or 32
    key = torch.randn(*shape(7, width), device=device)
    if kind == "self":
        return query, query, query
    return query, key, key if kind == "key is value" else torch.randn(*shape(7, width), device=device)


@pytest.mark.parametrize("kind", sorted(ATTENTION_INPUTS))
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_fp32_gemm_mode_reaches_multihead_attention_projections(kind, batch_first, need_weights, device,
                                                                 monkeypatch):
    """F.multi_head_attention_forward dispatches its products itself, out of the mode's sight: the mode runs it with
    its projections through the library's linear(). Shapes no split takes: eager's outputs and attention weights
    (per head too) bit for bit, and its gradients."""
    projections = _count_projections(monkeypatch)
    kdim = ATTENTION_INPUTS[kind][0]
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=batch_first, kdim=kdim, vdim=kdim).to(device)
    attention.eval()  # dropout off: the mode takes the call
    query, key, value = (t.requires_grad_(True) for t in _attention_inputs(kind, batch_first, device))
    for average in (True, False):
        expected = attention(query, key, value, need_weights=need_weights, average_attn_weights=average)
        with kernels.fp32_gemm():
            got = attention(query, key, value, need_weights=need_weights, average_attn_weights=average)
        assert torch.equal(got[0], expected[0])
        assert (got[1] is None and expected[1] is None) if not need_weights else torch.equal(got[1], expected[1])
    assert len(projections) == 2 * ATTENTION_INPUTS[kind][1]
    grad = torch.randn_like(expected[0])
    inputs = tuple(dict.fromkeys((query, key, value)))  # self-attention: one tensor
    for ours, eager in zip(torch.autograd.grad(got[0], inputs, grad), torch.autograd.grad(expected[0], inputs, grad)):
        torch.testing.assert_close(ours, eager, atol=1e-6, rtol=1e-5)  # a GPU's attention backward may add atomically


def _attention_masks(kind, device):
    """nn.MultiheadAttention's masks for 3 sequences of 5 queries over 5 keys, 4 heads."""
    g = torch.Generator(device=device).manual_seed(2)
    padding = torch.rand(3, 5, device=device, generator=g) > 0.6
    padding[:, 0] = False  # every query sees a key: no row of -inf only
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool, device=device), diagonal=1)
    return {
        "key_padding_mask": {"key_padding_mask": padding},
        "float key_padding_mask": {"key_padding_mask": torch.randn(3, 5, device=device, generator=g)},
        "attn_mask": {"attn_mask": causal},
        "3-D float attn_mask": {"attn_mask": torch.randn(12, 5, 5, device=device, generator=g)},
        "both": {"attn_mask": causal, "key_padding_mask": padding},
        "is_causal": {"attn_mask": causal, "is_causal": True},
        "is_causal and key_padding_mask": {"attn_mask": causal, "is_causal": True, "key_padding_mask": padding},
    }[kind]


@pytest.mark.parametrize("mask", ["key_padding_mask", "float key_padding_mask", "attn_mask", "3-D float attn_mask",
                                  "both", "is_causal", "is_causal and key_padding_mask"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_fp32_gemm_mode_multihead_attention_with_masks(mask, need_weights, device, monkeypatch):
    """Masks as nn.MultiheadAttention takes them (boolean or additive, key padding, 2-D or per-head attention masks,
    the is_causal hint): eager's outputs and weights bit for bit, with the projections on the library's linear()."""
    projections = _count_projections(monkeypatch)
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(32, 4, batch_first=True).to(device).eval()
    x = torch.randn(3, 5, 32, device=device)
    options = _attention_masks(mask, device)
    expected = attention(x, x, x, need_weights=need_weights, **options)
    with kernels.fp32_gemm():
        got = attention(x, x, x, need_weights=need_weights, **options)
    assert len(projections) == 2
    assert torch.equal(got[0], expected[0])
    assert (got[1] is None and expected[1] is None) if not need_weights else torch.equal(got[1], expected[1])


def test_multihead_attention_nested_and_ill_formed_calls_stay_eager(device, monkeypatch):
    """Nested-tensor inputs (eager's fused inference path) to a patched layer whose in-projection a split would take:
    eager's results. Projection shapes eager rejects, in the mode: eager's error."""
    import kernels.patching

    monkeypatch.setattr(kernels.patching, "plain_linear_suffices", lambda x, w: False)
    torch.manual_seed(0)
    eager = nn.MultiheadAttention(32, 4, batch_first=True).to(device).eval()
    model = kernels.patch(copy.deepcopy(eager))
    nested = torch.nested.nested_tensor([torch.randn(5, 32), torch.randn(7, 32)], device=device)
    with torch.inference_mode():
        expected = eager(nested, nested, nested, need_weights=False)[0]
        got = model(nested, nested, nested, need_weights=False)[0]
    assert torch.equal(got.to_padded_tensor(0.0), expected.to_padded_tensor(0.0))
    query, key = torch.randn(5, 3, 16, device=device), torch.randn(7, 3, 8, device=device)
    arguments = (query, key, key, 16, 4, None, torch.randn(3, device=device), None, None, False, 0.0,
                 torch.randn(16, 16, device=device), None)
    options = dict(training=False, use_separate_proj_weight=True, q_proj_weight=torch.randn(16, 16, device=device),
                   k_proj_weight=torch.randn(16, 8, device=device), v_proj_weight=torch.randn(16, 8, device=device))
    with pytest.raises(Exception) as eager_error:  # a bias of 3 values for three projections of 16
        F.multi_head_attention_forward(*arguments, **options)
    with kernels.fp32_gemm(), pytest.raises(type(eager_error.value), match=re.escape(str(eager_error.value)[:30])):
        F.multi_head_attention_forward(*arguments, **options)


@pytest.mark.parametrize("need_weights", [False, True])
def test_fp32_gemm_mode_multihead_attention_under_autocast(need_weights, device):
    """Under autocast the mode's nn.MultiheadAttention casts as eager's does: the same dtypes and values."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(32, 4, batch_first=True).to(device).eval()
    x = torch.randn(3, 5, 32, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        expected = attention(x, x, x, need_weights=need_weights)
        with kernels.fp32_gemm():
            got = attention(x, x, x, need_weights=need_weights)
    for ours, eager in zip(got, expected):
        if eager is not None:
            assert ours.dtype == eager.dtype and torch.equal(ours, eager)


@pytest.mark.parametrize("call", ["training with dropout", "add_bias_kv", "add_zero_attn", "unbatched"])
def test_fp32_gemm_mode_leaves_other_multihead_attention_calls_to_eager(call, device, monkeypatch):
    """Dropout in training, bias_k / bias_v, zero attention and unbatched inputs: eager's own computation, bit for
    bit (RNG draws included)."""
    projections = _count_projections(monkeypatch)
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(32, 4, dropout=0.5, add_bias_kv=call == "add_bias_kv",
                                      add_zero_attn=call == "add_zero_attn").to(device)
    attention.train(call == "training with dropout")
    x = torch.randn(5, 32, device=device) if call == "unbatched" else torch.randn(5, 3, 32, device=device)
    torch.manual_seed(1)
    expected = attention(x, x, x)
    with kernels.fp32_gemm():
        torch.manual_seed(1)
        got = attention(x, x, x)
    assert not projections
    for ours, eager in zip(got, expected):
        assert torch.equal(ours, eager)


@pytest.mark.parametrize("kind", sorted(ATTENTION_INPUTS))
@pytest.mark.parametrize("batch_first", [False, True])
def test_patch_multihead_attention(kind, batch_first, device, monkeypatch):
    """patch() turns nn.MultiheadAttention into the library's: the same class and state_dict, and, with its projections
    on linear() (forced here: at these widths no split takes them, and the module's own forward runs), eager's
    results bit for bit, masks included; unpatch() gives the class back."""
    import kernels.patching

    kdim = ATTENTION_INPUTS[kind][0]
    torch.manual_seed(0)
    eager = nn.MultiheadAttention(32, 4, batch_first=batch_first, kdim=kdim, vdim=kdim).to(device).eval()
    model = kernels.patch(copy.deepcopy(eager))
    assert kernels.is_patched(model) and isinstance(model, nn.MultiheadAttention)
    assert list(model.state_dict()) == list(eager.state_dict())
    query, key, value = _attention_inputs(kind, batch_first, device)
    padding = torch.rand(3, key.shape[1 if batch_first else 0], device=device) > 0.6
    padding[:, 0] = False
    calls = [{}, {"need_weights": False}, {"key_padding_mask": padding}, {"need_weights": False,
                                                                          "key_padding_mask": padding}]
    for options in calls:  # the module's own forward
        assert all(torch.equal(a, b) for a, b in zip(model(query, key, value, **options),
                                                     eager(query, key, value, **options)) if a is not None)
    monkeypatch.setattr(kernels.patching, "plain_linear_suffices", lambda x, w: False)
    projections = _count_projections(monkeypatch)
    for options in calls:
        got, expected = model(query, key, value, **options), eager(query, key, value, **options)
        assert torch.equal(got[0], expected[0])
        assert (got[1] is None and expected[1] is None) or torch.equal(got[1], expected[1])
    assert len(projections) == len(calls) * ATTENTION_INPUTS[kind][1]
    eager.train()  # dropout 0: still the library's computation
    model.train()
    assert torch.equal(model(query, key, value)[0], eager(query, key, value)[0])
    kernels.unpatch(model)
    assert type(model) is nn.MultiheadAttention


@requires_cuda
@pytest.mark.parametrize("setup", ["self", "self, weights and masks", "key is value", "cross", "sequence first"])
def test_patched_multihead_attention_takes_the_split_path(setup):
    """A patched nn.MultiheadAttention at a width the split takes: the library's GEMM runs, within the contract against
    float64, with gradients; batch-major inputs (batch_first) run batch-major, with or without weights and masks."""
    if gemm_path(torch.empty(4096, 1024, device="cuda"), torch.empty(3072, 1024, device="cuda")) == "cublas":
        pytest.skip("this GPU's float32 path is cuBLAS")
    torch.manual_seed(0)
    batch_first = setup != "sequence first"
    eager = nn.MultiheadAttention(1024, 16, batch_first=batch_first).cuda().eval()
    model = kernels.patch(copy.deepcopy(eager))
    shape = (4, 1024, 1024) if batch_first else (1024, 4, 1024)
    x = torch.randn(*shape, device="cuda", requires_grad=True)
    other, third = (torch.randn(*shape, device="cuda", requires_grad=True) for _ in range(2))
    inputs = {"key is value": (x, other, other), "cross": (x, other, third)}.get(setup, (x, x, x))
    options = {"need_weights": False}
    if setup == "self, weights and masks":
        padding = torch.zeros(4, 1024, dtype=torch.bool, device="cuda")
        padding[:, 900:] = True
        causal = torch.ones(1024, 1024, dtype=torch.bool, device="cuda").triu(1)
        options = {"need_weights": True, "key_padding_mask": padding, "attn_mask": causal}
    names = ops_called(lambda: model(*inputs, **options))
    assert any("kernels.gemm_multiply_leaky_relu" in n for n in names), names
    if setup == "self":  # batch-major: no copy of the input, of the packed projection or of attention's output
        assert not any(n.startswith(("aten.clone", "aten.copy_", "aten.contiguous")) for n in names), names
    (ours, ours_weights), (expected, expected_weights) = model(*inputs, **options), eager(*inputs, **options)
    inputs64 = [t.detach().double() for t in inputs]
    y64 = copy.deepcopy(eager).double()(*inputs64, **options)[0]
    check_close_to_float64(ours, expected, y64)
    if options["need_weights"]:
        torch.testing.assert_close(ours_weights, expected_weights, atol=TOL, rtol=TOL)
    grad = torch.randn_like(expected)
    leaves = {"key is value": [x, other], "cross": [x, other, third]}.get(setup, [x])
    for ours_g, eager_g in zip(torch.autograd.grad(ours, [*leaves, *model.parameters()], grad),
                               torch.autograd.grad(expected, [*leaves, *eager.parameters()], grad)):
        torch.testing.assert_close(ours_g, eager_g, atol=gradient_atol(eager_g), rtol=TOL)


@requires_cuda
def test_fp32_gemm_mode_multihead_attention_takes_the_split_path():
    """nn.MultiheadAttention at a width the split takes (4096 tokens of 1024): its projections on the library's GEMM,
    within the contract against float64, with gradients."""
    if gemm_path(torch.empty(4096, 1024, device="cuda"), torch.empty(3072, 1024, device="cuda")) == "cublas":
        pytest.skip("this GPU's float32 path is cuBLAS")
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(1024, 16, batch_first=True).cuda().eval()
    x = torch.randn(4, 1024, 1024, device="cuda", requires_grad=True)
    eager = attention(x, x, x, need_weights=False)[0]
    with kernels.fp32_gemm():
        names = ops_called(lambda: attention(x, x, x, need_weights=False))
        ours = attention(x, x, x, need_weights=False)[0]
    assert any("kernels.gemm_multiply_leaky_relu" in n for n in names), names
    x64 = x.detach().double()
    y64 = copy.deepcopy(attention).double()(x64, x64, x64, need_weights=False)[0]
    check_close_to_float64(ours, eager, y64)
    grad = torch.randn_like(eager)
    grads, grads_eager = (torch.autograd.grad(y, [x, *attention.parameters()], grad) for y in (ours, eager))
    for ours_g, eager_g in zip(grads, grads_eager):
        torch.testing.assert_close(ours_g, eager_g, atol=gradient_atol(eager_g), rtol=TOL)


def test_fp32_gemm_mode_leaves_batched_products_to_eager(device):
    q, k = torch.randn(2, 4, 8, 16, device=device), torch.randn(2, 4, 8, 16, device=device)
    expected = q @ k.transpose(-2, -1)
    with kernels.fp32_gemm():
        assert torch.equal(q @ k.transpose(-2, -1), expected)
        assert torch.equal(torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)), expected.flatten(0, 1))
        assert torch.equal(torch.einsum("bhid,bhjd->bhij", q, k), expected)


def test_fp32_gemm_mode_einsum_forms(monkeypatch):
    """With the routes' size gate open (the library's CPU op then computes what a split-paying CUDA call would): the
    einsums that are a tensor times a matrix get einsum's result through the library's op; the others (an output in
    another order, a batched matrix, a diagonal, three operands, sizes eager refuses) get eager's result or error."""
    monkeypatch.setattr(patching, "plain_linear_suffices", lambda x, w: False)
    x, w, v, u = torch.randn(2, 3, 4, 5), torch.randn(5, 6), torch.randn(6), torch.randn(4, 5)
    routed = ["bijl,lk->bijk", "bijl,kl->bijk", "...l,lk->...k", "b...l,lk->b...k", "bijl,lk", "ijl,lk->ijk"]
    for equation in routed:
        matrix = w.t() if ",kl" in equation else w
        operand = x[0] if equation.startswith("ijl") else x
        with kernels.fp32_gemm():
            names = ops_called(lambda: torch.einsum(equation, operand, matrix))
            got = torch.einsum(equation, operand, matrix)
        assert any("kernels.gemm_multiply_leaky_relu" in n for n in names), (equation, names)
        torch.testing.assert_close(got, torch.einsum(equation, operand, matrix), atol=TOL, rtol=TOL, msg=equation)
    eager = {
        "another order": lambda: torch.einsum("bijl,lk->bikj", x, w),
        "batched matrix": lambda: torch.einsum("bijl,blk->bijk", x, w.expand(2, 5, 6)),
        "diagonal": lambda: torch.einsum("biil,lk->bik", x[:, :, :3, :].expand(2, 3, 3, 5), w),
        "three operands": lambda: torch.einsum("bijl,lk,k->bij", x, w, v),
        "contracted twice": lambda: torch.einsum("bijl,jl->bi", x, u),
        "sizes refused": lambda: torch.einsum("bijl,lk->bijk", x, u),
        "a space in the ellipsis": lambda: torch.einsum("bij. ..l,lk->bij...k", x, w),
        "a space in the arrow": lambda: torch.einsum("bijl,lk- >bijk", x, w),
    }
    for name, call in eager.items():
        expected = _outcome(call)
        with kernels.fp32_gemm():
            names = ops_called(lambda: _outcome(call))
            got = _outcome(call)
        assert not any("kernels.gemm_multiply_leaky_relu" in n for n in names), (name, names)
        if isinstance(expected, torch.Tensor):
            assert torch.equal(got, expected), name
        else:
            assert got is expected, (name, got, expected)


# ---- the shapes real models bring, on the GPU ------------------------------------------------------------------------

def _draw(kind, shape, g):
    return (torch.rand if kind == "rand" else torch.randn)(*shape, device="cuda", generator=g)


@requires_cuda
@pytest.mark.parametrize("m,k,n", [(4096, 768, 2304), (8192, 256, 1024), (4096, 512, 1024), (4096, 384, 4096)])
@pytest.mark.parametrize("kind", ["randn", "rand"])
def test_short_reductions_beat_eager(m, k, n, kind):
    """K of 256-768 at outputs the split now takes: error at most eager's against float64, forward and gradients."""
    g = torch.Generator(device="cuda").manual_seed(m + k + n)
    x = _draw(kind, (m, k), g).requires_grad_(True)
    w = ((torch.rand(n, k, device="cuda", generator=g) * 2 - 1) / k ** 0.5).requires_grad_(True)
    b = torch.randn(n, device="cuda", generator=g) * 0.1
    y = linear(x, w, b)
    y_eager = F.linear(x, w, b)
    y64 = F.linear(x.double(), w.double(), b.double())
    check_close_to_float64(y, y_eager, y64)
    grad = torch.randn(m, n, device="cuda", generator=g)
    grads = torch.autograd.grad(y, (x, w), grad)
    grads_eager = torch.autograd.grad(y_eager, (x, w), grad)
    grads64 = (grad.double() @ w.double(), grad.double().t() @ x.double())
    for ours, eager, exact in zip(grads, grads_eager, grads64):
        assert relative_error(ours, exact) <= relative_error(eager, exact) * 1.0001


@requires_cuda
@pytest.mark.parametrize("m,k,n", [(2048, 1024, 5003), (2560, 768, 30522)])
def test_vocabulary_products(m, k, n):
    """An output layer over a vocabulary of any size: grad_x's reduction runs over it (rows of grad_y not 16-byte
    aligned). Forward and both gradients at most eager's error against float64, NaN rows included."""
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(m, k, device="cuda", generator=g)
    x[1, 2] = float("nan")
    x.requires_grad_(True)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).requires_grad_(True)
    y, y_eager = linear(x, w), F.linear(x, w)
    y64 = F.linear(x.double(), w.double())
    assert torch.equal(torch.isnan(y), torch.isnan(y_eager))
    check_close_to_float64(y[2:], y_eager[2:], y64[2:])
    grad = torch.randn(m, n, device="cuda", generator=g)
    grad[:2] = 0  # the NaN row's gradient stays out of grad_w's comparison
    grads = torch.autograd.grad(y, (x, w), grad)
    grads_eager = torch.autograd.grad(y_eager, (x, w), grad)
    x64 = x.detach().double().nan_to_num()
    grads64 = (grad.double() @ w.double(), grad.double().t() @ x64)
    for ours, eager, exact in zip(grads, grads_eager, grads64):
        assert torch.equal(torch.isnan(ours), torch.isnan(eager))
        finite = torch.isfinite(exact) & ~torch.isnan(eager)
        assert relative_error(ours[finite], exact[finite]) <= relative_error(eager[finite], exact[finite]) * 1.0001


@requires_cuda
@pytest.mark.parametrize("m,k,n", [(2048, 1024, 3072), (1024, 2048, 1024), (1000, 1024, 4096), (2048, 1024, 1022)])
def test_transposed_weight_view(m, k, n):
    """A weight given as the transpose of an (in, out) matrix (Conv1D, x @ W): the same results as the weight made
    contiguous, forward and backward, NaN and Inf rows included; no copy of the weight where n % 4 == 0."""
    g = torch.Generator(device="cuda").manual_seed(m + n)
    w_in_out = (torch.randn(k, n, device="cuda", generator=g) / k ** 0.5).requires_grad_(True)
    x = torch.randn(m, k, device="cuda", generator=g)
    x[3, 5] = float("nan")
    x[7, 0] = float("inf")
    x.requires_grad_(True)
    b = torch.randn(n, device="cuda", generator=g)
    y = linear(x, w_in_out.t(), b)
    y_eager = torch.addmm(b, x, w_in_out)
    y64 = torch.addmm(b.double(), x.double(), w_in_out.double())
    assert torch.equal(torch.isnan(y), torch.isnan(y_eager))
    finite = torch.isfinite(y64).all(1)
    check_close_to_float64(y[finite], y_eager[finite], y64[finite])
    xc = x.detach()[finite].clone().requires_grad_(True)
    grad = torch.randn(xc.shape[0], n, device="cuda", generator=g)
    grads = torch.autograd.grad(linear(xc, w_in_out.t(), b), (xc, w_in_out), grad)
    grads_eager = torch.autograd.grad(torch.addmm(b, xc, w_in_out), (xc, w_in_out), grad)
    for ours, eager in zip(grads, grads_eager):
        assert ours.shape == eager.shape
        torch.testing.assert_close(ours, eager, atol=gradient_atol(eager), rtol=TOL)
    if n % 4 == 0:
        names = ops_called(lambda: linear(x.detach(), w_in_out.detach().t(), b))
        assert not any("clone" in name or "copy" in name or "contiguous" in name for name in names), names


# ---- patchify convolutions (patch embeddings) -------------------------------------------------------------------------

class DoubledConv2d(nn.Conv2d):
    """A Conv2d subclass with a forward of its own: patch() must leave it as it is."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_patch_takes_patchify_convolutions_only(device):
    """patch() turns an nn.Conv2d whose kernel is its stride (no padding, dilation or groups) and leaves every other
    convolution; where no split takes the call (the CPU, small images) the patched layer is its own forward, bit for
    bit; unpatch() gives the class back; split_layer_names names the convolution at a ViT-B/16 image batch."""
    torch.manual_seed(0)
    convs = nn.ModuleDict({
        "patch": nn.Conv2d(3, 32, 8, stride=8),
        "rectangular": nn.Conv2d(3, 16, (2, 4), stride=(2, 4), bias=False, padding="valid"),
        "overlapping": nn.Conv2d(3, 16, 4, stride=2),
        "padded": nn.Conv2d(3, 16, 2, stride=2, padding=1),
        "dilated": nn.Conv2d(3, 16, 2, stride=2, dilation=2),
        "grouped": nn.Conv2d(4, 16, 2, stride=2, groups=2),
        "pointwise": nn.Conv2d(3, 16, 1),
        "own_forward": DoubledConv2d(3, 16, 8, stride=8),
    }).to(device)
    keys = list(convs.state_dict())
    kernels.patch(convs)
    assert {name for name, conv in convs.items() if kernels.is_patched(conv)} == {"patch", "rectangular"}
    assert list(convs.state_dict()) == keys and all(isinstance(conv, nn.Conv2d) for conv in convs.values())
    x = torch.randn(2, 3, 16, 16, device=device)
    for name in ("patch", "rectangular"):
        conv = convs[name]
        assert torch.equal(conv(x), F.conv2d(x, conv.weight, conv.bias, stride=conv.stride))
    embedding = nn.Conv2d(3, 768, 16, stride=16, device="meta")  # ViT-B/16's
    assert kernels.split_layer_names(embedding, torch.empty(64, 3, 224, 224, device="meta")) == [""]
    assert kernels.split_layer_names(embedding, torch.empty(2, 3, 224, 224, device="meta")) == []
    kernels.unpatch(convs)
    assert not any(kernels.is_patched(conv) for conv in convs.values())


def split_paths_here():
    from kernels.gemm.gemm import SPLIT_PATHS, gemm_paths

    return [path for path in gemm_paths("cuda") if path in SPLIT_PATHS]


@requires_cuda
@pytest.mark.parametrize("case", ["vit", "remainder", "rectangular_no_bias", "channels_last", "offset_view",
                                  "non_finite", "scaled"])
def test_patchify_convolution_against_float64(case):
    """A patched patchify convolution at a size the split takes (ViT-B/16's patch embedding, 32 images), on each split
    path: its output and its gradients (weight, bias, image) against float64, at most eager's error (cuDNN's TF32 off:
    eager's fp32) and allclose to eager, in eager's memory format; NaN and Inf where eager has them; images of very
    different magnitudes each at most eager's error."""
    g = torch.Generator(device="cuda").manual_seed(0)
    kernel, bias, shape = (16, 16), True, (32, 3, 224, 224)
    if case == "remainder":  # rows and columns no whole patch covers are left out
        shape = (32, 3, 230, 237)
    if case == "rectangular_no_bias":
        kernel, bias = (8, 16), False
    conv = nn.Conv2d(3, 768, kernel, stride=kernel, bias=bias).cuda()
    kernels.patch(conv)
    x = torch.randn(shape, device="cuda", generator=g)
    if case == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    if case == "offset_view":
        x = torch.randn(shape[0], shape[1], shape[2] + 3, shape[3] + 5, device="cuda", generator=g)[:, :, 3:, 5:]
    if case == "non_finite":
        x[1, 0, 5, 7] = float("nan")
        x[2, 2, 40, 80] = float("inf")
    if case == "scaled":  # images of very different magnitudes
        x = x * torch.logspace(-10, 10, shape[0], device="cuda").view(-1, 1, 1, 1)
    assert patching._patchify_takes(conv, x)
    x.requires_grad_(True)
    parameters = (conv.weight,) + ((conv.bias,) if bias else ())
    grad = torch.randn(shape[0], 768, shape[2] // kernel[0], shape[3] // kernel[1], device="cuda", generator=g)
    inputs64 = [t.detach().double().requires_grad_(True) for t in (x, *parameters)]
    y64 = F.conv2d(inputs64[0], inputs64[1], inputs64[2] if bias else None, stride=kernel)
    expected64 = torch.autograd.grad(y64, inputs64, grad.double())
    previous = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        y_eager = F.conv2d(x, conv.weight, conv.bias, stride=kernel)
        expected = torch.autograd.grad(y_eager, (x, *parameters), grad)
    finally:
        torch.backends.cudnn.allow_tf32 = previous
    for path in split_paths_here():
        with forced_gemm_path(path):
            names = ops_called(lambda: conv(x))
            y = conv(x)
            grads = torch.autograd.grad(y, (x, *parameters), grad)
        assert any("kernels.gemm_multiply_leaky_relu" in name for name in names), names
        assert y.shape == y_eager.shape and y.stride() == y_eager.stride(), (y.stride(), y_eager.stride())
        if case == "non_finite":
            assert torch.equal(torch.isnan(y), torch.isnan(y_eager))
            assert torch.equal(torch.isinf(y), torch.isinf(y_eager))
            continue
        if case == "scaled":  # each image against its own float64 result (allclose does not scale per image)
            for ours, eager, exact in zip(y, y_eager, y64):
                assert relative_error(ours, exact) <= relative_error(eager, exact) * 1.0001 + 1e-12
            continue
        check_close_to_float64(y, y_eager, y64)
        for ours, eager, exact in zip(grads, expected, expected64):
            assert relative_error(ours, exact) <= relative_error(eager, exact) * 1.0001 + 1e-12
            torch.testing.assert_close(ours, eager, atol=gradient_atol(eager), rtol=TOL)


def test_timm_patch_embed_gives_the_gemm_rows_as_tokens(device, monkeypatch):
    """timm's PatchEmbed patched, where its proj takes the one-GEMM form (ViT-B/16's embedding of 32 images on CUDA;
    forced on the CPU, where no split runs): its tokens are the GEMM's rows as they lie, contiguous, bit for bit the
    patched proj's output flattened as timm flattens it, with that route's gradients; an image size timm's checks
    refuse raises timm's error; with a hook on proj the call is its own forward, which the hook sees."""
    timm = pytest.importorskip("timm")
    images = 32
    if device == "cpu":
        monkeypatch.setattr(patching, "_patchify_takes", lambda conv, x: x.dim() == 4 and x.dtype == torch.float32)
        images = 2
    torch.manual_seed(0)
    embed = timm.layers.PatchEmbed(img_size=224, patch_size=16, in_chans=3, embed_dim=768).to(device)
    kernels.patch(embed)
    assert kernels.is_patched(embed) and kernels.is_patched(embed.proj)
    x = torch.randn(images, 3, 224, 224, device=device, requires_grad=True)
    assert patching._patchify_takes(embed.proj, x)
    tokens = embed(x)
    by_proj = embed.proj(x).flatten(2).transpose(1, 2)  # timm's own steps on the patched proj
    assert tokens.shape == (images, 196, 768) and tokens.is_contiguous()
    assert torch.equal(tokens, by_proj)
    grad = torch.randn(tokens.shape, device=device)
    parameters = (x, embed.proj.weight, embed.proj.bias)
    ours = torch.autograd.grad(tokens, parameters, grad)
    for mine, theirs in zip(ours, torch.autograd.grad(by_proj, parameters, grad)):
        torch.testing.assert_close(mine, theirs, atol=0, rtol=1e-6)
    with pytest.raises(AssertionError, match="Input height"):
        embed(torch.randn(1, 3, 208, 224, device=device))
    seen = []
    handle = embed.proj.register_forward_hook(lambda module, args, output: seen.append(output.shape))
    try:
        assert torch.equal(embed(x), tokens)
    finally:
        handle.remove()
    assert seen == [(images, 768, 14, 14)]


@requires_cuda
@pytest.mark.slow
def test_patchify_convolution_follows_the_callers_mode():
    """Where the GEMM takes no call, the patched convolution is eager's own: autocast (float16, eager's policy), a
    float64 image, TF32 allowed for products (the split path steps aside: "high"), torch.func's transforms (vmap);
    under torch.compile and functional_call the route's result is eager's within the contract."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 768, 16, stride=16).cuda()
    kernels.patch(conv)
    x = torch.randn(32, 3, 224, 224, device="cuda")
    assert patching._patchify_takes(conv, x)
    with torch.autocast("cuda", dtype=torch.float16):
        assert not patching._patchify_takes(conv, x)
        assert conv(x).dtype == torch.float16
    assert not patching._patchify_takes(conv.double(), x.double())
    conv.float()
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert not patching._patchify_takes(conv, x)
    finally:
        torch.set_float32_matmul_precision(previous)
    parameters = dict(conv.named_parameters())
    with torch.no_grad():
        expected = conv(x)
        compiled = torch.compile(conv)
        torch.testing.assert_close(compiled(x), expected, atol=TOL, rtol=TOL)
        # torch.func's transforms: eager's convolution (its default TF32 included), as an unpatched layer gives
        unpatched = F.conv2d(x, conv.weight, conv.bias, stride=16)
        torch.testing.assert_close(torch.func.functional_call(conv, parameters, (x,)), expected, atol=TOL, rtol=TOL)
        torch.testing.assert_close(torch.func.vmap(conv)(x[:2].unsqueeze(1)).squeeze(1), unpatched[:2], atol=TOL,
                                   rtol=TOL)


# ---- plain layers: no extra work -------------------------------------------------------------------------------------

def test_plain_small_layer_is_f_linear(device):
    """A plain call that no split can take is F.linear itself: the op is not called, and the result is F.linear's bit
    for bit."""
    layer = FusedLinear(64, 48).to(device)
    x = torch.randn(10, 64, device=device, requires_grad=True)
    assert plain_linear_suffices(x, layer.weight)
    names = ops_called(lambda: layer(x))
    assert not any("kernels." in name for name in names), names
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("n,k", [(512, 512), (1024, 1024), (3072, 768), (768, 3072), (50257, 1024), (48, 64)])
def test_plain_bound_agrees_with_the_full_check(n, k):
    """FusedLinear's kept bound (rows_below_any_split) stands for plain_linear_suffices: below it every call is plain,
    with or without gradients; at it some product of a training call may split."""
    from kernels.gemm.gemm import rows_below_any_split, split_may_pay

    bound = rows_below_any_split(n, k)
    for m in {1, bound // 2, bound - 1} - {0}:
        if m < (1 << 40):
            assert not (split_may_pay(m, n, k) or split_may_pay(m, k, n) or split_may_pay(n, k, m)), m
    if bound < (1 << 40):
        assert split_may_pay(bound, n, k) or split_may_pay(bound, k, n) or split_may_pay(n, k, bound)


def test_plain_bound_follows_the_weight(device):
    """The bound is kept per weight object: a layer given a new weight of another shape (a Parameter set anew) checks
    again, and calls that may split leave the plain path (the op is called on the GPU)."""
    layer = FusedLinear(64, 48).to(device)
    x = torch.randn(10, 64, device=device)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer._plain_numel_below[0]() is layer.weight
    layer.weight = nn.Parameter(torch.randn(1024, 1024, device=device))
    layer.bias = nn.Parameter(torch.randn(1024, device=device))
    x = torch.randn(2048, 1024, device=device)
    names = ops_called(lambda: layer(x))
    assert layer._plain_numel_below[0]() is layer.weight
    assert layer._plain_numel_below[1] <= x.numel()
    assert any("kernels." in name for name in names) == (device == "cuda"), names
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=TOL, rtol=TOL)
    copied = pickle.loads(pickle.dumps(layer))  # the bound's weak reference is not pickled: the copy notes its own
    torch.testing.assert_close(copied(x[:10]), F.linear(x[:10], copied.weight, copied.bias), atol=TOL, rtol=TOL)
    assert copied._plain_numel_below[0]() is copied.weight


def test_an_instance_attribute_hiding_a_parameter_is_what_the_layer_reads(device):
    """A weight or bias set in the instance's dict over the registered parameter (object.__setattr__) is what
    attribute lookup, and so nn.Linear's forward, reads: the patched layer computes with it too."""
    layer = FusedLinear(64, 48).to(device)
    weight, bias = torch.randn(48, 64, device=device), torch.randn(48, device=device)
    x = torch.randn(10, 64, device=device)
    for name, value in (("weight", weight), ("bias", bias)):
        object.__setattr__(layer, name, value)
        assert layer._parameters[name] is not value
        expected = nn.Linear.forward(layer, x)
        torch.testing.assert_close(layer(x), expected, atol=TOL, rtol=TOL)
        torch.testing.assert_close(layer.forward_gelu(x), F.gelu(expected), atol=TOL, rtol=TOL)


@requires_cuda
def test_identity_epilogue_keeps_no_output():
    """The identity epilogue's backward needs nothing of the output: the graph keeps x and the weight only."""
    layer = FusedLinear(1024, 2048).cuda()
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        y = layer(x)
    assert (1024, 2048) not in saved, saved
    y.sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(1024, -1), atol=1e-4, rtol=1e-4)


# ---- kept weight splits within a budget ------------------------------------------------------------------------------

def test_kept_split_budget_bad_values_are_clear_errors():
    for nbytes in (-1, float("inf"), "1"):
        with pytest.raises(ValueError, match="nbytes must be None or a number >= 0"):
            set_kept_split_budget(nbytes)
    with pytest.raises(ValueError, match="kept on CUDA GPUs only, got device cpu"):
        kept_split_bytes("cpu")


@requires_cuda
def test_kept_splits_stay_within_the_budget():
    layers = [FusedLinear(2048, 2048).cuda() for _ in range(3)]
    x = torch.randn(1024, 2048, device="cuda")
    if gemm_path(x, layers[0].weight) not in ("split_fp16", "split_fp16_sm80"):
        pytest.skip("this GPU's float32 path keeps no split")
    try:
        set_kept_split_budget(None)
        with torch.no_grad():
            for layer in layers:
                layer(x), layer(x)  # kept from the second call on
        assert all(layer._weight_split is not None for layer in layers)
        per_split = kept_split_bytes() // 3
        set_kept_split_budget(2 * per_split)  # the least recently used goes
        assert layers[0]._weight_split is None and layers[2]._weight_split is not None
        assert kept_split_bytes() == 2 * per_split
        with torch.no_grad():
            expected = F.linear(x, layers[0].weight, layers[0].bias)
            layers[0](x)
            y = layers[0](x)  # its split again (from its second call after the drop): layers[1] goes
        assert layers[1]._weight_split is None and layers[0]._weight_split is not None
        torch.testing.assert_close(y, expected, atol=TOL, rtol=TOL)
        with torch.no_grad():
            layers[0].weight.data.mul_(0.5)  # uncounted (as PEFT's merge writes): the kept split is not told
            kernels.clear_kept_splits()
            assert kept_split_bytes() == 0 and all(layer._weight_split is None for layer in layers)
            expected = torch.ops.kernels.gemm_multiply_leaky_relu(x, layers[0].weight, layers[0].bias, 1.0, 1.0, False)
            ys = [layers[0](x) for _ in range(3)]  # seen, split anew and kept, read
        assert layers[0]._weight_split is not None
        assert all(torch.equal(y, expected[0]) for y in ys)
        set_kept_split_budget(0)
        assert kept_split_bytes() == 0 and all(layer._weight_split is None for layer in layers)
        with torch.no_grad():
            layers[0](x), layers[0](x)
        assert layers[0]._weight_split is None
        del layers
        assert kept_split_bytes() == 0
    finally:
        set_kept_split_budget(None)


# ---- modes -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", ["small", "split"])
@pytest.mark.slow
def test_patched_model_under_torch_compile(shape, device):
    """torch.compile(fullgraph=True) of a patched model: the same results as the patched model in eager, gradients
    too, at a shape no split takes and at one the split path takes (on the GPU)."""
    if shape == "split" and device == "cpu":
        pytest.skip("the split path is CUDA only")
    torch.manual_seed(0)
    width, rows = (32, 8) if shape == "small" else (1024, 2048)
    model = kernels.patch(nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)).to(device))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(rows, width, device=device, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y_compiled = model(x), compiled(x2)
    torch.testing.assert_close(y_compiled, y, atol=TOL, rtol=TOL)
    y.sum().backward()
    y_compiled.sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, atol=gradient_atol(x.grad), rtol=TOL)


@pytest.mark.slow
def test_patched_llama_norm_and_mlp_under_torch_compile(device):
    """torch.compile(fullgraph=True) of a patched LlamaRMSNorm feeding a patched LlamaMLP (rms_norm and silu_mul on the
    GPU): the same results and gradients as the patched modules in eager."""
    t = _transformers()
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    torch.manual_seed(0)
    norm = kernels.patch(LlamaRMSNorm(64).to(device))
    mlp = kernels.patch(LlamaMLP(t.LlamaConfig(hidden_size=64, intermediate_size=160)).to(device))

    def block(x):
        return mlp(norm(x))

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(3, 17, 64, device=device, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y_compiled = block(x), compiled(x2)
    torch.testing.assert_close(y_compiled, y, atol=TOL, rtol=TOL)
    y.square().sum().backward()
    y_compiled.square().sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, atol=gradient_atol(x.grad), rtol=TOL)


@requires_cuda
def test_patched_model_in_a_cuda_graph():
    """A captured training-free forward replays the same results as eager calls, at a split shape."""
    torch.manual_seed(0)
    model = kernels.patch(nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024)).cuda())
    x = torch.randn(2048, 1024, device="cuda")
    with torch.no_grad():
        expected = model(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                model(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, model(x), atol=0, rtol=0)
    assert not torch.equal(out, expected)


@pytest.mark.parametrize("shape", ["small", "split"])
@pytest.mark.slow
def test_fp32_gemm_mode_under_torch_compile(shape, device):
    """A compiled function called inside fp32_gemm(): the same results as the mode in eager."""
    if shape == "split" and device == "cpu":
        pytest.skip("the split path is CUDA only")
    rows, width = (8, 32) if shape == "small" else (2048, 1024)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, width, device=device, generator=g)
    w = torch.randn(width, width, device=device, generator=g) / width ** 0.5

    def f(x, w):
        return torch.relu(x @ w.t()) @ w

    torch._dynamo.reset()
    compiled = torch.compile(f)
    with kernels.fp32_gemm():
        expected = f(x, w)
        torch.testing.assert_close(compiled(x, w), expected, atol=TOL, rtol=TOL)
    y64 = f(x.double(), w.double())
    assert relative_error(expected, y64) <= relative_error(f(x, w), y64) * 1.0001


def _fill_free_cached_blocks():
    """Tensors that take every free block of 1 MB or more inside the caching allocator's reserved segments (largest
    first), so that a later allocation needs memory reserved anew."""
    free = sorted((block["size"] for segment in torch.cuda.memory_snapshot() if segment["device"] == 0
                   for block in segment["blocks"] if block["state"] == "inactive" and block["size"] >= 1 << 20),
                  reverse=True)
    return [torch.empty(size, dtype=torch.uint8, device="cuda") for size in free]


@requires_cuda
def test_out_of_memory_while_making_a_kept_split_goes_on_without():
    """Where the GPU's memory runs out while making a weight's split to keep, the call goes on without one, with
    eager's result, and the GPU's kept splits are dropped: no out-of-memory error that eager would not raise."""
    torch.manual_seed(0)
    # kept's split (16 MB) is smaller than layer's (64 MB): were it dropped to make room, its memory and the headroom
    # below would still not hold layer's, so the allocation fails whatever this process held before.
    kept, layer = FusedLinear(4096, 1024).cuda(), FusedLinear(4096, 4096).cuda()
    x_kept, x = torch.randn(1024, 4096, device="cuda"), torch.randn(512, 4096, device="cuda")
    if gemm_path(x, layer.weight) != "split_fp16":
        pytest.skip("the kept split of this test's shape is split_fp16's")
    with torch.no_grad():
        kept(x_kept), kept(x_kept)
        assert kept._weight_split is not None
        layer(x)  # seen once: its split is made on the next call
        expected = F.linear(x, layer.weight, layer.bias)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        fillers = _fill_free_cached_blocks()  # earlier tests' segments may hold free blocks the split would fit in
        total = torch.cuda.get_device_properties(0).total_memory
        # Room for the call's own temporaries (x's split and y, 16 MB, in at most two of the allocator's 20 MB
        # segments), not for the weight's split besides (64 MB).
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (40 << 20)) / total)
        try:
            y = layer(x)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
            del fillers
    assert layer._weight_split is None and kept._weight_split is None and kept_split_bytes() == 0
    torch.testing.assert_close(y, expected, atol=TOL, rtol=TOL)


# ---- minGPT's NewGELU and CausalSelfAttention --------------------------------------------------------------------

def _mingpt_attention(device, tokens=32, max_seqlen=48, embed=64, heads=4):
    import reference

    torch.manual_seed(0)
    attention = reference.CausalSelfAttention(embed, heads, 0.0, 0.0, max_seqlen).to(device)
    x = torch.randn(3, tokens, embed, device=device, requires_grad=True)
    return attention, x


def _attention_gradients(module, x, grad):
    return torch.autograd.grad(module(x), (x, *module.parameters()), grad)


def test_mingpt_causal_self_attention_patch(device):
    """minGPT's CausalSelfAttention (KernelBench's level-3 GPT problems): the scale, causal mask and softmax on
    causal_softmax on CUDA (the op ran), eager's bits on the CPU; outputs within the fp32 tolerance of eager's and no
    less accurate against a float64 copy, at fewer tokens than the mask holds too; gradients alike; unpatch gives the
    class back."""
    import reference

    for tokens in (48, 29):
        attention, x = _mingpt_attention(device, tokens=tokens)
        patched = kernels.patch(copy.deepcopy(attention))
        assert kernels.is_patched(patched) and isinstance(patched, reference.CausalSelfAttention)
        names = ops_called(lambda: patched(x))
        assert ("kernels.causal_softmax.default" in names) == (device == "cuda"), names
        y, y_patched = attention(x), patched(x)
        if device == "cpu":
            assert torch.equal(y_patched, y)
        torch.testing.assert_close(y_patched, y, atol=TOL, rtol=TOL)
        y64 = copy.deepcopy(attention).double()(x.detach().double())
        assert relative_error(y_patched, y64) <= relative_error(y, y64)
        grad = torch.randn_like(y)
        for got, expected in zip(_attention_gradients(patched, x, grad), _attention_gradients(attention, x, grad)):
            torch.testing.assert_close(got, expected, atol=gradient_atol(expected), rtol=1e-4)
    assert ("_causal_mask_verdict" in vars(patched)) == (device == "cuda")
    kernels.unpatch(patched)
    assert type(patched) is reference.CausalSelfAttention and "_causal_mask_verdict" not in vars(patched)


@pytest.fixture
def route_device(device, monkeypatch):
    """`device`, with the minGPT attention route taken on the CPU too (causal_softmax runs ATen's formula there): its
    checks and kept verdicts tested on both devices."""
    monkeypatch.setattr(patching, "_CAUSAL_SOFTMAX_DEVICE_TYPES", ("cuda", "cpu"))
    return device


def test_mingpt_attention_route_follows_its_mask_and_mode(route_device, monkeypatch):
    """The route leaves to the module's own forward, each with eager's result: a mask that is not causal (also when
    it changes in place after a call the route took; checked once, not on every call), autocast (whose float32
    softmax eager's output dtype shows), torch.func's transforms, float64, a process group, and more tokens than the
    mask (eager's error)."""
    attention, x = _mingpt_attention(route_device)
    patched = kernels.patch(copy.deepcopy(attention))
    x = x.detach()

    def route_taken(module=patched):
        return "kernels.causal_softmax.default" in ops_called(lambda: module(x))

    assert route_taken()
    with torch.no_grad():
        patched.bias[0, 0, 0, 1] = 1.0  # not causal any more: seen by the buffer's version
        attention.bias[0, 0, 0, 1] = 1.0
    assert not route_taken()
    assert "aten.equal.default" not in ops_called(lambda: patched(x))  # the verdict kept: no check, no sync
    torch.testing.assert_close(patched(x), attention(x), atol=TOL, rtol=TOL)
    with torch.no_grad():
        patched.bias[0, 0, 0, 1] = 0.0
        attention.bias[0, 0, 0, 1] = 0.0
    assert route_taken()
    patched.bias = patched.bias.bool()  # a boolean mask: the same mask
    assert route_taken()
    with torch.autocast(route_device, dtype=torch.bfloat16):
        y, expected = patched(x), attention(x)
        assert not route_taken()
    assert y.dtype == expected.dtype
    torch.testing.assert_close(y, expected, atol=TOL, rtol=TOL)
    per_sample = torch.func.vmap(lambda t: patched(t.unsqueeze(0)).squeeze(0))(x)
    torch.testing.assert_close(per_sample, attention(x), atol=TOL, rtol=TOL)
    double = copy.deepcopy(patched).double()
    assert "kernels.causal_softmax.default" not in ops_called(lambda: double(x.double()))
    with monkeypatch.context() as scope:  # collectives may rewrite the mask uncounted: no verdict is trusted
        scope.setattr(patching, "_rewritten_uncounted", lambda: True)
        assert not route_taken()
    assert route_taken()
    too_long = torch.randn(1, attention.bias.shape[-1] + 1, 64, device=route_device)
    with pytest.raises(RuntimeError) as eager_error:
        attention(too_long)
    with pytest.raises(RuntimeError, match=re.escape(str(eager_error.value))):
        patched(too_long)


def test_mingpt_attention_route_kept_check_and_copies(route_device):
    """The mask's kept verdict holds no mask alive (a replaced buffer is freed) and is neither copied nor pickled: a
    copy made after a call, its mask then changed in place, runs its own forward (eager's result); pickled, a patched
    attention loads and takes the route. A mask made in inference mode (an inference tensor: no version counter)
    runs the module's own forward, without error."""
    import gc
    import weakref

    attention, x = _mingpt_attention(route_device)
    patched = kernels.patch(copy.deepcopy(attention))
    x = x.detach()
    with torch.no_grad():
        patched(x)
        replaced = weakref.ref(patched.bias)
        patched.bias = patched.bias.clone()
        patched(x)
    gc.collect()
    assert replaced() is None
    assert "_causal_mask_verdict" in vars(patched)
    copied = copy.deepcopy(patched)
    assert "_causal_mask_verdict" not in vars(copied)
    with torch.no_grad():
        copied.bias[0, 0, 0, 1] = 1.0
        attention.bias[0, 0, 0, 1] = 1.0
        assert "kernels.causal_softmax.default" not in ops_called(lambda: copied(x))
        torch.testing.assert_close(copied(x), attention(x), atol=TOL, rtol=TOL)
        attention.bias[0, 0, 0, 1] = 0.0
    loaded = pickle.loads(pickle.dumps(patched))
    with torch.no_grad():
        assert "kernels.causal_softmax.default" in ops_called(lambda: loaded(x))
        torch.testing.assert_close(loaded(x), attention(x), atol=TOL, rtol=TOL)
    with torch.inference_mode():
        frozen = kernels.patch(copy.deepcopy(attention))
        frozen.bias = frozen.bias.clone()  # an inference tensor
        assert frozen.bias.is_inference()
        assert "kernels.causal_softmax.default" not in ops_called(lambda: frozen(x))
        torch.testing.assert_close(frozen(x), attention(x), atol=TOL, rtol=TOL)


@requires_cuda
def test_mingpt_attention_route_in_a_cuda_graph():
    """A CUDA graph of a patched minGPT attention: captured after warm-up, the route (its mask's check kept) is in
    the graph and a replay on new inputs gives eager's bits; captured first, eager's formula is."""
    from conftest import assert_graph_replay_matches_eager

    attention, x = _mingpt_attention("cuda")
    patched = kernels.patch(copy.deepcopy(attention))
    x = x.detach()

    def step():
        with torch.no_grad():
            return (patched(x),)

    assert_graph_replay_matches_eager(step, lambda: x.copy_(torch.randn_like(x)))
    assert "kernels.causal_softmax.default" in ops_called(step)
    fresh = kernels.patch(copy.deepcopy(attention))  # no check kept: the capture runs eager's formula
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.no_grad(), torch.cuda.graph(graph):
        captured = fresh(x)
    graph.replay()
    torch.testing.assert_close(captured, attention(x), atol=TOL, rtol=TOL)


def test_mingpt_new_gelu_patch(device):
    """minGPT's NewGELU on gelu_tanh (transformers' NewGELUActivation's formula): eager's result within 1e-6, no less
    accurate against float64, gradients alike."""
    import reference

    activation = reference.NewGELU()
    patched = kernels.patch(copy.deepcopy(activation))
    assert kernels.is_patched(patched) and isinstance(patched, reference.NewGELU)
    x = (torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4).to(device).requires_grad_()
    y, y_patched = activation(x), patched(x)
    torch.testing.assert_close(y_patched, y, atol=1e-6, rtol=1e-6)
    assert relative_error(y_patched, activation(x.detach().double())) <= relative_error(
        y, activation(x.detach().double()))
    grad = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y_patched, x, grad)[0], torch.autograd.grad(y, x, grad)[0],
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(patched(x=x), y_patched, atol=0, rtol=0)  # minGPT's argument name, by keyword
    with torch.autocast(device, dtype=torch.bfloat16):  # eager's pow runs in float32 there: its dtype kept
        half = x.detach().bfloat16()
        y_half, expected = patched(half), activation(half)
    assert y_half.dtype == expected.dtype
    torch.testing.assert_close(y_half, expected)
    meta = torch.empty(8, dtype=torch.bfloat16, device="meta")  # a device autocast does not serve: the op's shapes
    assert patched(meta).shape == meta.shape and patched(meta).dtype == torch.bfloat16


def test_mingpt_code_in_a_module_that_rebinds_its_globals_is_left():
    """The same forward code reading other objects under torch's, math's or F's names computes something else:
    patch() leaves it."""
    import reference

    for rebinding in ("math = types.SimpleNamespace(sqrt=lambda v: 1.0, pi=3.0)\n",
                      "torch = types.SimpleNamespace(tanh=torch.sin, pow=torch.pow, tril=torch.tril, ones=torch.ones)\n",
                      "F = types.SimpleNamespace(softmax=lambda t, dim: t)\n", "float = str\n"):
        namespace = {}
        source = ("import math, types\nimport torch\nimport torch.nn.functional as F\nfrom torch import nn\n"
                  + rebinding + "\n" + _class_source(reference.NewGELU) + "\n" + _class_source(
                      reference.CausalSelfAttention))
        exec(compile(source, "<rebinding>", "exec"), namespace)
        gelu_patched = kernels.is_patched(kernels.patch(namespace["NewGELU"]()))
        attention_patched = kernels.is_patched(kernels.patch(namespace["CausalSelfAttention"](64, 4, 0.0, 0.0, 8)))
        assert gelu_patched == rebinding.startswith(("F", "float")), rebinding
        assert attention_patched == rebinding.startswith("torch"), rebinding  # its forward reads no torch
    # The same source with nothing rebound is patched: the check above fails for the rebinding only.
    namespace = {}
    exec(compile("import math\nimport torch\nimport torch.nn.functional as F\nfrom torch import nn\n"
                 + _class_source(reference.CausalSelfAttention), "<plain>", "exec"), namespace)
    assert kernels.is_patched(kernels.patch(namespace["CausalSelfAttention"](64, 4, 0.0, 0.0, 8)))


def _class_source(cls):
    import inspect
    import textwrap

    return textwrap.dedent(inspect.getsource(cls))


def test_fused_layer_names_on_the_meta_device():
    """fused_layer_names: minGPT's attention and NewGELU that the model calls on float32 tensors (KernelBench's
    44_MiniGPTBlock, at any size), none in float64; split_layer_names keeps to the linear layers."""
    import reference

    with torch.device("meta"):
        block = reference.MiniGPTBlockModel(64, 4, 0.0, 0.0, 32)
        x = torch.randn(2, 32, 64)
    assert kernels.fused_layer_names(block, x) == ["attn", "mlp.act"]
    assert kernels.fused_layer_names(block.double(), x.double()) == []
    assert kernels.split_layer_names(block.float(), x) == []


def test_mingpt_attention_patch_under_torch_compile(route_device):
    """torch.compile (fullgraph; Dynamo's tracing with the eager backend) of a patched minGPT attention traces the
    module's own forward and gives eager's result."""
    attention, x = _mingpt_attention(route_device)
    patched = kernels.patch(copy.deepcopy(attention))
    compiled = torch.compile(patched, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), attention(x), atol=TOL, rtol=TOL)
