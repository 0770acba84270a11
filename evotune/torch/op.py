"""The `evotune::attention` custom op, its Python entry point, explain() and warmup().

The whole decision (table lookup, fallback, notices) happens inside the op's implementation,
which torch.compile treats as one opaque node: the compiled graph has no break, and the choice is
made at run time on the real tensors. The fake implementation only checks the arguments and
returns the output's metadata: (B, H, Sq, Dv) dense in the query's layout, which both routes
return (SDPA's result is copied into that layout only when its backend chose another).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..errors import UsageError
from ..problems.shapes import Shape
from . import fallback as _fallback
from . import launcher, record, routing
from .call import (DTYPES, NO_MODS, Call, aligned_for_sdpa, check_args, check_mods, check_sinks, layout_for,
                   misaligned, new_output, output_layout, score_mods)
from .autograd import lse_backend
from .kernels import CACHE, PREPARED, launch, load_for
from .routing import FAST_ROUTES


# The op is defined through torch.library.Library with its Python body registered straight to a backend
# dispatch key, not through torch.library.custom_op: custom_op wraps the body in its own autograd,
# redispatch, dynamo-disable and aliasing-check layers, Python functions that a compiled graph paid on every
# call (on a CPU, torch.ops.evotune.attention cost 54 us against SDPA's 7 us through them, 11 us without:
# tools/op_host_overhead.py). The op has no autograd formula of its own: attention() sends calls that need
# gradients to evotune::attention_lse (evotune.torch.autograd), which has one.
_LIB = torch.library.Library("evotune", "FRAGMENT")
# The score mods go last with the defaults of a call without them, so positional callers of the first seven keep
# working; the window is two ints (flash-attention's window_size, -1: unbounded), not an int[], so the op's cached
# routes key on plain values. The sink logits (attention sinks) come last of all, an optional tensor: an input of
# the call (the kernel reads them through a pointer), not a value its routes key on.
_SCHEMA_ARGS = ("Tensor q, Tensor k, Tensor v, bool is_causal=False, float? scale=None, bool enable_gqa=False, "
                "str fallback='sdpa', float softcap=0.0, int window_left=-1, int window_right=-1, Tensor? sinks=None")
_LIB.define(f"attention({_SCHEMA_ARGS}) -> Tensor")


def _op_body(q, k, v, is_causal=False, scale=None, enable_gqa=False, fallback="sdpa", softcap=0.0, window_left=-1,
             window_right=-1, sinks=None):
    """The op's kernel on real tensors. A compiled graph calls it at run time, call after call: the same cached
    routes as eager code."""
    if launcher.PENDING[0]:  # a compiled graph's calls load the launcher's finished build too
        launcher.load()
    if not record._ACTIVE:
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device,
               k.device, v.device, is_causal, scale, enable_gqa, fallback, softcap, window_left, window_right)
        if sinks is None:
            fast = FAST_ROUTES.get(key)
            if fast is not None:
                return fast(q, k, v)
        else:
            fast = FAST_ROUTES.get(key + (_sink_facts(sinks),))
            if fast is not None:
                return fast(q, k, v, sinks)
    return _eager_call(q, k, v, is_causal, scale, enable_gqa, fallback, (softcap, window_left, window_right), sinks)


def _body_from_launcher(q, k, v, is_causal=False, scale=None, enable_gqa=False, fallback="sdpa", softcap=0.0,
                        window_left=-1, window_right=-1, sinks=None):
    """evotune::_attention_body: what the compiled launcher (evotune.torch.launcher) hands back, a call it has no
    route for (a softcap, window or sinks call always: launcher.cpp hands those back unread). The op's body, but a
    kernel route runs its Python launch: its compiled one would hand the call back again (a view off a 16-byte
    boundary, another current device)."""
    if not record._ACTIVE:
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device,
               k.device, v.device, is_causal, scale, enable_gqa, fallback, softcap, window_left, window_right)
        if sinks is None:
            fast = FAST_ROUTES.get(key)
            if fast is not None:
                return getattr(fast, "python", fast)(q, k, v)
        else:
            fast = FAST_ROUTES.get(key + (_sink_facts(sinks),))
            if fast is not None:  # a sinks route is never the compiled launcher's: its closure is Python's
                return fast(q, k, v, sinks)
    return _eager_call(q, k, v, is_causal, scale, enable_gqa, fallback, (softcap, window_left, window_right), sinks)


# CompositeExplicitAutograd: every device's calls (CPU, CUDA, any other) reach the body, as custom_op's did;
# meta and fake tensors reach the fake implementation, which is registered for them. With the compiled launcher
# loaded, CUDA calls reach its C++ kernel first, which hands what it has no route for to _attention_body.
_LIB.impl("attention", _op_body, "CompositeExplicitAutograd")
_LIB.define(f"_attention_body({_SCHEMA_ARGS}) -> Tensor")
_LIB.impl("_attention_body", _body_from_launcher, "CompositeExplicitAutograd")
routing.ON_FORGET.append(launcher.clear)
record.ON_START.append(launcher.clear)
# Routes worked out before the compiled launcher loaded are Python's: forgotten, the next call of each registers there.
launcher.ON_LOAD.append(routing.forget_fast_routes)
attention_op = torch.ops.evotune.attention


def _attention_impl(q, k, v, is_causal, scale, enable_gqa, fallback, mods=NO_MODS, sinks=None):
    """The op's real implementation: route, then run evotune's kernel or the fallback (SDPA; for score mods or sinks
    evotune.torch.fallback)."""
    routing.check_fallback(fallback)
    check_args(q, k, v, enable_gqa)
    if mods != NO_MODS:
        check_mods(*mods, is_causal, q.shape[2], k.shape[2])
    if sinks is not None:
        check_sinks(sinks, q)
    decision = routing.decide_for(q, k, v, is_causal, mods, sinks is not None)
    record.observe(decision)
    if decision.route == "evotune":
        return _run_evotune(decision, q, k, v, scale, sinks)
    routing.notify(decision, fallback)
    return _run_fallback(q, k, v, is_causal, scale, enable_gqa, mods, sinks)


@torch.library.register_fake("evotune::attention", lib=_LIB)
def _attention_fake(q, k, v, is_causal=False, scale=None, enable_gqa=False, fallback="sdpa", softcap=0.0,
                    window_left=-1, window_right=-1, sinks=None):
    routing.check_fallback(fallback)
    check_args(q, k, v, enable_gqa)
    check_mods(softcap, window_left, window_right, is_causal, q.shape[2], k.shape[2])
    check_sinks(sinks, q)
    return new_output(q, v)


def _run_evotune(decision, q, k, v, scale, sinks=None):
    index = decision.call.device_index
    if index == torch.cuda.current_device():
        return _launch_here(decision, q, k, v, scale, sinks)
    with torch.cuda.device(index):
        return _launch_here(decision, q, k, v, scale, sinks)


def _launch_here(decision, q, k, v, scale, sinks=None):
    """Launch on the current device, the tensors'."""
    loaded = load_for(decision)
    out = new_output(q, v)
    launch(loaded, decision.shape, q, k, v, out, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
           sinks=kernel_sinks(sinks))
    return out


