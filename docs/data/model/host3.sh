#!/usr/bin/env bash
# Host cost per attention call, round 3 (issue 41 section 1): the compiled launcher on by default, with a Python
# entry that eager calls try first (evotune.torch.launcher). One device call, each step under a timeout:
#   1. the launcher's GPU tests (a fresh cache: built here), the op's and the adapter's GPU tests, the launcher on
#   2. tools/op_host_overhead.py, every row, 7 interleaved rounds of 1000 calls, each eager row also in a CUDA graph,
#      on the GPT-2 row (1,12,512,64 causal, bshd) and the mission shape (1,8,512,64, bshd): --launcher cpp (the
#      default), then --launcher python (EVOTUNE_CPP_LAUNCHER=0); each run's ratios against its own SDPA rows
# Run from the repository root, alone on the host (no other job loading its CPUs):  bash docs/data/model/host3.sh
# Writes $OUT/host3.tar.gz (pytest logs, each tool run's JSON, markdown and stdout, the launcher's build log) and
# prints the test summaries and the tables last.
set -u
OUT=${OUT:-/tmp/host3-out}
. tools/device_env.sh || exit 1
work=${TMPDIR:-/tmp}/host3-work
rm -rf "$work"; mkdir -p "$work" "$OUT"
export EVOTUNE_CACHE=$work/cache
unset EVOTUNE_CPP_LAUNCHER
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$work/device.txt"
(c++ --version | head -n 1; nproc; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)") >> "$work/device.txt" 2>&1
git rev-parse --short HEAD > "$work/git.txt" 2>/dev/null
start=$(date +%s)

if [ "${TESTS:-1}" = 1 ]; then
timeout 180 python3 -m pytest -q -m gpu tests/test_torch_launcher_gpu.py -p no:cacheprovider \
  > "$work/pytest-launcher.log" 2>&1
echo "launcher tests rc=$? ($(( $(date +%s) - start )) s): $(tail -n 1 "$work/pytest-launcher.log")"
cp "$work"/cache/launcher/*/build.log "$work/launcher-build.log" 2>/dev/null
timeout 170 python3 -m pytest -q -m gpu tests/test_torch_gpu.py tests/test_torch_train_gpu.py tests/test_op_sinks_gpu.py \
  -p no:cacheprovider > "$work/pytest-op.log" 2>&1
echo "op tests rc=$? ($(( $(date +%s) - start )) s): $(tail -n 1 "$work/pytest-op.log")"
fi

# HOST_SHAPES: name=shape pairs (default both); TESTS=0 skips step 1
for spec in ${HOST_SHAPES:-gpt2=1,12,512,64:causal mission=1,8,512,64}; do
  name=${spec%%=*}; shape=${spec#*=}
  for which in cpp python; do
    timeout 100 python3 tools/op_host_overhead.py --shape "$shape" --n 1000 --rounds 7 --graph --launcher $which \
      --out "$work/host-$name-$which.json" --md "$work/host-$name-$which.md" > "$work/host-$name-$which.txt" 2>&1
    echo "op_host_overhead $name $which rc=$? ($(( $(date +%s) - start )) s)"
  done
done

TORCH_LOGS=output_code,guards timeout 90 python3 docs/data/model/compile_probe.py 1,12,512,64:causal \
  > "$work/compile-probe.log" 2>&1
echo "compile probe rc=$? ($(( $(date +%s) - start )) s): $(grep -c '+- [A-Z_]*:' "$work/compile-probe.log") guards logged"

tar -czf "$OUT/host3.tar.gz" -C "$work" --exclude cache .
for f in "$work"/pytest-*.log; do
  grep -E "^FAILED|^ERROR|passed|failed" "$f" | tail -n 8
done
for f in "$work"/host-*.txt; do echo; tail -n 13 "$f"; done
