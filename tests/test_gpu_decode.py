"""GPU tests of the decode attention family: the full gate (NaN-poisoned output, stress inputs, the dependency
check) on ragged caches, GQA 32/8 and 8/1, Sq 1 and 4, fp16 and bf16; run on the H100 (`python -m pytest -m gpu`)."""

from __future__ import annotations

import random

import pytest

from evotune.build.compile import compile_source
from evotune.build.template import instantiate
from evotune.problems import get_problem
from evotune.records import result as R
from evotune.space.searchspace import load_builtin

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def decode():
    return get_problem("attention-decode")


@pytest.fixture(scope="module")
def dspace():
    return load_builtin("attention-decode")


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
    ("1,12,12,1025,64:bf16", {"splits": 16, "warps": 2, "vec": 4, "unroll": 2, "stages": 2}),
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
    outs = []
    for _ in range(2):
        out = torch.full_like(inputs["q"], float("nan"))
        decode.launcher(kernel, cfg, shape, inputs, out)()
        torch.cuda.synchronize()
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and not outs[0].isnan().any()
    ref = F.scaled_dot_product_attention(inputs["q"], inputs["k"], inputs["v"], enable_gqa=True)
    assert torch.allclose(outs[0].float(), ref.float(), atol=2e-2, rtol=2e-2)
