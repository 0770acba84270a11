#!/usr/bin/env bash
# The held-out benchmark of the tuner (tools/heldout_tuner.py), one phase over the held-out shapes, one process per
# GPU in parallel, in one device call of under 9 minutes.
#
#   bash docs/data/heldout/run.sh GPUS PHASE [K/N] [TOOL OPTIONS...]
#   bash docs/data/heldout/run.sh 0,1,2,3 tune            # ~3-5 min on 4 H100s
#   bash docs/data/heldout/run.sh 0,1,2,3 long 1/3        # then 2/3, 3/3: one or two long searches per GPU per call
#   bash docs/data/heldout/run.sh 0,1,2,3 kt 1/2          # then 2/2 (needs kernel_tuner and its deps in .whl)
#
# GPUS: comma list of GPU indices (each process sees one through CUDA_VISIBLE_DEVICES). PHASE: tune, long, kt,
# bare (tune --no-priors: before the priors shipped) or all (tune, long and kt). K/N: this call takes the K-th of
# N shards of the shape list (shape i where i % N == K-1). The shard's shapes go round-robin to the GPUs; each
# GPU's process measures its shapes one after another, each given an equal share of CALL_S (default 480 s) as its
# deadline (a long search stopped by it keeps what it measured, and the table says
# so). Writes $OUT/heldout-PHASE-K-of-N.tar.gz (the phase JSONs, logs and run folders, without compile caches and
# study databases) and prints the merged table of this call last. Merge calls: untar them into one folder, then
#   python tools/heldout_tuner.py --report --out FOLDER --md docs/EFFICIENCY-heldout.md
set -u
[ $# -ge 2 ] || { echo "usage: run.sh GPUS PHASE [K/N] [TOOL OPTIONS...]" >&2; exit 2; }
gpus=${1//,/ }; phase=$2; shift 2
shard=1/1
if [ $# -ge 1 ] && [[ $1 =~ ^[0-9]+/[0-9]+$ ]]; then shard=$1; shift; fi
k=${shard%/*}; n=${shard#*/}
{ [ "$n" -ge 1 ] && [ "$k" -ge 1 ] && [ "$k" -le "$n" ]; } || { echo "run.sh: shard $shard: give K/N with 1 <= K <= N" >&2; exit 2; }
case $phase in tune|long|kt|bare|all) ;; *) echo "run.sh: phase $phase: give tune, long, kt, bare or all" >&2; exit 2;; esac
OUT=${OUT:-/tmp/heldout-out}
CALL_S=${CALL_S:-480}
. tools/device_env.sh || exit 1
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader

mapfile -t all < <(python3 tools/heldout_tuner.py --list | awk '{print $1}')
mine=()
for i in "${!all[@]}"; do [ $(( i % n )) -eq $(( k - 1 )) ] && mine+=("${all[$i]}"); done
read -r -a gpu_list <<< "$gpus"
work=/tmp/heldout-$phase-$k-of-$n
rm -rf "$work"; mkdir -p "$work"
pids=()
for g in "${!gpu_list[@]}"; do
  names=()
  for j in "${!mine[@]}"; do [ $(( j % ${#gpu_list[@]} )) -eq "$g" ] && names+=("${mine[$j]}"); done
  [ ${#names[@]} -gt 0 ] || continue
  phases=1; [ "$phase" = all ] && phases=3
  deadline=$(( CALL_S / (${#names[@]} * phases) ))
  list=$(IFS=,; echo "${names[*]}")
  echo "GPU ${gpu_list[$g]}: $phase on $list (deadline ${deadline} s each)"
  python3 tools/heldout_tuner.py --phase "$phase" --shapes "$list" --gpu "${gpu_list[$g]}" --deadline "$deadline" \
    --out "$work/gpu${gpu_list[$g]}" "$@" > "$work/gpu${gpu_list[$g]}.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
mkdir -p "$OUT"
tar czf "$OUT/heldout-$phase-$k-of-$n.tar.gz" --exclude=cache --exclude=study.db --exclude=kt-work -C "$work" .
tail -n 3 "$work"/gpu*.log
python3 tools/heldout_tuner.py --report --out "$work"
exit $rc
