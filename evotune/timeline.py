"""Where a command's wall time goes: named phases (seconds and count), measured from the process's start.

A search records one timeline per invocation in its run folder (timeline.jsonl, one line each) and
prints it in one line at the end, so "the first search took 47 s" becomes "start-up 2.1 s, GPU worker
3.4 s, enumerating the space 0.3 s, compile wait 5.2 s, ...". Phases may nest (the loop's phases sit
inside "search"); `as_dict` keeps them flat, in first-seen order, and `wall_s` is the whole.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

TIMELINE_FILE = "timeline.jsonl"


def process_start() -> float:
    """The epoch second this process started (Linux: /proc), so interpreter start-up and imports count;
    elsewhere the moment this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22 of proc(5): start time in clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - started_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(age, 0.0)
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_IMPORTED = time.time()


class Timeline:
    """Named phases of one command: total seconds and how many times each ran."""

    def __init__(self, origin: float | None = None):
        self.origin = process_start() if origin is None else origin
        self.phases: dict[str, list[float]] = {}   # name -> [seconds, count]
        self.marks: dict[str, float] = {}          # name -> seconds after the origin, first occurrence

    def add(self, name: str, seconds: float, count: int = 1) -> None:
        entry = self.phases.setdefault(name, [0.0, 0])
        entry[0] += seconds
        entry[1] += count

    @contextmanager
    def phase(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def mark(self, name: str) -> None:
        """Note the first time `name` happened (e.g. "first result"), in seconds after the origin."""
        self.marks.setdefault(name, time.time() - self.origin)

    def since_start(self) -> float:
        return time.time() - self.origin

    def as_dict(self) -> dict:
        return {"started": self.origin, "wall_s": round(self.since_start(), 3),
                "phases": {k: {"s": round(v[0], 4), "count": v[1]} for k, v in self.phases.items()},
                "marks": {k: round(v, 3) for k, v in self.marks.items()}}

    @staticmethod
    def line_of(d: dict) -> str:
        """`wall 18.2 s: start-up 2.1 s, ..., evaluate 3.0 s (gpu: verify 1.2 s, ...)` from as_dict(): phases of
        0.05 s or more in first-seen order; `gpu: ...` phases (inside the worker) in brackets after "evaluate"."""
        def spell(name, entry):
            return f"{name} {entry['s']:.1f} s" + (f" x{entry['count']}" if entry["count"] > 1 else "")

        phases = {k: v for k, v in d["phases"].items() if v["s"] >= 0.05}
        inner = [spell(k, v) for k, v in phases.items() if k.startswith("gpu: ")]
        parts = []
        for name, entry in phases.items():
            if not name.startswith("gpu: "):
                parts.append(spell(name, entry) + (f" ({', '.join(inner)})" if name == "evaluate" and inner else ""))
        return f"wall {d['wall_s']:.1f} s: " + ", ".join(parts)

    def append_to(self, folder: str | os.PathLike, **extra) -> Path:
        """One line more in folder/timeline.jsonl (a resumed run has one line per invocation)."""
        path = Path(folder) / TIMELINE_FILE
        with open(path, "a") as f:
            f.write(json.dumps({**self.as_dict(), **extra}) + "\n")
        return path

