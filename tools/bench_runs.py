"""ModelNew's speedup over eager per bench.py row across several runs (the JSON files of `bench.py --json`), its
lowest, and the rows whose lowest is under a floor (0.98 unless given).

    python tools/bench_runs.py bench1.json bench2.json bench3.json [--floor 0.98]
"""

import argparse
import json


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="JSON")
    parser.add_argument("--floor", type=float, default=0.98)
    args = parser.parse_args()
    speedups = {}  # (problem, case, variant) -> one speedup per run, in the order of the first run's rows
    for path in args.runs:
        with open(path) as f:
            for row in json.load(f)["rows"]:
                if row["variant"].startswith("ModelNew"):
                    speedups.setdefault((row["problem"], row["case"], row["variant"]), []).append(row["speedup"])
    below = []
    for (problem, case, variant), values in speedups.items():
        lowest = min(values)
        mark = " <" if lowest < args.floor else ""
        runs = " ".join(f"{v:6.3f}" for v in values)
        print(f"{problem:34} {case:36} {variant:24} {runs}  min {lowest:.3f}{mark}")
        if lowest < args.floor or len(values) < len(args.runs):
            below.append(f"{problem}: {case} ({variant})")
    print(f"\n{len(speedups)} ModelNew rows over {len(args.runs)} runs; under {args.floor} or missing from a run: "
          + (", ".join(below) if below else "none"))


if __name__ == "__main__":
    main()
