"""Host time per attention call, for every route and mode of evotune.torch.attention, beside SDPA (developer tool).

Rows, on the same inputs (--shape), each timed in every round, rounds interleaved (row order rotated each
round), so a slow stretch of the machine lands on all rows alike:

  sdpa            F.scaled_dot_product_attention
  op-tuned        evotune.torch.attention on a tuned key (a fixture table routes the shape to the default config
                  of --space on this GPU; CUDA only: the kernel launches)
  op-fallback     evotune.torch.attention on a key the table lacks (the SDPA route, told once)
  op-dispatch     torch.ops.evotune.attention.default, tuned where op-tuned runs, else the fallback: what a
                  compiled graph pays per call (the dispatcher, then the op's body)
  hf-sdpa         transformers' sdpa_attention_forward (no mask, is_causal), as a model calls it
  hf-tuned        evotune.torch.hf.attention_forward, tuned key (CUDA only)
  hf-fallback     evotune.torch.hf.attention_forward, missing key
  hf-decode-sdpa  transformers' sdpa_attention_forward on a decode step: one query of --shape over its keys
  hf-decode       the adapter on the same step (the decode op: its kernel where a decode table routes the key, else
                  SDPA, told once; the tool loads no decode table, so the SDPA route)
  compile-sdpa    torch.compile(fullgraph=True, default mode) of a function calling SDPA then one small op
  compile-tuned   the same function calling evotune.torch.attention on the tuned key (CUDA only)
  compile-fallback  ... on the missing key (the trace calls SDPA itself: op._sdpa_when_traced)

Per row and round: time.perf_counter() around --n back-to-back calls with no synchronisation inside, divided
by --n (host us per call: what a call costs the CPU; the GPU runs behind). Reported per row: the median over
--rounds rounds with the min and max, and the ratio to sdpa's time in the same round (compile rows: to
compile-sdpa's), median with min and max. On CUDA, --graph adds each eager row's per-call time inside one CUDA
graph of --graph-n captured calls (CUDA events around replays).

    python tools/op_host_overhead.py --shape 1,8,512,64 --graph --out op_host_overhead.json --md op_host_overhead.md
    python tools/op_host_overhead.py --device cpu --shape 1,1,1,64     # host cost on a CPU: no kernel rows
    python tools/op_host_overhead.py --launcher python ...             # the op's Python routes only

--launcher cpp (the default, as the product's: evotune.torch.launcher, evotune::attention's CUDA kernel in C++ and a
Python entry the eager calls try first) builds and loads the compiled launcher before the warm-up; the tuned rows then
launch from C++ and their route reads "tuned-cpp", and the eager fallback rows run SDPA from C++ (op-fallback,
op-dispatch and hf-fallback on the missing key; compile-fallback traces SDPA itself either way). --launcher python
sets EVOTUNE_CPP_LAUNCHER=0 for this process. Each row's report says what its timed calls ran (the library's counters
over them: "direct" calls served from its Python entry, "launches" of kernels, "sdpa" routes, "misses" handed back
to the Python body). Run the tool once per launcher and compare each run's ratios to its own SDPA rows.

Writes JSON to --out and the docs' markdown table to --md, prints a table last. Exit status 2 for bad options.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = ("sdpa", "op-tuned", "op-fallback", "op-dispatch", "hf-sdpa", "hf-tuned", "hf-fallback", "hf-decode-sdpa",
        "hf-decode", "compile-sdpa", "compile-tuned", "compile-fallback")
CUDA_ONLY = ("op-tuned", "hf-tuned", "compile-tuned")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1,8,512,64", help="attention shape (evotune spelling or preset)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--layout", default="bshd", choices=["bshd", "bhsd"],
                    help="the inputs' memory: bshd as a projection leaves them (models), or bhsd")
    ap.add_argument("--n", type=int, default=1000, help="calls per timed batch")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (each row once a round)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    ap.add_argument("--space", default="attention-hopper", help="space whose default config the tuned rows run")
    ap.add_argument("--launcher", default="cpp", choices=["python", "cpp"],
                    help="the op's launch: the compiled launcher (the default), or its Python routes only "
                         "(EVOTUNE_CPP_LAUNCHER=0)")
    ap.add_argument("--graph", action="store_true", help="also time each eager row inside a CUDA graph")
    ap.add_argument("--graph-n", type=int, default=100, help="calls captured per CUDA graph")
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--md", default=None, help="markdown table (for the docs)")
    args = ap.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows or args.n < 1 or args.rounds < 1:
        print(f"op_host_overhead: bad --rows {','.join(bad)} (rows: {', '.join(ROWS)}) or --n/--rounds < 1"
              if bad or not rows else "op_host_overhead: --n and --rounds must be at least 1", file=sys.stderr)
        raise SystemExit(2)
    if args.device == "cpu":
        rows = [r for r in rows if r not in CUDA_ONLY]
    args.rows = rows
    return args


class _Module:
    """The attention module a transformers attention function reads (is_causal, num_key_value_groups)."""

    def __init__(self, groups):
        self.is_causal, self.num_key_value_groups, self.training = True, groups, False


def _inputs(shape, device, layout, torch):
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[shape.dtype]
    if device == "cpu":
        dt = torch.float32  # CPU SDPA's cheapest dtype: the rows differ by their host work, not the math
    gen = torch.Generator().manual_seed(0)

    # bshd: as a projection leaves them, (B, S, H, D) memory seen as (B, H, S, D), the layout models call with.
    def one(seq, heads):
        if layout == "bhsd":
            return torch.randn(shape.batch, heads, seq, shape.head_dim, generator=gen).to(device, dt)
        return torch.randn(shape.batch, seq, heads, shape.head_dim, generator=gen).to(device, dt).transpose(1, 2)

    return one(shape.seq_q, shape.heads), one(shape.seq_k, shape.kv_heads), one(shape.seq_k, shape.kv_heads)


def _fixture_table(space_name, shape, gpu):
    from _tables import entry, table

    from evotune.space.searchspace import load_builtin

    return table(entry(shape, load_builtin(space_name).default_config().as_dict(), space_name, gpu=gpu))


def build_rows(args, shape, torch):
    """{row: (table, fn)}: the table each row runs under (a fixture table with the tuned key, or None) and
    the zero-argument call it times."""
    import torch.nn.functional as F

    import evotune.torch as et

    q, k, v = _inputs(shape, args.device, args.layout, torch)
    causal, gqa = shape.causal, shape.kv_heads != shape.heads
    extra = {"enable_gqa": True} if gqa else {}
    tuned = None
    if args.device == "cuda":
        gpu = (torch.cuda.get_device_name(0), "%d.%d" % torch.cuda.get_device_capability(0))
        tuned = _fixture_table(args.space, shape, gpu)
    fns = {}
    fns["sdpa"] = (None, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, **extra))
    op = lambda: et.attention(q, k, v, is_causal=causal, enable_gqa=gqa)  # noqa: E731
    fns["op-tuned"] = (tuned, op)
    fns["op-fallback"] = (None, op)
    dispatch = torch.ops.evotune.attention.default
    fns["op-dispatch"] = (tuned, lambda: dispatch(q, k, v, causal, None, gqa, "sdpa"))
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        from evotune.torch import hf
    except ImportError:
        sdpa_attention_forward = hf = None
    if hf is not None:
        module = _Module(shape.heads // shape.kv_heads)
        fns["hf-sdpa"] = (None, lambda: sdpa_attention_forward(module, q, k, v, None, is_causal=causal))
        adapter = lambda: hf.attention_forward(module, q, k, v, None, is_causal=causal)  # noqa: E731
        fns["hf-tuned"] = (tuned, adapter)
        fns["hf-fallback"] = (None, adapter)
        step = q[:, :, -1:]  # a decode step's query over the shape's keys as its cache
        fns["hf-decode-sdpa"] = (None, lambda: sdpa_attention_forward(module, step, k, v, None, is_causal=causal))
        fns["hf-decode"] = (None, lambda: hf.attention_forward(module, step, k, v, None, is_causal=causal))

    # One function per compiled row, each its own code object: dynamo keeps a compiled graph per code object
    # (guarded on its inputs, not on the op's table), so the tuned and fallback rows must not share one.
    def compile_sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **extra) + 1

    def compile_tuned(q, k, v):
        return et.attention(q, k, v, is_causal=causal, enable_gqa=gqa) + 1

    def compile_fallback(q, k, v):
        return et.attention(q, k, v, is_causal=causal, enable_gqa=gqa) + 1

    for name, table, body in (("compile-sdpa", None, compile_sdpa), ("compile-tuned", tuned, compile_tuned),
                              ("compile-fallback", None, compile_fallback)):
        fn = torch.compile(body, fullgraph=True)
        fns[name] = (table, lambda fn=fn: fn(q, k, v))
    return {r: fns[r] for r in args.rows if r in fns}, (q, k, v)


def _use(table, et):
    """Make `table` (None: an empty one, every key missing) the op's table, keeping its cached routes where
    it already is."""
    table = table if table is not None else _EMPTY[0]
    if et.current_table() is not table:
        et.use_table(table)


_EMPTY = [None]


def time_host(fn, n, sync) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) / n * 1e6


def time_graph(fn, n, reps, torch) -> float:
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


def spread(xs) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def markdown(report) -> str:
    """The docs' table of one report."""
    lines = [f"{report['device']}, torch {report['torch']}, launcher {report.get('launcher', 'python')}"
             + (f", transformers {report['transformers']}" if report.get("transformers") else "")
             + f"; shape {report['shape']} ({report['layout']} inputs); host us per call: median [min - max] of "
             f"{report['rounds']} interleaved rounds of {report['n']} calls; speed: SDPA's time in the same round "
             "(compile rows: the compiled SDPA function's; hf-decode: transformers' sdpa on the same step) / the "
             "row's, median [min - max]; launcher: what the compiled launcher's counters read per timed call", "",
             "| row | route | host us | speed vs SDPA | CUDA graph us | launcher per call |", "|---|---|---|---|---|---|"]
    calls = report["n"] * report["rounds"]
    for r in report["rows"]:
        h, sp = r["host_us"], _speed(r)
        g = r["graph_us"]
        lines.append(f"| {r['row']} | {r['route']} | {h['median']:.2f} [{h['min']:.2f} - {h['max']:.2f}] | "
                     + (f"{sp['median']:.2f}x [{sp['min']:.2f} - {sp['max']:.2f}]" if sp else "-") + " | "
                     + (f"{g:.2f}" if isinstance(g, float) else (g or "-")) + " | "
                     + served_text(r.get("launcher_served") or {}, calls) + " |")
    return "\n".join(lines) + "\n"


