"""Inputs and quiet calls shared by the CPU tests of the torch op (test_torch_op.py, test_torch_autograd.py)."""

from __future__ import annotations

import warnings

import torch

import evotune.torch as et


def qkv(b=2, h=4, sq=16, sk=24, d=64, dtype=torch.bfloat16, layout="bhsd", device="cpu", kv_heads=None,
        seed=0, grad=False):
    """q, k, v of (b, h, s, d) (a bshd layout is a transposed view), drawn in fp32 from one seeded generator, then
    cast; k and v have `kv_heads` heads (default h); with `grad` they require gradients."""
    gen = torch.Generator().manual_seed(seed)

    def one(s, heads):
        t = torch.randn(b, s, heads, d, generator=gen).to(dtype).transpose(1, 2) if layout == "bshd" \
            else torch.randn(b, heads, s, d, generator=gen).to(dtype)
        return t.to(device).requires_grad_(grad)

    return one(sq, h), one(sk, kv_heads or h), one(sk, kv_heads or h)


def quiet(fn, *args, **kwargs):
    """fn(*args, **kwargs) without the op's fallback notices."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", et.EvotuneFallbackWarning)
        return fn(*args, **kwargs)
