#!/usr/bin/env bash
# The sm_80 split kernel on a Hopper GPU (device machine, repo root): build, ptxas report of the GEMM kernels, the
# forced split_fp16_sm80 path at the problem's size (error, time, kernels) at both pipeline depths, the same for
# the Hopper kernel beside it, then the GEMM tests. Logs go to $OUT if set.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/sm80_check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import kernels.functional" || exit 1
for so in "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}"/*gemm*/*.so; do cuobjdump --dump-sass "$so"; done \
  > "$OUT/sass.txt" 2>&1
echo "SASS: tensor-core instructions per GEMM kernel:"
awk '/Function :/{name=$3} /HMMA|HGMMA/{split($2, op, "."); n[name " " op[1]]++} END {for (k in n) print "   ", n[k], k}' \
  "$OUT/sass.txt"
python3 tools/gemm_sweep.py --path split_fp16_sm80 2>&1 | tee "$OUT/sm80_sweep.log"
echo "--- two stages (the A100's depth)"
KERNELS_GEMM_SM80_STAGES=2 python3 tools/gemm_sweep.py --path split_fp16_sm80 2>&1 | head -4
echo "--- the Hopper kernel"
python3 tools/gemm_sweep.py 2>&1 | head -4
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -x -rs tests/test_gemm.py ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -15
fi
