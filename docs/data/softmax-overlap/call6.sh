set -u
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs /tmp/logs /tmp/bench /tmp/pairs
start=$(date +%s)
tar -xzf .whl/s16/call5-runs.tgz -C /tmp runs
cp -r runs/llama-4k-causal-h100-tma /tmp/runs/
R=llama-4k-causal-h100-warm-overlap
timeout 200 python3 -m evotune search --shape llama-4k-causal --space search_spaces/attention-hopper3-overlap.yaml --resume \
    --trials 80 --run $R > /tmp/logs/$R-resume.txt 2>&1
echo "== $R resumed: rc=$? at $(( $(date +%s) - start )) s"; tail -3 /tmp/logs/$R-resume.txt
for i in 1 2; do
  for r in $R llama-4k-causal-h100-tma; do
    timeout 60 python3 -m evotune bench best --run $r --reps 100 --out /tmp/bench/$r-$i.json > /tmp/bench/$r-$i.txt 2>&1 || echo "bench failed"
    echo "bench $r $i $(grep -E '│ (evotune|cudnn) ' /tmp/bench/$r-$i.txt | awk -F'│' '{printf "%s=%s ", $2, $3}')"
  done
done
H='"mma":"wgmma"'
C="{$H,\"block_m\":128,\"block_n\":128,\"compute_warps\":8,\"producer_warps\":4,\"stages\":2,\"q_in_regs\":true,\"pingpong\":false,\"persistent\":true,\"epilogue\":\"regs\""
OUT=/tmp/pairs timeout 120 python3 tools/time_configs.py --space attention-hopper3-overlap llama-4k-causal \
    "$C,\"rescale\":\"always\",\"softmax_overlap\":false}" "$C,\"rescale\":\"always\",\"softmax_overlap\":true}" \
    "$C,\"rescale\":\"lazy\",\"softmax_overlap\":false}" "$C,\"rescale\":\"lazy\",\"softmax_overlap\":true}" > /tmp/pairs/llama-4k-causal.txt 2>&1
mv /tmp/pairs/time_configs.json /tmp/pairs/llama-4k-causal.json
echo "== quad at $(( $(date +%s) - start )) s"; tail -7 /tmp/pairs/llama-4k-causal.txt | cut -c1-150
cd /tmp && tar -czf $OUT/runs.tgz runs/$R logs bench pairs
