#!/usr/bin/env bash
# Hopper (wgmma) variant on the GPU: deep-verify a spread of configs on small ragged shapes
# (each under a timeout, so a hang is a finding, not a stuck job), then time them beside
# SDPA on the large shapes. Results under $OUT/hopper-probe/, a table last.
#   CONFIGS='<json>;<json>' SHAPES='...' LARGE='...' bash tools/hopper_probe.sh
set -u
OUT=${OUT:-/tmp}/hopper-probe
mkdir -p "$OUT"
W='"mma":"wgmma","smem_layout":"swizzle","kv_splits":1,"warp_key_groups":1'
CONFIGS=${CONFIGS:-"{$W,\"compute_warps\":4,\"block_m\":64,\"producer_warps\":0,\"stages\":2,\"block_n\":64,\"q_in_regs\":false};\
{$W,\"compute_warps\":4,\"block_m\":64,\"producer_warps\":4,\"stages\":1,\"block_n\":64,\"q_in_regs\":true};\
{$W,\"compute_warps\":4,\"block_m\":64,\"producer_warps\":4,\"stages\":2,\"block_n\":128,\"q_in_regs\":false};\
{$W,\"compute_warps\":8,\"block_m\":128,\"producer_warps\":4,\"stages\":2,\"block_n\":128,\"q_in_regs\":false};\
{$W,\"compute_warps\":8,\"block_m\":128,\"producer_warps\":4,\"stages\":2,\"block_n\":128,\"q_in_regs\":false,\"pingpong\":true};\
{$W,\"compute_warps\":8,\"block_m\":128,\"producer_warps\":0,\"stages\":2,\"block_n\":64,\"q_in_regs\":true,\"pingpong\":true}"}
SHAPES=${SHAPES:-"1,2,197,300,64 1,2,197,197,128:causal 2,3,256,256,64:bf16:causal:bshd 1,2,300,197,128:bf16"}
LARGE=${LARGE:-"4,32,4096,128 4,32,4096,128:causal 16,12,1024,64 2,16,8192,64"}
IFS=';' read -ra CFGS <<< "$CONFIGS"
summary="$OUT/summary.txt"; : > "$summary"
ok_cfgs=()
for i in "${!CFGS[@]}"; do
  cfg=${CFGS[$i]}; all_ok=1
  for shape in $SHAPES; do
    tag="cfg$i-$(echo "$shape" | tr ',:' '_-')"
    timeout 90 python3 -m evotune verify --config "$cfg" --shape "$shape" --launches 20 > "$OUT/verify-$tag.txt" 2>&1
    rc=$?
    [ $rc -eq 0 ] || all_ok=0
    echo "verify cfg$i $shape rc=$rc $(grep -m1 -iE 'pass|fail|wrong|error|timed' "$OUT/verify-$tag.txt" | cut -c1-120)" >> "$summary"
  done
  [ $all_ok -eq 1 ] && ok_cfgs+=("$cfg")
done
for shape in $LARGE; do
  [ ${#ok_cfgs[@]} -gt 0 ] || break
  echo "== $shape" >> "$summary"
  OUT="$OUT" timeout 240 python3 tools/time_configs.py "$shape" "${ok_cfgs[@]}" > "$OUT/time-$(echo "$shape" | tr ',:' '_-').txt" 2>&1
  cat "$OUT/time-$(echo "$shape" | tr ',:' '_-').txt" >> "$summary"
  mv "$OUT/time_configs.json" "$OUT/time-$(echo "$shape" | tr ',:' '_-').json" 2>/dev/null
done
for i in "${!CFGS[@]}"; do echo "cfg$i ${CFGS[$i]}" >> "$summary"; done
cat "$summary"
