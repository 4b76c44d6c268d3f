"""The LeakyReLU family's CPU loops against eager's, op against op, per size and dtype.

One op call at a time (no autograd, no module): forward and backward at a few sizes, in each dtype asked for.
Samples of `--calls` back-to-back calls, taken round-robin (kernels.timing), so drift of the host's speed hits both
alike. Prints the CPU, ATen's CPU capability (set ATEN_CPU_CAPABILITY=avx2 to make eager run its AVX2 loops) and the
thread count.

    python tools/cpu_loops.py [--dtypes fp32,fp16] [--sizes 256x8192,64x8192] [--samples 101] [--calls 20]
"""

import argparse
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import kernels.functional  # noqa: F401  (loads torch.ops.kernels)
from kernels.timing import time_each_ms

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "fp16": torch.float16, "bf16": torch.bfloat16}


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="fp32")
    parser.add_argument("--sizes", default="256x8192")
    parser.add_argument("--samples", type=int, default=101)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--slope", type=float, default=0.01)
    args = parser.parse_args()
    print(f"{cpu_name()}, ATen CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'case':28} | {'eager ms':>9} | {'ours ms':>9} | speedup")
    slope = args.slope
    for size in args.sizes.split(","):
        rows, cols = (int(v) for v in size.split("x"))
        for label in args.dtypes.split(","):
            x = torch.randn(rows, cols).to(DTYPES[label])
            grad = torch.randn_like(x)
            cases = {
                "forward": (lambda: torch.ops.aten.leaky_relu(x, slope),
                            lambda: torch.ops.kernels.leaky_relu(x, slope)),
                "backward": (lambda: torch.ops.aten.leaky_relu_backward(grad, x, slope, False),
                             lambda: torch.ops.kernels.leaky_relu_backward(grad, x, slope, 1.0)),
            }
            for name, (eager, ours) in cases.items():
                assert torch.equal(eager(), ours()), f"{name} {label}: results differ"
                eager_ms, ours_ms = time_each_ms([eager, ours], samples=args.samples, calls_per_sample=args.calls,
                                                 cpu=True)
                print(f"{name + ' ' + label + ' ' + size:28} | {eager_ms:9.4f} | {ours_ms:9.4f} | "
                      f"{eager_ms / ours_ms:6.3f}x", flush=True)


if __name__ == "__main__":
    main()
