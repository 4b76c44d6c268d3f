"""Distributed modes that act on ModelNew's `gemm` submodule: tensor parallelism (parallelize_module with
ColwiseParallel or RowwiseParallel on `gemm`, and replicated DTensor weights with row-sharded or replicated x) and
FSDP2 (fully_shard on the whole model and on `gemm` alone), against the reference model under the same plan, on two
processes (tools/checks/tp_check.py under torchrun): on the CPU over gloo (runs in CI), on two GPUs over NCCL
(tests/test_multi_gpu.py, which `python tools/device_check.py multi-gpu` runs). And, in one process, what makes them
work: `gemm` is an nn.Linear that the forward calls, so hooks attached to it run, and its plain call is nn.Linear's."""

import re

import pytest
import torch
import torch.nn.functional as F

from conftest import run_on_two_processes
from kernels.gemm.gemm import FusedLinear
from model_new import GemmMultiplyLeakyReLUModelNew
from reference import GemmMultiplyLeakyReLUModel


def test_gemm_is_an_nn_linear_whose_plain_call_is_linear(device):
    torch.manual_seed(0)
    reference = GemmMultiplyLeakyReLUModel(48, 40, 2.0, 0.1).to(device)
    torch.manual_seed(0)
    new = GemmMultiplyLeakyReLUModelNew(48, 40, 2.0, 0.1).to(device)
    assert isinstance(new.gemm, torch.nn.Linear) and isinstance(new.gemm, FusedLinear)
    x = torch.randn(7, 48, device=device)
    with torch.no_grad():
        torch.testing.assert_close(new.gemm(x), reference.gemm(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(new.gemm(x, multiplier=-1.5, negative_slope=0.3),
                                   F.leaky_relu(reference.gemm(x) * -1.5, 0.3), atol=1e-5, rtol=1e-5)


def test_forward_runs_the_hooks_of_gemm():
    """What a tensor-parallel plan or FSDP2 attaches to `gemm` (forward pre-hooks and hooks) runs and takes effect."""
    _, new = GemmMultiplyLeakyReLUModel(16, 8, 2.0, 0.1), GemmMultiplyLeakyReLUModelNew(16, 8, 2.0, 0.1)
    seen = []
    new.gemm.register_forward_pre_hook(lambda module, inputs: (inputs[0] * 0,))
    new.gemm.register_forward_hook(lambda module, inputs, output: seen.append(output.shape) or output + 1)
    y = new(torch.randn(3, 16))
    assert seen == [torch.Size([3, 8])]
    expected = F.leaky_relu(new.gemm.bias.detach().expand(3, 8) * 2.0, 0.1) + 1
    torch.testing.assert_close(y.detach(), expected)


CASES = ("ColwiseParallel", "RowwiseParallel", "replicated weight, rows of x", "replicated weight, replicated x",
         "fully_shard(model)", "fully_shard(gemm)", "gemm_gelu sharded", "gemm_gelu sharded, tanh")


def run_tp_check(device_env):
    """tools/checks/tp_check.py on two processes under torchrun; its output, checked for both ranks' final "ok"."""
    output = run_on_two_processes("tools/checks/tp_check.py", device_env)
    # Each rank's last line (the two ranks' lines may run together in the shared pipe).
    finals = re.findall(r"tp_check rank (\d+): ok(?=\s|$|tp_check)", output)
    assert sorted(finals) == ["0", "1"], output[-8000:]
    return output


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
@pytest.mark.slow
def test_tensor_parallel_and_fsdp2_on_two_cpu_processes():
    output = run_tp_check({"TP_CHECK_DEVICE": "cpu"})
    for case in CASES:
        assert output.count(f"{case} 12x64->40: ok") == 2, output[-8000:]
