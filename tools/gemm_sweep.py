"""The split fp16 GEMM's error, time and kernels, one measurement per subcommand (on the GPU machine, from the repo
root); without one, the problem's size (1024x8192 -> 8192, fp32): error against float64 and eager's, time, and where
one call's time goes, kernel by kernel. Also the tensor cores' measured rates, and versions of kernel files timed
side by side (variants).

    python tools/gemm_sweep.py                    # the problem's size
    python tools/gemm_sweep.py k-sweep            # any subcommand below (--help lists them)
    python tools/gemm_sweep.py --path split_fp16_sm80 k-sweep   # every call forced onto one path
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

# The split path that --k-sweep and --shapes force: --path's where it names a split path.
SPLIT_PATH = "split_fp16"


def problem_size():
    import copy

    import reference
    from kernels.precision import relative_error
    from kernels.timing import time_ms
    from model_new import GemmMultiplyLeakyReLUModelNew

    init = reference.gemm_multiply_leaky_relu_get_init_inputs()
    torch.manual_seed(0)
    eager = reference.GemmMultiplyLeakyReLUModel(*init).cuda()
    torch.manual_seed(0)
    new = GemmMultiplyLeakyReLUModelNew(*init).cuda()
    print(f"{'inputs':>6} {'ms':>9} {'eager ms':>9} {'error':>10} {'eager':>10} {'ratio':>6}")
    for kind in ("randn", "rand"):
        torch.manual_seed(1)
        x = (torch.randn if kind == "randn" else torch.rand)(1024, 8192, device="cuda")
        with torch.no_grad():
            y64 = copy.deepcopy(eager).double()(x.double())
            ours, theirs = relative_error(new(x), y64), relative_error(eager(x), y64)
            ms, eager_ms = time_ms(lambda: new(x)), time_ms(lambda: eager(x))
        print(f"{kind:>6} {ms:9.4f} {eager_ms:9.4f} {ours:10.3e} {theirs:10.3e} {ours / theirs:6.3f}")


def profiled(step, calls):
    """torch.profiler's CUDA record of `calls` runs of step(), after three unmeasured runs."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    return prof


def profile(step, calls=10):
    """The device time of `calls` runs of step(), kernel by kernel, after three unmeasured runs."""
    print(profiled(step, calls).key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                                     max_name_column_width=60))


def profile_one_call():
    from model_new import GemmMultiplyLeakyReLUModelNew

    new = GemmMultiplyLeakyReLUModelNew(8192, 8192, 2.0, 0.1).cuda()
    x = torch.randn(1024, 8192, device="cuda")
    with torch.no_grad():
        profile(lambda: new(x))


def weight_split_times():
    """The forward at the problem's size (no_grad, as an evaluation runs it) with and without the weight's split kept
    (FusedLinear.cache_weight_split), on the current path: times, kernels, and the bitwise check of the outputs.
    "split anew" is every call's cost without a kept split (also each first call after a weight change); the call
    that splits ahead costs "weight split" plus "kept"."""
    from kernels.timing import time_each_ms
    from model_new import GemmMultiplyLeakyReLUModelNew

    torch.manual_seed(0)
    anew = GemmMultiplyLeakyReLUModelNew(8192, 8192, 2.0, 0.1).cuda()
    anew.gemm.cache_weight_split = False
    torch.manual_seed(0)
    kept = GemmMultiplyLeakyReLUModelNew(8192, 8192, 2.0, 0.1).cuda()
    x = torch.randn(1024, 8192, device="cuda")
    with torch.no_grad():
        outputs = [kept(x) for _ in range(3)]
        print("kept split:", kept.gemm._weight_split is not None)
        same = all(torch.equal(y.view(torch.int32), anew(x).view(torch.int32)) for y in outputs)
        print("outputs bit for bit the same with and without it:", same)
        weight = kept.gemm.weight
        times = time_each_ms([lambda: anew(x), lambda: kept(x),
                              lambda: torch.ops.kernels.gemm_weight_split(x, weight)], samples=40)
        for name, ms in zip(("split anew", "kept", "weight split"), times):
            print(f"{name:>14} {ms:8.4f} ms")
        profile(lambda: kept(x))


def parts():
    """Each part's time alone (L2 flushed, no kept weight split): the forward over batch sizes at 8192 -> 8192, and,
    at the problem's size, the backward op asked for grad_x alone and for grad_W (with grad_b) alone, and the training
    step (forward and autograd.grad of x, W and b)."""
    from kernels.timing import time_each_ms
    from model_new import GemmMultiplyLeakyReLUModelNew

    torch.manual_seed(0)
    new = GemmMultiplyLeakyReLUModelNew(8192, 8192, 2.0, 0.1).cuda()
    new.gemm.cache_weight_split = False
    weight, bias = new.gemm.weight, new.gemm.bias
    with torch.no_grad():
        rows = (1024, 2048, 4096, 8192)
        xs = {m: torch.randn(m, 8192, device="cuda") for m in rows}
        times = time_each_ms([lambda x=xs[m]: new(x) for m in rows], samples=20)
        for m, ms in zip(rows, times):
            print(f"forward {m}x8192->8192: {ms:8.4f} ms, {3 * 2 * m * 8192 * 8192 / ms / 1e9:6.1f} TFLOP/s (x3)")
        x, grad_y = xs[1024], torch.randn(1024, 8192, device="cuda")
        y, _ = torch.ops.kernels.gemm_multiply_leaky_relu(x, weight, bias, 2.0, 0.1, False)
        backward = torch.ops.kernels.gemm_multiply_leaky_relu_backward
        grad_x_ms, grad_w_ms = time_each_ms([
            lambda: backward(grad_y, x, weight, y, 2.0, 0.1, True, False, False),
            lambda: backward(grad_y, x, weight, y, 2.0, 0.1, False, True, True)], samples=20)
    x_train = xs[1024].clone().requires_grad_(True)
    step_ms = time_each_ms([lambda: torch.autograd.grad(new(x_train), [x_train, weight, bias], grad_y)],
                           samples=20)[0]
    print(f"backward grad_x alone {grad_x_ms:8.4f} ms, grad_W and grad_b alone {grad_w_ms:8.4f} ms, "
          f"train step {step_ms:8.4f} ms")


