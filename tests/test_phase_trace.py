"""Tests for the phase trace (tools/phase_trace.py, the `//[trace]` lines of kernels/attention.cu and device_common.cuh):
on the CPU, that no searched source changes, that the traced mission winner compiles without spills and keeps every
global access after griddepcontrol.wait, and the tool's decoding, checks, summaries and table on synthetic buffers;
on the GPU (marked `gpu`), that the traced kernel's output is bitwise the untraced one's and its stamps are ordered."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from evotune.build.compile import compile_source, static_violations
from evotune.build.template import instantiate, read_template, select_flagged_lines, template_flag_names
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import Config

from _paths import load_tool

phase_trace = load_tool("phase_trace")

# test_pdl.py's configs: the mission winner, and producer warps with split-KV (the other paths the stamps sit on).
MISSION = dict(block_m=32, block_n=128, compute_warps=4, kv_splits=1, producer_warps=0, q_in_regs=True,
               smem_layout="swizzle", stages=4, warp_key_groups=2)
PRODUCERS = dict(block_m=64, block_n=64, compute_warps=4, producer_warps=2, stages=3, smem_layout="pad",
                 q_in_regs=False, kv_splits=2, warp_key_groups=1)
SHAPES = ("mission", "2,16,1024,64:causal", "16,12,1024,64:bf16:causal:bshd", "4,32,4096,128")
_TRACE_LINE = re.compile(r"^[ \t]*//\[trace\].*\n?", re.MULTILINE)


def without_trace_lines(text: str) -> str:
    return _TRACE_LINE.sub("", text)


def test_the_kernels_flag_trace_and_the_tool_sets_it():
    """The templates' flagged lines name trace (beside pdl), and the tool's problem keeps them."""
    _, template = read_template("attention.cu")
    assert "trace" in template_flag_names(template)
    assert phase_trace.TracedAttention().template_flags(Config.from_dict(MISSION)) == {"trace"}
    assert phase_trace.TracedAttention().template_flags(Config.from_dict({**MISSION, "pdl": True})) == {"trace"}


def test_admitted_sources_are_unchanged_by_the_trace_lines(attention, space, tmp_path, monkeypatch):
    """Every attention.yaml-admitted config on four shapes has the source it would have without the //[trace] lines:
    no config's template_flags hold trace, its template part is the same for each flag set the configs have, and
    whole instantiations agree for a spread of them (built from a kernels folder with the lines deleted)."""
    _, template = read_template("attention.cu")
    stripped_dir = tmp_path / "kernels"
    stripped_dir.mkdir()
    from evotune.build.template import kernels_dir

    for path in kernels_dir().rglob("*"):  # the pieces' subfolders (kernels/hopper/) too
        if path.is_file():
            copy = stripped_dir / path.relative_to(kernels_dir())
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(without_trace_lines(path.read_text()))
    flag_sets, sample = set(), []
    for shape_text in SHAPES:
        shape = parse_shape(shape_text)
        configs = space.admitted_configs(attention.context(shape))
        flag_sets |= {attention.template_flags(c) for c in configs}
        sample += [(c, shape) for c in configs[:: max(1, len(configs) // 40)]]
    assert frozenset() in flag_sets
    assert not any("trace" in flags for flags in flag_sets)
    for flags in flag_sets:
        assert select_flagged_lines(template, flags) == select_flagged_lines(without_trace_lines(template), flags)
    ours = [instantiate(attention, c, s).code for c, s in sample]
    monkeypatch.setenv("EVOTUNE_KERNELS", str(stripped_dir))
    assert "//[trace]" not in read_template("attention.cu")[1]
    assert [instantiate(attention, c, s).code for c, s in sample] == ours


def test_trace_layout_is_read_from_the_kernel():
    """The tool reads the record layout from the kernel's trace lines: the events it names, and the word counts."""
    layout = phase_trace.trace_layout()
    assert list(layout.fixed) == ["entry", "start", "q", "sync", "merge", "store", "exit"]
    assert layout.tile_events == ("wait", "ready", "qk", "softmax", "pv")
    assert layout.tile0 == len(layout.fixed) and layout.record_words == layout.header_words + 2 * layout.events
    assert layout.index("t0.wait") == layout.tile0 and layout.index("t2.pv") == layout.tile0 + 2 * 5 + 4
    with pytest.raises(ValueError, match="namespace trace"):
        phase_trace.trace_layout("nothing here")


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "nopdl"])
def test_traced_mission_winner_compiles_without_spills(attention, mission, pdl):
    """The traced mission winner compiles with NVRTC for sm_90a here (no GPU), spill-free and within one SM, and its
    cubin holds the trace buffer under the symbol the tool reads."""
    config = Config.from_dict({**MISSION, "pdl": pdl})
    traced = phase_trace.TracedAttention()
    src = instantiate(traced, config, mission)
    assert src.digest != instantiate(attention, config, mission).digest and "evotune_trace" in src.code
    assert not _TRACE_LINE.search(src.code)
    compiled = compile_source(src.code, src.entry, arch="sm_90a")
    res = compiled.resources
    assert res.spill_stores == res.spill_loads == res.stack_frame == 0
    geo = traced.geometry(config, mission)
    assert not static_violations(res, geo.threads, geo.dynamic_smem)
    assert geo == attention.geometry(config, mission)  # the same launch as the untraced kernel
    with open(compiled.cubin_path, "rb") as f:
        assert phase_trace.TRACE_SYMBOL.encode() in f.read()


