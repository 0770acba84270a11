"""Device-side correctness and timing sweep (developer tool, one call to the GPU machine).

Compiles a sample of admitted configs for several shapes (in parallel on the CPU cores),
verifies every one against the fp32 reference and times those on the first shape beside
the SDPA backends. Full records go to $OUT/sweep.jsonl; a short table is printed last.

    python3 tools/device_sweep.py --shapes mission,2,3,200,333,64 --sample 40
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evotune.build.compile import CompileError, compile_source  # noqa: E402
from evotune.problems import get_problem  # noqa: E402
from evotune.problems.shapes import parse_shape  # noqa: E402
from evotune.space.searchspace import load_builtin  # noqa: E402
from evotune.build.template import instantiate  # noqa: E402


def _compile(args):
    shape_text, cfg_dict = args
    problem = get_problem("attention")
    space = load_builtin("attention")
    shape = parse_shape(shape_text)
    cfg = space.config(cfg_dict)
    src = instantiate(problem, cfg, shape)
    try:
        return shape_text, cfg_dict, compile_source(src.code, src.entry), None
    except CompileError as e:
        return shape_text, cfg_dict, None, str(e)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="mission")
    ap.add_argument("--sample", type=int, default=40)
    ap.add_argument("--time-first", action="store_true", help="time candidates on the first shape")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out_dir, exist_ok=True)
    shapes = args.shapes.split(";")
    problem = get_problem("attention")
    space = load_builtin("attention")

    jobs = []
    for st in shapes:
        shape = parse_shape(st)
        admitted = space.admitted_configs(problem.context(shape))
        rng = random.Random(args.seed)
        sample = admitted if len(admitted) <= args.sample else rng.sample(admitted, args.sample)
        if space.default_config() in admitted and space.default_config() not in sample:
            sample.append(space.default_config())
        jobs += [(st, c.as_dict()) for c in sample]
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        compiled = list(pool.map(_compile, jobs))
    print(f"compiled {len(jobs)} candidates in {time.time() - t0:.1f}s", flush=True)

    import torch

    from evotune.gpu.evaluate import evaluate_compiled, measure_baselines

    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} cuda {torch.version.cuda}", flush=True)
    rows = []
    with open(os.path.join(out_dir, "sweep.jsonl"), "w") as f:
        for i, st in enumerate(shapes):
            shape = parse_shape(st)
            base = measure_baselines(problem, shape, names=["flash", "cudnn", "efficient", "math"])
            f.write(json.dumps({"shape": st, "baselines": base}) + "\n")
            for name, b in base.items():
                if b.get("available"):
                    print(f"  {st:>24} SDPA {name:>9}: {b['time_us']:8.2f} us  max_abs {b['verification']['max_abs']:.3g}")
            for sst, cfg_dict, comp, err in compiled:
                if sst != st:
                    continue
                cfg = space.config(cfg_dict)
                if comp is None:
                    rec = {"status": "compile_error", "message": err}
                else:
                    try:
                        rec = evaluate_compiled(problem, shape, cfg, comp, time_it=(i == 0 and args.time_first)).as_dict()
                    except Exception as e:  # a fault here is a kernel bug worth seeing in full
                        rec = {"status": "launch_error", "message": f"{type(e).__name__}: {e}"}
                rec.update(shape=st, config=cfg_dict)
                f.write(json.dumps(rec) + "\n")
                f.flush()
                rows.append(rec)
    print()
    print(f"{'shape':>24} {'n':>4} {'ok':>4} {'wrong':>5} {'pruned':>6} {'other':>5} {'worst_ok_err':>12}")
    for st in shapes:
        rs = [r for r in rows if r["shape"] == st]
        ok = [r for r in rs if r["status"] == "ok"]
        wrong = [r for r in rs if r["status"] == "wrong"]
        pruned = [r for r in rs if r["status"] == "pruned"]
        worst = max((r["max_abs"] for r in ok), default=float("nan"))
        print(f"{st:>24} {len(rs):>4} {len(ok):>4} {len(wrong):>5} {len(pruned):>6} {len(rs)-len(ok)-len(wrong)-len(pruned):>5} {worst:12.3g}")
    for r in rows:
        if r["status"] in ("wrong", "launch_error", "compile_error"):
            print("FAIL", r["shape"], r["config"], r["status"], r["message"][:200])
    timed = sorted((r for r in rows if r.get("time_us")), key=lambda r: r["time_us"])
    for r in timed[:8]:
        print(f"{r['time_us']:8.2f} us  err {r['max_abs']:.2e}  regs {r['resources']['registers']:3d}  {r['config']}")


if __name__ == "__main__":
    main()
