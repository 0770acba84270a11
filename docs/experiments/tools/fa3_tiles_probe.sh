#!/usr/bin/env bash
# Issue 13, items 2 and 3: FlashAttention-3's tile shapes and persistent grid against the committed winners of the
# presets, hand-picked (an explanation, not a claim: the claims come from searches), each verified by the gate and
# timed beside SDPA's FLASH and CUDNN backends in one process per shape (tools/time_configs.py).
#   TILE=wg3  OUT=dir bash tools/fa3_tiles_probe.sh   three consumer warpgroups (192 rows), 8 configs, on the d64 presets
#   TILE=n176 OUT=dir bash tools/fa3_tiles_probe.sh   176-key K/V tiles, 2 configs, on the llama-4k presets
#   TILE=persistent OUT=dir bash tools/fa3_tiles_probe.sh   each winner as committed, with ping-pong off and a
#                                                  producer (one tile per CTA), and that persistent: the before/after pair
# -> $OUT/fa3_tiles-$TILE.tgz (one time_configs.json and log per shape); RUNS="..." picks other committed runs.
set -uo pipefail
FINAL=${OUT:?set OUT}; TILE=${TILE:?set TILE to wg3 or n176}; work=$(mktemp -d)/fa3_tiles-$TILE; mkdir -p "$work"
here=$(cd "$(dirname "$0")/.." && pwd)
W='"mma":"wgmma","smem_layout":"swizzle","kv_splits":1,"warp_key_groups":1'
cands=()
case $TILE in
  wg3)
    default_runs="gpt2-h100-hopper gpt2-causal-h100-hopper long-8k-h100-hopper long-16k-causal-h100-hopper"
    for pw in 0 4; do for bn in 64 128; do for st in 2 3; do
      cands+=("{$W,\"pingpong\":false,\"block_m\":192,\"compute_warps\":12,\"producer_warps\":$pw,\"block_n\":$bn,\"stages\":$st,\"q_in_regs\":false}")
    done; done; done ;;
  n176)
    default_runs="llama-4k-h100-hopper llama-4k-bf16-h100-hopper llama-4k-causal-h100-hopper"
    for pp in false true; do
      cands+=("{$W,\"block_m\":128,\"compute_warps\":8,\"producer_warps\":4,\"block_n\":176,\"stages\":2,\"q_in_regs\":false,\"pingpong\":$pp}")
    done ;;
  persistent)
    default_runs="gpt2-h100-hopper3 gpt2-causal-h100-hopper llama-4k-h100-hopper3 llama-4k-bf16-h100-hopper
      llama-4k-causal-h100-hopper long-8k-h100-hopper3 long-8k-bf16-h100-hopper3 long-16k-causal-h100-hopper" ;;
  *) echo "TILE: wg3, n176 or persistent, not $TILE" >&2; exit 2 ;;
esac
for run in ${RUNS:-$default_runs}; do
  shape=$(python3 -c "import json; print(json.load(open('$here/runs/$run/meta.json'))['shape_spec'])")
  best=$(python3 -c "import json; print(json.dumps(json.load(open('$here/runs/$run/best.json'))['config']))")
  mkdir -p "$work/$run"
  if [ "$TILE" = persistent ]; then  # the winner's own pair: one tile per CTA, then persistent
    mapfile -t cands < <(python3 -c "import json; c = json.loads('$best'); c.update(pingpong=False, producer_warps=4)
for p in (False, True): print(json.dumps(dict(c, persistent=p)))")
  fi
  OUT=$work/$run timeout 300 python3 "$here/tools/time_configs.py" "$shape" "$best" "${cands[@]}" > "$work/$run/log.txt" 2>&1
  echo "== $run ($shape): rc=$?"; tail -12 "$work/$run/log.txt"
done
tar -czf "$FINAL/fa3_tiles-$TILE.tgz" -C "$(dirname "$work")" "fa3_tiles-$TILE"
