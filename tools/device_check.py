"""The checks and measurements of the GPU machine, one subcommand each (`SUBCOMMAND --help` says what it runs).

    python tools/device_check.py all            # build, tests, sanitize, bench: the whole single-GPU run
    python tools/device_check.py tests --quick -k gemm

Each writes into --out (default: $OUT, else /tmp/device_check), its whole output also into
device_check_<subcommand>.log there, and exits 1 where a step failed, naming it. SKIP_TESTS, SKIP_SANITIZE,
SKIP_BENCH, BENCH_ARGS and BENCH_RUNS set flags' defaults. Missing matplotlib or pytest-xdist is installed from the
wheels in .whl/, if carried, into /tmp/site.
"""

import argparse
import collections
import contextlib
import glob
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from kernels.env import env_flag  # noqa: E402  (pure Python: builds nothing)

PYTHON = sys.executable
IMPORT_LIBRARY = [PYTHON, "-c", "import kernels.functional"]
# The programs this runner starts (tools/checks/): not entry points of their own.
CASES, DDP_CHECK, TP_CHECK, ARCHITECTURES_CHECK = (
    f"tools/checks/{name}.py" for name in ("sanitize_cases", "ddp_check", "tp_check", "architectures_check"))
TORCHRUN = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
SMOKE_TEST_LIMIT_S = 180  # a pipeline that deadlocks hangs
WHEEL_SITE = "/tmp/site"  # where the wheels carried in .whl/ are installed, outside the repository
Ran = collections.namedtuple("Ran", "status lines timed_out")


class Tee:
    """The terminal and the subcommand's log, written together."""

    def __init__(self, *files):
        self.files = files

    def write(self, text):
        for f in self.files:
            f.write(text)
            f.flush()

    def flush(self):
        pass


def run(command, log=None, show=True, limit_s=None, env=None):
    """`command` in the repository root, stdout and stderr together into the file `log` and, where `show`, printed;
    SIGKILL to it and its children after `limit_s` seconds. `env`: variables set on top of this process's."""
    try:  # a session of its own, so that a time limit or Ctrl-C ends its children too
        process = subprocess.Popen(command, cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    except FileNotFoundError:
        print(f"{command[0]}: not found")
        return Ran(127, [], False)
    expired = threading.Event()

    def end():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)

    timer = threading.Timer(limit_s or 0, lambda: (expired.set(), end()))
    if limit_s:
        timer.start()
    lines = collections.deque(maxlen=200)  # the tail kept in memory; the whole output is in `log`
    try:
        with open(log or os.devnull, "w", encoding="utf-8") as log_file:
            for line in process.stdout:
                log_file.write(line)
                lines.append(line.rstrip("\n"))
                if show:
                    sys.stdout.write(line)
        status = process.wait()
    except KeyboardInterrupt:
        end()
        raise
    finally:
        timer.cancel()
    return Ran(128 - status if status < 0 else status, lines, expired.is_set())


def step(name, command, tail=0, **options):
    """run(command, **options), its last `tail` lines shown; [name] where it failed (saying how), else []."""
    ran = run(command, **options)
    for line in list(ran.lines)[-tail:] if tail else ():
        print(line)
    if ran.status == 0:
        return []
    print(f"== {name}: FAILED ({'timed out' if ran.timed_out else f'exit status {ran.status}'})")
    return [name]


def importable(module):
    return subprocess.run([PYTHON, "-c", f"import {module}"], cwd=REPO, capture_output=True).returncode == 0


def ensure_module(module):
    """Where `module` does not import, installs the wheels in .whl/ (the GPU machine has no network) into WHEEL_SITE,
    first on PYTHONPATH for every process started from here. Whether it imports then."""
    wheels = sorted(glob.glob(os.path.join(REPO, ".whl", "*.whl")))
    if importable(module):
        return True
    if not wheels:
        return False
    print(f"{module} is missing: installing {len(wheels)} wheels from .whl/ into {WHEEL_SITE}")
    if not run([PYTHON, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target",
                WHEEL_SITE, *wheels]).status:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (WHEEL_SITE, os.environ.get("PYTHONPATH")) if p)
    if not importable(module):
        print(f"{module} is still missing: no wheel of it in .whl/")
        return False
    return True


def print_versions():
    run([PYTHON, "-c", "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, "
                       "'devices', torch.cuda.device_count())"])
    print(f"CPUs: {len(os.sched_getaffinity(0))}")


def timed(label, command, **options):
    start = time.time()
    failed = step(label, command, **options)
    print(f"{label}: {time.time() - start:.2f} s")
    return failed


# --- subcommands; each returns the names of its steps that failed


