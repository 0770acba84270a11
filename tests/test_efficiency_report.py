"""Tests for tools/efficiency_report.py: the best-so-far curve math, and an end-to-end report on a synthetic
exhaustive run (a fake run folder over a 96-config space) replayed through the real search loop."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from evotune.records import result as R
from evotune.build.compile import static_violations
from evotune.records.runs import Run
from evotune.space.searchspace import load_space
from _paths import REPO_ROOT, load_tool
from test_search import REDUCED_SPACE

E = load_tool("efficiency_report")


def rec(status: str, t: float | None, counted: bool = True, dup: int | None = None) -> dict:
    return {"counted": counted, "duplicate_of": dup, "result": {"status": status, "time_us": t}}


def test_best_so_far_counts_only_counted_evaluations():
    """The curve has one point per counted evaluation, ignores failures, non-counted records and duplicates,
    is inf before the first pass, and keeps its last value when the run stopped short of the budget."""
    records = [rec(R.PRUNED, None, counted=False), rec(R.WRONG, 0.5), rec(R.OK, 9.0), rec(R.OK, 9.0, False, 2),
               rec(R.OK, 7.0), rec(R.COMPILE_ERROR, None), rec(R.OK, 8.0), rec(R.OK, 6.0)]
    assert E.best_so_far(records, 5) == [math.inf, 9.0, 7.0, 7.0, 7.0]
    assert E.best_so_far(records, 8) == [math.inf, 9.0, 7.0, 7.0, 7.0, 6.0, 6.0, 6.0]
    assert E.evals_to_within([math.inf, 9.0, 7.0, 6.1, 6.0], 6.0) == 4      # 6.1 is within 3% of 6.0
    assert E.evals_to_within([math.inf, 9.0, 7.0], 6.0) is None
    assert E.checkpoint(456, 15) == 69 and E.checkpoint(456, 5) == 23 and E.checkpoint(3, 1) == 1


def synthetic_time(c: dict) -> float:
    return round(6.0 + abs(c["block_m"] - 64) / 16 + abs(c["block_n"] - 64) / 32 + 0.25 * c["stages"]
                 + 0.5 * c["producer_warps"] + (0.125 if c["smem_layout"] == "pad" else 0.0)
                 + (0.2 if not c["q_in_regs"] else 0.0) + 0.1 * c["compute_warps"], 6)


@pytest.fixture
def exhaustive_run(tmp_path, attention, mission, monkeypatch):
    """A fake exhaustive run: every admitted config of the reduced space with a synthetic time, one compile error,
    one config the static gate prunes (recorded spills) and one that failed the gate."""
    monkeypatch.setenv("EVOTUNE_RUNS", str(tmp_path / "runs"))
    space_path = tmp_path / "attention-reduced.yaml"
    space_path.write_text(REDUCED_SPACE)
    space = load_space(space_path)
    admitted = space.admitted_configs(attention.context(mission))
    run = Run.create("exhaustive", {"family": "attention", "shape": mission.as_dict(), "shape_spec": mission.spec,
                                    "space": str(space_path), "command_line": "synthetic", "git_sha": "test"})
    clean = {"registers": 96, "static_smem": 0, "stack_frame": 0, "spill_stores": 0, "spill_loads": 0, "barriers": 1}
    for number, config in enumerate(admitted):
        c = config.as_dict()
        result = {"status": R.OK, "message": "", "time_us": synthetic_time(c), "max_abs": 1e-3,
                  "resources": clean, "compile_seconds": 2.0}
        if number == 3:
            result = {"status": R.COMPILE_ERROR, "message": "NVRTC: error: synthetic"}
        elif number == 5:
            spilling = {**clean, "spill_stores": 8, "spill_loads": 8}
            assert static_violations(type("Res", (), spilling)(), 128, 0)
            result = {"status": R.PRUNED, "message": "static: spills registers (8 B stores, 8 B loads)",
                      "resources": spilling}
        elif number == 7:
            result = {"status": R.WRONG, "message": "synthetic", "time_us": 0.01, "max_abs": 0.5, "resources": clean}
        run.append_trial({"number": number, "config": c, "digest": config.digest(), "counted": True,
                          "result": result})
    return run, admitted


def test_replay_tells_each_strategy_what_the_exhaustive_run_recorded(exhaustive_run):
    """A replayed search's counted records carry exactly the exhaustive run's results (statuses and times), the
    compile error and the static prune included, and nothing is compiled."""
    run, admitted = exhaustive_run
    ex = E.Exhaustive(run.path)
    assert ex.size == len(admitted) == 96
    assert ex.optimum == min(synthetic_time(c.as_dict()) for i, c in enumerate(admitted) if i not in (3, 5, 7))
    out = E.replay(ex, "random", 0, 96, run.path.parent / "scratch")
    assert out["mismatched"] == 0 and out["evaluated"] == 96
    assert out["curve"][-1] == ex.optimum  # the whole space: the optimum is found
    replayed = Run(run.path.parent / "scratch" / "random-s0").trials()
    by_digest = {r["digest"]: r for r in run.trials()}
    for r in replayed:
        if r["counted"]:
            want = by_digest[r["digest"]]["result"]
            assert r["result"]["status"] == want["status"] and r["result"].get("time_us") == want.get("time_us")
    statuses = {r["result"]["status"] for r in replayed if r["counted"]}
    assert {R.COMPILE_ERROR, R.PRUNED, R.WRONG, R.OK} <= statuses


def test_report_files_are_written(exhaustive_run, tmp_path):
    """The tool writes EFFICIENCY.md (tables, verdict, command, data source), the JSON data with one curve per
    strategy and seed, and the PNG plot when matplotlib is installed."""
    run, _ = exhaustive_run
    out = tmp_path / "docs"
    assert E.main([str(run.path), "--seeds", "2", "--budget-pct", "40", "--out-dir", str(out)]) == 0
    text = (out / "EFFICIENCY.md").read_text()
    for s in ("nsga2", "nsga2-plain", "tpe", "random", "Verdict", "within 3%", "synthetic", "--seeds 2", "exhaustive"):
        assert s in text
    data = json.loads((out / "data" / "efficiency.json").read_text())
    assert data["budget"] == E.checkpoint(96, 40) == 39
    assert len(data["runs"]) == 10 and all(len(r["curve"]) == 39 for r in data["runs"])  # 5 strategies x 2 seeds
    assert all(r["mismatched"] == 0 for r in data["runs"])
    assert data["summary"]["table"]["nsga2"]["seeds"] == 2
    for r in data["runs"]:  # each curve is what best_so_far says of its run's records: non-increasing
        assert all(a >= b for a, b in zip(r["curve"], r["curve"][1:]))
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "efficiency.png").stat().st_size > 10_000
        assert "efficiency.png" in text


def test_incomplete_exhaustive_run_is_refused(exhaustive_run, tmp_path):
    """A run missing some admitted configs cannot be replayed: exit code 2 and a one-line reason."""
    run, admitted = exhaustive_run
    lines = run.trials_path.read_text().splitlines()
    run.trials_path.write_text("\n".join(lines[:-1]) + "\n")
    assert E.main([str(run.path), "--out-dir", str(tmp_path / "docs")]) == 2
    with pytest.raises(E.ReplayError, match="1 of 96 admitted configs have no record"):
        E.Exhaustive(run.path)


def test_attention_small_is_a_subset_of_attention(attention, mission):
    """search_spaces/attention-small.yaml is a slice of attention.yaml: each knob's values a subset, the knobs it
    omits at their defaults (mma = sync; the Hopper-only epilogue knob, added later, = regs; the key_merge knob, added
    later still, = gather; the kv_load knob, added after it, = cp_async; the kv_cluster knob, after that, = 1), and on
    every one of
    its configs the same derived values and the same admit/reject decision as the full space, on the mission shape
    and a causal d128 bf16 one; it admits the 456 configs its header and the README promise on the mission shape."""
    from evotune.problems.attention import KNOB_DEFAULTS
    from evotune.problems.shapes import parse_shape
    from evotune.space.searchspace import load_builtin

    full, small = load_builtin("attention"), load_builtin("attention-small")
    domains = {p.name: set(p.values) for p in full.params}
    assert {p.name for p in small.params} <= set(domains)
    assert all(set(p.values) <= domains[p.name] for p in small.params)
    omitted = set(domains) - {p.name for p in small.params}
    assert omitted == {"mma", "pingpong", "persistent", "pdl", "epilogue", "key_merge", "kv_load", "kv_cluster",
                       "exp2_fma", "rescale", "softmax_overlap", "lean_addressing", "p_operand", "empty_warpgroups",
                       "causal_extent", "stripe_order"}
    pinned = {name: KNOB_DEFAULTS[name] for name in omitted}
    assert pinned == {"mma": "sync", "pingpong": False, "persistent": False, "pdl": False, "epilogue": "regs",
                      "key_merge": "gather", "kv_load": "cp_async", "kv_cluster": 1, "exp2_fma": 0,
                      "rescale": "always", "softmax_overlap": False, "lean_addressing": False, "p_operand": "regs",
                      "empty_warpgroups": "compute", "causal_extent": "tile", "stripe_order": "fixed"}
    for shape in (mission, parse_shape("2,4,300,300,128:bf16:causal")):
        ctx = attention.context(shape)
        for cfg in small.all_configs():
            as_full = full.config({**cfg.as_dict(), **pinned})
            assert bool(small.violations(cfg, ctx)) == bool(full.violations(as_full, ctx)), cfg.as_dict()
            assert small.derive(cfg, ctx) == {k: v for k, v in full.derive(as_full, ctx).items()
                                                      if k in small.derive(cfg, ctx)}
    assert small.size() == 972 and len(small.admitted_configs(attention.context(mission))) == 456


KT_SECTIONS = """<!-- kt_compare:begin mission-h100-exhaustive-small (generated by tools/kt_compare.py; rerun it rather than \
editing) -->
## evotune against Kernel Tuner on the mission
| tool | strategy | evals to within 3% |
<!-- kt_compare:end mission-h100-exhaustive-small -->

