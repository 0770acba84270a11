"""Tests for evotune.records.priors, `evotune priors build|show` and the search's warm start from the shipped priors."""

from __future__ import annotations

import json
import math

import pytest

from evotune.cli.search import warm_start_configs
from evotune.paths import REPO_ROOT
from evotune.problems.shapes import parse_shape
from evotune.records import priors as P
from evotune.records import result as R
from evotune.records.best import BASELINES_FILE, BESIDE_KIND
from evotune.records.runs import Run
from evotune.records.tuning_table import family_runs
from evotune.search.loop import SearchOptions, run_search
from evotune.search.warmstart import prior_configs
from evotune.space.searchspace import Config, load_builtin
from test_strategies import MemoryRun, fake_compiler, model_evaluate

pytestmark = pytest.mark.usefixtures("runs_root")

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(scope="module")
def attention_small():
    return load_builtin("attention-small")


@pytest.fixture
def admitted_small(attention, attention_small, mission):
    return [c.as_dict() for c in attention_small.admitted_configs(attention.context(mission))]


def fake_run(name: str, shape, results: list[tuple[dict, float | None]], sdpa: dict | None = None,
             gpu: str = H100) -> Run:
    """A finished run on `shape` whose trials passed in the given times (None: failed the gate), and where `sdpa`
    ({backend: (us, passed)}) is given, a baselines.json of those backends."""
    run = Run.create(name, {"family": "attention", "shape": shape.as_dict(), "shape_spec": shape.spec,
                            "device": {"name": gpu}, "git_sha": "abc123"})
    for number, (config, t) in enumerate(results):
        result = {"status": R.OK if t is not None else R.WRONG, "message": "", "time_us": t,
                  "max_abs": 1e-3 if t is not None else 0.5}
        run.append_trial({"number": number, "config": config, "digest": Config.from_dict(config).digest(),
                          "source_digest": f"src{number}", "counted": True, "result": result})
    if sdpa is not None:
        rows = {name: {"available": True, "time_us": us, "verification": {"passed": ok}}
                for name, (us, ok) in sdpa.items()}
        (run.path / BASELINES_FILE).write_text(json.dumps({"kind": BESIDE_KIND, "baselines": rows}))
    return run


def test_build_takes_each_runs_best_and_near_winners(admitted_small, mission):
    """Per run: the best and the configs within 5% of it (one per source), each with its ratio to the fastest SDPA
    backend that passed; a run with no passing trial is left out with a note; the file says how it was built."""
    c = admitted_small
    a = fake_run("a", mission, [(c[0], 10.4), (c[1], 10.0), (c[2], 10.3), (c[3], 12.0), (c[4], None)],
                 sdpa={"cudnn": (8.0, True), "flash": (9.0, True), "math": (1.0, False)})
    b = fake_run("b", mission, [(c[5], None)])
    doc, notes = P.build_priors([a.path, b.path], "evotune priors build a b")
    assert len(notes) == 1 and notes[0].startswith("b: left out")
    (entry,) = doc["entries"]
    assert [w["config"] for w in entry["winners"]] == [c[1], c[2], c[0]]
    assert entry["winners"][0]["ratio_to_sdpa"] == pytest.approx(10.0 / 8.0)
    assert entry["sdpa"] == {"backend": "cudnn", "time_us": 8.0}
    assert entry["winners"][0]["source_digest"] == "src1"
    assert entry["class"] == {"family": "attention", "gpu": H100, "dtype": mission.dtype,
                              "head_dim": mission.head_dim, "causal": mission.causal, "kv_group": 1,
                              "seq_bucket": int(math.log2(mission.seq_k)),
                              "bh_bucket": int(math.log2(mission.batch * mission.heads))}
    assert doc["version"] == P.VERSION and doc["command"] == "evotune priors build a b"
    assert doc["sources"] == [{"run": "a", "git_sha": "abc123"}]
    assert P.parse_priors(json.loads(P.dump_priors(doc)), "x") == doc  # round trip


