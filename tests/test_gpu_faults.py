"""Planted faults on the GPU (`python -m pytest -m gpu tests/test_gpu_faults.py`): the real search, real
GPU workers and the real watchdog against kernels that write out of bounds, hang, compute wrong values,
leave output unwritten, or fail to compile, and against kernels that compute correctly whenever the
gate looks and cheat otherwise (skip work on a repeat, keep state across launches, change an input,
store just outside O, remember their own answers), which the launch-integrity checks of evaluate.py must
catch, in the search, in `evotune bench` and in `evotune verify` (tests/fault_family.py; the CPU side is
tests/test_faults.py, tests/test_evaluate.py and tests/test_memo_family.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evotune.records import result as R
from evotune.gpu.bench import summarize
from evotune.build.compile import compile_source
from evotune.problems import get_problem
from evotune.records.runs import Run
from evotune.search.loop import worker_evaluator
from evotune.space.searchspace import load_space
from evotune.build.template import instantiate
from _paths import REPO_ROOT
from evotune.gpu.workers import GPUWorker, compiled_to_dict

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

FAMILY = "tests.fault_family:PROBLEM"
FAULT_SPACE = REPO_ROOT / "tests" / "data" / "attention-faults.yaml"
# The watchdog: a candidate gets this long on the GPU. A healthy one takes ~1-3 s on the mission
# shape (a fresh worker's first job included); the planted hang gives up only after 30 s.
TIMEOUT_S = 12
KILLS_THE_WORKER = ("oob_write", "hang")
HEALTHY = {"block_m": 64, "warp_key_groups": 1}  # the healthy config the gate faults are planted into


@pytest.fixture(scope="module", autouse=True)
def repo_on_path():
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
    """The loaded tests.fault_family module (GATE_FAULTS, CAUGHT_AS)."""
    return sys.modules[type(faults).__module__]


def _compiled(faults, fault_space, shape, **knobs):
    config = fault_space.config(knobs)
    src = instantiate(faults, config, shape)
    return config, compile_source(src.code, src.entry)


def test_search_records_every_planted_fault(faults, fault_module, fault_space, mission, tmp_path, cache_dir):
    """`evotune search` over the fault space, exhaustively on the H100, records every fault with its status and reason,
    kills the hung kernel at the timeout, measures the configs after each killed worker in a fresh one, completes,
    and never picks a fault as best or for the Pareto front."""
    env = {**os.environ, "EVOTUNE_RUNS": str(tmp_path / "runs"), "EVOTUNE_CACHE": str(cache_dir)}
    proc = subprocess.run(
        [sys.executable, "-m", "evotune", "search", "--space", str(FAULT_SPACE), "--shape", "mission",
         "--sampler", "exhaustive", "--trials", "100", "--timeout", str(TIMEOUT_S), "--run", "faults", "--json"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    run = Run(Path(summary["path"]))
    records = run.trials()
    n_admitted = len(fault_space.admitted_configs(faults.context(mission)))
    assert summary["evaluated"] == n_admitted == len(records) and summary["abandoned"] == 0
    assert all(r.get("duplicate_of") is None for r in records)
    assert run.meta()["family"] == FAMILY

    for r in records:
        fault, res = r["config"]["fault"], r["result"]
        status, message = res["status"], res["message"] or ""
        where = f"{fault}: {res}"
        if fault == "none":
            assert status == R.OK and res["time_us"] > 0, where
            assert res["verification"]["passed"], where
        elif fault == "oob_write":
            assert status == R.LAUNCH_ERROR, where
            assert "illegal" in message.lower() or "launch failure" in message.lower(), where
        elif fault == "hang":
            assert status == R.TIMEOUT, where
            assert f"no answer within {TIMEOUT_S} s" in message and "killed" in message, where
        elif fault == "wrong_values":
            assert status == R.WRONG and "x the gate" in message, where
            assert res["verification"]["nonfinite"] == 0 and res["verification"]["gate_ratio"] > 1, where
        elif fault == "unwritten":
            assert status == R.WRONG and "non-finite" in message and "NaN poison" in message, where
            assert res["verification"]["nonfinite"] > 0, where
        elif fault == "compile_error":
            assert status == R.COMPILE_ERROR and message.startswith("NVRTC: "), where
            assert "evotune_planted_compile_error" in message, where
        elif fault in fault_module.GATE_FAULTS:
            assert status == R.WRONG and message.startswith(fault_module.CAUGHT_AS[fault]), where
            assert res["time_us"] is None and message.startswith(res["verification"]["failed_check"]), where
        else:
            raise AssertionError(where)

    # After each fault that took its worker down, a later candidate was measured (a fresh worker answered).
    for i, r in enumerate(records):
        if r["config"]["fault"] in KILLS_THE_WORKER:
            later = [x for x in records[i + 1:]
                     if x["config"]["fault"] in ("none", "wrong_values", "unwritten", *fault_module.GATE_FAULTS)]
            if later:
                assert later[0]["result"]["verification"] is not None, later[0]

    best = summary["best"]
    assert best is not None and best["config"]["fault"] == "none"
    front = json.loads((run.path / "pareto.json").read_text())
    assert front and all(r["config"]["fault"] == "none" for r in front)


def test_watchdog_kills_a_hung_kernel_and_the_next_worker_measures(faults, fault_space, mission):
    """A kernel that spins is a TIMEOUT at the worker's timeout; the worker process is gone, and the next candidate is
    measured in a fresh worker at its usual speed (nothing left spinning on the GPU)."""
    good_cfg, good = _compiled(faults, fault_space, mission, block_m=64, warp_key_groups=1, fault="none")
    hang_cfg, hang = _compiled(faults, fault_space, mission, block_m=64, warp_key_groups=1, fault="hang")
    with GPUWorker(timeout_s=TIMEOUT_S) as worker:
        evaluate = worker_evaluator(worker, faults, mission)
        first = evaluate(good_cfg, good)
        assert first.status == R.OK, first
        hung_proc = worker._proc
        start = time.monotonic()
        res = evaluate(hang_cfg, hang)
        waited = time.monotonic() - start
        assert res.status == R.TIMEOUT, res
        assert waited >= TIMEOUT_S  # it waited the watchdog out (the worker's death below says it then killed)
        assert not hung_proc.is_alive() and worker._proc is None and worker.restarts == 1
        again = evaluate(good_cfg, good)
        assert again.status == R.OK, again
        assert worker.restarts == 1 and worker._proc.pid != hung_proc.pid
    # A hung kernel still holding an SM (or the GPU, time-sliced) would show here.
    assert again.time_us < 2 * first.time_us, (first.time_us, again.time_us)


def test_hang_is_bounded_even_if_never_killed(faults, fault_space, mission, monkeypatch):
    """With the bound set to 2 s and a watchdog far longer, the planted hang ends by itself (every later launch of the
    module at once: the deadline is shared), and the candidate still fails the gate on its unwritten tile."""
    module = sys.modules[type(faults).__module__]
    monkeypatch.setattr(module, "HANG_BOUND_S", 2)
    cfg, hang = _compiled(faults, fault_space, mission, block_m=64, warp_key_groups=1, fault="hang")
    with GPUWorker(timeout_s=60) as worker:
        evaluate = worker_evaluator(worker, faults, mission)
        worker.call({"kind": "info"})  # start the worker before the clock starts
        start = time.monotonic()
        res = evaluate(cfg, hang)
        took = time.monotonic() - start
    assert res.status == R.WRONG and "NaN poison" in res.message, res
    assert took >= 2, took  # ended by its own bound: the 60 s watchdog never fired (the result is not a TIMEOUT)


# ------------------------------------------------------------------ the faults that cheat the gate


@pytest.fixture(scope="module")
def gate_results(faults, fault_module, fault_space, mission):
    """fault -> Result of each gate fault and its healthy twin, each evaluated once, in one GPU worker, as the
    search evaluates: a module's __device__ state lives as long as the process (CuPy keeps one module per cubin)."""
    results = {}
    with GPUWorker(timeout_s=120) as worker:
        evaluate = worker_evaluator(worker, faults, mission)
        for fault in ("none", *fault_module.GATE_FAULTS):
            config, compiled = _compiled(faults, fault_space, mission, **HEALTHY, fault=fault)
            results[fault] = evaluate(config, compiled)
    return results


