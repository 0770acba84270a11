# Call 2: deeper K/V rings (stages 5 to 8, the `//[deep_ring]` lines) for the 256-row persistent tile, fixed and
# mirrored, on gpt2-causal fp16 and bf16 (interleaved pools, 12 rounds; every config through the gate first), with a
# 45-s sanity launch of the deepest first.
set -u
OUT_REAL=$OUT
start=$(date +%s)
mkdir -p $OUT_REAL/pairs
G='"mma":"wgmma","pingpong":false,"rescale":"lazy","softmax_overlap":true,"lean_addressing":true,"persistent":true,"producer_warps":4,"causal_extent":"warpgroup","epilogue":"tma"'
B="$G,\"block_m\":256,\"block_n\":64,\"compute_warps\":16,\"q_in_regs\":false"
C="$G,\"block_m\":192,\"block_n\":64,\"compute_warps\":12,\"q_in_regs\":false,\"empty_warpgroups\":\"skip\""
c() { echo "{$1,\"stages\":$2,\"stripe_order\":\"$3\"}"; }
S="--space attention-hopper3-mirror"
export OUT=/tmp/o-sanity; mkdir -p $OUT
timeout 45 python3 tools/time_configs.py $S gpt2-causal "$(c "$B" 8 mirrored)" > $OUT_REAL/sanity.txt 2>&1; rc=$?
echo "== sanity rc=$rc"; cut -c1-200 $OUT_REAL/sanity.txt | tail -4; [ $rc = 0 ] || exit 1
for shape in gpt2-causal gpt2-causal:bf16; do
  mkdir -p /tmp/o-$shape; export OUT=/tmp/o-$shape
  timeout 200 python3 tools/time_configs.py $S $shape "$(c "$B" 4 fixed)" "$(c "$B" 4 mirrored)" "$(c "$B" 6 fixed)" \
    "$(c "$B" 6 mirrored)" "$(c "$B" 8 fixed)" "$(c "$B" 8 mirrored)" "$(c "$B" 5 mirrored)" "$(c "$B" 7 mirrored)" \
    "$(c "$C" 6 mirrored)" "$(c "$C" 8 mirrored)" > $OUT_REAL/pairs/$shape.txt 2>&1
  echo "== $shape rc=$? at $(( $(date +%s) - start )) s"; tail -14 $OUT_REAL/pairs/$shape.txt | cut -c1-100
  cp /tmp/o-$shape/time_configs.json $OUT_REAL/pairs/$shape.json 2>/dev/null
done
tar czf $OUT_REAL/pairs.tgz -C $OUT_REAL pairs && rm -rf $OUT_REAL/pairs
