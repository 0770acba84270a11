"""CPU tests of the decode attention family: shapes, the space, NVRTC compiles for sm_90a, and the split-KV math."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from evotune.build.compile import compile_source, static_violations
from evotune.build.template import instantiate
from evotune.errors import UsageError
from evotune.problems import FAMILIES
from evotune.problems.decode import PRESETS, DecodeShape, parse_shape, reference_decode


# ------------------------------------------------------------------ shapes


def test_registered_with_its_space(decode, dspace):
    """The family is a built-in one, and its default space names it."""
    assert "attention-decode" in FAMILIES and decode.family == dspace.family == "attention-decode"


@pytest.mark.parametrize("text, want", [
    ("1,32,8,16384,128:bf16", DecodeShape(1, 32, 8, 1, 16384, 128, "bf16")),
    ("2,8,1,4,300,64:causal:bshd", DecodeShape(2, 8, 1, 4, 300, 64, "fp16", "bshd", True)),
    ("llama8b-decode-2k:fp16", DecodeShape(1, 32, 8, 1, 2048, 128, "fp16")),
])
def test_shape_spelling_round_trips(text, want):
    """A spelling parses to its shape, and the shape's spec and dict read back to it."""
    shape = parse_shape(text)
    assert shape == want
    assert parse_shape(shape.spec) == shape and DecodeShape.from_dict(shape.as_dict()) == shape


@pytest.mark.parametrize("text, words", [
    ("1,32,8,128", "cannot read"),
    ("1,32,7,64,128", "must divide"),
    ("1,32,8,8,4,128", "Sq <= Sk"),
    ("1,32,8,17,2048,128", "at most 16"),
    ("1,32,8,64,128:causal:causal", "repeats"),
    ("1,32,8,64,128:kv8", "unknown flag"),
    ("nosuch", "unknown preset"),
])
def test_bad_shapes_say_why(text, words):
    """A shape the family cannot take is one UsageError naming the fault."""
    with pytest.raises(UsageError, match=words):
        parse_shape(text)


def test_check_shape_refuses_what_the_kernel_cannot_compute(decode):
    """Head dims the kernel lacks (80) and more than 16 packed rows are refused before any compile."""
    with pytest.raises(UsageError, match="head_dim 80"):
        decode.check_shape(parse_shape("1,32,8,64,80"))
    with pytest.raises(UsageError, match="32 rows"):
        decode.check_shape(parse_shape("1,64,2,64,128"))
    decode.check_shape(parse_shape("1,32,8,4,64,128:causal"))


# ------------------------------------------------------------------ the space


def test_every_preset_admits_a_split(decode, dspace):
    """On every preset some config with several splits is admitted, and the default where at most 8 rows are packed
    (16 rows need vec 4 and unroll 1 to fit the registers)."""
    for name, (shape, _) in PRESETS.items():
        ctx = decode.context(shape)
        if shape.rows <= 8:
            assert dspace.admitted(dspace.default_config(), ctx), (name, dspace.violations(dspace.default_config(), ctx))
        assert any(c["splits"] > 1 for c in dspace.admitted_configs(ctx)), name


def split_ranges(seq_k: int, splits: int, block_n: int, chunks: str = "ceil") -> list[tuple[int, int]]:
    """(begin, end) of each split's keys as the kernels deal them: attention_decode.cu's chunks of ceil(Sk / splits)
    keys rounded up to whole tiles, or split_chunks = even's tiles dealt evenly (kernels/decode/combine.cuh)."""
    if chunks == "even":
        tiles = math.ceil(seq_k / block_n)
        base, extra = divmod(tiles, splits)
        firsts = [s * base + min(s, extra) for s in range(splits + 1)]
        return [(min(seq_k, a * block_n), min(seq_k, b * block_n)) for a, b in zip(firsts, firsts[1:])]
    per_split = math.ceil(math.ceil(seq_k / splits) / block_n) * block_n
    return [(min(seq_k, s * per_split), min(seq_k, s * per_split + per_split)) for s in range(splits)]


def test_no_admitted_split_is_empty(decode, dspace):
    """Where the space admits a split count, the kernel's chunking (ceil or even) gives every split at least one key,
    and the splits cover the cache once, in order."""
    for text in ("1,32,8,1000,128", "1,32,8,2080,128"):
        shape = parse_shape(text)
        for cfg in random.Random(3).sample(dspace.admitted_configs(decode.context(shape)), 60):
            ranges = split_ranges(shape.seq_k, cfg["splits"], decode.block_n(cfg, shape), cfg["split_chunks"])
            assert all(b > a for a, b in ranges), cfg.key()
            assert ranges[0][0] == 0 and ranges[-1][1] == shape.seq_k
            assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1)), cfg.key()


