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
from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import UsageError
from ..problems.shapes import Shape
from . import record, routing
from .call import DTYPES, Call, check_args, misaligned, new_output
from .autograd import lse_backend
from .kernels import CACHE, PREPARED, launch, load_for


@torch.library.custom_op("evotune::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                 scale: Optional[float] = None, enable_gqa: bool = False, fallback: str = "sdpa") -> torch.Tensor:
    # A compiled graph calls this at run time, call after call: the same cached routes as eager code.
    if not record.active():
        fast = routing.FAST_ROUTES.get(_facts(q, k, v, is_causal, scale, enable_gqa, fallback))
        if fast is not None:
            return fast(q, k, v)
    return _eager_call(q, k, v, is_causal, scale, enable_gqa, fallback)


def _attention_impl(q, k, v, is_causal, scale, enable_gqa, fallback):
    """The op's real implementation: route, then run evotune's kernel or SDPA."""
    routing.check_fallback(fallback)
    check_args(q, k, v, enable_gqa)
    decision = routing.decide_for(q, k, v, is_causal)
    record.observe(decision)
    if decision.route == "evotune":
        return _run_evotune(decision, q, k, v, scale)
    routing.notify(decision, fallback)
    return _run_sdpa(q, k, v, is_causal, scale, enable_gqa)


@attention_op.register_fake
def _attention_fake(q, k, v, is_causal=False, scale=None, enable_gqa=False, fallback="sdpa"):
    routing.check_fallback(fallback)
    check_args(q, k, v, enable_gqa)
    return new_output(q, v)


def _run_evotune(decision, q, k, v, scale):
    index = decision.call.device_index
    if index == torch.cuda.current_device():
        return _launch_here(decision, q, k, v, scale)
    with torch.cuda.device(index):
        return _launch_here(decision, q, k, v, scale)


def _launch_here(decision, q, k, v, scale):
    """Launch on the current device, the tensors'."""
    loaded = load_for(decision)
    out = new_output(q, v)
    launch(loaded, decision.shape, q, k, v, out, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    return out


def _run_sdpa(q, k, v, is_causal, scale, enable_gqa):
    gqa = {"enable_gqa": True} if enable_gqa else {}  # the keyword exists from torch 2.5
    o = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, **gqa)
    out = new_output(q, v)
    if o.stride() == out.stride():
        return o
    out.copy_(o)
    return out


def _check_options(q, k, v, is_causal, scale, enable_gqa) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"evotune.torch.attention: {name} must be a tensor, got {type(t).__name__}")
    for name, value in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(value, bool):
            raise UsageError(f"evotune.torch.attention: {name} must be True or False, got {value!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise UsageError(f"evotune.torch.attention: scale must be a number or None, got {type(scale).__name__}")


def _needs_grad(q, k, v) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def attention(q, k, v, *, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
              fallback: str = "sdpa") -> torch.Tensor:
    """softmax(scale·QKᵀ [+ top-left causal mask])·V with SDPA's semantics, on evotune's tuned kernel where
    the tuning table has one for this GPU and key, else PyTorch SDPA if `fallback` is "sdpa" (told once
    per key) or a UsageError if it is "error" (where the table itself routes a key to SDPA, SDPA runs).
    q (B, H, Sq, D), k and v (B, Hk, Sk, D): any strides with a unit last one; the output has the
    query's layout. Inputs that require grad run `evotune::attention_lse` (the kernel with its
    log-sum-exp epilogue, then PyTorch's attention backward: evotune.torch.autograd)."""
    fast = _fast_route(q, k, v, is_causal, scale, enable_gqa, fallback)
    if fast is not None:
        return fast(q, k, v)
    _check_options(q, k, v, is_causal, scale, enable_gqa)
    scale = None if scale is None else float(scale)
    routing.check_fallback(fallback)
    if _needs_grad(q, k, v):
        return _grad_path(q, k, v, is_causal, scale, enable_gqa, fallback)
    if _eager(q, k, v):
        return _eager_call(q, k, v, is_causal, scale, enable_gqa, fallback)
    if torch.compiler.is_compiling() and _sdpa_when_traced(q, k, v, is_causal, enable_gqa, fallback):
        return _run_sdpa(q, k, v, is_causal, scale, enable_gqa)
    return torch.ops.evotune.attention(q, k, v, is_causal, scale, enable_gqa, fallback)


# --------------------------------------------------------------------------- SDPA routes decided while tracing
#
# Where a call's route is SDPA by facts fixed when torch.compile traces it (sizes, strides, dtype, device,
# the table: a key the table routes to SDPA, one it lacks, one the kernel cannot compute), the compiled graph
# calls SDPA itself rather than the opaque op, so the compiler plans it as it plans SDPA in any model (on the
# H100, GPT-2 16x1024 under torch.compile read 0.95x sdpa's speed with the opaque op around its SDPA route;
# docs/PERFORMANCE.md). Shapes the trace keeps
# symbolic (dynamic=True) and evotune routes keep the op: its body decides at run time.


def _sdpa_when_traced(q, k, v, is_causal, enable_gqa, fallback) -> bool:
    sizes = tuple(q.shape) + tuple(k.shape) + tuple(v.shape) + q.stride() + k.stride() + v.stride()
    if not all(type(n) is int for n in sizes) or record.active():  # symbolic, or every call must be recorded
        return False
    return _sdpa_route_of((tuple(q.shape), tuple(k.shape), tuple(v.shape)), (q.stride(), k.stride(), v.stride()),
                          DTYPES.get(q.dtype, str(q.dtype).replace("torch.", "")), q.device.type, q.device.index,
                          bool(is_causal), bool(enable_gqa), fallback)


@torch.compiler.assume_constant_result
def _sdpa_route_of(shapes, strides, dtype, device_type, device_index, is_causal, enable_gqa, fallback) -> bool:
    """Whether this call's route is SDPA whatever its data (run once, while tracing; its notice is told then,
    and fallback="error" raises then)."""
    (b, h, sq, d), (_, hk, sk, _), (_, _, _, dv) = shapes
    if device_type == "cuda" and device_index is None:
        device_index = 0
    device = device_type if device_index is None else f"{device_type}:{device_index}"
    layout = "bshd" if strides[0][1] < strides[0][2] else "bhsd"
    decision = routing.decide(Call(b, h, hk, sq, sk, d, dv, dtype, is_causal, layout, device, strides))
    if decision.route == "evotune":
        return False
    routing.notify(decision, fallback)
    return True


def _grad_path(q, k, v, is_causal, scale, enable_gqa, fallback):
    """The training op where a PyTorch backward takes (O, LSE) on this device; elsewhere SDPA with its own
    autograd, told once (in eager code; while torch.compile traces, a notice would break the graph)."""
    if lse_backend(q, k, is_causal) is not None:
        return torch.ops.evotune.attention_lse(q, k, v, is_causal, scale, enable_gqa, fallback)[0]
    if not torch.compiler.is_compiling():
        check_args(q, k, v, enable_gqa)
        decision = routing.uncovered(routing.decide(Call.of(q, k, v, is_causal)),
                                     f"no PyTorch attention backward takes a log-sum-exp on {q.device.type}")
        record.observe(decision)
        routing.notify(decision, fallback)
    elif fallback == "error":
        raise UsageError(f"evotune.torch.attention: no attention backward on {q.device.type} [fallback='error']")
    gqa = {"enable_gqa": True} if enable_gqa else {}
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, **gqa)


