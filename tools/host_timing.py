"""Timings outside the GEMM's kernels, one per subcommand (from the repo root; `SUBCOMMAND --help` says more):
per-call (a small LeakyReLU call's host time, layer by layer; GPU), cpu-loops (the LeakyReLU CPU loops against
eager's), export (the exported KernelBench candidates against bench.py's "KB ms"; GPU), build-units (where a cold
build's time goes, compiler command by command).

    python tools/host_timing.py per-call
    python tools/host_timing.py cpu-loops --dtypes fp32,fp16 --sizes 256x8192,64x8192
    python tools/host_timing.py build-units --together
"""

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


# ---- per-call -----------------------------------------------------------------------------------------------------

# A pybind11 module built here only, for the layers below Python: a bare binding, the output allocation, the op
# through the dispatcher from C++ with and without the autograd layer.
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


def per_call(args):
    """16x16384 float32 on CUDA: eager's module, functions and ops beside ModelNew, the op's overload and the probe's
    layers; samples of 1000 back-to-back calls, taken round-robin, so drift of the host's speed hits all alike."""
    import torch
    import torch.nn.functional as F
    from torch.utils import cpp_extension

    import kernels.functional  # noqa: F401  (loads torch.ops.kernels)
    import reference
    from kernels.timing import time_each_ms
    from model_new import LeakyReLUModelNew

    print(torch.cuda.get_device_name(0), "torch", torch.__version__, "CPU", cpu_name())
    probe = cpp_extension.load_inline(name="per_call_probe", cpp_sources=[PROBE_SOURCE],
                                      build_directory=tempfile.mkdtemp(), extra_cflags=["-O3"],
                                      no_implicit_headers=True)
    x = torch.randn(16, 16384, device="cuda")
    x_grad = x.clone().requires_grad_(True)
    slope = 0.01
    eager_module, new_module = reference.LeakyReLUModel(slope), LeakyReLUModelNew(slope)
    overload = torch.ops.kernels.leaky_relu.default
    variants = {
        "eager module": lambda: eager_module(x),
        "F.leaky_relu": lambda: F.leaky_relu(x, slope),
        "torch._C._nn.leaky_relu": lambda: torch._C._nn.leaky_relu(x, slope),
        "ModelNew": lambda: new_module(x),
        "torch.ops overload": lambda: overload(x, slope),
        "torch.ops overload._op": lambda: overload._op(x, slope),
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
    print(f"\n{'variant':<30} {'us per call':>11} {'vs eager module':>15}")
    for name, ms in zip(variants, times):
        print(f"{name:<30} {ms * 1e3:>11.2f} {ms / times[0]:>14.2f}x")


# ---- cpu-loops ----------------------------------------------------------------------------------------------------

def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor()


def cpu_loops(args):
    """One op call at a time (no autograd, no module), forward and backward, per size and dtype, against eager's;
    samples of --calls back-to-back calls, taken round-robin. ATEN_CPU_CAPABILITY=avx2 makes eager run its AVX2
    loops."""
    import torch

    import kernels.functional  # noqa: F401  (loads torch.ops.kernels)
    from kernels.timing import time_each_ms

    dtypes = {"fp32": torch.float32, "fp64": torch.float64, "fp16": torch.float16, "bf16": torch.bfloat16}
    print(f"{cpu_name()}, ATen CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'case':28} | {'eager ms':>9} | {'ours ms':>9} | speedup")
    slope = args.slope
    for size in args.sizes.split(","):
        rows, cols = (int(v) for v in size.split("x"))
        for label in args.dtypes.split(","):
            x = torch.randn(rows, cols).to(dtypes[label])
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


# ---- export -------------------------------------------------------------------------------------------------------

CANDIDATE_TIMING = r"""
import importlib.util, sys, torch
source = open(sys.argv[1]).read()
namespace = {"__name__": "candidate"}
exec(compile(source, "<candidate>", "exec"), namespace)
spec = importlib.util.spec_from_file_location("timing", sys.argv[2])  # the timing helper alone, not the package
timing = importlib.util.module_from_spec(spec)
spec.loader.exec_module(timing)
torch.manual_seed(0)
model = namespace["ModelNew"](*namespace["get_init_inputs"]()).cuda()
inputs = [t.cuda() for t in namespace["get_inputs"]()]
with torch.no_grad():
    print(timing.kernelbench_ms(lambda: model(*inputs)))
"""


def candidate_and_bench_ms(problem, folder, path):
    import json

    candidate_ms = float(subprocess.run(
        [sys.executable, "-c", CANDIDATE_TIMING, path, os.path.join(REPO, "kernels", "timing.py")],
        cwd=folder, check=True, capture_output=True, text=True).stdout.split()[-1])
    report = os.path.join(folder, "bench.json")
    subprocess.run([sys.executable, "bench.py", "--problem", problem, "--variant", "ModelNew", "--dtype", "fp32",
                    "--json", report], cwd=REPO, check=True, capture_output=True, text=True)
    with open(report) as f:
        rows = json.load(f)["rows"]
    # ModelNew on its automatic path: "ModelNew" or "ModelNew (<path>)", not a forced path's row.
    bench_ms = next(r["kernelbench_ms"] for r in rows if r["case"].startswith("forward fp32") and
                    (r["variant"] == "ModelNew" or r["variant"].startswith("ModelNew (")))
    return candidate_ms, bench_ms


def export(args):
    """Each problem's exported candidate, exec'd from a string in a fresh process (no package on the path but the
    timing helper), timed KernelBench's way, against bench.py's "KB ms" for ModelNew in another process; in turn,
    --rounds times, the verdict on the medians. Exits 1 where a ratio is off by more than 5%."""
    import statistics

    within = True
    for problem in ("leaky_relu", "gemm_multiply_leaky_relu"):
        source = subprocess.run([sys.executable, "-m", "kernels.export", problem], cwd=REPO, check=True,
                                capture_output=True, text=True).stdout
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "candidate.py")
            with open(path, "w") as f:
                f.write(source)
            pairs = [candidate_and_bench_ms(problem, folder, path) for _ in range(args.rounds)]
        candidate_ms = statistics.median(c for c, _ in pairs)
        bench_ms = statistics.median(b for _, b in pairs)
        ratio = candidate_ms / bench_ms
        within &= abs(ratio - 1) <= 0.05
        rounds_text = ", ".join(f"{c:.4f}/{b:.4f}" for c, b in pairs)
        print(f"{problem}: exported candidate {candidate_ms:.4f} ms, bench.py KB ms {bench_ms:.4f} ms (medians; "
              f"rounds {rounds_text}), ratio {ratio:.3f} ({'within' if abs(ratio - 1) <= 0.05 else 'NOT within'} 5%)")
    return 0 if within else 1


