"""Five model families end to end with attn_implementation="evotune" (issue 42), random weights, no download.

Builds, from transformers configs, a Gemma-2-like model (Gemma-2-2B's attention: 8 query heads on 4 K/V heads,
head dim 256, query_pre_attn_scalar 256, attn_logit_softcapping 50, final_logit_softcapping 30, alternating sliding
and full layers), a Mistral-like one (Mistral-7B-v0.1: 32 on 8, head dim 128, sliding_window), a Phi-3-like one
(Phi-3.5-mini: 32 on 32, head dim 96, longrope, its window of 262144) and a Qwen2-like one (Qwen2-7B: 28 on 4, head
dim 128, q/k/v bias, rope theta 1e6) and a gpt-oss-like one (gpt-oss-20b: 64 on 8, head dim 64, attention sinks
passed as s_aux, a sliding window of 128 on every other layer, mixture-of-experts MLPs), --layers layers each, seeded,
and for each family and --batch x --seq:

  prefill   the logits of one forward (use_cache=False; the last --check-tokens positions) with "evotune"
            against the family's reference (what transformers runs it with: eager for Gemma-2, whose softcap
            transformers' sdpa refuses; sdpa for the others) and against the other of sdpa / eager where it runs;
            pass where max |diff| / max |reference| <= --tol (default 1e-4 fp32, 2e-2 fp16, 5e-2 bf16). The two
            references against each other are the floor of what rounding alone gives.
  generate  a greedy generate() of --new-tokens tokens (DynamicCache) with each: the tokens equal or the first step
            that differs. A difference fails only where both references agree with each other (else a near-tie).
  calls     every attention call of the evotune prefill and of its generate() (prefill and decode steps): how many,
            the share that ran evotune's kernels (the op's tuned kernel or the decode kernel), and for every other
            call why, with counts: "adapter: ..." where the transformers adapter kept the call from the op (it ran
            transformers' sdpa or math_attention), "op: ..." where the op routed it to SDPA (untuned key, uncovered
            head dim, no CUDA), "decode: ..." where the decode op did.

The sliding window of Gemma-2, Mistral and gpt-oss is --window (default: half the shortest --seq, at most the real 4096 (gpt-oss: 128), so
that it cuts keys at the lengths measured, as 4096 does at the models' own lengths). --record DIR writes each
family's recorded calls as DIR/<family>.shapes.json (evotune.torch.record_shapes' file: `evotune tune --shapes` tunes
it). Prints a short table last; --json writes the whole report. Exit status 1 where a check failed, 2 for bad input.

    python tools/model_families.py                                   # all five: 1x512 and 8 new tokens
    python tools/model_families.py --record shapes/ --json families.json
    evotune tune --shapes shapes/qwen2.shapes.json --table table.json --decode-table table.decode.json
    python tools/model_families.py --table table.json --decode-table table.decode.json
    python tools/model_families.py --device cpu --tiny --seq 16 --new-tokens 3   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import model_bench  # noqa: E402  (puts the repository root on sys.path)
from model_bench import _generate_fn, _kernel_share, free, rel_diff, short, use_table_and_register  # noqa: E402

IMPLS = ("evotune", "sdpa", "eager")
DTYPES = ("auto", "fp16", "bf16", "fp32")
TOL = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 5e-2}
REAL_WINDOW = 4096
TINY_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # inside a 256-token vocabulary

# Per family: the config class, the real model's sizes and flags, the tiny overrides (--tiny: the same head dims,
# GQA ratio and flags, small hidden sizes and vocabulary), whether --window sets its sliding window, its reference.
FAMILIES = {
    "gemma2": {
        "config": "Gemma2Config", "like": "Gemma-2-2B", "windowed": True, "reference": "eager",
        "real": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_attention_heads=8,
                     num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                     final_logit_softcapping=30.0, max_position_embeddings=8192),
        "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                     num_key_value_heads=1),
    },
    "mistral": {
        "config": "MistralConfig", "like": "Mistral-7B-v0.1", "windowed": True, "reference": "sdpa",
        "real": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, max_position_embeddings=32768),
        "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=1),
    },
    "phi3": {  # Phi3Config ties the head dim to hidden / heads (its rope check): the tiny one keeps 96 that way
        "config": "Phi3Config", "like": "Phi-3.5-mini", "windowed": False, "reference": "sdpa",
        "real": dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
                     num_key_value_heads=32, max_position_embeddings=131072, original_max_position_embeddings=4096,
                     sliding_window=262144,
                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "factor": 32.0,
                                      "original_max_position_embeddings": 4096, "short_factor": [1.0] * 48,
                                      "long_factor": [1.0 + 0.25 * i for i in range(48)]}),
        "tiny": dict(vocab_size=256, hidden_size=384, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=4),
    },
    "gptoss": {  # gpt-oss-20b's attention: 64 on 8, head dim 64, sinks (s_aux), sliding window 128 on every other layer
        "config": "GptOssConfig", "like": "gpt-oss-20b", "windowed": True, "window_cap": 128, "reference": "eager",
        "real": dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                     num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                     max_position_embeddings=131072),
        "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_attention_heads=8,
                     num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2),
    },
    "qwen2": {
        "config": "Qwen2Config", "like": "Qwen2-7B", "windowed": False, "reference": "sdpa",
        "real": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                     num_key_value_heads=4, head_dim=128, max_position_embeddings=32768,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=7,
                     num_key_value_heads=1),
    },
}


def release(args, torch) -> None:
    """Free what the last step left on the GPU (a full gc.collect costs about 0.2 s: on the CPU, not worth it)."""
    if args.device == "cuda":
        free(torch)


def fail(msg: str):
    print(f"model_families: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _ints(text: str, option: str, low: int) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < low:
        fail(f"{option} {text!r}: give whole numbers >= {low}, comma-separated")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.error = fail  # one line, not argparse's usage block
    p.add_argument("--families", default=",".join(FAMILIES), help=f"of {', '.join(FAMILIES)}")
    p.add_argument("--seq", default="512", help="prefill lengths, comma-separated")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens generate() adds (0: no generate)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: fp16 on CUDA, fp32 on the CPU")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--layers", type=int, default=2, help="decoder layers per model (Gemma-2: sliding, full, ...)")
    p.add_argument("--window", default="auto",
                   help="the sliding window of Gemma-2, Mistral and gpt-oss (auto: half the shortest --seq, at most 4096; gpt-oss at most its 128)")
    p.add_argument("--tiny", action="store_true", help="tiny configs (the real head dims, GQA ratios and flags)")
    p.add_argument("--check-tokens", type=int, default=512,
                   help="logits compared at each sequence's last N positions (0: all; bounds the logits' memory)")
    p.add_argument("--tol", type=float, default=None, help="max |logits diff| / max |reference logits| allowed")
    p.add_argument("--table", default=None, help="tuning table to route by (default: the current one, "
                                                 "$EVOTUNE_TABLE or the default file)")
    p.add_argument("--decode-table", default=None, help="decode table (default: TABLE.decode.json beside --table "
                                                        "where there is one, else the current one)")
    p.add_argument("--record", default=None, metavar="DIR", help="write DIR/<family>.shapes.json")
    p.add_argument("--json", default=None, metavar="OUT", help="write the whole report as JSON")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    check_args(args)
    return args


def check_args(args) -> None:
    """Bad input is one line and exit 2, before torch or transformers is imported."""
    from evotune.errors import UsageError
    from evotune.outputs import check_output_path

    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown or not args.families:
        fail(f"--families: unknown {', '.join(unknown) or '(none given)'}; of {', '.join(FAMILIES)}")
    args.seqs = _ints(args.seq, "--seq", 1)
    if args.batch < 1 or args.new_tokens < 0 or args.layers < 1 or args.check_tokens < 0:
        fail("--batch and --layers take whole numbers >= 1, --new-tokens and --check-tokens >= 0")
    if args.window == "auto":
        args.window = max(1, min(REAL_WINDOW, min(args.seqs) // 2))
    else:
        args.window = _ints(args.window, "--window", 1)[0]
    if args.tol is not None and not args.tol > 0:
        fail("--tol must be > 0")
    for option, path in (("--table", args.table), ("--decode-table", args.decode_table)):
        if path is not None and not Path(path).is_file():
            fail(f"{option} {path}: no such file")
    try:
        if args.json:
            check_output_path(args.json, "--json")
        if args.record:
            if Path(args.record).exists() and not Path(args.record).is_dir():
                fail(f"--record {args.record}: not a folder")
            for family in args.families:
                check_output_path(str(Path(args.record) / f"{family}.shapes.json"), "--record", create_parents=True)
    except UsageError as e:
        fail(str(e))


# --------------------------------------------------------------------------- models


def build(family: str, args, torch, dtype, max_len: int):
    """The family's model, seeded random weights on args.device in `dtype`, eval mode, no grads; and its config."""
    import transformers

    spec = FAMILIES[family]
    kw = dict(spec["real"])
    if args.tiny:
        kw.update(spec["tiny"], **TINY_TOKENS)
    kw["num_hidden_layers"] = args.layers
    kw["max_position_embeddings"] = max(kw["max_position_embeddings"], max_len)
    if spec["windowed"]:
        kw["sliding_window"] = min(args.window, spec.get("window_cap", args.window))  # gpt-oss: its own 128
    cfg = getattr(transformers, spec["config"])(**kw)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=spec["reference"])
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, cfg


