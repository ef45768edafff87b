"""The Python API: :func:`run` and :func:`compare`, what ``fedhetero train`` and ``fedhetero compare``
do, called from Python.

``fedhetero.run`` and ``fedhetero.compare`` (lazy names of the package) are these functions::

    import fedhetero

    result = fedhetero.run(overrides={"train.rounds": 5})
    result.history      # the metrics.jsonl rows
    result.summary      # what summary.json holds
    result.model        # the trained global model, an nn.Module in eval mode
    result.out          # the run directory

A job is described as on the command line: ``config`` is a YAML file (``--config``), a dict of
config sections, a :class:`~fedhetero.core.common.config.RunConfig` or ``None`` (the embedded default
job), and ``overrides`` maps dotted keys to values as ``--set key=value`` does. The run directory,
its lock, ``resume`` and ``overwrite`` behave as ``--out``, ``--resume`` and ``--overwrite``:
:func:`build_engine` builds the job for both.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import numbers
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from torch import nn

from fedhetero.core.run.compare import compare_settings, default_compare_dir, parse_options, run_comparison
from fedhetero.core.common.config import RunConfig, backend_names, from_dict, to_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.common.configfile import apply_overrides, load_config
from fedhetero.core.common.console import make_console
from fedhetero.core.common.rundir import FinishedRunError, RunDirError, read_metrics
from fedhetero.core.run.engine import Engine
from fedhetero.core.run.reports import default_out_dir, plot_run

__all__ = ["CompareResult", "Config", "RunResult", "build_engine", "compare", "finished_numbers", "finished_run",
           "load", "run", "set_items"]

#: what ``config`` may be: a YAML file, config sections as a dict, a config, or None (the default job)
Config = Union[str, Path, Mapping[str, Any], RunConfig, None]


@dataclass(frozen=True)
class RunResult:
    """What :func:`run` returns (the engine's own result, :class:`fedhetero.core.run.engine.RunResult`,
    has no model)."""

    #: the run directory (``config.yaml``, ``metrics.jsonl``, ``summary.json``, the models, …)
    out: Path
    #: the final numbers, as ``summary.json`` holds them
    summary: dict[str, Any]
    #: one row per round, as ``metrics.jsonl`` holds them
    history: list[dict[str, Any]]
    #: the trained global model (the one ``final_model.pt`` holds), in eval mode
    model: nn.Module = field(repr=False)
    #: the resolved config the run used
    config: RunConfig = field(repr=False)


@dataclass(frozen=True)
class CompareResult:
    """What :func:`compare` returns."""

    #: the comparison directory (``comparison.json``, ``comparison.csv``, a run directory per method and seed)
    out: Path
    #: one row per algorithm, as ``comparison.json`` holds them: mean (and std) over the seeds, or
    #: ``status`` N/A / failed
    rows: list[dict[str, Any]]


def set_items(overrides: Mapping[str, Any] | Sequence[str] | None) -> list[str]:
    """``--set`` strings (``key=value``) of ``overrides``: a dict of dotted keys and values, or
    already such strings. A string value is read as ``--set`` reads it (YAML: ``"3"`` is 3); any other
    value (numbers, booleans, None, lists, dicts) is taken as it is."""
    if overrides is None:
        return []
    if isinstance(overrides, str):
        raise ConfigError(f"overrides: expected a dict of dotted keys and values, got the string {overrides!r}")
    if not isinstance(overrides, Mapping):
        items = list(overrides)
        bad = [i for i in items if not isinstance(i, str) or "=" not in i]
        if bad:
            raise ConfigError(f"overrides: expected a dict or 'key=value' strings, got {bad[0]!r}")
        return items
    out = []
    for key, value in overrides.items():
        if not isinstance(key, str) or not key.strip():
            raise ConfigError(f"overrides: keys are dotted config names such as 'train.rounds', got {key!r}")
        # JSON is YAML's flow syntax: a value that is not a string reads back as itself
        text = value if isinstance(value, str) else json.dumps(_plain(value), allow_nan=True)
        out.append(f"{key}={text}")
    return out


def _plain(value: Any) -> Any:
    """``value`` with tuples as lists and NumPy scalars as Python numbers (for JSON)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, numbers.Number) and not isinstance(value, (bool, int, float)) and hasattr(value, "item"):
        return value.item()
    return value


