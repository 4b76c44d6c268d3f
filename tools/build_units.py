"""Where a cold build's time goes, unit by unit: each compiler command of the op library's build run again alone,
beside the same command on the unit's headers only (its preprocessor lines: includes, conditionals, defines), so
that a unit's time splits into parsing torch's headers and compiling its own code. Optionally the CUDA units again
without nvcc's -split-compile (the loader's flag), with their SASS compared function by function against the
loader's build; and the C++ units again at -O3 (the loader builds those without CPU loops at -O1).

    python tools/build_units.py [--build-root DIR] [--split-compile] [--o3] [--repeat N] [--part LIBRARY:PATH[,PATH]]
    python tools/build_units.py --build-root DIR --together

--build-root: a folder the loader built into ($TORCH_EXTENSIONS_DIR); default: a fresh build into a temporary one.
--together: instead, each unit's command alone, then all of them at once (as the loader's build runs them): how much of
a unit's time in the parallel build is its own and how much the compilers beside it.
--part: files under kernels/ (joined as the loader joins them) compiled alone with that library's C++ command, e.g.
gemm:gemm/gemm_cublas_bf16x9.cpp: what a unit of their own would take. The commands are ninja's own (`ninja -t commands`), so flags and include paths are the loader's.
"""

import argparse
import collections
import glob
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def unit_commands(build_root):
    """(library label, object, compiler command as a list) for every compiled unit under build_root."""
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
            continue
        if part in ("-MF",):
            skip = True
            continue
        if part in ("-MMD", "-MD"):
            continue
        if part == "-o":
            result += ["-o", output]
            skip = True
            continue
        if part.endswith((".cpp", ".cu")) and os.path.isfile(part):
            result.append(source)
            continue
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
    seconds = time.perf_counter() - start
    if ran.returncode != 0:
        print(f"failed: {shlex.join(command)[:300]}\n{ran.stderr[-2000:]}", flush=True)
        return float("nan")
    return seconds


def sass_by_function(path):
    """{function: its SASS text, addresses kept} from cuobjdump."""
    text = subprocess.run(["cuobjdump", "--dump-sass", path], capture_output=True, text=True).stdout
    functions, name = collections.defaultdict(list), None
    for line in text.splitlines():
        match = re.search(r"Function : (\S+)", line)
        if match:
            name = match.group(1)
        elif name:
            functions[name].append(line.strip())
    return {name: "\n".join(lines) for name, lines in functions.items()}


def time_alone_and_together(units, scratch):
    """Each unit's command once alone, then all at once; prints both per unit."""
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build-root")
    parser.add_argument("--split-compile", action="store_true")
    parser.add_argument("--o3", action="store_true")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--part", action="append", default=[])
    parser.add_argument("--together", action="store_true")
    args = parser.parse_args()
    build_root = args.build_root
    if build_root is None:
        build_root = tempfile.mkdtemp(prefix="build_units_")
        subprocess.run([sys.executable, "-c", "import kernels.functional"], cwd=REPO, check=True,
                       env=dict(os.environ, TORCH_EXTENSIONS_DIR=build_root))
    scratch = tempfile.mkdtemp(prefix="build_units_scratch_")
    if args.together:
        time_alone_and_together(unit_commands(build_root), scratch)
        return
    print(f"{'unit':<44} {'whole':>7} {'headers':>8}  (seconds, each alone; best of {args.repeat})")
    for label, target, command in unit_commands(build_root):
        source = source_of(command)
        headers = os.path.join(scratch, f"{label}_{target}_headers" + os.path.splitext(source)[1])
        with open(source) as f, open(headers, "w") as out:
            out.write(headers_only(f.read()))
        whole = min(timed(with_source_and_output(command, source, os.path.join(scratch, "whole.o")))
                    for _ in range(args.repeat))
        parse = min(timed(with_source_and_output(command, headers, os.path.join(scratch, "headers.o")))
                    for _ in range(args.repeat))
        print(f"{label + ' ' + target:<44} {whole:7.1f} {parse:8.1f}", flush=True)
        if args.split_compile and target.endswith(".cuda.o"):
            unsplit_command = [part for part in command if not part.startswith("-split-compile")]
            split, unsplit = (os.path.join(scratch, f"{label}_{name}.o") for name in ("split", "unsplit"))
            timed(with_source_and_output(command, source, split))
            seconds = min(timed(with_source_and_output(unsplit_command, source, unsplit)) for _ in range(args.repeat))
            a, b = sass_by_function(split), sass_by_function(unsplit)
            differing = sorted(name for name in a.keys() | b.keys() if a.get(name) != b.get(name))
            print(f"{'  without -split-compile':<44} {seconds:7.1f}           SASS: {len(a)} functions, "
                  f"{len(differing)} differ{': ' + ', '.join(differing[:6]) if differing else ''}", flush=True)
        if args.o3 and not target.endswith(".cuda.o") and "-O3" not in command:
            o3_command = ["-O3" if part in ("-O0", "-O1", "-O2", "-Os") else part for part in command]
            seconds = min(timed(with_source_and_output(o3_command, source, os.path.join(scratch, "o3.o")))
                          for _ in range(args.repeat))
            print(f"{'  at -O3':<44} {seconds:7.1f}", flush=True)

    sys.path.insert(0, REPO)
    from kernels.loader import joined_source
    units = unit_commands(build_root)
    for part in args.part:
        library, paths = part.split(":", 1)
        command = next(c for label, target, c in units
                       if label in (f"kernels_{library}_cuda", f"kernels_{library}_cpu") and target == "main.o")
        source = os.path.join(scratch, f"part_{library}.cpp")
        with open(source, "w") as f:
            f.write(joined_source(paths.split(",")))
        seconds = min(timed(with_source_and_output(command, source, os.path.join(scratch, "part.o")))
                      for _ in range(args.repeat))
        print(f"{'part ' + paths:<44} {seconds:7.1f}", flush=True)


if __name__ == "__main__":
    main()
