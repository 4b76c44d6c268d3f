"""The exported KernelBench candidates' time, KernelBench's way, against bench.py's "KB ms" for ModelNew (within 5%).

On the GPU machine, from the repo root: each problem's exported candidate, exec'd from a string in a fresh process
(no package on the path but the pure-torch timing helper), is timed KernelBench's way on get_inputs(), and compared
with bench.py's "KB ms" figure for ModelNew, measured in another process. Exits 1 where a ratio is off by more.

    python tools/export_timing.py [--rounds 3]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
    candidate_ms = float(subprocess.run(
        [sys.executable, "-c", CANDIDATE_TIMING, path, os.path.join(REPO, "kernels", "timing.py")],
        cwd=folder, check=True, capture_output=True, text=True).stdout.split()[-1])
    report = os.path.join(folder, "bench.json")
    subprocess.run([sys.executable, "bench.py", "--problem", problem, "--variant", "ModelNew", "--dtype", "fp32",
                    "--json", report], cwd=REPO, check=True, capture_output=True, text=True)
    rows = json.load(open(report))["rows"]
    # ModelNew on its automatic path: "ModelNew" or "ModelNew (<path>)", not a forced path's row.
    bench_ms = next(r["kernelbench_ms"] for r in rows if r["case"].startswith("forward fp32") and
                    (r["variant"] == "ModelNew" or r["variant"].startswith("ModelNew (")))
    return candidate_ms, bench_ms


def main(rounds=3):
    """Candidate and bench.py measured in turn, `rounds` times each, so that a drift of the GPU's clocks hits both;
    the verdict is on the medians."""
    within = True
    for problem in ("leaky_relu", "gemm_multiply_leaky_relu"):
        source = subprocess.run([sys.executable, "-m", "kernels.export", problem], cwd=REPO, check=True,
                                capture_output=True, text=True).stdout
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "candidate.py")
            with open(path, "w") as f:
                f.write(source)
            pairs = [candidate_and_bench_ms(problem, folder, path) for _ in range(rounds)]
        candidate_ms = statistics.median(c for c, _ in pairs)
        bench_ms = statistics.median(b for _, b in pairs)
        ratio = candidate_ms / bench_ms
        within &= abs(ratio - 1) <= 0.05
        rounds_text = ", ".join(f"{c:.4f}/{b:.4f}" for c, b in pairs)
        print(f"{problem}: exported candidate {candidate_ms:.4f} ms, bench.py KB ms {bench_ms:.4f} ms (medians; "
              f"rounds {rounds_text}), ratio {ratio:.3f} ({'within' if abs(ratio - 1) <= 0.05 else 'NOT within'} 5%)")
    sys.exit(0 if within else 1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each, in turn (3)")
    main(parser.parse_args().rounds)
