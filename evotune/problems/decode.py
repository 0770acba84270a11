"""The decode attention family: kernels/attention_decode.cu against PyTorch SDPA (enable_gqa).

A few queries (Sq 1 to 16: a decode step, or a short chunk of a cached prefill) over a KV cache of Sk keys
with grouped-query attention: split-KV across CTAs with the combine in the last CTA of each (batch, K/V
head), and the query heads of one K/V head packed into one CTA (FA3's PackGQA). Causal is bottom-right
aligned, as a KV cache's mask is: query i sees keys 0 .. Sk - Sq + i.

A shape is written `B,Hq,Hkv,Sk,D` (one query: a decode step) or `B,Hq,Hkv,Sq,Sk,D`, optionally followed by
`:fp16|:bf16`, `:bhsd|:bshd` (the memory layout of Q, K, V and O), `:causal`, `:sinks` and `:paged=P`, or a preset
name, e.g. `1,32,8,16384,128:bf16` (a Llama-3-8B decode step at 16k context).

`:sinks` is attention sinks (gpt-oss's `s_aux`, flash-attention's `learnable_sink`): one logit per query head, in the
units of the scaled scores, joins every row's softmax as a column that has no value, O = sum_j exp(s_j) v_j /
(exp(sink_h) + sum_j exp(s_j)). The logits are an (Hq,) float32 input, not part of the shape.

`:paged=P` is a paged KV cache (vLLM's, FlashInfer's, FlashAttention's `flash_attn_with_kvcache` with `block_table`):
K and V of shape (num_pages, P, Hkv, D), a (B, max_pages) int32 block table and (B,) int32 cache_seqlens. Any page
size from 1 to 65536 keys is compiled in (one kernel per page size); Sk is every sequence's length in the tuned shape
(the gate's stress inputs draw ragged lengths up to Sk; the kernel reads each sequence's own). The layout flag then
applies to Q and O only. `1,32,8,16384,128:bf16:paged=16` is a Llama-3-8B decode step over a vLLM cache at 16k.
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
from . import LaunchGeometry, Problem, aim_key, check_sinks, knob_reader, sink_logits

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
MAX_PAGE_SIZE = 65536  # DecodeVariantTraits: PAGE_SIZE (keys a page; any size, compiled in)

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
                 "dtype_bytes", "causal", "sinks", "page_size") + DEVICE_CONTEXT_NAMES

# The attention family's gate: O is a convex combination of V's rows, the same error budget per element.
TOLERANCE = {"fp16": (1e-3, 4e-3), "bf16": (8e-3, 3e-2)}  # (atol, rtol)


knob = knob_reader(KNOB_DEFAULTS)


def is_variant(config) -> bool:
    """Whether `config` sets a knob of kernels/decode/variants.cuh off its default (else attention_decode.cu's kernel)."""
    return any(knob(config, name) != next(iter(enums)) for name, (_, enums) in VARIANT_KNOBS.items())


def uses_variants(config, shape) -> bool:
    """Whether `config` on `shape` instantiates kernels/decode/variants.cuh's kernel: a variant knob off its default, or
    a shape with sinks or a paged cache (their pieces are there; attention_decode.cu's kernel stays as it was)."""
    return is_variant(config) or shape.sinks or shape.paged


def block_threads(config) -> int:
    """Threads of a CTA: the consumer warps, and kv_load = bulk's producer warp."""
    return 32 * (int(knob(config, "warps")) + (1 if knob(config, "kv_load") == "bulk" else 0))


# The entry point's parameters in order (DecodeProblem.instantiation), as the op's ParamPacket reads them; a sinks
# shape's logits and a paged shape's table follow (entry_params).
BASE_PARAMS = ((("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("o", "ptr"))
               + tuple((f"{t}_s{d}", "i64") for t in "qkvo" for d in "bhs")
               + (("seq_k", "i32"), ("scale_log2", "f32"), ("ws_o", "ptr"), ("ws_ml", "ptr"), ("ws_count", "ptr")))
SINK_PARAMS = (("sinks", "ptr"),)
PAGED_PARAMS = (("block_table", "ptr"), ("bt_sb", "i64"), ("cache_seqlens", "ptr"))
_DECLS = {"sinks": "const float* __restrict__ sinks", "block_table": "const int* __restrict__ block_table",
          "bt_sb": "long long bt_sb", "cache_seqlens": "const int* __restrict__ cache_seqlens"}
FEATURE_NOTES = """
// Sinks shapes add `sinks` (Hq float32 logits, one per query head, in units of the scaled scores). Paged shapes read
// k and v as (num_pages, PAGE_SIZE, Hkv, D) caches through their (page, head, row) strides in k_sb, k_sh, k_ss (and
// v's), add block_table (B rows of bt_sb int32 page ids) and cache_seqlens (B int32 lengths), and pass seq_k = the
// table's pages x PAGE_SIZE, which bounds every length."""


def entry_params(shape) -> tuple:
    """The entry point's (name, kind) parameters for `shape`: the dense entry's, then a sinks shape's logits, then a
    paged shape's block table, its row stride and the lengths."""
    return BASE_PARAMS + (SINK_PARAMS if shape.sinks else ()) + (PAGED_PARAMS if shape.paged else ())


def feature_decls(shape) -> list[str]:
    """The entry's C declarations of the parameters sinks and paged shapes add."""
    return [_DECLS[name] for name, _ in entry_params(shape)[len(BASE_PARAMS):]]


def feature_args(shape) -> list[tuple[str, object]]:
    """DecodeVariantTraits' SINKS and PAGE_SIZE arguments, only where the shape has them (defaults false and 0): the
    variants' instantiations of dense shapes without sinks keep their text."""
    if shape.paged:
        return [("SINKS", "true" if shape.sinks else "false"), ("PAGE_SIZE", shape.page_size)]
    return [("SINKS", "true")] if shape.sinks else []


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
    layout: str = "bhsd"  # of Q and O, and of K and V unless paged
    causal: bool = False
    sinks: bool = False   # attention sinks: a per-query-head logit joins each row's denominator (the logits: input)
    page_size: int = 0    # a paged KV cache's keys a page; 0: a dense cache

    def __post_init__(self) -> None:
        check_fields(self, MAX_DIMS, lambda name, limit: f"at most {limit} for the decode kernel")
        if not isinstance(self.sinks, bool):
            raise UsageError(f"shape: sinks must be True or False, got {self.sinks!r}")
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or \
                not 0 <= self.page_size <= MAX_PAGE_SIZE:
            raise UsageError(f"shape: page size must be an integer from 1 to {MAX_PAGE_SIZE} keys (0: not paged), "
                             f"got {self.page_size!r}")
        if self.heads % self.kv_heads:
            raise UsageError(f"shape: {self.kv_heads} K/V heads for {self.heads} query heads: the K/V heads must "
                             f"divide the query heads")
        if self.seq_q > self.seq_k:
            raise UsageError(f"shape: {self.seq_q} queries over {self.seq_k} keys: a KV cache holds at least the "
                             f"queries' own keys (Sq <= Sk)")

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def pages_per_seq(self) -> int:
        """A paged shape's pages per sequence (its block table's width in make_inputs)."""
        return -(-self.seq_k // self.page_size) if self.paged else 0

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
        flags += (["sinks"] if self.sinks else []) + ([f"paged={self.page_size}"] if self.paged else [])
        return ",".join(map(str, dims)) + ":" + ":".join(flags)

    @property
    def dtype_bytes(self) -> int:
        return 2

    def flops(self) -> float:
        """Matmul FLOPs (4·D per visible query-key pair and query head); bottom-right causal hides Sq(Sq-1)/2 pairs."""
        pairs = self.seq_q * self.seq_k - (self.seq_q * (self.seq_q - 1) // 2 if self.causal else 0)
        return 4.0 * self.batch * self.heads * pairs * self.head_dim

    def min_bytes(self) -> int:
        """Fewest bytes moved through device memory: K and V read once per K/V head, Q read and O written once (and a
        paged cache's block table and lengths, sinks' logits)."""
        kv = 2 * self.batch * self.kv_heads * self.seq_k * self.head_dim
        qo = 2 * self.batch * self.heads * self.seq_q * self.head_dim
        extra = 4 * self.batch * (self.pages_per_seq + 1) if self.paged else 0
        return (kv + qo) * self.dtype_bytes + extra + (4 * self.heads if self.sinks else 0)

    def as_dict(self) -> dict:
        """The shape's fields; sinks and page_size only where set, so a dense shape's dict reads as before them."""
        d = {"batch": self.batch, "heads": self.heads, "kv_heads": self.kv_heads, "seq_q": self.seq_q,
             "seq_k": self.seq_k, "head_dim": self.head_dim, "dtype": self.dtype, "layout": self.layout,
             "causal": self.causal}
        if self.sinks:
            d["sinks"] = True
        if self.paged:
            d["page_size"] = self.page_size
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DecodeShape":
        return cls(**{k: d[k] for k in ("batch", "heads", "kv_heads", "seq_q", "seq_k", "head_dim", "dtype",
                                        "layout", "causal")},
                   sinks=d.get("sinks") is True, page_size=int(d.get("page_size") or 0))


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
_FLAGS = {**{d: "dtype" for d in DTYPES}, **{lay: "layout" for lay in LAYOUTS}, "causal": "causal", "sinks": "sinks"}
_PAGED_FLAG = re.compile(r"^paged=")  # paged=P; the value is read (and refused) by parse_shape


def parse_shape(text: str) -> DecodeShape:
    """A preset name or `B,Hq,Hkv,[Sq,]Sk,D[:flags]` as a DecodeShape, or UsageError."""
    if text is None or not str(text).strip():
        raise UsageError("shape: empty; give a preset (see `evotune shapes --family attention-decode`) or B,Hq,Hkv,Sk,D")
    text = str(text).strip()
    dims_part, *flag_texts = text.split(":")
    given = parse_flags(flag_texts, _FLAGS, text, ((_PAGED_FLAG, "page_size", "paged=P"),))
    fields = {kind: (True if kind in ("causal", "sinks") else flag) for kind, flag in given.items()}
    if "page_size" in fields:
        value = fields["page_size"].split("=", 1)[1].strip()
        if not re.fullmatch(r"[0-9]{1,6}", value) or not 1 <= int(value) <= MAX_PAGE_SIZE:
            raise UsageError(f"shape: paged={value[:20]!r} in {text[:60]!r}: the page size is a whole number of keys "
                             f"from 1 to {MAX_PAGE_SIZE} (e.g. paged=16, vLLM's)")
        fields["page_size"] = int(value)
    name = dims_part.strip()
    if name in PRESETS:
        return replace(PRESETS[name][0], **fields)
    if not _DIMS.match(dims_part):
        if re.match(r"^[A-Za-z][\w-]*$", name):
            raise UsageError(f"shape: unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        raise UsageError(f"shape: cannot read {text[:60]!r}; write B,Hq,Hkv,Sk,D or B,Hq,Hkv,Sq,Sk,D with optional "
                         f":fp16|:bf16|:bshd|:causal|:sinks|:paged=P")
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
        cols = {"B": str(shape.batch), "Hq": str(shape.heads), "Hkv": str(shape.kv_heads), "Sq": str(shape.seq_q),
                "Sk": str(shape.seq_k), "D": str(shape.head_dim), "dtype": shape.dtype,
                "causal": "yes" if shape.causal else "no"}
        if shape.sinks:
            cols["sinks"] = "yes"
        if shape.paged:
            cols["page"] = str(shape.page_size)
        return cols

    def describe_shape(self, shape: DecodeShape) -> str:
        mods = " sinks" if shape.sinks else ""
        mods += f" paged (page {shape.page_size})" if shape.paged else ""
        return (f"B={shape.batch} Hq={shape.heads} Hkv={shape.kv_heads} Sq={shape.seq_q} Sk={shape.seq_k} "
                f"D={shape.head_dim}{' causal (bottom-right)' if shape.causal else ''}{mods}")

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
                "dtype": shape.dtype, "dtype_bytes": shape.dtype_bytes, "causal": shape.causal, "sinks": shape.sinks,
                "page_size": shape.page_size, **device_context()}

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
             if uses_variants(config, shape) else []) + feature_args(shape)

    def instantiation(self, config, shape: DecodeShape) -> str:
        """The entry point; a config with a knob of kernels/decode/variants.cuh off its default, or a shape with sinks
        or a paged cache, gets that header (inlined) ahead of it and calls its decode_attention_variant (traits
        DecodeVariantTraits); sinks and paged shapes add their entry parameters last (FEATURE_PARAMS)."""
        targs = ",\n    ".join(f"/* {name} = */ {value}" for name, value in self.template_args(config, shape))
        geo = self.geometry(config, shape)
        asserts = launch_asserts(geo.threads, geo.dynamic_smem, ("kRows", shape.rows))
        if uses_variants(config, shape):
            pieces = inline_includes('#include "decode/variants.cuh"\n', (self.kernel_file,))
            return pieces + self._entry("DecodeVariantTraits", "decode_attention_variant", targs, asserts, shape)
        return self._entry("DecodeTraits", "decode_attention", targs, asserts)

    def _entry(self, traits: str, body: str, targs: str, asserts: str, shape: DecodeShape | None = None) -> str:
        extra_params, extra_args, notes = "", "", ""
        if shape is not None and (shape.sinks or shape.paged):
            extra_params = "".join(f",\n               {decl}" for decl in feature_decls(shape))
            extra_args = (", evotune::DecodeExtras{" + ("sinks" if shape.sinks else "nullptr") + ", " +
                          ("block_table, bt_sb, cache_seqlens" if shape.paged else "nullptr, 0, nullptr") + "}")
            notes = FEATURE_NOTES
        return f"""using EvotuneTraits = evotune::{traits}<
    {targs}>;
{asserts}
// Launch: grid (SPLITS, kv_heads, batch), block (EvotuneTraits::kThreads), dynamic shared memory
// EvotuneTraits::kSmemBytes. Pointers are fp16/bf16 bit patterns; strides are in elements (b = batch,
// h = head, s = sequence; the head-dim stride is 1), rows 16-byte aligned. q and o hold kv_heads * GROUP query
// heads. With SPLITS > 1: ws_o (batch * kv_heads * SPLITS * ROWS * HEAD_DIM fp32), ws_ml (... * ROWS * 2 fp32)
// and ws_count (batch * kv_heads int32, zeroed once; the kernel leaves it zero); null otherwise.{notes}
extern "C" __global__ void __launch_bounds__(EvotuneTraits::kThreads)
{self.entry_name}(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
               const unsigned short* __restrict__ v, unsigned short* __restrict__ o,
               long long q_sb, long long q_sh, long long q_ss, long long k_sb, long long k_sh, long long k_ss,
               long long v_sb, long long v_sh, long long v_ss, long long o_sb, long long o_sh, long long o_ss,
               int seq_k, float scale_log2, float* ws_o, float* ws_ml, int* ws_count{extra_params}) {{
    evotune::{body}<EvotuneTraits>(q, k, v, o, q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss,
                                             o_sb, o_sh, o_ss, seq_k, scale_log2, ws_o, ws_ml, ws_count{extra_args});
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
        what = (f"shape        group {shape.group}, {shape.seq_q} queries, head_dim {shape.head_dim} (compiled in); "
                + (f"pages of {shape.page_size} keys (compiled in), any lengths" if shape.paged else "any seq_k"))
        notes = [what]
        if shape.sinks:
            notes.append(f"sinks        ({shape.heads},) float32 logits, one per query head")
        if shape.paged:
            notes.append("paged        k, v (num_pages, page, Hkv, D); block_table (B, pages) int32; cache_seqlens (B,) "
                         "int32; seq_k = pages x page")
        if not n_count:
            return ["workspace    none (splits = 1): pass null for ws_o, ws_ml, ws_count"] + notes
        return [f"workspace    ws_o {n_o} fp32, ws_ml {n_ml} fp32, ws_count {n_count} int32 zeroed once"] + notes

    def signature(self, config=None) -> str:
        return ("evotune_decode(const unsigned short* q, k, v, unsigned short* o  /* fp16 or bf16 bit patterns */, "
                "int64 q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, o_sb, o_sh, o_ss, int seq_k, "
                "float scale_log2, float* ws_o, float* ws_ml, int32* ws_count[, const float* sinks][, const int32* "
                "block_table, int64 bt_sb, const int32* cache_seqlens])  // strides in elements; "
                "scale_log2 = scale*log2(e); sinks with :sinks, the table with :paged=P")

    def tolerance(self, shape: DecodeShape) -> tuple[float, float]:
        return TOLERANCE[shape.dtype]

    def error_scale(self, inputs: dict) -> float:
        """O is a convex combination of V's rows: the RMS of V scales its rounding error (a paged cache's: of the rows
        its sequences hold, not the poisoned or spare ones)."""
        v = inputs["v"]
        if "block_table" in inputs:
            v = torch_cat_rows(gather_rows(inputs["v"], inputs["block_table"], inputs["cache_seqlens"]))
        return float(v.float().pow(2).mean().sqrt().item())

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

        A sinks shape adds "sinks", (Hq,) float32 logits about a row's log-sum-exp (sink_logits). A paged shape's "k"
        and "v" are (num_pages, page, Hkv, D) caches with "block_table" (B, pages) int32, a random permutation of the
        pages with spares left unused, and "cache_seqlens" (B,) int32 (paginate): every sequence Sk keys in the normal
        pattern (the one timed), ragged lengths with NaN in every slot no sequence holds in the stress patterns.
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

        inputs = {"q": place(q), "k": place(k), "v": place(v), "scale": 1.0 / math.sqrt(d)}
        if shape.paged:
            inputs.update(paginate(k.to(dt), v.to(dt), shape, seed, ragged=pattern != "normal"))
        if shape.sinks:
            inputs["sinks"] = sink_logits(shape, gen, device)
        return inputs

    def perturb(self, shape: DecodeShape, inputs: dict, rng=None) -> tuple[dict, object]:
        """Inputs with one K/V row changed, and the (B, Hq, Sq) mask of the output rows that must change: the
        group's query heads, those queries that see the key (bottom-right causal: query i sees keys <= Sk-Sq+i). The
        key is aimed at one of those queries (problems.aim_key). A paged cache's key is one its sequence holds, changed
        in the page the block table names."""
        import torch

        lengths = inputs["cache_seqlens"].tolist() if shape.paged else [shape.seq_k] * shape.batch
        if rng is None:
            b, kvh = shape.batch - 1, shape.kv_heads - 1
            j = lengths[b] // 2
        else:
            b, kvh = rng.randrange(shape.batch), rng.randrange(shape.kv_heads)
            j = rng.randrange(lengths[b])
        first = max(0, j - (lengths[b] - shape.seq_q)) if shape.causal else 0
        head = kvh * shape.group + (rng.randrange(shape.group) if rng is not None else 0)
        row = rng.randrange(first, shape.seq_q) if rng is not None else shape.seq_q - 1
        must = torch.zeros(shape.batch, shape.heads, shape.seq_q, dtype=torch.bool, device=inputs["q"].device)
        heads = slice(kvh * shape.group, (kvh + 1) * shape.group)
        must[b, heads, first:] = True
        if shape.paged:  # aim_key's aim and raise, at the row the block table names
            page, slot = int(inputs["block_table"][b, j // shape.page_size]), j % shape.page_size
            target = inputs["q"][b, head, row, :].float()
            k, v = inputs["k"].clone(), inputs["v"].clone()
            k[page, slot, kvh, :] = (6.0 * target / (inputs["scale"] * target.pow(2).sum().clamp_min(1e-6))).to(k.dtype)
            v[page, slot, kvh, :] += 8.0 * max(1, lengths[b] // 512)
            return {**inputs, "k": k, "v": v}, must
        k, v = aim_key(inputs, b, kvh, j, head, row)
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

    def launch_args(self, config, shape: DecodeShape, q, k, v, out, scale: float, workspace=(), sinks=None,
                    block_table=None, cache_seqlens=None) -> tuple:
        """The entry point's arguments (numpy scalars) for these (B, H, S, D)-viewed tensors (a paged shape's k and v:
        its (num_pages, page, Hkv, D) caches, with block_table and cache_seqlens; a sinks shape's (Hq,) float32
        sinks); UsageError where the tensors do not match the shape or the kernel's alignment."""
        import numpy as np

        if shape.paged:
            k, v = check_paged(shape, k, v, block_table, cache_seqlens, q.device)
        # A lane's vector (vec 4: 8 bytes); kv_load = bulk copies whole rows, whose global address must be 16-byte aligned.
        align = 16 if knob(config, "kv_load") == "bulk" else 2 * int(knob(config, "vec"))
        for name, t in (("q", q), ("k", k), ("v", v), ("o", out)):
            if t.dim() != 4 or t.stride(-1) != 1 or t.data_ptr() % align or any(s % 8 for s in t.stride()[:-1]):
                raise UsageError(f"attention-decode: {name} must be 4-D with unit head-dim stride and 16-byte "
                                 f"aligned rows")
        kv = (k.shape[0], shape.kv_heads, shape.page_size) if shape.paged else (shape.batch, shape.kv_heads, shape.seq_k)
        want = {"q": (shape.batch, shape.heads, shape.seq_q), "k": kv, "v": kv,
                "o": (shape.batch, shape.heads, shape.seq_q)}
        for name, t in (("q", q), ("k", k), ("v", v), ("o", out)):
            if tuple(t.shape) != want[name] + (shape.head_dim,):
                raise UsageError(f"attention-decode: {name} is {tuple(t.shape)}; the shape {shape.spec} needs "
                                 f"{want[name] + (shape.head_dim,)}")
        if len(workspace) != (3 if self.workspace_elems(config, shape)[2] else 0):
            raise UsageError("attention-decode: this launch needs its workspace (new_workspace)")
        ptrs = [t.data_ptr() for t in workspace] or [0, 0, 0]
        strides = [s for t in (q, k, v, out) for s in t.stride()[:3]]
        seq_k = block_table.shape[1] * shape.page_size if shape.paged else shape.seq_k
        if seq_k >= 2**31:
            raise UsageError(f"attention-decode: a block table of {block_table.shape[1]} pages of {shape.page_size} "
                             f"keys: past the kernel's 32-bit key index")
        extra = ()
        if shape.sinks:
            extra += (np.uint64(check_sinks(sinks, shape, q.device, "attention-decode").data_ptr()),)
        if shape.paged:
            extra += (np.uint64(block_table.data_ptr()), np.int64(block_table.stride(0)),
                      np.uint64(cache_seqlens.data_ptr()))
        return ((np.uint64(q.data_ptr()), np.uint64(k.data_ptr()), np.uint64(v.data_ptr()), np.uint64(out.data_ptr()))
                + tuple(np.int64(s) for s in strides)
                + (np.int32(seq_k), np.float32(scale * math.log2(math.e)))
                + tuple(np.uint64(p) for p in ptrs) + extra)

    def launcher(self, kernel, config, shape: DecodeShape, inputs: dict, out):
        from ..build.compile import torch_stream_launcher

        geo = self.geometry(config, shape)
        workspace = self.new_workspace(config, shape, out.device)
        args = self.launch_args(config, shape, inputs["q"], inputs["k"], inputs["v"], out, inputs["scale"], workspace,
                                inputs.get("sinks"), inputs.get("block_table"), inputs.get("cache_seqlens"))
        return torch_stream_launcher(kernel, geo.grid, geo.block, args, geo.dynamic_smem, keep=workspace)

    def reference(self, shape: DecodeShape, inputs: dict):
        """softmax(scale·QKᵀ + bottom-right causal mask)·V in fp32 (no TF32), one (batch, K/V head) at a time; with
        sinks each row's softmax has one more column, its head's sink logit, that carries no value; a paged cache's
        sequences gathered from their pages, each at its own length."""
        if shape.paged:
            return reference_paged(inputs["q"], inputs["k"], inputs["v"], inputs["block_table"],
                                   inputs["cache_seqlens"], inputs["scale"], shape.causal, inputs.get("sinks"))
        return reference_decode(inputs["q"], inputs["k"], inputs["v"], inputs["scale"], shape.causal,
                                inputs.get("sinks"))

    def baselines(self) -> list[str]:
        return ["flash", "cudnn", "efficient", "math"]

    def baselines_for(self, shape: DecodeShape) -> list[str]:
        """SDPA's backends; with sinks, which SDPA lacks, FlexAttention (compiled; the sink through its log-sum-exp)
        and the op's fallback (PyTorch fp32 math with the sink column) instead. A paged shape's baselines run on its
        sequences gathered into a dense cache once, outside the timed call: the dense anchor a paged kernel is held
        to."""
        return ["flex", "sink-math"] if shape.sinks else self.baselines()

    def baseline_skip_reason(self, name: str, shape: DecodeShape) -> str | None:
        if name in ("flex", "sink-math") and not shape.sinks:
            return "skipped: FlexAttention and the sink math only beside sinks"
        if shape.sinks and name in self.baselines():
            return "skipped: SDPA has no attention sinks"
        if name in ("math", "sink-math") and shape.batch * shape.heads * shape.seq_q * shape.seq_k > (1 << 28):
            return "skipped: the math backend's S matrix is too large"
        return None

    def baseline_launcher(self, name: str, shape: DecodeShape, inputs: dict, probe: bool = True):
        """SDPA with one backend forced on the same tensors (un-repeated K/V heads, enable_gqa), returning its output;
        with `probe`, None where the backend refuses them. Bottom-right causal (Sq > 1) goes in as a boolean mask:
        SDPA's is_causal is top-left aligned. A paged shape's cache is gathered first (dense_kv, not timed), ragged
        lengths masked. Sinks shapes: "flex" (FlexAttention with the sink's share of its log-sum-exp) or "sink-math"."""
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = self.baselines() + ["flex", "sink-math"]
        if name not in names:
            raise UsageError(f"attention-decode: unknown baseline {name!r}; baselines: {', '.join(names)}")
        q = inputs["q"]
        k, v, visible = dense_kv(shape, inputs)
        gqa = {"enable_gqa": True} if shape.kv_heads != shape.heads else {}
        if name == "sink-math":
            sinks = inputs["sinks"]
            return self.probed(lambda: attention_math(q, k, v, inputs["scale"], visible, sinks), probe)
        if name == "flex":
            run = flex_sinks_launcher(q, k, v, inputs["scale"], visible, inputs["sinks"])
            return self.probed(run, probe)
        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]
        mask = visible

        def run():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=inputs["scale"], **gqa)

        return self.probed(run, probe)


