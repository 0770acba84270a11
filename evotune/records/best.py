"""Which trial of a run is its best: the fastest recorded one, or the winner of the run's closing re-timing.

A search times each candidate once, alone, one after another. On the H100 two such timings of one config
differ by 3-6% (the clocks and power state left by whatever ran before), so among candidates that close,
the fastest recorded time names a winner by chance as often as by merit: a llama-4k search recorded a one-tile
config fastest that a same-process probe then measured slower than a persistent one
(docs/experiments/CHANGELOG.md: llama-4k-h100-persistent).

So a search ends by re-timing its finalists (`finalists`: up to FINALISTS distinct trials whose recorded
time is within FINALIST_WITHIN of the fastest) interleaved in one GPU process, beside the SDPA backends
(search.finalists.measure_beside_best writes that job's record as the run's baselines.json). The finalist with
the fastest interleaved median is the run's best (`final_best`): what `replay best`, `export best`,
`bench best` and the tuning table take. Where baselines.json re-timed a different set of finalists than
the records name now (a resumed search found a new contender and has not re-timed yet), or there is no
such record, the best is the fastest recorded trial, as before.
"""

from __future__ import annotations

import json
from pathlib import Path

BASELINES_FILE = "baselines.json"   # a run's SDPA times measured beside its finalists (search.finalists.measure_beside_best)
BESIDE_KIND = "evotune-run-baselines"
# Six: on the H100's large presets the six fastest recorded trials lay within 4% of each other, the size of
# the timing drift, and re-timing one of them costs about 11 replays x 10 rounds (0.2 s at 2 ms a call).
FINALISTS = 6
# Only trials whose recorded time is within 10% of the fastest: further off than twice the drift, a trial
# is not a contender, and re-timing it would only lengthen the closing job.
FINALIST_WITHIN = 0.10


def ok_records(records: list[dict]) -> list[dict]:
    return [r for r in records if (r.get("result") or {}).get("status") == "ok" and r.get("duplicate_of") is None]


def _speed_key(r: dict):
    return (r["result"]["time_us"], r["result"]["max_abs"], r["number"])


def best_record(records: list[dict]) -> dict | None:
    """Fastest trial that passed the gate (ties: lower error, then earlier)."""
    ok = ok_records(records)
    if not ok:
        return None
    return min(ok, key=_speed_key)


def finalists(records: list[dict], count: int = FINALISTS, within: float = FINALIST_WITHIN) -> list[dict]:
    """The trials a search re-times at its end: the fastest passing ones, fastest first, at most `count`,
    each within `within` (a fraction) of the fastest recorded time, one per kernel source (two configs
    that instantiate the same source are one contender)."""
    ok = sorted(ok_records(records), key=_speed_key)
    if not ok or count < 1:
        return []
    limit = ok[0]["result"]["time_us"] * (1.0 + within)
    out, sources = [], set()
    for r in ok:
        if r["result"]["time_us"] > limit or len(out) == count:
            break
        source = r.get("source_digest") or r.get("digest")
        if source in sources:
            continue
        sources.add(source)
        out.append(r)
    return out


def _identity(r: dict) -> tuple:
    return (r.get("number"), r.get("digest"))


def read_beside(run_path: Path) -> dict | None:
    """The run's baselines.json where search.finalists.measure_beside_best wrote it (None where absent, unreadable or
    foreign: a bare {backend: row} map from before that job)."""
    try:
        obj = json.loads((Path(run_path) / BASELINES_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) and obj.get("kind") == BESIDE_KIND else None


def rule_of(beside: dict | None) -> tuple[int, float] | None:
    """(count, within) of the finalists a baselines.json record re-timed (None: it re-timed only a best)."""
    rule = (beside or {}).get("finalist_rule")
    if not isinstance(rule, dict):
        return None
    try:
        return int(rule["count"]), float(rule["within"])
    except (KeyError, TypeError, ValueError):
        return None


def same_finalists(beside: dict | None, records: list[dict]) -> bool:
    """Whether `beside` re-timed exactly the finalists `records` name now (under the rule it recorded)."""
    rule = rule_of(beside)
    if rule is None:
        return False
    timed = [_identity(f) for f in beside.get("finalists") or [] if isinstance(f, dict)]
    return timed == [_identity(r) for r in finalists(records, *rule)]


def final_best(records: list[dict], beside: dict | None) -> dict | None:
    """The run's best: the finalist that `beside` (the run's baselines.json) timed fastest interleaved, where
    it re-timed exactly today's finalists and one of them passed; else the fastest recorded trial."""
    fallback = best_record(records)
    pick = (beside or {}).get("best") or {}
    if pick.get("interleaved_us") is None or not same_finalists(beside, records):
        return fallback
    for r in ok_records(records):
        if _identity(r) == _identity(pick):
            return r
    return fallback