def load(config: Config = None, overrides: Sequence[str] = ()) -> RunConfig:
    """The resolved, validated config of ``config`` (see :data:`Config`) with ``--set`` strings applied."""
    if config is None or isinstance(config, (str, Path)):
        return load_config(config, list(overrides))
    if isinstance(config, RunConfig):
        return from_dict(apply_overrides(to_dict(config), list(overrides)))
    if isinstance(config, Mapping):
        return from_dict(apply_overrides(dict(config), list(overrides)))
    raise ConfigError(f"config: expected a YAML path, a dict, a RunConfig or None, got {type(config).__name__}")


def build_engine(
    config: Config,
    overrides: Sequence[str],
    *,
    out: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    console: Any = None,
) -> Engine:
    """The engine of one job, as ``fedhetero train`` builds it (it runs with ``.run()``).

    Without ``out`` the run directory is ``runs/<algorithm>-<dataset>-<model>-s<seed>-<hash>``
    (:func:`~fedhetero.core.run.reports.default_out_dir`). ``resume``: continue the run in ``out``; with
    ``config`` that config (it must match the saved one), else the saved config with the
    ``overrides`` applied to it (only the fields that may change on resume may differ)."""
    if resume:
        if overwrite:
            raise ConfigError("--resume and --overwrite: choose one (continue the run, or replace it)")
        cfg = load(config, overrides) if config is not None else None
        if out is None:
            out = _resume_dir(cfg if cfg is not None else load(None, overrides))
        return Engine(cfg, out, resume=True, progress=progress, console=console,
                      overrides=None if cfg is not None else list(overrides))
    cfg = load(config, overrides)
    return Engine(cfg, out if out is not None else default_out_dir(cfg), progress=progress, console=console,
                  overwrite=overwrite)


def _resume_dir(cfg: RunConfig) -> Path:
    """The default directory a resume without ``out`` continues: the config's own
    (:func:`~fedhetero.core.run.reports.default_out_dir`), or, when that holds no run, the one the same
    config made on another back end (the back end may change on resume)."""
    own = default_out_dir(cfg)
    if (own / "config.yaml").is_file():
        return own
    for name in backend_names():
        other = default_out_dir(dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, backend=name)))
        if (other / "config.yaml").is_file():
            return other
    return own


#: the command line's flags a run-directory refusal names, and what a Python caller passes instead
_PYTHON_ADVICE = (("--resume", "resume=True"), ("--overwrite", "overwrite=True"), ("--out", "out="))


@contextlib.contextmanager
def python_advice() -> Iterator[None]:
    """Run-directory refusals raised inside, with the advice in Python's words: the keyword
    arguments of :func:`run` and :func:`compare` (``resume=True``, ``overwrite=True``, ``out=``)
    instead of the command line's flags."""
    try:
        yield
    except RunDirError as exc:
        text = str(exc)
        for flag, keyword in _PYTHON_ADVICE:
            text = text.replace(flag, keyword)
        raise RunDirError(text) from None


