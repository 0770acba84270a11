"""Where the op's host time goes, piece by piece, on any machine (developer tool; no GPU needed).

Times, with timeit's best of --repeat, the pieces each route pays per call beside the call it wraps:

  sdpa               F.scaled_dot_product_attention (the baseline every route pays or replaces)
  op-fallback        evotune.torch.attention on a key the table lacks (the cached SDPA route)
    key              the cached route's key (sizes, strides, dtype, device, options)
    lookup           the key built and looked up
    checks           the fast path's per-call checks (grads, tensor types, modes)
    compile-check    torch.compiler.is_compiling()
  hf-sdpa            transformers' sdpa_attention_forward (no mask, is_causal)
  hf-fallback        evotune.torch.hf.attention_forward, the same call
  tuned-python       the tuned route's Python launch (kernels.PreparedLaunch of the plain mma.sync config on these
                     tensors, output allocated) with the driver call stubbed at evotune.gpu.packet.launch_packet and a
                     fixed stream: what the Python route costs besides cuLaunchKernel
  dispatch-op        torch.ops.evotune.attention.default._op (the op's C++ entry, then its Python body here)
  dispatch-overload  torch.ops.evotune.attention.default (OpOverload.__call__ first: what a compiled graph calls)

    python tools/op_host_profile.py --shape 1,1,1,64:causal

On a CPU the inputs are fp32 (CPU SDPA's cheapest dtype) so SDPA's own time stays small. Prints one table (ns per
call, and per piece its share of the gap between op-fallback and sdpa). Exit status 2 for bad options.
"""

from __future__ import annotations

import argparse
import sys
import timeit
import types
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1,1,1,64:causal", help="attention shape (evotune spelling or preset)")
    ap.add_argument("--number", type=int, default=20000, help="calls per timing")
    ap.add_argument("--repeat", type=int, default=5, help="timings per piece (the best is reported)")
    args = ap.parse_args(argv)
    if args.number < 1 or args.repeat < 1:
        print("op_host_profile: --number and --repeat must be at least 1", file=sys.stderr)
        raise SystemExit(2)
    return args


def pieces(shape, torch):
    """name -> zero-argument callable, in report order."""
    import torch.nn.functional as F

    import evotune.torch as et
    from evotune.gpu import packet
    from evotune.space.searchspace import load_builtin
    from evotune.torch import hf, kernels, op

    gen = torch.Generator().manual_seed(0)

    def one(seq, heads):  # bshd memory, as a projection leaves it
        return torch.randn(shape.batch, seq, heads, shape.head_dim, generator=gen).transpose(1, 2)

    q, k, v = one(shape.seq_q, shape.heads), one(shape.seq_k, shape.kv_heads), one(shape.seq_k, shape.kv_heads)
    causal, gqa = shape.causal, shape.kv_heads != shape.heads
    et.use_table(None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        et.attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    routes = op.FAST_ROUTES

    class Module:
        is_causal, num_key_value_groups, training = True, shape.heads // shape.kv_heads, False

    module = Module()
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:
        sdpa_attention_forward = None
    # The tuned route's Python launch with the driver call stubbed (its packet patched per call, as on a GPU).
    fake = kernels.LoadedKernel(types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=1)),
                                load_builtin("attention").default_config(), 0, "profile", "profile")
    size, stride = op.output_layout(q, v)
    out = q.new_empty_strided(size, stride)
    from evotune.problems.shapes import Shape

    cfg_shape = Shape(shape.batch, shape.heads, shape.seq_q, shape.seq_k, shape.head_dim, "fp16", causal, "bshd",
                      shape.kv_heads)
    prepared = kernels.PreparedLaunch(fake, cfg_shape, (q.stride(), k.stride(), v.stride()), 0.125, out.stride())
    kernels._raw_stream = lambda index: 0
    packet.launch_packet = lambda *args: None

    def tuned_python():  # op._kernel_route's run, less its device check (no CUDA here)
        addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        if (addresses[0] | addresses[1] | addresses[2]) & 15:
            raise AssertionError
        o = q.new_empty_strided(size, stride)
        prepared(q, k, v, o, None, addresses)
        return o

    dispatch = torch.ops.evotune.attention.default
    table = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
        "op-fallback": lambda: et.attention(q, k, v, is_causal=causal, enable_gqa=gqa),
        "  key": lambda: (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, q.device, causal,
                          None, gqa, "sdpa"),
        "  lookup": lambda: routes.get((q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype,
                                        q.device, causal, None, gqa, "sdpa")),
        "  checks": lambda: (not (q.requires_grad or k.requires_grad or v.requires_grad) and type(q) is op._TENSOR
                             and type(k) is op._TENSOR and type(v) is op._TENSOR and not op._torch_function_mode()
                             and not op._dispatch_stack()),
        "  compile-check": torch.compiler.is_compiling,
        "tuned-python": tuned_python,
        "dispatch-op": lambda: dispatch._op(q, k, v, causal, None, gqa, "sdpa"),
        "dispatch-overload": lambda: dispatch(q, k, v, causal, None, gqa, "sdpa"),
    }
    if sdpa_attention_forward is not None:
        table["hf-sdpa"] = lambda: sdpa_attention_forward(module, q, k, v, None, is_causal=causal)
        table["hf-fallback"] = lambda: hf.attention_forward(module, q, k, v, None, is_causal=causal)
    return table


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from evotune.errors import UsageError
    from evotune.problems.shapes import parse_shape

    try:
        shape = parse_shape(args.shape)
    except UsageError as e:
        print(f"op_host_profile: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = pieces(shape, torch)
        for fn in table.values():  # warm: routes cached, notices told
            fn()
        ns = {name: min(timeit.repeat(fn, number=args.number, repeat=args.repeat)) / args.number * 1e9
              for name, fn in table.items()}
    gap = ns["op-fallback"] - ns["sdpa"]
    print(f"{shape.spec} bshd on the CPU, torch {torch.__version__}: ns per call, best of {args.repeat} x "
          f"{args.number}; share = the piece's ns / (op-fallback - sdpa) = {gap:.0f} ns")
    print(f"{'piece':<20} {'ns':>9} {'share':>7}")
    for name, t in ns.items():
        share = f"{t / gap:.0%}" if name.startswith("  ") and gap > 0 else ""
        print(f"{name:<20} {t:>9.0f} {share:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