def test_even_chunks_admit_what_ceil_leaves_empty(decode, dspace):
    """At Sk 2080 with 32-key tiles, ceil's chunks of 160 keys leave the 16th of 16 splits empty (so at most 8 splits,
    64 CTAs, were admitted); even deals the 65 tiles as 5 and 4, every split busy."""
    shape = parse_shape("1,32,8,2080,128")
    base = {"splits": 16, "warps": 8, "vec": 8, "unroll": 2, "stages": 3}
    assert not dspace.admitted(dspace.config(base), decode.context(shape))
    assert dspace.admitted(dspace.config({**base, "split_chunks": "even"}), decode.context(shape))
    assert [b - a for a, b in split_ranges(2080, 16, 32, "even")] == [160] + [128] * 15


# ------------------------------------------------------------------ compiles (shared: one compile per case)

COMPILE_CASES = [
    ("1,32,8,16384,128:bf16", {"splits": 16, "warps": 4, "vec": 8, "unroll": 2, "stages": 2}),
    ("2,8,1,2,300,64:causal:bshd", {"splits": 2, "warps": 2, "vec": 4, "unroll": 2, "stages": 3}),
    ("1,32,8,4,2048,128:bf16:causal", {"splits": 8, "warps": 8, "vec": 4, "unroll": 1, "stages": 1}),
    ("1,32,32,2081,96", {"splits": 8, "warps": 4, "vec": 8, "unroll": 2, "stages": 2}),  # Phi-3: lanes of 128, 4 idle
    ("1,8,4,777,256:bf16", {"splits": 4, "warps": 4, "vec": 8, "unroll": 2, "stages": 2, "kv_load": "bulk"}),
]


@pytest.fixture(scope="module")
def compiled_cases(decode, dspace):
    out = []
    for text, overrides in COMPILE_CASES:
        shape, cfg = parse_shape(text), dspace.config(overrides)
        src = instantiate(decode, cfg, shape)
        out.append((shape, cfg, src, compile_source(src.code, src.entry)))
    return out


def test_compiles_clean(decode, dspace, compiled_cases):
    """Admitted configs (a split, fp16 and bf16, head dims 64, 96, 128 and 256, causal, Sq 1/2/4, the bulk ring)
    compile for sm_90a with no spills and pass the static gate."""
    for shape, cfg, _, compiled in compiled_cases:
        assert dspace.admitted(cfg, decode.context(shape)), dspace.violations(cfg, decode.context(shape))
        res = compiled.resources
        assert res.spill_stores == res.spill_loads == res.stack_frame == 0, (shape.spec, cfg.key(), res)
        geo = decode.geometry(cfg, shape)
        assert static_violations(res, geo.threads, geo.dynamic_smem) == [], cfg.key()
        assert "Compiling entry function 'evotune_decode' for 'sm_90a'" in compiled.log


@pytest.mark.parametrize("name", ["splits", "warps", "vec", "unroll", "stages", "kv_load", "combine", "split_chunks"])
def test_every_knob_changes_the_machine_code(decode, dspace, compiled_cases, name):
    """Moving one knob of the first compiled case changes the entry's machine code."""
    from test_softmax import text_section

    shape, cfg, src, compiled = compiled_cases[0]
    param = next(p for p in dspace.params if p.name == name)
    other = next(dspace.config({**cfg.as_dict(), name: v}) for v in param.values
                 if v != cfg[name] and dspace.admitted(dspace.config({**cfg.as_dict(), name: v}), decode.context(shape)))
    src2 = instantiate(decode, other, shape)
    texts = [text_section(Path(c.cubin_path).read_bytes(), s.entry)
             for s, c in ((src, compiled), (src2, compile_source(src2.code, src2.entry)))]
    assert texts[0] != texts[1]


# ------------------------------------------------------------------ the split-KV math, emulated on the CPU


def emulate_kernel(q, k, v, scale, causal, splits, groups, unroll, chunks="ceil"):
    """kernels/attention_decode.cu's algorithm in torch on the CPU for one (batch, K/V head): keys dealt to splits
    of whole tiles (split_ranges: ceil or even) and within a tile to key groups (key = tile_start + u * groups + g), a
    running log2-domain (max, sum, O) per group, the merge of the groups, then the combine of the splits' partials."""
    import torch

    rows, sk = q.shape[0], k.shape[0]
    seq_q = rows  # one query head per row group is enough for the math: rows are the queries here
    block_n = groups * unroll
    s_all = (q @ k.T) * scale * math.log2(math.e)
    key = torch.arange(sk)
    visible = torch.ones(rows, sk, dtype=torch.bool)
    if causal:
        visible = key[None, :] <= (sk - seq_q + torch.arange(rows))[:, None]
    partials = []
    for begin, end in split_ranges(sk, splits, block_n, chunks):
        gm = torch.full((groups, rows), -math.inf)
        gl = torch.zeros(groups, rows)
        go = torch.zeros(groups, rows, v.shape[1])
        for tile in range(begin, end, block_n):
            keys = tile + torch.arange(unroll)[None, :] * groups + torch.arange(groups)[:, None]  # (groups, unroll)
            live = keys < end
            keys = keys.clamp(max=sk - 1)
            s = s_all[:, keys].masked_fill(~(visible[:, keys] & live), -math.inf)  # (rows, groups, unroll)
            mx = torch.maximum(gm, s.max(dim=2).values.T)                           # (groups, rows)
            base = torch.where(mx == -math.inf, torch.zeros_like(mx), mx)
            rescale = torch.exp2(gm - base)
            p = torch.exp2(s - base.T[..., None])                                   # (rows, groups, unroll)
            gl = gl * rescale + p.sum(dim=2).T
            go = go * rescale[..., None] + torch.einsum("rgu,gud->grd", p, v[keys])
            gm = mx
        mx = gm.max(dim=0).values
        w = torch.exp2(gm - torch.where(mx == -math.inf, torch.zeros_like(mx), mx))
        partials.append((mx, (gl * w).sum(dim=0), (go * w[..., None]).sum(dim=0)))
    m = torch.stack([p[0] for p in partials]).max(dim=0).values
    w = [torch.exp2(p[0] - m) for p in partials]
    total = sum(p[1] * wi for p, wi in zip(partials, w))
    return sum(p[2] * wi[:, None] for p, wi in zip(partials, w)) / total[:, None]


