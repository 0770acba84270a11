"""GPU tests of the decode kernel's variants (kernels/decode/variants.cuh: kv_load bulk, combine acq_rel,
split_chunks even): the family's full gate on long and short caches, GQA groups 4 and 8, Sq 1 and 4, d64 and d128,
fp16 and bf16, dense and strided caches; bitwise twins where a variant must not change the arithmetic; repeated
launches of the acquire-release counter. Run on the H100 or H200 (`python -m pytest -m gpu`)."""

from __future__ import annotations

import random

import pytest

from evotune.build.compile import compile_source, load_kernel
from evotune.build.template import instantiate
from evotune.records import result as R

pytestmark = pytest.mark.gpu

BULK = {"kv_load": "bulk", "combine": "acq_rel", "split_chunks": "even"}

# (shape, config): each variant alone and together; Sk never a multiple of a split's keys nor of the tile, so the
# last tile of the last split runs past the cache's end (bulk's clamped rows) and splits end inside tiles.
CASES = [
    # long caches, GQA group 4, Sq 1 (the Llama-3-8B decode step)
    ("1,32,8,16383,128:bf16", {"splits": 16, "warps": 8, "vec": 8, "unroll": 4, "stages": 4, **BULK}),
    ("1,32,8,16416,128", {"splits": 16, "warps": 4, "vec": 8, "unroll": 4, "stages": 8, "kv_load": "bulk"}),
    ("1,32,8,16383,128", {"splits": 32, "warps": 4, "vec": 8, "unroll": 2, "stages": 3, "combine": "acq_rel"}),
    ("1,32,8,2080,128", {"splits": 16, "warps": 8, "vec": 8, "unroll": 2, "stages": 3, "split_chunks": "even"}),
    # short caches; GQA group 8 (rows 8); one split
    ("1,32,8,300,128:bf16", {"splits": 4, "warps": 4, "vec": 8, "unroll": 2, "stages": 2, **BULK}),
    ("2,32,4,1000,128", {"splits": 8, "warps": 4, "vec": 8, "unroll": 2, "stages": 3, **BULK}),
    ("2,32,4,5001,128:bf16", {"splits": 1, "warps": 4, "vec": 8, "unroll": 2, "stages": 4, "kv_load": "bulk"}),
    ("3,8,1,777,64", {"splits": 4, "warps": 2, "vec": 8, "unroll": 2, "stages": 3, **BULK}),
    # Sq 4, bottom-right causal: GQA 4 (16 rows) and 8 (32 query heads over 4: 32 rows is too many, so 16 over 2)
    ("1,32,8,4,2049,128:bf16:causal", {"splits": 4, "warps": 4, "vec": 4, "unroll": 1, "stages": 3, **BULK}),
    ("2,16,8,4,4097,64:causal", {"splits": 8, "warps": 4, "vec": 8, "unroll": 1, "stages": 4, **BULK}),
    ("1,16,2,2,1500,128:bf16:causal", {"splits": 8, "warps": 4, "vec": 4, "unroll": 2, "stages": 2, **BULK}),
    # a (B, S, H, D) cache: rows are not dense along the keys, so bulk copies one row a lane
    ("2,8,1,777,128:bf16:bshd", {"splits": 4, "warps": 4, "vec": 8, "unroll": 1, "stages": 3, **BULK}),
    ("1,32,8,3000,128:bshd", {"splits": 8, "warps": 4, "vec": 8, "unroll": 4, "stages": 4, "kv_load": "bulk"}),
]


def _evaluate(problem, shape, cfg, **kw):
    from evotune.gpu.evaluate import evaluate_compiled

    src = instantiate(problem, cfg, shape)
    return evaluate_compiled(problem, shape, cfg, compile_source(src.code, src.entry), **kw)


@pytest.mark.parametrize("shape_text, overrides", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_variant_cases_pass_the_gate(decode, dspace, shape_text, overrides):
    """Each variant case passes the full gate (poisoned output, stress inputs, the dependency check) with no NaN."""
    shape, cfg = decode.parse_shape(shape_text), dspace.config(overrides)
    assert dspace.admitted(cfg, decode.context(shape)), dspace.violations(cfg, decode.context(shape))
    res = _evaluate(decode, shape, cfg, time_it=False)
    assert res.status == R.OK, (shape_text, cfg.key(), res.status, res.message)
    assert res.verification["nonfinite"] == 0 and res.verification["gate_ratio"] <= 1.0


def test_sampled_variant_configs_pass_the_gate(decode, dspace):
    """A seeded sample of the admitted variant configs on a ragged Llama-like decode shape passes the gate."""
    shape = decode.parse_shape("2,32,8,3001,128:bf16")
    variants = [c for c in dspace.admitted_configs(decode.context(shape))
                if (c["kv_load"], c["combine"], c["split_chunks"]) != ("cp_async", "fenced", "ceil")]
    for cfg in random.Random(41).sample(variants, 8):
        res = _evaluate(decode, shape, cfg, time_it=False)
        assert res.status == R.OK, (cfg.key(), res.status, res.message)


def _outputs(decode, dspace, shape, overrides, launches: int = 3, seed: int = 5):
    """The outputs of `launches` launches of one kernel and one workspace (NaN-poisoned before each)."""
    import torch

    cfg = dspace.config(overrides)
    src = instantiate(decode, cfg, shape)
    kernel = load_kernel(compile_source(src.code, src.entry), decode.geometry(cfg, shape).dynamic_smem)
    inputs = decode.make_inputs(shape, seed=seed)
    out = torch.empty_like(inputs["q"])
    launch = decode.launcher(kernel, cfg, shape, inputs, out)
    outs = []
    for _ in range(launches):
        out.fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        outs.append(out.clone())
    return inputs, outs


@pytest.mark.parametrize("shape_text", ["1,32,8,5000,128:bf16", "2,8,1,777,64:bshd", "1,32,8,4,2049,128:causal"])
def test_bulk_ring_is_the_cp_async_ring_bit_for_bit(decode, dspace, shape_text):
    """kv_load only moves the bytes: bulk and cp_async give the same bits (same tiles, same arithmetic order)."""
    import torch

    shape = decode.parse_shape(shape_text)
    base = {"splits": 8, "warps": 4, "vec": 4 if shape.rows > 8 else 8, "unroll": 1, "stages": 3}
    _, ours = _outputs(decode, dspace, shape, {**base, "kv_load": "bulk"}, launches=1)
    _, theirs = _outputs(decode, dspace, shape, base, launches=1)
    assert torch.equal(ours[0], theirs[0]) and not ours[0].isnan().any()


@pytest.mark.parametrize("overrides", [
    {"splits": 16, "warps": 8, "vec": 8, "unroll": 4, "stages": 4, **BULK},
    {"splits": 64, "warps": 4, "vec": 8, "unroll": 1, "stages": 2, "combine": "acq_rel"},
])
def test_acq_rel_launches_repeat_bitwise_and_match_sdpa(decode, dspace, overrides):
    """combine = acq_rel launched three times on one workspace (its counter left zero by the last CTA) gives the same
    bits each time, close to SDPA's GQA."""
    import torch
    import torch.nn.functional as F

    shape = decode.parse_shape("1,32,8,5000,128:bf16")
    inputs, outs = _outputs(decode, dspace, shape, overrides)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2]) and not outs[0].isnan().any()
    ref = F.scaled_dot_product_attention(inputs["q"], inputs["k"], inputs["v"], enable_gqa=True)
    assert torch.allclose(outs[0].float(), ref.float(), atol=2e-2, rtol=2e-2)
