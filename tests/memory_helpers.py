"""What the norms' memory tests share: the peak memory of one call above what was held before it, and the bound on
the blocked ATen formulas' float64 temporaries (kernels/common/row_blocks.h)."""

import os
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in a fresh process after `setup`, which defines call(n): a call on the first n rows of inputs it makes from
# sys.argv[2:]. The peak resident set is reset (clear_refs) once the inputs are written and a 2-row call has run.
_CPU_PEAK_SCRIPT = """
import gc, sys, torch
{setup}
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))
call(2)
gc.collect()
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
results = call(int(sys.argv[1]))
print(status("VmHWM") - before)
"""


def cpu_peak_above_inputs(setup, rows, *args):
    """The peak resident memory of call(rows) (defined by `setup`, given `args` as sys.argv[2:]) above the resident
    memory before it, in a fresh process."""
    result = subprocess.run([sys.executable, "-c", _CPU_PEAK_SCRIPT.format(setup=setup), str(rows),
                             *map(str, args)], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return int(result.stdout.split()[-1])


def cuda_peak_above_inputs(call):
    """The peak CUDA memory allocated by call() above the memory allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    results = call()
    torch.cuda.synchronize()
    del results
    return torch.cuda.max_memory_allocated() - before


def float64_blocks_allowance(device):
    """What the blocked ATen formulas may hold beside their results: 16 blocks of float64 temporaries at most (a
    block: 2^18 elements on the CPU, 2^22 on CUDA), and on the CPU what the call's first parallel region maps (OpenMP
    threads' stacks, malloc arenas), which the resident set counts and other test workers' load varies."""
    return 16 * 8 * (1 << (18 if device == "cpu" else 22)) + (8 << 20 if device == "cpu" else 0)
