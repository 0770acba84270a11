# Call 2 (after call 1 hung in its first block_m 256 config: consumers took 120 registers where the launch allocated
# 96 per thread, so setmaxnreg.inc waited forever; now 112): a 45-s sanity launch of that config first, then call 1.
# Call 1 timed block_m 256 against the winners on gpt2, gpt2-causal, gpt2 bf16 and long-8k (gated first).
set -u
OUT_REAL=$OUT
start=$(date +%s)
mkdir -p $OUT_REAL/t
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $OUT_REAL/device.txt 2>&1
python3 -c "import torch, cupy; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), cupy.__version__)" >> $OUT_REAL/device.txt 2>&1
G='"mma":"wgmma","pingpong":false,"rescale":"lazy","softmax_overlap":true,"lean_addressing":true,"epilogue":"tma"'
W192="{$G,\"block_m\":192,\"block_n\":128,\"compute_warps\":12,\"producer_warps\":4,\"q_in_regs\":false,\"stages\":4,\"persistent\":true,\"empty_warpgroups\":\"skip\"}"
W128="{$G,\"block_m\":128,\"block_n\":64,\"compute_warps\":8,\"persistent\":false,\"producer_warps\":0,\"stages\":4,\"q_in_regs\":true}"
F="{$G,\"block_m\":256,\"block_n\":64,\"compute_warps\":16"
P4="$F,\"producer_warps\":4,\"stages\":4"
C1="$P4,\"persistent\":true,\"q_in_regs\":false,\"p_operand\":\"regs\"}"
C2="$P4,\"persistent\":true,\"q_in_regs\":false,\"p_operand\":\"smem\"}"
C3="$P4,\"persistent\":true,\"q_in_regs\":true,\"p_operand\":\"smem\"}"
C4="$P4,\"persistent\":false,\"q_in_regs\":false,\"p_operand\":\"regs\"}"
C5="$F,\"producer_warps\":0,\"stages\":4,\"q_in_regs\":true,\"p_operand\":\"regs\"}"
C6="$F,\"producer_warps\":0,\"stages\":4,\"q_in_regs\":false,\"p_operand\":\"smem\"}"
export OUT=/tmp/o-sanity; mkdir -p $OUT
timeout 45 python3 tools/time_configs.py gpt2 "$C1" "$C5" > $OUT_REAL/sanity.txt 2>&1; rc=$?
echo "== sanity rc=$rc"; cut -c1-200 $OUT_REAL/sanity.txt | tail -8; [ $rc = 0 ] || exit 1
for shape in gpt2 gpt2-causal gpt2:bf16 long-8k; do
  [ $(( $(date +%s) - start )) -lt 450 ] || break
  case $shape in gpt2-causal) W="$W128";; *) W="$W192";; esac
  mkdir -p /tmp/o-$shape; export OUT=/tmp/o-$shape
  timeout 130 python3 tools/time_configs.py $shape "$W" "$C1" "$C2" "$C3" "$C4" "$C5" "$C6" > $OUT_REAL/t/$shape.txt 2>&1
  echo "== $shape rc=$? at $(( $(date +%s) - start )) s"; tail -11 $OUT_REAL/t/$shape.txt | cut -c1-200
  cp /tmp/o-$shape/time_configs.json $OUT_REAL/t/$shape.json 2>/dev/null
done
tar czf $OUT_REAL/t.tgz -C $OUT_REAL t && rm -rf $OUT_REAL/t
