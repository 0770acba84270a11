"""Input is bounded and checked before hardware (issue 38): files the user names are read as regular files within a
byte bound, enumeration is bounded, every bad option is one line and exit 2 before the GPU is looked for, a plugin
that fails to import is one line, and a bare space name finds the packaged spaces."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from evotune.errors import UsageError
from evotune.outputs import read_input
from evotune.space import enumeration, searchspace
from _paths import REPO_ROOT
from test_cli import assert_one_line_error, cli, make_run, passing_record  # noqa: F401 (cli: a fixture)

NO_GPU = "no CUDA GPU is visible"


# ------------------------------------------------------------------ every option before the GPU


@pytest.mark.parametrize("args, fragment", [
    (["tune", "--shape", "1,8,512,80"], "head_dim 80 is not supported"),
    (["tune", "--shape", "mission", "--timeout", "nan"], "'--timeout'"),
    (["tune", "--shape", "mission", "--gpu", "-1"], "'--gpu'"),
    (["tune", "--shape", "mission", "--trials", "99999999999999999999999"], "'--trials'"),
    (["search", "--trials", "99999999999999999999999"], "'--trials'"),
    (["search", "--timeout", "nan"], "'--timeout'"),
    (["search", "--timeout", "inf"], "'--timeout'"),
    (["search", "--timeout", "0"], "'--timeout'"),
    (["search", "--gpu", "-1"], "'--gpu'"),
    (["search", "--gpus", "99999999999999999999"], "--gpus"),
    (["search", "--storage", "foo://bar"], "scheme 'foo'"),
    (["search", "--seed", "-1"], "'--seed'"),
    (["search", "--population", "99999999999999999999"], "'--population'"),
    (["search", "--compile-workers", "99999999999"], "'--compile-workers'"),
    (["search", "--lookahead", "99999999999"], "'--lookahead'"),
    (["search", "--shape", "1,8,512,80"], "head_dim 80 is not supported"),
    (["bench", "--config", "{}", "--reps", "99999999999999"], "'--reps'"),
    (["verify", "--config", "{}", "--launches", "99999999999999"], "'--launches'"),
    (["check", "--sample", "99999999999999999999"], "'--sample'"),
    (["check", "--seed", "99999999999999999999"], "'--seed'"),
    (["check", "--jobs", "99999999999"], "'--jobs'"),
], ids=lambda a: "-".join(a) if isinstance(a, list) and len("-".join(a)) < 40 else None)
def test_bad_input_is_exit_2_before_the_gpu(main_in_process, runs_root, args, fragment):
    """Each bad option or shape is one line and exit 2, not this machine's `no CUDA GPU` (exit 1); no run is made."""
    line = assert_one_line_error(main_in_process(*args), 2, fragment)
    assert NO_GPU not in line
    assert not runs_root.exists() or list(runs_root.iterdir()) == []


# ------------------------------------------------------------------ files that are not files, or too large


def test_space_file_that_is_a_device_or_a_fifo(cli, tmp_path):
    """`check --space /dev/zero` and a FIFO are one line and exit 2 at once (the deadline only guards a hang)."""
    fifo = tmp_path / "space.yaml"
    os.mkfifo(fifo)
    assert_one_line_error(cli("check", "--space", "/dev/zero", timeout=120), 2, "is a character device",
                          "must be a regular file")
    assert_one_line_error(cli("check", "--space", str(fifo), timeout=120), 2, "is a FIFO")


@pytest.mark.parametrize("args, what", [
    (["tune", "--shapes", "{special}"], "shapes file"),
    (["table", "show", "{special}"], "tuning table"),
    (["table", "build", "--bench", "{special}", "-o", "{tmp}/t.json", "r"], "bench record"),
])
def test_other_input_files_must_be_regular(main_in_process, runs_root, mission, space, tmp_path, args, what):
    """Shapes files, tables and bench records: a device or a FIFO is one line, exit 2 (never read, never waited on)."""
    make_run("r", mission, [passing_record(space, 0)])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for special, kind in (("/dev/zero", "a character device"), (str(fifo), "a FIFO")):
        argv = [a.replace("{special}", special).replace("{tmp}", str(tmp_path)) for a in args]
        assert_one_line_error(main_in_process(*argv), 2, f"is {kind}", f"a {what} must be a regular file")


def test_read_input_counts_what_it_reads(tmp_path):
    """The bound is on the bytes read: a file past it is refused with its size; one within it is read whole."""
    path = tmp_path / "f.json"
    path.write_bytes(b"x" * 100)
    with pytest.raises(UsageError, match=r"f.json: 100 bytes; a test file is at most 99 bytes$"):
        read_input(path, "test file", 99)
    assert read_input(path, "test file", 100) == b"x" * 100


# ------------------------------------------------------------------ enumeration


def _wide_space(tmp_path, constraint: str = "") -> str:
    """A space of 8^6 = 262,144 configs with no constraint, or with one that only its last knob decides."""
    params = "".join(f"  p{i}: {{values: [1, 2, 3, 4, 5, 6, 7, 8]}}\n" for i in range(6))
    extra = f"constraints:\n  - {{expr: '{constraint}', why: never}}\n" if constraint else ""
    path = tmp_path / "wide.yaml"
    path.write_text(f"family: t\nparams:\n{params}{extra}")
    return str(path)


