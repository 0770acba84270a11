"""Host time per call of evotune.torch.attention against F.scaled_dot_product_attention (developer tool, GPU).

For each variant (the space's default config of `attention` = mma.sync, and of `attention-hopper` = wgmma),
a fixture tuning table routes the shape's key on this GPU to that config; then, on the same inputs:

  eager host us   time.perf_counter() around N back-to-back calls with no synchronisation inside, after a
                  warm-up, divided by N: what a call costs the CPU (dispatcher, routing, launch); the GPU
                  runs behind, so for a small shape this is the op's floor in eager code
  eager wall us   the same N calls followed by one synchronize, divided by N
  graph us        CUDA-graph replay of N captured calls, CUDA events, per call (host cost gone)

Prints a short table and writes JSON to --out:

    python tools/op_host_overhead.py --shape 1,8,512,64 --n 2000 --out op_host_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _table_for(space_name: str, shape, gpu) -> object:
    from _tables import entry, table

    from evotune.space.searchspace import load_builtin

    config = load_builtin(space_name).default_config().as_dict()
    return table(entry(shape, config, space_name, gpu=gpu))


def _inputs(shape, torch):
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[shape.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def one(seq):
        return torch.randn(shape.batch, shape.heads, seq, shape.head_dim, generator=gen, device="cuda").to(dt)

    return one(shape.seq_q), one(shape.seq_k), one(shape.seq_k)


def _eager(fn, n: int, reps: int, torch) -> tuple[float, float]:
    """(median host us per call, median wall us per call) over `reps` batches of `n` calls."""
    host, wall = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / n * 1e6)
        wall.append((t2 - t0) / n * 1e6)
    return statistics.median(host), statistics.median(wall)


def _graph(fn, n: int, reps: int, torch) -> float:
    """Median us per call of a CUDA-graph replay of `n` captured calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1,8,512,64", help="attention shape (evotune spelling or preset)")
    ap.add_argument("--n", type=int, default=2000, help="calls per timed batch")
    ap.add_argument("--reps", type=int, default=5, help="timed batches (median reported)")
    ap.add_argument("--graph-n", type=int, default=100, help="calls captured per CUDA graph")
    ap.add_argument("--variants", default="sync,wgmma", help="comma list of sync, wgmma")
    ap.add_argument("--out", default="op_host_overhead.json")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    import evotune.torch as et
    from evotune.problems.shapes import parse_shape

    shape = parse_shape(args.shape)
    gpu = (torch.cuda.get_device_name(0), "%d.%d" % torch.cuda.get_device_capability(0))
    q, k, v = _inputs(shape, torch)
    causal = shape.causal

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    rows = []
    host, wall = _eager(sdpa, 200, 1, torch)  # warm-up
    host, wall = _eager(sdpa, args.n, args.reps, torch)
    rows.append({"impl": "F.scaled_dot_product_attention", "eager_host_us": host, "eager_wall_us": wall,
                 "graph_us": _graph(sdpa, args.graph_n, args.reps, torch)})
    spaces = {"sync": "attention", "wgmma": "attention-hopper"}
    for variant in [x for x in args.variants.split(",") if x]:
        et.use_table(_table_for(spaces[variant], shape, gpu))

        def op():
            return et.attention(q, k, v, is_causal=causal, fallback="error")

        assert et.explain(q, k, v, is_causal=causal).kind == "tuned"
        with warnings.catch_warnings():
            warnings.simplefilter("error", et.EvotuneFallbackWarning)
            et.warmup()
            _eager(op, 200, 1, torch)
            host, wall = _eager(op, args.n, args.reps, torch)
            graph_us = _graph(op, args.graph_n, args.reps, torch)
        rows.append({"impl": f"evotune.torch.attention ({variant})", "eager_host_us": host, "eager_wall_us": wall,
                     "graph_us": graph_us})
    et.use_table(None)

    report = {"shape": shape.spec, "gpu": gpu[0], "cc": gpu[1], "torch": torch.__version__, "n": args.n,
              "reps": args.reps, "graph_n": args.graph_n, "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{shape.spec} on {gpu[0]}: per call, median of {args.reps} x {args.n} calls")
    print(f"{'implementation':<40} {'eager host us':>14} {'eager wall us':>14} {'graph us':>10}")
    for r in rows:
        print(f"{r['impl']:<40} {r['eager_host_us']:>14.2f} {r['eager_wall_us']:>14.2f} {r['graph_us']:>10.2f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
