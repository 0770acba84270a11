"""Programmatic dependent launch measured (GPU): one attention config compiled with the knob pdl off and on, timed
side by side and beside every SDPA backend, in three settings.

    python tools/pdl_chain.py                                   # the mission winner on the mission shape
    python tools/pdl_chain.py --shape 1,16,1024,64 --layers 8 --out /tmp/pdl.json
    python tools/pdl_chain.py --config '{"block_m": 64, "block_n": 64}' --settings chain

The settings, each timed interleaved in one pool (evotune.gpu.interleave.time_interleaved: every contender prepared
as the search prepares a candidate, then rounds in a varied order, whole Williams cycles, medians), ours with pdl off
and on and each SDPA backend that takes the shape (CUDNN, FLASH, EFFICIENT, MATH, forced with sdpa_kernel):

  alone         one attention call per CUDA-graph replay: nothing runs before it that it could overlap
  back_to_back  as many calls per replay as fill ~400 us, what `evotune bench` and the search time: a PDL launch may
                start under the previous call's tail
  chain         --layers layers of [QKV projection (torch.matmul) -> attention -> output projection with the residual
                (torch.addmm, beta = 1)] per replay, hidden = heads * head_dim, batch * seq tokens, as a model's forward
                runs them: the kernel before ours is a cuBLAS GEMM, and q, k, v are strided views of its output

Our output is gated in each setting before the timing and again after it: O filled with NaN, one launch (the chain:
one whole chain, then its last layer's O), then its max abs error against SDPA (default dispatch) and the family's
gate against the fp32 reference. Inputs and weights are fresh N(0, 1) draws (weights scaled by 1/sqrt(fan-in)),
never zeros. The JSON (--out) holds everything, with the device, driver, torch and CUDA versions and the date; the
short table comes last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The mission winner: runs/mission-h100-exhaustive-small/best.json (5.32 us per call back to back on the H100).
MISSION_WINNER = {"block_m": 32, "block_n": 128, "compute_warps": 4, "producer_warps": 0, "stages": 4,
                  "smem_layout": "swizzle", "q_in_regs": True, "kv_splits": 1, "warp_key_groups": 2}
SETTINGS = ("alone", "back_to_back", "chain")
BACKENDS = ("cudnn", "flash", "efficient", "math")
OFF, ON = "pdl off", "pdl on"
ALONE_REPS_FACTOR = 5  # one launch per replay is cheap: take more replays per round there
DEVICE = "cuda"  # tests/test_pdl_chain.py runs the settings' plumbing on "cpu" with stand-in launches and timing


def sync() -> None:
    import torch

    torch.cuda.synchronize()


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; argparse's exit 2 with one line for anything malformed."""
    p = argparse.ArgumentParser(description="Time an attention config with pdl off and on, alone, back to back and "
                                            "in a model-like chain, beside the SDPA backends (GPU).")
    p.add_argument("--shape", default="mission", help="the shape (a preset or B,H,S,D[:flags]); default mission")
    p.add_argument("--config", default=None, help="the config as JSON (knobs over the template's defaults; pdl is "
                                                  "set by the tool); default: the mission winner")
    p.add_argument("--layers", type=int, default=4, help="layers in the chain (default 4)")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"SDPA backends, of {', '.join(BACKENDS)}")
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds at least (rounded up to whole cycles)")
    p.add_argument("--reps", type=int, default=20, help="timed replays per contender and round")
    p.add_argument("--seed", type=int, default=2026, help="the inputs' and weights' seed")
    p.add_argument("--out", default=None, help="the JSON record (default $OUT/pdl_chain.json, or ./pdl_chain.json)")
    args = p.parse_args(argv)
    args.settings = _subset(p, "--settings", args.settings, SETTINGS)
    args.backends = _subset(p, "--backends", args.backends, BACKENDS, allow_empty=True)
    if args.layers < 1 or args.rounds < 1 or args.reps < 1:
        p.error("--layers, --rounds and --reps must be at least 1")
    try:
        args.config = MISSION_WINNER if args.config is None else json.loads(args.config)
    except ValueError as e:
        p.error(f"--config: not JSON ({e})")
    if not isinstance(args.config, dict) or "pdl" in args.config:
        p.error("--config: a JSON object of knobs, without pdl (the tool times both)")
    args.out = args.out or os.path.join(os.environ.get("OUT", "."), "pdl_chain.json")
    return args


