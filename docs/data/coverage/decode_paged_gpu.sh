#!/usr/bin/env bash
# Decode attention sinks and the paged KV cache on the H100/H200: the GPU tests of tests/test_gpu_decode_sinks_paged.py
# (the gate: NaN poison, ragged lengths with NaN in every unused cache slot, the fp32 reference's tolerance; the ops),
# then our paged decode kernel's time beside the fastest PyTorch path for the same semantics and beside our dense
# decode kernel on the same keys ("paged costs no more than dense"), all measured in this process with
# evotune.gpu.evaluate.time_gpu (CUDA-graph replays). flash-attn is not installed on the GPU host: the anchors are
#   sdpa-dense   SDPA's fastest backend (flash, cuDNN, efficient) on the sequences gathered into a dense cache once,
#                outside the timed call: what a dense cache costs PyTorch (a lower bound for a paged one)
#   gather+sdpa  evotune.torch.decode.paged_fallback: the pages gathered, then SDPA, per call (what the op falls back to)
#   flex         with sinks, FlexAttention (compiled) on the gathered dense cache, the sink through its log-sum-exp
#   sink-math    with sinks, the op's fallback: PyTorch fp32 math with the sink column
# Our kernels: a few fixed configs per case (no search), each timed, the fastest reported, for the paged kernel and
# the dense kernel alike (same configs, same keys). Run from the repository root with .whl carried
# (docs: /work/shared/device/README.md). At most about 7.5 minutes (pytest capped at 200 s, the timings at 230 s).
# Writes $OUT/pytest.log, $OUT/decode_paged.json; prints a table last.
. tools/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_decode_sinks_paged.py -p no:cacheprovider > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? (tail):"; tail -n 15 "$OUT/pytest.log"
timeout 230 python3 - "$OUT" <<'EOF'
import json, math, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from evotune.build.compile import compile_source, load_kernel
from evotune.build.template import instantiate
from evotune.gpu.evaluate import time_gpu
from evotune.problems.decode import PROBLEM as P, dense_kv, flex_sinks_launcher, attention_math, paginate
from evotune.space.searchspace import load_builtin
from evotune.torch.decode import paged_fallback

out_dir = sys.argv[1]
space = load_builtin("attention-decode")
W4 = {"warps": 4, "vec": 8, "unroll": 2, "stages": 2}
W8 = {"warps": 8, "vec": 8, "unroll": 4, "stages": 4}
# (name, paged or sinks shape, ragged lengths or None, configs tried)
CASES = [
    ("llama8b b8 8k p16", "8,32,8,8192,128:bf16:paged=16", None,
     [{**W4, "splits": 4}, {**W8, "splits": 8}, {**W8, "splits": 4, "kv_load": "bulk"}]),
    ("llama8b b8 8k p64", "8,32,8,8192,128:bf16:paged=64", None, [{**W4, "splits": 4}, {**W8, "splits": 8}]),
    ("llama8b b8 8k p256", "8,32,8,8192,128:bf16:paged=256", None, [{**W4, "splits": 4}, {**W8, "splits": 8}]),
    ("llama8b b1 16k p16", "1,32,8,16384,128:bf16:paged=16", None,
     [{**W8, "splits": 16}, {**W8, "splits": 16, "kv_load": "bulk", "combine": "acq_rel", "split_chunks": "even"}]),
    ("llama8b b8 ragged p16", "8,32,8,8192,128:bf16:paged=16", [8192, 1, 100, 2000, 4096, 37, 512, 8000],
     [{**W4, "splits": 4}, {**W8, "splits": 8}]),
    ("gpt-oss b1 8k sinks", "1,64,8,8192,64:bf16:sinks", None, [{**W8, "splits": 16}, {**W4, "splits": 32}]),
    ("gpt-oss b8 4k sinks p16", "8,64,8,4096,64:bf16:sinks:paged=16", None,
     [{**W4, "splits": 4}, {**W8, "splits": 8}]),
]


def kernel_time(shape, knobs, inputs):
    cfg = space.config(knobs)
    viol = space.violations(cfg, P.context(shape))
    if viol:
        return None, None, "not admitted: " + viol[0]
    src = instantiate(P, cfg, shape)
    comp = compile_source(src.code, src.entry)
    kern = load_kernel(comp, P.geometry(cfg, shape).dynamic_smem)
    o = P.new_output(inputs).fill_(math.nan)
    launch = P.launcher(kern, cfg, shape, inputs, o)
    launch(); torch.cuda.synchronize()
    note = f"{cfg.key()} regs {comp.resources.registers} spills {comp.resources.spill_stores}"
    return time_gpu(launch, reps=30).median_us, o.clone(), note


