set -u
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs /tmp/logs /tmp/bench
start=$(date +%s)
for r in gpt2-causal-h100-exhaustive-hopper3 gpt2-bf16-h100-tma gpt2-causal-bf16-h100-tma llama-4k-causal-bf16-h100-tma llama-4k-causal-h100-tma; do cp -r runs/$r /tmp/runs/; done
go() {  # shape warm run trials
  [ $(( $(date +%s) - start )) -lt 440 ] || { echo "skip $4"; return; }
  timeout 150 python3 -m evotune search --shape $1 --space search_spaces/attention-hopper3-overlap.yaml $2 \
    --trials $3 --run $4 > /tmp/logs/$4.txt 2>&1
  echo "== $4: rc=$? at $(( $(date +%s) - start )) s"; tail -3 /tmp/logs/$4.txt
  for i in 1 2; do
    [ $(( $(date +%s) - start )) -lt 555 ] || break
    timeout 60 python3 -m evotune bench best --run $4 --reps 100 --out /tmp/bench/$4-$i.json > /tmp/bench/$4-$i.txt 2>&1 || echo "bench failed"
    echo "bench $i $(grep -E '│ (evotune|cudnn) ' /tmp/bench/$4-$i.txt | awk -F'│' '{printf "%s=%s ", $2, $3}')"
  done
}
go llama-4k-causal "--warm-start llama-4k-causal-h100-tma" 40 llama-4k-causal-h100-warm-overlap
go llama-4k-causal:bf16 "--warm-start llama-4k-causal-bf16-h100-tma" 40 llama-4k-causal-bf16-h100-warm-overlap
go gpt2-causal "--warm-start gpt2-causal-h100-exhaustive-hopper3" 40 gpt2-causal-h100-warm-overlap
go gpt2:bf16 "--warm-start gpt2-bf16-h100-tma" 40 gpt2-bf16-h100-warm-overlap
go gpt2-causal:bf16 "--warm-start gpt2-causal-bf16-h100-tma" 40 gpt2-causal-bf16-h100-warm-overlap
cd /tmp && tar -czf $OUT/runs.tgz runs/*-overlap logs bench
