"""``fedhetero train``: run one federated job."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from fedhetero.core.config import ConfigError, load_config
from fedhetero.core.reports import default_out_dir, plot_run, print_summary

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
    from fedhetero.core.engine import Engine

    console = Console(highlight=False)
    out = Path(args.out) if args.out else None
    if args.resume:
        if args.overwrite:
            raise ConfigError("--resume and --overwrite: choose one (continue the run, or replace it)")
        if out is None:
            out = default_out_dir(load_config(args.config, args.set))
        # with --config: that config (it must match the saved one); else the saved config with
        # the --set overrides applied (only fields that may change on resume can differ)
        cfg = load_config(args.config, args.set) if args.config else None
        engine = Engine(cfg, out, resume=True, progress=not args.quiet, console=console,
                        overrides=None if args.config else list(args.set))
    else:
        cfg = load_config(args.config, args.set)
        out = out or default_out_dir(cfg)
        engine = Engine(cfg, out, progress=not args.quiet, console=console, overwrite=args.overwrite)
    args.resume_hint = f"fedhetero train --out {shlex.quote(str(out))} --resume"
    cfg = engine.cfg
    if not args.quiet:
        console.print(Text.assemble(
            ("fedhetero train", "bold"),
            f": {cfg.algorithm.name} on {cfg.data.dataset} ({cfg.data.partition}, {cfg.data.num_clients} clients), "
            f"model {cfg.model.name}, {cfg.train.rounds} rounds → {out}",
        ))
    result = engine.run()
    print_summary(console, result.summary, out)
    plot_run(console, result, out)
    return 0
