"""ModelNew and the reference model in DistributedDataParallel (NCCL, 2 GPUs): equal gradients and weights.

Run by `python tools/device_check.py ddp` (torchrun, 2 processes). On every rank both models, with the same weights,
train two SGD steps on per-rank randn data; after each backward the all-reduced gradients must equal the reference's
and be the same on every rank, after each step so must the weights (allclose at atol = rtol = 1e-4, atol relative to
the tensor's scale). Each rank prints its mismatches and one line "ddp_check rank R/W ...: ok" or "...: MISMATCH".
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# NVLink multicast stays off (tests/distributed_helpers.py says why), set before torch.distributed reads it.
from tests.distributed_helpers import NO_NVLINK_MULTICAST, grad_output_away_from_the_kink  # noqa: E402

for _name, _value in NO_NVLINK_MULTICAST.items():
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from kernels.gemm.gemm import gemm_path, gemm_paths  # noqa: E402
from model_new import GemmMultiplyLeakyReLUModelNew, LeakyReLUModelNew  # noqa: E402
from reference import GemmMultiplyLeakyReLUModel, LeakyReLUModel  # noqa: E402

TOLERANCE = 1e-4
STEPS = 2


def stack(gemm, leaky_relu):
    return nn.Sequential(gemm(256, 512, 2.0, 0.1), leaky_relu(0.05), gemm(512, 128, -1.5, -0.2))


# name: (the reference model and ModelNew, rows of x per rank, whether the first GEMM should take split_fp16 wherever
# the GPU has that path)
MODELS = {
    "gemm 1024x1024->1024": (lambda: (GemmMultiplyLeakyReLUModel(1024, 1024, -1.5, -0.2),
                                      GemmMultiplyLeakyReLUModelNew(1024, 1024, -1.5, -0.2)), 1024, True),
    "gemm 40x136->72": (lambda: (GemmMultiplyLeakyReLUModel(136, 72, 2.0, 0.1),
                                 GemmMultiplyLeakyReLUModelNew(136, 72, 2.0, 0.1)), 40, False),
    "stack 64x256->512->128": (lambda: (stack(GemmMultiplyLeakyReLUModel, LeakyReLUModel),
                                        stack(GemmMultiplyLeakyReLUModelNew, LeakyReLUModelNew)), 64, False),
}


def layers(model):
    return list(model) if isinstance(model, nn.Sequential) else [model]


def last_preactivation(reference, x):
    """The pre-activation of the model's last LeakyReLU, (x @ W^T + b) * multiplier of its last GEMM."""
    with torch.no_grad():
        *first, last = layers(reference)
        for layer in first:
            x = layer(x)
        return last.gemm(x) * last.multiplier


class Comparisons:
    """Every comparison of one rank: the worst normwise error seen, and the mismatches."""

    def __init__(self):
        self.count, self.worst, self.mismatches = 0, (0.0, ""), []

    def compare(self, where, got, expected):
        self.count += 1
        got, expected = got.detach().double(), expected.detach().double()
        diff, scale = (got - expected).abs(), expected.abs().max().item()
        norm = torch.linalg.vector_norm(expected).item()
        normwise = torch.linalg.vector_norm(got - expected).item() / norm if norm > 0 else diff.max().item()
        self.worst = max(self.worst, (normwise, where))
        if got.shape != expected.shape or not bool((diff <= TOLERANCE * scale + TOLERANCE * expected.abs()).all()):
            self.mismatches.append(f"{where}: max |diff| {diff.max().item():.3e} (scale {scale:.3e}), normwise "
                                   f"{normwise:.3e}")


def same_on_every_rank(t):
    """Whether `t` equals, bit for bit, rank 0's tensor of the same name (every rank calls this in the same order)."""
    from_rank_0 = t.detach().clone()
    dist.broadcast(from_rank_0, src=0)
    return torch.equal(t.detach(), from_rank_0)


def check_model(name, make_pair, rows, split_expected, device, rank, comparisons):
    torch.manual_seed(0)  # the same weights on every rank (DistributedDataParallel also broadcasts rank 0's)
    reference, new = make_pair()
    new.load_state_dict(reference.state_dict())
    reference, new = reference.to(device), new.to(device)
    first_weight = layers(new)[0].gemm.weight
    models = [DistributedDataParallel(model, device_ids=[device.index]) for model in (reference, new)]
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) for model in models]
    generator = torch.Generator(device).manual_seed(1000 + rank)  # different data on every rank
    parameters = list(zip(reference.named_parameters(), new.parameters()))
    for step in range(1, STEPS + 1):
        x = torch.randn(rows, first_weight.shape[1], device=device, generator=generator)
        grad = grad_output_away_from_the_kink(last_preactivation(reference, x), generator)
        path = gemm_path(x, first_weight)
        if split_expected and "split_fp16" in gemm_paths(device) and path != "split_fp16":
            comparisons.mismatches.append(f"{name}: the GEMM took the {path} path, not split_fp16")
        outputs = []
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad(set_to_none=True)
            y = model(x)
            (y * grad).sum().backward()  # grad_output = grad; DistributedDataParallel averages over the ranks
            outputs.append(y.detach())
        comparisons.compare(f"{name} step {step} output", outputs[1], outputs[0])
        for (param_name, p_ref), p_new in parameters:
            comparisons.compare(f"{name} step {step} grad {param_name}", p_new.grad, p_ref.grad)
            if not same_on_every_rank(p_new.grad):
                comparisons.mismatches.append(f"{name} step {step} grad {param_name}: differs between ranks")
        for optimizer in optimizers:
            optimizer.step()
        for (param_name, p_ref), p_new in parameters:
            comparisons.compare(f"{name} step {step} weight {param_name}", p_new, p_ref)
    return path


def main():
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    comparisons = Comparisons()
    paths = {name: check_model(name, *spec, device, rank, comparisons) for name, spec in MODELS.items()}
    torch.cuda.synchronize(device)
    for mismatch in comparisons.mismatches:
        print(f"ddp_check mismatch on rank {rank}: {mismatch}", flush=True)
    summary = (f"ddp_check rank {rank}/{world} {torch.cuda.get_device_name(device)}: {len(MODELS)} models x {STEPS} "
               f"SGD steps, {comparisons.count} comparisons; worst normwise {comparisons.worst[0]:.3e} "
               f"({comparisons.worst[1]}); first GEMM's path: " + ", ".join(f"{n} {p}" for n, p in paths.items())
               + (f": MISMATCH ({len(comparisons.mismatches)})" if comparisons.mismatches else ": ok"))
    for turn in range(world):  # one rank at a time, each line in one write, so that lines do not interleave
        if turn == rank:
            sys.stdout.write(summary + "\n")
            sys.stdout.flush()
        dist.barrier(device_ids=[local_rank])
    dist.destroy_process_group()
    return 1 if comparisons.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
