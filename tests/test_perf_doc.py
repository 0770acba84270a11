"""tools/perf_doc.py on the CPU: the committed bench records (solo timings) still render, and a record with a
head-to-head shows its interleaved figures and the spread of CUDNN's time over ours across rounds."""

from __future__ import annotations

import json

import pytest

from _paths import REPO_ROOT, load_tool
from evotune.gpu.bench import OURS, summarize


@pytest.fixture(scope="module")
def perf_doc():
    return load_tool("perf_doc")


@pytest.fixture(scope="module")
def records():
    return [json.loads(p.read_text()) for p in sorted((REPO_ROOT / "docs" / "data" / "bench").glob("*.json"))]


def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]


def test_committed_records_render_as_solo(perf_doc, records):
    """Every committed record gets a row of the first table, timed "solo", without a spread."""
    text = perf_doc.render(records)
    header, *rows = _table_rows(text)[:len(records) + 1]
    assert "vs CUDNN min-max over rounds" in header and header.count("|") == 14
    assert len(rows) == len(records)
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert len(cells) == 13 and cells[-1] == "solo" and cells[-3] == "-", row


def _interleaved(rec: dict) -> dict:
    """`rec` as if its bench had a head-to-head of 3 rounds: every time 1% under the solo one, CUDNN's
    per-round time over ours 1.00, 1.05 and 1.10 of the solo ratio."""
    raw = rec["raw"]
    solo = {OURS: raw["kernel"]["time_us"],
            **{n: b["time_us"] for n, b in raw["baselines"].items() if b.get("available")}}
    timings = {n: {"median_us": 0.99 * t, "p10_us": 0.98 * t, "p90_us": t, "reps": 30, "launches_per_rep": 1,
                   "method": "cuda-graph"} for n, t in solo.items()}
    spread = {n: {"min": t / solo[OURS], "max": 1.1 * t / solo[OURS]} for n, t in solo.items() if n != OURS}
    raw = {**raw, "head_to_head": {"rounds": 3, "reps_per_round": 10, "timings": timings, "ours_speedup": spread}}
    return {**rec, **summarize(raw, rec["flops"], rec["min_bytes"]), "raw": raw}


def test_a_head_to_head_record_shows_its_interleaved_figures(perf_doc, records):
    """A record with a head-to-head shows the interleaved times, CUDNN's min-max over rounds and its timing."""
    rec = next(r for r in records if r["shape"] == "1,8,512,64:fp16")
    new = _interleaved(rec)
    row = _table_rows(perf_doc.render([new]))[1]
    cudnn = rec["raw"]["baselines"]["cudnn"]["time_us"] / rec["raw"]["kernel"]["time_us"]
    assert f"| {0.99 * rec['raw']['kernel']['time_us']:.2f} |" in row
    assert f"| {cudnn:.2f}-{1.1 * cudnn:.2f}x |" in row and row.endswith("| interleaved, 3 rounds x 10 |")
    both = perf_doc.render([rec, new])
    assert "solo |" in both and "interleaved, 3 rounds x 10 |" in both


def test_tuning_tables_render_one_row_per_entry(perf_doc):
    """--tables: an attention table's and a decode table's entries, one row each, with evotune's time, the baseline
    timed beside it and their ratio, the route and what measured it."""
    data = REPO_ROOT / "docs" / "data" / "2026-11-28-h200" / "coverage2" / "families" / "job3"
    tables = [(str(p), json.loads(p.read_text())) for p in (data / "table.json", data / "table.decode.json")]
    rows = _table_rows(perf_doc.render_tables(tables))[1:]
    assert len(rows) == sum(len(t["entries"]) for _, t in tables) == 2
    decode = next(r for r in rows if r.startswith("| 1,28,4,519,128:fp16 "))
    entry = tables[1][1]["entries"][0]
    ratio = entry["sdpa"]["time_us"] / entry["evotune_us"]
    assert f"| {entry['evotune_us']:.2f} | cudnn {entry['sdpa']['time_us']:.2f} | {ratio:.2f}x | evotune |" in decode


def test_feature_records_render_one_row_per_case(perf_doc):
    from evotune.problems.shapes import parse_shape

    dense_of = load_tool("feature_bench").dense_of
    """--features: tools/feature_bench.py's record (a device run's), one row per case with our time, FlexAttention's and
    the per-round ratios as recorded; a contender that was not timed renders as '-'."""
    path = REPO_ROOT / "docs" / "data" / "2026-11-28-h200" / "coverage3" / "sinks" / "job0" / "sinks.json"
    doc = json.loads(path.read_text())
    rows = _table_rows(perf_doc.render_features([(str(path), doc)]))[1:]
    assert len(rows) == len(doc["cases"]) == 4
    for row, case in zip(rows, doc["cases"]):
        ours, ratio = case["ours"], case["ours_vs_flex"]
        assert row.startswith(f"| `{case['shape']}` | default | {ours['median_us']:.1f} [")
        assert f"| {ratio['median']:.2f}x [{ratio['min']:.2f}-{ratio['max']:.2f}] |" in row
        assert row.count("| - | - |") == 2  # no "without the sinks" nor "dense, tuned" contender in that run
        assert f"(`{dense_of(parse_shape(case['shape'])).spec}`)" in row  # the tool's dense shape of the case


def test_best_per_shape_keeps_one_row_a_shape(perf_doc):
    """--best-per-shape: two tunes of one shape (a short search, then a longer one) render as the better one's row."""
    data = REPO_ROOT / "docs" / "data" / "2026-11-28-h200" / "coverage2" / "head-dims"
    tables = [(str(p), json.loads(p.read_text())) for p in (data / "job2" / "table.json", data / "call6-job0" / "table.json")]
    every = _table_rows(perf_doc.render_tables(tables))[1:]
    best = _table_rows(perf_doc.render_tables(tables, best_per_shape=True))[1:]
    shape = "| 1,8,2048,256:fp16:causal:kv4 |"
    assert sum(r.startswith(shape) for r in every) == 2 and sum(r.startswith(shape) for r in best) == 1
    assert "| 1.17x | evotune |" in next(r for r in best if r.startswith(shape))
