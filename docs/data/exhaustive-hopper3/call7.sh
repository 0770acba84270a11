set -u
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs /tmp/logs /tmp/bench
start=$(date +%s)
search() {  # shape run trials seconds
  timeout $4 python3 -m evotune search --shape $1 --space search_spaces/attention-hopper3.yaml --sampler exhaustive \
    --trials $3 --run $2 > /tmp/logs/$2.txt 2>&1
  echo "$2 rc=$? at $(( $(date +%s) - start )) s"; grep -h '^finalists:' /tmp/logs/$2.txt; grep -h -A1 '^best:' /tmp/logs/$2.txt; grep -h "candidates evaluated" -A1 /tmp/logs/$2.txt
}
bench() {
  timeout 60 python3 -m evotune bench best --run $1 --reps 100 --out /tmp/bench/$1-1.json > /tmp/bench/$1-1.txt 2>&1 || echo "bench $1 failed"
  echo "$1 $(grep -E '│ (evotune|cudnn) ' /tmp/bench/$1-1.txt | awk -F'│' '{printf "%s=%s ", $2, $3}')"
}
search gpt2-causal gpt2-causal-h100-exhaustive-hopper3 640 110
tar -czf $OUT/search.tgz -C /tmp runs logs
search long-8k long-8k-h100-exhaustive-hopper3 640 300
tar -czf $OUT/search.tgz -C /tmp runs logs
for r in gpt2-causal-h100-tma long-8k-h100-tma; do cp -r runs/$r /tmp/runs/; done
for r in gpt2-causal-h100-exhaustive-hopper3 gpt2-causal-h100-tma long-8k-h100-exhaustive-hopper3 long-8k-h100-tma; do
  [ $(( $(date +%s) - start )) -lt 540 ] || break; [ -f /tmp/runs/$r/best.json ] && bench $r; done
tar -czf $OUT/bench.tgz -C /tmp bench