def kernel_sinks(sinks):
    """The sink logits as the kernel reads them: H contiguous float32 values behind one pointer (SINK_PARAMS). A
    float32 contiguous tensor is passed as it is (.float() and .contiguous() return the tensor itself); another dtype
    (gpt-oss keeps its sinks in the model's, bf16) or a strided view is converted here, once per call: one (H,) copy
    beside the attention, which is never kept across calls, since the caller's tensor may change in place (a
    training step, a loaded checkpoint) and a CUDA graph must capture the conversion to replay it. Freed after the
    call, its memory is reused only by later work on the same stream (the caching allocator's stream order)."""
    return None if sinks is None else sinks.float().contiguous()


def _sink_facts(sinks) -> tuple:
    """What of a call's sink logits its cached route was made for: size, dtype and device (their values and their
    address may change from call to call; a route converts them or reads them each time)."""
    return sinks.shape, sinks.dtype, sinks.device


def _run_sdpa(q, k, v, is_causal, scale, enable_gqa):
    gqa = {"enable_gqa": True} if enable_gqa else {}  # the keyword exists from torch 2.5
    q, k, v = aligned_for_sdpa(q, k, v)
    return _in_query_layout(F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, **gqa), q, v)


def _run_fallback(q, k, v, is_causal, scale, enable_gqa, mods, sinks=None):
    """What runs a call off the kernel, in the op's output layout: SDPA, or for a softcap, window or sinks the fallback
    module's way (SDPA has none of them)."""
    if mods == NO_MODS and sinks is None:
        return _run_sdpa(q, k, v, is_causal, scale, enable_gqa)
    return _in_query_layout(_fallback.attention(q, k, v, is_causal, scale, enable_gqa, mods, sinks), q, v)


def _in_query_layout(o, q, v):
    """SDPA's result `o` in the op's output layout (call.new_output's); a copy only where SDPA's backend chose
    another."""
    if o.stride() == output_layout(q, v)[1]:
        return o
    out = new_output(q, v)
    out.copy_(o)
    return out


