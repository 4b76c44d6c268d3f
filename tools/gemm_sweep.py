"""The split fp16 GEMM's error, time and kernels, one measurement per subcommand (on the GPU machine, from the repo
root); without one, the problem's size (1024 x 8192 -> 8192, fp32). `variants` builds versions of kernel files in
copies of the repository and runs a command in each: an A/B in one machine session.

    python tools/gemm_sweep.py                    # the problem's size
    python tools/gemm_sweep.py k-sweep            # any subcommand below (--help lists them)
    python tools/gemm_sweep.py --path split_fp16_sm80 k-sweep   # every call forced onto one path
"""

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The split path the sweeps force: --path's where it names a split path.
SPLIT_PATH = "split_fp16"
# Real models' outputs (rows x out_features): ViT-B/16 at batch 64, BERT and GPT-2 at 8-16 x 512 tokens, LLaMA-style,
# KernelBench level 3's small transformers.
MODEL_OUTPUTS = ((12608, 2304), (12608, 768), (12608, 3072), (8192, 1024), (8192, 4096), (4096, 2048), (4096, 512),
                 (2048, 2048), (1024, 1024), (394, 512))
# subcommand: (outputs m x n, K, input kinds, epilogue (multiplier, slope)); the first kind is also timed.
SWEEPS = {
    "k-sweep": (((512, 512),), (8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 2048, 4096, 8192),
                ("randn", "rand", "wide_rows"), (2.0, 0.1)),
    "shapes": (((128, 512), (512, 512), (1024, 1024), (1024, 2048), (2048, 2048), (1024, 8192), (4096, 4096)),
               (1024, 4096, 8192), ("randn", "rand", "kb"), (2.0, 0.1)),
    "small-k": (MODEL_OUTPUTS, (256, 384, 512, 640, 768, 1000, 1024), ("randn", "kb", "wide_rows"), (1.0, 1.0)),
}


def problem_models(dtype=torch.float32):
    """Eager's model and ModelNew at the problem's size, the same weights."""
    import reference
    from model_new import GemmMultiplyLeakyReLUModelNew

    init = reference.gemm_multiply_leaky_relu_get_init_inputs()
    torch.manual_seed(0)
    eager = reference.GemmMultiplyLeakyReLUModel(*init).cuda().to(dtype)
    new = GemmMultiplyLeakyReLUModelNew(*init).cuda().to(dtype)
    new.load_state_dict(eager.state_dict())
    return eager, new


