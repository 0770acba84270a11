# Call 5: Nsight Compute on the gpt2 winners of the four-warpgroup searches and on the 192-row winner they replace
# (tools/tma_store_device.sh's ncu step: one launch of each run's best under `evotune verify`).
set -u
STEPS=ncu NCU_RUNS="gpt2-h100-exhaustive-wg4 gpt2-h100-exhaustive-skip gpt2-bf16-h100-exhaustive-wg4" \
  bash tools/tma_store_device.sh