def test_nearest_class_first_and_other_classes_never(admitted_small, mission):
    """Priors come nearest shape class first (same dtype, head dim and mask; then the size buckets' distance);
    another dtype, head dim or mask is never proposed."""
    c = admitted_small
    s = mission.as_dict()
    far = fake_run("far", parse_shape(f"{s['batch']},{s['heads']},{s['seq_q'] * 8},{s['head_dim']}"), [(c[0], 1.0)])
    same = fake_run("same", mission, [(c[1], 50.0)])
    causal = fake_run("causal", parse_shape(mission.spec + ":causal"), [(c[2], 1.0)])
    doc, _ = P.build_priors([far.path, same.path, causal.path], "x")
    target = P.class_of_shape(mission, "attention", None)
    found = P.nearest_configs(doc, target)
    assert [e["run"] for _, e, _ in found] == ["same", "far"]
    assert found[0][0] == 0 and found[1][0] == 3
    assert P.class_distance(P.class_of_shape(mission, "attention", "another GPU"), found[0][1]["class"]) == 0


def test_the_searchs_gpu_model_ranks_first_among_equals(attention, attention_small, mission, admitted_small,
                                                        tmp_path):
    """At the same class distance a prior measured on the search's GPU model comes before one from another GPU;
    the other GPU's is not dropped, and a nearer class still comes first whatever its GPU."""
    c = admitted_small
    other = fake_run("other", mission, [(c[0], 1.0)], gpu="NVIDIA A100")
    same = fake_run("same", mission, [(c[1], 9.0)])
    doc, _ = P.build_priors([other.path, same.path], "x")
    path = tmp_path / "p.json"
    path.write_text(P.dump_priors(doc))
    context = attention.context(mission)
    assert prior_configs(attention, mission, attention_small, context, path=path, gpu=H100)[0] == [c[1], c[0]]
    assert prior_configs(attention, mission, attention_small, context, path=path, gpu="NVIDIA A100")[0] == [c[0], c[1]]
    assert prior_configs(attention, mission, attention_small, context, path=path)[0] == [c[0], c[1]]  # by time


def test_a_stale_prior_is_marked_and_its_time_is_never_read(attention, attention_small, mission, admitted_small,
                                                           tmp_path, main_in_process):
    """A prior whose recorded source digest is not today's is stale (priors show says so; today's digest is not);
    within one run's priors, what the search takes (the configs asked first, the surrogate's prior mean) does not
    change when their recorded times do."""
    from evotune.build.template import instantiate
    from evotune.search.warmstart import knob_prior

    c = admitted_small
    run = fake_run("r", mission, [(c[0], 5.0), (c[1], 5.1)])
    doc, _ = P.build_priors([run.path], "x")
    (entry,) = doc["entries"]
    entry["winners"][1]["source_digest"] = instantiate(attention, Config.from_dict(c[1]), mission).digest
    assert "measured source src0" in P.stale_reason(entry, entry["winners"][0])
    assert P.stale_reason(entry, entry["winners"][1]) is None
    path = tmp_path / "p.json"
    path.write_text(P.dump_priors(doc))
    proc = main_in_process("priors", "show", "--file", str(path), "--json")
    assert [w["stale"] is None for w in json.loads(proc.stdout)["entries"][0]["winners"]] == [False, True]
    proc = main_in_process("priors", "show", "--file", str(path))
    assert "1 of 2 configs are stale" in proc.stdout
    context = attention.context(mission)
    before = (prior_configs(attention, mission, attention_small, context, path=path)[0],
              knob_prior(attention, mission, attention_small, path=path))
    for w in entry["winners"]:
        w["time_us"], w["ratio_to_sdpa"] = 1e6, 99.0
    path.write_text(P.dump_priors(doc))
    assert (prior_configs(attention, mission, attention_small, context, path=path)[0],
            knob_prior(attention, mission, attention_small, path=path)) == before


