"""What the attention kernel can do: the features the op asks about before it routes a call to the kernel.
A module of its own so that call.py (argument checks) and kernels.py (the kernel cache) both read it without
importing each other."""

from __future__ import annotations

from ..errors import UsageError

FEATURES = ("gqa", "lse")
# Features the kernel lacks today, and why: the op routes such calls per its fallback policy, saying
# this. When kernels/attention.cu grows a feature, its entry goes (and the op's path for it with it).
# "gqa": both variants read K/V head h // (heads / kv_heads) through the kv_magic launch argument, never
# a per-query-head copy of K/V. "lse": an instantiation asked for it (write_lse) also writes each row's
# log-sum-exp, which the op's autograd hands to PyTorch's attention backward.
MISSING_FEATURES: dict[str, str] = {}


def supports(feature: str) -> bool:
    """Whether the attention kernel supports `feature` ("gqa", "lse")."""
    if feature not in FEATURES:
        raise UsageError(f"unknown kernel feature {feature!r}; features: {', '.join(FEATURES)}")
    return feature not in MISSING_FEATURES


def unsupported(feature: str) -> str:
    """Why the kernel does not support `feature` (empty where it does)."""
    return "" if supports(feature) else MISSING_FEATURES[feature]
