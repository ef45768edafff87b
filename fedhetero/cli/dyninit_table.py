"""``fedhetero dyninit-table``: the DynInit study's transition table (:mod:`fedhetero.lab.dyninit_table`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from fedhetero.cli._lists import floats, ints, names

__all__ = ["METHODS", "add_parser", "run"]

#: the methods of :data:`fedhetero.lab.dyninit_table.METHODS`, named here so that the parser does not
#: import the lab (numpy) at start-up; a test keeps the two equal
METHODS = ("dyninit", "continuous", "previous", "average")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``dyninit-table`` to a ``add_subparsers()`` object."""
    p = subparsers.add_parser(
        "dyninit-table",
        help="the DynInit transition table: overlap x alpha x host x method x seed, run in parallel",
        description="``fedhetero dyninit-table``: the DynInit study's transition table on a data set you have.",
    )
    p.add_argument("--config", default="examples/configs/fmnist_dyninit.yaml", help="base config (one DynInit run)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override for every run, e.g. data.data_dir=...")
    p.add_argument("--out", default="runs/dyninit-table", help="folder for the runs and the tables")
    p.add_argument("--overlaps", default="0.0,0.2")
    p.add_argument("--alphas", default="0.3,0.7")
    p.add_argument("--hosts", default="fedprox,scaffold,moon,fedacg,fedavg")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seeds", default="100,200,300")
    p.add_argument("--jobs", type=int, default=max(1, os.cpu_count() or 1), help="runs in parallel (one thread each)")
    p.add_argument("--rho", type=float, default=0.95,
                   help="time-to-accuracy target: this fraction of DynInit's session peak")
    p.add_argument("--no-run", action="store_true", help="only build the tables from finished runs")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``fedhetero dyninit-table``."""
    # deferred for start-up time: the lab imports numpy and the grid runner
    from fedhetero.lab.dyninit_table import run_table

    return run_table(
        config=args.config, overrides=args.set, out=args.out, overlaps=floats(args.overlaps),
        alphas=floats(args.alphas), hosts=names(args.hosts), methods=names(args.methods), seeds=ints(args.seeds),
        jobs=args.jobs, rho=args.rho, run=not args.no_run,
    )
