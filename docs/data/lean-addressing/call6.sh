set -u
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs /tmp/logs /tmp/bench
start=$(date +%s)
cp -r runs/gpt2-h100-warm-lean runs/gpt2-causal-h100-warm-lean /tmp/runs/
ex() {  # shape run
  [ $(( $(date +%s) - start )) -lt 330 ] || { echo "skip $2"; return; }
  timeout 240 python3 -m evotune search --shape $1 --space search_spaces/attention-hopper3-tiles.yaml --sampler exhaustive \
    --trials 640 --run $2 > /tmp/logs/$2.txt 2>&1
  echo "== $2: rc=$? at $(( $(date +%s) - start )) s"; tail -4 /tmp/logs/$2.txt | cut -c1-300
  for r in $2 $3; do
    [ $(( $(date +%s) - start )) -lt 560 ] || break
    timeout 60 python3 -m evotune bench best --run $r --reps 100 --out /tmp/bench/$r-c6.json > /tmp/bench/$r-c6.txt 2>&1 || echo "bench failed"
    echo "bench $r $(grep -E '│ (evotune|cudnn) ' /tmp/bench/$r-c6.txt | awk -F'│' '{printf "%s=%s ", $2, $3}')"
  done
}
ex gpt2 gpt2-h100-exhaustive-tiles gpt2-h100-warm-lean
ex gpt2-causal gpt2-causal-h100-exhaustive-tiles gpt2-causal-h100-warm-lean
cd /tmp && tar -czf $OUT/call6.tgz runs/*-exhaustive-tiles logs bench
