"""The decode attention family: kernels/attention_decode.cu against PyTorch SDPA (enable_gqa).

A few queries (Sq 1 to 16: a decode step, or a short chunk of a cached prefill) over a KV cache of Sk keys
with grouped-query attention: split-KV across CTAs with the combine in the last CTA of each (batch, K/V
head), and the query heads of one K/V head packed into one CTA (FA3's PackGQA). Causal is bottom-right
aligned, as a KV cache's mask is: query i sees keys 0 .. Sk - Sq + i.

A shape is written `B,Hq,Hkv,Sk,D` (one query: a decode step) or `B,Hq,Hkv,Sq,Sk,D`, optionally followed by
`:fp16|:bf16`, `:bhsd|:bshd` (the memory layout of Q, K, V and O) and `:causal`, or a preset name, e.g.
`1,32,8,16384,128:bf16` (a Llama-3-8B decode step at 16k context).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from ..build.template import inline_includes
from ..errors import UsageError
from ..limits import launch_asserts
from .shapes import check_fields, parse_dim, parse_flags
from ..space.searchspace import DEVICE_CONTEXT_NAMES, device_context
from . import LaunchGeometry, Problem, aim_key, knob_reader

DTYPES = ("fp16", "bf16")
LAYOUTS = ("bhsd", "bshd")
HEAD_DIMS = (64, 96, 128, 256)


def lane_dim(head_dim: int) -> int:
    """The columns a key's lanes cover (DecodeTraits::kLaneDim): a power-of-two lane group, so head dim 96 takes the
    lanes of 128, those past 96 idle."""
    return 128 if head_dim == 96 else head_dim
MAX_SEQ_Q = 16   # kernels/attention_decode.cu DecodeTraits: SEQ_Q
MAX_ROWS = 16    # ... GROUP * SEQ_Q rows in one CTA (their Q and O slices live in registers)
# Grid y (K/V heads) and z (batch) are CUDA's 65535 at most; keys are 32-bit ints in the kernel.
MAX_DIMS = {"batch": 65535, "heads": 65535, "kv_heads": 65535, "seq_q": MAX_SEQ_Q, "seq_k": 2**30, "head_dim": 256}

# The value a knob takes when a (reduced) search space does not list it.
KNOB_DEFAULTS = {"warps": 4, "vec": 8, "unroll": 2, "stages": 2, "splits": 1, "kv_load": "cp_async",
                 "combine": "fenced", "split_chunks": "ceil"}
# The knobs of kernels/decode/variants.cuh: knob -> (DecodeVariantTraits' template parameter, each value's enum
# constant there), the default first. A config with all of them at their defaults instantiates attention_decode.cu's
# own kernel, as before they existed.
VARIANT_KNOBS = {
    "kv_load": ("KV_LOAD", {"cp_async": "kLoadCpAsync", "bulk": "kLoadBulk"}),
    "combine": ("COMBINE", {"fenced": "kCombineFenced", "acq_rel": "kCombineAcqRel"}),
    "split_chunks": ("CHUNKS", {"ceil": "kChunksCeil", "even": "kChunksEven"}),
}

# The values each knob may take: what DecodeTraits' static_asserts accept for it alone.
KNOB_DOMAINS = {
    "warps": range(1, 17),
    "vec": (4, 8),
    "unroll": range(1, 17),
    "stages": range(1, 9),
    "splits": range(1, 257),
    **{name: tuple(enums) for name, (_, enums) in VARIANT_KNOBS.items()},
}

CONTEXT_NAMES = ("batch", "heads", "kv_heads", "group", "seq_q", "seq_k", "head_dim", "rows", "dtype",
                 "dtype_bytes", "causal") + DEVICE_CONTEXT_NAMES

# The attention family's gate: O is a convex combination of V's rows, the same error budget per element.
TOLERANCE = {"fp16": (1e-3, 4e-3), "bf16": (8e-3, 3e-2)}  # (atol, rtol)


knob = knob_reader(KNOB_DEFAULTS)


def is_variant(config) -> bool:
    """Whether `config` sets a knob of kernels/decode/variants.cuh off its default (else attention_decode.cu's kernel)."""
    return any(knob(config, name) != next(iter(enums)) for name, (_, enums) in VARIANT_KNOBS.items())


def block_threads(config) -> int:
    """Threads of a CTA: the consumer warps, and kv_load = bulk's producer warp."""
    return 32 * (int(knob(config, "warps")) + (1 if knob(config, "kv_load") == "bulk" else 0))


@dataclass(frozen=True)
class DecodeShape:
    """One decode problem: `seq_q` queries of `heads` query heads over `seq_k` cached keys of `kv_heads` K/V heads."""

    batch: int
    heads: int
    kv_heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    dtype: str = "fp16"
    layout: str = "bhsd"
    causal: bool = False

    def __post_init__(self) -> None:
        check_fields(self, MAX_DIMS, lambda name, limit: f"at most {limit} for the decode kernel")
        if self.heads % self.kv_heads:
            raise UsageError(f"shape: {self.kv_heads} K/V heads for {self.heads} query heads: the K/V heads must "
                             f"divide the query heads")
        if self.seq_q > self.seq_k:
            raise UsageError(f"shape: {self.seq_q} queries over {self.seq_k} keys: a KV cache holds at least the "
                             f"queries' own keys (Sq <= Sk)")

    @property
    def group(self) -> int:
        """Query heads per K/V head."""
        return self.heads // self.kv_heads

    @property
    def rows(self) -> int:
        """Rows one CTA serves: the group's query heads times the queries (PackGQA)."""
        return self.group * self.seq_q

    @property
    def spec(self) -> str:
        dims = [self.batch, self.heads, self.kv_heads] + ([self.seq_q] if self.seq_q != 1 else []) + [self.seq_k,
                                                                                                       self.head_dim]
        flags = [self.dtype] + (["bshd"] if self.layout == "bshd" else []) + (["causal"] if self.causal else [])
        return ",".join(map(str, dims)) + ":" + ":".join(flags)

    @property
    def dtype_bytes(self) -> int:
        return 2

    def flops(self) -> float:
        """Matmul FLOPs (4·D per visible query-key pair and query head); bottom-right causal hides Sq(Sq-1)/2 pairs."""
        pairs = self.seq_q * self.seq_k - (self.seq_q * (self.seq_q - 1) // 2 if self.causal else 0)
        return 4.0 * self.batch * self.heads * pairs * self.head_dim

    def min_bytes(self) -> int:
        """Fewest bytes moved through device memory: K and V read once per K/V head, Q read and O written once."""
        kv = 2 * self.batch * self.kv_heads * self.seq_k * self.head_dim
        qo = 2 * self.batch * self.heads * self.seq_q * self.head_dim
        return (kv + qo) * self.dtype_bytes

    def as_dict(self) -> dict:
        return {"batch": self.batch, "heads": self.heads, "kv_heads": self.kv_heads, "seq_q": self.seq_q,
                "seq_k": self.seq_k, "head_dim": self.head_dim, "dtype": self.dtype, "layout": self.layout,
                "causal": self.causal}

    @classmethod
    def from_dict(cls, d: dict) -> "DecodeShape":
        return cls(**{k: d[k] for k in ("batch", "heads", "kv_heads", "seq_q", "seq_k", "head_dim", "dtype",
                                        "layout", "causal")})


PRESETS: dict[str, tuple[DecodeShape, str]] = {
    "llama8b-decode-2k": (DecodeShape(1, 32, 8, 1, 2048, 128, "bf16"), "Llama-3-8B decode step, 2k context"),
    "llama8b-decode-16k": (DecodeShape(1, 32, 8, 1, 16384, 128, "bf16"), "Llama-3-8B decode step, 16k context"),
    "llama8b-decode-b8": (DecodeShape(8, 32, 8, 1, 2048, 128, "bf16"), "batch 8 of decode steps at 2k"),
    "mqa-decode-4k": (DecodeShape(1, 8, 1, 1, 4096, 128, "bf16"), "multi-query (8 heads, 1 K/V head) at 4k"),
    "gpt2-decode-1k": (DecodeShape(1, 12, 12, 1, 1024, 64), "GPT-2 decode step (no grouping), d64"),
    "llama8b-chunk4": (DecodeShape(1, 32, 8, 4, 2048, 128, "bf16", causal=True),
                       "4 queries over a 2k cache, bottom-right causal (speculative / chunked)"),
}

_DIMS = re.compile(r"^\s*[0-9]+(\s*,\s*[0-9]+){4,5}\s*$")
_FLAGS = {**{d: "dtype" for d in DTYPES}, **{lay: "layout" for lay in LAYOUTS}, "causal": "causal"}


def parse_shape(text: str) -> DecodeShape:
    """A preset name or `B,Hq,Hkv,[Sq,]Sk,D[:flags]` as a DecodeShape, or UsageError."""
    if text is None or not str(text).strip():
        raise UsageError("shape: empty; give a preset (see `evotune shapes --family attention-decode`) or B,Hq,Hkv,Sk,D")
    text = str(text).strip()
    dims_part, *flag_texts = text.split(":")
    given = parse_flags(flag_texts, _FLAGS, text)
    fields = {kind: (True if kind == "causal" else flag) for kind, flag in given.items()}
    name = dims_part.strip()
    if name in PRESETS:
        return replace(PRESETS[name][0], **fields)
    if not _DIMS.match(dims_part):
        if re.match(r"^[A-Za-z][\w-]*$", name):
            raise UsageError(f"shape: unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        raise UsageError(f"shape: cannot read {text[:60]!r}; write B,Hq,Hkv,Sk,D or B,Hq,Hkv,Sq,Sk,D with optional "
                         f":fp16|:bf16|:bshd|:causal")
    texts = dims_part.split(",")
    names = ("batch", "heads", "kv_heads", "seq_k", "head_dim") if len(texts) == 5 else tuple(MAX_DIMS)
    dims = {n: parse_dim(t, n, MAX_DIMS[n], "the decode kernel's limit") for n, t in zip(names, texts)}
    dims.setdefault("seq_q", 1)
    return DecodeShape(**dims, **fields)


class DecodeProblem(Problem):
    family = "attention-decode"
    kernel_file = "attention_decode.cu"
    entry_name = "evotune_decode"
    default_space = "attention-decode"
    default_shape = "llama8b-decode-2k"
    title = "decode attention kernel"
    context_names = CONTEXT_NAMES
    perturbed = "key"
    baseline_kind = "SDPA"
    rate_unit = "GB/s"
    knob_abbrev = {"warps": "w", "vec": "v", "unroll": "u", "stages": "st", "splits": "split", "kv_load": "load-",
                   "combine": "combine-", "split_chunks": "chunks-"}
    # kv_load, combine and split_chunks came after the recorded runs; at cp_async, fenced and ceil the source is
    # attention_decode.cu's as it was (the variants' header is not appended).
    late_knobs = {name: next(iter(enums)) for name, (_, enums) in VARIANT_KNOBS.items()}
    # The batch and the cache length are amounts of K/V traffic: a good start for each other (the split count
    # is re-searched anyway); the group, queries, head dim, dtype, layout and mask change the code.
    size_fields = frozenset({"batch", "seq_k"})

    # ------------------------------------------------------------ shapes
    def parse_shape(self, text: str) -> DecodeShape:
        return parse_shape(text)

    def shape_from_dict(self, d: dict) -> DecodeShape:
        return DecodeShape.from_dict(d)

    def presets(self) -> dict:
        return dict(PRESETS)

    def shape_columns(self, shape: DecodeShape) -> dict:
        return {"B": str(shape.batch), "Hq": str(shape.heads), "Hkv": str(shape.kv_heads), "Sq": str(shape.seq_q),
                "Sk": str(shape.seq_k), "D": str(shape.head_dim), "dtype": shape.dtype,
                "causal": "yes" if shape.causal else "no"}

    def describe_shape(self, shape: DecodeShape) -> str:
        return (f"B={shape.batch} Hq={shape.heads} Hkv={shape.kv_heads} Sq={shape.seq_q} Sk={shape.seq_k} "
                f"D={shape.head_dim}{' causal (bottom-right)' if shape.causal else ''}")

    def sanitize_shape(self, shape: DecodeShape) -> DecodeShape:
        """Two K/V heads of the same group, a ragged short cache: a head-group index off by one shows."""
        return replace(shape, batch=1, heads=2 * shape.group, kv_heads=2, seq_k=max(shape.seq_q, 301))

    def check_shape(self, shape: DecodeShape) -> None:
        if not isinstance(shape, DecodeShape):
            raise UsageError(f"attention-decode: not a decode shape: {shape!r}")
        if shape.head_dim not in HEAD_DIMS:
            raise UsageError(f"attention-decode: head_dim {shape.head_dim} is not supported "
                             f"({', '.join(map(str, HEAD_DIMS[:-1]))} or {HEAD_DIMS[-1]})")
        if shape.rows > MAX_ROWS:
            raise UsageError(f"attention-decode: {shape.group} query heads per K/V head x {shape.seq_q} queries = "
                             f"{shape.rows} rows; one CTA packs at most {MAX_ROWS}")

    def context(self, shape: DecodeShape) -> dict:
        return {"batch": shape.batch, "heads": shape.heads, "kv_heads": shape.kv_heads, "group": shape.group,
                "seq_q": shape.seq_q, "seq_k": shape.seq_k, "head_dim": shape.head_dim, "rows": shape.rows,
                "dtype": shape.dtype, "dtype_bytes": shape.dtype_bytes, "causal": shape.causal, **device_context()}

    def knob_domains(self) -> dict:
        return KNOB_DOMAINS

    def rate(self, shape: DecodeShape, time_us: float) -> float:
        return shape.min_bytes() / time_us / 1e3  # GB/s

    # ------------------------------------------------------------ code
    def block_n(self, config, shape: DecodeShape) -> int:
        """Keys per tile: key groups (warps x 32 / (lane_dim / vec)) x unroll."""
        lanes_per_key = lane_dim(shape.head_dim) // int(knob(config, "vec"))
        return int(knob(config, "warps")) * (32 // lanes_per_key) * int(knob(config, "unroll"))

    def smem_bytes(self, config, shape: DecodeShape) -> int:
        """DecodeTraits::kSmemBytes: the cp.async ring, or the group merge that reuses it, whichever is larger."""
        groups = self.block_n(config, shape) // int(knob(config, "unroll"))
        ring = int(knob(config, "stages")) * 2 * self.block_n(config, shape) * shape.head_dim * 2
        return max(ring, groups * shape.rows * (2 + shape.head_dim) * 4)

    def template_args(self, config, shape: DecodeShape) -> list[tuple[str, object]]:
        return [
            ("HEAD_DIM", shape.head_dim),
            ("GROUP", shape.group),
            ("SEQ_Q", shape.seq_q),
            ("WARPS", int(knob(config, "warps"))),
            ("VEC", int(knob(config, "vec"))),
            ("UNROLL", int(knob(config, "unroll"))),
            ("STAGES", int(knob(config, "stages"))),
            ("SPLITS", int(knob(config, "splits"))),
            ("IS_BF16", "true" if shape.dtype == "bf16" else "false"),
            ("CAUSAL", "true" if shape.causal else "false"),
        ] + ([(param, "evotune::" + enums[knob(config, name)]) for name, (param, enums) in VARIANT_KNOBS.items()]
             if is_variant(config) else [])

    def instantiation(self, config, shape: DecodeShape) -> str:
        """The entry point; a config with a knob of kernels/decode/variants.cuh off its default gets that header
        (inlined) ahead of it and calls its decode_attention_variant (traits DecodeVariantTraits)."""
        targs = ",\n    ".join(f"/* {name} = */ {value}" for name, value in self.template_args(config, shape))
        geo = self.geometry(config, shape)
        asserts = launch_asserts(geo.threads, geo.dynamic_smem, ("kRows", shape.rows))
        if is_variant(config):
            pieces = inline_includes('#include "decode/variants.cuh"\n', (self.kernel_file,))
            return pieces + self._entry("DecodeVariantTraits", "decode_attention_variant", targs, asserts)
        return self._entry("DecodeTraits", "decode_attention", targs, asserts)

    def _entry(self, traits: str, body: str, targs: str, asserts: str) -> str:
        return f"""using EvotuneTraits = evotune::{traits}<
    {targs}>;
{asserts}
// Launch: grid (SPLITS, kv_heads, batch), block (EvotuneTraits::kThreads), dynamic shared memory
// EvotuneTraits::kSmemBytes. Pointers are fp16/bf16 bit patterns; strides are in elements (b = batch,
// h = head, s = sequence; the head-dim stride is 1), rows 16-byte aligned. q and o hold kv_heads * GROUP query
// heads. With SPLITS > 1: ws_o (batch * kv_heads * SPLITS * ROWS * HEAD_DIM fp32), ws_ml (... * ROWS * 2 fp32)
// and ws_count (batch * kv_heads int32, zeroed once; the kernel leaves it zero); null otherwise.
extern "C" __global__ void __launch_bounds__(EvotuneTraits::kThreads)
{self.entry_name}(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
               const unsigned short* __restrict__ v, unsigned short* __restrict__ o,
               long long q_sb, long long q_sh, long long q_ss, long long k_sb, long long k_sh, long long k_ss,
               long long v_sb, long long v_sh, long long v_ss, long long o_sb, long long o_sh, long long o_ss,
               int seq_k, float scale_log2, float* ws_o, float* ws_ml, int* ws_count) {{
    evotune::{body}<EvotuneTraits>(q, k, v, o, q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss,
                                             o_sb, o_sh, o_ss, seq_k, scale_log2, ws_o, ws_ml, ws_count);
}}
"""

    def geometry(self, config, shape: DecodeShape) -> LaunchGeometry:
        return LaunchGeometry(grid=(int(knob(config, "splits")), shape.kv_heads, shape.batch),
                              block=(block_threads(config), 1, 1), dynamic_smem=self.smem_bytes(config, shape))

    def workspace_elems(self, config, shape: DecodeShape) -> tuple[int, int, int]:
        """(ws_o floats, ws_ml floats, ws_count ints) of one launch: zeros without a split."""
        splits = int(knob(config, "splits"))
        if splits == 1:
            return 0, 0, 0
        slices = shape.batch * shape.kv_heads * splits * shape.rows
        return slices * shape.head_dim, slices * 2, shape.batch * shape.kv_heads

    def launch_notes(self, config, shape: DecodeShape) -> list[str]:
        n_o, n_ml, n_count = self.workspace_elems(config, shape)
        if not n_count:
            return ["workspace    none (splits = 1): pass null for ws_o, ws_ml, ws_count",
                    f"shape        group {shape.group}, {shape.seq_q} queries, head_dim {shape.head_dim} (compiled in); "
                    "any seq_k"]
        return [f"workspace    ws_o {n_o} fp32, ws_ml {n_ml} fp32, ws_count {n_count} int32 zeroed once",
                f"shape        group {shape.group}, {shape.seq_q} queries, head_dim {shape.head_dim} (compiled in); "
                "any seq_k"]

    def signature(self, config=None) -> str:
        return ("evotune_decode(const unsigned short* q, k, v, unsigned short* o  /* fp16 or bf16 bit patterns */, "
                "int64 q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, o_sb, o_sh, o_ss, int seq_k, "
                "float scale_log2, float* ws_o, float* ws_ml, int32* ws_count)  // strides in elements; "
                "scale_log2 = scale*log2(e)")

    def tolerance(self, shape: DecodeShape) -> tuple[float, float]:
        return TOLERANCE[shape.dtype]

    def error_scale(self, inputs: dict) -> float:
        """O is a convex combination of V's rows: the RMS of V scales its rounding error."""
        return float(inputs["v"].float().pow(2).mean().sqrt().item())

    # ------------------------------------------------------------ GPU side
    def torch_dtype(self, shape: DecodeShape):
        import torch

        return {"fp16": torch.float16, "bf16": torch.bfloat16}[shape.dtype]

    PATTERNS = ("normal", "large", "dominant_key", "equal_scores", "very_negative")

    def make_inputs(self, shape: DecodeShape, seed: int, device="cuda", pattern: str = "normal") -> dict:
        """Fresh Q, K, V (never zeros) in the shape's layout; K and V hold kv_heads heads, never expanded.

        large:         |Q|, |K| x4 (peaked softmax) and |V| x30 (large |O|)
        dominant_key:  one key per K/V head aligned with its group's queries: it takes almost all the mass
        equal_scores:  every key identical: O = mean of the visible V rows
        very_negative: keys point away from the queries: scores near -240 (exp underflows without the max)
        """
        import torch

        if pattern not in self.PATTERNS:
            raise UsageError(f"attention-decode: unknown input pattern {pattern!r}; patterns: {', '.join(self.PATTERNS)}")
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        b, hk, d = shape.batch, shape.kv_heads, shape.head_dim
        q = torch.randn(b, shape.heads, shape.seq_q, d, generator=gen, device=device)
        k = torch.randn(b, hk, shape.seq_k, d, generator=gen, device=device)
        v = torch.randn(b, hk, shape.seq_k, d, generator=gen, device=device)
        if pattern == "large":
            q, k, v = q * 4, k * 4, v * 30
        elif pattern in ("dominant_key", "very_negative"):
            u = torch.randn(b, hk, 1, d, generator=gen, device=device)
            q = u.repeat_interleave(shape.group, dim=1) + 0.3 * q
            if pattern == "dominant_key":
                # The first key: every query sees it, causal or not.
                k[:, :, 0, :] = 4 * u[:, :, 0, :]
            else:
                k = -30 * u + 0.3 * k
        elif pattern == "equal_scores":
            k = k[:, :, :1, :].expand_as(k).clone()
        dt = self.torch_dtype(shape)

        def place(t):
            if shape.layout == "bshd":  # (B, S, H, D) memory viewed as (B, H, S, D)
                return t.transpose(1, 2).contiguous().to(dt).transpose(1, 2)
            return t.to(dt).contiguous()

        return {"q": place(q), "k": place(k), "v": place(v), "scale": 1.0 / math.sqrt(d)}

    def perturb(self, shape: DecodeShape, inputs: dict, rng=None) -> tuple[dict, object]:
        """Inputs with one K/V row changed, and the (B, Hq, Sq) mask of the output rows that must change: the
        group's query heads, those queries that see the key (bottom-right causal: query i sees keys <= Sk-Sq+i). The
        key is aimed at one of those queries (problems.aim_key)."""
        import torch

        if rng is None:
            b, kvh, j = shape.batch - 1, shape.kv_heads - 1, shape.seq_k // 2
        else:
            b, kvh, j = rng.randrange(shape.batch), rng.randrange(shape.kv_heads), rng.randrange(shape.seq_k)
        first = max(0, j - (shape.seq_k - shape.seq_q)) if shape.causal else 0
        head = kvh * shape.group + (rng.randrange(shape.group) if rng is not None else 0)
        row = rng.randrange(first, shape.seq_q) if rng is not None else shape.seq_q - 1
        k, v = aim_key(inputs, b, kvh, j, head, row)
        must = torch.zeros(shape.batch, shape.heads, shape.seq_q, dtype=torch.bool, device=k.device)
        heads = slice(kvh * shape.group, (kvh + 1) * shape.group)
        must[b, heads, first:] = True
        return {**inputs, "k": k, "v": v}, must

    def new_output(self, inputs: dict):
        import torch

        return torch.empty_like(inputs["q"])

    def new_workspace(self, config, shape: DecodeShape, device) -> tuple:
        """(ws_o, ws_ml, ws_count) of one launch, () without a split; the counters start at zero and the kernel
        leaves them so. Per launch, not per config: two streams may run the same config at once."""
        n_o, n_ml, n_count = self.workspace_elems(config, shape)
        if not n_count:
            return ()
        import torch

        return (torch.empty(n_o, dtype=torch.float32, device=device),
                torch.empty(n_ml, dtype=torch.float32, device=device),
                torch.zeros(n_count, dtype=torch.int32, device=device))

    def launch_args(self, config, shape: DecodeShape, q, k, v, out, scale: float, workspace=()) -> tuple:
        """The entry point's arguments (numpy scalars) for these (B, H, S, D)-viewed tensors; UsageError where the
        tensors do not match the shape or the kernel's alignment."""
        import numpy as np

        # A lane's vector (vec 4: 8 bytes); kv_load = bulk copies whole rows, whose global address must be 16-byte aligned.
        align = 16 if knob(config, "kv_load") == "bulk" else 2 * int(knob(config, "vec"))
        for name, t in (("q", q), ("k", k), ("v", v), ("o", out)):
            if t.dim() != 4 or t.stride(-1) != 1 or t.data_ptr() % align or any(s % 8 for s in t.stride()[:-1]):
                raise UsageError(f"attention-decode: {name} must be 4-D with unit head-dim stride and 16-byte "
                                 f"aligned rows")
        want = {"q": (shape.batch, shape.heads, shape.seq_q), "k": (shape.batch, shape.kv_heads, shape.seq_k),
                "v": (shape.batch, shape.kv_heads, shape.seq_k), "o": (shape.batch, shape.heads, shape.seq_q)}
        for name, t in (("q", q), ("k", k), ("v", v), ("o", out)):
            if tuple(t.shape) != want[name] + (shape.head_dim,):
                raise UsageError(f"attention-decode: {name} is {tuple(t.shape)}; the shape {shape.spec} needs "
                                 f"{want[name] + (shape.head_dim,)}")
        if len(workspace) != (3 if self.workspace_elems(config, shape)[2] else 0):
            raise UsageError("attention-decode: this launch needs its workspace (new_workspace)")
        ptrs = [t.data_ptr() for t in workspace] or [0, 0, 0]
        strides = [s for t in (q, k, v, out) for s in t.stride()[:3]]
        return ((np.uint64(q.data_ptr()), np.uint64(k.data_ptr()), np.uint64(v.data_ptr()), np.uint64(out.data_ptr()))
                + tuple(np.int64(s) for s in strides)
                + (np.int32(shape.seq_k), np.float32(scale * math.log2(math.e)))
                + tuple(np.uint64(p) for p in ptrs))

    def launcher(self, kernel, config, shape: DecodeShape, inputs: dict, out):
        from ..build.compile import torch_stream_launcher

        geo = self.geometry(config, shape)
        workspace = self.new_workspace(config, shape, out.device)
        args = self.launch_args(config, shape, inputs["q"], inputs["k"], inputs["v"], out, inputs["scale"], workspace)
        return torch_stream_launcher(kernel, geo.grid, geo.block, args, geo.dynamic_smem, keep=workspace)

    def reference(self, shape: DecodeShape, inputs: dict):
        """softmax(scale·QKᵀ + bottom-right causal mask)·V in fp32 (no TF32), one (batch, K/V head) at a time."""
        return reference_decode(inputs["q"], inputs["k"], inputs["v"], inputs["scale"], shape.causal)

    def baselines(self) -> list[str]:
        return ["flash", "cudnn", "efficient", "math"]

    def baseline_skip_reason(self, name: str, shape: DecodeShape) -> str | None:
        if name == "math" and shape.batch * shape.heads * shape.seq_q * shape.seq_k > (1 << 28):
            return "skipped: the math backend's S matrix is too large"
        return None

    def baseline_launcher(self, name: str, shape: DecodeShape, inputs: dict, probe: bool = True):
        """SDPA with one backend forced on the same tensors (un-repeated K/V heads, enable_gqa), returning its output;
        with `probe`, None where the backend refuses them. Bottom-right causal (Sq > 1) goes in as a boolean mask:
        SDPA's is_causal is top-left aligned."""
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if name not in self.baselines():
            raise UsageError(f"attention-decode: unknown baseline {name!r}; baselines: {', '.join(self.baselines())}")
        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        gqa = {"enable_gqa": True} if shape.kv_heads != shape.heads else {}
        mask = None
        if shape.causal and shape.seq_q > 1:
            mask = bottom_right_mask(shape.seq_q, shape.seq_k, q.device)

        def run():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=inputs["scale"], **gqa)

        return self.probed(run, probe)


def bottom_right_mask(seq_q: int, seq_k: int, device):
    """(Sq, Sk) boolean, True where query i sees key j: j <= Sk - Sq + i (a KV cache's causal mask)."""
    import torch

    return torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril(diagonal=seq_k - seq_q)


def reference_decode(q, k, v, scale: float, causal: bool):
    """The fp32 answer for (B, Hq, Sq, D) queries over (B, Hkv, Sk, D) keys and values (Hq a multiple of Hkv),
    bottom-right causal when asked; one (batch, K/V head) at a time, so grouped K/V are never expanded whole."""
    import torch

    b_, hq, sq, _ = q.shape
    hk, sk = k.shape[1], k.shape[2]
    group = hq // hk
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    mask = bottom_right_mask(sq, sk, q.device) if causal else None
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for b in range(b_):
            for h in range(hk):
                qg = q[b, h * group:(h + 1) * group].float()               # (G, Sq, D)
                s = torch.matmul(qg, k[b, h].float().transpose(0, 1)) * scale  # (G, Sq, Sk)
                if mask is not None:
                    s = s.masked_fill(~mask, float("-inf"))
                out[b, h * group:(h + 1) * group] = torch.matmul(torch.softmax(s, dim=-1), v[b, h].float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return out


PROBLEM = DecodeProblem()
