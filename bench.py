"""Times each problem: eager PyTorch, torch.compile and ModelNew, with the measured error beside every time.

    python bench.py                      # every problem, full KernelBench sizes on the GPU
    python bench.py --problem leaky_relu --json results.json

Times are medians of CUDA-event-timed calls after warm-up, with L2 flushed before each timed call (as KernelBench
does) unless a row says "per call" (back-to-back calls, where host overhead decides). Ceilings are measured in the
same run: a device-to-device copy of the same bytes (memory-bound rows) and cuBLAS's GEMM in the same precision
(GEMM rows). Inputs are randn, so both branches of LeakyReLU are exercised. Without a GPU, the problems run on the
CPU at small sizes, and the output says so.
"""

import argparse
import copy
import json
import statistics
import time

import torch

import reference
from kernels.precision import allclose, matmul_precision, relative_error
from model_new import MODEL_NEW

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


# ---- the one timing helper --------------------------------------------------------------------------------------

_l2_flush_buffer = None


def time_each_ms(fns, *, samples=30, warmup=3, calls_per_sample=1, flush_l2=True):
    """Median milliseconds per call of each function in fns. Samples are taken round-robin (one of each function in
    turn), so a drift in clocks or host speed hits every function alike. On the GPU each sample is timed with CUDA
    events on the current stream; with flush_l2 a buffer twice the L2 size is overwritten before it, outside the
    timed region."""
    global _l2_flush_buffer
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    if not HAS_CUDA:
        for _ in range(samples):
            for fn, fn_times in zip(fns, times):
                start = time.perf_counter()
                for _ in range(calls_per_sample):
                    fn()
                fn_times.append((time.perf_counter() - start) * 1e3 / calls_per_sample)
        return [statistics.median(fn_times) for fn_times in times]
    if flush_l2 and _l2_flush_buffer is None:
        l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
        _l2_flush_buffer = torch.empty(2 * l2_bytes // 4, dtype=torch.float32, device="cuda")
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(samples)]
              for _ in fns]
    torch.cuda.synchronize()
    for i in range(samples):
        for fn, fn_events in zip(fns, events):
            start, end = fn_events[i]
            if flush_l2:
                _l2_flush_buffer.zero_()
            start.record()
            for _ in range(calls_per_sample):
                fn()
            end.record()
    torch.cuda.synchronize()
    return [statistics.median(start.elapsed_time(end) / calls_per_sample for start, end in fn_events)
            for fn_events in events]


def time_ms(fn, **options):
    """Median milliseconds per call of fn(); options as time_each_ms's."""
    return time_each_ms([fn], **options)[0]


def compiled(model, mode=None):
    torch._dynamo.reset()
    return torch.compile(model, mode=mode)


# ---- leaky_relu -------------------------------------------------------------------------------------------------

