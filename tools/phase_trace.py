"""Per-phase trace of one mma.sync attention config (GPU): when each CTA of the grid enters, waits, loads, multiplies,
normalises, merges, stores and exits, from %globaltimer and %clock64 stamps taken inside the kernel.

    python tools/phase_trace.py                                     # the mission winner (pdl) on the mission shape
    python tools/phase_trace.py --pdl false                         # the same config without pdl
    python tools/phase_trace.py --run mission-h100-pdl --out /tmp/trace.json
    python tools/phase_trace.py --config '{"block_m": 64, "block_n": 64, "stages": 3}' --shape 2,8,1024,64

The stamps are the `//[trace]` lines of kernels/attention.cu and device_common.cuh (docs/TRACE.md): a source keeps
them only where its problem's template_flags hold "trace", which only TracedAttention here does, so every searched
source stays byte for byte what it was. Lane 0 of every warp writes its record (the layout is read from the
kernel's own text, trace_layout) into the `__device__` buffer evotune_trace, which the host zeroes before a launch and
reads back afterwards; the launch itself is the family's (AttentionProblem.launcher: same arguments, same grid, the
pdl attribute where the config has pdl).

What the tool runs, after warm-up, on fresh random inputs (the family's make_inputs):
  isolated      one traced launch after a synchronize: nothing runs before it
  back to back  --chain traced launches in a row, alternating two loads of the cubin (two modules, two buffers), so
                that the last two launches' traces survive: the grid before ("previous") and the last ("current");
                with pdl the current grid's CTAs may enter while the previous one still runs
Each traced output (O filled with NaN first) must equal the untraced kernel's bitwise; the untraced output must pass
the family's gate against the fp32 reference and SDPA's output. Every warp's stamps must be in program order. Then
the untraced and the traced kernel are timed interleaved (evotune.gpu.interleave, CUDA-graph replays of back-to-back
launches, as the search times), so the trace's own cost is measured in the same process, and a small probe kernel
measures the SM clock (clock64 cycles per globaltimer ns) and globaltimer's step.

Within a CTA (one SM) times come from clock64, converted to ns at the probe's clock; across CTAs (the grid view:
first entry to last exit, the launch wave, CTAs per SM) from globaltimer. The JSON (--out) holds every warp's stamps,
the summaries, the checks, the timings and the device; the short table comes last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from evotune.problems.attention import AttentionProblem, is_split_merge, is_tma_load, is_wgmma, knob  # noqa: E402

# The mission winner with pdl: runs/mission-h100-exhaustive-small-pdl/best.json (4.77 us per call back to back).
MISSION_WINNER = {"block_m": 32, "block_n": 128, "compute_warps": 4, "producer_warps": 0, "stages": 4,
                  "smem_layout": "swizzle", "q_in_regs": True, "kv_splits": 1, "warp_key_groups": 2, "pdl": True}
TRACE_FLAG = "trace"
SPLIT_TRACE_FLAG = "trace_split"
TMA_LOAD_TRACE_FLAG = "trace_tma"
# evotune::evotune_trace, the buffer's symbol in the cubin (a namespace-scope variable: its mangled name).
TRACE_SYMBOL = "_ZN7evotune13evotune_traceE"
ISOLATED, BACK_TO_BACK = "isolated", "back to back"
PREVIOUS, CURRENT = "previous", "current"
UNTRACED, TRACED = "untraced", "traced"
PROBE_SPIN_NS = 2_000_000  # the clock probe's busy wait: 2 ms per SM


class TracedAttention(AttentionProblem):
    """The attention family with the kernels' `//[trace]` lines kept: the same entry point, arguments, launch
    geometry and launch (pdl included); only the source differs, and only by those lines."""

    def template_flags(self, config) -> frozenset[str]:
        # The split merge's stamps (key_merge = split, the traits' kSplitMerge) are `//[trace_split]` lines inside its
        # `if constexpr` branch, the TMA loads' wait stamp (kv_load = tma, kTmaLoad) a `//[trace_tma]` line in its own.
        flags = super().template_flags(config)
        return (flags | {TRACE_FLAG} | ({SPLIT_TRACE_FLAG} if is_split_merge(config) else set())
                | ({TMA_LOAD_TRACE_FLAG} if is_tma_load(config) else set()))

    def instantiation(self, config, shape, write_lse: bool = False) -> str:
        return "// phase trace variant (tools/phase_trace.py): evotune_trace holds per-warp stamps\n" + \
            super().instantiation(config, shape, write_lse)


# --------------------------------------------------------------------------- the record layout (CPU)


class TraceLayout(NamedTuple):
    """Where a warp's stamps lie in evotune_trace (64-bit words), as kernels/device_common.cuh declares it. (A
    NamedTuple: the tests load this script as a module outside sys.modules, where dataclasses cannot resolve it.)"""

    fixed: dict            # event name -> index: entry, start, q, sync, merge, store, exit
    tile0: int             # index of tile 0's first event
    tile_events: tuple     # per K/V tile, in order: wait, ready, qk, softmax, pv
    max_tiles: int         # tiles of a warp's loop that get stamps
    header_words: int
    record_words: int
    records: int           # warp records the buffer holds

    @property
    def events(self) -> int:
        return self.tile0 + len(self.tile_events) * self.max_tiles

    def index(self, name: str) -> int:
        """The event index of `name` (a fixed event, or "t<i>.<tile event>")."""
        if name in self.fixed:
            return self.fixed[name]
        tile, event = name[1:].split(".")
        return self.tile0 + len(self.tile_events) * int(tile) + self.tile_events.index(event)


def _enum(text: str, name: str) -> dict:
    m = re.search(r"enum\s+" + name + r"\s*:\s*int\s*\{([^}]*)\}", text)
    if not m:
        raise ValueError(f"kernel trace layout: enum {name} not found")
    return {k.strip(): int(v) for k, v in (item.split("=") for item in m.group(1).split(",") if item.strip())}


def _snake(enumerator: str) -> str:
    return enumerator[1:].lower()  # kEntry -> entry, kQK -> qk, kPV -> pv


def trace_layout(text: str | None = None) -> TraceLayout:
    """The layout the kernel's `//[trace]` lines declare (namespace trace in kernels/device_common.cuh), read from
    `text` (default: the attention template with its headers inlined), so the tool and the kernel cannot drift."""
    from evotune.build.template import read_template, select_flagged_lines

    if text is None:
        _, text = read_template("attention.cu")
    block = re.search(r"namespace trace \{(.*?)\}  // namespace trace", select_flagged_lines(text, {TRACE_FLAG}), re.S)
    if not block:
        raise ValueError("kernel trace layout: no `namespace trace { ... }  // namespace trace` in the trace lines")
    text = block.group(1)
    events = _enum(text, "Event")
    tile = _enum(text, "TileEvent")
    consts: dict[str, int] = dict(events)
    for m in re.finditer(r"constexpr\s+int\s+([^;]+);", text):
        for item in m.group(1).split(","):
            key, expr = (s.strip() for s in item.split("="))
            if not re.fullmatch(r"[\w\s+*()-]+", expr):
                raise ValueError(f"kernel trace layout: cannot read {key} = {expr}")
            consts[key] = int(eval(expr, {"__builtins__": {}}, dict(consts)))  # our own constant expressions
    tile_names = tuple(_snake(k) for k, _ in sorted(tile.items(), key=lambda kv: kv[1]))
    if [tile[k] for k in sorted(tile, key=tile.get)] != list(range(len(tile))) or consts["kTileEvents"] != len(tile):
        raise ValueError("kernel trace layout: tile events must be numbered 0..kTileEvents-1")
    layout = TraceLayout(fixed={_snake(k): v for k, v in events.items() if k != "kTile0"}, tile0=events["kTile0"],
                         tile_events=tile_names, max_tiles=consts["kMaxTiles"],
                         header_words=consts["kHeaderWords"], record_words=consts["kRecordWords"],
                         records=consts["kRecords"])
    if layout.events != consts["kEvents"] or layout.record_words != layout.header_words + 2 * layout.events:
        raise ValueError("kernel trace layout: kEvents or kRecordWords disagree with the events")
    return layout


def program_order(tiles: int, layout: TraceLayout) -> list[str]:
    """A warp's events in the order its code passes them, for a warp whose loop ran `tiles` K/V tiles."""
    names = ["entry", "start"]
    for i in range(min(tiles, layout.max_tiles)):
        names += [f"t{i}.wait", f"t{i}.ready"] + (["q"] if i == 0 else []) + \
                 [f"t{i}.{e}" for e in layout.tile_events[2:]]
    return names + ["sync", "merge", "store", "exit"]


