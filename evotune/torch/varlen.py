"""evotune.torch.attention_varlen: variable-length packed batches, flash-attention's `flash_attn_varlen_func`.

    from evotune.torch.varlen import attention_varlen
    out = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=True)

q (total_q, H, D), k and v (total_k, Hkv, D) hold B sequences one after another; cu_seqlens_q / cu_seqlens_k are the
(B + 1,) int32 prefix sums of their lengths, max_seqlen_q / max_seqlen_k at least the longest. Sequence b's queries
(rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1) attend to its keys only; the output is (total_q, H, D), contiguous.
GQA (H a multiple of Hkv), fp16 and bf16, the Hopper kernel's head dims. A sequence with queries and no keys gives rows
of 0 (flash-attention's).

Causal: is_causal is the dense op's top-left mask (SDPA's) inside each sequence, so it needs each sequence's query
and key lengths equal (packed self-attention: transformers' packed training and prefill, where flash-attention's
bottom-right causal agrees). The op takes that as given when cu_seqlens_q and cu_seqlens_k are the same tensor (or
views of the same memory); otherwise it compares them (torch.equal: one wait for the GPU per call) and refuses
differing ones with one UsageError line. No softcap, window or sinks here (the kernel has them; the op's arguments
do not yet).

The op is `torch.ops.evotune.attention_varlen` (torch.library.custom_op with a fake implementation: torch.compile
traces it as one node). A call is routed by the tuning table as the dense op's calls are (evotune.torch.routing's
table, evotune.records.tuning_table.select with EVOTUNE_NEAREST, and its notices): its key is the dense key's fields
with `varlen: true`, the sequence buckets those of max_seqlen_q / _k and the work bucket the number of sequences x
heads (TableKey's comment says why the lengths are not in it). Off the kernel (no entry, a CPU tensor, a call that
needs gradients: the kernel has no varlen backward, ...) it runs PyTorch SDPA once per sequence, told once per reason
(EvotuneFallbackWarning, naming what runs).
"""

from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import UsageError
from ..problems.attention import HEAD_DIMS, sdpa_has_gqa
from ..problems.varlen import call_shape, packed_view
from ..records.tuning_table import TableKey, nearest_allowed, select
from . import routing
from .call import DTYPES, KERNEL_CC, stride_fault
from .kernels import PROBLEM, KernelCache, current_stream_handle
from .routing import EvotuneFallbackWarning

HEAD = "evotune.torch.attention_varlen"
FALLBACK = "PyTorch SDPA per sequence"


