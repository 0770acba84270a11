set -u
git log --oneline -1 > $OUT/tree.txt 2>&1; git status --short >> $OUT/tree.txt 2>&1
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_p_operand.py -m gpu -rs > $OUT/gpu-tests.txt 2>&1
echo "pytest rc=$?"; tail -4 $OUT/gpu-tests.txt
