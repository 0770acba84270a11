#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck) on one config for every
# dtype x head dim x mask, on small ragged shapes; prints one line per combo.
# Usage: tools/sanitize_combos.sh 'CONFIG_JSON'
set -u
for d in 64 128; do for t in fp16 bf16; do for c in "" ":causal"; do
  sk=300; [ -n "$c" ] && sk=197
  shape="1,2,197,${sk},${d}:${t}${c}"
  timeout 120 python3 -m evotune sanitize --config "$1" --shape "$shape" --json > /tmp/san.json 2>/tmp/san.err
  python3 -c "
import json,sys
try:
    d=json.load(open('/tmp/san.json')); print('$shape', {r['tool']: r['summary'] for r in d['reports']})
except Exception: print('$shape', 'no report:', open('/tmp/san.err').read()[-200:])"
done; done; done
