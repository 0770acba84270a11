"""A score feature's cost, measured: our kernel on a shape with a feature (sinks, softcap, window), the same config on
the dense shape of the same tensors, and FlexAttention with the same semantics, timed interleaved in one process.

Issue 42's two targets for a feature: at least 1.3x FlexAttention on the same semantics, and never slower than the
dense kernel on the same shape. Both need the three contenders timed in one process, in alternating rounds
(evotune.gpu.interleave.time_interleaved: the same rounds, a Williams order, CUDA-graph replays), on fresh random
inputs; each of our launches is checked first against the fp32 reference at the gate's tolerance into a
NaN-poisoned output (a kernel that fails is reported, not timed).

    python3 tools/feature_bench.py --case "1,64,4096,64:bf16:kv8:causal:sinks" --table runs/table.json --out r.json
    python3 tools/feature_bench.py --case "1,8,512,64:sinks" --config '{"mma": "wgmma", ...}'

The config: --config (knobs over the attention space's defaults), else the table's entry for the case's key
(--table, as the op would select it), else the Hopper default below. The dense shape: the case without sinks and
softcap, and a window L,0 as causal (its dense anchor: what the layer would cost with full causal attention; a
two-sided window as non-causal). A sinks case with a window or cap also times the same config without the sinks (the
sink's own cost). Prints one line per case: medians with [p10-p90], and the per-round ratios' median [min-max].
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HOPPER = {"mma": "wgmma", "block_m": 128, "compute_warps": 8, "producer_warps": 4, "block_n": 128, "stages": 2,
          "q_in_regs": False}


def dense_of(shape):
    """The same tensors without the features: no sinks or cap; a causal sliding window (L, 0) as causal."""
    causal = shape.causal or (shape.has_window and shape.window_right == 0 and shape.seq_q == shape.seq_k)
    return replace(shape, sinks=False, softcap=0.0, window_left=-1, window_right=-1, causal=causal)


def config_for(shape, args, space):
    """(knobs dict, where it came from)."""
    if args.config:
        return json.loads(args.config), "--config"
    if args.table:
        import torch

        from evotune.records.tuning_table import TableKey, load_table, select

        key = TableKey.for_shape(shape, torch.cuda.get_device_name(), "%d.%d" % torch.cuda.get_device_capability())
        table = load_table(args.table)
        sel = select(table, key, shape)
        if sel.entry is not None:
            return dict(sel.entry.config), f"table {args.table} ({sel.match})"
        # The key's own entry even where the op would not use it (stale: measured on an older kernel text): here the
        # table is only where the tuned config comes from, and every contender is re-measured now.
        same = [e for e in table.entries if e.key == key]
        if same:
            return dict(same[0].config), f"table {args.table} (exact, {sel.reason[:60]})"
        print(f"{shape.spec}: no table entry ({sel.reason[:100]}); the Hopper default", file=sys.stderr)
    return dict(HOPPER), "default"


def kernel_launch(problem, space, shape, knobs, inputs):
    """A checked launcher of `knobs` on `shape` over `inputs`: one launch into NaN checked against the fp32 reference
    at the gate's tolerance; returns (launch, output, note) or raises with the reason."""
    import torch

    from evotune.build.compile import compile_source, load_kernel
    from evotune.build.template import instantiate
    from evotune.gpu.evaluate import output_errors

    cfg = space.config(knobs)
    viol = space.violations(cfg, problem.context(shape))
    if viol:
        raise ValueError(f"not admitted: {viol[0]}")
    src = instantiate(problem, cfg, shape)
    comp = compile_source(src.code, src.entry)
    kern = load_kernel(comp, problem.launch_plan(cfg, shape).dynamic_smem)
    out = problem.new_output(inputs).fill_(math.nan)
    launch = problem.launcher(kern, cfg, shape, inputs, out)
    launch()
    torch.cuda.synchronize()
    atol, rtol = problem.tolerance(shape)
    scale = problem.error_scale(inputs)
    max_abs, _, nonfinite, ratio = output_errors(out, problem.reference(shape, inputs), atol * scale, rtol)
    if nonfinite or ratio > 1:
        raise ValueError(f"fails the gate: max |err| {max_abs:.3g}, gate ratio {ratio:.3g}, {nonfinite} non-finite")
    return launch, {"max_abs_err": max_abs, "gate_ratio": ratio, "registers": comp.resources.registers,
                    "spills": comp.resources.spill_stores}