def _subset(parser, flag: str, text: str, known: tuple, allow_empty: bool = False) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or (not names and not allow_empty):
        parser.error(f"{flag}: {', '.join(unknown) or 'none given'}; choose from {', '.join(known)}")
    return list(dict.fromkeys(names))


# --------------------------------------------------------------------------- the table (CPU)


def _us(timing) -> str:
    return f"{timing['median_us']:.2f}" if timing else "-"


def table_lines(record: dict) -> list[str]:
    """The short table of a record: per setting, ours off and on (median us per call, per chain in the chain), on/off
    per round (median, min-max), each SDPA backend's median, and the gate (ours off / on: ok or FAIL, gate ratio)."""
    backends = record["backends"]
    head = ["setting", OFF, ON, "on/off (min-max)"] + [f"sdpa {b}" for b in backends] + ["gate off/on"]
    rows = [head]
    for name, s in record["settings"].items():
        if "skipped" in s:
            rows.append([name, f"skipped: {s['skipped']}"])
            continue
        t, r = s["timings"], s.get("on_over_off")
        ratio = f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})" if r else "-"
        gate = "/".join(("ok" if g["passed"] else "FAIL") + f" {g['gate_ratio']:.2f}"
                        for g in (s["gate"][OFF], s["gate"][ON]))
        label = f"{name} ({s['unit']})"
        rows.append([label, _us(t.get(OFF)), _us(t.get(ON)), ratio]
                    + [_us(t.get(f"sdpa {b}")) for b in backends] + [gate])
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(head))]
    lines = [f"pdl_chain: {record['device'].get('name', '?')}, {record['shape']}, {record['config_summary']}; "
             f"medians in us, interleaved ({record['rounds']} rounds x {record['reps']} replays)"]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(row, widths))).rstrip() if len(row) == len(head) else "  ".join(row))
    return lines


def config_summary(config: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(config.items()))


# --------------------------------------------------------------------------- GPU


def build(problem, shape, knobs: dict) -> dict:
    """{False: (config, kernel), True: ...}: the config compiled and loaded with pdl off and on."""
    from evotune.build.compile import compile_source, load_kernel, launch_violations
    from evotune.build.template import instantiate
    from evotune.space.searchspace import Config

    built = {}
    for pdl in (False, True):
        config = Config.from_dict({**knobs, "pdl": pdl})
        src = instantiate(problem, config, shape)
        compiled = compile_source(src.code, src.entry)
        geo = problem.geometry(config, shape)
        why = launch_violations(compiled.resources, geo)
        if why:
            sys.exit(f"pdl_chain: {config_summary(config.as_dict())} on {shape.spec}: {'; '.join(why)}")
        assert problem.launch_plan(config, shape).pdl == pdl
        built[pdl] = (config, load_kernel(compiled, geo.dynamic_smem), src.digest)
    return built


def sdpa_call(problem, backend: str | None, q, k, v, shape, scale: float):
    """A callable running SDPA on q, k, v: one backend forced (the family's own baseline_launcher, as bench and the
    gate run it), or None: torch's own choice."""
    if backend is not None:
        return problem.baseline_launcher(backend, shape, {"q": q, "k": k, "v": v, "scale": scale}, probe=False)
    import torch.nn.functional as F

    gqa = {"enable_gqa": True} if shape.kv_heads != shape.heads else {}
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, scale=scale, **gqa)


def usable_backends(problem, shape, names, q, k, v, scale) -> tuple[list[str], dict]:
    """The backends that run on these tensors (each tried once), and why each other one is left out."""
    usable, why = [], {}
    for name in names:
        skip = problem.baseline_skip_reason(name, shape)
        if skip:
            why[name] = skip
            continue
        try:
            sdpa_call(problem, name, q, k, v, shape, scale)()
            sync()
            usable.append(name)
        except RuntimeError as e:
            why[name] = f"refused: {str(e).splitlines()[0][:120]}"
    return usable, why


