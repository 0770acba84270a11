#!/usr/bin/env bash
# Run independent jobs side by side, one per GPU of a multi-GPU machine, in one device call:
#   bash tools/gpu_jobs.sh "bash docs/data/decode/run.sh" "bash docs/data/model/host2.sh" ...
# Job i runs with CUDA_VISIBLE_DEVICES=i (i < the GPUs visible), its own OUT ($OUT/jobI) and its own TMPDIR, and
# its stdout+stderr in $OUT/jobI/log.txt; the carried wheels (.whl) are installed once, before any job starts, since
# concurrent installs into one --target would race. Each job's folder is then packed into $OUT/jobI.tar.gz (the
# device tool returns at most 8 files) and the tail of each log is printed last, job by job.
# Jobs share the host's CPUs: a host-overhead figure measured beside other jobs is compared only with its own
# process's SDPA rows, never across jobs.
set -u
OUT=${OUT:-/tmp/gpu-jobs}
TAIL=${TAIL:-25}
[ $# -ge 1 ] || { echo "usage: gpu_jobs.sh CMD [CMD ...]" >&2; exit 2; }
ngpu=$(nvidia-smi -L | wc -l)
[ $# -le "$ngpu" ] || { echo "gpu_jobs.sh: $# jobs but $ngpu GPUs" >&2; exit 2; }
. tools/device_env.sh || exit 1
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
i=0; pids=()
for cmd in "$@"; do
  d=$OUT/job$i; mkdir -p "$d" "/tmp/job$i-tmp"
  echo "$cmd" > "$d/cmd.txt"
  ( export CUDA_VISIBLE_DEVICES=$i OUT=$d TMPDIR=/tmp/job$i-tmp; s=$SECONDS; bash -c "$cmd" > "$d/log.txt" 2>&1
    echo "rc=$? after $((SECONDS - s)) s" >> "$d/log.txt" ) &
  pids+=($!); i=$((i + 1))
done
wait "${pids[@]}"
for ((j = 0; j < i; j++)); do
  d=$OUT/job$j
  tar -czf "$OUT/job$j.tar.gz" -C "$d" . && rm -rf "$d"
  echo; echo "=== job$j: $(tar -xzOf "$OUT/job$j.tar.gz" ./cmd.txt)"
  tar -xzOf "$OUT/job$j.tar.gz" ./log.txt | tail -n "$TAIL"
done
