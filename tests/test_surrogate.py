"""Tests for the default strategy, strategies.SurrogateSampler, and the loop's pacing (SearchOptions.paced:
the whole admitted space compiled at the start where it is cheap, and then one proposal asked ahead).

The sampler tests drive an Optuna study directly over attention-small's admitted configs on the mission shape,
with a synthetic objective; the loop tests compile real kernels (NVRTC, no GPU) with test_search's fake evaluator.
"""

from __future__ import annotations

import math
import random

import optuna
import pytest

from evotune.search import loop as S
from evotune.search.loop import SearchOptions
from evotune.search.strategies import SurrogateSampler
from evotune.records.runs import Run
from test_search import FakeEvaluator, TINY_SPACE

pytestmark = pytest.mark.usefixtures("runs_root")


@pytest.fixture(scope="module")
def attention_small():
    from evotune.space.searchspace import load_builtin

    return load_builtin("attention-small")


def additive_time(c: dict) -> float:
    """A landscape whose log is additive in the knob values (what the surrogate models), with its optimum at
    block_m 32, block_n 128, compute_warps 2, stages 4, swizzle."""
    return (5.0 * {32: 1.0, 64: 1.3, 128: 1.9}[c["block_m"]] * {32: 1.5, 64: 1.2, 128: 1.0}[c["block_n"]]
            * {2: 1.0, 4: 1.1, 8: 1.4}[c["compute_warps"]] * {2: 1.1, 3: 1.05, 4: 1.0}[c["stages"]]
            * (1.0 if c["smem_layout"] == "swizzle" else 1.2) * (1.0 + 0.01 * c["producer_warps"]))


def drive(sampler, space, admitted, objective, n: int) -> list[float]:
    """Ask and tell `n` trials one at a time; the times in ask order."""
    study = optuna.create_study(directions=["minimize", "minimize"], sampler=sampler)
    dists = S.distributions(space)
    times = []
    for _ in range(n):
        trial = study.ask(dists)
        config = space.config(trial.params)
        assert config in admitted
        t = objective(config.as_dict())
        study.tell(trial, [t, 1e-3])
        times.append(t)
    return times


def test_surrogate_proposes_admitted_untaken_configs_until_the_space_is_exhausted(attention, attention_small, mission):
    context = attention.context(mission)
    admitted = attention_small.admitted_configs(context)
    seen: set[str] = set()
    sampler = S.make_sampler("surrogate", 16, 0, space=attention_small, admitted=admitted,
                             taken=lambda digest: digest in seen)
    assert isinstance(sampler, SurrogateSampler)
    study = optuna.create_study(directions=["minimize", "minimize"], sampler=sampler)
    dists = S.distributions(attention_small)
    for _ in range(len(admitted)):
        trial = study.ask(dists)
        config = attention_small.config(trial.params)
        assert config in admitted and config.digest() not in seen
        seen.add(config.digest())
        study.tell(trial, [additive_time(config.as_dict()), 1e-3])
    assert len(seen) == len(admitted)


def test_surrogate_finds_an_additive_optimum_in_a_few_evaluations(attention, attention_small, mission):
    """On a landscape the model can represent, the surrogate comes within 3% of the optimum of hundreds of configs
    (the criterion docs/EFFICIENCY.md counts) within a couple of dozen evaluations for nearly every seed (19 of
    seeds 0-19 when written); random search over the same space, at the same budget, mostly does not."""
    context = attention.context(mission)
    admitted = attention_small.admitted_configs(context)
    optimum = min(additive_time(c.as_dict()) for c in admitted)
    budget = 24
    assert len(admitted) > 10 * budget
    hits = []
    for seed in range(10):
        taken: set[str] = set()
        sampler = SurrogateSampler(admitted, S.distributions(attention_small), lambda d: d in taken, seed=seed)
        times = drive(sampler, attention_small, admitted,
                      lambda c: (taken.add(attention_small.config(c).digest()), additive_time(c))[1], budget)
        hits.append(min(times) <= 1.03 * optimum)
    # Random search at the same budget: 24 distinct admitted configs drawn uniformly.
    random_hits = [min(additive_time(c.as_dict()) for c in random.Random(seed).sample(admitted, budget))
                   <= 1.03 * optimum for seed in range(10)]
    assert sum(hits) >= 8 and sum(random_hits) <= 4, (hits, random_hits)