def gate(problem, shape, out, q, k, v, scale) -> dict:
    """Our output against SDPA (default dispatch: max abs error) and the fp32 reference (the family's gate)."""
    from evotune.gpu.evaluate import output_errors

    inputs = {"q": q, "k": k, "v": v, "scale": scale}
    ref = problem.reference(shape, inputs)
    sdpa = sdpa_call(problem, None, q, k, v, shape, scale)().float()
    atol, rtol = problem.tolerance(shape)
    max_abs, _, nonfinite, ratio = output_errors(out, ref, atol * problem.error_scale(inputs), rtol)
    vs_sdpa = float((out.float() - sdpa).abs().max().item()) if not nonfinite else math.inf
    return {"passed": nonfinite == 0 and ratio <= 1.0, "gate_ratio": ratio, "max_abs_vs_reference": max_abs,
            "max_abs_vs_sdpa": vs_sdpa, "sdpa_max_abs_vs_reference": float((sdpa - ref).abs().max().item()),
            "nonfinite": nonfinite}


def checked(problem, shape, run, outs: dict, q, k, v, scale) -> dict:
    """Per label of `outs`: that output filled with NaN, `run(label)` (a launch, a chain, a timed graph's replay)
    once, then the gate of the output (the q, k, v it read are those tensors' contents afterwards)."""
    report = {}
    for label, out in outs.items():
        out.fill_(float("nan"))
        run(label)
        sync()
        report[label] = gate(problem, shape, out, q, k, v, scale)
    return report


def time_pool(fns: dict, rounds: int, reps: int, launches_per_rep: int | None):
    """The contenders timed interleaved: (their timings, on/off per round and the pool's record; the Interleaved)."""
    from evotune.gpu.evaluate import prepare_launches
    from evotune.gpu.interleave import time_interleaved, whole_cycles

    def prepare(fn, warmup=10):
        return prepare_launches(fn, launches_per_rep, warmup)

    result = time_interleaved(fns, rounds=whole_cycles(len(fns), rounds), reps_per_round=reps, prepare=prepare)
    pool = result.as_dict()
    return {"timings": pool["timings"], "on_over_off": result.ratios(OFF, ON), "interleaved": pool}, result


def single_setting(problem, shape, built, backends, args, launches_per_rep) -> dict:
    """`alone` (launches_per_rep 1) or `back_to_back` (None: as the search picks) on the family's inputs."""
    inputs = problem.make_inputs(shape, args.seed, device=DEVICE)
    q, k, v, scale = inputs["q"], inputs["k"], inputs["v"], inputs["scale"]
    outs = {label: problem.new_output(inputs) for label in (OFF, ON)}
    launches = {label: problem.launcher(built[pdl][1], built[pdl][0], shape, inputs, outs[label])
                for label, pdl in ((OFF, False), (ON, True))}
    before = checked(problem, shape, lambda label: launches[label](), outs, q, k, v, scale)
    fns = {**launches, **{f"sdpa {b}": sdpa_call(problem, b, q, k, v, shape, scale) for b in backends}}
    reps = args.reps * (ALONE_REPS_FACTOR if launches_per_rep == 1 else 1)
    timed, result = time_pool(fns, args.rounds, reps, launches_per_rep)
    after = checked(problem, shape, lambda label: result.replays[label](), outs, q, k, v, scale)
    return {"unit": "per call", "gate": before, "gate_after_timing": after, **timed}


