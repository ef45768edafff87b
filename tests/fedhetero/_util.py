"""Helpers shared by the tests in this folder."""

from __future__ import annotations

from typing import Any


def strip_wall(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metrics rows without their wall-clock fields (the rest must match between runs)."""
    out = []
    for r in rows:
        r = {k: v for k, v in r.items() if k not in ("wall_s", "timers")}
        r["clients"] = [{k: v for k, v in c.items() if k != "wall_s"} for c in r["clients"]]
        out.append(r)
    return out