def print_kernels(step, calls=5, count=15):
    """step()'s kernels by device time (torch.profiler, after three unmeasured steps): ms and launches per step."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                    key=lambda e: -e.self_device_time_total)
    print(f"kernels: {sum(e.self_device_time_total for e in events) / calls / 1000:.4f} ms per step")
    for e in events[:count]:
        print(f"{e.self_device_time_total / calls / 1000:9.4f} ms x{e.count // calls:<4d} {e.key[:100]}")


def problem(args):
    """Error against float64 beside eager's and time on randn and rand inputs; then one forward's kernels."""
    import copy

    from kernels.precision import relative_error
    from kernels.timing import time_each_ms

    eager, new = problem_models()
    print(f"{'inputs':>6} {'ms':>9} {'eager ms':>9} {'error':>10} {'eager':>10} {'ratio':>6}")
    with torch.no_grad():
        for kind in ("randn", "rand"):
            torch.manual_seed(1)
            x = getattr(torch, kind)(1024, 8192, device="cuda")
            y64 = copy.deepcopy(eager).double()(x.double())
            ours, theirs = relative_error(new(x), y64), relative_error(eager(x), y64)
            ms, eager_ms = time_each_ms([lambda: new(x), lambda: eager(x)])
            print(f"{kind:>6} {ms:9.4f} {eager_ms:9.4f} {ours:10.3e} {theirs:10.3e} {ours / theirs:6.3f}")
        print_kernels(lambda: new(x))


def profile(args):
    """One step's kernels and its time (no L2 flush): the forward (no_grad), bench.py's train step (autograd.grad of
    x, W and b) or its loop step (training_loop_step)."""
    from bench import training_loop_step
    from kernels.timing import time_ms

    _, new = problem_models(DTYPES[args.dtype])
    x = torch.randn(1024, 8192, device="cuda", dtype=DTYPES[args.dtype], requires_grad=args.step != "forward")
    grad = torch.randn(1024, 8192, device="cuda", dtype=x.dtype)
    weight, bias = new.gemm.weight, new.gemm.bias
    step = {"forward": lambda: new(x), "loop": lambda: training_loop_step(new, x),
            "train": lambda: torch.autograd.grad(new(x), [x, weight, bias], grad)}[args.step]
    with torch.set_grad_enabled(args.step != "forward"):
        print_kernels(step)
        print(f"{args.step} step {time_ms(step, samples=30, flush_l2=False):.4f} ms")


def model_gaps(args):
    """A bench.py model's no_grad forward, eager and patched: the synchronized forward's time, the host's time to
    enqueue one (no synchronization), the kernels' busy time and the GPU's idle time between them (torch.profiler),
    the largest idle gaps by the kernels either side, with --kernels the kernels of most time; the patched forward's
    trace, with the host's Python stacks, into --out (chrome://tracing)."""
    import copy

    import bench
    import kernels
    from kernels.timing import time_ms

    name = next(n for n in bench._model_specs() if n.startswith(args.model))
    build, inputs, loss, logits = bench._model_specs()[name]
    torch.manual_seed(0)
    initial = build().cuda().train(not args.eval)  # bench.py's models run in training mode, dropout 0
    batch = inputs(torch.Generator(device="cuda").manual_seed(0))
    for variant in ("eager", "patched"):
        model = copy.deepcopy(initial)
        if variant == "patched":
            kernels.patch(model)

        def forward(model=model):
            with torch.no_grad():
                logits(model, batch)

        for _ in range(3):
            forward()
        torch.cuda.synchronize()
        if args.after_training:  # bench.py times the forward after its training steps
            before_training = time_ms(forward, samples=20, warmup=2, flush_l2=False)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            for _ in range(args.after_training):
                optimizer.zero_grad(set_to_none=True)
                loss(model, batch).backward()
                optimizer.step()
            torch.cuda.synchronize()
            print(f"{name} {variant}: forward {before_training:.3f} ms synchronized before "
                  f"{args.after_training} AdamW steps")
        enqueue = []
        for _ in range(10):
            start = time.perf_counter()
            forward()
            enqueue.append((time.perf_counter() - start) * 1e3)
            torch.cuda.synchronize()
        synchronized = time_ms(forward, samples=20, warmup=2, flush_l2=False)
        if args.host_profile:
            print_host_profile(forward, args.host_profile)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities, with_stack=True) as prof:
            forward()
            torch.cuda.synchronize()
        kernels_ = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                           and e.time_range.elapsed_us() > 0), key=lambda e: e.time_range.start)
        busy = sum(e.time_range.elapsed_us() for e in kernels_) / 1e3
        gaps, busy_until = [], kernels_[0].time_range.end if kernels_ else 0
        for before, after in zip(kernels_, kernels_[1:]):
            if after.time_range.start > busy_until:
                gaps.append((after.time_range.start - busy_until, before, after))
            busy_until = max(busy_until, after.time_range.end)
        idle_ms = sum(g[0] for g in gaps) / 1e3
        mode = "eval" if args.eval else "train"
        print(f"{name} {variant} ({mode} mode): forward {synchronized:.3f} ms synchronized, host enqueue "
              f"{min(enqueue):.3f} ms (median {sorted(enqueue)[len(enqueue) // 2]:.3f}), kernels {busy:.3f} ms, idle "
              f"between them {idle_ms:.3f} ms, {len(kernels_)} kernels", flush=True)
        if args.kernels:
            print_kernels(forward, count=args.kernels)
        if variant == "patched":
            prof.export_chrome_trace(os.path.join(args.out, f"{args.model}_patched_{mode}.json"))
            for idle, before, after in sorted(gaps, key=lambda g: -g[0])[:args.gaps]:
                print(f"  idle {idle:8.1f} us before {after.name[:70]} (after {before.name[:50]})")
        del model
        torch.cuda.empty_cache()


def print_host_profile(step, calls, count=40):
    """The host's Python functions over `calls` calls of step (each synchronized after the profile stops timing it),
    by their own time and by their cumulative time (cProfile)."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    for _ in range(calls):
        profile.enable()
        step()
        profile.disable()
        torch.cuda.synchronize()
    stats = pstats.Stats(profile).strip_dirs()
    print(f"host profile of {calls} calls, by own time:")
    stats.sort_stats("tottime").print_stats(count)
    print("by cumulative time:")
    stats.sort_stats("cumulative").print_stats(count)


def sizes(text):
    """"AxB,CxD..." as [(A, B), (C, D), ...] (any number of sizes per item): the subcommands' shape options."""
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",")]


def draw(kind, m, n, k, g):
    """x, weight and bias of one input kind: randn, rand, wide_rows (randn rows scaled by 10^U(-10, 10)) or kb
    (KernelBench's: rand x, nn.Linear's uniform weight of both signs)."""
    x = (torch.rand if kind in ("rand", "kb") else torch.randn)(m, k, device="cuda", generator=g)
    if kind == "wide_rows":
        x *= torch.pow(10.0, torch.empty(m, 1, device="cuda").uniform_(-10, 10, generator=g))
    weight = (torch.rand(n, k, device="cuda", generator=g) * 2 - 1 if kind == "kb" else
              (torch.rand if kind == "rand" else torch.randn)(n, k, device="cuda", generator=g)) / k ** 0.5
    return x, weight, torch.randn(n, device="cuda", generator=g) * 0.1


