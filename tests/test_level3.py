"""KernelBench's level-3 problems of reference.py (mlp, shallow_wide_mlp, mini_gpt_block): each ModelNew against its
reference model built after the same seed, on CPU and CUDA: the same weights and state_dict, outputs within the
fp32 tolerance with an error against float64 no larger than eager's, on rand and randn inputs, and the same
gradients. The problem-size runs are in test_export.py (the candidates, five seeds) and bench.py."""

import re

import pytest
import torch

import reference
from conftest import requires_cuda
from kernels.precision import ERROR_RATIO_LIMIT, allclose, gradient_atol, relative_error
from model_new import MODEL_NEW

# Small sizes for every device, and sizes at which the GPU's GEMMs take the split path (K >= 512, >= 2^20 outputs).
SMALL = {
    "mlp": ([256, [512, 384], 128], (16, 256)),
    "shallow_wide_mlp": ([128, [640], 256], (8, 128)),
    "mini_gpt_block": ([64, 4, 0.0, 0.0, 32], (2, 16, 64)),
}
SPLIT_SIZES = {
    "mlp": ([1024, [2048, 2048], 1024], (512, 1024)),
    "mini_gpt_block": ([768, 8, 0.0, 0.0, 256], (8, 256, 768)),
}


def make_pair(problem, init, device, seed=0):
    torch.manual_seed(seed)
    model = reference.PROBLEMS[problem].model(*init)
    torch.manual_seed(seed)
    model_new = MODEL_NEW[problem](*init)
    return model.to(device), model_new.to(device)


def float64_model(problem, init, device, seed=0):
    """The reference built anew after the same seed, in float64 (a copy would keep mini_gpt_block's lambda bound to
    the original's modules)."""
    torch.manual_seed(seed)
    return reference.PROBLEMS[problem].model(*init).to(device).double()


def draw(kind, shape, device):
    return (torch.rand if kind == "rand" else torch.randn)(*shape, device=device)


@pytest.mark.parametrize("problem", sorted(SMALL))
def test_same_seed_gives_same_weights_and_state_dicts_load_both_ways(problem):
    init, _ = SMALL[problem]
    model, model_new = make_pair(problem, init, "cpu")
    assert list(model.state_dict()) == list(model_new.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model_new.state_dict().values()))
    torch.manual_seed(7)
    other = MODEL_NEW[problem](*init)
    other.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(model_new.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values()))


def check_forward(problem, init, shape, device, kind, margin=0.0):
    """allclose to the reference, and an error against float64 no larger than eager's (plus `margin`)."""
    model, model_new = make_pair(problem, init, device)
    torch.manual_seed(1)
    x = draw(kind, shape, device)
    with torch.no_grad():
        y, y_ref = model_new(x), model(x)
        y64 = float64_model(problem, init, device)(x.double())
    assert allclose(y, y_ref), (y - y_ref).abs().max()
    ours, eager = relative_error(y, y64), relative_error(y_ref, y64)
    assert ours <= ERROR_RATIO_LIMIT[torch.float32] * eager + margin, (ours, eager)


# At the small sizes both errors are within about one unit roundoff of float32 (the rounding of the output alone):
# there a different order of the same roundings may land either side of eager's, so a margin of one unit roundoff.
UNIT_ROUNDOFF = 2.0 ** -24


@pytest.mark.parametrize("kind", ["rand", "randn"])
@pytest.mark.parametrize("problem", sorted(SMALL))
def test_forward_matches_the_reference(problem, kind, device):
    check_forward(problem, *SMALL[problem], device, kind, margin=UNIT_ROUNDOFF)


@requires_cuda
@pytest.mark.parametrize("kind", ["rand", "randn"])
@pytest.mark.parametrize("problem", sorted(SPLIT_SIZES))
def test_forward_matches_the_reference_on_the_split_path(problem, kind):
    check_forward(problem, *SPLIT_SIZES[problem], "cuda", kind)