def bottom_right_mask(seq_q: int, seq_k: int, device):
    """(Sq, Sk) boolean, True where query i sees key j: j <= Sk - Sq + i (a KV cache's causal mask)."""
    import torch

    return torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril(diagonal=seq_k - seq_q)


def visible_keys(lengths, seq_q: int, width: int, causal: bool, device):
    """(B, 1, Sq, width) boolean, True where query i of sequence b sees key j: j < lengths[b], and with causal
    (bottom-right, per sequence) j <= lengths[b] - Sq + i. `lengths`: a (B,) integer tensor."""
    import torch

    lengths = lengths.to(device=device, dtype=torch.long).view(-1, 1, 1, 1)
    j = torch.arange(width, device=device).view(1, 1, 1, -1)
    seen = j < lengths
    if causal:
        i = torch.arange(seq_q, device=device).view(1, 1, -1, 1)
        seen = seen & (j <= lengths - seq_q + i)
    return seen


def check_paged(shape: DecodeShape, k_cache, v_cache, block_table, cache_seqlens, device) -> tuple:
    """A paged launch's caches viewed as (num_pages, Hkv, page, D), after checking them, the (B, pages) int32 block
    table (unit last stride) and the (B,) int32 contiguous lengths on `device`; one UsageError line otherwise."""
    import torch

    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape[1:]) != (shape.page_size, shape.kv_heads,
                                                                                   shape.head_dim):
            raise UsageError(f"attention-decode: {name} must be (num_pages, {shape.page_size}, {shape.kv_heads}, "
                             f"{shape.head_dim}) for {shape.spec}, got {tuple(getattr(t, 'shape', ()))}")
    if k_cache.shape[0] != v_cache.shape[0]:
        raise UsageError(f"attention-decode: k_cache has {k_cache.shape[0]} pages, v_cache {v_cache.shape[0]}")
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 or \
            block_table.shape[0] != shape.batch or block_table.shape[1] < 1 or block_table.stride(1) != 1 or \
            block_table.device != device:
        raise UsageError(f"attention-decode: block_table must be a ({shape.batch}, max_pages) int32 tensor with unit "
                         f"last stride on {device}, got {tuple(getattr(block_table, 'shape', ()))} "
                         f"{getattr(block_table, 'dtype', None)}")
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32 or \
            tuple(cache_seqlens.shape) != (shape.batch,) or not cache_seqlens.is_contiguous() or \
            cache_seqlens.device != device:
        raise UsageError(f"attention-decode: cache_seqlens must be a contiguous ({shape.batch},) int32 tensor on "
                         f"{device}, got {tuple(getattr(cache_seqlens, 'shape', ()))} "
                         f"{getattr(cache_seqlens, 'dtype', None)}")
    return k_cache.transpose(1, 2), v_cache.transpose(1, 2)


