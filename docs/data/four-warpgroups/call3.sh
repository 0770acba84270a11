# Call 3 (the kernel as committed): exhaustive searches of search_spaces/attention-hopper3-wg4.yaml on gpt2 fp16 and
# bf16, and `evotune bench best` of each.
set -u
OUT_REAL=$OUT
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs $OUT_REAL/logs $OUT_REAL/bench
start=$(date +%s)
ex() {  # shape run
  [ $(( $(date +%s) - start )) -lt 380 ] || return
  timeout 220 python3 -m evotune search --shape $1 --space search_spaces/attention-hopper3-wg4.yaml --sampler exhaustive \
    --trials 948 --run $2 > $OUT_REAL/logs/$2.txt 2>&1
  echo "== $2: rc=$? at $(( $(date +%s) - start )) s"; grep -E "candidates evaluated|^best" -A2 $OUT_REAL/logs/$2.txt | cut -c1-200
  timeout 60 python3 -m evotune bench best --run $2 --reps 100 --out $OUT_REAL/bench/$2.json > $OUT_REAL/bench/$2.txt 2>&1
  grep -E "ours / best" $OUT_REAL/bench/$2.txt
}
ex gpt2 gpt2-h100-exhaustive-wg4
ex gpt2:bf16 gpt2-bf16-h100-exhaustive-wg4
cd /tmp && tar -czf $OUT_REAL/runs.tgz runs
