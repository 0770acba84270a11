"""Experiment only: time variants (config JSON over the full attention space, constraints NOT checked, plus an
optional source-rewrite hook) of one shape, gated, then interleaved with SDPA flash and cudnn.
    python3 hooktime.py SHAPE 'label|{json}|hook.py' ...
"""
import json, os, sys, warnings
sys.path.insert(0, os.getcwd())
warnings.filterwarnings("ignore")
from evotune.build.compile import compile_source, load_kernel
from evotune.build.template import instantiate
from evotune.gpu.evaluate import bind_kernel, evaluate_compiled, measure_baselines
from evotune.gpu.interleave import DEFAULT_ROUNDS, head_to_head, split_reps
from evotune.problems import get_problem
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin

problem, space = get_problem("attention"), load_builtin("attention")
shape = parse_shape(sys.argv[1])
kernels, lines = {}, []
for item in sys.argv[2:]:
    label, text, *hook = item.split("|")
    cfg = space.config(json.loads(text))
    src = instantiate(problem, cfg, shape)
    code = src.code
    if hook and hook[0]:
        exec(open(hook[0]).read())
    compiled = compile_source(code, src.entry)
    res = evaluate_compiled(problem, shape, cfg, compiled)
    lines.append(f"{label:<14} {res.status:<6} solo {res.time_us or 0:8.2f} us regs {res.resources['registers']} "
                 f"spill {res.resources.get('spill_stores')} gate {((res.verification or {}).get('gate_ratio') or 0):.3f} {res.message[:50]}")
    if res.ok:
        kernels[label] = bind_kernel(problem, shape, cfg, load_kernel(compiled, problem.geometry(cfg, shape).dynamic_smem))
base = measure_baselines(problem, shape, names=["flash", "cudnn"])
avail = [n for n, b in base.items() if b.get("available")]
result, violations = head_to_head(problem, shape, kernels, avail, DEFAULT_ROUNDS, split_reps(100))
out = {"shape": shape.spec, "lines": lines, "violations": {k: str(v) for k, v in violations.items()}}
if result:
    out["interleaved"] = d = result.as_dict()
    for k in kernels:
        if k in d["timings"] and k not in violations:
            r = result.ratios(k, "cudnn")
            lines.append(f"{k:<14} {d['timings'][k]['median_us']:9.2f} us  cudnn/this {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})")
    for n in avail:
        lines.append(f"{n:<14} {d['timings'][n]['median_us']:9.2f} us")
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), f"hook-{sys.argv[1]}.json"), "w"), indent=1, default=str)
print(f"== {sys.argv[1]}")
print("\n".join(lines))
