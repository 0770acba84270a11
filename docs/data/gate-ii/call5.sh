#!/usr/bin/env bash
# Issue 38, call 5 (H100 or H200: the reply says), after fa45e02 and 9782ca4: the GPU fault tests against the gate at HEAD (.gate_new = git archive HEAD).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONUNBUFFERED=1 EVOTUNE_CACHE=/tmp/evotune-cache
root=$PWD; new=$root/.gate_new
export PYTHONPATH=/tmp/site:$new
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee $OUT/device.txt
cd $new
timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_faults.py tests/test_memo_family.py tests/test_gpu.py tests/test_bench.py \
    > $OUT/gpu-faults.txt 2>&1; echo "pytest rc $?" >> $OUT/gpu-faults.txt
tail -n 15 $OUT/gpu-faults.txt
