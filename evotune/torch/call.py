"""One attention call as evotune sees it: argument checks, the query's layout, the output's layout,
and whether the kernel can compute the call at all.

Two kinds of fault. Arguments SDPA itself would refuse (not 4-D, mismatched sizes, dtypes or
devices, fewer K/V heads without enable_gqa) are a UsageError. Arguments SDPA computes but the
kernel does not (a CPU tensor, fp32, head dim 96, a strided head dim) make the call "uncovered": `coverage` names what, and the op's fallback policy decides between SDPA and
an error. Grouped K/V heads (enable_gqa, fewer K/V heads than query heads) are covered: the kernel
reads K/V head h // (heads / kv_heads) for query head h, and K/V go in un-repeated.

Logit soft-capping and a sliding window ("score mods": `softcap`, `window`) are the Hopper kernel's SOFTCAP and LOCAL
traits, with flash-attention's semantics as evotune.problems.shapes defines them; a call carries them as the triple
(softcap, window_left, window_right), NO_MODS where it has neither, and its Shape (so its table key and its kernel's
instantiation) carries them too.

Attention sinks (`sinks`: gpt-oss's `s_aux`, flash-attention's `learnable_sink`) are the Hopper kernel's SINKS trait:
one logit per query head joins every row's softmax as a column with no value. The logits are a tensor, an input of
the call, not one of its facts: a Call carries only whether it has them (`sinks`), which its Shape, table key and
kernel instantiation read; the tensor goes to the launch (its pointer) or the fallback.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from ..errors import UsageError
from ..problems.attention import HEAD_DIM_V_PAIRS, HEAD_DIMS

HEAD = "evotune.torch.attention"
NO_MODS = (0.0, -1, -1)  # (softcap, window_left, window_right) of a call with neither
DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
# The kernels are compiled for sm_90a (compile.DEFAULT_ARCH): their cubins load on compute capability 9.0 only.
KERNEL_CC = (9, 0)


def layout_of(q: torch.Tensor) -> str:
    """"bshd" where the query's head stride is below its sequence stride ((B,S,H,D) memory seen through
    strides, a projection's output), else "bhsd"."""
    return "bshd" if q.stride(1) < q.stride(2) else "bhsd"


def new_output(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The op's output, (B, H, Sq, Dv) dense in the query's layout. The fake implementation returns the
    same, so the strides torch.compile plans with are the strides the op returns."""
    size, stride = output_layout(q, v)
    return q.new_empty_strided(size, stride)


def output_layout(q, v) -> tuple[tuple, tuple]:
    """(size, stride) of the op's output for q and v (new_output's, without allocating)."""
    return layout_for(q.shape[0], q.shape[1], q.shape[2], v.shape[3], layout_of(q) == "bshd")


def layout_for(b: int, h: int, s: int, dv: int, bshd: bool) -> tuple[tuple, tuple]:
    """(size, stride) of the op's output, (B, H, Sq, Dv) dense in the query's layout, from its sizes (torch.compile's
    trace-time plan reads them as constants)."""
    if bshd:
        return (b, h, s, dv), (s * h * dv, dv, h * dv, 1)
    return (b, h, s, dv), (h * s * dv, s * dv, dv, 1)


def check_args(q, k, v, enable_gqa: bool) -> None:
    """UsageError for arguments SDPA would refuse (works on fake and meta tensors)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"evotune.torch.attention: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise UsageError(f"evotune.torch.attention: {name} must be 4-D (batch, heads, seq, head_dim), "
                             f"got {t.dim()}-D {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise UsageError(f"evotune.torch.attention: q, k, v must share one floating dtype, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise UsageError(f"evotune.torch.attention: q, k, v are on {q.device}, {k.device}, {v.device}: use one device")
    (bq, hq, _, dq), (bk, hk, sk, dk), (bv, hv, sv, _) = q.shape, k.shape, v.shape
    if not (bq == bk == bv) or hk != hv or sk != sv or dq != dk:
        raise UsageError(f"evotune.torch.attention: sizes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} (batch and k/v heads and lengths must agree, and q, k head dims)")
    if hq != hk and not (enable_gqa and hk > 0 and hq % hk == 0):
        need = "a divisor of the query heads" if enable_gqa else "equal to the query heads (or pass enable_gqa=True)"
        raise UsageError(f"evotune.torch.attention: {hk} k/v heads for {hq} query heads: must be {need}")