def chain_setting(problem, shape, built, backends, args) -> dict:
    """`chain`: --layers layers of QKV projection, attention, output projection with the residual, per replay."""
    import torch

    if shape.seq_q != shape.seq_k:
        return {"skipped": "the chain is self-attention: seq_q must equal seq_k"}
    b, s, h, kv, d = shape.batch, shape.seq_q, shape.heads, shape.kv_heads, shape.head_dim
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[shape.dtype]
    tokens, hidden, width = b * s, h * d, (h + 2 * kv) * d
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed)

    def randn(rows, cols, scale=1.0):
        return (torch.randn(rows, cols, generator=gen, device=DEVICE) * scale).to(dtype)

    x_in = randn(tokens, hidden)
    w_qkv = [randn(hidden, width, hidden ** -0.5) for _ in range(args.layers)]
    w_o = [randn(hidden, hidden, hidden ** -0.5) for _ in range(args.layers)]
    qkv = torch.empty(tokens, width, dtype=dtype, device=DEVICE)
    xs = [torch.empty(tokens, hidden, dtype=dtype, device=DEVICE) for _ in range(2)]
    # q, k, v: strided (B, H, S, D) views of the projection's output, as a model hands them over (no copy).
    heads = qkv.view(b, s, h + 2 * kv, d)
    q, k, v = (heads[:, :, lo:hi].transpose(1, 2) for lo, hi in ((0, h), (h, h + kv), (h + kv, h + 2 * kv)))
    scale = d ** -0.5
    # Ours writes O in (B, S, H, D) memory, which the output projection reads as (tokens, hidden) without a copy.
    outs = {label: torch.empty(b, s, h, d, dtype=dtype, device=DEVICE).transpose(1, 2) for label in (OFF, ON)}
    inputs = {"q": q, "k": k, "v": v, "scale": scale}
    launches = {label: problem.launcher(built[pdl][1], built[pdl][0], shape, inputs, outs[label])
                for label, pdl in ((OFF, False), (ON, True))}

    def chain(attend):
        def run():
            x = x_in
            for layer in range(args.layers):
                torch.matmul(x, w_qkv[layer], out=qkv)
                o = attend()
                y = xs[layer % 2]
                # SDPA's O becomes (tokens, hidden) as a model's does it: a view where its memory allows, else a copy.
                torch.addmm(x, o.transpose(1, 2).reshape(tokens, hidden), w_o[layer], out=y)
                x = y
            return x
        return run

    ours = {label: chain(lambda label=label: (launches[label](), outs[label])[1]) for label in (OFF, ON)}
    torch.matmul(x_in, w_qkv[0], out=qkv)  # a backend may refuse these strided views where it took the family's
    usable, left_out = usable_backends(problem, shape, backends, q, k, v, scale)
    fns = {**ours, **{f"sdpa {n}": chain(sdpa_call(problem, n, q, k, v, shape, scale)) for n in usable}}
    before = checked(problem, shape, lambda label: ours[label](), outs, q, k, v, scale)
    ends = {label: ours[label]().clone() for label in (OFF, ON)}
    reference_end = chain(sdpa_call(problem, None, q, k, v, shape, scale))().float()
    sync()
    for label, end in ends.items():
        before[label]["chain_output_max_abs_vs_sdpa"] = float((end.float() - reference_end).abs().max().item())
    timed, result = time_pool(fns, args.rounds, args.reps, None)
    after = checked(problem, shape, lambda label: result.replays[label](), outs, q, k, v, scale)
    return {"unit": f"per chain of {args.layers}", "layers": args.layers, "tokens": tokens, "hidden": hidden,
            "backends_left_out": left_out, "gate": before, "gate_after_timing": after, **timed}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("pdl_chain: no CUDA GPU visible")
    from evotune.gpu.workers import device_info, gpu_clocks
    from evotune.problems import get_problem
    from evotune.space.searchspace import load_builtin

    problem = get_problem("attention")
    shape = problem.parse_shape(args.shape)
    problem.check_shape(shape)
    space, context = load_builtin("attention"), problem.context(shape)
    built = build(problem, shape, args.config)
    inputs = problem.make_inputs(shape, args.seed, device=DEVICE)
    backends, left_out = usable_backends(problem, shape, args.backends, inputs["q"], inputs["k"], inputs["v"],
                                         inputs["scale"])
    record = {"tool": "tools/pdl_chain.py", "argv": sys.argv[1:] if argv is None else list(argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": device_info(), **gpu_clocks(), "shape": shape.spec, "shape_dict": shape.as_dict(),
              "config": args.config, "config_summary": config_summary(args.config),
              "source_digests": {OFF: built[False][2], ON: built[True][2]},
              # attention.yaml's verdict (its pdl constraint admits pdl up to 2^32 multiply-adds per Q K^T)
              "space_admits": {label: not space.violations(space.config({**args.config, "pdl": pdl}), context)
                               for label, pdl in ((OFF, False), (ON, True))},
              "rounds": args.rounds, "reps": args.reps, "seed": args.seed, "backends": backends,
              "backends_left_out": left_out, "settings": {}}
    for name in args.settings:
        if name == "chain":
            record["settings"][name] = chain_setting(problem, shape, built, backends, args)
        else:
            record["settings"][name] = single_setting(problem, shape, built, backends, args,
                                                      1 if name == "alone" else None)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print("\n".join(table_lines(record)))
    failed = [f"{n} {label}" for n, s in record["settings"].items() for g in ("gate", "gate_after_timing")
              for label, r in s.get(g, {}).items() if not r["passed"]]
    if failed:
        print(f"pdl_chain: our output FAILED the gate in: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
