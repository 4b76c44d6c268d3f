"""The checks that need the GPU machine, one subcommand each (`SUBCOMMAND --help` says what it runs):
build, tests, sanitize, cases, bench, multi-gpu, ddp, tp, sm80, profile, gelu-tanh, causal-softmax, all.

    python tools/device_check.py all            # build, tests, sanitize, bench: the whole single-GPU run
    python tools/device_check.py tests --quick -k gemm

Every subcommand writes into --out (default: $OUT, else /tmp/device_check), its whole output also into
device_check_<subcommand>.log there, and exits 1 where a step failed, naming it. Switches set flags' defaults:
SKIP_TESTS, SKIP_SANITIZE, SKIP_BENCH, SKIP_RATES, BENCH_ARGS, BENCH_RUNS, TEST_TIMEOUT, PYTEST_ARGS. Missing
matplotlib or pytest-xdist is installed from the wheels in .whl/, if carried, into /tmp/site.
"""

import argparse
import collections
import glob
import json
import os
import re
import shlex
import shutil
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
CASES = "tools/checks/sanitize_cases.py"
DDP_CHECK = "tools/checks/ddp_check.py"
TP_CHECK = "tools/checks/tp_check.py"
TORCHRUN = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


SMOKE_TEST_LIMIT_S = 180
# As `timeout --kill-after=30`: a process still there this long after SIGTERM gets SIGKILL.
KILL_AFTER_S = 30
# Lines of a command's output kept in memory for its tail; the whole output is in its log.
KEPT_LINES = 200
# Where the wheels carried in .whl/ are installed, outside the repository.
WHEEL_SITE = "/tmp/site"


class Console:
    """The terminal and the subcommand's log (device_check_<subcommand>.log), written together, a line at a time."""

    def __init__(self):
        self.log = None
        self.lock = threading.Lock()  # the output of a command comes from its reader thread

    def open(self, path):
        self.log = open(path, "w", encoding="utf-8")

    def write(self, text):
        with self.lock:
            sys.stdout.write(text)
            sys.stdout.flush()
            if self.log:
                self.log.write(text)
                self.log.flush()


CONSOLE = Console()


def say(*parts):
    CONSOLE.write(" ".join(str(part) for part in parts) + "\n")


def show_tail(lines, count):
    for line in list(lines)[-count:]:
        say(line)


class Ran:
    """How a command ended: its exit status (bash's numbering: 128 + the signal that ended it, 124 when its time
    limit ended it, 137 when that took SIGKILL, 127 when it was not found), the last KEPT_LINES lines of its output,
    and whether its time limit ran out."""

    def __init__(self, status, lines, timed_out=False):
        self.status, self.lines, self.timed_out = status, lines, timed_out


