"""`evotune tune` on the CPU: argument handling, --shapes file checks, and the per-key loop with the
per-key search (evotune.cli.table._search_key, which needs a GPU) replaced by one that writes a run folder."""

from __future__ import annotations

import json

import pytest

from evotune.cli import common as cli_common
from evotune.cli import table as cli_table
from evotune.errors import EvotuneError
from evotune.problems.shapes import parse_shape
from evotune.records.tuning_table import load_table

from test_tuning_table import base, make_run


@pytest.fixture
def fake_search(runs_root, monkeypatch):
    """A GPU is 'visible' and each key's search writes a run that beat SDPA; `calls` lists the searches."""
    runs_root.mkdir()
    calls = []

    def search_key(shape, trials, timeout, gpu, json_out, **options):  # seeds, priors: not read here
        calls.append((shape.spec, trials))
        if shape.spec in fake_search_fails:
            raise EvotuneError(f"run r{len(calls)}: no candidate passed the correctness gate")
        name = f"r{len(calls)}"
        make_run(runs_root, name, shape, time_us=10.0, baselines={"cudnn": base(12.0)})
        return name

    fake_search_fails: set[str] = set()
    monkeypatch.setattr(cli_common, "gpu_count", lambda: 1)
    monkeypatch.setattr(cli_table, "_search_key", search_key)
    return calls, fake_search_fails


def shapes_file(tmp_path, obj, name="shapes.json"):
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


def rec(*specs):
    return {"version": 1, "kind": "evotune-attention-shapes", "shapes": [{"shape": s, "calls": 1} for s in specs]}


@pytest.mark.parametrize("content, says", [
    ("{not json", "not a readable JSON shapes file"),
    ([1, 2], "not a shapes record (expected an object, got a list)"),
    ({"version": 1, "kind": "evotune-bench", "shapes": []}, "not a shapes record (kind \"evotune-bench\""),
    ({"version": 3, "kind": "evotune-attention-shapes", "shapes": []}, "version 3 is not supported"),
    ({"version": 2, "kind": "evotune-attention-shapes", "shapes": [{"shape": "mission", "family": "softmax"}]},
     "shapes[0]: family \"softmax\" is not one tune takes"),
    ({"version": 1, "kind": "evotune-attention-shapes", "shapes": []}, "records no shape"),
    ({"version": 1, "kind": "evotune-attention-shapes", "shapes": [{"shape": None}]}, "records no shape"),
    ({"version": 1, "kind": "evotune-attention-shapes", "shapes": {}}, "shapes: expected a list"),
    ({"version": 1, "kind": "evotune-attention-shapes", "shapes": [{"shape": 3}]}, "shapes[0]: expected an object"),
])
def test_bad_shapes_file_is_exit_2_naming_it(fake_search, main_in_process, tmp_path, content, says):
    calls, _ = fake_search
    path = shapes_file(tmp_path, content)
    proc = main_in_process("tune", "--shapes", path, "--table", str(tmp_path / "t.json"))
    assert proc.returncode == 2 and proc.stderr.startswith(f"evotune: error: {path}: ") and says in proc.stderr, \
        proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not calls


@pytest.mark.parametrize("args, says", [
    ((), "nothing to tune: give --shape SPEC"),
    (("--shape", "mission", "--shapes", "x.json"), "not both"),
    (("--shape", "1,2,3"), "shape: cannot read '1,2,3'"),
    (("--shape", "mission", "--shapes", "missing.json"), "not both"),
    (("--shapes", "missing.json"), "missing.json: no such shapes file"),
    (("--shape", "mission", "--table", "/nonexistent-dir/t.json"), "folder /nonexistent-dir does not exist"),
    (("--shape", "mission", "--trials", "0"), "--trials"),
    (("--shape", "mission", "--time-budget", "0"), "--time-budget"),
    (("--shape", "mission", "--time-budget", "nan"), "--time-budget"),
])
def test_bad_arguments_are_exit_2(fake_search, main_in_process, args, says):
    calls, _ = fake_search
    proc = main_in_process("tune", *args)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert not calls


def test_damaged_table_fails_before_any_search(fake_search, main_in_process, tmp_path):
    calls, _ = fake_search
    (tmp_path / "t.json").write_text('{"version": 9}')
    proc = main_in_process("tune", "--shape", "mission", "--table", str(tmp_path / "t.json"))
    assert proc.returncode == 2 and "version 9 is not supported" in proc.stderr and not calls


def test_without_gpu_fails_in_one_line_before_searching(runs_root, main_in_process, tmp_path, monkeypatch):
    searched = []
    monkeypatch.setattr(cli_common, "gpu_count", lambda: 0)
    monkeypatch.setattr(cli_table, "_search_key", lambda *a: searched.append(a))
    proc = main_in_process("tune", "--shape", "mission", "--table", str(tmp_path / "t.json"))
    assert proc.returncode == 1 and "no CUDA GPU is visible: `evotune tune` needs one" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not searched and not (tmp_path / "t.json").exists()


