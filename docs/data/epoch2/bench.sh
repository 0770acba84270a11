#!/usr/bin/env bash
# Issue 39 item 4: `evotune bench` of every preset's winning config (docs/data/epoch2/presets.json, the configs of
# docs/data/best/) compiled from TODAY's kernel source, each beside every SDPA backend, in one device session.
# Usage on the device machine: bash docs/data/epoch2/bench.sh INDEX... (indices into the sorted preset names; none:
# all). The records come back as one tar file ($OUT/records.tar: NAME.json and NAME.txt each).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONUNBUFFERED=1 EVOTUNE_CACHE=/tmp/evotune-cache PYTHONPATH=/tmp/site:$PWD
mkdir -p $OUT/rec
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/device.txt
python3 - "$@" <<'PY'
import json, os, subprocess, sys
wanted = {int(a) for a in sys.argv[1:]}
presets = json.load(open("docs/data/epoch2/presets.json"))
out = os.environ["OUT"] + "/rec"
for i, name in enumerate(sorted(presets)):
    if wanted and i not in wanted:
        continue
    p = presets[name]
    cmd = [sys.executable, "-m", "evotune", "bench", "--config", json.dumps(p["config"]), "--shape", p["shape"],
           "--out", f"{out}/{name}.json"] + (["--space", p["space"]] if p.get("space") else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    open(f"{out}/{name}.txt", "w").write(" ".join(cmd) + "\n" + r.stdout + r.stderr + f"\nrc {r.returncode}\n")
    try:
        rec = json.load(open(f"{out}/{name}.json"))
        rows = {x["name"]: x for x in rec["rows"]}
        ours, cudnn = rows["evotune"]["time_us"], rows.get("cudnn", {}).get("time_us")
        print(f"{name:42s} {p['shape']:28s} ours {ours:9.2f} us  cudnn {cudnn or float('nan'):9.2f} us  "
              f"{(cudnn / ours) if (ours and cudnn) else float('nan'):.3f}x", flush=True)
    except Exception as e:
        print(f"{name}: rc {r.returncode}: {(r.stderr or r.stdout).strip().splitlines()[-1:]}", flush=True)
PY
tar -C $OUT -cf $OUT/records.tar rec && rm -rf $OUT/rec
