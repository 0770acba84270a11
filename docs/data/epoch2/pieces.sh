#!/usr/bin/env bash
# Issue 39 item 2 (the Hopper kernel as traits and pieces: stripe_order a traits parameter, kernels/ptx.cuh,
# kernels/hopper/{consumer,ring,scheduler,epilogue}.cuh): the GPU side of a refactor whose SASS was checked identical
# on the CPU (tools/sass_equivalence.py). Runs every knob against its twin (tests/test_knob_twins_gpu.py) and the
# GPU tests of the pieces that moved most: stripe_order (the mirrored stripes and Q's two buffers, on few SMs and
# with the log-sum-exp), the TMA-store epilogue, the deep ring; sanitizers (marked slow) are left out.
# From the repo root on the device machine, with .whl carried: bash docs/data/epoch2/pieces.sh
# Writes $OUT/pieces.log (pytest -rA) and $OUT/device.txt; prints the failures and the summary last.
# Expected: ~5-7 min on an H100 (NVRTC compiles into a fresh cache, then the launches); each step has its timeout.
. tools/device_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
timeout 280 python3 -m pytest -q -rA -m "gpu and not slow" -p no:cacheprovider tests/test_knob_twins_gpu.py \
    > "$OUT/pieces.log" 2>&1
rc1=$?
timeout 170 python3 -m pytest -q -rA -m "gpu and not slow" -p no:cacheprovider tests/test_stripe_order.py \
    tests/test_tma_store.py tests/test_deep_ring.py >> "$OUT/pieces.log" 2>&1
rc2=$?
grep -E "^(FAILED|ERROR)" "$OUT/pieces.log" | cut -c1-200 | head -40
grep -E "^[0-9]+ (passed|failed)|passed|failed" "$OUT/pieces.log" | grep -E " in [0-9.]+s" | tail -2
echo "pytest rc: twins=$rc1 pieces=$rc2 (124: the step's timeout)"
