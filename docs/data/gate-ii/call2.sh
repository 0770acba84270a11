#!/usr/bin/env bash
# Issue 38, call 2 (H100): a cold-cache mission search, benches of committed preset winners beside every SDPA
# backend (rotating timing inputs, the floor judged), and what measuring the floor's ceilings costs a worker.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONUNBUFFERED=1 EVOTUNE_CACHE=/tmp/evotune-cache
root=$PWD; new=$root/.gate_new
export PYTHONPATH=/tmp/site:$new
cd $new
EVOTUNE_RUNS=/tmp/runs EVOTUNE_CACHE=/tmp/evotune-cold timeout 90 python3 -m evotune search --shape mission --run first \
    > $OUT/search-mission.txt 2>&1; echo "search rc $?" >> $OUT/search-mission.txt
for run in mission-h100-pdl llama-4k-h100-warm-lean gpt2-causal-h100-exhaustive-mirror; do
  EVOTUNE_RUNS=$root/runs timeout 150 python3 -m evotune bench best --run $run --out $OUT/bench-$run.json \
    > $OUT/bench-$run.txt 2>&1; echo "bench rc $?" >> $OUT/bench-$run.txt
done
PYTHONPATH=/tmp/site:$new python3 - > $OUT/floor-cost.txt 2>&1 <<'PY'
import time, torch
from evotune.gpu.plausibility import Floors
from evotune.problems import get_problem
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
f = Floors(); p = get_problem("attention")
for spec in ("mission", "mission:bf16", "llama-4k"):
    t = time.perf_counter(); fl, ce = f.floor(p.parse_shape(spec)); dt = time.perf_counter() - t
    print(f"{spec}: floor {fl['floor_us']:.3f} us (launch {fl['launch_us']:.3f}, memory {fl['memory_us']:.3f}, "
          f"compute {fl['compute_us']:.3f}); copy {ce['copy']['gb_s']:.0f} GB/s, matmul {ce['matmul']['tflop_s']:.0f} "
          f"TFLOP/s; measured in {dt:.3f} s")
PY
tail -n 4 $OUT/search-mission.txt; cat $OUT/floor-cost.txt
for f in $OUT/bench-*.txt; do echo "== $f"; grep -E "evotune|cudnn|floor|rc" $f | head -8; done
