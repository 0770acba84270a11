"""Tests for tools/kt_compare.py: the exhaustive run as a Kernel Tuner cache file (keys, failure markers) and its
restrictions admitting exactly the space's admitted set; skipped when kernel_tuner is not installed."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("kernel_tuner")

from evotune.records import result as R  # noqa: E402
from _paths import REPO_ROOT, load_tool  # noqa: E402

K = load_tool("kt_compare")

RUN = REPO_ROOT / "runs" / "mission-h100-exhaustive-small"


@pytest.fixture(scope="module")
def ex():
    return K.E.Exhaustive(RUN)


def test_cache_keys_and_failure_markers(ex, tmp_path):
    """One entry per admitted config, keyed by its comma-joined values in tune_params order; passing configs carry
    their time in ms, pruned ones CompilationFailedConfig, and Kernel Tuner's reader flags those as errors."""
    from kernel_tuner import util

    data = K.build_cache(ex)
    tp = K.tune_params(ex.space)
    assert data["tune_params_keys"] == ex.space.param_names() == list(tp)
    assert len(data["cache"]) == ex.size
    for c in ex.admitted:
        d = c.as_dict()
        key = ",".join(str(d[k]) for k in tp)
        entry = data["cache"][key]
        assert all(entry[k] == d[k] for k in tp)
        res = ex.records[c.digest()]["result"]
        if res["status"] == R.OK:
            assert entry["time"] == pytest.approx(res["time_us"] / 1000.0)
        else:
            assert entry["time"] == ("CompilationFailedConfig" if res["status"] in (R.PRUNED, R.COMPILE_ERROR)
                                     else "RuntimeFailedConfig")
    path = K.write_cache(ex, tmp_path / "cache.json")
    read = util.read_cache(str(path), open_cache=False)
    errors = [e for e in read["cache"].values() if "__error__" in e]
    assert len(errors) == ex.size - ex.statuses.get(R.OK, 0)
    assert all(isinstance(e["__error__"], util.CompilationFailedConfig) for e in errors)
    assert min(e["time"] for e in read["cache"].values() if "__error__" not in e) == pytest.approx(ex.optimum / 1000)
    json.loads(path.read_text())  # a closed, valid JSON file


def test_restrictions_admit_the_same_configs(ex):
    """Kernel Tuner's searchspace from tune_params and restrictions holds exactly the admitted configs, and its
    per-config restriction check (what its simulation runner uses) agrees with the space on all 972 configs."""
    from kernel_tuner import util

    context = dict(ex.problem.context(ex.shape))
    tp = K.tune_params(ex.space)
    ss = K.kt_searchspace(ex.space, context)
    assert {K.config_key(c) for c in ss.list} == {K.config_key(c.as_dict()[k] for k in tp) for c in ex.admitted}
    rs = K.restrictions(ex.space, context)
    for c in ex.space.all_configs():
        params = {k: c.as_dict()[k] for k in tp}
        assert bool(util.check_restrictions(rs, params, False)) == ex.space.admitted(c, context), c.key()


def test_kt_run_is_repeatable_and_counts_failures(ex, tmp_path):
    """A seeded Kernel Tuner run over the cache repeats exactly, spends at most its budget, and its curve counts
    failed configs as evaluations (a run that visits a pruned config still has one point per evaluation)."""
    cache = K.write_cache(ex, tmp_path / "cache.json")
    tp = K.tune_params(ex.space)
    times = {K.config_key(c.as_dict()[k] for k in tp): (ex.records[c.digest()]["result"]["time_us"]
             if ex.records[c.digest()]["result"]["status"] == R.OK else None) for c in ex.admitted}
    for strategy in ("random_sample", "diff_evo"):
        a = K.kt_run(ex, cache, strategy, 1, 23, times)
        b = K.kt_run(ex, cache, strategy, 1, 23, times)
        assert a["curve"] == b["curve"] and len(a["curve"]) == 23 and a["evaluated"] <= 23 and a["outside"] == 0
        assert a["curve"] == sorted(a["curve"], reverse=True)


# --------------------------------------------------------------------------- a second oracle: attention-hopper on gpt2

HOPPER = REPO_ROOT / "search_spaces" / "attention-hopper.yaml"
HOPPER_RUN = "gpt2-h100-exhaustive-hopper"


