set -u
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs /tmp/logs /tmp/bench
start=$(date +%s)
timeout 430 python3 -m evotune search --shape llama-4k --space search_spaces/attention-hopper3.yaml --sampler exhaustive \
  --trials 490 --run llama-4k-h100-exhaustive-hopper3 > /tmp/logs/llama-4k-h100-exhaustive-hopper3.txt 2>&1
echo "search rc=$? at $(( $(date +%s) - start )) s"; grep -h '^finalists:' /tmp/logs/llama-4k-h100-exhaustive-hopper3.txt; grep -h -A1 '^best:' /tmp/logs/llama-4k-h100-exhaustive-hopper3.txt; grep -h "candidates evaluated" -A1 /tmp/logs/llama-4k-h100-exhaustive-hopper3.txt
tar -czf $OUT/search.tgz -C /tmp runs/llama-4k-h100-exhaustive-hopper3 logs
cp -r runs/llama-4k-h100-tma /tmp/runs/
bench() {
  timeout 50 python3 -m evotune bench best --run $1 --reps 100 --out /tmp/bench/$1-$2.json > /tmp/bench/$1-$2.txt 2>&1 || echo "bench $1 failed"
  echo "$1 $2 $(grep -E '│ (evotune|cudnn) ' /tmp/bench/$1-$2.txt | awk -F'│' '{printf "%s=%s ", $2, $3}') at $(( $(date +%s) - start )) s"
}
for x in "llama-4k-h100-exhaustive-hopper3 1" "llama-4k-h100-tma 1" "llama-4k-h100-exhaustive-hopper3 2"; do
  [ $(( $(date +%s) - start )) -lt 540 ] || break; [ -f /tmp/runs/${x%% *}/best.json ] && bench $x; done
tar -czf $OUT/bench.tgz -C /tmp bench
