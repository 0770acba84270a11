set -u
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs /tmp/logs /tmp/bench /tmp/pairs /tmp/ncu
start=$(date +%s)
tar -xzf .whl/s17/lean-runs.tgz -C /tmp runs
pair() {  # shape name config-without-lean...
  local shape=$1 name=$2; shift 2
  local args=()
  for c in "$@"; do args+=("$c,\"lean_addressing\":false}" "$c,\"lean_addressing\":true}"); done
  OUT=/tmp/pairs timeout 150 python3 tools/time_configs.py --space attention-hopper3-lean $shape "${args[@]}" > /tmp/pairs/$name.txt 2>&1
  mv /tmp/pairs/time_configs.json /tmp/pairs/$name.json
  echo "== pairs $name at $(( $(date +%s) - start )) s"; tail -$(( 2 * $# + 2 )) /tmp/pairs/$name.txt | cut -c1-110
}
G='"mma":"wgmma","epilogue":"tma","rescale":"lazy","softmax_overlap":true'
pair gpt2 gpt2 "{$G,\"block_m\":128,\"block_n\":64,\"compute_warps\":8,\"producer_warps\":0,\"stages\":4,\"q_in_regs\":true,\"pingpong\":false,\"persistent\":false"
pair gpt2-causal gpt2-causal "{$G,\"block_m\":64,\"block_n\":64,\"compute_warps\":4,\"producer_warps\":0,\"stages\":4,\"q_in_regs\":true,\"pingpong\":false,\"persistent\":false"
pair llama-4k llama-4k "{$G,\"block_m\":128,\"block_n\":128,\"compute_warps\":8,\"producer_warps\":4,\"stages\":2,\"q_in_regs\":true,\"pingpong\":false,\"persistent\":true"
pair llama-4k-causal llama-4k-causal "{$G,\"block_m\":128,\"block_n\":128,\"compute_warps\":8,\"producer_warps\":4,\"stages\":2,\"q_in_regs\":true,\"pingpong\":false,\"persistent\":true" "{$G,\"block_m\":128,\"block_n\":128,\"compute_warps\":8,\"producer_warps\":4,\"stages\":3,\"q_in_regs\":true,\"pingpong\":true,\"persistent\":false"
for r in gpt2-h100-warm-lean llama-4k-h100-warm-lean; do
  timeout 120 ncu --target-processes all -k regex:evotune_attention -s 3 -c 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section Occupancy python3 -m evotune verify --run $r --launches 2 > /tmp/ncu/ncu-$r.txt 2>&1
  echo "== ncu $r rc=$? at $(( $(date +%s) - start )) s"; grep -E "Duration|Tensor is|Issue Slots Busy|Achieved Occupancy" /tmp/ncu/ncu-$r.txt | cut -c1-120
done
for r in long-8k-h100-warm-rescale long-8k-bf16-h100-warm-rescale; do cp -r runs/$r /tmp/runs/; done
go() {  # shape warm run trials
  [ $(( $(date +%s) - start )) -lt 440 ] || { echo "skip $4"; return; }
  timeout 150 python3 -m evotune search --shape $1 --space search_spaces/attention-hopper3-lean.yaml --warm-start $2 \
    --trials $3 --run $4 > /tmp/logs/$4.txt 2>&1
  echo "== $4: rc=$? at $(( $(date +%s) - start )) s"; tail -4 /tmp/logs/$4.txt | cut -c1-300
  for i in 1 2; do
    [ $(( $(date +%s) - start )) -lt 550 ] || break
    timeout 60 python3 -m evotune bench best --run $4 --reps 100 --out /tmp/bench/$4-$i.json > /tmp/bench/$4-$i.txt 2>&1 || echo "bench failed"
    echo "bench $i $(grep -E '│ (evotune|cudnn) ' /tmp/bench/$4-$i.txt | awk -F'│' '{printf "%s=%s ", $2, $3}')"
  done
}
go long-8k long-8k-h100-warm-rescale 40 long-8k-h100-warm-lean
go long-8k:bf16 long-8k-bf16-h100-warm-rescale 40 long-8k-bf16-h100-warm-lean
cd /tmp && tar -czf $OUT/call4.tgz runs/long-8k*-lean logs bench pairs ncu
