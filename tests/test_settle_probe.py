"""tools/settle_probe.py on the CPU: its arguments and its printed row (the timing itself needs the GPU)."""

from __future__ import annotations

import pytest

from _paths import load_tool


@pytest.fixture(scope="module")
def probe():
    return load_tool("settle_probe")


def test_arguments(probe, capsys):
    """--run, or --shape with --config; settle lengths parsed; bad ones are usage errors (exit 2)."""
    args = probe.parse_args(["--run", "r", "--settle-us", "0, 20000", "--repeats", "3"])
    assert (args.run, args.settle, args.repeats) == ("r", [0.0, 20000.0], 3)
    for bad in (["--shape", "mission"], [], ["--run", "r", "--shape", "s", "--config", "{}"],
                ["--run", "r", "--settle-us", "x"], ["--run", "r", "--settle-us", "-1"], ["--run", "r", "--repeats", "0"]):
        with pytest.raises(SystemExit) as e:
            probe.parse_args(bad)
        assert e.value.code == 2, bad
    capsys.readouterr()


def test_summary_line_names_the_largest_predecessor_effect(probe):
    h2h = {"rounds": 12, "timings": {"evotune": {"median_us": 1800.0}, "cudnn": {"median_us": 1700.0}},
           "vs_cudnn": {"median": 0.944, "min": 0.9, "max": 1.01},
           "predecessor_effect": {"evotune": 1.01, "efficient": 0.95, "cudnn": 1.0}}
    line = probe.summary_line(20000.0, h2h)
    assert "settle    20000 us" in line and "rounds 12" in line and "ours   1800.00" in line
    assert "cudnn/ours 0.944 (0.900-1.010)" in line and line.endswith("after efficient 0.950")
