set -u
mkdir -p /tmp/ncu
G='"mma":"wgmma","pingpong":false,"rescale":"lazy","softmax_overlap":true,"lean_addressing":true'
W="{$G,\"block_m\":128,\"block_n\":64,\"compute_warps\":8,\"persistent\":false,\"producer_warps\":0,\"stages\":4,\"q_in_regs\":true,\"epilogue\":\"tma\""
F="{$G,\"block_m\":192,\"block_n\":192,\"compute_warps\":12,\"producer_warps\":4,\"stages\":2,\"q_in_regs\":false,\"p_operand\":\"smem\",\"persistent\":true,\"epilogue\":\"tma\"}"
for item in "regs|$W,\"p_operand\":\"regs\"}" "smem|$W,\"p_operand\":\"smem\"}" "fa3d64|$F"; do
  name=${item%%|*}; cfg=${item#*|}
  timeout 60 ncu --target-processes all -k regex:evotune_attention -s 3 -c 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section Occupancy python3 -m evotune verify --config "$cfg" --shape gpt2 --space search_spaces/attention-hopper3-ss.yaml --launches 2 > /tmp/ncu/ncu-$name.txt 2>&1
  echo "== ncu $name rc=$?"; grep -E "Duration|highest-utilized|Issue Slots Busy|Achieved Occupancy|Registers Per" /tmp/ncu/ncu-$name.txt | cut -c1-110
done
tar -czf $OUT/ncu.tgz -C /tmp ncu
