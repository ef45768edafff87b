"""Experiment loggers: the numbers of ``metrics.jsonl`` and ``summary.json``, also written for the tools
people watch runs with.

A run names its loggers in the config (``loggers: [tensorboard, mlflow]``, or ``--set
loggers=[tensorboard]``); the names come from :data:`LOGGERS` (:func:`register_logger` adds one).
The engine calls every logger at the same places (:class:`RunLoggers`): :meth:`Logger.start` once
before its first round, :meth:`Logger.log_round` with each row it appends to ``metrics.jsonl``,
:meth:`Logger.log_summary` with ``summary.json`` and :meth:`Logger.close` at the end, whether the
run finished or stopped. ``metrics.jsonl`` stays the record: a logger only shows it elsewhere.

Each value is logged with the round as its step. A resumed run repeats the rounds after its last
checkpoint, so on resume a logger first makes what it holds equal the rows of the rounds the run
keeps (``history``) and then goes on: no step is logged twice, and a logger turned on at a resume
is given the earlier rounds.

The loggers shipped here write into the run directory, each in its own folder
(:data:`fedhetero.core.common.rundir.LOGGER_DIRS`, which ``--overwrite`` clears):

* ``tensorboard``: event files in ``tensorboard/`` (``tensorboard --logdir runs``);
* ``mlflow``: an MLflow tracking store in ``mlflow/mlflow.db`` (SQLite; ``mlflow ui
  --backend-store-uri sqlite:///runs/<run>/mlflow/mlflow.db``).

Both need the extra ``fedhetero[loggers]``; a run that names one without its packages is refused
before it starts, naming the extra. What is logged (:func:`round_scalars`): every number of a row
under its key (``accuracy``, ``loss``, ``bytes_up``, ``sim_time_s``, ``wall_s``, …), nested
mappings by path (``tier_accuracy/<tier>``, ``timers/<timer>``), and from the row's clients per
tier the mean of each number a client entry holds (``clients/macs/<tier>``,
``clients/budget_macs/<tier>``, ``clients/loss/<tier>``, …), the budget use (``clients/budget_use/<tier>``:
the mean of MACs trained over budget) and the counts (``clients/count``, ``clients/count/<tier>``,
``clients/dropped``). The summary's numbers go under ``summary/`` at the last round's step.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import numbers
import os
import re
import shutil
import tempfile
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedhetero.core.common.config import LOGGERS, RunConfig, config_hash, logger_names, to_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.common.configfile import dump_config
from fedhetero.core.common.rundir import LOGGER_DIRS

__all__ = [
    "LOGGERS",
    "Logger",
    "MLflowLogger",
    "RunLoggers",
    "TensorBoardLogger",
    "logger_class",
    "logger_names",
    "register_logger",
    "round_scalars",
    "summary_scalars",
]

#: The extra that installs the packages of the loggers shipped here.
EXTRA = "loggers"

Row = Mapping[str, Any]


class Logger:
    """Base of an experiment logger. A subclass sets :attr:`requires` (the import names of the
    packages it needs, checked before the run starts) and overrides the methods it needs; the
    engine calls them in the order :meth:`start`, :meth:`log_round` per round, :meth:`log_summary`
    (only when the run finished), :meth:`close` (always, also after an error)."""

    #: import names of the packages the logger needs
    requires: tuple[str, ...] = ()
    #: the folder of the run directory it writes in (a name of
    #: :data:`~fedhetero.core.common.rundir.LOGGER_DIRS`), or None when it writes none there
    folder: str | None = None
    #: the extra that installs them (named by the message when one is missing)
    extra: str = EXTRA

    def __init__(self, cfg: RunConfig, out_dir: Path) -> None:
        self.cfg = cfg
        self.out_dir = Path(out_dir)

    def start(self, resumed_from: int, history: Sequence[Row]) -> None:
        """Called once, before the first round this process runs. ``resumed_from``: the round the
        run goes on after (0: from the start); ``history``: the rows of rounds 1..resumed_from as
        ``metrics.jsonl`` holds them."""

    def log_round(self, row: Row) -> None:
        """One round's row of ``metrics.jsonl`` (step: ``row["round"]``)."""

    def log_summary(self, summary: Row) -> None:
        """The run's ``summary.json``, when it finished."""

    def close(self) -> None:
        """Release what the logger holds (files, connections); called once, also after an error."""