def _check_options(q, k, v, is_causal, scale, enable_gqa) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"evotune.torch.attention: {name} must be a tensor, got {type(t).__name__}")
    _check_values(is_causal, scale, enable_gqa)


def _check_values(is_causal, scale, enable_gqa) -> None:
    for name, value in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(value, bool):
            raise UsageError(f"evotune.torch.attention: {name} must be True or False, got {value!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise UsageError(f"evotune.torch.attention: scale must be a number or None, got {type(scale).__name__}")


def _needs_grad(q, k, v, sinks=None) -> bool:
    # The tensors' flags first (an attribute each); the grad mode (a function call) only where one is set.
    return ((q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad))
            and torch.is_grad_enabled())


def attention(q, k, v, *, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
              fallback: str = "sdpa", softcap: float = 0.0, window: tuple[int, int] | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(cap(scale·QKᵀ) [+ masks])·V with SDPA's semantics, on evotune's tuned kernel where the tuning table has
    one for this GPU and key, else the fallback if `fallback` is "sdpa" (told once per key) or a UsageError if it
    is "error" (where the table itself routes a key away from the kernel, the fallback runs). The fallback is PyTorch
    SDPA; with a softcap or sinks, PyTorch math attention in fp32; with a window only, SDPA with the window's boolean
    mask (evotune.torch.fallback: SDPA has none of them).

    q (B, H, Sq, D), k and v (B, Hk, Sk, D): any strides with a unit last one; the output has the query's layout.
    is_causal: SDPA's top-left causal mask. softcap: C > 0 caps each scaled score s at C·tanh(s / C) before the softmax
    (flash-attention's softcap, Gemma-2's attn_logit_softcapping); 0 or None: none. window: None, or flash-attention's
    window_size (left, right): query i sees key j iff i + Sk - Sq - left <= j <= i + Sk - Sq + right (bottom-right
    aligned), -1 leaving a side unbounded; (L, 0) is Mistral's causal sliding window of L + 1 keys. Beside is_causal
    a window needs Sq == Sk, where the two alignments agree. A row whose window holds no key is 0.
    sinks: None, or a (H,) tensor of per-query-head sink logits on q's device, any float dtype (gpt-oss's s_aux,
    flash-attention's learnable_sink): in the units of the scaled (and capped) scores, each head's joins every row's
    softmax as one more column with no value, O_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij)); a row that
    sees no key is 0.
    Inputs that require grad run `evotune::attention_lse` (the kernel with its log-sum-exp epilogue, then PyTorch's
    attention backward: evotune.torch.autograd); with a softcap, window or sinks, whose backward that is not, the
    fallback with its own autograd (told; sinks that require grad get theirs)."""
    # The eager fast path first (see below): a call seen before costs this lookup and its route's work.
    if not torch.compiler.is_compiling() and FAST_ROUTES and not record._ACTIVE:
        # The compiled launcher's entry first (evotune.torch.launcher): a route of these facts served from C, or None.
        if launcher.ACTIVE[0]:
            if window is None and not softcap and sinks is None:
                out = launcher.CALL[0](q, k, v, is_causal, scale, enable_gqa, fallback)
                if out is not None:
                    return out
        elif launcher.PENDING[0]:  # its background build just finished: load it (the routes then register there)
            launcher.load()
        try:
            left, right = (-1, -1) if window is None else window
            key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
                   q.device, k.device, v.device, is_causal, scale, enable_gqa, fallback, softcap or 0.0, left, right)
            # A sinks call's route is keyed by its logits' facts too, one key longer: never a dense call's route.
            fast = FAST_ROUTES.get(key if sinks is None else key + (_sink_facts(sinks),))
        except (AttributeError, TypeError, ValueError):  # not tensors, unhashable options, no pair: the full path says
            fast = None
        # A route exists only for plain tensors of these facts; what a call may change is a mode or grads.
        if (fast is not None and not (q.requires_grad or k.requires_grad or v.requires_grad)
                and type(q) is _TENSOR and type(k) is _TENSOR and type(v) is _TENSOR
                and not _torch_function_mode() and not _dispatch_stack()):
            if sinks is None:  # a route the library declined (another device, a misaligned view): its Python launch
                return getattr(fast, "python", fast)(q, k, v)
            if _plain_sinks(sinks):
                return fast(q, k, v, sinks)
    elif window is None and not softcap and sinks is None and torch.compiler.is_compiling():
        traced = _traced_plain(q, k, v, is_causal, scale, enable_gqa, fallback)
        if traced is not None:
            return traced
    _check_options(q, k, v, is_causal, scale, enable_gqa)
    scale = None if scale is None else float(scale)
    routing.check_fallback(fallback)
    mods = score_mods(softcap, window, is_causal, q, k)
    check_sinks(sinks, q)
    if _needs_grad(q, k, v, sinks):
        return _grad_path(q, k, v, is_causal, scale, enable_gqa, fallback, mods, sinks)
    if _eager(q, k, v, sinks):
        return _eager_call(q, k, v, is_causal, scale, enable_gqa, fallback, mods, sinks)
    if torch.compiler.is_compiling() and _sdpa_when_traced(q, k, v, is_causal, enable_gqa, fallback, mods,
                                                           sinks is not None):
        return _run_fallback(q, k, v, is_causal, scale, enable_gqa, mods, sinks)
    if sinks is None:  # the schema's default: a dense call's traced graph reads as before sinks existed
        return torch.ops.evotune.attention(q, k, v, is_causal, scale, enable_gqa, fallback, *mods)
    return torch.ops.evotune.attention(q, k, v, is_causal, scale, enable_gqa, fallback, *mods, sinks)


def eager_attention(q, k, v, is_causal: bool, scale, enable_gqa: bool, softcap: float = 0.0, window=None,
                    sinks=None):
    """attention(q, k, v, is_causal=, scale=, enable_gqa=, softcap=, window=, sinks=) for a caller that has checked it
    is not compiling (the transformers adapter, per layer call): the cached route without attention()'s keyword
    parsing and compile check; a call without one goes to attention(). The same conditions as attention()'s fast
    path."""
    if FAST_ROUTES and not record._ACTIVE:
        if launcher.ACTIVE[0]:
            if window is None and not softcap and sinks is None:
                out = launcher.CALL[0](q, k, v, is_causal, scale, enable_gqa, "sdpa")
                if out is not None:
                    return out
        elif launcher.PENDING[0]:
            launcher.load()
        left, right = (-1, -1) if window is None else window  # the adapter passes a pair or None
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device,
               k.device, v.device, is_causal, scale, enable_gqa, "sdpa", softcap or 0.0, left, right)
        fast = FAST_ROUTES.get(key if sinks is None else key + (_sink_facts(sinks),))
        if (fast is not None and not (q.requires_grad or k.requires_grad or v.requires_grad)
                and type(q) is _TENSOR and type(k) is _TENSOR and type(v) is _TENSOR
                and not _torch_function_mode() and not _dispatch_stack()):
            if sinks is None:
                return getattr(fast, "python", fast)(q, k, v)
            if _plain_sinks(sinks):
                return fast(q, k, v, sinks)
    return attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, softcap=softcap, window=window,
                     sinks=sinks)


def _plain_sinks(sinks) -> bool:
    """Sink logits a cached route may take: a plain tensor or a module's Parameter (gpt-oss's sinks are one; a
    Parameter dispatches as a tensor), not needing grad in this grad mode (a Parameter under no_grad does not)."""
    return type(sinks) in _SINK_TYPES and not (sinks.requires_grad and torch.is_grad_enabled())


# --------------------------------------------------------------------------- SDPA routes decided while tracing
#
# Where a call's route is SDPA by facts fixed when torch.compile traces it (sizes, strides, dtype, device,
# the table: a key the table routes to SDPA, one it lacks, one the kernel cannot compute), the compiled graph
# calls SDPA itself rather than the opaque op, so the compiler plans it as it plans SDPA in any model (on the
# H100, GPT-2 16x1024 under torch.compile read 0.95x sdpa's speed with the opaque op around its SDPA route;
# docs/PERFORMANCE.md). Shapes the trace keeps
# symbolic (dynamic=True) and evotune routes keep the op: its body decides at run time.


def _traced_plain(q, k, v, is_causal, scale, enable_gqa, fallback):
    """attention() while torch.compile traces a call with no softcap, window or sinks, in as few Python steps as its
    decision allows. Each function the trace steps into and each module global it reads becomes a guard that dynamo
    checks before every call of the compiled graph: the general path's checks made 95 (SDPA's call: 12; 37 now:
    docs/data/model/guards_probe.py), most of a compiled fallback call's cost over SDPA's on a CPU (docs/
    PERFORMANCE.md). Here the checks and the route are one constant function of the call's facts (_traced_plan).
    None where the general path decides (a tensor needing grad, not a tensor)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return None
    shapes, strides = (q.shape, k.shape, v.shape), (q.stride(), k.stride(), v.stride())
    static = all(_fixed_by_trace(n) for sizes in shapes + strides for n in sizes)
    plan, scale, layout = _traced_plan(
        is_causal, scale, enable_gqa, fallback, tuple(tuple(x) for x in shapes) if static else None,
        strides if static else None, q.dtype, q.device,
        (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled(), len(record._ACTIVE) > 0)
    if plan == "op":
        return attention_op(q, k, v, is_causal, scale, enable_gqa, fallback)
    if plan == "sdpa":
        o = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                           **({"enable_gqa": True} if enable_gqa else {}))
        size, stride = layout
        if o.stride() == stride:
            return o
        out = q.new_empty_strided(size, stride)  # the op's output layout (call.new_output's), as _in_query_layout
        out.copy_(o)
        return out
    return None


