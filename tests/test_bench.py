"""Tests of evotune bench: the floor arithmetic, the summary rows, the CLI's errors, and (GPU) a real bench."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from evotune.gpu.bench import floor_analysis, summarize
from evotune.cli import app

CEIL = {"copy": {"gb_s": 3000.0, "bytes": 1, "time_us": 1.0},
        "matmul": {"tflop_s": 700.0, "dtype": "fp16", "n": 8192, "time_us": 1.0},
        "empty_kernel": {"time_us": 1.5}}


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
