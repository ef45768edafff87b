"""The ``fedhetero`` command line: one argparse tree, one module per command.

``fedhetero train``               run one federated job (with no arguments: the embedded default)
``fedhetero compare``             run several algorithms on the same clients, data, budgets and seeds
``fedhetero bench``               benchmarks: ``reparam``, ``reparam-gain``, ``round``, ``memory``, ``engines``, ``selector``
``fedhetero dyninit-table``       the DynInit study's transition table
``fedhetero dynamicfl-ablation``  DynamicFL against FedAvg and the width baselines, and each of its choices
``fedhetero flower``              run on Flower's simulation engine, or write a Flower App for deployment
``fedhetero info``                algorithms, models, datasets and versions

Each command module declares its parser with ``add_parser(subparsers)`` and sets ``func`` to the
function that runs it (``run(args) -> int``); ``fedhetero flower`` is declared by
:mod:`fedhetero.integrations.flower.cli`. :func:`main` parses, runs the command and turns the errors a
user can act on into one line on stderr and an exit status.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any, Iterable, Sequence

import fedhetero
from fedhetero.cli import ablation, bench, compare, dyninit_table, info, train
from fedhetero.core.common.options import ConfigError
from fedhetero.core.run.reports import default_out_dir, print_summary
from fedhetero.core.common.rundir import RunDirError
from fedhetero.integrations.flower import cli as flower

__all__ = ["CommandParser", "build_parser", "default_out_dir", "main", "print_summary"]

#: ``add_parser`` of every command, in the order ``fedhetero --help`` lists them
COMMANDS = (
    train.add_parser,
    compare.add_parser,
    bench.add_parser,
    dyninit_table.add_parser,
    ablation.add_parser,
    flower.add_parser,
    info.add_parser,
)


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose commands report the arguments they do not take themselves, with
    their own usage (``fedhetero bench round --bogus`` names ``fedhetero bench round``); plain
    argparse leaves them to the top-level parser. Its sub-parsers are of this class too."""

    def parse_known_args(self, args: Iterable[str] | None = None, namespace: Any = None) -> tuple[Any, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and self._subparsers is None:  # a command (no commands below it)
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def _overview(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    parser.print_help()
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``fedhetero`` parser; the parsed namespace's ``func`` runs the command given."""
    parser = CommandParser(
        prog="fedhetero",
        description="Federated learning across clients with very different compute, "
        "built on lossless structural re-parameterization.",
    )
    parser.add_argument("--version", action="version", version=f"fedhetero {fedhetero.__version__}")
    # no command: the overview; resume_hint: what continues an interrupted run (a command sets it
    # once its run directory is known)
    parser.set_defaults(func=functools.partial(_overview, parser), resume_hint=None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add_parser in COMMANDS:
        add_parser(sub)
    return parser


def _report(exc: Exception) -> int | None:
    """Print one line for an error the user can act on and return the exit status; ``None``: an
    error to re-raise (with ``FEDHETERO_DEBUG`` set)."""
    # deferred for start-up time: both modules import torch (a command failing with their errors
    # has imported them already)
    from fedhetero.core.local.context import RunError
    from fedhetero.data.errors import DataConfigError, DatasetFormatError

    if isinstance(exc, ConfigError):
        print(f"fedhetero: config error: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, (FileNotFoundError, RunDirError, DataConfigError, DatasetFormatError)):
        print(f"fedhetero: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, RunError):
        detail = getattr(exc, "detail", "")
        hint = " (set FEDHETERO_DEBUG=1 for the first failure's traceback)" if detail else ""
        print(f"fedhetero: {exc}{hint}", file=sys.stderr)
        if detail and os.environ.get("FEDHETERO_DEBUG"):
            print(f"first failure:\n{detail}", file=sys.stderr)
        return 1
    if isinstance(exc, PermissionError):
        print(f"fedhetero: permission denied: {exc.filename or exc}", file=sys.stderr)
        return 2
    # anything else: one line, the traceback on request
    if os.environ.get("FEDHETERO_DEBUG"):
        return None
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    print(f"fedhetero: {type(exc).__name__}: {first} (set FEDHETERO_DEBUG=1 for the traceback)", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fedhetero`` with ``argv`` (default: the process's arguments); returns the exit status.
    ``--help``, ``--version`` and argument errors exit through :class:`SystemExit`, as in argparse."""
    args = build_parser().parse_args(argv)
    # after the arguments are read, so that --help stays free of torch
    fedhetero._torchvision_importable()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        how = args.resume_hint
        print(f"fedhetero: interrupted; continue with: {how}" if how else "fedhetero: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        status = _report(exc)
        if status is None:
            raise
        return status
