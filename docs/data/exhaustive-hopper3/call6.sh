set -u
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs /tmp/logs
start=$(date +%s)
timeout 470 python3 -m evotune search --shape gpt2 --space search_spaces/attention-hopper3.yaml --sampler exhaustive \
  --trials 640 --run gpt2-h100-exhaustive-hopper3 > /tmp/logs/gpt2-h100-exhaustive-hopper3.txt 2>&1
echo "search rc=$? in $(( $(date +%s) - start )) s"; grep -h '^finalists:' /tmp/logs/gpt2-h100-exhaustive-hopper3.txt; tail -8 /tmp/logs/gpt2-h100-exhaustive-hopper3.txt
tar -czf $OUT/search.tgz -C /tmp runs/gpt2-h100-exhaustive-hopper3 logs
cp -r runs/gpt2-h100-tma /tmp/runs/
mkdir -p /tmp/bench
for run in gpt2-h100-exhaustive-hopper3 gpt2-h100-tma; do
  [ $(( $(date +%s) - start )) -lt 540 ] || break
  timeout 40 python3 -m evotune bench best --run $run --reps 100 --out /tmp/bench/$run-1.json > /tmp/bench/$run-1.txt 2>&1 || echo "bench $run failed"
  echo "$run $(grep -E '│ (evotune|cudnn) ' /tmp/bench/$run-1.txt | awk -F'│' '{printf "%s=%s ", $2, $3}')"
done
tar -czf $OUT/bench.tgz -C /tmp bench
