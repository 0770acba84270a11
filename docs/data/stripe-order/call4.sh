# Call 4 (the tree of commit ee9cb12): the exhaustive search of search_spaces/attention-hopper3-mirror.yaml on
# gpt2-causal bf16 and `evotune bench best` of it, `-m "gpu and slow"` tests/test_deep_ring.py (memcheck, racecheck),
# then Nsight Compute on call 3's fp16 winner (runs/gpt2-causal-h100-exhaustive-mirror, carried in) and on the
# previous one (runs/gpt2-causal-h100-exhaustive-causal; tools/tma_store_device.sh's ncu step).
set -u
OUT_REAL=$OUT
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs $OUT_REAL/logs $OUT_REAL/bench
cp -r runs/gpt2-causal-h100-exhaustive-mirror runs/gpt2-causal-h100-exhaustive-causal /tmp/runs/
start=$(date +%s)
ex() {  # shape run
  timeout 420 python3 -m evotune search --shape $1 --space search_spaces/attention-hopper3-mirror.yaml --sampler exhaustive \
    --trials 2586 --run $2 > $OUT_REAL/logs/$2.txt 2>&1
  echo "== $2: rc=$? at $(( $(date +%s) - start )) s"; grep -E "candidates evaluated|^best" -A2 $OUT_REAL/logs/$2.txt | cut -c1-200
  timeout 45 python3 -m evotune bench best --run $2 --reps 100 --out $OUT_REAL/bench/$2.json > $OUT_REAL/bench/$2.txt 2>&1
  grep -E "ours / best" $OUT_REAL/bench/$2.txt
}
ex gpt2-causal:bf16 gpt2-causal-bf16-h100-exhaustive-mirror
(cd /tmp/runs && tar -czf $OUT_REAL/runs.tgz gpt2-causal-bf16-h100-exhaustive-mirror)
tar -czf $OUT_REAL/logs.tgz -C $OUT_REAL logs && rm -rf $OUT_REAL/logs
if [ $(( $(date +%s) - start )) -lt 420 ]; then
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_deep_ring.py -m "gpu and slow" -rs > $OUT_REAL/gpu-tests-slow.txt 2>&1
  echo "slow pytest rc=$? at $(( $(date +%s) - start )) s"; tail -1 $OUT_REAL/gpu-tests-slow.txt
fi
if [ $(( $(date +%s) - start )) -lt 480 ]; then
  STEPS=ncu NCU_RUNS="gpt2-causal-h100-exhaustive-mirror gpt2-causal-h100-exhaustive-causal" timeout 100 bash tools/tma_store_device.sh
fi