@torch.compiler.assume_constant_result
def _traced_plan(is_causal, scale, enable_gqa, fallback, shapes, strides, dtype, device, needs_grad: bool,
                 recording: bool) -> tuple:
    """(plan, scale, (size, stride) of the output) of a plain call being traced, run once at trace time: "sdpa"
    where its route is SDPA whatever its data (told then; fallback="error" raises then), "op" where the op decides
    at run time (an evotune route, sizes the trace keeps symbolic, a recorder active), "full" where the general
    path takes it (grads). Bad options raise here, with the eager path's messages."""
    _check_values(is_causal, scale, enable_gqa)
    routing.check_fallback(fallback)
    scale = None if scale is None else float(scale)
    if needs_grad:
        return "full", scale, None
    if shapes is None or recording:
        return "op", scale, None
    dtype_name = DTYPES.get(dtype, str(dtype).replace("torch.", ""))
    if not _sdpa_route_of(shapes, strides, dtype_name, device.type, device.index, bool(is_causal), bool(enable_gqa),
                          fallback):
        return "op", scale, None
    (b, h, sq, _), _, (_, _, _, dv) = shapes
    return "sdpa", scale, layout_for(b, h, sq, dv, strides[0][1] < strides[0][2])  # layout_of's rule, on constants


def _sdpa_when_traced(q, k, v, is_causal, enable_gqa, fallback, mods=NO_MODS, sinks: bool = False) -> bool:
    """Whether the trace calls the fallback itself (SDPA, or for score mods or sinks evotune.torch.fallback's plain
    PyTorch)."""
    sizes = tuple(q.shape) + tuple(k.shape) + tuple(v.shape) + q.stride() + k.stride() + v.stride()
    if not all(_fixed_by_trace(n) for n in sizes) or record.active():  # symbolic, or every call must be recorded
        return False
    return _sdpa_route_of((tuple(q.shape), tuple(k.shape), tuple(v.shape)), (q.stride(), k.stride(), v.stride()),
                          DTYPES.get(q.dtype, str(q.dtype).replace("torch.", "")), q.device.type, q.device.index,
                          bool(is_causal), bool(enable_gqa), fallback, *mods, sinks)


