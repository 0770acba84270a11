"""`evotune check` without a GPU: enumerate a space's admitted configs on a shape, compile a sample of
them with NVRTC in worker processes, and report registers, spills and shared memory against the
static gate. The CLI draws the progress; this module reports it through callbacks.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Optional

Progress = Callable[[int, int], None]  # (done, total)


def admitted_configs(space, context: dict, on_progress: Optional[Progress] = None) -> tuple[list, int, float]:
    """(admitted configs in file order, configs in the space, seconds), through the space's pruned enumeration
    (SearchSpace.admitted_configs: ~1 s for the full attention space on the mission shape). The loop it replaces
    asked space.admitted of every config: 241 s on CI's CPU once attention.yaml reached 9.2 M configs. Progress is
    reported once, at the end (done = total = the space's size)."""
    start = time.perf_counter()
    admitted = space.admitted_configs(context)
    total = space.size()
    if on_progress is not None:
        on_progress(total, total)
    return admitted, total, time.perf_counter() - start


def pick(admitted: list, sample: int, seed: int) -> list:
    """`sample` of the admitted configs drawn with `seed` (all of them for 0 or a sample at least as large)."""
    if sample < 0:
        raise ValueError("sample must be 0 (all) or positive")  # the CLI refuses it first, in the user's words
    if sample == 0 or sample >= len(admitted):
        return list(admitted)
    return random.Random(seed).sample(admitted, sample)


def check_one(args: tuple) -> dict:
    """Compile one config (in a compile-pool process) and judge it by the static gate."""
    family, shape_dict, space_path, cfg_dict = args
    from ..build.compile import CompileError, compile_source, launch_violations
    from ..problems import get_problem
    from ..space.searchspace import load_space
    from ..build.template import instantiate

    problem = get_problem(family)
    shape = problem.shape_from_dict(shape_dict)
    space = load_space(space_path, tuple(problem.context(shape)), problem.knob_domains())
    cfg = space.config(cfg_dict)
    src = instantiate(problem, cfg, shape)
    geo = src.geometry
    try:
        c = compile_source(src.code, src.entry)
    except CompileError as e:
        return {"config": cfg_dict, "status": "compile_error", "message": str(e)}
    why = launch_violations(c.resources, geo)
    return {"config": cfg_dict, "status": "pruned" if why else "ok", "message": "; ".join(why),
            "resources": c.resources.as_dict(), "threads": geo.threads, "dynamic_smem": geo.dynamic_smem,
            "compile_seconds": c.compile_seconds, "cached": c.cached}


def compile_all(problem, shape, space, configs: list, jobs: int, on_progress: Optional[Progress] = None) -> list[dict]:
    """check_one of each config, in order, on `jobs` processes that die with this one (compile.compile_pool:
    a SIGTERM or SIGKILL here leaves no worker behind). Interrupted, it cancels what has not started."""
    from ..build.compile import compile_pool

    work = [(problem.family, shape.as_dict(), space.path, c.as_dict()) for c in configs]
    rows: list[dict] = []
    if not work:
        return rows
    pool = compile_pool(max(1, min(jobs, len(work))))
    try:
        for row in pool.map(check_one, work):
            rows.append(row)
            if on_progress is not None:
                on_progress(len(rows), len(work))
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)  # Ctrl-C: do not wait for hundreds of queued compiles
        raise
    pool.shutdown(wait=True)
    return rows


def summarize(space, shape, enumerated: int, admitted: int, rows: list[dict], enumerate_seconds: float,
              compile_seconds: float) -> dict:
    """The summary `evotune check` prints and puts in --json."""
    return {"space": space.path, "shape": shape.spec, "space_size": enumerated, "admitted": admitted,
            "compiled": len(rows), "ok": sum(r["status"] == "ok" for r in rows),
            "pruned_static": sum(r["status"] == "pruned" for r in rows),
            "compile_errors": sum(r["status"] == "compile_error" for r in rows),
            "enumerate_seconds": round(enumerate_seconds, 1), "seconds": round(compile_seconds, 1)}
