"""Problem shapes: presets and the `--shape` spelling.

A shape is written either as a preset name (`mission`) or as
`B,H,S,D` / `B,H,Sq,Sk,D`; either may be followed by `:`-separated flags
(`fp16`, `bf16`, `causal`, `bshd`, `bhsd`, `kvN`, `softcap=C`, `window=L,R`, `sinks`), e.g.
`4,32,4096,128:bf16:causal` or `mission:bf16`. Each kind of flag (dtype, mask, layout, K/V heads, softcap, window,
sinks) may be given once.

`softcap=C` is logit soft-capping (Gemma-2's, flash-attention's `softcap`): each scaled score s becomes
C * tanh(s / C) before the softmax. `window=L,R` is sliding-window (local) attention with flash-attention's
`window_size=(left, right)`: query i sees key j iff i + d - L <= j <= i + d + R, d = Sk - Sq (bottom-right
aligned, as flash-attention aligns it); -1 is unbounded on that side. `window=L,0` is Mistral's causal sliding
window. Beside `causal` (top-left, SDPA's) it needs Sq == Sk, where the two alignments agree.

`sinks` is attention sinks (gpt-oss's `s_aux`, flash-attention's `learnable_sink`): one logit per query head, in the
units of the scaled (and capped) scores, joins every row's softmax as a column that has no value. Row i's output is
sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij)); the logits are a (H,) float32 input, not part of the shape.

`varlen=L1/L2/...` is a variable-length packed batch (flash-attention's `flash_attn_varlen_func`, `cu_seqlens_q/k`):
B sequences of those lengths packed one after another, Q as (total_q, H, D) and K, V as (total_k, Hkv, D) (token-major,
so the layout is `bshd`, implied), and attention never crosses sequences. `varlen=Q1/Q2,K1/K2` gives the keys'
lengths apart (non-causal only); `L*N` repeats a length N times (`varlen=4096/512*15`). B must be the number of
sequences and Sq (Sk) at least the longest query (key) length: they are the grid's batch axis and
flash-attention's `max_seqlen_q` (`max_seqlen_k`); `spec` writes the longest. Causal is top-left per sequence, as
the dense kernel's, and so needs equal query and key lengths per sequence (packed self-attention, where
flash-attention's bottom-right causal agrees); a length may be 0 (a sequence with queries and no keys gives rows
of 0, as flash-attention writes them).

`dv=N` is a value head dim of its own (flash-attention's `hdim_v`; DeepSeek-V2/V3's MLA prefill: Q and K of head dim
192, V and so O of 128, `1,16,4096,192:bf16:causal:dv=128`): V is (B, Hkv, Sk, N) and O (B, H, Sq, N); the softmax
scale stays 1/sqrt(D), Q's. Written (`spec`, `as_dict`) only where N differs from D, so older specs and records read
the same; `dv=D` is D.

`kvN` is grouped-query attention (SDPA's enable_gqa): N K/V heads shared by the H query heads in
groups of H/N (query head h reads K/V head h // (H/N)); N must divide H. `4,32,4096,128:kv8` is
Llama-3-8B's attention. Without the flag, or with N = H, there are as many K/V heads as query heads
and the spelling (`spec`) and `as_dict` leave it out, so older specs and records read the same.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from ..errors import UsageError

DTYPES = ("fp16", "bf16")
LAYOUTS = ("bhsd", "bshd")

# Upper bounds that keep every index kernels/attention.cu computes inside its types. Element offsets
# are 64-bit (strides are long long), but row indices are int: seq_q and seq_k are passed as int,
# and a tile's first row plus the tile (q_row0 + BLOCK_M, kv0 + BLOCK_N, up to 128 rows) must stay
# below 2^31; 2^30 leaves room for any tile. Heads and batch are the grid's y and z, which CUDA caps
# at 65535 (split-KV launches batch x kv_splits CTAs along z), and batch x heads + head is computed
# in 32 bits for the split-KV workspace, which 65535 x 65535 fits.
MAX_DIMS = {"batch": 65535, "heads": 65535, "seq_q": 2**30, "seq_k": 2**30, "head_dim": 2**30}
_WHY_MAX = {"batch": "CUDA's grid z limit", "heads": "CUDA's grid y limit",
            "seq_q": "the kernel indexes rows with 32-bit int", "seq_k": "the kernel indexes rows with 32-bit int",
            "head_dim": "the kernel indexes columns with 32-bit int"}


def check_fields(shape, max_dims: dict, too_large) -> None:
    """A shape dataclass's sizes are positive integers within `max_dims` (`too_large(name, limit)` says the limit and
    why) and its dtype and layout are known ones; one UsageError line otherwise. Attention's and the decode
    family's shapes share it."""
    for name, limit in max_dims.items():
        value = getattr(shape, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"shape: {name} must be a positive integer, got {value!r}")
        if value > limit:
            raise UsageError(f"shape: {name} {value} is too large: {too_large(name, limit)}")
    if shape.dtype not in DTYPES:
        raise UsageError(f"shape: dtype must be one of {', '.join(DTYPES)}, got {shape.dtype!r}")
    if shape.layout not in LAYOUTS:
        raise UsageError(f"shape: layout must be one of {', '.join(LAYOUTS)}, got {shape.layout!r}")


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
    kv_heads: int = 0     # K/V heads (grouped-query attention); 0 means `heads` (and becomes it)
    softcap: float = 0.0  # logit soft-capping's cap C (0: none)
    window_left: int = -1   # sliding window, flash-attention's window_size[0] (-1: unbounded)
    window_right: int = -1  # window_size[1] (-1: unbounded); both -1: no window
    sinks: bool = False     # attention sinks: a per-head logit joins each row's softmax denominator (the logits: input)
    # Variable-length packed batch: the sequences' query lengths (batch of them), and their key lengths where they
    # differ (() : the same); () without (a dense batch). seq_q / seq_k are then the longest (max_seqlen_q / _k).
    varlen: tuple = ()
    varlen_k: tuple = ()
    head_dim_v: int = 0  # V's (and O's) head dim where it differs from head_dim (MLA's 128 beside 192); 0: the same

    @property
    def dv(self) -> int:
        """V's and O's head dim: head_dim_v, or head_dim where the shape has none of its own."""
        return self.head_dim_v or self.head_dim

    @property
    def has_dv(self) -> bool:
        """Whether V's head dim differs from Q's and K's."""
        return self.head_dim_v != 0

    def __post_init__(self) -> None:
        check_fields(self, MAX_DIMS, lambda name, limit: f"at most {limit} ({_WHY_MAX[name]})")
        kv = self.kv_heads
        if not isinstance(kv, int) or isinstance(kv, bool) or kv < 0:
            raise UsageError(f"shape: kv_heads must be a positive integer, got {kv!r}")
        if kv == 0:
            object.__setattr__(self, "kv_heads", self.heads)  # one spelling of "no grouping": equal == default
        elif kv > self.heads or self.heads % kv:
            raise UsageError(f"shape: {kv} K/V heads for {self.heads} query heads: the K/V heads must divide "
                             f"the query heads (1 <= kv <= heads)")
        cap = self.softcap
        # A chained compare, not math.isfinite: torch.compile(dynamic=True) cannot trace math.isfinite even on a
        # constant, and the op checks its softcap through this rule while traced (NaN fails both compares).
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 <= cap < math.inf:
            raise UsageError(f"shape: softcap must be a finite number >= 0 (0: none), got {cap!r}")
        object.__setattr__(self, "softcap", float(cap))
        for side in ("window_left", "window_right"):
            w = getattr(self, side)
            if not isinstance(w, int) or isinstance(w, bool) or not -1 <= w <= MAX_DIMS["seq_k"]:
                raise UsageError(f"shape: {side} must be an integer from -1 (unbounded) to {MAX_DIMS['seq_k']}, "
                                 f"got {w!r}")
        if not isinstance(self.sinks, bool):
            raise UsageError(f"shape: sinks must be True or False, got {self.sinks!r}")
        dv = self.head_dim_v
        if not isinstance(dv, int) or isinstance(dv, bool) or not 0 <= dv <= MAX_DIMS["head_dim"]:
            raise UsageError(f"shape: head_dim_v must be an integer from 1 to {MAX_DIMS['head_dim']} (0: head_dim's), "
                             f"got {dv!r}")
        if dv == self.head_dim:
            object.__setattr__(self, "head_dim_v", 0)  # one spelling of "the same": equal == default
        self._check_varlen()
        if self.has_window and self.causal and self.seq_q != self.seq_k:
            raise UsageError(f"shape: causal with a window needs Sq == Sk (got {self.seq_q} and {self.seq_k}): causal is "
                             f"top-left (SDPA's) and the window bottom-right (flash-attention's); write "
                             f"window={self.window_left},0 without causal for flash-attention's causal window")

    def _check_varlen(self) -> None:
        """A varlen shape's lengths: as many as the batch, each an integer from 0 to seq_q (seq_k), at least one query
        and one key in all, the packed (token-major) layout, and under the causal mask equal query and key lengths.
        Normalises the lengths to tuples and varlen_k to () where it equals varlen."""
        if not self.varlen and not self.varlen_k:
            return
        lengths = {}
        for name in ("varlen", "varlen_k"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise UsageError(f"shape: {name} must be a sequence of lengths, got {value!r}")
            value = tuple(value)
            if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in value):
                raise UsageError(f"shape: {name}: each sequence length must be an integer >= 0")
            lengths[name] = value
        q, k = lengths["varlen"], lengths["varlen_k"] or lengths["varlen"]
        if not q:
            raise UsageError("shape: varlen_k without varlen: give the query lengths too")
        if len(q) != self.batch or len(k) != self.batch:
            raise UsageError(f"shape: varlen has {len(q)} query and {len(k)} key lengths for batch {self.batch}: "
                             f"the batch is the number of sequences")
        if max(q) > self.seq_q or max(k) > self.seq_k:
            raise UsageError(f"shape: varlen's longest sequence ({max(q)} queries, {max(k)} keys) is longer than "
                             f"Sq {self.seq_q} / Sk {self.seq_k} (max_seqlen_q / max_seqlen_k)")
        if sum(q) < 1 or sum(k) < 1:
            raise UsageError("shape: varlen needs at least one query and one key in all")
        if sum(q) > MAX_DIMS["seq_q"] or sum(k) > MAX_DIMS["seq_k"]:
            raise UsageError(f"shape: varlen's {sum(q)} queries or {sum(k)} keys in all are too many: at most "
                             f"{MAX_DIMS['seq_q']} (the kernel indexes packed rows with 32-bit int)")
        if self.causal and q != k:
            raise UsageError("shape: causal varlen needs each sequence's query and key lengths equal (the causal mask "
                             "is top-left, SDPA's; flash-attention's varlen causal is bottom-right, and the two agree "
                             "where the lengths do)")
        object.__setattr__(self, "varlen", q)
        object.__setattr__(self, "varlen_k", () if k == q else k)
        object.__setattr__(self, "layout", "bshd")  # packed sequences are token-major: (total, H, D)

    @property
    def is_varlen(self) -> bool:
        """Whether this is a variable-length packed batch (varlen)."""
        return bool(self.varlen)

    @property
    def key_lengths(self) -> tuple:
        """A varlen shape's key lengths (varlen_k, or the query lengths); () for a dense shape."""
        return self.varlen_k or self.varlen

    @property
    def total_q(self) -> int:
        """Query rows in all: the packed tensors' length (batch x seq_q for a dense shape)."""
        return sum(self.varlen) if self.varlen else self.batch * self.seq_q

    @property
    def total_k(self) -> int:
        """Key rows in all (batch x seq_k for a dense shape)."""
        return sum(self.key_lengths) if self.varlen else self.batch * self.seq_k

    def cu_seqlens(self) -> tuple[tuple, tuple]:
        """A varlen shape's (cu_seqlens_q, cu_seqlens_k): the B + 1 prefix sums of the lengths."""
        out = []
        for lengths in (self.varlen, self.key_lengths):
            acc, sums = 0, [0]
            for n in lengths:
                acc += n
                sums.append(acc)
            out.append(tuple(sums))
        return out[0], out[1]

    def sequence_shape(self, b: int) -> "Shape":
        """A varlen shape's sequence b as a dense shape of batch 1 (its lengths, the same heads, head dim, dtype, mask
        and score mods); its query and key lengths must be at least 1."""
        return Shape(1, self.heads, self.varlen[b], self.key_lengths[b], self.head_dim, self.dtype, self.causal,
                     "bshd", self.kv_heads, self.softcap, self.window_left, self.window_right, self.sinks,
                     head_dim_v=self.head_dim_v)

    def computed_sequences(self) -> list[int]:
        """The varlen sequences with at least one query and one key (the others compute nothing)."""
        return [b for b, (lq, lk) in enumerate(zip(self.varlen, self.key_lengths)) if lq and lk]

    @property
    def has_window(self) -> bool:
        """Whether a sliding window limits the keys (either side bounded)."""
        return self.window_left >= 0 or self.window_right >= 0

    @property
    def has_softcap(self) -> bool:
        return self.softcap > 0

    def key_range(self, i: int) -> tuple[int, int]:
        """[lo, hi] of the keys query row i sees (hi < lo: none), under the window and the causal mask."""
        d = self.seq_k - self.seq_q
        lo = 0 if self.window_left < 0 else max(0, i + d - self.window_left)
        hi = self.seq_k - 1 if self.window_right < 0 else min(self.seq_k - 1, i + d + self.window_right)
        if self.causal:
            hi = min(hi, i)
        return lo, hi

    def visible_pairs(self) -> int:
        """(query, key) pairs the masks leave, per (batch, head): exact, in O(1) for the dense and causal
        cases and by rows (numpy) with a window. Varlen: over all its sequences, per head."""
        if self.varlen:
            return sum(self.sequence_shape(b).visible_pairs() for b in self.computed_sequences())
        sq, sk = self.seq_q, self.seq_k
        if not self.has_window:
            if not self.causal:
                return sq * sk
            n = min(sq, sk)  # top-left: row i sees min(i + 1, sk) keys
            return n * (n + 1) // 2 + (sq - n) * sk
        import numpy as np

        i = np.arange(sq, dtype=np.int64)
        d = sk - sq
        lo = np.zeros_like(i) if self.window_left < 0 else np.maximum(0, i + d - self.window_left)
        hi = np.full_like(i, sk - 1) if self.window_right < 0 else np.minimum(sk - 1, i + d + self.window_right)
        if self.causal:
            hi = np.minimum(hi, i)
        return int(np.maximum(0, hi - lo + 1).sum())

    @property
    def kv_group(self) -> int:
        """Query heads per K/V head (1 without grouped-query attention)."""
        return self.heads // self.kv_heads

    @property
    def spec(self) -> str:
        """The canonical `--shape` spelling of this shape."""
        dims = [self.batch, self.heads, self.seq_q] + ([self.seq_k] if self.seq_k != self.seq_q else []) + [self.head_dim]
        packed = self.layout == "bshd" and not self.varlen  # varlen's token-major layout is implied
        flags = [self.dtype] + (["causal"] if self.causal else []) + (["bshd"] if packed else [])
        flags += [f"kv{self.kv_heads}"] if self.kv_heads != self.heads else []
        flags += [f"softcap={self.softcap:g}"] if self.has_softcap else []
        flags += [f"window={self.window_left},{self.window_right}"] if self.has_window else []
        flags += ["sinks"] if self.sinks else []
        flags += [f"dv={self.head_dim_v}"] if self.has_dv else []
        if self.varlen:
            flags.append("varlen=" + spell_lengths(self.varlen) + ("," + spell_lengths(self.varlen_k) if self.varlen_k
                                                                     else ""))
        return ",".join(map(str, dims)) + ":" + ":".join(flags)

    @property
    def dtype_bytes(self) -> int:
        return 2

    def flops(self) -> float:
        """Matmul FLOPs of the forward pass (2·B·H·Sq·Sk·(D + Dv): Q K^T's 2 D and P V's 2 Dv per pair; 4·B·H·Sq·Sk·D
        at one head dim), halved for causal as FlashAttention counts them; with a window, 2·B·H·(D + Dv) per (query,
        key) pair the masks leave (visible_pairs), as FlashAttention's benchmark counts local attention."""
        if self.varlen:  # each sequence's, as a dense batch of one counts it
            return sum(self.sequence_shape(b).flops() for b in self.computed_sequences())
        f = 2.0 * self.batch * self.heads * self.seq_q * self.seq_k * (self.head_dim + self.dv)
        if self.has_window:
            return 2.0 * self.batch * self.heads * (self.head_dim + self.dv) * self.visible_pairs()
        return f / 2 if self.causal else f

    def min_bytes(self) -> int:
        """Fewest bytes moved through device memory: Q, K, V read once and O written once (K and V
        once per K/V head: a group's query heads share them; V and O at V's head dim). Varlen: each sequence's."""
        if self.varlen:
            return sum(self.sequence_shape(b).min_bytes() for b in self.computed_sequences())
        q_and_o = self.batch * self.heads * self.seq_q * (self.head_dim + self.dv)
        keys = self.seq_k
        if self.has_window:  # the keys some query sees: one contiguous range (first row's lo to last row's hi)
            keys = max(0, self.key_range(self.seq_q - 1)[1] - self.key_range(0)[0] + 1)
        k_and_v = self.batch * self.kv_heads * keys * (self.head_dim + self.dv)
        return (q_and_o + k_and_v) * self.dtype_bytes

    def as_dict(self) -> dict:
        """The fields; kv_heads only where it differs from heads, head_dim_v only where it differs from head_dim (records
        without them stay as they were)."""
        d = {
            "batch": self.batch, "heads": self.heads, "seq_q": self.seq_q, "seq_k": self.seq_k,
            "head_dim": self.head_dim, "dtype": self.dtype, "causal": self.causal, "layout": self.layout,
        }
        if self.kv_heads != self.heads:
            d["kv_heads"] = self.kv_heads
        if self.has_softcap:
            d["softcap"] = self.softcap
        if self.has_window:
            d["window"] = [self.window_left, self.window_right]
        if self.sinks:
            d["sinks"] = True
        if self.varlen:
            d["varlen"] = list(self.varlen)
            if self.varlen_k:
                d["varlen_k"] = list(self.varlen_k)
        if self.has_dv:
            d["head_dim_v"] = self.head_dim_v
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Shape":
        fields = {k: d[k] for k in ("batch", "heads", "seq_q", "seq_k", "head_dim", "dtype", "causal", "layout")}
        window = d.get("window") or (-1, -1)
        return cls(**fields, kv_heads=d.get("kv_heads") or 0, softcap=d.get("softcap") or 0.0,
                   window_left=int(window[0]), window_right=int(window[1]), sinks=d.get("sinks") is True,
                   varlen=tuple(d.get("varlen") or ()), varlen_k=tuple(d.get("varlen_k") or ()),
                   head_dim_v=d.get("head_dim_v") or 0)


