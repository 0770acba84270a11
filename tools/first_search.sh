#!/usr/bin/env bash
# The README's first search, timed from a cold start: fresh compile cache and runs folder, one process
# per run, wall time from the command to the printed best, and the run's own timeline (timeline.jsonl).
#   OUT=dir TRIALS=60 [SAMPLER=nsga2] SHAPE=mission REPEATS=1 PROFILE=0 bash tools/first_search.sh
# (no SAMPLER: the search's default strategy, as the README's command runs it)
# PROFILE=1 adds one more cold run under cProfile (the search process only) and keeps its stats.
set -uo pipefail
OUT=${OUT:-/tmp/first-search}; TRIALS=${TRIALS:-60}; SAMPLER=${SAMPLER:-}; PICK=${SAMPLER:+--sampler $SAMPLER}; SHAPE=${SHAPE:-mission}
REPEATS=${REPEATS:-1}; PROFILE=${PROFILE:-0}; EXTRA=${EXTRA:-}
mkdir -p "$OUT"
python3 -c "import os; print('cpus', os.cpu_count())" | tee "$OUT/machine.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv >> "$OUT/machine.txt" 2>&1
for i in $(seq 1 "$REPEATS"); do
  work=$(mktemp -d)
  start=$(date +%s.%N)
  EVOTUNE_CACHE=$work/cache EVOTUNE_RUNS=$work/runs python3 -m evotune search --shape "$SHAPE" \
    --trials "$TRIALS" $PICK --run first $EXTRA > "$OUT/search-$i.log" 2>&1
  rc=$?
  end=$(date +%s.%N)
  wall=$(python3 -c "print(round($end - $start, 2))")
  cp "$work/runs/first/timeline.jsonl" "$OUT/timeline-$i.jsonl" 2>/dev/null
  cp "$work/runs/first/trials.jsonl" "$OUT/trials-$i.jsonl" 2>/dev/null
  rate=$(python3 - "$OUT/trials-$i.jsonl" "$wall" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
counted = [r for r in recs if r.get("counted")]
loop = max(r["finished"] for r in recs) - min(r["started"] for r in recs)
# Sustained: from the first record's end to the last's (start-up, the first compiles and warm-up excluded).
ends = sorted(r["finished"] for r in counted)
steady = (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 else 0.0
print(f"evaluated={len(counted)} proposals={len(recs)} loop_s={loop:.1f} sustained_per_s={steady:.2f} "
      f"overall_per_s={len(counted) / float(sys.argv[2]):.2f}")
PY
)
  echo "run $i: rc=$rc wall_s=$wall $rate $(tail -2 "$OUT/search-$i.log" | tr '\n' ' ')" | tee -a "$OUT/summary.txt"
  rm -rf "$work"
done
if [ "$PROFILE" = 1 ]; then
  work=$(mktemp -d)
  EVOTUNE_CACHE=$work/cache EVOTUNE_RUNS=$work/runs python3 -m cProfile -o "$OUT/search.prof" -m evotune search \
    --shape "$SHAPE" --trials "$TRIALS" $PICK --run first $EXTRA > "$OUT/search-profiled.log" 2>&1
  python3 -c "import pstats; pstats.Stats('$OUT/search.prof').sort_stats('cumulative').print_stats(45)" \
    > "$OUT/profile.txt" 2>&1
  rm -rf "$work"
fi
cat "$OUT/summary.txt"