# --------------------------------------------------------------------------- the eager fast path
#
# In eager code the op's implementation is called directly, not through the dispatcher (whose Python
# custom-op layers cost more than SDPA's whole call: tools/op_host_overhead.py); torch.compile, export and
# any tensor subclass or mode still go through torch.ops.evotune.attention. After a call's first run its
# route is kept per call facts (sizes, strides, dtype, device, options) as a small closure, so a repeated
# call costs a dict lookup, an alignment check, the output's allocation and a packet launch, in eager code
# and inside a compiled graph alike (the op's body looks the closure up first).


def _eager(q, k, v) -> bool:
    return (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and not torch.compiler.is_compiling() and not torch._C._is_torch_function_mode_enabled()
            and not torch._C._len_torch_dispatch_stack())


def _facts(q, k, v, is_causal, scale, enable_gqa, fallback) -> tuple:
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, q.device, is_causal, scale,
            enable_gqa, fallback)


def _fast_route(q, k, v, is_causal, scale, enable_gqa, fallback):
    """The cached route of a call seen before (None: take the full path), for plain eager forward calls."""
    if torch.compiler.is_compiling():  # first: dynamo then reads nothing below (no guards on the cache)
        return None
    if record.active() or not routing.FAST_ROUTES or not _eager(q, k, v) or _needs_grad(q, k, v):
        return None
    try:
        return routing.FAST_ROUTES.get(_facts(q, k, v, is_causal, scale, enable_gqa, fallback))
    except TypeError:  # unhashable arguments: the full path says what is wrong with them
        return None


def _eager_call(q, k, v, is_causal, scale, enable_gqa, fallback):
    out = _attention_impl(q, k, v, is_causal, scale, enable_gqa, fallback)
    route = _route_for(q, k, v, is_causal, scale, enable_gqa, fallback)
    if route is not None:
        routing.FAST_ROUTES[_facts(q, k, v, is_causal, scale, enable_gqa, fallback)] = route
    return out


def _route_for(q, k, v, is_causal, scale, enable_gqa, fallback):
    """The closure that repeats this (just completed) call's route, or None where each call must decide."""
    decision = routing.decide(Call.of(q, k, v, is_causal))
    if decision.route != "evotune":
        if fallback == "error" and decision.refused_by_error_fallback:
            return None
        return lambda q, k, v: _run_sdpa(q, k, v, is_causal, scale, enable_gqa)
    if misaligned(q, k, v):
        return None
    index = decision.call.device_index
    loaded = load_for(decision)
    shape = decision.shape
    prepared = PREPARED.get(loaded, shape, q, k, v, new_output(q, v), scale if scale is not None
                            else 1.0 / math.sqrt(q.shape[-1]))

    def run(q, k, v):
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15 or torch.cuda.current_device() != index:
            return _attention_impl(q, k, v, is_causal, scale, enable_gqa, fallback)
        out = new_output(q, v)
        prepared(q, k, v, out)
        return out

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

    def __str__(self) -> str:
        lines = [f"route: {'evotune kernel' if self.route == 'evotune' else 'PyTorch SDPA'} ({self.kind})",
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


def explain(q, k, v, *, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Explanation:
    """Which kernel attention(q, k, v, ...) would use and why, without running it or warning."""
    _check_options(q, k, v, is_causal, scale, enable_gqa)
    check_args(q, k, v, enable_gqa)
    decision = routing.decide_for(q, k, v, is_causal)
    return Explanation(decision.route, decision.kind, decision.reason, decision.call.as_dict(),
                       decision.key.as_dict() if decision.key else None, decision.match,
                       decision.entry.as_dict() if decision.entry else None, decision.refused_by_error_fallback)


def warmup(devices=None) -> list[dict]:
    """Compile and load, on each CUDA device (default: all visible), every table entry of that GPU that
    routes to evotune, so no call compiles or loads later (do it before CUDA graph capture). Returns one
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
    return rows
