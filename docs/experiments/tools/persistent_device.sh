#!/usr/bin/env bash
# Issue 13 item 3 on the GPU machine, in the order that guards each later step: the persistent grid's GPU checks
# first (a kernel that fails them is never timed), then its before/after pairs beside SDPA, then the searches that
# decide where it pays, then repeated `evotune bench` records of the winners (one bench reads the ratio to within
# ~5%, a 2% knob needs several).
#   STEPS="check probe search bench" OUT=dir bash tools/persistent_device.sh
# Measured on the H100 (2026-11-23): check 75-100 s, probe 92-113 s (8 presets), search 36-45 s per shape at 48
# trials, bench ~14 s per record. Each step may still get its own device call (STEPS=check, then STEPS=probe, ...),
# with the same EVOTUNE_RUNS/EVOTUNE_CACHE kept between them or the runs carried; the device returns at most a few
# files from $OUT, so tar the bench records (the bench step writes one JSON and one log per record).
#   check   pytest -m gpu -k persistent (gate on 23 shapes x 4 configs at 3 CTAs, 3 shapes at every SM,
#           determinism, compute-sanitizer memcheck/racecheck/synccheck)          -> $OUT/check.txt
#   probe   TILE=persistent tools/fa3_tiles_probe.sh (winner, one-tile twin, persistent twin per large preset)
#                                                                                 -> $OUT/fa3_tiles-persistent.tgz
#   search  tools/large_searches.sh over attention-hopper3 (SHAPES, TRIALS, PER_SEARCH_S; runs *-h100-persistent)
#                                                                                 -> $OUT/large.tgz
#   final   each run named in FINAL_RUNS (committed runs, copied from runs/ with their study) resumed at its own
#           trial count: no new trial, only the closing job, which re-times its finalists interleaved beside the
#           baselines and names the best (records/best.py)                      -> $OUT/final.tgz (RUN/*.json, logs)
#   bench   tools/bench_runs.sh: REPS x `evotune bench best` of each run in BENCH_RUNS (default: the searches' runs)
#                                                                                 -> $OUT/bench.tgz (bench/RUN-N.json)
# Each step is bounded by a timeout; a failed step is reported and the next one still runs (check's failures are
# in check.txt: read them before trusting the probe).
set -uo pipefail
OUT=${OUT:?set OUT}; here=$(cd "$(dirname "$0")/.." && pwd)
export EVOTUNE_RUNS=${EVOTUNE_RUNS:-/tmp/runs} EVOTUNE_CACHE=${EVOTUNE_CACHE:-/tmp/cache}
SHAPES=${SHAPES:-"gpt2 llama-4k llama-4k-causal long-8k long-16k-causal"}
for step in ${STEPS:-check probe search bench}; do
  start=$(date +%s)
  case $step in
    check)
      timeout "${CHECK_S:-540}" python3 -m pytest -q -m gpu -k persistent "$here/tests/test_gpu.py" -p no:cacheprovider \
        > "$OUT/check.txt" 2>&1
      echo "check rc=$? $(tail -1 "$OUT/check.txt")" ;;
    probe)
      OUT=$OUT TILE=persistent timeout "${PROBE_S:-480}" bash "$here/tools/fa3_tiles_probe.sh"
      echo "probe rc=$?" ;;
    search)
      SHAPES=$SHAPES TRIALS=${TRIALS:-48} PER_SEARCH_S=${PER_SEARCH_S:-100} RUN_SUFFIX=-persistent \
        EXTRA="--space search_spaces/attention-hopper3.yaml" bash "$here/tools/large_searches.sh"
      echo "search rc=$?" ;;
    final)
      final=$(mktemp -d)/final; mkdir -p "$final" "$EVOTUNE_RUNS"
      for run in ${FINAL_RUNS:?set FINAL_RUNS}; do
        [ -d "$EVOTUNE_RUNS/$run" ] || cp -r "$here/runs/$run" "$EVOTUNE_RUNS/"
        read -r shape space trials < <(python3 -c 'import json, sys; m = json.load(open(sys.argv[1]))
print(m["shape_spec"], m["space"], m["options"]["trials"])' "$EVOTUNE_RUNS/$run/meta.json")
        (cd "$here" && timeout "${PER_FINAL_S:-240}" python3 -m evotune search --shape "$shape" --space "$space" \
          --run "$run" --resume --trials "$trials") > "$final/$run.txt" 2>&1 || echo "final $run failed: $(tail -1 "$final/$run.txt")"
        mkdir -p "$final/$run"
        cp "$EVOTUNE_RUNS/$run"/{baselines.json,best.json,timeline.jsonl} "$final/$run/" 2>/dev/null
        echo "$run: $(grep -h '^finalists:' "$final/$run.txt")"
        tar -czf "$OUT/final.tgz" -C "$(dirname "$final")" final  # after each run: a timed-out call keeps the rest
      done ;;
    bench)
      RUNS=${BENCH_RUNS:-$(for s in $SHAPES; do echo "${s//:/-}-h100-persistent"; done)} bash "$here/tools/bench_runs.sh" ;;
    *) echo "unknown step $step (check, probe, search, final, bench)" >&2 ;;
  esac
  echo "== $step took $(( $(date +%s) - start )) s"
done
