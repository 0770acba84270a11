"""The tuning table: which tuned attention config to use for a call, and whether to use one at all.

A table is one versioned JSON file that `evotune.torch.attention` reads (EVOTUNE_TABLE, else
`default_table_path()`) and `build_table` writes from run folders (the library behind
`evotune table build RUN... -o FILE`):

    {"version": 1, "family": "attention", "entries": [
       {"key": {"gpu": "NVIDIA H100 80GB HBM3", "cc": "9.0", "dtype": "fp16", "head_dim": 64,
                "causal": false, "layout": "bhsd", "seq_q_bucket": 1024, "seq_k_bucket": 1024,
                "bh_bucket": 256 [, "kv_group": 4]},
        "config": {...}, "space": "attention-hopper", "shape": {the shape the run measured},
        "evotune_us": 130.8, "sdpa": {"backend": "cudnn", "time_us": 121.6} or null,
        "route": "evotune" | "sdpa", "reason": "why, in words",
        "evidence": {"kind": "bench" | "run" | "none", "file": path or null},
        "provenance": {"run", "trial", "git_sha", "evotune_version", "device", "source_digest"}}]}

Sequence buckets. A key holds each sequence length rounded up to a power of two (`seq_bucket`):
513..1024 -> 1024. Why powers of two: what decides a tile choice and the race against cuDNN is the
number of query tiles per SM and the length of the K/V loop, which change by factors, not by
steps of a few rows, so a geometric grid keeps a table small (about 20 buckets span 1..2^20
rows) without putting very different work in one bucket; it is also how Triton users bucket.
Rounding up, not to the nearest: a bucket is named by the longest length it holds, and the
shapes runs tune (512, 1024, 4096, ...) sit at the top of their bucket.

Work buckets. The key also holds batch x query heads rounded up the same way, `bh_bucket`
(`bh_bucket` helper; 16 x 12 = 192 -> 256, spelled "BH<=256" in `spec()`). Why: the kernel launches
one CTA per (batch, head, query tile), so batch x heads times the query tiles is the number of CTAs
the 132 SMs of an H100 share. Few CTAs (batch 1, 12 heads, 512 rows: 96 CTAs of 64 rows, under one
wave) make a call launch- and latency-bound: launch overhead, prologue and pipeline depth decide;
many (batch 16 at 1024 rows: 3072 CTAs, over 23 waves at one CTA per SM) make it compute-bound: the
tile's MMA efficiency and the quantisation of the last wave decide, and cuDNN's kernels are at their
best. Measured on the H100: a config tuned at 1 x 12 x 512 (6.27 us vs cuDNN 9.63 us) ran 0.94x
SDPA's speed at 16 x 12 x 1024, when the key had no batch or heads and the nearest-bucket rule took
it. The work size is a bucket, not exact batch and heads, for the same reason as the sequence
buckets: the CTA count changes the choice by factors. Query heads, not K/V heads: the grid is over
query heads (a K/V group's heads share K/V, see below).

Tables written before `bh_bucket` (version 1 keys without it) load unchanged, still version 1: every
entry records the shape it measured ("shape", batch and heads included; the schema requires it and the
key is checked against it), so a key without `bh_bucket` takes the bucket of that shape's batch x heads.
That is exact information, not a guess, so such an entry can be an exact match like a new one. A table
written now has `bh_bucket` in every key; an evotune from before the field refuses it with one line
("unknown field 'bh_bucket'"), never a wrong choice.

Grouped-query attention. The key holds the group size, `kv_group` = query heads / K/V heads, written
only where it is above 1 (a key without it is group 1, so every table written before grouped-query
attention loads unchanged, still version 1). The group size and not the K/V head count: like batch and
heads, the count of K/V heads is an amount of work, while the group size sets how many query heads
share one K/V head, hence the K/V bytes each CTA's tile reads per FLOP, which is what moves a tile
choice and the race against SDPA (H32 KV8 reads a quarter of H32's K/V). A grouped call never takes an
entry of another group size, not even a nearest bucket: it is "missing" until its group is tuned.

Selection (`select(table, key, shape, allow_nearest=False)`), in order:
1. Only entries of the call's GPU (name and compute capability), dtype, head dim, causal flag,
   query layout and K/V group size are candidates; the exact key first, then the nearest buckets by
   |log2 Sq-bucket ratio| + |log2 Sk-bucket ratio| + |log2 BH-bucket ratio| up to MAX_BUCKET_DISTANCE
   (ties: the longer sequence bucket, then the larger batch x heads bucket, then the key's spelling,
   so the choice is deterministic).
2. A candidate whose config is not admitted by its search space on the call's actual shape
   (evotune.space.searchspace constraints, with the family Problem's context) is skipped, never used; so is a
   candidate whose kernel source is no longer the one that was measured (the template changed).
   This holds whether or not nearest entries are allowed.
3. The first usable candidate decides. An exact match (match "exact", `Selection.verified`): its
   entry's own route, "evotune" or "sdpa" as measured at this key, and its reason says why.
4. A nearest match (match "nearest", not verified) was measured at another key, so it says nothing
   certain about this one (a launch-bound winner can lose a compute-bound call). By default it is
   never routed to evotune: route "sdpa" with that nearest entry, and a reason naming it, what it
   measured there and the shape to tune ("unverified at this key: the nearest tuned key ... measured
   evotune X us vs cudnn Y us there; tune this key: evotune tune --shape SPEC"). The opt-in
   `allow_nearest=True` uses it as before (its own route, reason prefixed "nearest tuned bucket ...").
   Callers that take the opt-in from the user read `nearest_allowed()`: the environment variable
   EVOTUNE_NEAREST, "1" allows, unset, "" or "0" keeps the guard, anything else is a UsageError.
5. No usable candidate: route "sdpa", match "none", entry None (the op's fallback policy applies).

Routing rule (`build_table`): an entry routes to evotune only where the run (or a bench record
of that run's best config, which times the kernel and every SDPA backend in one process) measured
both evotune's kernel and the SDPA backends on the same GPU, the kernel passed the gate, and its
median beat the fastest SDPA backend that passed the same gate. Slower or equal: route "sdpa"
(a tuner never makes a model slower). No SDPA time measured beside the kernel: route "sdpa",
reason "unverified"; the entry keeps evotune's own time and says how to measure SDPA.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from ..errors import UsageError
from ..outputs import MAX_JSON_BYTES, read_input
from .best import BASELINES_FILE, BESIDE_KIND, final_best, read_beside

TABLE_VERSION = 1
FAMILY = "attention"
ROUTES = ("evotune", "sdpa")
EVIDENCE_KINDS = ("bench", "run", "none")
# Two doublings of one dimension (Sq, Sk or batch x heads), or one of each of two: a decision measured
# further away says little about whether evotune still beats cuDNN (gpt2 1k d64: 1.08x cuDNN's time;
# mission 512 B1 H8: 0.56x). It bounds the candidates a nearest match is named from (and, with
# allow_nearest, used from); without the opt-in a nearest entry never routes to evotune.
MAX_BUCKET_DISTANCE = 2
NEAREST_ENV = "EVOTUNE_NEAREST"  # "1": select() may use nearest-bucket entries (see nearest_allowed)

KEY_FIELDS = ("gpu", "cc", "dtype", "head_dim", "causal", "layout", "seq_q_bucket", "seq_k_bucket")
# bh_bucket: always written; a key read without it (a table from before the field) takes its entry's
# measured shape's. kv_group: written only where not 1 (grouped-query attention). softcap, window_bucket and sinks:
# written only where set (logit soft-capping; a sliding window; attention sinks), so the keys of dense calls read as
# before.
# varlen: written only where set (a variable-length packed batch), likewise; head_dim_v: V's head dim, written only where
# it differs from head_dim (DeepSeek MLA's 128 beside 192).
OPTIONAL_KEY_FIELDS = ("bh_bucket", "kv_group", "softcap", "window_bucket", "sinks", "varlen", "head_dim_v")
ENTRY_FIELDS = ("key", "config", "space", "shape", "evotune_us", "sdpa", "route", "reason", "evidence",
                "provenance")
PROVENANCE_FIELDS = ("run", "trial", "git_sha", "evotune_version", "device", "source_digest")


def _pow2_bucket(n: int, what: str) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise UsageError(f"tuning table: {what} must be a positive integer, got {n!r}")
    return 1 << (n - 1).bit_length()


def seq_bucket(n: int) -> int:
    """The bucket of a sequence length: the smallest power of two >= n (n >= 1)."""
    return _pow2_bucket(n, "a sequence length")


def bh_bucket(batch: int, heads: int) -> int:
    """The work bucket of a call: the smallest power of two >= batch x query heads (the seq_bucket rule)."""
    _pow2_bucket(batch, "a batch size")
    _pow2_bucket(heads, "a head count")
    return _pow2_bucket(batch * heads, "batch x heads")


def window_bucket(shape) -> int:
    """The window key field of an attention Shape: 0 without a window, else the keys one row's window spans (left +
    right + 1, an unbounded side counted to the sequence's end, the whole at most Sk) rounded up to a power of two
    (the seq_bucket rule: the K/V tiles a query tile walks scale with it)."""
    if not shape.has_window:
        return 0
    left = shape.seq_k if shape.window_left < 0 else min(shape.window_left, shape.seq_k)
    right = shape.seq_q if shape.window_right < 0 else min(shape.window_right, shape.seq_q)
    return _pow2_bucket(min(shape.seq_k, left + right + 1), "a window's keys")


def nearest_allowed() -> bool:
    """Whether the user opted in to nearest-bucket entries: $EVOTUNE_NEAREST is "1" (pass the answer to
    `select(..., allow_nearest=...)`). Unset, "" or "0": no; any other value is a UsageError, so a typo
    is not taken silently either way."""
    value = os.environ.get(NEAREST_ENV, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise UsageError(f"{NEAREST_ENV}={value!r}: use 1 (run evotune's kernel with the nearest tuned bucket's config, "
                     f"unverified at the call's key) or 0 / unset (PyTorch SDPA wherever the call's key was not tuned)")


def default_table_path() -> Path:
    """$EVOTUNE_TABLE, else tuning-table.json in evotune's cache root ($EVOTUNE_CACHE or ~/.cache/evotune),
    the folder whose cubin/ holds the compiled kernels the table's configs become."""
    if os.environ.get("EVOTUNE_TABLE"):
        return Path(os.environ["EVOTUNE_TABLE"])
    root = os.environ.get("EVOTUNE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "evotune")
    return Path(root) / "tuning-table.json"


# --------------------------------------------------------------------------- keys and entries


@dataclass(frozen=True, order=True)
class TableKey:
    gpu: str
    cc: str
    dtype: str
    head_dim: int
    causal: bool
    layout: str
    seq_q_bucket: int
    seq_k_bucket: int
    bh_bucket: int        # batch x query heads, rounded up to a power of two (the work size: CTAs vs SMs)
    kv_group: int = 1     # query heads per K/V head (grouped-query attention; 1 without)
    softcap: bool = False  # logit soft-capping (its cap is a runtime argument: one kernel for every cap)
    window_bucket: int = 0  # a sliding window's keys per row (window_bucket), 0 without a window
    sinks: bool = False  # attention sinks (the logits are an input: one kernel for every value)
    # A variable-length packed batch (flash-attention's varlen; its own kernel, HopperTraits' VARLEN). Its buckets are
    # the dense key's, read as varlen's: seq_q_bucket / seq_k_bucket the longest sequence (max_seqlen_q / _k, which
    # sizes the grid's query tiles and bounds a tile's K/V loop) and bh_bucket the number of sequences x query heads
    # (the grid's CTAs before those past their sequence's end exit). The lengths themselves are not in the key: a
    # packed training batch changes them every step, and the op knows them only on the GPU (cu_seqlens).
    varlen: bool = False
    # V's head dim where it differs from head_dim (a kernel of its own, HopperTraits' HEAD_DIM_V); 0: the same.
    head_dim_v: int = 0

    @classmethod
    def for_shape(cls, shape, gpu: str, cc: str) -> "TableKey":
        """The key of an attention Shape on GPU `gpu` of compute capability `cc` ("9.0")."""
        return cls(gpu, cc, shape.dtype, shape.head_dim, shape.causal, shape.layout,
                   seq_bucket(shape.seq_q), seq_bucket(shape.seq_k), bh_bucket(shape.batch, shape.heads),
                   shape.kv_group, shape.has_softcap, window_bucket(shape), shape.sinks, shape.is_varlen,
                   shape.head_dim_v)

    def as_dict(self) -> dict:
        d = {name: getattr(self, name) for name in KEY_FIELDS}
        d["bh_bucket"] = self.bh_bucket
        if self.kv_group != 1:
            d["kv_group"] = self.kv_group
        if self.softcap:
            d["softcap"] = True
        if self.window_bucket:
            d["window_bucket"] = self.window_bucket
        if self.sinks:
            d["sinks"] = True
        if self.varlen:
            d["varlen"] = True
        if self.head_dim_v:
            d["head_dim_v"] = self.head_dim_v
        return d

    def group(self) -> tuple:
        """Everything but the sequence and work buckets: the entries a nearest-bucket search may choose among (a
        window's bucket stays: its tile range, not the sequence, decides the work per query tile)."""
        return (self.gpu, self.cc, self.dtype, self.head_dim, self.causal, self.layout, self.kv_group, self.softcap,
                self.window_bucket, self.sinks, self.varlen, self.head_dim_v)

    def distance(self, other: "TableKey") -> int:
        """Bucket distance in doublings: |log2 Sq ratio| + |log2 Sk ratio| + |log2 BH ratio|."""
        return sum(abs(getattr(self, name).bit_length() - getattr(other, name).bit_length())
                   for name in ("seq_q_bucket", "seq_k_bucket", "bh_bucket"))

    def spec(self) -> str:
        mask = "causal" if self.causal else "non-causal"
        group = f" kv-group {self.kv_group}" if self.kv_group != 1 else ""
        group += " softcap" if self.softcap else ""
        group += f" window<={self.window_bucket}" if self.window_bucket else ""
        group += " sinks" if self.sinks else ""
        group += " varlen" if self.varlen else ""
        dims = f"d{self.head_dim}" + (f"/dv{self.head_dim_v}" if self.head_dim_v else "")
        return (f"{self.gpu} (sm {self.cc}) {self.dtype} {dims} {mask} {self.layout}{group} "
                f"Sq<={self.seq_q_bucket} Sk<={self.seq_k_bucket} BH<={self.bh_bucket}")


@dataclass(frozen=True)
class Entry:
    key: TableKey
    config: dict
    space: str
    shape: dict
    evotune_us: float
    sdpa: dict | None
    route: str
    reason: str
    evidence: dict
    provenance: dict

    def as_dict(self) -> dict:
        return {"key": self.key.as_dict(), "config": dict(self.config), "space": self.space, "shape": dict(self.shape),
                "evotune_us": self.evotune_us, "sdpa": dict(self.sdpa) if self.sdpa else None, "route": self.route,
                "reason": self.reason, "evidence": dict(self.evidence), "provenance": dict(self.provenance)}

    def speedup(self) -> float | None:
        """Best SDPA time over evotune's (above 1: evotune is faster), or None where SDPA was not measured."""
        return self.sdpa["time_us"] / self.evotune_us if self.sdpa else None


@dataclass(frozen=True)
class Table:
    entries: tuple[Entry, ...] = ()
    path: str | None = None

    def entry(self, key: TableKey) -> Entry | None:
        return next((e for e in self.entries if e.key == key), None)

    def gpus(self) -> list[str]:
        """The GPUs the table has entries for, as `name (sm cc)`."""
        return sorted({f"{e.key.gpu} (sm {e.key.cc})" for e in self.entries})

    def has_gpu(self, gpu: str, cc: str) -> bool:
        return any(e.key.gpu == gpu and e.key.cc == cc for e in self.entries)

    def as_dict(self) -> dict:
        return {"version": TABLE_VERSION, "family": FAMILY,
                "entries": [e.as_dict() for e in sorted(self.entries, key=lambda e: e.key)]}


# --------------------------------------------------------------------------- loading and saving


class _Fault(Exception):
    """A schema fault at a JSON path; load_table turns it into one UsageError line naming the file."""


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _expect(value, kind: str, where: str):
    ok = {"object": isinstance(value, dict), "list": isinstance(value, list), "string": isinstance(value, str),
          "boolean": isinstance(value, bool),
          "integer": isinstance(value, int) and not isinstance(value, bool),
          "number": isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}[kind]
    if not ok:
        raise _Fault(f"{where}: expected {'an' if kind[0] in 'aeiou' else 'a'} {kind}, got {_kind(value)}")
    return value


def _fields(obj, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    """`obj` as an object with exactly the required fields (and maybe the optional ones)."""
    _expect(obj, "object", where)
    for name in obj:
        if name not in required and name not in optional:
            raise _Fault(f"{where}: unknown field {name!r}; fields: {', '.join(required + optional)}")
    for name in required:
        if name not in obj:
            raise _Fault(f"{where}: missing field {name!r}")
    return obj


def _measured_shape(obj, where: str):
    """The entry's "shape" object as an attention Shape; a _Fault at `where` where it is not one."""
    from ..problems.shapes import Shape

    _expect(obj, "object", where)
    try:
        return Shape.from_dict(obj)
    except (KeyError, TypeError, UsageError) as e:
        raise _Fault(f"{where}: not an attention shape ({e})") from None


def _parse_key(obj, where: str, shape_obj, shape_where: str) -> TableKey:
    """The key at `where`; one without bh_bucket (written before the field) takes the bucket of the entry's
    measured shape `shape_obj` (at `shape_where`), which holds its batch and heads."""
    _fields(obj, where, KEY_FIELDS, OPTIONAL_KEY_FIELDS)
    for name in ("gpu", "cc", "dtype", "layout"):
        _expect(obj[name], "string", f"{where}.{name}")
    _expect(obj["causal"], "boolean", f"{where}.causal")
    for name in ("head_dim", "seq_q_bucket", "seq_k_bucket"):
        value = _expect(obj[name], "integer", f"{where}.{name}")
        if value < 1 or (name != "head_dim" and value & (value - 1)):
            raise _Fault(f"{where}.{name}: {value} is not {'positive' if name == 'head_dim' else 'a power of two'}")
    if obj["dtype"] not in ("fp16", "bf16"):
        raise _Fault(f"{where}.dtype: {obj['dtype']!r} is not fp16 or bf16")
    if obj["layout"] not in ("bhsd", "bshd"):
        raise _Fault(f"{where}.layout: {obj['layout']!r} is not bhsd or bshd")
    kv_group = _expect(obj.get("kv_group", 1), "integer", f"{where}.kv_group")
    if kv_group < 1:
        raise _Fault(f"{where}.kv_group: {kv_group} is not positive")
    softcap = _expect(obj.get("softcap", False), "boolean", f"{where}.softcap")
    window = _expect(obj.get("window_bucket", 0), "integer", f"{where}.window_bucket")
    if window < 0 or window & (window - 1):
        raise _Fault(f"{where}.window_bucket: {window} is not 0 (no window) or a power of two")
    sinks = _expect(obj.get("sinks", False), "boolean", f"{where}.sinks")
    varlen = _expect(obj.get("varlen", False), "boolean", f"{where}.varlen")
    head_dim_v = _expect(obj.get("head_dim_v", 0), "integer", f"{where}.head_dim_v")
    if head_dim_v < 0 or head_dim_v == obj["head_dim"]:
        raise _Fault(f"{where}.head_dim_v: {head_dim_v} is not V's own head dim (positive, not head_dim; leave it out "
                     f"where V's is head_dim)")
    if "bh_bucket" in obj:
        bh = _expect(obj["bh_bucket"], "integer", f"{where}.bh_bucket")
        if bh < 1 or bh & (bh - 1):
            raise _Fault(f"{where}.bh_bucket: {bh} is not a power of two")
    else:
        measured = _measured_shape(shape_obj, shape_where)
        bh = bh_bucket(measured.batch, measured.heads)
    return TableKey(**{name: obj[name] for name in KEY_FIELDS}, bh_bucket=bh, kv_group=kv_group, softcap=softcap,
                    window_bucket=window, sinks=sinks, varlen=varlen, head_dim_v=head_dim_v)


def _parse_provenance(obj, where: str) -> dict:
    _fields(obj, where, PROVENANCE_FIELDS)
    for name in ("run", "git_sha", "evotune_version", "source_digest"):
        _expect(obj[name], "string", f"{where}.{name}")
    _expect(obj["trial"], "integer", f"{where}.trial")
    device = _expect(obj["device"], "object", f"{where}.device")
    for name in ("name", "sm"):
        _expect(device.get(name), "string", f"{where}.device.{name}")
    return obj


def _parse_entry(obj, where: str) -> Entry:
    _fields(obj, where, ENTRY_FIELDS)
    key = _parse_key(obj["key"], f"{where}.key", obj["shape"], f"{where}.shape")
    config = _expect(obj["config"], "object", f"{where}.config")
    for name, value in config.items():
        if type(value) not in (int, str, bool):
            raise _Fault(f"{where}.config.{name}: expected an integer, string or boolean, got {_kind(value)}")
    shape = _expect(obj["shape"], "object", f"{where}.shape")
    _expect(obj["space"], "string", f"{where}.space")
    evotune_us = _expect(obj["evotune_us"], "number", f"{where}.evotune_us")
    sdpa = obj["sdpa"]
    if sdpa is not None:
        _fields(sdpa, f"{where}.sdpa", ("backend", "time_us"))
        _expect(sdpa["backend"], "string", f"{where}.sdpa.backend")
        _expect(sdpa["time_us"], "number", f"{where}.sdpa.time_us")
    route = _expect(obj["route"], "string", f"{where}.route")
    if route not in ROUTES:
        raise _Fault(f"{where}.route: {route!r} is not one of {', '.join(ROUTES)}")
    _expect(obj["reason"], "string", f"{where}.reason")
    evidence = _fields(obj["evidence"], f"{where}.evidence", ("kind", "file"))
    if evidence["kind"] not in EVIDENCE_KINDS:
        raise _Fault(f"{where}.evidence.kind: {evidence['kind']!r} is not one of {', '.join(EVIDENCE_KINDS)}")
    provenance = _parse_provenance(obj["provenance"], f"{where}.provenance")
    entry = Entry(key, config, obj["space"], shape, float(evotune_us), sdpa, route, obj["reason"], evidence, provenance)
    _check_consistent(entry, where)
    return entry


def _check_consistent(entry: Entry, where: str) -> None:
    """Faults no single field shows: a route to evotune with no measured win, or a key that is not the
    shape and GPU the entry was measured on (a hand-edited or foreign entry)."""
    if entry.route == "evotune":
        if entry.sdpa is None:
            raise _Fault(f"{where}: routes to evotune but records no SDPA time measured beside it")
        if entry.evotune_us >= entry.sdpa["time_us"]:
            raise _Fault(f"{where}: routes to evotune but evotune's {entry.evotune_us:.2f} us is not faster than "
                         f"{entry.sdpa['backend']}'s {entry.sdpa['time_us']:.2f} us")
    device = entry.provenance["device"]
    if (device["name"], device["sm"]) != (entry.key.gpu, entry.key.cc):
        raise _Fault(f"{where}: key is for {entry.key.gpu} (sm {entry.key.cc}) but it was measured on "
                     f"{device['name']} (sm {device['sm']})")
    measured = TableKey.for_shape(_measured_shape(entry.shape, f"{where}.shape"), entry.key.gpu, entry.key.cc)
    if measured != entry.key:
        raise _Fault(f"{where}: key ({entry.key.spec()}) is not the key of the measured shape ({measured.spec()})")


def parse_table(obj, path: str | None = None) -> Table:
    """A Table from the parsed JSON `obj`; UsageError `<path>: <json path>: <fault>` on the first fault."""
    where = path or "tuning table"
    try:
        if not isinstance(obj, dict):
            raise _Fault(f"not a tuning table (expected an object with version, family, entries; got {_kind(obj)})")
        version = obj.get("version")
        if version != TABLE_VERSION:
            said = "has no version" if version is None else f"version {json.dumps(version)} is not supported"
            raise _Fault(f"{said} (this evotune reads tuning-table version {TABLE_VERSION})")
        _fields(obj, "top level", ("version", "family", "entries"))
        if obj["family"] != FAMILY:
            raise _Fault(f"family {json.dumps(obj['family'])}: a tuning table holds {FAMILY} entries")
        entries = [_parse_entry(e, f"entries[{i}]") for i, e in enumerate(_expect(obj["entries"], "list", "entries"))]
        seen: dict[TableKey, int] = {}
        for i, e in enumerate(entries):
            if e.key in seen:
                raise _Fault(f"entries[{i}] repeats the key of entries[{seen[e.key]}] ({e.key.spec()})")
            seen[e.key] = i
    except _Fault as fault:
        raise UsageError(f"{where}: {fault}") from None
    return Table(tuple(entries), path)


def load_table(path: str | os.PathLike) -> Table:
    """Read and validate a tuning table; UsageError naming the file and the first fault."""
    path = str(path)
    if not os.path.lexists(path):
        raise UsageError(f"{path}: no such tuning table")
    # Bounded, regular files only: the op reads $EVOTUNE_TABLE in a user's process too.
    raw = read_input(path, "tuning table", MAX_JSON_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: cannot read the tuning table ({e})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except RecursionError:
        raise UsageError(f"{path}: not valid JSON (nested too deeply)") from None
    return parse_table(obj, path)


def save_table(table: Table, path: str | os.PathLike) -> Path:
    """Write `table` to `path` whole (outputs.write_output: a temporary file, then a rename)."""
    from ..outputs import write_output

    return write_output(path, json.dumps(table.as_dict(), indent=1) + "\n", "tuning table")


# --------------------------------------------------------------------------- selection


@dataclass(frozen=True)
class Selection:
    """What the table says for one call: the entry chosen (None where none is usable), the route, how
    the entry matched ("exact", "nearest" or "none"), why, and the candidates skipped and why. A
    "nearest" entry routes to SDPA unless select() was given allow_nearest=True: the entry is then the
    one named in the reason, not a measured decision for this call."""

    entry: Entry | None
    route: str
    match: str
    reason: str
    skipped: tuple[tuple[str, str], ...] = field(default=())

    @property
    def verified(self) -> bool:
        """Whether the entry was measured at this call's key (an exact match): its route, evotune or SDPA,
        is the table's measured decision here. False for a nearest entry (not measured here) and for none."""
        return self.match == "exact" and self.entry is not None


@lru_cache(maxsize=32)
def _space(ref: str):
    from ..space.searchspace import load_builtin, load_space

    return load_space(ref) if ref.endswith((".yaml", ".yml")) or os.sep in ref else load_builtin(ref)


@lru_cache(maxsize=256)
def _current_digest(config_items: tuple, dtype: str, head_dim: int, causal: bool, softcap: bool = False,
                    window: bool = False, sinks: bool = False, varlen: bool = False, head_dim_v: int = 0) -> str:
    """The digest of the kernel source the op would compile now for this config and shape class. The
    source depends on the shape only through dtype, head dim (and V's), causal and whether it has a softcap, a window, sinks or
    is varlen (their values are runtime arguments) (AttentionProblem.template_args; the op's kernel cache relies on the same), so a
    call of new sequence lengths reads no template."""
    from ..problems import get_problem
    from ..problems.shapes import Shape
    from ..space.searchspace import Config
    from ..build.template import instantiate

    shape = Shape(1, 1, 1, 1, head_dim, dtype, causal, softcap=1.0 if softcap else 0.0, window_left=0 if window else -1,
                  sinks=sinks, varlen=(1,) if varlen else (), head_dim_v=head_dim_v)
    return instantiate(get_problem(FAMILY), Config(config_items), shape).digest


def _digest_now(config: dict, shape) -> str:
    from ..space.searchspace import Config

    return _current_digest(Config.from_dict(config).items, shape.dtype, shape.head_dim, shape.causal, shape.has_softcap,
                           shape.has_window, shape.sinks, shape.is_varlen, shape.head_dim_v)


def clear_caches() -> None:
    """Forget loaded spaces and template digests (after a space or kernel file changed in this process)."""
    _space.cache_clear()
    _current_digest.cache_clear()


def unusable_reason(entry: Entry, shape) -> str | None:
    """Why `entry`'s config must not run `shape` (not admitted by its space there, or a kernel source that
    is not the one measured); None where it may."""
    from ..problems import get_problem

    problem = get_problem(FAMILY)
    try:
        space = _space(entry.space)
        # A knob the space gained after the run (Problem.late_knobs), absent from its config, is at the value that
        # leaves the source as it was: the digest check below still holds the entry to the kernel it measured.
        late = {k for k, v in problem.late_knobs.items() if k not in entry.config and _default_is(space, k, v)}
        if set(entry.config) | late != set(space.param_names()):
            return (f"its config names {', '.join(sorted(entry.config))}, not the parameters of space "
                    f"{entry.space!r} ({', '.join(sorted(space.param_names()))})")
        failed = space.violations(space.config(entry.config), problem.context(shape))
    except UsageError as e:
        return f"its config cannot be checked against space {entry.space!r}: {e}"
    if failed:
        return f"not admitted by space {entry.space!r} on {shape.spec}: {failed[0]}"
    now = _digest_now(entry.config, shape)
    if now != entry.provenance["source_digest"]:
        return (f"stale: the kernel source changed since run {entry.provenance['run']} measured it "
                f"(measured {entry.provenance['source_digest']}, now {now})")
    return None


def stale_reason(entry: Entry) -> str | None:
    """Why `entry` is stale: the kernel source today's template gives its config on its measured shape is not the one
    it measured (or none at all); None where it is the same. A stale entry is never used (unusable_reason) and
    `evotune tune --stale` re-measures it: a run's archive keeps the code it measured for replay and export, but
    the op compiles today's template, so only a measurement of today's source may route a call to it."""
    from ..problems.shapes import Shape

    recorded = entry.provenance["source_digest"]
    try:
        now = _digest_now(entry.config, Shape.from_dict(entry.shape))
    except (UsageError, KeyError, TypeError, ValueError) as e:
        return f"stale: its config no longer instantiates ({e})"
    if now != recorded:
        return (f"stale: the kernel source changed since run {entry.provenance['run']} measured it "
                f"(measured {recorded}, now {now})")
    return None


def stale_entries(table: Table) -> list[tuple[Entry, str]]:
    """The table's stale entries with why (stale_reason), in key order."""
    found = [(e, stale_reason(e)) for e in sorted(table.entries, key=lambda e: e.key)]
    return [(e, why) for e, why in found if why]


def _default_is(space, name: str, value) -> bool:
    """Whether `space` has a parameter `name` whose default is `value` (of its type)."""
    default = space.default_config().as_dict().get(name, _MISSING)
    return type(default) is type(value) and default == value


_MISSING = object()


def candidates(table: Table, key: TableKey) -> list[Entry]:
    """The entries `select` may use for `key`, in the order it tries them."""
    group = [e for e in table.entries if e.key.group() == key.group() and key.distance(e.key) <= MAX_BUCKET_DISTANCE]
    return sorted(group, key=lambda e: (key.distance(e.key), -e.key.seq_q_bucket, -e.key.seq_k_bucket,
                                        -e.key.bh_bucket, e.key.spec()))


def select(table: Table, key: TableKey, shape, allow_nearest: bool = False) -> Selection:
    """The entry and route for a call of `shape` whose key is `key` (rules in the module docstring). A nearest
    entry routes to SDPA, named in the reason, unless `allow_nearest` (the user's opt-in: nearest_allowed())."""
    skipped = []
    for entry in candidates(table, key):
        why = unusable_reason(entry, shape)
        if why:
            skipped.append((entry.key.spec(), why))
            continue
        if entry.key == key:
            return Selection(entry, entry.route, "exact", entry.reason, tuple(skipped))
        if allow_nearest:
            return Selection(entry, entry.route, "nearest",
                             f"nearest tuned bucket {entry.key.spec()} (nearest allowed, unverified at this key): "
                             f"{entry.reason}", tuple(skipped))
        return Selection(entry, "sdpa", "nearest", _unverified_reason(entry, shape), tuple(skipped))
    if skipped:
        reason = "no usable entry: " + "; ".join(f"{spec}: {why}" for spec, why in skipped)
    elif table.entries and not table.has_gpu(key.gpu, key.cc):
        reason = (f"{table.path or 'the tuning table'} has entries for {', '.join(table.gpus())} only, "
                  f"none for {key.gpu} (sm {key.cc})")
    else:
        reason = f"no entry within {MAX_BUCKET_DISTANCE} bucket doublings of {key.spec()}"
    return Selection(None, "sdpa", "none", reason, tuple(skipped))


def _unverified_reason(entry: Entry, shape) -> str:
    """Why a nearest entry does not run a call of `shape`: where it was measured, what it measured there,
    and what would measure this key."""
    from ..problems.shapes import Shape

    there = Shape.from_dict(entry.shape).spec
    ours = f"evotune {entry.evotune_us:.2f} us"
    measured = (f"{ours} vs {entry.sdpa['backend']} {entry.sdpa['time_us']:.2f} us" if entry.sdpa
                else f"{ours} with no SDPA time beside it")
    return (f"unverified at this key: the nearest tuned key {entry.key.spec()} ({there}) measured {measured} there "
            f"(route {entry.route} there); tune this key: evotune tune --shape {shape.spec} "
            f"(or {NEAREST_ENV}=1 to use the nearest entry unverified)")


# --------------------------------------------------------------------------- building from runs


@dataclass(frozen=True)
class BuildNote:
    """What build_table did with one run: "added" (a new key), "replaced" (the existing table's entry for the
    key), "dropped" (another given run won the key) or "skipped" (the run gives no entry: `reason` says why)."""

    run: str
    action: str
    key: str | None
    reason: str


def build_table(run_paths, existing: Table | None = None, bench_paths=()) -> tuple[Table, list[BuildNote]]:
    """A table with one entry per key from the given run folders (or names under runs_dir()), on top of
    `existing`. `bench_paths` are `evotune bench --out` records: one of a run's best config gives the
    entry its same-process evotune and SDPA times. Among the given runs, the one with the larger
    measured speedup over SDPA wins a key (a measured one beats an unmeasured one; ties: the later);
    a given run replaces what `existing` says for its key. Returns the table and one note per run."""
    benches = [_read_bench(p) for p in bench_paths]
    results = [_entry_from_run(ref, benches) for ref in run_paths]
    winners: dict[TableKey, Entry] = {}
    for entry, _ in results:
        if entry is not None and (entry.key not in winners or _rank(entry) >= _rank(winners[entry.key])):
            winners[entry.key] = entry
    old = {e.key: e for e in (existing.entries if existing else ())}
    notes = []
    for entry, note in results:
        if entry is None:
            notes.append(note)
        elif winners[entry.key] is not entry:
            winner = winners[entry.key].provenance["run"]
            notes.append(replace(note, action="dropped", reason=f"run {winner} won this key: {note.reason}"))
        else:
            notes.append(replace(note, action="replaced" if entry.key in old else "added"))
    merged = {**old, **winners}
    return Table(tuple(sorted(merged.values(), key=lambda e: e.key)), existing.path if existing else None), notes


def _rank(entry: Entry) -> tuple:
    """How strongly an entry's measurement speaks for its key: of the kernel source compiled now, then
    with an SDPA time beside it, then by its speedup over SDPA."""
    from ..problems.shapes import Shape

    current = _digest_now(entry.config, Shape.from_dict(entry.shape))
    speedup = entry.speedup()
    return (entry.provenance["source_digest"] == current, speedup is not None, speedup or 0.0)


def _resolve_run(ref):
    from .runs import Run, runs_dir

    path = Path(ref)
    if not path.is_dir() and os.sep not in str(ref):
        path = runs_dir() / str(ref)
    if not (path / "meta.json").is_file():
        raise UsageError(f"{ref}: not a run folder (no meta.json in {path})")
    return Run(path)


def _entry_from_run(ref, benches: list[dict]) -> tuple[Entry | None, BuildNote]:
    """The entry one run gives, or None and the note saying why it gives none."""
    from ..space.searchspace import Config
    from ..build.template import instantiate

    run = _resolve_run(ref)
    meta = run.meta()
    if meta.get("family") != FAMILY:
        return None, BuildNote(run.run_id, "skipped", None, f"family {meta.get('family')!r}: the table holds {FAMILY} runs")
    problem, shape = run.problem_and_shape()
    device = meta.get("device")
    if not isinstance(device, dict) or not isinstance(device.get("name"), str) or not isinstance(device.get("sm"), str):
        return None, BuildNote(run.run_id, "skipped", None, f"{run.path / 'meta.json'} records no device name and sm")
    best = final_best(run.trials(), read_beside(run.path))
    if best is None:
        return None, BuildNote(run.run_id, "skipped", None, "no trial passed the correctness gate")
    key = TableKey.for_shape(shape, device["name"], device["sm"])
    now = instantiate(problem, Config.from_dict(best["config"]), shape).digest
    timing = _timing(run, meta, best, benches, now)
    route, reason = _route(run.run_id, timing, now)
    provenance = {"run": run.run_id, "trial": best["number"], "git_sha": str(meta.get("git_sha") or "unknown"),
                  "evotune_version": str((meta.get("versions") or {}).get("evotune") or "unknown"),
                  "device": device, "source_digest": timing["digest"]}
    entry = Entry(key, dict(best["config"]), _space_ref(meta, problem), shape.as_dict(), timing["evotune_us"],
                  timing["sdpa"], route, reason, timing["evidence"], provenance)
    return entry, BuildNote(run.run_id, "added", key.spec(), reason)


def _space_ref(meta: dict, problem) -> str:
    """The run's space as the table names it: a built-in space's name, else the file's absolute path."""
    from ..space.reader import profile_of
    from ..space.searchspace import builtin_names

    recorded = meta.get("space")
    if not recorded:
        return problem.default_space
    file, profile = profile_of(recorded)  # a profile, or the file a profile was (attention-hopper.yaml)
    path = Path(file)
    name = f"{path.stem}:{profile}" if profile else path.stem
    if path.suffix in (".yaml", ".yml") and path.parent.name in ("search_spaces", "") and name in builtin_names():
        return name
    return str(path.resolve()) + (f"#{profile}" if profile else "")


def _timing(run, meta: dict, best: dict, benches: list[dict], digest_now: str) -> dict:
    """evotune's time, the best SDPA time measured beside it (or None), the digest of the kernel source
    timed, and the evidence: a bench record of this run's best config (same process) first, then the
    run's own baselines.json, else the trial's time alone."""
    bench = _matching_bench(run.run_id, meta, best, benches, digest_now)
    if bench is not None:
        rows = bench["rows"]
        return {"evotune_us": float(rows[0]["time_us"]), "sdpa": _fastest(rows[1:]), "digest": bench["source_digest"],
                "evidence": {"kind": "bench", "file": bench["_file"]}}
    trial = {"evotune_us": float(best["result"]["time_us"]), "digest": str(best.get("source_digest") or "unknown")}
    path = run.path / BASELINES_FILE
    if path.is_file():
        trial, found = _run_baselines(_read_json(path, "baselines"), best, trial)
        rows = [{"name": name, **row} for name, row in found.items() if isinstance(row, dict)]
        rows = [{**r, "passed": (r.get("verification") or {}).get("passed")} for r in rows]
        return {**trial, "sdpa": _fastest(rows), "evidence": {"kind": "run", "file": str(path)}}
    return {**trial, "sdpa": None, "evidence": {"kind": "none", "file": None}}


def _run_baselines(obj: dict, best: dict, trial: dict) -> tuple[dict, dict]:
    """(evotune's time and digest, {backend: row}) from a run's baselines.json: the record
    search.finalists.measure_beside_best writes (where it re-timed this best trial beside the baselines in one
    process and the kernel passed again, that time is evotune's), or a bare {backend: row} map."""
    if obj.get("kind") != BESIDE_KIND:
        return trial, obj
    ours, timed = obj.get("evotune") or {}, obj.get("best") or {}
    ours_us, paired = beside_times(obj)
    if (timed.get("number") == best["number"] and ours.get("status") == "ok"
            and isinstance(ours_us, (int, float)) and isinstance(timed.get("source_digest"), str)):
        trial = {"evotune_us": float(ours_us), "digest": timed["source_digest"]}
    found = obj.get("baselines")
    if not isinstance(found, dict):
        return trial, {}
    return trial, {name: ({**row, "time_us": paired[name]} if name in paired and isinstance(row, dict) else row)
                   for name, row in found.items()}


def beside_times(obj: dict) -> tuple[float | None, dict[str, float]]:
    """(evotune's time, {backend: time}) of a baselines.json record: the interleaved head-to-head's medians
    where it has one (version 2: one kernel, "evotune"; version 3: the finalists, each by its label, the
    best's being evotune's time), else evotune's solo time and no backend times (the rows' own solo times
    stand)."""
    timings = (obj.get("head_to_head") or {}).get("timings") or {}
    paired = {name: float(t["median_us"]) for name, t in timings.items()
              if isinstance(t, dict) and isinstance(t.get("median_us"), (int, float))}
    kernels = {f.get("label") for f in obj.get("finalists") or [] if isinstance(f, dict)}
    ours = paired.pop((obj.get("best") or {}).get("label") or "evotune", None)
    paired = {name: t for name, t in paired.items() if name not in kernels}
    if ours is None:
        return (obj.get("evotune") or {}).get("time_us"), {}
    return ours, paired


def _fastest(rows: list[dict]) -> dict | None:
    """The fastest available baseline row that passed the gate, as {"backend", "time_us"}."""
    ok = [r for r in rows if r.get("available") and r.get("passed") and isinstance(r.get("time_us"), (int, float))]
    if not ok:
        return None
    top = min(ok, key=lambda r: r["time_us"])
    return {"backend": str(top["name"]), "time_us": float(top["time_us"])}


def _route(run_id: str, timing: dict, digest_now: str) -> tuple[str, str]:
    ours, sdpa, evidence = timing["evotune_us"], timing["sdpa"], timing["evidence"]
    if timing["digest"] != digest_now:
        return "sdpa", (f"stale: run {run_id} timed kernel source {timing['digest']}, the template now gives "
                        f"{digest_now}; re-measure with `evotune bench best --run {run_id} --out FILE` and rebuild "
                        f"with --bench FILE")
    if sdpa is None:
        return "sdpa", (f"unverified: run {run_id} measured no SDPA backend beside evotune's {ours:.2f} us; measure "
                        f"both with `evotune bench best --run {run_id} --out FILE` and rebuild with --bench FILE")
    where = f"bench {evidence['file']}" if evidence["kind"] == "bench" else f"run {run_id}"
    versus = f"evotune {ours:.2f} us vs {sdpa['backend']} {sdpa['time_us']:.2f} us ({where})"
    if ours < sdpa["time_us"]:
        return "evotune", f"faster: {versus}, {sdpa['time_us'] / ours:.2f}x"
    return "sdpa", f"slower: {versus}, {ours / sdpa['time_us'] - 1:+.1%} time"


def _read_json(path, what: str):
    if not os.path.lexists(path):
        raise UsageError(f"{path}: no such {what} file")
    try:
        obj = json.loads(read_input(path, f"{what} file", MAX_JSON_BYTES).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UsageError(f"{path}: not a readable JSON {what} file ({e})") from None
    if not isinstance(obj, dict):
        raise UsageError(f"{path}: not a {what} record (expected an object, got {_kind(obj)})")
    return obj


def _read_bench(path) -> dict:
    """An `evotune bench --out` record, checked for what build_table reads."""
    obj = _read_json(path, "bench")
    try:
        for name, kind in (("source", "object"), ("config", "object"), ("shape_dict", "object"), ("device", "object"),
                           ("rows", "list"), ("source_digest", "string")):
            _expect(obj.get(name), kind, name)
        for i, row in enumerate(obj["rows"]):
            _expect(row, "object", f"rows[{i}]")
            _expect(row.get("name"), "string", f"rows[{i}].name")
        if not obj["rows"] or obj["rows"][0]["name"] != "evotune":
            raise _Fault("rows[0] is not the evotune kernel's row")
    except _Fault as fault:
        raise UsageError(f"{path}: not a bench record: {fault}") from None
    return {**obj, "_file": str(path)}


def _matching_bench(run_id: str, meta: dict, best: dict, benches: list[dict], digest_now: str) -> dict | None:
    """The bench record that timed this run's best config on its shape and GPU and passed the gate,
    preferring one of the kernel source the op would compile now (then the last given)."""
    device_name = (meta.get("device") or {}).get("name")
    found = [b for b in benches
             if b["source"].get("run") == run_id and b["source"].get("trial") in ("best", best["number"])
             and b["config"] == best["config"] and b["shape_dict"] == meta.get("shape")
             and b["device"].get("name") == device_name
             and b["rows"][0].get("passed") and isinstance(b["rows"][0].get("time_us"), (int, float))]
    if not found:
        return None
    current = [b for b in found if b["source_digest"] == digest_now]
    return (current or found)[-1]


# --------------------------------------------------------------------------- the CLI's workflow (table build, tune)

SHAPES_KIND = "evotune-attention-shapes"  # what evotune.torch.record_shapes() saves
SHAPES_VERSIONS = (1, 2)  # 2: a row may name its family ("attention-decode"); rows without one are attention's
DECODE_FAMILY = "attention-decode"


def family_runs(root: Path | None = None, families: tuple[str, ...] = (FAMILY,)) -> list[Path]:
    """Every run folder of the attention family (or of `families`) under the runs dir (or `root`), oldest name
    first."""
    from .runs import runs_dir

    root = root or runs_dir()
    found = []
    for meta in sorted(root.glob("*/meta.json")) if root.is_dir() else ():
        try:
            family = json.loads(meta.read_text(encoding="utf-8")).get("family")
        except (OSError, ValueError, AttributeError):
            continue  # a damaged run: `evotune runs` says what is wrong with it
        if family in families:
            found.append(meta.parent)
    return found


def update_table(run_paths, path, bench_paths=()) -> tuple[Table, list[BuildNote], Path]:
    """Build the table at `path` from runs on top of what it holds (a new file where none is), and save it."""
    path = Path(path)
    existing = load_table(path) if path.exists() else None
    table, notes = build_table(run_paths, existing, bench_paths)
    return table, notes, save_table(table, path)


def note_line(note: BuildNote, table: Table) -> str:
    """One line per build note: what happened to the run and, for an entry, its route and why."""
    if note.action == "skipped":
        return f"skipped {note.run}: {note.reason}"
    if note.action == "dropped":
        return f"dropped {note.run}: {note.reason}"
    entry = next((e for e in table.entries if e.key.spec() == note.key), None)
    route = entry.route if entry is not None else "?"
    return f"{note.action} {note.key} from run {note.run}: route {route}: {note.reason}"


def read_shapes_file(path) -> list[str]:
    """The attention `--shape` spellings a `record_shapes()` file holds (rows the kernel has no shape for are left
    out); UsageError naming the file where it is not such a file or holds none of any family."""
    specs = read_recorded_shapes(path)
    return specs[FAMILY]


def read_recorded_shapes(path) -> dict[str, list[str]]:
    """{family: its distinct `--shape` spellings, in the order recorded} of a `record_shapes()` file, for the
    attention family and the decode family (DECODE_FAMILY); UsageError naming the file where it is not such a file,
    a row names another family, or it holds no spelling at all."""
    obj = _read_json(path, "shapes")
    if obj.get("kind") != SHAPES_KIND:
        raise UsageError(f"{path}: not a shapes record (kind {json.dumps(obj.get('kind'))}, expected "
                         f"{SHAPES_KIND!r}, as evotune.torch.record_shapes() saves)")
    if obj.get("version") not in SHAPES_VERSIONS:
        raise UsageError(f"{path}: shapes record version {json.dumps(obj.get('version'))} is not supported "
                         f"(this evotune reads versions {', '.join(map(str, SHAPES_VERSIONS))})")
    rows = obj.get("shapes")
    if not isinstance(rows, list):
        raise UsageError(f"{path}: shapes: expected a list, got {_kind(rows)}")
    specs: dict[str, list[str]] = {FAMILY: [], DECODE_FAMILY: []}
    for i, row in enumerate(rows):
        spec = row.get("shape") if isinstance(row, dict) else None
        if not isinstance(row, dict) or not (spec is None or isinstance(spec, str)):
            raise UsageError(f"{path}: shapes[{i}]: expected an object whose shape is a string or null")
        family = row.get("family", FAMILY)
        if family not in specs:
            raise UsageError(f"{path}: shapes[{i}]: family {json.dumps(family)} is not one tune takes "
                             f"({FAMILY} or {DECODE_FAMILY})")
        if spec:
            specs[family].append(spec)
    if not any(specs.values()):
        raise UsageError(f"{path}: records no shape evotune's kernels can run ({len(rows)} calls recorded, "
                         f"none with a --shape spelling): nothing to tune")
    return {family: list(dict.fromkeys(found)) for family, found in specs.items()}


def tune_plan(specs) -> tuple[list, list[str]]:
    """(the shapes to search, one per distinct key, in the order given; a note per shape left out because
    an earlier one has its key). The GPU part of the key is the machine's, the same for all."""
    from ..problems.shapes import parse_shape

    chosen: dict[TableKey, object] = {}
    notes = []
    for spec in specs:
        shape = parse_shape(spec)
        key = TableKey.for_shape(shape, "", "")
        if key in chosen:
            notes.append(f"{shape.spec} has the key of {chosen[key].spec}: tuned once, as {chosen[key].spec}")
        else:
            chosen[key] = shape
    if not chosen:
        raise UsageError("nothing to tune: give --shape SPEC (repeatable) or --shapes FILE")
    return list(chosen.values()), notes


def tune_keys(shapes, search_one, progress=None) -> list[dict]:
    """Search each shape with `search_one(shape) -> run id`, saying `progress(i, n, shape)` first. A key whose
    search fails (an EvotuneError other than no GPU) is reported and the next key goes on; returns one
    {"shape", "run", "error"} per shape."""
    from ..errors import EvotuneError, NoGPUError

    outcomes = []
    for i, shape in enumerate(shapes, 1):
        if progress is not None:
            progress(i, len(shapes), shape)
        try:
            outcomes.append({"shape": shape.spec, "run": search_one(shape), "error": None})
        except NoGPUError:
            raise
        except EvotuneError as e:
            outcomes.append({"shape": shape.spec, "run": None, "error": str(e)})
    return outcomes


__all__ = ["TABLE_VERSION", "MAX_BUCKET_DISTANCE", "NEAREST_ENV", "TableKey", "Entry", "Table", "Selection",
           "BuildNote", "seq_bucket", "bh_bucket", "nearest_allowed", "default_table_path", "parse_table", "load_table",
           "save_table", "select", "candidates",
           "unusable_reason", "stale_reason", "stale_entries", "build_table", "clear_caches", "family_runs", "update_table", "note_line",
           "read_shapes_file", "read_recorded_shapes", "tune_plan", "tune_keys"]
