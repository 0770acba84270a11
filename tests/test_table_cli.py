"""`evotune table build|show` on the CPU, from hand-made run folders (tests/test_tuning_table.make_run)."""

from __future__ import annotations

import json

import pytest

from evotune.cli import common as cli_common
from evotune.problems.shapes import Shape
from evotune.records.tuning_table import load_table

from test_tuning_table import base, make_run

FAST = Shape(2, 8, 1024, 1024, 64)
SLOW = Shape(2, 8, 4096, 4096, 64, causal=True)


@pytest.fixture
def two_runs(runs_root):
    runs_root.mkdir()
    make_run(runs_root, "fast", FAST, time_us=10.0, baselines={"flash": base(20.0), "cudnn": base(8.0, passed=False)})
    make_run(runs_root, "slow", SLOW, time_us=10.0, baselines={"cudnn": base(5.0)})
    make_run(runs_root, "soft", FAST, family="softmax")
    return runs_root


def test_build_defaults_to_every_attention_run_and_says_each_route(two_runs, main_in_process, tmp_path):
    out = tmp_path / "t.json"
    proc = main_in_process("table", "build", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("added ") and "from run fast: route evotune: faster: evotune 10.00 us vs flash 20.00 us"
               in line for line in lines), lines
    assert any("from run slow: route sdpa: slower" in line for line in lines), lines
    assert not any("soft" in line for line in lines)  # another family's run is not one of the defaults
    assert lines[-1] == f"table: 2 entries written to {out}"
    assert {e.provenance["run"]: e.route for e in load_table(out).entries} == {"fast": "evotune", "slow": "sdpa"}

    again = main_in_process("table", "build", "fast", "soft", "-o", str(out), "--json")
    assert again.returncode == 0, again.stderr
    rep = json.loads(again.stdout)
    assert rep["entries"] == 2 and rep["path"] == str(out)
    assert [(n["run"], n["action"]) for n in rep["notes"]] == [("fast", "replaced"), ("soft", "skipped")]
    assert "family 'softmax'" in rep["notes"][1]["reason"]


def test_build_writes_the_default_table(two_runs, main_in_process, tmp_path, monkeypatch):
    monkeypatch.delenv("EVOTUNE_TABLE", raising=False)
    monkeypatch.setenv("EVOTUNE_CACHE", str(tmp_path / "cache"))  # a folder not made yet
    proc = main_in_process("table", "build", "fast")
    target = tmp_path / "cache" / "tuning-table.json"
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"table: 1 entries written to {target}"
    monkeypatch.setenv("EVOTUNE_TABLE", str(tmp_path / "env.json"))
    assert main_in_process("table", "build", "slow").returncode == 0
    assert [e.provenance["run"] for e in load_table(tmp_path / "env.json").entries] == ["slow"]


@pytest.mark.parametrize("args, says", [
    (("table", "build", "-o", "{tmp}/t.json"), "no attention run under"),
    (("table", "build", "nope", "-o", "{tmp}/t.json"), "nope: not a run folder"),
    (("table", "show", "{tmp}/missing.json"), "missing.json: no such tuning table"),
    (("table", "show", "{tmp}/bad.json"), "bad.json: not valid JSON"),
])
def test_bad_input_is_one_line_exit_2(runs_root, main_in_process, tmp_path, args, says):
    (tmp_path / "bad.json").write_text("{")
    proc = main_in_process(*(a.format(tmp=tmp_path) for a in args))
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_build_into_a_missing_folder_is_exit_2(two_runs, main_in_process, tmp_path):
    proc = main_in_process("table", "build", "fast", "-o", str(tmp_path / "no" / "t.json"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr


@pytest.mark.parametrize("width", [80, 200])
def test_show_never_cuts_the_key(two_runs, main_in_process, tmp_path, monkeypatch, width):
    out = tmp_path / "t.json"
    assert main_in_process("table", "build", "-o", str(out)).returncode == 0
    monkeypatch.setattr(cli_common.console, "width", width)
    proc = main_in_process("table", "show", str(out))
    assert proc.returncode == 0, proc.stderr
    for e in load_table(out).entries:
        assert e.key.spec() in proc.stdout, (e.key.spec(), proc.stdout)
        assert f"{e.provenance['run']}/{e.provenance['trial']}" in proc.stdout
    assert "flash 20.00 us" in proc.stdout and "cudnn 5.00 us" in proc.stdout and "evotune" in proc.stdout
    title, *rest = proc.stdout.splitlines()
    assert title.strip() == f"{out}: 2 entries" and max(len(line) for line in rest) <= width  # the title names the file whole
    shown = json.loads(main_in_process("table", "show", str(out), "--json").stdout)
    assert shown["path"] == str(out) and len(shown["entries"]) == 2
