"""Tests for the `evotune` command line on a machine without a GPU.

Exit codes and error lines are checked through the real entry point in a subprocess
(`python -m evotune`, which is what the console script calls); output that needs no
process of its own goes through typer's CliRunner. Runs live in a temporary EVOTUNE_RUNS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from evotune import cli as cli_module
from evotune.cli import app
from evotune.cli import common as cli_common
from evotune.records.runs import Run

# A record that passed, as the search writes it (numbers are made up; the config is the default one).
MEASURED_US = 23.456


@pytest.fixture
def cli(runs_root, cache_dir, tmp_path):
    """Run `python -m evotune ARGS` with EVOTUNE_RUNS and EVOTUNE_CACHE pointing at temporary folders."""
    env = {**os.environ, "EVOTUNE_RUNS": str(runs_root), "EVOTUNE_CACHE": str(cache_dir), "COLUMNS": "80"}
    env.pop("EVOTUNE_SPACES", None)

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "evotune", *args], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=timeout)

    return run


def assert_one_line_error(proc: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    """The process exited with `code` and said exactly one line on stderr, `evotune: error: ...`, with no traceback."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("evotune: error: ")
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


def passing_record(space, number=0) -> dict:
    t = MEASURED_US
    return {
        "number": number, "config": space.default_config().as_dict(), "digest": space.default_config().digest(),
        "counted": True, "source_digest": "0" * 16, "started": 0.0, "finished": 1.0,
        "result": {
            "status": "ok", "message": "", "time_us": t, "max_abs": 1.2e-4, "compile_seconds": 0.5,
            "timing": {"median_us": t, "p10_us": 23.1, "p90_us": 24.0, "reps": 40, "launches_per_rep": 20,
                       "method": "cuda-graph"},
            "verification": {"max_abs": 1.2e-4, "max_rel": 1e-3, "nonfinite": 0, "gate_ratio": 0.1, "seeds": [1, 2, 3],
                             "atol": 1e-3, "rtol": 4e-3, "passed": True},
            "resources": {"registers": 136, "static_smem": 0, "stack_frame": 0, "spill_stores": 0, "spill_loads": 0,
                          "barriers": 1},
            "extra": {},
        },
    }


def failed_record(space, number, status) -> dict:
    cfg = space.config({"stages": 3})
    return {"number": number, "config": cfg.as_dict(), "digest": cfg.digest(), "counted": True,
            "result": {"status": status, "message": f"fake {status}", "time_us": None, "max_abs": None}}


def make_run(name, mission, records) -> Run:
    meta = {"family": "attention", "shape": mission.as_dict(), "shape_spec": mission.spec,
            "space": "search_spaces/attention.yaml", "device": {"name": "NVIDIA H100 80GB HBM3", "driver": "570.00"},
            "git_sha": "abc123def456", "versions": {"evotune": "0.1.0", "torch": "2.11.0", "nvrtc": "13.0"}}
    run = Run.create(name, meta)
    for r in records:
        run.append_trial(r)
    run.update_summary()
    return run


# ------------------------------------------------------------------ one-line errors, exit 2


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["check", "--shape", "nosuchpreset"], "unknown preset 'nosuchpreset'"),
        (["check", "--shape", "1,2,3"], "cannot read '1,2,3'"),
        (["check", "--shape", "1,8,512,80"], "head_dim 80 is not supported"),
        (["replay", "--run", "nope"], "no run named 'nope'"),
        (["export", "best", "--run", "nope", "-o", "x.cu"], "no run named 'nope'"),
        (["search", "--sampler", "annealing"], "unknown sampler 'annealing'"),
        (["search", "--resume"], "--resume needs --run"),
    ],
    ids=["unknown-preset", "malformed-shape", "head-dim-96", "replay-unknown-run",
         "export-unknown-run", "unknown-sampler", "resume-without-run"],
)
def test_usage_errors_exit_2(cli, runs_root, tmp_path, args, fragment):
    """Bad input exits 2 with one `evotune: error:` line on stderr, no traceback, and no run folder."""
    proc = cli(*args)  # the unknown-preset line is longer than 80 columns: one line means rich did not wrap it
    assert_one_line_error(proc, 2, fragment)
    assert proc.stdout == ""
    assert not runs_root.exists()
    assert not (tmp_path / "x.cu").exists()


