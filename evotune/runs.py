"""Run folders: runs/<run-id>/ with meta.json, trials.jsonl (one line per finished
trial, flushed as it happens), the Optuna study (SQLite), pareto.json and best.json.

Records are append-only: a killed run loses at most the trial in flight, and
`--resume` continues from what trials.jsonl and the study hold.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from . import __version__
from .errors import EvotuneError, UsageError
from .template import REPO_ROOT

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def runs_dir() -> Path:
    return Path(os.environ.get("EVOTUNE_RUNS", REPO_ROOT / "runs"))


def git_sha() -> str:
    """Short sha of the checkout (with -dirty); EVOTUNE_GIT_SHA names it where the tree has no .git (a copied tree)."""
    if os.environ.get("EVOTUNE_GIT_SHA"):
        return os.environ["EVOTUNE_GIT_SHA"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
        sha = out.stdout.strip() if out.returncode == 0 else "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty and sha != "unknown" else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def new_run_id(shape_spec: str) -> str:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{re.sub(r'[^A-Za-z0-9]+', '-', shape_spec).strip('-')}"


class Run:
    def __init__(self, path: Path):
        self.path = Path(path)

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def storage_url(self) -> str:
        return f"sqlite:///{self.path / 'study.db'}"

    @property
    def trials_path(self) -> Path:
        return self.path / "trials.jsonl"

    # ---------------------------------------------------------------- create / open
    @classmethod
    def create(cls, name: str | None, meta: dict) -> "Run":
        if name is None:
            name = new_run_id(meta.get("shape_spec", "run"))
        path = cls.check_new_name(name)
        path.mkdir(parents=True)
        run = cls(path)
        run.write_json("meta.json", {**meta, "run_id": name, "created": dt.datetime.now().isoformat(timespec="seconds")})
        run.trials_path.touch()
        return run

    @staticmethod
    def check_new_name(name: str) -> Path:
        """The folder a new run of this name would get; UsageError if the name is bad or taken."""
        if not _NAME_RE.match(name):
            raise UsageError(f"run name {name!r}: use letters, digits, '.', '_' and '-' (at most 100)")
        path = runs_dir() / name
        if path.exists():
            raise UsageError(f"run {name!r} already exists in {runs_dir()}; use --resume to continue it or pick another --run")
        return path

    @classmethod
    def open(cls, name: str | None) -> "Run":
        """An existing run by name; None or 'latest' is the most recently changed one."""
        root = runs_dir()
        if name in (None, "latest"):
            candidates = [p for p in root.glob("*/meta.json")] if root.exists() else []
            if not candidates:
                raise UsageError(f"no runs in {root}; start one with `evotune search`")
            return cls(max(candidates, key=lambda p: (p.parent / "trials.jsonl").stat().st_mtime
                           if (p.parent / "trials.jsonl").exists() else p.stat().st_mtime).parent)
        path = root / name
        if not (path / "meta.json").exists():
            known = sorted(p.parent.name for p in root.glob("*/meta.json")) if root.exists() else []
            hint = f"; known: {', '.join(known[-8:])}" if known else ""
            raise UsageError(f"no run named {name!r} in {root}{hint}")
        return cls(path)

    # ---------------------------------------------------------------- records
    def meta(self) -> dict:
        return self.read_json("meta.json")

    def write_json(self, filename: str, obj) -> None:
        tmp = self.path / f".{filename}.tmp"
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.path / filename)  # never a half-written file

    def read_json(self, filename: str):
        try:
            return json.loads((self.path / filename).read_text())
        except FileNotFoundError:
            raise EvotuneError(f"{self.path / filename}: missing") from None
        except json.JSONDecodeError as e:
            raise EvotuneError(f"{self.path / filename}: not valid JSON ({e})") from None

    def append_trial(self, record: dict) -> None:
        line = json.dumps(record, sort_keys=True) + "\n"
        with open(self.trials_path, "ab+") as f:
            # A run killed mid-write leaves a torn last line: start on a fresh line
            # so this record is not glued to it and lost with it.
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    line = "\n" + line
            f.write(line.encode())
            f.flush()
            os.fsync(f.fileno())

    def trials(self) -> list[dict]:
        """Every recorded trial; a torn last line (killed mid-write) is skipped."""
        out = []
        if not self.trials_path.exists():
            return out
        for line in self.trials_path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def update_summary(self, records: list[dict] | None = None) -> dict | None:
        """Rewrite pareto.json and best.json from `records` (default: all of trials.jsonl); return the best or None."""
        if records is None:
            records = self.trials()
        front = pareto_front(records)
        self.write_json("pareto.json", front)
        top = best_record(records)
        if top is not None:
            self.write_json("best.json", top)
        return top

    def best(self) -> dict:
        top = best_record(self.trials())
        if top is None:
            raise EvotuneError(f"run {self.run_id!r} has no trial that passed the correctness gate")
        return top

    def trial(self, number: int) -> dict:
        for rec in self.trials():
            if rec.get("number") == number:
                return rec
        raise UsageError(f"run {self.run_id!r} has no trial number {number}")


def ok_records(records: list[dict]) -> list[dict]:
    return [r for r in records if (r.get("result") or {}).get("status") == "ok" and r.get("duplicate_of") is None]


def best_record(records: list[dict]) -> dict | None:
    """Fastest trial that passed the gate (ties: lower error, then earlier)."""
    ok = ok_records(records)
    if not ok:
        return None
    return min(ok, key=lambda r: (r["result"]["time_us"], r["result"]["max_abs"], r["number"]))


def pareto_front(records: list[dict]) -> list[dict]:
    """Non-dominated passing trials on (time_us, max_abs), fastest first."""
    ok = ok_records(records)
    front = []
    for r in ok:
        t, e = r["result"]["time_us"], r["result"]["max_abs"]
        dominated = any(
            (o["result"]["time_us"] <= t and o["result"]["max_abs"] <= e)
            and (o["result"]["time_us"] < t or o["result"]["max_abs"] < e)
            for o in ok
        )
        if not dominated:
            front.append(r)
    return sorted(front, key=lambda r: (r["result"]["time_us"], r["result"]["max_abs"]))


def base_meta(command_line: list[str] | None = None) -> dict:
    from .compile import toolchain

    try:
        tc = toolchain()
    except Exception:  # NVRTC missing: the compile step will say so
        tc = {}
    # `python -m evotune` puts the package path in argv[0]: record what a user would type.
    argv = command_line if command_line is not None else ["evotune"] + sys.argv[1:]
    return {
        "command_line": " ".join(argv),
        "git_sha": git_sha(),
        "versions": {"evotune": __version__, "python": sys.version.split()[0], **tc},
    }