def hopper_time(c: dict) -> float:
    """A deterministic fake time (us) for a config of attention-hopper: one optimum, a few configs within 3%."""
    return round(40.0 + abs(c["block_n"] - 128) / 16 + 1.5 * abs(c["stages"] - 3) + (0 if c["producer_warps"] else 2.0)
                 + (0.7 if c["q_in_regs"] else 0.0) + (0.0 if c["pingpong"] else 0.9)
                 + (0.0 if c["block_m"] == 128 else 3.0), 6)


@pytest.fixture(scope="module")
def hopper_run(tmp_path_factory):
    """A fake exhaustive run of attention-hopper on gpt2 in the format `evotune search --sampler exhaustive` writes:
    meta.json, and one counted trials.jsonl record per admitted config (126), each with hopper_time; one config the
    static gate pruned (recorded spills) and one that failed the correctness gate."""
    from evotune.problems import get_problem
    from evotune.problems.shapes import parse_shape
    from evotune.records.runs import Run
    from evotune.space.searchspace import load_space

    root = tmp_path_factory.mktemp("oracle") / "runs"
    problem, shape = get_problem("attention"), parse_shape("gpt2")
    space = load_space(HOPPER)
    admitted = space.admitted_configs(problem.context(shape))
    clean = {"registers": 168, "static_smem": 0, "stack_frame": 0, "spill_stores": 0, "spill_loads": 0, "barriers": 1}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EVOTUNE_RUNS", str(root))
        run = Run.create(HOPPER_RUN, {"family": "attention", "shape": shape.as_dict(), "shape_spec": shape.spec,
                                      "space": str(HOPPER), "command_line": "synthetic", "git_sha": "test",
                                      "device": {"name": "NVIDIA H100 80GB HBM3"}})
    for number, config in enumerate(admitted):
        c = config.as_dict()
        result = {"status": R.OK, "message": "", "time_us": hopper_time(c), "max_abs": 1e-3, "resources": clean,
                  "compile_seconds": 2.0, "extra": {"eval_seconds": {"verify": 0.5, "time": 0.02}}}
        if number == 4:
            result = {"status": R.PRUNED, "message": "static: spills registers (8 B stores, 8 B loads)",
                      "resources": {**clean, "spill_stores": 8, "spill_loads": 8}}
        elif number == 9:
            result = {"status": R.WRONG, "message": "synthetic", "time_us": 1.0, "max_abs": 0.5, "resources": clean}
        run.append_trial({"number": number, "config": c, "digest": config.digest(), "counted": True,
                          "result": result})
    return run


def test_hopper_restrictions_admit_the_same_configs_on_gpt2():
    """attention-hopper extends attention.yaml with mma pinned to wgmma and three knobs omitted: on gpt2 Kernel
    Tuner's searchspace from tune_params and restrictions holds exactly evotune's 126 admitted configs, its
    per-config check agrees with the space on all 384 configs, and constant folding leaves plain string
    restrictions over the knobs (the pinned mma and the omitted knobs folded away; `block_n // 1 % 16 == 0`, which
    Kernel Tuner's string parser misreads, reads `block_n % 16 == 0`)."""
    from kernel_tuner import util

    from evotune.problems import get_problem
    from evotune.problems.shapes import parse_shape
    from evotune.space.searchspace import load_builtin

    space = load_builtin("attention-hopper")
    context = dict(get_problem("attention").context(parse_shape("gpt2")))
    admitted = space.admitted_configs(context)
    tp = K.tune_params(space)
    assert len(admitted) == 126 and tp["mma"] == ["wgmma"] and "pingpong" in tp
    ss = K.kt_searchspace(space, context)
    assert {K.config_key(c) for c in ss.list} == {K.config_key(c.as_dict()[k] for k in tp) for c in admitted}
    rs = K.restrictions(space, context)
    for c in space.all_configs():
        params = {k: c.as_dict()[k] for k in tp}
        assert bool(util.check_restrictions(rs, params, False)) == space.admitted(c, context), c.key()
    described = K.describe_restrictions(rs)
    assert all(isinstance(r, str) for r in rs) and "block_n % 16 == 0" in described
    assert not any(name in r for r in described for name in ("mma", "smem_layout", "kv_splits", "warp_key_groups"))
    assert len(ss.get_true_tunable_params()) == 7  # mma is not one: diff_evo's population is 16 x 7