# ---- build-units --------------------------------------------------------------------------------------------------

def unit_commands(build_root):
    """(library, object, compiler command as a list) for every compiled unit under build_root (ninja's own
    commands, so flags and include paths are the loader's)."""
    import glob

    units = []
    for ninja_file in sorted(glob.glob(os.path.join(build_root, "*", "build.ninja"))):
        folder = os.path.dirname(ninja_file)
        with open(ninja_file) as f:
            objects = re.findall(r"^build ([^ :]+\.o):", f.read(), flags=re.MULTILINE)
        for target in objects:
            command = subprocess.run(["ninja", "-C", folder, "-t", "commands", target], capture_output=True,
                                     text=True, check=True).stdout.strip().splitlines()[-1]
            units.append((os.path.basename(folder).rsplit("_", 1)[0], target, shlex.split(command)))
    return units


def with_source_and_output(command, source, output):
    """The compiler command with its input replaced by `source` and its output by `output`; no depfile."""
    result, skip = [], False
    for part in command:
        if skip:
            skip = False
        elif part in ("-MF", "-o"):
            skip = True
            result += ["-o", output] if part == "-o" else []
        elif part.endswith((".cpp", ".cu")) and os.path.isfile(part):
            result.append(source)
        elif part not in ("-MMD", "-MD"):
            result.append(part)
    return result


def source_of(command):
    return next(part for part in command if part.endswith((".cpp", ".cu")) and os.path.isfile(part))


def headers_only(text):
    """The preprocessor lines of a unit (with their continuations), minus #line: what the unit includes under the
    same conditions, and none of its own code."""
    kept, continuing = [], False
    for line in text.splitlines():
        stripped = line.lstrip()
        if continuing or (stripped.startswith("#") and not re.match(r"#\s*line\b", stripped)):
            kept.append(line)
            continuing = line.rstrip().endswith("\\")
    return "\n".join(kept) + "\n"


def timed(command):
    start = time.perf_counter()
    ran = subprocess.run(command, capture_output=True, text=True)
    if ran.returncode != 0:
        print(f"failed: {shlex.join(command)[:300]}\n{ran.stderr[-2000:]}", flush=True)
        return float("nan")
    return time.perf_counter() - start


def sass_by_function(path):
    """{function: its SASS text} from cuobjdump."""
    import collections

    text = subprocess.run(["cuobjdump", "--dump-sass", path], capture_output=True, text=True).stdout
    functions, name = collections.defaultdict(list), None
    for line in text.splitlines():
        match = re.search(r"Function : (\S+)", line)
        if match:
            name = match.group(1)
        elif name:
            functions[name].append(line.strip())
    return {name: "\n".join(lines) for name, lines in functions.items()}


