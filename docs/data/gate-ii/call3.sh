#!/usr/bin/env bash
# Issue 38, call 3 (H100): what the gate costs per candidate before (ee6c2e0, .gate_old) and after (HEAD,
# .gate_new), on the same configs (tools/gate_cost.py --same-configs), mission and gpt2.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONUNBUFFERED=1 EVOTUNE_CACHE=/tmp/evotune-cache
root=$PWD; new=$root/.gate_new; old=$root/.gate_old
for shape in mission gpt2; do
  n=16; [ $shape = gpt2 ] && n=8
  PYTHONPATH=/tmp/site:$new timeout 200 python3 $new/tools/gate_cost.py --space attention --shape $shape --n $n \
      --out $OUT/gate-after-$shape.json > $OUT/gate-after-$shape.txt 2>&1
  PYTHONPATH=/tmp/site:$old timeout 200 python3 $new/tools/gate_cost.py --same-configs $OUT/gate-after-$shape.json \
      --out $OUT/gate-before-$shape.json > $OUT/gate-before-$shape.txt 2>&1
  PYTHONPATH=/tmp/site:$new timeout 200 python3 $new/tools/gate_cost.py --same-configs $OUT/gate-after-$shape.json \
      --out $OUT/gate-after2-$shape.json > $OUT/gate-after2-$shape.txt 2>&1
done
for f in $OUT/gate-*.txt; do echo "== $f"; tail -n 8 $f; done