def build(args):
    """A cold build into a fresh $TORCH_EXTENSIONS_DIR and warm imports, timed (ninja's seconds per target), then the
    smoke test (cases)."""
    run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.sm", "--format=csv,noheader"])
    print_versions()
    # A cold build whatever is cached elsewhere; `all`'s later steps load this build.
    build_root = os.environ["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="device_check_build_")
    failed = timed(f"cold build + import into {build_root} (python and torch's start-up included)", IMPORT_LIBRARY)
    for ninja_log in sorted(glob.glob(os.path.join(build_root, "*", ".ninja_log"))):
        print(f"  {os.path.basename(os.path.dirname(ninja_log))}")
        with open(ninja_log) as f:  # per target: start and end in ms
            for fields in (line.split() for line in list(f)[1:]):
                if len(fields) >= 4 and not fields[3].endswith(".so"):
                    print(f"    {fields[3]:<10} {(int(fields[1]) - int(fields[0])) / 1000:5.1f} s")
    timed("warm import in a new process", IMPORT_LIBRARY)
    run([PYTHON, "-c", "import time, torch\nstart = time.perf_counter(); import kernels.functional\n"
                       "print(f'warm import of kernels after torch: {time.perf_counter() - start:.2f} s')"])
    timed("python + torch + CUDA start-up alone", [PYTHON, "-c", "import torch; torch.cuda.init()"])
    return failed or cases(args)


def cases(args):
    """Every CUDA kernel once on small shapes against eager (tools/checks/sanitize_cases.py): the smoke test."""
    print(f"== smoke test ({CASES})")
    return step("smoke test", [PYTHON, CASES], limit_s=SMOKE_TEST_LIMIT_S)


# A line of pytest -v's output that names a failed test, as it ends (under xdist: "[gw3] [ 12%] FAILED tests/...").
FAILED_LINE = re.compile(r"^(\[gw\d+\] \[ *\d+%\] )?(FAILED|ERROR) ")


def tests(args):
    """python -m pytest -v -rfEs --durations=30 tests (--quick: -m "not slow") on one build made first, each test
    stopped after --test-timeout seconds where pytest-timeout is installed (a hang named, not only a time limit).
    Other arguments go to pytest, and test paths among them run instead of tests/. Output in pytest.log, one line per
    test as it ends, so that a run cut short by --time-limit still names its failures; shown: the failed tests, then
    the last 40 lines."""
    ensure_module("xdist")
    timeout = bool(args.test_timeout) and importable("pytest_timeout")
    names_tests = any(not a.startswith("-") and os.path.exists(os.path.join(REPO, a.split("::")[0]))
                      and a.split("::")[0].startswith("tests") for a in args.extra)
    command = [PYTHON, "-m", "pytest", "-v", "-rfEs", "--durations=30",
               *(["--timeout", str(args.test_timeout)] if timeout else []),
               *(["-m", "not slow"] if args.quick else []), *args.extra, *([] if names_tests else ["tests"])]
    failed = step("build", IMPORT_LIBRARY)  # once: the workers load it instead of waiting on one another's build
    if failed:
        return failed
    log = os.path.join(args.out, "pytest.log")
    print(f"== tests: {shlex.join(['python', *command[1:]])} (output in pytest.log)")
    failed = step("tests", command, log=log, show=False, limit_s=args.time_limit)
    with open(log, errors="replace") as f:
        lines = f.read().splitlines()
    named = list(dict.fromkeys(line for line in lines if FAILED_LINE.match(line)))
    print("\n".join(named[:100] + lines[-40:]))
    return failed


def case_groups():
    """The names of sanitize_cases.py's groups of cases (its CASES dict), read from its source: importing it builds the
    library."""
    import ast

    with open(CASES) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CASES" for t in node.targets):
            return [key.value for key in node.value.keys]
    return []


def sanitize(args):
    """compute-sanitizer's memcheck, racecheck, initcheck and synccheck over the cases, each into
    sanitize_<tool>.log, on a build with KERNELS_LINEINFO=1 (source lines in the reports)."""
    lineinfo = {"KERNELS_LINEINFO": "1"}
    failed = step("sanitize build", IMPORT_LIBRARY, env=lineinfo)
    for tool in () if failed else ("memcheck", "racecheck", "initcheck", "synccheck"):
        # The library's kernels only (namespace kernels::), but for initcheck, which must see the writes of torch's
        # kernels (randn, copies) or every input reads as uninitialized. initcheck does not track TMA stores' writes:
        # the split GEMM takes its plain-store epilogue under it (tests/test_gemm_split.py pins both to the same bits).
        initcheck = tool == "initcheck"
        log = os.path.join(args.out, f"sanitize_{tool}.log")
        ran = run(["compute-sanitizer", "--tool", tool, *([] if initcheck else ["--kernel-regex", "kns=kernels"]),
                   "--target-processes", "all", "--error-exitcode", "86", PYTHON, CASES, *getattr(args, "cases", [])],
                  log=log, show=False, env=dict(lineinfo, KERNELS_GEMM_PLAIN_STORES="1" if initcheck else ""))
        summaries = [line for line in ran.lines if re.search("ERROR SUMMARY|RACECHECK SUMMARY", line)]
        print(f"{tool}: exit {ran.status}; {summaries[-1].strip() if summaries else ''}")
        if ran.status != 0:
            failed.append(f"sanitize {tool}")
            print("\n".join(list(ran.lines)[-20:]))
    return failed


def print_speedups_over_runs(paths, floor):
    """ModelNew's speedup per row over runs (`bench.py --json` files, in run order), its lowest, and the rows whose
    lowest is under `floor` or that a run lacks."""
    speedups = {}  # (problem, case, variant) -> one speedup per run
    for path in paths:
        with open(path) as f:
            for row in json.load(f)["rows"]:
                if row["variant"].startswith("ModelNew"):
                    speedups.setdefault((row["problem"], row["case"], row["variant"]), []).append(row["speedup"])
    below = []
    for (problem, case, variant), values in speedups.items():
        runs = " ".join(f"{v:6.3f}" for v in values)
        print(f"{problem:34} {case:36} {variant:24} {runs}  min {min(values):.3f}{' <' if min(values) < floor else ''}")
        if min(values) < floor or len(values) < len(paths):
            below.append(f"{problem}: {case} ({variant})")
    print(f"\n{len(speedups)} ModelNew rows over {len(paths)} runs; under {floor} or missing from a run: "
          + (", ".join(below) or "none"))


def bench(args):
    """bench.py --json bench.json --plot bench.png --markdown bench.md (other arguments go to bench.py); --runs N:
    N - 1 runs more (bench<N>.json), then ModelNew's speedup per row over them; --summarize: that alone."""
    if args.summarize:
        print_speedups_over_runs(args.summarize, args.floor)
        return []
    ensure_module("matplotlib")
    bench_args = shlex.split(args.bench_args) + args.extra
    paths = [os.path.join(args.out, f"bench{n if n > 1 else ''}.json") for n in range(1, args.runs + 1)]
    failed = []
    for n, path in enumerate(paths, 1):
        outputs = ["--plot", os.path.join(args.out, "bench.png"), "--markdown", os.path.join(args.out, "bench.md")]
        print(f"== bench run {n} of {args.runs} (output in {os.path.basename(path)[:-5]}.log)")
        failed += step(f"bench run {n}", [PYTHON, "bench.py", *bench_args, "--json", path, *(outputs if n == 1 else [])],
                       log=path[:-5] + ".log", show=n == 1)
    written = [path for path in paths if os.path.exists(path)]
    if args.runs > 1 and written:
        print_speedups_over_runs(written, args.floor)
    return failed


def multi_gpu(args):
    """The 2-GPU run, NVLink multicast off: one build, tests/test_multi_gpu.py, the ddp and tp checks alone for their
    per-rank lines, the peak-memory tests; each part into <part>.log under a time limit."""
    from tests.distributed_helpers import NO_NVLINK_MULTICAST

    os.environ.update(NO_NVLINK_MULTICAST)  # in every process started from here
    run(["nvidia-smi"])
    run(["nvidia-smi", "topo", "-m"])
    print_versions()
    ensure_module("xdist")
    pytest = [PYTHON, "-m", "pytest", "-q", "-rs"]
    parts = {"build": (600, IMPORT_LIBRARY),  # once, so that the tests and ranks load it instead of racing to build
             "pytest_multi_gpu": (1200, [*pytest, "tests/test_multi_gpu.py"]),
             "ddp_check": (600, [*TORCHRUN, DDP_CHECK]), "tp_check": (600, [*TORCHRUN, TP_CHECK]),
             "peak_memory": (600, [*pytest, "tests/test_reliability.py", "-k", "peak_memory"])}
    failed = []
    for name, (limit_s, command) in parts.items():
        print(f"== {name}")
        failed += step(name, command, tail=25, log=os.path.join(args.out, f"{name}.log"), show=False, limit_s=limit_s)
        if failed == ["build"]:
            return failed
    for name in ("ddp_check", "tp_check"):  # the ranks' summary lines
        with contextlib.suppress(FileNotFoundError), open(os.path.join(args.out, f"{name}.log"), errors="replace") as f:
            print("".join(line for line in f if f"{name} rank" in line and not line.startswith("Traceback")), end="")
    return failed


def torchrun_check(args, name, script, env=None):
    """`script` on 2 processes under torchrun, NVLink multicast off, after one build; into <name>.log."""
    from tests.distributed_helpers import NO_NVLINK_MULTICAST

    return step("build", IMPORT_LIBRARY) or step(name, [*TORCHRUN, script], tail=25, show=False, limit_s=600,
                                                 log=os.path.join(args.out, f"{name}.log"),
                                                 env={**NO_NVLINK_MULTICAST, **(env or {})})


def ddp(args):
    """ModelNew and the reference in DistributedDataParallel, 2 GPUs over NCCL (tools/checks/ddp_check.py)."""
    return torchrun_check(args, "ddp_check", DDP_CHECK)


def tp(args):
    """Tensor parallelism and FSDP2 on `gemm` against the reference (tools/checks/tp_check.py): 2 GPUs over NCCL, or
    with --cpu the CPU over gloo."""
    return torchrun_check(args, "tp_check", TP_CHECK, {"TP_CHECK_DEVICE": "cpu"} if args.cpu else None)


def architectures(args):
    """kernels.patch() on transformers architectures built from config at sizes where its paths engage, against
    eager and float64: outputs and gradients over two training calls (tools/checks/architectures_check.py, whose
    arguments the others are), into architectures.log and architectures.jsonl."""
    return step("architectures", [PYTHON, ARCHITECTURES_CHECK, "--out", args.out, *args.extra], limit_s=600,
                log=os.path.join(args.out, "architectures.log"))


def rate_rows(calls, samples):
    """Times {label: (call, bytes it moves)} round-robin; prints each one's rate and its share of the rate of the
    copy row ("copy" in its label) before it."""
    from kernels.timing import time_each_ms

    times = time_each_ms([call for call, _ in calls.values()], samples=samples)
    copy_rate = None
    for (label, (_, nbytes)), ms in zip(calls.items(), times):
        rate = nbytes / ms / 1e6  # GB/s
        copy_rate = rate if "copy" in label else copy_rate
        print(f"  {label:28} {ms:8.4f} ms  {rate:7.0f} GB/s  {rate / copy_rate:6.1%} of the copy's rate")


def copy_row(nbytes):
    """A rate_rows entry: a device copy that moves `nbytes` (half read, half written), the rate a pass is held to."""
    import torch

    source = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return lambda: target.copy_(source), nbytes


def print_errors(label, expected, results):
    """Each result's error against float64's `expected` (a pair: output, gradient)."""
    from kernels.precision import relative_error

    print(f"  error against float64, {label}: " + ", ".join(
        f"{name} {relative_error(got, expected[1] if 'backward' in name else expected[0]):.4g}"
        for name, got in results.items()))


def gelu_tanh(args):
    """The GELU (tanh) family at 65536 x 3072 (44_MiniGPTBlock's MLP activation), forward and backward beside a copy
    of the tensor, eager's formula and PyTorch's tanh GELU; then errors against float64 per dtype and input."""
    import math

    import torch
    import torch.nn.functional as F

    from kernels.functional import gelu_tanh as ours

    def formula(x):  # minGPT's NewGELU, op for op
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

    def formula_grad(x, grad):
        leaf = x.clone().requires_grad_(True)
        return torch.autograd.grad(formula(leaf), leaf, grad)[0]

    ours_grad, aten_grad = torch.ops.kernels.gelu_tanh_backward, torch.ops.aten.gelu_backward

    def rates(dtype):
        x = torch.randn(65536, 3072, device="cuda", dtype=dtype) * 3
        grad, copy, size = torch.randn_like(x), torch.empty_like(x), x.nbytes
        print(f"{torch.cuda.get_device_name()}, {dtype}, 65536 x 3072:")
        rate_rows({"copy": (lambda: copy.copy_(x), 2 * size), "ours forward": (lambda: ours(x), 2 * size),
                   "ours backward": (lambda: ours_grad(grad, x), 3 * size),
                   "eager formula forward": (lambda: formula(x), 2 * size),
                   "F.gelu tanh forward": (lambda: F.gelu(x, approximate="tanh"), 2 * size),
                   "aten gelu_backward tanh": (lambda: aten_grad(grad, x, approximate="tanh"), 3 * size)}, samples=30)

    rates(torch.float32)
    rates(torch.bfloat16)
    inputs = {"randn*3": torch.randn(1 << 24, device="cuda") * 3, "-20..20": torch.linspace(-20, 20, 1 << 24,
                                                                                            device="cuda")}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for label, x in inputs.items():
            x = x.to(dtype)
            grad = torch.randn(x.shape, device="cuda").to(dtype)
            print_errors(f"{dtype} {label}", (formula(x.double()), formula_grad(x.double(), grad.double())), {
                "ours forward": ours(x), "eager forward": formula(x), "F.gelu forward": F.gelu(x, approximate="tanh"),
                "ours backward": ours_grad(grad, x), "eager backward": formula_grad(x, grad),
                "aten backward": aten_grad(grad, x, approximate="tanh")})
    return []


def causal_softmax(args):
    """The causal softmax family at --shape (44_MiniGPTBlock's scores): forward and backward beside a copy of the bytes
    each must move and eager's steps, and each one's error against float64 on the first 16 matrices."""
    import math

    import torch

    from kernels.functional import causal_softmax as ours

    shape = tuple(int(n) for n in args.shape.split(","))
    rows, columns = shape[-2:]
    scale = 1.0 / math.sqrt(96)  # 44_MiniGPTBlock: n_embd 768, 8 heads
    bias = torch.tril(torch.ones(columns, columns, device="cuda")).view(1, 1, columns, columns)[..., -rows:, :]
    visible = math.prod(shape[:-2]) * sum(min(columns, max(0, i + columns - rows + 1)) for i in range(rows))
    backward = torch.ops.kernels.causal_softmax_backward

    def eager(scores):  # minGPT's steps, its mask buffer compared with 0 at each call
        return torch.softmax((scores * scale).masked_fill(bias == 0, float("-inf")), dim=-1)

    def gradients(fn, scores, grad):
        leaf = scores.clone().requires_grad_(True)
        y = fn(leaf)
        return y, (lambda: torch.autograd.grad(y, leaf, grad, retain_graph=True)[0])

    def rates(scores, grad):
        # Forward: the unmasked scores read, y written; backward: y and dy unmasked read, dx written.
        forward_bytes, backward_bytes = ((n * visible + scores.numel()) * scores.element_size() for n in (1, 2))
        y = ours(scores, scale)
        print(f"{scores.dtype}: forward moves {forward_bytes / 1e9:.3f} GB, backward {backward_bytes / 1e9:.3f} GB")
        rate_rows({"forward copy": copy_row(forward_bytes),
                   "forward": (lambda: ours(scores, scale), forward_bytes),
                   "forward eager": (lambda: eager(scores), forward_bytes),
                   "backward copy": copy_row(backward_bytes),
                   "backward op": (lambda: backward(grad, y, scale), backward_bytes),
                   "backward autograd": (gradients(lambda s: ours(s, scale), scores, grad)[1], backward_bytes),
                   "backward eager autograd": (gradients(eager, scores, grad)[1], backward_bytes)}, samples=20)

    print(torch.cuda.get_device_name(), "shape", shape, "scale", scale)
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        scores = torch.randn(shape, device="cuda").mul_(3).to(dtype)
        grad = torch.randn(shape, device="cuda").to(dtype)
        rates(scores, grad)
        # Errors on the first 16 matrices: the whole tensor in float64 would not fit twice.
        part, part_grad = scores.reshape(-1, 1, rows, columns)[:16], grad.reshape(-1, 1, rows, columns)[:16]
        y64, g64 = gradients(eager, part.double(), part_grad.double())
        results = {}
        for name, fn in (("ours", lambda s: ours(s, scale)), ("eager", eager)):
            y, g = gradients(fn, part, part_grad)
            results.update({f"{name} forward": y.detach(), f"{name} backward": g()})
        print_errors(str(dtype), (y64.detach(), g64()), results)
        torch.cuda.empty_cache()
    return []


def autograd_step(fn, inputs, grad):
    """A call of fn's forward and backward (the gradients of all of `inputs`, leaves of their own)."""
    import torch

    leaves = [t.clone().requires_grad_(True) for t in inputs]
    return lambda: torch.autograd.grad(fn(*leaves), leaves, grad)


def print_gradient_errors(functions, exact, inputs, grad, labels):
    """Each of `functions`' output and gradients (of every input) against `exact`'s in float64, labelled by `labels`
    (the output's, then each input's)."""
    import torch

    from kernels.precision import relative_error

    leaves64 = [t.double().requires_grad_(True) for t in inputs]
    y64 = exact(*leaves64)
    expected = (y64, *torch.autograd.grad(y64, leaves64, grad.double()))
    for name, fn in functions.items():
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        y = fn(*leaves)
        got = (y, *torch.autograd.grad(y, leaves, grad))
        print(f"  error against float64, {name}: " + ", ".join(
            f"{label} {relative_error(a, b):.3g}" for label, a, b in zip(labels, got, expected)))


def rms_norm(args):
    """The RMSNorm family at the LLaMA-style model's rows (4096 x 2048) and at 4096 x 4096: forward, backward op and a
    training step's autograd beside a copy of the bytes each moves, LlamaRMSNorm's eager ops and PyTorch's own
    F.rms_norm; then each one's error against the formula in float64, per dtype."""
    import torch
    import torch.nn.functional as F

    from kernels.functional import rms_norm as ours

    eps, backward = 1e-6, torch.ops.kernels.rms_norm_backward

    def llama(x, weight):  # transformers' LlamaRMSNorm.forward, op for op
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def fused(x, weight):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def exact(x, weight):
        x64 = x.double()
        return weight.double() * (x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps))

    print(torch.cuda.get_device_name())
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        for rows, columns in ((4096, 2048), (4096, 4096)):
            x = (torch.randn(rows, columns, device="cuda") * 3).to(dtype)
            weight = (torch.randn(columns, device="cuda") * 0.5 + 1).to(dtype)
            grad = torch.randn(rows, columns, device="cuda").to(dtype)
            size = x.nbytes
            print(f"{dtype}, {rows} x {columns}: forward moves {2 * size / 1e6:.0f} MB, "
                  f"backward {3 * size / 1e6:.0f} MB")
            rate_rows({"forward copy": copy_row(2 * size),
                       "forward": (lambda: ours(x, weight, eps), 2 * size),
                       "forward LlamaRMSNorm": (lambda: llama(x, weight), 2 * size),
                       "forward F.rms_norm": (lambda: fused(x, weight), 2 * size),
                       "backward copy": copy_row(3 * size),
                       "backward op": (lambda: backward(grad, x, weight, eps), 3 * size),
                       "step (forward + backward)": (autograd_step(ours, (x, weight), grad), 5 * size),
                       "step LlamaRMSNorm": (autograd_step(llama, (x, weight), grad), 5 * size),
                       "step F.rms_norm": (autograd_step(fused, (x, weight), grad), 5 * size)}, samples=30)
            print_gradient_errors({"ours": ours, "LlamaRMSNorm": llama, "F.rms_norm": fused}, exact, (x, weight), grad,
                                  ("y", "grad_x", "grad_weight"))
            torch.cuda.empty_cache()
    return []


