"""Where a GPU worker's start goes, step by step, in a fresh process on an idle machine (GPU needed).

The search's timeline.jsonl records the worker's start in a few parts (spawn, import cupy, import torch, CUDA
context, device info) while the search runs beside it; this splits the same work finer, alone, so that what
contention adds and what each step costs on its own can be told apart.

    python tools/worker_start_probe.py [--json FILE]      # run it twice: the first pays the cold page cache
    python tools/worker_start_probe.py --worker            # a real GPUWorker's start and first answer, as the
                                                           # search's timeline splits them ("gpu start: ...")
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def through_worker() -> dict:
    """A GPUWorker started from this process (idle), asked for the device info: its start's parts and the info's."""
    from evotune.gpu.workers import GPUWorker

    started = time.perf_counter()
    with GPUWorker(device=0) as worker:
        worker.info()
        total = time.perf_counter() - started
        parts = {**worker.start_phases, **{f"device info: {k}": s for k, s in worker.info_seconds.items()}}
    for name, s in parts.items():
        print(f"  {name:55s} {s:7.3f} s")
    print(f"  {'the rest':55s} {total - sum(parts.values()):7.3f} s")
    print(f"  {'total':55s} {total:7.3f} s")
    return {"steps": {k: round(v, 4) for k, v in parts.items()}, "total": round(total, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--worker", action="store_true", help="time a real GPUWorker's start instead of the steps alone")
    args = ap.parse_args()
    if args.worker:
        out = through_worker()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return
    from evotune.gpu.evaluate import Phases  # the worker's own step timer (no torch or CuPy behind it)

    phases = Phases()
    done = phases.lap
    import cupy
    done("import cupy")
    import torch
    done("import torch")
    torch.cuda.set_device(0)
    cupy.cuda.Device(0).use()
    done("torch.cuda.set_device + cupy Device.use")
    torch.cuda.get_device_properties(0)
    done("torch.cuda.get_device_properties (torch's CUDA init)")
    cupy.cuda.runtime.driverGetVersion()
    done("cupy driverGetVersion")
    from evotune.gpu.workers import _driver_string, gpu_clocks
    done("import evotune.gpu.workers")
    _driver_string()
    done("driver version (/proc or nvidia-smi)")
    torch.backends.cudnn.version()
    done("torch.backends.cudnn.version() (loads cuDNN)")
    x = torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    done("first tensor on the GPU")
    from evotune.problems import get_problem
    problem = get_problem("attention")
    shape = problem.parse_shape("mission")
    inputs = problem.make_inputs(shape, 1)
    torch.cuda.synchronize()
    done("mission inputs (seed 1)")
    problem.reference(shape, inputs)
    torch.cuda.synchronize()
    done("mission fp32 reference, first")
    problem.reference(shape, inputs)
    torch.cuda.synchronize()
    done("mission fp32 reference, again")
    gpu_clocks()
    done("nvidia-smi clocks query")
    del x
    steps = phases.as_dict()
    total = round(sum(steps.values()), 3)
    for name, s in steps.items():
        print(f"  {name:55s} {s:7.3f} s")
    print(f"  {'total':55s} {total:7.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": steps, "total": total, "torch": torch.__version__, "cupy": cupy.__version__}, f,
                      indent=1)


if __name__ == "__main__":
    main()