def bench_leaky_relu(rows):
    shape = (reference.LEAKY_RELU_BATCH_SIZE, reference.LEAKY_RELU_DIM) if HAS_CUDA else (256, 8192)
    slope = 0.01
    eager = reference.LeakyReLUModel(slope)
    new = MODEL_NEW["leaky_relu"](slope)

    def add(case, version, ms, bytes_moved, copy_ms, eager_ms, err):
        rows.append(dict(problem="leaky_relu", case=case, version=version, ms=ms, gbps=bytes_moved / ms / 1e6,
                         pct_of_copy=100 * copy_ms / ms, speedup=eager_ms / ms, error=err))

    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(shape, device=DEVICE, dtype=dtype)
            out = torch.empty_like(x)
            y_ref = eager(x)
            case = f"forward {dtype_name(dtype)} {shape[0]}x{shape[1]}"
            versions = [("eager", eager)]
            if HAS_CUDA:
                versions.append(("torch.compile", compiled(eager)))
            versions.append(("ModelNew", new))
            copy_ms, *version_ms = time_each_ms(
                [lambda: out.copy_(x)] + [lambda model=model: model(x) for _, model in versions])
            for (version, model), ms in zip(versions, version_ms):
                err = (model(x).float() - y_ref.float()).abs().max().item()
                add(case, version, ms, 2 * x.nbytes, copy_ms, version_ms[0], err)
            del x, out, y_ref

        # Backward: the kernel each autograd graph runs for grad of input (grad_output and input read, one write).
        x = torch.randn(shape, device=DEVICE)
        grad = torch.randn_like(x)
        out = torch.empty_like(x)
        g_ref = torch.ops.aten.leaky_relu_backward(grad, x, slope, False)
        case = f"backward float32 {shape[0]}x{shape[1]}"
        copy_ms, eager_ms, new_ms = time_each_ms([
            lambda: out.copy_(x),
            lambda: torch.ops.aten.leaky_relu_backward(grad, x, slope, False),
            lambda: torch.ops.kernels.leaky_relu_backward(grad, x, slope, 1.0)])
        del out
        err = (torch.ops.kernels.leaky_relu_backward(grad, x, slope, 1.0) - g_ref).abs().max().item()
        add(case, "eager", eager_ms, 3 * x.nbytes, 1.5 * copy_ms, eager_ms, 0.0)
        add(case, "ModelNew", new_ms, 3 * x.nbytes, 1.5 * copy_ms, eager_ms, err)
        del x, grad, g_ref

        # Launch-bound: host overhead per call decides, so calls run back to back.
        x = torch.randn(16, 16384, device=DEVICE)
        case = "per call, float32 16x16384"
        y_ref = eager(x)
        copy_ms, eager_ms, new_ms = time_each_ms([lambda: x.clone(), lambda: eager(x), lambda: new(x)],
                                                 calls_per_sample=200, samples=50, flush_l2=False)
        add(case, "eager", eager_ms, 2 * x.nbytes, copy_ms, eager_ms, 0.0)
        add(case, "ModelNew", new_ms, 2 * x.nbytes, copy_ms, eager_ms, (new(x) - y_ref).abs().max().item())


# ---- gemm_multiply_leaky_relu -----------------------------------------------------------------------------------

def bench_gemm_multiply_leaky_relu(rows, with_max_autotune=True):
    if HAS_CUDA:
        m, k, n = reference.GEMM_BATCH_SIZE, reference.GEMM_IN_FEATURES, reference.GEMM_OUT_FEATURES
    else:
        m, k, n = 128, 512, 512
    init = [k, n, reference.GEMM_MULTIPLIER, reference.GEMM_NEGATIVE_SLOPE]
    torch.manual_seed(0)
    eager32 = reference.GemmMultiplyLeakyReLUModel(*init).to(DEVICE)
    torch.manual_seed(0)
    new32 = MODEL_NEW["gemm_multiply_leaky_relu"](*init).to(DEVICE)
    x32 = torch.randn(m, k, device=DEVICE)
    flops = 2 * m * n * k
    with torch.no_grad():
        y64 = copy.deepcopy(eager32).double()(x32.double())
        y_eager32 = eager32(x32)
    grad32 = torch.randn(m, n, device=DEVICE)

    settings = [("fp32", torch.float32, "highest"), ("tf32", torch.float32, "high"), ("bf16", torch.bfloat16, "highest")]
    for label, dtype, precision in settings:
        with matmul_precision(precision):
            eager, new = copy.deepcopy(eager32).to(dtype), copy.deepcopy(new32).to(dtype)
            x, grad = x32.to(dtype), grad32.to(dtype)
            weight_t = eager.gemm.weight.detach().t()
            with torch.no_grad():
                versions = [("eager", eager)]
                if label == "fp32" and HAS_CUDA:
                    versions.append(("torch.compile", compiled(eager)))
                    if with_max_autotune:
                        versions.append(("compile max-autotune", compiled(eager, "max-autotune-no-cudagraphs")))
                versions.append(("ModelNew", new))
                cublas_ms, *version_ms = time_each_ms(
                    [lambda: torch.mm(x, weight_t)] + [lambda model=model: model(x) for _, model in versions])
                for (version, model), ms in zip(versions, version_ms):
                    y = model(x)
                    rows.append(dict(problem="gemm_multiply_leaky_relu", case=f"forward {label} {m}x{k}->{n}",
                                     version=version, ms=ms, tflops=flops / ms / 1e9,
                                     pct_of_cublas=100 * cublas_ms / ms, speedup=version_ms[0] / ms,
                                     error=relative_error(y, y64), allclose_1e4=allclose(y.float(), y_eager32)))

            # Training step: forward and the grads of x, weight and bias.
            x_train = x.clone().requires_grad_(True)
            versions = (("eager", eager), ("ModelNew", new))

            def train_step(model):
                return torch.autograd.grad(model(x_train), [x_train, model.gemm.weight, model.gemm.bias], grad)

            version_ms = time_each_ms([lambda model=model: train_step(model) for _, model in versions])
            for (version, model), ms in zip(versions, version_ms):
                rows.append(dict(problem="gemm_multiply_leaky_relu", case=f"train step {label} {m}x{k}->{n}",
                                 version=version, ms=ms, tflops=3 * flops / ms / 1e9, pct_of_cublas=None,
                                 speedup=version_ms[0] / ms, error=None, allclose_1e4=None))