def bench_case(text: str, args, problem, space) -> dict:
    import torch

    from evotune.gpu.interleave import time_interleaved
    from evotune.problems.attention import flex_launcher

    shape = problem.parse_shape(text)
    dense = dense_of(shape)
    knobs, source = config_for(shape, args, space)
    inputs = problem.make_inputs(shape, seed=args.seed)
    rec = {"shape": shape.spec, "dense_shape": dense.spec, "config": knobs, "config_from": source}
    fns = {}
    contenders = [("ours", shape), ("dense", dense)]
    if shape.sinks and replace(shape, sinks=False) != dense:
        contenders.append(("nosink", replace(shape, sinks=False)))  # the sink's own cost: the same mask and cap
    if args.dense_tuned and args.table:
        # The dense shape's own tuned config as a contender too: "never slower than the dense kernel" compares the
        # feature's best with the dense shape's best, not only the same config with and without the feature.
        dense_knobs, dense_source = config_for(dense, args, space)
        if dense_source.startswith("table"):
            contenders.append(("dense_tuned", dense))
            rec["dense_tuned_config"] = dense_knobs
    for name, s in contenders:
        try:
            cfg = rec["dense_tuned_config"] if name == "dense_tuned" else knobs
            fns[name], rec[name] = kernel_launch(problem, space, s, cfg, inputs)
        except Exception as e:  # a contender that fails is a row, not the end of the run
            rec[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    try:
        flex = flex_launcher(shape, inputs)
        o = flex()
        torch.cuda.synchronize()
        rec["flex"] = {"max_abs_err": float((o.float() - problem.reference(shape, inputs)).abs().max())}
        fns["flex"] = flex
    except Exception as e:
        rec["flex"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    if "ours" not in fns:
        return rec
    res = time_interleaved(fns, rounds=args.rounds)
    for name, t in res.timings.items():
        rec[name].update(t.as_dict())
    for other in ("dense", "dense_tuned", "nosink", "flex"):
        if other in fns:
            rec[f"ours_vs_{other}"] = res.ratios("ours", other)  # other's time over ours: > 1, ours is faster
    return rec


def row(rec: dict) -> str:
    def cell(name):
        r = rec.get(name, {})
        if "median_us" not in r:
            return f"{'-':>24}"
        return f"{r['median_us']:8.1f} [{r['p10_us']:.1f}-{r['p90_us']:.1f}]".rjust(24)

    def ratio(name):
        r = rec.get(f"ours_vs_{name}")
        return f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]" if r else "-"

    errs = "; ".join(f"{n}: {rec[n]['error'][:70]}" for n in ("ours", "dense", "nosink", "flex")
                     if "error" in rec.get(n, {}))
    return (f"{rec['shape']:44} {cell('ours')} {cell('dense')} {cell('flex')}  {ratio('dense'):>20} {ratio('flex'):>20}"
            f" {ratio('nosink'):>20} {ratio('dense_tuned'):>20}" + (f"  {errs}" if errs else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", required=True, help="a shape with a feature (repeatable)")
    ap.add_argument("--config", help="knobs (JSON) over the attention space's defaults, for every case")
    ap.add_argument("--table", help="a tuning table: each case's entry as the op selects it")
    ap.add_argument("--dense-tuned", action="store_true", help="with --table: also the dense shape's own tuned config "
                    "(its entry in the same table)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", help="write every case's record (JSON) here")
    args = ap.parse_args(argv)

    from evotune.errors import UsageError
    from evotune.problems import get_problem
    from evotune.space.searchspace import load_builtin

    problem, space = get_problem("attention"), load_builtin("attention")
    try:
        for text in args.case:
            problem.parse_shape(text)
    except UsageError as e:
        print(f"feature_bench: {e}", file=sys.stderr)
        return 2
    import torch

    recs = []
    for text in args.case:
        recs.append(bench_case(text, args, problem, space))
        print(json.dumps(recs[-1]), flush=True)
        if args.out:  # after every case: a run cut short keeps what it measured
            Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                  "cases": recs}, indent=1))
    print(f"\n{'shape':44} {'ours us [p10-p90]':>24} {'dense, same config':>24} {'FlexAttention':>24}  "
          f"{'dense/ours per round':>20} {'flex/ours per round':>20} {'no sink/ours':>20} {'dense tuned/ours':>20}")
    for rec in recs:
        print(row(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
