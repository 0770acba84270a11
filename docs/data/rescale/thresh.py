"""Explanation experiment (not a config): the lazy_rescale winner configs with the threshold 8 replaced by 4 and 0 in
the source, beside eager; per variant the gate's case ratios and an interleaved timing with cudnn."""
import json, os, sys, warnings
sys.path.insert(0, os.getcwd()); warnings.filterwarnings("ignore")
from evotune.build.compile import compile_source, load_kernel
from evotune.build.template import instantiate
from evotune.gpu.evaluate import bind_kernel, evaluate_compiled, measure_baselines
from evotune.gpu.interleave import DEFAULT_ROUNDS, head_to_head, split_reps
from evotune.problems import get_problem
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin

P, S = get_problem("attention"), load_builtin("attention-hopper3-lazy")
H = dict(mma="wgmma")
CFG = {"gpt2": dict(H, block_m=64, block_n=128, compute_warps=4, producer_warps=0, stages=2, q_in_regs=False,
                    pingpong=False, persistent=False, epilogue="tma"),
       "llama-4k": dict(H, block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=2, q_in_regs=True,
                        pingpong=False, persistent=True, epilogue="tma"),
       "long-8k": dict(H, block_m=192, block_n=128, compute_warps=12, producer_warps=4, stages=2, q_in_regs=False,
                       pingpong=False, persistent=True, epilogue="regs")}
out = {}
for shape_text in sys.argv[1:]:
    base = shape_text.split(":")[0]
    shape = parse_shape(shape_text)
    kernels, rows = {}, {}
    for label, lazy, thr in (("eager", False, None), ("lazy8", True, None), ("lazy4", True, "4.f"), ("lazy0", True, "0.f")):
        cfg = S.config(dict(CFG[base], lazy_rescale=lazy))
        src = instantiate(P, cfg, shape)
        code = src.code
        if thr:
            assert code.count("* scale_log2 > 8.f;") == 1
            code = code.replace("* scale_log2 > 8.f;", f"* scale_log2 > {thr};")
        compiled = compile_source(code, src.entry)
        res = evaluate_compiled(P, shape, cfg, compiled)
        v = res.verification or {}
        rows[label] = {"status": res.status, "solo_us": res.time_us, "gate_ratio": v.get("gate_ratio"),
                       "case_ratios": v.get("case_ratios"), "max_abs": v.get("max_abs"), "msg": res.message}
        if res.ok:
            kernels[label] = bind_kernel(P, shape, cfg, load_kernel(compiled, P.geometry(cfg, shape).dynamic_smem))
    base_t = measure_baselines(P, shape, names=["cudnn"])
    result, viol = head_to_head(P, shape, kernels, ["cudnn"], DEFAULT_ROUNDS, split_reps(100))
    d = result.as_dict()
    for k in kernels:
        rows[k]["interleaved_us"] = d["timings"][k]["median_us"]
        rows[k]["vs_cudnn"] = result.ratios(k, "cudnn")
    rows["cudnn_us"] = d["timings"]["cudnn"]["median_us"]
    out[shape_text] = rows
    print(f"== {shape_text}: cudnn {rows['cudnn_us']:.2f} us")
    for k in kernels:
        r = rows[k]
        cr = r["case_ratios"] or {}
        print(f"  {k:6} {r['interleaved_us']:9.2f} us  vs cudnn {json.dumps(r['vs_cudnn'])[:60]}  gate {r['gate_ratio']:.3f} "
              + " ".join(f"{c.split(':')[1][:6]}={x:.2f}" for c, x in cr.items()))
    json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "thresh.json"), "w"), indent=1)
