"""Times each problem: eager PyTorch, the peers a user would pick instead (torch.compile, its max-autotune, a
Triton tf32x3 GEMM) and ModelNew, with the measured error beside every time.

    python bench.py                                  # every problem, full KernelBench sizes on the GPU
    python bench.py --problem leaky_relu --json results.json --plot chart.png
    python bench.py --problem gemm_multiply_leaky_relu --dtype fp32 --size 4096x4096x4096 --quick
    python bench.py --problem-file KernelBench/level3 --quick       # any problem files, the Model patched

Rows: median time (CUDA events, L2 flushed), KernelBench's mean, speedups, share of a ceiling timed alike, error vs
float64 and fp32 verdict; "per call" rows: host overhead; CPU tables follow (alone without a GPU). Progress: stderr.
"""

import argparse
import copy
import json
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import reference
from kernels.precision import ALLCLOSE_TOLERANCE, allclose, matmul_precision, relative_error
from kernels.timing import kernelbench_ms, time_each_ms, time_ms
from kernels.gemm.gemm import FAST_FP32_PATHS, SPLIT_PATHS, forced_gemm_path, gemm_path, gemm_paths
from model_new import MODEL_NEW

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


_started = time.perf_counter()


def progress(message):
    print(f"[{time.perf_counter() - _started:6.1f} s] {message}", file=sys.stderr, flush=True)


def compiled(model, mode=None):
    torch._dynamo.reset()
    return torch.compile(model, mode=mode)


class Options:
    """What to run: problems, variants, dtypes, sizes, samples."""

    def __init__(self, args):
        self.variants = set(args.variant) if args.variant else None
        self.dtypes = set(args.dtype) if args.dtype else None
        self.size = args.size
        self.quick = args.quick
        self.samples = 10 if args.quick else 30
        self.kernelbench_calls = 20 if args.quick else 100
        self.models = getattr(args, "model", None)

    def model_specs(self):
        """_model_specs(), only the models --model names (by the start of their names) where it names any."""
        specs = _model_specs()
        return {name: spec for name, spec in specs.items()
                if not self.models or any(name.startswith(start) for start in self.models)}

    def wants(self, variant):
        """eager always runs: it is every row's reference."""
        return variant == "eager" or self.variants is None or variant in self.variants

    def eager_and_new(self, eager, new, with_compile=False, label=""):
        """{"eager": eager, "torch.compile": eager compiled (where with_compile), "ModelNew": new}, without the
        variants --variant leaves out; `label` names the case in the compile's progress line."""
        variants = {"eager": eager}
        if with_compile and self.wants("torch.compile"):
            progress(f"{label}: compiling with torch.compile")
            variants["torch.compile"] = compiled(eager)
        if self.wants("ModelNew"):
            variants["ModelNew"] = new
        return variants

    def wants_dtype(self, label):
        return self.dtypes is None or label in self.dtypes

    def sizes(self, default):
        if self.size:
            return tuple(int(v) for v in self.size.lower().split("x"))
        return default


@dataclass
class Case:
    """One measured case: its variants' names, median times, KernelBench-style times and outputs (None where no
    output is compared), in the same order, eager first."""
    problem: str
    case: str
    precision: str
    variants: list
    times: list
    kb_times: list
    outputs: list
    l2_flushed: bool = True  # False: back-to-back calls, as a host-bound layer runs in a model


@dataclass
class Rate:
    """A row's rate, rate_of(variant) in `unit` per ms, and its ceiling: a name and its time in ms, or a function of
    the variant giving both (a split path's ceiling differs from cuBLAS's)."""
    rate_of: Callable = lambda variant: 0.0
    unit: str = ""
    ceiling: object = "-"
    ceiling_ms: Optional[float] = None


@dataclass
class Reference:
    """What the outputs are judged against: float64 for the error, eager float32 for the fp32 tolerance."""
    y64: object = None
    y_eager32: object = None


def add_rows(rows, case, rate=Rate(), reference=Reference()):
    """One row per variant of `case`: times, speedups, rate, % of ceiling, error vs float64 and the fp32 verdict."""
    eager_ms = case.times[0]
    compile_ms = dict(zip(case.variants, case.times)).get("torch.compile")
    for variant, ms, kb_ms, y in zip(case.variants, case.times, case.kb_times, case.outputs):
        name, ceiling_ms = rate.ceiling(variant) if callable(rate.ceiling) else (rate.ceiling, rate.ceiling_ms)
        rows.append(dict(
            problem=case.problem, case=case.case, variant=variant, precision=case.precision, ms=ms,
            kernelbench_ms=kb_ms, speedup=eager_ms / ms, vs_compile=compile_ms / ms if compile_ms else None,
            rate=rate.rate_of(variant) / ms, unit=rate.unit, ceiling=name,
            pct_of_ceiling=100 * ceiling_ms / ms if ceiling_ms else None,
            l2_flushed=case.l2_flushed,
            error=relative_error(y, reference.y64) if y is not None and reference.y64 is not None else None,
            verdict=None if y is None or reference.y_eager32 is None
            else ("pass" if allclose(y.float(), reference.y_eager32) else "FAIL")))


CPU_SAMPLE_MS = 1.0
CPU_SAMPLES_FACTOR = 20


def run_case(fns, options, kernelbench=True, cpu=False):
    """Median times of fns (the first ones are ceilings), and their KernelBench-style means; cpu=True for CPU
    tensors (wall-clock time, also on a machine with a GPU)."""
    if cpu:
        # CPU calls run on every core and a single call is noisy (late threads, caches), so a CPU sample is as many
        # back-to-back calls as make about CPU_SAMPLE_MS for the slowest function, and medians take CPU_SAMPLES_FACTOR
        # times the samples, which makes the ratios repeatable on a shared host (kernels/leaky_relu/NOTES.md).
        slowest_ms = max(time_ms(fn, samples=3, warmup=1, cpu=True) for fn in fns)
        calls = max(1, min(50, round(CPU_SAMPLE_MS / slowest_ms)))
        times = time_each_ms(fns, samples=options.samples * CPU_SAMPLES_FACTOR, calls_per_sample=calls, cpu=True)
    else:
        times = time_each_ms(fns, samples=options.samples)
    kb = [kernelbench_ms(fn, options.kernelbench_calls, cpu=cpu) if kernelbench else None for fn in fns]
    return times, kb


def add_per_call_rows(rows, problem, eager, new, options, device, calls_per_sample, samples):
    """Small LeakyReLU calls back to back, where host overhead decides (no L2 flush, no KB column): one row without
    grad, and one with x requiring grad, where each call also records its autograd node (freed with the output)."""
    x = torch.randn(16, 16384, device=device)
    variants = options.eager_and_new(eager, new)
    for case, needs_grad in (("per call, fp32 16x16384", False), ("per call with grad, fp32 16x16384", True)):
        progress(f"{problem}: {case}")
        x_in = x.clone().requires_grad_(needs_grad)
        with torch.set_grad_enabled(needs_grad):
            copy_ms, *times = time_each_ms([lambda: x.clone()] + [lambda m=m: m(x_in) for m in variants.values()],
                                           calls_per_sample=calls_per_sample, samples=samples, flush_l2=False,
                                           cpu=device == "cpu")
            outputs = [m(x_in).detach() for m in variants.values()]
        with torch.no_grad():
            add_rows(rows, Case(problem, case, "fp32", list(variants), times, [None] * len(times), outputs,
                                l2_flushed=False),
                     Rate(lambda v: 2 * x.nbytes / 1e6, "GB/s", "clone", copy_ms),
                     Reference(eager(x.double()), eager(x)))


# ---- leaky_relu -------------------------------------------------------------------------------------------------

def bench_leaky_relu(rows, options):
    rows_count, dim = options.sizes((reference.LEAKY_RELU_BATCH_SIZE, reference.LEAKY_RELU_DIM))
    slope = 0.01
    eager = reference.LeakyReLUModel(slope)
    new = MODEL_NEW["leaky_relu"](slope)
    problem = "leaky_relu"

    with torch.no_grad():
        for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            if not options.wants_dtype(label):
                continue
            case = f"forward {label} {rows_count}x{dim}"
            progress(f"{problem}: {case}")
            x32 = torch.randn(rows_count, dim, device=DEVICE)
            x = x32.to(dtype)
            del x32
            out = torch.empty_like(x)
            variants = options.eager_and_new(eager, new, with_compile=HAS_CUDA, label=problem)
            (copy_ms, *times), (_, *kb) = run_case(
                [lambda: out.copy_(x)] + [lambda model=model: model(x) for model in variants.values()], options)
            del out
            y64 = eager(x.double())
            y_eager32 = eager(x.float())
            outputs = [model(x) for model in variants.values()]
            add_rows(rows, Case(problem, case, label, list(variants), times, kb, outputs),
                     Rate(lambda v: 2 * x.nbytes / 1e6, "GB/s", "copy", copy_ms), Reference(y64, y_eager32))
            del x, y64, y_eager32, outputs

        if options.wants_dtype("fp32"):
            # Backward: the kernel each autograd graph runs for grad of input (grad_output and input read, one write).
            case = f"backward fp32 {rows_count}x{dim}"
            progress(f"{problem}: {case}")
            x = torch.randn(rows_count, dim, device=DEVICE)
            grad = torch.randn_like(x)
            out = torch.empty_like(x)
            fns = {"eager": lambda: torch.ops.aten.leaky_relu_backward(grad, x, slope, False)}
            if options.wants("ModelNew"):
                fns["ModelNew"] = lambda: torch.ops.kernels.leaky_relu_backward(grad, x, slope, 1.0)
            (copy_ms, *times), (_, *kb) = run_case([lambda: out.copy_(x)] + list(fns.values()), options)
            del out
            g64 = torch.ops.aten.leaky_relu_backward(grad.double(), x.double(), slope, False)
            outputs = [fn() for fn in fns.values()]
            add_rows(rows, Case(problem, case, "fp32", list(fns), times, kb, outputs),
                     Rate(lambda v: 3 * x.nbytes / 1e6, "GB/s", "copy", 1.5 * copy_ms), Reference(g64, outputs[0]))
            del x, grad, g64, outputs

    if options.wants_dtype("fp32"):
        add_per_call_rows(rows, problem, eager, new, options, DEVICE, calls_per_sample=200, samples=50)


