# Call 4 (the tree as committed): the GPU tests of tests/test_four_warpgroups.py, then call 3 again (call 3's searches
# ran with a comment line in kernels/hopper_tma_store.cuh that the commit moved, so their TMA-store configs' source
# digests were not the committed sources'), then the sanitizer tests if time is left.
set -u
OUT_REAL=$OUT
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs $OUT_REAL/logs $OUT_REAL/bench
start=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_four_warpgroups.py -m "gpu and not slow" -rs > $OUT_REAL/gpu-tests.txt 2>&1
echo "pytest rc=$? at $(( $(date +%s) - start )) s"; tail -1 $OUT_REAL/gpu-tests.txt
ex() {  # shape run
  [ $(( $(date +%s) - start )) -lt 330 ] || return
  timeout 150 python3 -m evotune search --shape $1 --space search_spaces/attention-hopper3-wg4.yaml --sampler exhaustive \
    --trials 948 --run $2 > $OUT_REAL/logs/$2.txt 2>&1
  echo "== $2: rc=$? at $(( $(date +%s) - start )) s"; grep -E "candidates evaluated|^best" -A2 $OUT_REAL/logs/$2.txt | cut -c1-200
  timeout 45 python3 -m evotune bench best --run $2 --reps 100 --out $OUT_REAL/bench/$2.json > $OUT_REAL/bench/$2.txt 2>&1
  grep -E "ours / best" $OUT_REAL/bench/$2.txt
}
ex gpt2 gpt2-h100-exhaustive-wg4
ex gpt2:bf16 gpt2-bf16-h100-exhaustive-wg4
if [ $(( $(date +%s) - start )) -lt 500 ]; then
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_four_warpgroups.py -m "gpu and slow" -rs > $OUT_REAL/gpu-tests-slow.txt 2>&1
  echo "slow pytest rc=$? at $(( $(date +%s) - start )) s"; tail -1 $OUT_REAL/gpu-tests-slow.txt
fi
cd /tmp && tar -czf $OUT_REAL/runs.tgz runs