def paginate(k, v, shape: DecodeShape, seed: int, ragged: bool = False) -> dict:
    """A paged shape's cache from dense (B, Hkv, Sk, D) K and V: "k" and "v" (num_pages, page, Hkv, D) holding
    sequence b's key j in row j % page of page block_table[b][j // page], "block_table" (B, pages) int32 (a random
    permutation of B x pages + 2 pages: non-contiguous, spares unused) and "cache_seqlens" (B,) int32. Every length
    is Sk, or with `ragged` the first Sk, the last Sq (B >= 3) and the others drawn in [Sq, Sk]; the slots no
    sequence holds are NaN with `ragged` (a kernel that reads one and weighs it 0 still turns NaN), else finite
    garbage of about 100 (timed sets must differ bitwise, which NaN cannot)."""
    import torch

    b, hk, sk, d = k.shape
    page, n = shape.page_size, shape.pages_per_seq
    cpu = torch.Generator().manual_seed(seed * 7919 + 17)
    dev = torch.Generator(device=k.device).manual_seed(seed * 7919 + 18)
    num_pages = b * n + 2
    table = torch.randperm(num_pages, generator=cpu)[:b * n].view(b, n).to(torch.int32)
    lengths = torch.full((b,), sk, dtype=torch.int32)
    if ragged and b > 1:
        lengths[1:] = torch.randint(shape.seq_q, sk + 1, (b - 1,), generator=cpu, dtype=torch.int32)
        if b >= 3:
            lengths[-1] = shape.seq_q
    out = {}
    for name, t in (("k", k), ("v", v)):
        if ragged:
            cache = torch.full((num_pages, page, hk, d), math.nan, dtype=t.dtype, device=t.device)
        else:
            cache = (torch.randn(num_pages, page, hk, d, generator=dev, device=t.device) * 100).to(t.dtype)
        rows = torch.full((b, n * page, hk, d), math.nan, dtype=t.dtype, device=t.device)
        rows[:, :sk] = t.transpose(1, 2)
        keep = torch.arange(n * page, device=t.device)[None, :] < lengths.to(t.device)[:, None]  # (B, n * page)
        flat = table.view(-1).long().to(t.device)
        rows = torch.where(keep[..., None, None], rows, cache[flat].view(b, n * page, hk, d))
        cache[flat] = rows.view(b * n, page, hk, d)
        out[name] = cache
    out["block_table"] = table.to(k.device)
    out["cache_seqlens"] = lengths.to(k.device)
    return out