<!-- kt_compare:begin gpt2-h100-exhaustive-hopper (generated by tools/kt_compare.py; rerun it rather than editing) -->
## evotune against Kernel Tuner on gpt2
<!-- kt_compare:end gpt2-h100-exhaustive-hopper -->

<!-- kt_compare:verdict begin (generated by tools/kt_compare.py from the kt_compare sections; rerun it rather than \
editing) -->
## evotune against Kernel Tuner across the oracles
Verdict: **met**; met on 2 of 2 oracles.
<!-- kt_compare:verdict end -->"""


def test_rewriting_the_report_keeps_every_kt_compare_section(exhaustive_run, tmp_path):
    """Rewriting EFFICIENCY.md keeps kt_compare's sections, one per oracle and the verdict across them, as they
    were (the report's own text is replaced); --md/--plot/--json write a second oracle's report under names of its
    own, linking its plot relative to the report."""
    run, _ = exhaustive_run
    out = tmp_path / "docs"
    out.mkdir()
    (out / "EFFICIENCY.md").write_text("# Search efficiency\n\nan older report\n\n" + KT_SECTIONS + "\n")
    assert E.main([str(run.path), "--seeds", "1", "--strategies", "random", "--budget-pct", "10",
                   "--out-dir", str(out)]) == 0
    text = (out / "EFFICIENCY.md").read_text()
    assert "an older report" not in text and text.endswith("\n" + KT_SECTIONS + "\n")
    assert text.count("<!-- kt_compare:") == 6
    assert E.main([str(run.path), "--seeds", "1", "--strategies", "random", "--budget-pct", "10",
                   "--out-dir", str(out)]) == 0
    assert (out / "EFFICIENCY.md").read_text() == text  # rerunning keeps the sections once, in place

    second = out / "EFFICIENCY-second.md"
    assert E.main([str(run.path), "--seeds", "1", "--strategies", "random", "--budget-pct", "10", "--md",
                   str(second), "--plot", str(out / "img" / "second.png"), "--json", str(out / "data" / "second.json")]) == 0
    assert json.loads((out / "data" / "second.json").read_text())["budget"] == 10
    assert "kt_compare" not in second.read_text() and (out / "EFFICIENCY.md").read_text() == text
    if importlib.util.find_spec("matplotlib") is not None:
        assert "](img/second.png)" in second.read_text() and (out / "img" / "second.png").exists()