def test_traced_producer_split_config_compiles(mission):
    """The stamps on the producer-warp and split-KV paths compile spill-free too."""
    src = instantiate(phase_trace.TracedAttention(), Config.from_dict(PRODUCERS), parse_shape("16,12,1024,64:causal"))
    res = compile_source(src.code, src.entry).resources
    assert res.spill_stores == res.spill_loads == res.stack_frame == 0


def test_traced_pdl_sass_stamps_and_waits_first(mission, cuobjdump):
    """In the traced pdl winner's SASS every global access (the trace's stores included) follows griddepcontrol.wait,
    and only the entry stamp's timer reads precede it."""
    from evotune.build.sass import disassemble

    src = instantiate(phase_trace.TracedAttention(), Config.from_dict({**MISSION, "pdl": True}), mission)
    sass = disassemble(compile_source(src.code, src.entry).cubin_path)
    lines = [(int(a, 16), rest) for a, rest in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    wait = next(a for a, rest in lines if rest.strip().startswith("ACQBULK"))
    stores = [a for a, rest in lines if re.search(r"\b(STG|LDG|LDGSTS|ATOMG|RED)\b", rest)]
    assert stores and min(stores) > wait
    timers = [a for a, rest in lines if "SR_GLOBALTIMER" in rest]
    assert sum(a < wait for a in timers) == 1 and len(timers) > 10


# ---------------------------------------------------------------- the tool's logic on synthetic buffers


def synthetic_words(layout, grid, warps, tiles, t0=1_000_000, ghz=2.0, entry_step=50, skew=10, sm_of=None,
                    key_groups=2):
    """A buffer as the kernel would leave it: CTA c enters at t0 + c * entry_step ns; warp w runs 100 ns per event
    plus w * skew; clock64 = 2 cycles per ns on SM sm_of(c); warps of key group > 0 have no merge and store."""
    n = grid[0] * grid[1] * grid[2]
    words = np.zeros(layout.records * layout.record_words, dtype=np.uint64)
    sm_of = sm_of or (lambda c: c)
    for c in range(n):
        for w in range(warps):
            base = (c * warps + w) * layout.record_words
            words[base] = (1 << 63) | (tiles << 32) | sm_of(c)
            order = phase_trace.program_order(tiles, layout)
            if w % key_groups:
                order = [e for e in order if e not in ("merge", "store")]
            gt = t0 + c * entry_step
            clk = 7_000_000 * (sm_of(c) + 1) + c * entry_step * ghz
            for k, name in enumerate(order):
                dt = 0 if k == 0 else 100 + w * skew
                gt += dt
                clk += dt * ghz
                i = base + layout.header_words + 2 * layout.index(name)
                words[i], words[i + 1] = gt, int(clk)
    return words


def test_decode_reads_every_warp_and_event():
    """decode: block index, SM, tile count and every recorded stamp of every warp; a zero header is no record."""
    layout = phase_trace.trace_layout()
    words = synthetic_words(layout, (2, 3, 1), 4, 3)
    ctas = phase_trace.decode(words, (2, 3, 1), 4, layout)
    assert [c["block"] for c in ctas[:3]] == [[0, 0, 0], [1, 0, 0], [0, 1, 0]] and ctas[5]["sm"] == 5
    w0, w1 = ctas[0]["warps"][0], ctas[0]["warps"][1]
    assert w0["tiles"] == 3 and list(w0["events"]) == phase_trace.program_order(3, layout)
    assert "merge" not in w1["events"] and w1["events"]["exit"][0] > w1["events"]["sync"][0]
    assert phase_trace.order_violations(ctas, layout) == []
    assert phase_trace.tile_events_missing(ctas, 4, layout) == []
    words[(1 * 4 + 2) * layout.record_words] = 0
    again = phase_trace.decode(words, (2, 3, 1), 4, layout)
    assert again[1]["warps"][2] == {"warp": 2, "recorded": False, "why": "no record written"}
    assert any("CTA 1 (1, 0, 0) warp 2: no record written" in v for v in phase_trace.order_violations(again, layout))


def test_order_violations_name_the_swapped_stamps():
    """A stamp earlier than the one before it in program order, or a missing tile stamp, is reported."""
    layout = phase_trace.trace_layout()
    words = synthetic_words(layout, (1, 1, 1), 2, 2)
    qk, sm = layout.header_words + 2 * layout.index("t1.qk"), layout.header_words + 2 * layout.index("t1.softmax")
    words[qk:qk + 2], words[sm:sm + 2] = words[sm:sm + 2].copy(), words[qk:qk + 2].copy()
    ctas = phase_trace.decode(words, (1, 1, 1), 2, layout)
    bad = phase_trace.order_violations(ctas, layout)
    assert len(bad) == 1 and "t1.pv before t1.softmax" not in bad[0] and "warp 0: t1.softmax before t1.qk" in bad[0]
    pv = layout.header_words + 2 * layout.index("t0.pv")
    words[pv:pv + 2] = 0
    assert "no t0.pv stamp" in phase_trace.tile_events_missing(phase_trace.decode(words, (1, 1, 1), 2, layout), 2,
                                                               layout)[0]


def test_phase_rows_grid_view_and_handoff():
    """Per phase, ns since the CTA's entry when its last warp got there (clock64 at the given clock), the step from
    the previous phase; the grid view (first entry to last exit, waves, CTAs per SM) and the handoff."""
    layout = phase_trace.trace_layout()
    grid, warps, tiles = (4, 1, 1), 4, 2
    ctas = phase_trace.decode(synthetic_words(layout, grid, warps, tiles, sm_of=lambda c: c % 3), grid, warps, layout)
    rows = {r["phase"]: r for r in phase_trace.phase_rows(ctas, layout, 2.0)}
    # The slowest warp (3) takes 130 ns per event: start at 130, t0.wait at 260, ...
    assert rows["start"]["since_entry_ns"] == {"median": 130.0, "min": 130.0, "max": 130.0, "n": 4}
    assert rows["t0.wait"]["step_ns_median"] == 130.0 and rows["t1.pv"]["since_entry_ns"]["median"] == 130.0 * 12
    assert rows["merge"]["since_entry_ns"]["median"] == 120.0 * 14  # key group 0's slower warp (2) merges
    assert rows["exit"]["since_entry_globaltimer_ns_median"] == 120 * 16  # warp 2 also stores: 16 steps
    g = phase_trace.grid_view(ctas)
    assert g["first_entry_to_last_exit_ns"] == 3 * 50 + 120 * 16
    assert g["cta_entry_ns"] == {"first": 0, "median": 75.0, "last": 150}
    assert g["sms_used"] == 3 and g["ctas_per_sm"] == {"1": 2, "2": 1}
    assert phase_trace.cycles_per_ns_from_trace(ctas) == 2.0
    assert phase_trace.warp_skew(ctas, layout, 2.0) == {"median": 3 * 10 * 12 / 1.0, "max": 360.0}
    later = phase_trace.decode(synthetic_words(layout, grid, warps, tiles, t0=1_000_000 + 2000), grid, warps, layout)
    h = phase_trace.handoff(g, phase_trace.grid_view(later))
    assert h["first_entry_after_previous_exit_ns"] == 2000 - g["first_entry_to_last_exit_ns"]
    assert h["first_start_after_previous_exit_ns"] == h["first_entry_after_previous_exit_ns"] + 100  # warp 0


def synthetic_record(layout, bitwise=True):
    grid, warps, tiles = (16, 8, 1), 4, 4
    ctas = {name: phase_trace.decode(synthetic_words(layout, grid, warps, tiles, t0=t0), grid, warps, layout)
            for name, t0 in ((phase_trace.ISOLATED, 10**6), (phase_trace.PREVIOUS, 2 * 10**6),
                             (phase_trace.CURRENT, 2 * 10**6 + 10000))}
    checks = {"bitwise_equal": bitwise, "differing_elements": {"isolated": 0 if bitwise else 5, "back to back": 0},
              "gate": {"passed": True, "gate_ratio": 0.16, "gate_ratio_vs_sdpa": 0.21}}
    timing = {"timings": {"untraced": {"median_us": 4.70}, "traced": {"median_us": 4.85}},
              "traced_over_untraced": {"median": 1.032, "min": 1.02, "max": 1.04}}
    meta = {"device": {"name": "NVIDIA H100 80GB HBM3"}, "shape": "1,8,512,64", "config_summary": "block_m=32,pdl=True"}
    clock = {"cycles_per_ns": 2.0, "source": "probe", "globaltimer_step_ns": 32}
    return phase_trace.assemble(ctas, checks, clock, layout, 4, meta, timing)


def test_assembled_record_table_and_failures():
    """The record of a synthetic mission-sized trace: JSON-serialisable, its table ends with the checks and the
    timing, names every phase of both modes and the handoff; failures() names what failed."""
    layout = phase_trace.trace_layout()
    record = synthetic_record(layout)
    json.loads(json.dumps(record))
    assert record["grid_ctas"] == 128 and record["warps_per_cta"] == 4 and record["tiles"] == 4
    assert record["checks"]["order_violations"] == [] and phase_trace.failures(record) == []
    lines = phase_trace.table_lines(record)
    assert lines[0].startswith("phase_trace: NVIDIA H100 80GB HBM3, 1,8,512,64")
    assert "2.000 GHz (probe); globaltimer step 32 ns" in lines[1]
    table = "\n".join(lines)
    for phase in ("start", "t0.wait", "q", "t3.pv", "sync", "merge", "store", "exit"):
        assert re.search(rf"^{re.escape(phase)}\s+\d+", table, re.MULTILINE), phase
    assert "first entry -> last exit" in table and "after the previous grid's last exit: first entry +530" in table
    assert lines[-2].startswith("checks: traced == untraced bitwise: yes") and "stamps in order and complete: yes" in lines[-2]
    assert lines[-1] == ("CUDA-event time per call (interleaved, back to back): untraced 4.70 us, traced 4.85 us "
                         "(traced/untraced 1.032, per round 1.020-1.040)")
    bad = synthetic_record(layout, bitwise=False)
    assert phase_trace.failures(bad)[0].startswith("traced output differs from the untraced one")


def test_compare_prints_records_side_by_side(tmp_path, capsys):
    """--compare reads earlier records (no GPU) and prints their phases side by side, then a line per record."""
    layout = phase_trace.trace_layout()
    paths = []
    for name, bitwise in (("pdl_on", True), ("pdl_off", False)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(synthetic_record(layout, bitwise)))
    assert phase_trace.main(["--compare", *map(str, paths)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["phase", "pdl_on", "iso", "pdl_on", "b2b", "pdl_off", "iso", "pdl_off", "b2b"]
    assert re.match(r"t3\.pv\s+(2860\s+){3}2860$", next(line for line in out if line.startswith("t3.pv")))
    assert out[-2].startswith("pdl_on: first entry -> last exit iso 9470, b2b 9470 ns; b2b after the previous exit: "
                              "first entry 530") and out[-2].endswith("traced 4.85 us; checks ok")
    assert out[-1].endswith("checks FAIL")


def test_arguments(tmp_path, monkeypatch):
    """Defaults: the pdl mission winner; --pdl overrides, --run reads a run's best.json; wgmma and odd chains are
    refused with exit 2."""
    args = phase_trace.parse_args([])
    assert args.config == phase_trace.MISSION_WINNER and args.config["pdl"] is True and args.shape == "mission"
    assert phase_trace.parse_args(["--pdl", "false"]).config == {**phase_trace.MISSION_WINNER, "pdl": False}
    run = tmp_path / "r"
    run.mkdir()
    (run / "best.json").write_text(json.dumps({"config": {"block_m": 64, "pdl": False}}))
    assert phase_trace.parse_args(["--run", str(run), "--pdl", "true"]).config == {"block_m": 64, "pdl": True}
    assert phase_trace.parse_args(["--run", "mission-h100-exhaustive-small-pdl"]).config == phase_trace.MISSION_WINNER
    monkeypatch.setenv("OUT", str(tmp_path))
    assert phase_trace.parse_args([]).out == str(tmp_path / "phase_trace.json")
    for argv in (["--config", '{"mma": "wgmma"}'], ["--chain", "3"], ["--run", "no-such-run"],
                 ["--config", "[1]"]):
        with pytest.raises(SystemExit) as info:
            phase_trace.parse_args(argv)
        assert info.value.code == 2


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "nopdl"])
def test_traced_output_is_bitwise_and_stamps_are_ordered(mission, pdl):
    """On the GPU: the traced mission winner's output (isolated and back to back) equals the untraced kernel's
    bitwise, the untraced one passes the gate, and every warp of every traced launch stamped its events in order."""
    layout = phase_trace.trace_layout()
    built = phase_trace.build(mission, {**MISSION, "pdl": pdl})
    run = phase_trace.trace_launches(built, mission, seed=7, chain=4, layout=layout)
    checks = run["checks"]
    assert checks["bitwise_equal"], checks["differing_elements"]
    assert checks["gate"]["passed"], checks["gate"]
    for name, ctas in run["ctas"].items():
        assert len(ctas) == 128 and all(len(c["warps"]) == 4 for c in ctas), name
        assert phase_trace.order_violations(ctas, layout) == [], name
        assert phase_trace.tile_events_missing(ctas, 4, layout) == [], name
        assert all(w["tiles"] == 4 for c in ctas for w in c["warps"])
    prev, cur = (phase_trace.grid_view(run["ctas"][n]) for n in (phase_trace.PREVIOUS, phase_trace.CURRENT))
    assert cur["first_entry_globaltimer"] > prev["first_entry_globaltimer"]
    # Every CTA starts its work (after the pdl wait, or with no pdl, enters) once the previous grid has exited
    # (a little slack for any skew between the SMs' copies of globaltimer).
    assert prev["last_exit_globaltimer"] <= cur["first_entry_globaltimer"] + cur["cta_start_ns"]["first"] + 64