def layer_norm(args):
    """The LayerNorm family at ViT-B/16's rows (12608 x 768) and BERT-large's (8192 x 1024): forward, backward op and a
    training step's autograd beside a copy of the bytes each moves and eager's F.layer_norm, and the residual forms
    (add_layer_norm; the backward with grad_residual) beside eager's add and norm; then each one's error against
    float64, per dtype."""
    import torch
    import torch.nn.functional as F

    from kernels.functional import add_layer_norm
    from kernels.functional import layer_norm as ours

    eps, backward = 1e-5, torch.ops.kernels.layer_norm_backward

    def eager(x, weight, bias):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    print(torch.cuda.get_device_name())
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        for rows, columns in ((12608, 768), (8192, 1024)):
            x = (torch.randn(rows, columns, device="cuda") * 3 + 1).to(dtype)
            weight = (torch.randn(columns, device="cuda") * 0.5 + 1).to(dtype)
            bias = (torch.randn(columns, device="cuda") * 0.5).to(dtype)
            grad = torch.randn(rows, columns, device="cuda").to(dtype)
            residual = torch.randn(rows, columns, device="cuda").to(dtype)
            size = x.nbytes
            print(f"{dtype}, {rows} x {columns}: forward moves {2 * size / 1e6:.0f} MB, "
                  f"backward {3 * size / 1e6:.0f} MB; the residual forms {4 * size / 1e6:.0f} MB each")
            rate_rows({"forward copy": copy_row(2 * size),
                       "forward": (lambda: ours(x, weight, bias, eps), 2 * size),
                       "forward eager": (lambda: eager(x, weight, bias), 2 * size),
                       "backward copy": copy_row(3 * size),
                       "backward op": (lambda: backward(grad, x, weight, eps), 3 * size),
                       "step (forward + backward)": (autograd_step(ours, (x, weight, bias), grad), 5 * size),
                       "step eager": (autograd_step(eager, (x, weight, bias), grad), 5 * size),
                       "residual forms' copy": copy_row(4 * size),
                       "add_layer_norm": (lambda: add_layer_norm(x, residual, weight, bias, eps), 4 * size),
                       "add, then layer_norm": (lambda: ours(x + residual, weight, bias, eps), 4 * size),
                       "eager's add and norm": (lambda: eager(x + residual, weight, bias), 4 * size),
                       "backward op with grad_residual": (lambda: backward(grad, x, weight, eps, residual), 4 * size),
                       "backward op, then the add": (lambda: backward(grad, x, weight, eps)[0] + residual, 4 * size)},
                      samples=30)
            print_gradient_errors({"ours": ours, "eager": eager}, eager, (x, weight, bias), grad,
                                  ("y", "grad_x", "grad_weight", "grad_bias"))
            torch.cuda.empty_cache()
    return []


