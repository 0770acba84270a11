"""Tests of evotune bench: the floor arithmetic, the summary rows (solo and head-to-head), the head-to-head
phase on CPU stand-ins, the printed table, the CLI's errors, and (GPU) a real bench."""

from __future__ import annotations

import json

import pytest
from _fake_gpu import FakeGPU, cpu_interleaved
from _paths import REPO_ROOT
from _planted import Planted, cpu_timer, on_cpu
from typer.testing import CliRunner

from evotune.cli import app
from evotune.gpu import evaluate as E
from evotune.gpu.bench import OURS, floor_analysis, summarize, with_head_to_head
from evotune.gpu.plausibility import Floors
from evotune.problems import get_problem
from evotune.records import result as R

CEIL = {"copy": {"gb_s": 3000.0, "bytes": 1, "time_us": 1.0},
        "matmul": {"tflop_s": 700.0, "dtype": "fp16", "n": 8192, "time_us": 1.0},
        "empty_kernel": {"time_us": 1.5}}
CPU_FLOORS = Floors(lambda dtype: CEIL)  # the floor's ceilings, as a GPU worker would measure them


def test_floor_is_launch_plus_the_larger_of_memory_and_compute():
    """3 MB at 3000 GB/s is 1 us, 1.4 GFLOP at 700 TFLOP/s is 2 us: compute-bound, floor 1.5 + 2 us."""
    fl = floor_analysis(1.4e9, 3e6, CEIL)
    assert fl["memory_us"] == pytest.approx(1.0)
    assert fl["compute_us"] == pytest.approx(2.0)
    assert fl["bound"] == "compute"
    assert fl["floor_us"] == pytest.approx(3.5)
    assert floor_analysis(1e6, 3e9, CEIL)["bound"] == "memory"


def _raw(kernel_status="ok"):
    ver = {"gate_ratio": 0.4, "max_abs": 1e-4, "passed": True}
    kernel = {"status": kernel_status, "time_us": 5.0 if kernel_status == "ok" else None, "message": "boom",
              "timing": {"p10_us": 4.9, "p90_us": 5.2}, "verification": ver}
    base = {"flash": {"available": True, "time_us": 10.0, "timing": {"p10_us": 9.8, "p90_us": 10.3}, "verification": ver},
            "cudnn": {"available": True, "time_us": 9.0, "timing": {"p10_us": 8.8, "p90_us": 9.1}, "verification": ver},
            "math": {"available": False, "reason": "skipped"}}
    return {"kernel": kernel, "baselines": base, "ceilings": CEIL}


def test_summary_rows_speedups_and_best_baseline():
    """Rows put the kernel first; speedups are baseline time over ours; the best baseline is the fastest available."""
    s = summarize(_raw(), flops=1e9, nbytes=1e6)
    names = [r["name"] for r in s["rows"]]
    assert names == ["evotune", "flash", "cudnn", "math"]
    flash = s["rows"][1]
    assert flash["ours_speedup"] == pytest.approx(2.0)
    assert flash["tflop_s"] == pytest.approx(1e9 / 10.0 / 1e6)
    assert s["rows"][0]["tflop_s"] == pytest.approx(200.0)
    assert s["best_baseline"] == "cudnn"
    assert s["ours_over_best_baseline"] == pytest.approx(5.0 / 9.0)
    assert s["rows"][3]["available"] is False and s["rows"][3]["time_us"] is None


def test_summary_of_a_failed_kernel_has_no_speedups():
    s = summarize(_raw("wrong"), flops=1e9, nbytes=1e6)
    assert s["rows"][0]["time_us"] is None and "wrong" in s["rows"][0]["reason"]
    assert all(r["ours_speedup"] is None for r in s["rows"])
    assert s["ours_over_best_baseline"] is None