PRESETS: dict[str, tuple[Shape, str]] = {
    "mission": (Shape(1, 8, 512, 512, 64), "the product's target: small, launch-bound"),
    "gpt2": (Shape(16, 12, 1024, 1024, 64), "GPT-2-like block, d64"),
    "gpt2-causal": (Shape(16, 12, 1024, 1024, 64, causal=True), "GPT-2-like block, causal"),
    "llama-4k": (Shape(4, 32, 4096, 4096, 128), "Llama-like d128 at 4k"),
    "llama-4k-causal": (Shape(4, 32, 4096, 4096, 128, causal=True), "Llama-like d128 at 4k, causal"),
    "long-8k": (Shape(2, 16, 8192, 8192, 64), "long sequence, d64"),
    "long-16k-causal": (Shape(1, 16, 16384, 16384, 128, causal=True), "long causal 16k, d128"),
}

_DIMS = re.compile(r"^\s*[0-9]+(\s*,\s*[0-9]+){3,4}\s*$")
_FLAG_KINDS = {**{d: "dtype" for d in DTYPES}, "causal": "causal", **{lay: "layout" for lay in LAYOUTS},
               "sinks": "sinks"}
_VARLEN_FLAG = re.compile(r"^varlen=")    # varlen=L1/L2/... or varlen=Q1/Q2/...,K1/K2/... (L*N: N times)
_LENGTH = re.compile(r"^\s*([0-9]+)\s*(?:\*\s*([0-9]+)\s*)?$")
MAX_SEQUENCES = MAX_DIMS["batch"]  # the grid's z (one per sequence)
_KV_FLAG = re.compile(r"^kv([0-9]+)$")  # kvN: N K/V heads (grouped-query attention)
_SOFTCAP_FLAG = re.compile(r"^softcap=")  # softcap=C; the value is read (and refused) by _parse_flags
_WINDOW_FLAG = re.compile(r"^window=")    # window=L,R
_DV_FLAG = re.compile(r"^dv=")            # dv=N: V's head dim
_WINDOW_VALUE = re.compile(r"^\s*(-1|[0-9]+)\s*,\s*(-1|[0-9]+)\s*$")
_MAX_DIGITS = 12  # far above any bound in MAX_DIMS; stops int() on thousands of digits