def best_of(shape, configs, inputs, ref):
    rows = []
    for knobs in configs:
        try:
            t, o, note = kernel_time(shape, knobs, inputs)
            err = None if o is None else float((o.float() - ref).abs().max())
            rows.append({"us": t, "max_err": err, "config": note})
        except Exception as e:  # a failure is a row, not the end of the run
            rows.append({"error": f"{type(e).__name__}: {e}"[:300], "config": str(knobs)})
    ok = [r for r in rows if r.get("us")]
    return (min(ok, key=lambda r: r["us"]) if ok else None), rows


def timed(fn):
    res = {}
    call = lambda: res.__setitem__("o", fn())
    call(); torch.cuda.synchronize()
    return time_gpu(call, reps=30).median_us, res["o"]


full = []
for name, text, lengths, configs in CASES:
    shape = P.parse_shape(text)
    inputs = P.make_inputs(shape, seed=11)
    if lengths is not None:
        lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        inputs["cache_seqlens"] = lens
    ref = P.reference(shape, inputs)
    rec = {"case": name, "shape": text, "lengths": lengths}
    best, rows = best_of(shape, configs, inputs, ref)
    rec["ours"], rec["ours_configs"] = best, rows
    k, v, visible = dense_kv(shape, inputs)
    if shape.paged:  # our dense kernel on the same keys (equal lengths only: the dense kernel has one length)
        if lengths is None:
            from dataclasses import replace
            dense = replace(shape, page_size=0)
            dense_inputs = {"q": inputs["q"], "k": k, "v": v, "scale": inputs["scale"]}
            if shape.sinks:
                dense_inputs["sinks"] = inputs["sinks"]
            rec["ours_dense"], rec["ours_dense_configs"] = best_of(dense, configs, dense_inputs, ref)
        try:
            sinks = inputs.get("sinks")
            t, o = timed(lambda: paged_fallback(inputs["q"], inputs["k"], inputs["v"], inputs["block_table"],
                                                inputs["cache_seqlens"], shape.causal, inputs["scale"], sinks,
                                                int(inputs["cache_seqlens"].max())))
            rec["gather+sdpa" if sinks is None else "gather+sink-math"] = {
                "us": t, "max_err": float((o.float() - ref).abs().max())}
        except Exception as e:
            rec["gather+sdpa"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    anchors = {}
    if shape.sinks:
        try:
            anchors["flex"] = timed(flex_sinks_launcher(inputs["q"], k, v, inputs["scale"], visible, inputs["sinks"]))
        except Exception as e:
            anchors["flex"] = e
        try:
            anchors["sink-math"] = timed(lambda: attention_math(inputs["q"], k, v, inputs["scale"], visible,
                                                                inputs["sinks"]))
        except Exception as e:
            anchors["sink-math"] = e
    else:
        gqa = {"enable_gqa": True} if shape.kv_heads != shape.heads else {}
        for bname, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                               ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            def run(backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(inputs["q"], k, v, attn_mask=visible,
                                                          scale=inputs["scale"], **gqa)
            try:
                anchors["sdpa-" + bname] = timed(run)
            except Exception as e:
                anchors["sdpa-" + bname] = e
    rec["anchors"] = {n: ({"error": f"{type(a).__name__}: {a}"[:200]} if isinstance(a, Exception) else
                          {"us": a[0], "max_err": float((a[1].float() - ref).abs().max())}) for n, a in anchors.items()}
    done = {n: a for n, a in rec["anchors"].items() if a.get("us")}
    rec["fastest_anchor"] = min(done, key=lambda n: done[n]["us"]) if done else None
    full.append(rec)
    print(json.dumps(rec), flush=True)
    # written after every case: a run cut short by its timeout keeps what it measured
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": full},
              open(f"{out_dir}/decode_paged.json", "w"), indent=1)

print(f"\n{'case':26} {'ours us':>8} {'dense us':>9} {'pg/dense':>8} {'anchor':>16} {'anchor us':>9} {'x anchor':>8} "
      f"{'gather us':>9} {'max err':>9}")
for rec in full:
    o, d = rec.get("ours") or {}, rec.get("ours_dense") or {}
    a = rec["anchors"].get(rec["fastest_anchor"] or "", {})
    g = rec.get("gather+sdpa") or rec.get("gather+sink-math") or {}
    f = lambda x: f"{x:.1f}" if isinstance(x, (int, float)) else "-"
    ratio = f"{o['us'] / d['us']:.2f}" if o.get("us") and d.get("us") else "-"
    xa = f"{a['us'] / o['us']:.2f}" if o.get("us") and a.get("us") else "-"
    err = f"{o['max_err']:.2e}" if o.get("max_err") is not None else "-"
    print(f"{rec['case']:26} {f(o.get('us')):>8} {f(d.get('us')):>9} {ratio:>8} {str(rec['fastest_anchor']):>16} "
          f"{f(a.get('us')):>9} {xa:>8} {f(g.get('us')):>9} {err:>9}")
EOF
echo "bench rc=$?"