def sweep(args):
    """Both paths forced per output size and K: times on the first input kind (L2 flushed), and the worst ratio of the
    split's error to cuBLAS's against float64 over the input kinds."""
    from kernels.functional import gemm_multiply_leaky_relu
    from kernels.gemm.gemm import forced_gemm_path
    from kernels.precision import relative_error
    from kernels.timing import time_each_ms

    outputs, ks, kinds, (multiplier, slope) = SWEEPS[args.subcommand]
    outputs = sizes(args.outputs) if args.outputs else outputs
    ks = [int(k) for k in args.ks.split(",")] if args.ks else ks

    def on(path, x, weight, bias):
        with forced_gemm_path(path), torch.no_grad():
            return gemm_multiply_leaky_relu(x, weight, bias, multiplier, slope)

    print(f"{'m':>6} {'n':>5} {'k':>5} {'split ms':>9} {'cublas ms':>9} {'speedup':>7} {'worst':>9} {'split':>10} "
          f"{'cublas':>10} {'ratio':>6}  (epilogue: x {multiplier}, slope {slope})")
    for m, n in outputs:
        for k in ks:
            g = torch.Generator(device="cuda").manual_seed(0)
            worst = ("", 0.0, 1.0, 0.0)
            for kind in kinds:
                x, weight, bias = draw(kind, m, n, k, g)
                y64 = F.leaky_relu(F.linear(x.double(), weight.double(), bias.double()) * multiplier, slope)
                split, cublas = (relative_error(on(path, x, weight, bias), y64) for path in (SPLIT_PATH, "cublas"))
                if kind == kinds[0]:
                    times = time_each_ms([lambda p=p: on(p, x, weight, bias) for p in (SPLIT_PATH, "cublas")])
                worst = max(worst, (kind, split, cublas, split / cublas), key=lambda w: w[3])
            print(f"{m:>6} {n:>5} {k:>5} {times[0]:9.4f} {times[1]:9.4f} {times[1] / times[0]:7.3f} {worst[0]:>9} "
                  f"{worst[1]:10.3e} {worst[2]:10.3e} {worst[3]:6.3f}", flush=True)


# grad_W's products (out_features x in_features over the batch's rows): BERT/GPT-2 and ViT-B layers at 12608 and
# 4096-8192 rows, and outputs around split_pays_off's smallest.
SPLIT_K_SHAPES = ((1024, 1024, 8192), (1024, 1024, 4096), (768, 3072, 12608), (3072, 768, 12608), (768, 768, 12608),
                  (768, 768, 8192), (768, 768, 4096), (512, 1024, 12608), (512, 512, 12608), (2304, 768, 12608),
                  (3072, 1024, 4096), (4096, 1024, 8192))
SPLIT_K_SLICES = (1, 2, 3, 4, 5, 6, 8)  # the slice counts forced; stream-K is timed after them


def slices_name(slices):
    return "stream" if slices < 0 else str(slices)


