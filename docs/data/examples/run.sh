#!/usr/bin/env bash
# The examples (examples/gemm, examples/rmsnorm) tuned on the GPU, each beside its torch op and Kernel Tuner at the
# same budget (docs/PLUGINS.md). About 4-6 minutes on one H100, at most 8 (each step has its own timeout; the GPU test of tests/test_examples.py first). From the repository root, with .whl carried:
#
#   bash docs/data/examples/run.sh [BUDGET]          # BUDGET: trials each (default 40)
#
# Per example: `python3 -m evotune search --family examples/E/E.yaml --trials BUDGET --json` (its wall time, from the
# command's start: interpreter, worker start, compiles and all), then compare.py: Kernel Tuner 1.5's tune_kernel at
# max_fevals BUDGET (random_sample), both winners re-timed by evotune's harness, the torch op timed the same way.
# Kernel Tuner needs, beside optuna's wheels in .whl, what `import kernel_tuner` imports beyond the image (numpy,
# torch, cupy): ../shared/device/prepare-wheels.sh kernel_tuner==1.5.0 python-constraint2 xmltodict jsonschema
# jsonschema-specifications referencing rpds-py attrs packaging (scipy only for strategies not used here; a few MB in
# all). Without them its rows say "not installed" and the rest runs.
# Writes $OUT/examples.tar.gz (search summaries and logs, the compare JSONs, the run folders) and $OUT/table.txt;
# prints the table last.
set -u
budget=${1:-40}
OUT=${OUT:-/tmp/examples-out}
mkdir -p "$OUT"
. tools/device_env.sh || exit 1
work=/tmp/examples-work
rm -rf "$work"; mkdir -p "$work"
export EVOTUNE_RUNS=$work/runs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$work/device.txt"
timeout 75 python3 -m pytest -q -p no:cacheprovider tests/test_examples.py > "$work/gpu-test.log" 2>&1
echo "tests/test_examples.py (the GPU test: 8 configs x 2 shapes each through the whole gate): rc $?" | tee "$work/gpu-test.txt"
tail -n 3 "$work/gpu-test.log"
for ex in gemm rmsnorm; do
  start=$(date +%s.%N)
  timeout 110 python3 -m evotune search --family "examples/$ex/$ex.yaml" --trials "$budget" --json \
    > "$work/$ex-search.json" 2> "$work/$ex-search.log"
  rc=$?
  wall=$(python3 -c "print(round($(date +%s.%N) - $start, 2))")
  echo "$ex: evotune search rc $rc in $wall s"; tail -n 3 "$work/$ex-search.log"
  timeout 90 python3 docs/data/examples/compare.py "$ex" "$work/$ex-search.json" "$wall" "$rc" "$work/$ex-compare.json" \
    --budget "$budget" > "$work/$ex-compare.log" 2>&1 || { echo "$ex: compare failed"; tail -n 5 "$work/$ex-compare.log"; }
done
{ cat "$work/gpu-test.txt"; python3 docs/data/examples/compare.py --table "$work"/*-compare.json; } > "$work/table.txt" 2>&1
cp "$work/table.txt" "$OUT/table.txt"
tar czf "$OUT/examples.tar.gz" -C "$work" --exclude='*.cubin' .
cat "$work/table.txt"