def _fixed_by_trace(n) -> bool:
    """Whether a size is a constant of the trace, not a symbol (torch.compile's automatic dynamic shapes make a size
    symbolic from its second value on; dynamic=True from the first). Under dynamo a symbolic size answers type() and
    isinstance() as an int, so the test asks the shape environment instead: Python proves both for an int, but for a
    symbol the bound does not hold (a size's range is unbounded above) and floor and Mod stay unevaluated. Two
    tests, so a size the user bounded (mark_dynamic(max=)) still reads as symbolic."""
    return statically_known_true(n < 2 ** 62) and statically_known_true(n == n // 3 * 3 + n % 3)


@torch.compiler.assume_constant_result
def _sdpa_route_of(shapes, strides, dtype, device_type, device_index, is_causal, enable_gqa, fallback,
                   softcap=0.0, window_left=-1, window_right=-1, sinks=False) -> bool:
    """Whether this call's route is the fallback whatever its data (run once, while tracing; its notice is told then,
    and fallback="error" raises then)."""
    (b, h, sq, d), (_, hk, sk, _), (_, _, _, dv) = shapes
    if device_type == "cuda" and device_index is None:
        device_index = 0
    device = device_type if device_index is None else f"{device_type}:{device_index}"
    layout = "bshd" if strides[0][1] < strides[0][2] else "bhsd"
    decision = routing.decide(Call(b, h, hk, sq, sk, d, dv, dtype, is_causal, layout, device, strides, softcap,
                                   (window_left, window_right), sinks))
    if decision.route == "evotune":
        return False
    routing.notify(decision, fallback)
    return True


def _grad_path(q, k, v, is_causal, scale, enable_gqa, fallback, mods=NO_MODS, sinks=None):
    """The training op where a PyTorch backward takes (O, LSE) on this device; elsewhere SDPA with its own
    autograd, told once (in eager code; while torch.compile traces, a notice would break the graph)."""
    if mods != NO_MODS or sinks is not None:
        return _grad_fallback(q, k, v, is_causal, scale, enable_gqa, fallback, mods, sinks)
    # A value head dim of its own (MLA): PyTorch's flash backwards, the op's backward on CUDA and the CPU, need one.
    own_dv = v.shape[-1] != q.shape[-1]
    if not own_dv and lse_backend(q, k, is_causal) is not None:
        return torch.ops.evotune.attention_lse(q, k, v, is_causal, scale, enable_gqa, fallback)[0]
    if not torch.compiler.is_compiling():
        check_args(q, k, v, enable_gqa)
        why = (f"value head dim {v.shape[-1]} beside {q.shape[-1]} with gradients: the op's backward (PyTorch's flash "
               f"backward, from the kernel's log-sum-exp) takes one head dim" if own_dv else
               f"no PyTorch attention backward takes a log-sum-exp on {q.device.type}")
        decision = routing.uncovered(routing.decide(Call.of(q, k, v, is_causal)), why)
        record.observe(decision)
        routing.notify(decision, fallback)
    elif fallback == "error":
        raise UsageError(f"evotune.torch.attention: no attention backward on {q.device.type} [fallback='error']")
    gqa = {"enable_gqa": True} if enable_gqa else {}
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, **gqa)


