#!/usr/bin/env bash
# Programmatic dependent launch (the attention family's knob pdl, docs/PDL.md) on the GPU machine, from the repo root,
# in the order that guards each later step: the GPU checks first (a pdl kernel that fails them is never timed), then
# compute-sanitizer on the pdl mission winner, then tools/pdl_chain.py on two small shapes.
#   OUT=dir bash tools/pdl_device.sh                    # STEPS="check sanitize mission d64" by default
#   STEPS=check OUT=dir bash tools/pdl_device.sh        # one step per device call, if the calls are short
# Estimates, not yet measured (H100, a cold compile cache; EVOTUNE_CACHE kept between calls saves the compiles):
#   check     pytest -m gpu -k pdl over tests/test_pdl.py, test_pdl_chain.py and test_torch_gpu.py: ~40 NVRTC
#             compiles (~1 s each), the gate on 7 shapes x 4 pdl configs, graph timing, the hazard tests (2 ms
#             writers), the op, the tool's smoke run: 2-5 min                              -> pdl/check.txt
#   sanitize  evotune sanitize of the pdl mission winner (memcheck, racecheck, synccheck on a small ragged shape of
#             its class, launched through cuLaunchKernelEx): ~1 min                       -> pdl/sanitize.txt
#   mission   tools/pdl_chain.py, the mission winner on mission (runs/mission-h100-exhaustive-small): 2 compiles, 3
#             settings x 6 contenders x 12 rounds: 1-2 min                                -> pdl/mission.{json,txt}
#   d64       the same for runs/d64-fp16's best on 2,8,1024,64 (22 us per call, 2^30 multiply-adds: still admitted
#             with pdl by attention.yaml): 1-2 min                                        -> pdl/d64.{json,txt}
# Each step is bounded by a timeout; a failed step is reported and the next one still runs (read check.txt before
# trusting the timings). After each step $OUT/pdl is tarred into $OUT/pdl.tgz (the device returns at most ~8 files;
# a call that times out keeps what the steps before it wrote); each chain table is also printed.
set -uo pipefail
OUT=${OUT:?set OUT}; here=$(cd "$(dirname "$0")/.." && pwd)
export EVOTUNE_RUNS=${EVOTUNE_RUNS:-/tmp/runs} EVOTUNE_CACHE=${EVOTUNE_CACHE:-/tmp/cache}
dir=$OUT/pdl; mkdir -p "$dir"
MISSION='{"block_m":32,"block_n":128,"compute_warps":4,"producer_warps":0,"stages":4,"smem_layout":"swizzle","q_in_regs":true,"kv_splits":1,"warp_key_groups":2}'
D64='{"block_m":64,"block_n":64,"compute_warps":4,"producer_warps":0,"stages":3,"smem_layout":"swizzle","q_in_regs":true,"kv_splits":1}'
chain() {  # name shape config: tools/pdl_chain.py into $dir/name.{json,txt}, its table printed
  timeout "${CHAIN_S:-300}" python3 "$here/tools/pdl_chain.py" --shape "$2" --config "$3" --layers "${LAYERS:-4}" \
    --out "$dir/$1.json" > "$dir/$1.txt" 2>&1
  echo "$1 rc=$?"; tail -6 "$dir/$1.txt"
}
for step in ${STEPS:-check sanitize mission d64}; do
  start=$(date +%s)
  case $step in
    check)
      (cd "$here" && timeout "${CHECK_S:-540}" python3 -m pytest -q -m gpu -k pdl tests/test_pdl.py \
        tests/test_pdl_chain.py tests/test_torch_gpu.py -p no:cacheprovider) > "$dir/check.txt" 2>&1
      echo "check rc=$? $(tail -1 "$dir/check.txt")" ;;
    sanitize)
      (cd "$here" && timeout "${SANITIZE_S:-300}" python3 -m evotune sanitize --config "${MISSION%\}},\"pdl\":true}" \
        --space search_spaces/attention-small-pdl.yaml) > "$dir/sanitize.txt" 2>&1
      echo "sanitize rc=$?"; tail -4 "$dir/sanitize.txt" ;;
    mission) chain mission mission "$MISSION" ;;
    d64) chain d64 2,8,1024,64 "$D64" ;;
    *) echo "unknown step $step (check, sanitize, mission, d64)" >&2 ;;
  esac
  echo "== $step took $(( $(date +%s) - start )) s"
  tar -czf "$OUT/pdl.tgz" -C "$OUT" pdl
done
