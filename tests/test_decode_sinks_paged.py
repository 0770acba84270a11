"""CPU tests of the decode family's attention sinks and paged KV cache: the shapes' spelling, the table keys, admission,
clean sm_90a compiles, the kernel's sink and page arithmetic emulated, the ops' argument checks and their PyTorch
fallbacks against brute force (a concatenated sink column; gathered pages), ragged lengths."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from evotune.build.compile import compile_source, static_violations
from evotune.build.template import instantiate
from evotune.errors import UsageError
from evotune.problems.decode import (DecodeShape, entry_params, gather_rows, paginate, parse_shape, reference_decode,
                                     reference_paged, uses_variants)
from evotune.torch import decode as D
from evotune.torch.routing import EvotuneFallbackWarning

from test_decode_op import fresh  # noqa: E402,F401 (autouse: no decode table, the op's caches cleared around each test)


# ------------------------------------------------------------------ shapes


@pytest.mark.parametrize("text, want", [
    ("1,64,8,4096,64:bf16:sinks", DecodeShape(1, 64, 8, 1, 4096, 64, "bf16", sinks=True)),
    ("4,32,8,16384,128:bf16:paged=16", DecodeShape(4, 32, 8, 1, 16384, 128, "bf16", page_size=16)),
    ("2,32,8,4,3000,128:causal:paged=256:sinks", DecodeShape(2, 32, 8, 4, 3000, 128, causal=True, sinks=True,
                                                               page_size=256)),
    ("llama8b-decode-2k:paged=64", DecodeShape(1, 32, 8, 1, 2048, 128, "bf16", page_size=64)),
    ("3,8,1,777,64:paged=1", DecodeShape(3, 8, 1, 1, 777, 64, page_size=1)),
    ("3,8,1,777,64:paged=48", DecodeShape(3, 8, 1, 1, 777, 64, page_size=48)),
])
def test_sinks_and_paged_spellings_round_trip(text, want):
    """`:sinks` and `:paged=P` parse to their fields; the spec and the dict read back to the same shape."""
    shape = parse_shape(text)
    assert shape == want
    assert parse_shape(shape.spec) == shape and DecodeShape.from_dict(shape.as_dict()) == shape


def test_dense_shape_dict_reads_as_before():
    """A dense shape without sinks writes neither field, so its records read the same."""
    d = parse_shape("1,32,8,2048,128:bf16").as_dict()
    assert "sinks" not in d and "page_size" not in d
    assert set(parse_shape("1,32,8,2048,128:bf16:sinks:paged=16").as_dict()) >= {"sinks", "page_size"}


@pytest.mark.parametrize("text, words", [
    ("1,32,8,2048,128:paged=0", "page size is a whole number"),
    ("1,32,8,2048,128:paged=65537", "page size is a whole number"),
    ("1,32,8,2048,128:paged=x", "page size is a whole number"),
    ("1,32,8,2048,128:paged=16:paged=32", "conflicts with"),
    ("1,32,8,2048,128:sinks:sinks", "repeats"),
    ("1,32,8,2048,128:sink", "unknown flag"),
])
def test_bad_feature_flags_say_why(text, words):
    """A bad page size, a repeated flag or a misspelt one is one UsageError naming it."""
    with pytest.raises(UsageError, match=words):
        parse_shape(text)


def test_feature_shapes_use_the_variants_kernel(decode, dspace):
    """Sinks and paged shapes instantiate decode/variants.cuh's kernel with their traits and entry parameters; a dense
    shape at the defaults keeps attention_decode.cu's entry (no new parameters)."""
    cfg = dspace.default_config()
    dense = parse_shape("1,32,8,2048,128:bf16")
    assert not uses_variants(cfg, dense) and entry_params(dense) == D.ENTRY_PARAMS
    src = instantiate(decode, cfg, dense).code
    assert "DecodeVariantTraits<" not in src and "sinks" not in src.split("evotune instantiation")[-1]
    both = parse_shape("1,32,8,2048,128:bf16:sinks:paged=16")
    code = instantiate(decode, cfg, both).code.split("evotune instantiation")[-1]
    assert "/* SINKS = */ true" in code and "/* PAGE_SIZE = */ 16" in code
    assert "const float* __restrict__ sinks" in code and "const int* __restrict__ block_table" in code
    assert [n for n, _ in entry_params(both)][-4:] == ["sinks", "block_table", "bt_sb", "cache_seqlens"]
    only_sinks = instantiate(decode, cfg, parse_shape("1,32,8,2048,128:bf16:sinks")).code
    assert "PAGE_SIZE = */" not in only_sinks.split("evotune instantiation")[-1]


