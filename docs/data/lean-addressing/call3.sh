set -u
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs /tmp/logs /tmp/bench
start=$(date +%s)
for r in llama-4k-h100-warm-overlap llama-4k-bf16-h100-warm-overlap llama-4k-causal-h100-warm-overlap llama-4k-causal-bf16-h100-warm-overlap; do cp -r runs/$r /tmp/runs/; done
go() {  # shape warm run trials
  [ $(( $(date +%s) - start )) -lt 440 ] || { echo "skip $4"; return; }
  timeout 150 python3 -m evotune search --shape $1 --space search_spaces/attention-hopper3-lean.yaml --warm-start $2 \
    --trials $3 --run $4 > /tmp/logs/$4.txt 2>&1
  echo "== $4: rc=$? at $(( $(date +%s) - start )) s"; tail -4 /tmp/logs/$4.txt | cut -c1-400
  for i in 1 2; do
    [ $(( $(date +%s) - start )) -lt 550 ] || break
    timeout 60 python3 -m evotune bench best --run $4 --reps 100 --out /tmp/bench/$4-$i.json > /tmp/bench/$4-$i.txt 2>&1 || echo "bench failed"
    echo "bench $i $(grep -E '│ (evotune|cudnn) ' /tmp/bench/$4-$i.txt | awk -F'│' '{printf "%s=%s ", $2, $3}')"
  done
}
go llama-4k-causal llama-4k-causal-h100-warm-overlap 40 llama-4k-causal-h100-warm-lean
go llama-4k llama-4k-h100-warm-overlap 40 llama-4k-h100-warm-lean
go llama-4k:bf16 llama-4k-bf16-h100-warm-overlap 40 llama-4k-bf16-h100-warm-lean
go llama-4k-causal:bf16 llama-4k-causal-bf16-h100-warm-overlap 40 llama-4k-causal-bf16-h100-warm-lean
cd /tmp && tar -czf $OUT/runs.tgz runs/*-lean logs bench
