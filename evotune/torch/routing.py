"""Which kernel runs an attention call, and saying so when it is not evotune's.

A call's route is decided once per distinct call (sizes, dtype, strides, device, mask) and cached:

  uncovered  the kernel cannot compute it (device, dtype, head dim, strides, a backward); grouped
             K/V heads (enable_gqa) are computed, keyed by their group size in the tuning table: SDPA where fallback="sdpa", UsageError where fallback="error"
  missing    no usable table entry for its key (no table, no entry, not admitted, stale, another
             GPU's table): likewise, and the notice names the key and the command that would tune it
  stale      the key's own entry measured a kernel source that today's template no longer gives (the template
             changed since): likewise, and the notice says why and names `evotune tune --stale`, which re-measures it
  unverified only a nearer key's entry (another sequence or batch x heads bucket), measured there, not
             here: likewise (EVOTUNE_NEAREST=1 opts in to using it; tuning_table.select says why not by default)
  table      the table routes the key to SDPA (evotune's best was slower, or SDPA was not measured
             beside it): SDPA whatever the fallback, since that is the table's measured decision
  tuned      evotune's kernel

Every SDPA route is told once per key (EvotuneFallbackWarning), never silently. A call with a softcap or a window
(the score mods) or attention sinks routes the same way, keyed with them (TableKey's softcap, window_bucket and
sinks), and where it is not the kernel's runs evotune.torch.fallback (SDPA has none of them), which its notice names.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from ..errors import UsageError
from ..records.tuning_table import Entry, Table, TableKey, default_table_path, load_table, nearest_allowed, select
from . import fallback as _fallback
from . import kernels
from .call import NO_MODS, Call, coverage, misaligned

FALLBACKS = ("sdpa", "error")


class EvotuneFallbackWarning(UserWarning):
    """A call ran PyTorch SDPA instead of an evotune kernel (told once per key, with the reason)."""


@dataclass(frozen=True)
class Decision:
    route: str                    # "evotune" or "sdpa"
    kind: str                     # "tuned", "table", "missing", "stale", "unverified" or "uncovered"
    reason: str
    call: Call
    key: TableKey | None = None
    shape: object = None          # evotune.problems.shapes.Shape where the call is one
    entry: Entry | None = None
    match: str = "none"           # how the entry matched the key: "exact", "nearest" or "none"
    config: object = None         # the entry's evotune.space.searchspace.Config, made once for the launches

    @property
    def refused_by_error_fallback(self) -> bool:
        """Whether fallback="error" makes this call raise (no evotune kernel, and not the table's choice)."""
        return self.kind in ("missing", "stale", "unverified", "uncovered")

    def notice(self) -> str:
        """The one line said when this call runs SDPA (or, with a softcap or window, evotune.torch.fallback)."""
        head = "evotune.torch.attention"
        if self.kind == "uncovered":
            return f"{head}: the evotune kernel cannot run this call ({self.reason})"
        if self.kind == "stale":
            return (f"{head}: the tuned entry for {self.key.spec()} is {self.reason}; re-measure it: "
                    f"evotune tune --stale --table {table_path()}")
        if self.kind == "unverified":  # the reason names the nearest entry and the tune command
            return f"{head}: no tuned kernel for {self.key.spec()}: {self.reason}"
        if self.kind == "missing":
            return f"{head}: no tuned kernel for {self.key.spec()} ({self.reason}); tune it: {tune_command(self.shape)}"
        away = "PyTorch SDPA" if self.call.plain else "the fallback"  # SDPA has no softcap, window or sinks
        return f"{head}: the tuning table routes {self.key.spec()} to {away} ({self.reason})"

    def notice_key(self) -> tuple:
        # A call with a softcap, window or sinks says what runs instead (not SDPA): told once per reason and fallback.
        runs = () if self.call.plain else (_fallback.name(self.call.mods, self.call.sinks),)
        told = (self.kind, self.key) if self.key is not None and self.kind != "uncovered" else (self.kind, self.reason)
        return told + runs


def tune_command(shape) -> str:
    """The command that would tune `shape` into the table the op reads."""
    return f"evotune tune --shape {shape.spec} --table {table_path()}"


# --------------------------------------------------------------------------- the table in use


class _TableState:
    """The table the op reads: one given to use_table(), else $EVOTUNE_TABLE, else the default file
    if it exists (else none). Loaded once; a fault is kept and raised on every call until use_table()."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset(None)

    def reset(self, source) -> None:
        self.source = source
        self.loaded = False
        self.table: Table | None = None
        self.fault: UsageError | None = None

    def path(self) -> Path:
        if isinstance(self.source, Table):
            return Path(self.source.path or "<in-memory tuning table>")
        return Path(self.source) if self.source is not None else default_table_path()

    def get(self) -> Table | None:
        if not self.loaded:
            with self.lock:
                if not self.loaded:
                    self._load()
        if self.fault is not None:
            raise self.fault
        return self.table

    def _load(self) -> None:
        path = self.path()
        try:
            if isinstance(self.source, Table):
                self.table = self.source
            elif self.source is not None or os.environ.get("EVOTUNE_TABLE") or path.exists():
                self.table = load_table(path)
        except UsageError as e:
            self.fault = e
        self.loaded = True


_STATE = _TableState()
_DECISIONS: dict[tuple, Decision] = {}
# The op's eager fast path (op._fast_route): call facts -> a callable, valid while the table is; emptied with
# _DECISIONS by use_table().
FAST_ROUTES: dict[tuple, object] = {}
# What else keeps routes and forgets them with FAST_ROUTES (the op registers the compiled launcher's clear): a
# callback, as kernels.ON_CLEAR, so routing imports nothing above it.
ON_FORGET: list = []


def forget_fast_routes() -> None:
    FAST_ROUTES.clear()
    for forget in ON_FORGET:
        forget()


kernels.ON_CLEAR.append(forget_fast_routes)  # their closures hold loaded kernels: clearing the cache drops them
_WARNED: set = set()
_WARN_LOCK = threading.Lock()


def use_table(source=None) -> Table | None:
    """Use this tuning table (a path or a Table; None: back to $EVOTUNE_TABLE or the default file), loading
    a path now so a bad file fails here. Forgets cached decisions and the notices already given."""
    from ..records.tuning_table import clear_caches

    with _STATE.lock:
        _STATE.reset(source)
    _DECISIONS.clear()
    forget_fast_routes()
    with _WARN_LOCK:
        _WARNED.clear()
    clear_caches()
    return _STATE.get() if source is not None else None


def current_table() -> Table | None:
    """The table in use (None where there is none); UsageError naming the file where it is bad."""
    return _STATE.get()


def table_path() -> Path:
    """The file the op reads its table from (or would)."""
    return _STATE.path()


@lru_cache(maxsize=None)
def gpu_identity(index: int) -> tuple[str, str, tuple[int, int]]:
    """(name, "major.minor", (major, minor)) of CUDA device `index`."""
    major, minor = torch.cuda.get_device_capability(index)
    return torch.cuda.get_device_name(index), f"{major}.{minor}", (major, minor)


# --------------------------------------------------------------------------- deciding and telling


def decide(call: Call) -> Decision:
    """The route of `call` (cached per distinct call until use_table()). A training call decides as a forward
    one does: a tuned key runs the tuned config with its log-sum-exp epilogue (evotune.torch.autograd), which
    only adds the row stores after the loop."""
    found = _DECISIONS.get(call)
    if found is None:
        found = _DECISIONS[call] = _decide(call)
    return found


def decide_for(q, k, v, is_causal: bool, mods: tuple = NO_MODS, sinks: bool = False) -> Decision:
    """decide() for these tensors (and score mods: call.NO_MODS, or (softcap, window_left, window_right); `sinks`:
    whether the call has sink logits), turned to SDPA where the kernel's route meets a view that starts off a 16-byte
    boundary (an address, not a call fact: checked every call, never cached)."""
    decision = decide(Call.of(q, k, v, is_causal, mods, sinks))
    why = misaligned(q, k, v) if decision.route == "evotune" else None
    return uncovered(decision, why) if why else decision


def _decide(call: Call) -> Decision:
    index = call.device_index
    why = coverage(call, gpu_identity(index)[2] if index is not None else None)
    if why:
        return Decision("sdpa", "uncovered", why, call)
    shape = call.shape()
    name, cc, _ = gpu_identity(index)
    key = TableKey.for_shape(shape, name, cc)
    table = current_table()
    if table is None:
        return Decision("sdpa", "missing", f"no tuning table at {table_path()}; set EVOTUNE_TABLE or build one "
                                           f"with `evotune table build RUN... -o FILE`", call, key, shape)
    chosen = select(table, key, shape, allow_nearest=nearest_allowed())
    # The key's own entry skipped as stale (tuning_table.stale_reason): said as such, not as a missing key.
    stale = next((why for spec, why in chosen.skipped if spec == key.spec() and why.startswith("stale:")), None)
    if stale is not None and chosen.route == "sdpa":
        return Decision("sdpa", "stale", stale, call, key, shape, chosen.entry, chosen.match)
    if chosen.entry is None:
        return Decision("sdpa", "missing", chosen.reason, call, key, shape)
    if chosen.route == "sdpa" and not chosen.verified:  # a nearer key's entry, not measured at this one
        return Decision("sdpa", "unverified", chosen.reason, call, key, shape, chosen.entry, chosen.match)
    from ..space.searchspace import Config

    kind = "tuned" if chosen.route == "evotune" else "table"
    return Decision(chosen.route, kind, chosen.reason, call, key, shape, chosen.entry, chosen.match,
                    Config.from_dict(chosen.entry.config))


def uncovered(decision: Decision, why: str) -> Decision:
    """`decision` turned to SDPA for a fault of this call alone (not cached)."""
    return Decision("sdpa", "uncovered", why, decision.call, decision.key, decision.shape)


def check_fallback(fallback) -> None:
    if fallback not in FALLBACKS:
        raise UsageError(f"evotune.torch.attention: fallback={fallback!r}; use 'sdpa' (run PyTorch SDPA where no "
                         f"tuned kernel applies, and say so once) or 'error'")


def notify(decision: Decision, fallback: str) -> None:
    """Before an SDPA route runs: raise where fallback="error" refuses it, else warn once per key."""
    if fallback == "error" and decision.refused_by_error_fallback:
        raise UsageError(decision.notice() + " [fallback='error']")
    key = decision.notice_key()
    if key in _WARNED:
        return
    with _WARN_LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    warnings.warn(f"{decision.notice()}; running {fallback_name(decision)}", EvotuneFallbackWarning, stacklevel=3)


def fallback_name(decision: Decision) -> str:
    """What runs `decision`'s call off the kernel: PyTorch SDPA, or for a softcap, window or sinks
    evotune.torch.fallback's way (never called evotune's kernel)."""
    return _fallback.name(decision.call.mods, decision.call.sinks)
