"""tools/time_configs.py on the CPU: the table it prints from the interleaved pool (the timing itself needs the GPU)."""

from __future__ import annotations

import pytest

from _paths import load_tool


@pytest.fixture(scope="module")
def time_configs():
    return load_tool("time_configs")


def _t(median):
    return {"median_us": median, "p10_us": median - 1, "p90_us": median + 1}


def test_table_shows_interleaved_times_and_ratio_vs_cudnn(time_configs):
    """Baselines and passed configs show their interleaved medians, each config cudnn's time over its own per
    round (median, min-max) beside its solo line; a config that failed after the interleaved timing or the
    gate shows why, untimed."""
    rows = [{"config": '{"a":1}', "line": "ok   10.00 us", "label": "config 1"},
            {"config": '{"a":2}', "line": "wrong    0.00 us  error"},
            {"config": '{"a":3}', "line": "ok   9.00 us", "label": "config 3"}]
    interleaved = {"rounds": 10, "reps_per_round": 10,
                   "timings": {"config 1": _t(10.5), "config 3": _t(9.0), "flash": _t(12.0), "cudnn": _t(11.0)},
                   "vs_cudnn": {"config 1": {"median": 1.048, "min": 1.01, "max": 1.09}}}
    lines = time_configs.table_lines(rows, interleaved, {"config 3": "timed output: after the interleaved timing"})
    assert lines[0].startswith("interleaved: 10 rounds x 10 replays per contender")
    assert lines[1] == "SDPA flash       12.00 us  (11.00-13.00)"
    assert lines[3] == ('   10.50 us  (9.50-11.50)  cudnn/this 1.048 (1.010-1.090)  solo ok   10.00 us   {"a":1}')
    assert lines[4] == 'wrong    0.00 us  error   {"a":2}'
    assert lines[5].startswith("wrong   after the interleaved timing: timed output") and lines[5].endswith('{"a":3}')


def test_table_without_a_pool(time_configs):
    """Nothing timed (no config passed, no baseline available): the baselines say n/a, the configs their gate line."""
    lines = time_configs.table_lines([{"config": "{}", "line": "not admitted: x"}], None, {})
    assert lines == ["SDPA flash         n/a", "SDPA cudnn         n/a", "not admitted: x   {}"]
