"""Tests for evotune.records.sources: a run's source archive (written by its search, read by replay, export, bench and
verify), and what a changed template does to a run's trials and to tuning-table entries."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import shutil
import warnings

import pytest

from evotune.build.template import KernelSource, instantiate
from evotune.cli import candidate
from evotune.problems.shapes import Shape
from evotune.records import result as R
from evotune.records import sources as S
from evotune.records.result import Result
from evotune.records.runs import Run
from evotune.records.tuning_table import clear_caches, select, stale_entries, save_table
from evotune.search.loop import SearchOptions, run_search
from evotune.space.searchspace import load_space

from _tables import entry, table
from test_search import TINY_SPACE
from test_tuning_table import key_of, make_run

TWO = TINY_SPACE  # two configurations (block_n 32 and 64), cheap to compile


def older(src: KernelSource, tag: str = "1") -> KernelSource:
    """`src` as an earlier template would have given it: the same kernel with one more comment line."""
    return dataclasses.replace(src, code=src.code.replace("\n", f"\n// an older kernel {tag}\n", 1))


def files_of(folder) -> dict:
    """{name: (bytes, mtime)} of every file under `folder`, to see that nothing was written."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            p = os.path.join(root, name)
            out[os.path.relpath(p, folder)] = (open(p, "rb").read(), os.stat(p).st_mtime_ns)
    return out


@pytest.fixture
def sources(attention, space, mission):
    """Three sources of the default config's family: two configs of today's template and an 'older' one."""
    a = instantiate(attention, space.default_config(), mission)
    b = instantiate(attention, space.config({"block_n": 32, "stages": 3}), mission)
    return a, b, older(a)


# --------------------------------------------------------------------------- the archive


def test_archive_reads_back_byte_identical_whole_then_deltas(tmp_path, sources, attention):
    """The first source is kept whole (zcat gives it), later ones as small deltas on it; each reads back exactly."""
    for src in sources:
        assert S.archive_source(tmp_path, src) is True
    folder = tmp_path / "sources"
    a, b, c = sources
    assert (folder / f"{a.digest}.cu.gz").is_file()
    assert gzip.decompress((folder / f"{a.digest}.cu.gz").read_bytes()).decode() == a.code
    for src in (b, c):
        delta = folder / f"{src.digest}.delta.gz"
        assert delta.is_file() and delta.stat().st_size < 0.25 * (folder / f"{a.digest}.cu.gz").stat().st_size
    assert S.archived_digests(tmp_path) == {a.digest, b.digest, c.digest}
    for src in sources:
        got = S.read_source(tmp_path, src.digest, attention.entry_name, "attention")
        assert got.code == src.code and got.digest == src.digest and got.entry == "evotune_attention"
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_archive_is_deduplicated_and_append_only(tmp_path, sources):
    """Archiving a digest the archive holds writes nothing (never replaces the file); the bytes are the same on
    every host (gzip without a time stamp)."""
    a = sources[0]
    assert S.archive_source(tmp_path, a) is True
    before = files_of(tmp_path)
    assert S.archive_source(tmp_path, a) is False
    assert files_of(tmp_path) == before
    other = tmp_path / "other"
    other.mkdir()
    S.archive_source(other, a)
    assert (other / "sources" / f"{a.digest}.cu.gz").read_bytes() == (tmp_path / "sources" / f"{a.digest}.cu.gz").read_bytes()


