"""Tests for evotune.search.warmstart and the warm start of run_search: which earlier runs and configs seed a new
search, and that the seeds are its first proposals, once, and only those admitted on the new shape.

The searches compile nothing and keep their study in memory (see test_strategies.MemoryRun).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from evotune.records import result as R
from evotune.cli.search import warm_start_configs
from evotune.errors import UsageError
from evotune.records.runs import Run
from evotune.search.loop import SearchOptions, run_search
from evotune.space.searchspace import load_builtin
from evotune.search.warmstart import admitted, configs_from, pick_runs, similar, with_new_knobs
from test_strategies import MemoryRun, fake_compiler, model_evaluate


# Every test here writes runs into a temporary EVOTUNE_RUNS (conftest.runs_root).
pytestmark = pytest.mark.usefixtures("runs_root")

@pytest.fixture(scope="module")
def attention_small():
    return load_builtin("attention-small")


def recorded_run(name: str, shape_dict: dict, results: list[tuple[dict, float | None]], family: str = "attention") -> Run:
    """A finished run whose trials passed with the given times (None: failed the gate)."""
    from evotune.space.searchspace import Config

    run = Run.create(name, {"family": family, "shape": shape_dict, "shape_spec": name})
    for number, (config, t) in enumerate(results):
        result = {"status": R.OK if t is not None else R.WRONG, "message": "", "time_us": t,
                  "max_abs": 1e-3 if t is not None else 0.5}
        run.append_trial({"number": number, "config": config, "digest": Config.from_dict(config).digest(),
                          "counted": True, "result": result})
    return run


def test_similar_shapes(attention, mission):
    """Shapes are similar when only the amount of work differs (batch, heads, sequence lengths)."""
    a = mission.as_dict()
    assert similar(attention, a, {**a, "batch": 4, "seq_q": 2048, "seq_k": 2048})
    assert not similar(attention, a, {**a, "head_dim": 128})
    assert not similar(attention, a, {**a, "dtype": "bf16"})
    assert not similar(attention, a, {**a, "causal": True})


def test_auto_picks_same_then_similar_shapes(attention, attention_small, mission):
    """`auto` takes the runs of the same family on the same shape (fastest first), then on similar shapes, and
    skips other head dims, other families, and runs with nothing that passed."""
    configs = [c.as_dict() for c in attention_small.admitted_configs(attention.context(mission))[:12]]
    same = mission.as_dict()
    recorded_run("same-slow", same, [(configs[0], 9.0)])
    recorded_run("same-fast", same, [(configs[1], 7.0), (configs[2], 8.0)])
    recorded_run("bigger", {**same, "batch": 8}, [(configs[3], 5.0)])
    recorded_run("d128", {**same, "head_dim": 128}, [(configs[4], 1.0)])
    recorded_run("softmax", {"rows": 4, "cols": 8, "dtype": "fp16"}, [({"block": 1}, 1.0)], family="softmax")
    recorded_run("nothing-passed", same, [(configs[5], None)])
    picked = pick_runs("auto", attention, mission)
    assert [s.run.run_id for s in picked] == ["same-fast", "same-slow", "bigger"]
    assert [s.same_shape for s in picked] == [True, True, False]
    assert pick_runs("auto", attention, mission, exclude="same-fast")[0].run.run_id == "same-slow"
    named = pick_runs("bigger,same-slow", attention, mission)
    assert [s.run.run_id for s in named] == ["bigger", "same-slow"]  # named runs keep their order
    with pytest.raises(UsageError, match="no trial that passed"):
        pick_runs("nothing-passed", attention, mission)
    with pytest.raises(UsageError, match="family 'softmax'"):
        pick_runs("softmax", attention, mission)
    with pytest.raises(UsageError, match="no run named"):
        pick_runs("no-such-run", attention, mission)


def test_configs_from_takes_each_runs_front_and_fastest(attention, attention_small, mission):
    """Each run gives its Pareto front and its fastest passing configs, fastest first, each config once."""
    configs = [c.as_dict() for c in attention_small.admitted_configs(attention.context(mission))[:12]]
    a = recorded_run("a", mission.as_dict(), [(configs[i], 10.0 + i) for i in range(10)] + [(configs[10], None)])
    b = recorded_run("b", mission.as_dict(), [(configs[1], 3.0), (configs[11], 4.0)])
    sources = pick_runs("a,b", attention, mission)
    out = configs_from(sources, per_run=3)
    assert out == [configs[0], configs[1], configs[2], configs[11]]  # b's configs[1] is a's already
    assert configs_from(sources, per_run=3, limit=2) == out[:2]
    assert a.run_id == "a" and b.run_id == "b"


def test_inadmissible_warm_configs_are_dropped_with_a_note(attention, attention_small, mission):
    """Configs the new space does not admit on the new shape, or does not have at all, are dropped, each with a note."""
    context = attention.context(mission)
    good = attention_small.admitted_configs(context)[0].as_dict()
    violating = next(c for c in attention_small.all_configs() if not attention_small.admitted(c, context)).as_dict()
    foreign = {**good, "q_in_regs": False}          # a value attention-small does not have
    keep, notes = admitted(attention_small, context, [good, violating, foreign, good])
    assert [c.as_dict() for c in keep] == [good]
    assert len(notes) == 2
    assert "not admitted here" in notes[0] and "not in this space" in notes[1] and "q_in_regs" in notes[1]


def test_warm_configs_meet_a_knob_their_runs_lacked(attention, attention_small, mission):
    """Into a space with a knob the source run's space omitted (attention-small-pdl.yaml's pdl over attention-small's
    configs), each of the fastest `top` warm configs is followed by its variant at the knob's other value; the rest
    come as they were; a space with no new knob leaves the list alone, and the CLI's warm start expands its configs
    the same way."""
    pdl_space = load_builtin("attention-small-pdl")
    context = attention.context(mission)
    configs = [c.as_dict() for c in attention_small.admitted_configs(context)[:6]]
    assert all("pdl" not in c for c in configs)
    out = with_new_knobs(pdl_space, context, configs, top=2)
    assert out == [configs[0], {**configs[0], "pdl": True}, configs[1], {**configs[1], "pdl": True}, *configs[2:]]
    assert with_new_knobs(attention_small, context, configs) == configs
    # On a shape where the space's constraint refuses pdl (above 2^32 multiply-adds), no variant is added.
    from evotune.problems.shapes import parse_shape

    big = attention.context(parse_shape("gpt2"))
    assert with_new_knobs(pdl_space, big, configs, top=2) == configs
    recorded_run("small", mission.as_dict(), [(configs[i], 10.0 + i) for i in range(6)])
    asked, _ = warm_start_configs("small", False, "new", attention, mission, pdl_space, 16, True)
    assert list(asked[:2]) == [{**configs[0], "pdl": False}, {**configs[0], "pdl": True}]


def test_the_fastest_warm_config_meets_new_knobs_together(attention):
    """Warm configs of attention-hopper3 (no rescale, no softmax_overlap) into attention-hopper3-overlap: each of the
    first `top` is asked at each new value alone (rescale new_max and lazy, softmax_overlap true); the fastest one
    also at the two combinations with both knobs off their defaults, which is where the two pay on llama-4k."""
    from evotune.problems.shapes import parse_shape

    hopper3 = load_builtin("attention-hopper3")
    overlap = load_builtin("attention-hopper3-overlap")
    context = attention.context(parse_shape("gpt2"))
    configs = [c.as_dict() for c in hopper3.admitted_configs(context)[:3]]
    out = with_new_knobs(overlap, context, configs, top=2)
    alone = [{"rescale": "new_max"}, {"rescale": "lazy"}, {"softmax_overlap": True}]
    joint = [{"rescale": "new_max", "softmax_overlap": True}, {"rescale": "lazy", "softmax_overlap": True}]
    assert out == ([configs[0]] + [{**configs[0], **v} for v in alone + joint]
                   + [configs[1]] + [{**configs[1], **v} for v in alone] + [configs[2]])


def test_warm_started_search_asks_the_warm_configs_first_and_once(attention, attention_small, mission):
    """The first proposals of a warm-started search are the admitted warm configs, in order; a resume of that run
    enqueues nothing again; inadmissible warm configs are never proposed."""
    context = attention.context(mission)
    configs = attention_small.admitted_configs(context)
    warm = [configs[40].as_dict(), configs[7].as_dict(), configs[300].as_dict()]
    violating = next(c for c in attention_small.all_configs() if not attention_small.admitted(c, context)).as_dict()
    for sampler in ("nsga2", "tpe", "random"):
        run = MemoryRun(Run.create(f"warm-{sampler}", {}).path)
        options = SearchOptions(trials=5, sampler=sampler, population=4, lookahead=2, compile_workers=1,
                                warm_start=(warm[0], violating, warm[1], warm[2]))
        run_search(attention, attention_small, mission, run, model_evaluate, options, compiler=fake_compiler)
        records = run.trials()
        assert [r["config"] for r in records[:3]] == warm, sampler
        assert violating not in [r["config"] for r in records]
        study = _study(run)
        assert sum(1 for t in study.trials if t.system_attrs.get("fixed_params")) == 3

        run_search(attention, attention_small, mission, run, model_evaluate, replace(options, trials=10),
                   compiler=fake_compiler)
        assert sum(1 for t in _study(run).trials if t.system_attrs.get("fixed_params")) == 3, "resume re-enqueued"
        records = run.trials()
        assert sum(r["counted"] for r in records) == 10
        for config in warm:  # measured once; any later proposal of it is a duplicate answered from the record
            assert sum(1 for r in records if r["config"] == config and r["counted"]) == 1


def _study(run):
    import optuna

    return optuna.load_study(study_name=run.study_name, storage=run.storage())


def test_warm_start_option_seeds_new_runs_only(attention, attention_small, mission):
    """The CLI's --warm-start takes a population's worth of admitted configs and records the runs in meta.json;
    with --resume it is a usage error."""
    configs = [c.as_dict() for c in attention_small.admitted_configs(attention.context(mission))[:30]]
    recorded_run("earlier", mission.as_dict(), [(c, 10.0 + i) for i, c in enumerate(configs)])
    warm, meta = warm_start_configs("auto", False, "new", attention, mission, attention_small, 4, json_out=True)
    assert list(warm) == configs[:4]
    assert meta["warm_start"]["runs"] == ["earlier"] and meta["warm_start"]["configs"] == 4
    assert warm_start_configs(None, False, "new", attention, mission, attention_small, 4, json_out=True) == ((), {})
    with pytest.raises(UsageError, match="new run"):
        warm_start_configs("auto", True, "earlier", attention, mission, attention_small, 4, json_out=True)
