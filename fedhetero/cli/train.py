"""``fedhetero train``: run one federated job."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from rich.text import Text

from fedhetero.core.common.config import config_hash
from fedhetero.core.common.options import ConfigError
from fedhetero.core.common.configfile import load_config
from fedhetero.core.common.console import make_console
from fedhetero.core.run.reports import plot_run, print_summary

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``train`` to a ``add_subparsers()`` object."""
    p = subparsers.add_parser(
        "train",
        help="run one federated training job",
        description="Run one federated job. With no arguments: the embedded default "
        "(digits, Dirichlet beta=0.5, 3 tiers 1:2:3, DynamicFL).",
    )
    p.add_argument("--config", help="YAML config file (see examples/configs/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set train.rounds=50 (repeatable)")
    p.add_argument("--out", help="run directory (default: runs/<algorithm>-<dataset>-<model>-s<seed>-<config hash>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace a run that --out already holds (otherwise refused)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``fedhetero train``; sets ``args.resume_hint`` once the run directory is known."""
    # deferred for start-up time: the engine imports torch
    from fedhetero.core.run.api import build_engine

    from fedhetero.core.common.rundir import FinishedRunError

    console = make_console(highlight=False)
    # the run directory, its lock and --resume / --overwrite as fedhetero.run does them
    try:
        engine = build_engine(args.config, args.set, out=args.out, resume=args.resume, overwrite=args.overwrite,
                              progress=not args.quiet, console=console)
    except FinishedRunError as done:  # the same run, finished before: its table, nothing trained
        return show_finished(console, done.out_dir)
    out = engine.out_dir
    args.resume_hint = continue_command(args, engine)
    cfg = engine.cfg
    if not args.resume:  # the method and its options are checked before anything says what will run
        from fedhetero.core.method.registry import build_algorithm

        build_algorithm(cfg)
    if not args.quiet:
        console.print(Text.assemble(
            ("fedhetero train", "bold"),
            f": {cfg.algorithm.name} on {cfg.data.dataset} ({cfg.data.partition}, {cfg.data.num_clients} clients), "
            f"model {cfg.model.name}, {cfg.train.rounds} rounds → {out}",
        ))
    try:
        result = engine.run()
    except KeyboardInterrupt:
        args.resume_hint = continue_command(args, engine)  # what is on disk now decides
        raise
    print_summary(console, result.summary, out, cfg, result.metrics)
    plot = plot_run(console, result, out, cfg)
    if plot is not None:
        console.print(f"plot: {plot} (accuracy and loss by round)", markup=False)
    return 0


def show_finished(console: Any, out: Path) -> int:
    """Print the result table of the finished run in ``out`` (from its files, nothing trained) and
    how to run it again; exit status 0."""
    from fedhetero.core.common.rundir import RUN_AGAIN
    from fedhetero.core.run.api import finished_numbers

    summary, history = finished_numbers(out)
    print_summary(console, summary, out, None, history)
    console.print(f"{out} already held this run, finished: its result above, nothing trained; {RUN_AGAIN}",
                  markup=False)
    return 0


def continue_command(args: argparse.Namespace, engine: Any) -> str:
    """The exact command that continues an interrupted ``fedhetero train``: ``--out DIR --resume``
    once the run directory holds this run's config (written when the set-up is done), naming again
    a method from code outside fedhetero (a run directory never makes fedhetero import code);
    before that, nothing of the run is on disk and the command is the one given, with its ``--out``."""
    out = str(engine.out_dir)
    saved = engine.out_dir / "config.yaml"
    if args.resume or (saved.is_file() and _hash_of(saved) == config_hash(engine.cfg)):
        sets = list(args.set) if args.resume else []  # a resume's --set: fields that may change on resume
        name = engine.cfg.algorithm.name
        if ":" in name and not any(s.split("=", 1)[0].strip() == "algorithm.name" for s in sets):
            sets.append(f"algorithm.name={name}")
        argv = ["fedhetero", "train", "--out", out, "--resume"] + [a for s in sets for a in ("--set", s)]
    else:
        argv = ["fedhetero", "train"] + (["--config", args.config] if args.config else [])
        argv += [a for s in args.set for a in ("--set", s)] + ["--out", out]
        argv += ["--overwrite"] if args.overwrite else []
    return shlex.join(argv)


def _hash_of(path: Path) -> str | None:
    try:
        return config_hash(load_config(path))
    except (ConfigError, OSError):
        return None