def parse_shape(text: str) -> Shape:
    """Turn a preset name or a `B,H,S,D[:flags]` spelling into a Shape, or raise UsageError."""
    if text is None or not str(text).strip():
        raise UsageError("shape: empty; give a preset (see `evotune shapes`) or B,H,S,D")
    text = str(text).strip()
    if text in PRESETS:
        return PRESETS[text][0]
    dims_part, *flag_texts = text.split(":")
    fields = _parse_flags(flag_texts, text)
    name = dims_part.strip()
    if name in PRESETS:  # a preset with flags, e.g. mission:bf16: the flags override its own
        p = PRESETS[name][0]
        return Shape(p.batch, p.heads, p.seq_q, p.seq_k, p.head_dim,
                     **{"dtype": p.dtype, "causal": p.causal, "layout": p.layout, "kv_heads": p.kv_heads,
                        "softcap": p.softcap, "window_left": p.window_left, "window_right": p.window_right,
                        "sinks": p.sinks, "head_dim_v": p.head_dim_v, **fields})
    if not _DIMS.match(dims_part):
        if re.match(r"^[A-Za-z][\w-]*$", name):
            raise UsageError(f"shape: unknown preset {_shown(name)}; presets: {', '.join(PRESETS)}")
        raise UsageError(
            f"shape: cannot read {_shown(text)}; write B,H,S,D or B,H,Sq,Sk,D with optional "
            f":fp16|:bf16|:causal|:bshd|:kvN|:softcap=C|:window=L,R|:sinks|:varlen=L1/L2/...|:dv=N"
        )
    dims = _parse_dims(dims_part.split(","))
    b, h, sq, sk, d = (dims[0], dims[1], dims[2], dims[2], dims[3]) if len(dims) == 4 else dims
    if "varlen" in fields:
        q, k = fields["varlen"], fields.get("varlen_k") or fields["varlen"]
        if fields.get("layout") == "bhsd":
            raise UsageError(f"shape: {_shown(text)}: varlen's packed sequences are token-major (total, H, D); "
                             f"leave out :bhsd")
        if b != len(q) or sq < max(q) or sk < max(k):
            right = f"{len(q)},{h},{max(q)}" + (f",{max(k)}" if max(k) != max(q) else "") + f",{d}"
            raise UsageError(f"shape: {_shown(text)}: with varlen, B is the number of sequences and Sq, Sk at least "
                             f"the longest (max_seqlen): write {right}:...")
    return Shape(b, h, sq, sk, d, **fields)