def _head_to_head(raw, ours=4.0, flash=(8.0, 9.0, 10.0), cudnn=(4.0, 4.4, 4.8)):
    """`raw` with a head-to-head of three rounds: ours at `ours` us every round, each baseline's round medians."""
    def timing(medians):
        return {"median_us": sorted(medians)[1], "p10_us": min(medians), "p90_us": max(medians), "reps": 9,
                "launches_per_rep": 1, "method": "cuda-graph"}

    medians = {OURS: [ours] * 3, "flash": list(flash), "cudnn": list(cudnn)}
    speedups = {n: {"per_round": [m / ours for m in medians[n]], "median": sorted(medians[n])[1] / ours,
                    "min": min(medians[n]) / ours, "max": max(medians[n]) / ours} for n in ("flash", "cudnn")}
    return {**raw, "head_to_head": {"rounds": 3, "reps_per_round": 3, "round_medians": medians,
                                    "timings": {n: timing(m) for n, m in medians.items()}, "ours_speedup": speedups}}


def test_summary_takes_the_head_to_head_where_there_is_one():
    """With a head-to-head, rows' times, p10-p90, rates and speedups are the interleaved ones; the solo
    time stays as solo_time_us, and each baseline gets its speedup's min and max over the rounds."""
    s = summarize(_head_to_head(_raw()), flops=1e9, nbytes=1e6)
    ours, flash, cudnn, math = s["rows"]
    assert s["interleaved"] == {"rounds": 3, "reps_per_round": 3}
    assert (ours["time_us"], ours["solo_time_us"], ours["interleaved"]) == (4.0, 5.0, True)
    assert ours["tflop_s"] == pytest.approx(250.0) and ours["ours_speedup_min"] is None
    assert (flash["time_us"], flash["solo_time_us"], flash["p10_us"], flash["p90_us"]) == (9.0, 10.0, 8.0, 10.0)
    assert flash["ours_speedup"] == pytest.approx(9.0 / 4.0)
    assert (flash["ours_speedup_min"], flash["ours_speedup_max"]) == pytest.approx((2.0, 2.5))
    assert cudnn["ours_speedup"] == pytest.approx(1.1) and cudnn["ours_speedup_min"] == pytest.approx(1.0)
    assert s["best_baseline"] == "cudnn" and s["ours_over_best_baseline"] == pytest.approx(4.0 / 4.4)
    assert math["available"] is False and math["time_us"] is None and math["interleaved"] is False


def test_summary_without_head_to_head_is_the_solo_one():
    """A record without a head-to-head (all records before it) keeps its solo times, with no spread."""
    s = summarize(_raw(), flops=1e9, nbytes=1e6)
    assert s["interleaved"] is None
    assert all(r["solo_time_us"] == r["time_us"] and not r["interleaved"] for r in s["rows"])
    assert all(r["ours_speedup_min"] is None and r["ours_speedup_max"] is None for r in s["rows"])


def test_committed_bench_records_summarize_as_they_were_written():
    """Every committed record's raw data (docs/data/bench/, solo timings) gives back the rows it stores."""
    paths = sorted((REPO_ROOT / "docs" / "data" / "bench").glob("*.json"))
    assert paths
    for path in paths:
        rec = json.loads(path.read_text())
        s = summarize(rec["raw"], rec["flops"], rec["min_bytes"])
        for stored, row in zip(rec["rows"], s["rows"], strict=True):
            assert {k: row[k] for k in stored} == stored, path.name
        assert s["ours_over_best_baseline"] == rec["ours_over_best_baseline"]


@pytest.fixture(scope="module")
def cpu_attention():
    """The attention family on CPU tensors, its baselines Python stand-ins."""

    class WithBaselines(type(on_cpu(get_problem("attention")))):
        def baseline_launcher(self, name, shape, inputs, probe=True):
            return lambda: self.reference(shape, inputs)

    problem = WithBaselines()
    return problem, problem.parse_shape("1,2,40,56,64:bshd")


def _solo(problem, shape) -> dict:
    """A passed kernel's solo record (evaluate_launches, the CPU stand-in timer) and two baselines, one unavailable."""
    planted = Planted(problem, shape)
    kernel = E.evaluate_launches(problem, shape, planted.launch_for, timer=cpu_timer(planted)).as_dict()
    return {"kernels": {OURS: kernel}, "baselines": {"flash": {"available": True, "time_us": 8.0},
                                                     "math": {"available": False, "reason": "skipped"}}}


