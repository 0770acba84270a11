set -u
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs /tmp/ncu /tmp/pairs
start=$(date +%s)
tar -xzf .whl/s16/call2-runs.tgz -C /tmp runs
NCU="ncu --target-processes all -k regex:evotune_attention -s 3 -c 1 --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy"
for r in llama-4k-h100-warm-overlap llama-4k-bf16-h100-warm-overlap gpt2-h100-warm-overlap; do
  timeout 120 $NCU python3 -m evotune verify --run $r --launches 2 > /tmp/ncu/ncu-$r.txt 2>&1
  echo "== ncu $r rc=$? at $(( $(date +%s) - start )) s"
  grep -E "Duration|SM Frequency|Issue Slots Busy|highest-utilized|Achieved Occupancy" /tmp/ncu/ncu-$r.txt | head -6
done
H='"mma":"wgmma"'
L="{$H,\"block_m\":128,\"block_n\":128,\"compute_warps\":8,\"producer_warps\":4,\"stages\":2,\"q_in_regs\":true,\"pingpong\":false,\"persistent\":true,\"epilogue\":\"tma\""
G="{$H,\"block_m\":128,\"block_n\":64,\"compute_warps\":8,\"producer_warps\":0,\"stages\":4,\"q_in_regs\":true,\"pingpong\":false,\"persistent\":false,\"epilogue\":\"tma\""
quad() {  # shape prefix tag
  OUT=/tmp/pairs timeout 120 python3 tools/time_configs.py --space attention-hopper3-overlap $1 \
    "$2,\"rescale\":\"always\",\"softmax_overlap\":false}" "$2,\"rescale\":\"always\",\"softmax_overlap\":true}" \
    "$2,\"rescale\":\"lazy\",\"softmax_overlap\":false}" "$2,\"rescale\":\"lazy\",\"softmax_overlap\":true}" > /tmp/pairs/$3.txt 2>&1
  mv /tmp/pairs/time_configs.json /tmp/pairs/$3.json 2>/dev/null
  echo "== $3 ($1) at $(( $(date +%s) - start )) s"; tail -7 /tmp/pairs/$3.txt | cut -c1-150
}
quad llama-4k "$L" llama-4k
quad llama-4k:bf16 "$L" llama-4k-bf16
quad gpt2 "$G" gpt2
cd /tmp && tar -czf $OUT/ncu-pairs.tgz ncu pairs
