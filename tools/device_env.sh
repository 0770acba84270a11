# Sourced by the device scripts (docs/data/*/*.sh, tools/gpu_jobs.sh) from the repository root:
#   . tools/device_env.sh || exit 1
# Where optuna is missing (the GPU machine's image lacks it), the carried wheels (.whl) are installed into /tmp/site
# (once: a later script finds optuna); PYTHONPATH then reaches them and this tree, and Python's output is unbuffered.
if ! python3 -c "import optuna" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || return 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
