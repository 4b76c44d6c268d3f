"""The op library's host code built two or three ways, timed side by side by bench.py: whether a build choice of the
loader (the torch side and autograd at -O1; each family's CPU loops, ops and autograd as libraries of their own)
costs a row anything. Each variant builds into its own folder; bench.py then runs under each variant in turn, for
--rounds rounds, so that drift of the host's speed hits every variant alike, and ModelNew's speedup over eager
per row is printed per variant and round.

    python tools/build_variant_ab.py [--rounds 2] [--variants loader,o3,joined] [--bench "ARGS" ...]

Variants:
  loader  the loader as it is.
  o3      every C++ unit at -O3 (the loader builds the units without CPU loops at -O1).
  joined  one library per family, every unit at -O3: the layout of a machine with fewer CPUs than units.
--bench: one bench.py invocation's arguments (repeatable); default: the GPU per-call rows (leaky_relu at
16x16384, where host code decides) and the CPU LeakyReLU rows in fp32 and bf16.
"""

import argparse
import collections
import json
import os
import shlex
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in the child before bench.py: patches the loader's choices, then runs bench.py as __main__.
_EVERY_UNIT_AT_O3 = ("from kernels import loader\n"
                     "_flags = loader.build_flags\n"
                     "loader.build_flags = lambda with_cuda, cpu_loops=True: _flags(with_cuda, True)\n")
VARIANT_PATCHES = {
    "loader": "",
    "o3": _EVERY_UNIT_AT_O3,
    "joined": _EVERY_UNIT_AT_O3 + "loader._cpu_count = lambda: 1\n",  # one library per family
}
CHILD = """import runpy, sys
sys.path.insert(0, {repo!r})
{patch}
sys.argv = ["bench.py", *{args!r}]
runpy.run_path({bench!r}, run_name="__main__")
"""
DEFAULT_BENCH = ["--problem leaky_relu --size 16x16384 --variant ModelNew --quick",
                 "--problem leaky_relu_cpu --dtype fp32 --dtype bf16 --variant ModelNew"]


def run_bench(variant, args, build_root, json_path):
    code = CHILD.format(repo=REPO, patch=VARIANT_PATCHES[variant], args=[*shlex.split(args), "--json", json_path],
                        bench=os.path.join(REPO, "bench.py"))
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=build_root)
    ran = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    if ran.returncode != 0:
        sys.exit(f"{variant}: bench.py {args} failed:\n{ran.stdout[-2000:]}\n{ran.stderr[-3000:]}")
    with open(json_path) as f:
        rows = json.load(f)["rows"]
    return {(r["problem"], r["case"]): r["speedup"] for r in rows if r["variant"].startswith("ModelNew")}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default="loader,o3,joined")
    parser.add_argument("--bench", action="append")
    args = parser.parse_args()
    variants = args.variants.split(",")
    scratch = tempfile.mkdtemp(prefix="build_variant_ab_")
    roots = {variant: os.path.join(scratch, variant) for variant in variants}
    speedups = collections.defaultdict(list)  # (row, variant) -> one speedup per round
    for round_index in range(args.rounds):
        for variant in variants:
            for i, bench_args in enumerate(args.bench or DEFAULT_BENCH):
                json_path = os.path.join(scratch, f"{variant}_{round_index}_{i}.json")
                for row, speedup in run_bench(variant, bench_args, roots[variant], json_path).items():
                    speedups[(row, variant)].append(speedup)
            print(f"round {round_index + 1}, {variant}: done", flush=True)
    rows = list(dict.fromkeys(row for row, _ in speedups))
    print(f"\nModelNew's speedup over eager, per round ({', '.join(variants)})")
    for row in rows:
        cells = "   ".join(f"{variant} " + " ".join(f"{s:.3f}" for s in speedups[(row, variant)])
                           for variant in variants)
        print(f"{row[0] + ': ' + row[1]:<52} {cells}")


if __name__ == "__main__":
    main()
