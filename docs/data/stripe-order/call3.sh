# Call 3 (the tree of commit ee9cb12): `-m "gpu and not slow"` tests/test_deep_ring.py, the exhaustive search of
# search_spaces/attention-hopper3-mirror.yaml on gpt2-causal (fp16) and `evotune bench best` of it.
set -u
OUT_REAL=$OUT
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs $OUT_REAL/logs $OUT_REAL/bench
start=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_deep_ring.py -m "gpu and not slow" -rs > $OUT_REAL/gpu-tests.txt 2>&1
echo "pytest rc=$? at $(( $(date +%s) - start )) s"; tail -1 $OUT_REAL/gpu-tests.txt
grep -E "^(FAILED|ERROR)" $OUT_REAL/gpu-tests.txt | head -5
ex() {  # shape run
  timeout 420 python3 -m evotune search --shape $1 --space search_spaces/attention-hopper3-mirror.yaml --sampler exhaustive \
    --trials 2586 --run $2 > $OUT_REAL/logs/$2.txt 2>&1
  echo "== $2: rc=$? at $(( $(date +%s) - start )) s"; grep -E "candidates evaluated|^best" -A2 $OUT_REAL/logs/$2.txt | cut -c1-200
  timeout 45 python3 -m evotune bench best --run $2 --reps 100 --out $OUT_REAL/bench/$2.json > $OUT_REAL/bench/$2.txt 2>&1
  grep -E "ours / best" $OUT_REAL/bench/$2.txt
}
ex gpt2-causal gpt2-causal-h100-exhaustive-mirror
(cd /tmp && tar -czf $OUT_REAL/runs.tgz runs)
tar -czf $OUT_REAL/logs.tgz -C $OUT_REAL logs && rm -rf $OUT_REAL/logs
