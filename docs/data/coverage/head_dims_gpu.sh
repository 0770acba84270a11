#!/usr/bin/env bash
# Head dims 96, 192 and 256 (issue 42): `evotune tune` of model-sized shapes, each key's finalists timed beside SDPA's
# backends in the same process; the table (evotune's and the best SDPA backend's time per key) and each tune's log
# under $OUT. New head dims have no shipped priors: each search starts cold.
#   SHAPES="1,32,2048,96:causal 1,8,4096,256:causal:kv4" TRIALS=40 BUDGET=200 bash docs/data/coverage/head_dims_gpu.sh
set -u
OUT=${OUT:-/tmp/head-dims}
mkdir -p "$OUT"
i=0
for s in ${SHAPES:?SHAPES: the shapes to tune, space-separated}; do
  python3 -m evotune tune --shape "$s" --trials "${TRIALS:-40}" --time-budget "${BUDGET:-200}" \
      --table "$OUT/table.json" > "$OUT/tune-$i.log" 2>&1
  echo "tune $s: rc=$?"; tail -4 "$OUT/tune-$i.log"
  i=$((i + 1))
done
python3 -m evotune table show "$OUT/table.json" 2>&1 | tee "$OUT/table.txt" | tail -20
