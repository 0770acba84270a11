#!/usr/bin/env bash
# Several search agents sharing one study on the GPU machine, in one call (issue 4 item 5):
#   1. `search --gpus 0,0` (two agents on one GPU; 0,1 where two GPUs are visible) on the run's SQLite study;
#   2. a single-agent search of the same size, for throughput and best time beside it;
#   3. a two-agent search stopped with Ctrl-C (SIGINT to the CLI) mid-run, then resumed to its total;
#   4. where PostgreSQL and psycopg2 are installed, step 1 through a server started on loopback.
# Logs and runs go to $OUT (tarred); a short summary is printed last. About 5-8 minutes on an H100.
set -u
export EVOTUNE_RUNS=/tmp/runs EVOTUNE_CACHE=/tmp/cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/runs /tmp/logs "$OUT"
TRIALS=${TRIALS:-32}
SHAPE=${SHAPE:-mission}
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${NGPU:-0}" -ge 2 ]; then GPUS=${GPUS:-0,1}; else GPUS=${GPUS:-0,0}; fi
echo "visible GPUs: $NGPU; agents on --gpus $GPUS; $TRIALS trials on $SHAPE"

t0=$(date +%s)
timeout 480 python3 -m evotune search --shape "$SHAPE" --trials "$TRIALS" --gpus "$GPUS" --run shared \
    > /tmp/logs/shared.txt 2>&1
echo "shared: exit $? in $(( $(date +%s) - t0 )) s"

t0=$(date +%s)
timeout 480 python3 -m evotune search --shape "$SHAPE" --trials "$TRIALS" --run single > /tmp/logs/single.txt 2>&1
echo "single: exit $? in $(( $(date +%s) - t0 )) s"

# Ctrl-C: SIGINT to the CLI once 6 trials are counted; the agents finish what they measure and exit 130.
set -m  # job control: a background job of a script otherwise starts with SIGINT ignored
python3 -m evotune search --shape "$SHAPE" --trials 20 --gpus "$GPUS" --run interrupted > /tmp/logs/interrupted.txt 2>&1 &
cli=$!
for _ in $(seq 600); do
    n=$(python3 -c "import json,sys; print(sum(json.loads(l).get('counted', False) for l in open(sys.argv[1]) if l.strip()))" \
        /tmp/runs/interrupted/trials.jsonl 2>/dev/null || echo 0)
    [ "${n:-0}" -ge 6 ] && break
    kill -0 $cli 2>/dev/null || break
    sleep 0.5
done
kill -INT $cli 2>/dev/null
wait $cli
echo "interrupted: exit $? (130 expected)"
set +m
timeout 300 python3 -m evotune search --shape "$SHAPE" --trials 20 --gpus "$GPUS" --run interrupted --resume \
    > /tmp/logs/resumed.txt 2>&1
echo "resumed: exit $?"

PGBIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | tail -n 1)
if [ -n "$PGBIN" ] && python3 -c "import psycopg2" 2>/dev/null; then
    PGURL=$(cd tests && python3 -c "
import _postgres, json
s = _postgres.PostgresServer().start()
print(s.url, s.root)")
    read -r URL PGROOT <<< "$PGURL"
    timeout 480 python3 -m evotune search --shape "$SHAPE" --trials "$TRIALS" --gpus "$GPUS" --run shared-pg \
        --storage "$URL" > /tmp/logs/shared_pg.txt 2>&1
    echo "shared-pg: exit $?"
    runuser -u postgres -- "$PGBIN/pg_ctl" -D "$PGROOT/data" -m immediate stop > /dev/null 2>&1 \
        || "$PGBIN/pg_ctl" -D "$PGROOT/data" -m immediate stop > /dev/null 2>&1
    rm -rf "$PGROOT"
else
    echo "shared-pg: skipped (no PostgreSQL server binaries or no psycopg2 here)"
fi

tar czf "$OUT/shared_study.tgz" -C /tmp runs logs
python3 - "$TRIALS" <<'PY'
import collections, json, math, os, sys
import optuna
from evotune.records.runs import Run, best_record
optuna.logging.set_verbosity(optuna.logging.WARNING)
trials = int(sys.argv[1])
for name, want in (("shared", trials), ("single", trials), ("interrupted", 20), ("shared-pg", trials)):
    path = os.path.join(os.environ["EVOTUNE_RUNS"], name)
    if not os.path.exists(path):
        print(f"{name}: no run"); continue
    run = Run(path)
    lines = open(run.trials_path).read().splitlines()
    recs = [json.loads(l) for l in lines]  # every line must be whole JSON
    counted = [r for r in recs if r.get("counted")]
    per_agent = collections.Counter(r.get("agent") for r in counted)
    digests = collections.Counter(r["digest"] for r in counted)
    races = sum(1 for r in recs if r.get("note"))
    try:
        study = optuna.load_study(study_name=run.study_name, storage=run.storage())
        states = collections.Counter(t.state.name for t in study.trials)
    except Exception as e:  # shared-pg: the server is gone by now
        states = f"(study not read: {type(e).__name__})"
    best = best_record(recs)
    span = (max(r["finished"] for r in recs) - min(r["started"] for r in recs)) if recs else 0
    ok = "OK" if len(counted) == want and max(digests.values(), default=1) == 1 else "MISMATCH"
    best_text = f"best {best['result']['time_us']:.2f} us {best['config']}" if best else "no best"
    print(f"{name}: {ok} counted {len(counted)}/{want}, records {len(recs)}, per agent {dict(per_agent)}, "
          f"races {races}, study {dict(states) if isinstance(states, collections.Counter) else states}, "
          f"{len(counted) / span * 60 if span else 0:.1f} counted/min; {best_text}")
PY
grep -hE "^run |^best|error|Traceback" /tmp/logs/*.txt | head -20
