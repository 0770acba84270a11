#!/usr/bin/env bash
# The decode kernel's variants (issue 41: kernels/decode/variants.cuh; docs/experiments/perf-34-decode-variants.md)
# on one H100 or H200, in one device call of under 9 minutes (each step under a timeout; 490 s at most):
#   1. their GPU tests (tests/test_gpu_decode_variants.py: the gate on long and short caches, GQA 4 and 8, Sq 1 and 4,
#      d64 and d128, fp16 and bf16, dense and strided caches; bulk bitwise equal to cp_async; repeated launches)
#   2. per shape (SHAPES, NAME=SHAPE; default the Llama-3-8B decode keys of 1x32/8 d128 fp16 at 16k and 2k):
#      a. NAME-base: a short search of the cp-async profile, the kernel as it was before the variants (BASE_TRIALS)
#      b. NAME-first: the variants profile measured whole, their first guesses (bulk + acq_rel + even, 45 configs)
#      c. NAME: a search of the whole space (TRIALS), warm-started from a and b: it asks their fastest first, and a's
#         fastest again at each variant knob's other values (search/warmstart.py with_new_knobs)
#      d. `evotune bench` of c's best beside SDPA's backends (flash, cuDNN, efficient, math) in one process
#   3. docs/data/decode/op_check.py: the decode table from those benches, and the op (evotune.torch.decode, the
#      launches a model's call makes) beside SDPA on the same tensors, eager and in a CUDA graph
# Run from the repository root with .whl carried (optuna):  bash docs/data/decode/run_variants.sh
# Writes $OUT/decode-variants.tar.gz (pytest log, run folders without caches, bench JSONs, logs) and prints the
# table last: per shape the bench row, then c's fastest trial of the kernel before the variants and with each.
set -u
OUT=${OUT:-/tmp/decode-variants-out}
TRIALS=${TRIALS:-150}
BASE_TRIALS=${BASE_TRIALS:-40}
. tools/device_env.sh || exit 1
work=${TMPDIR:-/tmp}/decode-variants-work
rm -rf "$work"; mkdir -p "$work/runs" "$work/bench"
export EVOTUNE_RUNS=$work/runs EVOTUNE_CACHE=$work/cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$work/device.txt"
start=$(date +%s)
say() { echo "$1 rc=$2 ($(( $(date +%s) - start )) s)"; }

timeout 80 python3 -m pytest -q -m gpu tests/test_gpu_decode_variants.py -p no:cacheprovider > "$work/pytest.log" 2>&1
say "pytest" $?; tail -n 1 "$work/pytest.log"

search() {  # NAME SHAPE TIMEOUT ARGS...: one search into run NAME, its log in $work/search-NAME.log
  local name=$1 shape=$2 limit=$3; shift 3
  timeout "$limit" python3 -m evotune search --family attention-decode --shape "$shape" --run "$name" "$@" \
    > "$work/search-$name.log" 2>&1
  say "search $name" $?
}

for item in ${SHAPES:-llama-e2e-32k=1,32,8,16416,128:fp16 llama-e2e-4k=1,32,8,2080,128:fp16}; do
  name=${item%%=*}; shape=${item#*=}
  search "$name-base" "$shape" 35 --space attention-decode:cp-async --trials "$BASE_TRIALS" --warm-start none
  search "$name-first" "$shape" 30 --space attention-decode:variants --sampler exhaustive --trials 48 \
    --warm-start none
  warm=$name-base
  grep -q '"status": "ok"' "$work/runs/$name-first/trials.jsonl" 2>/dev/null && warm=$warm,$name-first
  search "$name" "$shape" 90 --trials "$TRIALS" --warm-start "$warm" --population 64 --no-priors
  timeout 30 python3 -m evotune bench best --run "$name" --reps 100 --out "$work/bench/$name.json" \
    > "$work/bench-$name.log" 2>&1
  say "bench $name" $?
done

timeout 40 python3 docs/data/decode/op_check.py "$work/bench" "$work" > "$work/op_check.log" 2>&1
say "op_check" $?

mkdir -p "$OUT"
cp "$work/decode-table.json" "$OUT/" 2>/dev/null
tar czf "$OUT/decode-variants.tar.gz" --exclude=cache --exclude=study.db -C "$work" .
grep -E "passed|failed|error" "$work/pytest.log" | tail -n 3
python3 - "$work" <<'PY'
import glob, json, os, sys

work = sys.argv[1]
names = ("flash", "cudnn", "efficient", "math")
print(f"{'shape':<24}{'config':<86}{'ours us':>9}{'GB/s':>7}  " + "  ".join(f"{n:>10}" for n in names) + "   ours/best")
for path in sorted(glob.glob(os.path.join(work, "bench", "*.json"))):
    rec = json.load(open(path))
    rows = {r["name"]: r for r in rec["rows"]}
    ours = rec["rows"][0]
    cfg = " ".join(f"{k}={v}" for k, v in sorted(rec["config"].items()))
    cells = [f"{rows[n]['time_us']:>8.2f}us" if (rows.get(n) or {}).get("time_us") else f"{'-':>10}" for n in names]
    t = f"{ours['time_us']:.2f}" if ours.get("time_us") else ours.get("reason", "")[:30]
    gb = f"{ours['gb_s']:.0f}" if ours.get("gb_s") else "-"
    ratio = rec.get("ours_over_best_baseline")
    tail = f"   {ratio:.3f} vs {rec.get('best_baseline')}" if ratio else ""
    print(f"{rec['shape']:<24}{cfg:<86}{t:>9}{gb:>7}  " + "  ".join(cells) + tail)
# The whole-space search's own timings (one process, one GPU): its fastest trial of the kernel before the variants
# (every variant knob at its default) and its fastest with each variant value, so each piece's gain reads off here.
print("\nfastest trial of each whole-space search, by variant (us; trials measured)")
groups = (("before", lambda c: all(c.get(k, d) == d for k, d in
                                   (("kv_load", "cp_async"), ("combine", "fenced"), ("split_chunks", "ceil")))),
          ("bulk", lambda c: c.get("kv_load") == "bulk"), ("acq_rel", lambda c: c.get("combine") == "acq_rel"),
          ("even", lambda c: c.get("split_chunks") == "even"),
          ("all three", lambda c: (c.get("kv_load"), c.get("combine"), c.get("split_chunks")) == ("bulk", "acq_rel", "even")))
for path in sorted(glob.glob(os.path.join(work, "bench", "*.json"))):
    run = os.path.splitext(os.path.basename(path))[0]
    trials = [json.loads(line) for line in open(os.path.join(work, "runs", run, "trials.jsonl"))]
    ok = [(t["result"]["time_us"], t["config"]) for t in trials if t["result"].get("status") == "ok"]
    cells = []
    for label, pick in groups:
        mine = [t for t, c in ok if pick(c)]
        cells.append(f"{label} {min(mine):.2f} ({len(mine)})" if mine else f"{label} -")
    print(f"{run:<24}" + "   ".join(cells))
PY
tail -n 4 "$work/op_check.log"
