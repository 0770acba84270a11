"""Tests for the search strategies behind SAMPLERS, chiefly evotune's own "exhaustive" (evotune/strategies.py):
real NVRTC compiles of a small attention space and an injected evaluator, as in tests/test_search.py.

SMALL_SPACE has 8 configurations; its constraint admits 6 on the mission shape.
"""

from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState
from typer.testing import CliRunner

from evotune import search as S
from evotune.cli import app
from evotune.runs import Run
from evotune.search import SAMPLERS, SearchOptions, make_sampler, run_search
from evotune.space import load_space
from test_search import FakeEvaluator, check_records, without_times

SMALL_SPACE = """\
family: attention
params:
  block_m: {values: [32, 64]}
  block_n: {values: [32, 64]}
  compute_warps: {values: [2, 4]}
  producer_warps: {values: [0]}
  stages: {values: [2]}
  smem_layout: {values: [swizzle]}
  q_in_regs: {values: [true]}
constraints:
  - expr: block_m % (16 * compute_warps) == 0
    why: each compute warp owns a whole number of 16-row mma tiles
"""


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("spaces") / "attention-small.yaml"
    path.write_text(SMALL_SPACE)
    return load_space(path)


@pytest.fixture(autouse=True)
def runs_root(tmp_path, monkeypatch):
    monkeypatch.setenv("EVOTUNE_RUNS", str(tmp_path / "runs"))


def exhaustive(problem, space, shape, run, evaluator, trials, lookahead=0):
    options = SearchOptions(trials=trials, sampler="exhaustive", compile_workers=2, lookahead=lookahead)
    return run_search(problem, space, shape, run, evaluator, options)


def test_exhaustive_visits_every_admitted_config_once_in_order(attention, small, mission):
    """Exhaustive evaluates each admitted config exactly once, in the space's order, proposes no pruned config,
    and stops after as many evaluations as there are admitted configs."""
    context = attention.context(mission)
    admitted = small.admitted_configs(context)
    assert len(admitted) == 6 and small.size() == 8
    run = Run.create("exh", {})
    ev = FakeEvaluator(small, context)
    summary = exhaustive(attention, small, mission, run, ev, trials=100)
    assert ev.digests() == [c.digest() for c in admitted]
    records = run.trials()
    check_records(records)
    assert [r["digest"] for r in records] == [c.digest() for c in admitted]
    assert all(r["counted"] and r.get("duplicate_of") is None for r in records)
    assert summary["evaluated"] == summary["proposals"] == 6 and summary["best"] is not None


def test_exhaustive_stops_at_trials_and_resume_takes_the_rest(attention, small, mission):
    """Exhaustive stops at --trials; a resume evaluates the remaining configs in order, the one a killed process
    left RUNNING included, and none twice."""
    context = attention.context(mission)
    admitted = small.admitted_configs(context)
    run = Run.create("exh-resume", {})
    ev = FakeEvaluator(small, context)
    first = exhaustive(attention, small, mission, run, ev, trials=4)
    assert first["evaluated"] == 4 and ev.digests() == [c.digest() for c in admitted[:4]]

    # A killed process asked for the fifth config and never told: no record, a RUNNING trial in the study.
    study = optuna.load_study(study_name="evotune", storage=run.storage_url)
    study.enqueue_trial(admitted[4].as_dict())
    orphan = study.ask(S.distributions(small)).number

    second = exhaustive(attention, small, mission, Run.open("exh-resume"), ev, trials=100, lookahead=3)
    assert second["evaluated"] == 6 and second["proposals"] == 2
    assert ev.digests() == [c.digest() for c in admitted]
    check_records(run.trials())
    study = optuna.load_study(study_name="evotune", storage=run.storage_url)
    assert study.trials[orphan].state == TrialState.FAIL


def test_exhaustive_compiling_ahead_matches_serial(attention, small, mission):
    """Exhaustive with compile-ahead records exactly what the serial exhaustive search records."""
    context = attention.context(mission)
    serial = Run.create("exh-serial", {})
    exhaustive(attention, small, mission, serial, FakeEvaluator(small, context), trials=5)
    ahead = Run.create("exh-ahead", {})
    ev = FakeEvaluator(small, context)
    exhaustive(attention, small, mission, ahead, ev, trials=5, lookahead=4)
    assert len(ahead.trials()) == 5
    assert without_times(ahead.trials()) == without_times(serial.trials())
    assert ev.digests() == [r["digest"] for r in ahead.trials()]


def test_exhaustive_sampler_needs_the_space():
    """make_sampler refuses "exhaustive" without the space and the admitted configs it enumerates."""
    with pytest.raises(ValueError, match="needs the space and its admitted configs"):
        make_sampler("exhaustive", 4, 0)


def test_search_help_lists_every_sampler():
    """`evotune search --help` names every strategy in SAMPLERS, the list --sampler is checked against."""
    result = CliRunner().invoke(app, ["search", "--help"], terminal_width=200)
    assert result.exit_code == 0
    text = " ".join(result.output.replace("│", " ").split())
    assert "exhaustive" in SAMPLERS and f"Search strategy: {', '.join(SAMPLERS)}" in text
