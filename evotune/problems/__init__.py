"""Kernel families. Each module defines one Problem: shapes it accepts, how a Config
becomes template arguments and launch geometry, inputs, the launch, and the reference.

The compile/evaluate/search/runs code talks to a family only through this interface.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError


@dataclass(frozen=True)
class LaunchGeometry:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dynamic_smem: int

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    def as_dict(self) -> dict:
        return {"grid": list(self.grid), "block": list(self.block), "dynamic_smem": self.dynamic_smem}


def get_problem(family: str):
    """The Problem object of a family name."""
    if family == "attention":
        from .attention import PROBLEM

        return PROBLEM
    raise UsageError(f"unknown kernel family {family!r}; known: attention")


FAMILIES = ("attention",)
