#!/usr/bin/env bash
# Host cost per attention call, round 2 (issue 41 section 1), on the H100 in one device call of ~6 minutes (each
# step under a timeout; 460 s at most):
#   1. the op's GPU tests (tests/test_torch_gpu.py, tests/test_torch_train_gpu.py) after the Python cuts (the eager
#      fast path's checks, the transformers adapter's one-pass check and plain counters), the launcher off
#   2. the compiled launcher's GPU tests (tests/test_torch_launcher_gpu.py, EVOTUNE_CPP_LAUNCHER=1 inside): built
#      here on first use, launches bitwise equal to the Python route's (mma.sync, split-KV, Hopper TMA maps on new
#      addresses, the persistent grid's counters), the dispatcher and torch.compile through it, CUDA-graph capture,
#      a misaligned view handed back to Python
#   3. tools/op_host_overhead.py on the GPT-2 row (1,12,512,64 causal, bshd), every row, 7 interleaved rounds of
#      1000 calls and each eager row in a CUDA graph: --launcher python, then --launcher cpp (its tuned rows read
#      "tuned-cpp"; its fallback rows run SDPA from C++); compare each run's ratios to its own SDPA rows
# Run from the repository root:  bash docs/data/model/host2.sh
# Writes $OUT/host2.tar.gz (the pytest logs, each tool run's JSON, markdown and stdout, the launcher's build log) and
# prints the test summaries and both tables last.
set -u
OUT=${OUT:-/tmp/host2-out}
. tools/device_env.sh || exit 1
work=${TMPDIR:-/tmp}/host2-work
rm -rf "$work"; mkdir -p "$work" "$OUT"
export EVOTUNE_CACHE=$work/cache
unset EVOTUNE_CPP_LAUNCHER
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$work/device.txt"
(c++ --version | head -n 1; python3 -c "import torch; print('torch', torch.__version__)") >> "$work/device.txt" 2>&1
git rev-parse --short HEAD > "$work/git.txt" 2>/dev/null
start=$(date +%s)

timeout 185 python3 -m pytest -q -m gpu tests/test_torch_gpu.py tests/test_torch_train_gpu.py -p no:cacheprovider \
  > "$work/pytest-op.log" 2>&1
echo "op tests rc=$? ($(( $(date +%s) - start )) s): $(tail -n 1 "$work/pytest-op.log")"
timeout 75 python3 -m pytest -q -m gpu tests/test_torch_launcher_gpu.py -p no:cacheprovider \
  > "$work/pytest-launcher.log" 2>&1
echo "launcher tests rc=$? ($(( $(date +%s) - start )) s): $(tail -n 1 "$work/pytest-launcher.log")"
cp "$work"/cache/launcher/*/build.log "$work/launcher-build.log" 2>/dev/null

timeout 100 python3 tools/op_host_overhead.py --shape 1,12,512,64:causal --n 1000 --rounds 7 --graph --launcher python \
  --out "$work/host-gpt2-python.json" --md "$work/host-gpt2-python.md" > "$work/host-gpt2-python.txt" 2>&1
echo "op_host_overhead python rc=$? ($(( $(date +%s) - start )) s)"
timeout 100 python3 tools/op_host_overhead.py --shape 1,12,512,64:causal --n 1000 --rounds 7 --graph --launcher cpp \
  --out "$work/host-gpt2-cpp.json" --md "$work/host-gpt2-cpp.md" > "$work/host-gpt2-cpp.txt" 2>&1
echo "op_host_overhead cpp rc=$? ($(( $(date +%s) - start )) s)"

tar -czf "$OUT/host2.tar.gz" -C "$work" --exclude cache .
for f in "$work"/pytest-op.log "$work"/pytest-launcher.log; do
  grep -E "^FAILED|^ERROR|passed|failed" "$f" | tail -n 6
done
for f in "$work"/host-gpt2-python.txt "$work"/host-gpt2-cpp.txt; do echo; tail -n 13 "$f"; done
