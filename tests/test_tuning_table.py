"""Tests for evotune.records.tuning_table: buckets, the file's schema and its faults, the selection rules, and
building a table from run folders (hand-made ones, and a committed H100 run with its bench record)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evotune.records import tuning_table as tt
from evotune.errors import UsageError
from evotune.problems import get_problem
from evotune.problems.shapes import Shape
from evotune.space.searchspace import load_builtin
from evotune.build.template import instantiate
from evotune.records.tuning_table import (TableKey, bh_bucket, build_table, load_table, parse_table, save_table, select,
                                  seq_bucket)

from _tables import H100, entry, table

REPO = Path(__file__).resolve().parents[1]
A100 = ("NVIDIA A100-SXM4-80GB", "8.0")


def key_of(shape: Shape, gpu=H100) -> TableKey:
    return TableKey.for_shape(shape, *gpu)


# --------------------------------------------------------------------------- buckets and paths


@pytest.mark.parametrize("n, bucket", [(1, 1), (2, 2), (3, 4), (512, 512), (513, 1024), (1000, 1024), (4097, 8192)])
def test_seq_bucket_rounds_up_to_a_power_of_two(n, bucket):
    """A sequence length's bucket is the smallest power of two not below it."""
    assert seq_bucket(n) == bucket


@pytest.mark.parametrize("bad", [0, -4, True, 3.0])
def test_seq_bucket_refuses_non_lengths(bad):
    """Zero, negatives, booleans and floats are not sequence lengths."""
    with pytest.raises(UsageError, match="positive integer"):
        seq_bucket(bad)


@pytest.mark.parametrize("batch, heads, bucket", [(1, 1, 1), (1, 8, 8), (1, 12, 16), (2, 8, 16), (16, 12, 256),
                                                   (4, 32, 128)])
def test_bh_bucket_rounds_batch_times_heads_up(batch, heads, bucket):
    """The work bucket is batch x query heads rounded up to a power of two."""
    assert bh_bucket(batch, heads) == bucket


@pytest.mark.parametrize("batch, heads", [(0, 8), (2, 0), (True, 8), (2, 8.0)])
def test_bh_bucket_refuses_non_sizes(batch, heads):
    """A batch or head count that is not a positive integer is refused."""
    with pytest.raises(UsageError, match="positive integer"):
        bh_bucket(batch, heads)


def test_key_holds_the_batch_heads_bucket():
    """Batch 1 and batch 16 of one sequence bucket are two keys; the bucket is in as_dict and spec, and in the distance."""
    small, big = key_of(Shape(1, 12, 512, 512, 64)), key_of(Shape(16, 12, 512, 512, 64))
    assert (small.bh_bucket, big.bh_bucket) == (16, 256) and small != big and small.group() == big.group()
    assert small.as_dict()["bh_bucket"] == 16 and small.spec().endswith("Sq<=512 Sk<=512 BH<=16")
    assert key_of(Shape(2, 6, 500, 500, 64)) == small  # 12 -> 16 and 500 -> 512: the same buckets
    assert small.distance(big) == 4 and big.distance(key_of(Shape(16, 12, 1024, 1024, 64))) == 2
    assert key_of(Shape(1, 32, 512, 512, 64, kv_heads=8)).bh_bucket == 32  # query heads, not K/V heads


def test_default_path_follows_env(monkeypatch, tmp_path):
    """EVOTUNE_TABLE names the table; without it the table sits in the cache root beside cubin/."""
    monkeypatch.delenv("EVOTUNE_TABLE", raising=False)
    monkeypatch.setenv("EVOTUNE_CACHE", str(tmp_path))
    assert tt.default_table_path() == tmp_path / "tuning-table.json"
    monkeypatch.setenv("EVOTUNE_TABLE", str(tmp_path / "mine.json"))
    assert tt.default_table_path() == tmp_path / "mine.json"