# --------------------------------------------------------------------------- the argument checks


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale) -> None:
    """UsageError, one line, for arguments flash_attn_varlen_func would refuse (works on fake and meta tensors: reads
    no values)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"{HEAD}: {name} must be a tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise UsageError(f"{HEAD}: {name} must be 3-D (total tokens, heads, head_dim), got {t.dim()}-D "
                             f"{tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise UsageError(f"{HEAD}: q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    devices = {t.device for t in (q, k, v, cu_seqlens_q, cu_seqlens_k)}
    if len(devices) != 1:
        raise UsageError(f"{HEAD}: q, k, v and the cu_seqlens are on {', '.join(sorted(map(str, devices)))}: use one "
                         f"device")
    (tq, hq, dq), (tk, hk, dk), (tv, hv, _) = q.shape, k.shape, v.shape
    if tk != tv or hk != hv or dq != dk:
        raise UsageError(f"{HEAD}: sizes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (k "
                         f"and v tokens and heads must agree, and q, k head dims)")
    if hk < 1 or hq % hk:
        raise UsageError(f"{HEAD}: {hk} k/v heads for {hq} query heads: must divide them")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] < 2:
            raise UsageError(f"{HEAD}: {name} must be a 1-D int32 tensor of B + 1 >= 2 offsets, got "
                             f"{tuple(t.shape)} {t.dtype}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise UsageError(f"{HEAD}: cu_seqlens_q has {cu_seqlens_q.shape[0]} offsets, cu_seqlens_k "
                         f"{cu_seqlens_k.shape[0]}: one per sequence boundary in each")
    batch = cu_seqlens_q.shape[0] - 1
    for name, m, total in (("max_seqlen_q", max_seqlen_q, tq), ("max_seqlen_k", max_seqlen_k, tk)):
        if not _is_int(m) or m < 0:
            raise UsageError(f"{HEAD}: {name} must be an integer >= 0, got {m!r}")
        if _is_int(total) and total > batch * m:
            raise UsageError(f"{HEAD}: {total} tokens in {batch} sequences of at most {name}={m}: {name} is too small")
    if not isinstance(is_causal, bool):
        raise UsageError(f"{HEAD}: is_causal must be True or False, got {is_causal!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise UsageError(f"{HEAD}: scale must be a number or None, got {type(scale).__name__}")
    if is_causal and (tq != tk or max_seqlen_q != max_seqlen_k):
        raise UsageError(f"{HEAD}: is_causal needs each sequence's query and key lengths equal (top-left causal, "
                         f"SDPA's; flash-attention's varlen causal is bottom-right), got {tq} and {tk} tokens, "
                         f"max_seqlen {max_seqlen_q} and {max_seqlen_k}")


def _same_offsets(cu_q, cu_k) -> bool:
    """Whether the two offset tensors are one (the same tensor or a view of the same memory): no value read."""
    if cu_q is cu_k:
        return True
    try:
        return (cu_q.data_ptr() == cu_k.data_ptr() and cu_q.shape == cu_k.shape and cu_q.stride() == cu_k.stride())
    except RuntimeError:  # fake tensors have no storage
        return False


def check_causal_offsets(cu_q, cu_k) -> None:
    """is_causal: the sequences' query and key lengths must be equal. Free where the offsets are one tensor; else they
    are compared (one wait for the GPU) and differing ones refused."""
    if not _same_offsets(cu_q, cu_k) and not torch.equal(cu_q, cu_k):
        raise UsageError(f"{HEAD}: is_causal with cu_seqlens_q != cu_seqlens_k: the causal mask is top-left per "
                         f"sequence (SDPA's), which needs each sequence's query and key lengths equal; pass one "
                         f"offsets tensor for both (packed self-attention)")


# --------------------------------------------------------------------------- routing


@dataclass(frozen=True)
class VarlenCall:
    """The facts of a varlen call that decide its route (hashable)."""

    batch: int
    heads: int
    kv_heads: int
    total_q: int
    total_k: int
    max_q: int
    max_k: int
    head_dim: int
    v_head_dim: int
    dtype: str
    causal: bool
    device: str
    strides: tuple

    @classmethod
    def of(cls, q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, is_causal) -> "VarlenCall":
        device = q.device if q.device.type != "cuda" or q.device.index is not None else torch.device("cuda", 0)
        return cls(cu_seqlens_q.shape[0] - 1, q.shape[1], k.shape[1], q.shape[0], k.shape[0], max_seqlen_q,
                   max_seqlen_k, q.shape[2], v.shape[2], DTYPES.get(q.dtype, str(q.dtype).replace("torch.", "")),
                   bool(is_causal), str(device), (tuple(q.stride()), tuple(k.stride()), tuple(v.stride())))

    @property
    def device_index(self) -> int | None:
        return torch.device(self.device).index if self.device.startswith("cuda") else None

    def shape(self):
        """The call's varlen Shape (problems.varlen.call_shape)."""
        return call_shape(self.batch, self.heads, self.kv_heads, self.head_dim, self.dtype, self.causal, self.total_q,
                          self.total_k, self.max_q, self.max_k)


@dataclass(frozen=True)
class VarlenDecision:
    route: str                    # "evotune" or "fallback"
    kind: str                     # routing.Decision's kinds: tuned, table, missing, stale, unverified, uncovered
    reason: str
    key: TableKey | None = None
    shape: object = None
    entry: object = None
    config: object = None

    def notice(self) -> str:
        if self.kind == "uncovered":
            return f"{HEAD}: the evotune kernel cannot run this call ({self.reason})"
        if self.kind == "missing":
            return (f"{HEAD}: no tuned kernel for {self.key.spec()} ({self.reason}); tune it: evotune tune --shape "
                    f"<a varlen shape, e.g. {self.shape.spec}> --table {routing.table_path()}")
        if self.kind in ("stale", "unverified"):
            return f"{HEAD}: no usable tuned kernel for {self.key.spec()}: {self.reason}"
        return f"{HEAD}: the tuning table routes {self.key.spec()} to the fallback ({self.reason})"

    def notice_key(self) -> tuple:
        return (self.kind, self.key) if self.key is not None and self.kind != "uncovered" else (self.kind, self.reason)