def end_process_group(process):
    """SIGTERM to the command and everything it started (torchrun's ranks, pytest's workers), SIGKILL if they are
    still there KILL_AFTER_S later; whether SIGKILL was needed."""
    for sig, wait_s in ((signal.SIGTERM, KILL_AFTER_S), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return False
        try:
            process.wait(timeout=wait_s)
            return sig == signal.SIGKILL
        except subprocess.TimeoutExpired:
            continue
    return True


def run(command, log=None, show=True, limit_s=None, env=None, stop_after_lines=None):
    """Runs `command` in the repository root, stdout and stderr together: every line into the file `log` (if one is
    named) and, where `show`, to the terminal and the subcommand's log. `limit_s`: SIGTERM, then SIGKILL, to it and its
    children at the limit. `stop_after_lines`: it is ended after that many lines, which is not a failure (as
    `| head -N`). `env`: variables set for it on top of this process's."""
    environment = dict(os.environ, **(env or {}))
    try:
        # A session of its own, so that a time limit or Ctrl-C here ends its children too.
        process = subprocess.Popen(command, cwd=REPO, env=environment, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    except FileNotFoundError:
        say(f"{command[0]}: not found")
        return Ran(127, collections.deque())
    lines = collections.deque(maxlen=KEPT_LINES)
    enough = threading.Event()
    log_file = open(log, "w", encoding="utf-8") if log else None

    def pump():
        count = 0
        for raw in iter(process.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            lines.append(line)
            if log_file:
                log_file.write(line + "\n")
                log_file.flush()
            if show and not enough.is_set():
                CONSOLE.write(line + "\n")
            count += 1
            if stop_after_lines and count >= stop_after_lines:
                enough.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    deadline = None if limit_s is None else time.monotonic() + limit_s
    timed_out = stopped = killed = False
    try:
        while process.poll() is None:
            if enough.is_set():
                stopped = True
                end_process_group(process)
                break
            if deadline is not None and time.monotonic() > deadline:
                timed_out = True
                killed = end_process_group(process)
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        end_process_group(process)
        raise
    finally:
        # A child that outlives the command can hold the pipe open.
        reader.join(timeout=KILL_AFTER_S)
        if reader.is_alive():
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            reader.join()
        process.stdout.close()
        if log_file:
            log_file.close()
    if timed_out:
        return Ran(137 if killed else 124, lines, timed_out=True)
    if stopped:
        return Ran(0, lines)
    status = process.returncode
    return Ran(128 - status if status < 0 else status, lines)


def passed(name, ran, limit_s=None):
    """Says how a step that failed ended; whether it passed."""
    if ran.status == 0:
        return True
    if ran.timed_out:
        say(f"== {name}: FAILED: timed out after {limit_s} s")
    else:
        say(f"== {name}: FAILED (exit status {ran.status})")
    return False


def print_cpu_count():
    say(f"CPUs: {len(os.sched_getaffinity(0))}")


def importable(module):
    return subprocess.run([PYTHON, "-c", f"import {module}"], cwd=REPO, capture_output=True).returncode == 0


def ensure_module(module):
    """Where `module` does not import, installs the wheels in .whl/ (if carried: the GPU machine has no network)
    into WHEEL_SITE and puts it first on PYTHONPATH for every process started from here."""
    if importable(module):
        return
    wheels = sorted(glob.glob(os.path.join(REPO, ".whl", "*.whl")))
    if not wheels:
        return
    say(f"{module} is missing: installing {len(wheels)} wheels from .whl/ into {WHEEL_SITE}")
    ran = run([PYTHON, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target",
               WHEEL_SITE, *wheels])
    if ran.status == 0:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (WHEEL_SITE, os.environ.get("PYTHONPATH")) if p)
    if not importable(module):
        say(f"{module} is still missing: no wheel of it in .whl/")


def default_build_root():
    """Where the loader builds the library: $TORCH_EXTENSIONS_DIR, else torch's default folder (its
    cpp_extension.get_default_build_root(), which is the user cache folder; not imported here, so that this
    process stays free of torch)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(cache, "torch_extensions")


# --- SASS


def dump_sass(libraries, path):
    """cuobjdump's SASS of every library into `path`, its errors too."""
    with open(path, "w") as f:
        if not libraries:
            f.write("no library found\n")
        for library in libraries:
            f.flush()
            try:
                subprocess.run(["cuobjdump", "--dump-sass", library], cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
            except FileNotFoundError:
                f.write("cuobjdump: not found\n")
                break


def sass_lines(path):
    """(function, fields) for each line of a SASS dump: the function ("Function : <name>") the line is in (None
    before the first), the line split at whitespace."""
    function = None
    with open(path, errors="replace") as f:
        for line in f:
            fields = line.split()
            if "Function :" in line and len(fields) > 2:
                function = fields[2]
            yield function, fields


def print_vectorized_forward_accesses(path):
    """The global loads and stores of the vectorized fp32 forward kernel (multiply_leaky_relu_kernel<float, 4,
    false, false>), counted per opcode and first operand: one 16-byte access per pack, or not."""
    say("SASS: vectorized fp32 forward kernel's global accesses:")
    counts = collections.Counter()
    for function, fields in sass_lines(path):
        if function and "multiply_leaky_relu_kernelIfLi4ELb0ELb0E" in function and len(fields) > 1 \
                and fields[0] != "Function" and re.search("LDG|STG", " ".join(fields)):
            counts[" ".join(fields[1:3])] += 1
    for access, count in sorted(counts.items()):
        say(f"{count:7d}     {access}")


def print_instruction_counts(path, pattern, by_opcode):
    """How many instructions matching `pattern` each function has (per opcode too, where `by_opcode`)."""
    counts = collections.Counter()
    for function, fields in sass_lines(path):
        if function and len(fields) > 1 and re.search(pattern, " ".join(fields)):
            counts[f"{function} {fields[1].split('.')[0]}" if by_opcode else function] += 1
    for key, count in counts.items():
        say(f"    {count} {key}")


# --- subcommands; each returns the names of its steps that failed


def build(args):
    """Cold build, timed; warm imports, timed; SASS summaries; the smoke test."""
    failed = []
    run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.sm", "--format=csv,noheader"])
    run([PYTHON, "-c", "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"])
    print_cpu_count()

    # A cold build, whatever is cached elsewhere; `all`'s later steps load this build.
    build_root = tempfile.mkdtemp(prefix="device_check_build_")
    os.environ["TORCH_EXTENSIONS_DIR"] = build_root
    say(f"== build into TORCH_EXTENSIONS_DIR={build_root}")
    start = time.time()
    ran = run(IMPORT_LIBRARY)
    say(f"cold build + import: {time.time() - start:.1f} s (includes python and torch start-up)")
    if not passed("cold build", ran):
        failed.append("cold build")
    # Per library and target of the build: seconds, from ninja's log (start and end in ms). The libraries build at
    # once.
    for ninja_log in sorted(glob.glob(os.path.join(build_root, "*", ".ninja_log"))):
        say(f"  {os.path.basename(os.path.dirname(ninja_log))}")
        with open(ninja_log) as f:
            for fields in (line.split() for line in list(f)[1:]):
                if len(fields) >= 4 and not fields[3].endswith(".so"):
                    say(f"    {fields[3]:<10} {(int(fields[1]) - int(fields[0])) / 1000:5.1f} s")
    # Again into an empty folder: the compilers' files are in the page cache now, so this shows how much of the
    # first build was cold disk.
    page_cached_root = tempfile.mkdtemp(prefix="device_check_build_again_")
    ran = run(IMPORT_LIBRARY, show=False, env={"TORCH_EXTENSIONS_DIR": page_cached_root})
    for line in ran.lines:
        if "built" in line:
            say(line)
    shutil.rmtree(page_cached_root, ignore_errors=True)
    start = time.time()
    run(IMPORT_LIBRARY)
    say(f"warm import in a new process: {time.time() - start:.2f} s (python + torch + kernels)")
    run([PYTHON, "-c", "import time, torch\n"
                       "start = time.perf_counter(); import kernels.functional\n"
                       "print(f'warm import of kernels alone (torch already imported): "
                       "{time.perf_counter() - start:.2f} s')"])
    start = time.time()
    run([PYTHON, "-c", "import torch; torch.cuda.init()"])
    say(f"python + torch + CUDA start-up alone: {time.time() - start:.2f} s")
    if getattr(args, "units", False):
        run([PYTHON, "tools/host_timing.py", "build-units", "--build-root", build_root, "--together"])

    sass = os.path.join(args.out, "sass.txt")
    dump_sass(sorted(glob.glob(os.path.join(build_root, "*", "*.so"))), sass)
    print_vectorized_forward_accesses(sass)
    say("SASS: HGMMA instructions per GEMM kernel:")
    print_instruction_counts(sass, "HGMMA", by_opcode=False)

    failed += smoke_test()
    return failed


def smoke_test():
    """Every kernel once on small shapes against eager, bounded in time (a pipeline that deadlocks hangs)."""
    say(f"== smoke test ({CASES})")
    ran = run([PYTHON, CASES], limit_s=SMOKE_TEST_LIMIT_S)
    if ran.status != 0:
        say("smoke test failed or hung" + (f" ({SMOKE_TEST_LIMIT_S} s)" if ran.timed_out else ""))
        return ["smoke test"]
    return []


def names_tests(pytest_args):
    """Whether pytest's arguments name tests to run: a file, a folder or a node id under tests/ (an option's value,
    as in `-k gemm`, names none)."""
    tests_folder = os.path.join(REPO, "tests")
    for arg in pytest_args:
        path = os.path.realpath(os.path.join(REPO, arg.split("::")[0]))
        inside_tests = os.path.commonpath([path, tests_folder]) == tests_folder
        if not arg.startswith("-") and os.path.exists(path) and inside_tests:
            return True
    return False


def tests(args):
    """The full test suite (or --quick's part of it), its tail shown."""
    ensure_module("xdist")
    command = [PYTHON, "-m", "pytest", "-q", "-rs", *(["-m", "not slow"] if args.quick else []), *args.extra]
    if not names_tests(args.extra):
        command.append("tests")
    say(f"== tests: {shlex.join(['python', *command[1:]])} (output in pytest.log)")
    ran = run(command, log=os.path.join(args.out, "pytest.log"), show=False, limit_s=args.time_limit)
    show_tail(ran.lines, 25)
    return [] if passed("tests", ran, args.time_limit) else ["tests"]


SANITIZER_TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")


def sanitize(args):
    """compute-sanitizer's four tools over the cases; a summary line per tool."""
    lineinfo = {"KERNELS_LINEINFO": "1"}  # source lines in the reports
    say("== sanitize: the library built with KERNELS_LINEINFO=1")
    if not passed("sanitize build", run(IMPORT_LIBRARY, env=lineinfo)):
        return ["sanitize build"]
    failed = []
    for tool in SANITIZER_TOOLS:
        # Only the library's kernels (their names hold the namespace kernels::), not torch's own; except for
        # initcheck, which must see the writes of torch's kernels too (randn, copies), or every input they made
        # reads as uninitialized.
        kernel_filter = [] if tool == "initcheck" else ["--kernel-regex", "kns=kernels"]
        # initcheck does not track TMA stores' writes: the split GEMM takes its plain-store epilogue under it (the
        # outputs' coverage on the TMA path is tested by tests/test_gemm_split.py on a NaN-poisoned allocator).
        plain_stores = "1" if tool == "initcheck" else ""
        log = os.path.join(args.out, f"sanitize_{tool}.log")
        ran = run(["compute-sanitizer", "--tool", tool, *kernel_filter, "--target-processes", "all",
                   "--error-exitcode", "86", PYTHON, CASES],
                  log=log, show=False, env=dict(lineinfo, KERNELS_GEMM_PLAIN_STORES=plain_stores))
        summaries = []
        if os.path.exists(log):
            with open(log, errors="replace") as f:
                summaries = [line.strip() for line in f if re.search("ERROR SUMMARY|RACECHECK SUMMARY", line)]
        say(f"{tool}: exit {ran.status}; {summaries[-1] if summaries else ''}")
        if ran.status != 0:
            failed.append(f"sanitize {tool}")
            show_tail(ran.lines, 20)
    return failed


def print_speedups_over_runs(paths, floor):
    """ModelNew's speedup per bench.py row across runs (JSON files of `bench.py --json`, in run order), its lowest,
    and the rows whose lowest is under `floor` or that a run lacks."""
    speedups = {}  # (problem, case, variant) -> one speedup per run, in the order of the first run's rows
    for path in paths:
        with open(path) as f:
            for row in json.load(f)["rows"]:
                if row["variant"].startswith("ModelNew"):
                    speedups.setdefault((row["problem"], row["case"], row["variant"]), []).append(row["speedup"])
    below = []
    for (problem, case, variant), values in speedups.items():
        lowest = min(values)
        mark = " <" if lowest < floor else ""
        runs = " ".join(f"{v:6.3f}" for v in values)
        say(f"{problem:34} {case:36} {variant:24} {runs}  min {lowest:.3f}{mark}")
        if lowest < floor or len(values) < len(paths):
            below.append(f"{problem}: {case} ({variant})")
    say(f"\n{len(speedups)} ModelNew rows over {len(paths)} runs; under {floor} or missing from a run: "
        + (", ".join(below) if below else "none"))


def bench(args):
    """bench.py with its JSON, chart and Markdown; more runs and the speedups over them where --runs asks."""
    if args.summarize:
        print_speedups_over_runs(args.summarize, args.floor)
        return []
    failed = []
    ensure_module("matplotlib")
    bench_args = shlex.split(args.bench_args) + args.extra
    out = args.out
    say("== bench (output in bench.log)")
    ran = run([PYTHON, "bench.py", *bench_args, "--json", os.path.join(out, "bench.json"),
               "--plot", os.path.join(out, "bench.png"), "--markdown", os.path.join(out, "bench.md")],
              log=os.path.join(out, "bench.log"))
    if not passed("bench", ran):
        failed.append("bench")
    # More runs, tables to their logs only, then ModelNew's speedup per row across all of them.
    paths = [os.path.join(out, "bench.json")]
    for run_number in range(2, args.runs + 1):
        paths.append(os.path.join(out, f"bench{run_number}.json"))
        say(f"== bench run {run_number} of {args.runs} (output in bench{run_number}.log)")
        ran = run([PYTHON, "bench.py", *bench_args, "--json", paths[-1]],
                  log=os.path.join(out, f"bench{run_number}.log"), show=False)
        if not passed(f"bench run {run_number}", ran):
            failed.append(f"bench run {run_number}")
    if args.runs > 1:
        written = [path for path in paths if os.path.exists(path)]
        for path in sorted(set(paths) - set(written)):
            say(f"{path}: not written")
        if written:
            print_speedups_over_runs(written, args.floor)
    return failed


def multi_gpu(args):
    """The 2-GPU run: GPUs and links, one build, the multi-GPU tests, the DDP and tensor-parallel checks on their
    own for their per-rank lines, the peak-memory tests; each part bounded in time."""
    from tests.distributed_helpers import NO_NVLINK_MULTICAST

    os.environ.update(NO_NVLINK_MULTICAST)  # in every process started from here
    run(["nvidia-smi"])
    run(["nvidia-smi", "topo", "-m"])
    run([PYTHON, "-c", "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'devices', "
                       "torch.cuda.device_count())"])
    print_cpu_count()
    ensure_module("xdist")
    parts = [
        # One build before anything else, so that the tests and the ranks load the library instead of racing to
        # build it.
        ("build", 600, IMPORT_LIBRARY),
        ("pytest_multi_gpu", 1200, [PYTHON, "-m", "pytest", "-q", "-rs", "tests/test_multi_gpu.py"]),
        ("ddp_check", 600, [*TORCHRUN, DDP_CHECK]),
        ("tp_check", 600, [*TORCHRUN, TP_CHECK]),
        ("peak_memory", 600, [PYTHON, "-m", "pytest", "-q", "-rs", "tests/test_reliability.py", "-k", "peak_memory"]),
    ]
    failed = []
    for name, limit_s, command in parts:
        say(f"== {name}")
        ran = run(command, log=os.path.join(args.out, f"{name}.log"), show=False, limit_s=limit_s)
        show_tail(ran.lines, 25)
        if not passed(name, ran, limit_s):
            failed.append(name)
            if name == "build":
                return failed
    for name, wanted in (("ddp_check", lambda line: line.startswith("ddp_check rank")),
                         ("tp_check", lambda line: "tp_check rank" in line and not line.startswith("Traceback"))):
        log = os.path.join(args.out, f"{name}.log")
        if os.path.exists(log):
            with open(log, errors="replace") as f:
                for line in f:
                    if wanted(line):
                        say(line.rstrip("\n"))
    return failed


def torchrun_check(args, name, script, env=None):
    """`script` on 2 processes under torchrun, NVLink multicast off, after one build (so that the ranks load the
    library instead of racing to build it); its output into <name>.log, its last 25 lines shown."""
    from tests.distributed_helpers import NO_NVLINK_MULTICAST

    if not passed("build", run(IMPORT_LIBRARY)):
        return ["build"]
    say(f"== {name}: {script} on 2 processes")
    ran = run([*TORCHRUN, script], log=os.path.join(args.out, f"{name}.log"), show=False, limit_s=600,
              env={**NO_NVLINK_MULTICAST, **(env or {})})
    show_tail(ran.lines, 25)
    return [] if passed(name, ran, 600) else [name]


def ddp(args):
    """The DistributedDataParallel check on 2 GPUs."""
    return torchrun_check(args, "ddp_check", DDP_CHECK)


def tp(args):
    """The tensor-parallel and FSDP2 check on 2 GPUs, or on the CPU over gloo."""
    return torchrun_check(args, "tp_check", TP_CHECK, {"TP_CHECK_DEVICE": "cpu"} if args.cpu else None)


def sm80(args):
    """The sm_80 split kernel on a Hopper GPU: its SASS, its time and error at both pipeline depths beside the
    Hopper kernel's, the GEMM tests."""
    run(["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.max.sm", "--format=csv,noheader"])
    if not passed("build", run(IMPORT_LIBRARY)):
        return ["build"]
    failed = []
    sass = os.path.join(args.out, "sm80_sass.txt")
    dump_sass(sorted(glob.glob(os.path.join(default_build_root(), "kernels_gemm_cuda_*", "*.so"))), sass)
    say("SASS: tensor-core instructions per GEMM kernel:")
    print_instruction_counts(sass, "HMMA|HGMMA", by_opcode=True)
    sweep = [PYTHON, "tools/gemm_sweep.py", "--path", "split_fp16_sm80"]
    if not passed("sm80 sweep", run(sweep, log=os.path.join(args.out, "sm80_sweep.log"))):
        failed.append("sm80 sweep")
    say("--- two stages (the A100's depth)")
    run(sweep, env={"KERNELS_GEMM_SM80_STAGES": "2"}, stop_after_lines=4)
    say("--- the Hopper kernel")
    run([PYTHON, "tools/gemm_sweep.py"], stop_after_lines=4)
    if not args.skip_tests:
        ensure_module("xdist")
        gemm_tests = sorted(glob.glob(os.path.join(REPO, "tests", "test_gemm*.py")))  # the GEMM family's files
        command = [PYTHON, "-m", "pytest", "-q", "-x", "-rs", *gemm_tests,
                   *shlex.split(os.environ.get("PYTEST_ARGS", "")), *args.extra]
        say("== GEMM tests (output in sm80_pytest.log)")
        ran = run(command, log=os.path.join(args.out, "sm80_pytest.log"), show=False, limit_s=args.test_time_limit)
        show_tail(ran.lines, 15)
        if not passed("GEMM tests", ran, args.test_time_limit):
            failed.append("GEMM tests")
        # The depth an A100 runs (two stages), which the automatic choice never takes on Hopper: the split tests and
        # every kernel's small cases again on it.
        two_stages = {"KERNELS_GEMM_SM80_STAGES": "2"}
        say("== GEMM split tests and sanitize_cases at two stages (output in sm80_pytest_2_stages.log)")
        ran = run([*command, "-k", "split"], log=os.path.join(args.out, "sm80_pytest_2_stages.log"), show=False,
                  limit_s=args.test_time_limit, env=two_stages)
        show_tail(ran.lines, 3)
        if not passed("GEMM split tests, two stages", ran, args.test_time_limit):
            failed.append("GEMM split tests, two stages")
        if not passed("sanitize_cases, two stages", run([PYTHON, CASES], env=two_stages)):
            failed.append("sanitize_cases, two stages")
    return failed


# One forward of ModelNew at the problem's shape on the split path named in argv[1], after two unprofiled ones.
PROFILED_CALL = """
import sys
import torch
import reference
from kernels.gemm.gemm import forced_gemm_path
from model_new import GemmMultiplyLeakyReLUModelNew
init = reference.gemm_multiply_leaky_relu_get_init_inputs()
model = GemmMultiplyLeakyReLUModelNew(*init).cuda()
weight, bias = model.gemm.weight.detach(), model.gemm.bias.detach()
x = torch.randn(1024, 8192, device="cuda")
path, call = sys.argv[1], sys.argv[2]
with forced_gemm_path(path), torch.no_grad():
    y, _ = torch.ops.kernels.gemm_multiply_leaky_relu(x, weight, bias, init[2], init[3], False)
    grad_y = torch.randn_like(y)
    backward = torch.ops.kernels.gemm_multiply_leaky_relu_backward

    def once():
        if call == "forward":  # from the second call on, the model's kept weight split (the presplit kernel)
            model(x)
        elif call == "forward_anew":  # the op without a weight split: w split in registers, as a training forward
            torch.ops.kernels.gemm_multiply_leaky_relu(x, weight, bias, init[2], init[3], False)
        else:
            wants_x = call == "grad_x"
            backward(grad_y, x, weight, y, init[2], init[3], wants_x, not wants_x, not wants_x)

    for _ in range(2):
        once()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    once()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
"""

PROFILED_CALLS = ("forward", "forward_anew", "grad_x", "grad_w")

NCU_SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "MemoryWorkloadAnalysis_Tables",
                "SchedulerStats", "WarpStateStats", "LaunchStats", "Occupancy", "SourceCounters")


def profile(args):
    """Tensor-core rates, then Nsight Compute over one call (the forward, or a product of the backward) per split
    path named."""
    os.environ["KERNELS_LINEINFO"] = "1"
    failed = []
    targets = []
    for target in args.extra or ["split_fp16", "split_fp16_sm80"]:
        path, _, call = target.partition(":")
        if call not in ("",) + PROFILED_CALLS:
            return [f"profile: unknown call '{call}' in '{target}'; expected PATH, or PATH:" + " or PATH:".join(
                PROFILED_CALLS[1:])]
        targets.append((path, call or "forward", target.replace(":", "_")))
    if not args.skip_rates and not passed("tensor-core rates", run(
            [PYTHON, "tools/gemm_sweep.py", "tensor-core-rates"], log=os.path.join(args.out, "tensor_core_rates.log"))):
        failed.append("tensor-core rates")
    if not passed("build", run(IMPORT_LIBRARY)):
        return failed + ["build"]
    ncu = shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))), None)
    if ncu is None:
        return failed + ["ncu not found"]
    for path, call, name in targets:
        report = os.path.join(tempfile.mkdtemp(), name)
        command = [ncu, "--profile-from-start", "off", "--import-source", "no", "-f", "-o", report,
                   *[part for section in NCU_SECTIONS for part in ("--section", section)],
                   PYTHON, "-c", PROFILED_CALL, path, call]
        say(f"== ncu, {path}, {call}")
        if not passed(f"ncu {name}", run(command, log=os.path.join(args.out, f"ncu_{name}_run.log"), show=False,
                                         limit_s=300)):
            failed.append(f"ncu {name}")
            continue
        if not passed(f"ncu {name} details", run([ncu, "--import", report + ".ncu-rep", "--page", "details"],
                                                  log=os.path.join(args.out, f"ncu_{name}.txt"), show=False)):
            failed.append(f"ncu {name} details")
        if not passed(f"ncu {name} source", run([ncu, "--import", report + ".ncu-rep", "--page", "source", "--csv",
                                                 "--print-source", "sass", "--kernel-name", "regex:split_gemm"],
                                                log=os.path.join(args.out, f"ncu_{name}_source.csv"), show=False)):
            failed.append(f"ncu {name} source")
        run(["grep", "-E", "^  [a-z_]|Duration|Compute \\(SM\\) Throughput|Memory Throughput|Issue Slots Busy|"
             "Executed Ipc A|Warp Cycles Per Issued|No Eligible|Registers Per|Achieved Occupancy",
             os.path.join(args.out, f"ncu_{name}.txt")])
    return failed


