"""One model forward under torch.profiler, transformers' sdpa against evotune (issue 41's "profile of one call"):
per forward, the wall time (synchronised), the host time (no synchronisation inside a batch of forwards: what the
CPU spends), the CUDA kernels each side launches (count and GPU time, attention's apart) and the host time of the
attention calls (the profiler's CPU time of the attention ops: SDPA's aten op; evotune's launch has no aten op of
its own, so its row is the calls' output allocation and what the library launches), and what the transformers
adapter did over the timed forwards (its calls and fallbacks, the compiled launcher's counters per forward).
Developer tool (bash docs/data/model/profile.sh runs it on this session's tables):

    python tools/profile_forward.py --model gpt2 --size 1x512 \
        --table docs/data/2026-11-28-h200/launcher/e2e-call3/e2e-table-gpt2.json --out prof.json
    python tools/profile_forward.py --what first-token --model gpt2 --size 1x2048 --table ...   # generate()'s TTFT

Writes JSON (--out) with each side's kernel table, and prints a short table last. Exit status 2 for bad options.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

ATTENTION_WORDS = ("attention", "fmha", "flash", "cudnn", "attn", "sdpa")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2", choices=["gpt2", "llama", "qwen2"])
    p.add_argument("--size", default="1x512", help="BxS of the prefill")
    p.add_argument("--table", required=True, help="the tuning table evotune's calls read")
    p.add_argument("--layers", type=int, default=None, help="layers (default: model_bench's: gpt2 12, else 4)")
    p.add_argument("--forwards", type=int, default=5, help="forwards profiled per side")
    p.add_argument("--what", default="forward", choices=["forward", "first-token"],
                   help="a plain forward (use_cache=False), or generate()'s first token under a DynamicCache (what "
                        "model_bench's time to first token times)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        args.batch, args.seq = (int(x) for x in args.size.lower().split("x"))
    except ValueError:
        print(f"profile_forward: --size takes BxS (e.g. 1x512), not {args.size!r}", file=sys.stderr)
        raise SystemExit(2)
    if not Path(args.table).is_file():
        print(f"profile_forward: no tuning table at {args.table}", file=sys.stderr)
        raise SystemExit(2)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    import model_bench as mb

    if not torch.cuda.is_available():
        print("profile_forward: no CUDA device visible", file=sys.stderr)
        return 2
    warnings.simplefilter("ignore")
    et = mb.use_table_and_register(args.table)
    et.warmup()
    from evotune.torch import launcher

    layers = args.layers or (12 if args.model == "gpt2" else 4)
    margs = types.SimpleNamespace(tiny=False, gpt2_layers=layers, llama_layers=layers, qwen2_layers=layers, seed=0,
                                  device="cuda", llama_vocab=128256)
    model, cfg = mb.build_model(args.model, margs, args.seq, torch, torch.float16)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda")
    report = {"model": args.model, "size": args.size, "what": args.what, "layers": layers, "device": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "launcher": bool(launcher.ACTIVE[0]), "sides": {}}
    from evotune.torch import hf, routing

    for impl in ("sdpa_unpacked", "evotune", "sdpa_unpacked", "evotune"):  # the second pass is the one kept
        model.set_attn_implementation(impl)
        hf.reset_stats()
        served = launcher.counts()
        with torch.no_grad():
            forward = (mb.forward_fn(model, ids, 1) if args.what == "forward"
                       else mb._generate_fn(model, ids, "dynamic", 1))
            for _ in range(10):
                forward()
            torch.cuda.synchronize()
            walls, hosts = [], []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(10):
                    forward()
                hosts.append((time.perf_counter() - start) / 10 * 1e3)
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - start) / 10 * 1e3)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(args.forwards):
                    forward()
                torch.cuda.synchronize()
        kernels, host_ops = {}, {}
        for event in prof.key_averages():
            gpu_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.key] = {"count": event.count / args.forwards, "us": gpu_us / args.forwards}
            elif any(w in event.key.lower() for w in ATTENTION_WORDS) or event.key in (
                    "aten::empty_strided", "aten::zeros", "cuLaunchKernel", "cudaLaunchKernel", "cudaLaunchKernelExC"):
                host_ops[event.key] = {"count": event.count / args.forwards,
                                       "cpu_us": event.cpu_time_total / args.forwards}
        side = "sdpa" if impl == "sdpa_unpacked" else "evotune"
        after = launcher.counts()
        calls = 10 + 50 + args.forwards  # the forwards since the counters were read
        adapter = {"calls": hf.stats(), "fallbacks": hf.fallbacks(), "fast_routes": len(routing.FAST_ROUTES),
                   "launcher_per_forward": {k: (after[k] - served[k]) / calls for k in after if k != "routes"}}
        attention = {k: v for k, v in kernels.items() if any(w in k.lower() for w in ATTENTION_WORDS)
                     or "kernel_entry" in k}
        report["sides"][side] = {
            "wall_ms": statistics.median(walls), "host_ms": statistics.median(hosts),
            "kernels_per_forward": sum(v["count"] for v in kernels.values()),
            "gpu_us_per_forward": sum(v["us"] for v in kernels.values()),
            "attention_kernels": attention, "host_ops": host_ops, "adapter": adapter,
            "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:25])}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.model} {args.size} {args.what} ({layers} layers) on {report['device']}, torch {report['torch']}, "
          f"launcher {'loaded' if report['launcher'] else 'not loaded'}: per {args.what}")
    print(f"{'side':<8} {'wall ms':>8} {'host ms':>8} {'kernels':>8} {'GPU us':>9}  attention kernels (count, us)")
    for side, r in report["sides"].items():
        att = "; ".join(f"{k[:40]} x{v['count']:.0f} {v['us']:.0f}" for k, v in r["attention_kernels"].items())
        print(f"{side:<8} {r['wall_ms']:>8.3f} {r['host_ms']:>8.3f} {r['kernels_per_forward']:>8.0f} "
              f"{r['gpu_us_per_forward']:>9.1f}  {att}")
        if side == "evotune":
            print(f"         adapter: {r['adapter']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
