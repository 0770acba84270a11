"""The decode table: which config of the attention-decode family (kernels/attention_decode.cu) runs a decode call's
key, or SDPA, and why. evotune.torch.decode reads it; `evotune tune --shapes` (from a recording of generate()) and
`build_decode_table` over `evotune bench --out` records write it. In the records floor so that the CLI can build it
without importing torch.

Its key is exact, no nearest bucket:

    gpu, cc, dtype, head_dim, group (Hq / Hkv), seq_q, causal: what the compiled code depends on;
    seq_k_bucket: the K/V length rounded up to a power of two (the split count's best value moves with it; a paged
        call's: its longest sequence, `max_seqlen`, else the block table's pages x page size);
    bkv_bucket: batch x K/V heads rounded up likewise (the CTAs the splits multiply);
    sinks (attention sinks) and page_size (a paged cache's keys a page, exact: compiled in), written only where set
        (OPTIONAL_KEY_FIELDS), so the keys of dense calls without sinks, and the tables written before them, read as
        before.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import UsageError
from ..problems import get_problem
from .tuning_table import seq_bucket

PROBLEM = get_problem("attention-decode")
TABLE_ENV = "EVOTUNE_DECODE_TABLE"
TABLE_VERSION = 1
KEY_FIELDS = ("gpu", "cc", "dtype", "head_dim", "group", "seq_q", "causal", "seq_k_bucket", "bkv_bucket")
# Written only where set; a key without them has their defaults.
OPTIONAL_KEY_FIELDS = ("sinks", "page_size")
OPTIONAL_DEFAULTS = {"sinks": False, "page_size": 0}


def default_decode_table_path() -> Path:
    """$EVOTUNE_DECODE_TABLE, else decode-table.json in evotune's cache root ($EVOTUNE_CACHE or ~/.cache/evotune)."""
    if os.environ.get(TABLE_ENV):
        return Path(os.environ[TABLE_ENV])
    root = os.environ.get("EVOTUNE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "evotune")
    return Path(root) / "decode-table.json"


def table_key(gpu: str, cc: str, shape) -> tuple:
    """The table key of a call's DecodeShape on a GPU (KEY_FIELDS, then OPTIONAL_KEY_FIELDS, in order)."""
    return (gpu, cc, shape.dtype, shape.head_dim, shape.group, shape.seq_q, bool(shape.causal and shape.seq_q > 1),
            seq_bucket(shape.seq_k), seq_bucket(shape.batch * shape.kv_heads), bool(shape.sinks),
            int(shape.page_size))


def key_dict(key: tuple) -> dict:
    """A table key as its entry's "key" object: the optional fields only where they are not their defaults."""
    d = dict(zip(KEY_FIELDS + OPTIONAL_KEY_FIELDS, key))
    for name, default in OPTIONAL_DEFAULTS.items():
        if d.get(name, default) == default:
            d.pop(name, None)
    return d


def key_of(obj: dict) -> tuple:
    """The key tuple of an entry's "key" object (KeyError where a required field is missing; UsageError where an
    optional one is not of its type)."""
    sinks, page = obj.get("sinks", False), obj.get("page_size", 0)
    if not isinstance(sinks, bool) or not isinstance(page, int) or isinstance(page, bool) or page < 0:
        raise UsageError(f"decode table key: sinks must be a boolean and page_size a whole number, got {sinks!r}, "
                         f"{page!r}")
    return tuple(obj[f] for f in KEY_FIELDS) + (sinks, page)


def build_decode_table(bench_paths) -> dict:
    """The decode table from `evotune bench --out` records of the attention-decode family (a later record of the
    same key replaces an earlier one). Route "evotune" only where our kernel passed the gate and its median beat
    the fastest SDPA backend measured beside it; "sdpa" otherwise, with the reason."""
    entries: dict[tuple, dict] = {}
    for path in bench_paths:
        rec = json.loads(Path(path).read_text())
        if rec.get("family") != PROBLEM.family:
            raise UsageError(f"{path}: a bench record of family {rec.get('family')!r}, not {PROBLEM.family}")
        shape = PROBLEM.shape_from_dict(rec["shape_dict"])
        device = rec["raw"]["device"]
        ours = rec["rows"][0]
        base = [r for r in rec["rows"][1:] if r.get("time_us") and r.get("passed") is not False]
        best = min(base, key=lambda r: r["time_us"]) if base else None
        if not ours.get("available") or not ours.get("time_us"):
            route, reason = "sdpa", f"evotune's kernel did not pass: {ours.get('reason', '')}"
        elif best is None:
            route, reason = "sdpa", "unverified: no SDPA backend was measured beside the kernel"
        elif ours["time_us"] < best["time_us"]:
            route, reason = "evotune", f"{ours['time_us']:.2f} us vs {best['name']} {best['time_us']:.2f} us"
        else:
            route, reason = "sdpa", f"slower: {ours['time_us']:.2f} us vs {best['name']} {best['time_us']:.2f} us"
        key = table_key(device["name"], str(device["sm"]), shape)  # evotune.gpu.workers.device_info: "sm" is "9.0"
        entries[key] = {"key": key_dict(key), "config": rec["config"], "shape": shape.as_dict(),
                        "route": route, "reason": reason, "evotune_us": ours.get("time_us"),
                        "sdpa": {"backend": best["name"], "time_us": best["time_us"]} if best else None,
                        "source_digest": rec["source_digest"], "bench": str(path)}
    return {"version": TABLE_VERSION, "family": PROBLEM.family, "entries": list(entries.values())}


def plan_key(shape) -> tuple:
    """A decode shape's table key without the GPU (what `tune` merges recorded calls by)."""
    return table_key("", "", shape)[2:]


def decode_tune_plan(specs) -> tuple[list, list[str]]:
    """(the decode shapes to search, one per table key: the longest cache recorded in its bucket, so that the splits
    are tuned for the bucket's longest calls; a note per shape merged into another). generate() records one shape per
    step, the cache one key longer each time: a 32-token generate() after a 2048-token prompt is 32 shapes of one key."""
    chosen: dict[tuple, object] = {}
    merged: dict[tuple, list] = {}
    for spec in specs:
        shape = PROBLEM.parse_shape(spec)
        PROBLEM.check_shape(shape)
        key = plan_key(shape)
        merged.setdefault(key, []).append(shape)
        if key not in chosen or shape.seq_k > chosen[key].seq_k:
            chosen[key] = shape
    notes = [f"{len(shapes)} recorded decode shapes of one key (cache {min(s.seq_k for s in shapes)}-"
             f"{max(s.seq_k for s in shapes)} keys): tuned once, as {chosen[key].spec}"
             for key, shapes in merged.items() if len(shapes) > 1]
    return list(chosen.values()), notes


def merge_decode_tables(old: dict | None, new: dict) -> dict:
    """`old`'s entries (a decode table document, or None) with `new`'s on top: an entry of a key `new` measured
    replaces the old one; the others stay."""
    entries = {key_of(e["key"]): e for e in (old or {}).get("entries", [])}
    for e in new["entries"]:
        entries[key_of(e["key"])] = e
    return {"version": TABLE_VERSION, "family": PROBLEM.family, "entries": list(entries.values())}


def read_decode_table(path) -> dict | None:
    """The decode table document at `path` (None where there is no file); UsageError naming it where it is not one."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"decode table {path}: cannot read it: {e}") from None
    if not isinstance(obj, dict) or obj.get("version") != TABLE_VERSION or obj.get("family") != PROBLEM.family \
            or not isinstance(obj.get("entries"), list):
        raise UsageError(f"decode table {path}: not a version {TABLE_VERSION} {PROBLEM.family} table")
    return obj

