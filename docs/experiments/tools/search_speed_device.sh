#!/usr/bin/env bash
# Issue 14's measurements in one GPU call (H100): the README's first search from a cold start (three times), a
# 300-trial search for the sustained rate, the second exhaustive oracle (gpt2 over attention-hopper.yaml),
# and, where kernel_tuner is importable, Kernel Tuner's live tune beside evotune's default (tools/kt_live.py).
#   OUT=dir bash tools/search_speed_device.sh        (STEPS="first sustained oracle kt" by default; also: hopper, loopcost)
set -uo pipefail
# Everything lands in $OUT/search_speed.tgz (the device tool brings back few files).
FINAL=${OUT:?set OUT}; OUT=$(mktemp -d)/search_speed; STEPS=${STEPS:-first sustained oracle kt}
here=$(cd "$(dirname "$0")/.." && pwd)
for step in $STEPS; do
  case $step in
    first) OUT=$OUT/first REPEATS=3 bash "$here/tools/first_search.sh" ;;
    sustained) OUT=$OUT/sustained TRIALS=300 bash "$here/tools/first_search.sh" ;;
    loopcost)
      # The loop's own cost per candidate on this host (no GPU, no NVRTC): the journal against the SQLite study.
      mkdir -p "$OUT/loopcost"
      for sampler in surrogate nsga2; do for storage in journal sqlite; do
        python3 "$here/tools/loop_cost.py" --sampler $sampler --storage $storage --trials 300 \
          --json "$OUT/loopcost/$sampler-$storage.json" | head -1
      done; done ;;
    oracle)
      work=$(mktemp -d); mkdir -p "$OUT/oracle"; start=$(date +%s)
      EVOTUNE_CACHE=$work/cache EVOTUNE_RUNS=$OUT/oracle python3 -m evotune search --shape gpt2 \
        --space search_spaces/attention-hopper.yaml --sampler exhaustive --trials 126 \
        --run gpt2-h100-exhaustive-hopper > "$OUT/oracle/search.log" 2>&1
      echo "oracle: rc=$? $(( $(date +%s) - start )) s $(tail -3 "$OUT/oracle/search.log" | tr '\n' ' ')" ;;
    hopper)
      # The default search on gpt2 over attention-hopper.yaml (126 configs: compiled at the start, 2 ahead), at the
      # 30% budget of docs/EFFICIENCY.md's replay, from a cold cache: the live counterpart of that replay.
      work=$(mktemp -d); mkdir -p "$OUT/hopper"; start=$(date +%s)
      EVOTUNE_CACHE=$work/cache EVOTUNE_RUNS=$OUT/hopper python3 -m evotune search --shape gpt2 \
        --space search_spaces/attention-hopper.yaml --trials ${HOPPER_TRIALS:-38} --run gpt2-h100-hopper-default \
        > "$OUT/hopper/search.log" 2>&1
      echo "hopper: rc=$? $(( $(date +%s) - start )) s $(tail -3 "$OUT/hopper/search.log" | tr '\n' ' ')" ;;
    kt)
      # evotune's default budget (60) on attention-small, then Kernel Tuner's best replay strategy at the same
      # budget on the same template and space, both from cold caches; one harness re-times both winners.
      if python3 -c "import kernel_tuner" 2>/dev/null; then
        work=$(mktemp -d); mkdir -p "$OUT/kt"
        EVOTUNE_CACHE=$work/cache EVOTUNE_RUNS=$OUT/kt python3 -m evotune search --shape mission \
          --space search_spaces/attention-small.yaml --trials 60 --run mission-h100-small-60 > "$OUT/kt/evotune.log" 2>&1
        echo "evotune: rc=$? $(tail -3 "$OUT/kt/evotune.log" | tr '\n' ' ')"
        CUPY_CACHE_DIR=$work/cupy EVOTUNE_CACHE=$work/cache2 EVOTUNE_RUNS=$OUT/kt timeout 500 python3 \
          "$here/tools/kt_live.py" --shape mission --space search_spaces/attention-small.yaml \
          --strategy genetic_algorithm --budget 60 --seed 0 --evotune-run "$OUT/kt/mission-h100-small-60" \
          --reference-run "$here/runs/mission-h100-exhaustive-small" --out "$OUT/kt/live" > "$OUT/kt/kt_live.log" 2>&1
        echo "kt: rc=$?"; tail -25 "$OUT/kt/kt_live.log"
      else
        echo "kt: kernel_tuner is not importable here"
      fi ;;
  esac
done
tar -czf "$FINAL/search_speed.tgz" -C "$(dirname "$OUT")" search_speed