def _speed(row: dict):
    """A row's speed against its base row (sdpa; compile rows compile-sdpa; decode rows hf-decode-sdpa)."""
    return next((value for key, value in row.items() if key.startswith("speed_vs_")), None)


def served_text(served: dict, calls: int) -> str:
    """The launcher's counters over a row's timed calls, per call ("direct 1.00, launches 1.00"; "-": none moved)."""
    moved = [f"{what} {count / calls:.2f}" for what, count in served.items() if count]
    return ", ".join(moved) or "-"


def main(argv=None) -> int:
    args = parse_args(argv)
    import os

    os.environ["EVOTUNE_CPP_LAUNCHER"] = "1" if args.launcher == "cpp" else "0"  # read by launcher.load()
    import torch

    import evotune.torch as et
    from evotune.errors import UsageError
    from evotune.problems.shapes import parse_shape
    import _tables

    try:
        # The table's key spells the inputs' layout: a bhsd key never matches bshd inputs (before 2026-11-28 the
        # fixture's key kept the spec's bhsd while the inputs were bshd, so every "tuned" row ran the SDPA route).
        shape = dataclasses.replace(parse_shape(args.shape), layout=args.layout)
    except UsageError as e:
        print(f"op_host_overhead: {e}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("op_host_overhead: no CUDA device visible (use --device cpu)", file=sys.stderr)
        return 2
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    _EMPTY[0] = _tables.table(path="<empty table: every key missing>")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    warnings.simplefilter("ignore")  # the fallback rows' notices, told once each
    from evotune.torch import launcher

    cpp = args.device == "cuda" and args.launcher == "cpp" and launcher.load(wait=True)  # built now, not behind a call
    if args.device == "cuda" and args.launcher == "cpp" and not cpp:
        print(f"op_host_overhead: the compiled launcher did not load ({launcher.why_not()}): the rows are Python's",
              file=sys.stderr)
    rows, inputs = build_rows(args, shape, torch)
    # Warm-up, once per row under its table: compiles (kernel and torch.compile), loads, caches routes.
    routes = {}
    for name, (table, fn) in rows.items():
        _use(table, et)
        if table is not None:
            et.warmup()
        for _ in range(50):
            fn()
        sync()
        routes[name] = "tuned" if table is not None else ("sdpa" if name.endswith(("sdpa",)) else "fallback")
        if table is not None and name.startswith(("op", "hf")):  # a tuned row must run the kernel: checked, not assumed
            q, k, v = inputs
            said = et.explain(q, k, v, is_causal=shape.causal, enable_gqa=shape.kv_heads != shape.heads)
            if said.route != "evotune":
                print(f"op_host_overhead: the {name} row's call does not route to the kernel ({said.reason})",
                      file=sys.stderr)
                return 1
    if cpp:
        routes = {name: route + "-cpp" if route in ("tuned", "fallback") and name != "compile-fallback" else route
                  for name, route in routes.items()}
    samples = {name: [] for name in rows}
    served = {name: {} for name in rows}  # the library's counters over each row's timed calls, summed over rounds
    order = list(rows)
    for r in range(args.rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            table, fn = rows[name]
            _use(table, et)
            for _ in range(20):
                fn()
            before = launcher.counts()
            samples[name].append(time_host(fn, args.n, sync))
            for what, count in launcher.counts().items():
                if what != "routes":
                    served[name][what] = served[name].get(what, 0) + count - before[what]
    graph = {}
    if args.graph and args.device == "cuda":
        for name, (table, fn) in rows.items():
            if name.startswith("compile"):
                continue
            _use(table, et)
            try:
                graph[name] = time_graph(fn, args.graph_n, 5, torch)
            except Exception as e:  # a row that cannot capture is a value, not the end of the run
                graph[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    et.use_table(None)
    report_rows = []
    for name, xs in samples.items():
        base = ("compile-sdpa" if name.startswith("compile") else "hf-decode-sdpa" if name.startswith("hf-decode")
                else "sdpa")
        ratio = ([b / x for x, b in zip(xs, samples[base])] if base in samples else None)
        report_rows.append({"row": name, "route": routes[name], "host_us": spread(xs), "samples_us": xs,
                            "speed_vs_" + base: spread(ratio) if ratio else None, "graph_us": graph.get(name),
                            "launcher_served": served[name]})
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (no kernel rows)"
    report = {"shape": shape.spec, "layout": args.layout, "device": gpu, "torch": torch.__version__, "n": args.n, "rounds": args.rounds,
              "space": args.space, "rows": report_rows, "launcher": "cpp" if cpp else "python",
              "launcher_counts": launcher.counts(),
              "how": "perf_counter around n back-to-back calls, no sync inside; rounds interleaved, order rotated"}
    try:
        import transformers

        report["transformers"] = transformers.__version__
    except ImportError:
        pass
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.md:
        Path(args.md).write_text(markdown(report))
    print(f"{shape.spec} {args.layout} on {gpu}, torch {torch.__version__}, launcher {report['launcher']} "
          f"{report['launcher_counts']}: host us per call, median [min-max] of {args.rounds} "
          f"rounds x {args.n} calls; speed = sdpa's time / the row's, same round")
    print(f"{'row':<17} {'route':<9} {'host us':>9} {'[min - max]':>17} {'speed vs sdpa':>22} {'graph us':>9}")
    for r in report_rows:
        h = r["host_us"]
        sp = _speed(r)
        g = r["graph_us"]
        span = "[%.2f - %.2f]" % (h["min"], h["max"])
        speed = "%.2fx [%.2f-%.2f]" % (sp["median"], sp["min"], sp["max"]) if sp else "-"
        graph_text = "%.2f" % g if isinstance(g, float) else (g or "-")[:9]
        print(f"{r['row']:<17} {r['route']:<9} {h['median']:>9.2f} {span:>17} {speed:>22} {graph_text:>9}")
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
