"""Planted faults on the CPU: the plugin path that loads a family from outside evotune, the
fault family (tests/fault_family.py) and its space, real NVRTC compiles of every fault, and the
search loop over the faults, once with an injected evaluator that answers as the GPU worker
would and once through GPUWorker processes that hang, fault and crash (tests/_fake_workers.py).
The faults that cheat the gate are judged there by the real gate (evaluate.evaluate_launches) on
the CPU, on their Python twins (tests/_planted.py). The same search on the H100 is
tests/test_gpu_faults.py.
"""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import _fake_workers as fake
import _gate_fault_workers as gate_workers
import pytest
from _planted import Planted, cpu_timer, on_cpu

from evotune.records import result as R
from evotune.gpu import workers
from evotune.build.compile import DEFAULT_ARCH, CompileError, compile_source, static_violations
from evotune.errors import UsageError
from evotune.gpu.evaluate import evaluate_launches
from evotune.problems import get_problem
from evotune.problems.attention import AttentionProblem
from evotune.records.result import Result
from evotune.records.runs import Run
from evotune.search.loop import SearchOptions, run_search, worker_evaluator
from evotune.space.searchspace import load_space
from evotune.build.template import instantiate
from _paths import REPO_ROOT
from evotune.gpu.workers import GPUWorker

FAMILY = "tests.fault_family:PROBLEM"
FAULT_SPACE = REPO_ROOT / "tests" / "data" / "attention-faults.yaml"
FAULTS = ("none", "oob_write", "hang", "wrong_values", "unwritten", "compile_error",
          "skip_on_repeat", "stateful_counter", "input_mutation", "write_past_o", "write_before_o",
          "memo_o", "memo_fingerprint", "memo_late", "memo_cache")
# The faults that compute correctly whenever the gate looks; the launch-integrity checks catch them.
GATE_FAULTS = ("skip_on_repeat", "stateful_counter", "input_mutation", "write_past_o", "write_before_o",
               "memo_o", "memo_fingerprint", "memo_late", "memo_cache")
CPU_SHAPE = "1,2,40,56,64"  # the shape the CPU gate judges the gate faults' Python twins on