# --------------------------------------------------------------------------- schema


def two_entries():
    return (entry(Shape(16, 12, 1024, 1024, 64)),
            entry(Shape(4, 32, 4096, 4096, 128, "fp16", True), route="sdpa", evotune_us=3.0, sdpa=("cudnn", 2.5)))


def test_save_and_load_round_trip(tmp_path):
    """A saved table loads back equal, as version-1 JSON, and leaves no temporary file behind."""
    path = save_table(table(*two_entries()), tmp_path / "t.json")
    loaded = load_table(path)
    assert loaded.entries == table(*two_entries()).entries and loaded.path == str(path)
    raw = json.loads(path.read_text())
    assert raw["version"] == tt.TABLE_VERSION and raw["family"] == "attention" and len(raw["entries"]) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_save_refuses_a_missing_folder(tmp_path):
    """Saving into a folder that does not exist is one UsageError naming it."""
    with pytest.raises(UsageError, match="does not exist"):
        save_table(table(), tmp_path / "nope" / "t.json")


def _raw():
    return table(*two_entries()).as_dict()


def _set(path: str, value):
    """A table dict with the field at dotted `path` (entries[0].key.gpu) set to `value` (or deleted if ...)."""
    raw = _raw()
    parts = path.replace("]", "").replace("[", ".").split(".")
    node = raw
    for part in parts[:-1]:
        node = node[int(part)] if part.isdigit() else node[part]
    last = int(parts[-1]) if parts[-1].isdigit() else parts[-1]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return raw


BAD_TABLES = [
    ("[1, 2]", "not a tuning table"),
    (_set("version", ...), "has no version"),
    (_set("version", 2), "version 2 is not supported"),
    (_set("extra", 1), "unknown field 'extra'"),
    (_set("family", "softmax"), 'family "softmax"'),
    (_set("entries", {}), "entries: expected a list, got an object"),
    (_set("entries.0.route", ...), r"entries\[0\]: missing field 'route'"),
    (_set("entries.0.key.head_dim", "64"), r"entries\[0\].key.head_dim: expected an integer, got a string"),
    (_set("entries.0.key.colour", "red"), r"entries\[0\].key: unknown field 'colour'"),
    (_set("entries.0.key.seq_q_bucket", 1000), "not a power of two"),
    (_set("entries.0.key.bh_bucket", 200), r"key.bh_bucket: 200 is not a power of two"),
    (_set("entries.0.key.bh_bucket", "256"), r"key.bh_bucket: expected an integer, got a string"),
    (_set("entries.0.key.bh_bucket", 16), "not the key of the measured shape"),
    (_set("entries.0.shape.batch", 1), "not the key of the measured shape"),
    (_set("entries.0.key.dtype", "fp32"), "not fp16 or bf16"),
    (_set("entries.0.route", "maybe"), "'maybe' is not one of evotune, sdpa"),
    (_set("entries.0.sdpa", None), "routes to evotune but records no SDPA time"),
    (_set("entries.0.evotune_us", 5.0), "not faster than cudnn"),
    (_set("entries.0.evotune_us", float("nan")), "expected a number"),
    (_set("entries.0.config.block_m", [64]), "expected an integer, string or boolean"),
    (_set("entries.0.provenance.trial", "best"), "provenance.trial: expected an integer"),
    (_set("entries.0.key.gpu", "NVIDIA A100-SXM4-80GB"), "measured on NVIDIA H100"),
    (_set("entries.0.shape.seq_q", 4096), "not the key of the measured shape"),
    (_set("entries.1", _raw()["entries"][0]), r"entries\[1\] repeats the key of entries\[0\]"),
]


@pytest.mark.parametrize("content, fault", BAD_TABLES)
def test_bad_tables_are_one_line_naming_file_and_fault(tmp_path, content, fault):
    """A corrupt, foreign-version, mistyped, inconsistent or duplicated table is one UsageError line naming the file."""
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(UsageError, match=fault) as info:
        load_table(path)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)


