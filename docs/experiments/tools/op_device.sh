#!/usr/bin/env bash
# The PyTorch op and the Hopper variant's by-value tensor maps on the GPU (issues 12/13): the GPU tests
# of the op, the Hopper variant and the kernel matrix; the op's host overhead beside SDPA; a short
# search that ends with the same-run SDPA record (runs/<run>/baselines.json). Results under $OUT/op/.
set -u
OUT=${OUT:-/tmp}/op
mkdir -p "$OUT"
export EVOTUNE_CACHE=${EVOTUNE_CACHE:-/tmp/evotune-cache} EVOTUNE_RUNS=$OUT/runs
python3 -m pytest -q -m gpu ${GPU_TESTS:-tests/test_torch_gpu.py tests/test_hopper.py tests/test_gpu.py tests/test_gpu_faults.py} \
    > "$OUT/gpu-tests.txt" 2>&1
python3 tools/op_host_overhead.py --shape 1,8,512,64 --n 2000 --out "$OUT/op_host_overhead.json" > "$OUT/op_host_overhead.txt" 2>&1
python3 -m evotune search --shape mission --trials 12 --run op-device-search > "$OUT/search.txt" 2>&1
echo "== search"; tail -n 6 "$OUT/search.txt"; ls "$OUT/runs/op-device-search"
echo "== op host overhead"; tail -n 12 "$OUT/op_host_overhead.txt"
echo "== gpu tests"; grep -E "FAILED|ERROR" "$OUT/gpu-tests.txt" | head -20; tail -n 3 "$OUT/gpu-tests.txt"