# ---- report -----------------------------------------------------------------------------------------------------

def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def fmt(value, spec, width):
    """value formatted by spec, right-aligned in width characters; "-" where there is no value."""
    return format("-" if value is None else format(value, spec), f">{width}")


def print_table(rows):
    leaky = [r for r in rows if r["problem"] == "leaky_relu"]
    gemm = [r for r in rows if r["problem"] == "gemm_multiply_leaky_relu"]
    if leaky:
        print("\nleaky_relu (memory-bound; % of copy = bandwidth over a device-to-device copy of the same bytes)")
        print(f"| {'case':<30} | {'version':<14} | {'time ms':>9} | {'GB/s':>7} | {'% of copy':>9} | "
              f"{'vs eager':>8} | {'max |err|':>9} |")
        print(f"|{'-' * 32}|{'-' * 16}|{'-' * 11}|{'-' * 9}|{'-' * 11}|{'-' * 10}|{'-' * 11}|")
        for r in leaky:
            print(f"| {r['case']:<30} | {r['version']:<14} | {r['ms']:>9.4f} | {r['gbps']:>7.0f} | "
                  f"{r['pct_of_copy']:>8.1f}% | {r['speedup']:>7.3f}x | {r['error']:>9.2e} |")
    if gemm:
        print("\ngemm_multiply_leaky_relu (compute-bound; % of cuBLAS = rate over cuBLAS's plain GEMM in the same "
              "precision; error = ||y - y64|| / ||y64||; allclose vs eager fp32 at 1e-4)")
        print(f"| {'case':<32} | {'version':<20} | {'time ms':>8} | {'TFLOP/s':>7} | {'% cuBLAS':>8} | "
              f"{'vs eager':>8} | {'error':>8} | {'allclose':>8} |")
        print(f"|{'-' * 34}|{'-' * 22}|{'-' * 10}|{'-' * 9}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 10}|")
        for r in gemm:
            verdict = "-" if r["allclose_1e4"] is None else ("pass" if r["allclose_1e4"] else "FAIL")
            print(f"| {r['case']:<32} | {r['version']:<20} | {r['ms']:>8.4f} | {r['tflops']:>7.1f} | "
                  f"{fmt(r['pct_of_cublas'], '.1f', 7)}{'%' if r['pct_of_cublas'] else ' '} | "
                  f"{r['speedup']:>7.3f}x | {fmt(r['error'], '.2e', 8)} | {verdict:>8} |")


BENCHES = {"leaky_relu": bench_leaky_relu, "gemm_multiply_leaky_relu": bench_gemm_multiply_leaky_relu}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problem", choices=sorted(BENCHES), action="append",
                        help="problem to run (repeatable; default: all)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    args = parser.parse_args()

    if HAS_CUDA:
        device = torch.cuda.get_device_name(0)
        print(f"device: {device}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    else:
        device = "cpu"
        print(f"No GPU visible: running on the CPU at small sizes (torch {torch.__version__}); "
              "these figures say nothing about GPU performance.")
    rows = []
    for name in args.problem or list(BENCHES):
        BENCHES[name](rows)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
