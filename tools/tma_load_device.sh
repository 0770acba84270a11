#!/usr/bin/env bash
# TMA loads for the mma.sync kernel (knob kv_load = tma, kernels/attention_tma_load.cuh) on the GPU machine: the steps
# of tools/mission_knob_device.sh (check, pairs, search, bench, trace, race, ncu) for this knob.
#   STEPS="check pairs" OUT=dir bash tools/tma_load_device.sh
#   STEPS="search bench trace" OUT=dir bash tools/tma_load_device.sh
#   check   tests/test_tma_load.py: the gate on 8 shapes x 5 configs (bit for bit the cp_async twin's output),
#           write_lse; then the slow compute-sanitizer runs
#   pairs   the split-merge winner of runs/mission-h100-exhaustive-small-merge, its gather twin and its pdl-off twin,
#           each with kv_load = cp_async and tma
#   search  attention-small-tma.yaml, exhaustive (1890 admitted configs) -> run mission-h100-exhaustive-small-tma
#   bench   that run and mission-h100-exhaustive-small-merge;  trace: against docs/data/split-merge/trace/split_pdl_on.json.gz
here=$(cd "$(dirname "$0")/.." && pwd)
w='"block_m":32,"block_n":128,"compute_warps":4,"producer_warps":0,"stages":4,"smem_layout":"swizzle","q_in_regs":true,"kv_splits":1,"warp_key_groups":2'
KNOB=kv_load VALUES="cp_async tma" TESTS=tests/test_tma_load.py SPACE=search_spaces/attention-small-tma.yaml \
  RUN=mission-h100-exhaustive-small-tma OLD=mission-h100-exhaustive-small-merge TRIALS=${TRIALS:-1890} \
  OLD_TRACE=docs/data/split-merge/trace/split_pdl_on.json.gz \
  RACE_CONFIG=${RACE_CONFIG:-"{$w,\"key_merge\":\"split\",\"pdl\":true}"} \
  PAIRS="[{$w,\"key_merge\":\"split\",\"pdl\":true}, {$w,\"key_merge\":\"gather\",\"pdl\":true}, {$w,\"key_merge\":\"split\",\"pdl\":false}]" \
  exec bash "$here/tools/mission_knob_device.sh"
