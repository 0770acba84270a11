set -u
start=$(date +%s)
mkdir -p $OUT/t
H='"mma":"wgmma"'
G="{$H,\"block_m\":64,\"block_n\":128,\"compute_warps\":4,\"producer_warps\":0,\"stages\":2,\"q_in_regs\":false,\"pingpong\":false,\"persistent\":false,\"epilogue\":\"tma\""
L="{$H,\"block_m\":128,\"block_n\":128,\"compute_warps\":8,\"producer_warps\":4,\"stages\":2,\"q_in_regs\":true,\"pingpong\":false,\"persistent\":true,\"epilogue\":\"tma\""
C="{$H,\"block_m\":128,\"block_n\":128,\"compute_warps\":8,\"producer_warps\":4,\"stages\":2,\"q_in_regs\":true,\"pingpong\":false,\"persistent\":true,\"epilogue\":\"regs\""
E="{$H,\"block_m\":192,\"block_n\":128,\"compute_warps\":12,\"producer_warps\":4,\"stages\":2,\"q_in_regs\":false,\"pingpong\":false,\"persistent\":true,\"epilogue\":\"regs\",\"rescale\":\"lazy\""
pair() {  # shape config-prefix tag
  [ $(( $(date +%s) - start )) -lt 330 ] || { echo "skip $3"; return; }
  OUT=$OUT/t timeout 75 python3 tools/time_configs.py --space attention-hopper3-overlap $1 "$2,\"softmax_overlap\":false}" "$2,\"softmax_overlap\":true}" > $OUT/t/$3.txt 2>&1
  mv $OUT/t/time_configs.json $OUT/t/$3.json 2>/dev/null
  echo "== $3 ($1) at $(( $(date +%s) - start )) s"; tail -5 $OUT/t/$3.txt
}
pair gpt2 "$G" gpt2
pair llama-4k "$L" llama-4k
pair long-8k "$E" long-8k
pair gpt2-causal "$G" gpt2-causal
pair llama-4k:bf16 "$L" llama-4k-bf16
pair llama-4k-causal "$C" llama-4k-causal
pair gpt2:bf16 "$G" gpt2-bf16
left=$(( 585 - ($(date +%s) - start) ))
timeout $left python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_softmax_overlap.py -rfs > $OUT/t/tests.txt 2>&1
echo "tests rc=$? $(tail -1 $OUT/t/tests.txt) at $(( $(date +%s) - start )) s"
grep -E "^(FAILED|ERROR)" $OUT/t/tests.txt | head -10
cd $OUT && tar -czf t.tgz t && rm -rf t
