"""Verify and time given configs beside the SDPA backends, in one process (developer tool, GPU).

    python3 tools/time_configs.py mission '{"block_m":16,"warp_key_groups":4}' '{...}'
"""

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

from evotune.build.compile import compile_source  # noqa: E402
from evotune.gpu.evaluate import evaluate_compiled, measure_baselines  # noqa: E402
from evotune.problems import get_problem  # noqa: E402
from evotune.problems.shapes import parse_shape  # noqa: E402
from evotune.space.searchspace import load_builtin  # noqa: E402
from evotune.build.template import instantiate  # noqa: E402


def main() -> None:
    problem, space = get_problem("attention"), load_builtin("attention")
    shape = parse_shape(sys.argv[1])
    rows = []
    for text in sys.argv[2:]:
        cfg = space.config(json.loads(text))
        why = space.violations(cfg, problem.context(shape))
        if why:
            rows.append((text, "not admitted: " + "; ".join(why)))
            continue
        src = instantiate(problem, cfg, shape)
        res = evaluate_compiled(problem, shape, cfg, compile_source(src.code, src.entry))
        rows.append((text, f"{res.status:<7} {res.time_us or 0:8.2f} us  regs {res.resources['registers']}  "
                           f"gate {((res.verification or {}).get('gate_ratio') or 0):.3f} {res.message[:60]}"))
    base = measure_baselines(problem, shape, names=["flash", "cudnn"])
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "time_configs.json"), "w") as f:
        json.dump({"shape": shape.spec, "configs": rows, "baselines": base}, f, indent=1)
    for name, b in base.items():
        print(f"SDPA {name:<8} {b.get('time_us', float('nan')):8.2f} us")
    for text, line in rows:
        print(f"{line}   {text}")


if __name__ == "__main__":
    main()
