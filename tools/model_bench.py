"""evotune's attention inside real transformers causal LMs (random weights, no download), beside sdpa and eager.

Builds a Llama-like model (hidden 4096, 32 query heads, 8 K/V heads, head dim 128, intermediate 14336,
--llama-layers layers) and a GPT-2-like one (n_embd 768, 12 heads, 12 layers) from configs, seeded, fp16 on
CUDA, in one process, and for each (model, BxS) in --sizes:

  routing     what evotune.torch.attention routed each attention call to (record_shapes: the tuned kernel,
              or SDPA and why) and the adapter's own fallbacks; the table says which kernel really ran
  logits      attn_implementation="evotune" (and "eager") against "sdpa": max |diff| over the last
              --check-tokens positions, relative to max |logits| of sdpa, checked against --tol
  latency     prefill (forward, no grad, use_cache=False, logits of the last token only, as generate()'s
              prefill) for each --impls in each --modes: eager (CUDA events around one forward, synchronised
              per rep: end-to-end latency with the host cost), graph (the forward captured in a CUDA graph
              with static inputs after warm-up, replayed; its output checked against eager) and compile
              (torch.compile fullgraph=True, dynamic=False: a graph break is a failure); median of --reps
  train       one training step (--train-size, loss.backward()) per model: loss and the largest per-tensor
              max |grad diff| / max |grad| of evotune against sdpa

--e2e measures instead, per model (llama; gpt2; qwen2: Qwen2-7B's attention, 28 query heads on 4 K/V heads, head
dim 128, --qwen2-layers layers) and row, evotune against sdpa_unpacked, each on its own copy of the same weights,
timed in alternating rounds (--rounds; the ratio sdpa_unpacked / evotune per round, median [min-max]):

  prefill     --prefill MODEL:BxS rows in --prefill-modes eager, graph (CUDA graph), compile (fullgraph, default
              mode); logits over the last --check-tokens positions against sdpa_unpacked
  generate    --generate MODEL:BxS contexts: generate() time to first token and decode tokens/s over --new-tokens
              greedy tokens, in --generate-modes dynamic (DynamicCache), static (StaticCache, eager), compile
              (StaticCache with transformers' compiled decode step); the share of generated tokens that agree
  kernel      per row, the attention calls that reached evotune's kernels (the op's routes, the decode routes,
              the adapter's fallbacks to transformers' sdpa)

--tune-trials N first records every row's attention keys and runs `evotune tune --shapes` into --table
(--tune-only: only that). eager attention is skipped where its score matrices would pass --eager-attn-max-gb (said so). Compile runs
last and stops starting new measurements after --budget-s seconds (the rest is recorded as skipped). Writes
JSON (--out) and markdown (--md), prints a short table last; exit status 1 where a correctness check failed.

    python tools/model_bench.py --table TABLE.json --out model_bench.json --md model_bench.md
    python tools/model_bench.py --device cpu --tiny     # a CPU smoke run: no performance claim
    python tools/model_bench.py --e2e --table TABLE.json --prefill llama:1x8192 --generate llama:1x16384
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_SIZES = "llama:1x512,llama:4x4096,llama:1x16384,gpt2:1x512,gpt2:16x1024"
TINY_SIZES = "llama:1x16,llama:2x32,gpt2:1x16,gpt2:2x32"
DEFAULT_COMPILE_SIZES = "gpt2:1x512,llama:1x512,gpt2:16x1024,llama:4x4096,llama:1x16384"
IMPLS = ("sdpa", "sdpa_unpacked", "evotune", "eager")
FAMILIES = ("llama", "gpt2", "qwen2")
MODES = ("eager", "graph", "compile")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny configs and sizes (CPU smoke test)")
    p.add_argument("--sizes", default=None, help=f"model:BxS list (default {DEFAULT_SIZES}; --tiny {TINY_SIZES})")
    p.add_argument("--compile-sizes", default=None,
                   help="which sizes also run under torch.compile, in this order (default: every size, GPT-2 1x512 "
                        "first); 'none' for none")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--llama-layers", type=int, default=4)
    p.add_argument("--llama-vocab", type=int, default=128256)
    p.add_argument("--gpt2-layers", type=int, default=12)
    p.add_argument("--qwen2-layers", type=int, default=4)
    p.add_argument("--check-tokens", type=int, default=128, help="positions whose logits are compared")
    p.add_argument("--tol", type=float, default=None,
                   help="max |logits diff| / max |sdpa logits| allowed (default 2e-2 in fp16, 1e-4 in fp32)")
    p.add_argument("--grad-tol", type=float, default=None,
                   help="max per-tensor |grad diff| / max |grad| allowed (default 5e-2 in fp16, 1e-4 in fp32)")
    p.add_argument("--train-size", default="1x512", help="BxS of the training step ('none' to skip); --tiny: 2x16")
    p.add_argument("--eager-attn-max-gb", type=float, default=24.0)
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--budget-s", type=float, default=None, help="start no compile measurement after this many s")
    p.add_argument("--table", default=None, help="tuning table the op reads (sets EVOTUNE_TABLE)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--md", default=None, help="markdown tables")
    add_e2e_args(p)
    return p.parse_args(argv)


def parse_sizes(text):
    if not text or text == "none":
        return []
    out = []
    for item in text.split(","):
        model, _, bs = item.strip().partition(":")
        b, _, s = bs.partition("x")
        if model not in FAMILIES or not b.isdigit() or not s.isdigit() or int(b) < 1 or int(s) < 1:
            print(f"model_bench: bad size {item!r}: use MODEL:BxS, MODEL one of {', '.join(FAMILIES)}",
                  file=sys.stderr)
            raise SystemExit(2)
        out.append((model, int(b), int(s)))
    return out


def short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return (text[0] if text else type(e).__name__)[:400]


# --------------------------------------------------------------------------- models


def build_model(family, args, max_seq, torch, dtype):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    if family == "llama":
        if args.tiny:
            cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              max_position_embeddings=max(max_seq, 64))
        else:
            cfg = LlamaConfig(vocab_size=args.llama_vocab, hidden_size=4096, intermediate_size=14336,
                              num_hidden_layers=args.llama_layers, num_attention_heads=32, num_key_value_heads=8,
                              head_dim=128, max_position_embeddings=max(max_seq, 8192), rope_theta=500000.0,
                              tie_word_embeddings=False)
    elif family == "qwen2":
        from transformers import Qwen2Config

        if args.tiny:
            cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(max_seq, 64))
        else:  # Qwen2-7B's attention: 28 query heads on 4 K/V heads (groups of 7), head dim 128
            cfg = Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                              num_hidden_layers=args.qwen2_layers, num_attention_heads=28, num_key_value_heads=4,
                              max_position_embeddings=max(max_seq, 32768), rope_theta=1000000.0,
                              tie_word_embeddings=False)
    else:
        if args.tiny:
            cfg = GPT2Config(vocab_size=256, n_embd=64, n_head=4, n_layer=2, n_positions=max(max_seq, 64))
        else:
            cfg = GPT2Config(n_embd=768, n_head=12, n_layer=args.gpt2_layers, n_positions=max(max_seq, 1024))
        cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0  # the training step compares without dropout
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, cfg


def describe(family, cfg) -> str:
    if family == "qwen2":
        return (f"Qwen2-like: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} "
                f"q heads, {cfg.num_key_value_heads} kv heads, head dim {cfg.hidden_size // cfg.num_attention_heads}, "
                f"vocab {cfg.vocab_size}")
    if family == "llama":
        return (f"Llama-like: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} "
                f"q heads, {cfg.num_key_value_heads} kv heads, head dim {cfg.head_dim}, vocab {cfg.vocab_size}")
    return (f"GPT-2-like: {cfg.n_layer} layers, n_embd {cfg.n_embd}, {cfg.n_head} heads, head dim "
            f"{cfg.n_embd // cfg.n_head}, vocab {cfg.vocab_size}")


def attn_bytes(family, cfg, b, s) -> int:
    """Eager attention's score matrices for one layer: fp16 scores, fp32 softmax, fp16 probabilities."""
    heads = cfg.n_head if family == "gpt2" else cfg.num_attention_heads
    return b * heads * s * s * (2 + 4 + 2)


