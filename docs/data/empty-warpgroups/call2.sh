# Call 2: the persistent skip configs with the thin tiles last (the knob) and in persistent_tile's order
# (--with-flag skip_natural_order), beside compute, on gpt2 fp16 and bf16.
set -u
OUT_REAL=$OUT
start=$(date +%s)
mkdir -p $OUT_REAL/t
G='"mma":"wgmma","pingpong":false,"rescale":"lazy","softmax_overlap":true,"lean_addressing":true'
T="{$G,\"block_m\":192,\"block_n\":128,\"compute_warps\":12,\"producer_warps\":4,\"q_in_regs\":false,\"epilogue\":\"tma\",\"persistent\":true"
for shape in gpt2 gpt2:bf16; do
  mkdir -p /tmp/o-$shape; export OUT=/tmp/o-$shape
  timeout 150 python3 tools/time_configs.py --with-flag skip_natural_order $shape \
    "$T,\"stages\":3,\"empty_warpgroups\":\"compute\"}" "$T,\"stages\":3,\"empty_warpgroups\":\"skip\"}" \
    "$T,\"stages\":4,\"empty_warpgroups\":\"skip\"}" > $OUT_REAL/t/$shape.txt 2>&1
  echo "== $shape rc=$? at $(( $(date +%s) - start )) s"; tail -8 $OUT_REAL/t/$shape.txt | cut -c1-150
  cp /tmp/o-$shape/time_configs.json $OUT_REAL/t/$shape.json 2>/dev/null
done