def test_small_budgets_and_failing_strategies(hopper_run, tmp_path):
    """At a budget below its population (pso: 50 on 126 configs) a Kernel Tuner run still gives one point per
    evaluation; a strategy that raises is recorded with its error and a curve that found nothing, not fatal."""
    ex = K.E.Exhaustive(hopper_run.path)
    cache = K.write_cache(ex, tmp_path / "cache.json")
    tp = K.tune_params(ex.space)
    times = {K.config_key(c.as_dict()[k] for k in tp): (ex.records[c.digest()]["result"]["time_us"]
             if ex.records[c.digest()]["result"]["status"] == R.OK else None) for c in ex.admitted}
    r = K.kt_run(ex, cache, "pso", 0, 7, times)
    assert len(r["curve"]) == 7 and r["evaluated"] == 7 and "error" not in r
    bad = K.kt_run(ex, cache, "no_such_strategy", 0, 7, times)
    assert bad["error"] and bad["curve"] == [float("inf")] * 7 and bad["evaluated"] == 0
    assert K.first_population("kernel_tuner", "pso", 126, 7) == (50, "first swarm, random")
    assert K.first_population("kernel_tuner", "diff_evo", 126, 7)[0] == 112
    assert K.first_population("evotune", "nsga2", 126, 7)[0] == 16 and K.first_population("evotune", "random", 126, 7) is None


def test_diff_evo_note_on_searchspace_order(hopper_run):
    """The table note on diff_evo holds: Kernel Tuner's Latin hypercube sample comes back in searchspace order
    (ascending indices), and the note's position of the first config within 3% is that of the searchspace list."""
    import numpy as np

    ex = K.E.Exhaustive(hopper_run.path)
    ss = K.kt_searchspace(ex.space, dict(ex.problem.context(ex.shape)))
    np.random.seed(3)
    with K._seeded_lhs():
        sample = ss.get_LHS_sample_indices(112)
    assert list(sample) == sorted(sample) and len(sample) == 112
    tp = K.tune_params(ex.space)
    times = {K.config_key(c.as_dict()[k] for k in tp): hopper_time(c.as_dict()) for c in ex.admitted}
    info = K._opening_and_lookahead(ex, ss, ["diff_evo"], [], [], None)
    ok = {K.config_key(c.as_dict()[k] for k in tp) for c in ex.admitted
          if ex.records[c.digest()]["result"]["status"] == R.OK}
    first = next(i for i, c in enumerate(ss.list, start=1)
                 if K.config_key(c) in ok and times[K.config_key(c)] <= ex.optimum * 1.03)
    assert info["kt_order_first_within"] == first and info["first_population"]["kernel_tuner diff_evo"][0] == 112


LEGACY = """<!-- kt_compare:begin (generated by tools/kt_compare.py; rerun it rather than editing) -->
## evotune against Kernel Tuner (replay over the exhaustive run)

Both tools search the same 456 admitted configs of `search_spaces/attention-small.yaml` on shape 1,8,512,64:fp16, \
answered from run `mission-h100-exhaustive-small` (NVIDIA H100 80GB HBM3): optimum 5.319 us, 2 configs within 3%.

| tool | strategy | best at 5% (23 evals) | evals to within 3% | reached | evals used | s/run |
|---|---|---|---|---|---|---|
| evotune | tpe | 6.31 (+18.6%) | **50.5 (11.1%)** | 10/10 | 137 | 3.35 |
| evotune | nsga2 | 6.49 (+22.1%) | 60 (13.2%) | 10/10 | 137 | 0.6 |
| kernel_tuner | genetic_algorithm | 6.32 (+18.7%) | 65 (14.3%) | 10/10 | 136.5 | 0.03 |
| kernel_tuner | bayes_opt | 6.72 (+26.4%) | not within | 1/10 | 137 | 0.22 |

<!-- kt_compare:end -->"""


