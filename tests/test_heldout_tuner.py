"""Tests for tools/heldout_tuner.py: its shape list, reading a run's ratio to cuDNN, the merge and the report."""

from __future__ import annotations

import json

import pytest

from _paths import load_tool
from evotune.problems.shapes import parse_shape

H = load_tool("heldout_tuner")


def test_no_heldout_shape_is_a_preset_or_a_priors_shape():
    """Every held-out shape parses, the kernel takes it, and none has the sizes, K/V heads and mask of a preset or
    of a run the shipped priors were built from."""
    from evotune.problems import get_problem

    known = H.known_shapes()
    assert any(w.startswith("prior run") for w in known.values())
    assert any(w.startswith("preset") for w in known.values())
    attention = get_problem("attention")
    for name, (spec, _) in H.SHAPES.items():
        shape = parse_shape(spec)
        attention.check_shape(shape)
        assert H.dims_of(shape) not in known, f"{name} is {known.get(H.dims_of(shape))}"


def test_the_shapes_span_what_the_issue_asks():
    """At least 8 shapes over fp16 and bf16, d64 and d128, causal and not, grouped K/V and not, 256 to 16k keys."""
    shapes = [parse_shape(spec) for spec, _ in H.SHAPES.values()]
    assert len(shapes) >= 8
    assert {s.dtype for s in shapes} == {"fp16", "bf16"} and {s.head_dim for s in shapes} == {64, 128}
    assert {s.causal for s in shapes} == {True, False} and {s.kv_group > 1 for s in shapes} == {True, False}
    assert min(s.seq_k for s in shapes) == 256 and max(s.seq_k for s in shapes) == 16384


def test_shapes_option_takes_names_and_spellings():
    """--shapes takes held-out names and shape spellings; anything else is a usage error."""
    assert H.resolve_shapes("bert-base,2,8,300,64:bf16") == [("bert-base", "8,12,512,64:fp16"),
                                                             ("2_8_300_64_bf16", "2,8,300,64:bf16")]
    with pytest.raises(H.Usage, match="neither"):
        H.resolve_shapes("bert")
    with pytest.raises(H.Usage, match="flags"):
        H.resolve_shapes("1,2,3")
    with pytest.raises(H.Usage, match="cannot read"):
        H.resolve_shapes("1,2,3:fp16")


def test_speedup_from_a_runs_beside_file_and_from_a_bench():
    """The ratio is cuDNN's interleaved median over the kernel's: from baselines.json (the best finalist's label)
    and from a head-to-head whose kernel has a given label."""
    beside = {"best": {"label": "f1"}, "finalists": [{"label": "f0"}, {"label": "f1"}],
              "head_to_head": {"timings": {"f0": {"median_us": 11.0}, "f1": {"median_us": 10.0},
                                           "cudnn": {"median_us": 12.0}, "flash": {"median_us": 13.0}}}}
    got = H.speedup_of_beside(beside)
    assert got["speedup"] == 1.2 and got["ours_us"] == 10.0 and got["fastest_sdpa"]["backend"] == "cudnn"
    raw = {"head_to_head": {"timings": {"evotune": {"median_us": 8.0}, "cudnn": {"median_us": 6.0}}}}
    assert H.speedup_of_h2h(raw, "evotune")["speedup"] == 0.75
    no_cudnn = {"head_to_head": {"timings": {"evotune": {"median_us": 8.0}}}}
    assert H.speedup_of_h2h(no_cudnn, "evotune")["speedup"] is None


def _phase(out, shape, phase, started="2026-11-27T00:00:00Z", **fields):
    doc = {"kind": H.KIND, "shape": shape, "spec": H.SHAPES.get(shape, ("x", ""))[0], "phase": phase,
           "started": started, **fields}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{shape}.{phase}.{started[-3:-1]}.json").write_text(json.dumps(doc))


def test_merge_and_report(tmp_path):
    """Phase JSONs from several folders merge per shape (the latest measurement of a phase wins); the report
    judges the targets only where tune and long were both measured, and lists errors."""
    a, b = tmp_path / "a", tmp_path / "b" / "deep"
    _phase(a, "bert-base", "tune", speedup=1.05, wall_s=40.0, best_trial=3)
    _phase(b, "bert-base", "tune", started="2026-11-27T01:00:09Z", speedup=1.11, wall_s=45.0,
           best_trial=2)
    _phase(b, "bert-base", "long", speedup=1.13, wall_s=200.0, counted=300)
    _phase(a, "latency-b1", "tune", speedup=1.2, wall_s=70.0)
    _phase(a, "latency-b1", "bare", speedup=1.04, wall_s=30.0)
    _phase(a, "latency-b1", "long", speedup=1.21, stopped_by_deadline=True, counted=120)
    _phase(a, "qwen2-7b-4k", "kt", error="no config passed")
    (a / "other.json").write_text('{"kind": "something else"}')
    rows = H.merge([a, tmp_path / "b"])
    assert sorted(rows) == ["bert-base", "latency-b1", "qwen2-7b-4k"]
    assert rows["bert-base"]["tune"]["speedup"] == 1.11
    assert H.verdict(rows["bert-base"])["met"] is True          # 1.11 >= 1.10, within 1.8% of 1.13, 45 s
    assert H.verdict(rows["latency-b1"])["met"] is False        # 70 s of wall time
    assert H.verdict(rows["qwen2-7b-4k"]) == {"within": None, "met": None}
    text = H.report(rows)
    lines = text.splitlines()
    assert lines[2].startswith("| bert-base |") and "1.110x" in lines[2] and "| yes |" in lines[2]
    assert "120 (deadline)" in lines[3] and "**no**" in lines[3] and "| 1.040x |" in lines[3]
    assert "Targets met on 1 of 2 shapes" in text and "- qwen2-7b-4k kt: no config passed" in text