def test_version_1_tables_without_bh_bucket_load(tmp_path):
    """A table written before bh_bucket loads unchanged (still version 1): each key takes the bucket of its measured
    shape's batch x heads, exact information, so its entry matches exactly; saving it again writes the field."""
    small, big = entry(Shape(1, 12, 512, 512, 64)), entry(Shape(16, 12, 512, 512, 64))
    obj = table(small, big).as_dict()
    for raw in obj["entries"]:
        del raw["key"]["bh_bucket"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(obj))
    loaded = load_table(path)
    assert loaded.entries == (small, big) and [e.key.bh_bucket for e in loaded.entries] == [16, 256]
    for call, want in ((Shape(1, 12, 512, 512, 64), small), (Shape(16, 12, 512, 512, 64), big)):
        chosen = select(loaded, key_of(call), call)
        assert (chosen.entry, chosen.match, chosen.route, chosen.verified) == (want, "exact", "evotune", True)
    between = Shape(4, 12, 512, 512, 64)  # BH 64: two doublings from each; not measured here
    chosen = select(loaded, key_of(between), between)
    assert (chosen.entry, chosen.match, chosen.route) == (big, "nearest", "sdpa")
    again = json.loads(save_table(loaded, tmp_path / "new.json").read_text())
    assert again["version"] == 1 and [e["key"]["bh_bucket"] for e in again["entries"]] == [16, 256]
    del obj["entries"][0]["shape"]["batch"]  # without bh_bucket the shape must say the work size
    with pytest.raises(UsageError, match=r"entries\[0\].shape: not an attention shape"):
        parse_table(obj)


def test_version_1_table_without_work_bucket_loads_with_it():
    """A table written before bh_bucket (the H100 model table of 2026-11-23's first run, kept as test data)
    loads; its 1x12x512 entry is BH<=16."""
    path = REPO / "tests/data/h100-table-before-bh-bucket.json"
    (e,) = load_table(path).entries
    assert "bh_bucket" not in json.loads(path.read_text())["entries"][0]["key"]
    assert (e.shape["batch"], e.shape["heads"], e.key.bh_bucket) == (1, 12, 16) and e.key.spec().endswith("BH<=16")


def test_committed_model_table_loads():
    """The committed H100 model table (five keys, written with bh_bucket) loads, each key's bucket its shape's."""
    path = REPO / "docs/data/model/2026-11-23-h100-table.json"
    if not path.exists():
        pytest.skip("the committed model table is not in this checkout")
    entries = load_table(path).entries
    assert len(entries) == 5
    for e in entries:
        assert e.key.bh_bucket == bh_bucket(e.shape["batch"], e.shape["heads"])
    assert sum(e.route == "sdpa" for e in entries) == 1  # GPT-2 16x1024: evotune measured slower there


def test_unreadable_tables(tmp_path):
    """A missing file and a file that is not JSON each give one line naming the file."""
    with pytest.raises(UsageError, match="no such tuning table"):
        load_table(tmp_path / "none.json")
    (tmp_path / "t.json").write_text('{"version": 1, "entries": [')
    with pytest.raises(UsageError, match=r"t.json: not valid JSON \(line 1"):
        load_table(tmp_path / "t.json")


# --------------------------------------------------------------------------- selection


def test_exact_key_is_used():
    """A call whose key is in the table gets that entry, as an exact match, with its route and reason."""
    e = entry(Shape(16, 12, 1024, 1024, 64))
    call = Shape(16, 10, 1000, 1000, 64)  # 160 -> 256 and 1000 -> 1024: the entry's buckets
    chosen = select(table(e), key_of(call), call)
    assert (chosen.entry, chosen.route, chosen.match, chosen.verified) == (e, "evotune", "exact", True)
    assert chosen.reason == e.reason


