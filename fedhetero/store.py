"""Per-client state that persists between rounds, kept on disk.

What a client keeps between rounds (a structure spec, saliency, branch tensors, BN statistics…)
goes to one file per client and version, so memory grows with the clients sampled per round and
not with the clients that exist. Versions are tagged with the round that wrote them so that a run
resumed from the checkpoint of round ``k`` sees exactly the state that existed after round ``k``:
:meth:`ClientStateStore.get` returns the newest version written before the current round, and
:meth:`ClientStateStore.rollback` deletes versions newer than a checkpoint.

Files are written atomically (temporary file, then rename) and read with
``torch.load(weights_only=True)``: a state is a nested structure of tensors, numbers, strings,
lists and dicts, never arbitrary objects.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

__all__ = ["ClientStateStore", "atomic_save"]

_NAME = re.compile(r"^r(\d+)(b?)\.pt$")


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file in the same folder, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class ClientStateStore:
    """Disk-backed store: ``put(cid, state, round)`` / ``get(cid, before_round)``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)  # created on the first put, so an aborted set-up leaves nothing
        self._touched: set[int] | None = None  # clients written since the last compaction (None: all)

    def _dir(self, cid: int) -> Path:
        return self.root / f"client_{int(cid):06d}"

    def _versions(self, cid: int) -> list[tuple[int, Path]]:
        d = self._dir(cid)
        if not d.is_dir():
            return []
        out = []
        for p in d.iterdir():
            m = _NAME.match(p.name)
            if m:
                # tick 2r: written in round r; tick 2r+1 ("rNb.pt"): written between round r and
                # round r+1 (a prelude exchange that round r+1's own tasks must see)
                out.append((2 * int(m.group(1)) + (1 if m.group(2) else 0), p))
        return sorted(out)

    @staticmethod
    def _tick(round: int, prelude: bool) -> int:
        return 2 * int(round) - (1 if prelude else 0)

    def put(self, cid: int, state: dict[str, Any], round: int, prelude: bool = False) -> None:
        """Store ``state`` as the version written in ``round`` (``prelude``: by an exchange that
        runs before round ``round`` proper, whose state that round's tasks see); older versions
        are kept until :meth:`compact` (a checkpoint may still need them)."""
        name = f"r{int(round) - 1:06d}b.pt" if prelude else f"r{int(round):06d}.pt"
        atomic_save(state, self._dir(cid) / name)
        if self._touched is not None:
            self._touched.add(int(cid))

    def _before(self, cid: int, before_round: int | None, prelude: bool) -> list[tuple[int, Path]]:
        versions = self._versions(cid)
        if before_round is not None:
            tick = self._tick(before_round, prelude)
            versions = [v for v in versions if v[0] < tick]
        return versions

    def get(self, cid: int, before_round: int | None = None, prelude: bool = False) -> dict[str, Any] | None:
        """Newest state written before ``before_round`` (all rounds when None; with ``prelude``,
        before that round's prelude exchange), or None."""
        versions = self._before(cid, before_round, prelude)
        if not versions:
            return None
        return torch.load(versions[-1][1], weights_only=True, map_location="cpu")

    def has(self, cid: int, before_round: int | None = None, prelude: bool = False) -> bool:
        return bool(self._before(cid, before_round, prelude))

    def clients(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(
            int(p.name.split("_")[1]) for p in self.root.iterdir() if p.name.startswith("client_")
        )

    def compact(self, upto_round: int) -> None:
        """Keep, per client, only the newest version at or before ``upto_round`` and anything newer.

        Called after a checkpoint of ``upto_round`` is safely on disk.
        """
        cids = self.clients() if self._touched is None else sorted(self._touched)
        for cid in cids:
            versions = self._versions(cid)
            old = [v for v in versions if v[0] <= 2 * upto_round]
            for _, p in old[:-1]:
                p.unlink(missing_ok=True)
        self._touched = set()

    def rollback(self, to_round: int) -> None:
        """Delete versions written after ``to_round`` (resuming from that round's checkpoint)."""
        for cid in self.clients():
            for tick, p in self._versions(cid):
                if tick > 2 * to_round:
                    p.unlink(missing_ok=True)

    def disk_bytes(self) -> int:
        if not self.root.is_dir():
            return 0
        return sum(p.stat().st_size for p in self.root.rglob("*.pt"))