def split_k(args):
    """grad_W through the backward op on the split path with K split into S slices or by stream-K (forced, then
    split_gemm_k_slices's choice "auto") against eager's grad_pre.t().mm(x): times, errors against float64, whether two
    runs agree bit for bit. With --forwards, the forward op's products of those (rows x in x out) instead, against
    eager's x @ w.t() (the output m x n over k)."""
    from kernels.gemm.gemm import STREAM_K, forced_gemm_path, forced_k_slices
    from kernels.precision import relative_error
    from kernels.timing import time_each_ms

    backward = torch.ops.kernels.gemm_multiply_leaky_relu_backward
    forward = torch.ops.kernels.gemm_multiply_leaky_relu.default
    slice_counts = (*SPLIT_K_SLICES, STREAM_K)
    # (output rows, output columns, reduction) of each product
    products = [(m, n, k) for m, k, n in sizes(args.forwards)] if args.forwards else SPLIT_K_SHAPES
    print(f"{'n':>5} {'k':>5} {'m':>6} {'auto':>6} {'eager':>7} "
          + " ".join(f"{'S=' + slices_name(s):>8}" for s in slice_counts)
          + f" {'S=auto':>8} {'speedup':>7} {'inputs':>6} {'ours':>9} {'eager':>9} {'bits':>4}"
          + ("  (forwards: n = rows, k = out, m = in)" if args.forwards else ""))
    for n, k, m in products:
        torch.manual_seed(0)
        if not args.forwards:  # the backward op's weight and grad_bias placeholders (grad_W reads neither)
            weight, empty = torch.empty(n, k, device="cuda"), torch.empty(0, device="cuda")
        for kind in ("randn", "rand"):
            if args.forwards:  # y (n x k) = x (n x m) w^T, w (k x m)
                x, w = getattr(torch, kind)(n, m, device="cuda"), getattr(torch, kind)(k, m, device="cuda")

                def ours(s, x=x, w=w):
                    with forced_gemm_path(SPLIT_PATH), forced_k_slices(s), torch.no_grad():
                        return forward(x, w, None, 1.0, 1.0, False)[0]

                def eager(x=x, w=w):
                    return x @ w.t()

                reference = x.double() @ w.double().t()
            else:
                grad_pre, x = getattr(torch, kind)(m, n, device="cuda"), getattr(torch, kind)(m, k, device="cuda")

                def ours(s, grad_pre=grad_pre, x=x):
                    with forced_gemm_path(SPLIT_PATH), forced_k_slices(s):
                        return backward(grad_pre, x, weight, empty, 1.0, 1.0, False, True, False)[1]

                def eager(grad_pre=grad_pre, x=x):
                    return grad_pre.t().mm(x)

                reference = grad_pre.double().t() @ x.double()
            if kind == "randn":
                row = time_each_ms([eager] + [lambda s=s: ours(s) for s in (*slice_counts, 0)])
            result, again = ours(0), ours(0)
            bits = "same" if torch.equal(result.view(torch.int32), again.view(torch.int32)) else "DIFF"
            print(f"{n:>5} {k:>5} {m:>6} {slices_name(torch.ops.kernels._gemm_k_slices(n, k, m)):>6} "
                  + f"{row[0]:7.4f} " + " ".join(f"{t:8.4f}" for t in row[1:]) + f" {row[0] / row[-1]:7.3f} {kind:>6} "
                  f"{relative_error(result, reference):9.3e} {relative_error(eager(), reference):9.3e} "
                  f"{bits:>4}", flush=True)


# (rows, in_features, out_features): the models' products whose speedup is lowest (kernels/gemm/NOTES.md).
PRODUCT_SHAPES = ((4096, 1024, 1024), (8192, 1024, 1024), (4096, 1024, 3072))


def products(args):
    """The forward's, grad_x's and grad_W's products of a linear layer, each through the library's op on the path it
    takes, against eager's product (L2 flushed), then each call's kernels (with KERNELS_DEPENDENT_LAUNCH=0: else each
    kernel's time includes its wait on the one before); and x's row split against a copy, a read and a write of the
    same matrix (the pass's floor at these sizes)."""
    import kernels.functional  # noqa: F401 (the op library)
    from kernels.timing import time_each_ms

    forward = torch.ops.kernels.gemm_multiply_leaky_relu.default
    backward = torch.ops.kernels.gemm_multiply_leaky_relu_backward
    shapes = sizes(args.shapes) if args.shapes else PRODUCT_SHAPES
    for m, k, n in shapes:
        torch.manual_seed(0)
        x, grad = torch.randn(m, k, device="cuda"), torch.randn(m, n, device="cuda")
        w, empty = torch.randn(n, k, device="cuda") / k ** 0.5, torch.empty(0, device="cuda")
        if args.weight_transposed:  # stored (in, out) as Conv1D's and read through its transposed view
            w = w.t().contiguous().t()
        calls = {"forward": (lambda: forward(x, w, None, 1.0, 1.0, False), lambda: x @ w.t()),
                 "grad_x": (lambda: backward(grad, x, w, empty, 1.0, 1.0, True, False, False), lambda: grad @ w),
                 "grad_W": (lambda: backward(grad, x, w, empty, 1.0, 1.0, False, True, False), lambda: grad.t() @ x)}
        for product, (ours, eager) in calls.items():
            ours_ms, eager_ms = time_each_ms([ours, eager], samples=40)
            print(f"{m} x {k} -> {n} {product}: {ours_ms * 1e3:.1f} us against eager's {eager_ms * 1e3:.1f} "
                  f"({eager_ms / ours_ms:.3f}x)")
            print_kernels(ours, count=8)
        out = torch.empty_like(x)
        floor = {"x's row split": lambda: torch.ops.kernels._gemm_split_sweep(x, "rows"), "copy": lambda: out.copy_(x),
                 "read (sum)": lambda: x.sum(), "write (fill)": lambda: out.fill_(1.0)}
        times = time_each_ms(list(floor.values()), samples=40)
        print(f"{m} x {k}: " + ", ".join(f"{name} {ms * 1e3:.1f} us" for name, ms in zip(floor, times)), flush=True)
        del x, grad, w, out
        torch.cuda.empty_cache()


