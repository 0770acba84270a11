#!/usr/bin/env bash
# Variable-length packed batches (varlen, cu_seqlens) on the Hopper kernel: the GPU tests of tests/test_varlen.py and
# tests/test_varlen_op.py (the gate with NaN poison and one sequence's perturbed key, guard rows around the packed
# output, uniform lengths bitwise equal to the dense kernel, the op's kernel route and graph capture), then one fixed
# Hopper config (wgmma, 128x128 tiles, 8 compute + 4 producer warps, 2 stages, one tile per CTA) timed on packed
# batches beside the same config on the dense batch of the same tokens (as many sequences, each of the mean length),
# FlexAttention (torch.compile) with a document mask over the packed rows, and SDPA's flash and cuDNN backends on that
# dense batch, all in this process with evotune.gpu.evaluate.time_gpu (CUDA-graph replays, median of 30).
# Run from the repository root with .whl carried (docs: /work/shared/device/README.md). At most about 7.5 minutes
# (pytest capped at 240 s, the timings at 200 s; FlexAttention compiles once per case).
# Writes $OUT/pytest.log, $OUT/varlen.json; prints a table last.
. tools/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 240 python3 -m pytest -q -m gpu tests/test_varlen.py tests/test_varlen_op.py -p no:cacheprovider \
  > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? (tail):"; tail -n 15 "$OUT/pytest.log"
timeout 200 python3 - "$OUT" <<'EOF'
import json, math, sys
import torch
from evotune.build.compile import compile_source, load_kernel
from evotune.build.template import instantiate
from evotune.gpu.evaluate import time_gpu
from evotune.problems.attention import PROBLEM as A
from evotune.problems.shapes import Shape, parse_shape
from evotune.space.searchspace import load_builtin

out_dir = sys.argv[1]
space = load_builtin("attention")
HOPPER = {"mma": "wgmma", "block_m": 128, "compute_warps": 8, "producer_warps": 4, "block_n": 128, "stages": 2,
          "q_in_regs": False}
CASES = [
    "8,32,2048,128:bf16:causal:kv8:varlen=2048*8",                           # uniform: the packing's own cost
    "22,32,4096,128:bf16:causal:kv8:varlen=4096/2048/1024*4/512*8/256*8",    # a packed training batch, 16k tokens
    "33,32,8192,128:bf16:causal:kv8:varlen=8192/256*32",                     # one long + many short
    "64,16,512,64:bf16:causal:varlen=512*16/384*16/256*16/128*16",           # many short, d64
    "8,16,4096,128:bf16:varlen=4096/3000/2000/1000/512/300/100/1",           # non-causal, ragged
]


def dense_of(shape):
    """As many sequences, each of the mean length (the same tokens), dense (token-major)."""
    mean = max(1, round(shape.total_q / shape.batch))
    return Shape(shape.batch, shape.heads, mean, mean, shape.head_dim, shape.dtype, shape.causal, "bshd",
                 shape.kv_heads)


def ours(shape, inputs):
    cfg = space.config(HOPPER)
    viol = space.violations(cfg, A.context(shape))
    if viol:
        return None, None, "not admitted: " + viol[0]
    src = instantiate(A, cfg, shape)
    comp = compile_source(src.code, src.entry)
    kern = load_kernel(comp, A.launch_plan(cfg, shape).dynamic_smem)
    out = A.new_output(inputs).fill_(math.nan)
    launch = A.launcher(kern, cfg, shape, inputs, out)
    launch(); torch.cuda.synchronize()
    return time_gpu(launch, reps=30).median_us, out, f"regs {comp.resources.registers} spills {comp.resources.spill_stores}"


def timed(run):
    res = {}
    call = lambda: res.__setitem__("o", run())
    call(); torch.cuda.synchronize()
    return time_gpu(call, reps=30).median_us, res["o"]


rows = []
for text in CASES:
    shape = parse_shape(text)
    dense = dense_of(shape)
    rec = {"shape": text, "dense": dense.spec, "tokens": shape.total_q, "tflop": shape.flops() / 1e12,
           "dense_tflop": dense.flops() / 1e12}
    try:
        inputs = A.make_inputs(shape, seed=11)
        ref = A.reference(shape, inputs)
        t, o, note = ours(shape, inputs)
        rec["ours"] = {"us": t, "max_err": None if o is None else float((o.float() - ref).abs().max()), "note": note}
        dense_inputs = A.make_inputs(dense, seed=11)
        td, _, _ = ours(dense, dense_inputs)
        rec["dense_us"] = td
        for name in ("flash", "cudnn"):
            try:
                run = A.baseline_launcher(name, dense, dense_inputs)
                rec[f"sdpa_{name}_dense_us"] = timed(run)[0] if run is not None else None
            except Exception as e:
                rec[f"sdpa_{name}_dense_us"] = None
                rec[f"sdpa_{name}_error"] = f"{type(e).__name__}: {e}"[:200]
    except Exception as e:  # a failure is a row, not the end of the run
        rec["ours"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    try:
        tf, of = timed(A.baseline_launcher("flex", shape, inputs, probe=False))
        rec["flex"] = {"us": tf, "max_err": float((of.float() - ref).abs().max())}
    except Exception as e:
        rec["flex"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    rows.append(rec)
    print(json.dumps(rec), flush=True)
    # written after every case: a run cut short by its timeout keeps what it measured
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "config": HOPPER, "cases": rows},
              open(f"{out_dir}/varlen.json", "w"), indent=1)

print(f"\n{'packed shape':62} {'ours us':>8} {'TF/s':>6} {'dense us':>8} {'TF/s':>6} {'flex us':>8} {'x flex':>6} "
      f"{'best sdpa dense':>15} {'max err':>8}")
for rec in rows:
    r, f = rec.get("ours", {}), rec.get("flex", {})
    if r.get("us") is None:
        print(f"{rec['shape']:62} {r.get('error', r.get('note', ''))[:80]}")
        continue
    tf = rec["tflop"] * 1e6 / r["us"]
    td = rec["dense_tflop"] * 1e6 / rec["dense_us"] if rec.get("dense_us") else 0
    fx = f"{f['us'] / r['us']:.2f}" if f.get("us") else "-"
    sd = [rec.get(f"sdpa_{n}_dense_us") for n in ("flash", "cudnn")]
    sd = min([s for s in sd if s] or [0])
    print(f"{rec['shape']:62} {r['us']:8.1f} {tf:6.0f} {rec.get('dense_us') or 0:8.1f} {td:6.0f} "
          f"{f.get('us') or 0:8.1f} {fx:>6} {sd:15.1f} {r['max_err']:8.1e}")
print("TF/s: each row's own FLOPs (packed: the sum over its sequences; dense: B x the mean length's); targets: ours "
      "within 5% of the dense batch's TF/s, >= 1.2x FlexAttention")
EOF
echo "bench rc=$?"
