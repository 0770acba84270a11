#!/usr/bin/env bash
# The phase trace (tools/phase_trace.py, docs/TRACE.md) of the mission winner on the GPU machine, from the repo root:
# the GPU test first (traced output bitwise the untraced one's, stamps in order; a kernel that fails it is not read),
# then the trace with pdl on (the winner as searched) and with pdl off, then both side by side.
#   OUT=dir bash tools/phase_trace_device.sh                  # STEPS="check on off compare" by default
#   STEPS="on compare" OUT=dir bash tools/phase_trace_device.sh
# Where the device machine has carried wheels in ./.whl (../shared/device/README.md), they are installed first; the
# trace needs none of them (torch, cupy, numpy and the image's packages suffice), and PYTHONPATH is set to the repo.
# Estimates, not yet measured (H100, cold compile cache): check 2 traced + 2 untraced compiles, 2 x 2 traced runs:
# under 1 min; on / off: 2 compiles, warm-up, 3 traced launches' read-back, interleaved timing (10 rounds x 20 replays
# of ~400 us, per contender), a 2 ms clock probe, plus torch's start: 20-40 s each; compare: a second.
#   check    pytest -m gpu tests/test_phase_trace.py                        -> trace/check.txt
#   on       tools/phase_trace.py (the mission winner, pdl true)            -> trace/pdl_on.{json,txt}
#   off      tools/phase_trace.py --pdl false                               -> trace/pdl_off.{json,txt}
#   compare  tools/phase_trace.py --compare pdl_on.json pdl_off.json        -> trace/compare.txt (printed last)
# Each step is bounded by a timeout; a failed step is reported and the next one still runs (read check.txt before
# trusting the traces). After each step $OUT/trace is tarred into $OUT/trace.tgz; each trace's table is printed.
set -uo pipefail
OUT=${OUT:?set OUT}; here=$(cd "$(dirname "$0")/.." && pwd)
if compgen -G "$here/.whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$here"/.whl/*.whl \
    || echo "phase_trace_device: installing .whl failed; going on without it" >&2
fi
export PYTHONPATH=/tmp/site:$here${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export EVOTUNE_RUNS=${EVOTUNE_RUNS:-/tmp/runs} EVOTUNE_CACHE=${EVOTUNE_CACHE:-/tmp/cache}
dir=$OUT/trace; mkdir -p "$dir"
trace() {  # name [args...]: tools/phase_trace.py into $dir/name.{json,txt}, its table printed
  local name=$1; shift
  (cd "$here" && timeout "${TRACE_S:-300}" python3 tools/phase_trace.py "$@" --out "$dir/$name.json") > "$dir/$name.txt" 2>&1
  echo "$name rc=$?"; tail -40 "$dir/$name.txt"
}
for step in ${STEPS:-check on off compare}; do
  start=$(date +%s)
  case $step in
    check)
      (cd "$here" && timeout "${CHECK_S:-300}" python3 -m pytest -q -m gpu tests/test_phase_trace.py -p no:cacheprovider) \
        > "$dir/check.txt" 2>&1
      echo "check rc=$? $(tail -1 "$dir/check.txt")" ;;
    on) trace pdl_on ;;
    off) trace pdl_off --pdl false ;;
    compare)
      (cd "$here" && python3 tools/phase_trace.py --compare "$dir/pdl_on.json" "$dir/pdl_off.json") > "$dir/compare.txt" 2>&1
      echo "compare rc=$?" ;;
    *) echo "unknown step $step (check, on, off, compare)" >&2 ;;
  esac
  echo "== $step took $(( $(date +%s) - start )) s"
  tar -czf "$OUT/trace.tgz" -C "$OUT" trace
done
# The short table last: both traces side by side.
[ -f "$dir/compare.txt" ] && cat "$dir/compare.txt"
exit 0
