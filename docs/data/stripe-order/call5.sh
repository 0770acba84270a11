# Call 5 (the tree that adds the two runs): `evotune bench best` twice each of the two new runs and of the winners they
# replace (runs/gpt2-causal{,-bf16}-h100-exhaustive-causal), alternating, so that the before and after ratios come
# from one session.
set -u
OUT_REAL=$OUT
mkdir -p $OUT_REAL/bench
for i in 1 2; do
  for run in gpt2-causal-h100-exhaustive-causal gpt2-causal-h100-exhaustive-mirror gpt2-causal-bf16-h100-exhaustive-causal \
             gpt2-causal-bf16-h100-exhaustive-mirror; do
    timeout 60 python3 -m evotune bench best --run $run --reps 100 --out $OUT_REAL/bench/$run-$i.json > $OUT_REAL/bench/$run-$i.txt 2>&1
    echo "$run #$i: $(grep -E 'ours / best' $OUT_REAL/bench/$run-$i.txt)"
  done
done
tar czf $OUT_REAL/bench.tgz -C $OUT_REAL bench && rm -rf $OUT_REAL/bench
