#!/usr/bin/env bash
# `evotune tune` of model-sized shapes (issue 42: head dims 96, 192, 256; sinks; any shape), each key's finalists timed
# beside its anchors (SDPA's backends, or FlexAttention for softcap/window/sinks) in the same process; the table
# (evotune's and the best anchor's time per key), each tune's log, and each tune's run folder (meta.json, trials.jsonl,
# study.db: what `evotune priors build` distils into the shipped priors) under $OUT. The runs go to $OUT/runs
# ($EVOTUNE_RUNS), so a run made on the device comes back with the call.
#   SHAPES="1,32,2048,96:causal 1,8,4096,256:causal:kv4" TRIALS=40 BUDGET=200 bash docs/data/coverage/head_dims_gpu.sh
set -u
OUT=${OUT:-/tmp/head-dims}
mkdir -p "$OUT/runs"
export EVOTUNE_RUNS=$OUT/runs
i=0
for s in ${SHAPES:?SHAPES: the shapes to tune, space-separated}; do
  python3 -m evotune tune --shape "$s" --trials "${TRIALS:-40}" --time-budget "${BUDGET:-200}" \
      --table "$OUT/table.json" > "$OUT/tune-$i.log" 2>&1
  echo "tune $s: rc=$?"; tail -4 "$OUT/tune-$i.log"
  i=$((i + 1))
done
python3 -m evotune table show "$OUT/table.json" 2>&1 | tee "$OUT/table.txt" | tail -20