def test_each_distinct_key_is_searched_once_then_the_table_is_updated(fake_search, main_in_process, tmp_path):
    calls, _ = fake_search
    table = tmp_path / "t.json"
    # 1000 and 1024 rows share the bucket 1024, 2x8 and 1x12 heads the batch x heads bucket 16: one key,
    # tuned as the first shape given.
    path = shapes_file(tmp_path, rec("2,8,1000,64:bf16", "2,8,4096,128:fp16:causal", "1,12,1024,64:bf16"))
    proc = main_in_process("tune", "--shapes", path, "--trials", "7", "--table", str(table))
    assert proc.returncode == 0, proc.stderr
    assert calls == [("2,8,1000,64:bf16", 7), ("2,8,4096,128:fp16:causal", 7)]
    assert "key 1/2: 2,8,1000,64:bf16 ..." in proc.stderr and "key 2/2: 2,8,4096,128:fp16:causal ..." in proc.stderr
    assert "1,12,1024,64:bf16 has the key of 2,8,1000,64:bf16" in proc.stderr
    assert proc.stdout.splitlines()[-1] == f"table: 2 entries written to {table}"
    entries = load_table(table).entries
    assert sorted(e.provenance["run"] for e in entries) == ["r1", "r2"] and {e.route for e in entries} == {"evotune"}

    # Again with --shape: the new run replaces its key's entry, the other entry stays.
    proc = main_in_process("tune", "--shape", "2,8,4096,128:fp16:causal", "--table", str(table), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["keys"] == [{"shape": "2,8,4096,128:fp16:causal", "run": "r3", "error": None}]
    assert [(n["run"], n["action"]) for n in out["notes"]] == [("r3", "replaced")]
    assert sorted(e.provenance["run"] for e in load_table(table).entries) == ["r1", "r3"]


def test_a_failed_key_does_not_stop_the_others(fake_search, main_in_process, tmp_path):
    calls, fails = fake_search
    fails.add("2,8,1024,64:fp16")
    table = tmp_path / "t.json"
    proc = main_in_process("tune", "--shape", "2,8,1024,64", "--shape", "2,8,2048,64", "--table", str(table))
    assert proc.returncode == 1 and len(calls) == 2
    assert "key 2,8,1024,64:fp16: not tuned: run r1: no candidate passed" in proc.stderr
    assert "1 of 2 keys not tuned (2,8,1024,64:fp16)" in proc.stderr
    assert [e.provenance["run"] for e in load_table(table).entries] == ["r2"]


def test_tune_plan_keeps_the_first_shape_of_each_key():
    from evotune.records.tuning_table import tune_plan

    plan, notes = tune_plan(["1,8,512,64", "1,6,300,64", "1,8,512,64:causal", "1,8,512,64"])
    assert [s.spec for s in plan] == ["1,8,512,64:fp16", "1,8,512,64:fp16:causal"]
    assert len(notes) == 2 and parse_shape("1,6,300,64").spec in notes[0]


def test_tune_plan_tunes_each_batch_heads_bucket():
    """One sequence bucket at batch 1 and at batch 16 is two keys, so two searches (the work differs 16x)."""
    from evotune.records.tuning_table import tune_plan

    plan, notes = tune_plan(["1,12,512,64", "16,12,512,64", "16,16,512,64"])
    assert [s.spec for s in plan] == ["1,12,512,64:fp16", "16,12,512,64:fp16"] and len(notes) == 1


def test_time_budget_is_shared_among_the_keys_left(fake_search, main_in_process, runs_root, tmp_path, monkeypatch):
    """--time-budget S: each key's search may ask candidates until its share of what is left (S / keys not yet
    searched) has passed, a key that ends early leaving the rest to the next; without it no search has a stop."""
    clock = [1000.0]
    stops, made = [], iter(range(1, 100))

    def search_key(shape, trials, timeout, gpu, json_out, stop_at=None, **options):
        stops.append(None if stop_at is None else round(stop_at - clock[0], 6))
        clock[0] += 10.0  # each search takes 10 s, finalists included
        name = f"b{next(made)}"
        make_run(runs_root, name, shape, time_us=10.0, baselines={"cudnn": base(12.0)})
        return name

    monkeypatch.setattr(cli_table, "_search_key", search_key)
    monkeypatch.setattr(cli_table.time, "monotonic", lambda: clock[0])
    shapes = ("--shape", "mission", "--shape", "1,8,2048,64:causal", "--shape", "2,16,4096,128:bf16")
    proc = main_in_process("tune", *shapes, "--time-budget", "90", "--table", str(tmp_path / "t.json"))
    assert proc.returncode == 0, proc.stderr
    assert stops == [30.0, 40.0, 70.0]  # 90/3; then (90-10)/2; then 90-10-10
    stops.clear()
    proc = main_in_process("tune", *shapes, "--table", str(tmp_path / "u.json"))
    assert proc.returncode == 0 and stops == [None, None, None], proc.stderr
