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

Writes are held in memory (up to ``memory_bytes``) and reach the disk at :meth:`flush`, which the
engine calls before every checkpoint: a resumed run restarts from a checkpoint, and every version
it can need was flushed before that checkpoint was written, so nothing a resume reads is lost by
waiting. Small states written every round (SCAFFOLD's control variates, MOON's previous model of
100 clients) would otherwise cost one file per client and round.

A version written by :meth:`flush` stays in memory too, as long as it fits beside the writes still
held (``memory_bytes`` bounds both together; the least recently used written version goes first):
a client sampled again reads it back without loading its file. The file is what a resumed run (a
fresh store) reads; within a run the two hold the same values, since a file is written from that
snapshot and never changed while the run holds it. With the default job (DynamicFL, a checkpoint
every round) loading each returning client's state from its file took 5 % of the run.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from fedhetero.core.common.rundir import RunDirError, writing
from fedhetero.core.exchange.types import payload_bytes

__all__ = ["ClientStateStore", "atomic_save"]

_NAME = re.compile(r"^r(\d+)(b?)\.pt$")
_CLIENT = re.compile(r"^client_\d{6}$")


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file in the same folder, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with writing(path, tmp):
        torch.save(obj, tmp)
        os.replace(tmp, path)


class ClientStateStore:
    """Disk-backed store: ``put(cid, state, round)`` / ``get(cid, before_round)``."""

    def __init__(self, root: str | Path, memory_bytes: int = 256 * 2**20) -> None:
        self.root = Path(root)  # created on the first put, so an aborted set-up leaves nothing
        self._touched: set[int] | None = None  # clients written since the last compaction (None: all)
        self.memory_bytes = int(memory_bytes)
        self._pending_by_cid: dict[int, dict[int, dict[str, Any]]] = {}  # cid -> {tick: state}
        self._pending_bytes = 0
        # versions on disk still held in memory, least recently used first: (cid, tick) -> state
        self._written: OrderedDict[tuple[int, int], dict[str, Any]] = OrderedDict()
        self._written_bytes = 0
        self._disk: dict[int, dict[int, Path]] = {}  # cid -> {tick: file}, read once per client

    def _dir(self, cid: int) -> Path:
        return self.root / f"client_{int(cid):06d}"

    def _file(self, cid: int, tick: int) -> Path:
        """File of a version: ``r<round>.pt`` (tick 2r) or ``r<round>b.pt`` (tick 2r+1)."""
        r, between = divmod(int(tick), 2)
        return self._dir(cid) / (f"r{r:06d}b.pt" if between else f"r{r:06d}.pt")

    def _on_disk(self, cid: int) -> dict[int, Path]:
        """{tick: file} of the versions on disk (the run directory is locked: only this store
        writes there, so the folder is listed once)."""
        cid = int(cid)
        if cid not in self._disk:
            found: dict[int, Path] = {}
            d = self._dir(cid)
            if d.is_dir():
                for p in d.iterdir():
                    m = _NAME.match(p.name)
                    if m:
                        # tick 2r: written in round r; tick 2r+1 ("rNb.pt"): written between
                        # round r and round r+1 (a prelude exchange round r+1's tasks must see)
                        found[2 * int(m.group(1)) + (1 if m.group(2) else 0)] = p
            self._disk[cid] = found
        return self._disk[cid]

    def _versions(self, cid: int) -> list[tuple[int, Path]]:
        """(tick, file) of every version, on disk or still in memory, oldest first."""
        found = dict(self._on_disk(cid))
        for tick in self._held(cid):
            found[tick] = self._file(cid, tick)
        return sorted(found.items())

    def _held(self, cid: int) -> dict[int, dict[str, Any]]:
        return self._pending_by_cid.get(int(cid), {})

    @staticmethod
    def _tick(round: int, prelude: bool) -> int:
        return 2 * int(round) - (1 if prelude else 0)

    def put(self, cid: int, state: dict[str, Any], round: int, prelude: bool = False) -> None:
        """Store ``state`` as the version written in ``round`` (``prelude``: by an exchange that
        runs before round ``round`` proper, whose state that round's tasks see); older versions
        are kept until :meth:`compact` (a checkpoint may still need them)."""
        held = self._pending_by_cid.setdefault(int(cid), {})
        tick = self._tick(round, prelude)
        old = held.pop(tick, None)
        if old is not None:
            self._pending_bytes -= payload_bytes(old)
        self._forget(int(cid), tick)  # a file of that version, if any, is about to be replaced
        held[tick] = _clone(state)  # a snapshot, as a file would be
        self._pending_bytes += payload_bytes(held[tick])
        if self._touched is not None:
            self._touched.add(int(cid))
        if self._pending_bytes > self.memory_bytes:
            self.flush()
        else:
            self._evict()

    def flush(self, upto_round: int | None = None) -> None:
        """Write the states held in memory to their files. With ``upto_round`` (the engine passes
        the round it is about to checkpoint), of a client's versions at or before that round only
        the newest is written: the older ones would be deleted by :meth:`compact` right after the
        checkpoint, a run going forward reads only the newest, and a resumed run rolls back to a
        checkpoint whose versions were all flushed before it."""
        for cid, held in sorted(self._pending_by_cid.items()):
            ticks = sorted(held)
            if upto_round is not None:
                old = [t for t in ticks if t <= 2 * int(upto_round)]
                ticks = old[-1:] + [t for t in ticks if t > 2 * int(upto_round)]
            for tick in ticks:
                path = self._file(cid, tick)
                atomic_save(held[tick], path)
                self._on_disk(cid)[tick] = path
                self._written[(int(cid), tick)] = held[tick]  # nothing else refers to it now
                self._written_bytes += payload_bytes(held[tick])
        self._pending_by_cid.clear()
        self._pending_bytes = 0
        self._evict()

    def _forget(self, cid: int, tick: int) -> None:
        """Drop the in-memory copy of a version on disk, if there is one."""
        kept = self._written.pop((cid, tick), None)
        if kept is not None:
            self._written_bytes -= payload_bytes(kept)

    def _evict(self) -> None:
        """Drop in-memory copies of versions on disk, least recently used first, until they fit
        beside the writes still held in ``memory_bytes``."""
        while self._written and self._pending_bytes + self._written_bytes > self.memory_bytes:
            _, kept = self._written.popitem(last=False)
            self._written_bytes -= payload_bytes(kept)

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
        tick, path = versions[-1]
        held = self._held(cid).get(tick)
        if held is not None:
            return _clone(held)
        written = self._written.get((int(cid), tick))
        if written is not None:
            self._written.move_to_end((int(cid), tick))
            return _clone(written)
        try:
            state = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as exc:  # truncated, overwritten, not a weights-only file, …
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RunDirError(
                f"{path} is damaged ({first}); this client's state is lost, so the run cannot be continued"
            ) from None
        if not isinstance(state, dict):
            raise RunDirError(f"{path} is damaged (not a client state); the run cannot be continued")
        return state

    def has(self, cid: int, before_round: int | None = None, prelude: bool = False) -> bool:
        return bool(self._before(cid, before_round, prelude))

    def clients(self) -> list[int]:
        found = {c for c, held in self._pending_by_cid.items() if held}
        if self.root.is_dir():
            found.update(int(p.name[7:]) for p in self.root.iterdir() if _CLIENT.match(p.name) and p.is_dir())
        return sorted(found)

    def _drop(self, cid: int, tick: int, path: Path) -> None:
        held = self._held(cid).pop(tick, None)
        if held is not None:
            self._pending_bytes -= payload_bytes(held)
        else:
            path.unlink(missing_ok=True)
            self._on_disk(cid).pop(tick, None)
            self._forget(int(cid), tick)

    def compact(self, upto_round: int) -> None:
        """Keep, per client, only the newest version at or before ``upto_round`` and anything newer.

        Called after a checkpoint of ``upto_round`` is safely on disk.
        """
        cids = self.clients() if self._touched is None else sorted(self._touched)
        for cid in cids:
            versions = self._versions(cid)
            old = [v for v in versions if v[0] <= 2 * upto_round]
            for tick, p in old[:-1]:
                self._drop(cid, tick, p)
        self._touched = set()

    def rollback(self, to_round: int) -> None:
        """Delete versions written after ``to_round`` (resuming from that round's checkpoint)."""
        for cid in self.clients():
            for tick, p in self._versions(cid):
                if tick > 2 * to_round:
                    self._drop(cid, tick, p)

    def manifest(self, upto_round: int) -> dict[int, list[int]]:
        """Per client, ``[tick, bytes]`` of the newest version at or before ``upto_round`` (after
        :meth:`flush`): what a checkpoint of that round needs on disk. :meth:`verify` checks it."""
        out: dict[int, list[int]] = {}
        for cid in self.clients():
            old = [(t, p) for t, p in self._versions(cid) if t <= 2 * int(upto_round)]
            if old:
                tick, path = old[-1]
                out[int(cid)] = [int(tick), int(path.stat().st_size)]
        return out

    def verify(self, manifest: dict[Any, Any], to_round: int) -> None:
        """After :meth:`rollback` to ``to_round``: the versions on disk are exactly the ones the
        checkpoint recorded (``manifest``), else :class:`RunDirError` naming the first difference (a
        deleted, replaced or foreign state would give other numbers than the run it continues)."""
        want = {int(c): (int(v[0]), int(v[1])) for c, v in manifest.items()}
        have: dict[int, tuple[int, int]] = {}
        for cid in self.clients():
            versions = [(t, p) for t, p in self._versions(cid) if t <= 2 * int(to_round)]
            if versions:
                tick, path = versions[-1]
                have[cid] = (tick, path.stat().st_size if path.is_file() else -1)
        for cid in sorted(set(want) | set(have)):
            if want.get(cid) != have.get(cid):
                w = want.get(cid)
                what = (
                    f"client {cid}'s state {self._file(cid, w[0]).relative_to(self.root.parent)} is missing or changed"
                    if w is not None
                    else f"client {cid} has a state the checkpoint does not know"
                )
                raise RunDirError(
                    f"{self.root} does not match the checkpoint of round {to_round} ({what}); a run continued "
                    "from it would give other numbers. Restore the folder, or start again with --overwrite"
                )

    def disk_bytes(self) -> int:
        """Bytes of the state files on disk (call :meth:`flush` first to count everything)."""
        if not self.root.is_dir():
            return 0
        return sum(p.stat().st_size for p in self.root.rglob("*.pt"))


def _clone(obj: Any) -> Any:
    """A deep copy of a state's tensors (other leaves are immutable or copied as containers)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj
