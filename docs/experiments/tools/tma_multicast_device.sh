#!/usr/bin/env bash
# TMA multicast of the K/V tiles across a cluster of query tiles (knob kv_cluster, kernels/attention_tma_multicast.cuh)
# on the GPU machine: the steps of tools/mission_knob_device.sh (check, pairs, search, bench, trace, race, ncu) for this
# knob.
#   STEPS="check pairs" OUT=dir bash tools/tma_multicast_device.sh
#   STEPS="search bench trace" OUT=dir bash tools/tma_multicast_device.sh
#   check   tests/test_tma_multicast.py: the gate on 8 shapes x 6 configs (bit for bit the kv_cluster = 1 twin's
#           output), write_lse; then the slow compute-sanitizer runs
#   pairs   the kv_load = tma winner of runs/mission-h100-exhaustive-small-tma (3 stages: one refill behind the
#           cluster barrier), its 4-stage twin (no refill) and its gather twin, each with kv_cluster 1, 2 and 4
#   search  attention-small-mc.yaml, exhaustive (2646 admitted configs) -> run mission-h100-exhaustive-small-mc
#   bench   that run and mission-h100-exhaustive-small-tma;  trace: against docs/data/tma-load/trace/tma_pdl_on.json.gz
here=$(cd "$(dirname "$0")/.." && pwd)
w='"block_m":32,"block_n":128,"compute_warps":4,"producer_warps":0,"smem_layout":"swizzle","q_in_regs":true,"kv_splits":1,"warp_key_groups":2,"kv_load":"tma","pdl":true'
KNOB=kv_cluster VALUES="1 2 4" TESTS=tests/test_tma_multicast.py SPACE=search_spaces/attention-small-mc.yaml \
  RUN=mission-h100-exhaustive-small-mc OLD=mission-h100-exhaustive-small-tma TRIALS=${TRIALS:-2646} \
  OLD_TRACE=docs/data/tma-load/trace/tma_pdl_on.json.gz \
  RACE_CONFIG=${RACE_CONFIG:-"{$w,\"stages\":3,\"key_merge\":\"split\"}"} \
  PAIRS="[{$w,\"stages\":3,\"key_merge\":\"split\"}, {$w,\"stages\":4,\"key_merge\":\"split\"}, {$w,\"stages\":3,\"key_merge\":\"gather\"}]" \
  exec bash "$here/tools/mission_knob_device.sh"