def test_with_head_to_head_adds_the_interleaved_timings(cpu_attention):
    """A correct kernel: the head-to-head holds ours and every available baseline, the per-round speedup
    vs each baseline, and says the timed output was checked."""
    problem, shape = cpu_attention
    raw = _solo(problem, shape)
    out = with_head_to_head(raw, problem, shape, {OURS: Planted(problem, shape).launch_for}, reps=12, rounds=3,
                            timer=cpu_interleaved(FakeGPU({OURS: 5.0, "flash": 8.0})), floors=CPU_FLOORS)
    h2h = out["head_to_head"]
    assert out["kernels"] == raw["kernels"] and set(h2h["timings"]) == {OURS, "flash"}
    # 3 rounds asked, 4 run: whole Williams cycles of the two contenders (interleave.whole_cycles)
    assert (h2h["rounds"], h2h["reps_per_round"], h2h["winner"]) == (4, 4, OURS)
    assert h2h["ours_speedup"]["flash"]["per_round"] == pytest.approx([1.6] * 4)
    assert h2h["timed_output"].startswith("O after the interleaved timing")
    json.dumps(out)  # a record: plain data only


def test_with_head_to_head_makes_a_cheat_wrong(cpu_attention):
    """A kernel that passed alone but whose launches skip work once there are many (in its head-to-head module)
    becomes WRONG naming the timed-output check, with no time; no head-to-head is recorded."""
    problem, shape = cpu_attention
    raw = _solo(problem, shape)
    out = with_head_to_head(raw, problem, shape, {OURS: Planted(problem, shape, "stateful_counter").launch_for},
                            reps=12, rounds=3, timer=cpu_interleaved(FakeGPU({OURS: 1.0, "flash": 8.0})),
                            floors=CPU_FLOORS)
    kernel = out["kernels"][OURS]
    assert "head_to_head" not in out and kernel["status"] == R.WRONG and kernel["time_us"] is None
    assert kernel["message"].startswith("timed output: after the interleaved timing over 2 rotating input sets")
    assert kernel["verification"]["failed_check"] == R.TIMED_OUTPUT
    row = summarize({"kernel": kernel, "baselines": out["baselines"], "ceilings": CEIL}, 1e9, 1e6)["rows"][0]
    assert row["time_us"] is None and row["reason"].startswith("wrong: timed output")


def test_with_head_to_head_names_the_fastest_passing_finalist(cpu_attention):
    """Several kernels (a search's finalists): the winner is the one with the fastest interleaved median among
    those that kept their output; a faster one that cheats is WRONG and not the winner; the speedups are the
    winner's."""
    problem, shape = cpu_attention
    planted = Planted(problem, shape)
    solo = E.evaluate_launches(problem, shape, planted.launch_for, timer=cpu_timer(planted)).as_dict()
    raw = {"kernels": {"trial 1": solo, "trial 2": solo, "trial 3": solo},
           "baselines": {"flash": {"available": True, "time_us": 8.0}}}
    launches = {"trial 1": planted.launch_for, "trial 2": Planted(problem, shape).launch_for,
                "trial 3": Planted(problem, shape, "stateful_counter").launch_for}
    out = with_head_to_head(raw, problem, shape, launches, reps=12, rounds=3,
                            timer=cpu_interleaved(FakeGPU({"trial 1": 6.0, "trial 2": 4.0, "trial 3": 1.0,
                                                           "flash": 8.0})), floors=CPU_FLOORS)
    h2h = out["head_to_head"]
    assert h2h["winner"] == "trial 2" and out["kernels"]["trial 3"]["status"] == R.WRONG
    assert out["kernels"]["trial 1"] == out["kernels"]["trial 2"] == solo
    assert set(h2h["ours_speedup"]) == {"flash"}
    assert h2h["ours_speedup"]["flash"]["median"] == pytest.approx(2.0)


