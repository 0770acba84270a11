# Call 3 (the knob as committed: persistent_tile's order, handed out): GPU tests, the pairs again, exhaustive searches
# of attention-hopper3-skip on gpt2 fp16 and bf16 with a bench of each best, then the sanitizer tests.
set -u
OUT_REAL=$OUT
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs $OUT_REAL/t $OUT_REAL/logs $OUT_REAL/bench
start=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_empty_warpgroups.py -m "gpu and not slow" -rs > $OUT_REAL/gpu-tests.txt 2>&1
echo "pytest rc=$? at $(( $(date +%s) - start )) s"; tail -1 $OUT_REAL/gpu-tests.txt
G='"mma":"wgmma","pingpong":false,"rescale":"lazy","softmax_overlap":true,"lean_addressing":true'
W="{$G,\"block_m\":128,\"block_n\":64,\"compute_warps\":8,\"persistent\":false,\"producer_warps\":0,\"stages\":4,\"q_in_regs\":true,\"epilogue\":\"tma\"}"
T="{$G,\"block_m\":192,\"block_n\":128,\"compute_warps\":12,\"producer_warps\":4,\"q_in_regs\":false,\"epilogue\":\"tma\",\"persistent\":true"
for shape in gpt2 gpt2:bf16; do
  mkdir -p /tmp/o-$shape; export OUT=/tmp/o-$shape
  timeout 100 python3 tools/time_configs.py $shape "$W" \
    "$T,\"stages\":3,\"empty_warpgroups\":\"compute\"}" "$T,\"stages\":3,\"empty_warpgroups\":\"skip\"}" \
    "$T,\"stages\":4,\"empty_warpgroups\":\"compute\"}" "$T,\"stages\":4,\"empty_warpgroups\":\"skip\"}" > $OUT_REAL/t/$shape.txt 2>&1
  echo "== $shape rc=$? at $(( $(date +%s) - start )) s"; tail -5 $OUT_REAL/t/$shape.txt | cut -c1-100
  cp /tmp/o-$shape/time_configs.json $OUT_REAL/t/$shape.json 2>/dev/null
done
export OUT=$OUT_REAL
ex() {  # shape run
  [ $(( $(date +%s) - start )) -lt 400 ] || return
  timeout 170 python3 -m evotune search --shape $1 --space search_spaces/attention-hopper3-skip.yaml --sampler exhaustive \
    --trials 816 --run $2 > $OUT_REAL/logs/$2.txt 2>&1
  echo "== $2: rc=$? at $(( $(date +%s) - start )) s"; grep -E "candidates evaluated|^best" -A2 $OUT_REAL/logs/$2.txt | cut -c1-200
  timeout 60 python3 -m evotune bench best --run $2 --reps 100 --out $OUT_REAL/bench/$2.json > $OUT_REAL/bench/$2.txt 2>&1
  grep -E "ours / best" $OUT_REAL/bench/$2.txt
}
ex gpt2 gpt2-h100-exhaustive-skip
ex gpt2:bf16 gpt2-bf16-h100-exhaustive-skip
if [ $(( $(date +%s) - start )) -lt 500 ]; then
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_empty_warpgroups.py -m "gpu and slow" -rs > $OUT_REAL/gpu-tests-slow.txt 2>&1
  echo "slow pytest rc=$? at $(( $(date +%s) - start )) s"; tail -1 $OUT_REAL/gpu-tests-slow.txt
fi
cd /tmp && tar -czf $OUT_REAL/runs.tgz runs