def _grad_fallback(q, k, v, is_causal, scale, enable_gqa, fallback, mods, sinks=None):
    """A softcap, window or sinks call that needs gradients: the fallback (evotune.torch.fallback), differentiable
    through PyTorch's autograd (in the sink logits too), told once. The op's backward is PyTorch's attention backward
    from the kernel's log-sum-exp, which has neither a softcap, nor a bottom-right window, nor sinks."""
    what = "a call with attention sinks" if sinks is not None else "a softcap or window call"
    if not torch.compiler.is_compiling():
        check_args(q, k, v, enable_gqa)
        decision = routing.decide(Call.of(q, k, v, is_causal, mods, sinks is not None))
        if decision.route == "evotune":
            decision = routing.uncovered(decision, f"{what} that needs gradients: the op's backward (PyTorch's, from "
                                                   f"the kernel's log-sum-exp) takes "
                                                   f"{'no sinks' if sinks is not None else 'neither'}")
        record.observe(decision)
        routing.notify(decision, fallback)
    elif fallback == "error":
        raise UsageError(f"evotune.torch.attention: {what} that needs gradients runs the fallback, not the kernel "
                         f"[fallback='error']")
    return _fallback.attention(q, k, v, is_causal, scale, enable_gqa, mods, sinks)


# --------------------------------------------------------------------------- the eager fast path
#
# In eager code the op's implementation is called directly, not through the dispatcher; torch.compile, export
# and any tensor subclass or mode still go through torch.ops.evotune.attention. After a call's first run its
# route is kept per call facts (sizes, strides, dtype, device, options) as a small closure, so a repeated
# call costs a dict lookup and its route's own work, in eager code and inside a compiled graph alike (the op's
# body looks the closure up first): an SDPA route one F.scaled_dot_product_attention call (and a stride
# compare), a kernel route an alignment and device check, the output's allocation and a packet launch.


_TENSOR = torch.Tensor
_SINK_TYPES = (torch.Tensor, torch.nn.Parameter)  # what a cached route takes as sink logits (_plain_sinks)
_torch_function_mode = torch._C._is_torch_function_mode_enabled
_dispatch_stack = torch._C._len_torch_dispatch_stack
# The op's C++ entry without OpOverload.__call__'s Python frame (on a CPU here, 23 against 31 us a call through the
# Python body: the difference is the wrapper's).
_DISPATCH = getattr(attention_op.default, "_op", attention_op.default)


def _plain(q, k, v) -> bool:
    """Plain tensors with no torch-function or dispatch mode active (compiling is checked before)."""
    return (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and not torch._C._is_torch_function_mode_enabled() and not torch._C._len_torch_dispatch_stack())


def _eager(q, k, v, sinks=None) -> bool:
    # compiling first: dynamo then reads no more. Sink logits of a tensor subclass go through the dispatcher too.
    return not torch.compiler.is_compiling() and _plain(q, k, v) and (sinks is None or type(sinks) in _SINK_TYPES)


def _facts(q, k, v, is_causal, scale, enable_gqa, fallback, mods=NO_MODS, sinks=None) -> tuple:
    """The key of a call's cached route (FAST_ROUTES): the facts that fix its route, its score mods last; a sinks
    call's key ends with its logits' facts (_sink_facts), so it is one longer than any call's without. K's and V's
    dtype and device are facts too: a later call of the same sizes with another K or V dtype or device (which the full
    path refuses) must not take a kernel route made for the uniform call."""
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            k.device, v.device, is_causal, scale, enable_gqa, fallback) + tuple(mods) + (
                () if sinks is None else (_sink_facts(sinks),))


