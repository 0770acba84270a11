#!/usr/bin/env bash
# Issue 5 on the GPU machine: default-strategy searches on the large shapes, each bounded by
# a timeout (a killed search is resumable: nothing recorded is lost). Runs and logs go to
# $OUT (tarred); the best of each is printed last.
# Usage: SHAPES="gpt2 llama-4k" TRIALS=48 PER_SEARCH_S=130 [RUN_SUFFIX=-hopper] [EXTRA="--space ..."] bash tools/large_searches.sh
set -u
export EVOTUNE_RUNS=${EVOTUNE_RUNS:-/tmp/runs} EVOTUNE_CACHE=${EVOTUNE_CACHE:-/tmp/cache}
mkdir -p "$EVOTUNE_RUNS" /tmp/logs
for s in ${SHAPES:-gpt2 llama-4k llama-4k-causal long-8k}; do
  name="${s//:/-}-h100${RUN_SUFFIX:-}"
  timeout "${PER_SEARCH_S:-130}" python3 -m evotune search --shape "$s" --trials "${TRIALS:-48}" --run "$name" \
    ${EXTRA:-} > "/tmp/logs/search_$name.txt" 2>&1
  echo "$s exit $?" >> /tmp/logs/exits.txt
done
tar czf "$OUT/large.tgz" -C "$(dirname "$EVOTUNE_RUNS")" "$(basename "$EVOTUNE_RUNS")" -C /tmp logs
cat /tmp/logs/exits.txt
python3 - <<'PY'
import glob, json, os
for d in sorted(glob.glob(os.path.join(os.environ["EVOTUNE_RUNS"], "*"))):
    recs = [json.loads(l) for l in open(os.path.join(d, "trials.jsonl")) if l.strip()]
    counted = [r for r in recs if r.get("counted")]
    ok = sorted((r for r in counted if r["result"]["status"] == "ok"), key=lambda r: r["result"]["time_us"])
    st = {}
    for r in counted:
        st[r["result"]["status"]] = st.get(r["result"]["status"], 0) + 1
    print(os.path.basename(d), len(counted), st)
    for r in ok[:3]:
        c = r["config"]
        print(f'  {r["result"]["time_us"]:9.2f} us  ' + " ".join(f"{k}={v}" for k, v in c.items()))
PY
