#!/usr/bin/env bash
# A value head dim of its own (DeepSeek-V2/V3 MLA prefill: q, k 192, v 128; HopperTraits' HEAD_DIM_V): the GPU tests of
# tests/test_mla.py (the full gate, NaN poison, perturbed keys and the fp32 reference, over the Hopper kernel's pieces
# at 192/128 and 128/64, causal and not, ragged, GQA, bf16, bshd; SDPA's backends probed as baselines; the op's kernel
# route from a hand-made table entry, and its fallback), then `evotune tune` of each MLA shape, its finalists timed
# beside SDPA's backends (those that take dv != d: flash is skipped, cuDNN and efficient probed) in the same process;
# the table (evotune's and the best anchor's time per key), each tune's log and run folder under $OUT ($EVOTUNE_RUNS =
# $OUT/runs, so the runs come back with the call). Run from the repository root (docs: /work/shared/device/README.md).
# pytest is capped at 200 s; each tune at BUDGET seconds.
#   bash docs/data/coverage/mla_gpu.sh
#   SHAPES="1,16,4096,192:bf16:causal:dv=128 1,128,4096,192:bf16:causal:dv=128" TRIALS=40 BUDGET=170 \
#     bash docs/data/coverage/mla_gpu.sh
# Writes $OUT/pytest.log, $OUT/tune-N.log, $OUT/table.json, $OUT/table.txt; prints the table last.
set -u
. tools/device_env.sh || exit 1
OUT=${OUT:-/tmp/mla}
mkdir -p "$OUT/runs"
export EVOTUNE_RUNS=$OUT/runs
timeout 200 python3 -m pytest -q -rs -s -m gpu tests/test_mla.py -p no:cacheprovider > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? (tail):"; grep "SDPA backends\|refuses" "$OUT/pytest.log" | sort -u; tail -n 15 "$OUT/pytest.log"
# DeepSeek-V2-Lite / V3-like prefill heads (16 and 128 query heads, MLA's q/k 192 = 128 nope + 64 rope, v 128).
SHAPES=${SHAPES:-"1,16,4096,192:bf16:causal:dv=128 1,128,4096,192:bf16:causal:dv=128 4,16,2048,192:bf16:causal:bshd:dv=128"}
i=0
for s in $SHAPES; do
  timeout $(( ${BUDGET:-170} + 120 )) python3 -m evotune tune --shape "$s" --trials "${TRIALS:-40}" \
      --time-budget "${BUDGET:-170}" --table "$OUT/table.json" > "$OUT/tune-$i.log" 2>&1
  echo "tune $s: rc=$?"; tail -4 "$OUT/tune-$i.log"
  i=$((i + 1))
done
python3 -m evotune table show "$OUT/table.json" 2>&1 | tee "$OUT/table.txt" | tail -20
