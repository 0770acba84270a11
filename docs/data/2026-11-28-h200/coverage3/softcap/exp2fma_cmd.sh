. tools/device_env.sh
mkdir -p $OUT
for e in 1 2; do
  cfg=$( [ $e = 1 ] && echo '{"block_m": 128, "block_n": 128, "causal_extent": "tile", "compute_warps": 8, "empty_warpgroups": "compute", "epilogue": "tma", "exp2_fma": 1, "key_merge": "gather", "kv_cluster": 1, "kv_load": "cp_async", "kv_splits": 1, "lean_addressing": true, "mma": "wgmma", "p_operand": "regs", "pdl": false, "persistent": true, "pingpong": false, "producer_warps": 4, "q_in_regs": false, "rescale": "always", "smem_layout": "swizzle", "softmax_overlap": false, "stages": 2, "stripe_order": "fixed", "warp_key_groups": 1}' || echo '{"block_m": 128, "block_n": 128, "causal_extent": "tile", "compute_warps": 8, "empty_warpgroups": "compute", "epilogue": "tma", "exp2_fma": 2, "key_merge": "gather", "kv_cluster": 1, "kv_load": "cp_async", "kv_splits": 1, "lean_addressing": true, "mma": "wgmma", "p_operand": "regs", "pdl": false, "persistent": true, "pingpong": false, "producer_warps": 4, "q_in_regs": false, "rescale": "always", "smem_layout": "swizzle", "softmax_overlap": false, "stages": 2, "stripe_order": "fixed", "warp_key_groups": 1}' )
  timeout 120 python3 tools/feature_bench.py --case 2,16,4096,128:bf16:kv8:causal:softcap=50 --config "$cfg" --rounds 8 --out $OUT/exp2fma-$e.json > $OUT/exp2fma-$e.log 2>&1
  grep -v '^{' $OUT/exp2fma-$e.log | tail -1
done
