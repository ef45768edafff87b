"""The run directory: atomic files, a lock, tolerant reading, clean-up of interrupted writes.

What a run directory holds is fixed (:data:`RUN_ENTRIES`); a directory that holds anything else is
not a run, and fedhetero never deletes or replaces a file it did not write (:func:`inspect_dir`,
:func:`clear_run`).

Every file a run writes goes through a temporary file in the same folder and an ``os.replace``,
so a kill at any instant leaves either the old file or the new one, never a truncated one. Only
``metrics.jsonl`` grows by appending (one line per round); a kill inside an append can leave a
partial last line, which :func:`read_metrics` drops (that round was not checkpointed yet, so it is
run again on resume).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "LOGGER_DIRS",
    "RUN_ENTRIES",
    "RUN_FILES",
    "DirState",
    "DiskFullError",
    "MetricsLog",
    "FinishedRunError",
    "RUN_AGAIN",
    "RunDirError",
    "RunLock",
    "atomic_write_text",
    "clean_stale",
    "clear_run",
    "inspect_dir",
    "writing",
    "describe_run",
    "dumps_row",
    "finite_json",
    "read_metrics",
]

#: Files whose presence means a directory holds a run.
RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoint.pt", "summary.json")


#: The folders of the experiment loggers (:mod:`fedhetero.core.run.loggers`), each with the names of
#: the files its logger writes there: TensorBoard's event files; MLflow's SQLite store and the
#: journal files SQLite keeps beside it while it writes.
LOGGER_DIRS: dict[str, re.Pattern[str]] = {
    "tensorboard": re.compile(r"events\.out\.tfevents\..+"),
    "mlflow": re.compile(r"mlflow\.db(-journal|-wal|-shm)?"),
}

#: Every file and folder a run writes into its directory (``client_state/`` holds only the state
#: store's files, ``client_NNNNNN/rNNNNNN[b].pt``; a logger's folder only its logger's files, see
#: :data:`LOGGER_DIRS`); ``.NAME.tmpPID`` files are interrupted writes.
RUN_ENTRIES = (
    ".lock",
    "config.yaml",
    "run.json",
    "partition.npz",
    "metrics.jsonl",
    "checkpoint.pt",
    "summary.json",
    "final_model.pt",
    "best_model.pt",
    "model.json",
    "accuracy.png",
    "client_state",
    *LOGGER_DIRS,
)

_TMP = re.compile(r"^\..+\.tmp\d+$")
_CLIENT_DIR = re.compile(r"^client_\d{6}$")
_STATE_FILE = re.compile(r"^r\d{6}b?\.pt$")

#: Below this many free bytes a failed write is reported as a full disk.
_FULL_BELOW = 64 * 2**20


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (in use, damaged, holds another run)."""


#: how to train a finished run again, in the command line's words
RUN_AGAIN = "run it again with --overwrite, another --out or another seed (--set seed=N)"


class FinishedRunError(RunDirError):
    """The run directory already holds this very run, finished: the same config hash, a
    ``summary.json``. Not a failure for a caller who wants the result: ``fedhetero train`` prints
    that run's table and ``fedhetero.run`` returns it, neither training again."""

    def __init__(self, message: str, out_dir: Path) -> None:
        super().__init__(message)
        self.out_dir = Path(out_dir)


class DiskFullError(RunDirError):
    """A run file could not be written because the disk is full."""


@contextlib.contextmanager
def writing(path: Path, tmp: Path | None = None) -> Iterator[None]:
    """Turn a failed write of ``path`` into one line: a full disk says so (and that ``--resume``
    continues from the last checkpoint); ``tmp``, the temporary file of an atomic write, is removed."""
    try:
        yield
    except (OSError, RuntimeError) as exc:  # torch.save reports a short write as a RuntimeError
        if tmp is not None:
            with contextlib.suppress(OSError):
                Path(tmp).unlink()
        try:
            free = shutil.disk_usage(Path(path).parent).free
        except OSError:
            free = None
        full = getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or (free is not None and free < _FULL_BELOW)
        if full:
            raise DiskFullError(
                f"the disk is full: {path} could not be written ({free if free is not None else 0} bytes free); "
                "free some space and continue the run with --resume (it restarts from its last checkpoint)"
            ) from None
        if isinstance(exc, OSError):
            raise RunDirError(f"{path} could not be written ({exc.strerror or exc})") from None
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (never a partial file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with writing(path, tmp):
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)