def test_enumeration_is_bounded_in_memory(tmp_path, monkeypatch):
    """A space that admits more configs than the bound is one UsageError saying so, not gigabytes."""
    monkeypatch.setattr(enumeration, "MAX_ADMITTED", 1000)
    space = searchspace.load_space(_wide_space(tmp_path), context_names=(), knob_domains=None)
    with pytest.raises(UsageError, match=r"wide.yaml: admits more than 1,000 configs on this shape \(of 262,144\)"):
        space.admitted_configs({})


def test_enumeration_is_bounded_in_steps(tmp_path, monkeypatch):
    """A walk that would visit more nodes than the bound (here: nothing admitted, decided at the last knob) is one
    UsageError, counted in steps, not timed; check_nonempty stops the same way."""
    monkeypatch.setattr(enumeration, "MAX_ENUMERATION_STEPS", 10_000)
    space = searchspace.load_space(_wide_space(tmp_path, "p5 > 100"), context_names=(), knob_domains=None)
    with pytest.raises(UsageError, match=r"enumerating its 262,144 configs takes more than 10,000 steps"):
        space.admitted_configs({})
    with pytest.raises(UsageError, match=r"takes more than 10,000 steps"):
        searchspace.check_nonempty(space, {})


def test_check_says_the_space_is_too_large(main_in_process, monkeypatch):
    """Through `evotune check`: one line, exit 2, nothing compiled."""
    monkeypatch.setattr(enumeration, "MAX_ADMITTED", 10)
    assert_one_line_error(main_in_process("check", "--space", "attention-small", "--sample", "1"), 2,
                          "admits more than 10 configs")


# ------------------------------------------------------------------ plugins


@pytest.mark.parametrize("body, fragment", [
    ("raise RuntimeError('plugin is broken\\nsecond line')", "RuntimeError: plugin is broken second line"),
    ("import sys\nsys.exit(0)", "it called sys.exit(0)"),
    ("import sys\nsys.exit(3)", "it called sys.exit(3)"),
])
def test_plugin_failing_on_import_is_one_line(cli, tmp_path, body, fragment):
    """A plugin module that raises, or exits (even with 0), on import is one line and exit 2."""
    (tmp_path / "evotune_failfam.py").write_text(body + "\n")
    assert_one_line_error(cli("--plugin", "evotune_failfam", "check", "--family", "evotune_failfam:PROBLEM"), 2,
                          "kernel family 'evotune_failfam:PROBLEM': importing module 'evotune_failfam' failed",
                          fragment)


# ------------------------------------------------------------------ built-in spaces by name


def test_bare_space_name_is_a_builtin(monkeypatch, tmp_path):
    """`--space attention:hopper3` (and `attention-hopper3`, the file that profile was) names the packaged profile
    from any folder (as a wheel install ships them: here a copy in EVOTUNE_SPACES); an unknown name lists the
    built-in ones."""
    from evotune.cli.common import load_problem

    packaged = tmp_path / "site-packages" / "evotune" / "search_spaces"
    shutil.copytree(REPO_ROOT / "search_spaces", packaged)
    monkeypatch.setenv("EVOTUNE_SPACES", str(packaged))
    monkeypatch.chdir(tmp_path)
    for name in ("attention:hopper3", "attention-hopper3"):
        _, _, space = load_problem(None, name)
        assert space.path == str(packaged / "attention.yaml") + "#hopper3"
    with pytest.raises(UsageError, match=r"--space nope: no such file, nor a built-in space .*attention:hopper3"):
        load_problem(None, "nope")


# ------------------------------------------------------------------ records


def test_unknown_knob_in_a_recorded_config_is_refused(main_in_process, runs_root, mission, space, tmp_path):
    """A best trial whose config names a knob the family does not have is not exported: one line, exit 2."""
    rec = passing_record(space, 0)
    rec["config"] = {**rec["config"], "warp_magic": 7}
    make_run("odd", mission, [rec])
    out = tmp_path / "k.cu"
    assert_one_line_error(main_in_process("export", "best", "--run", "odd", "-o", str(out)), 2,
                          "trial 0", "'warp_magic' is not a knob")
    assert not out.exists()


def test_runs_and_export_agree_on_a_folder_without_meta(main_in_process, runs_root, mission, space, tmp_path):
    """A run folder with records but no meta.json: `runs` lists it damaged naming meta.json, and `export --run`
    says it is damaged naming meta.json (exit 2), rather than that there is no such run."""
    run = make_run("orphan", mission, [passing_record(space, 0)])
    (run.path / "meta.json").unlink()
    rows = json.loads(main_in_process("runs", "--json").stdout)
    assert [r["damaged"] for r in rows] == ["meta.json: missing"]
    assert_one_line_error(main_in_process("export", "best", "--run", "orphan", "-o", str(tmp_path / "k.cu")), 2,
                          "run 'orphan' is damaged", "meta.json: missing")


def test_tuning_table_and_records_read_by_the_library_are_bounded(tmp_path):
    """The op's own table read ($EVOTUNE_TABLE) and the bench/shapes records refuse a FIFO or a device at once
    (never opened to wait) with one UsageError line; a missing table keeps its own message."""
    from evotune.records import tuning_table

    fifo = tmp_path / "table.json"
    os.mkfifo(fifo)
    for read in (tuning_table.load_table, tuning_table.read_shapes_file):
        with pytest.raises(UsageError, match="must be a regular file"):
            read(fifo)
    with pytest.raises(UsageError, match="must be a regular file"):
        tuning_table.load_table("/dev/zero")
    with pytest.raises(UsageError, match="no such tuning table"):
        tuning_table.load_table(tmp_path / "missing.json")
