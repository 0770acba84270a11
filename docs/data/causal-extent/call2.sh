# Call 2 (the tree as committed): exhaustive searches of search_spaces/attention-hopper3-causal.yaml on gpt2-causal fp16
# and bf16, `evotune bench best` of each, then Nsight Compute on the fp16 winner and on the committed winner of
# runs/gpt2-causal-h100-exhaustive-tiles (tools/tma_store_device.sh's ncu step).
set -u
OUT_REAL=$OUT
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs $OUT_REAL/logs $OUT_REAL/bench
start=$(date +%s)
ex() {  # shape run
  [ $(( $(date +%s) - start )) -lt 330 ] || return
  timeout 170 python3 -m evotune search --shape $1 --space search_spaces/attention-hopper3-causal.yaml --sampler exhaustive \
    --trials 1192 --run $2 > $OUT_REAL/logs/$2.txt 2>&1
  echo "== $2: rc=$? at $(( $(date +%s) - start )) s"; grep -E "candidates evaluated|^best" -A2 $OUT_REAL/logs/$2.txt | cut -c1-200
  timeout 45 python3 -m evotune bench best --run $2 --reps 100 --out $OUT_REAL/bench/$2.json > $OUT_REAL/bench/$2.txt 2>&1
  grep -E "ours / best" $OUT_REAL/bench/$2.txt
}
ex gpt2-causal gpt2-causal-h100-exhaustive-causal
ex gpt2-causal:bf16 gpt2-causal-bf16-h100-exhaustive-causal
(cd /tmp && tar -czf $OUT_REAL/runs.tgz runs)
if [ $(( $(date +%s) - start )) -lt 450 ]; then
  STEPS=ncu NCU_RUNS="gpt2-causal-h100-exhaustive-causal gpt2-causal-h100-exhaustive-tiles" bash tools/tma_store_device.sh
fi
tar -czf $OUT_REAL/logs.tgz -C $OUT_REAL logs && rm -rf $OUT_REAL/logs
