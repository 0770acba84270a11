"""Time the enumeration of every built-in space on its family's presets (CPU only; house rule 11: measured here,
reported in docs/PERFORMANCE.md "Space enumeration", never asserted in a test):

    python tools/space_timings.py                  # every built-in space, every preset of its family
    python tools/space_timings.py attention        # some spaces only
    python tools/space_timings.py --json t.json    # every figure, for the record

Each space runs in a fresh process. `cold`: SearchSpace.admitted_configs the first time on that shape in the
process (the space's expressions compiled on the first shape; numpy imported before); `warm`: the same call again;
`check`: check_nonempty (what `evotune search` and `check` run before enumerating), warm. Seconds, wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _child(name: str) -> list[dict]:
    import numpy  # noqa: F401 - imported before the clock: every evotune command has it loaded already

    from evotune.problems import get_problem
    from evotune.space.searchspace import check_nonempty, load_builtin

    space = load_builtin(name)
    problem = get_problem(space.family)
    rows = []
    for preset in problem.presets():
        context = problem.context(problem.parse_shape(preset))
        figures = {}
        for label in ("cold", "warm"):
            start = time.perf_counter()
            admitted = space.admitted_configs(context)
            figures[label] = time.perf_counter() - start
        start = time.perf_counter()
        try:
            check_nonempty(space, context)
        except Exception:  # noqa: BLE001 - nothing admitted: timed all the same
            pass
        figures["check"] = time.perf_counter() - start
        rows.append({"space": name, "shape": preset, "configs": space.size(), "admitted": len(admitted), **figures})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spaces", nargs="*", help="built-in space names (default: all)")
    parser.add_argument("--json", help="write every row to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.child:
        print(json.dumps(_child(args.child)))
        return
    from evotune.space.searchspace import builtin_names

    rows = []
    print(f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"{'space':28} {'shape':16} {'configs':>15} {'admitted':>9} {'cold s':>7} {'warm s':>7} {'check s':>7}")
    for name in args.spaces or builtin_names():
        out = subprocess.run([sys.executable, __file__, "--child", name], cwd=REPO, check=True,
                             capture_output=True, text=True).stdout
        for row in json.loads(out.strip().splitlines()[-1]):
            rows.append(row)
            print(f"{row['space']:28} {row['shape']:16} {row['configs']:>15,} {row['admitted']:>9,} "
                  f"{row['cold']:>7.2f} {row['warm']:>7.2f} {row['check']:>7.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