def test_knob_prior_favours_what_nearer_priors_chose(attention, attention_small, mission, admitted_small, tmp_path):
    """The surrogate's prior mean: a knob value chosen by a nearer class's prior is favoured over one a farther
    class chose; a prior from another GPU counts half; knobs no prior names get no mean."""
    from evotune.search.warmstart import TRANSFER_SCALE, knob_prior

    c = admitted_small
    a = c[0]
    b = next(x for x in c if x["block_m"] != a["block_m"])
    s = mission.as_dict()
    near = fake_run("near", mission, [(a, 5.0)])
    far = fake_run("far", parse_shape(f"{s['batch']},{s['heads']},{s['seq_q'] * 8},{s['head_dim']}"), [(b, 5.0)])
    doc, _ = P.build_priors([near.path, far.path], "x")
    path = tmp_path / "p.json"
    path.write_text(P.dump_priors(doc))
    mean = knob_prior(attention, mission, attention_small, path=path)
    assert mean[("block_m", a["block_m"])] < mean[("block_m", b["block_m"])]
    n = len(next(p for p in attention_small.params if p.name == "block_m").values)
    # near counts 1, far 2^-3: a's value holds 8/9 of the weight, and the evidence is w / (w + 1), w = 9/8
    assert mean[("block_m", a["block_m"])] == pytest.approx(-TRANSFER_SCALE * (9 / 17) * (8 / 9 - 1 / n))
    assert knob_prior(attention, mission, attention_small, path=path, gpu=H100) == mean
    elsewhere = knob_prior(attention, mission, attention_small, path=path, gpu="NVIDIA A100")
    assert 0 > elsewhere[("block_m", a["block_m"])] > mean[("block_m", a["block_m"])]  # both halved: less evidence
    assert all(len(p.values) > 1 for p in attention_small.params if (p.name, p.values[0]) in mean)


def test_the_surrogate_learns_from_the_priors_knob_values(attention, attention_small, mission, admitted_small,
                                                           tmp_path):
    """The surrogate shrinks toward the priors' prior mean: with two results that never tried the prior's block_m,
    configs with it are predicted faster than without the mean; from the mean alone (no result, min_results 0) its
    proposals are the prior's neighbours, one knob away. A search's options carry the mean to the sampler."""
    import numpy as np
    import optuna

    from evotune.search import loop as S
    from evotune.search.strategies import SurrogateSampler
    from evotune.search.warmstart import knob_prior

    context = attention.context(mission)
    admitted = attention_small.admitted_configs(context)
    prior = admitted_small[17]
    run = fake_run("p", mission, [(prior, 5.0)])
    doc, _ = P.build_priors([run.path], "x")
    path = tmp_path / "p.json"
    path.write_text(P.dump_priors(doc))
    mean = knob_prior(attention, mission, attention_small, path=path)
    dists = S.distributions(attention_small)

    class Done:
        def __init__(self, c, t):
            self.params, self.values = c, [t]

    other = [c.as_dict() for c in admitted if c.as_dict()["block_m"] != prior["block_m"]][:2]
    done = [Done(other[0], 10.0), Done(other[1], 11.0)]
    with_it = SurrogateSampler(admitted, dists, lambda d: False, explore=0.0, prior_mean=mean).predict(done)
    without = SurrogateSampler(admitted, dists, lambda d: False, explore=0.0).predict(done)
    has = np.array([c.as_dict()["block_m"] == prior["block_m"] for c in admitted])
    shift = with_it - without  # the mean's pull on each config's predicted log time
    assert shift[has].mean() < shift[~has].mean() - 0.01

    taken = {Config.from_dict(prior).digest()}
    sampler = SurrogateSampler(admitted, dists, lambda d: d in taken, seed=1, prior_mean=mean, min_results=0)
    study = optuna.create_study(directions=["minimize", "minimize"], sampler=sampler)
    for _ in range(6):
        config = attention_small.config(study.ask(dists).params)
        taken.add(config.digest())
        assert sum(config.as_dict()[k] != v for k, v in prior.items()) == 1
    options = SearchOptions(prior_mean=mean)
    sampler = S.make_sampler("surrogate", 16, 0, space=attention_small, admitted=admitted,
                             prior_mean=options.prior_mean)
    assert dict(options.prior_mean) == mean and sampler._mean.any()


