"""``fedhetero dynamicfl-ablation``: DynamicFL against the baselines, and each of its choices
(:mod:`fedhetero.lab.ablation`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from fedhetero.cli._lists import floats, ints, names

__all__ = ["CHOICES", "add_parser", "run"]

#: the variants of :data:`fedhetero.lab.ablation.CHOICES`, named here so that the parser does not
#: import the lab (numpy) at start-up; a test keeps the two equal
CHOICES = ("default", "sum-gamma", "bn-reset", "anchor-calibrated", "anchor-frozen", "saliency-random", "branches-1x1_kxk",
           "grow-block", "no-fill", "tiers-1x", "global-bn", "rep-weights",
           "rep-calibrated", "branches-reset", "block-mean",
           "block-mean-calibrated")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``dynamicfl-ablation`` to a ``add_subparsers()`` object."""
    p = subparsers.add_parser(
        "dynamicfl-ablation",
        help="DynamicFL vs FedAvg and the width baselines, and each DynamicFL choice, run in parallel",
        description="``fedhetero dynamicfl-ablation``: DynamicFL against FedAvg and the width baselines, and "
        "each of DynamicFL's design choices, on a data set you have (by default Fashion-MNIST with LeNet-5, "
        "``examples/configs/fmnist_dynamicfl.yaml``).",
    )
    p.add_argument("--config", default="examples/configs/fmnist_dynamicfl.yaml", help="base config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override for every run, e.g. data.data_dir=...")
    p.add_argument("--out", default="runs/dynamicfl-ablation", help="folder for the runs and the tables")
    p.add_argument("--betas", default="0.1,0.5,5", help="Dirichlet β of the methods table")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--choice-betas", default="0.5", help="Dirichlet β of the choices runs (FedAP runs at the first)")
    p.add_argument("--choices", default=",".join(CHOICES), help=f"DynamicFL variants ({', '.join(CHOICES)})")
    p.add_argument("--dynamicfl-choice", default="default", metavar="CHOICE",
                   help="the DynamicFL variant of the methods table (default: the shipped one; "
                   "sum-gamma regenerates the tables made before the default changed)")
    p.add_argument("--no-fedap", action="store_true", help="leave out the FedAP runs")
    p.add_argument("--jobs", type=int, default=max(1, os.cpu_count() or 1), help="runs in parallel (one thread each)")
    p.add_argument("--no-run", action="store_true", help="only build the tables from finished runs")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``fedhetero dynamicfl-ablation``."""
    # deferred for start-up time: the lab imports numpy and the grid runner
    from fedhetero.lab.ablation import run_ablation

    return run_ablation(
        config=args.config, overrides=args.set, out=args.out, betas=floats(args.betas), seeds=ints(args.seeds),
        choice_betas=floats(args.choice_betas), choices=names(args.choices), fedap=not args.no_fedap,
        jobs=args.jobs, run=not args.no_run, dynamicfl_choice=args.dynamicfl_choice,
    )
