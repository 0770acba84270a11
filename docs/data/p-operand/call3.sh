set -u
OUT_REAL=$OUT
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs $OUT_REAL/logs $OUT_REAL/bench $OUT_REAL/ncu
start=$(date +%s)
git log --oneline -1 > $OUT_REAL/tree.txt; git status --short >> $OUT_REAL/tree.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_p_operand.py -m gpu -rs > $OUT_REAL/gpu-tests.txt 2>&1
echo "pytest rc=$? at $(( $(date +%s) - start )) s"; tail -2 $OUT_REAL/gpu-tests.txt
ex() {  # shape run
  timeout 200 python3 -m evotune search --shape $1 --space search_spaces/attention-hopper3-ss.yaml --sampler exhaustive \
    --trials 1074 --run $2 > $OUT_REAL/logs/$2.txt 2>&1
  echo "== $2: rc=$? at $(( $(date +%s) - start )) s"; grep -E "candidates evaluated|^best" -A2 $OUT_REAL/logs/$2.txt | cut -c1-200
  timeout 60 python3 -m evotune bench best --run $2 --reps 100 --out $OUT_REAL/bench/$2.json > $OUT_REAL/bench/$2.txt 2>&1
  grep -E "ours / best" $OUT_REAL/bench/$2.txt
}
ex gpt2 gpt2-h100-exhaustive-ss
[ $(( $(date +%s) - start )) -lt 330 ] && ex gpt2-causal gpt2-causal-h100-exhaustive-ss
G='"mma":"wgmma","pingpong":false,"rescale":"lazy","softmax_overlap":true,"lean_addressing":true'
W="{$G,\"block_m\":128,\"block_n\":64,\"compute_warps\":8,\"persistent\":false,\"producer_warps\":0,\"stages\":4,\"q_in_regs\":true,\"epilogue\":\"tma\""
F="{$G,\"block_m\":192,\"block_n\":192,\"compute_warps\":12,\"producer_warps\":4,\"stages\":2,\"q_in_regs\":false,\"p_operand\":\"smem\",\"persistent\":true,\"epilogue\":\"tma\"}"
for item in "regs|$W,\"p_operand\":\"regs\"}" "smem|$W,\"p_operand\":\"smem\"}" "fa3d64|$F"; do
  [ $(( $(date +%s) - start )) -lt 530 ] || break
  name=${item%%|*}; cfg=${item#*|}
  timeout 60 ncu --target-processes all -k regex:evotune_attention -s 3 -c 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section Occupancy python3 -m evotune verify --config "$cfg" --shape gpt2 --space search_spaces/attention-hopper3-ss.yaml --launches 2 > $OUT_REAL/ncu/ncu-$name.txt 2>&1
  echo "== ncu $name rc=$?"; grep -E "Duration|Tensor is|Issue Slots Busy|Achieved Occupancy|Registers Per" $OUT_REAL/ncu/ncu-$name.txt | cut -c1-110
done
cd /tmp && tar -czf $OUT_REAL/runs.tgz runs