# ---- gemm_multiply_leaky_relu -----------------------------------------------------------------------------------

# A variant that keeps no split of its weight (FusedLinear.cache_weight_split off): each call splits the weight anew,
# as the first call after a change of the weight does, and every forward that trains it. The variants beside it
# keep the split from their second call on, as a model evaluated with an unchanged weight does.
ANEW = "weight split anew"


def weight_split_anew(model):
    """A copy of `model` whose calls split its weight anew (ANEW)."""
    anew = copy.deepcopy(model)
    anew.gemm.cache_weight_split = False
    return anew


class ForcedPath:
    """model(x) with every gemm_multiply_leaky_relu call on one path ("cublas" or one of FAST_FP32_PATHS)."""

    def __init__(self, model, path):
        self.model, self.path = model, path
        self.gemm = model.gemm

    def __call__(self, x):
        with forced_gemm_path(self.path):
            return self.model(x)

    def gradients(self, y, inputs, grad):
        """torch.autograd.grad on the same path (the backward's products choose their path when they run)."""
        with forced_gemm_path(self.path):
            return torch.autograd.grad(y, inputs, grad)


def triton_tf32x3_peer(model):
    """The peer a user could write in Triton: tl.dot(input_precision="tf32x3") with the same fused epilogue.
    Returns None (with a note) where Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        progress("triton is not installed: the Triton tf32x3 row is skipped")
        return None

    @triton.jit
    def kernel(x_ptr, w_ptr, b_ptr, y_ptr, m, n, k, multiplier, slope,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + rows[:, None] * k + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < k),
                        other=0.0)
            b = tl.load(w_ptr + cols[None, :] * k + ks[:, None], mask=(cols[None, :] < n) & (ks[:, None] < k),
                        other=0.0)
            acc = tl.dot(a, b, acc, input_precision="tf32x3")
        acc = (acc + tl.load(b_ptr + cols, mask=cols < n, other=0.0)[None, :]) * multiplier
        acc = tl.where(acc > 0, acc, acc * slope)
        tl.store(y_ptr + rows[:, None] * n + cols[None, :], acc, mask=(rows[:, None] < m) & (cols[None, :] < n))

    weight, bias = model.gemm.weight.detach(), model.gemm.bias.detach()

    def forward(x):
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty(m, n, device=x.device, dtype=torch.float32)
        grid = (triton.cdiv(m, 128), triton.cdiv(n, 128))
        kernel[grid](x, weight, bias, y, m, n, k, model.multiplier, model.leaky_relu.negative_slope,
                     BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=3)
        return y

    return forward


def gemm_ceiling_and_rate(label, flops, cublas_ms, cublas16_ms):
    """ceiling(variant) and rate_of(variant) for a GEMM forward row in precision `label`. A variant on a split path
    (named "... (split_fp16)" or "..., split_fp16 path") does three fp16 products: its rate and ceiling count those."""
    def is_split(variant):
        return any(f"({p})" in variant or f", {p} path" in variant for p in SPLIT_PATHS)

    def ceiling(variant):
        return ("cuBLAS fp16 x3", 3 * cublas16_ms) if is_split(variant) else (f"cuBLAS {label}", cublas_ms)

    def rate_of(variant):
        return (3 if is_split(variant) else 1) * flops / 1e9

    return ceiling, rate_of


def bench_gemm_multiply_leaky_relu(rows, options):
    m, k, n = options.sizes((reference.GEMM_BATCH_SIZE, reference.GEMM_IN_FEATURES, reference.GEMM_OUT_FEATURES))
    problem = "gemm_multiply_leaky_relu"
    init = [k, n, reference.GEMM_MULTIPLIER, reference.GEMM_NEGATIVE_SLOPE]
    torch.manual_seed(0)
    eager32 = reference.GemmMultiplyLeakyReLUModel(*init).to(DEVICE)
    torch.manual_seed(0)
    new32 = MODEL_NEW[problem](*init).to(DEVICE)
    x32 = torch.randn(m, k, device=DEVICE)
    flops = 2 * m * n * k
    with torch.no_grad():
        y64 = copy.deepcopy(eager32).double()(x32.double())
        y_eager32 = eager32(x32)
    grad32 = torch.randn(m, n, device=DEVICE)

    settings = [("fp32", torch.float32, "highest"), ("tf32", torch.float32, "high"),
                ("bf16", torch.bfloat16, "highest")]
    for label, dtype, precision in settings:
        if not options.wants_dtype(label):
            continue
        with matmul_precision(precision):
            case = f"forward {label} {m}x{k}->{n}"
            progress(f"{problem}: {case}")
            eager, new = copy.deepcopy(eager32).to(dtype), copy.deepcopy(new32).to(dtype)
            x, grad = x32.to(dtype), grad32.to(dtype)
            weight_t = eager.gemm.weight.detach().t()
            weight16_t, x16 = weight_t.half(), x.half()
            path = gemm_path(x, new.gemm.weight)
            # The fast float32 paths this GPU runs besides the automatic choice's (on Hopper, forced: the sm_80
            # kernel, what an A100 would run, at a lower bound of its speed; cuBLAS's FP32 emulation, Blackwell's path,
            # which cuBLAS computes as it chooses on this GPU).
            other_fast_paths = ([p for p in gemm_paths(DEVICE) if p in FAST_FP32_PATHS and p != path]
                                if label == "fp32" else [])
            with torch.no_grad():
                variants = {"eager": eager}
                if label == "fp32" and HAS_CUDA:
                    if options.wants("torch.compile"):
                        progress(f"{problem}: compiling with torch.compile")
                        variants["torch.compile"] = compiled(eager)
                    if options.wants("compile max-autotune") and not options.quick:
                        progress(f"{problem}: compiling with torch.compile max-autotune (its autotuning takes a "
                                 "minute or two)")
                        variants["compile max-autotune"] = compiled(eager, "max-autotune-no-cudagraphs")
                    if options.wants("triton tf32x3"):
                        peer = triton_tf32x3_peer(eager)
                        if peer is not None:
                            variants["triton tf32x3"] = peer
                if options.wants("ModelNew"):
                    # Each variant its own copy: a model keeps its weight's split for the path it last ran on.
                    if path != "cublas":
                        variants["ModelNew, cublas path"] = ForcedPath(copy.deepcopy(new), "cublas")
                    for other in other_fast_paths:
                        variants[f"ModelNew, {other} path"] = ForcedPath(copy.deepcopy(new), other)
                        if other in SPLIT_PATHS:
                            variants[f"ModelNew, {other} path, {ANEW}"] = ForcedPath(weight_split_anew(new), other)
                    variants[f"ModelNew ({path})"] = new
                    if path in SPLIT_PATHS:
                        variants[f"ModelNew ({path}), {ANEW}"] = weight_split_anew(new)
                (cublas_ms, cublas16_ms, *times), (_, _, *kb) = run_case(
                    [lambda: torch.mm(x, weight_t), lambda: torch.mm(x16, weight16_t)]
                    + [lambda model=model: model(x) for model in variants.values()], options)
                outputs = [model(x) for model in variants.values()]

            ceiling, rate_of = gemm_ceiling_and_rate(label, flops, cublas_ms, cublas16_ms)
            # float64 of this row's own inputs: the weights and x rounded to its dtype (the same as float32's for tf32).
            with torch.no_grad():
                row_y64 = y64 if dtype == torch.float32 else copy.deepcopy(eager).double()(x.double())
            add_rows(rows, Case(problem, case, label, list(variants), times, kb, outputs),
                     Rate(rate_of, "TFLOP/s", ceiling), Reference(row_y64, y_eager32))

            # Training step: forward and the grads of x, weight and bias.
            case = f"train step {label} {m}x{k}->{n}"
            progress(f"{problem}: {case}")
            x_train = x.clone().requires_grad_(True)
            variants = options.eager_and_new(eager, new)
            if options.wants("ModelNew"):
                for other in other_fast_paths:
                    variants[f"ModelNew, {other} path"] = ForcedPath(new, other)

            def train_step(model):
                inputs = [x_train, model.gemm.weight, model.gemm.bias]
                if isinstance(model, ForcedPath):
                    return model.gradients(model(x_train), inputs, grad)
                return torch.autograd.grad(model(x_train), inputs, grad)

            times, kb = run_case([lambda model=model: train_step(model) for model in variants.values()], options)
            add_rows(rows, Case(problem, case, label, list(variants), times, kb, [None] * len(times)),
                     Rate(lambda v: 3 * flops / 1e9, "TFLOP/s", "-"))
            if label == "fp32":
                add_training_loop_rows(rows, problem, eager, new, x, options)

    # Mixed precision: the float32 models and input under torch.autocast, as mixed-precision training runs them (the
    # casts of x and the weights are part of each call, eager's and ours).
    if not options.wants_dtype("autocast"):
        return
    for label, dtype in (("autocast bf16", torch.bfloat16), ("autocast fp16", torch.float16)):
        case = f"forward {label} {m}x{k}->{n}"
        progress(f"{problem}: {case}")
        variants = options.eager_and_new(eager32, new32)
        x_low, weight_low_t = x32.to(dtype), eager32.gemm.weight.detach().t().to(dtype)

        def autocast_call(model, x=x32, dtype=dtype):
            with torch.autocast("cuda", dtype=dtype):
                return model(x)

        with torch.no_grad():
            (ceiling_ms, *times), (_, *kb) = run_case(
                [lambda: torch.mm(x_low, weight_low_t)] + [lambda model=model: autocast_call(model)
                                                           for model in variants.values()], options)
            outputs = [autocast_call(model) for model in variants.values()]
        add_rows(rows, Case(problem, case, label, list(variants), times, kb, outputs),
                 Rate(lambda v: flops / 1e9, "TFLOP/s", f"cuBLAS {label[-4:]}", ceiling_ms), Reference(y64, y_eager32))

        case = f"train step {label} {m}x{k}->{n}"
        progress(f"{problem}: {case}")
        x_train = x32.clone().requires_grad_(True)

        def train_step(model, dtype=dtype):
            with torch.autocast("cuda", dtype=dtype):
                y = model(x_train)
            return torch.autograd.grad(y, [x_train, model.gemm.weight, model.gemm.bias], grad32.to(y.dtype))

        times, kb = run_case([lambda model=model: train_step(model) for model in variants.values()], options)
        add_rows(rows, Case(problem, case, label, list(variants), times, kb, [None] * len(times)),
                 Rate(lambda v: 3 * flops / 1e9, "TFLOP/s", "-"))


def training_loop_step(model, x):
    """One step as a training loop runs it: zero_grad(set_to_none=True), x's gradient cleared, the forward,
    y.square().mean(), backward()."""
    model.zero_grad(set_to_none=True)
    x.grad = None
    model(x).square().mean().backward()


def add_training_loop_rows(rows, problem, eager, new, x, options):
    """A step as a training loop runs it: zero_grad(set_to_none=True), the forward, y.square().mean(), backward().
    With x requiring grad (a layer inside a network: grad_x, grad_W, grad_b) and without (a first layer: no grad_x).
    Unlike the "train step" rows (torch.autograd.grad with a given grad_y), these include the loss, its backward and
    the accumulation into .grad."""
    m, k = x.shape
    n = eager.gemm.weight.shape[0]
    variants = options.eager_and_new(eager, new)
    for case, needs_grad in ((f"train loop fp32 {m}x{k}->{n}", True),
                             (f"train loop, first layer, fp32 {m}x{k}->{n}", False)):
        progress(f"{problem}: {case}")
        x_in = x.detach().clone().requires_grad_(needs_grad)
        times, kb = run_case([lambda model=model: training_loop_step(model, x_in) for model in variants.values()],
                             options)
        products = 3 if needs_grad else 2
        add_rows(rows, Case(problem, case, "fp32", list(variants), times, kb, [None] * len(times)),
                 Rate(lambda v, products=products: products * 2 * m * n * k / 1e9, "TFLOP/s", "-"))


# The split path away from the problem's shape: the shapes issue 22 names, as a user's model would bring them (the
# automatic choice, float32 at the default precision).
SPLIT_SHAPES = ((1024, 8192, 8192), (8192, 8192, 8192), (4096, 4096, 4096), (16384, 4096, 1024),
                (8192, 1024, 8192), (1024, 1024, 1024), (512, 8192, 8192), (256, 8192, 8192))


def bench_gemm_shapes(rows, options):
    """The fp32 forward over SPLIT_SHAPES (M x K -> N): eager against ModelNew on the path the automatic choice takes
    (named in the variant), the error against float64 beside eager's, % of three cuBLAS fp16 products on a split
    path."""
    problem = "gemm_multiply_leaky_relu shapes"
    for m, k, n in SPLIT_SHAPES:
        case = f"forward fp32 {m}x{k}->{n}"
        progress(f"{problem}: {case}")
        init = [k, n, reference.GEMM_MULTIPLIER, reference.GEMM_NEGATIVE_SLOPE]
        torch.manual_seed(0)
        eager = reference.GemmMultiplyLeakyReLUModel(*init).to(DEVICE)
        new = MODEL_NEW["gemm_multiply_leaky_relu"](*init).to(DEVICE)
        new.load_state_dict(eager.state_dict())
        x = torch.randn(m, k, device=DEVICE)
        weight_t = eager.gemm.weight.detach().t()
        weight16_t, x16 = weight_t.half(), x.half()
        path = gemm_path(x, new.gemm.weight)
        variants = {"eager": eager, f"ModelNew ({path})": new}
        if path in SPLIT_PATHS:
            variants[f"ModelNew ({path}), {ANEW}"] = weight_split_anew(new)
        with torch.no_grad():
            (cublas_ms, cublas16_ms, *times), (_, _, *kb) = run_case(
                [lambda: torch.mm(x, weight_t), lambda: torch.mm(x16, weight16_t)]
                + [lambda model=model: model(x) for model in variants.values()], options)
            outputs = [model(x) for model in variants.values()]
            y64 = copy.deepcopy(eager).double()(x.double())

        ceiling, rate_of = gemm_ceiling_and_rate("fp32", 2 * m * n * k, cublas_ms, cublas16_ms)
        add_rows(rows, Case(problem, case, "fp32", list(variants), times, kb, outputs),
                 Rate(rate_of, "TFLOP/s", ceiling), Reference(y64, outputs[0]))
        del eager, new, x, outputs, y64


# ---- attention: F.scaled_dot_product_attention against kernels.attention ---------------------------------------

# (batch, heads, rows, head dim, causal): the models' attention (BERT-large, ViT-B/16, GPT-2-medium, LLaMA-style)
# and a long causal sequence.
ATTENTION_SHAPES = ((16, 16, 512, 64, False), (64, 12, 197, 64, False), (8, 16, 512, 64, True),
                    (2, 16, 4096, 64, True), (8, 16, 512, 128, True))


def bench_attention(rows, options):
    """fp32 attention without a mask or dropout: eager's F.scaled_dot_product_attention (PyTorch's memory-efficient
    kernel) against kernels.attention (the split kernels), errors against float64; kernels.fp32_gemm routes the
    shapes where the variant is faster (kernels/attention/NOTES.md)."""
    import math

    from kernels.attention.attention import _reference
    from kernels.functional import attention

    problem = "attention (fp32)"
    for batch, heads, length, dim, causal in ATTENTION_SHAPES:
        case = f"{batch}x{heads}x{length}x{dim}{' causal' if causal else ''}"
        progress(f"{problem}: {case}")
        g = torch.Generator(device=DEVICE).manual_seed(0)
        q, k, v = (torch.randn(batch, heads, length, dim, device=DEVICE, generator=g) for _ in range(3))
        variants = {"eager": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
                    "kernels.attention": lambda: attention(q, k, v, causal)}
        with torch.no_grad():
            times, kb = run_case(list(variants.values()), options)
            outputs = [fn() for fn in variants.values()]
            y64 = _reference(q.double(), k.double(), v.double(), causal, 1.0 / math.sqrt(dim))
        flops = 4 * batch * heads * length * length * dim / (2 if causal else 1)
        add_rows(rows, Case(problem, case, "fp32", list(variants), times, kb, outputs),
                 Rate(lambda variant: flops / 1e9, "TFLOP/s"), Reference(y64, outputs[0]))
        del q, k, v, outputs, y64


# ---- RMSNorm: transformers' LlamaRMSNorm, eager against kernels.patch ------------------------------------------------

# (rows, width): the LLaMA-style model's 8 x 512 tokens of 2048, and 2 x 2048 tokens of a 4096-wide model.
RMS_NORM_SHAPES = ((4096, 2048), (4096, 4096))


def add_forward_and_training_rows(rows, options, problem, size, variants, y64, forward_bytes, training_bytes):
    """The rows of one size of a memory-bound layer: its no_grad forward (against float64's y64, and eager's for the
    fp32 tolerance) and a training step's forward and backward. variants: name -> (forward call, training-step call),
    eager first; rates over the bytes each must move."""
    names = list(variants)
    for case, train in ((f"forward {size}", False), (f"train step {size}", True)):
        progress(f"{problem}: {case}")
        if train:
            times, kb = run_case([calls[1] for calls in variants.values()], options, kernelbench=False)
            outputs, reference = [None] * len(names), Reference()
        else:
            with torch.no_grad():
                forwards = [calls[0] for calls in variants.values()]
                times, kb = run_case(forwards, options)
                outputs = [forward() for forward in forwards]
            reference = Reference(y64, outputs[0])
        moved = training_bytes if train else forward_bytes
        add_rows(rows, Case(problem, case, "fp32", names, times, kb, outputs),
                 Rate(lambda variant, moved=moved: moved / 1e6, "GB/s"), reference)


def bench_rms_norm(rows, options):
    """fp32 LlamaRMSNorm: eager (five element-wise ops forward, more backward) against kernels.patch (rms_norm: one
    pass each way), the no_grad forward and a training step's forward and backward (grad_x and grad_weight), rates
    over the bytes each must move (forward x and y; training x twice, y, grad_y and grad_x); errors against the
    formula in float64 (the module itself computes in float32)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    import kernels

    for tokens, width in RMS_NORM_SHAPES:
        torch.manual_seed(0)
        eager = LlamaRMSNorm(width, eps=1e-6).to(DEVICE)
        with torch.no_grad():
            eager.weight.normal_(1.0, 0.5)
        patched = kernels.patch(copy.deepcopy(eager))
        g = torch.Generator(device=DEVICE).manual_seed(0)
        x = torch.randn(tokens, width, device=DEVICE, generator=g)
        x_grad = x.clone().requires_grad_(True)
        grad = torch.randn(tokens, width, device=DEVICE, generator=g)
        x64, weight64 = x.double(), eager.weight.detach().double()
        y64 = weight64 * (x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6))
        variants = {name: (lambda norm=norm: norm(x),
                           lambda norm=norm: torch.autograd.grad(norm(x_grad), (x_grad, norm.weight), grad))
                    for name, norm in (("eager", eager), ("kernels.patch", patched))}
        add_forward_and_training_rows(rows, options, "LlamaRMSNorm (fp32)", f"{tokens}x{width}", variants, y64,
                                      2 * x.nbytes, 5 * x.nbytes)
        del eager, patched, x, x_grad, grad, x64, y64, variants
        torch.cuda.empty_cache()