GELU_TANH_MEASUREMENT = r"""
import json, math, sys
import torch
import torch.nn.functional as F
from kernels.functional import gelu_tanh
from kernels.precision import relative_error
from kernels.timing import time_each_ms

def new_gelu(x):  # minGPT's NewGELU, op for op
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

def float64_gradient(x, grad):
    x64 = x.double().requires_grad_(True)
    return torch.autograd.grad(new_gelu(x64), x64, grad.double())[0]

def eager_gradient(x, grad):
    leaf = x.clone().requires_grad_(True)
    return torch.autograd.grad(new_gelu(leaf), leaf, grad)[0]

results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [65536, 3072], "times": {},
           "errors": {}}
print(f"{results['device']}, torch {results['torch']}")
for dtype in (torch.float32, torch.bfloat16):
    name = str(dtype).removeprefix("torch.")
    x = torch.randn(65536, 3072, device="cuda", dtype=dtype) * 3
    grad = torch.randn_like(x)
    copy_out = torch.empty_like(x)
    size = x.numel() * x.element_size()
    calls = {"copy": (lambda: copy_out.copy_(x), 2), "ours forward": (lambda: gelu_tanh(x), 2),
             "ours backward": (lambda: torch.ops.kernels.gelu_tanh_backward(grad, x), 3),
             "eager formula forward": (lambda: new_gelu(x), 2),
             "F.gelu tanh forward": (lambda: F.gelu(x, approximate="tanh"), 2),
             "aten gelu_backward tanh": (lambda: torch.ops.aten.gelu_backward(grad, x, approximate="tanh"), 3)}
    times = time_each_ms([fn for fn, _ in calls.values()], samples=30)
    copy_rate = 2 * size / times[0]
    print(f"{name}, 65536 x 3072 ({x.numel()} elements):")
    for (label, (_, tensors)), ms in zip(calls.items(), times):
        rate = tensors * size / ms
        results["times"][f"{name} {label}"] = {"ms": ms, "GB/s": rate / 1e6, "of copy": rate / copy_rate}
        print(f"  {label:26s} {ms:8.4f} ms  {rate / 1e6:7.0f} GB/s  {rate / copy_rate:6.1%} of the copy's rate")
    del x, grad, copy_out
    torch.cuda.empty_cache()

inputs = {"randn*3": lambda: torch.randn(1 << 24, device="cuda") * 3,
          "-20..20": lambda: torch.linspace(-20, 20, 1 << 24, device="cuda")}
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    name = str(dtype).removeprefix("torch.")
    for label, make in inputs.items():
        x = make().to(dtype)
        grad = torch.randn(x.shape, device="cuda").to(dtype)
        y64, g64 = new_gelu(x.double()), float64_gradient(x, grad)
        row = {"ours forward": relative_error(gelu_tanh(x), y64),
               "eager forward": relative_error(new_gelu(x), y64),
               "F.gelu forward": relative_error(F.gelu(x, approximate="tanh"), y64),
               "ours backward": relative_error(torch.ops.kernels.gelu_tanh_backward(grad, x), g64),
               "eager backward": relative_error(eager_gradient(x, grad), g64),
               "aten gelu_backward": relative_error(torch.ops.aten.gelu_backward(grad, x, approximate="tanh"), g64)}
        results["errors"][f"{name} {label}"] = row
        print(f"error against float64, {name} {label}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()))
with open(sys.argv[1], "w") as f:
    json.dump(results, f, indent=1)
"""


