#!/usr/bin/env bash
# The model workflow on the GPU (issue 12): record the GPT-2-like model's attention keys, tune them
# (`evotune tune --shapes`, which ends each search with SDPA timed beside the best), build the table,
# then tools/model_bench.py with that table. Results under $OUT/model/, a table last.
set -u
OUT=${OUT:-/tmp}/model
mkdir -p "$OUT"
export EVOTUNE_CACHE=${EVOTUNE_CACHE:-/tmp/evotune-cache} EVOTUNE_RUNS=$OUT/runs
unset EVOTUNE_TABLE  # recording runs before any table exists (every key falls back to SDPA, recorded)
python3 tools/record_model_shapes.py --sizes "${RECORD_SIZES:-gpt2:1x512}" --out "$OUT/shapes.json" > "$OUT/record.txt" 2>&1
python3 -m evotune tune --shapes "$OUT/shapes.json" --trials "${TRIALS:-40}" --table "$OUT/table.json" > "$OUT/tune.txt" 2>&1
python3 -m evotune table show "$OUT/table.json" > "$OUT/table.txt" 2>&1
python3 tools/model_bench.py --table "$OUT/table.json" --reps "${REPS:-10}" --warmup 2 --budget-s "${BUDGET_S:-200}" \
    ${SIZES:+--sizes "$SIZES"} --out "$OUT/model_bench.json" --md "$OUT/model_bench.md" > "$OUT/model_bench.txt" 2>&1
echo "== record"; tail -n 2 "$OUT/record.txt"; cat "$OUT/shapes.json" | grep '"shape"'
echo "== tune"; tail -n 8 "$OUT/tune.txt"
echo "== table"; cat "$OUT/table.txt"
echo "== model bench"; tail -n 30 "$OUT/model_bench.txt"