def test_healthy_twin_passes_every_check(gate_results):
    """The healthy config passes the gate, the repeats, the guard bands, the input check and the timed-output audit."""
    res = gate_results["none"]
    assert res.status == R.OK and res.time_us > 0, res
    v = res.verification
    assert v["passed"] and v["failed_check"] == ""
    assert v["guards"].startswith("nothing written in the 256 KiB before or after O")
    assert v["inputs_intact"].startswith("every input bitwise unchanged")
    assert v["repeat"].startswith("3 launches on seed 1 normal bitwise identical")
    assert v["timed_output"].startswith("O after timing over 2 rotating input sets bitwise equal")
    assert {"load", "verify", "timed_check", "time"} <= set(res.extra["eval_seconds"])


@pytest.mark.parametrize("fault", ["skip_on_repeat", "stateful_counter", "input_mutation", "write_past_o",
                                   "write_before_o", "memo_o", "memo_fingerprint", "memo_late", "memo_cache"])
def test_gate_fault_is_wrong_naming_its_check(gate_results, fault_module, fault):
    """Each planted cheat is WRONG, untimed, with the message of the check that catches it (CAUGHT_AS)."""
    assert fault in fault_module.GATE_FAULTS
    res = gate_results[fault]
    assert res.status == R.WRONG and res.message.startswith(fault_module.CAUGHT_AS[fault]), res
    assert res.time_us is None and res.timing is None
    assert res.message.startswith(res.verification["failed_check"]) and not res.verification["passed"]