# ---- nn.LayerNorm: eager's F.layer_norm against kernels.layer_norm ---------------------------------------------------

# (rows, width): ViT-B/16's 64 x 197 tokens of 768, and the BERT-large-style model's 16 x 512 tokens of 1024.
LAYER_NORM_SHAPES = ((12608, 768), (8192, 1024))


def bench_layer_norm(rows, options):
    """fp32 nn.LayerNorm: eager (F.layer_norm: one kernel forward, two backward) against kernels.patch (layer_norm: one
    pass each way), the no_grad forward and a training step's forward and backward (grad_x, grad_weight, grad_bias),
    rates over the bytes each must move (forward x and y; training x twice, y, grad_y and grad_x); errors against
    float64."""
    import kernels

    for tokens, width in LAYER_NORM_SHAPES:
        torch.manual_seed(0)
        eager = torch.nn.LayerNorm(width, eps=1e-6).to(DEVICE)
        with torch.no_grad():
            eager.weight.normal_(1.0, 0.5)
            eager.bias.normal_(0.0, 0.5)
        patched = kernels.patch(copy.deepcopy(eager))
        g = torch.Generator(device=DEVICE).manual_seed(0)
        x = torch.randn(tokens, width, device=DEVICE, generator=g) + 0.5
        x_grad = x.clone().requires_grad_(True)
        grad = torch.randn(tokens, width, device=DEVICE, generator=g)
        y64 = copy.deepcopy(eager).double()(x.double())
        variants = {name: (lambda norm=norm: norm(x),
                           lambda norm=norm: torch.autograd.grad(norm(x_grad), (x_grad, norm.weight, norm.bias), grad))
                    for name, norm in (("eager", eager), ("kernels.patch", patched))}
        add_forward_and_training_rows(rows, options, "LayerNorm (fp32)", f"{tokens}x{width}", variants, y64,
                                      2 * x.nbytes, 5 * x.nbytes)
        del eager, patched, x, x_grad, grad, y64, variants
        torch.cuda.empty_cache()


