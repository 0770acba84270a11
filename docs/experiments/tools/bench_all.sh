#!/usr/bin/env bash
# `evotune bench` for each committed winner, one record per run under $OUT/bench (the
# records docs/PERFORMANCE.md is generated from with tools/perf_doc.py). A table is
# printed per run.  Usage: RUNS="mission-h100-tpe-300 gpt2-h100" bash tools/bench_all.sh
set -u
mkdir -p "$OUT/bench"
for run in ${RUNS:?list the runs to bench}; do
  timeout "${PER_BENCH_S:-240}" python3 -m evotune bench best --run "$run" --reps "${REPS:-100}" \
    --out "$OUT/bench/$run.json" > "$OUT/bench/$run.txt" 2>&1
  echo "== $run (exit $?)"; cat "$OUT/bench/$run.txt"
done
