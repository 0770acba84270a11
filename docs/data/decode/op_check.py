"""The decode op end to end on the GPU (run by docs/data/decode/run.sh after the benches): builds the decode table
from the bench records, then times evotune.torch.decode.decode_attention beside SDPA (enable_gqa) on the same
tensors, eager (events around 200 back-to-back calls: host time included) and in a CUDA graph of 20 calls, in
alternating rounds. Writes the table and a JSON of the timings; prints one line per shape.

    python3 docs/data/decode/op_check.py BENCH_DIR OUT_DIR
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from evotune.problems import get_problem
from evotune.torch import decode as D


def per_call_us(fn, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def graph_of(fn, calls: int):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def main(bench_dir: str, out_dir: str) -> int:
    problem = get_problem("attention-decode")
    benches = sorted(Path(bench_dir).glob("*.json"))
    table = D.build_decode_table(benches)
    Path(out_dir, "decode-table.json").write_text(json.dumps(table, indent=1))
    D.use_decode_table(table)
    results = []
    for entry in table["entries"]:
        shape = problem.shape_from_dict(entry["shape"])
        inputs = problem.make_inputs(shape, seed=3)
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        route = D.decode_route(q, k, v, shape.causal)
        mask = None
        if shape.causal and shape.seq_q > 1:
            from evotune.problems.decode import bottom_right_mask

            mask = bottom_right_mask(shape.seq_q, shape.seq_k, q.device)
        ops = {"evotune op": lambda: D.decode_attention(q, k, v, causal=shape.causal),
               "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)}
        out = ops["evotune op"]()
        ref = problem.reference(shape, inputs)
        err = (out.float() - ref).abs().max().item()
        graphs = {name: graph_of(fn, 20) for name, fn in ops.items()}
        eager = {name: [] for name in ops}
        graph = {name: [] for name in ops}
        for _ in range(7):  # alternating rounds: drift hits both alike
            for name, fn in ops.items():
                eager[name].append(per_call_us(fn, 200))
                graph[name].append(per_call_us(graphs[name].replay, 10) / 20)
        row = {"shape": shape.spec, "route": route, "max_abs_err": err, "table_route": entry["route"],
               "table_reason": entry["reason"],
               **{f"{mode} {name} us": statistics.median(xs[name]) for mode, xs in (("eager", eager), ("graph", graph))
                  for name in ops},
               "rounds": {"eager": eager, "graph": graph}}
        results.append(row)
    Path(out_dir, "op_check.json").write_text(json.dumps(results, indent=1))
    print(f"{'op: shape':<26}{'route':<10}{'err':>9}{'eager ours':>12}{'eager sdpa':>12}{'graph ours':>12}{'graph sdpa':>12}")
    for r in results:
        print(f"{r['shape']:<26}{r['route'][:9]:<10}{r['max_abs_err']:>9.1e}{r['eager evotune op us']:>11.2f}u"
              f"{r['eager sdpa us']:>11.2f}u{r['graph evotune op us']:>11.2f}u{r['graph sdpa us']:>11.2f}u")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
