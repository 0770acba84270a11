set -u
W='{"block_m": 32, "block_n": 128, "compute_warps": 4, "key_merge": "split", "kv_load": "tma", "kv_splits": 1, "pdl": true, "producer_warps": 0, "q_in_regs": true, "smem_layout": "swizzle", "stages": 4, "warp_key_groups": 2}'
S='{"block_m": 32, "block_n": 128, "compute_warps": 4, "key_merge": "split", "kv_load": "tma_split", "kv_splits": 1, "pdl": true, "producer_warps": 0, "q_in_regs": true, "smem_layout": "swizzle", "stages": 3, "warp_key_groups": 2}'
export EVOTUNE_RUNS=/tmp/runs
KNOB=exp2_fma VALUES="0 1 2" TESTS=tests/test_exp2_fma.py SPACE=search_spaces/attention-small-exp2.yaml \
RUN=mission-h100-exhaustive-small-exp2 OLD=mission-h100-exhaustive-small-split TRIALS=1980 SEARCH_S=300 CHECK_S=150 SANITIZE_S=90 \
PAIRS="[$W, $S]" STEPS="check pairs search" bash tools/mission_knob_device.sh
cp -r runs/mission-h100-exhaustive-small-split /tmp/runs/
mkdir -p /tmp/bench
for i in 1 2 3 4 5 6; do for run in mission-h100-exhaustive-small-exp2 mission-h100-exhaustive-small-split; do
  timeout 60 python3 -m evotune bench best --run $run --reps 100 --out /tmp/bench/$run-$i.json > /tmp/bench/$run-$i.txt 2>&1 || echo "bench $run $i failed"
  echo "$run $i $(grep -E '│ (evotune|cudnn) ' /tmp/bench/$run-$i.txt | awk -F'│' '{printf "%s=%s ", $2, $3}')"
done; done
tar -czf $OUT/bench.tgz -C /tmp bench
mkdir -p $OUT/trace
timeout 100 python3 tools/phase_trace.py --run mission-h100-exhaustive-small-exp2 --out $OUT/trace/new.json > /tmp/trace_new.txt 2>&1; echo "trace rc=$?"; tail -3 /tmp/trace_new.txt
gunzip -c docs/data/tma-load/trace/tma_pdl_on.json.gz > /tmp/old.json
python3 tools/phase_trace.py --compare /tmp/old.json $OUT/trace/new.json > $OUT/trace/compare.txt 2>&1
gzip -9 $OUT/trace/new.json
tail -32 $OUT/trace/compare.txt
