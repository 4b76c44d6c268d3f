"""Where the per-call time of a small LeakyReLU goes, layer by layer: eager against the op library.

16x16384 float32, CUDA, no grad. Timed by bench.py's helper: samples of 1000 back-to-back calls, taken round-robin
over the variants, so drift of the host's speed hits all of them alike.

    python tools/per_call.py              # on the GPU machine, from the repo root

An experimental pybind11 module, built here only, times the layers below Python: a bare binding, the output
allocation, the op called through the dispatcher from C++ with and without the autograd layer.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
from torch.utils import cpp_extension

import reference
from kernels.timing import time_each_ms
from model_new import LeakyReLUModelNew

import kernels.functional  # noqa: F401  (loads torch.ops.kernels)

PROBE_SOURCE = r"""
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/utils/pybind.h>

namespace {
const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, double)>& op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("kernels::leaky_relu", "")
                                 .typed<at::Tensor(const at::Tensor&, double)>();
  return handle;
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("identity", [](const at::Tensor& x) { return x; });
  m.def("empty_like", [](const at::Tensor& x) { return at::empty_like(x); });
  m.def("op", [](const at::Tensor& x, double s) { return op().call(x, s); });
  m.def("op_no_gil", [](const at::Tensor& x, double s) { return op().call(x, s); },
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("op_below_autograd", [](const at::Tensor& x, double s) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return op().call(x, s);
  });
}
"""


def build_probe():
    start = time.perf_counter()
    probe = cpp_extension.load_inline(name="per_call_probe", cpp_sources=[PROBE_SOURCE],
                                      build_directory=tempfile.mkdtemp(), extra_cflags=["-O3"],
                                      no_implicit_headers=True)
    print(f"probe module built in {time.perf_counter() - start:.1f} s")
    return probe


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(torch.cuda.get_device_name(0), "torch", torch.__version__)
    os.system("lscpu | grep -m1 'Model name'")
    probe = build_probe()
    x = torch.randn(16, 16384, device="cuda")
    x_grad = x.clone().requires_grad_(True)
    slope = 0.01
    eager_module = reference.LeakyReLUModel(slope)
    new_module = LeakyReLUModelNew(slope)
    overload = torch.ops.kernels.leaky_relu.default
    overload_c = overload._op
    variants = {
        "eager module": lambda: eager_module(x),
        "F.leaky_relu": lambda: F.leaky_relu(x, slope),
        "torch._C._nn.leaky_relu": lambda: torch._C._nn.leaky_relu(x, slope),
        "ModelNew": lambda: new_module(x),
        "torch.ops overload": lambda: overload(x, slope),
        "torch.ops overload._op": lambda: overload_c(x, slope),
        "probe: op": lambda: probe.op(x, slope),
        "probe: op, GIL released": lambda: probe.op_no_gil(x, slope),
        "probe: op below autograd": lambda: probe.op_below_autograd(x, slope),
        "probe: empty_like": lambda: probe.empty_like(x),
        "torch.empty_like": lambda: torch.empty_like(x),
        "probe: identity": lambda: probe.identity(x),
        "eager module, grad of x": lambda: eager_module(x_grad),
        "ModelNew, grad of x": lambda: new_module(x_grad),
        "torch.ops overload, grad of x": lambda: overload(x_grad, slope),
    }
    expected = eager_module(x).detach()
    for name in ("ModelNew", "torch.ops overload", "torch.ops overload._op", "probe: op", "probe: op below autograd"):
        torch.testing.assert_close(variants[name](), expected, rtol=0, atol=0)

    # Grad mode stays on: x needs no grad, so only the "grad of x" variants record a graph.
    times = time_each_ms(list(variants.values()), samples=15, warmup=200, calls_per_sample=1000, flush_l2=False)
    eager = times[0]
    print(f"\n{'variant':<30} {'us per call':>11} {'vs eager module':>15}")
    for name, ms in zip(variants, times):
        print(f"{name:<30} {ms * 1e3:>11.2f} {ms / eager:>14.2f}x")

if __name__ == "__main__":
    main()