def register_logger(name: str) -> Callable[[type[Logger]], type[Logger]]:
    """Class decorator: make a :class:`Logger` subclass available as ``loggers: [name]``
    (``LOGGERS.register(name)``; the names live in :data:`fedhetero.core.common.config.LOGGERS`,
    so the config checks them without importing this module)."""

    def add(cls: type[Logger]) -> type[Logger]:
        if not (isinstance(cls, type) and issubclass(cls, Logger)):
            raise TypeError(f"register_logger({name!r}): {cls!r} is not a Logger subclass")
        LOGGERS.add(name, cls)
        return cls

    return add


def logger_class(name: str) -> type[Logger]:
    """The :class:`Logger` subclass registered as ``name`` (a built-in one is imported here)."""
    entry = LOGGERS.get(name)
    assert isinstance(entry, type) and issubclass(entry, Logger), name
    return entry


def _missing(packages: Iterable[str]) -> list[str]:
    """The packages of ``packages`` that cannot be imported (found without importing them)."""
    out = []
    for name in packages:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out


class RunLoggers:
    """The loggers a run's config names, called together by the engine. Made before anything is
    written: a logger whose packages are missing is refused with one :class:`ConfigError` naming
    the field and the extra to install."""

    def __init__(self, cfg: RunConfig, out_dir: Path) -> None:
        self.loggers: list[Logger] = []
        for i, name in enumerate(cfg.loggers):
            if name not in LOGGERS:  # the config checks the names; a registry changed since
                raise ConfigError(f"loggers[{i}]: must be one of {', '.join(map(repr, LOGGERS))}, got {name!r}")
            cls = logger_class(name)
            missing = _missing(cls.requires)
            if missing:
                raise ConfigError(
                    f"loggers[{i}]: the {name} logger needs {', '.join(missing)}, which "
                    f"{'is' if len(missing) == 1 else 'are'} not installed: "
                    f"pip install \"fedhetero[{cls.extra}]\" (or leave {name} out of loggers)"
                )
            self.loggers.append(cls(cfg, Path(out_dir)))

    def start(self, resumed_from: int, history: Sequence[Row]) -> None:
        for lg in self.loggers:
            lg.start(resumed_from, history)

    def log_round(self, row: Row) -> None:
        for lg in self.loggers:
            lg.log_round(row)

    def log_summary(self, summary: Row) -> None:
        for lg in self.loggers:
            lg.log_summary(summary)

    def close(self) -> None:
        """Close every logger; a logger that fails to close is reported as a warning (this runs
        while an error may be on its way out, which it must not replace)."""
        loggers, self.loggers = self.loggers, []
        for lg in loggers:
            try:
                lg.close()
            except Exception as exc:  # noqa: BLE001 - reported, never raised over the run's own error
                warnings.warn(f"fedhetero: the {type(lg).__name__} could not be closed: {exc}", RuntimeWarning, stacklevel=2)


# ---------------------------------------------------------------------------- what is logged