def check_gradients(problem, init, shape, device, against_float64=False):
    """The gradients of x and every parameter: allclose to eager's, or (against_float64: where ReLU's gate flips at
    pre-activations within rounding of zero, by eager's rounding or ours, so single entries differ by a whole term)
    an error against float64 autograd no larger than eager's."""
    model, model_new = make_pair(problem, init, device)
    torch.manual_seed(2)
    x = torch.randn(*shape, device=device, requires_grad=True)
    y_ref = model(x)
    weights = torch.randn_like(y_ref)
    grads_ref = torch.autograd.grad((y_ref * weights).sum(), [x, *model.parameters()])
    grads = torch.autograd.grad((model_new(x) * weights).sum(), [x, *model_new.parameters()])
    names = ["x", *(name for name, _ in model.named_parameters())]
    if against_float64:
        model64 = float64_model(problem, init, device)
        x64 = x.detach().double().requires_grad_(True)
        grads64 = torch.autograd.grad((model64(x64) * weights.double()).sum(), [x64, *model64.parameters()])
        for name, grad, grad_ref, grad64 in zip(names, grads, grads_ref, grads64):
            ours, eager = relative_error(grad, grad64), relative_error(grad_ref, grad64)
            assert ours <= ERROR_RATIO_LIMIT[torch.float32] * eager, (name, ours, eager)
        return
    for name, grad, grad_ref in zip(names, grads, grads_ref):
        torch.testing.assert_close(grad, grad_ref, atol=gradient_atol(grad_ref), rtol=1e-4, msg=name)


@pytest.mark.parametrize("problem", sorted(SMALL))
def test_gradients_match_the_reference(problem, device):
    check_gradients(problem, *SMALL[problem], device)


@requires_cuda
@pytest.mark.parametrize("problem", sorted(SPLIT_SIZES))
def test_gradients_match_the_reference_on_the_split_path(problem):
    check_gradients(problem, *SPLIT_SIZES[problem], "cuda", against_float64=True)


def test_mlp_negative_pre_activations_give_zero(device):
    """The hidden layers' ReLU runs as the GEMM's epilogue with slope 0: negative values become zero (-0.0)."""
    model, model_new = make_pair("mlp", [32, [48], 16], device)
    with torch.no_grad():
        model_new.network[0].bias.fill_(-1e3)  # every pre-activation of the hidden layer negative
        model.network[0].bias.fill_(-1e3)
        x = torch.randn(4, 32, device=device)
        y, y_ref = model_new(x), model(x)
    torch.testing.assert_close(y, y_ref, atol=0, rtol=0)
    torch.testing.assert_close(y, model_new.network[2].bias.expand(4, 16), atol=0, rtol=0)


def test_mini_gpt_block_mask_changed_through_pytorch_is_followed(device):
    """The causal mask is applied as causal while the `bias` buffer holds it; a change made through PyTorch (in
    place, or a state_dict load) is seen, and the reference's masked_fill takes over."""
    init, shape = SMALL["mini_gpt_block"]
    model, model_new = make_pair("mini_gpt_block", init, device)
    x = torch.randn(*shape, device=device)
    with torch.no_grad():
        for change in ("fill", "load", "restore"):
            if change == "fill":
                model.attn.bias.fill_(1.0)  # no mask at all
                model_new.attn.bias.fill_(1.0)
            elif change == "load":
                state = model.state_dict()
                state["attn.bias"] = torch.ones_like(state["attn.bias"]).triu()  # a mask that is not causal
                model.load_state_dict(state)
                model_new.load_state_dict(state)
            else:
                size = model.attn.bias.shape[-1]
                model.attn.bias.copy_(torch.ones(size, size, device=device).tril())
                model_new.attn.bias.copy_(torch.ones(size, size, device=device).tril())
            y, y_ref = model_new(x), model(x)
            assert torch.equal(y.isnan(), y_ref.isnan()), change
            assert allclose(y, y_ref), (change, (y - y_ref).nan_to_num().abs().max())


