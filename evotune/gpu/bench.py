"""`evotune bench`: a tuned kernel beside every baseline of its family, in one process.

Everything is measured the one way evotune measures (evaluate.time_gpu: CUDA-graph replay
after warm-up, many repetitions, median and p10/p90), on the same inputs, and every
baseline passes the same gate as the kernel. The kernel goes through evaluate_compiled, as in
the search: a kernel whose timed output is not what the gate checked (or that writes outside
its output, changes an input, or differs on a repeat) is reported WRONG with the check that
caught it, and gets no time. Next to the times go the machine's ceilings,
measured in the same process: device-to-device copy bandwidth, the tensor rate of a large
torch.matmul (cuBLAS) in the shape's dtype, and the time of an empty kernel in a graph.
From those, each shape gets its floor: the empty-kernel time plus
max(compulsory bytes / bandwidth, FLOPs / tensor rate).

The GPU parts (`ceilings`, `bench_candidate`) run in a worker process; `floor_analysis`
and `summarize` are pure and tested on the CPU.
"""

from __future__ import annotations

import datetime as dt

from .evaluate import DEFAULT_SEEDS, measure_baselines, time_gpu

BENCH_REPS = 100
COPY_BYTES = 1 << 30        # 1 GiB each way: far past the 50 MB L2, so the copy streams HBM
MATMUL_N = 8192             # 2·8192³ FLOPs: long enough to reach cuBLAS's steady tensor rate
EMPTY_KERNEL = 'extern "C" __global__ void evotune_empty_kernel() {}\n'


def _torch_dtype(name: str):
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


def ceilings(dtype: str = "fp16", reps: int = 20) -> dict:
    """Measured roofs of this GPU (runs on the GPU): copy bandwidth, matmul tensor rate, empty-kernel time."""
    import torch

    from ..build.compile import compile_source, load_kernel, torch_stream_launcher

    out: dict = {}
    src = torch.randn(COPY_BYTES // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    t = time_gpu(lambda: dst.copy_(src), reps=reps)
    out["copy"] = {"bytes": 2 * COPY_BYTES, "time_us": t.median_us, "gb_s": 2 * COPY_BYTES / t.median_us / 1e3}
    del src, dst

    a = torch.randn(MATMUL_N, MATMUL_N, dtype=_torch_dtype(dtype), device="cuda")
    b = torch.randn_like(a)
    c = torch.empty_like(a)
    t = time_gpu(lambda: torch.matmul(a, b, out=c), reps=reps)
    flops = 2.0 * MATMUL_N ** 3
    out["matmul"] = {"n": MATMUL_N, "dtype": dtype, "time_us": t.median_us, "tflop_s": flops / t.median_us / 1e6}
    del a, b, c

    kernel = load_kernel(compile_source(EMPTY_KERNEL, "evotune_empty_kernel"))
    launch_empty = torch_stream_launcher(kernel, (1, 1, 1), (32, 1, 1), ())
    t = time_gpu(launch_empty, reps=reps)
    out["empty_kernel"] = {"time_us": t.median_us, "timing": t.as_dict()}
    return out


def flops_and_bytes(shape) -> tuple[float | None, float | None]:
    """The shape's FLOPs and compulsory bytes, where its family defines them (None otherwise)."""
    flops = getattr(shape, "flops", None)
    nbytes = getattr(shape, "min_bytes", None)
    return (flops() if flops else None), (nbytes() if nbytes else None)


def floor_analysis(flops: float | None, nbytes: float | None, ceil: dict) -> dict:
    """The shape's floor on this GPU from its compulsory bytes and FLOPs and the measured roofs."""
    memory_us = nbytes / (ceil["copy"]["gb_s"] * 1e3) if nbytes else None
    compute_us = flops / (ceil["matmul"]["tflop_s"] * 1e6) if flops else None
    parts = [x for x in (memory_us, compute_us) if x is not None]
    work_us = max(parts) if parts else None
    bound = None
    if memory_us is not None and compute_us is not None:
        bound = "memory" if memory_us >= compute_us else "compute"
    launch_us = ceil["empty_kernel"]["time_us"]
    return {"memory_us": memory_us, "compute_us": compute_us, "work_us": work_us, "bound": bound,
            "launch_us": launch_us,
            # Timed this way, every kernel pays what an empty one costs, and its work starts after
            # that launch: the floor is the sum.
            "floor_us": launch_us + (work_us or 0.0)}


def bench_candidate(problem, shape, config, compiled, reps: int = BENCH_REPS, seeds=DEFAULT_SEEDS,
                    baselines: list[str] | None = None) -> dict:
    """The kernel (gate + time) and every baseline (gate + time), and the device's ceilings (runs on the GPU)."""
    from .evaluate import evaluate_compiled

    res = evaluate_compiled(problem, shape, config, compiled, seeds=seeds, reps=reps)
    base = measure_baselines(problem, shape, names=baselines, seeds=seeds, reps=reps)
    dtype = getattr(shape, "dtype", "fp16")
    return {"kernel": res.as_dict(), "baselines": base, "ceilings": ceilings(dtype)}


def summarize(raw: dict, flops: float | None, nbytes: float | None) -> dict:
    """Rows (kernel first, then each baseline) with TFLOP/s, GB/s and speedups, plus the floor analysis."""
    kernel = raw["kernel"]
    ceil = raw["ceilings"]
    floor = floor_analysis(flops, nbytes, ceil)
    t_ours = kernel.get("time_us") if kernel.get("status") == "ok" else None
    rows = []

    def row(name: str, time_us, timing, verification, available=True, reason=""):
        r = {"name": name, "available": available, "reason": reason, "time_us": time_us,
             "p10_us": (timing or {}).get("p10_us"), "p90_us": (timing or {}).get("p90_us"),
             "tflop_s": flops / time_us / 1e6 if (flops and time_us) else None,
             "gb_s": nbytes / time_us / 1e3 if (nbytes and time_us) else None,
             "gate_ratio": (verification or {}).get("gate_ratio"),
             "max_abs": (verification or {}).get("max_abs"),
             "passed": (verification or {}).get("passed")}
        # speedup of ours over this row (>1: ours is faster); the ratio the targets are stated in.
        r["ours_speedup"] = time_us / t_ours if (time_us and t_ours) else None
        r["vs_floor"] = time_us / floor["floor_us"] if time_us else None
        rows.append(r)

    row("evotune", t_ours, kernel.get("timing"), kernel.get("verification"),
        available=kernel.get("status") == "ok", reason="" if kernel.get("status") == "ok"
        else f"{kernel.get('status')}: {kernel.get('message', '')}")
    for name, b in raw["baselines"].items():
        if not b.get("available"):
            row(name, None, None, None, available=False, reason=b.get("reason", ""))
        else:
            row(name, b["time_us"], b.get("timing"), b.get("verification"))
    avail = [r for r in rows[1:] if r["time_us"]]
    best_base = min(avail, key=lambda r: r["time_us"]) if avail else None
    return {"rows": rows, "floor": floor, "ceilings": ceil,
            "best_baseline": best_base["name"] if best_base else None,
            "ours_over_best_baseline": (t_ours / best_base["time_us"]) if (t_ours and best_base) else None}


def header(device: dict, command: str, sha: str | None) -> dict:
    return {"date": dt.date.today().isoformat(), "device": device, "command": command, "git_sha": sha}