def test_bench_reports_a_cheat_as_failing(faults, fault_space, mission):
    """`evotune bench`'s worker job runs the same checks: skip_on_repeat is WRONG there, without a time."""
    config, compiled = _compiled(faults, fault_space, mission, **HEALTHY, fault="skip_on_repeat")
    with GPUWorker(timeout_s=600) as worker:
        raw = worker.call({"kind": "bench", "family": faults.family, "shape": mission.as_dict(),
                           "config": config.as_dict(), "compiled": compiled_to_dict(compiled), "reps": 5,
                           "seeds": [101, 102, 103], "names": ["flash"]})
    assert raw["kernel"]["status"] == R.WRONG and raw["kernel"]["message"].startswith("repeat: "), raw["kernel"]
    row = summarize(raw, mission.flops(), mission.min_bytes())["rows"][0]
    assert row["time_us"] is None and row["reason"].startswith("wrong: repeat: ")


@pytest.mark.parametrize("fault", ["memo_o", "memo_late", "memo_cache"])
def test_bench_and_verify_catch_the_memo_kernels(faults, fault_module, fault_space, mission, fault):
    """The kernels that remember their answers fail `evotune bench`'s and `evotune verify`'s worker jobs too, naming
    the check (the search's is test_gate_fault_is_wrong_naming_its_check): none gets a time."""
    config, compiled = _compiled(faults, fault_space, mission, **HEALTHY, fault=fault)
    with GPUWorker(timeout_s=600) as worker:
        raw = worker.call({"kind": "bench", "family": faults.family, "shape": mission.as_dict(),
                           "config": config.as_dict(), "compiled": compiled_to_dict(compiled), "reps": 5,
                           "seeds": [101, 102, 103], "names": ["cudnn"]})
        rep = worker.call({"kind": "verify", "family": faults.family, "shape": mission.as_dict(),
                           "config": config.as_dict(), "compiled": compiled_to_dict(compiled), "launches": 100,
                           "seeds": [101, 102, 103]})
    assert raw["kernel"]["status"] == R.WRONG and raw["kernel"]["message"].startswith(fault_module.CAUGHT_AS[fault])
    assert raw["kernel"]["time_us"] is None and "head_to_head" not in raw
    # verify loads the module bench left behind (CuPy keeps one per cubin): a launch-count cheat is already live
    # in verify's gate, where whichever check meets it first names it.
    v = rep["verification"]
    assert not v["passed"] and v["failed_check"] in R.CHECKS and rep["message"].startswith(v["failed_check"]), rep


def test_the_floor_judges_a_real_kernel_plausible_and_a_faster_time_not(faults, fault_space, mission):
    """The healthy kernel's worker result carries the mission shape's floor on this GPU, measured in the worker,
    and its time is above it; the same result with the issue's 1.76 us is IMPLAUSIBLE under that floor."""
    from evotune.gpu.plausibility import FLOORS
    from evotune.records.result import Result

    config, compiled = _compiled(faults, fault_space, mission, **HEALTHY, fault="none")
    with GPUWorker(timeout_s=600) as worker:
        res = worker_evaluator(worker, faults, mission)(config, compiled)
    assert res.status == R.OK and res.time_us > res.extra["floor_us"] > 1.0, res
    floor = res.extra["floor_us"]
    fast = Result(status=R.OK, time_us=floor * 0.9)
    FLOORS._ceilings["fp16"] = {"copy": {"gb_s": 1.0}, "matmul": {"tflop_s": 1.0}, "empty_kernel": {"time_us": floor}}
    try:
        judged = FLOORS.judge(faults.parse_shape("1,1,1,1,64"), fast)
    finally:
        FLOORS._ceilings.clear()
    assert judged.status == R.IMPLAUSIBLE and "below this shape's floor" in judged.message


def test_verify_job_catches_a_stateful_kernel(faults, fault_space, mission):
    """`evotune verify`'s worker job runs the timed-output check too: stateful_counter fails it there, and its
    100-launch determinism check."""
    config, compiled = _compiled(faults, fault_space, mission, **HEALTHY, fault="stateful_counter")
    with GPUWorker(timeout_s=600) as worker:
        rep = worker.call({"kind": "verify", "family": faults.family, "shape": mission.as_dict(),
                           "config": config.as_dict(), "compiled": compiled_to_dict(compiled), "launches": 100,
                           "seeds": [101, 102, 103]})
    assert not rep["verification"]["passed"] and rep["verification"]["failed_check"] in (R.TIMED_OUTPUT,
                                                                                         R.CHANGED_INPUT), rep
    assert rep["message"].startswith(("timed output: ", "changed input: ")) and not rep["determinism"]["passed"], rep


def test_baselines_pass_the_new_checks(mission):
    """SDPA's backends, which write O with copy_, pass the whole gate: guard bands, inputs, repeats included."""
    with GPUWorker(timeout_s=600) as worker:
        report = worker.call({"kind": "baselines", "family": "attention", "shape": mission.as_dict(),
                              "names": ["flash", "cudnn", "efficient", "math"], "reps": 5})
    measured = {name: b for name, b in report.items() if b.get("available")}
    assert measured
    for name, b in measured.items():
        v = b["verification"]
        assert v["passed"] and v["failed_check"] == "", (name, v)
        assert v["repeat"].startswith("3 launches") and v["guards"].startswith("nothing written"), (name, v)
