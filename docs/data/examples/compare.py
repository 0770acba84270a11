"""One example family (examples/gemm or examples/rmsnorm) beside the torch op and Kernel Tuner, on the GPU.

    python3 docs/data/examples/compare.py EXAMPLE SEARCH_JSON SEARCH_WALL_S SEARCH_RC OUT_JSON [--budget 40]
    python3 docs/data/examples/compare.py --table OUT_JSON...
    python3 docs/data/examples/compare.py --markdown DIR      # DIR's *-compare.json and device.txt: docs/PLUGINS.md

run.sh first runs `evotune search --family examples/EXAMPLE/EXAMPLE.yaml --trials 40 --json` (its summary and wall
seconds are the arguments). This then
  1. tunes the same kernel with Kernel Tuner 1.5's tune_kernel at the same budget (random_sample, max_fevals =
     budget, lang="cupy", evotune's NVRTC options), with the glue a Kernel Tuner user writes (kt_gemm, kt_rmsnorm
     below: a __global__ wrapper over the same __device__ template, tune_params with block_size_x tied to the
     knobs by a restriction, the same constraints, smem_args, the fp32 answer and the same tolerance; and, for
     more than 48 KB of dynamic shared memory, which Kernel Tuner 1.5's CuPy backend never opts in to, the
     backend subclass that does);
  2. re-times evotune's winner and Kernel Tuner's winner with evotune's harness (evaluate_compiled: the full gate,
     then CUDA-graph timing, 100 replays), one after the other in this process, and the torch op (torch.matmul;
     F.rms_norm alone, and with the rstd the fused kernel also writes) with the same timer (time_gpu) on the same
     inputs;
  3. writes OUT_JSON (with the versions of torch, CUDA and Kernel Tuner). --table prints the table of several
     OUT_JSONs; --markdown the table docs/PLUGINS.md holds, from a dated folder of them (tests/test_examples_glue.py
     checks the page against it).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))


def family(example: str):
    from evotune.problems import allow_plugins, get_problem

    path = ROOT / "examples" / example / f"{example}.yaml"
    allow_plugins([str(path)])
    problem = get_problem(str(path))
    return problem, problem.parse_shape(problem.default_shape)


def kt_optin():
    """Kernel Tuner 1.5's CuPy backend never raises a kernel's dynamic shared memory limit (48 KB without it)."""
    import kernel_tuner.backends.cupy as kt_cupy

    class OptIn(kt_cupy.CupyFunctions):
        def copy_shared_memory_args(self, smem_args):
            super().copy_shared_memory_args(smem_args)
            if self.smem_size:
                self.func.max_dynamic_shared_size_bytes = self.smem_size

    kt_cupy.CupyFunctions = OptIn


# ---------------------------------------------------------------- Kernel Tuner glue (counted in docs/PLUGINS.md)
def kt_gemm(budget, options, M=4096, N=4096, K=4096):
    import numpy as np
    from kernel_tuner import tune_kernel

    source = (ROOT / "examples/gemm/gemm.cu").read_text() + """