def gather_rows(cache, block_table, cache_seqlens) -> list:
    """Each sequence's rows of a (num_pages, page, Hkv, D) cache, in key order: a list of (length, Hkv, D) tensors."""
    page = cache.shape[1]
    out = []
    for b, length in enumerate(cache_seqlens.tolist()):
        pages = block_table[b, :-(-length // page)].long()
        out.append(cache[pages].reshape(-1, *cache.shape[2:])[:length])
    return out


def torch_cat_rows(rows: list):
    import torch

    return torch.cat(rows) if rows else torch.zeros(0)


def dense_kv(shape: DecodeShape, inputs: dict) -> tuple:
    """(k, v, visible) for the baselines: a dense shape's own K and V and its bottom-right mask (None where every query
    sees every key); a paged shape's sequences gathered into dense (B, Hkv, longest, D) K and V (rows past a
    sequence's length zero) and the (B, 1, Sq, longest) mask of each sequence's length and causal edge."""
    import torch

    q = inputs["q"]
    if not shape.paged:
        mask = None
        if shape.causal and shape.seq_q > 1:
            mask = bottom_right_mask(shape.seq_q, shape.seq_k, q.device)
        return inputs["k"], inputs["v"], mask
    lengths = inputs["cache_seqlens"]
    longest = int(lengths.max())
    dense = []
    for name in ("k", "v"):
        rows = gather_rows(inputs[name], inputs["block_table"], lengths)
        t = torch.zeros(shape.batch, longest, shape.kv_heads, shape.head_dim, dtype=q.dtype, device=q.device)
        for b, r in enumerate(rows):
            t[b, :r.shape[0]] = r
        dense.append(t.transpose(1, 2).contiguous())
    uniform = bool((lengths == longest).all())
    visible = None
    if not uniform or (shape.causal and shape.seq_q > 1):
        visible = visible_keys(lengths, shape.seq_q, longest, shape.causal, q.device)
    return dense[0], dense[1], visible


def attention_math(q, k, v, scale: float, visible=None, sinks=None):
    """softmax(scale·QKᵀ masked by `visible`)·V in fp32 for q (B, Hq, Sq, D) over k, v (B, Hkv, Sk, D), grouped K/V
    un-repeated (the query heads of a K/V head as one batch of rows), with `sinks` ((Hq,) logits) a column per row
    that carries no value; a row that sees no key (and no sink) is 0. `visible`: boolean, broadcastable to
    (B, 1, Sq, Sk). Returns q's dtype: the op's fallback and the sink-math baseline."""
    import torch

    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    g = hq // hk
    s = torch.matmul(q.float().reshape(b, hk, g * sq, d), k.float().transpose(-1, -2)) * scale
    s = s.view(b, hk, g, sq, sk)
    if visible is not None:
        lead = visible.shape[0] if visible.dim() == 4 else 1  # (B or 1, 1, Sq, Sk) or (Sq, Sk)
        s = s.masked_fill(~visible.reshape(lead, 1, 1, sq, sk), float("-inf"))
    if sinks is not None:
        col = sinks.float().view(1, hk, g, 1, 1).expand(b, hk, g, sq, 1)
        lse = torch.logsumexp(torch.cat([s, col], dim=-1), dim=-1, keepdim=True)
    else:
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - lse)
    p = torch.nan_to_num(p, nan=0.0)  # a row with nothing to see: -inf - -inf
    out = torch.matmul(p, v.float().unsqueeze(2))  # (B, Hkv, G, Sq, D)
    return out.reshape(b, hq, sq, d).to(q.dtype)


_FLEX: dict = {}


def flex_with_sinks(q, k, v, sinks, **kw):
    """Attention sinks on FlexAttention, which has none: a sink adds exp(sink) to each row's denominator, so the
    output without it, O, and its log-sum-exp L give O · sigmoid(L - sink) (problems/attention.py's flex_with_sinks,
    flash-attention's and the gpt-oss reference's semantics)."""
    import torch
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    out, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True), **kw)
    share = torch.sigmoid(aux.lse - sinks.view(1, -1, 1))
    return (out.float() * share.unsqueeze(-1)).to(out.dtype)