class MetricsLog:
    """``metrics.jsonl`` as written by this run: appended one line per round, with the count,
    length and SHA-256 of what was written so far. A checkpoint records :meth:`mark`; a resume
    checks that the file still begins with exactly those bytes (:meth:`resume`), so a changed,
    cut or replaced log is refused instead of giving a wrong summary."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._reset()

    def _reset(self, written: bytes = b"", rows: int = 0) -> None:
        self._hash = hashlib.sha256(written)
        self._bytes = len(written)
        self._rows = rows

    def append(self, row: dict[str, Any]) -> None:
        data = (dumps_row(row) + "\n").encode("utf-8")
        with writing(self.path):
            with self.path.open("ab") as fh:
                fh.write(data)
        self._hash.update(data)
        self._bytes += len(data)
        self._rows += 1

    def mark(self) -> dict[str, Any]:
        """What a checkpoint records of the log."""
        return {"rows": self._rows, "bytes": self._bytes, "sha256": self._hash.hexdigest()}

    def start(self) -> None:
        """A new run: an empty log."""
        atomic_write_text(self.path, "")
        self._reset()

    def resume(self, mark: dict[str, Any] | None, rounds: int) -> list[dict[str, Any]]:
        """The rows of rounds ``1..rounds`` after checking them against a checkpoint's ``mark``
        (rows after it, written before a kill, are cut); raises :class:`RunDirError` when the
        file does not hold exactly what the checkpoint recorded. ``mark`` None (a checkpoint
        written before marks existed): the rows must be rounds 1..rounds, once each, in order."""
        try:
            data = self.path.read_bytes() if self.path.is_file() else b""
        except OSError as exc:
            raise RunDirError(f"{self.path} cannot be read ({exc.strerror or exc})") from None
        damaged = (
            f"{self.path} does not hold the {rounds} round{'s' if rounds != 1 else ''} that the checkpoint of "
            f"round {rounds} recorded (it was changed, cut, deleted or replaced, or the checkpoint was copied from "
            "another run); the run cannot be continued: start it again with --overwrite"
        )
        if mark is not None:
            n = int(mark.get("bytes", -1))
            if n < 0 or len(data) < n or hashlib.sha256(data[:n]).hexdigest() != mark.get("sha256"):
                raise RunDirError(damaged)
            data = data[:n]
        lines = data.decode("utf-8", errors="replace").split("\n")
        rows = []
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if mark is None and i >= len(lines) - 2:
                    break  # an old-style log cut by a kill inside an append
                raise RunDirError(damaged) from None
            if not isinstance(row, dict) or not isinstance(row.get("round"), int):
                raise RunDirError(damaged)
            if row["round"] > rounds and mark is None:
                break
            rows.append(row)
        if [r["round"] for r in rows] != list(range(1, rounds + 1)):
            raise RunDirError(damaged)
        body = "".join(dumps_row(r) + "\n" for r in rows) if mark is None else data.decode("utf-8")
        atomic_write_text(self.path, body)
        self._reset(body.encode("utf-8"), len(rows))
        return rows


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
    state = root / "client_state"
    folders = [root] + ([state, *sorted(d for d in state.iterdir() if _CLIENT_DIR.match(d.name))] if state.is_dir() else [])
    for folder in folders:  # only where this project writes: never inside a folder it did not make
        for p in folder.iterdir():
            if _TMP.match(p.name) and p.is_file():
                p.unlink(missing_ok=True)
                n += 1
    return n


@dataclass
class DirState:
    """What a directory holds, as far as a run is concerned."""

    exists: bool
    run_entries: list[str] = field(default_factory=list)  # what a run wrote there (.lock aside)
    foreign: list[str] = field(default_factory=list)  # anything else, relative paths

    @property
    def holds_run(self) -> bool:
        return bool(self.run_entries)

    def foreign_text(self, most: int = 5) -> str:
        names = ", ".join(self.foreign[:most])
        return names + (f" and {len(self.foreign) - most} more" if len(self.foreign) > most else "")


def inspect_dir(root: Path) -> DirState:
    """Sort what ``root`` holds into a run's own entries (:data:`RUN_ENTRIES`) and anything else."""
    root = Path(root)
    if not root.exists():
        return DirState(False)
    if not root.is_dir():
        raise RunDirError(f"{root} is not a directory")
    state = DirState(True)
    for p in sorted(root.iterdir()):
        name = p.name
        if name == "client_state" and p.is_dir():
            state.foreign += [f"client_state/{x}" for x in _foreign_state(p)]
            if any(p.iterdir()):
                state.run_entries.append(name)
        elif name in LOGGER_DIRS and p.is_dir() and not p.is_symlink():
            state.foreign += [f"{name}/{x}" for x in _foreign_files(p, LOGGER_DIRS[name])]
            if any(p.iterdir()):
                state.run_entries.append(name)
        elif name in RUN_ENTRIES and name not in ("client_state", *LOGGER_DIRS) and (p.is_file() and not p.is_symlink()):
            if name != ".lock":
                state.run_entries.append(name)
        elif _TMP.match(name) and p.is_file():
            continue  # an interrupted atomic write of this project's
        else:
            state.foreign.append(name + ("/" if p.is_dir() else ""))
    return state


