set -u
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs /tmp/logs /tmp/bench
start=$(date +%s)
for r in long-8k-h100-exhaustive-hopper3 long-8k-h100-tma long-8k-bf16-h100-tma; do cp -r runs/$r /tmp/runs/; done
bench() {  # run index
  timeout 60 python3 -m evotune bench best --run $1 --reps 100 --out /tmp/bench/$1-$2.json > /tmp/bench/$1-$2.txt 2>&1 || echo "bench $1 failed"
  echo "$1 $2 $(grep -E '│ (evotune|cudnn) ' /tmp/bench/$1-$2.txt | awk -F'│' '{printf "%s=%s ", $2, $3}') at $(( $(date +%s) - start )) s"
}
for i in 1 2 3; do bench long-8k-h100-exhaustive-hopper3 $i; done
bench long-8k-h100-tma 1
tar -czf $OUT/bench.tgz -C /tmp bench
timeout 150 python3 -m evotune search --shape long-8k:bf16 --space search_spaces/attention-hopper3.yaml \
  --warm-start long-8k-h100-exhaustive-hopper3 --trials 24 --run long-8k-bf16-h100-warm-hopper3 > /tmp/logs/long-8k-bf16-h100-warm-hopper3.txt 2>&1
echo "bf16 search rc=$? at $(( $(date +%s) - start )) s"; grep -h '^finalists:' /tmp/logs/long-8k-bf16-h100-warm-hopper3.txt; grep -h -A1 '^best:' /tmp/logs/long-8k-bf16-h100-warm-hopper3.txt
tar -czf $OUT/search.tgz -C /tmp runs/long-8k-bf16-h100-warm-hopper3 logs
for i in 1 2; do bench long-8k-bf16-h100-warm-hopper3 $i; done
bench long-8k-bf16-h100-tma 1
tar -czf $OUT/bench.tgz -C /tmp bench
if [ $(( $(date +%s) - start )) -lt 420 ]; then
  timeout 130 ncu --target-processes all -k regex:evotune_attention -s 3 -c 1 --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
    python3 -m evotune verify --run long-8k-h100-exhaustive-hopper3 --launches 2 > $OUT/ncu.txt 2>&1 || echo "ncu failed"
  grep -E "Duration|Issue Slots Busy|highest-utilized|Achieved Occupancy|Compute \(SM\)" $OUT/ncu.txt | head -8
fi