def describe(family: str, cfg) -> str:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    flags = [f"window {cfg.sliding_window}" if getattr(cfg, "sliding_window", None) else "no window"]
    if getattr(cfg, "layer_types", None):
        flags.append("layers " + "/".join(t.split("_")[0] for t in cfg.layer_types))
    if getattr(cfg, "attn_logit_softcapping", None):
        flags.append(f"softcap {cfg.attn_logit_softcapping:g}, query_pre_attn_scalar {cfg.query_pre_attn_scalar}")
    if getattr(cfg, "model_type", None) == "gpt_oss":  # its attention layers hold the sink logits (passed as s_aux)
        flags.append(f"sinks, {cfg.num_local_experts} experts (top {cfg.num_experts_per_tok})")
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type")
    if rope:
        flags.append(f"rope {rope}")
    return (f"{FAMILIES[family]['like']}-like: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
            f"{cfg.num_attention_heads} q heads on {cfg.num_key_value_heads} kv heads, head dim {head_dim}, vocab "
            f"{cfg.vocab_size}; {', '.join(flags)}")


# --------------------------------------------------------------------------- one family and size


def call_summary(share: dict) -> dict:
    """model_bench._kernel_share's counts as this report's: calls, kernel calls, share, and why each other call
    did not reach a kernel ({reason: calls}, the adapter's, the op's and the decode op's)."""
    why = Counter()
    for reason, n in share["adapter_fallbacks"].items():
        why[f"adapter: {reason}"] += n
    for row in share["op_routes"]:
        if row["route"] != "evotune":
            where = "decode" if row.get("family") == "attention-decode" else "op"
            why[f"{where}: {row.get('reason')}"] += row["calls"]
    missing = share["attention_calls"] - share["kernel_calls"] - sum(why.values())
    if missing:  # counted by the adapter but no route recorded: said, not hidden
        why["(no route recorded for these calls)"] += missing
    return {"attention_calls": share["attention_calls"], "kernel_calls": share["kernel_calls"],
            "share": share["share"], "fallbacks": dict(why.most_common()), "adapter": share["adapter"],
            "decode_routes": share["decode_routes"], "routes": share["op_routes"], "notices": share["notices"]}