@pytest.fixture(scope="module", autouse=True)
def repo_on_path():
    """`tests.fault_family` imports from the repository root, as it does under `python -m pytest` there."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(REPO_ROOT))
        yield


@pytest.fixture(scope="module")
def faults():
    return get_problem(FAMILY)


@pytest.fixture(scope="module")
def fault_space():
    return load_space(FAULT_SPACE)


@pytest.fixture(scope="module")
def fault_module(faults):
    """The loaded tests.fault_family module (its FAULTS, CAUGHT_AS, GATE_FAULTS, STATEFUL_LAUNCHES)."""
    return sys.modules[type(faults).__module__]


# Every test here writes runs into a temporary EVOTUNE_RUNS (conftest.runs_root).
pytestmark = pytest.mark.usefixtures("runs_root")

def base_of(config) -> dict:
    """The healthy twin of a config: its knobs without `fault`."""
    return {k: v for k, v in config.as_dict().items() if k != "fault"}


# ------------------------------------------------------------------ the plugin path


def test_plugin_path_loads_the_fault_family(faults):
    """get_problem("package.module:ATTR") imports the module and returns its Problem, whose family is that path."""
    assert faults.family == FAMILY and isinstance(faults, AttentionProblem)
    assert get_problem(FAMILY) is faults
    assert get_problem("attention").family == "attention"  # built-in names are untouched


@pytest.mark.parametrize("path, fragment", [
    ("nosuchpackage_xyz.families:PROBLEM", "no module 'nosuchpackage_xyz.families'"),
    ("tests.no_such_family_xyz:PROBLEM", "no module 'tests.no_such_family_xyz'"),
    ("tests.fault_family:NOPE", "has no 'NOPE'"),
    ("tests.fault_family:FAULTS", "tuple is not a Problem (no family, kernel_file"),
    ("evotune.problems.attention:PROBLEM", "its family attribute is 'attention'; it must be"),
    ("tests.fault_family:", "written package.module:ATTR"),
    (":PROBLEM", "written package.module:ATTR"),
    ("tests/fault_family.py:PROBLEM", "written package.module:ATTR"),
])
def test_bad_plugin_path_is_one_line_usage_error(path, fragment):
    """A plugin path that names no module, no attribute, no Problem, or a Problem of another name is one UsageError line."""
    with pytest.raises(UsageError) as info:
        get_problem(path)
    message = str(info.value)
    assert fragment in message and repr(path) in message
    assert "\n" not in message and info.value.exit_code == 2


def test_plugin_with_a_missing_dependency_raises_that_import_error(tmp_path, monkeypatch):
    """A plugin module that exists but fails to import is the plugin's bug: its own ImportError, not a bad path."""
    (tmp_path / "evotune_brokenfam.py").write_text("import nosuchdependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "evotune_brokenfam", raising=False)
    with pytest.raises(ModuleNotFoundError, match="nosuchdependency_xyz"):
        get_problem("evotune_brokenfam:PROBLEM")


def test_plugin_found_in_the_current_directory(tmp_path, monkeypatch):
    """A family module in the current directory loads even when that directory is not on sys.path (the console script)."""
    (tmp_path / "evotune_cwdfam.py").write_text(textwrap.dedent("""\
        from evotune.problems.attention import AttentionProblem

        class CwdProblem(AttentionProblem):
            family = "evotune_cwdfam:PROBLEM"

        PROBLEM = CwdProblem()
        """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "evotune_cwdfam", raising=False)
    try:
        problem = get_problem("evotune_cwdfam:PROBLEM")
        assert problem.family == "evotune_cwdfam:PROBLEM" and problem.kernel_file == "attention.cu"
    finally:
        sys.modules.pop("evotune_cwdfam", None)


# ------------------------------------------------------------------ the fault family and its space


def test_space_is_healthy_configs_times_faults(faults, fault_space, space, mission):
    """The fault space admits a few healthy attention configs, each with every fault, and nothing else."""
    assert fault_space.family == FAMILY
    admitted = fault_space.admitted_configs(faults.context(mission))
    assert len(admitted) <= 3 * len(FAULTS)
    bases = {json.dumps(base_of(c), sort_keys=True) for c in admitted}
    assert len(bases) >= 3
    assert {(json.dumps(base_of(c), sort_keys=True), c["fault"]) for c in admitted} == \
        {(b, f) for b in bases for f in FAULTS}
    for b in bases:  # each healthy twin is a config the real attention space admits
        assert space.admitted(space.config(json.loads(b)), faults.context(mission)), b
    # An exhaustive search visits a healthy config first, then its faults.
    assert [c["fault"] for c in admitted[:len(FAULTS)]] == list(FAULTS)


def test_fault_is_the_only_difference(faults, attention, fault_space, space, mission):
    """fault=none instantiates the attention kernel itself; every other fault only adds lines to it."""
    for config in fault_space.admitted_configs(faults.context(mission)):
        healthy = attention.instantiation(space.config(base_of(config)), mission)
        planted = faults.instantiation(config, mission)
        if config["fault"] == "none":
            assert planted == healthy
            continue
        ops = difflib.SequenceMatcher(a=healthy.splitlines(), b=planted.splitlines(), autojunk=False).get_opcodes()
        assert {op for op, *_ in ops} == {"equal", "insert"}, config.key()
        assert f'planted fault "{config["fault"]}"' in planted


def test_fault_lists_agree(fault_module):
    """The family's fault list, its gate faults and how the gate reports them match this file's and the space's."""
    assert fault_module.FAULTS == FAULTS and fault_module.GATE_FAULTS == GATE_FAULTS
    assert set(fault_module.CAUGHT_AS) == set(GATE_FAULTS)


def healthy_bases(faults, fault_space, mission) -> list[dict]:
    return [base_of(c) for c in fault_space.admitted_configs(faults.context(mission)) if c["fault"] == "none"]


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_sources_compile_for_sm90a(faults, fault_space, mission, fault):
    """Every planted fault compiles with NVRTC for sm_90a and passes the static gate in every healthy config of the
    fault space, except compile_error, which raises CompileError quoting the compiler."""
    bases = healthy_bases(faults, fault_space, mission)
    assert len(bases) == 3
    if fault == "compile_error":
        src = instantiate(faults, fault_space.config({**bases[0], "fault": fault}), mission)
        with pytest.raises(CompileError) as info:
            compile_source(src.code, src.entry)
        assert str(info.value).startswith("NVRTC: ") and "evotune_planted_compile_error" in str(info.value)
        assert "is undefined" in str(info.value) and "error" in info.value.log
        return
    for base in bases:
        config = fault_space.config({**base, "fault": fault})
        src = instantiate(faults, config, mission)
        assert src.family == FAMILY and src.entry == "evotune_attention"
        compiled = compile_source(src.code, src.entry)
        assert compiled.arch == DEFAULT_ARCH and Path(compiled.cubin_path).read_bytes()[:4] == b"\x7fELF"
        geo = faults.geometry(config, mission)
        assert static_violations(compiled.resources, geo.threads, geo.dynamic_smem) == [], (base, compiled.resources)


# ------------------------------------------------------------------ the search over the faults


def worker_answer(config) -> Result:
    """What the GPU worker reports for each fault (tests/test_gpu_faults.py checks the real answers)."""
    fault = config["fault"]
    if fault == "none":
        t = 10.0 + config["block_m"] / 100 + config["warp_key_groups"] / 10
        return Result(status=R.OK, time_us=t, max_abs=1e-4,
                      timing={"median_us": t, "p10_us": t, "p90_us": t, "reps": 5, "launches_per_rep": 10,
                              "method": "fake"})
    if fault == "oob_write":
        return Result(status=R.LAUNCH_ERROR, message=fake.ILLEGAL_ADDRESS)
    if fault == "hang":
        return Result(status=R.TIMEOUT, message="no answer within 12 s (hang?); worker killed")
    if fault == "wrong_values":  # faster than any that passes: must still never be best
        return Result(status=R.WRONG, message="error 215x the gate in seed 1 normal", time_us=1.0, max_abs=0.4)
    if fault == "unwritten":
        return Result(status=R.WRONG, message="4096 non-finite outputs (NaN poison left or computed) in seed 1 normal",
                      max_abs=float("inf"))
    raise AssertionError(f"fault {fault!r} reached the evaluator")


def cpu_gate_answer(faults, fault_module, config) -> Result:
    """What the real gate (evaluate_launches) says, on the CPU, of the Python twin of the config's fault
    (tests/_planted.py: as its CUDA kernel does, and as fast once it skips work)."""
    problem = on_cpu(faults)
    shape = problem.parse_shape(CPU_SHAPE)
    planted = Planted(problem, shape, config["fault"], stateful_launches=fault_module.STATEFUL_LAUNCHES, mutated="k")
    return evaluate_launches(problem, shape, planted.launch_for, reps=3, timer=cpu_timer(planted))


EXPECTED = {"none": R.OK, "oob_write": R.LAUNCH_ERROR, "hang": R.TIMEOUT, "wrong_values": R.WRONG,
            "unwritten": R.WRONG, "compile_error": R.COMPILE_ERROR, **{f: R.WRONG for f in GATE_FAULTS}}


def check_fault_run(run: Run, summary: dict, n_admitted: int, expected: dict, caught_as: dict) -> list[dict]:
    """Every config recorded once with its expected status and a reason (the gate faults' naming the check that caught
    them); only fault-free configs are best or on the front."""
    records = run.trials()
    assert all(r.get("duplicate_of") is None for r in records)  # the exhaustive search asks each config once
    assert len(records) == n_admitted and summary["evaluated"] == n_admitted
    for r in records:
        fault, res = r["config"]["fault"], r["result"]
        assert res["status"] == expected[fault], (fault, res)
        if fault != "none":
            assert res["message"], (fault, res)
        if fault in caught_as:
            assert res["message"].startswith(caught_as[fault]) and res["time_us"] is None, (fault, res)
    assert summary["best"] is not None and summary["best"]["config"]["fault"] == "none"
    assert json.loads((run.path / "best.json").read_text())["config"]["fault"] == "none"
    front = json.loads((run.path / "pareto.json").read_text())
    assert front and all(r["config"]["fault"] == "none" for r in front)
    return records


def test_search_over_faults_never_picks_one(faults, fault_module, fault_space, mission):
    """An exhaustive search of the fault space with the worker's answers (the real gate's, on the CPU, for the faults
    that cheat it) records every fault with its status and reason, never hands compile_error to the evaluator, and
    picks only fault-free configs as best and for the front."""
    seen = []

    def evaluate(config, compiled):
        seen.append(config["fault"])
        if config["fault"] in GATE_FAULTS:
            return cpu_gate_answer(faults, fault_module, config)
        return worker_answer(config)

    n = len(fault_space.admitted_configs(faults.context(mission)))
    run = Run.create("faults", {"family": FAMILY})
    options = SearchOptions(trials=100, sampler="exhaustive", compile_workers=2)
    summary = run_search(faults, fault_space, mission, run, evaluate, options)
    records = check_fault_run(run, summary, n, EXPECTED, fault_module.CAUGHT_AS)
    assert "compile_error" not in seen and len(seen) == n - n // len(FAULTS)
    ce = [r for r in records if r["config"]["fault"] == "compile_error"]
    assert ce and all("evotune_planted_compile_error" in r["result"]["message"] for r in ce)


def test_search_through_workers_that_hang_fault_and_crash(faults, fault_module, fault_space, mission, monkeypatch):
    """Through GPUWorker processes (stand-ins that hang, answer an illegal address, and die), the search records a
    timeout, a launch error and a crash, starts a fresh worker after each, measures the next config in it, and
    finishes with a fault-free best."""
    monkeypatch.setattr(workers, "_worker_main", gate_workers.gate_fault_worker)
    monkeypatch.setenv("EVOTUNE_FAKE_CRASH_ON", "unwritten")
    expected = {**EXPECTED, "unwritten": R.CRASHED}
    n = len(fault_space.admitted_configs(faults.context(mission)))
    run = Run.create("faults-workers", {"family": FAMILY})
    with GPUWorker(timeout_s=1.0) as worker:
        evaluate = worker_evaluator(worker, faults, mission, reps=5)
        summary = run_search(faults, fault_space, mission, run, evaluate,
                             SearchOptions(trials=100, sampler="exhaustive", compile_workers=2))
        restarts = worker.restarts
    records = check_fault_run(run, summary, n, expected, fault_module.CAUGHT_AS)
    by_fault = {}
    for r in records:
        by_fault.setdefault(r["config"]["fault"], []).append(r["result"])
    assert all("no answer within 1 s" in res["message"] for res in by_fault["hang"])
    assert all("illegal memory access" in res["message"] for res in by_fault["oob_write"])
    assert all(res["message"].startswith("GPU worker died (exit code 3)") for res in by_fault["unwritten"])
    # One fresh worker after each oob_write, hang and crash.
    assert restarts == sum(r["config"]["fault"] in ("oob_write", "hang", "unwritten") for r in records)
    # The answer after a killed worker comes from another process than the answer before it.
    answered = [r for r in records if r["config"]["fault"] != "compile_error"]
    pids = [r["result"].get("extra", {}).get("pid") for r in answered]
    for i, r in enumerate(answered[:-1]):
        if r["config"]["fault"] in ("oob_write", "hang", "unwritten"):
            before = next((p for p in reversed(pids[:i]) if p), None)
            after = next(p for p in pids[i + 1:] if p)
            assert after != before


# ------------------------------------------------------------------ the command line


def test_check_loads_the_plugin_family_from_the_space(cache_dir, tmp_path):
    """`evotune check --space tests/data/attention-faults.yaml` takes the family from the space file, compiles every
    config in worker processes that load the plugin by name, and fails on exactly the compile_error configs."""
    env = {**os.environ, "EVOTUNE_RUNS": str(tmp_path / "runs"), "EVOTUNE_CACHE": str(cache_dir)}
    proc = subprocess.run([sys.executable, "-m", "evotune", "check", "--space", str(FAULT_SPACE), "--sample", "0",
                           "--jobs", "2", "--json"], capture_output=True, text=True, env=env, cwd=REPO_ROOT,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "3 admitted configs failed to compile" in proc.stderr
    report = json.loads(proc.stdout)
    assert report["summary"]["admitted"] == report["summary"]["compiled"] == 3 * len(FAULTS)
    failed = [r for r in report["configs"] if r["status"] == "compile_error"]
    assert len(failed) == 3 and all(r["config"]["fault"] == "compile_error" for r in failed)
    assert all(r["status"] == "ok" for r in report["configs"] if r["config"]["fault"] != "compile_error")
