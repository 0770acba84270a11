#!/usr/bin/env bash
# The check step of the knob device scripts (tools/mission_knob_device.sh: split_merge_device.sh, tma_load_device.sh),
# on the GPU machine: a knob's GPU test file, first its gate and agreement tests (-m "gpu and not slow", CHECK_S
# seconds at most), then its compute-sanitizer tests (-m "gpu and slow", SANITIZE_S), each into a file under $OUT and one
# summary line printed. A failed first call does not skip the second: both reports are read before trusting a timing.
#   OUT=dir bash tools/gpu_checks.sh tests/test_split_merge.py     -> $OUT/check.txt, $OUT/sanitize.txt
set -uo pipefail
OUT=${OUT:?set OUT}; here=$(cd "$(dirname "$0")/.." && pwd)
tests=${1:?name a test file}
(cd "$here" && timeout "${CHECK_S:-300}" python3 -m pytest -q -m "gpu and not slow" "$tests" -p no:cacheprovider) \
  > "$OUT/check.txt" 2>&1
echo "check rc=$? $(tail -1 "$OUT/check.txt")"
(cd "$here" && timeout "${SANITIZE_S:-240}" python3 -m pytest -q -m "gpu and slow" "$tests" -p no:cacheprovider) \
  > "$OUT/sanitize.txt" 2>&1
echo "sanitize rc=$? $(tail -1 "$OUT/sanitize.txt")"