def flex_sinks_launcher(q, k, v, scale: float, visible, sinks):
    """FlexAttention (compiled once per process, static shapes) with the sinks on these tensors, `visible` as its
    block mask (a (B, 1, Sq, Sk) or (Sq, Sk) boolean, or None)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_with_sinks, dynamic=False)
    kw = {"scale": scale, "enable_gqa": k.shape[1] != q.shape[1]}
    if visible is not None:
        seen = visible if visible.dim() == 4 else visible.view(1, 1, *visible.shape)
        batched = seen.shape[0] > 1

        def mask_mod(b, h, i, j):
            return seen[b if batched else 0, 0, i, j]

        kw["block_mask"] = create_block_mask(mask_mod, seen.shape[0] if batched else None, None, q.shape[2],
                                             k.shape[2], device=q.device)
    fn = _FLEX["fn"]
    return lambda: fn(q, k, v, sinks, **kw)


def reference_decode(q, k, v, scale: float, causal: bool, sinks=None):
    """The fp32 answer for (B, Hq, Sq, D) queries over (B, Hkv, Sk, D) keys and values (Hq a multiple of Hkv),
    bottom-right causal when asked; one (batch, K/V head) at a time, so grouped K/V are never expanded whole. With
    `sinks` ((Hq,) logits) each row's softmax has one more column, its head's sink, that carries no value; a row that
    sees no key then gets 0."""
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
                if sinks is not None:
                    col = sinks[h * group:(h + 1) * group].float().view(group, 1, 1).expand(group, sq, 1)
                    p = torch.exp(s - torch.logsumexp(torch.cat([s, col], dim=-1), dim=-1, keepdim=True))
                else:
                    p = torch.softmax(s, dim=-1)
                out[b, h * group:(h + 1) * group] = torch.matmul(p, v[b, h].float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return out


def reference_paged(q, k_cache, v_cache, block_table, cache_seqlens, scale: float, causal: bool, sinks=None):
    """The fp32 answer over a paged cache: each sequence's keys gathered from its pages (gather_rows) at its own
    length, then reference_decode for that batch row. A sequence shorter than its queries' causal edge leaves those
    rows seeing no key: 0 (with or without sinks), as the kernel and flash-attention give."""
    import torch

    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    ks, vs = gather_rows(k_cache, block_table, cache_seqlens), gather_rows(v_cache, block_table, cache_seqlens)
    sq = q.shape[2]
    for b, (k, v) in enumerate(zip(ks, vs)):
        length = k.shape[0]
        if length == 0:
            continue
        kb, vb = k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None]  # (1, Hkv, length, D)
        if causal and length < sq:  # the first Sq - length queries see nothing: pad with keys none of them sees
            o = attention_math(q[b:b + 1].float(), kb.float(), vb.float(), scale,
                               visible_keys(torch.tensor([length]), sq, length, True, q.device), sinks)
            out[b] = o[0]
            continue
        out[b:b + 1] = reference_decode(q[b:b + 1], kb, vb, scale, causal, sinks)
    return out


PROBLEM = DecodeProblem()
