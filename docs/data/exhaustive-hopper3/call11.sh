set -u
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs /tmp/logs /tmp/bench
start=$(date +%s)
rm -rf /tmp/runs/long-8k-h100-exhaustive-hopper3 /tmp/bench/*; cp -r runs/long-8k-h100-exhaustive-hopper3 /tmp/runs/
timeout 300 python3 -m evotune search --shape long-8k --space search_spaces/attention-hopper3.yaml --sampler exhaustive \
  --trials 640 --resume --run long-8k-h100-exhaustive-hopper3 > /tmp/logs/long-8k-h100-exhaustive-hopper3-finalists.txt 2>&1
echo "rc=$? at $(( $(date +%s) - start )) s"; tail -6 /tmp/logs/long-8k-h100-exhaustive-hopper3-finalists.txt
tar -czf $OUT/search.tgz -C /tmp runs/long-8k-h100-exhaustive-hopper3 logs
for i in 3 4; do
  [ $(( $(date +%s) - start )) -lt 500 ] || break
  timeout 60 python3 -m evotune bench best --run long-8k-h100-exhaustive-hopper3 --reps 100 --out /tmp/bench/long-8k-h100-exhaustive-hopper3-$i.json > /tmp/bench/long-8k-h100-exhaustive-hopper3-$i.txt 2>&1 || echo "bench failed"
  echo "bench $i $(grep -E '│ (evotune|cudnn) ' /tmp/bench/long-8k-h100-exhaustive-hopper3-$i.txt | awk -F'│' '{printf "%s=%s ", $2, $3}')"
done
tar -czf $OUT/bench.tgz -C /tmp bench