# ---- the SwiGLU gate: LLaMA's MLP activation, eager's F.silu(gate) * up against kernels.silu_mul --------------------

# (rows, intermediate width): the LLaMA-style model's 8 x 512 tokens of 5632, and 8192 tokens of a 14336-wide MLP.
SILU_MUL_SHAPES = ((4096, 5632), (8192, 14336))


def bench_silu_mul(rows, options):
    """fp32 silu(gate) * up (LlamaMLP's act_fn(gate_proj(x)) * up_proj(x)): eager's two kernels (and the activation's
    output kept for the backward) against kernels.silu_mul (one sweep each way, what kernels.patch runs in a LlamaMLP),
    the no_grad forward and a training step's forward and backward, rates over the bytes each must move (forward gate,
    up and y; training those and grad_y, grad_gate, grad_up, gate and up again); errors against float64."""
    import torch.nn.functional as F

    from kernels.functional import silu_mul

    for tokens, width in SILU_MUL_SHAPES:
        g = torch.Generator(device=DEVICE).manual_seed(0)
        gate, up, grad = (torch.randn(tokens, width, device=DEVICE, generator=g) * 2 for _ in range(3))
        leaves = [t.clone().requires_grad_(True) for t in (gate, up)]
        variants = {name: (lambda fn=fn: fn(gate, up), lambda fn=fn: torch.autograd.grad(fn(*leaves), leaves, grad))
                    for name, fn in (("eager", lambda a, b: F.silu(a) * b), ("kernels.silu_mul", silu_mul))}
        add_forward_and_training_rows(rows, options, "SwiGLU gate silu(gate) * up (fp32)", f"{tokens}x{width}",
                                      variants, F.silu(gate.double()) * up.double(), 3 * gate.nbytes, 8 * gate.nbytes)
        del gate, up, grad, leaves, variants
        torch.cuda.empty_cache()


# ---- the rotary embedding: LLaMA's attention, eager's q * cos + rotate_half(q) * sin against kernels.rotary ---------

# (batch, q heads, kv heads, tokens, head dim): the LLaMA-style model's 8 x 512 tokens of 16 heads of 128, and grouped
# kv heads at 4 x 2048 tokens (32 heads, 8 kv heads).
ROTARY_SHAPES = ((8, 16, 16, 512, 128), (4, 32, 8, 2048, 128))


def bench_rotary(rows, options):
    """fp32 rotary embedding of q and k (transformers' apply_rotary_pos_emb, q and k the projections' outputs viewed
    as heads): eager's element-wise kernels (five a tensor each way) against kernels.rotary_embedding (one sweep over
    both each way, what kernels.patch runs in LLaMA-style attention), the no_grad forward and a training step's forward
    and backward, rates over the bytes each must move (forward q and k read and written; training those and their
    gradients); errors of q's rotation against float64."""
    from kernels.functional import rotary_embedding

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def eager(q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    for batch, q_heads, kv_heads, tokens, dim in ROTARY_SHAPES:
        g = torch.Generator(device=DEVICE).manual_seed(0)
        q = torch.randn(batch, tokens, q_heads, dim, device=DEVICE, generator=g).transpose(1, 2)
        k = torch.randn(batch, tokens, kv_heads, dim, device=DEVICE, generator=g).transpose(1, 2)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, device=DEVICE, dtype=torch.float64) / dim)
        angles = torch.arange(tokens, device=DEVICE, dtype=torch.float64)[:, None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1).expand(batch, tokens, dim)
        cos, sin = angles.cos().float(), angles.sin().float()
        grads = [torch.randn(t.shape, device=DEVICE, generator=g) for t in (q, k)]
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k)]
        variants = {name: (lambda fn=fn: fn(q, k, cos, sin)[0],
                           lambda fn=fn: torch.autograd.grad(fn(*leaves, cos, sin), leaves, grads))
                    for name, fn in (("eager", eager), ("kernels.rotary_embedding", rotary_embedding))}
        y64 = eager(q.double(), k.double(), cos.double(), sin.double())[0]
        moved = 2 * (q.nbytes + k.nbytes)
        add_forward_and_training_rows(rows, options, "rotary embedding of q and k (fp32)",
                                      f"{batch}x{q_heads}/{kv_heads}x{tokens}x{dim}", variants, y64, moved, 2 * moved)
        del q, k, cos, sin, grads, leaves, variants, y64
        torch.cuda.empty_cache()


# (batch, tokens, width, heads): nn.MultiheadAttention at torchvision's ViT-B/16 and at a BERT-large-style width.
MULTIHEAD_ATTENTION_SHAPES = ((64, 197, 768, 12), (16, 512, 1024, 16))


def bench_multihead_attention(rows, options):
    """nn.MultiheadAttention (batch_first, self-attention) in fp32: eager against kernels.patch (its projections on the
    library's GEMM where a split takes them), the no_grad forward without and with the attention weights and a
    training step's forward and backward; errors of the forward against the layer in float64."""
    import kernels

    problem = "nn.MultiheadAttention (fp32)"
    for batch, tokens, width, heads in MULTIHEAD_ATTENTION_SHAPES:
        torch.manual_seed(0)
        eager = torch.nn.MultiheadAttention(width, heads, batch_first=True).to(DEVICE)
        patched = kernels.patch(copy.deepcopy(eager))
        layer64 = copy.deepcopy(eager).double()
        g = torch.Generator(device=DEVICE).manual_seed(0)
        x = torch.randn(batch, tokens, width, device=DEVICE, generator=g)
        x_grad = x.clone().requires_grad_(True)
        grad = torch.randn(batch, tokens, width, device=DEVICE, generator=g)
        x64 = x.double()
        for case, need_weights, train in ((f"forward {batch}x{tokens}x{width}, {heads} heads", False, False),
                                          (f"forward with weights {batch}x{tokens}x{width}", True, False),
                                          (f"train step {batch}x{tokens}x{width}", False, True)):
            progress(f"{problem}: {case}")
            for layer in (eager, patched):
                layer.train(train)
            if train:
                fns = [lambda layer=layer: layer(x_grad, x_grad, x_grad, need_weights=False)[0].backward(grad)
                       for layer in (eager, patched)]
                times, kb = run_case(fns, options, kernelbench=False)
                outputs, y64 = [None, None], None
            else:
                with torch.no_grad():
                    fns = [lambda layer=layer: layer(x, x, x, need_weights=need_weights)[0]
                           for layer in (eager, patched)]
                    times, kb = run_case(fns, options)
                    outputs = [fn() for fn in fns]
                    y64 = layer64.eval()(x64, x64, x64, need_weights=need_weights)[0]
            # the four projections and the two products of attention; a training step's backward twice that
            flops = (8 * batch * tokens * width * width + 4 * batch * tokens * tokens * width) * (3 if train else 1)
            add_rows(rows, Case(problem, case, "fp32", ["eager", "kernels.patch"], times, kb, outputs),
                     Rate(lambda variant, flops=flops: flops / 1e9, "TFLOP/s"), Reference(y64, outputs[0]))
        del eager, patched, layer64, x, x_grad, grad, x64
        torch.cuda.empty_cache()


# ---- whole models: any fp32 model patched with kernels.patch ----------------------------------------------------

def _model_specs():
    """Real architectures built from config with random weights (no download), at bench sizes: name -> (build,
    inputs, loss). build() gives the model on the GPU; inputs(generator) a batch; loss(model, batch) a scalar."""
    import transformers

    def lm_batch(vocab, batch, tokens):
        return lambda g: torch.randint(0, vocab, (batch, tokens), device=DEVICE, generator=g)

    def lm_loss(model, ids):
        logits = model(input_ids=ids).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    def logits(model, ids):
        return model(input_ids=ids).logits

    def llama():
        config = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                                          num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                                          attention_dropout=0.0)
        return transformers.LlamaForCausalLM(config)

    def bert():
        config = transformers.BertConfig(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                                         intermediate_size=4096, vocab_size=30522, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)
        return transformers.BertForMaskedLM(config)

    def gpt2():
        config = transformers.GPT2Config(n_embd=1024, n_layer=4, n_head=16, vocab_size=50257, n_positions=1024,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)

    def vit():
        import timm

        return timm.create_model("vit_base_patch16_224", pretrained=False)

    def images(g):
        return torch.randn(64, 3, 224, 224, device=DEVICE, generator=g)

    def image_loss(model, x):
        return model(x).float().logsumexp(-1).mean()

    def image_logits(model, x):
        return model(x)

    return {
        "LLaMA-style 4 layers, hidden 2048, 8x512 tokens": (llama, lm_batch(32000, 8, 512), lm_loss, logits),
        "BERT-large-style 4 layers + MLM head, 16x512": (bert, lm_batch(30522, 16, 512), lm_loss, logits),
        "ViT-B/16 (timm), batch 64": (vit, images, image_loss, image_logits),
        "GPT-2-medium-style 4 layers, tied head, 8x512": (gpt2, lm_batch(50257, 8, 512), lm_loss, logits),
    }


MODEL_VARIANTS = ("eager", "TF32", "patched")


def _has_model_zoo():
    """Whether transformers and timm, which the models bench builds its architectures with, are installed."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("transformers", "timm"))
DRIFT_STEPS = 20


def _variant_context(variant):
    return matmul_precision("high" if variant == "TF32" else "highest")


def _train_losses(model, loss, batches, variant):
    """The losses of len(batches) AdamW steps from the model's current weights (the model is trained in place)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    with _variant_context(variant):
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            value = loss(model, batch)
            value.backward()
            optimizer.step()
            losses.append(value.item())
    return losses