_DECISIONS: dict[VarlenCall, VarlenDecision] = {}
_MAX_DECISIONS = 4096  # a training run's max_seqlen changes with its batches: the cache is bounded
_WARNED: set = set()
_LOCK = threading.Lock()


def _forget() -> None:
    _DECISIONS.clear()
    with _LOCK:
        _WARNED.clear()


routing.ON_FORGET.append(_forget)  # use_table() forgets the dense op's routes and these


def coverage(call: VarlenCall) -> str | None:
    """Why the kernel cannot compute `call`, or None."""
    if not call.device.startswith("cuda"):
        return f"device {call.device}: the kernel runs on CUDA GPUs"
    cc = routing.gpu_identity(call.device_index)[2]
    if cc != KERNEL_CC:
        return f"GPU {call.device} has compute capability {cc[0]}.{cc[1]}: the kernels are compiled for sm_90a (9.0)"
    if call.dtype not in DTYPES.values():
        return f"dtype {call.dtype}: the kernel computes fp16 and bf16"
    if call.head_dim not in HEAD_DIMS or call.v_head_dim != call.head_dim:
        return (f"head dim {call.head_dim} (value head dim {call.v_head_dim}): the kernel is written for "
                f"{', '.join(map(str, HEAD_DIMS))}, the same for q, k and v")
    if 0 in (call.total_q, call.total_k):
        return "an empty tensor (no query or no key tokens)"
    fault = stride_fault(call.strides)
    if fault:
        return fault
    try:
        call.shape()
    except UsageError as e:
        return str(e)
    return None


def decide(call: VarlenCall) -> VarlenDecision:
    """The route of `call`, cached per distinct call until use_table()."""
    found = _DECISIONS.get(call)
    if found is None:
        if len(_DECISIONS) >= _MAX_DECISIONS:
            _DECISIONS.clear()
        found = _DECISIONS[call] = _decide(call)
    return found


def _decide(call: VarlenCall) -> VarlenDecision:
    why = coverage(call)
    if why:
        return VarlenDecision("fallback", "uncovered", why)
    shape = call.shape()
    name, cc, _ = routing.gpu_identity(call.device_index)
    key = TableKey.for_shape(shape, name, cc)
    table = routing.current_table()
    if table is None:
        return VarlenDecision("fallback", "missing", f"no tuning table at {routing.table_path()}", key, shape)
    chosen = select(table, key, shape, allow_nearest=nearest_allowed())
    stale = next((w for spec, w in chosen.skipped if spec == key.spec() and w.startswith("stale:")), None)
    if stale is not None and chosen.route == "sdpa":
        return VarlenDecision("fallback", "stale", stale, key, shape, chosen.entry)
    if chosen.entry is None:
        return VarlenDecision("fallback", "missing", chosen.reason, key, shape)
    if chosen.route == "sdpa":
        kind = "table" if chosen.verified else "unverified"
        return VarlenDecision("fallback", kind, chosen.reason, key, shape, chosen.entry)
    from ..space.searchspace import Config

    return VarlenDecision("evotune", "tuned", chosen.reason, key, shape, chosen.entry,
                          Config.from_dict(chosen.entry.config))


def notify(decision: VarlenDecision) -> None:
    """Before the fallback runs a call: warn once per reason (EvotuneFallbackWarning, naming what runs)."""
    told = decision.notice_key()
    with _LOCK:
        if told in _WARNED:
            return
        _WARNED.add(told)
    warnings.warn(f"{decision.notice()}; running {FALLBACK}", EvotuneFallbackWarning, stacklevel=4)


# --------------------------------------------------------------------------- the kernel and the fallback


# Compiled and loaded varlen kernels: a cache of their own (the dense op's kernels.CACHE keys its shape class without
# varlen, and every shape here is varlen, so the two never share a key).
CACHE = KernelCache()