def test_exact_or_nearest_by_batch():
    """The same sequence bucket at another batch is not the entry's key: a nearest match, not verified, SDPA by default."""
    e = entry(Shape(1, 12, 512, 512, 64), evotune_us=6.27, sdpa=("cudnn", 9.63))
    same = select(table(e), key_of(Shape(1, 12, 512, 512, 64)), Shape(1, 12, 512, 512, 64))
    assert (same.match, same.route, same.verified) == ("exact", "evotune", True)
    call = Shape(2, 12, 512, 512, 64)  # BH 24 -> 32: one doubling from the entry's 16
    other = select(table(e), key_of(call), call)
    assert (other.entry, other.match, other.route, other.verified) == (e, "nearest", "sdpa", False)
    far = Shape(16, 12, 1024, 1024, 64)  # the measured case: BH 256 and Sq/Sk 1024, 6 doublings away
    missing = select(table(e), key_of(far), far)
    assert (missing.entry, missing.match, missing.verified) == (None, "none", False)


def test_nearest_routes_sdpa_by_default_naming_the_nearest_key():
    """An unverified nearest entry never routes to evotune by default; the reason names it, its times and the tune command."""
    e = entry(Shape(1, 12, 512, 512, 64), evotune_us=6.27, sdpa=("cudnn", 9.63))
    call = Shape(4, 12, 512, 512, 64)
    chosen = select(table(e), key_of(call), call)
    assert (chosen.entry, chosen.route, chosen.match, chosen.verified) == (e, "sdpa", "nearest", False)
    assert chosen.reason.startswith(f"unverified at this key: the nearest tuned key {e.key.spec()} "
                                    f"(1,12,512,64:fp16) measured evotune 6.27 us vs cudnn 9.63 us there")
    assert "tune this key: evotune tune --shape 4,12,512,64:fp16" in chosen.reason
    assert "EVOTUNE_NEAREST=1" in chosen.reason
    unmeasured = entry(Shape(1, 12, 512, 512, 64), route="sdpa", sdpa=None)
    said = select(table(unmeasured), key_of(call), call).reason
    assert "measured evotune 1.00 us with no SDPA time beside it there (route sdpa there)" in said


def test_allow_nearest_uses_the_nearest_entry():
    """allow_nearest=True uses a nearest entry with its own route, as a nearest (unverified) match."""
    e = entry(Shape(1, 12, 512, 512, 64))
    call = Shape(4, 12, 512, 512, 64)
    chosen = select(table(e), key_of(call), call, allow_nearest=True)
    assert (chosen.entry, chosen.route, chosen.match, chosen.verified) == (e, "evotune", "nearest", False)
    assert chosen.reason.startswith(f"nearest tuned bucket {e.key.spec()}") and chosen.reason.endswith(e.reason)
    slower = entry(Shape(1, 12, 512, 512, 64), route="sdpa", evotune_us=3.0)
    assert select(table(slower), key_of(call), call, allow_nearest=True).route == "sdpa"


@pytest.mark.parametrize("value, allowed", [(None, False), ("", False), ("0", False), ("1", True), (" 1 ", True)])
def test_nearest_allowed_reads_evotune_nearest(monkeypatch, value, allowed):
    """EVOTUNE_NEAREST=1 is the opt-in callers pass to select(); unset, empty or 0 keep the guard."""
    if value is None:
        monkeypatch.delenv("EVOTUNE_NEAREST", raising=False)
    else:
        monkeypatch.setenv("EVOTUNE_NEAREST", value)
    assert tt.nearest_allowed() is allowed
    e = entry(Shape(1, 12, 512, 512, 64))
    call = Shape(4, 12, 512, 512, 64)
    assert select(table(e), key_of(call), call, allow_nearest=tt.nearest_allowed()).route == (
        "evotune" if allowed else "sdpa")


