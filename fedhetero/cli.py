"""The ``fedhetero`` command line.

``fedhetero train``    run one federated job (the embedded default when given no arguments)
``fedhetero compare``  run several algorithms on the same clients, data, budgets and seeds
``fedhetero bench``    benchmarks (``reparam``, ``round``, ``memory``, ``engines``, ``selector``)
``fedhetero flower``   run on Flower's simulation engine, or write a Flower App for deployment
``fedhetero info``     algorithms, models, datasets and versions
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

from rich.text import Text

from fedhetero.config import ConfigError
from fedhetero.reports import default_out_dir, plot_run, print_summary

__all__ = ["build_parser", "default_out_dir", "main", "print_summary"]


#: the command that continues an interrupted run (set once its directory is known)
_INTERRUPTED: dict[str, str] = {}


def _console():
    from rich.console import Console

    return Console(stderr=False, highlight=False)


def _train(args: argparse.Namespace) -> int:
    from fedhetero.config import load_config
    from fedhetero.engine import Engine

    console = _console()
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
    _INTERRUPTED["resume"] = f"fedhetero train --out {shlex.quote(str(out))} --resume"
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


def _compare(args: argparse.Namespace) -> int:
    from fedhetero.compare import run_comparison

    console = _console()
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    if args.resume and args.overwrite:
        raise ConfigError("--resume and --overwrite: choose one (continue the comparison, or replace it)")
    _INTERRUPTED["resume"] = "the same fedhetero compare command with --resume"
    run_comparison(
        config=args.config,
        overrides=args.set,
        algorithms=algorithms,
        seeds=args.seeds,
        out=Path(args.out) if args.out else None,
        plot=not args.no_plot,
        console=console,
        progress=not args.quiet,
        resume=args.resume,
        options=args.option,
        overwrite=args.overwrite,
    )
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.what == "reparam":
        from fedhetero.lab.bench_reparam import main as bench_main

        return int(bench_main(args.rest, prog="fedhetero bench reparam") or 0)
    from fedhetero.lab import bench

    if args.what == "round":
        return int(bench.round_main(args.rest) or 0)
    if args.what == "memory":
        return int(bench.memory_main(args.rest) or 0)
    if args.what == "engines":
        return int(bench.engines_main(args.rest) or 0)
    if args.what == "selector":
        from fedhetero.lab.bench_selector import main as selector_main

        return int(selector_main(args.rest) or 0)
    raise SystemExit(f"unknown benchmark {args.what!r}")  # pragma: no cover


def _info(args: argparse.Namespace) -> int:
    import torch

    import fedhetero
    from fedhetero.algorithms import get_algorithm, list_algorithms
    from fedhetero.models import list_models

    console = _console()
    console.print(f"fedhetero {fedhetero.__version__}, torch {torch.__version__}")
    console.print("[bold]algorithms[/bold]:")
    for name in list_algorithms():
        cls = get_algorithm(name)
        doc = (cls.__doc__ or "").strip().splitlines()
        scen = ",".join(sorted(cls.adapts_to))
        console.print(f"  {name:<16} {doc[0] if doc else ''} [dim](budgets: {scen})[/dim]")
    console.print("[bold]models[/bold]: " + ", ".join(list_models()))
    console.print("[bold]datasets[/bold]: digits (bundled), cifar10, cifar100, dermamnist, mnist, fashion_mnist, femnist, synthetic")
    return 0


def _dyninit_table(args: argparse.Namespace) -> int:
    from fedhetero.lab.dyninit_table import main as table_main

    return table_main(list(args.rest))


def _ablation(args: argparse.Namespace) -> int:
    from fedhetero.lab.ablation import main as ablation_main

    return ablation_main(list(args.rest))


#: commands with their own argument parser: name -> (function, help, description)
_OWN_PARSER: dict[str, tuple[Any, str, str]] = {
    "dyninit-table": (
        _dyninit_table,
        "the DynInit transition table: overlap x alpha x host x method x seed, run in parallel",
        "Run (or reuse) the DynInit study's grid and print the transition and time-to-accuracy tables",
    ),
    "dynamicfl-ablation": (
        _ablation,
        "DynamicFL vs FedAvg and the width baselines, and each DynamicFL choice, run in parallel",
        "Run (or reuse) the DynamicFL ablation grid and print its tables",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedhetero",
        description="Federated learning across clients with very different compute, "
        "built on lossless structural re-parameterization.",
    )
    import fedhetero

    parser.add_argument("--version", action="version", version=f"fedhetero {fedhetero.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "train",
        help="run one federated training job",
        description="Run one federated job. With no arguments: the embedded default "
        "(digits, Dirichlet beta=0.5, 3 tiers 1:2:3, DynamicFL).",
    )
    p.add_argument("--config", help="YAML config file (see examples/configs/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field, e.g. --set train.rounds=50 (repeatable)")
    p.add_argument("--out", help="run directory (default: runs/<algorithm>-<dataset>-<model>-s<seed>-<config hash>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace a run that --out already holds (otherwise refused)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=_train)

    p = sub.add_parser(
        "compare",
        help="run several algorithms on the same clients, data, budgets and seeds",
        description="Run every listed algorithm on identical partitions, tiers, budgets and seeds; "
        "print a table and write comparison.csv / comparison.json (and PNG plots with the plot extra).",
    )
    p.add_argument("--config", help="YAML config file shared by every algorithm")
    p.add_argument("--algorithms", required=True, help="comma-separated algorithm names (see `fedhetero info`)")
    p.add_argument("--seeds", type=int, default=1, help="number of seeds (0..N-1 added to the config seed)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field (repeatable)")
    p.add_argument("--option", action="append", default=[], metavar="ALGO.KEY=VALUE", help="an option of one algorithm, e.g. --option fedap.prune_round=10 (repeatable)")
    p.add_argument("--out", help="output directory (default: runs/compare-<dataset>-<model>-<settings hash>)")
    p.add_argument("--resume", action="store_true", help="continue a comparison of the same settings: reuse finished runs, resume unfinished ones")
    p.add_argument("--overwrite", action="store_true", help="replace a comparison that --out already holds (otherwise refused)")
    p.add_argument("--no-plot", action="store_true", help="do not write PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=_compare)

    p = sub.add_parser("bench", help="benchmarks: reparam | round | memory | engines | selector", description="Benchmarks measured side by side in one run; pass --help after the name for its options.")
    p.add_argument("what", choices=["reparam", "round", "memory", "engines", "selector"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of the benchmark")
    p.set_defaults(func=_bench)

    for name, (func, help_text, description) in _OWN_PARSER.items():
        p = sub.add_parser(name, help=help_text, description=description + "; pass --help after the name for its options.",
                           add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER, help=f"options (see `fedhetero {name} --help`)")
        p.set_defaults(func=func)

    from fedhetero.integrations.flower.cli import add_parser as add_flower_parser

    add_flower_parser(sub)  # imports Flower only when a flower command runs

    p = sub.add_parser("info", help="list algorithms, models and datasets")
    p.set_defaults(func=_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] and raw[0] in _OWN_PARSER:  # its own parser: every option (--help too) goes to it
        args = argparse.Namespace(command=raw[0], func=_OWN_PARSER[raw[0]][0], rest=raw[1:])
    else:
        args = parser.parse_args(raw)
    if args.command is None:
        parser.print_help()
        return 0
    import os

    from fedhetero.context import RunError
    from fedhetero.data.errors import DataConfigError, DatasetFormatError
    from fedhetero.rundir import RunDirError

    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"fedhetero: config error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, RunDirError, DataConfigError, DatasetFormatError) as exc:
        print(f"fedhetero: {exc}", file=sys.stderr)
        return 2
    except RunError as exc:
        detail = getattr(exc, "detail", "")
        hint = " (set FEDHETERO_DEBUG=1 for the first failure's traceback)" if detail else ""
        print(f"fedhetero: {exc}{hint}", file=sys.stderr)
        if detail and os.environ.get("FEDHETERO_DEBUG"):
            print(f"first failure:\n{detail}", file=sys.stderr)
        return 1
    except PermissionError as exc:
        print(f"fedhetero: permission denied: {exc.filename or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        how = _INTERRUPTED.get("resume")
        print(f"fedhetero: interrupted; continue with: {how}" if how else "fedhetero: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # anything else: one line, the traceback on request
        if os.environ.get("FEDHETERO_DEBUG"):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(
            f"fedhetero: {type(exc).__name__}: {first} (set FEDHETERO_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
