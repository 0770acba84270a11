set -u
start=$(date +%s)
mkdir -p $OUT/t
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_lazy_rescale.py -k "log_sum_exp or sanitizers" -rfs > $OUT/t/tests2.txt 2>&1
echo "tests rc=$? $(tail -1 $OUT/t/tests2.txt) at $(( $(date +%s) - start )) s"
grep -E "^(FAILED|ERROR)" $OUT/t/tests2.txt | head -10
OUT=$OUT/t timeout 420 python3 .whl/s15/thresh.py gpt2 long-8k llama-4k 2>&1 | tail -30
cd $OUT && tar -czf t.tgz t && rm -rf t
