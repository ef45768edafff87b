"""``fedhetero info``: algorithms, models, datasets and versions."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

import fedhetero

__all__ = ["add_parser", "run"]

def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``info`` to a ``add_subparsers()`` object."""
    p = subparsers.add_parser("info", help="list algorithms, models and datasets")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Print the versions, the registered algorithms (first docstring line, budget scenarios), the
    zoo's models and the data sets."""
    # deferred for start-up time: torch, and the algorithms and models that import it
    import torch

    from fedhetero.algorithms import get_algorithm, list_algorithms
    from fedhetero.data import DATASETS
    from fedhetero.models import list_models

    console = Console(highlight=False)
    console.print(f"fedhetero {fedhetero.__version__}, torch {torch.__version__}")
    console.print("[bold]algorithms[/bold]:")
    for name in list_algorithms():
        cls = get_algorithm(name)
        doc = (cls.__doc__ or "").strip().splitlines()
        scen = ",".join(sorted(cls.adapts_to))
        console.print(f"  {name:<16} {doc[0] if doc else ''} [dim](budgets: {scen})[/dim]")
    console.print("[bold]models[/bold]: " + ", ".join(list_models()))
    names = [f"{d} (bundled)" if d == "digits" else d for d in DATASETS]
    console.print("[bold]datasets[/bold]: " + ", ".join(names))
    return 0
