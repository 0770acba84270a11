#!/usr/bin/env bash
# Issue 4's throughput target on the GPU machine: a cold-cache search on the mission shape
# under cProfile, then where the seconds went: compile (in the pool), GPU-side phases per
# candidate (result.extra.eval_seconds), and the search process's own time (pstats).
# Usage: TRIALS=200 SAMPLER=tpe bash tools/throughput_probe.sh
set -u
export EVOTUNE_RUNS=${EVOTUNE_RUNS:-/tmp/runs} EVOTUNE_CACHE=${EVOTUNE_CACHE:-/tmp/cache-throughput}
rm -rf "$EVOTUNE_CACHE"
mkdir -p "$OUT"
start=$(date +%s.%N)
python3 -m cProfile -o "$OUT/search.prof" -m evotune search --shape mission --trials "${TRIALS:-200}" \
  --sampler "${SAMPLER:-tpe}" --run "throughput-${SAMPLER:-tpe}" ${EXTRA:-} > "$OUT/search.txt" 2>&1
end=$(date +%s.%N)
python3 - "$start" "$end" <<'PY'
import json, os, pstats, statistics, sys
start, end = map(float, sys.argv[1:3])
run = os.path.join(os.environ["EVOTUNE_RUNS"], "throughput-" + os.environ.get("SAMPLER", "tpe"))
recs = [json.loads(l) for l in open(os.path.join(run, "trials.jsonl")) if l.strip()]
counted = [r for r in recs if r.get("counted")]
first, last = min(r["started"] for r in recs), max(r["finished"] for r in recs)
st = {}
for r in counted:
    st[r["result"]["status"]] = st.get(r["result"]["status"], 0) + 1
phases = {}
for r in counted:
    for k, v in ((r["result"].get("extra") or {}).get("eval_seconds") or {}).items():
        phases.setdefault(k, []).append(v)
comp = [r["result"].get("compile_seconds") or 0 for r in counted]
print(f"process wall {end - start:.1f} s; first ask to last record {last - first:.1f} s")
print(f"evaluated {len(counted)} ({st}), proposals {len(recs)}: {len(counted) / (last - first):.2f} evaluated/s "
      f"in the loop, {len(counted) / (end - start):.2f}/s including start-up")
print(f"compile s per candidate (pool, overlapped): median {statistics.median(comp):.2f}, sum {sum(comp):.0f}")
for k, v in phases.items():
    print(f"GPU-side {k:7s}: median {statistics.median(v) * 1e3:7.1f} ms, sum {sum(v):6.1f} s over {len(v)}")
p = pstats.Stats(os.path.join(os.environ["OUT"], "search.prof"))
p.sort_stats("cumulative").print_stats(18)
PY