def test_surrogate_prediction_recovers_an_additive_ranking(attention, attention_small, mission):
    context = attention.context(mission)
    admitted = attention_small.admitted_configs(context)
    sampler = SurrogateSampler(admitted, S.distributions(attention_small), lambda d: False, ridge=1e-6, explore=0.0)

    class Done:
        def __init__(self, c):
            self.params, self.values = c.as_dict(), [additive_time(c.as_dict())]

    predicted = sampler.predict([Done(c) for c in admitted[::3]])
    actual = [math.log(additive_time(c.as_dict())) for c in admitted]
    assert max(abs(p - a) for p, a in zip(predicted, actual)) < 1e-6


def test_surrogate_random_draws_pick_the_variant_first(attention):
    """Before the model has data, a variant with few admitted configs is drawn as often as one with many."""
    from evotune.problems.shapes import parse_shape
    from evotune.space.searchspace import load_builtin

    space = load_builtin("attention")
    shape = parse_shape("mission")
    # Every 8th admitted config: the variants' shares as in all 114,080, at an eighth of the 40 samplers' setup cost
    # (each takes the digest and columns of every config it is given; 97 s in all on CI's 2 cores, issue 38).
    # The 1-4 stage configs only: the deep ring (stages 5-8, wgmma's alone) would bring the slices closer than this
    # test's premise, one variant with at most half the configs of the other.
    admitted = [c for c in space.admitted_configs(attention.context(shape)) if c["stages"] <= 4][::8]
    counts = {}
    for c in admitted:
        counts[c[space.variant]] = counts.get(c[space.variant], 0) + 1
    # The wgmma slice is 26% of the mission shape's admitted configs (29760 of 114080; on gpt2 34% since the 256-row
    # tile, 26% since the p_operand knob, 19% before it).
    assert len(counts) > 1 and min(counts.values()) * 2 < max(counts.values())
    drawn = {}
    for seed in range(40):
        sampler = SurrogateSampler(admitted, S.distributions(space), lambda d: False, seed=seed, variant=space.variant)
        study = optuna.create_study(directions=["minimize", "minimize"], sampler=sampler)
        value = space.config(study.ask(S.distributions(space)).params)[space.variant]
        drawn[value] = drawn.get(value, 0) + 1
    # Drawn in proportion to the admitted configs, the smaller variant would take about 10 of the 40 draws.
    assert set(drawn) == set(counts) and min(drawn.values()) >= 14


def test_default_strategy_is_the_surrogate():
    assert SearchOptions().sampler == "surrogate" and S.SAMPLERS[0] == "surrogate"


def test_pacing_precompiles_small_spaces_and_asks_one_ahead():
    """16 workers: attention-hopper on gpt2 (126 configs, ~4 s of compiles) is compiled at the start and paced 2
    ahead; attention-small on mission (456, ~14 s) is not, and keeps one round of the pool ahead. An explicit
    --lookahead is kept, and so is precompile off."""
    options = SearchOptions(compile_workers=16)
    assert options.lookahead == 16
    assert options.precompiles(126) and options.paced(126) == 2
    assert not options.precompiles(456) and options.paced(456) == 16
    two = SearchOptions(compile_workers=2)  # 126 configs are 31 s of compiles on 2 CPUs: not at the start
    assert not two.precompiles(126) and two.paced(126) == 2
    explicit = SearchOptions(compile_workers=16, lookahead=8)
    assert not explicit.precompiles(126) and explicit.paced(126) == 8
    assert SearchOptions(compile_workers=16, precompile=False).paced(126) == 16
    forced = SearchOptions(compile_workers=16, lookahead=8, precompile=True)
    assert forced.precompiles(456) and forced.paced(456) == 8
    assert not SearchOptions(compile_workers=16, lookahead=0, precompile=True).precompiles(2)  # serial: no pool
    assert SearchOptions(compile_workers=16, sampler="nsga2", population=8).lookahead == 8


@pytest.fixture()
def tiny(tmp_path):
    from evotune.space.searchspace import load_space

    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_SPACE)
    return load_space(path)


def test_a_precompiled_search_compiles_each_config_once_and_records_them(attention, tiny, mission):
    """Real NVRTC compiles in the pool, submitted at the start; each config's compile is used by its trial."""
    run = Run.create("pre", {"shape_spec": "mission"})
    loop = S.SearchLoop(attention, tiny, mission, run, FakeEvaluator(tiny, attention.context(mission)),
                        SearchOptions(trials=2, compile_workers=2, precompile=True))
    summary = loop.run().as_dict()
    assert summary["precompiled"] and summary["lookahead"] == 2
    assert loop.precompiled == {}  # both configs' compiles were taken by their trials, none compiled twice
    assert "precompile the space" in loop.timeline.as_dict()["phases"]
    records = run.trials()
    assert len(records) == 2 and {r["result"]["status"] for r in records} == {"ok"}
    assert len({r["digest"] for r in records}) == 2
