"""Gate ratio of every (seed, input pattern) case, for SDPA's backends and a few evotune configs
(developer tool, GPU). Shows how much margin each passes the gate by; writes JSON to $OUT.

    python3 tools/gate_report.py "mission;1,4,1000,128:bf16:causal"
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

from evotune.build.compile import compile_source, load_kernel  # noqa: E402
from evotune.gpu.evaluate import kernel_runner, verify  # noqa: E402
from evotune.problems import get_problem  # noqa: E402
from evotune.problems.shapes import parse_shape  # noqa: E402
from evotune.space.searchspace import load_builtin  # noqa: E402
from evotune.build.template import instantiate  # noqa: E402

CONFIGS = {
    "default": {},
    "M32N128pw2st1": dict(block_m=32, block_n=128, compute_warps=2, producer_warps=2, stages=1, q_in_regs=False),
    "M32N32kv4": dict(block_m=32, block_n=32, compute_warps=2, kv_splits=4, q_in_regs=False),
}


def main() -> None:
    problem, space = get_problem("attention"), load_builtin("attention")
    report = {}
    for text in (sys.argv[1] if len(sys.argv) > 1 else "mission").split(";"):
        shape = parse_shape(text)
        rows = {}
        for name in ("flash", "cudnn", "efficient"):
            if problem.baseline_launcher(name, shape, problem.make_inputs(shape, 0)) is None:
                continue

            def run_into(inputs, out, name=name):
                out.copy_(problem.baseline_launcher(name, shape, inputs, probe=False)())

            rows[f"SDPA {name}"] = verify(problem, shape, run_into).as_dict()
        for label, cfg_dict in CONFIGS.items():
            cfg = space.config(cfg_dict)
            if not space.admitted(cfg, problem.context(shape)):
                continue
            src = instantiate(problem, cfg, shape)
            kernel = load_kernel(compile_source(src.code, src.entry), problem.geometry(cfg, shape).dynamic_smem)
            rows[f"evotune {label}"] = verify(problem, shape, kernel_runner(problem, shape, cfg, kernel)).as_dict()
        report[shape.spec] = rows
        cases = list(next(iter(rows.values()))["case_ratios"])
        print(f"\n{shape.spec}: gate ratio per case (pass <= 1)")
        print(f"{'':24}" + "".join(f"{c.split(':')[1][:12]:>13}" for c in cases) + "   dependency")
        for who, v in rows.items():
            print(f"{who:24}" + "".join(f"{v['case_ratios'][c]:13.3f}" for c in cases) + "   " + v["dependency"][:40])
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "gate_report.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
