"""GPU tests of the decode attention family: the full gate (NaN-poisoned output, stress inputs, the dependency
check) on ragged caches, GQA 32/8 and 8/1, Sq 1 and 4, fp16 and bf16, head dims 64, 96, 128 and 256; run on the H100 (`python -m pytest -m gpu`)."""

from __future__ import annotations

import random

import pytest

from evotune.build.compile import compile_source
from evotune.build.template import instantiate
from evotune.records import result as R

pytestmark = pytest.mark.gpu


def _evaluate(problem, shape, cfg, **kw):
    from evotune.gpu.evaluate import evaluate_compiled

    src = instantiate(problem, cfg, shape)
    return evaluate_compiled(problem, shape, cfg, compile_source(src.code, src.entry), **kw)


# (shape, config): Sk never a multiple of the split's keys nor of the tile.
CASES = [
    ("1,32,8,1000,128:bf16", {"splits": 8, "warps": 4, "vec": 8, "unroll": 2, "stages": 2}),
    ("1,32,8,16383,128:bf16", {"splits": 32, "warps": 4, "vec": 8, "unroll": 4, "stages": 3}),
    ("3,8,1,777,64", {"splits": 4, "warps": 2, "vec": 8, "unroll": 2, "stages": 2}),
    ("2,8,1,777,128:bf16:bshd", {"splits": 1, "warps": 8, "vec": 8, "unroll": 1, "stages": 1}),
    ("1,32,8,4,2049,128:bf16:causal", {"splits": 4, "warps": 4, "vec": 4, "unroll": 1, "stages": 2}),
    ("2,32,8,4,33,128:causal", {"splits": 2, "warps": 1, "vec": 4, "unroll": 1, "stages": 4}),
    ("1,12,12,1025,64:bf16", {"splits": 8, "warps": 2, "vec": 4, "unroll": 2, "stages": 2}),
    # Head dim 96 (Phi-3: 32 on 32) in the lanes of 128, the last 4 (vec 8) or 8 (vec 4) of each key's lanes idle.
    ("1,32,32,2081,96", {"splits": 8, "warps": 4, "vec": 8, "unroll": 2, "stages": 2}),
    ("2,32,8,3001,96:bf16:bshd", {"splits": 4, "warps": 4, "vec": 4, "unroll": 2, "stages": 3, "kv_load": "bulk"}),
    ("1,32,8,4,999,96:causal", {"splits": 2, "warps": 2, "vec": 4, "unroll": 1, "stages": 2}),
    # Head dim 256 (Gemma-2's 8 on 4): a key's row is a whole warp.
    ("1,8,4,777,256:bf16", {"splits": 4, "warps": 4, "vec": 8, "unroll": 2, "stages": 2}),
    ("2,8,4,4097,256", {"splits": 16, "warps": 8, "vec": 8, "unroll": 1, "stages": 2, "kv_load": "bulk",
                        "combine": "acq_rel", "split_chunks": "even"}),
]


@pytest.mark.parametrize("shape_text, overrides", CASES, ids=[c[0] for c in CASES])
def test_cases_pass_the_gate(decode, dspace, shape_text, overrides):
    """Each case passes the full gate against the fp32 reference, with no NaN and within tolerance."""
    shape, cfg = decode.parse_shape(shape_text), dspace.config(overrides)
    assert dspace.admitted(cfg, decode.context(shape)), dspace.violations(cfg, decode.context(shape))
    res = _evaluate(decode, shape, cfg, time_it=False)
    assert res.status == R.OK, (shape_text, cfg.key(), res.status, res.message)
    assert res.verification["nonfinite"] == 0 and res.verification["gate_ratio"] <= 1.0


def test_sampled_configs_pass_the_gate(decode, dspace):
    """A seeded sample of the configs admitted on a ragged Llama-like decode shape passes the gate."""
    shape = decode.parse_shape("2,32,8,3001,128:bf16")
    for cfg in random.Random(41).sample(dspace.admitted_configs(decode.context(shape)), 10):
        res = _evaluate(decode, shape, cfg, time_it=False)
        assert res.status == R.OK, (cfg.key(), res.status, res.message)


