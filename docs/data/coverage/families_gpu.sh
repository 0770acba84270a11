#!/usr/bin/env bash
# The four model families of issue 42 end to end (tools/model_families.py): run them untuned, recording their calls;
# `evotune tune --shapes` each family's recording (prefill keys into a tuning table, generate()'s decode keys into a
# decode table, each key benched beside SDPA's backends or, for softcap / window, FlexAttention); run them again on
# those tables. Logits and tokens beside sdpa/eager, the share of calls on evotune's kernels and each fallback's reason.
#   FAMILIES=gemma2,phi3 TRIALS=30 BUDGET=240 bash docs/data/coverage/families_gpu.sh
set -u
OUT=${OUT:-/tmp/families}
FAM=${FAMILIES:-gemma2,mistral,phi3,qwen2}
mkdir -p "$OUT"
python3 tools/model_families.py --families "$FAM" --record "$OUT/shapes" --json "$OUT/untuned.json" \
    > "$OUT/untuned.txt" 2>&1
echo "untuned: rc=$?"
for f in ${FAM//,/ }; do
  python3 -m evotune tune --shapes "$OUT/shapes/$f.shapes.json" --trials "${TRIALS:-30}" --time-budget "${BUDGET:-240}" \
      --table "$OUT/table.json" --decode-table "$OUT/table.decode.json" > "$OUT/tune-$f.log" 2>&1
  echo "tune $f: rc=$?"; grep -E "^(added|updated|route|note|finalists)" "$OUT/tune-$f.log" | cut -c1-220
done
# A family whose recording has no decode key the decode kernel takes (head dims 96 and 256) writes no decode table.
decode=(); [ -f "$OUT/table.decode.json" ] && decode=(--decode-table "$OUT/table.decode.json")
python3 tools/model_families.py --families "$FAM" --table "$OUT/table.json" "${decode[@]}" \
    --json "$OUT/tuned.json" 2>&1 | grep -v '^\[transformers\]' | tee "$OUT/tuned.txt" | tail -30