def bench_models(rows, options):
    """Each model of _model_specs in fp32: eager, eager with TF32 allowed, and patched (kernels.patch): the AdamW
    training step and the no_grad forward (medians), the logits' error against a float64 copy, and the loss drift
    over DRIFT_STEPS AdamW steps against a float64 run and against eager fp32."""
    import kernels

    problem = "models (fp32, AdamW)"
    for name, (build, inputs, loss, logits) in options.model_specs().items():
        progress(f"{problem}: {name}")
        torch.manual_seed(0)
        initial = build().to(DEVICE).train()
        g = torch.Generator(device=DEVICE).manual_seed(0)
        batch = inputs(g)
        batches = [inputs(g) for _ in range(DRIFT_STEPS)]
        # float64: the logits' reference and the drift's
        model64 = copy.deepcopy(initial).double()

        def in_float64(b):
            return b.double() if b.is_floating_point() else b

        with torch.no_grad():
            reference_logits = logits(model64, in_float64(batch)).double()
        losses64 = _train_losses(model64, loss, [in_float64(b) for b in batches], "eager")
        del model64
        figures = {}
        for variant in MODEL_VARIANTS:
            model = copy.deepcopy(initial)
            if variant == "patched":
                kernels.patch(model)
            with torch.no_grad(), _variant_context(variant):
                error = relative_error(logits(model, batch).double(), reference_logits)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step(model=model, optimizer=optimizer, variant=variant):
                with _variant_context(variant):
                    optimizer.zero_grad(set_to_none=True)
                    loss(model, batch).backward()
                    optimizer.step()

            def forward(model=model, variant=variant):
                with torch.no_grad(), _variant_context(variant):
                    logits(model, batch)

            train_ms = time_ms(step, samples=options.samples // 2, warmup=3, flush_l2=False)
            forward_ms = time_ms(forward, samples=options.samples // 2, warmup=3, flush_l2=False)
            del optimizer
            model.load_state_dict(initial.state_dict())
            losses = _train_losses(model, loss, batches, variant)
            figures[variant] = dict(train_ms=train_ms, forward_ms=forward_ms, error=error, losses=losses)
            del model
            torch.cuda.empty_cache()
        eager = figures["eager"]
        for variant, f in figures.items():
            rows.append(dict(
                problem=problem, case=name, variant=variant, precision="tf32" if variant == "TF32" else "fp32",
                ms=f["train_ms"], kernelbench_ms=None, speedup=eager["train_ms"] / f["train_ms"], vs_compile=None,
                rate=None, unit="", ceiling="-", pct_of_ceiling=None, error=f["error"], verdict=None,
                forward_ms=f["forward_ms"], forward_speedup=eager["forward_ms"] / f["forward_ms"],
                drift64=max(abs(a - b) for a, b in zip(f["losses"], losses64)),
                drift_eager=max(abs(a - b) for a, b in zip(f["losses"], eager["losses"]))))
        del initial, batch, batches, reference_logits
        torch.cuda.empty_cache()


def _model_gemm_shapes(model, inputs):
    """The (rows, in_features, out_features) of every patched linear layer call (nn.Linear, transformers' Conv1D) and
    patchify convolution (one GEMM: a row per output position) of one forward of `model` (patched), in call order,
    each shape once; after a group's first projection, the one product a training call makes of the group's
    projections (kernels/patching.py's _ProjectionGroup; self-attention's, all of them reading the parent's input).
    Other patched modules (norms, MLPs, attention) are no GEMM of their own."""
    import kernels
    from kernels.patching import _Conv1DPatch, _PatchifyConv2dPatch

    shapes = {}
    # A group's first projection -> the output features of the group's one product while training.
    grouped = {}
    for parent in model.modules():
        group = parent.__dict__.get("_projection_group")
        if group is not None and group.fuses:
            layers = [parent._modules[name] for name in group.names]
            grouped[layers[0]] = sum(layer.weight.shape[0] for layer in layers)

    def record_linear(module, args, output):
        k = args[0].shape[-1]
        shapes[(args[0].numel() // k, k, output.shape[-1])] = None
        if module in grouped:
            shapes[(args[0].numel() // k, k, grouped[module])] = None

    def record_convolution(module, args, output):
        n = output.shape[1]
        shapes[(output.numel() // n, module.weight[0].numel(), n)] = None

    def recorder(module):
        if isinstance(module, (torch.nn.Linear, _Conv1DPatch)):
            return record_linear
        return record_convolution if isinstance(module, _PatchifyConv2dPatch) else None

    hooks = [m.register_forward_hook(recorder(m)) for m in model.modules() if kernels.is_patched(m) and recorder(m)]
    try:
        with torch.no_grad():
            model(**inputs) if isinstance(inputs, dict) else model(inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return list(shapes)


def bench_model_gemms(rows, options):
    """Every GEMM shape of the models table: the forward, grad_x's and grad_W's product, each on the path the library
    takes (named in the variant) against eager's product, with errors against float64. The forward is a patched
    model's layer call against nn.Linear's (kernels.nn.Linear and nn.Linear holding the same weight, no kept split),
    host work included. The library's backward products are its backward op's, but where a layer of the shape is all
    F.linear (plain_linear_suffices: FusedLinear's call and its backward are then eager's own), whose products are
    eager's calls: the op called from Python would charge them a host cost no model pays."""
    import kernels
    from kernels.gemm.gemm import plain_linear_suffices

    problem = "model GEMMs (fp32)"
    backward = torch.ops.kernels.gemm_multiply_leaky_relu_backward
    seen = set()
    for name, (build, inputs, _, _) in options.model_specs().items():
        torch.manual_seed(0)
        model = kernels.patch(build().to(DEVICE))
        batch = inputs(torch.Generator(device=DEVICE).manual_seed(0))
        shapes = [s for s in _model_gemm_shapes(model, {"input_ids": batch} if not batch.is_floating_point()
                                                else batch) if s not in seen]
        seen.update(shapes)
        del model
        for m, k, n in shapes:
            g = torch.Generator(device=DEVICE).manual_seed(m + k + n)
            x = torch.randn(m, k, device=DEVICE, generator=g)
            w = (torch.rand(n, k, device=DEVICE, generator=g) * 2 - 1) / k ** 0.5
            grad = torch.randn(m, n, device=DEVICE, generator=g)
            none = torch.empty(0, device=DEVICE)
            eager_grad_x, eager_grad_w = (lambda: grad @ w), (lambda: grad.t() @ x)
            all_eager = plain_linear_suffices(x, w.detach().requires_grad_(True))
            patched_layer = kernels.nn.Linear(k, n, bias=False, device="meta", cache_weight_split=False)
            eager_layer = torch.nn.Linear(k, n, bias=False, device="meta")
            patched_layer.weight = eager_layer.weight = torch.nn.Parameter(w)
            products = {
                "forward": (patched_layer, eager_layer, lambda: x.double() @ w.double().t(), gemm_path(x, w),
                            2 * m * n * k),
                "grad_x": (eager_grad_x if all_eager else
                           (lambda: backward(grad, x, w, none, 1.0, 1.0, True, False, False)[0]),
                           eager_grad_x, lambda: grad.double() @ w.double(), gemm_path(grad, w.t()), 2 * m * n * k),
                "grad_W": (eager_grad_w if all_eager else
                           (lambda: backward(grad, x, w, none, 1.0, 1.0, False, True, False)[1]),
                           eager_grad_w, lambda: grad.double().t() @ x.double(), gemm_path(grad.t(), x.t()),
                           2 * m * n * k),
            }
            for product, (ours, eager, exact, path, flops) in products.items():
                if product == "forward":
                    ours, eager = (lambda layer=ours: layer(x)), (lambda layer=eager: layer(x))
                case = f"{name.split(' ')[0]} {m}x{k}->{n} {product}"
                progress(f"{problem}: {case}")
                with torch.no_grad():
                    times, kb = run_case([eager, ours], options, kernelbench=False)
                    y64 = exact()
                    outputs = [eager(), ours()]
                # allclose's verdict for the forward only: a gradient's sum over thousands of rows carries eager's own
                # rounding at every element (kernels.precision.gradient_atol); the error column is the contract.
                add_rows(rows, Case(problem, case, "fp32", ["eager", f"library ({path})"], times, kb, outputs),
                         Rate(lambda v, flops=flops: flops / 1e9, "TFLOP/s", "-"),
                         Reference(y64, outputs[0] if product == "forward" else None))
                del y64, outputs
            del x, w, grad, patched_layer, eager_layer
            torch.cuda.empty_cache()


# The split sweeps of the models' products at bench sizes (sweep, rows x cols of the float32 matrix it reads, what
# it splits): _gemm_split_sweep's sweeps (gemm_products.cpp). Each reads 4 bytes an element and writes 4 (hi and
# lo), as a copy of the matrix does.
SPLIT_SWEEP_SHAPES = (
    ("rows", 4096, 2048, "x, LLaMA-style"), ("rows", 12608, 768, "x, ViT-B/16"),
    ("rows_natural", 4096, 1024, "x before a Conv1D, GPT-2-medium-style"),
    ("rows", 8192, 30522, "grad_y for grad_x, BERT-large-style vocabulary (unaligned rows)"),
    ("rows", 4096, 50257, "grad_y for grad_x, GPT-2-medium-style vocabulary (unaligned rows)"),
    ("rows", 4096, 32000, "grad_y for grad_x, LLaMA-style vocabulary"),
    ("chunks", 5632, 2048, "w, LLaMA-style MLP"), ("chunks", 32000, 2048, "w, LLaMA-style vocabulary"),
    ("chunks_natural", 8192, 8192, "w for split_fp16_sm80, L2/12"),
    ("chunks_transposed", 5632, 2048, "w^T for grad_x, LLaMA-style MLP"),
    ("chunks_transposed", 12608, 768, "x^T for grad_W, ViT-B/16"),
    ("columns", 4096, 5632, "grad_pre for grad_W, LLaMA-style MLP"),
    ("columns", 12608, 3072, "grad_pre for grad_W, ViT-B/16 MLP"),
    ("columns", 8192, 1024, "grad_pre for grad_W, BERT-large-style"),
    ("columns", 4096, 32000, "grad_pre for grad_W, LLaMA-style vocabulary"),
)


def _graph_replay(fn):
    """fn captured in a CUDA graph, as its replay: the GPU's time alone, without the host's per-call work (in a model
    the host runs ahead of these kernels; at the smaller sizes here it would not)."""
    fn()  # allocations and first-call work outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench_split_sweeps(rows, options):
    """Each split sweep of the split paths alone (torch.ops.kernels._gemm_split_sweep) against a copy of the same
    float32 matrix, both replayed from CUDA graphs: both read 4 bytes an element and write 4, so the % of ceiling
    column is the sweep's share of copy bandwidth."""
    import kernels.gemm.gemm  # noqa: F401  (loads the op library)

    problem = "split sweeps (fp32)"
    sweep_op = torch.ops.kernels._gemm_split_sweep
    for sweep, m, n, what in SPLIT_SWEEP_SHAPES:
        case = f"{sweep} {m}x{n} ({what})"
        progress(f"{problem}: {case}")
        src = torch.randn(m, n, device=DEVICE)
        out = torch.empty_like(src)
        variants = {"copy": lambda: out.copy_(src), "split sweep": lambda: sweep_op(src, sweep)}
        if sweep == "columns":  # beside the staged kernel, the one that reads each element twice
            variants["split sweep, read twice"] = lambda: sweep_op(src, "columns_read_twice")
        with torch.no_grad():
            times, _ = run_case([_graph_replay(fn) for fn in variants.values()], options, kernelbench=False)
        add_rows(rows, Case(problem, case, "fp32", list(variants), times, [None] * len(variants),
                            [None] * len(variants)),
                 Rate(lambda variant: 2 * src.nbytes / 1e6, "GB/s", "copy", times[0]))
        del src, out
        torch.cuda.empty_cache()


# Host-bound linear layers (KernelBench level 3's small transformers): nn.Linear against kernels.nn.Linear.
HOST_BOUND_LINEARS = ((394, 512, 512), (64, 1024, 1024))


def bench_linear_layers(rows, options):
    """nn.Linear against kernels.nn.Linear at host-bound sizes, called back to back (no L2 flush): the forward, and a
    training step's forward and backward. A second nn.Linear shows the spread between equal layers. All three share
    one weight and bias (as kernels.patch keeps a layer's Parameters), so only the call differs, not where the
    weight lies in memory."""
    import kernels

    problem = "host-bound linear layers (fp32)"
    for m, k, n in HOST_BOUND_LINEARS:
        torch.manual_seed(0)
        eager = torch.nn.Linear(k, n).to(DEVICE)
        twin = torch.nn.Linear(k, n).to(DEVICE)  # the same layer again: the spread between two equal layers
        ours = kernels.nn.Linear(k, n).to(DEVICE)
        for layer in (twin, ours):
            layer.weight, layer.bias = eager.weight, eager.bias
        x = torch.randn(m, k, device=DEVICE)
        x_grad = x.clone().requires_grad_(True)
        grad = torch.randn(m, n, device=DEVICE)
        y64 = torch.nn.functional.linear(x.double(), eager.weight.double(), eager.bias.double())
        for case, step in ((f"forward {m}x{k}->{n}", lambda layer: layer(x)),
                           (f"train step {m}x{k}->{n}", lambda layer: layer(x_grad).backward(grad))):
            progress(f"{problem}: {case}")
            layers = {"nn.Linear": eager, "nn.Linear, a second copy": twin, "kernels.nn.Linear": ours}
            # 200 samples: a host-bound call's time moves with the host's jitter, and these rows compare nearly equal
            # host work (kernels/gemm/NOTES.md, Open).
            times = time_each_ms([lambda layer=layer: step(layer) for layer in layers.values()], samples=200,
                                 calls_per_sample=50, flush_l2=False)
            with torch.no_grad():
                outputs = [layer(x) for layer in layers.values()]
            add_rows(rows, Case(problem, case, "fp32", list(layers), times, [None] * len(layers), outputs,
                                l2_flushed=False),
                     Rate(lambda v: 2 * m * n * k / 1e9, "TFLOP/s", "-"), Reference(y64, outputs[0]))


# ---- level 3: whole models, the harness's way ----------------------------------------------------------------------

KERNELBENCH_SEED = 42
KERNELBENCH_TRIALS = 5


def _tensors(output):
    """The tensors of a model's output (a tensor, or a tuple or list of them)."""
    return [output] if isinstance(output, torch.Tensor) else [t for t in output if isinstance(t, torch.Tensor)]


def _outputs_allclose(output, expected, tol=ALLCLOSE_TOLERANCE[torch.float32]):
    """The harness's check: torch.allclose on each output tensor, without equal_nan (kernels.precision.allclose, which
    takes NaN as equal, would pass what the harness fails)."""
    got, want = _tensors(output), _tensors(expected)
    return len(got) == len(want) and all(
        a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, atol=tol, rtol=tol)
        for a, b in zip(got, want))


def _flat(output):
    return torch.cat([t.detach().reshape(-1).double() for t in _tensors(output)])


def _on_device(inputs, dtype=None):
    return [t.to(DEVICE, dtype if dtype and t.is_floating_point() else t.dtype) if isinstance(t, torch.Tensor) else t
            for t in inputs]


def add_kernelbench_rows(rows, problem, case, build_model, build_new, get_inputs, get_init_inputs, options,
                         with_compile):
    """Model and ModelNew as KernelBench's harness judges them: both built on the CPU after the same seed and moved
    to the GPU; correct when every one of KERNELBENCH_TRIALS seeded draws of get_inputs() matches at 1e-4; timed
    under no_grad (medians, and the KB column: the harness's mean). Error against the Model built again after the
    same seed, in float64, on the timed inputs."""
    progress(f"{problem}: {case}")
    init = get_init_inputs()
    with torch.no_grad():
        torch.manual_seed(KERNELBENCH_SEED)
        model = build_model(init).to(DEVICE)
        torch.manual_seed(KERNELBENCH_SEED)
        new = build_new(init).to(DEVICE)
        correct = 0
        for trial in range(KERNELBENCH_TRIALS):
            torch.manual_seed(KERNELBENCH_SEED + trial)
            inputs = _on_device(get_inputs())
            correct += _outputs_allclose(new(*inputs), model(*inputs))
        variants = options.eager_and_new(model, new, with_compile=with_compile, label=f"{problem}: {case}")
        torch.manual_seed(KERNELBENCH_SEED)
        inputs = _on_device(get_inputs())
        times, kb = run_case([lambda m=m: m(*inputs) for m in variants.values()], options)
        outputs = [_flat(m(*inputs)) for m in variants.values()]
    names = list(variants)
    del variants, model, new
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    y64 = None
    try:  # a model may hold what float64 cannot run (an op without a float64 kernel): no error figure then
        with torch.no_grad():
            torch.manual_seed(KERNELBENCH_SEED)
            y64 = _flat(build_model(init).to(DEVICE).double()(*_on_device(inputs, torch.float64)))
    except (RuntimeError, TypeError) as e:
        progress(f"{problem}: {case}: no float64 reference ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
        outputs = [None] * len(outputs)
    torch.cuda.empty_cache()
    start = len(rows)
    add_rows(rows, Case(problem, case, "fp32", names, times, kb, outputs), reference=Reference(y64))
    for row in rows[start:]:
        row["rate"] = None
        if row["variant"] == "ModelNew":
            row["verdict"] = f"{correct}/{KERNELBENCH_TRIALS}"
    progress(f"{problem}: {case}: " + ", ".join(f"{r['variant']} {r['ms']:.3f} ms {r['speedup']:.3f}x" for r in rows[start:])
             + f", correct {correct}/{KERNELBENCH_TRIALS}")


def bench_level3_problem(name):
    """bench.py's rows for reference.py's level-3 problem `name`: eager, torch.compile and ModelNew."""
    def bench(rows, options):
        spec = reference.PROBLEMS[name]
        add_kernelbench_rows(rows, f"{name} ({spec.kernelbench}, fp32)", "forward, KernelBench inputs",
                             lambda init: spec.model(*init), lambda init: MODEL_NEW[name](*init), spec.get_inputs,
                             spec.get_init_inputs, options, with_compile=True)
    return bench


def bench_problem_files(rows, options, paths):
    """Each KernelBench problem file as the export makes its candidate (python -m kernels.export --problem): the
    file's Model against ModelNew, the Model after kernels.patch of the layers a split takes at get_inputs()'s shapes,
    its forward under fp32_gemm() where it makes functional products a split takes (kernels.export.problem_plan);
    eager and ModelNew (torch.compile only where asked for with --variant)."""
    import os

    from kernels.export import problem_files, problem_model_new, problem_plan

    for path in problem_files(paths):
        try:  # one problem that cannot be read, built or run leaves the others' rows
            namespace = {"__name__": "problem"}
            with open(path, encoding="utf-8") as f:
                exec(compile(f.read(), path, "exec"), namespace)
            model_class = namespace["Model"]
            plan = problem_plan(path, namespace)
            if plan.trial is not None:
                progress(f"{os.path.basename(path)}: {plan.trial}")
            model_new = problem_model_new(model_class, plan)  # the candidate's ModelNew
            add_kernelbench_rows(rows, "problem files (the Model patched: kernels.export --problem)",
                                 os.path.splitext(os.path.basename(path))[0], lambda init: model_class(*init),
                                 lambda init: model_new(*init), namespace["get_inputs"],
                                 namespace["get_init_inputs"], options,
                                 with_compile=options.variants is not None and "torch.compile" in options.variants)
        except Exception as e:  # noqa: BLE001
            progress(f"{path}: FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            rows.append(dict(problem="problem files (the Model patched: kernels.export --problem)",
                             case=os.path.splitext(os.path.basename(path))[0], variant="ModelNew", precision="fp32",
                             ms=float("nan"), kernelbench_ms=None, speedup=float("nan"), vs_compile=None, rate=None,
                             unit="", ceiling="-", pct_of_ceiling=None, error=None, verdict=type(e).__name__))
            torch.cuda.empty_cache()


# ---- CPU, every dtype, small sizes ------------------------------------------------------------------------------

CPU_DTYPES = (("fp32", torch.float32), ("fp64", torch.float64), ("fp16", torch.float16), ("bf16", torch.bfloat16))


def bench_leaky_relu_cpu(rows, options):
    """The CPU loops (forward, backward) in every dtype, and the per-call time of a small call."""
    rows_count, dim = options.sizes((256, 8192))
    slope = 0.01
    eager = reference.LeakyReLUModel(slope)
    new = MODEL_NEW["leaky_relu"](slope)
    problem = "leaky_relu, CPU"
    with torch.no_grad():
        for label, dtype in CPU_DTYPES:
            if not options.wants_dtype(label):
                continue
            case = f"forward {label} {rows_count}x{dim}"
            progress(f"{problem}: {case}")
            x = torch.randn(rows_count, dim).to(dtype)
            out = torch.empty_like(x)
            variants = options.eager_and_new(eager, new)
            (copy_ms, *times), (_, *kb) = run_case(
                [lambda: out.copy_(x)] + [lambda model=model: model(x) for model in variants.values()], options,
                cpu=True)
            add_rows(rows,
                     Case(problem, case, label, list(variants), times, kb, [model(x) for model in variants.values()]),
                     Rate(lambda v: 2 * x.nbytes / 1e6, "GB/s", "copy", copy_ms),
                     Reference(eager(x.double()), eager(x.float())))

            case = f"backward {label} {rows_count}x{dim}"
            progress(f"{problem}: {case}")
            grad = torch.randn_like(x)
            fns = {"eager": lambda: torch.ops.aten.leaky_relu_backward(grad, x, slope, False)}
            if options.wants("ModelNew"):
                fns["ModelNew"] = lambda: torch.ops.kernels.leaky_relu_backward(grad, x, slope, 1.0)
            (copy_ms, *times), (_, *kb) = run_case([lambda: out.copy_(x)] + list(fns.values()), options, cpu=True)
            g64 = torch.ops.aten.leaky_relu_backward(grad.double(), x.double(), slope, False)
            g32 = torch.ops.aten.leaky_relu_backward(grad.float(), x.float(), slope, False)
            add_rows(rows, Case(problem, case, label, list(fns), times, kb, [fn() for fn in fns.values()]),
                     Rate(lambda v: 3 * x.nbytes / 1e6, "GB/s", "copy", 1.5 * copy_ms), Reference(g64, g32))

    if options.wants_dtype("fp32"):
        # 4x the GPU rows' samples: a CPU call's time moves more from sample to sample (run_case).
        add_per_call_rows(rows, problem, eager, new, options, "cpu", calls_per_sample=20, samples=200)


def bench_gemm_multiply_leaky_relu_cpu(rows, options):
    """The GEMM family's CPU path, forward, in every dtype."""
    m, k, n = options.sizes((256, 512, 512))
    problem = "gemm_multiply_leaky_relu, CPU"
    init = [k, n, reference.GEMM_MULTIPLIER, reference.GEMM_NEGATIVE_SLOPE]
    torch.manual_seed(0)
    eager32 = reference.GemmMultiplyLeakyReLUModel(*init)
    torch.manual_seed(0)
    new32 = MODEL_NEW[problem.split(",")[0]](*init)
    x32 = torch.randn(m, k)
    with torch.no_grad():
        y64 = copy.deepcopy(eager32).double()(x32.double())
        y_eager32 = eager32(x32)
        for label, dtype in CPU_DTYPES:
            if not options.wants_dtype(label):
                continue
            case = f"forward {label} {m}x{k}->{n}"
            progress(f"{problem}: {case}")
            eager, new = copy.deepcopy(eager32).to(dtype), copy.deepcopy(new32).to(dtype)
            x = x32.to(dtype)
            weight_t = eager.gemm.weight.t()
            variants = options.eager_and_new(eager, new)
            (mm_ms, *times), (_, *kb) = run_case(
                [lambda: torch.mm(x, weight_t)] + [lambda model=model: model(x) for model in variants.values()],
                options, cpu=True)
            add_rows(rows,
                     Case(problem, case, label, list(variants), times, kb, [model(x) for model in variants.values()]),
                     Rate(lambda v: 2 * m * n * k / 1e6, "GFLOP/s", f"torch.mm {label}", mm_ms),
                     # float64 of this row's own inputs: the weights and x rounded to its dtype
                     Reference(y64 if dtype == torch.float32 else copy.deepcopy(eager).double()(x.double()),
                               y_eager32))


# ---- report -----------------------------------------------------------------------------------------------------

def fmt(value, spec):
    """value formatted by spec; "-" where there is no value."""
    return "-" if value is None else format(value, spec)


COLUMNS = [  # header, cell
    ("case", lambda r: r["case"]),
    ("variant", lambda r: r["variant"]),
    ("median ms", lambda r: f"{r['ms']:.4f}"),
    ("KB ms", lambda r: fmt(r["kernelbench_ms"], ".4f")),
    ("vs eager", lambda r: f"{r['speedup']:.3f}x"),
    ("vs compile", lambda r: fmt(r["vs_compile"], ".3f") + ("x" if r["vs_compile"] else "")),
    ("rate", lambda r: "-" if r["rate"] is None else f"{r['rate']:.1f} {r['unit']}"),
    ("% of ceiling", lambda r: f"{r['pct_of_ceiling']:.1f}% {r['ceiling']}" if r["pct_of_ceiling"] else "-"),
    ("error", lambda r: fmt(r["error"], ".2e")),
    ("fp32 tol", lambda r: fmt(r["verdict"], "")),
]
LEFT_ALIGNED = {"case", "variant", "% of ceiling", "model"}

# The models table's own columns (bench_models).
MODEL_COLUMNS = [
    ("model", lambda r: r["case"]),
    ("variant", lambda r: r["variant"]),
    ("train step ms", lambda r: f"{r['ms']:.2f}"),
    ("vs eager", lambda r: f"{r['speedup']:.3f}x"),
    ("no_grad forward ms", lambda r: f"{r['forward_ms']:.2f}"),
    ("vs eager ", lambda r: f"{r['forward_speedup']:.3f}x"),
    ("logits error", lambda r: fmt(r["error"], ".2e")),
    (f"loss drift vs float64", lambda r: f"{r['drift64']:.2e}"),
    ("vs eager fp32", lambda r: f"{r['drift_eager']:.2e}"),
]


def legend(rows):
    """The legend lines that apply to the rows printed."""
    gpu = [r for r in rows if not r["problem"].endswith(", CPU") and not r["problem"].startswith("models")]
    cpu = [r for r in rows if r["problem"].endswith(", CPU")]
    # (rows of a saved run from before these fields: flushed, and KernelBench's 100 calls)
    kb_calls = sorted({r.get("kernelbench_calls", 100) for r in rows if r["kernelbench_ms"] is not None})
    lines = []
    if any(r.get("l2_flushed", True) for r in gpu):
        lines.append("median ms: median of CUDA-event-timed calls, L2 flushed before each, samples of all variants "
                     "taken in turn, each round in a fresh order" + (
                         f"; KB ms: KernelBench's way (sync, L2 flush, events, mean of "
                         f"{' or '.join(map(str, kb_calls))} calls)." if kb_calls else "."))
    unflushed = sorted({r["problem"] for r in gpu if not r.get("l2_flushed", True)})
    if unflushed:
        lines.append(f"{', '.join(unflushed)}: the per-call and host-bound rows time samples of back-to-back calls, "
                     "no L2 flush, as a small layer runs in a model; no KB column.")
    if cpu:
        lines.append("CPU tables: wall-clock times of samples of back-to-back calls (about 1 ms a sample, "
                     f"{CPU_SAMPLES_FACTOR}x the samples of a GPU row), no L2 flush; KB ms: the mean of back-to-back "
                     "calls.")
    ceilings = sorted({r["ceiling"] for r in rows if r["pct_of_ceiling"]})
    if ceilings:
        kinds = dict.fromkeys(CEILINGS.get(c.split()[0] + (" x3" if c.endswith("x3") else ""), c) for c in ceilings)
        lines.append("% of ceiling: the row's rate over the ceiling's, measured in the same run (" + "; ".join(kinds)
                     + ").")
    if any(r["problem"].startswith("split sweeps") for r in rows):
        lines.append("split sweeps: each sweep and the copy beside it replayed from a CUDA graph (the GPU's time alone, "
                     "as in a model, where the host runs ahead); both read 4 bytes an element and write 4. The "
                     "columns' split sweep reads each element once where it can (staged in shared memory); read "
                     "twice: the kernel that reads it a second time from L2, for the matrices the other cannot take.")
    if any(r["problem"].startswith("models") for r in rows):
        lines.append(f"models: eager fp32, eager with TF32 allowed (float32 matmul precision \"high\"), and the model "
                     f"after kernels.patch(model); median times of back-to-back steps (no L2 flush); logits error "
                     f"against a float64 copy; loss drift: the largest difference of the losses over {DRIFT_STEPS} "
                     f"AdamW steps (lr 1e-4) from the same weights and batches, against the float64 run's and "
                     f"against eager fp32's.")
    if any(r["variant"] == "ModelNew" and "/" in str(r["verdict"] or "") for r in rows):
        lines.append(f"KernelBench rows (level 3, problem files): both models built on the CPU after seed "
                     f"{KERNELBENCH_SEED} and moved to the GPU, timed under no_grad on get_inputs()'s draw; fp32 tol: "
                     f"the trials of {KERNELBENCH_TRIALS} seeded draws of get_inputs() on which ModelNew matched the "
                     f"Model at atol = rtol = 1e-4 (the harness's check).")
    if any(r["error"] is not None for r in rows):
        lines.append("error: ||y - y64|| / ||y64|| against float64 on the same inputs; fp32 tol: allclose to eager "
                     "float32 at atol = rtol = 1e-4.")
    if any(r["variant"].endswith(ANEW) for r in rows):
        lines.append(f"ModelNew's forward rows: a model called again with its weight unchanged keeps the weight's "
                     f"split (FusedLinear, from its second call on; the results are the same bit for bit); the rows "
                     f"named \"{ANEW}\" keep none, as each first call after a change of the weight and every forward "
                     f"that trains the weight run.")
    failed = sorted({r["precision"] for r in rows if r["verdict"] == "FAIL"})
    if failed:
        lines.append(f"FAIL in the fp32 tol column ({', '.join(failed)} rows): those rows compute in a lower "
                     "precision than float32 by the user's choice (TF32 allowed, float16/bfloat16 inputs, autocast), "
                     "so they cannot meet float32's 1e-4 against eager float32; eager's own row fails alike. Their "
                     "contract is the error column: no more than 2x eager's in the same precision.")
    return lines


# What each kind of ceiling is (keyed by its name's first word, "x3" for the split paths' triple product).
CEILINGS = {
    "copy": "copy: a copy of the same bytes (device to device on a GPU)",
    "clone": "clone: a clone of the same tensor, per call",
    "cuBLAS": "cuBLAS: cuBLAS's GEMM in the row's precision",
    "cuBLAS x3": "cuBLAS fp16 x3: three cuBLAS fp16 products, for the split paths, whose rate counts their three "
                 "products",
    "torch.mm": "torch.mm: torch.mm in the row's dtype",
}


def tables_text(rows):
    """The tables, one per problem, each column as wide as its widest cell."""
    lines = []
    for problem in dict.fromkeys(r["problem"] for r in rows):
        columns = MODEL_COLUMNS if problem.startswith("models") else COLUMNS
        table = [[cell(r) for _, cell in columns] for r in rows if r["problem"] == problem]
        widths = [max(len(header), *(len(line[i]) for line in table)) for i, (header, _) in enumerate(columns)]

        def line(cells, columns=columns, widths=widths):
            return "| " + " | ".join(c.ljust(w) if h in LEFT_ALIGNED else c.rjust(w)
                                     for c, w, (h, _) in zip(cells, widths, columns)) + " |"

        lines += ["", problem, line([h for h, _ in columns]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        lines += [line(cells) for cells in table]
    return "\n".join(lines)


def print_table(rows):
    print(tables_text(rows))
    print()
    for text in legend(rows):
        print(text)


def write_markdown(rows, path, device, torch_version=torch.__version__, command="python bench.py"):
    """docs/bench.md: the run's tables as bench.py printed them, under a heading that names the machine, so that the
    published figures are always a run's own. From a saved run: write_markdown(run["rows"], path, run["device"],
    run["torch"]) with run the --json file's contents."""
    import datetime

    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# Bench: {device}, torch {torch_version}, {datetime.date.today().isoformat()}\n\n"
                f"Written by `{command}` (bench.py --markdown); the README's headline figures come from these rows.\n\n"
                "```\n" + tables_text(rows).strip("\n") + "\n```\n\n" + "\n\n".join(legend(rows)) + "\n")
    progress(f"tables written to {path}")


def plot_models(rows, path, device, torch_version=torch.__version__):
    """The models table as a chart: the training step's and the no_grad forward's speedup over eager fp32 (TF32 and
    patched), and the logits' error against float64 (eager, TF32, patched)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [r for r in rows if r["problem"].startswith("models")]
    names = list(dict.fromkeys(r["case"] for r in models))
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 0.9 * len(names) + 1.6), sharey=True)
    colors = {"eager": "#999999", "TF32": "#dd8452", "patched": "#4c72b0"}
    for i, (variant, key) in enumerate((("TF32", "speedup"), ("patched", "speedup"), ("TF32", "forward_speedup"),
                                        ("patched", "forward_speedup"))):
        values = [next(r[key] for r in models if r["case"] == n and r["variant"] == variant) for n in names]
        left.barh([y + 0.2 * i - 0.3 for y in range(len(names))], values, height=0.2, color=colors[variant],
                  alpha=1.0 if key == "speedup" else 0.55, label=f"{variant}, {'training step' if key == 'speedup' else 'no_grad forward'}")
    left.axvline(1.0, color="black", lw=0.8)
    left.set_yticks(range(len(names)), names, fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("speedup over eager fp32")
    left.legend(fontsize=7, loc="lower right")
    for i, variant in enumerate(MODEL_VARIANTS):
        values = [next(r["error"] for r in models if r["case"] == n and r["variant"] == variant) for n in names]
        right.barh([y + 0.25 * i - 0.25 for y in range(len(names))], values, height=0.25, color=colors[variant],
                   label=variant)
    right.set_xscale("log")
    right.set_xlabel("logits error vs float64 (lower is better)")
    right.legend(fontsize=7)
    fig.suptitle(f"kernels.patch(model), fp32 with AdamW: {device}, torch {torch_version}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    progress(f"chart written to {path}")


def plot(rows, path, device, torch_version=torch.__version__):
    """Speedup over eager (left) and error against float64 (right) per row; the ceiling marked on the left. From a
    saved run: plot(run["rows"], path, run["device"], run["torch"]) with run the --json file's contents."""
    try:
        import matplotlib
    except ImportError:
        sys.exit("bench.py --plot needs matplotlib, which is not installed: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if any(r["problem"].startswith("models") for r in rows):
        plot_models(rows, path.replace(".png", "") + "_models.png", device, torch_version)
        rows = [r for r in rows if not r["problem"].startswith("models")]
    shown = [r for r in rows if r["variant"] != "eager" or r["error"] is not None]
    labels = [f"{r['case']} | {r['variant']}" for r in shown]
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 0.32 * len(shown) + 1.6), sharey=True,
                                      gridspec_kw={"width_ratios": [3, 2]})
    ys = range(len(shown))
    colors = ["#4c72b0" if r["variant"].startswith("ModelNew") else "#999999" for r in shown]
    left.barh(ys, [r["speedup"] for r in shown], color=colors)
    for y, r in zip(ys, shown):
        if r["pct_of_ceiling"]:  # the speedup a version at the ceiling would have
            left.plot([r["speedup"] * 100 / r["pct_of_ceiling"]] * 2, [y - 0.4, y + 0.4], color="#c44e52", lw=2)
    left.axvline(1.0, color="black", lw=0.8)
    left.set_xlabel("speedup over eager PyTorch (red tick: the measured ceiling)")
    left.set_yticks(list(ys), labels, fontsize=7)
    left.invert_yaxis()
    errors = [r["error"] if r["error"] else float("nan") for r in shown]
    right.barh(ys, errors, color=colors)
    right.set_xscale("log")
    right.set_xlabel("error vs float64, ||y - y64|| / ||y64|| (fp32 rows: lower is better)")
    fig.suptitle(f"kernels bench: {device}, torch {torch_version}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    progress(f"chart written to {path}")


GPU_BENCHES = {"leaky_relu": bench_leaky_relu, "gemm_multiply_leaky_relu": bench_gemm_multiply_leaky_relu,
               "gemm_shapes": bench_gemm_shapes, "models": bench_models, "model_gemms": bench_model_gemms,
               "linear_layers": bench_linear_layers, "attention": bench_attention,
               "split_sweeps": bench_split_sweeps, "multihead_attention": bench_multihead_attention,
               "rms_norm": bench_rms_norm, "layer_norm": bench_layer_norm, "silu_mul": bench_silu_mul,
               "rotary": bench_rotary,
               **{name: bench_level3_problem(name) for name in ("mlp", "shallow_wide_mlp", "mini_gpt_block")}}
CPU_BENCHES = {"leaky_relu_cpu": bench_leaky_relu_cpu, "gemm_multiply_leaky_relu_cpu": bench_gemm_multiply_leaky_relu_cpu}
BENCHES = {**GPU_BENCHES, **CPU_BENCHES}
VARIANTS = ["eager", "torch.compile", "compile max-autotune", "triton tf32x3", "ModelNew"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problem", choices=sorted(BENCHES), action="append",
                        help="problem to run (repeatable; default: all, the GPU ones only where a GPU is visible)")
    parser.add_argument("--variant", choices=VARIANTS, action="append",
                        help="variant to run besides eager (repeatable; default: all)")
    parser.add_argument("--dtype", choices=["fp32", "tf32", "fp64", "fp16", "bf16", "autocast"], action="append",
                        help="precision to run (repeatable; default: all); autocast: the float32 GEMM under "
                        "torch.autocast, bf16 and fp16")
    parser.add_argument("--problem-file", metavar="PATH", action="append",
                        help="a KernelBench problem file, or a folder of them (repeatable): its Model against the Model "
                        "patched, as `python -m kernels.export --problem PATH` makes its candidate")
    parser.add_argument("--model", choices=["LLaMA", "BERT", "ViT", "GPT-2"], action="append",
                        help="the models and model_gemms problems' model to run (repeatable; default: all four)")
    parser.add_argument("--size", help="another shape for the chosen problem: RxC for leaky_relu, MxKxN for the GEMM")
    parser.add_argument("--quick", action="store_true", help="fewer samples, no max-autotune")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    parser.add_argument("--plot", metavar="PATH", help="also draw speedup and error per row into PATH (PNG; "
                        "needs matplotlib)")
    parser.add_argument("--markdown", metavar="PATH", help="also write the tables and legend into PATH (Markdown; "
                        "docs/bench.md is this file of the latest GPU run)")
    args = parser.parse_args()
    problems = args.problem or ([] if args.problem_file else [
        p for p in (BENCHES if HAS_CUDA else CPU_BENCHES) if p not in ("models", "model_gemms") or _has_model_zoo()])
    if args.problem_file and not HAS_CUDA:
        parser.error("no GPU visible: --problem-file times problems on the GPU, as KernelBench's harness does")
    if not HAS_CUDA and any(p in GPU_BENCHES for p in problems):
        parser.error(f"no GPU visible: --problem takes {', '.join(CPU_BENCHES)} here")
    if args.size and len(problems) != 1:
        parser.error("--size needs exactly one --problem")

    if HAS_CUDA:
        device = torch.cuda.get_device_name(0)
        print(f"device: {device}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    else:
        device = "cpu"
        print(f"No GPU visible: the CPU tables only (torch {torch.__version__}, CPU capability "
              f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads).")
    options = Options(args)
    rows = []
    for name in problems:
        BENCHES[name](rows, options)
    if args.problem_file:
        bench_problem_files(rows, options, args.problem_file)
    for row in rows:  # the legend names how many calls the KB column's means took
        row["kernelbench_calls"] = options.kernelbench_calls if row["kernelbench_ms"] is not None else None
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, torch=torch.__version__, rows=rows), f, indent=1)
    if args.plot:
        plot(rows, args.plot, device)
    if args.markdown:
        write_markdown(rows, args.markdown, device, command="python bench.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
