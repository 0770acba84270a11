"""Inputs and quiet calls shared by the CPU tests of the torch op (test_torch_op.py, test_torch_autograd.py, test_op_host_path.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

import evotune.torch as et


@pytest.fixture(autouse=True)
def fresh_routing(monkeypatch):
    """Each test starts with no table, no cached decisions and no notices given (autouse where a test module
    imports it)."""
    monkeypatch.delenv("EVOTUNE_TABLE", raising=False)
    et.use_table(None)
    yield
    et.use_table(None)


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
