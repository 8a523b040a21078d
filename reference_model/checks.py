"""One analytic value against one measured value: what `gptcalc verify` prints per row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Check:
    """One analytic value against one measured value; exact unless a tolerance is given."""

    name: str  # what was checked, and by which tool
    analytic: int
    measured: int
    tool: str
    note: str = ""
    tolerance: int = 0  # absolute; 0 = exact

    @property
    def difference(self) -> int:
        return self.measured - self.analytic

    @property
    def ok(self) -> bool:
        return abs(self.difference) <= self.tolerance

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "analytic": self.analytic, "measured": self.measured,
                "difference": self.difference, "ok": self.ok, "tool": self.tool,
                "tolerance": self.tolerance, "note": self.note}


__all__ = ["Check"]
