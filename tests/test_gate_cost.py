"""tools/gate_cost.py on the CPU: its config draw, its summary of per-phase seconds (old and new phase
names alike), and one-line errors for bad input; the measuring itself needs the GPU."""

from __future__ import annotations

import pytest

from _paths import load_tool


@pytest.fixture(scope="module")
def gate_cost():
    return load_tool("gate_cost")


def test_draw_configs_is_seeded_distinct_and_admitted(gate_cost):
    """The same seed draws the same distinct admitted configs (so two checkouts can be given the same ones)."""
    problem, space, shape = gate_cost.problem_space_shape("attention", "mission")

    class EnumeratedOnce:
        """The space, its admitted configs enumerated once for the three draws (~8 s each on CI's 2 cores)."""

        def __init__(self):
            self.admitted = []

        def admitted_configs(self, context):
            if not self.admitted:
                self.admitted.extend(space.admitted_configs(context))
            return list(self.admitted)

    once = EnumeratedOnce()
    first = gate_cost.draw_configs(once, problem, shape, 12, seed=3)
    assert first == gate_cost.draw_configs(once, problem, shape, 12, seed=3)
    assert len(first) == 12 == len({c.key() for c in first})
    assert all(space.admitted(c, problem.context(shape)) for c in first)
    assert first != gate_cost.draw_configs(once, problem, shape, 12, seed=4)


def test_summary_takes_whatever_phases_a_checkout_records(gate_cost):
    """Mean and median per phase over the candidates that reached it, plus their sum and the wall time."""
    records = [
        {"status": "ok", "eval_seconds": {"load": 0.1, "verify": 1.0, "timed_check": 0.2, "time": 0.5},
         "wall_seconds": 1.9},
        {"status": "ok", "eval_seconds": {"load": 0.3, "verify": 2.0, "timed_check": 0.4, "time": 0.7},
         "wall_seconds": 3.5},
        {"status": "wrong", "eval_seconds": {"load": 0.2, "verify": 3.0}, "wall_seconds": 3.3},
        {"status": "raised", "message": "AcceleratorError: illegal address"},
    ]
    summary = gate_cost.summarize(records)
    phases = summary["phases"]
    assert list(phases) == ["load", "verify", "timed_check", "time", "total", "wall"]
    assert phases["verify"] == {"mean": 2.0, "median": 2.0, "n": 3}
    assert phases["time"]["n"] == 2 and phases["time"]["median"] == pytest.approx(0.6)
    assert phases["total"]["median"] == pytest.approx(3.2)
    assert summary["statuses"] == {"ok": 2, "wrong": 1, "raised": 1}
    text = gate_cost.table({"evaluated": 4, "space": "attention", "shape": "mission", "device": "H100",
                            "evotune": "/x", "git_sha": "abc", "summary": summary})
    assert text.splitlines()[-1] == "statuses: ok 2, wrong 1, raised 1"


@pytest.mark.parametrize("args, fragment", [
    (["--space", "nosuch"], "unknown search space 'nosuch'"),
    (["--shape", "1,2,3"], "shape"),
    (["--same-configs", "/nonexistent/report.json"], "No such file"),
])
def test_bad_input_is_one_line_exit_2(gate_cost, tmp_path, capsys, args, fragment):
    """A bad space, shape or earlier report is one `gate_cost: error:` line and exit code 2."""
    assert gate_cost.main([*args, "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gate_cost: error: ") and fragment in err[0]