def run_impl(model, impl, fn, torch):
    """fn() with attn_implementation `impl`: (output, None, error), and for evotune its call summary."""
    try:
        model.set_attn_implementation(impl)
        if impl != "evotune":
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return fn(), None, None
        box = []
        share = _kernel_share(model, lambda: box.append(fn()), torch)
        return box[0], call_summary(share), None
    except Exception as e:  # transformers refusing a family's feature is a finding, not the end of the run
        return None, None, short(e)


def compare_logits(logits: dict, reference: str, tol: float) -> dict:
    out = {}
    for a, b in (("evotune", reference), *(("evotune", i) for i in IMPLS[1:] if i != reference),
                 *((i, reference) for i in IMPLS[1:] if i != reference)):
        if logits.get(a) is not None and logits.get(b) is not None:
            d = rel_diff(logits[a], logits[b])
            out[f"{a}_vs_{b}"] = {**d, "tol": tol, "ok": bool(d["rel"] <= tol)} if a == "evotune" and b == reference \
                else d
    return out


def first_difference(a, b) -> int | None:
    """The first generated step (0-based) where two token tensors differ, None where none does."""
    diff = (a != b).any(dim=0).nonzero()
    return int(diff[0]) if len(diff) else None


def one_row(model, cfg, family, b, s, args, torch, tol) -> dict:
    reference = FAMILIES[family]["reference"]
    gen = torch.Generator(device="cpu").manual_seed(args.seed + b * 100003 + s)
    ids = torch.randint(3, cfg.vocab_size, (b, s), generator=gen).to(args.device)
    row = {"family": family, "batch": b, "seq": s, "reference": reference, "errors": {}}
    logits = {}
    for impl in IMPLS:
        out, calls, err = run_impl(model, impl, lambda: model(input_ids=ids, use_cache=False,
                                                                   logits_to_keep=args.check_tokens).logits, torch)
        logits[impl] = out
        if err:
            row["errors"][f"prefill {impl}"] = err
        if calls:
            row["prefill_calls"] = calls
    row["logits"] = compare_logits(logits, reference, tol)
    logits.clear()
    release(args, torch)
    if args.new_tokens:
        tokens = {}
        for impl in IMPLS:
            if f"prefill {impl}" in row["errors"]:
                continue
            out, calls, err = run_impl(model, impl, _generate_fn(model, ids, "dynamic", args.new_tokens), torch)
            if err:
                row["errors"][f"generate {impl}"] = err
                continue
            tokens[impl] = out[:, s:]
            if calls:
                row["generate_calls"] = calls
        gen_row = {"new_tokens": args.new_tokens}
        if "evotune" in tokens:
            for other in (i for i in IMPLS[1:] if i in tokens):
                gen_row[f"evotune_vs_{other}"] = first_difference(tokens["evotune"], tokens[other])
            refs_agree = all(first_difference(tokens[i], tokens[reference]) is None
                             for i in IMPLS[1:] if i in tokens and reference in tokens)
            gen_row["references_agree"] = refs_agree
            gen_row["ok"] = reference in tokens and (gen_row[f"evotune_vs_{reference}"] is None or not refs_agree)
            gen_row["tokens"] = tokens["evotune"][0].tolist()
        row["generate"] = gen_row
    release(args, torch)
    return row