# Forwards of the models' linear layers (m, k, n): ViT-B/16's projection, qkv, fc1 and fc2 at batch 64, BERT-large's at
# 16 x 512 tokens, the LLaMA-style model's attention projections at 8 x 512.
ORIENTATION_SHAPES = ((12608, 768, 768), (12608, 768, 2304), (12608, 768, 3072), (12608, 3072, 768),
                      (8192, 1024, 1024), (8192, 1024, 3072), (8192, 1024, 4096), (8192, 4096, 1024),
                      (4096, 2048, 2048))


def orientation(args):
    """A linear layer's forward (with bias, no activation) on split_fp16 in both orientations, against eager's (L2
    flushed): as it is and computed transposed (y^T = w x^T; the kernel writes y where n % 4 == 0), each from the
    weight's split kept (where the shape keeps one: its chunk split, or its row split) and split anew; each with its
    error against float64."""
    from kernels.functional import gemm_multiply_leaky_relu
    from kernels.gemm.gemm import forced_gemm_path, forced_transposed
    from kernels.precision import relative_error
    from kernels.timing import time_each_ms

    for m, k, n in sizes(args.shapes) if args.shapes else ORIENTATION_SHAPES:
        torch.manual_seed(0)
        x, bias = torch.randn(m, k, device="cuda"), torch.randn(n, device="cuda")
        w = torch.randn(n, k, device="cuda") / k ** 0.5
        y64 = torch.nn.functional.linear(x.double(), w.double(), bias.double())
        splits = {}
        for mode in (-1, 1):
            with forced_gemm_path(SPLIT_PATH), forced_transposed(mode), torch.no_grad():
                splits[mode] = torch.ops.kernels.gemm_weight_split(x, w)

        def ours(mode, weight_split=None):
            def call():
                with forced_gemm_path(SPLIT_PATH), forced_transposed(mode), torch.no_grad():
                    return gemm_multiply_leaky_relu(x, w, bias, 1.0, 1.0, weight_split)
            return call

        calls = {"eager": lambda: torch.nn.functional.linear(x, w, bias), "as it is, split anew": ours(-1),
                 "transposed, split anew": ours(1)}
        for mode, name in ((-1, "as it is, split kept"), (1, "transposed, split kept")):
            if splits[mode]:
                calls[name] = ours(mode, splits[mode])
        times = dict(zip(calls, time_each_ms(list(calls.values()), samples=40)))
        print(f"{m} x {k} -> {n}: " + ", ".join(
            f"{name} {ms * 1e3:.1f} us ({times['eager'] / ms:.3f}x, error {relative_error(calls[name](), y64):.2e})"
            for name, ms in times.items()), flush=True)
        del x, w, bias, y64, splits
        torch.cuda.empty_cache()


def coherence(args):
    """The part of a linear layer's error that every row shares (nn.Linear's weights; rand, rand - 0.5 and randn x),
    ours against eager: normwise error, the error of the mean over rows, and ||mean error|| sqrt(rows) / ||error||
    (about 1/sqrt(rows) where rows' errors are independent, 1 where they share one)."""
    from kernels.functional import linear
    from kernels.precision import relative_error

    print(f"{'shape':>20} {'inputs':>8} {'ours':>9} {'eager':>9} {'mean ours':>9} {'mean eager':>10} "
          f"{'coherence ours':>14} {'eager':>6}")
    for m, k, n in ((16384, 768, 2304), (4096, 1024, 1024), (8192, 4096, 4096), (16384, 256, 4096)):
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
                    figures += [relative_error(y, y64), float(error.mean(0).norm() / y64.mean(0).norm()),
                                float(error.mean(0).norm() * m ** 0.5 / error.norm())]
            print(f"{str((m, k, n)):>20} {kind:>8} {figures[0]:9.3e} {figures[3]:9.3e} {figures[1]:9.3e} "
                  f"{figures[4]:10.3e} {figures[2]:14.2f} {figures[5]:6.2f}", flush=True)
            del x, y64


def variants(args):
    """Each version built in a copy of the repository with --file replaced, then --command run there (default: this
    tool at the problem's size, on --path where given) --repeat times; the working tree's own version first, as
    `current`. The copies share one extensions folder (builds are named by their sources' hash); a name may come again
    (a=F b=G a=F: the versions' runs interleaved)."""
    command = args.command or shlex.join([sys.executable, "tools/gemm_sweep.py", *(["--path", args.path] if args.path
                                                                                    else [])])
    if any("=" not in v or len(v.split("=", 1)[1].split(",")) != len(args.file) for v in args.versions):
        sys.exit("each version is NAME=FILE[,FILE...], one file per --file")
    root = tempfile.mkdtemp(prefix="variants_")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=os.path.join(root, "extensions"), PYTHONUNBUFFERED="1")
    for index, (name, path) in enumerate([("current", None)] + [tuple(v.split("=", 1)) for v in args.versions]):
        copy = os.path.join(root, f"{index}_{name}")
        shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".git", ".variants", ".whl", "__pycache__"))
        for replacement, replaced in zip(path.split(","), args.file) if path else ():
            shutil.copyfile(os.path.join(REPO, replacement), os.path.join(copy, replaced))
        start = time.time()
        built = subprocess.run([sys.executable, "-c", "import kernels.functional"], cwd=copy, env=env,
                               capture_output=True, text=True)
        print(f"=== {name} ({path or ', '.join(args.file)}): build {time.time() - start:.1f} s"
              + ("" if built.returncode == 0 else f" FAILED\n{built.stderr[-3000:]}"), flush=True)
        for _ in range(args.repeat if built.returncode == 0 else 0):
            status = subprocess.run(command, shell=True, cwd=copy, env=env).returncode
            if status != 0:
                print(f"=== {name}: the command exited with status {status}", flush=True)