def test_mini_gpt_block_mask_verdict_is_not_copied(device):
    """A copy made after a call (deepcopy, pickle) checks its own mask again: changed in place there, the reference's
    masked_fill takes over. A mask made in inference mode (no version counter) takes it too, without error."""
    import copy
    import pickle

    init, shape = SMALL["mini_gpt_block"]
    model, model_new = make_pair("mini_gpt_block", init, device)
    x = torch.randn(*shape, device=device)
    with torch.no_grad():
        model_new(x)  # the verdict kept
        model.attn.bias[0, 0, 0, 1] = 1.0  # not causal
        for copied in (copy.deepcopy(model_new), pickle.loads(pickle.dumps(model_new))):
            copied.attn.bias[0, 0, 0, 1] = 1.0
            assert allclose(copied(x), model(x))
        model.attn.bias[0, 0, 0, 1] = 0.0
    with torch.inference_mode():
        model_new.attn.bias = model_new.attn.bias.clone()
        assert model_new.attn.bias.is_inference()
        assert allclose(model_new(x), model(x))


def test_mini_gpt_block_dropout_in_training_follows_the_reference(device):
    """With dropout on and in training mode, the same seed draws the same dropout masks in the same order."""
    model, model_new = make_pair("mini_gpt_block", [64, 4, 0.25, 0.25, 32], device)
    x = torch.randn(2, 16, 64, device=device)
    torch.manual_seed(3)
    y_ref = model(x)
    torch.manual_seed(3)
    y = model_new(x)
    assert allclose(y, y_ref), (y - y_ref).abs().max()
    model.eval(), model_new.eval()
    assert allclose(model_new(x), model(x))


def test_mini_gpt_block_longer_than_max_seqlen_raises_as_the_reference():
    """A sequence longer than the mask buffer (max_seqlen): the reference's masked_fill cannot broadcast and raises;
    ModelNew raises the same error, not a result the reference does not have."""
    model, model_new = make_pair("mini_gpt_block", [64, 4, 0.0, 0.0, 32], "cpu")
    x = torch.randn(2, 40, 64)
    with pytest.raises(RuntimeError) as expected:
        model(x)
    with pytest.raises(RuntimeError, match=re.escape(str(expected.value))):
        model_new(x)


def test_mlp_hooks_see_the_reference_calls():
    """Forward and backward hooks on a hidden Linear, on its ReLU, on the Sequential and global module hooks see what
    they see in the reference: the Linear's output before the ReLU, and every module's call."""
    model, model_new = make_pair("mlp", [32, [48], 16], "cpu")
    x = torch.randn(4, 32, requires_grad=True)

    def record(m):
        seen = []
        m.network[0].register_forward_hook(lambda mod, i, o: seen.append(("linear", o.detach().clone())))
        m.network[0].register_full_backward_hook(lambda mod, gi, go: seen.append(("linear grad", go[0].clone())))
        m.network[1].register_forward_hook(lambda mod, i, o: seen.append(("relu", o.detach().clone())))
        m.network.register_forward_hook(lambda mod, i, o: seen.append(("network", o.detach().clone())))
        m(x).sum().backward()
        return seen

    expected, got = record(model), record(model_new)
    assert [name for name, _ in got] == [name for name, _ in expected]
    for (name, a), (_, b) in zip(got, expected):
        torch.testing.assert_close(a, b, msg=name)
    names = {id(m): name for model_ in (model, model_new) for name, m in model_.named_modules()}
    for hook in (torch.nn.modules.module.register_module_forward_hook,
                 torch.nn.modules.module.register_module_forward_pre_hook):
        calls = []
        handle = hook(lambda mod, *args: calls.append(names[id(mod)]) and None)
        try:
            model(x), model_new(x)
        finally:
            handle.remove()
        assert calls[:len(calls) // 2] == calls[len(calls) // 2:], calls
