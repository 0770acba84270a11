"""record_shapes(): collect the distinct attention calls a model makes, to tune them.

    with evotune.torch.record_shapes() as rec:
        model(inputs)
    rec.save("shapes.json")        # {"version": 2, "kind": "evotune-attention-shapes", "shapes": [...]}

Each distinct call (sizes, K/V heads, dtype, mask, layout, device, softcap and window) is one row with its
`--shape` spelling (None where the kernel has no such shape, e.g. fp32; with `:softcap=C` and `:window=L,R` where
the call has them, so `evotune tune --shapes` tunes it as such), its table key, the route it took and why, and how
many times it was called. Calls inside torch.compile'd code are seen too: the op runs at run time, not only while
tracing. Decode calls (evotune.torch.decode: a few queries over a KV cache, e.g. generate()'s steps through the
transformers adapter) are rows of family "attention-decode" with that family's spelling, one per cache length;
`evotune tune --shapes` tunes them per decode-table key.
"""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path


SHAPES_VERSION = 2  # 2: rows may name their family (attention-decode); version 1 files (attention only) read as before
READ_VERSIONS = (1, 2)
SHAPES_KIND = "evotune-attention-shapes"

_ACTIVE: list["ShapeRecorder"] = []
ON_START: list = []  # called as a recorder starts (the op registers the compiled launcher's clear)
_LOCK = threading.Lock()


class ShapeRecorder:
    def __init__(self):
        self._rows: dict[tuple, dict] = {}
        self._lock = threading.Lock()

    def add(self, decision) -> None:
        call = decision.call.as_dict()
        ident = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in call.items())  # a window is a list
        self.add_row(ident, lambda: {**call, "key": decision.key.as_dict() if decision.key else None,
                                     "route": decision.route, "kind": decision.kind, "reason": decision.reason})

    def add_row(self, ident: tuple, make_row) -> None:
        """Count one call of identity `ident`; its row is `make_row()` the first time (a dict with a "shape")."""
        with self._lock:
            row = self._rows.get(ident)
            if row is None:
                row = self._rows[ident] = {**make_row(), "calls": 0}
            row["calls"] += 1

    @property
    def shapes(self) -> list[dict]:
        """The distinct calls, in the order first seen."""
        with self._lock:
            return [dict(row) for row in self._rows.values()]

    def specs(self, family: str = "attention") -> list[str]:
        """The distinct `--shape` spellings of `family` the kernels could be tuned for."""
        return list(dict.fromkeys(row["shape"] for row in self.shapes
                                  if row["shape"] and row.get("family", "attention") == family))

    def to_json(self) -> dict:
        return {"version": SHAPES_VERSION, "kind": SHAPES_KIND, "shapes": self.shapes}

    def save(self, path) -> Path:
        """Write to_json() to `path` whole (outputs.write_output: a temporary file, then a rename)."""
        from ..outputs import write_output

        return write_output(path, json.dumps(self.to_json(), indent=1) + "\n", str(path))


def active() -> bool:
    """Whether a recorder is active (the op's fast path then steps aside, so every call is seen). len, not bool: the
    op asks while torch.compile traces, and torch 2.11's dynamo cannot take bool() of a list (a graph break, which
    fullgraph=True refuses; H200 run of 2026-11-28)."""
    return len(_ACTIVE) > 0


def observe(decision) -> None:
    """Tell every active recorder about one call (free when none is active)."""
    if _ACTIVE:
        for recorder in list(_ACTIVE):
            recorder.add(decision)


@contextlib.contextmanager
def record_shapes():
    """Record the attention calls made inside the block (from any thread); yields the ShapeRecorder."""
    recorder = ShapeRecorder()
    with _LOCK:
        _ACTIVE.append(recorder)
    for hook in ON_START:  # the compiled launcher forgets its routes: each call must reach the op's body
        hook()
    try:
        yield recorder
    finally:
        with _LOCK:
            _ACTIVE.remove(recorder)
