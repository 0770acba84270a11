#!/usr/bin/env bash
# A knob of the mma.sync kernel on the mission shape, on the GPU machine, in the order that guards each later step: its
# GPU checks first (a kernel that fails them is never timed), then before/after pairs beside SDPA, then the exhaustive
# mission search that decides where it pays, its bench records beside the previous winner's, and the phase trace of
# the new winner. The knob's own script sets what differs and calls this one: tools/split_merge_device.sh (key_merge),
# tools/tma_load_device.sh (kv_load); docs/experiments/tools/tma_multicast_device.sh (kv_cluster) did too.
#   KNOB=kv_load VALUES="tma cp_async" TESTS=tests/test_tma_load.py SPACE=search_spaces/attention-small-tma.yaml \
#   RUN=mission-h100-exhaustive-small-tma OLD=mission-h100-exhaustive-small-merge TRIALS=1890 \
#   OLD_TRACE=docs/data/split-merge/trace/split_pdl_on.json.gz PAIRS='[{...}, ...]' STEPS="check pairs" OUT=dir \
#   bash tools/mission_knob_device.sh
#   check   tools/gpu_checks.sh $TESTS: the knob's gate and agreement tests, then its compute-sanitizer tests
#                                                                                  -> $OUT/check.txt, $OUT/sanitize.txt
#   pairs   tools/time_configs.py on the mission shape: each config of PAIRS (a JSON list of knob dicts) with KNOB at
#           each of VALUES, interleaved beside SDPA flash and cudnn               -> $OUT/pairs/{table.txt,*.json}
#   search  evotune search --shape mission over SPACE, exhaustive (all TRIALS admitted configs) -> run RUN
#                                                                                  -> $OUT/search.tgz
#   bench   tools/bench_runs.sh: REPS x `evotune bench best` of RUN and OLD        -> $OUT/bench.tgz
#   trace   tools/phase_trace.py on RUN's winner, then --compare with OLD_TRACE (a committed trace, if carried)
#                                                                                  -> $OUT/trace/
#   race    compute-sanitizer racecheck of one config (RACE_CONFIG, RACE_SHAPE) with KNOB at each of VALUES, each with
#           the tool's report                                                      -> $OUT/race.txt
#   ncu     Nsight Compute on RUN's best (speed of light, memory workload, occupancy)  -> $OUT/ncu.txt
set -uo pipefail
OUT=${OUT:?set OUT}; here=$(cd "$(dirname "$0")/.." && pwd)
export EVOTUNE_RUNS=${EVOTUNE_RUNS:-/tmp/runs} EVOTUNE_CACHE=${EVOTUNE_CACHE:-/tmp/cache}
: "${KNOB:?set KNOB}" "${VALUES:?set VALUES}" "${TESTS:?set TESTS}" "${SPACE:?set SPACE}" "${RUN:?set RUN}" "${OLD:?set OLD}"
export KNOB VALUES PAIRS
have_runs() {  # RUN...: each under $EVOTUNE_RUNS, copied from the committed runs/ unless this machine made it
  mkdir -p "$EVOTUNE_RUNS"
  for r in "$@"; do [ -d "$EVOTUNE_RUNS/$r" ] || cp -r "$here/runs/$r" "$EVOTUNE_RUNS/"; done
}
for step in ${STEPS:-check pairs}; do
  start=$(date +%s)
  case $step in
    check) bash "$here/tools/gpu_checks.sh" "$TESTS" ;;
    pairs)
      mkdir -p "$OUT/pairs"
      # each PAIRS config with KNOB at each of VALUES, as time_configs.py's JSON arguments
      mapfile -t configs < <(python3 -c '
import json, os
def knob_value(text):  # a VALUES word: a number or a boolean as JSON reads it (kv_cluster 2), else a name (tma)
    try:
        return json.loads(text)
    except ValueError:
        return text
for cfg in json.loads(os.environ["PAIRS"]):
    for value in os.environ["VALUES"].split():
        print(json.dumps(dict(cfg, **{os.environ["KNOB"]: knob_value(value)})))')
      (cd "$here" && OUT="$OUT/pairs" timeout 240 python3 tools/time_configs.py mission "${configs[@]}") \
        > "$OUT/pairs/table.txt" 2>&1 || echo "pairs failed: $(tail -1 "$OUT/pairs/table.txt")"
      tail -12 "$OUT/pairs/table.txt" ;;
    search)
      mkdir -p "$EVOTUNE_RUNS" /tmp/logs
      (cd "$here" && timeout "${SEARCH_S:-400}" python3 -m evotune search --shape mission --sampler exhaustive \
        --trials "${TRIALS:?set TRIALS}" --run "$RUN" --space "$SPACE") > "/tmp/logs/$RUN.txt" 2>&1
      echo "$RUN rc=$? $(grep -h '^finalists:' "/tmp/logs/$RUN.txt")"; tail -15 "/tmp/logs/$RUN.txt"
      tar -czf "$OUT/search.tgz" -C "$(dirname "$EVOTUNE_RUNS")" "$(basename "$EVOTUNE_RUNS")/$RUN" -C /tmp logs ;;
    bench)
      have_runs "$RUN" "$OLD"
      RUNS=${BENCH_RUNS:-"$RUN $OLD"} bash "$here/tools/bench_runs.sh" ;;
    trace)
      mkdir -p "$OUT/trace"; have_runs "$RUN"
      (cd "$here" && timeout "${TRACE_S:-300}" python3 tools/phase_trace.py --run "$RUN" --out "$OUT/trace/new.json") \
        > "$OUT/trace/new.txt" 2>&1
      echo "trace rc=$?"; tail -40 "$OUT/trace/new.txt"
      old=$here/${OLD_TRACE:-none}
      if [ -f "$old" ]; then
        gunzip -c "$old" > "$OUT/trace/old.json"
        (cd "$here" && python3 tools/phase_trace.py --compare "$OUT/trace/old.json" "$OUT/trace/new.json") \
          > "$OUT/trace/compare.txt" 2>&1
        rm -f "$OUT/trace/old.json"; cat "$OUT/trace/compare.txt"
      fi ;;
    race)
      # racecheck of one config with KNOB at each of VALUES, with the tool's own report (its first hazards)
      (cd "$here" && timeout 300 python3 - <<'PY') > "$OUT/race.txt" 2>&1; echo "race rc=$?"; tail -60 "$OUT/race.txt"