def test_report_cli_and_bad_input(tmp_path, capsys):
    """--report --md writes the page; bad input is one line and exit 2, before anything runs."""
    _phase(tmp_path / "r", "bert-base", "tune", speedup=1.05, wall_s=40.0)
    md = tmp_path / "page.md"
    assert H.main(["--report", "--out", str(tmp_path / "r"), "--md", str(md)]) == 0
    assert md.read_text().startswith("# Held-out shapes") and "| bert-base |" in md.read_text()
    capsys.readouterr()
    assert H.parse_args(["--out", "x"]).phases == ["tune", "long", "kt"]  # all: bare only when named
    for argv in (["--phase", "fast", "--out", str(tmp_path)], ["--report", "--out", str(tmp_path / "none")],
                 ["--gpu", "x", "--out", str(tmp_path)], ["--phase", "tune"], ["--long-trials", "0", "--out", "x"],
                 ["--report", "--out", str(tmp_path / "empty")]):
        (tmp_path / "empty").mkdir(exist_ok=True)
        assert H.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("heldout_tuner: "), err


FAKE_EVOTUNE = r'''
import json, os, sys
from evotune.records.best import BESIDE_KIND
from evotune.records.runs import Run
args = sys.argv[1:]
if args[0] == "bench":  # `evotune bench best --run R --out F`: the record's raw head-to-head
    raw = {"head_to_head": {"timings": {"evotune": {"median_us": 8.0}, "cudnn": {"median_us": 10.0}}}}
    open(args[args.index("--out") + 1], "w").write(json.dumps({"raw": raw}))
    sys.exit(0)
spec = args[args.index("--shape") + 1]
name = args[args.index("--run") + 1] if "--run" in args else "fake-tune"
run = Run.create(name, {"family": "attention", "shape_spec": spec, "device": {"name": "stand-in"},
                        "priors": {"configs": 2, "runs": ["r"]}})
for number, t in enumerate([9.0, 8.0, 8.1, None]):
    run.append_trial({"number": number, "config": {"k": number}, "digest": f"d{number}", "counted": True,
                      "result": {"status": "ok" if t else "wrong", "time_us": t, "max_abs": 1e-3}})
if "tune" in args:
    (run.path / "baselines.json").write_text(json.dumps({
        "kind": BESIDE_KIND, "best": {"label": "f1"}, "finalists": [{"label": "f1"}],
        "head_to_head": {"timings": {"f1": {"median_us": 8.0}, "cudnn": {"median_us": 9.0}}}}))
'''


def test_the_tune_and_long_phases_read_what_the_command_left(tmp_path, monkeypatch):
    """A phase runs its command in a fresh runs folder and reads the run it left: the ratio from the closing job's
    baselines.json (tune), or where the search left none, from `evotune bench best --out` (long)."""
    script = tmp_path / "fake_evotune.py"
    script.write_text(FAKE_EVOTUNE)
    monkeypatch.setattr(H, "evotune_cmd", lambda *a: [H.sys.executable, str(script), *a])
    args = H.parse_args(["--phase", "tune,long", "--shapes", "latency-b1", "--out", str(tmp_path / "o")])
    assert H.run_phases(H.resolve_shapes(args.shapes), args.phases, args) == 0
    tune = json.loads((tmp_path / "o" / "latency-b1.tune.json").read_text())
    assert tune["speedup"] == 1.125 and tune["ours_us"] == 8.0 and tune["best_trial"] == 1
    assert tune["trials_asked"] == 60 and tune["trials"] == tune["counted"] == 4 and tune["passed"] == 3
    assert tune["exit_code"] == 0 and tune["wall_s"] > 0 and not tune["stopped_by_deadline"]
    assert tune["trials_to_within_3pct"] == 2 and tune["priors"] == {"configs": 2, "runs": ["r"]}
    assert tune["command"].startswith("tune --shape 1,16,256,64:fp16 --trials 60")
    long = json.loads((tmp_path / "o" / "latency-b1.long.json").read_text())
    assert long["best_us"] == 8.0 and long["speedup"] == 1.25 and long["timed_by"].startswith("evotune bench best")
    assert "error" not in long and long["trials_asked"] == 300
    row = H.merge([tmp_path / "o"])["latency-b1"]
    assert H.verdict(row)["within"] == pytest.approx(1.125 / 1.25 - 1)  # 10% behind the long search: not met
    assert H.verdict(row)["met"] is False
