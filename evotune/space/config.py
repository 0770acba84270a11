"""Config: one point of a search space, a frozen, hashable mapping from knob name to value. A module of its own:
the space's model and its enumeration both build Configs, and neither imports the other for it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Config:
    """One point of a space: a frozen, hashable mapping from parameter name to value."""

    items: tuple[tuple[str, object], ...]

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> "Config":
        return cls(tuple(sorted(d.items())))

    def __getitem__(self, name: str):
        for key, value in self.items:
            if key == name:
                return value
        raise KeyError(name)

    def get(self, name: str, default=None):
        try:
            return self[name]
        except KeyError:
            return default

    def keys(self) -> list[str]:
        return [key for key, _ in self.items]

    def as_dict(self) -> dict:
        return dict(self.items)

    def key(self) -> str:
        """Short stable spelling, e.g. `block_m=64,block_n=64,...` (names sorted)."""
        return ",".join(f"{k}={v}" for k, v in self.items)

    def digest(self) -> str:
        """12 hex digits identifying the configuration (for file names and caches)."""
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:12]
