#!/usr/bin/env bash
# The decode attention family (issue 41 section 2) on the H100, in one device call of under 8 minutes (each step under a timeout; 470 s at most):
#   1. the GPU tests (tests/test_gpu_decode.py: full gate, ragged caches, GQA 32/8 and 8/1, Sq 1 and 4, bf16)
#   2. a short search on two Llama-3-8B decode shapes (1x32/8 d128 bf16 at Sk 2048 and 16384)
#   3. `evotune bench` of each run's best beside SDPA's backends (enable_gqa), and of one fixed config on the
#      4-query bottom-right-causal preset
#   4. docs/data/decode/op_check.py: the decode table from those benches, and the op (evotune.torch.decode)
#      beside SDPA on the same tensors, eager and in a CUDA graph
#   5. docs/data/decode/generate_check.py: generate() of a 2-layer Llama-like model through the adapter, beside sdpa
# Run from the repository root with .whl carried (optuna):  bash docs/data/decode/run.sh
# (SHAPES="NAME=SHAPE ..." searches those shapes instead of the two presets; TRIALS, default 24, trials each.)
# Writes $OUT/decode.tar.gz (pytest log, run folders without caches, bench JSONs, logs) and prints the table last.
set -u
OUT=${OUT:-/tmp/decode-out}
TRIALS=${TRIALS:-24}
. tools/device_env.sh || exit 1
work=${TMPDIR:-/tmp}/decode-work
rm -rf "$work"; mkdir -p "$work/runs" "$work/bench"
export EVOTUNE_RUNS=$work/runs EVOTUNE_CACHE=$work/cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$work/device.txt"
start=$(date +%s)

timeout 110 python3 -m pytest -q -m gpu tests/test_gpu_decode.py -p no:cacheprovider > "$work/pytest.log" 2>&1
echo "pytest rc=$? ($(( $(date +%s) - start )) s): $(tail -n 1 "$work/pytest.log")"

# SHAPES: what to search and bench, each a preset or NAME=SHAPE (e.g. the keys a model's generate() calls:
# llama-e2e-4k=1,32,8,2080,128:fp16 for 32 steps after a 2048-token prompt, whose cache lengths fall in the
# 4096 bucket).
for item in ${SHAPES:-llama8b-decode-2k llama8b-decode-16k}; do
  preset=${item%%=*}; shape=${item#*=}
  timeout 90 python3 -m evotune search --family attention-decode --shape "$shape" --trials "$TRIALS" \
    --run "$preset" > "$work/search-$preset.log" 2>&1
  echo "search $preset rc=$? ($(( $(date +%s) - start )) s)"
  timeout 35 python3 -m evotune bench best --run "$preset" --reps 100 --out "$work/bench/$preset.json" \
    > "$work/bench-$preset.log" 2>&1
  echo "bench $preset rc=$? ($(( $(date +%s) - start )) s)"
done
timeout 30 python3 -m evotune bench --family attention-decode --shape llama8b-chunk4 \
  --config '{"splits": 8, "warps": 4, "vec": 4, "unroll": 1, "stages": 2}' --reps 100 \
  --out "$work/bench/llama8b-chunk4.json" > "$work/bench-llama8b-chunk4.log" 2>&1
echo "bench llama8b-chunk4 rc=$? ($(( $(date +%s) - start )) s)"

timeout 45 python3 docs/data/decode/op_check.py "$work/bench" "$work" > "$work/op_check.log" 2>&1
echo "op_check rc=$? ($(( $(date +%s) - start )) s)"
timeout 35 python3 docs/data/decode/generate_check.py "$work/decode-table.json" "$work" > "$work/generate_check.log" 2>&1
echo "generate_check rc=$? ($(( $(date +%s) - start )) s)"

mkdir -p "$OUT"
cp "$work/decode-table.json" "$OUT/" 2>/dev/null
tar czf "$OUT/decode.tar.gz" --exclude=cache --exclude=study.db -C "$work" .
grep -E "passed|failed|error" "$work/pytest.log" | tail -n 5
python3 - "$work/bench" <<'PY'
import glob, json, os, sys
print(f"{'shape':<22}{'config':<44}{'ours us':>9}{'GB/s':>7}  " + "  ".join(f"{n:>10}" for n in ("flash", "cudnn", "efficient", "math")) + "   ours/best")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    rec = json.load(open(path))
    rows = {r["name"]: r for r in rec["rows"]}
    ours = rec["rows"][0]
    cfg = " ".join(f"{k}={v}" for k, v in sorted(rec["config"].items()))
    cells = []
    for n in ("flash", "cudnn", "efficient", "math"):
        r = rows.get(n) or {}
        cells.append(f"{r['time_us']:>8.2f}us" if r.get("time_us") else f"{'-':>10}")
    ratio = rec.get("ours_over_best_baseline")
    t = f"{ours['time_us']:.2f}" if ours.get("time_us") else ours.get("reason", "")[:30]
    gb = f"{ours['gb_s']:.0f}" if ours.get("gb_s") else "-"
    print(f"{rec['shape']:<22}{cfg:<44}{t:>9}{gb:>7}  " + "  ".join(cells)
          + f"   {ratio:.3f} vs {rec.get('best_baseline')}" if ratio else f"{rec['shape']:<22}{cfg:<44}{t:>9}{gb:>7}  " + "  ".join(cells))
PY
tail -n 4 "$work/op_check.log"
tail -n 1 "$work/generate_check.log"