def _launch(decision: VarlenDecision, call: VarlenCall, q, k, v, cu_seqlens_q, cu_seqlens_k, scale: float):
    """The tuned kernel on the packed tensors (on the current device, the tensors'), into a new (total_q, H, D)."""
    from ..gpu.packet import ParamPacket, launch_packet

    index = call.device_index
    config, shape = decision.config, decision.shape
    loaded = CACHE.loaded(config, shape, index)
    if loaded is None:
        if torch.cuda.is_current_stream_capturing():
            raise UsageError(f"{HEAD}: cannot capture {decision.key.spec()} in a CUDA graph: its kernel is not "
                             f"loaded yet: call the op once before capture")
        loaded = CACHE.get(config, shape, index, decision.entry.provenance["source_digest"])
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    views = [packed_view(t) for t in (q, k, v, out)]
    values = PROBLEM.launch_values(config, shape, *views, scale, cu_seqlens=(cu_seqlens_q, cu_seqlens_k))
    packet = ParamPacket(PROBLEM.entry_params(config, False, shape), values)
    plan = PROBLEM.launch_plan(config, shape)
    launch_packet(loaded.function, plan.grid, plan.block, plan.dynamic_smem, current_stream_handle(index), packet,
                  plan.pdl)
    return out


def fallback(q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal: bool, scale):
    """PyTorch SDPA once per sequence (the lengths read on the host), differentiable; a sequence with queries and
    no keys gives rows of 0. The fallback's semantics are the kernel's: the reference the gate holds it to."""
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    group = q.shape[1] // k.shape[1]
    gqa = group > 1 and sdpa_has_gqa()
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])  # rows of no sequence, or of one without keys: 0
    for b in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        if q1 <= q0 or k1 <= k0:
            continue
        qs, ks, vs = (t.transpose(0, 1) for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        if group > 1 and not gqa:
            ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=is_causal, scale=scale,
                                           **({"enable_gqa": True} if gqa else {}))
        out[q0:q1] = o.transpose(0, 1)
    return out


def _impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale):
    check_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale)
    if is_causal:
        check_causal_offsets(cu_seqlens_q, cu_seqlens_k)
    call = VarlenCall.of(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, is_causal)
    decision = decide(call)
    if decision.route == "evotune":
        if any(t.data_ptr() % 16 for t in (q, k, v)):
            decision = VarlenDecision("fallback", "uncovered", "q, k or v starts off a 16-byte boundary")
        else:
            s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
            index = call.device_index
            if index == torch.cuda.current_device():
                return _launch(decision, call, q, k, v, cu_seqlens_q, cu_seqlens_k, s)
            with torch.cuda.device(index):
                return _launch(decision, call, q, k, v, cu_seqlens_q, cu_seqlens_k, s)
    notify(decision)
    return fallback(q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal, scale)


@torch.library.custom_op("evotune::attention_varlen", mutates_args=())
def attention_varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool = False,
                        scale: float | None = None) -> torch.Tensor:
    """The op's body on real tensors: route, then the kernel or the fallback."""
    return _impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale)


@attention_varlen_op.register_fake
def _fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=False, scale=None):
    check_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale)
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                     is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Attention over a packed batch of variable-length sequences (flash_attn_varlen_func's arguments, in its order;
    the module docstring has the semantics): evotune's tuned Hopper kernel where the tuning table has one for this
    GPU and key, else PyTorch SDPA once per sequence (told once). Inputs that require grad run the fallback (the
    kernel has no varlen backward), told once."""
    check_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale)
    scale = None if scale is None else float(scale)
    if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
        if is_causal:
            check_causal_offsets(cu_seqlens_q, cu_seqlens_k)
        if not torch.compiler.is_compiling():
            notify(VarlenDecision("fallback", "uncovered", "a call that needs gradients: the kernel has no varlen "
                                                           "backward"))
        return fallback(q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal, scale)
    return attention_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale)


def explain_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                   is_causal: bool = False) -> VarlenDecision:
    """Which kernel attention_varlen(...) would use and why (its decision), without running it or warning."""
    check_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, None)
    return decide(VarlenCall.of(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, is_causal))


__all__ = ["attention_varlen", "attention_varlen_op", "explain_varlen", "fallback", "FALLBACK"]
