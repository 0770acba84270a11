#!/usr/bin/env bash
# End to end in transformers models (issue 41 section 3): evotune against transformers' sdpa under the same mask
# policy, in alternating rounds, per model (gpt2, llama, qwen2: tools/model_bench.py --e2e). One device call per
# (phase, model), each under 9 minutes:
#
#   bash docs/data/model/e2e.sh tune MODEL       record MODEL's attention keys (every prefill row and generate()
#                                                context) and `evotune tune --shapes` them (TRIALS trials a key)
#                                                into the table; ~6-8 min
#   bash docs/data/model/e2e.sh prefill MODEL    prefill at 1x512, 1x8192, 8x2048: eager, CUDA graph, torch.compile
#   bash docs/data/model/e2e.sh generate MODEL   generate(): TTFT and decode tokens/s at 1x2048, 8x2048 and (llama,
#                                                qwen2) 1x16384: DynamicCache, StaticCache, StaticCache + compile
#
# To fit a call, narrow it: PMODES=compile (prefill modes: eager,graph,compile), GMODES=dynamic (generate modes:
# dynamic,static,compile), ROWS=llama:1x8192 (the rows or contexts of the phase), ROUNDS (default 5).
#
# The table: docs/data/model/e2e-table.json where it exists (copy each tune call's $OUT/e2e-table.json there
# before the next call: tune updates it, the other phases read it), and its decode table e2e-table.decode.json
# (the decode steps a generate() row records, tuned by the same `evotune tune --shapes`). Run from the repository root with .whl
# carried (optuna, for tune). Writes $OUT/e2e-PHASE-MODEL.tar.gz (JSON, markdown, logs) and $OUT/e2e-table.json
# (tune), and prints the short table last.
set -u
PHASE=${1:?usage: e2e.sh tune|prefill|generate gpt2|llama|qwen2}
MODEL=${2:?usage: e2e.sh tune|prefill|generate gpt2|llama|qwen2}
OUT=${OUT:-/tmp/e2e-out}
TRIALS=${TRIALS:-10}
ROUNDS=${ROUNDS:-5}
. tools/device_env.sh || exit 1
work=${TMPDIR:-/tmp}/e2e-work
rm -rf "$work"; mkdir -p "$work/runs" "$OUT"
export EVOTUNE_RUNS=$work/runs EVOTUNE_CACHE=$work/cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$work/device.txt"
table=$work/e2e-table.json
[ -f docs/data/model/e2e-table.json ] && cp docs/data/model/e2e-table.json "$table"
# The decode table tune writes beside the table (model_bench.decode_table_beside), read by the generate phase.
[ -f docs/data/model/e2e-table.decode.json ] && cp docs/data/model/e2e-table.decode.json "$work/e2e-table.decode.json"
case $MODEL in
  gpt2) prefill="gpt2:1x512,gpt2:1x8192,gpt2:8x2048"; generate="gpt2:1x2048,gpt2:8x2048" ;;
  llama|qwen2) prefill="$MODEL:1x512,$MODEL:1x8192,$MODEL:8x2048"
               generate="$MODEL:1x2048,$MODEL:1x16384,$MODEL:8x2048" ;;
  *) echo "e2e.sh: model gpt2, llama or qwen2, not $MODEL" >&2; exit 2 ;;
esac
# --budget-s: no measurement starts after 330 s (a compile row of the Llama-like model takes about a minute);
# the JSON is rewritten after every row, so a call stopped by the timeout keeps what it finished.
common=(--e2e --rounds "$ROUNDS" --reps 6 --warmup 2 --new-tokens 32 --budget-s 330)
{ [ -f "$table" ] || [ "$PHASE" = tune ]; } && common+=(--table "$table")
prefill=${ROWS:-$prefill}; generate=${ROWS:-$generate}
common+=(--prefill-modes "${PMODES:-eager,graph,compile}" --generate-modes "${GMODES:-dynamic,static,compile}")
case $PHASE in
  tune) args=(--prefill "$prefill" --generate "$generate" --tune-trials "$TRIALS" --tune-only) ;;
  prefill) args=(--prefill "$prefill" --generate none) ;;
  generate) args=(--prefill none --generate "$generate") ;;
  *) echo "e2e.sh: phase tune, prefill or generate, not $PHASE" >&2; exit 2 ;;
esac
timeout 520 python3 tools/model_bench.py "${common[@]}" "${args[@]}" --out "$work/e2e-$PHASE-$MODEL.json" \
  --md "$work/e2e-$PHASE-$MODEL.md" > "$work/e2e-$PHASE-$MODEL.log" 2>&1
echo "model_bench rc=$?"
[ -f "$table" ] && cp "$table" "$OUT/e2e-table.json"
[ -f "$work/e2e-table.decode.json" ] && cp "$work/e2e-table.decode.json" "$OUT/e2e-table.decode.json"
tar -czf "$OUT/e2e-$PHASE-$MODEL.tar.gz" -C "$work" --exclude cache --exclude runs .
grep -E "^\[|tune:" "$work/e2e-$PHASE-$MODEL.log" | tail -n 12
sed -n '/^model  size/,$p' "$work/e2e-$PHASE-$MODEL.log"
