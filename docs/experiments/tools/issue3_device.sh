#!/usr/bin/env bash
# Issue 3 on the GPU machine in one call: racecheck probe, a causal d128 bf16 search +
# replay, and for every dtype x head dim x mask a short search whose best is run through
# compute-sanitizer. Logs and runs go to $OUT (tarred); a summary is printed last.
set -u
export EVOTUNE_RUNS=/tmp/runs EVOTUNE_CACHE=/tmp/cache
mkdir -p /tmp/runs /tmp/logs
python3 tools/racecheck_probe.py > /tmp/logs/racecheck_probe.txt 2>&1
timeout 200 python3 -m evotune search --shape llama-4k-causal:bf16 --trials ${LLAMA_TRIALS:-24} --run llama-4k-causal-bf16 > /tmp/logs/search_llama.txt 2>&1
timeout 120 python3 -m evotune replay best --run llama-4k-causal-bf16 > /tmp/logs/replay_llama.txt 2>&1
timeout 120 python3 -m evotune replay best --run llama-4k-causal-bf16 --json > /tmp/logs/replay_llama.json 2>/dev/null
for d in 64 128; do for t in fp16 bf16; do for c in "" ":causal"; do
  name="d${d}-${t}${c/:/-}"
  timeout 60 python3 -m evotune search --shape "2,8,1024,${d}:${t}${c}" --trials ${COMBO_TRIALS:-12} --run "$name" > /tmp/logs/search_$name.txt 2>&1
  timeout 90 python3 -m evotune sanitize best --run "$name" --json > /tmp/logs/sanitize_$name.json 2>/tmp/logs/sanitize_$name.err
done; done; done
tar czf $OUT/issue3.tgz -C /tmp runs logs
cat /tmp/logs/racecheck_probe.txt
grep -E "^run |^best" -A1 /tmp/logs/search_llama.txt; cat /tmp/logs/replay_llama.txt
python3 - <<'PY'
import glob, json
for p in sorted(glob.glob("/tmp/logs/sanitize_*.json")):
    try:
        d = json.load(open(p))
        print(p.split("sanitize_")[1][:-5], d["shape"], {r["tool"]: r["summary"] for r in d["reports"]}, d["config"])
    except Exception as e:
        print(p, "no report:", open(p.replace(".json", ".err")).read()[-300:])
PY