def train_step():
    """One fp32 training step at the problem's size (forward and the gradients of x, W and b): ModelNew's profile,
    then eager's and ModelNew's peak memory over what is held and each gradient's error against float64 through that
    forward's own branch mask (tests/test_gemm_backward.py, float64_gradients)."""
    import torch.nn.functional as F

    import reference
    from kernels.precision import relative_error
    from model_new import GemmMultiplyLeakyReLUModelNew

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from test_gemm import float64_gradients

    init = reference.gemm_multiply_leaky_relu_get_init_inputs()
    multiplier, slope = init[2], init[3]
    torch.manual_seed(0)
    eager = reference.GemmMultiplyLeakyReLUModel(*init).cuda()
    torch.manual_seed(0)
    new = GemmMultiplyLeakyReLUModelNew(*init).cuda()
    x = torch.randn(1024, init[0], device="cuda", requires_grad=True)
    grad_y = torch.randn(1024, init[1], device="cuda")
    profile(lambda: torch.autograd.grad(new(x), [x, new.gemm.weight, new.gemm.bias], grad_y))
    # The backward's two products apart (the same kernel serves both): grad_x alone, then grad_W with grad_b.
    with torch.no_grad():
        saved = new(x)
    for wanted in ((True, False, False), (False, True, True)):
        print("backward op, x_grad, weight_grad, bias_grad =", wanted)
        profile(lambda: torch.ops.kernels.gemm_multiply_leaky_relu_backward(
            grad_y, x.detach(), new.gemm.weight.detach(), saved, multiplier, slope, *wanted))
    del saved
    print(f"{'variant':>9} {'peak MiB over held':>18} {'err grad_x':>11} {'err grad_W':>11} {'err grad_b':>11}")
    for name, model in (("eager", eager), ("ModelNew", new)):
        for _ in range(2):  # the second step is measured: the first loads kernels and makes handles
            model.zero_grad(set_to_none=True)
            x.grad = None
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            model(x).backward(grad_y)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - held
        with torch.no_grad():
            positive = F.linear(x, model.gemm.weight, model.gemm.bias) * multiplier > 0
            if name == "ModelNew":
                positive = torch.ops.kernels.gemm_multiply_leaky_relu(x, new.gemm.weight, new.gemm.bias, multiplier,
                                                                      slope, True)[1]
        references = float64_gradients(x.detach(), model.gemm.weight.detach(), grad_y, positive, multiplier, slope)
        errors = [relative_error(g, r) for g, r in zip((x.grad, model.gemm.weight.grad, model.gemm.bias.grad),
                                                       references)]
        print(f"{name:>9} {peak / 2**20:18.1f} {errors[0]:11.3e} {errors[1]:11.3e} {errors[2]:11.3e}")


def train_step_profile(label):
    """Eager's and ModelNew's training step (bench.py's: the forward, then torch.autograd.grad of x, W and b) in one
    dtype at the problem's size: each one's time over several rounds of interleaved samples, then each one's kernels."""
    import reference
    from kernels.timing import time_each_ms
    from model_new import GemmMultiplyLeakyReLUModelNew

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[label]
    init = reference.gemm_multiply_leaky_relu_get_init_inputs()
    torch.manual_seed(0)
    eager = reference.GemmMultiplyLeakyReLUModel(*init).cuda().to(dtype)
    torch.manual_seed(0)
    new = GemmMultiplyLeakyReLUModelNew(*init).cuda().to(dtype)
    x = torch.randn(1024, init[0], device="cuda", dtype=dtype, requires_grad=True)
    grad = torch.randn(1024, init[1], device="cuda", dtype=dtype)
    steps = {name: (lambda model=model: torch.autograd.grad(model(x), [x, model.gemm.weight, model.gemm.bias], grad))
             for name, model in (("eager", eager), ("ModelNew", new))}
    for round_ in range(5):
        times = time_each_ms(list(steps.values()), samples=30)
        print(f"{label} train step, round {round_}: " + ", ".join(f"{n} {t:.4f} ms" for n, t in zip(steps, times))
              + f", ratio {times[0] / times[1]:.3f}")
    # Host time: how long the host takes to enqueue each part of a step, the GPU idle before each (median of 50).
    import statistics
    import time
    for name, model in (("eager", eager), ("ModelNew", new)):
        forward_us, backward_us = [], []
        for _ in range(50):
            torch.cuda.synchronize()
            start = time.perf_counter()
            y = model(x)
            middle = time.perf_counter()
            torch.autograd.grad(y, [x, model.gemm.weight, model.gemm.bias], grad)
            end = time.perf_counter()
            forward_us.append((middle - start) * 1e6)
            backward_us.append((end - middle) * 1e6)
        print(f"{label} train step, {name}: host time to enqueue the forward {statistics.median(forward_us):.1f} us, "
              f"the backward {statistics.median(backward_us):.1f} us")
    for name, step in steps.items():
        print(f"{label} train step, {name}:")
        profile(step)