def test_named_section_per_oracle_and_the_verdict_across(hopper_run, tmp_path, monkeypatch):
    """With nsga2 as the default (the LEGACY section's evotune row is nsga2's), kt_compare on the hopper oracle (2 seeds, 2 Kernel Tuner strategies and evotune's nsga2) writes its section
    between markers naming the run after the existing one, which is kept (an unnamed older section: under markers
    naming the mission run, its text unchanged); one verdict across both oracles follows, computed from the
    tables; the notes say what the small budgets mean; writing the same section again changes nothing."""
    monkeypatch.setattr(K.E, "DEFAULT_STRATEGY", "nsga2")
    md = tmp_path / "EFFICIENCY.md"
    md.write_text("# Search efficiency\n\nmission report\n\n" + LEGACY + "\n")
    out = tmp_path / "kt_compare_gpt2-hopper.json"
    assert K.main([str(hopper_run.path), "--seeds", "2", "--kt-strategies", "random_sample,pso",
                   "--evotune-strategies", "nsga2", "--md", str(md), "--out", str(out)]) == 0
    text = md.read_text()
    assert text.startswith("# Search efficiency\n\nmission report\n\n" + K.mark_begin("mission-h100-exhaustive-small"))
    legacy_body = LEGACY.split("-->\n", 1)[1].rsplit("<!-- kt_compare:end", 1)[0]
    assert K.mark_begin("mission-h100-exhaustive-small") + "\n" + legacy_body + K.mark_end(
        "mission-h100-exhaustive-small") in text
    assert "<!-- kt_compare:end -->" not in text and "kt_compare:begin (generated" not in text
    sections = [K._section_run(m) for m in K.SECTION_RE.finditer(text)]
    assert sections == ["mission-h100-exhaustive-small", HOPPER_RUN]
    assert text.index(K.mark_end(HOPPER_RUN)) < text.index(K.VERDICT_BEGIN) and text.count(K.VERDICT_BEGIN) == 1
    assert text.rstrip().endswith(K.VERDICT_END)

    data = json.loads(out.read_text())
    assert data["size"] == 126 and data["budgets"] == {"5": 7, "10": 13, "15": 19, "30": 38}
    assert len(data["runs"]) == 3 * 4 * 2 and not any(r.get("error") for r in data["runs"])
    notes = " ".join(data["notes"])
    assert "5% = 7, 10% = 13, 15% = 19, 30% = 38" in notes
    assert "kernel_tuner pso (50: first swarm, random) at 5%, 10%, 15%, 30%" in notes
    assert "evotune nsga2 (16: first population, random admissible configs) at 5%, 10%" in notes
    rows = {(r["tool"], r["strategy"]): r["median_evals_to_within"] for r in data["summary"]["rows"]}
    inf = lambda v: float("inf") if v is None else v  # noqa: E731
    mine = rows[("evotune", "nsga2")]
    met = mine is not None and all(mine <= inf(v) for (tool, _), v in rows.items() if tool == "kernel_tuner")
    verdict = text[text.index(K.VERDICT_BEGIN):]
    hopper_line = next(line for line in verdict.splitlines() if line.startswith(f"| `{HOPPER_RUN}`"))
    mission_line = next(line for line in verdict.splitlines() if line.startswith("| `mission-h100-exhaustive-small`"))
    assert hopper_line.endswith("| yes |" if met else "| **no** |")
    assert "`search_spaces/attention-small.yaml`, 1,8,512,64:fp16 | 456 | 60 (13.2%) | 65 (14.3%): genetic_algorithm" \
           " | yes |" in mission_line
    assert ("Verdict: **met**" if met else f"Verdict: **not met** (`{HOPPER_RUN}`)") in verdict

    section = text[text.index(K.mark_begin(HOPPER_RUN)):text.index(K.mark_end(HOPPER_RUN)) + len(K.mark_end(HOPPER_RUN))]
    K.write_md(md, section + "\n")
    assert md.read_text() == text


def test_cross_verdict_without_every_oracle(tmp_path, monkeypatch):
    """With nsga2 as the default (LEGACY's evotune row) and only the mission's section, the verdict is not decided
    yet and names the missing oracle; a section whose evotune default is not within 3% fails it, whatever Kernel
    Tuner's strategies did."""
    monkeypatch.setattr(K.E, "DEFAULT_STRATEGY", "nsga2")
    verdict = K.cross_verdict(LEGACY)
    assert "| `mission-h100-exhaustive-small` |" in verdict and "| `gpt2-h100-exhaustive-hopper` | - |" in verdict
    assert "Verdict: **not decided yet** (no section for `gpt2-h100-exhaustive-hopper`); met on 1 of 2" in verdict
    other = (LEGACY.replace("kt_compare:begin (generated", "kt_compare:begin other-run (generated")
             .replace("<!-- kt_compare:end -->", K.mark_end("other-run")).replace("| 60 (13.2%) |", "| not within |")
             .replace("answered from run `mission-h100-exhaustive-small`", "answered from run `other-run`"))
    md = tmp_path / "E.md"
    md.write_text(LEGACY + "\n")
    K.write_md(md, other)
    text = md.read_text()
    assert [K._section_run(m) for m in K.SECTION_RE.finditer(text)] == ["mission-h100-exhaustive-small", "other-run"]
    verdict = text.split(K.VERDICT_BEGIN)[1]
    assert "| not within | 65 (14.3%): genetic_algorithm | **no** |" in verdict
    assert "Verdict: **not met** (`other-run`); met on 1 of 3 oracles." in verdict