def _eager_call(q, k, v, is_causal, scale, enable_gqa, fallback, mods=NO_MODS, sinks=None):
    out = _attention_impl(q, k, v, is_causal, scale, enable_gqa, fallback, mods, sinks)
    route = _route_for(q, k, v, is_causal, scale, enable_gqa, fallback, mods, sinks is not None)
    if route is not None:
        FAST_ROUTES[_facts(q, k, v, is_causal, scale, enable_gqa, fallback, mods, sinks)] = route
    return out


def _route_for(q, k, v, is_causal, scale, enable_gqa, fallback, mods=NO_MODS, sinks: bool = False):
    """The closure that repeats this (just completed) call's route, or None where each call must decide; a sinks
    call's (`sinks`: whether it has them) takes the logits as a fourth argument. Calls with score mods or sinks never
    register with the compiled launcher: its call key has none of them (launcher.cpp hands such calls back to Python,
    so a dense call's route there is never taken for them)."""
    decision = routing.decide(Call.of(q, k, v, is_causal, mods, sinks))
    if decision.route != "evotune":
        if fallback == "error" and decision.refused_by_error_fallback:
            return None
        if mods != NO_MODS or sinks:
            return _mods_fallback_route(q, v, is_causal, scale, enable_gqa, mods, sinks)
        if q.is_cuda and not record._ACTIVE and launcher.load():  # the compiled launcher runs it from C++
            launcher.register_sdpa(q, k, v, is_causal, scale, enable_gqa, fallback, *output_layout(q, v))
        return _sdpa_route(q, v, is_causal, scale, enable_gqa)
    if misaligned(q, k, v):
        return None
    return _kernel_route(decision, q, k, v, is_causal, scale, enable_gqa, fallback, mods, sinks)


def _mods_fallback_route(q, v, is_causal, scale, enable_gqa, mods, sinks: bool = False):
    """A softcap, window or sinks call's fallback (_run_fallback's, evotune.torch.fallback), its result in the op's
    layout; a sinks call's takes the logits (q, k, v, sinks)."""
    if sinks:
        def run_with_sinks(q, k, v, sinks):
            return _run_fallback(q, k, v, is_causal, scale, enable_gqa, mods, sinks)

        return run_with_sinks

    def run(q, k, v):
        return _run_fallback(q, k, v, is_causal, scale, enable_gqa, mods)

    return run


def _sdpa_route(q, v, is_causal, scale, enable_gqa):
    """One SDPA call, its result returned as it is where it has the op's layout (decided now: the call's facts
    fix SDPA's output strides unless the caller changes SDPA's backend, which the check still catches)."""
    sdpa = F.scaled_dot_product_attention
    size, want = output_layout(q, v)

    def relayout(o, q):
        out = q.new_empty_strided(size, want)
        out.copy_(o)
        return out

    # The facts of a call do not include its addresses: each call checks them (aligned_for_sdpa's reason).
    if enable_gqa:
        def run(q, k, v):
            if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:  # inline: this route runs eager calls only
                q, k, v = aligned_for_sdpa(q, k, v)
            o = sdpa(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=True)
            return o if o.stride() == want else relayout(o, q)
    else:
        def run(q, k, v):
            if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:  # inline: this route runs eager calls only
                q, k, v = aligned_for_sdpa(q, k, v)
            o = sdpa(q, k, v, is_causal=is_causal, scale=scale)
            return o if o.stride() == want else relayout(o, q)
    return run


def _kernel_route(decision, q, k, v, is_causal, scale, enable_gqa, fallback, mods=NO_MODS, sinks: bool = False):
    index = decision.call.device_index
    size, stride = output_layout(q, v)
    out = new_output(q, v)
    prepared = PREPARED.get(load_for(decision), decision.shape, q, k, v, out,
                            scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)

    def run(q, k, v):
        addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr())  # read once: the check here, the packet's slots
        if (addresses[0] | addresses[1] | addresses[2]) & 15 or current_device() != index:
            return _attention_impl(q, k, v, is_causal, scale, enable_gqa, fallback, mods)
        out = q.new_empty_strided(size, stride)
        prepared(q, k, v, out, None, addresses)
        return out

    if sinks:  # the logits' pointer is read per call (kernel_sinks converts where their dtype or strides ask)
        def run_with_sinks(q, k, v, sinks):
            addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr())
            if (addresses[0] | addresses[1] | addresses[2]) & 15 or current_device() != index:
                return _attention_impl(q, k, v, is_causal, scale, enable_gqa, fallback, mods, sinks)
            out = q.new_empty_strided(size, stride)
            prepared(q, k, v, out, None, addresses, kernel_sinks(sinks))
            return out

        return run_with_sinks

    # With the compiled launcher (opt-in: evotune.torch.launcher), the route is registered with it and a call goes
    # straight to its C++ kernel, which checks the alignment and device itself; what it hands back runs `run`.
    if (mods == NO_MODS and not record._ACTIVE and launcher.load()
            and launcher.register(prepared, q, k, v, out, is_causal, scale, enable_gqa, fallback)):
        def compiled(q, k, v):
            return _DISPATCH(q, k, v, is_causal, scale, enable_gqa, fallback)

        compiled.python = run
        return compiled
    return run