@pytest.mark.parametrize("value", ["yes", "true", "2"])
def test_nearest_allowed_refuses_other_values(monkeypatch, value):
    """A value other than 1, 0 or empty is one UsageError naming the variable, not taken silently either way."""
    monkeypatch.setenv("EVOTUNE_NEAREST", value)
    with pytest.raises(UsageError, match=f"EVOTUNE_NEAREST='{value}': use 1"):
        tt.nearest_allowed()


def test_nearest_bucket_and_its_limit():
    """Allowed, without the exact key the nearest bucket is used (ties to the longer one); past two doublings none is."""
    short, long_ = entry(Shape(1, 8, 1024, 1024, 64)), entry(Shape(1, 8, 4096, 4096, 64))
    tbl = table(short, long_)
    call = Shape(1, 8, 2048, 2048, 64)
    chosen = select(tbl, key_of(call), call, allow_nearest=True)
    assert chosen.entry == long_ and chosen.match == "nearest" and "nearest tuned bucket" in chosen.reason
    assert chosen.route == "evotune"
    guarded = select(tbl, key_of(call), call)  # the same entry is named, but not run
    assert (guarded.entry, guarded.route, guarded.match) == (long_, "sdpa", "nearest")
    call = Shape(1, 8, 512, 512, 64)
    assert select(tbl, key_of(call), call, allow_nearest=True).entry == short
    call = Shape(1, 8, 16384, 16384, 64)
    far = select(tbl, key_of(call), call, allow_nearest=True)
    assert far.entry is None and far.match == "none" and far.route == "sdpa" and "within 2 bucket doublings" in far.reason
    call = Shape(4, 8, 4096, 4096, 64)  # BH 32: two doublings from the entries' 8 ...
    assert select(tbl, key_of(call), call, allow_nearest=True).entry == long_
    call = Shape(4, 8, 2048, 2048, 64)  # ... plus one of Sq and one of Sk: too far
    assert select(tbl, key_of(call), call, allow_nearest=True).entry is None


def test_nearest_ties_prefer_the_larger_work_bucket():
    """Two entries as near in batch x heads: the larger bucket is the one chosen, whatever their order."""
    few, many = entry(Shape(1, 8, 1024, 1024, 64)), entry(Shape(4, 8, 1024, 1024, 64))
    call = Shape(2, 8, 1024, 1024, 64)
    for tbl in (table(few, many), table(many, few)):
        assert select(tbl, key_of(call), call, allow_nearest=True).entry == many


def test_other_dtype_mask_layout_or_head_dim_never_match():
    """Nearest means nearest bucket only: dtype, head dim, causal and layout must be the call's."""
    tbl = table(entry(Shape(1, 8, 1024, 1024, 64)))
    for call in (Shape(1, 8, 1024, 1024, 64, "bf16"), Shape(1, 8, 1024, 1024, 128), Shape(1, 8, 1024, 1024, 64, causal=True),
                 Shape(1, 8, 1024, 1024, 64, layout="bshd")):
        assert select(tbl, key_of(call), call, allow_nearest=True).entry is None


@pytest.fixture
def seq_space(tmp_path):
    """attention's small profile plus a constraint on the call's seq_k, as a file outside the built-ins."""
    path = tmp_path / "seq-space.yaml"
    path.write_text("family: attention\nextends: attention:small\nconstraints:\n  - expr: seq_k % 512 == 0\n"
                    "    why: \"test: whole 512-key blocks\"\n")
    return str(path)


