"""GPU tests of the decode family's attention sinks and paged KV cache: the full gate (NaN-poisoned outputs, the stress
patterns' ragged lengths with NaN in every cache slot no sequence holds, the dependency check) on sinks, paged (pages
of 16, 64, 256 and others; scattered page tables), both; split-KV and SPLITS = 1, GQA, fp16 and bf16, head dims 64,
96, 128 and 256; then explicit ragged batches and the ops (`python -m pytest -m gpu tests/test_gpu_decode_sinks_paged.py`)."""

from __future__ import annotations

import math
import warnings

import pytest

from evotune.build.compile import compile_source, load_kernel
from evotune.build.template import instantiate
from evotune.records import result as R

pytestmark = pytest.mark.gpu

BULK = {"kv_load": "bulk", "combine": "acq_rel", "split_chunks": "even"}
ACQ_EVEN = {"combine": "acq_rel", "split_chunks": "even"}  # bulk's partners, on paged caches (bulk reads dense ones)

# (shape, config): lengths never a multiple of the page, the split's keys or the tile.
CASES = [
    # sinks (gpt-oss-like: 64 query heads on 8, d64), split and not, both combines, the bulk ring
    ("1,64,8,4000,64:bf16:sinks", {"splits": 16, "warps": 4, "vec": 8, "unroll": 2, "stages": 2}),
    ("1,64,8,4000,64:bf16:sinks", {"splits": 1, "warps": 8, "vec": 8, "unroll": 2, "stages": 3}),
    ("2,32,8,3001,128:sinks", {"splits": 8, "warps": 4, "vec": 8, "unroll": 2, "stages": 3, **BULK}),
    ("2,32,8,4,999,128:bf16:causal:sinks", {"splits": 4, "warps": 4, "vec": 4, "unroll": 1, "stages": 2}),
    ("1,8,4,777,256:bf16:sinks", {"splits": 4, "warps": 4, "vec": 8, "unroll": 2, "stages": 2}),
    ("1,32,32,2081,96:sinks", {"splits": 8, "warps": 4, "vec": 8, "unroll": 2, "stages": 2}),
    # paged: pages of 16 (vLLM), 64, 256 (a tile's whole page), 48 and 1 (any size); a page id a key (16 in 64-key
    # tiles) and a tile, both combines and chunkings
    ("4,32,8,3001,128:bf16:paged=16", {"splits": 4, "warps": 4, "vec": 8, "unroll": 2, "stages": 2}),
    ("4,32,8,3001,128:bf16:paged=16", {"splits": 1, "warps": 8, "vec": 8, "unroll": 4, "stages": 4}),
    ("3,32,8,2049,128:paged=64", {"splits": 8, "warps": 8, "vec": 8, "unroll": 4, "stages": 4, **ACQ_EVEN}),
    ("3,32,8,2049,128:bf16:paged=256", {"splits": 8, "warps": 4, "vec": 8, "unroll": 2, "stages": 3}),
    ("2,32,8,4,1500,128:causal:paged=64", {"splits": 4, "warps": 4, "vec": 4, "unroll": 1, "stages": 2}),
    ("3,8,1,777,64:paged=48", {"splits": 4, "warps": 2, "vec": 8, "unroll": 2, "stages": 2}),
    ("2,8,4,777,256:bf16:paged=16", {"splits": 4, "warps": 4, "vec": 8, "unroll": 2, "stages": 2}),
    ("2,32,32,2081,96:paged=16", {"splits": 4, "warps": 4, "vec": 8, "unroll": 2, "stages": 2}),
    ("2,8,2,301,64:bf16:paged=1", {"splits": 2, "warps": 2, "vec": 8, "unroll": 2, "stages": 2}),
    ("2,32,8,777,128:bf16:bshd:paged=16", {"splits": 2, "warps": 4, "vec": 8, "unroll": 2, "stages": 2}),
    # both
    ("4,64,8,3001,64:bf16:sinks:paged=16", {"splits": 8, "warps": 4, "vec": 8, "unroll": 2, "stages": 2}),
    ("2,32,8,4,2049,128:bf16:causal:sinks:paged=256", {"splits": 8, "warps": 4, "vec": 4, "unroll": 1, "stages": 3,
                                                       "combine": "acq_rel"}),
    ("3,64,8,2048,64:sinks:paged=64", {"splits": 1, "warps": 4, "vec": 8, "unroll": 2, "stages": 3}),
]


def _compiled(problem, shape, cfg):
    src = instantiate(problem, cfg, shape)
    return src, compile_source(src.code, src.entry)


