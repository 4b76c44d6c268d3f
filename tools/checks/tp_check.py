"""Tensor parallelism and FSDP2 over 2 processes: ModelNew against the reference model under the same plan.

Run by `python tools/device_check.py tp [--cpu]` (torchrun, 2 processes; GPUs over NCCL, or the CPU over gloo where
TP_CHECK_DEVICE=cpu). Cases: ColwiseParallel and RowwiseParallel on `gemm`, a replicated weight with x sharded by rows
and replicated, FSDP2 on the whole model and on `gemm` alone (training steps, then no_grad calls between weight
updates), gemm_gelu on sharded DTensors (both GELUs); at a small shape, and on GPUs one whose local products take the
split path.
Prints "tp_check rank R: <case>: ok" per case and "tp_check rank R: ok" at the end.
"""

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

from kernels.gemm.gemm import gemm_gelu, gemm_path  # noqa: E402
from kernels.precision import ALLCLOSE_TOLERANCE, gradient_atol  # noqa: E402
from model_new import GemmMultiplyLeakyReLUModelNew  # noqa: E402
from reference import GemmMultiplyLeakyReLUModel  # noqa: E402
from tests.distributed_helpers import grad_output_away_from_the_kink  # noqa: E402

TOLERANCE = ALLCLOSE_TOLERANCE[torch.float32]


def same(name, got, expected, gradient=False):
    """Equal placements (DTensors), shapes and values within allclose(1e-4); a gradient's atol is gradient_atol
    (kernels/precision.py: eager's own rounding scales with the gradient)."""
    if isinstance(expected, DTensor) or isinstance(got, DTensor):
        assert isinstance(got, DTensor) and isinstance(expected, DTensor), (name, type(got), type(expected))
        assert got.placements == expected.placements, (name, got.placements, expected.placements)
    assert got.shape == expected.shape, (name, got.shape, expected.shape)
    got, expected = (t.full_tensor() if isinstance(t, DTensor) else t for t in (got, expected))
    atol = gradient_atol(expected) if gradient else TOLERANCE
    torch.testing.assert_close(got, expected, msg=name, atol=atol, rtol=TOLERANCE)


def same_gradients(x_new, x_ref, new, reference):
    for name, got, expected in (("x", x_new, x_ref), ("weight", new.gemm.weight, reference.gemm.weight),
                                ("bias", new.gemm.bias, reference.gemm.bias)):
        same(f"{name} grad", got.grad, expected.grad, gradient=True)


def same_after_steps(new, reference, data):
    """Both models after three SGD steps on `data`: the same weights."""
    for model in (reference, new):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in data[:3]:
            optimizer.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            optimizer.step()
    same("weight after 3 steps", new.gemm.weight, reference.gemm.weight)
    same("bias after 3 steps", new.gemm.bias, reference.gemm.bias)


def build(shape, device, multiplier=2.0, slope=-0.2):
    _, k, n = shape
    torch.manual_seed(0)
    reference = GemmMultiplyLeakyReLUModel(k, n, multiplier, slope).to(device)
    new = GemmMultiplyLeakyReLUModelNew(k, n, multiplier, slope).to(device)
    new.load_state_dict(reference.state_dict())
    return reference, new


def tensor_parallel(plan_name, shape, mesh, device, rank, world):
    m, k, _ = shape
    reference, new = build(shape, device)
    plan = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}[plan_name]
    for model in (reference, new):
        parallelize_module(model, mesh, {"gemm": plan()})
    g = torch.Generator(device).manual_seed(1)  # the same draws on every rank
    x = torch.randn(m, k, device=device, generator=g)
    if plan_name == "rowwise":  # RowwiseParallel's input: this rank's columns of x
        x = x.chunk(world, -1)[rank].contiguous()
    x_ref, x_new = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_ref, y_new = reference(x_ref), new(x_new)
    same("y", y_new, y_ref)
    # Away from LeakyReLU's kink: zero where the output, and so the pre-activation, is near zero.
    grad = grad_output_away_from_the_kink(y_ref.detach(), g)
    y_ref.backward(grad)
    y_new.backward(grad)
    same_gradients(x_new, x_ref, new, reference)
    same_after_steps(new, reference, [torch.randn(x.shape, device=device, generator=g) for _ in range(3)])
    # A plain tensor beside DTensor weights is an error, as in eager's nn.Linear.
    for model in (reference, new):
        try:
            model.gemm.forward(x.detach())
        except RuntimeError as error:
            assert "mixed torch.Tensor and DTensor" in str(error), error
        else:
            raise AssertionError("a plain x with DTensor weights did not raise")


