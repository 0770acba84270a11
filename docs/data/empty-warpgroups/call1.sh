# Call 1: the knob's GPU tests, then interleaved pairs (compute vs skip) on the gpt2 presets beside the gpt2 winner.
set -u
OUT_REAL=$OUT
start=$(date +%s)
mkdir -p $OUT_REAL/t
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $OUT_REAL/device.txt 2>&1
python3 -c "import torch, cupy; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), cupy.__version__)" >> $OUT_REAL/device.txt 2>&1
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/test_empty_warpgroups.py -m "gpu and not slow" -rs > $OUT_REAL/gpu-tests.txt 2>&1
echo "pytest rc=$? at $(( $(date +%s) - start )) s"; tail -4 $OUT_REAL/gpu-tests.txt | cut -c1-200
G='"mma":"wgmma","pingpong":false,"rescale":"lazy","softmax_overlap":true,"lean_addressing":true'
W="{$G,\"block_m\":128,\"block_n\":64,\"compute_warps\":8,\"persistent\":false,\"producer_warps\":0,\"stages\":4,\"q_in_regs\":true,\"epilogue\":\"tma\"}"
T="{$G,\"block_m\":192,\"block_n\":128,\"compute_warps\":12,\"producer_warps\":4,\"q_in_regs\":false,\"epilogue\":\"tma\""
for shape in gpt2 gpt2-causal gpt2:bf16; do
  [ $(( $(date +%s) - start )) -lt 470 ] || break
  mkdir -p /tmp/o-$shape; export OUT=/tmp/o-$shape
  timeout 120 python3 tools/time_configs.py $shape "$W" \
    "$T,\"stages\":4,\"persistent\":true,\"empty_warpgroups\":\"compute\"}" "$T,\"stages\":4,\"persistent\":true,\"empty_warpgroups\":\"skip\"}" \
    "$T,\"stages\":3,\"persistent\":true,\"empty_warpgroups\":\"compute\"}" "$T,\"stages\":3,\"persistent\":true,\"empty_warpgroups\":\"skip\"}" \
    "$T,\"stages\":2,\"persistent\":false,\"empty_warpgroups\":\"compute\"}" "$T,\"stages\":2,\"persistent\":false,\"empty_warpgroups\":\"skip\"}" \
    > $OUT_REAL/t/$shape.txt 2>&1
  echo "== $shape rc=$? at $(( $(date +%s) - start )) s"; tail -12 $OUT_REAL/t/$shape.txt | cut -c1-220
  cp /tmp/o-$shape/time_configs.json $OUT_REAL/t/$shape.json 2>/dev/null
done
