"""The physical floor of a measured time: one rule for search, replay, bench and verify (issue 38).

No kernel runs faster than physics allows. Timed the evotune way (back-to-back launches in a CUDA
graph), every launch pays at least what an empty kernel pays, and its work takes at least
max(compulsory bytes / copy bandwidth, FLOPs / matmul rate), each measured on this GPU in this
process (`ceilings`: a 1 GiB device copy, an 8192^3 cuBLAS matmul in the shape's dtype, an empty
kernel). A time below that floor means the launches did not do the work they were timed on,
however they got past the gate's checks (a kernel keyed on a hash of every input that copies a
kept answer, say: it still reads every input, and skips only the FLOPs). Such a result is
IMPLAUSIBLE, with the numbers in its reason: never ok, never best, never in a tuning table.

The measured roofs are sustained rates, not hard ceilings, so the rule gives them ROOF_HEADROOM: a time
is implausible below launch + max(memory, compute) / ROOF_HEADROOM. On the H200 (2026-11-27,
docs/data/gate-ii/call2) llama-4k's committed winner ran at 693.7 TF/s against an 8192^3 cuBLAS rate of
703 TF/s measured in another process (764 in the bench's own), and FlashAttention-3 publishes d256
forward passes above cuBLAS's rate: without headroom an honest kernel could read implausible.

The ceilings are measured once per worker process and dtype, when the first time needs judging
(about 0.2 s of GPU on an H100). A family whose shapes define neither flops() nor min_bytes() has
only the launch floor.
"""

from __future__ import annotations

from dataclasses import replace

from ..records import result as R
from ..records.result import Result
from . import evaluate
from .evaluate import time_gpu

COPY_BYTES = 1 << 30        # 1 GiB each way: far past the 50 MB L2, so the copy streams HBM
MATMUL_N = 8192             # 2·8192³ FLOPs: long enough to reach cuBLAS's steady tensor rate
EMPTY_KERNEL = 'extern "C" __global__ void evotune_empty_kernel() {}\n'
ROOF_HEADROOM = 1.25        # how far past the measured copy and matmul rates a kernel may still be honest


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
    torch.cuda.empty_cache()  # 2.4 GiB the candidates may want back

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
            "floor_us": launch_us + (work_us or 0.0),
            # ... and below this, with the roofs' headroom, a time is implausible (implausible_reason).
            "plausible_us": launch_us + (work_us or 0.0) / ROOF_HEADROOM}


def implausible_reason(time_us: float | None, floor: dict, ceil: dict) -> str | None:
    """Why `time_us` cannot be a real measurement of the work (with the numbers), or None when it is at or
    above the floor."""
    if time_us is None or time_us >= floor["plausible_us"]:
        return None
    parts = [f"an empty kernel's {floor['launch_us']:.3g} us"]
    if floor["memory_us"] is not None:
        parts.append(f"compulsory bytes at {ceil['copy']['gb_s']:.0f} GB/s {floor['memory_us']:.3g} us")
    if floor["compute_us"] is not None:
        parts.append(f"FLOPs at {ceil['matmul']['tflop_s']:.0f} TFLOP/s {floor['compute_us']:.3g} us")
    return (f"timed {time_us:.3g} us, below this shape's floor of {floor['plausible_us']:.3g} us on this GPU "
            f"({'; '.join(parts)}; the work at {ROOF_HEADROOM:g}x those rates; measured in this process): "
            f"the launches did not do the work they were timed on")


class Floors:
    """The floor of each shape, from ceilings measured once per dtype in this process (lazily: a worker that
    judges nothing measures nothing). `measure(dtype)` is `ceilings` (a stand-in on the CPU)."""

    def __init__(self, measure=ceilings):
        self.measure = measure
        self._ceilings: dict[str, dict] = {}

    def ceilings_for(self, shape) -> dict:
        dtype = getattr(shape, "dtype", "fp16")
        dtype = dtype if dtype in ("fp16", "bf16", "fp32") else "fp16"
        if dtype not in self._ceilings:
            self._ceilings[dtype] = self.measure(dtype)
        return self._ceilings[dtype]

    def floor(self, shape) -> tuple[dict, dict]:
        """(floor_analysis, ceilings) of `shape` on this GPU."""
        ceil = self.ceilings_for(shape)
        return floor_analysis(*flops_and_bytes(shape), ceil), ceil

    def judge(self, shape, res: Result) -> Result:
        """`res`, IMPLAUSIBLE (no time, the numbers in its message) where it is OK and timed below the floor;
        an OK result carries the floor in extra["floor_us"] (replay compares a recorded time with it)."""
        if not res.ok or res.time_us is None:
            return res
        floor, ceil = self.floor(shape)
        why = implausible_reason(res.time_us, floor, ceil)
        if why is None:
            return replace(res, extra={**res.extra, "floor_us": floor["plausible_us"]})
        return replace(res, status=R.IMPLAUSIBLE, message=why, time_us=None,
                       extra={**res.extra, "floor_us": floor["plausible_us"], "implausible_time_us": res.time_us})

    def judge_dict(self, shape, res: dict) -> dict:
        """judge on a Result's plain-data form."""
        return self.judge(shape, Result.from_dict(res)).as_dict()


# One per process: a GPU worker measures its ceilings once (workers.py and bench.py judge through it).
FLOORS = Floors()


def evaluate_plausible(problem, shape, config, compiled, floors: Floors | None = None, **kw) -> Result:
    """evaluate.evaluate_compiled, then the floor's judgement (`floors`: this process's FLOORS): what the search,
    replay and verify record."""
    return (floors or FLOORS).judge(shape, evaluate.evaluate_compiled(problem, shape, config, compiled, **kw))