# --------------------------------------------------------------------------- report


def failed_checks(rows) -> list[str]:
    out = []
    for r in rows:
        tag = f"{r['family']} {r['batch']}x{r['seq']}"
        main = r["logits"].get(f"evotune_vs_{r['reference']}")
        if main is None:
            out.append(f"{tag}: no logits to compare ({'; '.join(r['errors'].values()) or 'none ran'})")
        elif not main["ok"]:
            out.append(f"{tag}: logits rel {main['rel']:.2e} > tol {main['tol']:.0e} against {r['reference']}")
        g = r.get("generate")
        if g is not None and not g.get("ok", False):
            out.append(f"{tag}: generate() tokens differ from {r['reference']}'s at step "
                       f"{g.get('evotune_vs_' + r['reference'])}" if "ok" in g else f"{tag}: evotune generate() failed")
    return out


def _calls(c) -> str:
    return f"{c['kernel_calls']}/{c['attention_calls']}" if c else "-"


def short_table(result) -> str:
    out = [f"{'family':8} {'BxS':8} {'ref':5} {'logits rel':>10} {'max abs':>9} {'ok':4} {'gen':10} "
           f"{'prefill kernel':>14} {'generate kernel':>15}"]
    for r in result["rows"]:
        main = r["logits"].get(f"evotune_vs_{r['reference']}")
        g = r.get("generate") or {}
        diff = g.get(f"evotune_vs_{r['reference']}", "n/a")
        gen = "-" if not g else "same" if diff is None else f"step {diff}" if "ok" in g else "error"
        out.append(f"{r['family']:8} {r['batch']}x{r['seq']:<6} {r['reference']:5} "
                   f"{main['rel'] if main else float('nan'):>10.2e} {main['max_abs'] if main else float('nan'):>9.2e} "
                   f"{('yes' if main and main['ok'] else 'NO'):4} {gen:10} {_calls(r.get('prefill_calls')):>14} "
                   f"{_calls(r.get('generate_calls')):>15}")
    for r in result["rows"]:
        lines = []
        for phase in ("prefill_calls", "generate_calls"):
            for reason, n in ((r.get(phase) or {}).get("fallbacks") or {}).items():
                lines.append(f"  {phase.split('_')[0]:8} {n:4} x {reason[:200]}")
        lines += [f"  error    {k}: {v[:200]}" for k, v in r["errors"].items()]
        if lines:
            out += [f"{r['family']} {r['batch']}x{r['seq']}: not on the kernel / errors"] + lines
    out.append("CHECKS: " + ("ok" if not result["failed_checks"] else "FAILED: " + "; ".join(result["failed_checks"])))
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def run(args) -> dict:
    import torch

    from evotune.torch import record_shapes

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("no CUDA device visible (--device cpu for a CPU run)")
    if args.dtype == "auto":
        args.dtype = "fp16" if args.device == "cuda" else "fp32"
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    tol = args.tol if args.tol is not None else TOL[args.dtype]
    use_table_and_register(args.table)
    if args.decode_table:
        from evotune.torch.decode import use_decode_table

        use_decode_table(str(Path(args.decode_table).resolve()))
    t0 = time.monotonic()
    result = {"env": model_bench.environment(args, torch), "dtype": args.dtype, "tol": tol, "window": args.window,
              "models": {}, "rows": [], "recorded": {}}
    build_failures = []
    for family in args.families:
        try:
            model, cfg = build(family, args, torch, dtype, max(args.seqs) + args.new_tokens)
        except Exception as e:  # this transformers cannot build the config: a finding, the other families still run
            why = " ".join(f"{type(e).__name__}: {e}".split())[:400]  # a validator's cause is on its second line
            result["models"][family] = f"not built: {why}"
            build_failures.append(f"{family}: not built ({why})")
            continue
        result["models"][family] = describe(family, cfg)
        with record_shapes() as rec:
            for s in args.seqs:
                result["rows"].append(one_row(model, cfg, family, args.batch, s, args, torch, tol))
                print(f"[{time.monotonic() - t0:6.0f}s] {family} {args.batch}x{s} done", flush=True)
        if args.record:
            Path(args.record).mkdir(parents=True, exist_ok=True)
            result["recorded"][family] = str(rec.save(Path(args.record) / f"{family}.shapes.json"))
        del model
        release(args, torch)
    result["failed_checks"] = build_failures + failed_checks(result["rows"])
    result["wall_s"] = time.monotonic() - t0
    return result


def main(argv=None) -> int:
    import json

    args = parse_args(argv)
    result = run(args)
    if args.json:
        from evotune.outputs import write_output

        write_output(args.json, json.dumps(result, indent=1, default=str) + "\n", "--json")
    for family, text in result["models"].items():
        print(f"{family}: {text}")
    print(short_table(result))
    return 1 if result["failed_checks"] else 0


if __name__ == "__main__":
    sys.exit(main())
