"""ModelNew under the modes PyTorch users train and deploy in, against the reference model in the same mode:
torch.autocast (output dtype, values, gradients, a training loop), torch.func (vmap over inputs and over stacked
ensembles, jacrev, jacfwd, vmap of the in-place op), torch.export and an AOTInductor package loaded in a fresh
process, and torch.use_deterministic_algorithms. Tensor parallelism is in test_tensor_parallel.py."""

import copy
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import HAS_CUDA
from kernels.functional import leaky_relu
from kernels.gemm.gemm import gemm_paths
from kernels.precision import ERROR_RATIO_LIMIT, allclose, relative_error
from model_new import GemmMultiplyLeakyReLUModelNew, LeakyReLUModelNew
from reference import GemmMultiplyLeakyReLUModel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AUTOCAST_DTYPES = [torch.bfloat16, torch.float16]


def make_pair(in_features, out_features, device, multiplier=2.0, slope=0.1, seed=0):
    torch.manual_seed(seed)
    reference = GemmMultiplyLeakyReLUModel(in_features, out_features, multiplier, slope).to(device)
    new = GemmMultiplyLeakyReLUModelNew(in_features, out_features, multiplier, slope).to(device)
    new.load_state_dict(reference.state_dict())
    return reference, new


def float64_model(model):
    return copy.deepcopy(model).double()


# ---- autocast ---------------------------------------------------------------------------------------------------

# (batch shape, in_features, out_features); on CUDA also a size whose float32 GEMM takes the split_fp16 path on
# Hopper, which autocast must not take.
AUTOCAST_SHAPES = [((64,), 128, 96), ((3, 5), 40, 24)]
AUTOCAST_CUDA_SHAPES = AUTOCAST_SHAPES + [((1024,), 1024, 1024)]


def autocast_cases():
    for device in ["cpu"] + (["cuda"] if HAS_CUDA else []):
        for shape in AUTOCAST_CUDA_SHAPES if device == "cuda" else AUTOCAST_SHAPES:
            for dtype in AUTOCAST_DTYPES:
                yield pytest.param(device, shape, dtype, id=f"{device}-{shape}-{str(dtype)[6:]}")


@pytest.mark.parametrize("device,shape,dtype", list(autocast_cases()))
def test_autocast_forward_follows_eager(device, shape, dtype):
    """Eager's output dtype, and an error against float64 within the contract for that dtype (2x eager's)."""
    batch, in_features, out_features = shape
    reference, new = make_pair(in_features, out_features, device)
    x = torch.randn(*batch, in_features, device=device)
    with torch.no_grad(), torch.autocast(device, dtype=dtype):
        y, y_ref = new(x), reference(x)
    assert y.dtype == y_ref.dtype == dtype and y.shape == y_ref.shape
    with torch.no_grad():
        y64 = float64_model(reference)(x.double())
    ours, eager = relative_error(y, y64), relative_error(y_ref, y64)
    assert ours <= ERROR_RATIO_LIMIT[dtype] * eager, (ours, eager)