# The causal softmax measurement, in a process of its own: argv[1] the shape, argv[2] the dtypes, argv[3] the JSON path.
CAUSAL_SOFTMAX_MEASUREMENT = r"""
import json, math, sys
import torch
from kernels.functional import causal_softmax
from kernels.precision import relative_error
from kernels.timing import time_each_ms

shape = tuple(int(n) for n in sys.argv[1].split(","))
dtypes = [getattr(torch, name) for name in sys.argv[2].split(",")]
rows, columns = shape[-2:]
scale = 1.0 / math.sqrt(96)  # 44_MiniGPTBlock: n_embd 768, 8 heads
bias = torch.tril(torch.ones(columns, columns, device="cuda")).view(1, 1, columns, columns)[..., -rows:, :]
numel = math.prod(shape)
visible = numel // (rows * columns) * sum(min(columns, max(0, i + columns - rows + 1)) for i in range(rows))
print(torch.cuda.get_device_name(), "torch", torch.__version__, "shape", shape, "scale", scale)
results = []

def eager(scores):  # minGPT's steps, its mask buffer compared with 0 at each call
    att = scores * scale
    att = att.masked_fill(bias[:, :, :rows, :columns] == 0, float("-inf"))
    return torch.softmax(att, dim=-1)

for dtype in dtypes:
    size = torch.tensor([], dtype=dtype).element_size()
    scores = torch.randn(shape, device="cuda").mul_(3).to(dtype)
    grad = torch.randn(shape, device="cuda").to(dtype)
    y = causal_softmax(scores, scale)
    leaf = scores.clone().requires_grad_(True)
    y_graphed = causal_softmax(leaf, scale)
    eager_leaf = scores.clone().requires_grad_(True)
    y_eager = eager(eager_leaf)
    forward_bytes, backward_bytes = (visible + numel) * size, (2 * visible + numel) * size
    copy_forward = torch.empty(forward_bytes // 2 // size, dtype=dtype, device="cuda")
    copy_backward = torch.empty(backward_bytes // 2 // size, dtype=dtype, device="cuda")
    copy_forward_out, copy_backward_out = torch.empty_like(copy_forward), torch.empty_like(copy_backward)
    fns = {
        "forward": lambda: causal_softmax(scores, scale),
        "forward copy": lambda: copy_forward_out.copy_(copy_forward),
        "forward eager": lambda: eager(scores),
        "backward op": lambda: torch.ops.kernels.causal_softmax_backward(grad, y, scale),
        "backward autograd": lambda: torch.autograd.grad(y_graphed, leaf, grad, retain_graph=True),
        "backward copy": lambda: copy_backward_out.copy_(copy_backward),
        "backward eager autograd": lambda: torch.autograd.grad(y_eager, eager_leaf, grad, retain_graph=True),
    }
    times = dict(zip(fns, time_each_ms(list(fns.values()), samples=20)))
    del copy_forward, copy_backward, copy_forward_out, copy_backward_out
    # Errors against float64 on the first 16 matrices of the batch (the whole tensor in float64 would not fit twice).
    part = scores.reshape(-1, rows, columns)[:16]
    part_grad = grad.reshape(-1, rows, columns)[:16]
    s64 = part.double().requires_grad_(True)
    y64 = eager(s64.view(-1, 1, rows, columns)).view(-1, rows, columns)
    (g64,) = torch.autograd.grad(y64, s64, part_grad.double())
    errors = {}
    for name, fn in (("ours", causal_softmax), ("eager", lambda s, _: eager(s.view(-1, 1, rows, columns)).view(s.shape))):
        s_leaf = part.clone().requires_grad_(True)
        out = fn(s_leaf, scale)
        (g,) = torch.autograd.grad(out, s_leaf, part_grad)
        errors[name] = (relative_error(out.detach(), y64.detach()), relative_error(g, g64))
    gb = lambda b, ms: b / ms / 1e9  # TB/s
    row = {"dtype": str(dtype), "shape": shape, "times_ms": times, "forward_bytes": forward_bytes,
           "backward_bytes": backward_bytes, "errors": errors, "device": torch.cuda.get_device_name()}
    results.append(row)
    print(f"== {dtype}: forward moves {forward_bytes / 1e9:.3f} GB (unmasked read, all written), backward "
          f"{backward_bytes / 1e9:.3f} GB")
    for direction, nbytes in (("forward", forward_bytes), ("backward", backward_bytes)):
        copy_ms = times[f"{direction} copy"]
        for name, ms in times.items():
            if name.startswith(direction):
                print(f"  {name:26} {ms:8.4f} ms  {gb(nbytes, ms):6.3f} TB/s of its bytes  "
                      f"{copy_ms / ms * 100:6.1f}% of the copy's rate")
    print(f"  eager's forward / ours: {times['forward eager'] / times['forward']:.2f}x; eager's autograd backward / "
          f"ours: {times['backward eager autograd'] / times['backward autograd']:.2f}x")
    print(f"  error against float64 (first 16 matrices), forward: ours {errors['ours'][0]:.4g}, eager "
          f"{errors['eager'][0]:.4g}; gradient: ours {errors['ours'][1]:.4g}, eager {errors['eager'][1]:.4g}")
    del scores, grad, y, leaf, y_graphed, eager_leaf, y_eager
    torch.cuda.empty_cache()
with open(sys.argv[3], "w") as f:
    json.dump(results, f, indent=1)
"""


