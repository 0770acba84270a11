set -u
export EVOTUNE_RUNS=/tmp/runs; mkdir -p /tmp/runs; cp -r runs/long-8k-h100-warm-rescale /tmp/runs/
C='{"mma":"wgmma","block_m":192,"block_n":128,"compute_warps":12,"producer_warps":4,"stages":2,"q_in_regs":false,"persistent":true,"pingpong":false,"epilogue":"regs","rescale":"RS"}'
for rs in lazy always; do
  timeout 150 ncu --target-processes all -k regex:evotune_attention -s 3 -c 1 --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
    python3 -m evotune verify --config "${C/RS/$rs}" --shape long-8k --space search_spaces/attention-hopper3-rescale.yaml --launches 2 > $OUT/ncu-$rs.txt 2>&1 || echo "ncu $rs failed"
  echo "== $rs"; grep -E "Duration|Issue Slots Busy|highest-utilized|Achieved Occupancy|Compute \(SM\)|No Eligible" $OUT/ncu-$rs.txt | head -8
done