def _foreign_state(root: Path) -> list[str]:
    """Entries of ``client_state/`` that the state store did not write."""
    out = []
    for d in sorted(root.iterdir()):
        if _TMP.match(d.name) and d.is_file():
            continue
        if not (_CLIENT_DIR.match(d.name) and d.is_dir() and not d.is_symlink()):
            out.append(d.name + ("/" if d.is_dir() else ""))
            continue
        for f in sorted(d.iterdir()):
            if not ((_STATE_FILE.match(f.name) or _TMP.match(f.name)) and f.is_file() and not f.is_symlink()):
                out.append(f"{d.name}/{f.name}")
    return out


def _foreign_files(folder: Path, names: re.Pattern[str]) -> list[str]:
    """Entries of a logger's folder that its logger did not write (``names``: its files; besides
    them, interrupted atomic writes)."""
    return [
        p.name + ("/" if p.is_dir() else "")
        for p in sorted(folder.iterdir())
        if not ((names.fullmatch(p.name) or _TMP.match(p.name)) and p.is_file() and not p.is_symlink())
    ]


def describe_run(root: Path) -> str | None:
    """A short description of the run in ``root`` (None when it holds none)."""
    root = Path(root)
    state = inspect_dir(root)
    if not state.holds_run:
        return None
    if (root / "summary.json").is_file():
        return "a finished run"
    if not (root / "config.yaml").is_file():
        return "part of a run (its config.yaml is missing, so it cannot be continued)"
    try:
        rounds = len(read_metrics(root / "metrics.jsonl"))
    except (RunDirError, OSError):
        rounds = 0
    return f"an unfinished run ({rounds} round{'s' if rounds != 1 else ''} recorded)"


def clear_run(root: Path) -> None:
    """Delete what a run wrote in ``root`` (never anything else: :func:`inspect_dir` must have
    found no foreign entry; checked again here)."""
    root = Path(root)
    state = inspect_dir(root)
    if state.foreign:
        raise RunDirError(
            f"{root} holds files that are not part of a fedhetero run ({state.foreign_text()}); "
            "nothing was deleted"
        )
    clean_stale(root)
    for name in RUN_ENTRIES:
        p = root / name
        if name == ".lock":
            continue
        if name == "client_state" and p.is_dir():
            for d in p.iterdir():
                for f in d.iterdir():
                    f.unlink()
                d.rmdir()
            p.rmdir()
        elif name in LOGGER_DIRS and p.is_dir():
            for f in p.iterdir():
                f.unlink()
            p.rmdir()
        elif p.is_file():
            p.unlink()


class RunLock:
    """An exclusive lock on a run directory for the lifetime of a run (``fcntl.flock`` on
    ``.lock``; released by the OS if the process dies)."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / ".lock"
        self._fh: Any = None

    def acquire(self) -> "RunLock":
        import fcntl  # deferred: POSIX only; the module imports everywhere

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

    @staticmethod
    def holder(root: Path) -> str | None:
        """Who holds the lock of the run directory ``root`` now (its pid, as the holder wrote it),
        or None when no process does; takes and drops the lock to find out."""
        path = Path(root) / ".lock"
        if not path.is_file():
            return None
        probe = RunLock(root)
        try:
            probe.acquire()
        except RunDirError:
            try:
                return path.read_text().strip() or "another process"
            except OSError:
                return "another process"
        probe.release()
        return None

    def release(self) -> None:
        if self._fh is not None:
            import fcntl  # deferred: POSIX only

            fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
