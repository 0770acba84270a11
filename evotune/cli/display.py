"""Progress of a search on the console: the live bar and best-so-far table, or a line per trial.

Part of the command line (rich); `evotune search` and `evotune tune` use it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from ..problems import FAMILIES, get_problem
from ..records.runs import best_record


@lru_cache(maxsize=1)
def _builtin_spellings() -> tuple[tuple[frozenset, dict], ...]:
    """Each built-in family's (knobs, spellings of them): Problem.knob_domains and Problem.knob_abbrev."""
    return tuple((frozenset(problem.knob_domains() or problem.knob_abbrev), dict(problem.knob_abbrev))
                 for problem in (get_problem(family) for family in FAMILIES))


def _abbrev_for(cfg: dict, family: Optional[str]) -> Optional[dict]:
    """The spellings of `cfg`'s knobs: its family's own where it is named; else those of the built-in family whose
    knobs hold all of the config's; None for a family of your own (every knob by its name)."""
    if family is not None:
        return dict(get_problem(family).knob_abbrev) if family in FAMILIES else None
    for knobs, abbrev in _builtin_spellings():
        if set(cfg) <= knobs:
            return abbrev
    return None


def cfg_short(cfg: dict, family: Optional[str] = None) -> str:
    """A config on one line, in its family's spelling (Problem.knob_abbrev): attention's "M128 N128 st3" only for
    attention's knobs, a family of your own's by their names ("block_m=128 block_n=128 stages=3")."""
    abbrev = _abbrev_for(cfg, family)
    if abbrev is None:
        return " ".join(f"{k}={v}" for k, v in cfg.items())
    parts = []
    for k, v in cfg.items():
        spelled = abbrev.get(k, k)
        parts.append((spelled[0] if v else spelled[1]) if isinstance(spelled, tuple) else f"{spelled}{v}")
    return " ".join(parts)


def best_table(best: Optional[dict], recent: list[dict], family: Optional[str] = None) -> Table:
    table = Table(title="best so far" if best else "no passing candidate yet", expand=False)
    for col in ("trial", "status", "time us", "max abs err", "regs", "config"):
        table.add_column(col)
    rows = ([best] if best else []) + [r for r in recent[-6:] if not best or r["number"] != best["number"]]
    for i, r in enumerate(rows):
        res = r["result"]
        t = f"{res['time_us']:.2f}" if res.get("time_us") else "-"
        e = f"{res['max_abs']:.2e}" if res.get("max_abs") is not None and res.get("max_abs") != float("inf") else "-"
        regs = str((res.get("resources") or {}).get("registers", "-"))
        status = res["status"] + (" (best)" if i == 0 and best else "") + (" dup" if r.get("duplicate_of") is not None else "")
        table.add_row(str(r["number"]), status, t, e, regs, cfg_short(r["config"], family))
    return table


def trial_line(record: dict, agent: str = "", family: Optional[str] = None) -> str:
    """One trial as a line (where no live table is drawn), its config in `family`'s spelling."""
    res = record["result"]
    t = f"{res['time_us']:.2f} us" if res.get("time_us") else res["message"][:80]
    who = f" {agent}" if agent else ""
    return f"trial {record['number']:4d}{who} {res['status']:<13} {t:<14} {cfg_short(record['config'], family)}"


class SearchDisplay:
    """A search's progress on stderr: on a terminal, a live bar with ETA over the best-so-far table;
    elsewhere a line per trial (none with --json). Used as a context manager: the live view is drawn inside.

    `records` are the run's records so far: a resumed run's bar starts at its counted trials. `family`: the
    searched family, whose spelling the configs take (a family of your own's knobs by their names, even where they
    are all attention's)."""

    def __init__(self, label: str, total: int, records: list[dict], json_out: bool, console: Console,
                 family: Optional[str] = None):
        self.console = console
        self.family = family
        self.json_out = json_out
        self.label = label
        self.said = ""
        self.recent: list[dict] = []
        self.best = best_record(records)
        self.progress = Progress(TextColumn("[bold]search[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=self.console)
        self.task = self.progress.add_task(label, total=total, completed=sum(1 for r in records if r.get("counted")))
        self.live = (Live(Group(self.progress), console=self.console, refresh_per_second=4)
                     if self.console.is_terminal and not json_out else None)

    def __enter__(self) -> SearchDisplay:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def rename(self, label: str) -> None:
        """The run's name, once it exists (the worker starts before a new run is created)."""
        self.label = label
        self.progress.update(self.task, description=label)

    def status(self, text: str) -> None:
        """What the search is doing while no result comes (starting the worker, compiling, warming up): beside
        the bar on a terminal, a line elsewhere (none with --json); "" clears it."""
        if text == self.said:
            return
        self.said = text
        self.progress.update(self.task, description=f"{self.label}: {text}" if text else self.label)
        if self.live is None and text and not self.json_out:
            self.console.print(f"search: {text}", markup=False, highlight=False)

    def show(self, record: dict, best: Optional[dict], agent: str = "") -> None:
        self.status("")
        self.recent.append(record)
        if record.get("counted"):
            self.progress.advance(self.task)
        if self.live is not None:
            self.live.update(Group(self.progress, best_table(best, self.recent, self.family)))
        elif not self.json_out:
            self.console.print(trial_line(record, agent, self.family), markup=False, highlight=False)

    def follow(self, records: list[dict]) -> None:
        """Show records read from the run's log, as several agents write it: the best so far is kept here."""
        for record in records:
            self.best = best_record([r for r in (self.best, record) if r is not None])
            self.show(record, self.best, record.get("agent", ""))