# The MLPs' first layers with a GELU (m, k, n, weight stored transposed): BERT-large and ViT-B/16 at bench.py's batches
# (nn.Linear), GPT-2-medium (Conv1D, (in, out)).
GELU_SHAPES = ((8192, 1024, 4096, False), (12608, 768, 3072, False), (4096, 1024, 4096, True))


def gelu(args):
    """An MLP's first layer and its GELU without a gradient (the weight's split kept, as FusedLinear keeps it):
    eager's nn.Linear then nn.GELU, the library's product then the GELU's op, and gemm_gelu (the GELU in the
    epilogue): times and errors against float64."""
    from kernels.functional import gemm_gelu, gemm_multiply_leaky_relu
    from kernels.gemm.gemm import _gelu_of
    from kernels.precision import relative_error
    from kernels.timing import time_each_ms

    print(f"{'m':>6} {'k':>5} {'n':>5} {'W':>4} {'approx':>6} {'eager':>7} {'two ops':>7} {'fused':>7} {'vs eager':>8} "
          f"{'vs two':>6} {'eager err':>9} {'fused err':>9}")
    for m, k, n, transposed in GELU_SHAPES:
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda")
        stored = torch.randn(k, n, device="cuda") if transposed else torch.randn(n, k, device="cuda")
        weight, bias = (stored.t() if transposed else stored) / k ** 0.5, torch.randn(n, device="cuda")
        approximate = "tanh" if transposed else "none"  # GPT-2's NewGELU, BERT's and ViT's nn.GELU
        split = [] if transposed else torch.ops.kernels.gemm_weight_split(x, weight)
        with torch.no_grad():
            calls = [lambda: F.gelu(F.linear(x, weight, bias), approximate=approximate),
                     lambda: _gelu_of(gemm_multiply_leaky_relu(x, weight, bias, 1.0, 1.0, split or None),
                                      approximate),
                     lambda: gemm_gelu(x, weight, bias, approximate, split or None)]
            times = time_each_ms(calls)
            y64 = F.gelu(F.linear(x.double(), weight.double(), bias.double()), approximate=approximate)
            errors = [relative_error(call(), y64) for call in (calls[0], calls[2])]
        print(f"{m:>6} {k:>5} {n:>5} {'k n' if transposed else 'n k':>4} {approximate:>6} "
              + " ".join(f"{t:7.4f}" for t in times)
              + f" {times[0] / times[2]:7.3f}x {times[1] / times[2]:5.3f}x {errors[0]:9.3e} {errors[1]:9.3e}",
              flush=True)


def gelu_training(args):
    """An MLP's first layer and its GELU while training, at GELU_SHAPES' nn.Linear sizes: the forward that keeps the
    GELU's input (the product then F.gelu, against _gemm_gelu_with_pre: the pre-activation written by the GEMM's
    epilogue) and the backward (eager's gelu_backward then the product's gradients, against gemm_gelu_backward: the
    GELU's gradient made by grad_x's row split): median times and their ratio."""
    from kernels.functional import gemm_multiply_leaky_relu
    from kernels.timing import time_each_ms

    backward = torch.ops.kernels.gemm_multiply_leaky_relu_backward
    print(f"{'m':>6} {'k':>5} {'n':>5} {'forward: two':>12} {'one':>7} {'ratio':>6} {'backward: two':>13} {'one':>7} "
          f"{'ratio':>6}")
    for m, k, n, transposed in GELU_SHAPES:
        if transposed:  # GPT-2's tanh GELU stays two ops (kernels/gemm/NOTES.md)
            continue
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda")
        weight, bias = torch.randn(n, k, device="cuda") / k ** 0.5, torch.randn(n, device="cuda")
        grad = torch.randn(m, n, device="cuda")
        none = torch.empty(0, device="cuda")
        with torch.no_grad():
            pre = gemm_multiply_leaky_relu(x, weight, bias, 1.0, 1.0)
            calls = [lambda: F.gelu(gemm_multiply_leaky_relu(x, weight, bias, 1.0, 1.0)),
                     lambda: torch.ops.kernels._gemm_gelu_with_pre(x, weight, bias, "none"),
                     lambda: backward(torch.ops.aten.gelu_backward(grad, pre), x, weight, none, 1.0, 1.0, True, True,
                                      True),
                     lambda: torch.ops.kernels.gemm_gelu_backward(grad, x, weight, pre, "none", True, True, True)]
            times = time_each_ms(calls)
        print(f"{m:>6} {k:>5} {n:>5} {times[0]:12.4f} {times[1]:7.4f} {times[0] / times[1]:5.3f}x {times[2]:13.4f} "
              f"{times[3]:7.4f} {times[2] / times[3]:5.3f}x", flush=True)


