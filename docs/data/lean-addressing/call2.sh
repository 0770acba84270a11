set -u
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs /tmp/logs /tmp/bench
start=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_lean_addressing.py > /tmp/logs/gpu-tests.txt 2>&1
echo "== gpu tests rc=$? at $(( $(date +%s) - start )) s"; tail -3 /tmp/logs/gpu-tests.txt
for r in gpt2-h100-warm-overlap gpt2-bf16-h100-warm-overlap gpt2-causal-h100-warm-overlap gpt2-causal-bf16-h100-warm-overlap; do cp -r runs/$r /tmp/runs/; done
go() {  # shape warm run trials
  [ $(( $(date +%s) - start )) -lt 450 ] || { echo "skip $4"; return; }
  timeout 120 python3 -m evotune search --shape $1 --space search_spaces/attention-hopper3-lean.yaml --warm-start $2 \
    --trials $3 --run $4 > /tmp/logs/$4.txt 2>&1
  echo "== $4: rc=$? at $(( $(date +%s) - start )) s"; tail -4 /tmp/logs/$4.txt
  for i in 1 2; do
    [ $(( $(date +%s) - start )) -lt 560 ] || break
    timeout 60 python3 -m evotune bench best --run $4 --reps 100 --out /tmp/bench/$4-$i.json > /tmp/bench/$4-$i.txt 2>&1 || echo "bench failed"
    echo "bench $i $(grep -E '│ (evotune|cudnn) ' /tmp/bench/$4-$i.txt | awk -F'│' '{printf "%s=%s ", $2, $3}')"
  done
}
go gpt2 gpt2-h100-warm-overlap 40 gpt2-h100-warm-lean
go gpt2:bf16 gpt2-bf16-h100-warm-overlap 40 gpt2-bf16-h100-warm-lean
go gpt2-causal gpt2-causal-h100-warm-overlap 40 gpt2-causal-h100-warm-lean
go gpt2-causal:bf16 gpt2-causal-bf16-h100-warm-overlap 40 gpt2-causal-bf16-h100-warm-lean
cd /tmp && tar -czf $OUT/runs.tgz runs/*-lean logs bench
