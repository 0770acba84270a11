"""What computes a call with a softcap, a window or attention sinks where evotune's kernel does not (no table entry, a
stale one, a loss to the baseline, a CPU tensor, a call that needs gradients, ...): PyTorch SDPA has neither a
softcap, nor flash-attention's bottom-right window, nor sinks, so

  window only   SDPA with a boolean mask of the window (and the causal mask, folded in): SDPA's own backends and
                autograd; the mask is built once per (Sq, Sk, causal, window, device) where it is small
  softcap       math_attention: the scores, the cap, the masks, the softmax and the product with V in fp32 (the
                order of transformers' eager attention: cap, then mask), differentiable, by chunks of query heads
  sinks         math_attention with each head's sink logit as one more softmax column that carries no value
                (evotune.problems.attention.sink_probs, the fp32 reference's), with or without a cap and a window;
                differentiable in the logits too. SDPA returns no log-sum-exp to fold a sink in afterwards.

with the semantics of evotune.problems.attention's fp32 reference: a row whose window holds no key (Sq > Sk with a
bounded right side) is 0, as flash-attention writes it. Both are plain PyTorch, so torch.compile traces them.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from ..problems.attention import sees, sink_probs
from .call import aligned_for_sdpa

# fp32 scores per chunk of query heads in math_attention (256 MiB, and as much again for the softmax): bounds its
# memory where transformers' eager attention materialises every head's scores at once.
MAX_SCORES = 1 << 26
# Window masks cached up to this many elements (16 MiB of booleans each, at most CACHED_MASKS of them): building one
# is a few element-wise kernels, cheap beside the attention it masks, but not free per call.
MAX_CACHED_MASK = 1 << 24
CACHED_MASKS = 16
_MIN = torch.finfo(torch.float32).min  # a masked score: finite, so a row masked whole (by a caller's mask) is not NaN


def name(mods: tuple, sinks: bool = False) -> str:
    """What runs a call with these score mods (softcap, window_left, window_right), and sinks where it has them, when
    the kernel does not."""
    softcap, left, right = mods
    if sinks:
        return "PyTorch math attention in fp32 with a sink column (SDPA has no attention sinks)"
    if softcap:
        return "PyTorch math attention in fp32 (SDPA has no softcap)"
    if left >= 0 or right >= 0:
        return "PyTorch SDPA with a boolean window mask (SDPA has no bottom-right window)"
    return "PyTorch SDPA"


def attention(q, k, v, is_causal: bool, scale, enable_gqa: bool, mods: tuple, sinks=None):
    """The fallback's result (B, H, Sq, Dv) for a call with score mods or sinks (the (H,) sink logits; a call with
    neither is plain SDPA's)."""
    softcap, left, right = mods
    if softcap or sinks is not None:
        return math_attention(q, k, v, is_causal=is_causal, scale=scale, softcap=softcap, window=(left, right),
                              sinks=sinks)
    return window_sdpa(q, k, v, is_causal, scale, enable_gqa, (left, right))


def window_sdpa(q, k, v, is_causal: bool, scale, enable_gqa: bool, window: tuple):
    """SDPA with the window's boolean mask (causal folded into it: SDPA takes a mask or is_causal, not both)."""
    mask, empty = window_mask(q.shape[2], k.shape[2], is_causal, window, q.device)
    gqa = {"enable_gqa": True} if enable_gqa else {}
    q, k, v = aligned_for_sdpa(q, k, v)
    return zero_rows(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **gqa), empty)