# ------------------------------------------------------------------ table keys


def test_table_key_gains_sinks_and_the_exact_page_size():
    """Sinks and the page size are key fields (exact), written only where set; a dense key's dict is as before."""
    base = dict(batch=1, heads=32, kv_heads=8, seq_q=1, seq_k=2048, head_dim=128, dtype="bf16")
    key = lambda **kw: D.table_key("H200", "9.0", DecodeShape(**{**base, **kw}))
    assert key() != key(sinks=True) != key(page_size=16) != key(page_size=64)
    assert key(page_size=16, seq_k=1500) == key(page_size=16)  # the length still a bucket
    assert set(D.key_dict(key())) == set(D.KEY_FIELDS)
    assert D.key_dict(key(sinks=True, page_size=16))["page_size"] == 16
    assert D.key_of(D.key_dict(key(sinks=True, page_size=16))) == key(sinks=True, page_size=16)
    assert D.key_of(D.key_dict(key())) == key()


def test_table_built_from_feature_benches_round_trips(tmp_path):
    """build_decode_table keys a paged sinks bench by its page size and sinks; the op parses the table back; an old
    key object without the optional fields reads as a dense one."""
    shape = DecodeShape(4, 64, 8, 1, 4096, 64, "bf16", sinks=True, page_size=16)
    rows = [{"name": "evotune", "available": True, "time_us": 9.0, "passed": True},
            {"name": "flex", "available": True, "time_us": 20.0, "passed": True}]
    rec = {"family": "attention-decode", "shape_dict": shape.as_dict(), "config": {"splits": 4},
           "source_digest": "abc", "rows": rows, "raw": {"device": {"name": "NVIDIA H200", "sm": "9.0"}}}
    path = tmp_path / "b.json"
    path.write_text(json.dumps(rec))
    table = D.build_decode_table([path])
    entry = table["entries"][0]
    assert entry["route"] == "evotune" and entry["key"]["sinks"] is True and entry["key"]["page_size"] == 16
    D.use_decode_table(table)
    assert list(D._table()) == [D.table_key("NVIDIA H200", "9.0", shape)]
    old = {k: v for k, v in entry["key"].items() if k not in ("sinks", "page_size")}
    assert D.key_of(old)[-2:] == (False, 0)


# ------------------------------------------------------------------ admission and compiles

COMPILE_CASES = [
    ("1,64,8,4096,64:bf16:sinks", {"splits": 16, "warps": 4, "vec": 8, "unroll": 2, "stages": 2}),  # gpt-oss-like
    ("1,64,8,4096,64:bf16:sinks", {"splits": 1, "warps": 8, "vec": 8, "unroll": 2, "stages": 3}),
    ("2,32,8,3000,128:fp16:sinks", {"splits": 8, "warps": 4, "vec": 8, "unroll": 2, "stages": 3,
                                    "kv_load": "bulk", "combine": "acq_rel", "split_chunks": "even"}),
    ("4,32,8,4096,128:bf16:paged=16", {"splits": 4, "warps": 4, "vec": 8, "unroll": 2, "stages": 2}),
    ("4,32,8,4096,128:bf16:paged=64", {"splits": 8, "warps": 8, "vec": 8, "unroll": 4, "stages": 4,
                                       "combine": "acq_rel", "split_chunks": "even"}),
    ("8,32,8,8192,128:bf16:paged=16", {"splits": 8, "warps": 8, "vec": 8, "unroll": 4, "stages": 4}),  # 4 ids a lane
    ("2,32,8,4,3000,128:causal:paged=256", {"splits": 1, "warps": 4, "vec": 4, "unroll": 1, "stages": 3}),
    ("2,8,4,777,256:bf16:paged=48", {"splits": 4, "warps": 4, "vec": 8, "unroll": 2, "stages": 2}),
    ("2,32,32,2081,96:paged=16", {"splits": 4, "warps": 4, "vec": 8, "unroll": 2, "stages": 2}),
    ("2,32,8,4,3000,128:bf16:causal:sinks:paged=16", {"splits": 8, "warps": 4, "vec": 4, "unroll": 1, "stages": 3,
                                                      "combine": "acq_rel"}),
    ("3,64,8,2048,64:bf16:sinks:paged=256", {"splits": 4, "warps": 4, "vec": 8, "unroll": 2, "stages": 3}),
]