import json, os
from evotune.build.compile import compile_source
from evotune.build.template import instantiate
from evotune.gpu.sanitize import run_tool
from evotune.gpu.workers import compiled_to_dict
from evotune.problems import get_problem
from evotune.space.searchspace import load_builtin
attention, space = get_problem("attention"), load_builtin("attention")
shape = attention.parse_shape(os.environ.get("RACE_SHAPE", "2,3,197,300,64:causal"))
cfg = json.loads(os.environ.get("RACE_CONFIG", '{"block_m":128,"block_n":64,"compute_warps":8,"producer_warps":1,'
                 '"stages":2,"smem_layout":"swizzle","q_in_regs":false,"warp_key_groups":2,"kv_splits":1}'))
for value in os.environ["VALUES"].split():
    try:
        value = json.loads(value)  # a number or a boolean (kv_cluster 2), else a name (tma)
    except ValueError:
        pass
    config = space.config(dict(cfg, **{os.environ["KNOB"]: value}))
    src = instantiate(attention, config, shape)
    job = {"family": "attention", "shape": shape.as_dict(), "config": config.as_dict(),
           "compiled": compiled_to_dict(compile_source(src.code, src.entry))}
    report = run_tool("racecheck", job)
    print(f"== {os.environ['KNOB']}={value}: {report['summary']}")
    print(report["output_tail"])
PY
      ;;
    ncu)
      have_runs "$RUN"
      (cd "$here" && timeout 120 ncu --target-processes all -k regex:evotune_attention -s 3 -c 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        python3 -m evotune verify --run "$RUN" --launches 2) > "$OUT/ncu.txt" 2>&1 || echo "ncu failed"
      grep -E "Duration|Memory Throughput|L2 Cache Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Compute \(SM\)" \
        "$OUT/ncu.txt" | head -12 ;;
    *) echo "unknown step $step (check, pairs, search, bench, trace, race, ncu)" >&2 ;;
  esac
  echo "== $step took $(( $(date +%s) - start )) s"
done
