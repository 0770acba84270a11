set -u
mkdir -p /tmp/h; export OUT_REAL=$OUT; export OUT=/tmp/h
start=$(date +%s)
G='"mma":"wgmma","epilogue":"tma","pingpong":false,"q_in_regs":true,"rescale":"lazy","softmax_overlap":true'
C2="{$G,\"block_m\":128,\"block_n\":64,\"compute_warps\":8,\"persistent\":false,\"producer_warps\":0,\"stages\":4"
CC="{$G,\"block_m\":64,\"block_n\":64,\"compute_warps\":4,\"persistent\":false,\"producer_warps\":0,\"stages\":4"
CL="{$G,\"block_m\":128,\"block_n\":128,\"compute_warps\":8,\"persistent\":true,\"producer_warps\":4,\"stages\":2"
CLC="{$G,\"block_m\":128,\"block_n\":128,\"compute_warps\":8,\"persistent\":false,\"producer_warps\":4,\"stages\":3"
CLC="${CLC/\"pingpong\":false/\"pingpong\":true}"
H=.whl/s17
timeout 150 python3 $H/hooktime.py gpt2 "base|$C2}" "desc|$C2}|$H/desc.py" "desc+uns|$C2}|$H/uns.py" "ex2fma1|$C2,\"exp2_fma\":1}" "ex2fma1+uns|$C2,\"exp2_fma\":1}|$H/uns.py" 2>&1 | tail -14
echo "-- $(( $(date +%s) - start )) s"
timeout 120 python3 $H/hooktime.py gpt2-causal "base|$CC}" "desc|$CC}|$H/desc.py" "desc+uns|$CC}|$H/uns.py" 2>&1 | tail -10
echo "-- $(( $(date +%s) - start )) s"
timeout 120 python3 $H/hooktime.py 16,12,1024,64:bf16 "base|$C2}" "desc+uns|$C2}|$H/uns.py" 2>&1 | tail -8
echo "-- $(( $(date +%s) - start )) s"
timeout 120 python3 $H/hooktime.py llama-4k "base|$CL}" "desc+uns|$CL}|$H/uns.py" 2>&1 | tail -8
echo "-- $(( $(date +%s) - start )) s"
timeout 120 python3 $H/hooktime.py llama-4k-causal "base|$CLC}" "desc+uns|$CLC}|$H/uns.py" 2>&1 | tail -8
echo "-- $(( $(date +%s) - start )) s"
tar -czf $OUT_REAL/hook.tgz -C /tmp h
