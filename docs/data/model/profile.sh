#!/usr/bin/env bash
# Issue 41's profile of one forward (tools/profile_forward.py): transformers' sdpa against evotune, wall and host ms
# per forward, the kernels each side launches, attention's apart; the GPT-2-like model at 1x512 and 1x8192 and the
# Qwen2-like at 1x512, each on its table of 2026-11-28 (docs/data/2026-11-28-h200/launcher/e2e-call3/); with
# FIRST_TOKEN=1 also generate()'s first token under a DynamicCache at GPT-2 1x2048 (the row whose time to first token
# read 0.89x that afternoon). One device call, one GPU:  bash docs/data/model/profile.sh   (writes
# $OUT/profile-*.json, prints each table)
set -u
OUT=${OUT:-/tmp/profile-out}
. tools/device_env.sh || exit 1
mkdir -p "$OUT"
export EVOTUNE_CACHE=${TMPDIR:-/tmp}/profile-cache
tables=docs/data/2026-11-28-h200/launcher/e2e-call3
for spec in gpt2:1x512 gpt2:1x8192 qwen2:1x512; do
  IFS=: read -r model size <<< "$spec"
  timeout 150 python3 tools/profile_forward.py --model "$model" --size "$size" --table "$tables/e2e-table-$model.json" \
    --out "$OUT/profile-$model-$size.json" 2>&1 | tail -n 5
done
if [ "${FIRST_TOKEN:-0}" = 1 ]; then
  timeout 150 python3 tools/profile_forward.py --what first-token --model gpt2 --size 1x2048 \
    --table "$tables/e2e-table-gpt2.json" --out "$OUT/profile-gpt2-1x2048-first-token.json" 2>&1 | tail -n 5
fi