extern "C" __global__ void gemm_kt(const __half* A, const __half* B, __half* C, int M, int N, int K) {
    gemm<__half, block_m, block_n, block_k, warps_m, warps_n, stages>(A, B, C, M, N, K);
}
"""
    A = np.random.randn(M, K).astype(np.float16)
    B = np.random.randn(K, N).astype(np.float16)
    C = np.zeros((M, N), dtype=np.float16)
    ref = A.astype(np.float32) @ B.astype(np.float32)
    tune_params = {"block_m": [64, 128, 256], "block_n": [64, 128, 256], "block_k": [32, 64],
                   "warps_m": [1, 2, 4], "warps_n": [1, 2, 4], "stages": [2, 3, 4],
                   "block_size_x": [32, 64, 128, 256, 512]}

    def smem(p):
        return p["stages"] * (p["block_m"] * (p["block_k"] + 8) + p["block_k"] * (p["block_n"] + 8)) * 2 \
            + p["warps_m"] * p["warps_n"] * 1024

    restrictions = ["block_size_x == warps_m * warps_n * 32",
                    "(block_m // warps_m) % 16 == 0 and (block_n // warps_n) % 16 == 0",
                    f"{M} % block_m == 0 and {N} % block_n == 0 and {K} % block_k == 0",
                    "stages * (block_m * (block_k + 8) + block_k * (block_n + 8)) * 2 + warps_m * warps_n * 1024"
                    " <= 232448",
                    "(block_m // warps_m // 16) * (block_n // warps_n // 16) * 8 <= 128"]

    def verify(answer, result, atol=None):
        return bool(np.all(np.abs(result[2].astype(np.float32) - answer[2]) <= 0.01 + 0.005 * np.abs(answer[2])))

    kt_optin()
    return tune_kernel("gemm_kt", source, (N, M), [A, B, C, np.int32(M), np.int32(N), np.int32(K)], tune_params,
                       grid_div_x=["block_n"], grid_div_y=["block_m"], restrictions=restrictions,
                       smem_args={"size": smem}, answer=[None, None, ref, None, None, None], verify=verify,
                       lang="cupy", compiler_options=options, strategy="random_sample",
                       strategy_options={"max_fevals": budget}, quiet=True)


def kt_rmsnorm(budget, options, M=16384, N=4096, eps=1e-6):
    import numpy as np
    from kernel_tuner import tune_kernel

    source = (ROOT / "examples/rmsnorm/rmsnorm.cu").read_text() + """
extern "C" __global__ void rms_norm_kt(const __half* x, const __half* w, __half* y, float* rstd, int M, int N,
                                       float eps) {
    rms_norm<__half, threads_per_row, rows_per_block, vec>(x, w, y, rstd, M, N, eps);
}
"""
    x = np.random.randn(M, N).astype(np.float16)
    w = (np.random.rand(N) + 0.5).astype(np.float16)
    y, rstd = np.zeros((M, N), dtype=np.float16), np.zeros(M, dtype=np.float32)
    xf = x.astype(np.float32)
    rstd_ref = 1 / np.sqrt((xf * xf).mean(-1) + eps)
    y_ref = xf * rstd_ref[:, None] * w.astype(np.float32)
    tune_params = {"threads_per_row": [8, 16, 32, 64, 128, 256, 512, 1024], "rows_per_block": [1, 2, 4, 8, 16],
                   "vec": [8, 4, 2], "block_size_x": [32, 64, 128, 256, 512, 1024]}
    restrictions = ["block_size_x == threads_per_row * rows_per_block", f"{N} % vec == 0",
                    f"threads_per_row * vec <= max({N}, 32 * vec)"]

    def verify(answer, result, atol=None):
        ok_y = np.all(np.abs(result[2].astype(np.float32) - answer[2]) <= 0.001 + 0.01 * np.abs(answer[2]))
        return bool(ok_y and np.all(np.abs(result[3] - answer[3]) <= 0.001 + 0.01 * np.abs(answer[3])))

    args = [x, w, y, rstd, np.int32(M), np.int32(N), np.float32(eps)]
    return tune_kernel("rms_norm_kt", source, M, args, tune_params, grid_div_x=["rows_per_block"],
                       restrictions=restrictions, answer=[None, None, y_ref, rstd_ref, None, None, None],
                       verify=verify, lang="cupy", compiler_options=options, strategy="random_sample",
                       strategy_options={"max_fevals": budget}, quiet=True)


# ---------------------------------------------------------------- the harness
def kernel_tuner_side(example: str, budget: int) -> dict:
    try:
        import kernel_tuner
    except ImportError:
        return {"available": False, "reason": "kernel_tuner is not installed (see run.sh for its wheels)"}
    import random

    import numpy as np

    from evotune.build.compile import nvrtc_options

    random.seed(0)
    np.random.seed(0)
    started = time.perf_counter()
    try:
        results, env = {"gemm": kt_gemm, "rmsnorm": kt_rmsnorm}[example](budget, list(nvrtc_options()))
    except Exception as e:  # noqa: BLE001 - recorded: Kernel Tuner ends its tune at the first failed check
        return {"available": True, "error": f"{type(e).__name__}: {e}"[:400], "wall_s": time.perf_counter() - started}
    wall = time.perf_counter() - started
    ok = [r for r in results if isinstance(r.get("time"), (int, float))]
    best = min(ok, key=lambda r: r["time"]) if ok else None
    knobs = {"gemm": ("block_m", "block_n", "block_k", "warps_m", "warps_n", "stages"),
             "rmsnorm": ("threads_per_row", "rows_per_block", "vec")}[example]
    return {"available": True, "version": getattr(kernel_tuner, "__version__", "1.5"), "wall_s": wall,
            "evaluated": len(results), "passed": len(ok),
            "best": {k: best[k] for k in knobs} if best else None, "best_kt_ms": best["time"] if best else None}


def retime(problem, shape, config: dict) -> dict:
    """A config through evotune's harness: compile (sm_90a), the full gate, CUDA-graph timing (100 replays)."""
    from evotune.build.compile import compile_source
    from evotune.build.template import instantiate
    from evotune.gpu.evaluate import evaluate_compiled

    cfg = problem.space.config(config)
    src = instantiate(problem, cfg, shape)
    res = evaluate_compiled(problem, shape, cfg, compile_source(src.code, src.entry), reps=100)
    return {"config": config, "status": res.status, "time_us": res.time_us, "message": res.message}