def silu_mul(args):
    """The SwiGLU gate family at the LLaMA-style model's MLP (4096 x 5632) and at 8192 x 14336: forward, backward op and
    a training step's autograd beside a copy of the bytes each moves and eager's F.silu(gate) * up; then each one's
    error against float64, per dtype."""
    import torch
    import torch.nn.functional as F

    from kernels.functional import silu_mul as ours

    backward = torch.ops.kernels.silu_mul_backward

    def eager(gate, up):
        return F.silu(gate) * up

    print(torch.cuda.get_device_name())
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        for rows, columns in ((4096, 5632), (8192, 14336)):
            gate, up, grad = ((torch.randn(rows, columns, device="cuda") * 3).to(dtype) for _ in range(3))
            size = gate.nbytes
            print(f"{dtype}, {rows} x {columns}: forward moves {3 * size / 1e6:.0f} MB, "
                  f"backward {5 * size / 1e6:.0f} MB")
            rate_rows({"forward copy": copy_row(3 * size),
                       "forward": (lambda: ours(gate, up), 3 * size),
                       "forward eager": (lambda: eager(gate, up), 3 * size),
                       "backward copy": copy_row(5 * size),
                       "backward op": (lambda: backward(grad, gate, up), 5 * size),
                       "step (forward + backward)": (autograd_step(ours, (gate, up), grad), 8 * size),
                       "step eager": (autograd_step(eager, (gate, up), grad), 8 * size)}, samples=30)
            part = slice(0, 1024)  # errors on the first rows: the whole in float64 would not fit beside the rest
            print_gradient_errors({"ours": ours, "eager": eager}, eager, (gate[part], up[part]), grad[part],
                                  ("y", "grad_gate", "grad_up"))
            del gate, up, grad, copies, outs
            torch.cuda.empty_cache()
    return []


