set -u
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs /tmp/logs /tmp/bench
start=$(date +%s)
for r in long-16k-causal-h100-persistent long-16k-causal-bf16-h100-persistent; do rm -rf /tmp/runs/$r; cp -r runs/$r /tmp/runs/; done
go() {  # shape warm run trials
  [ $(( $(date +%s) - start )) -lt 400 ] || { echo "skip $4"; return; }
  timeout 200 python3 -m evotune search --shape $1 --space search_spaces/attention-hopper3-lean.yaml --warm-start $2 \
    --trials $3 --run $4 > /tmp/logs/$4.txt 2>&1
  echo "== $4: rc=$? at $(( $(date +%s) - start )) s"; tail -4 /tmp/logs/$4.txt | cut -c1-300
  for i in 1 2; do
    [ $(( $(date +%s) - start )) -lt 540 ] || break
    timeout 60 python3 -m evotune bench best --run $4 --reps 100 --out /tmp/bench/$4-$i.json > /tmp/bench/$4-$i.txt 2>&1 || echo "bench failed"
    echo "bench $i $(grep -E '│ (evotune|cudnn) ' /tmp/bench/$4-$i.txt | awk -F'│' '{printf "%s=%s ", $2, $3}')"
  done
}
go long-16k-causal long-16k-causal-h100-persistent 40 long-16k-causal-h100-warm-lean
go long-16k-causal:bf16 long-16k-causal-bf16-h100-persistent 40 long-16k-causal-bf16-h100-warm-lean
cd /tmp && tar -czf $OUT/call5.tgz runs/long-16k*-lean logs/long-16k* bench/long-16k*