def kernel_table(step, calls=5):
    """Per kernel, its device milliseconds per step() and launches per step; the total first."""
    events = sorted((e for e in profiled(step, calls).key_averages() if e.self_device_time_total > 0),
                    key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events) / calls / 1000
    return total, [(e.self_device_time_total / calls / 1000, e.count // calls, e.key) for e in events]


def loop_profile():
    """Where a training loop's step (zero_grad, forward, y.square().mean(), backward, as bench.py's loop rows) spends
    its time beyond bench's autograd.grad step: both kinds of step, eager's and ModelNew's, kernel by kernel; then the
    autograd.grad step timed with three grad_y (randn, the loop's 2y/numel, 2y), one after the other, in alternating
    orders, to tell the data's effect on the split GEMMs from the card's state under sustained load."""
    import reference
    from bench import training_loop_step
    from kernels.timing import time_ms
    from model_new import GemmMultiplyLeakyReLUModelNew

    init = reference.gemm_multiply_leaky_relu_get_init_inputs()
    torch.manual_seed(0)
    eager = reference.GemmMultiplyLeakyReLUModel(*init).cuda()
    new = GemmMultiplyLeakyReLUModelNew(*init).cuda()
    new.load_state_dict(eager.state_dict())
    x = torch.randn(1024, init[0], device="cuda", requires_grad=True)
    grad = torch.randn(1024, init[1], device="cuda")

    def grad_step(model, grad_y=grad):
        torch.autograd.grad(model(x), [x, model.gemm.weight, model.gemm.bias], grad_y)

    for name, model in (("eager", eager), ("ModelNew", new)):
        for kind, step in (("loop", lambda model: training_loop_step(model, x)), ("autograd.grad step", grad_step)):
            total, rows = kernel_table(lambda: step(model))
            print(f"== {name}, {kind}: {total:.4f} ms of kernels per step")
            for ms, count, key in rows[:12]:
                print(f"   {ms:8.4f} ms x{count:<3d} {key[:90]}")
    with torch.no_grad():
        y = new(x)
    grads = {"randn": torch.randn_like(y), "2y/numel": 2 * y / y.numel(), "2y": 2 * y}
    for round_ in range(3):
        order = list(grads.items()) if round_ % 2 == 0 else list(grads.items())[::-1]
        times = []
        for label, grad_y in order:  # one grad_y after the other, each timed on its own: the card's drift shows
            ms = time_ms(lambda grad_y=grad_y: grad_step(new, grad_y), samples=20, flush_l2=False)
            times.append(f"{label} {ms:.4f} ms")
        print(f"ModelNew autograd.grad step, one grad_y after the other, round {round_}: " + ", ".join(times))


def loop_kernels():
    """ModelNew's training-loop step alone (fp32 1024x8192 -> 8192; zero_grad, forward, y.square().mean(),
    backward): its kernels' device time per step with the five largest, then its time (the median of 30 steps), each
    on one line: short enough to compare versions of a kernel with the variants subcommand."""
    import reference
    from bench import training_loop_step
    from kernels.timing import time_ms
    from model_new import GemmMultiplyLeakyReLUModelNew

    init = reference.gemm_multiply_leaky_relu_get_init_inputs()
    torch.manual_seed(0)
    model = GemmMultiplyLeakyReLUModelNew(*init).cuda()
    x = torch.randn(1024, init[0], device="cuda", requires_grad=True)
    total, rows = kernel_table(lambda: training_loop_step(model, x))
    largest = ", ".join(f"{ms:.4f} {key.split('(')[0].split('::')[-1][:40]}" for ms, _, key in rows[:5])
    print(f"loop step kernels {total:.4f} ms: {largest}")
    print(f"loop step {time_ms(lambda: training_loop_step(model, x), samples=30, flush_l2=False):.4f} ms")


def waves():
    """Whether the Hopper GEMM's time follows its rounds of tiles: the persistent kernel gives each CTA (one per
    multiprocessor) every P-th tile, so a GEMM of T tiles takes ceil(T / P) tile-times, and T / P is the work. At
    1024 x 8192 -> N, the forward and grad_W have T = 8 N / 128 and 64 N / 128 tiles (grad_x's output, 1024 x 8192, is
    512 tiles at every N: its time follows N's work alone). Per width: each GEMM kernel's device time per call, its
    tiles, rounds and rounds' fill, and its time per round."""
    import kernels.functional  # noqa: F401  (loads the op library)

    processors = torch.cuda.get_device_properties(0).multi_processor_count
    backward = torch.ops.kernels.gemm_multiply_leaky_relu_backward

    def tiles(rows, columns):  # the kernel's 128 x 128 output tiles (gemm_sm90_tile_scheduler.cuh, tile_count)
        return -(-rows // 128) * -(-columns // 128)

    print(f"{processors} multiprocessors; the split GEMM kernel's device time per call (torch.profiler)")
    print(f"{'N':>6} {'product':>8} {'tiles':>6} {'rounds':>6} {'fill':>6} {'ms':>8} {'ms/round':>9}")
    for n in (7936, 8192, 8448, 8576):
        torch.manual_seed(0)
        x, weight = torch.randn(1024, 8192, device="cuda"), torch.randn(n, 8192, device="cuda") / 8192 ** 0.5
        bias, grad_y = torch.randn(n, device="cuda"), torch.randn(1024, n, device="cuda")
        with torch.no_grad():
            y, _ = torch.ops.kernels.gemm_multiply_leaky_relu(x, weight, bias, 2.0, 0.1, False)
        steps = {  # each product's tiles over its output: y (1024 x n), grad_x (1024 x 8192), grad_W (n x 8192)
            "forward": (tiles(1024, n), lambda: torch.ops.kernels.gemm_multiply_leaky_relu(x, weight, bias, 2.0, 0.1,
                                                                                           False)),
            "grad_x": (tiles(1024, 8192), lambda: backward(grad_y, x, weight, y, 2.0, 0.1, True, False, False)),
            "grad_W": (tiles(n, 8192), lambda: backward(grad_y, x, weight, y, 2.0, 0.1, False, True, True)),
        }
        for name, (count, step) in steps.items():
            _, rows = kernel_table(step, calls=10)
            ms = sum(ms for ms, _, key in rows if "split_gemm_kernel" in key)
            rounds = -(-count // processors)
            print(f"{n:>6} {name:>8} {count:>6} {rounds:>6} {count / processors / rounds:6.1%} {ms:8.4f} "
                  f"{ms / rounds:9.4f}")


def k_sweep():
    import torch.nn.functional as F
    from kernels.functional import gemm_multiply_leaky_relu
    from kernels.gemm.gemm import forced_gemm_path
    from kernels.precision import relative_error

    print(f"{'k':>6} {'inputs':>10} {'split':>10} {'eager':>10} {'ratio':>6}  (m = n = 512, worst of 3 seeds)")
    for k in (8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 2048, 4096, 8192):
        for kind in ("randn", "rand", "wide_rows"):
            worst = (0.0, 0.0, 0.0)
            for seed in range(3):
                g = torch.Generator(device="cuda").manual_seed(seed)
                draw = torch.rand if kind == "rand" else torch.randn
                x = draw(512, k, device="cuda", generator=g)
                weight = draw(512, k, device="cuda", generator=g) / k ** 0.5
                if kind == "wide_rows":
                    x *= torch.pow(10.0, torch.empty(512, 1, device="cuda").uniform_(-20, 20, generator=g))
                bias = torch.randn(512, device="cuda", generator=g) * 0.1
                with torch.no_grad(), forced_gemm_path(SPLIT_PATH):
                    y = gemm_multiply_leaky_relu(x, weight, bias, 2.0, 0.1)
                y_eager = F.leaky_relu(F.linear(x, weight, bias) * 2.0, 0.1)
                y64 = F.leaky_relu(F.linear(x.double(), weight.double(), bias.double()) * 2.0, 0.1)
                ours, eager = relative_error(y, y64), relative_error(y_eager, y64)
                if ours / eager > worst[2]:
                    worst = (ours, eager, ours / eager)
            print(f"{k:>6} {kind:>10} {worst[0]:10.3e} {worst[1]:10.3e} {worst[2]:6.3f}")


# Real models' outputs (rows x out_features): ViT-B/16 at batch 64, BERT and GPT-2 at 8-16 x 512 tokens, LLaMA-style,
# KernelBench level 3's small transformers.
MODEL_OUTPUTS = ((12608, 2304), (12608, 768), (12608, 3072), (8192, 1024), (8192, 4096), (4096, 2048), (4096, 512),
                 (2048, 2048), (1024, 1024), (394, 512))


def small_k(outputs=MODEL_OUTPUTS, ks=(256, 384, 512, 640, 768, 1000, 1024)):
    """Below the split path's smallest K: time and error of both paths, forced, at real models' outputs with the
    identity epilogue (a plain linear layer), per K; the worst error ratio over randn, rand and scaled-row inputs."""
    import torch.nn.functional as F
    from kernels.timing import time_each_ms
    from kernels.functional import gemm_multiply_leaky_relu
    from kernels.gemm.gemm import forced_gemm_path
    from kernels.precision import relative_error

    print(f"{'m':>6} {'n':>5} {'k':>5} {'split ms':>9} {'cublas ms':>9} {'speedup':>7} {'worst':>9} {'split':>10} "
          f"{'eager':>10} {'ratio':>6}")
    for m, n in outputs:
        for k in ks:
            g = torch.Generator(device="cuda").manual_seed(0)
            worst = ("", 0.0, 1.0, 0.0)
            for kind in ("randn", "rand", "wide_rows"):
                draw = torch.rand if kind == "rand" else torch.randn
                x = draw(m, k, device="cuda", generator=g)
                if kind == "wide_rows":
                    x *= torch.pow(10.0, torch.empty(m, 1, device="cuda").uniform_(-10, 10, generator=g))
                weight = (torch.rand(n, k, device="cuda", generator=g) * 2 - 1) / k ** 0.5
                bias = (torch.rand(n, device="cuda", generator=g) * 2 - 1) / k ** 0.5
                with torch.no_grad():
                    with forced_gemm_path(SPLIT_PATH):
                        y = gemm_multiply_leaky_relu(x, weight, bias, 1.0, 1.0)
                    y_eager = F.linear(x, weight, bias)
                    y64 = F.linear(x.double(), weight.double(), bias.double())
                    ours, eager = relative_error(y, y64), relative_error(y_eager, y64)
                    if kind == "randn":
                        def split():
                            with forced_gemm_path(SPLIT_PATH):
                                gemm_multiply_leaky_relu(x, weight, bias, 1.0, 1.0)
                        times = time_each_ms([split, lambda: F.linear(x, weight, bias)])
                if ours / eager > worst[3]:
                    worst = (kind, ours, eager, ours / eager)
                del x, weight, y, y_eager, y64
            print(f"{m:>6} {n:>5} {k:>5} {times[0]:9.4f} {times[1]:9.4f} {times[1] / times[0]:7.3f} {worst[0]:>9} "
                  f"{worst[1]:10.3e} {worst[2]:10.3e} {worst[3]:6.3f}", flush=True)


def models_profile(names=None):
    """Each model of bench.py's models table, patched, one AdamW training step: its kernels by device time per step
    (the 15 largest), eager's total beside."""
    import copy

    import bench
    import kernels

    for name, (build, inputs, loss, _) in bench._model_specs().items():
        if names and not any(n.lower() in name.lower() for n in names):
            continue
        torch.manual_seed(0)
        eager = build().cuda().train()
        patched = kernels.patch(copy.deepcopy(eager))
        batch = inputs(torch.Generator(device="cuda").manual_seed(0))
        totals = {}
        for label, model in (("eager", eager), ("patched", patched)):
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step(model=model, optimizer=optimizer):
                optimizer.zero_grad(set_to_none=True)
                loss(model, batch).backward()
                optimizer.step()

            totals[label], rows = kernel_table(step, calls=3)
        print(f"\n{name}: device ms per step, eager {totals['eager']:.2f}, patched {totals['patched']:.2f}")
        for ms, count, key in rows[:15]:
            print(f"{ms:9.3f} {count:5d}  {key[:110]}")
        del eager, patched
        torch.cuda.empty_cache()


SWEEP_OUTPUTS = ((128, 512), (512, 512), (1024, 1024), (1024, 2048), (2048, 2048), (1024, 8192), (4096, 4096))


def shape_sweep(outputs=SWEEP_OUTPUTS):
    import torch.nn.functional as F
    from kernels.timing import time_ms
    from kernels.functional import gemm_multiply_leaky_relu
    from kernels.gemm.gemm import forced_gemm_path
    from kernels.precision import relative_error

    print(f"{'m':>5} {'n':>5} {'k':>5} {'split ms':>9} {'cublas ms':>9} {'inputs':>6} {'split':>10} {'eager':>10} "
          f"{'ratio':>6}")
    for m, n in outputs:
        for k in (1024, 4096, 8192):
            g = torch.Generator(device="cuda").manual_seed(0)
            times = {}
            for kind in ("randn", "rand", "kb"):
                x = (torch.randn if kind == "randn" else torch.rand)(m, k, device="cuda", generator=g)
                if kind == "kb":  # KernelBench's inputs: rand x, nn.Linear's uniform weight of both signs
                    weight = (torch.rand(n, k, device="cuda", generator=g) * 2 - 1) / k ** 0.5
                else:
                    weight = (torch.randn if kind == "randn" else torch.rand)(n, k, device="cuda", generator=g)
                    weight /= k ** 0.5
                bias = torch.randn(n, device="cuda", generator=g) * 0.1
                with torch.no_grad():
                    with forced_gemm_path(SPLIT_PATH):
                        y = gemm_multiply_leaky_relu(x, weight, bias, 2.0, 0.1)
                        if kind == "randn":
                            times["split"] = time_ms(lambda: gemm_multiply_leaky_relu(x, weight, bias, 2.0, 0.1))
                    with forced_gemm_path("cublas"):
                        y_cublas = gemm_multiply_leaky_relu(x, weight, bias, 2.0, 0.1)
                        if kind == "randn":
                            times["cublas"] = time_ms(lambda: gemm_multiply_leaky_relu(x, weight, bias, 2.0, 0.1))
                y64 = F.leaky_relu(F.linear(x.double(), weight.double(), bias.double()) * 2.0, 0.1)
                ours, eager = relative_error(y, y64), relative_error(y_cublas, y64)
                print(f"{m:>5} {n:>5} {k:>5} {times['split']:9.4f} {times['cublas']:9.4f} {kind:>6} {ours:10.3e} "
                      f"{eager:10.3e} {ours / eager:6.3f}")
                del x, weight, y, y_cublas, y64


# grad_W's products (out_features x in_features, reduction: the batch's rows): BERT/GPT-2 and ViT-B layers at 12608
# and 4096-8192 rows, and the outputs around split_pays_off's smallest.
SPLIT_K_SHAPES = ((1024, 1024, 8192), (1024, 1024, 4096), (768, 3072, 12608), (3072, 768, 12608), (768, 768, 12608),
                  (768, 768, 8192), (768, 768, 4096), (512, 1024, 12608), (512, 512, 12608))
SPLIT_K_SLICES = (1, 2, 3, 4, 5, 6, 8)


def split_k(shapes=SPLIT_K_SHAPES, slices=SPLIT_K_SLICES):
    """grad_W = grad_pre^T x through the backward op on the split path, K (the batch) split into S slices (forced),
    and S as split_gemm_k_slices chooses it ("auto"), against eager's grad_pre.t().mm(x): times (ms, L2 flushed,
    medians), errors against float64 of ours (auto) and eager's, randn and rand inputs, and whether two runs agree
    bit for bit."""
    from kernels.gemm.gemm import forced_gemm_path
    from kernels.precision import relative_error
    from kernels.timing import time_each_ms

    backward = torch.ops.kernels.gemm_multiply_leaky_relu_backward
    force = torch.ops.kernels._gemm_force_k_slices
    header = " ".join(f"{'S=' + str(s):>7}" for s in slices)
    print(f"{'n':>5} {'k':>5} {'m':>6} {'auto':>4} {'eager':>7} {header} {'S=auto':>7} {'speedup':>7} {'S=1 x':>6} "
          f"{'inputs':>6} {'ours':>9} {'eager':>9} {'bits':>4}")
    for n, k, m in shapes:
        torch.manual_seed(0)
        weight, empty = torch.empty(n, k, device="cuda"), torch.empty(0, device="cuda")
        auto = torch.ops.kernels._gemm_k_slices(n, k, m)
        row = None
        for kind in ("randn", "rand"):
            draw = torch.randn if kind == "randn" else torch.rand
            grad_pre, x = draw(m, n, device="cuda"), draw(m, k, device="cuda")

            def ours(s):
                with forced_gemm_path(SPLIT_PATH):
                    previous = force(s)
                    grad_w = backward(grad_pre, x, weight, empty, 1.0, 1.0, False, True, False)[1]
                    force(previous)
                return grad_w

            if row is None:
                fns = [lambda: grad_pre.t().mm(x)] + [lambda s=s: ours(s) for s in (*slices, 0)]
                row = time_each_ms(fns)
            grad_w, again = ours(0), ours(0)
            bits = torch.equal(grad_w.view(torch.int32), again.view(torch.int32))
            reference = grad_pre.double().t() @ x.double()
            error, eager_error = relative_error(grad_w, reference), relative_error(grad_pre.t().mm(x), reference)
            times = " ".join(f"{t:7.4f}" for t in row[1:-1])
            print(f"{n:>5} {k:>5} {m:>6} {auto:>4} {row[0]:7.4f} {times} {row[-1]:7.4f} {row[0] / row[-1]:7.3f} "
                  f"{row[0] / row[1]:6.3f} {kind:>6} {error:9.3e} {eager_error:9.3e} {'same' if bits else 'DIFF':>4}",
                  flush=True)
            del grad_pre, x, grad_w, again, reference


COHERENCE_SHAPES = ((16384, 768, 2304), (4096, 1024, 1024), (8192, 4096, 4096), (16384, 256, 4096))


def coherence(shapes=COHERENCE_SHAPES):
    """The part of the error that every row shares: a linear layer (nn.Linear's weights) on rand inputs (all
    positive, so every row holds the same large component along the mean direction), rand - 0.5 and randn, ours
    (automatic path) against eager: the normwise error, the error of the mean over rows, and the coherence
    ||mean of the error over rows|| sqrt(rows) / ||error|| (about 1/sqrt(rows) where rows' errors are independent,
    1 where all rows share one error). A shared error adds up where a later layer sums over rows (attention's
    att @ v), an independent one partly cancels."""
    import torch.nn.functional as F
    from kernels.functional import linear
    from kernels.precision import relative_error

    print(f"{'shape':>20} {'inputs':>8} {'ours':>9} {'eager':>9} {'mean ours':>9} {'mean eager':>10} "
          f"{'coherence ours':>14} {'eager':>6}")
    for m, k, n in shapes:
        torch.manual_seed(0)
        layer = torch.nn.Linear(k, n).cuda()
        weight, bias = layer.weight.detach(), layer.bias.detach()
        for kind in ("rand", "rand-0.5", "randn"):
            x = torch.randn(m, k, device="cuda") if kind == "randn" else torch.rand(m, k, device="cuda") - (
                0.5 if kind == "rand-0.5" else 0.0)
            with torch.no_grad():
                y64 = F.linear(x.double(), weight.double(), bias.double())
                figures = []
                for y in (linear(x, weight, bias), F.linear(x, weight, bias)):
                    error = y.double() - y64
                    figures.append((relative_error(y, y64), float(error.mean(0).norm() / y64.mean(0).norm()),
                                    float(error.mean(0).norm() * m ** 0.5 / error.norm())))
            (ours, mean_ours, coherent_ours), (eager, mean_eager, coherent_eager) = figures
            print(f"{str((m, k, n)):>20} {kind:>8} {ours:9.3e} {eager:9.3e} {mean_ours:9.3e} {mean_eager:10.3e} "
                  f"{coherent_ours:14.2f} {coherent_eager:6.2f}", flush=True)
            del x, y64


# ---- the tensor cores' rates -----------------------------------------------------------------------------------

TENSOR_CORE_RATES_SOURCE = r"""
#include <cstdint>
#include <cuda_runtime.h>
#include <torch/extension.h>

__device__ __forceinline__ void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void load_x4(std::uint32_t address, std::uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

// fp16 values near 1 with varied low bits (the tensor cores' power, and so their clock, depends on the data).
__device__ __forceinline__ std::uint32_t operand(int salt) {
  const std::uint32_t low = (threadIdx.x * 2654435761u + salt * 40503u) & 0x03ff03ffu;
  return 0x3c003c00u | low;
}

__global__ void __launch_bounds__(1024) mma_only(float* out, int iterations) {
  std::uint32_t a[4] = {operand(1), operand(2), operand(3), operand(4)};
  const std::uint32_t b0 = operand(5), b1 = operand(6);
  float acc[8][4] = {};
  for (int i = 0; i < iterations; ++i) {
#pragma unroll
    for (int c = 0; c < 8; ++c) mma(acc[c], a, b0, b1);
  }
  float sum = 0.0f;
#pragma unroll
  for (int c = 0; c < 8; ++c) sum += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  if (sum == 1234.5f) out[threadIdx.x] = sum;  // never true; keeps the products
}

// The sm_80 kernel's step: a warp's 64 x 32 tile, x_hi, x_lo (4 m16 fragments each) and w_hi, w_lo (2 pairs of n8
// fragments each) by ldmatrix.x4 from 128-byte rows with 16-byte unit u at u ^ (row % 8), then three products per
// fragment pair.
// At most 512 threads, the 16-warp row's block: 128 registers, which ptxas meets for sm_90a as it is and for sm_80
// with a 20-byte spill.
__global__ void __launch_bounds__(512) ldmatrix_mma(float* out, int iterations) {
  extern __shared__ __align__(128) unsigned char tiles[];  // 4 tiles of 128 rows x 128 bytes
  for (int i = threadIdx.x; i < 4 * 128 * 32; i += blockDim.x)
    reinterpret_cast<std::uint32_t*>(tiles)[i] = operand(i);
  __syncthreads();
  const std::uint32_t base = static_cast<std::uint32_t>(__cvta_generic_to_shared(tiles));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warp_x = warp % 2, warp_w = (warp / 2) % 4;
  const auto swizzled = [](int row, int unit) {
    return static_cast<std::uint32_t>(row * 128 + ((unit ^ (row % 8)) * 16));
  };
  float acc[4][4][4] = {};
  for (int i = 0; i < iterations; ++i) {
#pragma unroll
    for (int step = 0; step < 4; ++step) {
      std::uint32_t a_hi[4][4], a_lo[4][4], b_hi[2][4], b_lo[2][4];
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        const std::uint32_t offset = swizzled(warp_x * 64 + f * 16 + lane % 16, 2 * step + lane / 16);
        load_x4(base + offset, a_hi[f]);
        load_x4(base + 16384 + offset, a_lo[f]);
      }
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const std::uint32_t offset =
            swizzled(warp_w * 32 + p * 16 + lane % 8 + 8 * (lane / 16), 2 * step + (lane / 8) % 2);
        load_x4(base + 32768 + offset, b_hi[p]);
        load_x4(base + 49152 + offset, b_lo[p]);
      }
#pragma unroll
      for (int f = 0; f < 4; ++f)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma(acc[f][j], a_hi[f], b_lo[j / 2][2 * (j % 2)], b_lo[j / 2][2 * (j % 2) + 1]);
#pragma unroll
      for (int f = 0; f < 4; ++f)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma(acc[f][j], a_lo[f], b_hi[j / 2][2 * (j % 2)], b_hi[j / 2][2 * (j % 2) + 1]);
#pragma unroll
      for (int f = 0; f < 4; ++f)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma(acc[f][j], a_hi[f], b_hi[j / 2][2 * (j % 2)], b_hi[j / 2][2 * (j % 2) + 1]);
    }
  }
  float sum = 0.0f;
#pragma unroll
  for (int f = 0; f < 4; ++f)
#pragma unroll
    for (int j = 0; j < 4; ++j) sum += acc[f][j][0] + acc[f][j][1] + acc[f][j][2] + acc[f][j][3];
  if (sum == 1234.5f) out[threadIdx.x] = sum;
}

// Launches `kernel` (0: mma_only, 1: ldmatrix_mma) on blocks x warps; returns nothing (timed by the caller).
void launch_rate_kernel(int64_t kernel, int64_t blocks, int64_t warps, int64_t iterations, torch::Tensor out) {
  const cudaStream_t stream = 0;
  if (kernel == 0) {
    mma_only<<<blocks, warps * 32, 0, stream>>>(out.data_ptr<float>(), static_cast<int>(iterations));
  } else {
    cudaFuncSetAttribute(ldmatrix_mma, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536);
    ldmatrix_mma<<<blocks, warps * 32, 65536, stream>>>(out.data_ptr<float>(), static_cast<int>(iterations));
  }
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "launch failed");
}
"""

TENSOR_CORE_RATES_DECLARATION = ("void launch_rate_kernel(int64_t kernel, int64_t blocks, int64_t warps, "
                                 "int64_t iterations, torch::Tensor out);")

# Products per warp per iteration of each kernel.
PRODUCTS_PER_ITERATION = {0: 8, 1: 4 * 48}


def tensor_core_rates():
    """mma.sync m16n8k16 (fp16 in, fp32 accumulate) alone at 4-32 warps per SM (8 accumulators a warp, no memory),
    and fed by ldmatrix at the sm_80 kernel's ratio (its 64 x 32 warp tile's inner step, no pipeline around it),
    beside cuBLAS fp16 and fp32 at the problem's shape: the ceilings in kernels/gemm/NOTES.md."""
    from torch.utils.cpp_extension import load_inline

    from kernels.timing import time_ms

    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}{'a' if major == 9 else ''}"
    module = load_inline("tensor_core_rates", cpp_sources=TENSOR_CORE_RATES_DECLARATION,
                         cuda_sources=TENSOR_CORE_RATES_SOURCE, functions=["launch_rate_kernel"],
                         extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"])
    processors = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(1024, device="cuda")
    print(f"{processors} SMs; medians of 20 samples, operands cached (no L2 flush); 2 m n k flops per product")
    print(f"{'case':<44} {'ms':>8} {'TFLOP/s':>8}")
    for kernel, warps_per_sm, iterations in ((0, 4, 20000), (0, 8, 20000), (0, 16, 10000), (0, 32, 5000),
                                             (1, 8, 2000), (1, 16, 1000)):
        blocks, warps = (processors, warps_per_sm) if warps_per_sm <= 32 else (processors * 2, warps_per_sm // 2)
        ms = time_ms(lambda: module.launch_rate_kernel(kernel, blocks, warps, iterations, out), samples=20,
                     flush_l2=False)
        flops = blocks * warps * iterations * PRODUCTS_PER_ITERATION[kernel] * 2 * 16 * 8 * 16
        name = (f"mma.sync, {warps_per_sm} warps per SM" if kernel == 0
                else f"ldmatrix + mma.sync (64x32 tile), {warps_per_sm} warps/SM")
        print(f"{name:<44} {ms:8.3f} {flops / ms / 1e9:8.1f}")
    m, k, n = 1024, 8192, 8192
    for dtype in (torch.float16, torch.float32):
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype)
        ms = time_ms(lambda: torch.mm(a, b), samples=20, flush_l2=False)
        print(f"{'cuBLAS ' + str(dtype).replace('torch.', '') + ' 1024x8192x8192':<44} {ms:8.3f} "
              f"{2 * m * n * k / ms / 1e9:8.1f}")


# ---- versions of kernel files side by side ------------------------------------------------------------------------

def variants(args):
    """Each version built in a copy of the repository with --file replaced, then one command run there (default: this
    tool at the problem's size, on --path where given), --repeat times; the working tree's own version first, as
    `current`. The copies share one extensions folder (builds are named by their sources' hash)."""
    import shlex
    import shutil
    import subprocess
    import tempfile
    import time

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = args.command or shlex.join([sys.executable, "tools/gemm_sweep.py", *(["--path", args.path] if args.path
                                                                                    else [])])
    if any("=" not in v or len(v.split("=", 1)[1].split(",")) != len(args.file) for v in args.versions):
        sys.exit("each version is NAME=FILE[,FILE...], one file per --file")
    root = tempfile.mkdtemp(prefix="variants_")
    extensions = os.path.join(root, "extensions")
    for name, path in [("current", None)] + [tuple(v.split("=", 1)) for v in args.versions]:
        copy = os.path.join(root, name)
        shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git", ".variants", ".whl", "__pycache__"))
        for replacement, replaced in zip(path.split(","), args.file) if path else ():
            shutil.copyfile(os.path.join(repo, replacement), os.path.join(copy, replaced))
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=extensions, PYTHONUNBUFFERED="1")
        start = time.time()
        built = subprocess.run([sys.executable, "-c", "import kernels.functional"], cwd=copy, env=env,
                               capture_output=True, text=True)
        print(f"=== {name} ({path or ', '.join(args.file)}): build {time.time() - start:.1f} s"
              + ("" if built.returncode == 0 else f" FAILED\n{built.stderr[-3000:]}"), flush=True)
        for _ in range(args.repeat if built.returncode == 0 else 0):
            status = subprocess.run(command, shell=True, cwd=copy, env=env).returncode
            if status != 0:
                print(f"=== {name}: the command exited with status {status}", flush=True)


def shapes(args):
    outputs = (tuple(tuple(int(v) for v in mn.lower().split("x")) for mn in args.outputs.split(","))
               if args.outputs else SWEEP_OUTPUTS)
    shape_sweep(outputs)


# subcommand: (what it runs, given the parsed arguments; its help)
SUBCOMMANDS = {
    "problem": (lambda args: (problem_size(), profile_one_call()),
                "the problem's size: error, time, and where one call's time goes (the default)"),
    "k-sweep": (lambda args: k_sweep(), "error of the forced split path against eager's, per K (the smallest K the "
                "automatic choice sends to the split path)"),
    "shapes": (shapes, "time and error of both paths over output sizes and K"),
    "small-k": (lambda args: small_k(), "time and error of both paths at real models' outputs, K 256-1024, identity "
                "epilogue"),
    "models-profile": (lambda args: models_profile(args.models),
                       "bench.py's models, patched: one training step's kernels"),
    "profile": (lambda args: profile_one_call(), "only where one call's time goes"),
    "train": (lambda args: train_step(), "an fp32 training step: its time, peak memory and each gradient's error"),
    "train-profile": (lambda args: train_step_profile(args.dtype), "bench's training step in a dtype: times, then "
                      "kernels"),
    "weight-split": (lambda args: weight_split_times(), "the forward with and without the weight's split kept: "
                     "times, kernels, bitwise check"),
    "parts": (lambda args: parts(), "the forward over batch sizes, each backward product alone and the training "
              "step: times"),
    "loop-profile": (lambda args: loop_profile(), "a training loop's step against bench's autograd.grad step: "
                     "kernels, data against clock"),
    "loop-kernels": (lambda args: loop_kernels(), "ModelNew's training-loop step alone: its largest kernels and "
                     "its time, two lines (variants' A/B)"),
    "split-k": (lambda args: split_k(), "grad_W's product at small outputs and long reductions: per slices of K, "
                "against eager"),
    "coherence": (lambda args: coherence(), "the part of a linear layer's error every row shares, on rand, "
                  "rand - 0.5 and randn inputs"),
    "waves": (lambda args: waves(), "the training step's three GEMMs at widths that fill the multiprocessors by "
              "whole rounds, or not"),
    "tensor-core-rates": (lambda args: tensor_core_rates(), "mma.sync's measured rate, alone and fed by ldmatrix, "
                          "beside cuBLAS fp16 and fp32"),
    "variants": (variants, "versions of kernel files, each built in a copy of the repository, timed side by side"),
}
# Subcommands that only start other processes: no GPU work, no forced path here.
LAUNCHERS = {"variants"}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", help="every call forced onto this path: cublas, split_fp16, split_fp16_sm80")
    subcommands = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
    subparsers = {name: subcommands.add_parser(name, help=summary, description=summary)
                  for name, (_, summary) in SUBCOMMANDS.items()}
    subparsers["shapes"].add_argument("--outputs", metavar="MxN[,MxN...]",
                                      help="these output sizes instead (e.g. 256x8192,512x8192: small batches)")
    subparsers["models-profile"].add_argument("models", nargs="*", metavar="MODEL",
                                              help="models named by a word (default: all)")
    subparsers["train-profile"].add_argument("dtype", choices=["fp32", "bf16", "fp16"])
    sub = subparsers["variants"]
    sub.description = variants.__doc__
    sub.add_argument("--file", required=True, action="append",
                     help="a kernel file the versions replace (repo-relative); may be repeated")
    sub.add_argument("--command", help="run in each copy instead of this tool at the problem's size")
    sub.add_argument("--repeat", type=int, default=2, help="runs of the command per version (2)")
    sub.add_argument("versions", nargs="*", metavar="NAME=FILE[,FILE...]", help="one replacement per --file")
    args = parser.parse_args()
    run = SUBCOMMANDS[args.subcommand or "problem"][0]
    if args.subcommand in LAUNCHERS:
        return run(args)
    print(torch.cuda.get_device_name(0))
    if args.path:
        from kernels.gemm.gemm import forced_gemm_path

        global SPLIT_PATH
        SPLIT_PATH = args.path if args.path.startswith("split") else SPLIT_PATH
        print("every call forced onto the", args.path, "path")
        with forced_gemm_path(args.path):
            return run(args)
    return run(args)


if __name__ == "__main__":
    main()
