#!/usr/bin/env bash
# Issue 39 item 4: re-search a preset over the attention:wgmma profile (every Hopper knob), warm-started from the
# committed runs and the shipped priors, then `evotune bench` its best beside every SDPA backend and the preset's
# committed winner (docs/data/epoch2/presets.json) in the same process order. Usage on the device machine, from a
# tree holding evotune/, kernels/, search_spaces/, runs/ and this folder:
#   bash docs/data/epoch2/research.sh SHAPE TRIALS RUN PRESET_RECORD
# Results: $OUT/RUN.tar (the run folder, the bench records and logs).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${WHL:-.whl}"/*.whl || exit
export PYTHONUNBUFFERED=1 EVOTUNE_CACHE=/tmp/evotune-cache PYTHONPATH=/tmp/site:$PWD EVOTUNE_RUNS=/tmp/runs
shape=$1 trials=$2 run=$3 preset=$4
[ -d /tmp/runs ] || cp -r runs /tmp/runs
d=$OUT/$run; mkdir -p $d
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader | tee $d/device.txt
SECONDS=0
python3 -m evotune search --shape "$shape" --space attention:wgmma --trials "$trials" --run "$run" 2>&1 | tail -n 25 | tee $d/search.txt
echo "search wall ${SECONDS} s (the whole command; the search's own wall is its last line above)" | tee -a $d/search.txt
python3 -m evotune bench best --run "$run" --out $d/bench-new.json > $d/bench-new.txt 2>&1; tail -n 14 $d/bench-new.txt
cfg=$(python3 -c "import json,sys; p=json.load(open('docs/data/epoch2/presets.json'))['$preset']; print(json.dumps(p['config']))")
python3 -m evotune bench --config "$cfg" --shape "$shape" --out $d/bench-old.json > $d/bench-old.txt 2>&1; tail -n 14 $d/bench-old.txt
cp -r /tmp/runs/$run $d/run
tar -C $OUT -cf $OUT/$run.tar $run && rm -rf $d
