"""GPU tests of the row softmax family: run on the H100 (`python -m pytest -m gpu`); skipped where no GPU is visible."""

from __future__ import annotations

import random

import pytest

from evotune.records import result as R
from evotune.build.compile import compile_source
from evotune.problems import get_problem
from evotune.space.searchspace import load_builtin
from evotune.build.template import instantiate

pytestmark = pytest.mark.gpu

# Ragged: one row, one column, cols below / just past a vector, odd cols (no row start aligned), a vocabulary.
SHAPES = ["1,1", "3,7:bf16", "17,2", "37,1003", "129,4097:bf16", "5,50257", "1000,128", "2,33:bf16", "300,1024"]


@pytest.fixture(scope="module")
def softmax():
    return get_problem("softmax")


@pytest.fixture(scope="module")
def sspace():
    return load_builtin("softmax")


def _sample(sspace, n=24, seed=2026):
    """A seeded sample of the space's configs (before constraints: each shape skips those it does not admit),
    plus one of each (strategy, vec) pair with every row width."""
    configs = random.Random(seed).sample(list(sspace.all_configs()), n)
    for strategy in ("cached", "online", "three_pass"):
        for vec, tpr, rows in ((8, 32, 4), (4, 256, 1), (2, 8, 16)):
            configs.append(sspace.config({"strategy": strategy, "vec": vec, "threads_per_row": tpr, "rows_per_cta": rows,
                                          "unroll": 1 if strategy == "cached" else 2}))
    return configs


def _evaluate(problem, shape, cfg, **kw):
    from evotune.gpu.evaluate import evaluate_compiled

    src = instantiate(problem, cfg, shape)
    return evaluate_compiled(problem, shape, cfg, compile_source(src.code, src.entry), **kw)


@pytest.mark.parametrize("shape_text", SHAPES)
def test_sampled_configs_match_reference(softmax, sspace, shape_text):
    """Every sampled config the space admits on a ragged shape passes the full gate (stress inputs, dependency)."""
    shape = softmax.parse_shape(shape_text)
    ctx = softmax.context(shape)
    checked = 0
    for cfg in _sample(sspace):
        if not sspace.admitted(cfg, ctx):
            continue
        res = _evaluate(softmax, shape, cfg, time_it=False)
        assert res.status == R.OK, (cfg.key(), res.status, res.message)
        assert res.verification["nonfinite"] == 0 and res.verification["gate_ratio"] <= 1.0
        assert res.verification["dependency"].endswith("bitwise unchanged"), res.verification["dependency"]
        checked += 1
    assert checked >= 5


def test_evaluate_compiled_times_the_default(softmax, sspace):
    """The default config on softmax-1k passes and is timed (median inside p10..p90)."""
    shape = softmax.parse_shape("softmax-1k")
    res = _evaluate(softmax, shape, sspace.default_config(), reps=5)
    assert res.status == R.OK, res.message
    assert res.time_us > 0 and res.timing["p10_us"] <= res.time_us <= res.timing["p90_us"]


@pytest.mark.parametrize("shape_text", ["softmax-1k", "37,1003:bf16"])
def test_baselines_measure(softmax, shape_text):
    """torch.softmax is measured like a candidate and passes the gate."""
    from evotune.gpu.evaluate import measure_baselines

    report = measure_baselines(softmax, softmax.parse_shape(shape_text), reps=5)
    assert set(report) == {"softmax"}
    b = report["softmax"]
    assert b["available"] and b["time_us"] > 0
    assert b["verification"]["passed"] and b["verification"]["gate_ratio"] <= 1.0


def test_bitwise_deterministic(softmax, sspace):
    """100 launches of a multi-warp online config give bitwise identical outputs."""
    from evotune.build.compile import load_kernel
    from evotune.gpu.evaluate import check_determinism, kernel_runner

    shape = softmax.parse_shape("129,4097:bf16")
    cfg = sspace.config({"strategy": "online", "threads_per_row": 256, "unroll": 2})
    src = instantiate(softmax, cfg, shape)
    kernel = load_kernel(compile_source(src.code, src.entry))
    ok, detail = check_determinism(softmax, shape, kernel_runner(softmax, shape, cfg, kernel), launches=100)
    assert ok, detail


def test_gate_catches_a_wrong_kernel(softmax, sspace):
    """A cached kernel whose normaliser is 1% off fails the gate instead of passing."""
    from evotune.gpu.evaluate import evaluate_compiled

    shape = softmax.parse_shape("300,1024")
    cfg = sspace.config({"strategy": "cached", "threads_per_row": 128})
    src = instantiate(softmax, cfg, shape)
    wrong = src.code.replace("o[k] = c[j][k] * inv_s;", "o[k] = c[j][k] * inv_s * 1.01f;")
    assert wrong != src.code
    res = evaluate_compiled(softmax, shape, cfg, compile_source(wrong, src.entry), time_it=False)
    assert res.status == R.WRONG, res.message


def test_worker_evaluates_and_measures_baselines(softmax, sspace):
    """A GPU worker process rebuilds the softmax shape from its dict, evaluates a candidate and measures torch.softmax."""
    from evotune.search.loop import worker_evaluator
    from evotune.gpu.workers import GPUWorker

    shape = softmax.parse_shape("64,1003:bf16")
    cfg = sspace.config({"strategy": "three_pass", "threads_per_row": 32, "rows_per_cta": 4, "vec": 4})
    src = instantiate(softmax, cfg, shape)
    compiled = compile_source(src.code, src.entry)
    with GPUWorker(timeout_s=300) as worker:
        res = worker_evaluator(worker, softmax, shape, reps=5)(cfg, compiled)
        base = worker.call({"kind": "baselines", "family": "softmax", "shape": shape.as_dict(), "reps": 5}, timeout_s=300)
    assert res.status == R.OK, res.message
    assert base["softmax"]["available"] and base["softmax"]["verification"]["passed"]