def test_malformed_space_file_exits_2(cli, tmp_path):
    """A --space file that is not a valid space exits 2 with one line naming the file and line."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("family: attention\nparams:\n  block_m:\n    values: [16, 32\n")
    line = assert_one_line_error(cli("check", "--space", str(bad)), 2, str(bad), "YAML error")
    assert f"{bad}:" in line
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("family: attention\nparams:\n  block_m: {values: [16]}\nconstraints:\n  - {expr: warps > 1, why: x}\n")
    assert_one_line_error(cli("check", "--space", str(unknown)), 2, f"{unknown}:5:", "unknown name 'warps'")


# ------------------------------------------------------------------ no GPU


def test_search_without_gpu_exits_1_and_creates_no_run(cli, runs_root):
    """`search` without a GPU exits 1 saying no CUDA GPU is visible, and leaves no run folder behind."""
    proc = cli("search", "--trials", "2", "--run", "nogpu")
    assert_one_line_error(proc, 1, "no CUDA GPU", "evotune check")
    assert not (runs_root / "nogpu").exists()
    assert not runs_root.exists() or list(runs_root.iterdir()) == []


def test_resume_without_gpu_leaves_run_untouched(main_in_process, runs_root, mission, space):
    """`search --resume` of an existing run without a GPU exits 1 and does not touch the run's records."""
    run = make_run("keep", mission, [passing_record(space)])
    before = {p.name: p.read_bytes() for p in run.path.iterdir()}
    proc = main_in_process("search", "--run", "keep", "--resume", "--trials", "3")
    assert_one_line_error(proc, 1, "no CUDA GPU")
    assert {p.name: p.read_bytes() for p in run.path.iterdir()} == before


def test_resume_with_other_shape_is_usage_error(main_in_process, runs_root, mission, space):
    """Resuming a run with a shape other than the one it searched exits 2 naming both."""
    make_run("shaped", mission, [passing_record(space)])
    assert_one_line_error(main_in_process("search", "--run", "shaped", "--resume", "--shape", "gpt2"), 2,
                          "searched 1,8,512,64:fp16", "not 16,12,1024,64:fp16")


def test_debug_shows_traceback(cli, runs_root):
    """With --debug the same no-GPU error comes with its traceback, and still creates no run."""
    proc = cli("--debug", "search", "--trials", "2", "--run", "nogpu")
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert "NoGPUError: no CUDA GPU is visible" in proc.stderr
    assert not runs_root.exists() or list(runs_root.iterdir()) == []


def test_debug_reraises_usage_error(main_in_process):
    """--debug lets a usage error propagate (for its traceback) instead of printing the one-line message."""
    from evotune.errors import UsageError

    with pytest.raises(UsageError, match="cannot read '1,2,3'"):
        main_in_process("--debug", "check", "--shape", "1,2,3")
    assert cli_module._state["debug"] is True
    proc = main_in_process("check", "--shape", "1,2,3")  # the flag does not stick to the next command
    assert_one_line_error(proc, 2, "cannot read")


# ------------------------------------------------------------------ shapes, check, runs


def test_shapes_json():
    """`shapes --json` prints JSON holding the mission preset: batch 1, heads 8, seq_q 512, head_dim 64."""
    result = CliRunner().invoke(app, ["shapes", "--json"])
    assert result.exit_code == 0, result.output
    presets = json.loads(result.stdout)
    m = presets["mission"]
    assert (m["batch"], m["heads"], m["seq_q"], m["seq_k"], m["head_dim"]) == (1, 8, 512, 512, 64)
    assert m["dtype"] == "fp16" and m["causal"] is False and m["spec"] == "1,8,512,64:fp16"
    assert "gpt2" in presets and presets["llama-4k-causal"]["causal"] is True


def test_shapes_table(monkeypatch):
    """`shapes` without --json prints a table naming every preset."""
    monkeypatch.setattr(cli_common.console, "width", 200)  # the runner is not a terminal: rich would use 80 columns
    result = CliRunner().invoke(app, ["shapes"])
    assert result.exit_code == 0
    for name in ("mission", "gpt2", "long-16k-causal"):
        assert name in result.stdout


