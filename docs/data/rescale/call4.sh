set -u
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs /tmp/logs /tmp/bench
start=$(date +%s)
for r in long-8k-h100-exhaustive-hopper3 long-8k-bf16-h100-warm-hopper3 llama-4k-h100-exhaustive-hopper3 gpt2-h100-exhaustive-hopper3; do cp -r runs/$r /tmp/runs/; done
search() {  # shape run warm trials seconds
  [ $(( $(date +%s) - start )) -lt $((570 - $5)) ] || { echo "skip $2"; return; }
  timeout $5 python3 -m evotune search --shape $1 --space search_spaces/attention-hopper3-rescale.yaml --warm-start $3 \
    --trials $4 --run $2 > /tmp/logs/$2.txt 2>&1
  echo "$2 rc=$? at $(( $(date +%s) - start )) s"; grep -h "warm start" /tmp/logs/$2.txt; grep -h -A1 '^best:' /tmp/logs/$2.txt | cut -c1-200; grep -h "candidates evaluated" /tmp/logs/$2.txt
}
bench() {  # run i
  [ $(( $(date +%s) - start )) -lt 550 ] || { echo "skip bench $1"; return; }
  timeout 60 python3 -m evotune bench best --run $1 --reps 100 --out /tmp/bench/$1-$2.json > /tmp/bench/$1-$2.txt 2>&1 || echo "bench $1 failed"
  echo "bench $1 $2 $(grep -E '│ (evotune|cudnn) ' /tmp/bench/$1-$2.txt | awk -F'│' '{printf "%s=%s ", $2, $3}')"
}
search long-8k long-8k-h100-warm-rescale long-8k-h100-exhaustive-hopper3 48 170
bench long-8k-h100-warm-rescale 1
search long-8k:bf16 long-8k-bf16-h100-warm-rescale long-8k-bf16-h100-warm-hopper3 36 120
bench long-8k-bf16-h100-warm-rescale 1
search gpt2 gpt2-h100-warm-rescale gpt2-h100-exhaustive-hopper3 36 80
bench gpt2-h100-warm-rescale 1
search llama-4k llama-4k-h100-warm-rescale llama-4k-h100-exhaustive-hopper3 36 110
bench llama-4k-h100-warm-rescale 1
bench long-8k-h100-warm-rescale 2
bench long-8k-bf16-h100-warm-rescale 2
tar -czf $OUT/search.tgz -C /tmp runs/long-8k-h100-warm-rescale runs/long-8k-bf16-h100-warm-rescale runs/gpt2-h100-warm-rescale runs/llama-4k-h100-warm-rescale logs bench 2>/dev/null
echo "done at $(( $(date +%s) - start )) s"