def finished_numbers(out: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The summary and the per-round rows of the finished run in ``out`` (``summary.json``,
    ``metrics.jsonl``)."""
    out = Path(out)
    return json.loads((out / "summary.json").read_text(encoding="utf-8")), read_metrics(out / "metrics.jsonl")


def finished_run(out: str | Path) -> RunResult:
    """The result of the finished run in ``out``, read from its files (``summary.json``,
    ``metrics.jsonl``, ``final_model.pt``, ``config.yaml``); nothing is trained."""
    from fedhetero.core.run.export import load_model  # deferred: builds zoo models
    from fedhetero.core.run.resume import saved_config

    out = Path(out)
    summary, history = finished_numbers(out)
    return RunResult(out=out, summary=summary, history=history, model=load_model(out), config=saved_config(out))


#: what a second call of the same run says (see :class:`~fedhetero.core.common.rundir.FinishedRunError`)
AGAIN_PYTHON = "run it again with overwrite=True, another out= or another seed (overrides={\"seed\": N})"


def run(
    config: Config = None,
    *,
    out: str | Path | None = None,
    overrides: Mapping[str, Any] | Sequence[str] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    console: Any = None,
) -> RunResult:
    """Run one federated job, as ``fedhetero train`` does, and return its numbers and model.

    ``config``: a YAML file, a dict of config sections, a :class:`RunConfig` or ``None`` (the
    embedded default job). ``overrides``: dotted keys and values, e.g. ``{"train.rounds": 5,
    "algorithm.name": "fedavg"}``, with the meaning of ``--set`` (see :func:`set_items`). ``out``:
    the run directory (default ``runs/<algorithm>-<dataset>-<model>-s<seed>-<config hash>``, under
    the working directory). ``resume``: continue the run in ``out`` from its last checkpoint.
    ``overwrite``: replace a run ``out`` already holds (otherwise refused; a finished run of the
    same config is not refused: its result is returned, read from its files). ``progress``: print
    progress per round (on ``console``, default: a new rich console). Writes ``accuracy.png`` when
    matplotlib (the ``plot`` extra) is installed.

    Errors are raised as exceptions: :class:`~fedhetero.core.common.options.ConfigError` (a bad setting),
    :class:`~fedhetero.core.common.rundir.RunDirError` (a directory the run may not use), and the run's own
    errors (:class:`~fedhetero.core.local.context.RunError`)."""
    if console is None and progress:
        console = make_console(highlight=False)
    with python_advice():
        try:
            engine = build_engine(config, set_items(overrides), out=out, resume=resume, overwrite=overwrite,
                                  progress=progress, console=console)
        except FinishedRunError as done:  # the same run, finished before: its result, nothing trained
            if progress:
                console.print(f"{done.out_dir} already holds this run, finished: its result is returned "
                              f"(nothing trained); {AGAIN_PYTHON}", markup=False)
            return finished_run(done.out_dir)
        result = engine.run()
    plot_run(console if progress else None, result, engine.out_dir, engine.cfg)
    model = copy.deepcopy(engine.algorithm.eval_models(engine.ctx)["global"]).eval()
    return RunResult(out=engine.out_dir, summary=result.summary, history=result.metrics, model=model,
                     config=engine.cfg)


def compare(
    algorithms: Sequence[str] | str,
    config: Config = None,
    *,
    seeds: int = 1,
    overrides: Mapping[str, Any] | Sequence[str] | None = None,
    options: Mapping[str, Any] | Sequence[str] | None = None,
    out: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    plot: bool = True,
    progress: bool = True,
    console: Any = None,
) -> CompareResult:
    """Run several algorithms on the same clients, data, budgets and seeds, as ``fedhetero compare``
    does, and return its table.

    ``algorithms``: names (a list, or one comma-separated string). ``config`` and ``overrides``: as
    :func:`run`, shared by every algorithm. ``seeds``: runs per algorithm (seeds ``seed`` ..
    ``seed + seeds - 1``). ``options``: per-method options as ``{"ALGORITHM.option": value}`` (the
    meaning of ``--option``). ``out``: the comparison directory (default
    ``runs/compare-<dataset>-<model>-<settings hash>``); ``resume`` and ``overwrite`` as
    ``--resume`` and ``--overwrite``. ``plot``: write ``accuracy.png`` and ``tiers.png`` (with the
    ``plot`` extra). ``progress``: print progress and the table (on ``console``)."""
    names = [a.strip() for a in algorithms.split(",")] if isinstance(algorithms, str) else [str(a) for a in algorithms]
    names = [a for a in names if a]
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite: choose one (continue the comparison, or replace it)")
    if console is None and progress:
        console = make_console(highlight=False)
    base = load(config, set_items(overrides))
    option_items = set_items(options)
    if out is None:
        out = default_compare_dir(base, compare_settings(base, names, seeds, parse_options(option_items, names)))
    with python_advice():
        rows = run_comparison(
            config=base, overrides=[], algorithms=names, seeds=seeds, out=Path(out), plot=plot,
            console=console if progress else None, progress=progress, resume=resume, options=option_items,
            overwrite=overwrite,
        )
    return CompareResult(out=Path(out), rows=rows)
