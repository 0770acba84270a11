set -u
sed -i "s/values: \[0, 2, 3, 4\]/values: [0, 1, 2, 3, 4, 5, 6]/" search_spaces/attention.yaml; grep -n "0, 1, 2, 3, 4, 5, 6" search_spaces/attention.yaml
W='{"block_m": 32, "block_n": 128, "compute_warps": 4, "key_merge": "split", "kv_load": "tma", "kv_splits": 1, "pdl": true, "producer_warps": 0, "q_in_regs": true, "smem_layout": "swizzle", "stages": 4, "warp_key_groups": 2'
S='{"block_m": 32, "block_n": 128, "compute_warps": 4, "key_merge": "split", "kv_load": "tma_split", "kv_splits": 1, "pdl": true, "producer_warps": 0, "q_in_regs": true, "smem_layout": "swizzle", "stages": 4, "warp_key_groups": 2'
G='{"block_m": 128, "block_n": 64, "compute_warps": 8, "epilogue": "tma", "mma": "wgmma", "persistent": false, "pingpong": false, "producer_warps": 0, "q_in_regs": true, "stages": 4'
L='{"block_m": 192, "block_n": 64, "compute_warps": 12, "epilogue": "tma", "mma": "wgmma", "persistent": false, "pingpong": false, "producer_warps": 4, "q_in_regs": true, "stages": 4'
m=(); for e in 0 1 2 3 4 5; do m+=("$W, \"exp2_fma\": $e}" "$S, \"exp2_fma\": $e}"); done
mkdir -p $OUT/m $OUT/g $OUT/l
OUT=$OUT/m timeout 250 python3 tools/time_configs.py mission "${m[@]}" > $OUT/m/table.txt 2>&1; echo "mission rc=$?"
g=(); for e in 0 2 3 4; do g+=("$G, \"exp2_fma\": $e}"); done
OUT=$OUT/g timeout 150 python3 tools/time_configs.py gpt2 "${g[@]}" > $OUT/g/table.txt 2>&1; echo "gpt2 rc=$?"
l=(); for e in 0 2 3; do l+=("$L, \"exp2_fma\": $e}"); done
OUT=$OUT/l timeout 150 python3 tools/time_configs.py long-8k "${l[@]}" > $OUT/l/table.txt 2>&1; echo "long8k rc=$?"
for f in m g l; do echo "== $f"; tail -22 $OUT/$f/table.txt | cut -c1-150; done
