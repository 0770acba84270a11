#!/usr/bin/env bash
# Issue 13, item 2: three consumer warpgroups (192-row tiles, compute_warps 12) against the committed winners of the
# d64 presets, hand-picked (an explanation, not a claim: the claims come from searches), each verified by the gate and
# timed beside SDPA's FLASH and CUDNN backends in one process per shape (tools/time_configs.py).
#   OUT=dir bash tools/consumer_wgs_probe.sh     -> $OUT/consumer_wgs.tgz (one time_configs.json and log per shape)
set -uo pipefail
FINAL=${OUT:?set OUT}; work=$(mktemp -d)/consumer_wgs; mkdir -p "$work"
here=$(cd "$(dirname "$0")/.." && pwd)
W='"mma":"wgmma","smem_layout":"swizzle","kv_splits":1,"warp_key_groups":1,"pingpong":false'
three=()
for pw in 0 4; do for bn in 64 128; do for st in 2 3; do
  three+=("{$W,\"block_m\":192,\"compute_warps\":12,\"producer_warps\":$pw,\"block_n\":$bn,\"stages\":$st,\"q_in_regs\":false}")
done; done; done
for run in ${RUNS:-gpt2-h100-hopper gpt2-causal-h100-hopper long-8k-h100-hopper long-16k-causal-h100-hopper}; do
  shape=$(python3 -c "import json; print(json.load(open('$here/runs/$run/meta.json'))['shape_spec'])")
  best=$(python3 -c "import json; print(json.dumps(json.load(open('$here/runs/$run/best.json'))['config']))")
  mkdir -p "$work/$run"
  OUT=$work/$run timeout 300 python3 "$here/tools/time_configs.py" "$shape" "$best" "${three[@]}" > "$work/$run/log.txt" 2>&1
  echo "== $run ($shape): rc=$?"; tail -12 "$work/$run/log.txt"
done
tar -czf "$FINAL/consumer_wgs.tgz" -C "$(dirname "$work")" consumer_wgs
