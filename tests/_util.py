"""Helpers shared by the tests (``from _util import ...``: tests/ is on ``sys.path``, as the folder of
the rootdir conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: the repository's root folder (examples/, docs/, fedhetero/ ...), wherever a test file lies
ROOT = Path(__file__).resolve().parents[1]


def strip_wall(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metrics rows without their wall-clock fields (the rest must match between runs)."""
    out = []
    for r in rows:
        r = {k: v for k, v in r.items() if k not in ("wall_s", "timers")}
        r["clients"] = [{k: v for k, v in c.items() if k != "wall_s"} for c in r["clients"]]
        out.append(r)
    return out


class ServerOnlyModel(nn.Module):
    """A linear classifier whose forward fails in any process but the one that built it (a model
    a worker process cannot evaluate)."""

    def __init__(self, in_features: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features, classes)
        self.pid = os.getpid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if os.getpid() != self.pid:
            raise RuntimeError("not in this process")
        return self.fc(x.flatten(1))


def processes() -> list[tuple[int, str, list[str], bytes]]:
    """Every process as ``(pid, name, stat fields after the name, command line)``, read from
    /proc (Linux); a process that ends while it is read is left out."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        out.append((int(entry.name), name, stat[stat.rindex(")") + 2 :].split(), command))
    return out


def live_children(parent: int | None = None) -> set[int]:
    """The pids of the running children of ``parent`` (default: this process), read from /proc
    (Linux); a child that ended and waits for its reaper (a zombie) is left out."""
    parent = os.getpid() if parent is None else parent
    return {pid for pid, _, fields, _ in processes() if int(fields[1]) == parent and fields[0] != "Z"}
