"""Priors that ship: the winners and near-winners of recorded runs, per shape class, in one small versioned file.

`evotune priors build [RUN...]` distils run folders (meta.json, trials.jsonl, baselines.json) into
PACKAGED (package data, so a fresh install has it); a search asks first the priors its space admits on its
shape, nearest class first (search/warmstart.py). A prior is a proposal, never a result: one whose kernel source
changed since it was measured (its source_digest is not today's) is proposed all the same and re-measured like
any other candidate.

Shape class: GPU name, dtype, head dim, causal, K/V group (heads / kv_heads), and log2 buckets of seq_k and
batch*heads. Distance between classes: infinite unless family, dtype, head dim and causal agree; else the K/V
group's and the buckets' log2 distances added. At equal distance a prior measured on the search's GPU model comes
before one measured on another (`nearest_configs(gpu=)`): a config that won on an H100 is not wrong on another
GPU, only less likely to win there.

Stale priors (`stale_reason`): a prior whose recorded source digest is not the one today's template gives its config
is listed as stale by `evotune priors show`; it is proposed all the same, and re-measured like any candidate: the
search reads no prior's recorded time as a measurement (search/warmstart.py reads which configs won, not their times).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from ..errors import UsageError
from .best import final_best, finalists, ok_records, read_beside
from .runs import Run

KIND = "evotune-priors"
VERSION = 1
PACKAGED = Path(__file__).with_name("attention-priors.json")
PER_RUN = 5          # a run's best and near-winners, at most
NEAR = 0.05          # near-winner: recorded time within 5% of the run's fastest
MAX_BYTES = 4 << 20  # a priors file larger than this is not one evotune wrote
REBUILD = "evotune priors build -o evotune/records/attention-priors.json"


class DamagedPriors(UsageError):
    """A priors file that cannot be read as evotune writes it; the message names the file and what is wrong."""


def _log2_bucket(n) -> int:
    return int(math.floor(math.log2(max(1, int(n)))))


def shape_class(meta: dict) -> dict:
    """The class of a run's shape (from its meta.json) as a dict."""
    s, dev = meta.get("shape") or {}, meta.get("device") or {}
    heads = int(s.get("heads") or 1)
    kv = int(s.get("kv_heads") or heads)
    return {"family": meta.get("family", "attention"), "gpu": str(dev.get("name") or "unknown"),
            "dtype": s.get("dtype"), "head_dim": s.get("head_dim"), "causal": bool(s.get("causal")),
            "kv_group": max(1, heads // max(1, kv)), "seq_bucket": _log2_bucket(s.get("seq_k") or 1),
            "bh_bucket": _log2_bucket(int(s.get("batch") or 1) * heads)}


def class_of_shape(shape, family: str, gpu: str | None) -> dict:
    """The class of a Shape (problems.shapes) searched on GPU `gpu` (None: any)."""
    return shape_class({"family": family, "shape": shape.as_dict(), "device": {"name": gpu}})


def class_distance(a: dict, b: dict) -> float:
    """How far class `b` is from `a` (0: the same sizes; inf: another family, dtype, head dim or mask). The GPU is
    not a distance: nearest_configs ranks the search's own GPU model first among equals."""
    for field in ("family", "dtype", "head_dim", "causal"):
        if a.get(field) != b.get(field):
            return math.inf
    return (abs(math.log2(a["kv_group"]) - math.log2(b["kv_group"])) + abs(a["seq_bucket"] - b["seq_bucket"])
            + abs(a["bh_bucket"] - b["bh_bucket"]))


def _sdpa_fastest(beside: dict | None) -> dict | None:
    """The fastest SDPA backend that passed beside the finalists: its interleaved median where measured, else its
    solo time; as {"backend", "time_us"}."""
    from .tuning_table import beside_times

    if not beside or not isinstance(beside.get("baselines"), dict):
        return None
    _, paired = beside_times(beside)
    best = None
    for name, row in beside["baselines"].items():
        if not isinstance(row, dict) or not row.get("available") or not (row.get("verification") or {}).get("passed"):
            continue
        t = paired.get(name, row.get("time_us"))
        if isinstance(t, (int, float)) and (best is None or t < best["time_us"]):
            best = {"backend": str(name), "time_us": float(t)}
    return best


def run_priors(path: Path, per_run: int = PER_RUN, near: float = NEAR) -> dict | None:
    """One run's entry: its class, shape, space, git sha and its best and near-winners (each with config,
    source_digest, time_us and ratio to the fastest SDPA backend timed beside it, where one was); None where no
    trial passed."""
    run = Run(Path(path))
    meta, records = run.meta(), run.trials()
    ok = ok_records(records)
    if not ok:
        return None
    beside = read_beside(run.path)
    interleaved = {(f.get("number"), f.get("digest")): f.get("interleaved_us")
                   for f in (beside or {}).get("finalists") or [] if isinstance(f, dict)}
    best = final_best(records, beside)
    picked = [best] + [r for r in finalists(records, count=per_run, within=near) if r is not best]
    sources, out = set(), []
    for r in picked:
        source = r.get("source_digest") or r.get("digest")
        if source in sources or len(out) == per_run:
            continue
        sources.add(source)
        out.append(r)
    sdpa = _sdpa_fastest(beside)
    winners = []
    for rank, r in enumerate(out):
        t = interleaved.get((r.get("number"), r.get("digest")))
        t = float(t) if isinstance(t, (int, float)) else float(r["result"]["time_us"])
        winners.append({"rank": rank, "config": dict(r["config"]), "source_digest": r.get("source_digest"),
                        "trial": r.get("number"), "time_us": round(t, 4),
                        "ratio_to_sdpa": round(t / sdpa["time_us"], 4) if sdpa else None})
    return {"run": run.run_id, "git_sha": meta.get("git_sha", "unknown"), "class": shape_class(meta),
            "shape": meta.get("shape"), "space": meta.get("space"),
            "sdpa": {"backend": sdpa["backend"], "time_us": round(sdpa["time_us"], 4)} if sdpa else None,
            "winners": winners}


def build_priors(paths: list[Path], command: str) -> tuple[dict, list[str]]:
    """(the priors document of the runs at `paths`, one note per run left out and why)."""
    entries, notes = [], []
    for p in paths:
        try:
            entry = run_priors(Path(p))
        except UsageError as e:
            notes.append(f"{Path(p).name}: left out ({e})")
            continue
        if entry is None:
            notes.append(f"{Path(p).name}: left out (no trial passed the gate)")
            continue
        entries.append(entry)
    entries.sort(key=lambda e: (tuple(str(v) for v in e["class"].values()), e["run"]))
    doc = {"kind": KIND, "version": VERSION, "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": command, "rebuild": REBUILD,
           "sources": [{"run": e["run"], "git_sha": e["git_sha"]} for e in entries], "entries": entries}
    return doc, notes


def dump_priors(doc: dict) -> str:
    # One line per run: small (package data) and a readable diff when rebuilt.
    head = {k: v for k, v in doc.items() if k != "entries"}
    lines = [json.dumps(e, sort_keys=True, separators=(",", ":")) for e in doc["entries"]]
    return json.dumps(head, sort_keys=True)[:-1] + ', "entries": [\n' + ",\n".join(lines) + "\n]}\n"


def parse_priors(obj, where: str) -> dict:
    """`obj` checked as a priors document (DamagedPriors naming `where` and the fault otherwise)."""
    def bad(what: str):
        return DamagedPriors(f"priors file {where}: {what}; rebuild it with `{REBUILD}`")

    if not isinstance(obj, dict) or obj.get("kind") != KIND:
        raise bad(f"not an evotune priors file (kind is not {KIND!r})")
    if obj.get("version") != VERSION:
        raise bad(f"version {obj.get('version')!r}, this evotune reads version {VERSION}")
    entries = obj.get("entries")
    if not isinstance(entries, list):
        raise bad("'entries' is not a list")
    for i, e in enumerate(entries):
        if not (isinstance(e, dict) and isinstance(e.get("class"), dict) and isinstance(e.get("winners"), list)
                and all(isinstance(w, dict) and isinstance(w.get("config"), dict)
                        and isinstance(w.get("time_us"), (int, float)) for w in e["winners"])):
            raise bad(f"entry {i} lacks a class or winners with a config and a time")
        c = e["class"]
        if not all(isinstance(c.get(k), int) for k in ("kv_group", "seq_bucket", "bh_bucket")):
            raise bad(f"entry {i}: its class lacks kv_group, seq_bucket or bh_bucket")
    return obj


def load_priors(path: str | Path | None = None) -> dict:
    """The priors file at `path` (default: the packaged one), checked."""
    path = Path(path) if path is not None else PACKAGED
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise DamagedPriors(f"priors file {path}: cannot read it ({e.strerror or e})") from None
    if len(raw) > MAX_BYTES:
        raise DamagedPriors(f"priors file {path}: larger than {MAX_BYTES} bytes; not one evotune wrote")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise DamagedPriors(f"priors file {path}: not JSON ({e}); rebuild it with `{REBUILD}`") from None
    return parse_priors(obj, str(path))


def nearest_configs(doc: dict, target: dict, limit: int | None = None,
                    gpu: str | None = None) -> list[tuple[float, dict, dict]]:
    """(distance, entry, winner) of every prior in a class comparable with `target`, nearest class first, then (where
    `gpu` names the search's GPU model) those measured on it before those measured on another, then each entry's
    rank; each config once."""
    found = []
    for e in doc["entries"]:
        d = class_distance(target, e["class"])
        if d == math.inf:
            continue
        other = gpu is not None and e["class"].get("gpu") != gpu
        for w in e["winners"]:
            found.append((d, other, w.get("rank", 0), w.get("time_us", 0.0), e, w))
    found.sort(key=lambda t: t[:4])
    out, seen = [], set()
    for d, _, _, _, e, w in found:
        key = json.dumps(w["config"], sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        out.append((d, e, w))
    return out[:limit] if limit is not None else out


def stale_reason(entry: dict, winner: dict) -> str | None:
    """Why a prior is stale (its recorded source digest is not what today's template gives its config on its shape's
    class), or None where it is today's source."""
    from ..errors import EvotuneError
    from ..problems.shapes import Shape
    from .tuning_table import _digest_now

    recorded = winner.get("source_digest")
    if not recorded:
        return "no source digest recorded"
    family = entry["class"].get("family", "attention")
    try:
        if family != "attention":
            from ..build.template import instantiate
            from ..problems import get_problem
            from ..space.searchspace import Config

            problem = get_problem(family)
            now = instantiate(problem, Config.from_dict(winner["config"]), problem.shape_from_dict(entry["shape"])).digest
        else:
            now = _digest_now(winner["config"], Shape.from_dict(entry["shape"]))
    except (EvotuneError, KeyError, TypeError, ValueError) as e:
        return f"today's template cannot instantiate it ({e})"
    return None if now == recorded else f"measured source {recorded[:12]}, today's {now[:12]}"
