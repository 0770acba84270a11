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


def test_with_flag_arguments(time_configs):
    """--with-flag FLAG comes first; without it every argument after the shape is a config."""
    assert time_configs.parse_args(["gpt2", "{}"]) == (None, "gpt2", ["{}"])
    assert time_configs.parse_args(["--with-flag", "no_wg_overlap", "gpt2", "{}", "{}"]) == \
        ("no_wg_overlap", "gpt2", ["{}", "{}"])
    for bad in (["--with-flag"], ["--with-flag", "x"], []):
        with pytest.raises(SystemExit):
            time_configs.parse_args(bad)
    assert time_configs.split_space(["gpt2", "{}"]) == ("attention", ["gpt2", "{}"])
    assert time_configs.split_space(["--space", "attention-hopper3-rescale", "gpt2", "{}"]) == \
        ("attention-hopper3-rescale", ["gpt2", "{}"])
    with pytest.raises(SystemExit):
        time_configs.split_space(["--space"])


def test_no_wg_overlap_variant(time_configs, attention, space):
    """The variant --with-flag no_wg_overlap measures: the Hopper kernel with one more wgmma_wait<0> per K/V tile
    (its softmax waits for its own P V), compiled clean for sm_90a (no spills, wgmma not serialised); the config's
    own source is untouched (no config's flags hold it)."""
    from evotune.build.compile import compile_source, static_violations
    from evotune.build.template import instantiate
    from evotune.problems.shapes import parse_shape

    shape = parse_shape("gpt2")
    flagged = time_configs.with_flags(attention, {"no_wg_overlap"})
    wgmma = space.config(dict(mma="wgmma", block_m=128, block_n=64, compute_warps=8, producer_warps=0, stages=4,
                              q_in_regs=True, epilogue="tma"))  # gpt2-h100-tma's best (docs/experiments/CHANGELOG.md)
    plain, serial = instantiate(attention, wgmma, shape), instantiate(flagged, wgmma, shape)
    assert serial.code.count("wgmma_wait<0>();") == plain.code.count("wgmma_wait<0>();") + 1
    assert "no_wg_overlap" not in attention.template_flags(wgmma)  # only with_flags adds it
    compiled = compile_source(serial.code, serial.entry)
    geo = attention.geometry(wgmma, shape)
    assert static_violations(compiled.resources, geo.threads, geo.dynamic_smem) == []
    assert not [line for line in compiled.log.splitlines() if any(c in line for c in ("C7514", "C7515", "C7519"))]
