"""Tests for the search strategies behind SAMPLERS, chiefly evotune's own "exhaustive" (evotune/search/strategies.py):
real NVRTC compiles of a small attention space and an injected evaluator, as in tests/test_search.py.

SMALL_SPACE has 8 configurations; its constraint admits 6 on the mission shape.
"""

from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState
from typer.testing import CliRunner

from evotune.records import result as R
from evotune.search import loop as S
from evotune.cli import app
from evotune.errors import UsageError
from evotune.records.result import Result
from evotune.records.runs import Run
from evotune.search.loop import SAMPLERS, SearchOptions, make_sampler, run_search
from evotune.space.searchspace import load_builtin, load_space
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


# Every test here writes runs into a temporary EVOTUNE_RUNS (conftest.runs_root).
pytestmark = pytest.mark.usefixtures("runs_root")

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
    study = optuna.load_study(study_name="evotune", storage=run.storage())
    study.enqueue_trial(admitted[4].as_dict())
    orphan = study.ask(S.distributions(small)).number

    second = exhaustive(attention, small, mission, Run.open("exh-resume"), ev, trials=100, lookahead=3)
    assert second["evaluated"] == 6 and second["proposals"] == 2
    assert ev.digests() == [c.digest() for c in admitted]
    check_records(run.trials())
    study = optuna.load_study(study_name="evotune", storage=run.storage())
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


# ------------------------------------------------------------------ NSGA-II: steering, elites, operators
# These replay searches answer from a model instead of the GPU and compile nothing (run_search's
# `compiler` seam), and keep the study in memory: a few hundred proposals take a second.


class MemoryRun(Run):
    """A run whose Optuna study lives in memory (these searches are thrown away)."""

    def storage(self):
        if not hasattr(self, "_memory"):
            self._memory = optuna.storages.InMemoryStorage()
        return self._memory


def model_time(c) -> float:
    """A smooth stand-in for the GPU time of an attention-small config."""
    return (10.0 + {32: 1.0, 64: 0.0, 128: 1.5}[c["block_m"]] + {32: 0.5, 64: 0.0, 128: 0.8}[c["block_n"]]
            + 0.2 * abs(c["compute_warps"] - 4) + 0.3 * c["stages"] + 0.1 * c["producer_warps"]
            + (0.2 if c["smem_layout"] == "pad" else 0.0) - 0.3 * c["warp_key_groups"])