def _number(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (never a bool; ``metrics.jsonl`` holds a
    non-finite value as null)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    x = float(value)
    return x if math.isfinite(x) else None


def _numbers(tree: Mapping[str, Any], prefix: str, out: dict[str, float]) -> None:
    """Every finite number of ``tree`` under its path (``a/b``); lists and text are left out."""
    for key, value in tree.items():
        tag = f"{prefix}{key}"
        if isinstance(value, Mapping):
            _numbers(value, tag + "/", out)
        elif (x := _number(value)) is not None:
            out[tag] = x


def round_scalars(row: Row) -> dict[str, float]:
    """The scalars logged for one row of ``metrics.jsonl`` (its round is the step): every number
    of the row by path, and from its clients per tier the mean of each number of a client entry,
    the budget use and the counts (see the module's description)."""
    out: dict[str, float] = {}
    _numbers({k: v for k, v in row.items() if k not in ("round", "clients", "dropped")}, "", out)
    clients = [c for c in row.get("clients") or () if isinstance(c, Mapping)]
    out["clients/count"] = float(len(clients))
    out["clients/dropped"] = float(len(row.get("dropped") or ()))
    by_tier: dict[str, list[Mapping[str, Any]]] = {}
    for c in clients:
        by_tier.setdefault(str(c.get("tier")), []).append(c)
    for tier, entries in by_tier.items():
        out[f"clients/count/{tier}"] = float(len(entries))
        values: dict[str, list[float]] = {}
        for c in entries:
            for key, value in c.items():
                if key != "cid" and (x := _number(value)) is not None:
                    values.setdefault(key, []).append(x)
            macs, budget = _number(c.get("macs")), _number(c.get("budget_macs"))
            if macs is not None and budget:
                values.setdefault("budget_use", []).append(macs / budget)
        for key, xs in values.items():
            out[f"clients/{key}/{tier}"] = math.fsum(xs) / len(xs)
    return out


def summary_scalars(summary: Row) -> dict[str, float]:
    """The scalars logged for ``summary.json``: every number by path under ``summary/``."""
    out: dict[str, float] = {}
    _numbers(summary, "summary/", out)
    return out


def _last_step(summary: Row) -> int:
    rounds = summary.get("rounds")
    return int(rounds) if isinstance(rounds, int) and not isinstance(rounds, bool) else 0


# ---------------------------------------------------------------------------- TensorBoard

#: The event files TensorBoard's writer names ``events.out.tfevents.<time>.<host>.<pid>.<n>``.
_EVENT_FILE = LOGGER_DIRS["tensorboard"]


class TensorBoardLogger(Logger):
    """TensorBoard event files in ``<run dir>/tensorboard/``, written with TensorBoard's own
    writer: each scalar of :func:`round_scalars` with the round as step, the resolved config as
    text at step 0, the summary under ``summary/``. On start, earlier event files are replaced by
    one that holds exactly the kept rounds (their wall times kept), so a resume never leaves a step
    twice for any reader (TensorBoard's own purging of restarted runs depends on file order and on
    the reader)."""

    requires = ("tensorboard",)
    folder: str | None = "tensorboard"

    def __init__(self, cfg: RunConfig, out_dir: Path) -> None:
        super().__init__(cfg, out_dir)
        self.path = self.out_dir / "tensorboard"
        self._writer: Any = None

    def start(self, resumed_from: int, history: Sequence[Row]) -> None:
        # deferred: tensorboard is an optional extra (fedhetero[loggers])
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.path.mkdir(exist_ok=True)
        old = sorted(p for p in self.path.iterdir() if _EVENT_FILE.fullmatch(p.name) and p.is_file())
        times = self._wall_times(old, resumed_from) if old else {}
        self._writer = EventFileWriter(str(self.path), max_queue_size=1000, flush_secs=30)
        self._add_text("config", "\n".join("    " + line for line in dump_config(self.cfg).splitlines()), 0, times.get(0))
        for row in history:
            self._add_scalars(round_scalars(row), int(row["round"]), times.get(int(row["round"])))
        self._writer.flush()
        for p in old:  # now held by the new file
            p.unlink(missing_ok=True)

    @staticmethod
    def _wall_times(files: list[Path], upto: int) -> dict[int, float]:
        """The wall time at which each step up to ``upto`` was first logged in ``files``."""
        # deferred: tensorboard is an optional extra (fedhetero[loggers])
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

        times: dict[int, float] = {}
        for path in files:
            try:
                for event in EventFileLoader(str(path)).Load():
                    if event.HasField("summary") and event.step <= upto:
                        times.setdefault(int(event.step), float(event.wall_time))
            except Exception:  # noqa: BLE001 - a damaged file only loses its wall times; its rounds are rewritten
                continue
        return times

    def _add(self, summary: Any, step: int, wall_time: float | None) -> None:
        # deferred: tensorboard is an optional extra (fedhetero[loggers])
        from tensorboard.compat.proto.event_pb2 import Event

        self._writer.add_event(Event(wall_time=time.time() if wall_time is None else wall_time, step=step, summary=summary))

    def _add_scalars(self, scalars: Mapping[str, float], step: int, wall_time: float | None = None) -> None:
        # deferred: tensorboard is an optional extra (fedhetero[loggers])
        from tensorboard.compat.proto.summary_pb2 import Summary

        if scalars:
            values = [Summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()]
            self._add(Summary(value=values), step, wall_time)

    def _add_text(self, tag: str, text: str, step: int, wall_time: float | None = None) -> None:
        # deferred: tensorboard is an optional extra (fedhetero[loggers])
        from tensorboard.plugins.text.summary_v2 import text_pb

        self._add(text_pb(tag, text), step, wall_time)

    def log_round(self, row: Row) -> None:
        self._add_scalars(round_scalars(row), int(row["round"]))
        self._writer.flush()  # a round takes seconds: the board shows it at once

    def log_summary(self, summary: Row) -> None:
        self._add_scalars(summary_scalars(summary), _last_step(summary))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()


# ---------------------------------------------------------------------------- MLflow

#: What MLflow accepts in a metric or parameter name; anything else becomes "_".
_MLFLOW_NAME = re.compile(r"[^\w.\- /:]")
_LAST_ROUND = "fedhetero.last_round"  # tag: the last round the MLflow run holds
_SUMMARY = "fedhetero.summary"  # tag: "true" once it holds the summary
_BATCH = 1000  # MLflow's most metrics in one log_batch call
_PARAM_BATCH = 100  # ... and parameters
_PARAM_LENGTH = 6000  # the longest parameter value MLflow stores


def _mlflow_name(tag: str) -> str:
    """``tag`` as an MLflow metric or parameter name: its characters, and no empty, ``.`` or
    ``..`` part between slashes (MLflow refuses a name that would resolve to another path)."""
    parts = _MLFLOW_NAME.sub("_", tag).split("/")
    return "/".join(p if p not in ("", ".", "..") else "_" for p in parts)[:250]


def _params(tree: Any, prefix: str = "") -> dict[str, str]:
    """The config as MLflow parameters: dotted paths to text (JSON for what is not a string)."""
    if isinstance(tree, Mapping) and (tree or not prefix):
        out: dict[str, str] = {}
        for key, value in tree.items():
            out.update(_params(value, f"{prefix}{key}."))
        return out
    text = tree if isinstance(tree, str) else json.dumps(tree)
    if len(text) > _PARAM_LENGTH:
        text = text[: _PARAM_LENGTH - 1] + "…"
    return {_mlflow_name(prefix[:-1]): text}


@contextlib.contextmanager
def _mlflow_client(db: Path) -> Iterator[Any]:
    """An ``MlflowClient`` of the SQLite store ``db``: made without MLflow's and Alembic's INFO
    lines on the console, and (unless ``MLFLOW_SQLALCHEMYSTORE_POOLCLASS`` is set) with no pool of
    open connections: MLflow keeps one store per URI for the process's life, and a pooled
    connection would hold on to a store file that ``--overwrite`` replaced."""
    # deferred: mlflow is an optional extra (fedhetero[loggers])
    from mlflow.tracking import MlflowClient

    loggers = [logging.getLogger(name) for name in ("mlflow", "alembic")]
    levels = [lg.level for lg in loggers]
    pool = "MLFLOW_SQLALCHEMYSTORE_POOLCLASS"
    own_pool = pool not in os.environ
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    if own_pool:
        os.environ[pool] = "NullPool"
    try:
        # the path percent-quoted: SQLAlchemy reads the URL's database part unquoted
        yield MlflowClient(tracking_uri="sqlite:///" + urllib.parse.quote(str(db.resolve())))
    finally:
        if own_pool:
            os.environ.pop(pool, None)
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


#: An empty store made once in this process, copied for each new one: a new store runs MLflow's
#: schema migrations, which take seconds.
_EMPTY_STORE: dict[str, Any] = {}


def _new_store(db: Path) -> None:
    """Make ``db`` an empty MLflow store (through a temporary file: a kill leaves no half store)."""
    held = _EMPTY_STORE.get("dir")
    if held is None or not (Path(held.name) / "mlflow.db").is_file():
        held = tempfile.TemporaryDirectory(prefix="fedhetero-mlflow-")  # removed when the process ends
        with _mlflow_client(Path(held.name) / "mlflow.db") as client:
            client.search_experiments(max_results=1)
        _EMPTY_STORE["dir"] = held
    tmp = db.with_name(f".{db.name}.tmp{os.getpid()}")
    shutil.copyfile(Path(held.name) / "mlflow.db", tmp)
    os.replace(tmp, db)


class MLflowLogger(Logger):
    """An MLflow tracking store in ``<run dir>/mlflow/mlflow.db`` (SQLite; MLflow's file store is
    in maintenance mode and refuses to open by default): one MLflow run, named after the run
    directory, in experiment ``fedhetero``, with the config as parameters, each scalar of
    :func:`round_scalars` as a metric with the round as step and the summary under ``summary/``.
    Its status is ``FINISHED`` once the summary is logged and ``KILLED`` when the run stopped
    before (a resume sets it ``RUNNING`` again). No network: the store is a local file, and
    MLflow's usage telemetry is turned off unless ``MLFLOW_DISABLE_TELEMETRY`` is set.

    On resume the MLflow run is continued when it holds no round after the checkpoint's and no
    summary (the rounds it lacks are added from ``metrics.jsonl``); one that does (rounds logged
    after the last checkpoint, which the resumed run repeats, or the summary of a finished run
    resumed to add a logger) is deleted and made again from ``metrics.jsonl``, since MLflow cannot
    delete single metric values."""

    requires = ("mlflow", "sqlalchemy", "alembic")
    folder: str | None = "mlflow"
    experiment = "fedhetero"

    def __init__(self, cfg: RunConfig, out_dir: Path) -> None:
        super().__init__(cfg, out_dir)
        self.path = self.out_dir / "mlflow"
        self._client: Any = None
        self.run_id: str | None = None
        self._finished = False

    def start(self, resumed_from: int, history: Sequence[Row]) -> None:
        # no usage reports from a run that asked for a local store (the user's own setting wins;
        # MLflow reads it when it is first imported)
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        self.path.mkdir(exist_ok=True)
        db = self.path / "mlflow.db"
        if not db.is_file():
            _new_store(db)
        with _mlflow_client(db) as client:
            self._client = client
        exp = client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(
            self.experiment, artifact_location=(self.path / "artifacts").resolve().as_uri()
        )
        runs = client.search_runs([exp_id], max_results=1, order_by=["attributes.start_time DESC"])
        run = runs[0] if runs else None
        last = int(run.data.tags.get(_LAST_ROUND, "0")) if run is not None else 0
        if run is not None and (last > resumed_from or run.data.tags.get(_SUMMARY) == "true"):
            client.delete_run(run.info.run_id)  # holds rounds (or a summary) the resumed run logs again
            run, last = None, 0
        if run is None:
            tags = {
                "fedhetero.algorithm": self.cfg.algorithm.name,
                "fedhetero.dataset": self.cfg.data.dataset,
                "fedhetero.model": self.cfg.model.name,
                "fedhetero.config_hash": config_hash(self.cfg),
                _LAST_ROUND: "0",
            }
            run = client.create_run(exp_id, run_name=self.out_dir.resolve().name, tags=tags)
            self.run_id = run.info.run_id
            self._log_params(_params(to_dict(self.cfg)))
        else:
            self.run_id = run.info.run_id
            client.update_run(self.run_id, status="RUNNING")
        for row in history:
            if int(row["round"]) > last:
                self.log_round(row)

    def _log_params(self, params: dict[str, str]) -> None:
        # deferred: mlflow is an optional extra (fedhetero[loggers])
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), _PARAM_BATCH):
            self._client.log_batch(self.run_id, params=items[i : i + _PARAM_BATCH])

    def _log(self, scalars: Mapping[str, float], step: int, tags: Mapping[str, str] = {}) -> None:  # noqa: B006 - read only
        # deferred: mlflow is an optional extra (fedhetero[loggers])
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_name(k), v, now, step) for k, v in scalars.items()]
        for i in range(0, max(len(metrics), 1), _BATCH):
            last = i + _BATCH >= len(metrics)
            # the tag goes with the last batch, in its transaction: the store never holds a
            # round's tag without its metrics
            self._client.log_batch(
                self.run_id, metrics=metrics[i : i + _BATCH], tags=[RunTag(k, v) for k, v in tags.items()] if last else []
            )

    def log_round(self, row: Row) -> None:
        step = int(row["round"])
        self._log(round_scalars(row), step, {_LAST_ROUND: str(step)})

    def log_summary(self, summary: Row) -> None:
        self._log(summary_scalars(summary), _last_step(summary), {_SUMMARY: "true"})
        self._client.set_terminated(self.run_id, status="FINISHED")
        self._finished = True

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None and self.run_id is not None and not self._finished:
            client.set_terminated(self.run_id, status="KILLED")  # stopped before its end; --resume goes on