def attention(args):
    """The attention family's op at ViT-B/16's shape read from timm's packed qkv output (64 x 12 x 197 x 64) and at
    BERT-large's (16 x 16 x 512 x 64, full and causal), then ViT-B/16's patched no_grad forward (batch 64; medians of
    40, the op's with L2 flushed), and a digest of all their outputs: versions under `gemm_sweep.py variants` that
    print the same digest give the same bits."""
    import hashlib

    import timm
    import torch

    import kernels
    from kernels.functional import attention as ours
    from kernels.timing import time_each_ms

    print(torch.cuda.get_device_name())
    torch.manual_seed(0)
    q, k, v = torch.randn(64, 197, 3, 12, 64, device="cuda").permute(2, 0, 3, 1, 4).unbind(0)
    bert = [torch.randn(16, 16, 512, 64, device="cuda") for _ in range(3)]
    model = kernels.patch(timm.create_model("vit_base_patch16_224", pretrained=False).cuda())
    images = torch.randn(64, 3, 224, 224, device="cuda")
    calls = {"ViT packed": lambda: ours(q, k, v), "BERT": lambda: ours(*bert), "BERT causal": lambda: ours(*bert, True)}
    with torch.no_grad():
        outputs = [call() for call in calls.values()] + [model(images)]
        digest = hashlib.sha1(b"".join(t.cpu().numpy().tobytes() for t in outputs)).hexdigest()[:16]
        times = time_each_ms(list(calls.values()), samples=40)
        forward = time_each_ms([lambda: model(images)], samples=40, flush_l2=False)[0]
    print("digest", digest)
    print("attention ms: " + ", ".join(f"{name} {t:.4f}" for name, t in zip(calls, times)))
    print(f"ViT-B/16 no_grad forward ms: {forward:.3f}")
    return []


