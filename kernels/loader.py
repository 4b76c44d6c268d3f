"""Builds and loads the op library `torch.ops.kernels` with load_inline, all its libraries at once (library_builds):
with CUDA one library per family (kernels/manifest.py), its C++ files joined into one unit and its CUDA files into
another; CPU-only, two libraries, the families with CPU loops and the others, each one C++ unit. Project headers
("x.h", beside the includer or under kernels/) are inlined once with #line directives; system headers take <...>. A
build is named by a hash of its sources, flags and versions, so it is made once per content; concurrent builders
share torch's lock, stale locks are removed.
Env (each names a build of its own): KERNELS_VERBOSE_BUILD=1 (compiler output), KERNELS_LINEINFO=1 (nvcc -lineinfo),
KERNELS_PTXAS_REPORT=1 (ptxas -v, verbose). KERNELS_BUILD_LOCK_TIMEOUT: seconds to wait for another build (600).
"""

import atexit
import concurrent.futures
import contextlib
import hashlib
import importlib
import os
import re
import shutil
import sys
import time
import types
from dataclasses import dataclass

import torch

from kernels.env import env_flag
from torch.utils import cpp_extension

from .manifest import FAMILIES

SOURCE_ROOT = os.path.dirname(os.path.abspath(__file__))
LIBRARY_PREFIX = "kernels"
_PROJECT_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\b")


# ---- sources ----------------------------------------------------------------------------------------------------

def joined_source(paths, root=SOURCE_ROOT):
    """The text of one translation unit: the files at `paths` (relative to `root`) in order, with project headers
    inlined once each and #line directives naming every file as <basename of root>/<path>."""
    root = os.path.abspath(root)
    inlined = set()
    lines = []

    def display_name(real):
        return os.path.join(os.path.basename(root), os.path.relpath(real, root)).replace(os.sep, "/")

    def emit(real):
        if real in inlined:
            return
        inlined.add(real)
        name = display_name(real)
        lines.append(f'#line 1 "{name}"')
        with open(real, encoding="utf-8") as f:
            text = f.read().splitlines()
        for number, line in enumerate(text, 1):
            include = _PROJECT_INCLUDE.match(line)
            if include:
                candidates = [os.path.join(os.path.dirname(real), include.group(1)),
                              os.path.join(root, include.group(1))]
                found = next((os.path.normpath(c) for c in candidates if os.path.isfile(c)), None)
                if found is None:
                    raise FileNotFoundError(
                        f'{name}:{number}: #include "{include.group(1)}" names no project header (looked beside '
                        f'{name} and under {os.path.basename(root)}/); system headers take <...>')
                emit(found)
                lines.append(f'#line {number + 1} "{name}"')
            elif _PRAGMA_ONCE.match(line):
                lines.append("")  # the loader inlines each header once; the blank keeps line numbers
            else:
                lines.append(line)

    for path in paths:
        emit(os.path.normpath(os.path.join(root, path)))
    return "\n".join(lines) + "\n"


def family_sources(families, root=SOURCE_ROOT):
    """(C++ text, CUDA text) of one library made of `families`: one family's, or several joined (as a single-file
    build takes them; per-family namespaces keep their names apart)."""
    cpp = joined_source([p for family in families for p in family.cpp_unit], root)
    cuda_paths = [p for family in families for p in family.cuda_sources]
    return cpp, joined_source(cuda_paths, root) if cuda_paths else ""


# ---- flags ------------------------------------------------------------------------------------------------------


def with_cuda_build():
    return torch.version.cuda is not None and torch.cuda.is_available()


def cuda_arch_flags():
    """One -gencode per distinct visible GPU architecture. Hopper gets sm_90a, which has wgmma, TMA and setmaxnreg;
    the Hopper-only kernels compile to a stub for any other target and their launchers report it, so dispatch falls
    back there."""
    capabilities = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    flags = []
    for major, minor in capabilities:
        arch = f"{major}{minor}{'a' if (major, minor) == (9, 0) else ''}"
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


def build_flags(with_cuda, cpu_loops=True):
    """(C++ flags, CUDA flags, link flags). A C++ unit with CPU loops builds at -O3; one without (host code that runs
    once per call) at -O1, which compiles faster at no cost per call (kernels/leaky_relu/NOTES.md, Decisions, "C++
    units without CPU loops at -O1")."""
    # -fno-trapping-math (as torch itself is built) lets the CPU loops' selects vectorize; results are unchanged.
    # at::parallel_for runs its chunks on OpenMP threads only where the caller is compiled with -fopenmp; linked
    # with it too, the library shares the libgomp that torch has loaded (same soname).
    openmp = ["-fopenmp"] if torch.backends.openmp.is_available() else []
    # AT_PER_OPERATOR_HEADERS, as torch's own sources are built: units include the ATen ops they call
    # (ATen/ops/<op>.h) instead of ATen/Functions.h, every op's declaration, which is slow to parse.
    cflags = (["-O3" if cpu_loops else "-O1", "-fno-trapping-math", "-DAT_PER_OPERATOR_HEADERS", *openmp]
              + (["-DKERNELS_WITH_CUDA"] if with_cuda else []))
    cuda_cflags = []
    if with_cuda:
        # -split-compile=0: cicc and ptxas compile the unit's kernels in threads, one per CPU; the SASS does not
        # depend on the thread count (kernels/gemm/NOTES.md, Decisions, "nvcc -split-compile=0").
        cuda_cflags = ["-O3", "-split-compile=0", *cuda_arch_flags()]
        if env_flag("KERNELS_LINEINFO"):
            cuda_cflags.append("-lineinfo")
        if env_flag("KERNELS_PTXAS_REPORT"):
            cuda_cflags += ["-Xptxas", "-v"]
    return cflags, cuda_cflags, openmp


