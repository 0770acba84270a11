"""Problem shapes: presets and the `--shape` spelling.

A shape is written either as a preset name (`mission`) or as
`B,H,S,D` / `B,H,Sq,Sk,D`; either may be followed by `:`-separated flags
(`fp16`, `bf16`, `causal`, `bshd`, `bhsd`), e.g. `4,32,4096,128:bf16:causal`
or `mission:bf16`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from .errors import UsageError

DTYPES = ("fp16", "bf16")
LAYOUTS = ("bhsd", "bshd")


@dataclass(frozen=True)
class Shape:
    """One attention problem size: (batch, heads, seq_q, seq_k, head_dim) plus dtype, mask, layout."""

    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    dtype: str = "fp16"
    causal: bool = False
    layout: str = "bhsd"

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "seq_q", "seq_k", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"shape: {name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPES:
            raise UsageError(f"shape: dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.layout not in LAYOUTS:
            raise UsageError(f"shape: layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")

    @property
    def spec(self) -> str:
        """The canonical `--shape` spelling of this shape."""
        dims = [self.batch, self.heads, self.seq_q] + ([self.seq_k] if self.seq_k != self.seq_q else []) + [self.head_dim]
        flags = [self.dtype] + (["causal"] if self.causal else []) + (["bshd"] if self.layout == "bshd" else [])
        return ",".join(map(str, dims)) + ":" + ":".join(flags)

    @property
    def dtype_bytes(self) -> int:
        return 2

    def flops(self) -> float:
        """Matmul FLOPs of the forward pass (4·B·H·Sq·Sk·D), halved for causal as FlashAttention counts them."""
        f = 4.0 * self.batch * self.heads * self.seq_q * self.seq_k * self.head_dim
        return f / 2 if self.causal else f

    def min_bytes(self) -> int:
        """Fewest bytes moved through device memory: Q, K, V read once and O written once."""
        q_and_o = 2 * self.batch * self.heads * self.seq_q * self.head_dim
        k_and_v = 2 * self.batch * self.heads * self.seq_k * self.head_dim
        return (q_and_o + k_and_v) * self.dtype_bytes

    def as_dict(self) -> dict:
        return {
            "batch": self.batch, "heads": self.heads, "seq_q": self.seq_q, "seq_k": self.seq_k,
            "head_dim": self.head_dim, "dtype": self.dtype, "causal": self.causal, "layout": self.layout,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Shape":
        return cls(**{k: d[k] for k in ("batch", "heads", "seq_q", "seq_k", "head_dim", "dtype", "causal", "layout")})


PRESETS: dict[str, tuple[Shape, str]] = {
    "mission": (Shape(1, 8, 512, 512, 64), "the product's target: small, launch-bound"),
    "gpt2": (Shape(16, 12, 1024, 1024, 64), "GPT-2-like block, d64"),
    "gpt2-causal": (Shape(16, 12, 1024, 1024, 64, causal=True), "GPT-2-like block, causal"),
    "llama-4k": (Shape(4, 32, 4096, 4096, 128), "Llama-like d128 at 4k"),
    "llama-4k-causal": (Shape(4, 32, 4096, 4096, 128, causal=True), "Llama-like d128 at 4k, causal"),
    "long-8k": (Shape(2, 16, 8192, 8192, 64), "long sequence, d64"),
    "long-16k-causal": (Shape(1, 16, 16384, 16384, 128, causal=True), "long causal 16k, d128"),
}

_DIMS = re.compile(r"^\s*\d+(\s*,\s*\d+){3,4}\s*$")


def parse_shape(text: str) -> Shape:
    """Turn a preset name or a `B,H,S,D[:flags]` spelling into a Shape, or raise UsageError."""
    if text is None or not str(text).strip():
        raise UsageError("shape: empty; give a preset (see `evotune shapes`) or B,H,S,D")
    text = str(text).strip()
    if text in PRESETS:
        return PRESETS[text][0]
    dims_part, *flags = text.split(":")
    if dims_part.strip() in PRESETS:  # a preset with flags, e.g. mission:bf16
        p = PRESETS[dims_part.strip()][0]
        dims_part = f"{p.batch},{p.heads},{p.seq_q},{p.seq_k},{p.head_dim}"
        flags = [p.dtype] + (["causal"] if p.causal else []) + [p.layout] + flags
    if not _DIMS.match(dims_part):
        if re.match(r"^[A-Za-z][\w-]*$", dims_part.strip()):
            raise UsageError(f"shape: unknown preset {dims_part.strip()!r}; presets: {', '.join(PRESETS)}")
        raise UsageError(
            f"shape: cannot read {text!r}; write B,H,S,D or B,H,Sq,Sk,D with optional :fp16|:bf16|:causal|:bshd"
        )
    dims = [int(x) for x in dims_part.split(",")]
    if len(dims) == 4:
        b, h, s, d = dims
        sq = sk = s
    else:
        b, h, sq, sk, d = dims
    dtype, causal, layout = "fp16", False, "bhsd"
    for flag in (f.strip().lower() for f in flags):
        if flag in DTYPES:
            dtype = flag
        elif flag == "causal":
            causal = True
        elif flag in LAYOUTS:
            layout = flag
        else:
            raise UsageError(f"shape: unknown flag {flag!r} in {text!r}; flags: fp16, bf16, causal, bshd")
    return Shape(b, h, sq, sk, d, dtype=dtype, causal=causal, layout=layout)


def with_dtype(shape: Shape, dtype: str) -> Shape:
    return replace(shape, dtype=dtype)