def gemm_gelu_sharded(approximate, shape, mesh, device, rank, world):
    """gemm_gelu on DTensors (x replicated, the weight and bias sharded by rows, as ColwiseParallel places them)
    against eager's two ops on the full tensors, DTensor for DTensor: the output and the gradients."""
    m, k, n = shape
    g = torch.Generator(device).manual_seed(1)  # the same draws on every rank
    x, weight, bias = (torch.randn(*size, device=device, generator=g) for size in ((m, k), (n, k), (n,)))
    # nn.Linear's scale: outputs of order 1, where allclose's 1e-4 holds eager's own rounding (unscaled outputs grow
    # with sqrt(K), and so does eager's error)
    weight = weight / k ** 0.5
    placed = [distribute_tensor(t, mesh, placement).requires_grad_(True)
              for t, placement in ((x, [Replicate()]), (weight, [Shard(0)]), (bias, [Shard(0)]))]
    expected = [distribute_tensor(t, mesh, t_placed.placements).requires_grad_(True)
                for t, t_placed in zip((x, weight, bias), placed)]
    y = gemm_gelu(*placed, approximate)
    y_ref = F.gelu(F.linear(*expected), approximate=approximate)
    same("y", y, y_ref)
    grad = torch.randn(y_ref.shape, device=device, generator=g)
    y.backward(distribute_tensor(grad, mesh, y.placements))
    y_ref.backward(distribute_tensor(grad, mesh, y_ref.placements))
    for name, got, want in zip(("x", "weight", "bias"), placed, expected):
        same(f"{name} grad", got.grad, want.grad, gradient=True)


def replicated_weight(x_placement, shape, mesh, device, rank, world):
    m, k, _ = shape
    reference, new = build(shape, device)
    for model in (reference, new):
        distribute_module(model.gemm, mesh)  # parameters replicated over the mesh
    g = torch.Generator(device).manual_seed(2)
    x = torch.randn(m, k, device=device, generator=g)
    placement = Shard(0) if x_placement == "rows" else Replicate()
    local_x = x.chunk(world, 0)[rank].contiguous() if x_placement == "rows" else x
    x_ref, x_new = (DTensor.from_local(local_x.clone(), mesh, [placement]).requires_grad_(True) for _ in range(2))
    y_ref, y_new = reference(x_ref), new(x_new)
    same("y", y_new, y_ref)
    grad = DTensor.from_local(grad_output_away_from_the_kink(y_ref.to_local().detach(), g), mesh, y_ref.placements)
    y_ref.backward(grad)
    y_new.backward(grad)
    same_gradients(x_new, x_ref, new, reference)


def fsdp2(target, shape, mesh, device, rank, world):
    m, k, _ = shape
    reference, new = build(shape, device)
    for model in (reference, new):
        fully_shard(model.gemm if target == "gemm" else model, mesh=mesh)
    g = torch.Generator(device).manual_seed(10 + rank)  # data parallel: each rank its own batch
    same_after_steps(new, reference, [torch.randn(m, k, device=device, generator=g) for _ in range(3)])
    # Evaluation between weight updates: FSDP2 gathers an updated weight into memory it freed, often at the same
    # address, without moving its version counter, so a split kept across no_grad calls (FusedLinear) would go stale.
    x = torch.randn(m, k, device=device, generator=g)
    sharded = [model.gemm if target == "gemm" else model for model in (reference, new)]
    for update in range(2):
        with torch.no_grad():
            for call in range(3):  # on a GPU the weight is seen, then its split would be made, then read
                same(f"no_grad y, update {update}, call {call}", new(x), reference(x))
            for module in sharded:
                module.reshard()  # the root keeps its gathered parameters after a call: sharded again, the next gathers
                for parameter in module.parameters():  # the sharded parameters, as an optimizer's step writes them
                    parameter.mul_(0.5)


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    on_gpu = torch.cuda.is_available() and os.environ.get("TP_CHECK_DEVICE", "") != "cpu"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    # The backend named: with a GPU visible, the default group would hold NCCL only, which cannot move CPU tensors.
    dist.init_process_group("nccl" if on_gpu else "gloo")
    mesh = init_device_mesh(device.type, (world,))
    shapes = [(12, 64, 40)]
    if on_gpu:
        shapes.append((1024, 1024 * world, 1024 * world))  # each rank's products in the split path's range
    failures = 0
    for shape in shapes:
        for name, run, variant in (("ColwiseParallel", tensor_parallel, "colwise"),
                                   ("RowwiseParallel", tensor_parallel, "rowwise"),
                                   ("replicated weight, rows of x", replicated_weight, "rows"),
                                   ("replicated weight, replicated x", replicated_weight, "replicated"),
                                   ("fully_shard(model)", fsdp2, "model"), ("fully_shard(gemm)", fsdp2, "gemm"),
                                   ("gemm_gelu sharded", gemm_gelu_sharded, "none"),
                                   ("gemm_gelu sharded, tanh", gemm_gelu_sharded, "tanh")):
            case = f"{name} {shape[0]}x{shape[1]}->{shape[2]}"
            try:
                run(variant, shape, mesh, device, rank, world)
                print(f"tp_check rank {rank}: {case}: ok", flush=True)
            except Exception:  # reported, and counted: every case runs
                failures += 1
                print(f"tp_check rank {rank}: {case}: FAILED\n{traceback.format_exc()}", flush=True)
    if on_gpu:
        local = torch.randn(1024, 1024, device=device)
        print(f"tp_check rank {rank}: local products at the split-sized shape take {gemm_path(local, local)}",
              flush=True)
    # Both ranks done before either tears gloo down: a rank whose peer is still sending aborts at exit.
    dist.barrier()
    dist.destroy_process_group()
    print(f"tp_check rank {rank}: {'ok' if failures == 0 else f'{failures} failed'}", flush=True)
    # Out without the interpreter's teardown, where gloo's group can still abort ("terminate called without an active
    # exception": a joinable C++ thread destroyed); every check is done and reported, nothing is left to release.
    sys.stderr.flush()
    os._exit(1 if failures else 0)


if __name__ == "__main__":
    main()