# --------------------------------------------------------------------------- timing


class Timer:
    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def __call__(self, fn, reps, warmup):
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            if self.cuda:
                start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        times.sort()
        return {"median_ms": statistics.median(times), "p10_ms": times[len(times) // 10],
                "p90_ms": times[min(len(times) - 1, (9 * len(times)) // 10)], "reps": reps}


def free(torch):
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rel_diff(a, b) -> dict:
    a, b = a.float(), b.float()
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return {"max_abs": diff, "ref_max_abs": scale, "rel": diff / scale if scale else diff}


# --------------------------------------------------------------------------- one model and size


def forward_fn(model, ids, keep):
    return lambda: model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits


def check_logits(model, ids, impls, args, torch, tol, eager_ok):
    from evotune.torch import hf, record_shapes

    keep = min(args.check_tokens, ids.shape[1])
    out, logits = {}, {}
    with torch.no_grad():
        for impl in impls:
            if (impl == "eager" and not eager_ok) or impl == "sdpa_unpacked":
                continue
            model.set_attn_implementation(impl)
            if impl == "evotune":
                hf.reset_stats()
                with warnings.catch_warnings(record=True) as caught, record_shapes() as rec:
                    warnings.simplefilter("always")
                    logits[impl] = forward_fn(model, ids, keep)()
                out["routing"] = rec.shapes
                out["notices"] = sorted({str(w.message) for w in caught})
                out["adapter"] = {"calls": hf.stats(), "fallbacks": hf.fallbacks()}
            else:
                logits[impl] = forward_fn(model, ids, keep)()
    for impl in ("evotune", "eager"):
        if impl in logits and "sdpa" in logits:
            d = rel_diff(logits[impl], logits["sdpa"])
            d["tol"] = tol if impl == "evotune" else None
            d["ok"] = bool(d["rel"] <= tol) if impl == "evotune" else None
            out[f"{impl}_vs_sdpa"] = d
    return out


def route_summary(rows) -> str:
    if not rows:
        return "no op call"
    kernel = sum(r["calls"] for r in rows if r["route"] == "evotune")
    total = sum(r["calls"] for r in rows)
    if kernel == total:
        return f"evotune kernel ({total} calls)"
    reasons = sorted({f"{r['kind']}: {r['reason']}" for r in rows if r["route"] != "evotune"})
    head = f"SDPA {total - kernel}/{total} calls" + (f", kernel {kernel}" if kernel else "")
    return f"{head} ({'; '.join(reasons)})"


def measure(model, ids, impl, mode, args, torch, timer, ref_logits):
    """One latency measurement: {"median_ms", ...} or {"error"} / {"skipped"}."""
    model.set_attn_implementation(impl)
    fn = forward_fn(model, ids, 1)
    try:
        with torch.no_grad():
            if mode == "eager":
                return timer(fn, args.reps, args.warmup)
            if mode == "graph":
                return measure_graph(fn, args, torch, timer, ref_logits)
            return measure_compile(model, ids, args, torch, timer, ref_logits)
    except Exception as e:  # a failure is a value in the table, never the end of the run
        if args.debug_traceback:
            traceback.print_exc()
        return {"error": short(e), "graph_break": "graph break" in str(e).lower() or "Unsupported" in type(e).__name__}
    finally:
        free(torch)


@contextlib.contextmanager
def _one_mode(row: dict, mode: str, args, torch):
    """One mode's measurement of a row: a failure becomes the row's value for that mode (never the end of the run),
    and after it, whatever happened, compiled graphs are dropped and the memory freed."""
    try:
        yield
    except Exception as e:
        if args.debug_traceback:
            traceback.print_exc()
        row["modes"][mode] = {"error": short(e)}
    finally:
        if mode == "compile":
            torch._dynamo.reset()
        free(torch)


def measure_graph(fn, args, torch, timer, ref_logits):
    if args.device != "cuda":
        return {"skipped": "CUDA graphs need a CUDA device"}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(2, args.warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn()
    graph.replay()
    torch.cuda.synchronize()
    check = rel_diff(static_out, ref_logits)
    result = timer(graph.replay, args.reps, args.warmup)
    result["replay_vs_eager"] = check
    if check["rel"] > args.tol:  # a capture that recorded nothing replays stale or empty logits
        result["error"] = f"graph replay's logits differ from eager's (rel {check['rel']:.3g}): capture is wrong"
    del graph, static_out
    return result


def measure_compile(model, ids, args, torch, timer, ref_logits):
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=args.compile_backend)
    fn = forward_fn(compiled, ids, 1)
    t = time.perf_counter()
    first = fn()
    timer.sync()
    compile_s = time.perf_counter() - t
    check = rel_diff(first, ref_logits)
    result = timer(fn, args.reps, args.warmup)
    result.update(compile_s=compile_s, compiled_vs_eager=check)
    if check["rel"] > args.tol:
        result["error"] = f"compiled logits differ from eager's (rel {check['rel']:.3g})"
    del compiled, first
    torch._dynamo.reset()
    return result


def fp32_reference(model, ids, grads, torch) -> dict:
    """Both half-precision gradients against the same step in fp32 (the model cast up, sdpa's math): two fp16
    attentions differ by their rounding, so evotune's gradients pass where, for every parameter, their error
    from fp32 is at most twice sdpa's plus 1e-3 of the tensor's largest fp32 gradient (the GPU tests' rule)."""
    import copy

    from torch.nn.attention import SDPBackend, sdpa_kernel

    # A copy: casting the model itself up and back would also cast its fp32 buffers (Llama's rotary inv_freq)
    # to fp16, and every later measurement would run another model (seen: compiled logits then differed).
    exact_model = copy.deepcopy(model).float()
    try:
        exact_model.set_attn_implementation("sdpa")
        with sdpa_kernel(SDPBackend.MATH):
            exact_model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        exact = {n: p.grad.detach() for n, p in exact_model.named_parameters() if p.grad is not None}
        worst = {"evotune": (0.0, None), "sdpa": (0.0, None)}
        failing = []
        for n, g in exact.items():
            scale = g.abs().max().item() or 1.0
            errs = {impl: (grads[impl][n].float() - g).abs().max().item() for impl in ("evotune", "sdpa")}
            for impl, err in errs.items():
                if err / scale > worst[impl][0]:
                    worst[impl] = (err / scale, n)
            if errs["evotune"] > 2 * errs["sdpa"] + 1e-3 * scale:
                failing.append(n)
        return {"grad_vs_fp32_evotune": worst["evotune"][0], "grad_vs_fp32_evotune_param": worst["evotune"][1],
                "grad_vs_fp32_sdpa": worst["sdpa"][0], "grad_vs_fp32_sdpa_param": worst["sdpa"][1],
                "grad_vs_fp32_failing": failing[:5], "grad_vs_fp32_ok": not failing}
    finally:
        del exact_model
        free(torch)


def train_step(model, family, args, torch, grad_tol):
    from evotune.torch import hf, record_shapes

    b, s = (int(x) for x in args.train_size.split("x"))
    gen = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    ids = torch.randint(0, model.config.vocab_size, (b, s), generator=gen).to(args.device)
    params = [(n, p) for n, p in model.named_parameters()]
    for _, p in params:
        p.requires_grad_(True)
    model.train()
    res, grads = {"size": args.train_size}, {}
    try:
        for impl in ("sdpa", "evotune"):
            model.set_attn_implementation(impl)
            model.zero_grad(set_to_none=True)
            hf.reset_stats()
            with warnings.catch_warnings(record=True) as caught, record_shapes() as rec:
                warnings.simplefilter("always")
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
            res[f"loss_{impl}"] = loss.item()
            grads[impl] = {n: p.grad.detach().clone() for n, p in params if p.grad is not None}
            if impl == "evotune":
                res["routing"] = route_summary(rec.shapes)
                res["notices"] = sorted({str(w.message) for w in caught})
                res["adapter"] = {"calls": hf.stats(), "fallbacks": hf.fallbacks()}
        worst, worst_name = 0.0, None
        for n, g in grads["sdpa"].items():
            d = rel_diff(grads["evotune"][n], g)["rel"]
            if d > worst:
                worst, worst_name = d, n
        res.update(loss_abs_diff=abs(res["loss_evotune"] - res["loss_sdpa"]), grad_max_rel=worst,
                   grad_worst_param=worst_name, grad_tensors=len(grads["sdpa"]), grad_tol=grad_tol)
        loss_ok = res["loss_abs_diff"] <= grad_tol * max(1.0, abs(res["loss_sdpa"]))
        if next(model.parameters()).dtype == torch.float32:
            res["ok"] = bool(worst <= grad_tol and loss_ok)
        else:
            res.update(fp32_reference(model, ids, grads, torch))
            res["ok"] = bool(res["grad_vs_fp32_ok"] and loss_ok)
    except Exception as e:
        res.update(error=short(e), ok=False)
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
        for _, p in params:
            p.requires_grad_(False)
        grads.clear()
        free(torch)
    return res


# --------------------------------------------------------------------------- environment and output


def environment(args, torch):
    import transformers

    import evotune.torch as et

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
           "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "host": platform.node()}
    try:
        env["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True, timeout=10).stdout.strip() or None
    except Exception:
        env["git"] = None
    if args.device == "cuda":
        env["device"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    else:
        env["device"] = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores): no performance claim"
    env["table"] = str(et.table_path())
    try:
        table = et.current_table()
        env["table_entries"] = None if table is None else len(table.entries)
    except Exception as e:
        env["table_error"] = short(e)
    return env


def fmt(m) -> str:
    if m is None:
        return "-"
    if "median_ms" in m and "error" not in m:
        return f"{m['median_ms']:.2f}"
    if "error" in m:
        return "FAIL" + (" (graph break)" if m.get("graph_break") else "")
    return "skip"


def ratio(m, ref) -> str:
    ok = lambda x: x and "median_ms" in x and "error" not in x
    return f"{ref['median_ms'] / m['median_ms']:.2f}x" if ok(m) and ok(ref) else "-"


def markdown(result) -> str:
    env = result["env"]
    lines = [f"Device: {env['device']}" + (f" (CUDA {env.get('cuda')}, cc {env.get('capability')})" if env.get("cuda") else ""),
             f"Versions: torch {env['torch']}, transformers {env['transformers']}, python {env['python']}, "
             f"evotune git {env.get('git')}", f"Date: {env['date']}", f"Command: `{env['command']}`",
             f"Tuning table: {env['table']} ({env.get('table_entries', env.get('table_error'))} entries)", ""]
    for fam, text in result["models"].items():
        lines.append(f"- {fam}: {text}")
    lines += ["", "Prefill latency, ms (median; forward, no grad, use_cache=False, last-token logits). sdpa: "
              "transformers' stock sdpa (it materialises the causal mask while compiling or capturing); sdpa_unpacked "
              "and evotune: no mask, is_causal (hf.register(assume_unpacked=True)); speedup = sdpa_unpacked / "
              "evotune in the same mode:", "",
              "| model | BxS | impl | eager | CUDA graph | torch.compile | speedup eager / graph / compile | evotune op route |",
              "|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        t = row["timings"]
        for impl in row["impls"]:
            m = t.get(impl, {})
            base = t.get("sdpa_unpacked") or t.get("sdpa", {})
            sp = (" / ".join(ratio(m.get(mode), base.get(mode)) for mode in MODES)
                  if impl == "evotune" and not result["env"]["device"].startswith("CPU") else "")
            route = row["route"] if impl == "evotune" else ""
            lines.append(f"| {row['model']} | {row['size']} | {impl} | {fmt(m.get('eager'))} | {fmt(m.get('graph'))} | "
                         f"{fmt(m.get('compile'))} | {sp} | {route} |")
    lines += ["", f"Logits over the last {result['check_tokens']} positions, against sdpa (rel = max |diff| / max |sdpa "
              f"logits|):", "", "| model | BxS | evotune rel | tol | ok | eager rel (fp reference) |", "|---|---|---|---|---|---|"]
    for row in result["rows"]:
        c = row["check"]
        e, x = c.get("evotune_vs_sdpa"), c.get("eager_vs_sdpa")
        lines.append(f"| {row['model']} | {row['size']} | {e['rel']:.2e} | {e['tol']:.0e} | {e['ok']} | "
                     f"{x['rel']:.2e} |" if e and x else
                     f"| {row['model']} | {row['size']} | {e['rel']:.2e} | {e['tol']:.0e} | {e['ok']} | skipped |" if e
                     else f"| {row['model']} | {row['size']} | - | - | {c.get('error', '-')} | - |")
    lines += ["", "Training step (loss.backward()), evotune against sdpa, and both against the same step in fp32 "
              "(max over parameters of max |grad - fp32 grad| / max |fp32 grad|; ok: every parameter's evotune error "
              "<= 2x sdpa's + 1e-3):", "",
              "| model | BxS | loss sdpa | loss evotune | max rel grad diff evotune-sdpa | evotune vs fp32 | "
              "sdpa vs fp32 | ok | op route |", "|---|---|---|---|---|---|---|---|---|"]
    for fam, t in result["train"].items():
        if "loss_evotune" in t:
            fp32 = (f"{t['grad_vs_fp32_evotune']:.2e} | {t['grad_vs_fp32_sdpa']:.2e}" if "grad_vs_fp32_ok" in t
                    else "- | -")
            lines.append(f"| {fam} | {t['size']} | {t['loss_sdpa']:.5f} | {t['loss_evotune']:.5f} | "
                         f"{t['grad_max_rel']:.2e} | {fp32} | {t['ok']} | {t.get('routing')} |")
        else:
            lines.append(f"| {fam} | {t.get('size')} | - | - | - | - | - | {t.get('error', t.get('skipped'))} | |")
    failures = [f"{r['model']} {r['size']} {impl} {mode}: {m['error']}" for r in result["rows"]
                for impl, modes in r["timings"].items() for mode, m in modes.items() if m and "error" in m]
    skipped = [f"{r['model']} {r['size']} {impl} {mode}: {m['skipped']}" for r in result["rows"]
               for impl, modes in r["timings"].items() for mode, m in modes.items() if m and "skipped" in m]
    lines += _list_section("Failures", failures)
    lines += _list_section("Skipped", skipped)
    notices = sorted({n for r in result["rows"] for n in r["check"].get("notices", [])})
    lines += _list_section("Notices from the op and the adapter", notices)
    return "\n".join(lines) + "\n"


def _list_section(title: str, items) -> list[str]:
    """Markdown lines of a titled bullet list, none where there are no items."""
    return ["", f"{title}:", ""] + [f"- {x}" for x in items] if items else []


def short_table(result) -> str:
    out = [f"{'model':6} {'BxS':9} {'impl':13} {'eager':>9} {'graph':>9} {'compile':>9}  route"]
    for row in result["rows"]:
        for impl in row["impls"]:
            m = row["timings"].get(impl, {})
            out.append(f"{row['model']:6} {row['size']:9} {impl:13} {fmt(m.get('eager')):>9} {fmt(m.get('graph')):>9} "
                       f"{fmt(m.get('compile')):>9}  {row['route'][:70] if impl == 'evotune' else ''}")
    for fam, t in result["train"].items():
        out.append(f"train {fam}: ok={t.get('ok')} loss {t.get('loss_sdpa')} vs {t.get('loss_evotune')}, "
                   f"grad rel {t.get('grad_max_rel')}, vs fp32: evotune {t.get('grad_vs_fp32_evotune')} sdpa "
                   f"{t.get('grad_vs_fp32_sdpa')} failing {t.get('grad_vs_fp32_failing')}"
                   + (f" error {t['error']}" if "error" in t else ""))
    out.append("CHECKS: " + ("ok" if not result["failed_checks"] else "FAILED: " + "; ".join(result["failed_checks"])))
    return "\n".join(out)


# --------------------------------------------------------------------------- end to end (--e2e)
#
# Per model and size, evotune against sdpa_unpacked (transformers' sdpa under the same mask policy: no mask for
# an unpadded causal prefill, hf.register(assume_unpacked=True)), each on its own copy of the same weights, so
# every mode's compiled or captured function of both lives at once and the two are timed in alternating rounds
# (order swapped every round): the ratio is taken per round (sdpa's time / evotune's) and its median, min and
# max over --rounds are reported, so a drift of the machine lands on both alike.

E2E_PREFILL = ("gpt2:1x512,gpt2:1x8192,gpt2:8x2048,llama:1x512,llama:1x8192,llama:8x2048,"
               "qwen2:1x512,qwen2:1x8192,qwen2:8x2048")
E2E_GENERATE = "gpt2:1x2048,gpt2:8x2048,llama:1x2048,llama:1x16384,llama:8x2048,qwen2:1x2048,qwen2:1x16384,qwen2:8x2048"
PREFILL_MODES = ("eager", "graph", "compile")
GENERATE_MODES = ("dynamic", "static", "compile")
E2E_IMPLS = ("sdpa_unpacked", "evotune")


def add_e2e_args(p):
    g = p.add_argument_group("end to end (--e2e)")
    g.add_argument("--e2e", action="store_true", help="prefill and generate() rows, evotune vs sdpa_unpacked in "
                                                      "alternating rounds (the options below)")
    g.add_argument("--prefill", default=None, help=f"MODEL:BxS prefill rows ('none'; default {E2E_PREFILL})")
    g.add_argument("--generate", default=None, help=f"MODEL:BxS generate() contexts ('none'; default {E2E_GENERATE})")
    g.add_argument("--prefill-modes", default=",".join(PREFILL_MODES), help="eager, graph (CUDA graph), compile "
                                                                            "(torch.compile fullgraph, default mode)")
    g.add_argument("--generate-modes", default=",".join(GENERATE_MODES),
                   help="dynamic (DynamicCache, eager), static (StaticCache, eager), compile (StaticCache with "
                        "transformers' own compiled decode step: torch.compile, CUDA graphs)")
    g.add_argument("--rounds", type=int, default=5, help="alternating rounds per measurement")
    g.add_argument("--new-tokens", type=int, default=32, help="decode steps timed by generate()")
    g.add_argument("--tune-trials", type=int, default=0,
                   help="first record every row's attention keys and run `evotune tune --shapes` with this many "
                        "trials per key into --table (0: use --table as it is)")
    g.add_argument("--tune-only", action="store_true", help="stop after --tune-trials' tuning (a device call of its own)")


def _paired(fns: dict, rounds: int, reps: int, warmup: int, timer) -> dict:
    """Each impl's fn timed `reps` times a round, rounds alternating (order swapped each round): per impl the
    median of each round's median; ratio = sdpa_unpacked / evotune per round, median, min and max."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    timer.sync()
    per_round = {n: [] for n in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            per_round[name].append(timer(fns[name], reps, 0)["median_ms"])
    out = {n: {"median_ms": statistics.median(x), "min_ms": min(x), "max_ms": max(x), "rounds_ms": x}
           for n, x in per_round.items()}
    if "sdpa_unpacked" in per_round and "evotune" in per_round:
        ratios = [a / b for a, b in zip(per_round["sdpa_unpacked"], per_round["evotune"])]
        out["ratio"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def _graph_fn(fn, torch):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph.replay, out, graph


def _prefill_fns(models, ids, mode, torch, args):
    """{impl: zero-argument callable} for one prefill mode, and what must stay alive (graphs, compiled models)."""
    fns, keep = {}, []
    for impl, model in models.items():
        fn = forward_fn(model, ids, 1)
        if mode == "graph":
            replay, out, graph = _graph_fn(fn, torch)
            keep += [out, graph]
            fn = replay
        elif mode == "compile":
            compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=args.compile_backend)
            keep.append(compiled)
            fn = forward_fn(compiled, ids, 1)
        fns[impl] = fn
    return fns, keep


def _generate_fn(model, ids, mode, new_tokens):
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if mode in ("static", "compile"):
        kw["cache_implementation"] = "static"
        kw["disable_compile"] = mode == "static"
    attn = ids.new_ones(ids.shape)
    return lambda: model.generate(input_ids=ids, attention_mask=attn, **kw)


def _kernel_share(model, call, torch):
    """Which attention calls of one run of `call` reached evotune's kernels: the adapter's own fallbacks to
    transformers' sdpa, the op's routes (record_shapes) and the decode routes (evotune.torch.decode)."""
    from evotune.torch import hf, record_shapes

    decode_routes = {}
    try:
        from evotune.torch import decode as decode_mod
    except ImportError:
        decode_mod = None
    real = decode_mod.decode_attention if decode_mod else None
    if decode_mod is not None:
        def counted(q, k, v, **kw):
            route = decode_mod.decode_route(q, k, v, kw.get("causal", False))
            decode_routes[route] = decode_routes.get(route, 0) + 1
            return real(q, k, v, **kw)

        decode_mod.decode_attention = counted
    hf.reset_stats()
    try:
        with warnings.catch_warnings(record=True) as caught, record_shapes() as rec, torch.no_grad():
            warnings.simplefilter("always")
            call()
    finally:
        if decode_mod is not None:
            decode_mod.decode_attention = real
    rows = rec.shapes
    adapter = hf.stats()
    # The recorder's decode rows (family attention-decode) are the decode routes counted above: counted once.
    op_kernel = sum(r["calls"] for r in rows if r["route"] == "evotune" and r.get("family", "attention") == "attention")
    decode_kernel = sum(n for route, n in decode_routes.items() if route == "evotune")
    total = sum(adapter.values())  # the op's, transformers' sdpa's and (a softcap with a mask) math_attention's
    return {"attention_calls": total, "kernel_calls": op_kernel + decode_kernel,
            "share": (op_kernel + decode_kernel) / total if total else None, "adapter": adapter,
            "adapter_fallbacks": hf.fallbacks(), "op_routes": rows, "decode_routes": decode_routes,
            "notices": sorted({str(w.message) for w in caught})}


def _tune_first(args, torch, dtype, prefill, generate) -> dict:
    """Record the attention keys of every row (one prefill per prefill row, one generate() per context: its decode
    step too) and run `evotune tune --shapes` into --table, its decode keys into the decode table beside it
    (decode_table_beside), which use_table_and_register then puts in use."""
    from evotune.torch import hf, record_shapes

    table = Path(args.table or "e2e-table.json").resolve()
    shapes = table.with_suffix(".shapes.json")
    hf.register("evotune", assume_unpacked=True)
    with record_shapes() as rec, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for family in dict.fromkeys(f for f, _, _ in prefill + generate):
            sizes = [(b, s, "p") for f, b, s in prefill if f == family] + \
                    [(b, s, "g") for f, b, s in generate if f == family]
            model, cfg = build_model(family, args, max(s for _, s, _ in sizes) + args.new_tokens, torch, dtype)
            model.set_attn_implementation("evotune")
            for b, s, kind in sizes:
                ids = torch.randint(0, cfg.vocab_size, (b, s), device=args.device)
                if kind == "p":
                    model(input_ids=ids, use_cache=False, logits_to_keep=1)
                else:
                    _generate_fn(model, ids, "dynamic", 2)()
            del model
            free(torch)
    rec.save(shapes)
    cmd = [sys.executable, "-m", "evotune", "tune", "--shapes", str(shapes), "--trials", str(args.tune_trials),
           "--table", str(table), "--decode-table", str(decode_table_beside(table))]
    t = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    args.table = str(table)
    return {"command": " ".join(cmd[1:]), "shapes": rec.specs(), "decode_shapes": rec.specs("attention-decode"),
            "rc": proc.returncode,
            "seconds": time.monotonic() - t, "tail": (proc.stdout + proc.stderr)[-3000:]}


def _save_partial(args, result) -> None:
    """The rows so far to --out (a device call stopped by its timeout keeps them); main() writes the whole."""
    if args.out:
        Path(args.out).write_text(json.dumps({**result, "partial": True}, indent=1, default=str) + "\n")


def run_e2e(args) -> dict:
    import copy

    import torch

    prefill = parse_sizes(args.prefill if args.prefill is not None else ("gpt2:1x16,llama:2x16,qwen2:1x16" if args.tiny
                                                                       else E2E_PREFILL))
    generate = parse_sizes(args.generate if args.generate is not None else ("llama:1x16,qwen2:2x16" if args.tiny
                                                                         else E2E_GENERATE))
    pmodes = [m for m in args.prefill_modes.split(",") if m]
    gmodes = [m for m in args.generate_modes.split(",") if m]
    if set(pmodes) - set(PREFILL_MODES) or set(gmodes) - set(GENERATE_MODES) or args.rounds < 1:
        print(f"model_bench: --prefill-modes of {PREFILL_MODES}, --generate-modes of {GENERATE_MODES}, "
              f"--rounds >= 1", file=sys.stderr)
        raise SystemExit(2)
    if args.tune_only and not args.tune_trials:
        print("model_bench: --tune-only needs --tune-trials N", file=sys.stderr)
        raise SystemExit(2)
    if args.table and not args.tune_trials and not Path(args.table).is_file():
        print(f"model_bench: no tuning table at {args.table} (--tune-trials N makes one)", file=sys.stderr)
        raise SystemExit(2)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("model_bench: no CUDA device visible (use --device cpu --tiny for a smoke run)", file=sys.stderr)
        raise SystemExit(2)
    fp16 = args.device == "cuda"
    dtype = torch.float16 if fp16 else torch.float32
    args.tol = args.tol if args.tol is not None else (2e-2 if fp16 else 1e-4)
    args.debug_traceback = bool(os.environ.get("MODEL_BENCH_TRACEBACK"))
    t0 = time.monotonic()
    result = {"e2e": True, "models": {}, "prefill": [], "generate": [], "tune": None, "failed_checks": [],
              "rounds": args.rounds, "reps": args.reps, "new_tokens": args.new_tokens}
    if args.tune_trials:
        result["tune"] = _tune_first(args, torch, dtype, prefill, generate)
        print(f"[{time.monotonic() - t0:6.0f}s] tune: rc {result['tune']['rc']}", flush=True)
        if result["tune"]["rc"]:
            result["failed_checks"].append(f"evotune tune exited {result['tune']['rc']}")
        if args.tune_only:
            prefill, generate = [], []
    if args.table and not Path(args.table).is_file():  # a tune that wrote nothing: said, not a traceback
        result["failed_checks"].append(f"no tuning table at {args.table}")
        args.table = None
    et = use_table_and_register(args.table)
    result["env"] = environment(args, torch)
    if args.device == "cuda" and result["env"].get("table_entries"):
        try:
            result["warmup"] = et.warmup()
        except Exception as e:
            result["warmup"] = {"error": short(e)}
    from evotune.torch import launcher

    # The compiled launcher (evotune.torch.launcher): loaded by the warm-up where a table exists; its state is part of
    # what a row measured (without it the op launches from Python).
    result["env"]["launcher"] = {"loaded": bool(launcher.ACTIVE[0]), "why_not": launcher.why_not()}
    timer = Timer(torch, args.device)

    def over_budget():
        return args.budget_s is not None and time.monotonic() - t0 > args.budget_s

    for family in dict.fromkeys(f for f, _, _ in prefill + generate):
        longest = max([s for f, _, s in prefill if f == family] + [s + args.new_tokens for f, _, s in generate
                                                                     if f == family])
        base, cfg = build_model(family, args, longest, torch, dtype)
        result["models"][family] = describe(family, cfg)
        models = {"sdpa_unpacked": base, "evotune": copy.deepcopy(base)}  # the same weights, one copy per impl
        for impl, model in models.items():
            model.set_attn_implementation(impl)
        for _, b, s in [x for x in prefill if x[0] == family]:
            gen = torch.Generator(device="cpu").manual_seed(args.seed + b * 100003 + s)
            ids = torch.randint(0, cfg.vocab_size, (b, s), generator=gen).to(args.device)
            row = {"model": family, "size": f"{b}x{s}", "modes": {}}
            keep = min(args.check_tokens, s)
            with torch.no_grad():
                ref = forward_fn(models["sdpa_unpacked"], ids, keep)()
                got = forward_fn(models["evotune"], ids, keep)()
            row["logits"] = rel_diff(got, ref)
            row["logits"]["ok"] = bool(row["logits"]["rel"] <= args.tol)
            row["kernel"] = _kernel_share(models["evotune"], forward_fn(models["evotune"], ids, 1), torch)
            del ref, got
            for mode in pmodes:
                if mode == "graph" and args.device != "cuda":
                    row["modes"][mode] = {"skipped": "CUDA graphs need a CUDA device"}
                    continue
                if over_budget():
                    row["modes"][mode] = {"skipped": f"--budget-s {args.budget_s:g} spent"}
                    continue
                with _one_mode(row, mode, args, torch), torch.no_grad():
                    fns, alive = _prefill_fns(models, ids, mode, torch, args)
                    row["modes"][mode] = _paired(fns, args.rounds, args.reps, args.warmup, timer)
                    del fns, alive
            result["prefill"].append(row)
            _save_partial(args, result)
            print(f"[{time.monotonic() - t0:6.0f}s] prefill {family} {b}x{s} done", flush=True)
        for _, b, s in [x for x in generate if x[0] == family]:
            gen = torch.Generator(device="cpu").manual_seed(args.seed + 7 + b * 100003 + s)
            ids = torch.randint(0, cfg.vocab_size, (b, s), generator=gen).to(args.device)
            row = {"model": family, "context": f"{b}x{s}", "new_tokens": args.new_tokens, "modes": {}}
            row["kernel"] = _kernel_share(models["evotune"], _generate_fn(models["evotune"], ids, "dynamic", 4),
                                          torch)
            for mode in gmodes:
                if over_budget():
                    row["modes"][mode] = {"skipped": f"--budget-s {args.budget_s:g} spent"}
                    continue
                with _one_mode(row, mode, args, torch):
                    with torch.no_grad():
                        tokens = {i: _generate_fn(m, ids, mode, args.new_tokens)()[:, s:] for i, m in models.items()}
                        first = {i: _generate_fn(m, ids, mode, 1) for i, m in models.items()}
                        full = {i: _generate_fn(m, ids, mode, args.new_tokens) for i, m in models.items()}
                        # The first token is a host-bound ~10 ms: --reps of it a round (one a round let a single
                        # slow call make the round's number; GPT-2 1x2048 read 0.89x [0.84-0.90] so on 2026-11-28).
                        ttft = _paired(first, args.rounds, args.reps, 1, timer)
                        whole = _paired(full, args.rounds, max(2, args.reps // 3), 1, timer)
                    same = (tokens["evotune"] == tokens["sdpa_unpacked"]).float().mean().item()
                    steps = args.new_tokens - 1
                    # Per round: the decode steps' time is the whole generate() less the first token's.
                    decode_ms = {i: [w - f for w, f in zip(whole[i]["rounds_ms"], ttft[i]["rounds_ms"])]
                                 for i in models}
                    row["modes"][mode] = {"ttft": ttft, "generate": whole, "same_tokens": same}
                    if min(min(x) for x in decode_ms.values()) <= 0:  # the machine's noise beat the decode steps
                        row["modes"][mode]["decode_error"] = ("a generate() timed no longer than its first token: "
                                                              "raise --new-tokens")
                        continue
                    tps = {i: b * steps / (statistics.median(x) / 1e3) for i, x in decode_ms.items()}
                    ratios = [a / e for a, e in zip(decode_ms["sdpa_unpacked"], decode_ms["evotune"])]
                    row["modes"][mode].update(decode_tokens_per_s=tps, decode_ratio=statistics.median(ratios),
                                              decode_ratio_range=[min(ratios), max(ratios)])
            result["generate"].append(row)
            _save_partial(args, result)
            print(f"[{time.monotonic() - t0:6.0f}s] generate {family} {b}x{s} done", flush=True)
        del models, base
        free(torch)
    for row in result["prefill"]:
        if not row["logits"]["ok"]:
            result["failed_checks"].append(f"logits {row['model']} {row['size']}")
    result["wall_s"] = time.monotonic() - t0
    return result


def _ms(m, impl) -> str:
    if not m or "error" in m:
        return "FAIL" if m else "-"
    if "skipped" in m:
        return "skip"
    return f"{m[impl]['median_ms']:.2f}"


def _ratio(m) -> str:
    if not m or "ratio" not in m:
        return "-"
    r = m["ratio"]
    return f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]"


def e2e_markdown(result) -> str:
    env = result["env"]
    lines = [f"Device: {env['device']}" + (f" (CUDA {env.get('cuda')}, cc {env.get('capability')})" if env.get("cuda") else ""),
             f"Versions: torch {env['torch']}, transformers {env['transformers']}, python {env['python']}, "
             f"evotune git {env.get('git')}", f"Date: {env['date']}", f"Command: `{env['command']}`",
             f"Tuning table: {env['table']} ({env.get('table_entries', env.get('table_error'))} entries)", ""]
    lines += [f"- {fam}: {text}" for fam, text in result["models"].items()]
    if result.get("tune"):
        t = result["tune"]
        lines += ["", f"Tuned first: `{t['command']}` (exit {t['rc']}, {t['seconds']:.0f} s), keys: "
                      f"{', '.join(t['shapes'])}"]
    lines += ["", f"Prefill, ms (median of {result['rounds']} alternating rounds of {result['reps']} forwards; speed = "
              "sdpa_unpacked / evotune per round, median [min-max]; kernel = attention calls that ran evotune's kernel):",
              "", "| model | BxS | mode | sdpa_unpacked | evotune | speed | logits rel | kernel |", "|---|---|---|---|---|---|---|---|"]
    for row in result["prefill"]:
        k = row["kernel"]
        share = f"{k['kernel_calls']}/{k['attention_calls']}"
        for mode, m in row["modes"].items():
            lines.append(f"| {row['model']} | {row['size']} | {mode} | {_ms(m, 'sdpa_unpacked')} | {_ms(m, 'evotune')} | "
                         f"{_ratio(m)} | {row['logits']['rel']:.1e} | {share} |")
    lines += ["", f"generate(), {result['new_tokens']} new tokens, greedy: time to first token (ms; {result['reps']} "
              f"first tokens a round, {max(2, result['reps'] // 3)} whole generate() calls) and decode tokens/s "
              "(batch x (new tokens - 1) / (generate time - first-token time)); speed = sdpa_unpacked / evotune:", "",
              "| model | context | mode | TTFT sdpa | TTFT evotune | TTFT speed | decode tok/s sdpa | decode tok/s evotune | "
              "decode ratio | same tokens | kernel |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["generate"]:
        k = row["kernel"]
        share = f"{k['kernel_calls']}/{k['attention_calls']}"
        for mode, m in row["modes"].items():
            if "ttft" not in m:
                lines.append(f"| {row['model']} | {row['context']} | {mode} | {m.get('error', m.get('skipped'))} "
                             f"| | | | | | | {share} |")
                continue
            if "decode_tokens_per_s" in m:
                t = m["decode_tokens_per_s"]
                decode = (f"{t['sdpa_unpacked']:.0f} | {t['evotune']:.0f} | {m['decode_ratio']:.2f}x "
                          f"[{m['decode_ratio_range'][0]:.2f}-{m['decode_ratio_range'][1]:.2f}]")
            else:
                decode = f"- | - | {m['decode_error']}"
            lines.append(f"| {row['model']} | {row['context']} | {mode} | {_ms(m['ttft'], 'sdpa_unpacked')} | "
                         f"{_ms(m['ttft'], 'evotune')} | {_ratio(m['ttft'])} | {decode} | {m['same_tokens']:.2f} | "
                         f"{share} |")
    fails = [f"{r['model']} {r.get('size', r.get('context'))} {mode}: {m['error']}"
             for r in result["prefill"] + result["generate"] for mode, m in r["modes"].items() if "error" in m]
    lines += _list_section("Failures", fails)
    notices = sorted({n for r in result["prefill"] + result["generate"] for n in r["kernel"]["notices"]})
    lines += _list_section("Notices", notices)
    return "\n".join(lines) + "\n"


def e2e_short_table(result) -> str:
    out = [f"{'model':6} {'size':9} {'mode':8} {'sdpa ms':>9} {'evo ms':>9} {'speed [min-max]':>20} kernel"]
    for row in result["prefill"]:
        k = row["kernel"]
        for mode, m in row["modes"].items():
            out.append(f"{row['model']:6} {row['size']:9} {mode:8} {_ms(m, 'sdpa_unpacked'):>9} {_ms(m, 'evotune'):>9} "
                       f"{_ratio(m):>20} {k['kernel_calls']}/{k['attention_calls']}")
    for row in result["generate"]:
        k = row["kernel"]
        for mode, m in row["modes"].items():
            if "ttft" not in m:
                out.append(f"{row['model']:6} {row['context']:9} gen-{mode:4} {m.get('error', m.get('skipped'))[:60]}")
                continue
            t = m.get("decode_tokens_per_s")
            decode = (f"{t['sdpa_unpacked']:.0f}/{t['evotune']:.0f} tok/s {m['decode_ratio']:.2f}x "
                      f"[{m['decode_ratio_range'][0]:.2f}-{m['decode_ratio_range'][1]:.2f}]" if t else "n/a")
            out.append(f"{row['model']:6} {row['context']:9} gen-{mode:4} ttft {_ratio(m['ttft'])} decode {decode} "
                       f"same {m['same_tokens']:.2f} kernel {k['kernel_calls']}/{k['attention_calls']}")
    if result.get("tune"):
        t = result["tune"]
        out.append(f"tune: rc {t['rc']} in {t['seconds']:.0f} s, {len(t['shapes'])} keys: {', '.join(t['shapes'])}")
    out.append("CHECKS: " + ("ok" if not result["failed_checks"] else "FAILED: " + "; ".join(result["failed_checks"])))
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def decode_table_beside(table) -> Path:
    """The decode table `--tune-trials` writes beside the tuning table (TABLE.decode.json), which the rows then use."""
    return Path(table).resolve().with_suffix(".decode.json")


def use_table_and_register(table):
    """The tuning table `table` (if any) in use, through EVOTUNE_TABLE too (spawned processes), and the two attention
    implementations registered with the same mask policy (no mask for an unpadded prefill, even while compiling or
    capturing): transformers' stock "sdpa" materialises the causal mask there (see hf.register). Returns
    evotune.torch."""
    if table:
        os.environ["EVOTUNE_TABLE"] = str(Path(table).resolve())
    import evotune.torch as et
    from evotune.torch import hf
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if table:
        et.use_table(str(Path(table).resolve()))
        decode_table = decode_table_beside(table)
        if decode_table.is_file() and "EVOTUNE_DECODE_TABLE" not in os.environ:  # one given in the environment wins
            from evotune.torch.decode import use_decode_table

            use_decode_table(str(decode_table))
    hf.register("evotune", assume_unpacked=True)
    hf.register("sdpa_unpacked", assume_unpacked=True, attention_function=sdpa_attention_forward)
    return et


def run(args) -> dict:
    import torch

    args.debug_traceback = bool(os.environ.get("MODEL_BENCH_TRACEBACK"))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("model_bench: no CUDA device visible (use --device cpu --tiny for a smoke run)")
    et = use_table_and_register(args.table)
    fp16 = args.device == "cuda"
    dtype = torch.float16 if fp16 else torch.float32
    args.tol = args.tol if args.tol is not None else (2e-2 if fp16 else 1e-4)
    grad_tol = args.grad_tol if args.grad_tol is not None else (5e-2 if fp16 else 1e-4)
    if args.train_size == "1x512" and args.tiny:
        args.train_size = "2x16"
    sizes = parse_sizes(args.sizes or (TINY_SIZES if args.tiny else DEFAULT_SIZES))
    compile_order = parse_sizes(args.compile_sizes if args.compile_sizes is not None else
                                (args.sizes or (TINY_SIZES if args.tiny else DEFAULT_COMPILE_SIZES)))
    impls = [i for i in args.impls.split(",") if i]
    modes = [m for m in args.modes.split(",") if m]
    if "sdpa" not in impls or "evotune" not in impls or set(impls) - set(IMPLS) or set(modes) - set(MODES):
        raise SystemExit(f"model_bench: --impls must include sdpa and evotune (of {IMPLS}); --modes of {MODES}")
    t0 = time.monotonic()
    timer = Timer(torch, args.device)
    result = {"env": environment(args, torch), "check_tokens": args.check_tokens, "tol": args.tol, "models": {},
              "rows": [], "train": {}, "warmup": None, "failed_checks": []}
    if args.device == "cuda" and result["env"].get("table_entries"):
        try:
            result["warmup"] = et.warmup()
        except Exception as e:
            result["warmup"] = {"error": short(e)}
    models = {}
    for family in dict.fromkeys(m for m, _, _ in sizes + compile_order):
        max_seq = max(s for m, _, s in sizes + compile_order if m == family)
        models[family] = build_model(family, args, max_seq, torch, dtype)
        result["models"][family] = describe(family, models[family][1])
    ref = {}
    for family, b, s in sizes:  # phase 1: routing, logits, eager and graph latency
        model, cfg = models[family]
        gen = torch.Generator(device="cpu").manual_seed(args.seed + b * 100003 + s)
        ids = torch.randint(0, cfg.vocab_size, (b, s), generator=gen).to(args.device)
        eager_ok = attn_bytes(family, cfg, b, s) <= args.eager_attn_max_gb * 2**30
        row = {"model": family, "size": f"{b}x{s}", "impls": impls, "timings": {i: {} for i in impls}}
        try:
            row["check"] = check_logits(model, ids, impls, args, torch, args.tol, eager_ok)
        except Exception as e:
            row["check"] = {"error": short(e)}
        row["route"] = route_summary(row["check"].get("routing", []))
        for impl in impls:
            if impl == "eager" and not eager_ok:
                why = (f"eager attention's scores would need {attn_bytes(family, cfg, b, s) / 2**30:.0f} GiB a layer "
                       f"(> --eager-attn-max-gb {args.eager_attn_max_gb:g})")
                row["timings"][impl] = {m: {"skipped": why} for m in modes}
                continue
            model.set_attn_implementation(impl)
            with torch.no_grad():
                ref[(family, b, s, impl)] = forward_fn(model, ids, 1)().clone()
            for mode in modes:
                if mode != "compile":
                    row["timings"][impl][mode] = measure(model, ids, impl, mode, args, torch, timer,
                                                         ref[(family, b, s, impl)])
        row["ids"] = ids
        result["rows"].append(row)
        print(f"[{time.monotonic() - t0:6.0f}s] {family} {b}x{s}: done eager/graph", flush=True)
    if args.train_size != "none":  # phase 2: a training step per model
        for family, (model, _) in models.items():
            result["train"][family] = train_step(model, family, args, torch, grad_tol)
            print(f"[{time.monotonic() - t0:6.0f}s] {family} train step done", flush=True)
    if "compile" in modes:  # phase 3: torch.compile, in --compile-sizes order, within --budget-s
        rows = {(r["model"], r["size"]): r for r in result["rows"]}
        # evotune and its like-for-like sdpa first at every size, then stock sdpa, then eager attention.
        passes = [[i for i in impls if i in ("sdpa_unpacked", "evotune")], [i for i in impls if i == "sdpa"],
                  [i for i in impls if i == "eager"]]
        for family, b, s, group in [(f, b, s, g) for g in passes for f, b, s in compile_order]:
            row = rows.get((family, f"{b}x{s}"))
            if row is None:
                continue
            for impl in group:
                if "compile" in row["timings"][impl] or (family, b, s, impl) not in ref:
                    continue
                if args.budget_s is not None and time.monotonic() - t0 > args.budget_s:
                    row["timings"][impl]["compile"] = {"skipped": f"--budget-s {args.budget_s:g} spent"}
                    continue
                row["timings"][impl]["compile"] = measure(models[family][0], row["ids"], impl, "compile", args,
                                                          torch, timer, ref[(family, b, s, impl)])
            print(f"[{time.monotonic() - t0:6.0f}s] {family} {b}x{s} {','.join(group)}: done compile", flush=True)
        for row in result["rows"]:
            for impl in impls:
                row["timings"][impl].setdefault("compile", {"skipped": "not in --compile-sizes"})
    for row in result["rows"]:
        row.pop("ids", None)
        c = row["check"]
        if "error" in c or not (c.get("evotune_vs_sdpa") or {}).get("ok"):
            result["failed_checks"].append(f"logits {row['model']} {row['size']}")
        for impl, ms in row["timings"].items():
            for mode, m in ms.items():
                if m and ("replay_vs_eager" in m or "compiled_vs_eager" in m) and "error" in m:
                    result["failed_checks"].append(f"{mode} output {row['model']} {row['size']} {impl}")
    for family, t in result["train"].items():
        if not t.get("ok"):
            result["failed_checks"].append(f"train {family}")
    result["wall_s"] = time.monotonic() - t0
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run_e2e(args) if args.e2e else run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    if args.md:
        Path(args.md).write_text(e2e_markdown(result) if args.e2e else markdown(result))
    print(e2e_short_table(result) if args.e2e else short_table(result))
    return 1 if result["failed_checks"] else 0


if __name__ == "__main__":
    sys.exit(main())
