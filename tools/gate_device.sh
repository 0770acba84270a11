#!/usr/bin/env bash
# The trust gate on the H100 (issue 11): its cost per candidate before and after the new checks
# (the same configs, one process each, old checkout from BEFORE=<folder holding its evotune/,
# kernels/, search_spaces/>), then the GPU tests of the planted faults and the kernel matrix.
# Results under $OUT/gate/, a table last.
#   BEFORE=.gate_before bash tools/gate_device.sh
set -u
OUT=${OUT:-/tmp}/gate
mkdir -p "$OUT"
export EVOTUNE_CACHE=${EVOTUNE_CACHE:-/tmp/evotune-cache}
base=$PYTHONPATH
for spec in "mission 16" "gpt2 8"; do
    set -- $spec
    python3 tools/gate_cost.py --space attention --shape "$1" --n "$2" --out "$OUT/cost-$1-after.json" \
        > "$OUT/cost-$1-after.txt" 2>&1
    if [ -n "${BEFORE:-}" ]; then
        PYTHONPATH="$PWD/$BEFORE:$base" EVOTUNE_KERNELS="$PWD/$BEFORE/kernels" EVOTUNE_SPACES="$PWD/$BEFORE/search_spaces" \
            python3 tools/gate_cost.py --same-configs "$OUT/cost-$1-after.json" --out "$OUT/cost-$1-before.json" \
            > "$OUT/cost-$1-before.txt" 2>&1
    fi
done
python3 -m pytest -q -m gpu ${GPU_TESTS:-tests/test_gpu_faults.py tests/test_evaluate.py tests/test_gpu.py} \
    > "$OUT/gpu-tests.txt" 2>&1
for f in "$OUT"/cost-*.txt; do echo "== $(basename "$f")"; tail -n 8 "$f"; done
echo "== gpu tests"; tail -n 15 "$OUT/gpu-tests.txt"