def _shown(text: str, limit: int = 60) -> str:
    """`text` quoted for a message, cut short when long (an error stays one short line)."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def _parse_dims(texts: list[str]) -> list[int]:
    names = ("batch", "heads", "seq_q", "head_dim") if len(texts) == 4 else tuple(MAX_DIMS)
    return [parse_dim(t, name, MAX_DIMS[name], _WHY_MAX[name]) for name, t in zip(names, texts)]


def parse_dim(digits: str, name: str, limit: int, why: str) -> int:
    """A dimension from its decimal digits (already matched as digits); UsageError, before int() is tried,
    when it has more digits than any bound (Python refuses int() of over 4300 digits with a ValueError)."""
    digits = digits.strip()
    if len(digits.lstrip("0")) > _MAX_DIGITS:
        raise UsageError(f"shape: {name} has {len(digits)} digits: too large: at most {limit} ({why})")
    return int(digits)


def parse_flags(flag_texts: list[str], kinds: dict[str, str], text: str,
                patterns: tuple[tuple[re.Pattern, str, str], ...] = ()) -> dict[str, str]:
    """kind -> flag for the `:`-separated flags of `text`; `kinds` maps each flag (lower case) to its kind,
    `patterns` holds (regex, kind, how it is written) for flags that carry a value (`kv8`). A flag not in
    `kinds` nor matching a pattern, and a kind given twice, are UsageErrors: the last one does not silently win."""
    given: dict[str, str] = {}
    for flag in (f.strip().lower() for f in flag_texts):
        kind = kinds.get(flag)
        if kind is None:
            kind = next((k for pattern, k, _ in patterns if pattern.match(flag)), None)
        if kind is None:
            known = ", ".join([*kinds, *(spelled for _, _, spelled in patterns)])
            raise UsageError(f"shape: unknown flag {_shown(flag, 20)} in {_shown(text)}; flags: {known}")
        if kind in given:
            said = "repeats" if given[kind] == flag else "conflicts with"
            every = dict.fromkeys([*kinds.values(), *(k for _, k, _ in patterns)])
            raise UsageError(f"shape: flag {flag!r} {said} {given[kind]!r} in {_shown(text)}: give each of "
                             f"{', '.join(every)} once")
        given[kind] = flag
    return given


def _parse_flags(flag_texts: list[str], text: str) -> dict:
    """Shape fields from the `:`-separated flags (each kind is the Shape field it sets)."""
    given = parse_flags(flag_texts, _FLAG_KINDS, text, ((_KV_FLAG, "kv_heads", "kvN"),
                                                        (_SOFTCAP_FLAG, "softcap", "softcap=C"),
                                                        (_WINDOW_FLAG, "window", "window=L,R"),
                                                        (_VARLEN_FLAG, "varlen", "varlen=L1/L2/..."),
                                                        (_DV_FLAG, "head_dim_v", "dv=N")))
    fields: dict = {kind: True if kind in ("causal", "sinks") else flag for kind, flag in given.items()}
    if "softcap" in fields:
        value = fields["softcap"].split("=", 1)[1].strip()
        try:
            cap = float(value) if len(value) <= 32 else math.nan
        except ValueError:
            cap = math.nan
        if not math.isfinite(cap) or cap <= 0:
            raise UsageError(f"shape: {_shown(fields['softcap'], 40)} in {_shown(text)}: softcap=C needs a finite C > 0 "
                             f"(e.g. softcap=30.0, Gemma-2's)")
        fields["softcap"] = cap
    if "window" in fields:
        m = _WINDOW_VALUE.match(fields["window"].split("=", 1)[1])
        if not m or len(m.group(1)) > _MAX_DIGITS or len(m.group(2)) > _MAX_DIGITS:
            raise UsageError(f"shape: {_shown(fields['window'], 40)} in {_shown(text)}: write window=L,R with L, R "
                             f"keys to the left and right (integers >= 0, or -1: unbounded), e.g. window=4096,0")
        del fields["window"]
        fields["window_left"], fields["window_right"] = int(m.group(1)), int(m.group(2))
    if "varlen" in fields:
        parts = fields["varlen"].split("=", 1)[1].split(",")
        if len(parts) > 2:
            raise UsageError(f"shape: {_shown(fields['varlen'], 40)} in {_shown(text)}: write varlen=L1/L2/... (or "
                             f"Q1/Q2/...,K1/K2/... for keys of other lengths)")
        lists = [_parse_lengths(p, text) for p in parts]
        fields["varlen"] = lists[0]
        if len(lists) == 2:
            if len(lists[1]) != len(lists[0]):
                raise UsageError(f"shape: {_shown(text)}: varlen gives {len(lists[0])} query and {len(lists[1])} key "
                                 f"lengths: one of each per sequence")
            fields["varlen_k"] = lists[1]
    if "head_dim_v" in fields:
        digits = fields["head_dim_v"].split("=", 1)[1].strip()
        if not digits.isdigit() or int(digits[:_MAX_DIGITS + 1]) < 1:
            raise UsageError(f"shape: {_shown(fields['head_dim_v'], 40)} in {_shown(text)}: write dv=N with N V's head "
                             f"dim, a positive integer (e.g. dv=128, DeepSeek MLA's beside head dim 192)")
        fields["head_dim_v"] = parse_dim(digits, "head_dim_v", MAX_DIMS["head_dim"], _WHY_MAX["head_dim"])
    if "kv_heads" in fields:
        digits = _KV_FLAG.match(fields["kv_heads"]).group(1)
        kv = parse_dim(digits, "kv_heads", MAX_DIMS["heads"], _WHY_MAX["heads"])
        if kv < 1:
            raise UsageError(f"shape: {fields['kv_heads']!r} in {_shown(text)}: at least one K/V head")
        fields["kv_heads"] = kv
    return fields


def _parse_lengths(part: str, text: str) -> tuple:
    """A `/`-separated list of sequence lengths, each `L` or `L*N` (N copies); UsageError otherwise."""
    lengths: list[int] = []
    for item in part.split("/"):
        m = _LENGTH.match(item)
        if not m or len(m.group(1)) > _MAX_DIGITS or (m.group(2) and len(m.group(2)) > _MAX_DIGITS):
            raise UsageError(f"shape: varlen length {_shown(item, 20)} in {_shown(text)}: write lengths as integers "
                             f">= 0 separated by '/', L*N for N sequences of L (e.g. varlen=4096/512*15)")
        n = int(m.group(2)) if m.group(2) else 1
        if n < 1 or len(lengths) + n > MAX_SEQUENCES:
            raise UsageError(f"shape: varlen in {_shown(text)}: 1 to {MAX_SEQUENCES} sequences (CUDA's grid z limit)")
        lengths += [int(m.group(1))] * n
    return tuple(lengths)


def spell_lengths(lengths) -> str:
    """Sequence lengths as `varlen=` writes them: runs of one length as L*N."""
    items, i = [], 0
    while i < len(lengths):
        j = i
        while j + 1 < len(lengths) and lengths[j + 1] == lengths[i]:
            j += 1
        n = j - i + 1
        items.append(f"{lengths[i]}*{n}" if n > 1 else str(lengths[i]))
        i = j + 1
    return "/".join(items)


def with_dtype(shape: Shape, dtype: str) -> Shape:
    return replace(shape, dtype=dtype)
