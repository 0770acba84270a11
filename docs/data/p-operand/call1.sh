set -u
OUT_REAL=$OUT
start=$(date +%s)
mkdir -p $OUT_REAL/t
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_p_operand.py -m "gpu and not slow" -rs > $OUT_REAL/gpu-tests.txt 2>&1
echo "pytest rc=$? at $(( $(date +%s) - start )) s"; tail -3 $OUT_REAL/gpu-tests.txt
G='"mma":"wgmma","pingpong":false,"rescale":"lazy","softmax_overlap":true,"lean_addressing":true'
W="{$G,\"block_m\":128,\"block_n\":64,\"compute_warps\":8,\"persistent\":false,\"producer_warps\":0,\"stages\":4,\"q_in_regs\":true,\"epilogue\":\"tma\""
F="{$G,\"block_m\":192,\"block_n\":192,\"compute_warps\":12,\"producer_warps\":4,\"stages\":2,\"q_in_regs\":false,\"p_operand\":\"smem\""
T="{$G,\"block_m\":192,\"block_n\":128,\"compute_warps\":12,\"producer_warps\":4,\"stages\":2,\"q_in_regs\":false"
for shape in gpt2 gpt2-causal; do
  [ $(( $(date +%s) - start )) -lt 480 ] || break
  mkdir -p /tmp/o-$shape; export OUT=/tmp/o-$shape
  timeout 150 python3 tools/time_configs.py $shape "$W}" "$W,\"p_operand\":\"smem\"}" "$F,\"persistent\":false,\"epilogue\":\"tma\"}" \
    "$F,\"persistent\":false,\"epilogue\":\"regs\"}" "$F,\"persistent\":true,\"epilogue\":\"regs\"}" \
    "$T,\"persistent\":false,\"epilogue\":\"tma\",\"p_operand\":\"smem\"}" "$T,\"persistent\":false,\"epilogue\":\"tma\"}" > $OUT_REAL/t/$shape.txt 2>&1
  echo "== $shape rc=$? at $(( $(date +%s) - start )) s"; tail -14 $OUT_REAL/t/$shape.txt | cut -c1-200
  cp /tmp/o-$shape/time_configs.json $OUT_REAL/t/$shape.json 2>/dev/null
done