def linear_host(args):
    """Host time alone of a host-bound linear layer's call (bench.py's host-bound sizes): nn.Linear, a second
    nn.Linear with the same weights, kernels.nn.Linear, F.linear, and the two layers' forward() called directly (the
    module call's own cost left out), while the GPU is kept busy (the calls' kernels queue behind a sleep), all
    interleaved call by call; medians over rounds. --cpu (no GPU needed): the same calls on CPU tensors of 4 x 16 ->
    16, whose product is negligible, so each call's Python and dispatch cost; minima over rounds against F.linear's."""
    import statistics
    import time

    import torch
    import torch.nn.functional as F

    import kernels

    on_cpu = args.cpu
    if on_cpu:
        torch.set_num_threads(1)
    print("CPU" if on_cpu else torch.cuda.get_device_name(), sys.version.split()[0], torch.__version__)
    device = "cpu" if on_cpu else "cuda"
    for m, k, n in ((4, 16, 16),) if on_cpu else ((394, 512, 512), (64, 1024, 1024)):
        torch.manual_seed(0)
        eager, twin = torch.nn.Linear(k, n).to(device), torch.nn.Linear(k, n).to(device)
        ours = kernels.nn.Linear(k, n).to(device)
        twin.load_state_dict(eager.state_dict())
        ours.load_state_dict(eager.state_dict())
        x = torch.randn(m, k, device=device)
        calls = {"nn.Linear": lambda: eager(x), "nn.Linear, a second copy": lambda: twin(x),
                 "kernels.nn.Linear": lambda: ours(x), "F.linear": lambda: F.linear(x, eager.weight, eager.bias),
                 "nn.Linear.forward": lambda: eager.forward(x), "kernels.nn.Linear.forward": lambda: ours.forward(x)}
        # Not kernels.timing's time_each_ms: the GPU must stay busy under the calls (its sleep), else the slower of
        # host and GPU would be timed.
        times = {label: [] for label in calls}
        calls_per_round = 2000 if on_cpu else 20
        for round_index in range(40 if on_cpu else 300):
            if not on_cpu and round_index % 20 == 0:
                torch.cuda.synchronize()
                torch.cuda._sleep(400_000_000)  # the calls below queue: their host time alone is timed
            for label, call in calls.items():
                start = time.perf_counter()
                for _ in range(calls_per_round):
                    call()
                times[label].append((time.perf_counter() - start) / calls_per_round * 1e6)
        if on_cpu:
            base = min(times["F.linear"])
            print(f"{m} x {k} -> {n}, over F.linear's {base:.3f} us (minima): "
                  + ", ".join(f"{label} {min(t) - base:+.3f} us" for label, t in times.items() if label != "F.linear"))
            continue
        torch.cuda.synchronize()
        print(f"{m} x {k} -> {n}: " + ", ".join(f"{label} {statistics.median(t):.2f} us" for label, t in times.items()))
    return []


def kernelbench_timing(args):
    """Where the harness's time (KB ms: sync, L2 flush, events, mean) of the level-3 MLPs exceeds the median of
    calls timed in turn: the model's calls timed the harness's way, then the same way with the GPU kept busy while
    the host enqueues the call (a sleep before the start event: the host's latency to the first kernel hidden), each
    call's time listed by its mean, median, spread; the SM clock and power after the calls where pynvml reads them."""
    import statistics

    import torch

    import reference
    from kernels.timing import kernelbench_ms, time_each_ms
    from model_new import MODEL_NEW

    try:
        import pynvml
        pynvml.nvmlInit()
        nvml = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    except Exception:  # noqa: BLE001  (no pynvml: the clocks are not read)
        nvml = None

    def clocks():
        if nvml is None:
            return ""
        sm = pynvml.nvmlDeviceGetClockInfo(nvml, pynvml.NVML_CLOCK_SM)
        return f", SM {sm} MHz, {pynvml.nvmlDeviceGetPowerUsage(nvml) / 1000:.0f} W"

    print(torch.cuda.get_device_name())
    kernelbench_ms(lambda: None, calls=1)  # the flush buffer
    from kernels import timing
    flush = timing._l2_flush_buffer
    for name in ("mlp", "shallow_wide_mlp"):
        spec = reference.PROBLEMS[name]
        torch.manual_seed(42)
        init = spec.get_init_inputs()
        model = spec.model(*init).cuda()
        torch.manual_seed(42)
        model_new = MODEL_NEW[name](*init).cuda()
        inputs = [t.cuda() for t in spec.get_inputs()]
        with torch.no_grad():
            for label, fn in (("eager", lambda: model(*inputs)), ("ModelNew", lambda: model_new(*inputs))):
                median = time_each_ms([fn], samples=30)[0]
                rows = {}
                for busy in (False, True):
                    times = []
                    for _ in range(100):
                        torch.cuda.synchronize()
                        flush.zero_()
                        if busy:
                            torch.cuda._sleep(2_000_000)  # ~1 ms at the H100's clocks: the call queues behind it
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        fn()
                        end.record()
                        torch.cuda.synchronize()
                        times.append(start.elapsed_time(end))
                    rows["GPU busy before the call" if busy else "the harness's way"] = times
                print(f"{name} {label}: median of calls in turn {median:.4f} ms{clocks()}")
                for way, times in rows.items():
                    print(f"  {way}: mean {statistics.mean(times):.4f}, median {statistics.median(times):.4f}, "
                          f"min {min(times):.4f}, max {max(times):.4f}, first {times[0]:.4f} ms")
        del model, model_new, inputs
        torch.cuda.empty_cache()
    return []


