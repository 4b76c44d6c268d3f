#!/usr/bin/env bash
# The run on a machine with 2 GPUs (repo root): the GPUs and how they are linked, the op library built once, the
# multi-GPU tests (tests/test_multi_gpu.py: cuda:1 with cuda:0 current, two threads, no context on cuda:0, DDP and
# tensor parallelism / FSDP2 under torchrun), the DDP and tensor-parallel checks again on their own for their
# per-rank lines, and the peak-memory tests
# (tests/test_reliability.py). Each part is bounded in time; logs go to $OUT if set. The exit status is non-zero if any part failed.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/multi_gpu_check}
mkdir -p "$OUT"
exec > >(tee "$OUT/multi_gpu_check.log") 2>&1
# NVLink multicast stays off, here and in every process started from here (pytest's subprocesses, torchrun's ranks):
# nothing here needs it, and on a shared multi-GPU host a program that uses it can leave the GPUs unusable.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

nvidia-smi
nvidia-smi topo -m
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'devices', torch.cuda.device_count())"
nproc

failed=0
part() {  # part NAME SECONDS COMMAND...: runs COMMAND under a time limit, logs it to $OUT/NAME.log
  local name=$1 seconds=$2
  shift 2
  echo "== $name"
  timeout --kill-after=30 "$seconds" "$@" > "$OUT/$name.log" 2>&1
  local status=$?
  tail -25 "$OUT/$name.log"
  case $status in
    0) ;;
    124|137) echo "== $name: FAILED: timed out after $seconds s"; failed=1 ;;
    *) echo "== $name: FAILED (exit status $status)"; failed=1 ;;
  esac
}

# One build before anything else, so that the tests and the ranks load the library instead of racing to build it.
part build 600 python3 -c "import kernels.functional"
[ "$failed" = 0 ] || exit 1
part pytest_multi_gpu 1200 python3 -m pytest -q -rs tests/test_multi_gpu.py
part ddp_check 600 python3 -m torch.distributed.run --standalone --nproc_per_node=2 tools/ddp_check.py
part tp_check 600 python3 -m torch.distributed.run --standalone --nproc_per_node=2 tools/tp_check.py
part peak_memory 600 python3 -m pytest -q -rs tests/test_reliability.py -k peak_memory
grep -h "^ddp_check rank" "$OUT/ddp_check.log"
grep -h "tp_check rank" "$OUT/tp_check.log" | grep -v "^Traceback"
exit $failed
