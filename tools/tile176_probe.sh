#!/usr/bin/env bash
# Issue 13, item 2: 176-key K/V tiles (FlashAttention-3's d128 non-causal tile) against the committed winners of the
# d128 presets, hand-picked (an explanation, not a claim: the claims come from searches), each verified by the gate
# and timed beside SDPA's FLASH and CUDNN backends in one process per shape (tools/time_configs.py).
#   OUT=dir bash tools/tile176_probe.sh     -> $OUT/tile176.tgz (one time_configs.json and log per shape)
set -uo pipefail
FINAL=${OUT:?set OUT}; work=$(mktemp -d)/tile176; mkdir -p "$work"
here=$(cd "$(dirname "$0")/.." && pwd)
W='"mma":"wgmma","smem_layout":"swizzle","kv_splits":1,"warp_key_groups":1,"block_m":128,"compute_warps":8,"producer_warps":4,"block_n":176,"stages":2,"q_in_regs":false'
cands=("{$W,\"pingpong\":false}" "{$W,\"pingpong\":true}")
for run in ${RUNS:-llama-4k-h100-hopper llama-4k-bf16-h100-hopper llama-4k-causal-h100-hopper}; do
  shape=$(python3 -c "import json; print(json.load(open('$here/runs/$run/meta.json'))['shape_spec'])")
  best=$(python3 -c "import json; print(json.dumps(json.load(open('$here/runs/$run/best.json'))['config']))")
  mkdir -p "$work/$run"
  OUT=$work/$run timeout 300 python3 "$here/tools/time_configs.py" "$shape" "$best" "${cands[@]}" > "$work/$run/log.txt" 2>&1
  echo "== $run ($shape): rc=$?"; tail -5 "$work/$run/log.txt"
done
tar -czf "$FINAL/tile176.tgz" -C "$(dirname "$work")" tile176