def math_attention(q, k, v, *, is_causal: bool = False, scale=None, softcap: float = 0.0, window: tuple = (-1, -1),
                   mask=None, dropout: float = 0.0, sinks=None):
    """softmax(cap(scale·QKᵀ) + masks)·V in fp32, returned in q's dtype; differentiable. cap(s) = C·tanh(s / C) where
    softcap C > 0; the masks: is_causal (top-left, SDPA's), `window` (bottom-right, flash-attention's), and `mask`, a
    caller's (B or 1, H or 1, Sq, Sk) boolean (True: seen) or additive float mask (transformers' masks). Fewer K/V heads
    than query heads are shared by groups (GQA). `dropout` on the probabilities (transformers' training calls).
    `sinks`: None, or the (H,) sink logits (any float dtype, read in fp32): each head's joins every row's softmax as a
    column with no value (gpt-oss's s_aux), so a row's probabilities sum to less than 1, and a row whose keys are
    all masked (by `mask` too) is 0."""
    b, h, sq, _ = q.shape
    sk = k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    seen, empty = window_mask(sq, sk, is_causal, window, q.device) if is_causal or window != (-1, -1) else (None, 0)
    per = max(1, MAX_SCORES // max(1, b * sq * sk))
    parts = [_math_heads(q, k, v, h0, min(h, h0 + per), scale, softcap, seen, mask, dropout,
                         None if sinks is None else sinks[h0:min(h, h0 + per)])
             for h0 in range(0, h, per)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return zero_rows(out, empty).to(q.dtype)


def _math_heads(q, k, v, h0: int, h1: int, scale: float, softcap: float, seen, mask, dropout: float, sinks=None):
    """math_attention's query heads h0 to h1 (K/V heads h // group; `sinks` those heads' logits), in fp32."""
    group = q.shape[1] // k.shape[1]
    if group == 1:
        kh, vh = k[:, h0:h1], v[:, h0:h1]
    else:
        index = torch.arange(h0, h1, device=k.device) // group
        kh, vh = k.index_select(1, index), v.index_select(1, index)
    s = torch.matmul(q[:, h0:h1].float(), kh.float().transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if seen is not None:
        s = s.masked_fill(~seen, _MIN)
    if mask is not None:
        m = mask[:, h0:h1] if mask.dim() == 4 and mask.shape[1] > 1 else mask
        s = s.masked_fill(~m, _MIN) if m.dtype == torch.bool else s + m.float()
    # Masked scores are finite (_MIN), so a row masked whole takes exp(_MIN - lse) = 0 beside a sink: 0, as the
    # kernel and the reference write it.
    p = torch.softmax(s, dim=-1) if sinks is None else sink_probs(s, sinks.float())
    if dropout:
        p = F.dropout(p, dropout, training=True)
    return torch.matmul(p, vh.float())


def zero_rows(out, empty: int):
    """`out` with its first `empty` query rows 0 (the rows whose window holds no key: window_mask)."""
    if not empty:
        return out
    keep = torch.arange(out.shape[2], device=out.device) >= empty
    return torch.where(keep[:, None], out, out.new_zeros(()))


def window_mask(seq_q: int, seq_k: int, causal: bool, window: tuple, device):
    """(mask, empty): the (Sq, Sk) boolean mask of the keys each query sees (causal top-left, the window bottom-right:
    evotune.problems.attention.sees), and how many leading rows see no key (Sq > Sk + right); those
    rows see every key in the mask (so no backend computes a softmax of nothing: NaN in some, and in the backward) and
    zero_rows writes them 0. Cached while small, in eager code only (no tensor made while tracing or capturing a
    CUDA graph is kept)."""
    key = (seq_q, seq_k, bool(causal), tuple(window), torch.device(device))
    if (type(seq_q) is int and type(seq_k) is int and seq_q * seq_k <= MAX_CACHED_MASK
            and not torch.compiler.is_compiling()
            and not (key[-1].type == "cuda" and torch.cuda.is_current_stream_capturing())):
        return _cached_mask(*key)
    return _window_mask(*key)


@lru_cache(maxsize=CACHED_MASKS)
def _cached_mask(seq_q, seq_k, causal, window, device):
    return _window_mask(seq_q, seq_k, causal, window, device)


def _window_mask(seq_q, seq_k, causal, window, device):
    left, right = window
    i = torch.arange(seq_q, device=device)[:, None]
    j = torch.arange(seq_k, device=device)[None, :]
    seen = sees(i, j, seq_q, seq_k, causal, left, right)
    empty = max(0, min(seq_q, seq_q - seq_k - right)) if right >= 0 else 0
    if empty:
        seen = seen | (i < empty)
    return seen, empty


__all__ = ["name", "attention", "window_sdpa", "math_attention", "window_mask", "zero_rows"]
