#!/usr/bin/env bash
# REPS x `evotune bench best --run RUN --reps 100` of each run in RUNS, on the GPU machine, from the repository root;
# the records (bench/RUN-N.json and .txt) tarred into $OUT/bench.tgz after each run (the device returns few files, and
# a timed-out call keeps what it had), then one line per run: ours/CUDNN us per bench and CUDNN/ours min-max.
# docs/PERFORMANCE.md's "How to rerun" and tools/mission_knob_device.sh's bench step call it.
#   RUNS="llama-4k-h100-warm-lean gpt2-h100-exhaustive-wg4" REPS=3 OUT=dir bash tools/bench_runs.sh
set -uo pipefail
OUT=${OUT:?set OUT}; here=$(cd "$(dirname "$0")/.." && pwd)
bench=$(mktemp -d)/bench; mkdir -p "$bench"
for run in ${RUNS:?set RUNS}; do
  for i in $(seq 1 "${REPS:-3}"); do
    (cd "$here" && timeout 120 python3 -m evotune bench best --run "$run" --reps 100 --out "$bench/$run-$i.json") \
      > "$bench/$run-$i.txt" 2>&1 || echo "bench $run #$i failed: $(tail -1 "$bench/$run-$i.txt")"
  done
  tar -czf "$OUT/bench.tgz" -C "$(dirname "$bench")" bench
done
python3 - "$bench" <<'PY'
import glob, json, os, sys
rows = {}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    rec = json.load(open(path))  # evotune bench --out: one row per kernel, ours first
    times = {r["name"]: r.get("time_us") for r in rec["rows"] if r.get("available")}
    rows.setdefault(os.path.basename(path).rsplit("-", 1)[0], []).append((times.get("evotune"), times.get("cudnn")))
for run, pairs in rows.items():
    ratios = [c / o for o, c in pairs if o and c]
    print(f"{run:40s} " + "  ".join(f"{o or 0:8.2f}/{c or 0:8.2f}" for o, c in pairs)
          + (f"   CUDNN/ours {min(ratios):.3f}-{max(ratios):.3f}x" if ratios else ""))
PY