# A probe of HBM's read rate by the order of its reads (read_layout): no kernel of the library, so kept here.
READ_PROBE_SOURCE = r"""
// Reads `tiles` tiles of hi and lo (each tile 128 rows x k halves) as the Hopper kernel's CTAs read w's split: CTA c
// takes tiles c, c + gridDim.x, ...; per chunk of 64 along k, a 128 x 64 box of each. by_box 0: w's rows as they are
// (a box's 128 rows of 128 bytes lie 2k bytes apart); 1: each box's 16 KB stored together, box after box. 16 loads
// of 16 bytes in flight a thread (64 KB a CTA), XORed into a value stored only if it cannot be, so none is dropped.
__global__ void __launch_bounds__(256) read_boxes(const int4* __restrict__ hi, const int4* __restrict__ lo,
                                                  int k, int tiles, int by_box, int* sink) {
  const int chunks = k / 64;
  int acc = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    for (int chunk = 0; chunk < chunks; chunk += 2) {
      int4 v[16];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int piece = threadIdx.x + j * 256, row = piece / 8, unit = piece % 8;
          const long long at = by_box ? ((long long)tile * chunks + chunk + c) * 1024 + piece
                                      : ((long long)tile * 128 + row) * (k / 8) + (chunk + c) * 8 + unit;
          v[c * 8 + j] = __ldg(hi + at);
          v[c * 8 + 4 + j] = __ldg(lo + at);
        }
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) acc ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
    }
  }
  if (acc == 0x7fffffff) sink[0] = acc;
}

void read_boxes_launch(at::Tensor hi, at::Tensor lo, int64_t k, int64_t tiles, int64_t by_box, int64_t grid,
                       at::Tensor sink) {
  read_boxes<<<grid, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const int4*>(hi.data_ptr()), reinterpret_cast<const int4*>(lo.data_ptr()), k, tiles, by_box,
      sink.data_ptr<int>());
}
"""


