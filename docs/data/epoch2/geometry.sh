#!/usr/bin/env bash
# Issue 39 item 7 (KernelSource carries its launch geometry; a persistent grid is LaunchGeometry.grid_for of the
# device's SMs): the GPU side of a change whose values the CPU tests pin (tests/test_kernel_source_geometry.py,
# tests/test_persistent.py). Launches every launch class on the H100: attention's persistent grid on every SM and on
# few (EVOTUNE_SM_COUNT), its causal tile counters, the fixed grids, softmax's launcher and worker, and a family
# file's (examples/gemm, rmsnorm); sanitizers (marked slow) are left out.
# From the repo root on the device machine, with .whl carried: bash docs/data/epoch2/geometry.sh
# Writes $OUT/geometry.log (pytest -rA) and $OUT/device.txt; prints the failures and the summary last.
# Expected: ~4-6 min on an H100 (NVRTC compiles into a fresh cache, then the launches); each step has its timeout.
. tools/device_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
# Attention: the persistent grid on every SM and on few, its tile counters, and some fixed grids (102 tests).
pick="persistent_on_every_sm or tile_counters or (persistent_matches_reference and (mission or kv4 or 1000))"
pick="$pick or split_kv_counters or worker_survives or (kernel_matches_reference and mission and not bf16)"
timeout 240 python3 -m pytest -q -rA -m "gpu and not slow" -p no:cacheprovider tests/test_gpu.py -k "$pick" \
    > "$OUT/geometry.log" 2>&1
rc1=$?
timeout 180 python3 -m pytest -q -rA -m "gpu and not slow" -p no:cacheprovider tests/test_gpu_softmax.py \
    tests/test_examples.py tests/test_stripe_order.py -k "not sanitizers" >> "$OUT/geometry.log" 2>&1
rc2=$?
grep -E "^(FAILED|ERROR)" "$OUT/geometry.log" | cut -c1-200 | head -40
grep -E "passed|failed" "$OUT/geometry.log" | grep -E " in [0-9.]+s" | tail -2
echo "pytest rc: attention=$rc1 softmax/examples/stripe_order=$rc2 (124: the step's timeout)"
