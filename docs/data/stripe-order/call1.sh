# Call 1: a 45-s sanity launch of two stripe_order = mirrored configs (a hang stops the call there), the GPU tests of
# tests/test_stripe_order.py (then the slow ones: memcheck, racecheck), and interleaved pools of fixed / mirrored
# pairs on gpt2-causal fp16 and bf16 (configs 1-2, 3-4, ... each pair the same knobs but stripe_order).
set -u
OUT_REAL=$OUT
start=$(date +%s)
mkdir -p $OUT_REAL/pairs
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $OUT_REAL/device.txt 2>&1
python3 -c "import torch, cupy; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), cupy.__version__)" >> $OUT_REAL/device.txt 2>&1
G='"mma":"wgmma","pingpong":false,"rescale":"lazy","softmax_overlap":true,"lean_addressing":true,"persistent":true,"producer_warps":4,"causal_extent":"warpgroup"'
B="$G,\"block_m\":256,\"block_n\":64,\"compute_warps\":16,\"stages\":4,\"q_in_regs\":false,\"epilogue\":\"tma\""
C="$G,\"block_m\":192,\"block_n\":64,\"compute_warps\":12,\"stages\":4,\"q_in_regs\":false,\"epilogue\":\"tma\",\"empty_warpgroups\":\"skip\""
D="$G,\"block_m\":256,\"block_n\":32,\"compute_warps\":16,\"stages\":4,\"q_in_regs\":false,\"epilogue\":\"tma\""
E="$G,\"block_m\":192,\"block_n\":64,\"compute_warps\":12,\"stages\":4,\"q_in_regs\":true,\"epilogue\":\"tma\",\"empty_warpgroups\":\"skip\""
F="$G,\"block_m\":256,\"block_n\":64,\"compute_warps\":16,\"stages\":2,\"q_in_regs\":false,\"epilogue\":\"tma\""
f() { echo "{$1,\"stripe_order\":\"fixed\"}"; }
m() { echo "{$1,\"stripe_order\":\"mirrored\"}"; }
export OUT=/tmp/o-sanity; mkdir -p $OUT
timeout 45 python3 tools/time_configs.py gpt2-causal "$(m "$B")" "$(m "$C")" > $OUT_REAL/sanity.txt 2>&1; rc=$?
echo "== sanity rc=$rc"; cut -c1-200 $OUT_REAL/sanity.txt | tail -6; [ $rc = 0 ] || exit 1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_stripe_order.py -m "gpu and not slow" -rs > $OUT_REAL/gpu-tests.txt 2>&1
echo "pytest rc=$? at $(( $(date +%s) - start )) s"; tail -1 $OUT_REAL/gpu-tests.txt
grep -E "^(FAILED|ERROR)" $OUT_REAL/gpu-tests.txt | head -5
for shape in gpt2-causal gpt2-causal:bf16; do
  [ $(( $(date +%s) - start )) -lt 400 ] || break
  mkdir -p /tmp/o-$shape; export OUT=/tmp/o-$shape
  timeout 140 python3 tools/time_configs.py $shape "$(f "$B")" "$(m "$B")" "$(f "$C")" "$(m "$C")" "$(f "$D")" "$(m "$D")" \
    "$(f "$E")" "$(m "$E")" "$(f "$F")" "$(m "$F")" > $OUT_REAL/pairs/$shape.txt 2>&1
  echo "== $shape rc=$? at $(( $(date +%s) - start )) s"; tail -14 $OUT_REAL/pairs/$shape.txt | cut -c1-160
  cp /tmp/o-$shape/time_configs.json $OUT_REAL/pairs/$shape.json 2>/dev/null
done
if [ $(( $(date +%s) - start )) -lt 470 ]; then
  timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_stripe_order.py -m "gpu and slow" -rs > $OUT_REAL/gpu-tests-slow.txt 2>&1
  echo "slow pytest rc=$? at $(( $(date +%s) - start )) s"; tail -1 $OUT_REAL/gpu-tests-slow.txt
fi
tar czf $OUT_REAL/pairs.tgz -C $OUT_REAL pairs && rm -rf $OUT_REAL/pairs