@pytest.fixture(scope="module")
def compiled_features(decode, dspace):
    out = []
    for text, overrides in COMPILE_CASES:
        shape, cfg = parse_shape(text), dspace.config(overrides)
        src = instantiate(decode, cfg, shape)
        out.append((text, shape, cfg, src, compile_source(src.code, src.entry)))
    return out


def test_feature_configs_compile_clean(decode, dspace, compiled_features):
    """Admitted configs with sinks (cp_async and bulk), paged caches (pages 16, 48, 64, 256 keys) and both compile
    for sm_90a with no spills or stack and pass the static gate."""
    for text, shape, cfg, src, compiled in compiled_features:
        assert dspace.admitted(cfg, decode.context(shape)), (text, dspace.violations(cfg, decode.context(shape)))
        res = compiled.resources
        assert res.spill_stores == res.spill_loads == res.stack_frame == 0, (text, cfg.key(), res)
        geo = decode.geometry(cfg, shape)
        assert static_violations(res, geo.threads, geo.dynamic_smem) == [], (text, cfg.key())


def test_page_size_changes_the_machine_code(decode, dspace, compiled_features):
    """Two page sizes of one config are two kernels (the page size is compiled in): their machine code differs."""
    from pathlib import Path

    from test_softmax import text_section

    text, shape, cfg, src, compiled = compiled_features[3]
    other = parse_shape(text.replace("paged=16", "paged=128"))
    src2 = instantiate(decode, cfg, other)
    texts = [text_section(Path(c.cubin_path).read_bytes(), s.entry)
             for s, c in ((src, compiled), (src2, compile_source(src2.code, src2.entry)))]
    assert texts[0] != texts[1]


@pytest.mark.parametrize("page", [1, 16, 256])
def test_bulk_is_not_admitted_on_a_paged_cache(decode, dspace, page):
    """kv_load = bulk is refused on a paged shape of any page size (a head's rows are apart even inside a page: row
    copies issued a lane at a time), with the why, and stays admitted on the same dense shape."""
    knobs = {"splits": 4, "warps": 8, "vec": 8, "unroll": 4, "stages": 4, "kv_load": "bulk"}
    cfg = dspace.config(knobs)
    paged = decode.parse_shape(f"8,32,8,8192,128:bf16:paged={page}")
    why = dspace.violations(cfg, decode.context(paged))
    assert why and "a row at a time" in why[0]
    assert dspace.admitted(cfg, decode.context(decode.parse_shape("8,32,8,8192,128:bf16")))
    assert dspace.admitted(dspace.config({**knobs, "kv_load": "cp_async"}), decode.context(paged))


