set -u
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs /tmp/logs /tmp/bench $OUT/t
start=$(date +%s)
for r in long-8k-h100-exhaustive-hopper3 long-8k-bf16-h100-warm-hopper3 llama-4k-h100-exhaustive-hopper3; do cp -r runs/$r /tmp/runs/; done
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_rescale.py -rfs > /tmp/logs/tests.txt 2>&1
echo "tests rc=$? $(tail -1 /tmp/logs/tests.txt) at $(( $(date +%s) - start )) s"; grep -E "^(FAILED|ERROR)" /tmp/logs/tests.txt | head
search() {  # shape run warm trials seconds
  [ $(( $(date +%s) - start )) -lt $((560 - $5)) ] || { echo "skip $2"; return; }
  timeout $5 python3 -m evotune search --shape $1 --space search_spaces/attention-hopper3-rescale.yaml --warm-start $3 \
    --trials $4 --run $2 > /tmp/logs/$2.txt 2>&1
  echo "$2 rc=$? at $(( $(date +%s) - start )) s"; grep -h -A1 '^best:' /tmp/logs/$2.txt | cut -c1-220; grep -h "candidates evaluated" /tmp/logs/$2.txt
}
bench() {  # run i
  [ $(( $(date +%s) - start )) -lt 540 ] || { echo "skip bench $1"; return; }
  timeout 60 python3 -m evotune bench best --run $1 --reps 100 --out /tmp/bench/$1-$2.json > /tmp/bench/$1-$2.txt 2>&1 || echo "bench $1 failed"
  echo "bench $1 $2 $(grep -E '│ (evotune|cudnn) ' /tmp/bench/$1-$2.txt | awk -F'│' '{printf "%s=%s ", $2, $3}')"
}
search long-8k long-8k-h100-rescale long-8k-h100-exhaustive-hopper3 48 160
bench long-8k-h100-rescale 1
search long-8k:bf16 long-8k-bf16-h100-rescale long-8k-bf16-h100-warm-hopper3 36 130
bench long-8k-bf16-h100-rescale 1
search llama-4k llama-4k-h100-rescale llama-4k-h100-exhaustive-hopper3 36 120
bench llama-4k-h100-rescale 1
bench long-8k-h100-rescale 2
tar -czf $OUT/search.tgz -C /tmp runs/long-8k-h100-rescale runs/long-8k-bf16-h100-rescale runs/llama-4k-h100-rescale logs bench 2>/dev/null
echo "done at $(( $(date +%s) - start )) s"