@pytest.mark.parametrize("sk, causal, splits, groups, unroll, chunks", [
    (301, False, 4, 8, 2, "ceil"),   # ragged: the last split is short, the last tile partial
    (64, True, 3, 4, 1, "ceil"),     # bottom-right causal over a short cache
    (1000, True, 7, 16, 4, "ceil"),  # causal, many splits of whole tiles
    (2080, False, 16, 8, 4, "even"),  # the tiles dealt evenly (5 and 4 of 32 keys), the last one partial
    (77, True, 9, 4, 2, "even"),     # as many splits as tiles: one each
])
def test_split_kv_math_matches_the_reference(sk, causal, splits, groups, unroll, chunks):
    """The kernel's split/group/tile dealing and its combine give the reference's softmax(QK^T)V."""
    import torch

    gen = torch.Generator().manual_seed(sk)
    q, k, v = (torch.randn(n, 64, generator=gen) for n in (4, sk, sk))
    want = reference_decode(q[None, :, None, :].transpose(1, 2), k[None, None], v[None, None], 0.125, causal)[0, 0]
    got = emulate_kernel(q, k, v, 0.125, causal, splits, groups, unroll, chunks)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_reference_is_bottom_right_causal():
    """The reference's causal mask lets query i see keys 0 .. Sk - Sq + i (a KV cache's), not top-left."""
    import torch

    q = torch.zeros(1, 1, 3, 8)
    k = torch.zeros(1, 1, 5, 8)
    v = torch.arange(5.0)[None, None, :, None].expand(1, 1, 5, 8)
    out = reference_decode(q, k, v, 1.0, causal=True)[0, 0, :, 0]
    # Equal scores: each query averages the values of the keys it sees (0..2, 0..3, 0..4).
    assert torch.allclose(out, torch.tensor([1.0, 1.5, 2.0]))


@pytest.mark.parametrize("text", ["1,32,8,16383,128:bf16", "1,8,8,16384,64", "2,32,8,4,2049,128:bf16:causal",
                                  "3,8,1,777,64", "1,12,12,1025,64:bf16", "2,32,8,4,33,128:causal"])
def test_dependency_perturbation_clearly_moves_a_row_at_any_cache_length(decode, text):
    """The gate's dependency check needs a row the fp32 reference moves beyond the tolerance; a key nudged by +1
    moves none at Sk 16383 (its weight is ~1/Sk, the gate's run of that shape on the H100 said "test is too weak").
    Over many drawn positions, the perturbation always moves one, and only rows of the mask move."""
    import torch

    from evotune.gpu.evaluate import _error_scale

    shape = decode.parse_shape(text)
    inputs = decode.make_inputs(shape, seed=11, device="cpu")
    ref1 = decode.reference(shape, inputs)
    atol, rtol = decode.tolerance(shape)
    atol *= _error_scale(decode, inputs)
    rng = random.Random(5)
    for _ in range(6):
        changed, must = decode.perturb(shape, inputs, rng=rng)
        ref2 = decode.reference(shape, changed)
        moved = (ref2 - ref1).abs().amax(dim=-1)
        assert bool(((moved > atol + rtol * ref1.abs().amax(dim=-1)) & must).any())
        assert float(moved[~must].max()) == 0.0 if (~must).any() else True
        assert torch.equal(changed["q"], inputs["q"]) and changed["k"].stride() == inputs["k"].stride()


def test_gpu_cases_are_admitted(decode, dspace):
    """The GPU suite's decode cases are configs the space admits on their shapes: checked here, where no GPU is
    needed (a case with 16 splits of 1025 keys once reached the H100 only to fail its admission there)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_gpu_decode import CASES

    for text, overrides in CASES:
        shape = decode.parse_shape(text)
        assert dspace.admitted(dspace.config(overrides), decode.context(shape)), (text, overrides)