def test_gpu_feature_cases_are_admitted(decode, dspace):
    """The GPU suite's sinks and paged cases are configs the space admits on their shapes."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_gpu_decode_sinks_paged import CASES

    for text, overrides in CASES:
        shape = decode.parse_shape(text)
        assert dspace.admitted(dspace.config(overrides), decode.context(shape)), (text, overrides)


# ------------------------------------------------------------------ the kernel's sink and page arithmetic


def emulate_split_sinks(q, k, v, scale, sinks, splits):
    """The kernel's split combine with a sink, on the CPU for one head: each split's (max, sum, O) in log2 units,
    merged, then the sink's exp2(sink·log2e - top) joining the denominator once (combine.cuh's row_scale)."""
    l2e = math.log2(math.e)
    s = (q @ k.T) * scale * l2e
    parts = []
    for chunk in torch.tensor_split(torch.arange(k.shape[0]), splits):
        if len(chunk) == 0:
            parts.append((torch.full((q.shape[0],), -math.inf), torch.zeros(q.shape[0]), torch.zeros(q.shape[0], v.shape[1])))
            continue
        m = s[:, chunk].max(dim=1).values
        p = torch.exp2(s[:, chunk] - m[:, None])
        parts.append((m, p.sum(dim=1), p @ v[chunk]))
    mx = torch.stack([p[0] for p in parts]).max(dim=0).values
    w = [torch.exp2(p[0] - mx) for p in parts]
    total = sum(p[1] * wi for p, wi in zip(parts, w))
    x = sum(p[2] * wi[:, None] for p, wi in zip(parts, w))
    sink = sinks * l2e
    top = torch.maximum(mx, sink)
    ws = torch.exp2(mx - top)
    return x * (ws / (total * ws + torch.exp2(sink - top)))[:, None]


@pytest.mark.parametrize("splits, sink", [(1, 0.0), (4, 5.0), (7, 50.0), (3, -30.0)])
def test_sink_joins_the_denominator_once_after_the_splits(splits, sink):
    """The combine's sink term, added once after the splits merge, gives the reference's softmax over the keys and
    the sink column, from a sink far below the scores to one far above them (a stable shift, no overflow)."""
    gen = torch.Generator().manual_seed(splits)
    q, k, v = torch.randn(4, 64, generator=gen), torch.randn(301, 64, generator=gen), torch.randn(301, 64, generator=gen)
    sinks = torch.full((4,), sink)
    got = emulate_split_sinks(q, k, v, 0.125, sinks, splits)
    want = reference_decode(q[None, :, None], k[None, None], v[None, None], 0.125, False, sinks)[0, :, 0]
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


def test_a_sink_added_per_split_would_be_wrong():
    """Adding the sink in every split's denominator (the bug the design avoids) changes the answer."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 1, 1, 64, generator=gen), torch.randn(1, 1, 200, 64, generator=gen), torch.randn(1, 1, 200, 64, generator=gen)
    sinks = torch.tensor([3.0])
    once = reference_decode(q, k, v, 0.125, False, sinks)
    halves = [reference_decode(q, k[:, :, i:i + 100], v[:, :, i:i + 100], 0.125, False, sinks) for i in (0, 100)]
    assert not torch.allclose(once, (halves[0] + halves[1]) / 2, atol=1e-3)