# ---- building and loading ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Build:
    """One library: its sources, flags and where it lives."""
    label: str  # the family's name, or the name of a group of families built as one library
    family_names: tuple  # the families it holds, in the manifest's order
    name: str
    cpp_source: str
    cuda_source: str
    cflags: tuple
    cuda_cflags: tuple
    ldflags: tuple
    with_cuda: bool
    build_dir: str

    @property
    def library(self):
        return os.path.join(self.build_dir, f"{self.name}.so")


def plan_build(label, families, root=SOURCE_ROOT, with_cuda=None):
    """The Build of one library made of `families` (all their sources), named
    kernels_<label>_<cuda|cpu>_<hash of its content>."""
    with_cuda = with_cuda_build() if with_cuda is None else with_cuda
    cpp_source, cuda_source = family_sources(families, root)
    if not with_cuda:
        cuda_source = ""
    cflags, cuda_cflags, ldflags = build_flags(with_cuda, cpu_loops=any(f.cpu_loop_sources for f in families))
    if not cuda_source:
        cuda_cflags = []  # a library without a CUDA unit is not rebuilt for CUDA's switches
    key = hashlib.sha256()
    for part in [cpp_source, cuda_source, *cflags, *cuda_cflags, *ldflags, torch.__version__,
                 str(torch.version.cuda), sys.version, str(with_cuda)]:
        key.update(part.encode())
        key.update(b"\0")
    name = f"{LIBRARY_PREFIX}_{label}_{'cuda' if with_cuda else 'cpu'}_{key.hexdigest()[:16]}"
    build_root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Build(label, tuple(f.name for f in families), name, cpp_source, cuda_source, tuple(cflags),
                 tuple(cuda_cflags), tuple(ldflags), with_cuda, os.path.join(build_root, name))


def library_builds(families=FAMILIES, root=SOURCE_ROOT, with_cuda=None):
    """The Builds of the op library. With CUDA, one per family, in the manifest's order: its C++ and CUDA units
    compile side by side with every other family's. CPU-only, the families with CPU loops as one library (at -O3) and
    the others as another (at -O1): every C++ unit parses torch's headers, which is most of its compile time, so two
    units are faster than one per family where the compilers share a few cores (kernels/leaky_relu/NOTES.md,
    Decisions, "Build layout")."""
    with_cuda = with_cuda_build() if with_cuda is None else with_cuda
    if with_cuda:
        return [plan_build(family.name, [family], root, with_cuda) for family in families]
    groups = {"with_cpu_loops": [f for f in families if f.cpu_loop_sources],
              "without_cpu_loops": [f for f in families if not f.cpu_loop_sources]}
    return [plan_build(label, group, root, with_cuda) for label, group in groups.items() if group]


def _check_build_tools(with_cuda):
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("kernels: building the op library needs ninja; install it with `pip install ninja`.")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"kernels: building the op library needs a C++ compiler, and `{compiler}` was not found; "
                           "install g++ (e.g. `apt-get install g++`) or point CXX at one.")
    if with_cuda:
        nvcc = os.path.join(cpp_extension.CUDA_HOME or "", "bin", "nvcc")
        if cpp_extension.CUDA_HOME is None or not os.path.exists(nvcc):
            raise RuntimeError(
                f"kernels: a GPU is visible but the CUDA compiler nvcc was not found (CUDA_HOME="
                f"{cpp_extension.CUDA_HOME}); install the CUDA toolkit {torch.version.cuda} to match torch "
                f"{torch.__version__}, or set CUDA_HOME to it.")