def test_a_config_not_admitted_on_the_call_is_never_used(seq_space):
    """An entry whose config its space refuses on the call's shape is skipped (with why) for the next candidate."""
    refused = entry(Shape(1, 8, 512, 512, 64), load_builtin("attention-small").default_config().as_dict(), space=seq_space)
    fallback = entry(Shape(1, 8, 1024, 1024, 64))
    call = Shape(1, 8, 300, 300, 64)
    assert key_of(call) == refused.key  # the exact key, refused on this call's seq_k
    chosen = select(table(refused, fallback), key_of(call), call, allow_nearest=True)
    assert (chosen.entry, chosen.match, chosen.route) == (fallback, "nearest", "evotune")
    assert chosen.skipped[0][0] == refused.key.spec() and "test: whole 512-key blocks" in chosen.skipped[0][1]
    guarded = select(table(refused, fallback), key_of(call), call)
    assert (guarded.entry, guarded.match, guarded.route) == (fallback, "nearest", "sdpa") and guarded.skipped == chosen.skipped
    for allow in (False, True):
        alone = select(table(refused), key_of(call), call, allow_nearest=allow)
        assert alone.entry is None and "not admitted by space" in alone.reason
        nearest_only = Shape(2, 8, 300, 300, 64)  # BH 16: the refused entry is only a nearest candidate
        assert select(table(refused), key_of(nearest_only), nearest_only, allow_nearest=allow).entry is None
    whole = Shape(1, 8, 512, 512, 64)  # admitted where seq_k is a multiple of 512
    assert select(table(refused), key_of(whole), whole).entry == refused


def test_a_config_foreign_to_its_space_or_a_stale_source_is_skipped():
    """A config naming knobs its space lacks, or whose kernel source changed since measured, is never used."""
    shape = Shape(1, 8, 512, 512, 64)
    odd = entry(shape, {**load_builtin("attention").default_config().as_dict(), "colour": "red"}, digest="0" * 16)
    assert "not the parameters of space" in select(table(odd), key_of(shape), shape).reason
    stale = entry(shape, digest="0123456789abcdef")
    chosen = select(table(stale), key_of(shape), shape)
    assert chosen.entry is None and "stale: the kernel source changed" in chosen.reason


def test_foreign_gpu_table_says_so():
    """A table holding only another GPU's entries is never used, and the reason names the file and both GPUs."""
    shape = Shape(1, 8, 512, 512, 64)
    chosen = select(table(entry(shape, gpu=A100), path="/x/t.json"), key_of(shape), shape)
    assert chosen.entry is None
    assert chosen.reason == ("/x/t.json has entries for NVIDIA A100-SXM4-80GB (sm 8.0) only, "
                             "none for NVIDIA H100 80GB HBM3 (sm 9.0)")


def test_table_routing_to_sdpa_is_followed():
    """An exact entry that routes to SDPA decides the call: no nearer-looking evotune entry overrides it."""
    slower = entry(Shape(1, 8, 1024, 1024, 64), route="sdpa", evotune_us=3.0, sdpa=("cudnn", 2.0))
    faster = entry(Shape(1, 8, 2048, 2048, 64))
    call = Shape(1, 8, 1024, 1024, 64)
    chosen = select(table(slower, faster), key_of(call), call)
    assert chosen.entry == slower and chosen.route == "sdpa"


# --------------------------------------------------------------------------- building from runs