def gelu_tanh(args):
    """The GELU (tanh) kernels' time against a copy at the MLP activation's size, and their error against float64."""
    if not passed("build", run(IMPORT_LIBRARY)):
        return ["build"]
    say("== gelu-tanh: 65536 x 3072, against a device-to-device copy")
    ran = run([PYTHON, "-c", GELU_TANH_MEASUREMENT, os.path.join(args.out, "gelu_tanh.json")],
              log=os.path.join(args.out, "gelu_tanh.log"), limit_s=600)
    return [] if passed("gelu-tanh", ran, 600) else ["gelu-tanh"]


def causal_softmax(args):
    """The causal softmax family's forward and backward against the copy rate and eager's steps."""
    ran = run([PYTHON, "-c", CAUSAL_SOFTMAX_MEASUREMENT, args.shape, args.dtypes,
               os.path.join(args.out, "causal_softmax.json")], log=os.path.join(args.out, "causal_softmax.log"))
    return [] if passed("causal-softmax", ran) else ["causal-softmax"]


def run_all(args):
    """build, tests, sanitize, bench on one build; nothing after a failed build or smoke test."""
    failed = build(args)
    if failed:
        say("build or smoke test failed: stopping here")
        return failed
    if not args.skip_tests:
        args.quick = False
        failed += tests(args)
    if not args.skip_sanitize:
        failed += sanitize(args)
    if not args.skip_bench:
        failed += bench(args)
    return failed