def _process_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_for_other_build(build):
    """Waits while another process builds into the same folder (torch's lock file `lock` there). A lock left by a
    builder that no longer runs (a killed build: its pid is in `builder_pid`) is removed at once; a lock held past
    KERNELS_BUILD_LOCK_TIMEOUT seconds (default 600) is an error that says which file to delete."""
    lock = os.path.join(build.build_dir, "lock")
    timeout = float(os.environ.get("KERNELS_BUILD_LOCK_TIMEOUT", "600"))
    deadline = time.monotonic() + timeout
    while os.path.exists(lock):
        try:
            with open(os.path.join(build.build_dir, "builder_pid"), encoding="utf-8") as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            pid = None
        if pid is not None and not _process_alive(pid):
            print(f"kernels: removing the lock of a build that did not finish (process {pid} is gone): {lock}",
                  file=sys.stderr, flush=True)
            with contextlib.suppress(FileNotFoundError):
                os.remove(lock)
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"kernels: the build folder {build.build_dir} has been locked for over {timeout:.0f} s by another "
                f"build{f' (process {pid})' if pid else ''}. If no build of the op library is running, delete {lock} "
                "and import again.")
        time.sleep(0.2)


def _compile(build):
    """Builds `build` with load_inline, which also loads it into the process (unless another process built it
    meanwhile). A compiler error raises here, with the compiler's own message."""
    os.makedirs(build.build_dir, exist_ok=True)
    _wait_for_other_build(build)
    with open(os.path.join(build.build_dir, "builder_pid"), "w", encoding="utf-8") as f:
        f.write(str(os.getpid()))
    cpp_extension.load_inline(
        name=build.name,
        cpp_sources=[build.cpp_source],
        cuda_sources=[build.cuda_source] if build.cuda_source else None,
        extra_cflags=list(build.cflags),
        extra_cuda_cflags=list(build.cuda_cflags),
        extra_ldflags=list(build.ldflags),
        build_directory=build.build_dir,
        with_cuda=build.with_cuda,
        is_python_module=False,
        no_implicit_headers=True,
        verbose=env_flag("KERNELS_VERBOSE_BUILD") or env_flag("KERNELS_PTXAS_REPORT"),
    )


def _load(build):
    """Loads a built library; one that cannot be loaded (a killed link can leave a partial file) is built again."""
    try:
        torch.ops.load_library(build.library)
    except OSError as error:
        print(f"kernels: {build.library} cannot be loaded ({error}); building it again", file=sys.stderr,
              flush=True)
        os.remove(build.library)
        _compile(build)


def build_and_load(builds):
    """Builds the libraries of `builds` that are not built yet, all at once, then loads every one of them (in
    order) that is not loaded yet."""
    missing = [b for b in builds if not os.path.exists(b.library)]
    if missing:
        _check_build_tools(any(b.with_cuda for b in missing))
        target = (f"CUDA ({', '.join(f[f.rindex('=') + 1:] for f in cuda_arch_flags())})"
                  if missing[0].with_cuda else "the CPU only")
        families = [name for b in missing for name in b.family_names]
        libraries = f" ({len(missing)} libraries)" if len(missing) != len(families) else ""
        print(f"kernels: compiling {', '.join(families)}{libraries} for {target}, once per source version, into "
              f"{os.path.dirname(missing[0].build_dir)}",
              file=sys.stderr, flush=True)
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(missing)) as pool:
            for future in [pool.submit(_compile, b) for b in missing]:
                future.result()
        print(f"kernels: built in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    for build in builds:
        if os.path.realpath(build.library) not in torch.ops.loaded_libraries:
            _load(build)


_loaded = False
_registered = set()


def register_once(family_name, register):
    """Calls register() (a family's Python registrations: its fakes and batching rules) once per process, also where
    the family's module is executed again (importlib.reload)."""
    if family_name not in _registered:
        register()
        _registered.add(family_name)


def drain_autograd_at_exit():
    """Registers, once per process, an exit handler that runs a one-element backward on each CUDA device that has a
    context. Autograd's thread for a device may still be releasing a finished backward's tensors when the main thread
    exits; if one holds a Python object and Python is already finalizing, the process aborts ("terminate called
    without an active exception"). That thread drops a task and its graph before it takes the next, so once the
    handler's backward has run, the release is done; the handler's own graph leaves it nothing that holds a Python
    object (its tensors are kept in `record.kept` besides). At exit where CUDA is unusable (a sticky error) the
    handler's error is printed after the real one; the exit code is unchanged."""
    record = sys.modules.setdefault("kernels_autograd_exit", types.ModuleType("kernels_autograd_exit"))
    if hasattr(record, "kept"):
        return
    record.kept = []

    def drain():
        if not torch.cuda.is_initialized():  # also false in a forked child
            return
        for index in range(torch.cuda.device_count()):
            if torch._C._cuda_hasPrimaryContext(index):
                leaf = torch.zeros((), device=f"cuda:{index}", requires_grad=True)
                with torch.enable_grad():
                    product = leaf * 1
                product.backward()
                record.kept.append((leaf, product))

    atexit.register(drain)


def load_library():
    """Builds (where needed) and loads every family's library, then imports each family's Python module,
    which registers its fake implementations and batching rules. Once per process; later calls return at once."""
    global _loaded
    if _loaded:
        return
    build_and_load(library_builds())
    drain_autograd_at_exit()
    _loaded = True  # before the imports below: each family module calls load_library() itself
    for family in FAMILIES:
        importlib.import_module(family.python_module)
