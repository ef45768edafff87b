"""``fedhetero compare``: several algorithms on the same clients, data, budgets and seeds."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fedhetero.cli._lists import names
from fedhetero.core.common.options import ConfigError
from fedhetero.core.common.console import make_console

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``compare`` to a ``add_subparsers()`` object."""
    p = subparsers.add_parser(
        "compare",
        help="run several algorithms on the same clients, data, budgets and seeds",
        description="Run every listed algorithm on identical partitions, tiers, budgets and seeds; "
        "print a table and write comparison.csv / comparison.json (and PNG plots with the plot extra).",
    )
    p.add_argument("--config", help="YAML config file shared by every algorithm")
    p.add_argument("--algorithms", required=True, help="comma-separated algorithm names (see `fedhetero info`)")
    p.add_argument("--seeds", type=int, default=1, help="number of seeds (0..N-1 added to the config seed)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field (repeatable)")
    p.add_argument("--option", action="append", default=[], metavar="ALGO.KEY=VALUE",
                   help="an option of one algorithm, e.g. --option fedap.prune_round=10 (repeatable)")
    p.add_argument("--out", help="output directory (default: runs/compare-<dataset>-<model>-<settings hash>)")
    p.add_argument("--resume", action="store_true",
                   help="continue a comparison of the same settings: reuse finished runs, resume unfinished ones")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a comparison that --out already holds (otherwise refused)")
    p.add_argument("--no-plot", action="store_true", help="do not write PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``fedhetero compare``; sets ``args.resume_hint``."""
    # deferred for start-up time: the comparison imports torch
    from fedhetero.core.run.compare import run_comparison

    if args.resume and args.overwrite:
        raise ConfigError("--resume and --overwrite: choose one (continue the comparison, or replace it)")
    args.resume_hint = "the same fedhetero compare command with --resume"
    run_comparison(
        config=args.config,
        overrides=args.set,
        algorithms=names(args.algorithms),
        seeds=args.seeds,
        out=Path(args.out) if args.out else None,
        plot=not args.no_plot,
        console=make_console(highlight=False),
        progress=not args.quiet,
        resume=args.resume,
        options=args.option,
        overwrite=args.overwrite,
    )
    return 0