def test_a_prior_not_admitted_is_adapted_to_its_nearest_admitted_neighbour(attention, attention_small, mission,
                                                                          admitted_small, tmp_path):
    """A prior the space does not admit on the search's shape is proposed as the admitted config with the fewest
    knobs changed (each move the shortest along its knob's values), with what changed in its origin; at most
    `limit` come."""
    from evotune.search.warmstart import nearest_admitted

    context = attention.context(mission)
    violating = next(c for c in attention_small.all_configs() if not attention_small.admitted(c, context)).as_dict()
    c = admitted_small
    run = fake_run("r", mission, [(violating, 9.0), (c[0], 9.1), (c[1], 9.2), (c[2], 9.3)])
    doc, _ = P.build_priors([run.path], "x")
    path = tmp_path / "p.json"
    path.write_text(P.dump_priors(doc))
    got, origin = prior_configs(attention, mission, attention_small, context, limit=2, path=path)
    [near], changed = nearest_admitted(attention_small, context, violating)
    assert attention_small.admitted(near, context) and 1 <= len(changed) <= 2
    assert all(violating[k] == old and near.as_dict()[k] == new for k, (old, new) in changed.items())
    assert sum(violating[k] != v for k, v in near.as_dict().items()) == len(changed)
    assert got == [near.as_dict(), c[0]] and origin[0]["adapted"] == changed and "adapted" not in origin[1]


def test_nearest_admitted_moves_the_least(attention, mission):
    """Among neighbours with as many changed knobs, the one that moves least along the knob's values: a deep-ring
    prior (stages 8) on a space listing 1-4 is proposed at 4 stages, not 1; a prior no two changes can admit is
    skipped."""
    from evotune.search.warmstart import nearest_admitted
    from evotune.space.searchspace import load_builtin

    space = load_builtin("attention-small")
    context = attention.context(mission)
    base = next(c for c in space.admitted_configs(context) if c.as_dict()["stages"] == 4).as_dict()
    [near], changed = nearest_admitted(space, context, dict(base, stages=8))
    assert changed == {"stages": [8, 4]} and near.as_dict() == base
    assert nearest_admitted(space, context, dict(base, block_m=8, block_n=8, compute_warps=64), most=2) == ([], {})


def test_search_asks_the_priors_first(attention, attention_small, mission, admitted_small, tmp_path, monkeypatch):
    """By default a search's first proposals are the priors (then the configs of the user's runs the priors were not
    built from: the shipped runs are not read again); --no-priors and --warm-start none ask none."""
    c = admitted_small
    run = fake_run("shipped", mission, [(c[40], 5.0), (c[7], 5.1), (c[300], 5.2)])
    doc, _ = P.build_priors([run.path], "x")
    packaged = tmp_path / "attention-priors.json"
    packaged.write_text(P.dump_priors(doc))
    monkeypatch.setattr(P, "PACKAGED", packaged)
    fake_run("mine", mission, [(c[9], 6.0)])
    warm, meta = warm_start_configs("auto", False, "new", attention, mission, attention_small, 16, True, priors=True)
    assert list(warm) == [c[40], c[7], c[300], c[9]]
    assert meta["priors"] == {"configs": 3, "runs": ["shipped"], "adapted": 0} and meta["warm_start"]["runs"] == ["mine"]
    warm, _ = warm_start_configs(None, False, "new", attention, mission, attention_small, 16, True, priors=True)
    assert list(warm) == [c[40], c[7], c[300]]
    assert warm_start_configs(None, False, "new", attention, mission, attention_small, 16, True, priors=False) == ((), {})
    assert warm_start_configs("none", False, "new", attention, mission, attention_small, 16, True, priors=True) == ((), {})

    rn = MemoryRun(Run.create("searched", {}).path)
    options = SearchOptions(trials=5, sampler="random", population=4, lookahead=2, compile_workers=1, warm_start=warm)
    run_search(attention, attention_small, mission, rn, model_evaluate, options, compiler=fake_compiler)
    assert [r["config"] for r in rn.trials()[:3]] == [c[40], c[7], c[300]]