def score_mods(softcap, window, is_causal, q, k) -> tuple[float, int, int]:
    """(softcap, window_left, window_right) of attention()'s `softcap` (a number >= 0; 0 or None: no cap) and `window`
    (None, or a pair (left, right) of integers, -1 leaving that side unbounded), checked (check_mods): one UsageError
    line for a bad value. The causal rule reads q's and k's lengths where they are 4-D (check_args refuses the rest)."""
    if softcap is None:
        softcap = 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise UsageError(f"{HEAD}: softcap must be a number >= 0 (0 or None: no cap), got {type(softcap).__name__}")
    left, right = -1, -1
    if window is not None:
        try:
            sides = tuple(window)
            bad = len(sides) != 2 or any(isinstance(w, bool) for w in sides)
            left, right = (-1, -1) if bad else (operator.index(sides[0]), operator.index(sides[1]))
        except TypeError:  # not a sequence, or a side that is not an integer
            bad = True
        if bad:
            raise UsageError(f"{HEAD}: window must be None or a pair (left, right) of integers (-1: that side "
                             f"unbounded), e.g. (4095, 0) for a causal window of 4096 keys; got {_shown(window)}")
    four = getattr(q, "dim", lambda: 0)() == 4 and getattr(k, "dim", lambda: 0)() == 4
    check_mods(float(softcap), left, right, is_causal, q.shape[2] if four else None, k.shape[2] if four else None)
    return float(softcap), left, right


def check_mods(softcap: float, left: int, right: int, is_causal: bool, seq_q, seq_k) -> None:
    """The score mods' values by evotune.problems.shapes.Shape's rules (softcap finite and >= 0, each window side -1 or
    more, and beside the top-left causal mask a window only where Sq == Sk, where the two alignments agree): one
    UsageError line otherwise. Works on fake and meta tensors' sizes (seq_q, seq_k; None: not checked)."""
    from ..problems.shapes import Shape

    try:
        Shape(1, 1, 1, 1, 1, softcap=softcap, window_left=left, window_right=right)
    except UsageError as e:
        said = str(e).removeprefix("shape: ").replace("window_left", "window[0]").replace("window_right", "window[1]")
        raise UsageError(f"{HEAD}: {said}") from None
    if (left >= 0 or right >= 0) and is_causal and seq_q is not None and seq_q != seq_k:
        raise UsageError(f"{HEAD}: is_causal with a window needs as many queries as keys (got {seq_q} and {seq_k}): "
                         f"is_causal is top-left (SDPA's) and the window bottom-right (flash-attention's); pass "
                         f"window=({left}, 0) with is_causal=False for flash-attention's causal window")


def check_sinks(sinks, q) -> None:
    """attention()'s `sinks`: None, or a (H,) floating tensor of per-query-head sink logits on q's device (any float
    dtype: the kernel's launch converts them to float32). One UsageError line otherwise. Works on fake and meta
    tensors; the head count is read where q is 4-D (check_args refuses the rest)."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise UsageError(f"{HEAD}: sinks must be None or a (heads,) tensor of per-head sink logits, got "
                         f"{type(sinks).__name__}")
    if not sinks.dtype.is_floating_point:
        raise UsageError(f"{HEAD}: sinks must be a floating tensor (the sink logits), got {sinks.dtype}")
    heads = q.shape[1] if getattr(q, "dim", lambda: 0)() == 4 else None
    if sinks.dim() != 1 or (heads is not None and sinks.shape[0] != heads):
        want = f"({heads},)" if heads is not None else "(heads,)"
        raise UsageError(f"{HEAD}: sinks must hold one logit per query head, shape {want}, got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise UsageError(f"{HEAD}: sinks is on {sinks.device} and q on {q.device}: use one device")


def _shown(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True)
class Call:
    """The facts of one call that decide its route (hashable: the decision cache's key)."""

    batch: int
    heads: int
    kv_heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    v_head_dim: int
    dtype: str            # fp16, bf16, or torch's name of another dtype
    causal: bool
    layout: str           # of the query
    device: str           # "cuda:0", "cpu", ...
    strides: tuple        # of q, k, v
    softcap: float = 0.0  # the score mods (check_mods): logit soft-capping's C, 0 without
    window: tuple = (-1, -1)  # flash-attention's window_size (left, right), (-1, -1) without
    sinks: bool = False   # whether the call has attention sinks (their logits are an input, not a fact of the call)

    @classmethod
    def of(cls, q, k, v, is_causal: bool, mods: tuple = NO_MODS, sinks: bool = False) -> "Call":
        device = q.device if q.device.type != "cuda" or q.device.index is not None else torch.device("cuda", 0)
        return cls(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3],
                   DTYPES.get(q.dtype, str(q.dtype).replace("torch.", "")), bool(is_causal), layout_of(q),
                   str(device), (tuple(q.stride()), tuple(k.stride()), tuple(v.stride())), mods[0], mods[1:],
                   bool(sinks))

    @property
    def mods(self) -> tuple:
        """(softcap, window_left, window_right): NO_MODS where the call has neither."""
        return (self.softcap,) + tuple(self.window)

    @property
    def plain(self) -> bool:
        """Whether the call is SDPA's (no softcap, no window, no sinks): off the kernel, SDPA itself computes it."""
        return self.mods == NO_MODS and not self.sinks

    @property
    def device_index(self) -> int | None:
        return torch.device(self.device).index if self.device.startswith("cuda") else None

    def shape(self):
        """The evotune Shape of this call, or None where it is not one (dtype, or a size out of range)."""
        if self.dtype not in DTYPES.values():
            return None
        try:
            return self.shape_or_raise()
        except UsageError:
            return None

    def shape_or_raise(self):
        """The Shape of this call (its score mods too: the table key and the kernel's instantiation read them), or the
        UsageError saying why it is none."""
        from ..problems.shapes import Shape

        return Shape(self.batch, self.heads, self.seq_q, self.seq_k, self.head_dim, self.dtype, self.causal,
                     self.layout, self.kv_heads, self.softcap, self.window[0], self.window[1], self.sinks,
                     head_dim_v=self.v_head_dim)

    def as_dict(self) -> dict:
        """The call's facts (the shapes a recorder keeps); softcap, window and sinks only where set, so a dense call's
        row reads as before."""
        shape = self.shape()
        d = {"shape": shape.spec if shape else None, "batch": self.batch, "heads": self.heads,
             "kv_heads": self.kv_heads, "seq_q": self.seq_q, "seq_k": self.seq_k, "head_dim": self.head_dim,
             "v_head_dim": self.v_head_dim, "dtype": self.dtype, "causal": self.causal, "layout": self.layout,
             "device": self.device}
        if self.softcap:
            d["softcap"] = self.softcap
        if self.window != (-1, -1):
            d["window"] = list(self.window)
        if self.sinks:
            d["sinks"] = True
        return d