def test_with_head_to_head_makes_a_time_below_the_floor_implausible(cpu_attention):
    """A kernel that keeps its output through the interleaved timing but whose median is below the shape's floor (an
    empty kernel's 1.5 us here) is IMPLAUSIBLE with the numbers, gets no time and no head-to-head winner."""
    problem, shape = cpu_attention
    raw = _solo(problem, shape)
    out = with_head_to_head(raw, problem, shape, {OURS: Planted(problem, shape).launch_for}, reps=12, rounds=3,
                            timer=cpu_interleaved(FakeGPU({OURS: 1.0, "flash": 8.0})), floors=CPU_FLOORS)
    kernel = out["kernels"][OURS]
    assert "head_to_head" not in out and kernel["status"] == R.IMPLAUSIBLE and kernel["time_us"] is None
    assert kernel["message"].startswith("timed 1 us, below this shape's floor of 1.51 us on this GPU (an empty "
                                        "kernel's 1.5 us; compulsory bytes at 3000 GB/s ")
    assert kernel["extra"]["implausible_time_us"] == pytest.approx(1.0)


def test_printed_table_says_the_times_are_interleaved():
    """The bench table shows the interleaved time, the speedup's spread and one line saying how it was timed."""
    from evotune.cli.candidate import _print_bench
    from evotune.cli.common import console

    s = summarize(_head_to_head(_raw()), flops=1e9, nbytes=1e6)
    rec = {"date": "2026-01-01", "device": {"name": "GPU"}, "config": {}, "shape": "mission", "reps": 30, **s}
    width = console.width
    try:
        console.width = 200  # one row a line
        with console.capture() as cap:
            _print_bench(rec)
    finally:
        console.width = width
    text = cap.get()
    assert "interleaved: 3 rounds x 3 replays per kernel; (min-max) over rounds" in text
    assert "2.25x (2.00-2.50)" in text and "1.10x (1.00-1.20)" in text


def test_bench_unknown_baseline_is_a_usage_error(main_in_process):
    proc = main_in_process("bench", "--config", "{}", "--shape", "mission", "--baselines", "flash,nope")
    code, err = proc.returncode, proc.stderr
    assert code == 2
    assert "unknown baseline(s) nope" in err and len(err.strip().splitlines()) == 1


def test_bench_out_into_a_missing_folder_is_a_usage_error(main_in_process, tmp_path):
    proc = main_in_process("bench", "--config", "{}", "--shape", "mission",
                           "--out", str(tmp_path / "no" / "x.json"))
    code, err = proc.returncode, proc.stderr
    assert code == 2
    assert "does not exist" in err


runner = CliRunner()


@pytest.mark.gpu
def test_bench_default_config_on_mission(tmp_path):
    """A real bench: the kernel and every SDPA backend pass the gate, with ceilings and a floor."""
    out = tmp_path / "bench.json"
    res = runner.invoke(app, ["bench", "--config", "{}", "--shape", "mission", "--reps", "10", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rec = json.loads(out.read_text())
    assert rec["rows"][0]["name"] == "evotune" and rec["rows"][0]["time_us"] > 0
    assert {r["name"] for r in rec["rows"]} >= {"flash", "cudnn", "efficient", "math"}
    assert all(r["passed"] for r in rec["rows"] if r["available"])
    assert rec["ceilings"]["copy"]["gb_s"] > 100 and rec["ceilings"]["matmul"]["tflop_s"] > 10
    assert rec["floor"]["floor_us"] > rec["ceilings"]["empty_kernel"]["time_us"]
    h2h = rec["raw"]["head_to_head"]  # the kernel and every available backend, interleaved
    assert set(h2h["timings"]) == {r["name"] for r in rec["rows"] if r["available"]} and h2h["rounds"] == 10
    assert all(r["interleaved"] and r["solo_time_us"] > 0 for r in rec["rows"] if r["available"])
    assert all(r["ours_speedup_min"] <= r["ours_speedup_max"] for r in rec["rows"][1:] if r["available"])