@pytest.fixture
def runs_root(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    root.mkdir()
    monkeypatch.setenv("EVOTUNE_RUNS", str(root))
    return root


def make_run(root: Path, name: str, shape: Shape, time_us: float | None = 10.0, baselines: dict | None = None,
             digest: str | None = None, family: str = "attention", gpu=H100) -> Path:
    """A run folder as `evotune search` writes one: meta.json and trials.jsonl (one passing trial, one failed)."""
    path = root / name
    path.mkdir()
    config = load_builtin("attention").default_config()
    if digest is None:
        digest = instantiate(get_problem("attention"), config, shape).digest
    meta = {"family": family, "shape": shape.as_dict(), "space": "search_spaces/attention.yaml", "git_sha": "abc123",
            "device": {"name": gpu[0], "sm": gpu[1]}, "versions": {"evotune": "0.1.0"}, "run_id": name}
    (path / "meta.json").write_text(json.dumps(meta))
    trials = [{"number": 0, "config": config.as_dict(), "result": {"status": "compile_error"}}]
    if time_us is not None:
        trials.append({"number": 1, "config": config.as_dict(), "source_digest": digest,
                       "result": {"status": "ok", "time_us": time_us, "max_abs": 1e-4}})
    (path / "trials.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trials))
    if baselines is not None:
        (path / "baselines.json").write_text(json.dumps(baselines))
    return path


def base(time_us: float, passed: bool = True) -> dict:
    return {"available": True, "time_us": time_us, "verification": {"passed": passed}}


def test_run_without_sdpa_time_is_unverified(runs_root):
    """A run that measured no SDPA beside its kernel gives an entry that routes to SDPA, saying how to measure it."""
    shape = Shape(2, 8, 1024, 1024, 64)
    make_run(runs_root, "plain", shape)
    tbl, notes = build_table(["plain"])
    (e,) = tbl.entries
    assert e.route == "sdpa" and e.sdpa is None and e.evotune_us == 10.0 and e.evidence == {"kind": "none", "file": None}
    assert e.reason.startswith("unverified: run plain measured no SDPA") and "evotune bench best --run plain" in e.reason
    assert e.key == key_of(shape) and e.space == "attention" and e.provenance["trial"] == 1
    assert e.provenance["git_sha"] == "abc123" and e.provenance["evotune_version"] == "0.1.0"
    assert [(n.run, n.action) for n in notes] == [("plain", "added")]


def test_same_run_baselines_decide_the_route(runs_root):
    """With baselines.json the fastest passing SDPA backend is compared: faster routes to evotune, slower to SDPA."""
    make_run(runs_root, "win", Shape(2, 8, 1024, 1024, 64), baselines={
        "cudnn": base(12.0), "flash": base(8.0, passed=False), "math": {"available": False, "reason": "too large"}})
    make_run(runs_root, "lose", Shape(2, 8, 1024, 1024, 128), baselines={"cudnn": base(9.0), "flash": base(11.0)})
    tbl, _ = build_table(["win", "lose"])
    win, lose = (next(e for e in tbl.entries if e.provenance["run"] == r) for r in ("win", "lose"))
    assert win.route == "evotune" and win.sdpa == {"backend": "cudnn", "time_us": 12.0} and win.reason.startswith("faster")
    assert lose.route == "sdpa" and lose.sdpa == {"backend": "cudnn", "time_us": 9.0} and lose.reason.startswith("slower")
    assert win.evidence["kind"] == "run" and win.evidence["file"].endswith("win/baselines.json")


def test_stale_runs_route_to_sdpa(runs_root):
    """A run whose kernel source is not what the template gives now routes to SDPA, whatever it measured."""
    make_run(runs_root, "old", Shape(2, 8, 1024, 1024, 64), digest="0123456789abcdef", baselines={"cudnn": base(50.0)})
    (e,) = build_table(["old"])[0].entries
    assert e.route == "sdpa" and e.reason.startswith("stale: run old timed kernel source 0123456789abcdef")


def test_runs_that_give_no_entry_are_noted(runs_root):
    """A run with no passing trial, or of another family, is skipped with the reason."""
    make_run(runs_root, "failed", Shape(2, 8, 1024, 1024, 64), time_us=None)
    make_run(runs_root, "soft", Shape(2, 8, 1024, 1024, 64), family="softmax")
    tbl, notes = build_table(["failed", "soft"])
    assert tbl.entries == ()
    assert [(n.run, n.action) for n in notes] == [("failed", "skipped"), ("soft", "skipped")]
    assert "no trial passed" in notes[0].reason and "family 'softmax'" in notes[1].reason
    with pytest.raises(UsageError, match="not a run folder"):
        build_table(["nope"])


def test_one_key_many_runs_and_an_existing_table(runs_root):
    """Per key the run with the larger measured speedup wins; given runs replace existing entries, others stay."""
    make_run(runs_root, "a", Shape(2, 8, 1024, 1024, 64), baselines={"cudnn": base(12.0)})
    make_run(runs_root, "b", Shape(2, 8, 1000, 1000, 64), baselines={"cudnn": base(20.0)})
    make_run(runs_root, "c", Shape(2, 8, 1024, 1024, 64))
    kept = entry(Shape(1, 8, 4096, 4096, 128))
    old = entry(Shape(2, 8, 1024, 1024, 64), run="old")
    tbl, notes = build_table(["a", "b", "c"], existing=table(kept, old))
    assert {e.provenance["run"] for e in tbl.entries} == {"b", "fixture"}
    assert [(n.run, n.action) for n in notes] == [("a", "dropped"), ("b", "replaced"), ("c", "dropped")]
    assert notes[0].reason.startswith("run b won this key")


def test_runs_of_one_sequence_bucket_at_two_batches_are_two_entries(runs_root):
    """1x512 and 16x512 give two keys (the bucket comes from each run's shape); each run wins its own."""
    make_run(runs_root, "one", Shape(1, 12, 512, 512, 64), baselines={"cudnn": base(12.0)})
    make_run(runs_root, "sixteen", Shape(16, 12, 512, 512, 64), baselines={"cudnn": base(9.0)})
    make_run(runs_root, "also16", Shape(16, 16, 512, 512, 64), baselines={"cudnn": base(30.0)})  # BH 256 too
    tbl, notes = build_table(["one", "sixteen", "also16"])
    assert {e.provenance["run"]: e.key.bh_bucket for e in tbl.entries} == {"one": 16, "also16": 256}
    assert [(n.run, n.action) for n in notes] == [("one", "added"), ("sixteen", "dropped"), ("also16", "added")]
    assert all(n.key.endswith("BH<=16") for n in notes if n.run == "one")


def test_built_table_passes_its_own_validation(runs_root, tmp_path):
    """What build_table makes, save_table writes and load_table reads back unchanged."""
    make_run(runs_root, "a", Shape(2, 8, 1024, 1024, 64), baselines={"cudnn": base(12.0)})
    make_run(runs_root, "b", Shape(2, 8, 512, 700, 128, "bf16", True, "bshd"))
    tbl, _ = build_table(["a", "b"])
    assert load_table(save_table(tbl, tmp_path / "t.json")).entries == tbl.entries


def test_committed_h100_run_with_its_bench_record(tmp_path):
    """gpt2-h100-hopper with its bench record: same-process times from the bench, and SDPA because cuDNN was faster."""
    bench = REPO / "docs/data/bench/gpt2-h100-hopper.json"
    if not (REPO / "runs/gpt2-h100-hopper/meta.json").exists() or not bench.exists():
        pytest.skip("the committed gpt2-h100-hopper run or its bench record is not in this checkout")
    (e,) = build_table([REPO / "runs/gpt2-h100-hopper"], bench_paths=[bench])[0].entries
    record = json.loads(bench.read_text())
    cudnn = next(r for r in record["rows"] if r["name"] == "cudnn")
    assert e.evotune_us == record["rows"][0]["time_us"] and e.sdpa == {"backend": "cudnn", "time_us": cudnn["time_us"]}
    assert e.evidence == {"kind": "bench", "file": str(bench)} and e.space == "attention:hopper"
    assert e.key == TableKey("NVIDIA H100 80GB HBM3", "9.0", "fp16", 64, False, "bhsd", 1024, 1024, 256)
    assert e.route == "sdpa" and e.reason.split(":")[0] in ("slower", "stale")
    assert load_table(save_table(table(e), tmp_path / "t.json")).entries == (e,)


def test_bad_bench_record_is_one_line(tmp_path, runs_root):
    """A bench file that is not a bench record is one UsageError naming it."""
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(UsageError, match="b.json: not a bench record: source"):
        build_table([], bench_paths=[path])