def fake_compiler(config, source):
    """A compile without ptxas that the static gate passes: 64 registers, or for a Hopper kernel with setmaxnreg what
    its launch bound allocates (the gate checks the split against them)."""
    from evotune.build.compile import Compiled, Resources
    from evotune.problems.attention import setmaxnreg_registers

    knobs = config.as_dict()
    threads = 32 * (int(knobs.get("compute_warps", 4)) + int(knobs.get("producer_warps", 0)))
    registers = max(64, -(-setmaxnreg_registers(config) // threads // 8) * 8)
    return Compiled(config.digest(), source.entry, "none", "", (), "", Resources(registers, 0, 0, 0, 0, 1), 0.0)


def model_evaluate(config, compiled):
    return Result(status=R.OK, time_us=model_time(config.as_dict()), max_abs=1e-3)


@pytest.fixture(scope="module")
def attention_small():
    return load_builtin("attention-small")


def model_search(problem, space, shape, name, trials, sampler="nsga2", seed=0, evaluate=model_evaluate, **options):
    run = MemoryRun(Run.create(name, {}).path)
    opts = SearchOptions(trials=trials, sampler=sampler, seed=seed, lookahead=0, compile_workers=1, **options)
    summary = run_search(problem, space, shape, run, evaluate, opts, compiler=fake_compiler)
    return run, summary


def violating_share(records: list[dict], window: int) -> list[float]:
    """Share of constraint-violating proposals among those made for each `window` counted evaluations."""
    shares, proposals, violating, counted = [], 0, 0, 0
    for r in records:
        proposals += 1
        violating += r["result"]["message"].startswith("constraint: ")
        if r["counted"]:
            counted += 1
            if counted % window == 0:
                shares.append(violating / proposals)
                proposals = violating = 0
    return shares


def test_steering_keeps_nsga2_proposals_inside_the_constraints(attention, attention_small, mission):
    """Steered NSGA-II proposes no constraint-violating and no repeated config in any generation, where Optuna's
    NSGA-II (--no-steer) still violates a constraint in a tenth or more of its proposals after its first generation
    and repeats configs many times over.

    Measured on attention-small (456 of 972 admitted), population 8, 48 trials: unsteered, the share of
    violating proposals per generation was 0.27-0.44 in the first and 0.05-0.29 afterwards (seeds 0-2), with
    150-443 duplicate proposals; steered, 0 and 0."""
    for seed in range(3):
        plain, _ = model_search(attention, attention_small, mission, f"plain-{seed}", 48, seed=seed, population=8,
                                steer=False)
        steered, summary = model_search(attention, attention_small, mission, f"steer-{seed}", 48, seed=seed,
                                        population=8)
        p, s = violating_share(plain.trials(), 8), violating_share(steered.trials(), 8)
        assert s == [0.0] * 6, f"seed {seed}: steered proposals violated constraints: {s}"
        assert sum(p[1:]) / len(p[1:]) >= 0.1, f"seed {seed}: unsteered shares {p}"
        assert max(p) >= 0.25
        assert summary["proposals"] == summary["evaluated"] == 48  # every proposal new and admitted
        assert sum(1 for r in plain.trials() if r.get("duplicate_of") is not None) >= 100
        check_records(steered.trials())


def test_steered_nsga2_records_keep_their_meaning(attention, small, mission):
    """With steering the loop still records whatever is proposed the same way: a constraint-violating warm-start
    config is a non-counted PRUNED record that says which constraint, and the study holds it as PRUNED."""
    context = attention.context(mission)
    bad = next(c for c in small.all_configs() if not small.admitted(c, context))
    run = MemoryRun(Run.create("steer-records", {}).path)
    study = optuna.create_study(study_name=run.study_name, storage=run.storage(), directions=["minimize", "minimize"])
    study.enqueue_trial(bad.as_dict())
    opts = SearchOptions(trials=6, sampler="nsga2", population=2, lookahead=0, compile_workers=1)
    run_search(attention, small, mission, run, model_evaluate_small, opts, compiler=fake_compiler)
    first = run.trials()[0]
    assert first["digest"] == bad.digest() and first["counted"] is False
    assert first["result"]["status"] == R.PRUNED and first["result"]["message"].startswith("constraint: each compute warp")
    assert study.trials[0].state == TrialState.PRUNED
    assert sum(r["counted"] for r in run.trials()) == 6 == len(small.admitted_configs(context))


def model_evaluate_small(config, compiled):
    c = config.as_dict()
    return Result(status=R.OK, time_us=10.0 + c["block_m"] / 64 + c["block_n"] / 32 + c["compute_warps"] / 8, max_abs=1e-3)


def test_elites_are_chosen_from_every_completed_trial(attention, attention_small, mission):
    """The steered sampler's parents are the best distinct configs of all completed trials, a late-finishing one
    included (Optuna's NSGA-II chooses only from the previous generation and its parents, so a trial that completes
    after the next generation's parents were picked is never a parent), and a repeated config counts once."""
    from evotune.search.strategies import SteeredNSGAIISampler

    context = attention.context(mission)
    admitted = attention_small.admitted_configs(context)
    sampler = S.make_sampler("nsga2", 4, 0, space=attention_small, context=context, steer=True)
    assert isinstance(sampler, SteeredNSGAIISampler)
    study = optuna.create_study(directions=["minimize", "minimize"], sampler=sampler)
    dists = S.distributions(attention_small)
    times = [9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0]
    for cfg, t in zip(admitted, times):
        study.enqueue_trial(cfg.as_dict())
        study.tell(study.ask(dists), [t, 1e-3])
    study.enqueue_trial(admitted[7].as_dict())
    straggler = study.ask(dists)          # asked long ago, completes only now, and is the fastest
    study.enqueue_trial(admitted[6].as_dict())
    study.tell(study.ask(dists), [3.0, 1e-3])  # a repeat of the 3.0 us config
    study.tell(straggler, [1.0, 1e-3])
    parents = sampler._parents(study)
    assert len(parents) == 4
    assert sorted(t.values[0] for t in parents) == [1.0, 3.0, 4.0, 5.0]
    assert straggler.number in {t.number for t in parents}


def test_mutation_and_crossover_settings_reach_nsga2(attention, attention_small, mission):
    """--mutation-prob and --crossover-prob configure NSGA-II's child generation, and they change what it proposes:
    with no crossover and no mutation a child copies a parent, so unsteered NSGA-II only repeats its first
    generation, while the default operators keep finding new configs."""
    context = attention.context(mission)
    for steer in (False, True):
        sampler = S.make_sampler("nsga2", 8, 0, space=attention_small, context=context, steer=steer,
                                 mutation_prob=0.3, crossover_prob=0.2)
        assert sampler._child_generation_strategy._mutation_prob == 0.3
        assert sampler._child_generation_strategy._crossover_prob == 0.2
    frozen, summary = model_search(attention, attention_small, mission, "frozen", 16, population=8, steer=False,
                                   mutation_prob=0.0, crossover_prob=0.0, max_proposals_factor=4)
    told = [r for r in frozen.trials() if r["result"]["status"] == R.OK]  # what NSGA-II saw (repeats included)
    first_generation = {r["digest"] for r in told[:8]}
    assert len(told) > 8 and all(r["digest"] in first_generation for r in told[8:])  # nothing new after them
    assert summary["evaluated"] == len(first_generation) < 16
    _, summary = model_search(attention, attention_small, mission, "moving", 16, population=8, steer=False,
                              max_proposals_factor=4)
    assert summary["evaluated"] == 16


def test_search_options_check_the_evolution_settings():
    """Out-of-range probabilities and a population below 2 are usage errors."""
    with pytest.raises(UsageError, match="mutation probability"):
        SearchOptions(mutation_prob=1.5)
    with pytest.raises(UsageError, match="crossover probability"):
        SearchOptions(crossover_prob=-0.1)
    with pytest.raises(UsageError, match="population"):
        SearchOptions(population=1)


def test_search_help_lists_the_evolution_options():
    """`evotune search --help` documents the evolution and warm-start options."""
    result = CliRunner().invoke(app, ["search", "--help"], terminal_width=200)
    assert result.exit_code == 0
    for option in ("--population", "--mutation-prob", "--crossover-prob", "--no-steer", "--warm-start"):
        assert option in result.output


def test_variant_knob_is_drawn_first(attention):
    """With the space's `variant: mma`, the steered NSGA-II's random draws propose the Hopper variant about as often
    as mma.sync, although the constraints admit a few percent of its draws; without it a 48-trial search saw it at most a
    few times before the rescale knob and half as often since (none in 64 trials of an H100 run,
    docs/experiments/CHANGELOG.md: gpt2-h100-fullspace).
    Here the wgmma model is faster, and the elites find it."""
    from dataclasses import replace

    from evotune.problems.shapes import parse_shape

    full = load_builtin("attention")
    assert full.variant == "mma"
    # d128 with at most 128 query tiles: no persistent grid is admitted (it needs more tiles than SMs), so the
    # persistent knob rejects as many mma.sync draws as wgmma ones and the two variants' shares are those of the rest.
    llama = parse_shape("1,4,2048,128")

    def evaluate(config, compiled):
        c = config.as_dict()
        t = (6.0 if c["mma"] == "wgmma" else 9.0) + 0.1 * c["stages"] + (0.5 if c["block_n"] == 32 else 0.0)
        return Result(status=R.OK, time_us=t, max_abs=1e-3)

    # The blind search gets 16 trials, not 48: nearly all its proposals are refused (below), each refusal a rejection
    # draw of its own, so its 48 took ~70% of this test's time on CI's 2 cores; shares of the trials are compared.
    counts, trials = {}, {"variant": 48, "blind": 16}
    for name, space in (("variant", full), ("blind", replace(full, variant=None))):
        run, summary = model_search(attention, space, llama, f"variant-{name}", trials[name], seed=1, population=16,
                                    evaluate=evaluate)
        pruned = summary["statuses"].get("pruned", 0)
        if name == "variant":
            assert summary["evaluated"] == 48 and pruned == 0
        else:
            # Blind, most draws fall on configs the constraints refuse: every wgmma-only knob (rescale, softmax_overlap,
            # lean_addressing, ...) rejects the mma.sync draws that take its other values. Since lean_addressing it
            # evaluated 11 of 48 before its proposal budget (30 a trial) ran out, 1429 proposals refused; of 16, none
            # (480 refused).
            assert pruned > summary["evaluated"]
        counts[name] = sum(1 for r in run.trials() if r["counted"] and r["config"]["mma"] == "wgmma")
        if name == "variant":
            first = [r["config"]["mma"] for r in run.trials()[:16]]
            assert 4 <= first.count("wgmma") <= 12, first
            assert summary["best"]["config"]["mma"] == "wgmma"
    # Blind, 20 of 48 since the rescale knob (wgmma only: its constraint rejects two thirds of the mma.sync draws),
    # 3 or fewer before it, and at most the 11 it evaluated since lean_addressing (none of 16 since); the variant draw
    # proposes the Hopper variant at least 1.5 times as often a trial.
    assert counts["variant"] >= 16 and counts["variant"] / 48 >= 1.5 * counts["blind"] / 16, counts


def test_variant_draws_come_from_the_admitted_configs():
    """Given the admitted configs by variant value (the loop's enumeration), a random draw is uniform over the drawn
    variant's untaken admitted configs, never a taken one, and falls back to the other value when all of the drawn
    one's are taken."""
    from optuna.distributions import CategoricalDistribution

    from evotune.search.strategies import SteeredNSGAIISampler

    dists = {"v": CategoricalDistribution(["a", "b"]), "x": CategoricalDistribution([1, 2, 3, 4])}
    pools = {"a": [{"v": "a", "x": x} for x in (1, 2, 3)], "b": [{"v": "b", "x": 4}]}
    taken = [{"v": "a", "x": 2}]
    sampler = SteeredNSGAIISampler(distributions=dists, admissible=lambda p: False, taken=lambda p: p in taken,
                                   variant="v", admitted_by_variant=pools, population_size=4, seed=3)
    draws = [sampler._random_admissible(1) for _ in range(200)]
    assert {d["x"] for d in draws if d["v"] == "a"} == {1, 3} and {"v": "b", "x": 4} in draws
    assert 60 <= sum(d["v"] == "a" for d in draws) <= 140  # each value first about half the time
    taken += [{"v": "a", "x": 1}, {"v": "a", "x": 3}]
    assert all(sampler._random_admissible(1) == {"v": "b", "x": 4} for _ in range(20))
    taken.append({"v": "b", "x": 4})
    assert sampler._random_admissible(1) is None


def test_variant_must_name_a_parameter(tmp_path):
    """A space whose `variant:` is not one of its parameters is refused with file:line."""
    from evotune.errors import UsageError
    from evotune.space.searchspace import load_space

    path = tmp_path / "s.yaml"
    path.write_text("family: attention\nvariant: mma\nparams:\n  block_m:\n    values: [64]\n    default: 64\n")
    with pytest.raises(UsageError, match=r"s.yaml:2: variant 'mma' is not a parameter"):
        load_space(path)


def test_optuna_internals_the_steered_sampler_reads_are_there():
    """The private NSGA-II attributes SteeredNSGAIISampler reads exist in the installed Optuna, with the shapes it uses."""
    import optuna

    from evotune.search.strategies import SteeredNSGAIISampler

    plain = optuna.samplers.NSGAIISampler(population_size=8, seed=0)
    missing = [name for name in SteeredNSGAIISampler.OPTUNA_INTERNALS if not hasattr(plain, name)]
    assert not missing, f"optuna {optuna.__version__} lacks {missing}: re-check strategies.py before widening the bound"
    assert plain._population_size == 8
    assert callable(plain._elite_population_selection_strategy) and callable(plain._child_generation_strategy)
    assert hasattr(plain._rng, "rng") and 0 <= plain._rng.rng.randint(3) < 3