@pytest.mark.parametrize("shape_text, overrides", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_cases_pass_the_gate(decode, dspace, shape_text, overrides):
    """Each case passes the full gate against the fp32 reference (sink column; gathered pages), no NaN, in tolerance."""
    from evotune.gpu.evaluate import evaluate_compiled

    shape, cfg = decode.parse_shape(shape_text), dspace.config(overrides)
    assert dspace.admitted(cfg, decode.context(shape)), dspace.violations(cfg, decode.context(shape))
    _, compiled = _compiled(decode, shape, cfg)
    res = evaluate_compiled(decode, shape, cfg, compiled, time_it=False)
    assert res.status == R.OK, (shape_text, cfg.key(), res.status, res.message)
    assert res.verification["nonfinite"] == 0 and res.verification["gate_ratio"] <= 1.0


def _launch(decode, shape, cfg, inputs):
    """Our kernel on `inputs` into a NaN-poisoned output."""
    import torch

    _, compiled = _compiled(decode, shape, cfg)
    kernel = load_kernel(compiled, decode.geometry(cfg, shape).dynamic_smem)
    out = torch.full_like(inputs["q"], math.nan)
    decode.launcher(kernel, cfg, shape, inputs, out)()
    torch.cuda.synchronize()
    return out


def _ragged_inputs(decode, shape, lengths, seed=3):
    """`shape`'s inputs with a fresh scattered table for these lengths and NaN in every slot no sequence holds."""
    import torch

    from evotune.problems.decode import paginate

    inputs = decode.make_inputs(shape, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(shape.batch, shape.kv_heads, shape.seq_k, shape.head_dim, generator=gen, device="cuda")
    v = torch.randn(shape.batch, shape.kv_heads, shape.seq_k, shape.head_dim, generator=gen, device="cuda")
    dt = decode.torch_dtype(shape)
    cache = paginate(k.to(dt), v.to(dt), shape, seed, ragged=True)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    keep = torch.arange(shape.pages_per_seq * shape.page_size, device="cuda")[None, :] < lens[:, None].long()
    for name, dense in (("k", k), ("v", v)):
        rows = torch.full_like(cache[name], math.nan)
        flat = cache["block_table"].view(-1).long()
        full = torch.full((shape.batch, shape.pages_per_seq * shape.page_size, shape.kv_heads, shape.head_dim),
                          math.nan, dtype=dt, device="cuda")
        full[:, :shape.seq_k] = dense.transpose(1, 2).to(dt)
        full = torch.where(keep[..., None, None], full, torch.full((), math.nan, dtype=dt, device="cuda"))
        rows[flat] = full.view(-1, shape.page_size, shape.kv_heads, shape.head_dim)
        cache[name] = rows
    return {**inputs, **cache, "cache_seqlens": lens}


@pytest.mark.parametrize("shape_text, overrides, lengths", [
    # one long sequence and many short, length 1 among them; split and not
    ("8,32,8,4000,128:bf16:paged=16", {"splits": 8, "warps": 4, "vec": 8, "unroll": 2, "stages": 2},
     [4000, 1, 2, 3, 17, 16, 33, 1]),
    ("8,32,8,4000,128:bf16:paged=16", {"splits": 1, "warps": 8, "vec": 8, "unroll": 4, "stages": 4},
     [4000, 1, 2, 3, 17, 16, 33, 1]),
    ("6,64,8,3000,64:bf16:sinks:paged=64", {"splits": 16, "warps": 4, "vec": 8, "unroll": 2, "stages": 3, **ACQ_EVEN},
     [1, 3000, 64, 65, 127, 2]),
    ("4,32,8,4,2000,128:causal:sinks:paged=256", {"splits": 4, "warps": 4, "vec": 4, "unroll": 1, "stages": 2},
     [4, 2000, 257, 5]),
])
def test_ragged_lengths_match_the_reference(decode, dspace, shape_text, overrides, lengths):
    """Each sequence ends at its own cache_seqlens (a length of 1, a split with no key of a short sequence), NaN in
    every slot past them never reaches O, and the answer is the fp32 reference's within the gate's tolerance."""
    import torch

    shape, cfg = decode.parse_shape(shape_text), dspace.config(overrides)
    inputs = _ragged_inputs(decode, shape, lengths)
    out = _launch(decode, shape, cfg, inputs)
    ref = decode.reference(shape, inputs)
    atol, rtol = decode.tolerance(shape)
    assert not out.isnan().any()
    assert torch.allclose(out.float(), ref, atol=atol * decode.error_scale(inputs), rtol=rtol), \
        float((out.float() - ref).abs().max())


def test_paged_costs_the_same_answer_as_dense(decode, dspace):
    """The paged kernel on a scattered table gives the dense kernel's answer on the same keys, to rounding."""
    import torch

    from evotune.problems.decode import dense_kv

    paged = decode.parse_shape("2,32,8,3001,128:bf16:paged=16")
    dense = decode.parse_shape("2,32,8,3001,128:bf16")
    cfg = dspace.config({"splits": 8, "warps": 4, "vec": 8, "unroll": 2, "stages": 2})
    inputs = decode.make_inputs(paged, 7)
    k, v, _ = dense_kv(paged, inputs)
    a = _launch(decode, paged, cfg, inputs)
    b = _launch(decode, dense, cfg, {"q": inputs["q"], "k": k, "v": v, "scale": inputs["scale"]})
    assert torch.allclose(a.float(), b.float(), atol=2e-3, rtol=2e-3)


# ------------------------------------------------------------------ the ops


@pytest.fixture
def op_table(decode, dspace):
    """Use a decode table whose one entry routes `shape`'s key to `overrides`."""
    import torch

    from evotune.torch import decode as D

    def use(shape_text, overrides):
        shape = decode.parse_shape(shape_text)
        cfg = dspace.config(overrides)
        props = torch.cuda.get_device_properties(0)
        key = D.table_key(props.name, f"{props.major}.{props.minor}", shape)
        D.use_decode_table({"version": 1, "family": "attention-decode", "entries": [
            {"key": D.key_dict(key), "config": cfg.as_dict(), "route": "evotune", "reason": "test",
             "source_digest": instantiate(decode, cfg, shape).digest}]})
        D.clear()
        return shape

    yield use
    D.use_decode_table(None)
    D.clear()


def test_sinks_op_runs_our_kernel(decode, op_table):
    """decode_attention(sinks=) on a tuned key runs our kernel (nothing told), bf16 sinks cast to fp32, and matches the
    fp32 reference; without an entry for sinks the same tensors run the sink math, told once."""
    import torch

    from evotune.torch import decode as D
    from evotune.torch.routing import EvotuneFallbackWarning

    shape = op_table("1,64,8,4000,64:bf16:sinks", {"splits": 16, "warps": 4, "vec": 8, "unroll": 2, "stages": 2})
    inputs = decode.make_inputs(shape, seed=9)
    q, k, v, sinks = inputs["q"], inputs["k"], inputs["v"], inputs["sinks"]
    assert D.decode_route(q, k, v, sinks=sinks) == "evotune"
    with warnings.catch_warnings():
        warnings.simplefilter("error", EvotuneFallbackWarning)
        out = D.decode_attention(q, k, v, sinks=sinks)
        out16 = D.decode_attention(q, k, v, sinks=sinks.bfloat16())
    ref = decode.reference(shape, inputs)
    atol, rtol = decode.tolerance(shape)
    assert torch.allclose(out.float(), ref, atol=atol, rtol=rtol)
    assert torch.allclose(out16.float(), decode.reference(shape, {**inputs, "sinks": sinks.bfloat16().float()}),
                          atol=atol, rtol=rtol)
    with pytest.warns(EvotuneFallbackWarning, match="sink column"):
        D.decode_attention(q, torch.cat([k, k], 2), torch.cat([v, v], 2), sinks=sinks)


def test_paged_op_runs_our_kernel_on_ragged_lengths_and_in_a_graph(decode, op_table):
    """paged_decode_attention on a tuned key (its page size, max_seqlen's bucket) runs our kernel on ragged lengths,
    matches the reference, and replays in a CUDA graph with new lengths and contents."""
    import torch

    from evotune.torch import decode as D
    from evotune.torch.routing import EvotuneFallbackWarning

    shape = op_table("8,32,8,4000,128:bf16:paged=16", {"splits": 8, "warps": 4, "vec": 8, "unroll": 2, "stages": 2})
    inputs = _ragged_inputs(decode, shape, [4000, 1, 2, 3, 17, 16, 33, 1])
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["block_table"], inputs["cache_seqlens"])
    assert D.paged_decode_route(*args, max_seqlen=4000) == "evotune"
    with warnings.catch_warnings():
        warnings.simplefilter("error", EvotuneFallbackWarning)
        out = D.paged_decode_attention(*args, max_seqlen=4000)
    ref = decode.reference(shape, inputs)
    atol, rtol = decode.tolerance(shape)
    assert torch.allclose(out.float(), ref, atol=atol, rtol=rtol)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = D.paged_decode_attention(*args, max_seqlen=4000)
    fresh = _ragged_inputs(decode, shape, [5, 3999, 64, 1, 2, 100, 7, 3000], seed=11)
    for name in ("q", "k", "v", "block_table", "cache_seqlens"):
        inputs[name].copy_(fresh[name])
    captured.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(captured.float(), decode.reference(shape, fresh), atol=atol, rtol=rtol)


def test_paged_fallback_on_gpu_matches_the_reference(decode):
    """Without a table entry the paged op gathers the pages and runs SDPA (told once), right on ragged lengths."""
    import torch

    from evotune.torch import decode as D
    from evotune.torch.routing import EvotuneFallbackWarning

    D.use_decode_table({"version": 1, "family": "attention-decode", "entries": []})
    D.clear()
    try:
        shape = decode.parse_shape("4,32,8,4,2000,128:bf16:causal:paged=64")
        inputs = _ragged_inputs(decode, shape, [4, 2000, 257, 5])
        with pytest.warns(EvotuneFallbackWarning, match="pages gathered"):
            out = D.paged_decode_attention(inputs["q"], inputs["k"], inputs["v"], inputs["block_table"],
                                           inputs["cache_seqlens"])
        atol, rtol = decode.tolerance(shape)
        assert torch.allclose(out.float(), decode.reference(shape, inputs), atol=atol, rtol=rtol)
    finally:
        D.use_decode_table(None)
        D.clear()