def decode(words, grid: tuple, warps_per_cta: int, layout: TraceLayout) -> list[dict]:
    """The CTAs of one launch from the buffer's words (uint64): per CTA its block index, linear index and SM, and
    per warp its tile count and recorded events {name: [globaltimer ns, clock64 cycles]} (0 = not reached)."""
    import numpy as np

    words = np.asarray(words, dtype=np.uint64)
    gx, gy, gz = grid
    ctas = []
    for linear in range(gx * gy * gz):
        block = (linear % gx, linear // gx % gy, linear // (gx * gy))
        warps = []
        for w in range(warps_per_cta):
            index = linear * warps_per_cta + w
            if index >= layout.records:
                warps.append({"warp": w, "recorded": False, "why": "past the buffer's records"})
                continue
            rec = words[index * layout.record_words:(index + 1) * layout.record_words]
            head = int(rec[0])
            if not head >> 63:
                warps.append({"warp": w, "recorded": False, "why": "no record written"})
                continue
            tiles = (head >> 32) & 0x7FFFFFFF
            stamps = rec[layout.header_words:].reshape(layout.events, 2)
            events = {}
            for name in program_order(tiles, layout):
                gt, clk = (int(x) for x in stamps[layout.index(name)])
                if gt or clk:
                    events[name] = [gt, clk]
            warps.append({"warp": w, "recorded": True, "sm": head & 0xFFFFFFFF, "tiles": tiles, "events": events})
        sms = {w["sm"] for w in warps if w["recorded"]}
        ctas.append({"cta": linear, "block": list(block), "sm": min(sms) if sms else None,
                     "sms": sorted(sms), "warps": warps})
    return ctas


def recorded_warps(cta: dict) -> list[dict]:
    return [w for w in cta["warps"] if w["recorded"]]


def order_violations(ctas: list[dict], layout: TraceLayout) -> list[str]:
    """Stamps out of program order (globaltimer or clock64 going back within a warp), a CTA whose warps report
    different SMs, and warps without a record or without entry, start and exit."""
    bad = []
    for cta in ctas:
        where = f"CTA {cta['cta']} {tuple(cta['block'])}"
        if len(cta["sms"]) > 1:
            bad.append(f"{where}: warps on SMs {cta['sms']}")
        for w in cta["warps"]:
            if not w["recorded"]:
                bad.append(f"{where} warp {w['warp']}: {w['why']}")
                continue
            missing = [n for n in ("entry", "start", "exit") if n not in w["events"]]
            if missing:
                bad.append(f"{where} warp {w['warp']}: no {', '.join(missing)} stamp")
            seen = [(n, w["events"][n]) for n in program_order(w["tiles"], layout) if n in w["events"]]
            for (a, (ga, ca)), (b, (gb, cb)) in zip(seen, seen[1:]):
                if gb < ga or cb < ca:
                    bad.append(f"{where} warp {w['warp']}: {b} before {a} (globaltimer {gb - ga:+d} ns, "
                               f"clock64 {cb - ca:+d} cycles)")
    return bad


def tile_events_missing(ctas: list[dict], compute_warps: int, layout: TraceLayout) -> list[str]:
    """Compute warps (the first `compute_warps` of a CTA; producer warps stamp entry, start and exit only) that lack
    a stamp their loop must have passed: q and every event of every traced tile."""
    bad = []
    for cta in ctas:
        for w in cta["warps"][:compute_warps]:
            if not w["recorded"]:
                continue  # order_violations names it
            lost = [n for n in program_order(w["tiles"], layout)[2:-4] if n not in w["events"]]
            if lost:
                more = " ..." if len(lost) > 4 else ""
                bad.append(f"CTA {cta['cta']} warp {w['warp']}: no {', '.join(lost[:4])}{more} stamp")
    return bad


# --------------------------------------------------------------------------- summaries (CPU)


def cta_phases(cta: dict, layout: TraceLayout) -> dict:
    """name -> (clock64 cycles, globaltimer ns) since the CTA's entry (its first warp's), when its last warp that
    passes the event passed it; in program order."""
    warps = recorded_warps(cta)
    if not warps or any("entry" not in w["events"] for w in warps):
        return {}
    entry_gt = min(w["events"]["entry"][0] for w in warps)
    entry_clk = min(w["events"]["entry"][1] for w in warps)
    tiles = max(w["tiles"] for w in warps)
    phases = {}
    for name in program_order(tiles, layout):
        stamps = [w["events"][name] for w in warps if name in w["events"]]
        if stamps:
            phases[name] = (max(c for _, c in stamps) - entry_clk, max(g for g, _ in stamps) - entry_gt)
    return phases


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def phase_rows(ctas: list[dict], layout: TraceLayout, cycles_per_ns: float) -> list[dict]:
    """Per phase (program order), over the CTAs that reach it: ns since the CTA's entry from clock64 at
    `cycles_per_ns` (median, min, max), the step from the CTA's previous phase (median), and the same from
    globaltimer (median)."""
    per_cta = [cta_phases(c, layout) for c in ctas]
    tiles = max((w["tiles"] for c in ctas for w in recorded_warps(c)), default=0)
    rows = []
    for name in program_order(tiles, layout):
        since, steps, since_gt = [], [], []
        for phases in per_cta:
            if name not in phases:
                continue
            names = list(phases)
            clk, gt = phases[name]
            since.append(clk / cycles_per_ns)
            since_gt.append(gt)
            i = names.index(name)
            if i:
                steps.append((clk - phases[names[i - 1]][0]) / cycles_per_ns)
        if since:
            rows.append({"phase": name, "since_entry_ns": _stats(since),
                         "step_ns_median": statistics.median(steps) if steps else 0.0,
                         "since_entry_globaltimer_ns_median": statistics.median(since_gt)})
    return rows


def grid_view(ctas: list[dict]) -> dict:
    """The whole grid in globaltimer ns: first CTA entry to last exit, the spread of CTA entries (the launch wave),
    of starts (after the prologue and the pdl wait) and of exits, and how many CTAs each SM ran."""
    firsts = {}
    for key in ("entry", "start", "exit"):
        pick = max if key == "exit" else min
        firsts[key] = [pick(w["events"][key][0] for w in recorded_warps(c) if key in w["events"])
                       for c in ctas if any(key in w["events"] for w in recorded_warps(c))]
    if not firsts["entry"] or not firsts["exit"]:
        return {}
    t0 = min(firsts["entry"])
    spread = {key: {"first": min(v) - t0, "median": statistics.median(v) - t0, "last": max(v) - t0}
              for key, v in firsts.items() if v}
    per_sm = Counter(c["sm"] for c in ctas if c["sm"] is not None)
    return {"first_entry_globaltimer": t0, "last_exit_globaltimer": max(firsts["exit"]),
            "first_entry_to_last_exit_ns": max(firsts["exit"]) - t0,
            "cta_entry_ns": spread["entry"], "cta_start_ns": spread.get("start"), "cta_exit_ns": spread["exit"],
            "sms_used": len(per_sm), "ctas_per_sm": {str(k): v for k, v in sorted(Counter(per_sm.values()).items())}}


def handoff(previous: dict, current: dict) -> dict:
    """Two grids back to back (grid views): the current one's first entry, first start and last exit after the
    previous one's last exit, in ns (negative: before it, as a pdl launch's CTAs may enter)."""
    if not previous or not current:
        return {}
    end = previous["last_exit_globaltimer"]
    first = current["first_entry_globaltimer"]
    return {"first_entry_after_previous_exit_ns": first - end,
            "first_start_after_previous_exit_ns": first + current["cta_start_ns"]["first"] - end,
            "last_start_after_previous_exit_ns": first + current["cta_start_ns"]["last"] - end,
            "last_exit_after_previous_exit_ns": current["last_exit_globaltimer"] - end,
            "previous_first_entry_to_current_last_exit_ns": current["last_exit_globaltimer"]
            - previous["first_entry_globaltimer"]}


def warp_skew(ctas: list[dict], layout: TraceLayout, cycles_per_ns: float) -> dict:
    """Per CTA, the spread between its warps' arrival at the last tile's pv (the key groups' and row groups'
    imbalance), ns from clock64: median and max over CTAs."""
    skews = []
    for c in ctas:
        warps = recorded_warps(c)
        tiles = min((w["tiles"] for w in warps), default=0)
        name = f"t{min(tiles, layout.max_tiles) - 1}.pv"
        clks = [w["events"][name][1] for w in warps if name in w["events"]]
        if len(clks) > 1:
            skews.append((max(clks) - min(clks)) / cycles_per_ns)
    return {"median": statistics.median(skews), "max": max(skews)} if skews else {}


def summarize(ctas: list[dict], layout: TraceLayout, cycles_per_ns: float) -> dict:
    return {"phases": phase_rows(ctas, layout, cycles_per_ns), "grid": grid_view(ctas),
            "warp_skew_last_pv_ns": warp_skew(ctas, layout, cycles_per_ns),
            "order_violations": order_violations(ctas, layout)}


def cycles_per_ns_from_trace(ctas: list[dict]) -> float | None:
    """clock64 cycles per globaltimer ns over each warp's entry-to-exit span (median): the SM clock in GHz, as
    good as globaltimer's step over a few microseconds allows (the probe's is better)."""
    rates = []
    for c in ctas:
        for w in recorded_warps(c):
            e, x = w["events"].get("entry"), w["events"].get("exit")
            if e and x and x[0] > e[0]:
                rates.append((x[1] - e[1]) / (x[0] - e[0]))
    return statistics.median(rates) if rates else None


# --------------------------------------------------------------------------- the table (CPU)


def _ns(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def table_lines(record: dict) -> list[str]:
    """The short table: per phase, ns since the CTA's entry (median, min, max over CTAs) and the median step, in
    each mode; the grid views; the checks; the CUDA-event times with and without the trace."""
    modes = record["modes"]
    mode_rows = {ISOLATED: modes[ISOLATED]["summary"]["phases"],
                 BACK_TO_BACK: modes[BACK_TO_BACK][CURRENT]["summary"]["phases"]}
    names = list(dict.fromkeys(r["phase"] for rows in mode_rows.values() for r in rows))
    by = {m: {r["phase"]: r for r in rows} for m, rows in mode_rows.items()}
    head = ["phase"] + [f"{m}: {c}" if c == "median" else c for m in mode_rows for c in ("median", "min", "max", "step")]
    rows = [head]
    for name in names:
        row = [name]
        for m in mode_rows:
            r = by[m].get(name)
            s = r["since_entry_ns"] if r else None
            row += [_ns(s and s["median"]), _ns(s and s["min"]), _ns(s and s["max"]),
                    _ns(r and r["step_ns_median"])]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    clock = record["clock"]
    lines = [f"phase_trace: {record['device'].get('name', '?')}, {record['shape']}, {record['config_summary']}",
             f"  {record['grid_ctas']} CTAs x {record['warps_per_cta']} warps, up to {record['tiles']} K/V tiles per "
             f"CTA; SM clock {clock['cycles_per_ns']:.3f} GHz ({clock['source']}); globaltimer step "
             f"{_ns(clock.get('globaltimer_step_ns'))} ns",
             "  ns since the CTA's entry when its last warp passed the phase (clock64 / SM clock), over the CTAs; "
             "step = median from the previous phase"]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.append("grid (globaltimer ns):")
    for m in (ISOLATED, BACK_TO_BACK):
        g = modes[m]["summary"]["grid"] if m == ISOLATED else modes[m][CURRENT]["summary"]["grid"]
        if not g:
            lines.append(f"  {m}: no grid view (stamps missing)")
            continue
        skew = (modes[m]["summary"] if m == ISOLATED else modes[m][CURRENT]["summary"])["warp_skew_last_pv_ns"]
        lines.append(f"  {m}: first entry -> last exit {g['first_entry_to_last_exit_ns']} ns; CTA entries "
                     f"0..{g['cta_entry_ns']['last']} (median {g['cta_entry_ns']['median']:.0f}), starts "
                     f"{g['cta_start_ns']['first']}..{g['cta_start_ns']['last']}, exits "
                     f"{g['cta_exit_ns']['first']}..{g['cta_exit_ns']['last']}; {g['sms_used']} SMs, CTAs per SM "
                     f"{', '.join(f'{k}: {v}' for k, v in g['ctas_per_sm'].items())}"
                     + (f"; warp skew at the last pv median {skew['median']:.0f}, max {skew['max']:.0f}" if skew else ""))
    h = modes[BACK_TO_BACK].get("handoff")
    if h:
        lines.append(f"  back to back, after the previous grid's last exit: first entry "
                     f"{h['first_entry_after_previous_exit_ns']:+d}, first start {h['first_start_after_previous_exit_ns']:+d}, "
                     f"last start {h['last_start_after_previous_exit_ns']:+d}, last exit "
                     f"{h['last_exit_after_previous_exit_ns']:+d} ns")
    checks = record["checks"]
    bad = len(checks["order_violations"])
    lines.append(f"checks: traced == untraced bitwise: {'yes' if checks['bitwise_equal'] else 'NO'}; gate vs fp32 "
                 f"reference {checks['gate']['gate_ratio']:.2f}, vs SDPA {checks['gate']['gate_ratio_vs_sdpa']:.2f} "
                 f"({'ok' if checks['gate']['passed'] else 'FAIL'}); stamps in order and complete: "
                 + ("yes" if not bad else f"NO ({bad})"))
    t = record.get("timing")
    if t:
        r = t["traced_over_untraced"]
        lines.append(f"CUDA-event time per call (interleaved, back to back): untraced {t['timings'][UNTRACED]['median_us']:.2f} us, "
                     f"traced {t['timings'][TRACED]['median_us']:.2f} us (traced/untraced {r['median']:.3f}, "
                     f"per round {r['min']:.3f}-{r['max']:.3f})")
    return lines


def compare_lines(records: dict) -> list[str]:
    """Several records side by side (label -> record, e.g. pdl on and off): per phase the median ns since the CTA's
    entry, isolated and back to back; per record the grid's span, the back-to-back handoff and the two timings."""
    labels = list(records)
    cols = {(label, m): {r["phase"]: r for r in (rec["modes"][ISOLATED]["summary"]["phases"] if m == ISOLATED
                                                 else rec["modes"][BACK_TO_BACK][CURRENT]["summary"]["phases"])}
            for label, rec in records.items() for m in (ISOLATED, BACK_TO_BACK)}
    names = list(dict.fromkeys(n for c in cols.values() for n in c))
    head = ["phase"] + [f"{label} {'iso' if m == ISOLATED else 'b2b'}" for label, m in cols]
    rows = [head] + [[n] + [_ns(c[n]["since_entry_ns"]["median"]) if n in c else "-" for c in cols.values()]
                     for n in names]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["phase_trace compared: median ns since the CTA's entry (clock64), isolated (iso) and back to back (b2b)"]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    for label in labels:
        rec = records[label]
        spans = [rec["modes"][ISOLATED]["summary"]["grid"], rec["modes"][BACK_TO_BACK][CURRENT]["summary"]["grid"]]
        h = rec["modes"][BACK_TO_BACK].get("handoff") or {}
        t = rec.get("timing") or {}
        us = {k: v["median_us"] for k, v in t.get("timings", {}).items()}
        lines.append(f"{label}: first entry -> last exit iso {_ns(spans[0].get('first_entry_to_last_exit_ns'))}, "
                     f"b2b {_ns(spans[1].get('first_entry_to_last_exit_ns'))} ns; b2b after the previous exit: "
                     f"first entry {_ns(h.get('first_entry_after_previous_exit_ns'))}, first start "
                     f"{_ns(h.get('first_start_after_previous_exit_ns'))}, last exit "
                     f"{_ns(h.get('last_exit_after_previous_exit_ns'))} ns; per call untraced "
                     f"{us.get(UNTRACED, float('nan')):.2f} us, traced {us.get(TRACED, float('nan')):.2f} us; "
                     f"checks {'FAIL' if failures(rec) else 'ok'}")
    return lines


# --------------------------------------------------------------------------- arguments


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; argparse's exit 2 with one line for anything malformed."""
    p = argparse.ArgumentParser(description="Trace the phases of an mma.sync attention config per CTA (GPU).")
    p.add_argument("--shape", default="mission", help="the shape (a preset or B,H,S,D[:flags]); default mission")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", default=None, help="the config as JSON (knobs over the template's defaults)")
    src.add_argument("--run", default=None, help="take the config of this run's best.json (a run name under "
                                                 "$EVOTUNE_RUNS or ./runs or the repo's runs/, or a folder)")
    p.add_argument("--pdl", choices=("true", "false"), default=None, help="set the config's pdl knob")
    p.add_argument("--chain", type=int, default=20, help="traced launches back to back (even, at least 2)")
    p.add_argument("--rounds", type=int, default=10, help="interleaved timing rounds (whole cycles)")
    p.add_argument("--reps", type=int, default=20, help="timed replays per contender and round")
    p.add_argument("--seed", type=int, default=2026, help="the inputs' seed")
    p.add_argument("--out", default=None, help="the JSON record (default $OUT/phase_trace.json, or ./phase_trace.json)")
    p.add_argument("--compare", nargs="+", metavar="JSON", default=None,
                   help="print records of earlier runs side by side (label = file name) and exit; no GPU")
    args = p.parse_args(argv)
    if args.compare:
        return args
    if args.chain < 2 or args.chain % 2:
        p.error("--chain must be even and at least 2 (two modules alternate)")
    if args.rounds < 1 or args.reps < 1:
        p.error("--rounds and --reps must be at least 1")
    if args.run is not None:
        args.config = run_config(p, args.run)
    else:
        try:
            args.config = dict(MISSION_WINNER) if args.config is None else json.loads(args.config)
        except ValueError as e:
            p.error(f"--config: not JSON ({e})")
    if not isinstance(args.config, dict):
        p.error("--config: a JSON object of knobs")
    if is_wgmma(args.config):
        p.error("the trace covers the mma.sync kernel (kernels/attention.cu) only, not mma=wgmma")
    if args.pdl is not None:
        args.config = {**args.config, "pdl": args.pdl == "true"}
    args.out = args.out or os.path.join(os.environ.get("OUT", "."), "phase_trace.json")
    return args


def run_config(parser, run: str) -> dict:
    """The config of a run's best.json: `run` as a folder, else a run name under runs_dir(), else under the
    repository's runs/."""
    from evotune.records.runs import runs_dir

    for folder in (Path(run), runs_dir() / run, REPO / "runs" / run):
        best = folder / "best.json"
        if best.is_file():
            try:
                return dict(json.loads(best.read_text())["config"])
            except (ValueError, KeyError, TypeError) as e:
                parser.error(f"--run: {best}: no config ({e})")
    parser.error(f"--run: no best.json for {run!r} (tried {run}, {runs_dir() / run}, {REPO / 'runs' / run})")


def config_summary(config: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(config.items()))


# --------------------------------------------------------------------------- GPU


def sync() -> None:
    import torch

    torch.cuda.synchronize()


def build(shape, knobs: dict) -> dict:
    """The config compiled untraced (the family's source) and traced (TracedAttention's): per label its config,
    source digest, Compiled and static violations."""
    from evotune.build.compile import compile_source, launch_violations
    from evotune.build.template import instantiate
    from evotune.problems import get_problem
    from evotune.space.searchspace import Config

    config = Config.from_dict(knobs)
    built = {}
    for label, problem in ((UNTRACED, get_problem("attention")), (TRACED, TracedAttention())):
        src = instantiate(problem, config, shape)
        compiled = compile_source(src.code, src.entry)
        geo = problem.geometry(config, shape)
        built[label] = {"problem": problem, "config": config, "digest": src.digest, "compiled": compiled,
                        "violations": launch_violations(compiled.resources, geo),
                        "smem": geo.dynamic_smem}
    return built


class TraceBuffer:
    """The evotune_trace buffer of one loaded module (the module CuPy's Function keeps): zeroed and read whole
    records at a time, synchronously."""

    def __init__(self, kernel, layout: TraceLayout, records: int):
        try:  # cuModuleGetGlobal: the device address (the symbol is local to the cubin, as NVRTC emits it)
            got = kernel.kernel.module.get_global_var(TRACE_SYMBOL)
        except Exception as e:
            raise RuntimeError(f"phase_trace: the traced module has no {TRACE_SYMBOL} (evotune::evotune_trace): {e}")
        self.ptr = int(got[0] if isinstance(got, tuple) else got)
        self.nbytes = 8 * layout.record_words * min(records, layout.records)

    def zero(self) -> None:
        import cupy

        sync()
        cupy.cuda.runtime.memset(self.ptr, 0, self.nbytes)
        cupy.cuda.runtime.deviceSynchronize()

    def read(self):
        import cupy
        import numpy as np

        sync()
        host = np.empty(self.nbytes // 8, dtype=np.uint64)
        cupy.cuda.runtime.memcpy(host.ctypes.data, self.ptr, self.nbytes, cupy.cuda.runtime.memcpyDeviceToHost)
        return host


CLOCK_PROBE = r"""
extern "C" __global__ void evotune_clock_probe(unsigned long long* out, long long spin_ns) {
    unsigned long long g0, c0, g, c1, prev, step = ~0ull;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(c0));
    prev = g0;
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
        if (g != prev) { step = min(step, g - prev); prev = g; }
    } while ((long long)(g - g0) < spin_ns);
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(c1));
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    if (threadIdx.x == 0) {
        unsigned long long* o = out + 5 * blockIdx.x;
        o[0] = g0; o[1] = c0; o[2] = g; o[3] = c1; o[4] = step | (unsigned long long)sm << 48;
    }
}
"""


def clock_probe(blocks: int) -> dict:
    """The SM clock (clock64 cycles per globaltimer ns, median over `blocks` one-warp CTAs busy for
    PROBE_SPIN_NS) and globaltimer's smallest step seen while spinning on it."""
    import numpy as np
    import torch

    from evotune.build.compile import compile_source, load_kernel, cupy_stream

    kernel = load_kernel(compile_source(CLOCK_PROBE, "evotune_clock_probe"))
    out = torch.zeros(5 * blocks, dtype=torch.int64, device="cuda")
    stream = torch.cuda.current_stream()
    kernel((blocks, 1, 1), (32, 1, 1), (np.uint64(out.data_ptr()), np.int64(PROBE_SPIN_NS)),
           stream=cupy_stream(stream.cuda_stream, stream.device_index))
    sync()
    rows = out.view(blocks, 5).cpu().numpy().astype(np.uint64)
    rates = [(int(c1) - int(c0)) / (int(g1) - int(g0)) for g0, c0, g1, c1, _ in rows]
    steps = [int(s) & ((1 << 48) - 1) for *_, s in rows]
    return {"cycles_per_ns": statistics.median(rates), "min": min(rates), "max": max(rates),
            "globaltimer_step_ns": min(steps), "source": "probe", "blocks": blocks, "spin_ns": PROBE_SPIN_NS}


def gate(problem, shape, out, inputs) -> dict:
    """The output against the fp32 reference (the family's gate) and against SDPA's output, the same tolerance."""
    from evotune.gpu.evaluate import output_errors

    import torch.nn.functional as F

    ref = problem.reference(shape, inputs)
    gqa = {"enable_gqa": True} if shape.kv_heads != shape.heads else {}
    sdpa_out = F.scaled_dot_product_attention(inputs["q"], inputs["k"], inputs["v"], is_causal=shape.causal,
                                              scale=inputs["scale"], **gqa).float()  # torch's own dispatch
    atol, rtol = problem.tolerance(shape)
    atol *= problem.error_scale(inputs)
    max_abs, _, nonfinite, ratio = output_errors(out, ref, atol, rtol)
    sdpa_abs, _, _, sdpa_ratio = output_errors(out, sdpa_out, atol, rtol)
    return {"passed": nonfinite == 0 and ratio <= 1.0 and sdpa_ratio <= 1.0, "gate_ratio": ratio,
            "max_abs_vs_reference": max_abs, "gate_ratio_vs_sdpa": sdpa_ratio, "max_abs_vs_sdpa": sdpa_abs,
            "nonfinite": nonfinite, "atol": atol, "rtol": rtol}


def trace_launches(built: dict, shape, seed: int, chain: int, layout: TraceLayout) -> dict:
    """The isolated and back-to-back traces and the checks of their outputs (bitwise against the untraced kernel,
    which passes the gate), with the launchers for the timing. Used by main and the GPU test."""
    import shutil
    import tempfile
    from dataclasses import replace

    from evotune.build.compile import load_kernel
    from evotune.gpu.evaluate import differing_elements

    problem, config = built[UNTRACED]["problem"], built[UNTRACED]["config"]
    plan = problem.launch_plan(config, shape)
    warps_per_cta = plan.block[0] // 32
    ctas = plan.grid[0] * plan.grid[1] * plan.grid[2]
    smem = built[TRACED]["smem"]
    plain = load_kernel(built[UNTRACED]["compiled"], smem)
    # Two loads of the traced cubin, the second from a copy at another path (whatever a loader might cache by path):
    # two modules, each with its own evotune_trace.
    compiled = built[TRACED]["compiled"]
    copy = Path(tempfile.mkdtemp(prefix="phase_trace_")) / "traced-second-module.cubin"
    shutil.copyfile(compiled.cubin_path, copy)
    traced = [load_kernel(compiled, smem), load_kernel(replace(compiled, cubin_path=str(copy)), smem)]
    buffers = [TraceBuffer(k, layout, ctas * warps_per_cta) for k in traced]
    if buffers[0].ptr == buffers[1].ptr:
        raise RuntimeError("phase_trace: the two loads of the traced cubin share one evotune_trace")
    inputs = problem.make_inputs(shape, seed)
    outs = {label: problem.new_output(inputs) for label in (UNTRACED, TRACED)}
    run_plain = problem.launcher(plain, config, shape, inputs, outs[UNTRACED])
    runs = [built[TRACED]["problem"].launcher(k, config, shape, inputs, outs[TRACED]) for k in traced]
    for _ in range(20):  # warm-up: module loads, clocks, caches
        run_plain()
        runs[0]()
        runs[1]()
    sync()
    outs[UNTRACED].fill_(float("nan"))
    run_plain()
    sync()
    checks = {"gate": gate(problem, shape, outs[UNTRACED], inputs), "differing_elements": {}}
    words = {}
    for mode in (ISOLATED, BACK_TO_BACK):
        for b in buffers:
            b.zero()
        outs[TRACED].fill_(float("nan"))
        sync()
        if mode == ISOLATED:
            runs[0]()
        else:
            for i in range(chain):
                runs[i % 2]()
        sync()
        checks["differing_elements"][mode] = differing_elements(outs[TRACED], outs[UNTRACED])
        words[mode] = [b.read() for b in buffers]
    checks["bitwise_equal"] = not any(checks["differing_elements"].values())
    decoded = {ISOLATED: decode(words[ISOLATED][0], plan.grid, warps_per_cta, layout),
               PREVIOUS: decode(words[BACK_TO_BACK][0], plan.grid, warps_per_cta, layout),
               CURRENT: decode(words[BACK_TO_BACK][1], plan.grid, warps_per_cta, layout)}
    return {"plan": plan, "warps_per_cta": warps_per_cta, "ctas": decoded, "checks": checks,
            "launch": {UNTRACED: run_plain, TRACED: runs[0]}, "keep": (plain, traced, inputs, outs)}


def time_both(launch: dict, rounds: int, reps: int) -> dict:
    """The untraced and traced kernels timed interleaved (the search's CUDA-graph replays of back-to-back launches)."""
    from evotune.gpu.interleave import time_interleaved, whole_cycles

    result = time_interleaved({UNTRACED: launch[UNTRACED], TRACED: launch[TRACED]},
                              rounds=whole_cycles(2, rounds), reps_per_round=reps)
    pool = result.as_dict()
    return {"timings": pool["timings"], "traced_over_untraced": result.ratios(UNTRACED, TRACED), "interleaved": pool}


def assemble(ctas: dict, checks: dict, clock: dict, layout: TraceLayout, compute_warps: int, meta: dict,
             timing: dict | None = None) -> dict:
    """The record of one trace (pure: the CPU tests build it from synthetic buffers): `ctas` decoded per launch
    (isolated, previous, current), the output `checks`, the `clock` (cycles_per_ns), and `meta` (device, shape,
    config, digests, grid, ...); adds the summaries, the order checks, the back-to-back handoff and the timing."""
    ghz = clock["cycles_per_ns"]
    summaries = {name: summarize(c, layout, ghz) for name, c in ctas.items()}
    violations = [f"{name}: {v}" for name, s in summaries.items() for v in s["order_violations"]]
    violations += [f"{name}: {v}" for name, c in ctas.items() for v in tile_events_missing(c, compute_warps, layout)]
    tiles = max((w["tiles"] for c in ctas[ISOLATED] for w in recorded_warps(c)), default=0)
    warps = max((len(c["warps"]) for c in ctas[ISOLATED]), default=0)
    record = {**meta, "grid_ctas": len(ctas[ISOLATED]), "warps_per_cta": warps, "tiles": tiles,
              "layout": {"fixed": layout.fixed, "tile0": layout.tile0, "tile_events": list(layout.tile_events),
                         "max_tiles": layout.max_tiles, "record_words": layout.record_words,
                         "records": layout.records},
              "clock": clock, "checks": {**checks, "order_violations": violations}, "timing": timing,
              "modes": {ISOLATED: {"summary": summaries[ISOLATED], "ctas": ctas[ISOLATED]},
                        BACK_TO_BACK: {PREVIOUS: {"summary": summaries[PREVIOUS], "ctas": ctas[PREVIOUS]},
                                       CURRENT: {"summary": summaries[CURRENT], "ctas": ctas[CURRENT]},
                                       "handoff": handoff(summaries[PREVIOUS]["grid"], summaries[CURRENT]["grid"])}}}
    if len(ctas[ISOLATED]) * warps > layout.records or tiles > layout.max_tiles:
        record["truncated"] = (f"the buffer holds {layout.records} warp records of {layout.max_tiles} tiles; this "
                               f"grid has {len(ctas[ISOLATED]) * warps} warps of {tiles} tiles")
    return record


def failures(record: dict) -> list[str]:
    """Why the run failed (empty: it did not): traced output not bitwise the untraced one, the gate, the stamps."""
    checks = record["checks"]
    failed = [] if checks["bitwise_equal"] else [f"traced output differs from the untraced one "
                                                  f"({checks['differing_elements']} elements)"]
    failed += [] if checks["gate"]["passed"] else ["the untraced output fails the gate"]
    bad = checks["order_violations"]
    failed += [f"{len(bad)} stamps out of order or missing (first: {bad[0]})"] if bad else []
    return failed


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compare:
        records = {}
        for path in args.compare:
            try:
                records[Path(path).stem] = json.loads(Path(path).read_text())
            except (OSError, ValueError) as e:
                sys.exit(f"phase_trace: --compare {path}: {e}")
        print("\n".join(compare_lines(records)))
        return 0
    import torch

    if not torch.cuda.is_available():
        sys.exit("phase_trace: no CUDA GPU visible")
    from evotune.gpu.workers import device_info, gpu_clocks
    from evotune.problems import get_problem

    problem = get_problem("attention")
    shape = problem.parse_shape(args.shape)
    problem.check_shape(shape)
    layout = trace_layout()
    built = build(shape, args.config)
    for label, b in built.items():
        if b["violations"]:
            sys.exit(f"phase_trace: {label} {config_summary(args.config)} on {shape.spec}: {'; '.join(b['violations'])}")
    run = trace_launches(built, shape, args.seed, args.chain, layout)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    clock = {**clock_probe(props.multi_processor_count),
             "from_trace": cycles_per_ns_from_trace(run["ctas"][ISOLATED])}
    timing = time_both(run["launch"], args.rounds, args.reps)
    plan = run["plan"]
    meta = {"tool": "tools/phase_trace.py", "argv": sys.argv[1:] if argv is None else list(argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device_info(), **gpu_clocks(), "shape": shape.spec, "shape_dict": shape.as_dict(),
            "config": args.config, "config_summary": config_summary(args.config),
            "source_digests": {k: b["digest"] for k, b in built.items()},
            "resources": {k: b["compiled"].resources.as_dict() for k, b in built.items()},
            "grid": list(plan.grid), "block": list(plan.block), "pdl": bool(plan.pdl), "chain": args.chain,
            "seed": args.seed}
    record = assemble(run["ctas"], run["checks"], clock, layout, int(knob(args.config, "compute_warps")), meta, timing)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, separators=(",", ":"))  # compact: every warp's stamps of three launches
    print("\n".join(table_lines(record)))
    failed = failures(record)
    for why in failed:
        print(f"phase_trace: {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
