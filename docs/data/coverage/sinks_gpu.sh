#!/usr/bin/env bash
# Attention sinks (issue 42) on the GPU: the GPU tests of tests/test_sinks.py (the gate: NaN poison, perturbed keys, the
# fp32 reference's sink column; the log-sum-exp with the sink; a sink far above the scores), then tools/feature_bench.py:
# our kernel on gpt-oss-like shapes beside the same config on the dense shape and FlexAttention with the same sinks
# (its output through its log-sum-exp, compiled), interleaved in one process.
#   bash docs/data/coverage/sinks_gpu.sh                         # the Hopper default config
#   TABLE=runs/table.json bash docs/data/coverage/sinks_gpu.sh   # each case's tuned entry
#   TUNE="1,64,4096,64:bf16:kv8:causal:sinks" TRIALS=40 BUDGET=200 bash docs/data/coverage/sinks_gpu.sh  # tune first
# Run from the repository root with .whl carried (/work/shared/device/README.md). Writes $OUT/pytest.log,
# $OUT/sinks.json (and with TUNE, $OUT/table.json and the tune's log); prints a table last.
set -u
. tools/device_env.sh || exit 1
OUT=${OUT:-/tmp/sinks}; mkdir -p "$OUT"
CASES=${CASES:-"1,64,4096,64:bf16:kv8:window=127,0:sinks 1,64,4096,64:bf16:kv8:causal:sinks 1,8,512,64:sinks 2,16,4096,128:bf16:kv8:causal:sinks"}
if [ -z "${TUNE:-}" ] && [ -z "${SKIP_TESTS:-}" ]; then
  timeout 200 python3 -m pytest -q -m gpu tests/test_sinks.py -p no:cacheprovider > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$? (tail):"; tail -n 6 "$OUT/pytest.log"
fi
table=${TABLE:-}
if [ -n "${TUNE:-}" ]; then
  table=$OUT/table.json; CASES=$TUNE
  python3 -m evotune tune --shape "$TUNE" --trials "${TRIALS:-40}" --time-budget "${BUDGET:-200}" --table "$table" \
      > "$OUT/tune.log" 2>&1
  echo "tune rc=$?"; tail -n 4 "$OUT/tune.log"
fi
args=(); for c in $CASES; do args+=(--case "$c"); done
timeout 300 python3 tools/feature_bench.py "${args[@]}" ${table:+--table "$table"} --out "$OUT/sinks.json" \
    > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; grep -v '^{' "$OUT/bench.log" | tail -n 8