def torch_side(example: str, problem, shape) -> dict:
    import torch
    import torch.nn.functional as F

    from evotune.gpu.evaluate import time_gpu

    inputs = problem.make_inputs(shape, 1000)
    if example == "gemm":
        ops = {"torch.matmul": lambda: torch.matmul(inputs["A"], inputs["B"])}
    else:
        x, w, n = inputs["x"], inputs["w"], inputs["x"].shape[-1]
        ops = {"F.rms_norm (y only)": lambda: F.rms_norm(x, (n,), w, 1e-6),
               "F.rms_norm + rstd": lambda: (F.rms_norm(x, (n,), w, 1e-6),
                                             torch.rsqrt(x.float().square().mean(-1) + 1e-6))}
    return {name: time_gpu(op, reps=100).median_us for name, op in ops.items()}


def compare(example: str, search_json: str, wall: float, rc: int, out: str, budget: int) -> None:
    problem, shape = family(example)
    try:
        search = json.loads(Path(search_json).read_text())
    except (OSError, ValueError) as e:
        search = {"error": f"no search summary: {e}"}
    best = (search.get("best") or {}).get("config")
    record = {"example": example, "shape": shape.spec, "budget": budget,
              "evotune": {"wall_s": wall, "rc": rc, "evaluated": search.get("evaluated"),
                          "statuses": search.get("statuses"), "best": best,
                          "best_recorded_us": ((search.get("best") or {}).get("result") or {}).get("time_us"),
                          "baselines": search.get("baselines")}}
    record["kernel_tuner"] = kernel_tuner_side(example, budget)
    record["retimed"] = {"evotune": retime(problem, shape, best) if best else None,
                         "kernel_tuner": retime(problem, shape, record["kernel_tuner"]["best"])
                         if record["kernel_tuner"].get("best") else None}
    record["torch"] = torch_side(example, problem, shape)
    import torch

    record["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                          "kernel_tuner": record["kernel_tuner"].get("version")}
    Path(out).write_text(json.dumps(record, indent=2, default=str))
    print(json.dumps(record, default=str)[:2000])


def table(paths: list[str]) -> None:
    def us(x):
        return f"{x:.2f}" if isinstance(x, (int, float)) else "-"

    print(f"{'example':<8} {'tuner':<13} {'wall s':>7} {'evals':>6} {'winner us':>10}  winner (re-timed by evotune's harness)")
    for path in paths:
        r = json.loads(Path(path).read_text())
        ev, kt, rt = r["evotune"], r["kernel_tuner"], r["retimed"]
        e_rt, k_rt = rt.get("evotune") or {}, rt.get("kernel_tuner") or {}
        print(f"{r['example']:<8} {'evotune':<13} {us(ev['wall_s']):>7} {str(ev.get('evaluated')):>6} "
              f"{us(e_rt.get('time_us')):>10}  {e_rt.get('status', '-')} {ev.get('best')}")
        if not kt.get("available"):
            print(f"{'':<8} {'kernel_tuner':<13} {'-':>7} {'-':>6} {'-':>10}  {kt.get('reason')}")
        else:
            print(f"{'':<8} {'kernel_tuner':<13} {us(kt.get('wall_s')):>7} {str(kt.get('evaluated', '-')):>6} "
                  f"{us(k_rt.get('time_us')):>10}  {k_rt.get('status', kt.get('error', '-'))} {kt.get('best')}")
        for name, t in r["torch"].items():
            print(f"{'':<8} {name:<28} {us(t):>10}  the torch op, timed by the same harness")


def markdown(folder: str) -> str:
    """The measured table in Markdown, with where it came from: the device line run.sh wrote, the versions the JSONs
    record, the folder's date and the command. "x torch op": a winner's time over the first torch op's."""
    folder = Path(folder).resolve()
    records = [json.loads((folder / f"{e}-compare.json").read_text()) for e in ("gemm", "rmsnorm")]

    def us(x):
        return f"{x:.2f}" if isinstance(x, (int, float)) else "-"

    def row(what, tuner, wall, evaluated, passed, retimed, op):
        t = (retimed or {}).get("time_us")
        ratio = f"{t / op:.2f}" if isinstance(t, (int, float)) and op else "-"
        cfg = ", ".join(f"{k}={v}" for k, v in ((retimed or {}).get("config") or {}).items())
        return f"| {what} | {tuner} | {us(wall)} | {evaluated} | {passed} | {us(t)} | {ratio} | {cfg} |"

    lines = ["| kernel, shape | tuner | wall s | evaluated | passed the gate | winner us | x torch op | winner |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        ev, kt, rt = r["evotune"], r["kernel_tuner"], r["retimed"]
        op = next(iter(r["torch"].values()), None)
        lines.append(row(f"{r['example']}, `{r['shape']}`", "evotune", ev["wall_s"], ev["evaluated"],
                         (ev.get("statuses") or {}).get("ok", "-"), rt["evotune"], op))
        lines.append(row("", f"Kernel Tuner {kt.get('version', '')}", kt.get("wall_s"), kt.get("evaluated", "-"),
                         kt.get("passed", "-"), rt["kernel_tuner"], op))
        for name, t in r["torch"].items():
            lines.append(f"| | {name} | | | | {us(t)} | {us(t / op) if op else '-'} | the torch op |")
    device = (folder / "device.txt").read_text().strip()
    versions = {k: v for r in records for k, v in (r.get("versions") or {"kernel_tuner": r["kernel_tuner"].get(
        "version")}).items() if v}
    lines.append("")
    lines.append(f"Measured {folder.name} on one {device} (device.txt), "
                 f"{', '.join(f'{k} {v}' for k, v in sorted(versions.items()))} (the versions its JSONs record); "
                 f"`bash docs/data/examples/run.sh {records[0]['budget']}`; records in {folder.relative_to(ROOT)}/.")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1] == "--markdown":
        print(markdown(sys.argv[2]))
    elif sys.argv[1] == "--table":
        table(sys.argv[2:])
    else:
        budget = int(sys.argv[sys.argv.index("--budget") + 1]) if "--budget" in sys.argv else 40
        compare(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5], budget)