def test_reading_writes_nothing(tmp_path, sources, attention):
    """Reading an archived source, a missing one, or a run without an archive creates and changes no file."""
    a = sources[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert S.read_source(empty, a.digest, attention.entry_name) is None
    assert list(empty.iterdir()) == []
    (tmp_path / "run").mkdir()
    S.archive_source(tmp_path / "run", a)
    before = files_of(tmp_path)
    S.read_source(tmp_path / "run", a.digest, attention.entry_name)
    S.read_source(tmp_path / "run", "0" * 16, attention.entry_name)
    assert files_of(tmp_path) == before


@pytest.mark.parametrize("digest", ["../../x", "ABCDEF0123456789", "0123", None, 7])
def test_a_digest_that_is_no_digest_names_no_file(tmp_path, attention, digest):
    """A record's source_digest becomes a file name only where it is 16 hex digits."""
    assert S.read_source(tmp_path, digest, attention.entry_name) is None and not S.has_source(tmp_path, digest)


def test_damaged_archive_files_are_one_line_naming_the_file(tmp_path, sources, attention, monkeypatch):
    """A file that does not hash to its name, is not gzip, is a FIFO, unpacks past the bound, or lacks the entry
    point is DamagedSource naming it, never a wrong kernel."""
    a, b, _ = sources
    S.archive_source(tmp_path, a)
    folder = tmp_path / "sources"
    wrong = folder / f"{'1' * 16}.cu.gz"
    wrong.write_bytes(gzip.compress(a.code.encode()))
    with pytest.raises(S.DamagedSource, match="hashes to .* not to its name"):
        S.read_source(tmp_path, "1" * 16, attention.entry_name)
    (folder / f"{'2' * 16}.cu.gz").write_bytes(b"not gzip")
    with pytest.raises(S.DamagedSource, match="cannot unpack it"):
        S.read_source(tmp_path, "2" * 16, attention.entry_name)
    os.mkfifo(folder / f"{'3' * 16}.cu.gz")
    with pytest.raises(S.DamagedSource, match="FIFO"):
        S.read_source(tmp_path, "3" * 16, attention.entry_name)
    with pytest.raises(S.DamagedSource, match="does not define the entry point evotune_softmax"):
        S.read_source(tmp_path, a.digest, "evotune_softmax")
    monkeypatch.setattr(S, "MAX_SOURCE_BYTES", 1000)
    with pytest.raises(S.DamagedSource, match="unpacks to more than 1000 bytes"):
        S.read_source(tmp_path, a.digest, attention.entry_name)


# --------------------------------------------------------------------------- the search writes it


def test_a_search_archives_each_counted_trial(tmp_path, attention, mission, runs_root):
    """A CPU search (real NVRTC compiles, an injected evaluator) archives the source of every counted trial as it
    records it, in its own run folder only; each reads back as the source the trial compiled."""
    path = tmp_path / "two.yaml"
    path.write_text(TWO)
    space = load_space(path)
    run = Run.create("archived", {"shape_spec": mission.spec})

    def evaluator(config, compiled):
        return Result(status=R.OK, time_us=10.0 + config["block_n"] / 64, max_abs=1e-4,
                      timing={"median_us": 10.0, "p10_us": 10.0, "p90_us": 10.0, "reps": 5, "launches_per_rep": 1,
                              "method": "fake"})

    options = SearchOptions(trials=2, sampler="exhaustive", seed=0, compile_workers=1, lookahead=0)
    run_search(attention, space, mission, run, evaluator, options)
    counted = [r for r in run.trials() if r.get("counted")]
    assert len(counted) == 2
    assert S.archived_digests(run.path) == {r["source_digest"] for r in counted}
    for r in counted:
        src = S.read_source(run.path, r["source_digest"], attention.entry_name)
        assert src.code == instantiate(attention, run.config_of(r, attention), mission).code
    assert sorted(p.name for p in runs_root.iterdir()) == ["archived"]


# --------------------------------------------------------------------------- commands compile the archive


@pytest.fixture
def old_run(runs_root, attention, space, mission):
    """A run whose best trial measured an earlier kernel (the 'older' source), with that source archived."""
    runs_root.mkdir()
    today = instantiate(attention, space.default_config(), mission)
    then = older(today)
    path = make_run(runs_root, "old", mission, digest=then.digest)
    S.archive_source(path, then)
    return path, then, today


def test_trial_source_prefers_the_archive(old_run, attention, space, mission):
    """A trial whose source the run archives compiles that source on the run's shape; on another shape, today's."""
    path, then, today = old_run
    run = Run(path)
    rec = run.select("best", "bench")
    got = S.trial_source(run, rec, attention, space.default_config(), mission)
    assert got.archived and not got.changed and got.note is None and got.source.code == then.code
    other = S.trial_source(run, rec, attention, space.default_config(), mission, own_shape=False)
    assert other.origin == "today" and other.source.code == today.code


def test_without_an_archive_a_changed_template_is_said(runs_root, attention, space, mission):
    """An old run without an archive compiles today's source; where its digest is not the recorded one, one line
    says so; where it is, nothing is said."""
    runs_root.mkdir()
    run = Run(make_run(runs_root, "old", mission, digest="0123456789abcdef"))
    got = S.trial_source(run, run.select("best", "x"), attention, space.default_config(), mission)
    assert got.changed and got.source.digest != "0123456789abcdef"
    assert got.note == ("the kernel template changed since trial 1 of run old was recorded (source 0123456789abcdef "
                        f"then, {got.source.digest} now) and the run archives no source for it: measuring today's "
                        "source")
    same = Run(make_run(runs_root, "same", mission))
    fresh = S.trial_source(same, same.select("best", "x"), attention, space.default_config(), mission)
    assert fresh.origin == "today" and fresh.note is None


def test_bench_verify_and_replay_resolve_the_archived_source(old_run, attention, mission, monkeypatch):
    """bench, verify, sanitize and sass (_resolve_candidate) and replay (_trial_source) compile the run's archived
    source of the trial: NVRTC gets exactly that code. --config candidates instantiate today's template."""
    _, then, today = old_run
    compiled = []
    monkeypatch.setattr("evotune.build.compile.compile_source", lambda code, entry: compiled.append((code, entry)))
    problem, shp, cfg, origin = candidate._resolve_candidate("best", "old", None, None, None, None, "bench")
    assert origin.archived and shp == mission
    src, _ = candidate._compile_candidate(problem, shp, cfg, origin)
    assert src.code == then.code and compiled[-1] == (then.code, "evotune_attention")
    run = Run.open("old")
    replayed = candidate._trial_source(run, run.select("best", "replay"), problem, cfg, shp, True, False)
    assert replayed.source.code == then.code
    problem, shp, cfg, origin = candidate._resolve_candidate("best", None, json.dumps(cfg.as_dict()), "mission", None,
                                                             None, "bench")
    assert origin is None and candidate._compile_candidate(problem, shp, cfg, origin)[0].code == today.code


def test_export_writes_the_archived_source(old_run, main_in_process, tmp_path):
    """`evotune export` of a trial whose source the run archives writes that source, its header saying so; the run
    folder is left as it was."""
    path, then, _ = old_run
    before = files_of(path)
    out = tmp_path / "k.cu"
    proc = main_in_process("export", "best", "--run", "old", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert text.endswith(then.code) and "template changed" not in text and "template changed" not in proc.stderr
    assert f"// source       {then.digest}: the code the trial measured (from the run's source archive)" in text
    assert files_of(path) == before


def test_export_of_an_unarchived_changed_trial_says_so(runs_root, main_in_process, tmp_path, mission):
    """Without an archive, export writes today's source with the header's NOTE and one line on stderr."""
    runs_root.mkdir()
    make_run(runs_root, "old", mission, digest="0123456789abcdef")
    out = tmp_path / "k.cu"
    proc = main_in_process("export", "best", "--run", "old", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "// NOTE         the kernel template changed since this trial was measured" in out.read_text()
    said = [line for line in proc.stderr.splitlines() if "template changed" in line]
    assert len(said) == 1 and said[0].startswith("note: the kernel template changed since trial 1 of run old")
    assert "exporting today's source" in said[0]


# --------------------------------------------------------------------------- a changed template


@pytest.fixture
def changed_template(tmp_path, monkeypatch):
    """EVOTUNE_KERNELS names a copy of the kernels whose attention template gained a comment line (a kernel edit)."""
    from evotune.build.template import kernels_dir

    copy = tmp_path / "kernels"
    shutil.copytree(kernels_dir(), copy)
    attention_cu = copy / "attention.cu"
    attention_cu.write_text("// an edit after the run\n" + attention_cu.read_text())

    def change():
        monkeypatch.setenv("EVOTUNE_KERNELS", str(copy))
        clear_caches()

    yield change
    clear_caches()


def test_a_changed_template_keeps_replaying_the_archive(old_run, attention, space, mission, changed_template):
    """After a template edit, a trial of an archived run still compiles what it measured (no note); an unarchived
    one gets the stale line."""
    path, then, _ = old_run
    changed_template()
    run = Run(path)
    got = S.trial_source(run, run.select("best", "x"), attention, space.default_config(), mission)
    assert got.archived and got.source.code == then.code and got.note is None
    shutil.rmtree(path / "sources")
    gone = S.trial_source(run, run.select("best", "x"), attention, space.default_config(), mission)
    assert gone.changed and gone.source.code.startswith("// an edit after the run\n")


# --------------------------------------------------------------------------- tuning-table staleness


def test_a_changed_template_makes_entries_stale_and_routes_them_to_sdpa(changed_template, mission):
    """An entry measured on today's source is usable; after the template changes it is stale: select() skips it
    with the reason, stale_entries() lists it."""
    fresh = entry(mission)
    tbl = table(fresh)
    assert select(tbl, key_of(mission), mission).route == "evotune" and stale_entries(tbl) == []
    changed_template()
    chosen = select(tbl, key_of(mission), mission)
    assert chosen.entry is None and chosen.route == "sdpa" and "stale: the kernel source changed" in chosen.reason
    ((e, why),) = stale_entries(tbl)
    assert e is fresh and why.startswith("stale: the kernel source changed since run fixture measured it")


def test_the_op_says_a_stale_entry_once(monkeypatch, mission):
    """The op routes a call whose key's entry is stale to SDPA, kind 'stale', told once with the reason and the
    command that re-measures it; fallback='error' refuses it."""
    torch = pytest.importorskip("torch")  # noqa: F841
    import evotune.torch as et
    from evotune.errors import UsageError
    from evotune.torch import routing
    from evotune.torch.call import Call

    from _tables import H100

    monkeypatch.delenv("EVOTUNE_TABLE", raising=False)
    monkeypatch.setattr(routing, "gpu_identity", lambda index: (H100[0], H100[1], (9, 0)))
    strides = (8 * 512 * 64, 512 * 64, 64, 1)
    call = Call(1, 8, 8, 512, 512, 64, 64, "fp16", False, "bhsd", "cuda:0", (strides, strides, strides))
    try:
        et.use_table(table(entry(mission, digest="0123456789abcdef")))
        decision = routing.decide(call)
        assert (decision.route, decision.kind) == ("sdpa", "stale") and decision.refused_by_error_fallback
        assert "stale: the kernel source changed since run fixture measured it" in decision.notice()
        assert "evotune tune --stale --table" in decision.notice()
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            routing.notify(decision, "sdpa")
            routing.notify(routing.decide(call), "sdpa")
        assert len([w for w in got if issubclass(w.category, et.EvotuneFallbackWarning)]) == 1
        with pytest.raises(UsageError, match=r"is stale: .*\[fallback='error'\]"):
            routing.notify(decision, "error")
    finally:
        et.use_table(None)


def test_table_show_marks_stale_entries(tmp_path, main_in_process, mission, monkeypatch):
    """`table show` marks a stale entry's route and says why on a line of its own, with the command that
    re-measures it; --json lists the stale keys."""
    from evotune.cli import common as cli_common

    monkeypatch.setattr(cli_common.console, "width", 400)
    path = save_table(table(entry(mission, digest="0123456789abcdef"), entry(Shape(2, 8, 1024, 1024, 64))),
                      tmp_path / "t.json")
    proc = main_in_process("table", "show", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "STALE (sdpa)" in proc.stdout and proc.stdout.count("STALE") == 1
    assert any(line.startswith("stale: ") and "measured 0123456789abcdef" in line for line in proc.stdout.splitlines())
    assert f"evotune tune --stale --table {path}" in proc.stdout
    rep = json.loads(main_in_process("table", "show", str(path), "--json").stdout)
    assert [s["key"]["seq_q_bucket"] for s in rep["stale"]] == [512]


def test_tune_stale_re_measures_each_stale_entry_first(tmp_path, main_in_process, runs_root, mission, monkeypatch):
    """`evotune tune --stale` searches the shape of each stale entry with its config asked first, then the table's
    entry for that key is replaced by the new measurement (no longer stale); fresh entries are left alone."""
    from evotune.cli import common as cli_common
    from evotune.cli import table as cli_table
    from evotune.records.tuning_table import load_table

    from test_tuning_table import base

    runs_root.mkdir()
    fresh_shape = Shape(2, 8, 1024, 1024, 64)
    path = save_table(table(entry(mission, digest="0123456789abcdef"), entry(fresh_shape)), tmp_path / "t.json")
    calls = []

    def search_key(shape, trials, timeout, gpu, json_out, seeds=(), **options):  # priors: not read here
        calls.append((shape.spec, [dict(c) for c in seeds]))
        make_run(runs_root, f"r{len(calls)}", shape, time_us=1.0, baselines={"cudnn": base(2.0)})
        return f"r{len(calls)}"

    monkeypatch.setattr(cli_common, "gpu_count", lambda: 1)
    monkeypatch.setattr(cli_table, "_search_key", search_key)
    proc = main_in_process("tune", "--stale", "--table", str(path))
    assert proc.returncode == 0, proc.stderr
    assert calls == [(mission.spec, [entry(mission).config])]
    assert "stale: " in proc.stderr and "re-measuring its config on" in proc.stderr
    tbl = load_table(path)
    assert stale_entries(tbl) == [] and {e.provenance["run"] for e in tbl.entries} == {"r1", "fixture"}
    again = main_in_process("tune", "--stale", "--table", str(path))
    assert again.returncode == 2 and "no stale entry" in again.stderr and len(calls) == 1


# --------------------------------------------------------------------------- backfill and the committed archives


def test_backfill_archives_only_provable_sources(runs_root, attention, space, mission, tmp_path):
    """tools/archive_sources.py archives a run's best where today's template gives its recorded digest, or where
    the run's best.cu holds that code; a trial neither gives is listed as lost; a second pass and a dry run add
    nothing."""
    import importlib.util

    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "archive_sources.py"
    spec = importlib.util.spec_from_file_location("archive_sources", tool)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    runs_root.mkdir()
    today = instantiate(attention, space.default_config(), mission)
    then = older(today)
    make_run(runs_root, "current", mission)
    exported = make_run(runs_root, "exported", mission, digest=then.digest)
    (exported / "best.cu").write_text("// evotune export: header\n// config ...\n\n" + then.code)
    make_run(runs_root, "lost", mission, digest="0123456789abcdef")
    assert mod.main(["--dry-run"]) == 0 and not any(runs_root.glob("*/sources"))
    mod.main([])
    assert S.read_source(runs_root / "current", today.digest, "evotune_attention").code == today.code
    assert S.read_source(runs_root / "exported", then.digest, "evotune_attention").code == then.code
    assert not (runs_root / "lost" / "sources").exists()
    before = files_of(runs_root)
    mod.main([])
    assert files_of(runs_root) == before


def test_committed_archives_read_back_as_their_records_name(attention):
    """Every source archived in the repository's runs/ reads back (hashing to its name, defining its entry point)
    and is the source_digest of one of its run's trials."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "runs"
    folders = sorted(p.parent for p in root.glob("*/sources"))
    for folder in folders:
        run = Run(folder)
        named = {r.get("source_digest") for r in run.trials()}
        problem, _ = run.problem_and_shape()
        for digest in S.archived_digests(folder):
            assert digest in named, (folder.name, digest)
            assert S.read_source(folder, digest, problem.entry_name) is not None


def test_a_delta_never_names_a_base_the_folder_lost(tmp_path, sources, attention):
    """A folder emptied and filled again in one process gets a whole source first again (its deltas' base is there)."""
    a, b, c = sources
    (tmp_path / "run").mkdir()
    S.archive_source(tmp_path / "run", a)
    shutil.rmtree(tmp_path / "run" / "sources")
    S.archive_source(tmp_path / "run", b)
    S.archive_source(tmp_path / "run", c)
    assert (tmp_path / "run" / "sources" / f"{b.digest}.cu.gz").is_file()
    for src in (b, c):
        assert S.read_source(tmp_path / "run", src.digest, attention.entry_name).code == src.code