def test_split_launches_repeat_bitwise_and_match_sdpa(decode, dspace):
    """A split launch run twice (the counter it leaves zero is reused) gives the same bits, close to SDPA's GQA."""
    import torch
    import torch.nn.functional as F

    from evotune.build.compile import load_kernel

    shape = decode.parse_shape("1,32,8,5000,128:bf16")
    cfg = dspace.config({"splits": 16, "warps": 4, "vec": 8, "unroll": 2, "stages": 2})
    src = instantiate(decode, cfg, shape)
    kernel = load_kernel(compile_source(src.code, src.entry), decode.geometry(cfg, shape).dynamic_smem)
    inputs = decode.make_inputs(shape, seed=5)
    out = torch.empty_like(inputs["q"])
    launch = decode.launcher(kernel, cfg, shape, inputs, out)  # one workspace: its counters serve every launch
    outs = []
    for _ in range(3):
        out.fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        outs.append(out.clone())
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2]) and not outs[0].isnan().any()
    ref = F.scaled_dot_product_attention(inputs["q"], inputs["k"], inputs["v"], enable_gqa=True)
    assert torch.allclose(outs[0].float(), ref.float(), atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------ the op (evotune.torch.decode)


def _table_for(decode, dspace, shape, overrides) -> dict:
    """A decode table whose one entry routes `shape`'s key to `overrides` (as if a bench had shown it faster)."""
    import torch

    from evotune.torch import decode as D

    cfg = dspace.config(overrides)
    props = torch.cuda.get_device_properties(0)
    key = D.table_key(props.name, f"{props.major}.{props.minor}", shape)
    return {"version": 1, "family": "attention-decode", "entries": [
        {"key": dict(zip(D.KEY_FIELDS, key)), "config": cfg.as_dict(), "route": "evotune", "reason": "test",
         "source_digest": instantiate(decode, cfg, shape).digest}]}


@pytest.fixture
def op_table(decode, dspace):
    from evotune.torch import decode as D

    def use(shape_text, overrides):
        shape = decode.parse_shape(shape_text)
        D.use_decode_table(_table_for(decode, dspace, shape, overrides))
        D.clear()
        return shape

    yield use
    D.use_decode_table(None)
    D.clear()


@pytest.mark.parametrize("shape_text, overrides", [
    ("1,32,8,3000,128:bf16", {"splits": 16, "warps": 4, "vec": 8, "unroll": 2, "stages": 2}),
    ("2,32,8,4,1500,128:causal", {"splits": 4, "warps": 4, "vec": 4, "unroll": 1, "stages": 2}),
])
def test_op_runs_our_kernel_where_the_table_says(decode, op_table, shape_text, overrides):
    """A tuned key runs our kernel (no fallback told) and matches the fp32 reference; an untuned length runs SDPA,
    told once."""
    import warnings

    import torch

    from evotune.torch import decode as D
    from evotune.torch.routing import EvotuneFallbackWarning

    shape = op_table(shape_text, overrides)
    inputs = decode.make_inputs(shape, seed=9)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    assert D.decode_route(q, k, v, shape.causal) == "evotune"
    with warnings.catch_warnings():
        warnings.simplefilter("error", EvotuneFallbackWarning)
        out = D.decode_attention(q, k, v, causal=shape.causal)
    ref = decode.reference(shape, inputs)
    atol, rtol = decode.tolerance(shape)
    assert torch.allclose(out.float(), ref, atol=atol, rtol=rtol) and out.stride() == q.stride()
    # A shorter cache in the same length bucket: the same decision and kernel, the right answer at its length.
    cut = shape.seq_k * 3 // 4
    short = {**inputs, "k": k[:, :, :cut], "v": v[:, :, :cut]}
    from dataclasses import replace

    out = D.decode_attention(q, short["k"], short["v"], causal=shape.causal)
    assert torch.allclose(out.float(), decode.reference(replace(shape, seq_k=cut), short), atol=atol, rtol=rtol)
    longer = torch.cat([k, k], dim=2), torch.cat([v, v], dim=2)  # another K/V-length bucket: not tuned
    with pytest.warns(EvotuneFallbackWarning, match="untuned decode key"):
        D.decode_attention(q, *longer, causal=shape.causal)


def test_op_is_captured_in_a_cuda_graph(decode, op_table):
    """After one eager call the op captures into a CUDA graph; replays on new cache contents give the new answer."""
    import torch

    from evotune.torch import decode as D

    shape = op_table("1,32,8,2048,128:bf16", {"splits": 16, "warps": 4, "vec": 8, "unroll": 2, "stages": 2})
    inputs = decode.make_inputs(shape, seed=1)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    D.decode_attention(q, k, v)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = D.decode_attention(q, k, v)
    fresh = decode.make_inputs(shape, seed=2)
    for name in ("q", "k", "v"):
        inputs[name].copy_(fresh[name])
    out.fill_(float("nan"))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    atol, rtol = decode.tolerance(shape)
    assert torch.allclose(out.float(), decode.reference(shape, fresh), atol=atol, rtol=rtol)