# --- arguments


# What each subcommand runs: its --help.
DETAILS = {
    "build": "nvidia-smi's line for the GPU, torch's and CUDA's versions, the CPU count. A cold build of the op "
             "library into a fresh $TORCH_EXTENSIONS_DIR, timed, with each library's targets' seconds from ninja's "
             "log; the build again into another empty folder (the compilers' files then in the page cache: the "
             "difference is cold disk); a warm import in a new process and of kernels alone after torch, timed; "
             "python, torch and CUDA's start-up alone, timed. --units: each compiler command of the build again, "
             "alone and then all at once (tools/host_timing.py build-units). cuobjdump's SASS of every library into "
             "sass.txt, with the global accesses of the vectorized fp32 forward kernel and the HGMMA count per GEMM "
             f"kernel. Then the smoke test (cases) under a {SMOKE_TEST_LIMIT_S} s limit, as a pipeline that "
             "deadlocks hangs.",
    "tests": "python -m pytest -q -rs tests under --time-limit; --quick adds -m \"not slow\"; other arguments go to "
             "pytest, and where they name test files or node ids those run instead of tests/. The whole output into "
             "pytest.log, its last 25 lines to the terminal.",
    "sanitize": "the library built first, outside the sanitizer, with KERNELS_LINEINFO=1 (source lines in the "
                "reports); then compute-sanitizer's memcheck, racecheck, initcheck and synccheck over the cases, each "
                "into sanitize_<tool>.log: one line per tool, a failing tool's last 20 lines.",
    "cases": f"every CUDA kernel once on small shapes against eager ({CASES}): tails, offset views, every dtype, "
             "both GEMM paths.",
    "bench": "bench.py --json bench.json --plot bench.png --markdown bench.md, its output in bench.log. --runs N "
             "runs it N - 1 times more (bench<run>.json and .log only), then prints ModelNew's speedup per row over "
             "the runs, its lowest, and the rows under --floor or missing from a run; --summarize prints that for "
             "JSON files of `bench.py --json` already written, and runs nothing.",
    "multi-gpu": "nvidia-smi, the GPUs' links (nvidia-smi topo -m), torch's device count; then parts, each under a "
                 "time limit, into <part>.log with its last 25 lines shown: build (once, so that the tests and the "
                 "ranks load the library; a failed build stops here), pytest_multi_gpu (tests/test_multi_gpu.py), "
                 "ddp_check and tp_check (as the ddp and tp subcommands), peak_memory (tests/test_reliability.py -k "
                 "peak_memory); then the ranks' summary lines. NVLink multicast is off in every process it starts "
                 "(NO_NVLINK_MULTICAST, tests/distributed_helpers.py).",
    "ddp": f"ModelNew and the reference in DistributedDataParallel, 2 GPUs over NCCL ({DDP_CHECK} under torchrun): "
           "equal gradients and weights on every rank. NVLink multicast off.",
    "tp": f"tensor parallelism and FSDP2 on `gemm` against the reference under the same plan ({TP_CHECK} under "
          "torchrun on 2 processes): GPUs over NCCL, or with --cpu the CPU over gloo. NVLink multicast off.",
    "sm80": "nvidia-smi's clocks, the library built (where $TORCH_EXTENSIONS_DIR or torch's default folder has it, "
            "that one); the tensor-core instructions per GEMM kernel from the SASS (sm80_sass.txt); tools/"
            "gemm_sweep.py --path split_fp16_sm80 (sm80_sweep.log), its first 4 lines again at two pipeline stages "
            "(KERNELS_GEMM_SM80_STAGES=2, the A100's depth), the first 4 lines of the Hopper kernel's; then pytest "
            "-q -x -rs tests/test_gemm*.py under --test-time-limit (sm80_pytest.log, its last 15 lines shown; other "
            "arguments go to that pytest); then the split tests (-k split) and the cases again at two stages.",
    "profile": "tools/gemm_sweep.py tensor-core-rates (tensor_core_rates.log; --skip-rates leaves it out); then, for "
               "each split path named (default: split_fp16 and split_fp16_sm80), Nsight Compute over one call at the "
               "problem's shape, that path forced, on a build with KERNELS_LINEINFO=1: every kernel of the call with "
               "the speed of light, workload, scheduler and warp-state sections (ncu_<name>.txt), and the GEMM "
               "kernel's SASS with its stall samples (ncu_<name>_source.csv). The call is the forward (a model's, its "
               "weight's split kept), PATH:forward_anew the op's forward without a weight split, PATH:grad_x or "
               "PATH:grad_w one product of the backward; <name> is the argument with ':' as '_'.",
    "gelu-tanh": "the GELU (tanh) family at 44_MiniGPTBlock's MLP activation (65536 x 3072), float32 and bfloat16: "
                 "forward and backward timed beside a device-to-device copy of the same tensor (GB/s, share of the "
                 "copy's rate), eager's formula, F.gelu(approximate=\"tanh\") and aten's gelu_backward beside them; "
                 "then the error against float64 per dtype on randn * 3 and on -20..20. Into gelu_tanh.json and "
                 "gelu_tanh.log.",
    "causal-softmax": "the causal softmax family at 44_MiniGPTBlock's scores (128, 8, 512, 512) or --shape: for each "
                      "of --dtypes, forward and backward (the op, and through autograd) timed beside a "
                      "device-to-device copy of the bytes each must move and eager's steps, and the error of each "
                      "against float64; into causal_softmax.log and causal_softmax.json.",
    "all": "build, tests, sanitize and bench, in that order, into one folder and on one build; stops after build "
           "where the build or the smoke test failed.",
}


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    subcommands = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", default=os.environ.get("OUT") or "/tmp/device_check",
                        help="folder for the logs and results (default: $OUT, else /tmp/device_check)")

    def add(name, function, summary, extra=None):
        """A subcommand; `extra` names where its unrecognized arguments go, None where it takes none."""
        sub = subcommands.add_parser(name, parents=[common], help=summary, description=f"{name}: {DETAILS[name]}",
                                     allow_abbrev=False)
        sub.set_defaults(function=function, extra_to=extra)
        return sub

    def name_extra_in_usage(sub, extra):
        sub.usage = sub.format_usage().removeprefix("usage: ").rstrip() + f" [{extra} ...]"

    def add_bench_options(sub):
        sub.add_argument("--runs", type=int, default=int(os.environ.get("BENCH_RUNS") or 1),
                         help="bench.py runs; over 1, ModelNew's speedup per row over them (default: $BENCH_RUNS, "
                         "else 1)")
        sub.add_argument("--floor", type=float, default=0.98, help="speedup under which a row is named (0.98)")
        sub.add_argument("--bench-args", default=os.environ.get("BENCH_ARGS", ""),
                         help="arguments for bench.py, one string (default: $BENCH_ARGS)")

    sub = add("build", build, "cold build and warm imports timed, SASS summaries, the smoke test")
    sub.add_argument("--units", action="store_true",
                     help="each compiler command of the build again, alone and then all at once")
    sub = add("tests", tests, "the full test suite; other arguments go to pytest", extra="pytest")
    sub.add_argument("--quick", action="store_true", help='only -m "not slow"')
    sub.add_argument("--time-limit", type=int, default=900, help="seconds (900)")
    name_extra_in_usage(sub, "PYTEST_ARGS")
    add("sanitize", sanitize, "compute-sanitizer's four tools over every kernel on small shapes")
    add("cases", lambda args: smoke_test(), "every CUDA kernel once on small shapes against eager (the smoke test)")
    sub = add("bench", bench, "bench.py with JSON, chart and Markdown; other arguments go to bench.py",
              extra="bench.py")
    add_bench_options(sub)
    sub.add_argument("--summarize", nargs="+", metavar="JSON",
                     help="only the speedups over runs of these `bench.py --json` files, in run order")
    name_extra_in_usage(sub, "BENCH_ARGS")
    add("multi-gpu", multi_gpu, "the 2-GPU run: multi-GPU tests, DDP and tensor-parallel checks, peak memory")
    add("ddp", ddp, "ModelNew in DistributedDataParallel on 2 GPUs against the reference")
    sub = add("tp", tp, "tensor parallelism and FSDP2 on 2 processes against the reference")
    sub.add_argument("--cpu", action="store_true", help="on the CPU over gloo (TP_CHECK_DEVICE=cpu)")
    sub = add("sm80", sm80, "the sm_80 kernel on a Hopper GPU; other arguments go to the GEMM tests' pytest",
              extra="pytest")
    sub.add_argument("--skip-tests", action="store_true", default=env_flag("SKIP_TESTS"),
                     help="no GEMM tests (default: $SKIP_TESTS set)")
    sub.add_argument("--test-time-limit", type=int, default=int(os.environ.get("TEST_TIMEOUT") or 400),
                     help="seconds for the GEMM tests (default: $TEST_TIMEOUT, else 400)")
    name_extra_in_usage(sub, "PYTEST_ARGS")
    sub = add("profile", profile, "tensor-core rates; Nsight Compute over one call per split path named",
              extra="paths")
    sub.add_argument("--skip-rates", action="store_true", default=env_flag("SKIP_RATES"),
                     help="leave out the tensor-core rates (default: $SKIP_RATES set)")
    name_extra_in_usage(sub, "PATH[:forward_anew|:grad_x|:grad_w]")
    add("gelu-tanh", gelu_tanh, "the GELU (tanh) kernels' bandwidth against a copy at 65536 x 3072, and their error")
    sub = add("causal-softmax", causal_softmax, "the causal softmax family against the copy rate and eager's steps")
    sub.add_argument("--shape", default="128,8,512,512", help="the scores' shape, comma-separated (128,8,512,512)")
    sub.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (float32,bfloat16)")
    sub = add("all", run_all, "build, tests, sanitize and bench in order; stops after a failed build or smoke test")
    sub.add_argument("--skip-tests", action="store_true", default=env_flag("SKIP_TESTS"),
                     help="(default: $SKIP_TESTS set)")
    sub.add_argument("--skip-sanitize", action="store_true", default=env_flag("SKIP_SANITIZE"),
                     help="(default: $SKIP_SANITIZE set)")
    sub.add_argument("--skip-bench", action="store_true", default=env_flag("SKIP_BENCH"),
                     help="(default: $SKIP_BENCH set)")
    sub.add_argument("--time-limit", type=int, default=900, help="seconds for the tests (900)")
    add_bench_options(sub)

    args, extra = parser.parse_known_args(argv)
    if extra[:1] == ["--"]:  # `tests -- -k gemm`: the separator is not pytest's
        extra = extra[1:]
    if extra and args.extra_to is None:
        parser.error(f"{args.subcommand} takes no arguments besides its options: {shlex.join(extra)}")
    args.extra = extra
    args.out = os.path.abspath(args.out)
    args.summarize = getattr(args, "summarize", None)
    return args


def main(argv=None):
    args = parse_arguments(argv)
    os.makedirs(args.out, exist_ok=True)
    os.environ["PYTHONUNBUFFERED"] = "1"
    CONSOLE.open(os.path.join(args.out, f"device_check_{args.subcommand}.log"))
    failed = args.function(args)
    say(f"device_check {args.subcommand}: " + (f"FAILED: {', '.join(failed)}" if failed else "ok")
        + f" (logs in {args.out})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