@pytest.mark.parametrize("device,shape,dtype", list(autocast_cases()))
def test_autocast_gradients_follow_eager(device, shape, dtype):
    """Gradients of x, the weight and the bias, taken outside the autocast region as users do: float32, as eager's,
    each within 2x eager's error against the float64 model's gradients."""
    batch, in_features, out_features = shape
    reference, new = make_pair(in_features, out_features, device, slope=-0.2)
    x = torch.randn(*batch, in_features, device=device)
    grad_y = torch.randn(*batch, out_features, device=device)

    def gradients(model, x, autocast):
        x = x.clone().requires_grad_()
        with torch.autocast(device, dtype=dtype, enabled=autocast):
            y = model(x)
        (y.to(grad_y.dtype) * grad_y.to(y.dtype)).sum().backward()
        return [x.grad, model.gemm.weight.grad, model.gemm.bias.grad]

    ours, eager = gradients(new, x, True), gradients(reference, x, True)
    exact = gradients(float64_model(reference), x.double(), False)
    for name, g, g_ref, g64 in zip(["x", "weight", "bias"], ours, eager, exact):
        assert g.dtype == g_ref.dtype == torch.float32, name
        assert relative_error(g, g64) <= ERROR_RATIO_LIMIT[dtype] * relative_error(g_ref, g64), name


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if HAS_CUDA else []))
@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES)
@pytest.mark.slow
def test_autocast_training_loop_tracks_eager(device, dtype):
    """Eight SGD steps under autocast, the loss scaled by GradScaler for float16 on CUDA: our loss tracks eager's."""
    reference, new = make_pair(256, 128, device, slope=0.1)
    torch.manual_seed(1)
    batches = [(torch.randn(64, 256, device=device), torch.randn(64, 128, device=device)) for _ in range(8)]

    def losses(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16 and device == "cuda")
        history = []
        for x, target in batches:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=dtype):
                loss = F.mse_loss(model(x).float(), target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            history.append(loss.item())
        return torch.tensor(history)

    ours, eager = losses(new), losses(reference)
    assert ours[-1] < ours[0]  # it trains
    torch.testing.assert_close(ours, eager, rtol=2e-2, atol=0)


def test_autocast_leaves_leaky_relu_in_its_input_dtype(device):
    """F.leaky_relu is on no autocast list: eager keeps x's dtype, and so does ours."""
    x = torch.randn(4, 33, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y, y_ref = LeakyReLUModelNew(0.1)(x), F.leaky_relu(x, 0.1)
    assert y.dtype == y_ref.dtype == torch.float32 and torch.equal(y, y_ref)


# ---- torch.func -------------------------------------------------------------------------------------------------

def test_vmap_over_stacked_models_matches_eager(device):
    """Model ensembling: torch.func.stack_module_state and functional_call under vmap, eager's results."""
    from torch.func import functional_call, stack_module_state, vmap

    pairs = [make_pair(48, 40, device, seed=seed) for seed in range(3)]
    x = torch.randn(5, 48, device=device)
    results = []
    for models in ([new for _, new in pairs], [ref for ref, _ in pairs]):
        params, buffers = stack_module_state(models)
        base = copy.deepcopy(models[0]).to("meta")
        results.append(vmap(lambda p, b: functional_call(base, (p, b), (x,)))(params, buffers))
    assert results[0].shape == (3, 5, 40)
    torch.testing.assert_close(results[0], results[1], atol=1e-4, rtol=1e-4)


def test_vmap_over_inputs_matches_eager(device):
    """Per-sample calls (x batched, one weight), and vmap of the backward through torch.func.grad."""
    from torch.func import grad, vmap

    reference, new = make_pair(48, 40, device, slope=-0.3)
    x = torch.randn(6, 48, device=device)
    torch.testing.assert_close(vmap(new)(x), vmap(reference)(x), atol=1e-4, rtol=1e-4)
    per_sample = [vmap(grad(lambda xi, m=m: m(xi).square().sum()))(x) for m in (new, reference)]
    torch.testing.assert_close(per_sample[0], per_sample[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("transform", ["jacrev", "jacfwd"])
def test_jacobians_match_eager(device, transform):
    import torch.func

    reference, new = make_pair(24, 16, device, slope=-0.3)
    x = torch.randn(3, 24, device=device, dtype=torch.float64)
    reference, new = reference.double(), new.double()
    jacobian = getattr(torch.func, transform)
    torch.testing.assert_close(jacobian(new)(x), jacobian(reference)(x), atol=1e-10, rtol=1e-10)
    slope = 0.2
    torch.testing.assert_close(jacobian(lambda t: leaky_relu(t, slope))(x),
                               jacobian(lambda t: F.leaky_relu(t, slope))(x))


def test_vmap_of_the_inplace_op_matches_eager(device):
    from torch.func import vmap

    x = torch.randn(4, 7, device=device)
    y = vmap(lambda t: LeakyReLUModelNew(0.1, inplace=True)(t.clone()))(x)
    ours = x.clone()
    vmap(lambda t: leaky_relu(t, 0.1, inplace=True))(ours)
    assert torch.equal(y, F.leaky_relu(x, 0.1)) and torch.equal(ours, F.leaky_relu(x, 0.1))


# ---- export -----------------------------------------------------------------------------------------------------

def test_torch_export_matches_eager(device):
    reference, new = make_pair(64, 32, device)
    x = torch.randn(8, 64, device=device)
    exported = torch.export.export(new, (x,))
    assert any("kernels.gemm_multiply_leaky_relu" in str(node.target) for node in exported.graph.nodes)
    x2 = torch.randn(8, 64, device=device)
    with torch.no_grad():
        assert allclose(exported.module()(x2), reference(x2))
    leaky = torch.export.export(LeakyReLUModelNew(0.1), (x,))
    assert torch.equal(leaky.module()(x2), F.leaky_relu(x2, 0.1))


# Loads an AOTInductor package in a fresh process that imports the library (which registers the ops the package
# calls), runs it and compares with the expected output saved beside it.
AOTI_RUNNER = r"""
import ctypes, sys
# Not dumpable: where the machine's AOTInductor crashes (the control below tells), no core file of a process holding
# a CUDA context (gigabytes) is written, wherever core dumps are on.
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
import torch
sys.path.insert(0, sys.argv[1])
import kernels.functional  # registers torch.ops.kernels
package = torch._inductor.aoti_load_package(sys.argv[2])
x, expected = torch.load(sys.argv[3])
y = package(x)
assert y.dtype == expected.dtype and torch.allclose(y, expected, atol=1e-4, rtol=1e-4), (y - expected).abs().max()
print("AOTI OK")
"""


def run_aoti_package(model, x, expected, folder):
    """Builds the package in this process and runs it in a fresh one: the run, and the seconds each step took."""
    start = time.monotonic()
    with torch.no_grad():
        package = torch._inductor.aoti_compile_and_package(torch.export.export(model, (x,)),
                                                           package_path=str(folder / f"{type(model).__name__}.pt2"))
    torch.save((x, expected), folder / "io.pt")
    built = time.monotonic()
    run = subprocess.run([sys.executable, "-c", AOTI_RUNNER, REPO, package, str(folder / "io.pt")],
                         capture_output=True, text=True, timeout=600)
    return run, f"built in {built - start:.0f} s, ran in {time.monotonic() - built:.0f} s"


# The control: a package of torch's own leaky_relu, built in a process of its own and loaded in a fresh one, as the
# library's package is. It tells whether the machine's AOTInductor works at all.
AOTI_CONTROL = r"""
import pathlib, subprocess, sys, torch
import torch.nn.functional as F
repo, folder, device, runner = sys.argv[1:5]

class EagerLeakyReLU(torch.nn.Module):
    def forward(self, x):
        return F.leaky_relu(x, 0.1)

folder = pathlib.Path(folder)
x = torch.randn(8, 64, device=device)
with torch.no_grad():
    package = torch._inductor.aoti_compile_and_package(torch.export.export(EagerLeakyReLU(), (x,)),
                                                       package_path=str(folder / "EagerLeakyReLU.pt2"))
torch.save((x, F.leaky_relu(x, 0.1)), folder / "io.pt")
print("control package built", flush=True)
sys.exit(subprocess.run([sys.executable, "-c", runner, repo, package, str(folder / "io.pt")]).returncode)
"""


@pytest.mark.slow
def test_aot_inductor_package_runs_in_a_fresh_process(device, tmp_path):
    reference, new = make_pair(64, 32, device)
    x = torch.randn(8, 64, device=device)
    with torch.no_grad():
        expected = reference(x)
    # The control builds beside the library's package (the two builds take a minute or more each where the machine
    # is busy); it is waited for only if the library's package fails.
    (tmp_path / "control").mkdir()
    control = subprocess.Popen([sys.executable, "-c", AOTI_CONTROL, REPO, str(tmp_path / "control"), device, AOTI_RUNNER],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        run, timings = run_aoti_package(new, x, expected, tmp_path)
        if run.returncode != 0:
            # Where a package of torch's own ops fails the same way, the machine's AOTInductor is what fails (seen on
            # the GPU machine's CPU packages: SIGSEGV in the generated wrapper's parse_device_str, a std::regex built
            # by another libstdc++ than torch's), not this library.
            control_output, _ = control.communicate(timeout=900)
            # Only a control that built its package and then failed to run it says so; one that failed to build
            # is a broken control, and the library's failure stands.
            if control.returncode != 0 and "control package built" in control_output:
                pytest.skip(f"AOTInductor's {device} packages fail on this machine without this library too "
                            f"(exit {control.returncode}; the library's package {timings})")
    finally:
        if control.poll() is None:
            os.killpg(control.pid, 9)
            control.wait()
    assert run.returncode == 0 and "AOTI OK" in run.stdout, run.stdout + run.stderr


# ---- deterministic algorithms -----------------------------------------------------------------------------------

def deterministic_cases():
    yield pytest.param("cpu", "cublas", id="cpu")
    if HAS_CUDA:
        for path in gemm_paths("cuda"):
            yield pytest.param("cuda", path, id=f"cuda-{path}")


@pytest.mark.parametrize("device,path", list(deterministic_cases()))
def test_deterministic_algorithms_repeat_bitwise_or_raise_as_eager(device, path):
    """Under torch.use_deterministic_algorithms(True) a forward and backward either runs, and gives the same bits
    twice, or raises where eager raises (cuBLAS without CUBLAS_WORKSPACE_CONFIG)."""
    from kernels.gemm.gemm import forced_gemm_path

    reference, new = make_pair(1024, 1024, device, slope=-0.1)
    x = torch.randn(1024, 1024, device=device, requires_grad=True)

    def run(model):
        y = model(x)
        grads = torch.autograd.grad(y.square().sum(), [x, *model.parameters()])
        return [y.detach(), *grads]

    torch.use_deterministic_algorithms(True)
    try:
        eager_error = ours_error = None
        try:
            run(reference)
        except RuntimeError as error:
            eager_error = error
        with forced_gemm_path(path):
            try:
                first, second = run(new), run(new)
            except RuntimeError as error:
                ours_error = error
    finally:
        torch.use_deterministic_algorithms(False)
    if path in ("cublas", "cublas_bf16x9"):  # cuBLAS's calls: they raise where eager's raise
        assert (eager_error is None) == (ours_error is None), (eager_error, ours_error)
    else:
        assert ours_error is None, ours_error  # the split kernels use no cuBLAS: deterministic by construction
    if ours_error is None:
        for a, b in zip(first, second):
            assert torch.equal(a, b)
