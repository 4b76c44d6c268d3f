#!/usr/bin/env bash
# compute-sanitizer's four tools over every CUDA kernel of the library on small shapes (tools/sanitize_cases.py),
# on the device machine, from the repo root. The library is built first, outside the sanitizer. Prints one summary
# line per tool; full logs go to $OUT (or /tmp/sanitize).
set -uo pipefail
OUT=${OUT:-/tmp/sanitize}
mkdir -p "$OUT"
export KERNELS_LINEINFO=1  # source lines in the reports
python3 -c "import kernels.functional" || exit 1
status=0
for tool in memcheck racecheck initcheck synccheck; do
  # Only the library's kernels (their names hold the namespace kernels::), not torch's own; except for initcheck,
  # which must see the writes of torch's kernels too (randn, copies), or every input they made reads as uninitialized.
  filter=(--kernel-regex kns=kernels)
  [ "$tool" = initcheck ] && filter=()
  # initcheck does not track TMA stores' writes: the split GEMM takes its plain-store epilogue under it (the
  # outputs' coverage on the TMA path is tested by tests/test_gemm.py on a NaN-poisoned allocator).
  plain_stores=
  [ "$tool" = initcheck ] && plain_stores=1
  KERNELS_GEMM_PLAIN_STORES=$plain_stores compute-sanitizer --tool "$tool" "${filter[@]}" --target-processes all --error-exitcode 86 \
    python3 tools/sanitize_cases.py > "$OUT/sanitize_$tool.log" 2>&1
  rc=$?
  echo "$tool: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)"
  [ $rc -ne 0 ] && status=1 && tail -20 "$OUT/sanitize_$tool.log"
done
exit $status