# --------------------------------------------------------------------------- explain and warmup


@dataclass(frozen=True)
class Explanation:
    route: str
    kind: str
    reason: str
    call: dict
    key: dict | None
    match: str
    entry: dict | None
    raises_with_error_fallback: bool
    runs: str = ""  # what computes the call: "evotune kernel", "PyTorch SDPA", or evotune.torch.fallback's way

    def __str__(self) -> str:
        runs = self.runs or ("evotune kernel" if self.route == "evotune" else "PyTorch SDPA")
        lines = [f"route: {runs} ({self.kind})",
                 f"why:   {self.reason}", f"call:  {self.call['shape'] or self.call}"]
        if self.entry:
            prov = self.entry["provenance"]
            sdpa = self.entry["sdpa"]
            measured = Shape.from_dict(self.entry["shape"]).spec
            lines.append(f"entry: {self.match} match; run {prov['run']} trial {prov['trial']} (git {prov['git_sha']}) "
                         f"on {measured}: evotune {self.entry['evotune_us']:.2f} us"
                         + (f" vs {sdpa['backend']} {sdpa['time_us']:.2f} us" if sdpa else ", SDPA not measured"))
        if self.raises_with_error_fallback:
            lines.append("with fallback='error' this call raises")
        return "\n".join(lines)


def explain(q, k, v, *, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
            softcap: float = 0.0, window: tuple[int, int] | None = None,
            sinks: torch.Tensor | None = None) -> Explanation:
    """Which kernel attention(q, k, v, ...) would use and why, without running it or warning (its key holds the
    softcap flag, the window's bucket and the sinks flag where the call has them)."""
    _check_options(q, k, v, is_causal, scale, enable_gqa)
    check_args(q, k, v, enable_gqa)
    mods = score_mods(softcap, window, is_causal, q, k)
    check_sinks(sinks, q)
    decision = routing.decide_for(q, k, v, is_causal, mods, sinks is not None)
    runs = "evotune kernel" if decision.route == "evotune" else routing.fallback_name(decision)
    return Explanation(decision.route, decision.kind, decision.reason, decision.call.as_dict(),
                       decision.key.as_dict() if decision.key else None, decision.match,
                       decision.entry.as_dict() if decision.entry else None, decision.refused_by_error_fallback, runs)


def warmup(devices=None) -> list[dict]:
    """Compile and load, on each CUDA device (default: all visible), every table entry of that GPU that
    routes to evotune, and the compiled launcher (evotune.torch.launcher), so no call compiles or loads later (do it
    before CUDA graph capture). Returns one
    row per entry and device: {"key", "device", "status": "loaded" | "skipped", "why"}."""
    from ..space.searchspace import Config
    from ..records.tuning_table import unusable_reason

    if not torch.cuda.is_available():
        raise UsageError("evotune.torch.warmup: no CUDA GPU is visible")
    table = routing.current_table()
    if table is None:
        raise UsageError(f"evotune.torch.warmup: no tuning table at {routing.table_path()}")
    rows = []
    for index in range(torch.cuda.device_count()) if devices is None else devices:
        name, cc, _ = routing.gpu_identity(index)
        for entry in (e for e in table.entries if (e.key.gpu, e.key.cc) == (name, cc)):
            shape = Shape.from_dict(entry.shape)
            why = "the table routes it to SDPA" if entry.route != "evotune" else unusable_reason(entry, shape)
            if not why:
                CACHE.get(Config.from_dict(entry.config), shape, index, entry.provenance["source_digest"])
            rows.append({"key": entry.key.spec(), "device": index, "status": "skipped" if why else "loaded", "why": why})
    if not rows:
        raise UsageError(f"{routing.table_path()}: no entry for the visible GPUs; the table holds "
                         f"{', '.join(table.gpus()) or 'no entries'}")
    launcher.load(wait=True)  # the compiled launcher built and loaded now, not in the background after a first call
    return rows
