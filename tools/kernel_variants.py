"""Times versions of kernel files side by side on the GPU machine: each version built in a copy of the
repository with those files replaced, then one command run in that copy (default: the problem-size rows of
tools/gemm_sweep.py on a forced path). For kernel work: several candidates measured in one machine session.

    python tools/kernel_variants.py --file kernels/gemm/gemm_sm80.cu --path split_fp16_sm80 \
        base=.variants/A.cu pipelined=.variants/B.cu
    python tools/kernel_variants.py --file F --command "python bench.py --quick" a=... b=...
    python tools/kernel_variants.py --file F --file G old=.variants/F_old,.variants/G_old

Where --file is given more than once, a version names one replacement per --file, comma-separated, in their order.

The working tree's own version runs first, as `current`. The copies share one extensions folder (builds are named
by their sources' hash).
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", required=True, action="append",
                        help="a kernel file the versions replace (repo-relative); may be repeated")
    parser.add_argument("--path", default="split_fp16_sm80", help="gemm_sweep's forced path (default command)")
    parser.add_argument("--command", help="run in each copy instead of gemm_sweep's problem-size rows")
    parser.add_argument("--repeat", type=int, default=2, help="runs of the command per version (2)")
    parser.add_argument("versions", nargs="*", metavar="NAME=FILE")
    args = parser.parse_args()
    command = args.command or f"{shlex.quote(sys.executable)} tools/gemm_sweep.py --path {args.path}"
    if any("=" not in v or len(v.split("=", 1)[1].split(",")) != len(args.file) for v in args.versions):
        parser.error("each version is NAME=FILE[,FILE...], one file per --file")
    versions = [("current", None)] + [tuple(v.split("=", 1)) for v in args.versions]
    root = tempfile.mkdtemp(prefix="variants_")
    # One extensions folder for all copies: builds are named by their sources' hash, so the families a version leaves
    # unchanged are built once.
    extensions = os.path.join(root, "extensions")
    for name, path in versions:
        copy = os.path.join(root, name)
        shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".git", ".variants", ".whl", "__pycache__"))
        if path:
            for replacement, replaced in zip(path.split(","), args.file):
                shutil.copyfile(os.path.join(REPO, replacement), os.path.join(copy, replaced))
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=extensions, PYTHONUNBUFFERED="1")
        start = time.time()
        built = subprocess.run([sys.executable, "-c", "import kernels.functional"], cwd=copy, env=env,
                               capture_output=True, text=True)
        print(f"=== {name} ({path or ', '.join(args.file)}): build {time.time() - start:.1f} s"
              + ("" if built.returncode == 0 else f" FAILED\n{built.stderr[-3000:]}"), flush=True)
        if built.returncode != 0:
            continue
        for _ in range(args.repeat):
            status = subprocess.run(command, shell=True, cwd=copy, env=env).returncode
            if status != 0:
                print(f"=== {name}: the command exited with status {status}", flush=True)
            sys.stdout.flush()


if __name__ == "__main__":
    main()
