set -u
OUT_REAL=$OUT
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs $OUT_REAL/t $OUT_REAL/logs $OUT_REAL/bench
start=$(date +%s)
G='"mma":"wgmma","pingpong":false,"rescale":"lazy","softmax_overlap":true,"lean_addressing":true'
L="{$G,\"block_m\":128,\"block_n\":128,\"compute_warps\":8,\"epilogue\":\"tma\",\"persistent\":true,\"producer_warps\":4,\"q_in_regs\":true,\"stages\":2"
T3="{$G,\"block_m\":192,\"block_n\":128,\"compute_warps\":12,\"producer_warps\":4,\"stages\":2,\"q_in_regs\":false,\"p_operand\":\"smem\""
for shape in llama-4k llama-4k-causal; do
  mkdir -p /tmp/o-$shape; export OUT=/tmp/o-$shape
  timeout 150 python3 tools/time_configs.py $shape "$L}" "$L,\"p_operand\":\"smem\"}" "$T3,\"persistent\":false,\"epilogue\":\"tma\"}" \
    "$T3,\"persistent\":true,\"epilogue\":\"regs\"}" > $OUT_REAL/t/$shape.txt 2>&1
  echo "== $shape rc=$? at $(( $(date +%s) - start )) s"; tail -7 $OUT_REAL/t/$shape.txt | cut -c1-120
  cp /tmp/o-$shape/time_configs.json $OUT_REAL/t/$shape.json 2>/dev/null
done
export OUT=/tmp/o-search
timeout 240 python3 -m evotune search --shape gpt2 --space search_spaces/attention-hopper3-ss.yaml --sampler exhaustive \
  --trials 1074 --run gpt2-h100-exhaustive-ss > $OUT_REAL/logs/gpt2-h100-exhaustive-ss.txt 2>&1
echo "== search rc=$? at $(( $(date +%s) - start )) s"; tail -6 $OUT_REAL/logs/gpt2-h100-exhaustive-ss.txt | cut -c1-250
[ $(( $(date +%s) - start )) -lt 500 ] && timeout 60 python3 -m evotune bench best --run gpt2-h100-exhaustive-ss --reps 100 \
  --out $OUT_REAL/bench/gpt2-h100-exhaustive-ss.json > $OUT_REAL/bench/gpt2-h100-exhaustive-ss.txt 2>&1; tail -12 $OUT_REAL/bench/gpt2-h100-exhaustive-ss.txt
cd /tmp && tar -czf $OUT_REAL/runs.tgz runs