def test_check_sample_json(cli, space):
    """`check --sample 3 --json` compiles three admitted configs with NVRTC and reports them, with no compile errors,
    the time spent enumerating the whole space, and nothing on stderr where stderr is no terminal."""
    proc = cli("check", "--sample", "3", "--jobs", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    out = json.loads(proc.stdout)
    summary = out["summary"]
    assert summary["compiled"] == 3 and summary["compile_errors"] == 0
    assert summary["ok"] + summary["pruned_static"] == 3
    assert 3 <= summary["admitted"] <= summary["space_size"] == space.size()
    assert summary["enumerate_seconds"] > 0.1  # ~17 s for the ~300k configs of the built-in space
    assert summary["shape"] == "1,8,512,64:fp16"
    assert len(out["configs"]) == 3 and len({json.dumps(c["config"], sort_keys=True) for c in out["configs"]}) == 3
    for row in out["configs"]:
        assert row["status"] in ("ok", "pruned")
        assert row["resources"]["registers"] > 0 and row["threads"] >= 32 and row["dynamic_smem"] > 0


def test_runs_json(runs_root, mission, space):
    """`runs --json` lists a recorded run with its shape, device, trial count and best time."""
    make_run("listed", mission, [failed_record(space, 0, "wrong"), passing_record(space, 1)])
    make_run("empty", mission, [])
    result = CliRunner().invoke(app, ["runs", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["run"]: r for r in json.loads(result.stdout)}
    assert set(rows) == {"listed", "empty"}
    assert rows["listed"] == {"run": "listed", "shape": "1,8,512,64:fp16", "device": "NVIDIA H100 80GB HBM3",
                              "trials": 2, "best_us": MEASURED_US, "damaged": None}
    assert rows["empty"]["trials"] == 0 and rows["empty"]["best_us"] is None


def test_runs_json_with_no_runs(runs_root):
    """`runs --json` with no runs folder prints an empty list."""
    result = CliRunner().invoke(app, ["runs", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout) == []


# ------------------------------------------------------------------ export and replay


def test_export_best(runs_root, tmp_path, mission, space):
    """`export best` writes the best record's kernel with its entry point and measured time in the header."""
    make_run("exp", mission, [failed_record(space, 0, "launch_error"), passing_record(space, 1)])
    out = tmp_path / "sub" / "out.cu"
    result = CliRunner().invoke(app, ["export", "best", "--run", "exp", "-o", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert 'extern "C"' in text and "evotune_attention" in text
    header = text.split("\n\n", 1)[0]
    assert f"{MEASURED_US:.2f} us median" in header
    assert "run          exp" in header and "abc123def456" in header
    assert json.dumps(space.default_config().as_dict(), sort_keys=True) in header
    said = " ".join(result.stdout.split())  # rich wraps at the runner's 80 columns
    assert said.startswith("wrote ") and said.endswith("(run exp, trial 1)")


def test_export_trial_number(runs_root, tmp_path, mission, space):
    """`export N` writes the trial with that number."""
    make_run("exp2", mission, [passing_record(space, 0)])
    out = tmp_path / "t0.cu"
    assert CliRunner().invoke(app, ["export", "0", "--run", "exp2", "-o", str(out)]).exit_code == 0
    assert 'extern "C"' in out.read_text()


def test_export_and_replay_bad_selection(main_in_process, runs_root, mission, space, tmp_path):
    """A trial number the run lacks, or a selector that is neither 'best' nor a number, exits 2."""
    make_run("sel", mission, [passing_record(space, 0)])
    out = tmp_path / "x.cu"
    assert_one_line_error(main_in_process("export", "7", "--run", "sel", "-o", str(out)), 2, "no trial number 7")
    assert not out.exists()
    assert_one_line_error(main_in_process("replay", "fastest", "--run", "sel"), 2, "'best' or a trial number")


def test_replay_run_without_pass(cli, runs_root, mission, space):
    """`replay` of a run whose trials all failed exits 1 saying there is no trial that passed."""
    make_run("allfail", mission, [failed_record(space, 0, "wrong"), failed_record(space, 1, "timeout")])
    assert_one_line_error(cli("replay", "--run", "allfail"), 1, "no trial that passed")


def test_replay_failed_trial(main_in_process, runs_root, mission, space):
    """`replay N` of a trial that did not pass exits 1 naming its status, before looking for a GPU."""
    make_run("onefail", mission, [failed_record(space, 0, "crashed"), passing_record(space, 1)])
    assert_one_line_error(main_in_process("replay", "0", "--run", "onefail"), 1, "did not pass (crashed)")


def test_replay_without_gpu(main_in_process, runs_root, mission, space):
    """`replay` of a passing trial without a GPU exits 1 with the no-GPU message."""
    make_run("good", mission, [passing_record(space)])
    assert_one_line_error(main_in_process("replay", "--run", "good"), 1, "no CUDA GPU")


# ------------------------------------------------------------------ search --gpus / --storage


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--gpus", "0,x"], "--gpus '0,x': give device indices separated by commas"),
        (["--gpus", "0,,1"], "--gpus '0,,1'"),
        (["--gpus", "-1"], "--gpus '-1'"),
        (["--gpus", "0,1", "--gpu", "1"], "give --gpus or --gpu, not both"),
        (["--storage", "not a url"], "--storage 'not a url': not a database URL"),
    ],
    ids=["letter", "empty-entry", "negative", "with-gpu", "bad-storage"],
)
def test_search_gpus_and_storage_usage_errors(main_in_process, runs_root, args, fragment):
    """A malformed --gpus list (or --gpus with --gpu, or a --storage that is not a URL) exits 2 with one line,
    before anything looks for a GPU, and creates no run."""
    assert_one_line_error(main_in_process("search", "--run", "g", *args), 2, fragment)
    assert not runs_root.exists() or list(runs_root.iterdir()) == []


def test_search_gpus_beyond_visible_devices(main_in_process, runs_root, monkeypatch):
    """--gpus naming a device index at or past the number of visible GPUs exits 2 saying how many are visible."""
    monkeypatch.setattr(cli_common, "gpu_count", lambda: 2)
    line = assert_one_line_error(main_in_process("search", "--run", "g", "--gpus", "0,2,1,3"), 2,
                                 "--gpus names GPU 2, 3", "2 CUDA devices visible (indices 0-1)")
    assert "CUDA_VISIBLE_DEVICES" in line
    monkeypatch.setattr(cli_common, "gpu_count", lambda: 1)
    assert_one_line_error(main_in_process("search", "--run", "g", "--gpus", "0,0,1"), 2,
                          "--gpus names GPU 1", "there is 1 CUDA device visible (indices 0-0)")
    assert not runs_root.exists() or list(runs_root.iterdir()) == []


def test_search_gpus_without_gpu(cli, runs_root):
    """A well-formed --gpus list on a machine with no GPU exits 1 with the no-GPU line, like a plain search."""
    assert_one_line_error(cli("search", "--run", "g", "--gpus", "0,0"), 1, "no CUDA GPU")
    assert not runs_root.exists() or list(runs_root.iterdir()) == []


def test_resume_with_other_storage_is_usage_error(main_in_process, runs_root, mission, space):
    """Resuming a run with a --storage other than the one holding its study exits 2 naming both (password hidden)."""
    make_run("local", mission, [passing_record(space)])
    line = assert_one_line_error(
        main_in_process("search", "--run", "local", "--resume", "--storage", "sqlite:////tmp/elsewhere.db"), 2,
        "keeps its study in ", "not sqlite:////tmp/elsewhere.db")
    assert "study.journal" in line


def test_config_summaries_spell_every_value_apart():
    """A config's one-line summary (cfg_short, Problem.knob_abbrev) tells every value of every knob of each family's
    default space apart: a (true, false) pair of spellings only fits a bool knob (empty_warpgroups' compute once read
    "skipempty", as skip did)."""
    from evotune.cli.display import cfg_short
    from evotune.problems import FAMILIES, get_problem
    from evotune.space.searchspace import load_builtin

    for family in FAMILIES:
        for param in load_builtin(get_problem(family).default_space).params:
            spelled = {cfg_short({param.name: value}) for value in param.values}
            assert len(spelled) == len(param.values), (family, param.name, spelled)
