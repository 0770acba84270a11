"""The examples (examples/gemm, examples/rmsnorm) keep working: each family file loads, its default config compiles
for sm_90a with NVRTC (no GPU), its space admits configs on the default shape, and its reference passes the gate on
CPU tensors."""

from __future__ import annotations

import pytest

from evotune import testing
from evotune.build.compile import compile_source
from evotune.build.template import instantiate
from evotune.problems import allow_plugins, get_problem
from _paths import REPO_ROOT

EXAMPLES = {"gemm": ("examples/gemm/gemm.yaml", "M=32,N=48,K=16:bf16"),
            "rmsnorm": ("examples/rmsnorm/rmsnorm.yaml", "M=9,N=40:fp16")}


@pytest.fixture(params=sorted(EXAMPLES))
def example(request):
    file, small = EXAMPLES[request.param]
    path = REPO_ROOT / file
    allow_plugins([str(path)])
    return testing.on_cpu(get_problem(str(path))), small


def test_default_config_compiles_for_sm90a(example):
    """The space's default config on the family's default shape is admitted and compiles without spills."""
    problem, _ = example
    shape = problem.parse_shape(problem.default_shape)
    config = problem.space.default_config()
    assert problem.space.admitted(config, problem.context(shape))
    compiled = compile_source(instantiate(problem, config, shape).code, problem.entry_name)
    assert compiled.arch == "sm_90a" and compiled.resources.registers > 0 and compiled.resources.spill_stores == 0


def test_reference_passes_the_gate_on_cpu(example):
    """The example's inputs, outputs, reference and tolerance make a gate its reference passes."""
    problem, small = example
    check = testing.gate_on_cpu(problem, problem.parse_shape(small))
    assert check.passed, check


GPU_SHAPES = {"gemm": ["M=256,N=384,K=128:fp16", "M=128,N=256,K=256:bf16"],
              "rmsnorm": ["M=100,N=4096:fp16", "M=33,N=1000:bf16"]}


@pytest.mark.gpu
def test_sampled_configs_pass_the_gate_on_the_gpu(example):
    """Eight admitted configs of each example (the default first) pass the whole gate and are timed on the GPU, on
    two shapes each (both dtypes; rmsnorm with rows that end mid-CTA and a width that is no power of two)."""
    import random

    from evotune.gpu.evaluate import evaluate_compiled
    from evotune.records import result as R

    problem, _ = example
    problem = get_problem(problem.family)  # the family itself: inputs on the GPU
    for spec in GPU_SHAPES[problem.name]:
        shape = problem.parse_shape(spec)
        admitted = problem.space.admitted_configs(problem.context(shape))
        picked = [problem.space.default_config()] + random.Random(0).sample(admitted, min(7, len(admitted)))
        for config in picked:
            if not problem.space.admitted(config, problem.context(shape)):
                continue
            source = instantiate(problem, config, shape)
            res = evaluate_compiled(problem, shape, config, compile_source(source.code, source.entry), reps=5)
            assert res.status in (R.OK, R.PRUNED), (spec, config.as_dict(), res.message)
