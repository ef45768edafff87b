"""The run directory: atomic files, a lock, tolerant reading, clean-up of interrupted writes.

Every file a run writes goes through a temporary file in the same folder and an ``os.replace``,
so a kill at any instant leaves either the old file or the new one, never a truncated one. Only
``metrics.jsonl`` grows by appending (one line per round); a kill inside an append can leave a
partial last line, which :func:`read_metrics` drops (that round was not checkpointed yet, so it is
run again on resume).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = [
    "RUN_FILES",
    "RunDirError",
    "RunLock",
    "atomic_write_text",
    "clean_stale",
    "describe_run",
    "dumps_row",
    "finite_json",
    "read_metrics",
]

#: Files whose presence means a directory holds a run.
RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoint.pt", "summary.json")


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (in use, damaged, holds another run)."""


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (never a partial file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def finite_json(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (JSON has no NaN or infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def dumps_row(row: dict[str, Any]) -> str:
    """One strictly valid JSON line."""
    return json.dumps(finite_json(row), allow_nan=False)


def read_metrics(path: Path, upto: int | None = None) -> list[dict[str, Any]]:
    """Rows of ``metrics.jsonl`` (up to round ``upto``); a partial last line is dropped, a damaged
    line elsewhere is an error naming it."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i >= len(lines) - 2:  # the last written line: a kill inside an append
                break
            raise RunDirError(f"{path}: line {i + 1} is not valid JSON; the file is damaged") from None
        if not isinstance(row, dict) or not isinstance(row.get("round"), int):
            raise RunDirError(f"{path}: line {i + 1} is not a round record; the file is damaged")
        if upto is None or row["round"] <= upto:
            rows.append(row)
    return rows


def clean_stale(root: Path) -> int:
    """Remove temporary files left by interrupted atomic writes under ``root``; returns how many."""
    n = 0
    root = Path(root)
    if not root.is_dir():
        return 0
    for p in root.rglob(".*.tmp*"):
        if p.is_file():
            p.unlink(missing_ok=True)
            n += 1
    return n


def describe_run(root: Path) -> str | None:
    """A short description of the run in ``root`` (None when it holds none)."""
    root = Path(root)
    present = [f for f in RUN_FILES if (root / f).exists()]
    if not present:
        return None
    if (root / "summary.json").is_file():
        return "a finished run"
    try:
        rounds = len(read_metrics(root / "metrics.jsonl"))
    except (RunDirError, OSError):
        rounds = 0
    return f"an unfinished run ({rounds} round{'s' if rounds != 1 else ''} recorded)"


class RunLock:
    """An exclusive lock on a run directory for the lifetime of a run (``fcntl.flock`` on
    ``.lock``; released by the OS if the process dies)."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / ".lock"
        self._fh: Any = None

    def acquire(self) -> "RunLock":
        import fcntl

        self._fh = open(self.path, "a+")
        try:
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._fh.seek(0)
            owner = self._fh.read().strip() or "another process"
            self._fh.close()
            self._fh = None
            raise RunDirError(
                f"{self.path.parent} is in use by another fedhetero run (pid {owner}); wait for it to "
                "finish or choose another --out"
            ) from None
        self._fh.seek(0)
        self._fh.truncate()
        self._fh.write(str(os.getpid()))
        self._fh.flush()
        return self

    def release(self) -> None:
        if self._fh is not None:
            import fcntl

            fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
