#!/usr/bin/env bash
# Issue 39 item 6: every knob of attention.yaml against its twin on the GPU (tests/test_knob_twins_gpu.py: the outputs
# bit for bit the twin's, or within the gate's tolerance where the knob changes the arithmetic). From the repo root on
# the device machine, with .whl carried: bash docs/data/epoch2/twins.sh
# Writes $OUT/twins.log (pytest -rA: every item's outcome, skip reasons and failures) and $OUT/device.txt; prints the
# summary last. Expected: ~3-6 min on an H100 (about 150 NVRTC compiles in a 16-process pool into a fresh
# cache, then ~96 pairs of launches).
. tools/device_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
timeout 450 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_knob_twins_gpu.py > "$OUT/twins.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR)" "$OUT/twins.log" | cut -c1-200 | head -40
tail -1 "$OUT/twins.log"
echo "pytest rc=$rc"