def build_units(args):
    """Each compiler command of the op library's build run again alone, beside the same command on the unit's
    headers only (its preprocessor lines), so that a unit's time splits into parsing torch's headers and compiling
    its own code; --together: instead each alone, then all at once, as the loader's build runs them."""
    build_root = args.build_root
    if build_root is None:
        build_root = tempfile.mkdtemp(prefix="build_units_")
        subprocess.run([sys.executable, "-c", "import kernels.functional"], cwd=REPO, check=True,
                       env=dict(os.environ, TORCH_EXTENSIONS_DIR=build_root))
    scratch = tempfile.mkdtemp(prefix="build_units_scratch_")
    units = unit_commands(build_root)
    if not units:
        return f"no build of the op library under {build_root}"
    if args.together:
        commands = [with_source_and_output(command, source_of(command), os.path.join(scratch, f"{label}_{target}"))
                    for label, target, command in units]
        alone = [timed(command) for command in commands]
        began = time.perf_counter()
        running = {i: subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                   for i, command in enumerate(commands)}
        together = {}
        while running:
            for i, process in list(running.items()):
                if process.poll() is not None:
                    together[i] = time.perf_counter() - began
                    del running[i]
            time.sleep(0.02)
        for i, (label, target, _) in enumerate(units):
            print(f"{label + ' ' + target:<44} alone {alone[i]:5.1f} s, all at once {together[i]:5.1f} s")
        print(f"sum alone {sum(alone):.1f} s, all at once {max(together.values()):.1f} s", flush=True)
        return
    print(f"{'unit':<44} {'whole':>7} {'headers':>8}  (seconds, each alone; best of {args.repeat})")
    for label, target, command in units:
        source = source_of(command)
        headers = os.path.join(scratch, f"{label}_{target}_headers" + os.path.splitext(source)[1])
        with open(source) as f, open(headers, "w") as out:
            out.write(headers_only(f.read()))

        def best(command, source, output):
            return min(timed(with_source_and_output(command, source, output)) for _ in range(args.repeat))

        whole = best(command, source, os.path.join(scratch, "whole.o"))
        parse = best(command, headers, os.path.join(scratch, "headers.o"))
        print(f"{label + ' ' + target:<44} {whole:7.1f} {parse:8.1f}", flush=True)
        if args.split_compile and target.endswith(".cuda.o"):
            unsplit_command = [part for part in command if not part.startswith("-split-compile")]
            split, unsplit = (os.path.join(scratch, f"{label}_{name}.o") for name in ("split", "unsplit"))
            timed(with_source_and_output(command, source, split))
            seconds = best(unsplit_command, source, unsplit)
            a, b = sass_by_function(split), sass_by_function(unsplit)
            differing = sorted(name for name in a.keys() | b.keys() if a.get(name) != b.get(name))
            print(f"{'  without -split-compile':<44} {seconds:7.1f}           SASS: {len(a)} functions, "
                  f"{len(differing)} differ{': ' + ', '.join(differing[:6]) if differing else ''}", flush=True)
        if args.o3 and not target.endswith(".cuda.o") and "-O3" not in command:
            o3_command = ["-O3" if part in ("-O0", "-O1", "-O2", "-Os") else part for part in command]
            print(f"{'  at -O3':<44} {best(o3_command, source, os.path.join(scratch, 'o3.o')):7.1f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    subcommands = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")

    def add(name, function, summary):
        sub = subcommands.add_parser(name, help=summary, description=f"{summary}. {function.__doc__}")
        sub.set_defaults(function=function)
        return sub

    add("per-call", per_call, "where a small LeakyReLU call's host time goes, layer by layer, eager against ours (GPU)")
    sub = add("cpu-loops", cpu_loops, "the LeakyReLU family's CPU loops against eager's, op against op")
    sub.add_argument("--dtypes", default="fp32", help="comma-separated, of fp32, fp64, fp16, bf16 (fp32)")
    sub.add_argument("--sizes", default="256x8192", help="comma-separated RxC (256x8192)")
    sub.add_argument("--samples", type=int, default=101, help="(101)")
    sub.add_argument("--calls", type=int, default=20, help="back-to-back calls per sample (20)")
    sub.add_argument("--slope", type=float, default=0.01, help="(0.01)")
    sub = add("export", export, "the exported KernelBench candidates' time, KernelBench's way, against bench.py's "
              "\"KB ms\" (GPU)")
    sub.add_argument("--rounds", type=int, default=3, help="measurements of each, in turn (3)")
    sub = add("build-units", build_units, "where a cold build's time goes, compiler command by command")
    sub.add_argument("--build-root", help="a folder the loader built into ($TORCH_EXTENSIONS_DIR); default: a fresh "
                     "build into a temporary one")
    sub.add_argument("--together", action="store_true", help="each command alone, then all at once")
    sub.add_argument("--split-compile", action="store_true",
                     help="the CUDA units also without nvcc's -split-compile, their SASS compared")
    sub.add_argument("--o3", action="store_true", help="the C++ units built at -O1 also at -O3")
    sub.add_argument("--repeat", type=int, default=1, help="best of N runs of each command (1)")
    args = parser.parse_args()
    return args.function(args)


if __name__ == "__main__":
    sys.exit(main())
