#!/usr/bin/env bash
# Issue 13 item 4 (the TMA-store epilogue, knob epilogue = tma) on the GPU machine, in the order that guards each
# later step: its GPU checks first (a kernel that fails them is never timed), then before/after pairs beside SDPA,
# then the searches that decide where it pays, then repeated `evotune bench` records of their winners.
#   STEPS="check pairs" OUT=dir bash tools/tma_store_device.sh
#   STEPS="search bench" OUT=dir bash tools/tma_store_device.sh
#   check   tools/gpu_checks.sh tests/test_tma_store.py: the gate on 8 shapes x 8 configs (bit for bit the regs epilogue's
#           output too), write_lse, the op's prepared launch; then the slow compute-sanitizer runs
#                                                                              -> $OUT/check.txt, $OUT/sanitize.txt
#   pairs   tools/time_configs.py per committed persistent run whose winner admits the knob: the winner (regs) and
#           the same config with epilogue = tma, interleaved beside SDPA flash and cudnn  -> $OUT/pairs.tgz
#   search  SEARCH_SHAPES (default the d64 presets) over attention-hopper3.yaml, TRIALS trials each, warm-started
#           from the committed *-h100-persistent run of the shape (runs *-h100-tma)        -> $OUT/search.tgz
#   bench   tools/bench_runs.sh: REPS x `evotune bench best` of each run the search step made (or BENCH_RUNS)
#                                                                              -> $OUT/bench.tgz
#   overlap tools/time_configs.py --with-flag no_wg_overlap per run in OVERLAP_RUNS (committed runs/): the winner and
#           the same kernel without its intra-warpgroup overlap (item 1's baseline), interleaved beside SDPA
#                                                                              -> $OUT/overlap.tgz
#   ncu     Nsight Compute on the best of each run in NCU_RUNS (committed runs/): speed of light, compute workload,
#           warp states, occupancy of one launch                                        -> $OUT/ncu.tgz (RUN.txt)
set -uo pipefail
OUT=${OUT:?set OUT}; here=$(cd "$(dirname "$0")/.." && pwd)
export EVOTUNE_RUNS=${EVOTUNE_RUNS:-/tmp/runs} EVOTUNE_CACHE=${EVOTUNE_CACHE:-/tmp/cache}
PAIR_RUNS=${PAIR_RUNS:-"gpt2-h100-persistent gpt2-bf16-h100-persistent gpt2-causal-h100-persistent
  gpt2-causal-bf16-h100-persistent long-8k-h100-persistent long-8k-bf16-h100-persistent llama-4k-h100-persistent"}
SEARCH_SHAPES=${SEARCH_SHAPES:-"gpt2 gpt2:bf16 long-8k long-8k:bf16"}
run_best() {  # RUN [EPILOGUE]: the committed run's shape spec and its best config as JSON (epilogue set if given)
  python3 -c 'import json, sys
d = sys.argv[1]; c = json.load(open(d + "/best.json"))["config"]
if len(sys.argv) > 2: c = dict(c, epilogue=sys.argv[2])
print(json.load(open(d + "/meta.json"))["shape_spec"], json.dumps(c, separators=(",", ":")))' "$here/runs/$1" "${@:2}"
}
for step in ${STEPS:-check pairs}; do
  start=$(date +%s)
  case $step in
    check) bash "$here/tools/gpu_checks.sh" tests/test_tma_store.py ;;
    pairs)
      pairs=$(mktemp -d)/pairs; mkdir -p "$pairs"
      for run in $PAIR_RUNS; do
        read -r shape regs < <(run_best "$run" regs)
        read -r _ tma < <(run_best "$run" tma)
        mkdir -p "$pairs/$run"
        (cd "$here" && OUT="$pairs/$run" timeout 150 python3 tools/time_configs.py "$shape" "$regs" "$tma") \
          > "$pairs/$run/table.txt" 2>&1 || echo "pair $run failed: $(tail -1 "$pairs/$run/table.txt")"
        echo "== $run ($shape)"; tail -7 "$pairs/$run/table.txt"
        tar -czf "$OUT/pairs.tgz" -C "$(dirname "$pairs")" pairs  # after each: a timed-out call keeps the rest
      done ;;
    search)
      mkdir -p "$EVOTUNE_RUNS" /tmp/logs
      for s in $SEARCH_SHAPES; do
        from="${s//:/-}-h100-persistent"; name="${s//:/-}-h100-tma"
        [ -d "$EVOTUNE_RUNS/$from" ] || cp -r "$here/runs/$from" "$EVOTUNE_RUNS/"
        (cd "$here" && timeout "${PER_SEARCH_S:-150}" python3 -m evotune search --shape "$s" --trials "${TRIALS:-48}" \
          --run "$name" --space search_spaces/attention-hopper3.yaml --warm-start "$from") > "/tmp/logs/$name.txt" 2>&1
        echo "$name rc=$? $(grep -h '^finalists:' "/tmp/logs/$name.txt")"
        tar -czf "$OUT/search.tgz" -C "$(dirname "$EVOTUNE_RUNS")" "$(basename "$EVOTUNE_RUNS")" -C /tmp logs
      done ;;
    bench)
      RUNS=${BENCH_RUNS:-$(for s in $SEARCH_SHAPES; do echo "${s//:/-}-h100-tma"; done)} bash "$here/tools/bench_runs.sh" ;;
    overlap)
      ov=$(mktemp -d)/overlap; mkdir -p "$ov"
      for run in ${OVERLAP_RUNS:?set OVERLAP_RUNS}; do
        read -r shape cfg < <(run_best "$run")
        mkdir -p "$ov/$run"
        (cd "$here" && OUT="$ov/$run" timeout 150 python3 tools/time_configs.py --with-flag no_wg_overlap "$shape" "$cfg") \
          > "$ov/$run/table.txt" 2>&1 || echo "overlap $run failed: $(tail -1 "$ov/$run/table.txt")"
        echo "== $run ($shape)"; tail -5 "$ov/$run/table.txt"
        tar -czf "$OUT/overlap.tgz" -C "$(dirname "$ov")" overlap
      done ;;
    ncu)
      ncu_dir=$(mktemp -d)/ncu; mkdir -p "$ncu_dir" "$EVOTUNE_RUNS"
      for run in ${NCU_RUNS:?set NCU_RUNS}; do
        [ -d "$EVOTUNE_RUNS/$run" ] || cp -r "$here/runs/$run" "$EVOTUNE_RUNS/"
        (cd "$here" && timeout 120 ncu --target-processes all -k regex:evotune_attention -s 3 -c 1 \
          --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
          python3 -m evotune verify --run "$run" --launches 2) > "$ncu_dir/$run.txt" 2>&1 || echo "ncu $run failed"
        echo "== $run"; grep -E "Compute \(SM\) Throughput|Issue Slots Busy|Achieved Occupancy|Duration|pipe" \
          "$ncu_dir/$run.txt" | head -8
        tar -czf "$OUT/ncu.tgz" -C "$(dirname "$ncu_dir")" ncu
      done ;;
    *) echo "unknown step $step (check, pairs, search, bench, overlap, ncu)" >&2 ;;
  esac
  echo "== $step took $(( $(date +%s) - start )) s"
done