@pytest.mark.parametrize("page", [1, 16, 48, 64, 256])
def test_page_lookup_reads_each_key_where_the_table_puts_it(page):
    """Key j of sequence b is row j % page of page block_table[b][j // page]: the kernel's addressing (PagedCache:
    page * page_stride + (j % page) * row_stride in the (num_pages, Hkv, page, D) view) reads the dense key back."""
    shape = DecodeShape(3, 4, 2, 1, 700, 64, page_size=page)
    gen = torch.Generator().manual_seed(page)
    k = torch.randn(3, 2, 700, 64, generator=gen).half()
    inputs = paginate(k, k, shape, seed=1)
    view = inputs["k"].transpose(1, 2)  # what the entry reads: (page, head, row) strides
    flat = inputs["k"].view(-1)
    sp, sh, ss = view.stride()[:3]
    for b in range(3):
        for j in (0, page - 1 if page <= 700 else 5, 699, 351):
            p = int(inputs["block_table"][b, j // page])
            for h in range(2):
                off = p * sp + h * sh + (j % page) * ss
                assert torch.equal(flat[off:off + 64], k[b, h, j])


def test_paginate_uses_scattered_pages_and_poisons_what_no_sequence_holds():
    """The gate's caches: a random (non-contiguous) page order, spare pages, ragged lengths in the stress patterns
    with NaN in every slot no sequence holds, finite garbage in the timed pattern."""
    shape = DecodeShape(4, 8, 2, 2, 300, 64, causal=True, page_size=16)
    k = torch.randn(4, 2, 300, 64).half()
    normal, ragged = paginate(k, k, shape, seed=3), paginate(k, k, shape, seed=3, ragged=True)
    table = normal["block_table"]
    assert table.dtype == torch.int32 and table.shape == (4, 19)
    assert not torch.equal(table.view(-1).sort().values, table.view(-1))  # not in order
    assert normal["cache_seqlens"].tolist() == [300] * 4 and torch.isfinite(normal["k"]).all()
    lengths = ragged["cache_seqlens"].tolist()
    assert lengths[0] == 300 and lengths[-1] == 2 and all(2 <= n <= 300 for n in lengths)
    held = sum(r.numel() for r in gather_rows(ragged["k"], table, ragged["cache_seqlens"]))
    assert int(torch.isfinite(ragged["k"]).sum()) == held
    for rows, n in zip(gather_rows(ragged["k"], table, ragged["cache_seqlens"]), lengths):
        assert rows.shape[0] == n and torch.isfinite(rows).all()


# ------------------------------------------------------------------ the ops' checks and fallbacks


def brute_force(q, k, v, scale, lengths=None, causal=False, sinks=None):
    """Row by row in float64: each (batch, query head, query)'s scores over the keys it sees, a sink column
    concatenated, softmax, drop the column, times V."""
    b_, hq, sq, _ = q.shape
    hk = k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(b_):
        n = k.shape[2] if lengths is None else int(lengths[b])
        for h in range(hq):
            kv = h // (hq // hk)
            for i in range(sq):
                last = n if not causal else min(n, n - sq + i + 1)
                if last <= 0:
                    continue
                s = (q[b, h, i].double() @ k[b, kv, :last].double().T) * scale
                if sinks is not None:
                    s = torch.cat([s, sinks[h].double().view(1)])
                p = torch.softmax(s, dim=0)[:last]
                out[b, h, i] = p @ v[b, kv, :last].double()
    return out


def dense_of(cache, table, lengths, width):
    """A (num_pages, page, Hkv, D) cache's sequences as (B, Hkv, width, D), zero past each length."""
    rows = gather_rows(cache, table, lengths)
    out = torch.zeros(len(rows), cache.shape[2], width, cache.shape[3], dtype=cache.dtype)
    for b, r in enumerate(rows):
        out[b, :, :r.shape[0]] = r.transpose(0, 1)
    return out


def test_sinks_fallback_matches_brute_force_and_is_told_once():
    """CPU calls with sinks run the fp32 sink math (told once, naming it), equal to a concatenated sink column's
    softmax, causal bottom-right, GQA; sinks in bf16 are cast."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 4, 64, generator=gen)
    k, v = torch.randn(2, 2, 37, 64, generator=gen), torch.randn(2, 2, 37, 64, generator=gen)
    sinks = torch.randn(8, generator=gen) * 2 + 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [D.decode_attention(q, k, v, causal=True, scale=0.2, sinks=sinks) for _ in range(3)]
        half = D.decode_attention(q, k, v, causal=True, scale=0.2, sinks=sinks.bfloat16())
    told = [str(w.message) for w in caught if issubclass(w.category, EvotuneFallbackWarning)]
    assert len(told) == 1 and "sink column" in told[0] and "SDPA has no attention sinks" in told[0]
    want = brute_force(q, k, v, 0.2, causal=True, sinks=sinks)
    assert torch.allclose(outs[0].double(), want, atol=1e-5)
    assert torch.allclose(half.double(), brute_force(q, k, v, 0.2, causal=True, sinks=sinks.bfloat16().float()),
                          atol=1e-5)
    # without sinks the answer differs: the sink takes mass
    assert not torch.allclose(D.decode_attention(q, k, v, causal=True, scale=0.2).double(), want, atol=1e-3)


def test_a_dominant_sink_drives_the_output_to_zero_and_a_negligible_one_changes_nothing():
    """A sink 60 above every score leaves O ~ 0; one 60 below leaves plain attention."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 4, 1, 64, generator=gen), torch.randn(1, 4, 50, 64, generator=gen), torch.randn(1, 4, 50, 64, generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        high = D.decode_attention(q, k, v, sinks=torch.full((4,), 60.0))
        low = D.decode_attention(q, k, v, sinks=torch.full((4,), -60.0))
        plain = D.decode_attention(q, k, v)
    assert high.abs().max() < 1e-12 and torch.allclose(low, plain, atol=1e-6)


@pytest.mark.parametrize("bad, words", [
    (torch.zeros(7), r"sinks must be a \(8,\) floating-point tensor"),
    (torch.zeros(8, dtype=torch.int64), "floating-point"),
    (torch.zeros(1, 8), r"\(8,\)"),
    ([0.0] * 8, "got list"),
])
def test_bad_sinks_are_one_usage_error(bad, words):
    """Sinks of the wrong size, dtype or type are refused with one line before anything runs."""
    q, kv = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 9, 64)
    with pytest.raises(UsageError, match=words):
        D.decode_attention(q, kv, kv, sinks=bad)


def paged_inputs(lengths, page, hq=8, hk=2, sq=1, d=64, seed=0, dtype=torch.float32):
    """A paged cache for `lengths` with a scattered table and NaN in every slot no sequence holds."""
    shape = DecodeShape(len(lengths), hq, hk, sq, max(lengths), d, page_size=page)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(len(lengths), hk, max(lengths), d, generator=gen).to(dtype)
    v = torch.randn(len(lengths), hk, max(lengths), d, generator=gen).to(dtype)
    cache = paginate(k, v, shape, seed, ragged=True)
    lens = torch.tensor(lengths, dtype=torch.int32)
    # paginate's ragged lengths are its own draw: re-poison for these lengths
    for name in ("k", "v"):
        rows = torch.full_like(cache[name], math.nan)
        for b, n in enumerate(lengths):
            for j in range(n):
                p = int(cache["block_table"][b, j // page])
                rows[p, j % page] = (k if name == "k" else v)[b, :, j]
        cache[name] = rows
    q = torch.randn(len(lengths), hq, sq, d, generator=gen).to(dtype)
    return q, cache["k"], cache["v"], cache["block_table"], lens


@pytest.mark.parametrize("lengths, page, sq, causal, with_sinks", [
    ([1, 1, 1], 16, 1, True, False),           # length 1
    ([1000] + [3] * 7, 16, 1, True, False),    # one long sequence and many short
    ([1000] + [5] * 7, 64, 4, True, True),     # speculative queries, sinks
    ([17, 300, 256, 1], 256, 1, False, True),
    ([40, 2, 33], 48, 2, True, False),         # a page size that is no power of two; a sequence as long as Sq
    ([9, 70], 1, 1, True, True),               # one key a page
])
def test_paged_fallback_matches_brute_force_on_ragged_lengths(lengths, page, sq, causal, with_sinks):
    """A CPU paged call gathers each sequence's pages at its own length (NaN slots never read into the answer), told
    once, and equals brute force on the dense sequences; so does the fp32 paged reference."""
    q, kc, vc, table, lens = paged_inputs(lengths, page, sq=sq)
    sinks = torch.randn(8) + 2 if with_sinks else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = D.paged_decode_attention(q, kc, vc, table, lens, causal=causal, sinks=sinks)
        D.paged_decode_attention(q, kc, vc, table, lens, causal=causal, sinks=sinks)
    told = [str(w.message) for w in caught if issubclass(w.category, EvotuneFallbackWarning)]
    assert len(told) == 1 and "pages gathered" in told[0]
    width = max(lengths)
    k, v = dense_of(kc, table, lens, width), dense_of(vc, table, lens, width)
    want = brute_force(q, k, v, 1 / 8, lengths, causal, sinks)
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double(), want, atol=1e-5), float((out.double() - want).abs().max())
    ref = reference_paged(q, kc, vc, table, lens, 1 / 8, causal, sinks)
    assert torch.allclose(ref.double(), want, atol=1e-5)


def test_paged_fallback_with_max_seqlen_and_a_padded_table():
    """max_seqlen bounds the gather; table entries past a sequence's pages (vLLM pads them) are never followed."""
    q, kc, vc, table, lens = paged_inputs([50, 20], 16)
    padded = torch.cat([table, torch.full((2, 3), 10**6, dtype=torch.int32)], dim=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = D.paged_decode_attention(q, kc, vc, padded, lens, max_seqlen=50)
        b = D.paged_decode_attention(q, kc, vc, table, lens)
    assert torch.allclose(a, b, atol=1e-6) and torch.isfinite(a).all()


def test_paged_fallback_agrees_with_the_dense_op():
    """Equal lengths, contiguous or scattered pages: the paged op's answer is the dense op's on the same keys."""
    q, kc, vc, table, lens = paged_inputs([64, 64], 16, sq=3)
    k, v = dense_of(kc, table, lens, 64), dense_of(vc, table, lens, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        paged = D.paged_decode_attention(q, kc, vc, table, lens, causal=True, scale=0.3)
        dense = D.decode_attention(q, k, v, causal=True, scale=0.3)
    assert torch.allclose(paged, dense, atol=1e-5)


@pytest.mark.parametrize("mutate, words", [
    (lambda a: {**a, "block_table": a["block_table"].long()}, "block_table must be"),
    (lambda a: {**a, "block_table": a["block_table"][:1]}, "block_table must be"),
    (lambda a: {**a, "cache_seqlens": a["cache_seqlens"].long()}, "cache_seqlens must be"),
    (lambda a: {**a, "cache_seqlens": a["cache_seqlens"][:1]}, "cache_seqlens must be"),
    (lambda a: {**a, "v_cache": a["v_cache"][:, :8]}, "the same"),
    (lambda a: {**a, "k_cache": a["k_cache"][..., :32], "v_cache": a["v_cache"][..., :32]}, "head dims must match"),
    (lambda a: {**a, "q": a["q"][:, :7]}, "divide the query heads"),
    (lambda a: {**a, "q": a["q"].half()}, "share a dtype"),
    (lambda a: {**a, "max_seqlen": -1}, "max_seqlen"),
])
def test_paged_argument_checks_are_one_usage_error(mutate, words):
    """Each malformed paged call is one UsageError line naming the argument."""
    q, kc, vc, table, lens = paged_inputs([20, 9], 16)
    args = mutate({"q": q, "k_cache": kc, "v_cache": vc, "block_table": table, "cache_seqlens": lens,
                   "max_seqlen": None})
    with pytest.raises(UsageError, match=words):
        D.paged_decode_attention(args["q"], args["k_cache"], args["v_cache"], args["block_table"],
                                 args["cache_seqlens"], max_seqlen=args["max_seqlen"])


def test_paged_route_names_why_a_cpu_call_falls_back():
    """paged_decode_route says why a call is not ours (CPU tensors, fp32)."""
    q, kc, vc, table, lens = paged_inputs([20, 9], 16)
    assert "fp16 or bf16" in D.paged_decode_route(q, kc, vc, table, lens)
    assert "CUDA" in D.paged_decode_route(q.half(), kc.half(), vc.half(), table, lens)


def test_fake_implementations_give_the_query_metadata():
    """Under fake tensors both ops return q's shape, dtype and strides (sinks and a page table accepted)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 4, 8, 64, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.empty(2, 2, 512, 64, dtype=torch.bfloat16)
        sinks = torch.empty(8)
        out = D.decode_op(q, k, k, False, None, sinks)
        kc = torch.empty(40, 16, 2, 64, dtype=torch.bfloat16)
        paged = D.paged_decode_op(q, kc, kc, torch.empty(2, 20, dtype=torch.int32), torch.empty(2, dtype=torch.int32),
                                  True, None, sinks, 300)
    for o in (out, paged):
        assert o.shape == q.shape and o.dtype == q.dtype and o.stride() == q.stride()


def test_problem_reference_and_baselines_agree_on_cpu(decode):
    """The family's fp32 reference of a paged sinks shape equals its sink-math baseline (gathered pages), the stress
    patterns' ragged, NaN-poisoned caches included; the perturbation moves a row of the mask."""
    import random

    shape = decode.parse_shape("3,8,2,2,300,64:causal:sinks:paged=16")
    for pattern in ("normal", "large", "dominant_key"):
        inputs = decode.make_inputs(shape, seed=4, device="cpu", pattern=pattern)
        ref = decode.reference(shape, inputs)
        got = decode.baseline_launcher("sink-math", shape, inputs, probe=False)()
        assert torch.isfinite(ref).all()
        assert torch.allclose(got.float(), ref, atol=2e-3, rtol=2e-3), (pattern, float((got.float() - ref).abs().max()))
    inputs = decode.make_inputs(shape, seed=5, device="cpu")  # the dependency check's pattern
    changed, must = decode.perturb(shape, inputs, rng=random.Random(2))
    moved = (decode.reference(shape, changed) - decode.reference(shape, inputs)).abs().amax(dim=-1)
    assert bool((moved[must] > 1e-2).any()) and float(moved[~must].max()) == 0.0
    assert decode.baselines_for(shape) == ["flex", "sink-math"]
    assert decode.baseline_skip_reason("flash", shape) == "skipped: SDPA has no attention sinks"