def test_packaged_priors_load_and_match_the_committed_runs(attention, mission):
    """The shipped file loads, is small, and holds a class for each committed attention and decode run that passed."""
    doc = P.load_priors()
    assert P.PACKAGED.stat().st_size < 200_000
    assert doc["entries"] and all(e["winners"] for e in doc["entries"])
    built, _ = P.build_priors(family_runs(REPO_ROOT / "runs", ("attention", "attention-decode")), "x")
    assert sorted(s["run"] for s in doc["sources"]) == sorted(s["run"] for s in built["sources"])
    space = load_builtin("attention")
    got, _ = prior_configs(attention, mission, space, attention.context(mission))
    assert got and all(space.admitted(space.config(d), attention.context(mission)) for d in got)


@pytest.mark.parametrize("text, fault", [("{not json", "not JSON"), ('{"kind": "other"}', "not an evotune priors"),
                                         ('{"kind": "evotune-priors", "version": 99}', "version 99"),
                                         ('{"kind": "evotune-priors", "version": 1, "entries": [{"class": {}}]}',
                                          "entry 0")])
def test_a_damaged_priors_file_is_one_clear_error(text, fault, tmp_path, main_in_process):
    """A damaged priors file is a DamagedPriors naming the file and the fault; `priors show` says it in one line,
    exit 2."""
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    with pytest.raises(P.DamagedPriors, match=fault):
        P.load_priors(bad)
    proc = main_in_process("priors", "show", "--file", str(bad))
    assert proc.returncode == 2 and fault in proc.stderr and "Traceback" not in proc.stderr


def test_priors_build_and_show_cli(admitted_small, mission, tmp_path, main_in_process):
    """`priors build RUN -o FILE` writes a file `priors show` lists; -o into a run folder is refused."""
    fake_run("cli-run", mission, [(admitted_small[0], 3.0)], sdpa={"cudnn": (4.0, True)})
    out = tmp_path / "mine.json"
    proc = main_in_process("priors", "build", "cli-run", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert P.load_priors(out)["sources"] == [{"run": "cli-run", "git_sha": "abc123"}]
    proc = main_in_process("priors", "show", "--file", str(out), "--json")
    assert json.loads(proc.stdout)["entries"][0]["winners"][0]["ratio_to_sdpa"] == 0.75
    proc = main_in_process("priors", "build", "cli-run", "-o", str(Run.open("cli-run").path / "p.json"))
    assert proc.returncode == 2 and "run folder" in proc.stderr


def test_a_new_search_takes_the_users_runs_after_the_priors_by_default():
    """Without --warm-start a new run asks the user's own runs ('auto') after the priors; a resume asks nothing;
    a given --warm-start stands."""
    from evotune.cli.search import default_warm_start

    assert default_warm_start(None, False) == "auto"
    assert default_warm_start(None, True) is None
    assert default_warm_start("none", False) == "none" and default_warm_start("a,b", False) == "a,b"


def test_a_decode_search_asks_the_decode_runs_winners():
    """The committed decode runs (runs/llama-e2e-*) reach a decode search on a Llama-like cache: their winners come
    first, admitted on the shape, and no attention prior is asked (classes of another family are infinitely far)."""
    from evotune.problems import get_problem

    decode = get_problem("attention-decode")
    space = load_builtin("attention-decode")
    shape = decode.parse_shape("1,32,8,16385,128:fp16")
    got, origin = prior_configs(decode, shape, space, decode.context(shape))
    assert got and {o["run"] for o in origin} <= {"llama-e2e-32k", "llama-e2e-4k"} and origin[0]["run"] == "llama-e2e-32k"
    assert all(space.admitted(space.config(d), decode.context(shape)) for d in got)
