"""No command destroys data it was not asked to write (issue 38): an output option writes only an ordinary file,
never inside a run folder or the compile cache, and read-only commands write nothing into run folders."""

from __future__ import annotations

import gzip
import json
import os
import stat

import pytest

from evotune.outputs import check_output_path, write_output
from evotune.errors import UsageError
from test_cli import assert_one_line_error, make_run, passing_record


def folder_state(path) -> dict:
    """Every file under `path` by relative name, with its bytes (a new or changed file shows)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def run(runs_root, mission, space):
    return make_run("mission-h100", mission, [passing_record(space, 0), passing_record(space, 1)])


# ------------------------------------------------------------------ run folders and the cache


@pytest.mark.parametrize("name", ["trials.jsonl", "best.json", "meta.json", "new.cu"])
def test_export_into_a_run_folder_is_refused(main_in_process, run, name):
    """`export -o` onto a run's records (or any new file in its folder) exits 2 and leaves the folder as it was."""
    before = folder_state(run.path)
    assert_one_line_error(main_in_process("export", "best", "--run", run.run_id, "-o", str(run.path / name)), 2,
                          "is a run folder", "written only by its own search")
    assert folder_state(run.path) == before


def test_a_run_folder_outside_the_runs_dir_is_known_by_its_records(main_in_process, run, tmp_path):
    """A run folder elsewhere (a checkout's runs/ while EVOTUNE_RUNS points away) is one by its trials.jsonl."""
    other = tmp_path / "checkout" / "runs" / "old-run"
    other.mkdir(parents=True)
    (other / "trials.jsonl.gz").write_bytes(gzip.compress(b"{}\n"))
    before = folder_state(other)
    assert_one_line_error(main_in_process("export", "best", "--run", run.run_id, "-o", str(other / "best.json")), 2,
                          f"{other} is a run folder")
    assert_one_line_error(main_in_process("export", "best", "--run", run.run_id, "-o",
                                          str(other / "sub" / "k.cu")), 2, f"{other} is a run folder")
    assert folder_state(other) == before


def test_sass_onto_a_run_meta_is_refused_before_compiling(main_in_process, run, monkeypatch):
    """`sass -o` onto a run's meta.json exits 2 before anything is compiled."""
    import evotune.cli.candidate as candidate

    monkeypatch.setattr(candidate, "_compile_candidate", lambda *a: pytest.fail("compiled"))
    before = folder_state(run.path)
    assert_one_line_error(main_in_process("sass", "best", "--run", run.run_id, "-o", str(run.path / "meta.json")), 2,
                          "is a run folder")
    assert folder_state(run.path) == before


def test_the_compile_cache_is_refused(main_in_process, run, cache_dir):
    """`export -o` into the compile cache (onto a cubin there) exits 2; the cubin stays."""
    cubin = cache_dir / "cubin" / "0123abcd.cubin"
    cubin.parent.mkdir(parents=True, exist_ok=True)
    cubin.write_bytes(b"\x7fELF cubin")
    assert_one_line_error(main_in_process("export", "best", "--run", run.run_id, "-o", str(cubin)), 2,
                          "inside evotune's cache")
    assert cubin.read_bytes() == b"\x7fELF cubin"


# ------------------------------------------------------------------ files that are not ordinary files


def _special_files(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "stdout-link"
    link.symlink_to("/proc/self/fd/1")
    return [("/dev/full", "a character device", stat.S_ISCHR), (str(fifo), "a FIFO", stat.S_ISFIFO),
            (str(link), "a symbolic link", stat.S_ISLNK)]


@pytest.mark.parametrize("command", ["export", "sass"])
def test_output_onto_a_device_fifo_or_link_is_refused(main_in_process, run, tmp_path, command):
    """`-o` naming a character device, a FIFO or a symbolic link exits 2, and the thing stays what it was."""
    for target, kind, still in _special_files(tmp_path):
        assert_one_line_error(main_in_process(command, "best", "--run", run.run_id, "-o", target), 2,
                              f"is {kind}", "only regular files")
        assert still(os.lstat(target).st_mode)


def test_bench_out_and_table_outputs_refuse_before_the_gpu(main_in_process, run, tmp_path):
    """`bench --out`, `table build -o` and `tune --table` refuse a device or a run folder with exit 2, before the
    GPU check (this machine has none: that would be exit 1)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert_one_line_error(main_in_process("bench", "--config", "{}", "--out", str(fifo)), 2, "is a FIFO")
    assert_one_line_error(main_in_process("table", "build", run.run_id, "-o", "/dev/full"), 2, "character device")
    assert_one_line_error(main_in_process("table", "build", run.run_id, "-o", str(run.path / "t.json")), 2,
                          "is a run folder")
    assert_one_line_error(main_in_process("tune", "--shape", "mission", "--table", str(run.path / "t.json")), 2,
                          "is a run folder")
    assert_one_line_error(main_in_process("tune", "--shape", "mission", "--table", "/dev/full"), 2,
                          "character device")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and not (run.path / "t.json").exists()


def test_an_ordinary_file_is_replaced_whole(tmp_path):
    """An existing ordinary file is replaced by a rename (no temporary file left); the checks refuse specials."""
    target = tmp_path / "k.cu"
    target.write_text("old")
    write_output(target, "new", "-o")
    assert target.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["k.cu"]
    for special, kind, _ in _special_files(tmp_path):
        with pytest.raises(UsageError, match=f"is {kind}"):
            check_output_path(special, "-o")


# ------------------------------------------------------------------ read-only commands write nothing


@pytest.fixture
def packed_run(run):
    """The run as a committed one keeps it: trials.jsonl gzipped, no plain file."""
    plain = run.path / "trials.jsonl"
    (run.path / "trials.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    plain.unlink()
    return run


@pytest.mark.parametrize("args", [
    ["runs"], ["runs", "--json"], ["export", "best", "--run", "mission-h100", "-o", "{tmp}/k.cu"],
    ["export", "1", "--run", "mission-h100", "-o", "{tmp}/k1.cu"], ["replay", "--run", "mission-h100"],
    ["bench", "--run", "mission-h100"], ["verify", "--run", "mission-h100"],
    ["table", "build", "mission-h100", "-o", "{tmp}/table.json"],
], ids=lambda a: "-".join(a[:2]))
def test_read_only_commands_leave_a_packed_run_as_it_is(main_in_process, packed_run, tmp_path, args):
    """Reading a run whose records are gzipped unpacks nothing beside them (whatever the command's outcome)."""
    before = folder_state(packed_run.path)
    proc = main_in_process(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert "Traceback" not in proc.stderr
    assert folder_state(packed_run.path) == before


def test_a_packed_run_reads_the_same(main_in_process, packed_run, tmp_path):
    """`runs` and `export` read the gzipped records in memory: the same two trials, the same best."""
    proc = main_in_process("runs", "--json")
    [row] = json.loads(proc.stdout)
    assert row["trials"] == 2 and row["damaged"] is None
    proc = main_in_process("export", "1", "--run", packed_run.run_id, "-o", str(tmp_path / "k.cu"))
    assert proc.returncode == 0, proc.stderr
    assert not (packed_run.path / "trials.jsonl").exists()