def export_trial(args):
    """The export's trial (kernels.export.exact_output_trial) against the harness's check, per KernelBench problem
    file: the trial's verdict; then over 5 seeded draws of get_inputs() (seeds 42 to 46, both models built after seed
    42 on the CPU and moved to the GPU, as bench.py's --problem-file does), the values of the float32 Model outside
    the harness's tolerance of its output with exact products (what the trial counts on its one draw) and the values
    on which the candidate, its products on the library whatever the trial says, fails the harness's check against
    the Model. Where the trial refuses a problem, the second count should not be all zeros, and where it accepts
    one, it should; a disagreement fails the subcommand (on a GPU: on the CPU the library's products are eager's)."""
    import unittest.mock

    import torch
    from torch.utils._pytree import tree_leaves

    from kernels import export

    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(torch.cuda.get_device_name() if device == "cuda" else "CPU")
    failed = []
    for path in export.problem_files(args.problems):
        name = os.path.splitext(os.path.basename(path))[0]
        namespace = {"__name__": "problem"}
        with open(path, encoding="utf-8") as f:
            exec(compile(f.read(), path, "exec"), namespace)
        plan = export.problem_plan(path, namespace)
        print(f"{name}: {plan.trial or 'nothing routed, no trial'}")
        if plan.trial is None:
            continue
        with unittest.mock.patch.object(export, "exact_output_trial", lambda *a, **k: (True, None)):
            forced = export.problem_plan(path, namespace)  # the products on the library whatever the trial says
        init = namespace["get_init_inputs"]()
        torch.manual_seed(42)
        model = namespace["Model"](*init).to(device)
        torch.manual_seed(42)
        candidate = export.problem_model_new(namespace["Model"], forced)(*init).to(device)
        counts = []
        with torch.no_grad():
            for seed in range(42, 47):
                torch.manual_seed(seed)
                inputs = [t.to(device) if isinstance(t, torch.Tensor) else t for t in namespace["get_inputs"]()]
                eager = tree_leaves(model(*inputs))
                with export._exact_products():
                    exact = tree_leaves(model(*inputs))
                ours = tree_leaves(candidate(*inputs))
                counts.append((export.values_outside(eager, exact)[0], export.values_outside(ours, eager)[0]))
        print(f"  per draw, values of eager outside the tolerance of exact products / values failing the harness's "
              f"check: {', '.join(f'{a} / {b}' for a, b in counts)}")
        refused = (plan.layers, plan.functional_products) != (forced.layers, forced.functional_products)
        # On the CPU the library's products are eager's: nothing to compare the verdict with.
        if device == "cuda" and not plan.trial.startswith("not ") and refused != any(b for _, b in counts):
            print("  the trial's verdict and the harness's outcome disagree")
            failed.append(name)
        del model, candidate
        if device == "cuda":
            torch.cuda.empty_cache()
    return failed


EXIT_RACE_PROBLEM = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))

    def forward(self, x):
        return self.layers(x)


def get_inputs():
    return [torch.randn(2048, 1024)]


def get_init_inputs():
    return [1024]
