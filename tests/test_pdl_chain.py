"""Tests for tools/pdl_chain.py: its arguments and table on the CPU, its settings' plumbing on the CPU with
stand-in launches and timing (the views, strides and gates a GPU run goes through), and a GPU smoke run."""

from __future__ import annotations

import json
import math

import pytest

from _paths import load_tool

pdl_chain = load_tool("pdl_chain")


def test_defaults_are_the_mission_winner_in_every_setting():
    """Without arguments: the mission winner on the mission shape, all three settings and four SDPA backends."""
    args = pdl_chain.parse_args([])
    assert args.shape == "mission" and args.config == pdl_chain.MISSION_WINNER and args.layers == 4
    assert args.settings == ["alone", "back_to_back", "chain"] and args.backends == ["cudnn", "flash", "efficient", "math"]
    assert args.out.endswith("pdl_chain.json")


@pytest.mark.parametrize("argv, said", [
    (["--settings", "alone,sideways"], "--settings: sideways"),
    (["--settings", ""], "--settings: none given"),
    (["--backends", "fa3"], "--backends: fa3"),
    (["--layers", "0"], "at least 1"),
    (["--config", "{nope"], "--config: not JSON"),
    (["--config", '{"pdl": true}'], "without pdl"),
    (["--config", "[1]"], "a JSON object"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, said):
    """A malformed argument is argparse's exit 2 with a line naming it."""
    with pytest.raises(SystemExit) as info:
        pdl_chain.parse_args(argv)
    assert info.value.code == 2 and said in capsys.readouterr().err


def test_arguments_are_read(tmp_path, monkeypatch):
    """Shape, config, layers, settings (deduplicated), an empty backend list and $OUT are taken as given."""
    monkeypatch.setenv("OUT", str(tmp_path))
    args = pdl_chain.parse_args(["--shape", "1,16,1024,64", "--config", '{"block_m": 64}', "--layers", "8",
                                 "--settings", "chain,chain,alone", "--backends", "", "--rounds", "4", "--reps", "5"])
    assert (args.shape, args.config, args.layers, args.settings, args.backends) == (
        "1,16,1024,64", {"block_m": 64}, 8, ["chain", "alone"], [])
    assert (args.rounds, args.reps, args.out) == (4, 5, str(tmp_path / "pdl_chain.json"))


def _timing(us):
    return {"median_us": us, "p10_us": us * 0.99, "p90_us": us * 1.01, "reps": 10, "launches_per_rep": 1,
            "method": "cuda-graph"}


def _gate(ratio):
    return {"passed": ratio <= 1, "gate_ratio": ratio}


RECORD = {
    "device": {"name": "NVIDIA H100 80GB HBM3"}, "shape": "1,8,512,512,64", "config_summary": "block_m=32",
    "rounds": 10, "reps": 20, "backends": ["cudnn", "flash"],
    "settings": {
        "alone": {"unit": "per call", "timings": {"pdl off": _timing(7.5), "pdl on": _timing(7.25),
                                                  "sdpa cudnn": _timing(9.0), "sdpa flash": _timing(11.0)},
                  "on_over_off": {"median": 0.967, "min": 0.95, "max": 0.99},
                  "gate": {"pdl off": _gate(0.31), "pdl on": _gate(0.31)}},
        "chain": {"unit": "per chain of 4", "timings": {"pdl off": _timing(61.0), "pdl on": _timing(58.5),
                                                        "sdpa cudnn": _timing(64.0)},
                  "on_over_off": {"median": 0.959, "min": 0.94, "max": 0.97},
                  "gate": {"pdl off": _gate(0.3), "pdl on": _gate(1.7)}},
        "back_to_back": {"skipped": "not asked"},
    },
}


def test_table_lines():
    """The table: a header naming the device, shape and config; per setting ours off/on, on/off, each backend
    (- where one was not timed) and the gate; a skipped setting says why."""
    lines = pdl_chain.table_lines(RECORD)
    assert lines[0].startswith("pdl_chain: NVIDIA H100 80GB HBM3, 1,8,512,512,64, block_m=32; medians in us")
    assert lines[1].split() == ["setting", "pdl", "off", "pdl", "on", "on/off", "(min-max)", "sdpa", "cudnn", "sdpa",
                                "flash", "gate", "off/on"]
    assert lines[2].split() == ["alone", "(per", "call)", "7.50", "7.25", "0.967", "(0.950-0.990)", "9.00", "11.00",
                                "ok", "0.31/ok", "0.31"]
    assert lines[3].split() == ["chain", "(per", "chain", "of", "4)", "61.00", "58.50", "0.959", "(0.940-0.970)",
                                "64.00", "-", "ok", "0.30/FAIL", "1.70"]
    assert lines[4] == "back_to_back  skipped: not asked"


# --------------------------------------------------------------------------- the settings on the CPU


class StandIns:
    """CPU stand-ins for what needs a GPU: our launch (SDPA's math in fp32, written into the output buffer after
    the family's own argument checks), one untimed call per contender for the timing, and no-op syncs."""

    def __init__(self, problem):
        self.problem, self.launched, self.timed = problem, [], {}

    def launcher(self, kernel, config, shape, inputs, out, lse=None):
        import torch.nn.functional as F

        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        values = self.problem.launch_values(config, shape, q, k, v, out, inputs["scale"])  # strides, alignment
        assert values["q_ss"] == q.stride(2) and values["o_ss"] == out.stride(2)

        def launch():
            self.launched.append(bool(config.get("pdl")))
            out.copy_(F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=shape.causal,
                                                     scale=inputs["scale"], enable_gqa=shape.kv_heads != shape.heads
                                                     ).to(out.dtype))
        return launch

    def time_pool(self, fns, rounds, reps, launches_per_rep):
        class Result:
            replays = fns

        for fn in fns.values():
            fn()
        self.timed = {"labels": list(fns), "launches_per_rep": launches_per_rep, "reps": reps}
        return {"timings": {n: _timing(1.0) for n in fns}, "on_over_off": {"median": 1.0, "min": 1.0, "max": 1.0},
                "interleaved": {}}, Result()


@pytest.fixture
def cpu_tool(monkeypatch, attention):
    pytest.importorskip("torch")
    stand = StandIns(attention)
    monkeypatch.setattr(pdl_chain, "DEVICE", "cpu")
    monkeypatch.setattr(pdl_chain, "sync", lambda: None)
    monkeypatch.setattr(pdl_chain, "time_pool", stand.time_pool)
    monkeypatch.setattr(attention, "launcher", stand.launcher)
    return stand


def _built(attention, shape):
    from evotune.space.searchspace import Config

    return {pdl: (Config.from_dict({**pdl_chain.MISSION_WINNER, "pdl": pdl}), None, f"digest{int(pdl)}")
            for pdl in (False, True)}


@pytest.mark.parametrize("shape_text", ["1,2,64,64", "2,4,96,64:causal:kv2"])
def test_chain_setting_plumbing(cpu_tool, attention, shape_text):
    """The chain hands our launch strided views of the QKV projection (passing the family's stride and alignment
    checks) and an O the output projection reads without a copy; our last O passes the gate before and after the
    timing, the whole chain agrees with SDPA's, and both pdl settings and the backends are timed."""
    shape = attention.parse_shape(shape_text)
    args = pdl_chain.parse_args(["--layers", "3", "--backends", "math"])
    report = pdl_chain.chain_setting(attention, shape, _built(attention, shape), ["math"], args)
    assert report["unit"] == "per chain of 3" and report["tokens"] == shape.batch * shape.seq_q
    assert report["hidden"] == shape.heads * shape.head_dim
    assert cpu_tool.timed["labels"] == ["pdl off", "pdl on", "sdpa math"] and cpu_tool.timed["launches_per_rep"] is None
    for when in ("gate", "gate_after_timing"):
        assert all(g["passed"] and g["nonfinite"] == 0 for g in report[when].values()), report[when]
    assert all(g["chain_output_max_abs_vs_sdpa"] < 0.05 for g in report["gate"].values())
    assert set(cpu_tool.launched) == {False, True}


@pytest.mark.parametrize("setting, launches_per_rep, reps", [("alone", 1, 100), ("back_to_back", None, 20)])
def test_single_settings_plumbing(cpu_tool, attention, setting, launches_per_rep, reps):
    """`alone` times one launch per replay (five times the replays), `back_to_back` as the search does; our
    outputs pass the gate before and after the timing."""
    shape = attention.parse_shape("1,2,64,64:bshd")
    args = pdl_chain.parse_args(["--backends", "math"])
    report = pdl_chain.single_setting(attention, shape, _built(attention, shape), ["math"], args, launches_per_rep)
    assert (cpu_tool.timed["launches_per_rep"], cpu_tool.timed["reps"]) == (launches_per_rep, reps)
    for when in ("gate", "gate_after_timing"):
        assert all(g["passed"] and math.isfinite(g["max_abs_vs_sdpa"]) for g in report[when].values())
    json.dumps(report)  # the record is JSON


def test_chain_refuses_cross_attention(cpu_tool, attention):
    """A shape with Sq != Sk is no self-attention chain: the setting says so instead of running."""
    shape = attention.parse_shape("1,2,64,128,64")
    args = pdl_chain.parse_args([])
    assert "seq_q must equal seq_k" in pdl_chain.chain_setting(attention, shape, {}, [], args)["skipped"]


@pytest.mark.gpu
def test_smoke_on_the_gpu(tmp_path):
    """The tool end to end on the mission shape with few rounds: every setting times ours off and on and the
    math backend, our output passes the gate throughout, and the JSON and table come out."""
    out = tmp_path / "pdl.json"
    code = pdl_chain.main(["--layers", "2", "--rounds", "2", "--reps", "3", "--backends", "math,cudnn",
                           "--out", str(out)])
    record = json.loads(out.read_text())
    assert code == 0 and set(record["settings"]) == {"alone", "back_to_back", "chain"}
    for s in record["settings"].values():
        assert {"pdl off", "pdl on"} <= set(s["timings"]) and s["timings"]["pdl on"]["method"] == "cuda-graph"
    assert record["device"]["name"] and record["date"] and record["space_admits"] == {"pdl off": True, "pdl on": True}