def coverage(call: Call, gpu_cc: tuple[int, int] | None) -> str | None:
    """Why the kernel cannot compute `call` (device, dtype, head dim, stride, size), or None.
    `gpu_cc` is the compute capability of the call's GPU (None off CUDA)."""
    from .features import supports, unsupported

    if not call.device.startswith("cuda"):
        return f"device {call.device}: the kernel runs on CUDA GPUs"
    if gpu_cc != KERNEL_CC:
        return (f"GPU {call.device} has compute capability {gpu_cc[0]}.{gpu_cc[1]}: the kernels are compiled "
                f"for sm_90a (9.0)")
    if call.dtype not in DTYPES.values():
        return f"dtype {call.dtype}: the kernel computes fp16 and bf16"
    if call.head_dim not in HEAD_DIMS or (call.v_head_dim != call.head_dim
                                          and (call.head_dim, call.v_head_dim) not in HEAD_DIM_V_PAIRS):
        pairs = ", ".join(f"{d}/{dv}" for d, dv in HEAD_DIM_V_PAIRS)
        return (f"head dim {call.head_dim} (value head dim {call.v_head_dim}): the kernel is written for "
                f"{', '.join(map(str, HEAD_DIMS))}, the same for q, k and v, or q, k / v {pairs}")
    if call.kv_heads != call.heads and not supports("gqa"):
        return f"{call.kv_heads} k/v heads for {call.heads} query heads: {unsupported('gqa')}"
    if 0 in (call.batch, call.heads, call.seq_q, call.seq_k):
        return "an empty tensor (a size is 0)"
    fault = stride_fault(call.strides)
    if fault:
        return fault
    try:
        call.shape_or_raise()
    except UsageError as e:
        return str(e)
    return None


def stride_fault(strides) -> str | None:
    """Why q, k, v with these strides (q's, k's, v's; the last the head dim's) cannot be the kernel's, or None: TMA
    and the loaders need a unit head-dim stride and every other stride a multiple of 8 elements (16-byte rows). The
    dense op's tensors are 4-D, the varlen op's packed ones 3-D."""
    for name, st in zip("qkv", strides):
        if st[-1] != 1 or any(s % 8 for s in st[:-1]):
            return (f"{name} strides {st}: the kernel needs a unit head-dim stride and the others "
                    f"multiples of 8 elements (16-byte rows)")
    return None


def aligned_for_sdpa(q, k, v) -> tuple:
    """q, k, v, each copied to fresh storage where it starts off a 16-byte boundary, for SDPA, which
    does not check this: on torch 2.11 its cuDNN backend returned wrong values (max error 1.17 on N(0,1) inputs)
    for a query view 8 bytes past a boundary, and its flash backend raised an illegal-address error that left the
    CUDA context unusable (H200, docs/data/2026-11-28-h200/host/sdpa_misaligned.txt). A copy only on such calls."""
    if torch.compiler.is_compiling() or not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        return q, k, v  # traced by torch.compile: no addresses exist yet (the graph's SDPA gets what it gets)
    # clone() keeps a dense tensor's strides (the op's output layout follows q's) in fresh, aligned storage.
    return tuple(t.clone() if t.data_ptr() & 15 else t for t in (q, k, v))


def misaligned(q, k, v) -> str | None:
    """Which of q, k, v starts off a 16-byte boundary (a view into a larger tensor can); checked every call."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.data_ptr() % 16:
            return f"{name} starts at an address that is not 16-byte aligned (a view at an odd offset)"
    return None
