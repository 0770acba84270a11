#!/usr/bin/env bash
# The key groups' split merge (knob key_merge = split, kernels/attention_split_merge.cuh) on the GPU machine: the steps
# of tools/mission_knob_device.sh (check, pairs, search, bench, trace, race, ncu) for this knob.
#   STEPS="check pairs" OUT=dir bash tools/split_merge_device.sh
#   STEPS="search bench trace" OUT=dir bash tools/split_merge_device.sh
#   check   the gate on 8 shapes x 5 configs (agreeing with gather's output to two units in the last place), write_lse;
#           then the slow compute-sanitizer runs
#   pairs   the pdl winner of runs/mission-h100-exhaustive-small-pdl and its four-key-group twin, each with
#           key_merge = gather and split
#   search  attention-small-merge.yaml, exhaustive (1512 admitted configs) -> run mission-h100-exhaustive-small-merge
#   bench   that run and mission-h100-exhaustive-small-pdl;  trace: against docs/data/trace/pdl_on.json.gz
here=$(cd "$(dirname "$0")/.." && pwd)
w='"block_m":32,"block_n":128,"producer_warps":0,"stages":4,"smem_layout":"swizzle","q_in_regs":true,"kv_splits":1,"pdl":true'
KNOB=key_merge VALUES="gather split" TESTS=tests/test_split_merge.py SPACE=search_spaces/attention-small-merge.yaml \
  RUN=mission-h100-exhaustive-small-merge OLD=mission-h100-exhaustive-small-pdl TRIALS=${TRIALS:-1512} \
  OLD_TRACE=docs/data/trace/pdl_on.json.gz \
  PAIRS="[{$w,\"compute_warps\":4,\"warp_key_groups\":2}, {$w,\"compute_warps\":8,\"warp_key_groups\":4}]" \
  exec bash "$here/tools/mission_knob_device.sh"