"""
# Builds the candidate's ModelNew, runs one backward on the GPU and exits at once, as a harness's trial process does.
EXIT_RACE_RUNNER = """
import sys, torch
namespace = {"__name__": "candidate"}
exec(compile(open(sys.argv[1]).read(), "<candidate>", "exec"), namespace)
model = namespace["ModelNew"](*namespace["get_init_inputs"]()).cuda()
inputs = [t.cuda().requires_grad_(True) for t in namespace["get_inputs"]()]
torch.autograd.grad(model(*inputs).square().sum(), [*model.parameters(), *inputs])
"""


def exit_race(args):
    """Processes that exit right after a backward, many at once: a candidate of a small MLP problem as exported, and
    the same candidate without its exit handler (kernels.loader.drain_autograd_at_exit). Without it, autograd's device
    thread can still be releasing tensors when Python finalizes, which aborts the process. Counts the aborts of each;
    fails where the exported candidate aborts, and says so where the other does not (the race did not show)."""
    from kernels.export import problem_file_candidate

    folder = tempfile.mkdtemp(prefix="exit_race_")
    problem = os.path.join(folder, "mlp.py")
    with open(problem, "w", encoding="utf-8") as f:
        f.write(EXIT_RACE_PROBLEM)
    exported = problem_file_candidate(problem)
    without = exported.replace("_build_library()\ndrain_autograd_at_exit()\n", "_build_library()\n")
    assert without != exported, "the candidate no longer calls drain_autograd_at_exit() after _build_library()"
    failed = []
    for label, source in (("without the exit handler", without), ("as exported", exported)):
        path = os.path.join(folder, label.replace(" ", "_") + ".py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(source)
        run([PYTHON, "-c", EXIT_RACE_RUNNER, path], show=False)  # builds the library once, outside the count
        codes = collections.Counter()
        for start in range(0, args.processes, args.at_once):
            group = [subprocess.Popen([PYTHON, "-c", EXIT_RACE_RUNNER, path], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
                     for _ in range(min(args.at_once, args.processes - start))]
            codes.update(p.wait() for p in group)
        print(f"{label}: {args.processes} processes, {args.at_once} at once: exit codes "
              f"{', '.join(f'{code}: {count}' for code, count in sorted(codes.items()))}", flush=True)
        if label == "as exported" and set(codes) != {0}:
            failed.append("exit-race")
        if label != "as exported" and set(codes) == {0}:
            print("  no abort without the handler either: the race did not show, so the run proves nothing "
                  "(more processes, or more at once)")
    return failed


def run_all(args):
    """build, tests, sanitize and bench in that order on one build; nothing after a failed build or smoke test."""
    failed = build(args)
    if failed:
        return failed
    for skip, function in ((args.skip_tests, tests), (args.skip_sanitize, sanitize), (args.skip_bench, bench)):
        if not skip:
            failed += function(args)
    return failed


# --- arguments


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    subcommands = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", default=os.environ.get("OUT") or "/tmp/device_check",
                        help="folder for the logs and results (default: $OUT, else /tmp/device_check)")

    def add(name, function, summary, extra=None):
        """A subcommand, its function's docstring as its description; `extra`: what its other arguments are."""
        sub = subcommands.add_parser(name, parents=[common], help=summary, description=function.__doc__,
                                     allow_abbrev=False)
        sub.set_defaults(function=function, extra_to=extra, summarize=None, quick=False)
        return sub

    def flag(sub, name, summary, switch=None):
        sub.add_argument(name, action="store_true", default=bool(switch and env_flag(switch)),
                         help=summary + (f" (default: ${switch} set)" if switch else ""))

    def add_bench_options(sub):
        sub.add_argument("--runs", type=int, default=int(os.environ.get("BENCH_RUNS") or 1),
                         help="bench.py runs (default: $BENCH_RUNS, else 1)")
        sub.add_argument("--floor", type=float, default=0.98, help="speedup under which a row is named (0.98)")
        sub.add_argument("--bench-args", default=os.environ.get("BENCH_ARGS", ""),
                         help="arguments for bench.py, one string (default: $BENCH_ARGS)")

    add("build", build, "cold build and warm imports timed, the smoke test")
    sub = add("tests", tests, "the test suite; other arguments go to pytest", extra="PYTEST_ARGS")
    flag(sub, "--quick", 'only -m "not slow"')
    sub.add_argument("--time-limit", type=int, default=900, help="seconds (900)")
    sub.add_argument("--test-timeout", type=int, default=600, help="seconds for one test, 0: none (600)")
    sub = add("sanitize", sanitize, "compute-sanitizer's four tools over the cases")
    sub.add_argument("--cases", nargs="+", default=[], metavar="GROUP", choices=case_groups(),
                     help=f"only these groups of tools/checks/sanitize_cases.py: {', '.join(case_groups())} (default: "
                          "all)")
    add("cases", cases, "every CUDA kernel once on small shapes against eager (the smoke test)")
    sub = add("bench", bench, "bench.py with JSON, chart and Markdown; other arguments go to it", extra="BENCH_ARGS")
    add_bench_options(sub)
    sub.add_argument("--summarize", nargs="+", metavar="JSON", help="only the speedups over these files' runs")
    add("multi-gpu", multi_gpu, "the 2-GPU run: multi-GPU tests, ddp and tp checks, peak memory")
    add("ddp", ddp, "ModelNew in DistributedDataParallel on 2 GPUs against the reference")
    flag(add("tp", tp, "tensor parallelism and FSDP2 on 2 processes against the reference"), "--cpu",
         "on the CPU over gloo")
    add("gelu-tanh", gelu_tanh, "the GELU (tanh) family against a copy's rate, and its error")
    sub = add("causal-softmax", causal_softmax, "the causal softmax family against a copy's rate, and its error")
    sub.add_argument("--shape", default="128,8,512,512", help="the scores' shape (128,8,512,512)")
    sub.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (float32,bfloat16)")
    sub = add("rms-norm", rms_norm, "the RMSNorm family against a copy's rate, eager's and F.rms_norm, and its error")
    sub.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (float32,bfloat16)")
    sub = add("layer-norm", layer_norm, "the LayerNorm family against a copy's rate and eager's, and its error")
    sub.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (float32,bfloat16)")
    sub = add("silu-mul", silu_mul, "the SwiGLU gate family against a copy's rate and eager's, and its error")
    sub.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (float32,bfloat16)")
    add("attention", attention, "the attention op at ViT-B/16's and BERT-large's shapes, ViT-B/16's forward, a digest")
    sub = add("linear-host", linear_host, "host time of host-bound linear calls: nn.Linear against kernels.nn.Linear")
    sub.add_argument("--cpu", action="store_true", help="CPU tensors of 4 x 16 -> 16: each call's Python cost")
    add("architectures", architectures, "kernels.patch() on transformers architectures against eager and float64",
        extra="CHECK_ARGS")
    add("kernelbench-timing", kernelbench_timing, "the level-3 MLPs' KB ms against their median: host latency, clocks")
    sub = add("export-trial", export_trial, "the export's exact-output trial against the harness's check, per problem")
    sub.add_argument("problems", nargs="+", metavar="PATH", help="KernelBench problem files, or folders of them")
    sub = add("exit-race", exit_race, "processes exiting right after a backward: aborts with and without the exit "
              "handler")
    sub.add_argument("--processes", type=int, default=96, help="processes per variant (96)")
    sub.add_argument("--at-once", type=int, default=32, help="processes running together (32)")
    sub = add("all", run_all, "build, tests, sanitize and bench in order, on one build")
    for name in ("tests", "sanitize", "bench"):
        flag(sub, f"--skip-{name}", f"no {name}", f"SKIP_{name.upper()}")
    sub.add_argument("--time-limit", type=int, default=900, help="seconds for the tests (900)")
    sub.add_argument("--test-timeout", type=int, default=600, help="seconds for one test, 0: none (600)")
    add_bench_options(sub)
    for sub in subcommands.choices.values():
        if sub.get_default("extra_to"):
            sub.usage = sub.format_usage().removeprefix("usage: ").rstrip() + f" [{sub.get_default('extra_to')} ...]"

    args, extra = parser.parse_known_args(argv)
    extra = extra[1:] if extra[:1] == ["--"] else extra  # `tests -- -k gemm`: the separator is not pytest's
    if extra and args.extra_to is None:
        parser.error(f"{args.subcommand} takes no arguments besides its options: {shlex.join(extra)}")
    args.extra, args.out = extra, os.path.abspath(args.out)
    return args


def main(argv=None):
    args = parse_arguments(argv)
    os.makedirs(args.out, exist_ok=True)
    os.environ["PYTHONUNBUFFERED"] = "1"
    sys.stdout = Tee(sys.stdout, open(os.path.join(args.out, f"device_check_{args.subcommand}.log"), "w"))
    failed = args.function(args)
    print(f"device_check {args.subcommand}: {'FAILED: ' + ', '.join(failed) if failed else 'ok'} (logs in {args.out})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