def read_layout(args):
    """HBM's read rate by the order of the reads, at the weights of 1_MLP's and 2_ShallowWideMLP's layers (n x k,
    w's split: two fp16 arrays): a probe kernel reading them box by box as the Hopper kernel's CTAs do (128 or 132
    CTAs), from w's rows as they are and from boxes stored together; torch's sum and copy of the same bytes alike.
    TB/s over the bytes read (a copy's: read and written), medians, L2 flushed."""
    from torch.utils.cpp_extension import load_inline
    from kernels.timing import time_each_ms

    declaration = ("void read_boxes_launch(at::Tensor hi, at::Tensor lo, int64_t k, int64_t tiles, int64_t by_box, "
                   "int64_t grid, at::Tensor sink);")
    headers = "#include <ATen/ATen.h>\n#include <ATen/cuda/CUDAContext.h>\n"
    probe = load_inline("read_probe", cpp_sources=[declaration], cuda_sources=[headers + READ_PROBE_SOURCE],
                        functions=["read_boxes_launch"], extra_cuda_cflags=["-O3"])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    print(f"{'n x k':>14} {'read':>34} {'ms':>8} {'TB/s':>6}")
    for n, k in ((16384, 16384), (32768, 32768)):
        hi = torch.randint(-2 ** 15, 2 ** 15, (n, k), dtype=torch.int16, device="cuda")
        lo = torch.randint(-2 ** 15, 2 ** 15, (n, k), dtype=torch.int16, device="cuda")
        read_bytes = 2 * hi.numel() * 2
        tiles = n // 128
        cases = {}
        for grid in sorted({min(tiles, sms), min(tiles, 128)}):
            for by_box in (0, 1):
                name = ("boxes stored together" if by_box else "w's rows as they are") + f", {grid} CTAs"
                cases[name] = (lambda grid=grid, by_box=by_box: probe.read_boxes_launch(hi, lo, k, tiles, by_box,
                                                                                        grid, sink), read_bytes)
        flat = hi.view(-1)
        cases["torch: sum of hi and lo"] = (lambda: (flat.sum(dtype=torch.int32), lo.view(-1).sum(dtype=torch.int32)),
                                            read_bytes)
        copy = torch.empty_like(hi)
        cases["torch: copy of hi"] = (lambda: copy.copy_(hi), 2 * hi.numel() * 2)
        times = time_each_ms([fn for fn, _ in cases.values()], samples=20)
        for (name, (_, nbytes)), ms in zip(cases.items(), times):
            print(f"{n:>6} x {k:<5} {name:>34} {ms:8.4f} {nbytes / ms / 1e9:6.3f}", flush=True)
        del hi, lo, copy
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", help="every call forced onto this path: cublas, split_fp16, split_fp16_sm80")
    subcommands = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")

    def add(name, function, summary):
        sub = subcommands.add_parser(name, help=summary, description=function.__doc__)
        sub.set_defaults(function=function)
        return sub

    add("problem", problem, "the problem's size: error, time, one forward's kernels (the default)")
    sub = add("profile", profile, "one step's kernels and time: the forward, or bench.py's train or loop step")
    sub.add_argument("step", choices=["forward", "train", "loop"])
    sub.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    for name, summary in (("k-sweep", "per K at 512 x 512"), ("shapes", "over output sizes at K 1024-8192"),
                          ("small-k", "at real models' outputs, K 256-1024, identity epilogue")):
        sub = add(name, sweep, f"both paths' time and error {summary}")
        sub.add_argument("--outputs", metavar="MxN[,MxN...]", help="these output sizes instead")
        sub.add_argument("--ks", metavar="K[,K...]", help="these K instead")
    sub = add("model-gaps", model_gaps, "a bench.py model's no_grad forward: host enqueue time, GPU busy and idle")
    sub.add_argument("model", choices=["LLaMA", "BERT", "ViT", "GPT-2"])
    sub.add_argument("--gaps", type=int, default=20, help="the largest idle gaps to list (20)")
    sub.add_argument("--kernels", type=int, default=0, metavar="N", help="also the N kernels of most device time")
    sub.add_argument("--eval", action="store_true", help="the model in eval mode (bench.py's is in training mode)")
    sub.add_argument("--host-profile", type=int, default=0, metavar="CALLS",
                     help="also each forward's Python functions over CALLS calls (cProfile)")
    sub.add_argument("--after-training", type=int, default=0, metavar="STEPS",
                     help="time the forward also before these AdamW steps, the rest after them (bench.py's order)")
    sub.add_argument("--out", default=os.environ.get("OUT", "/tmp"), help="folder for the trace ($OUT, else /tmp)")
    sub = add("split-k", split_k, "grad_W's product at small outputs over long reductions, per slices of K")
    sub.add_argument("--forwards", metavar="MxKxN[,MxKxN...]",
                     help="the forwards of these (rows x in x out) instead (ViT-B/16's fc2: 12608x3072x768)")
    sub = add("products", products, "a linear layer's three products at the models' slowest shapes, and their kernels")
    sub.add_argument("--shapes", metavar="MxKxN[,MxKxN...]", help="these (rows x in x out) instead")
    sub.add_argument("--weight-transposed", action="store_true",
                     help="the weight stored (in x out), as transformers' Conv1D keeps it (GPT-2's layers)")
    add("coherence", coherence, "the part of a linear layer's error every row shares")
    sub = add("orientation", orientation, "a linear layer's forward as it is and computed transposed, at model shapes")
    sub.add_argument("--shapes", metavar="MxKxN[,MxKxN...]", help="these (rows x in x out) instead")
    add("gelu", gelu, "an MLP's first layer and GELU without a gradient: eager, two ops, gemm_gelu")
    add("gelu-training", gelu_training, "an MLP's first layer and GELU while training: two steps against one op each")
    add("read-layout", read_layout, "HBM's read rate for w's split read box by box, as stored and box after box")
    sub = add("variants", variants, "versions of kernel files, each built in a copy of the repository, timed")
    sub.add_argument("--file", required=True, action="append", help="a file the versions replace (repo-relative)")
    sub.add_argument("--command", help="run in each copy instead of this tool at the problem's size")
    sub.add_argument("--repeat", type=int, default=2, help="runs of the command per version (2)")
    sub.add_argument("versions", nargs="*", metavar="NAME=FILE[,FILE...]", help="one replacement per --file")
    args = parser.parse_args()
    function = getattr(args, "function", problem)
    if function is variants:  # only starts other processes
        return variants(args)
    print(torch.cuda.get_device_name(0))
    if args.path:
        from kernels.gemm.gemm import forced_gemm_path

        global SPLIT_PATH
        SPLIT_PATH = args.path if args.path.startswith("split") else SPLIT_PATH
        print("every call forced onto the", args.path, "path")
        with forced_gemm_path(args.path):
            return function(args)
    return function(args)


if __name__ == "__main__":
    main()
