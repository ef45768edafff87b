"""The ``fedhetero`` command line.

``fedhetero train``    run one federated job (the embedded default when given no arguments)
``fedhetero compare``  run several algorithms on the same clients, data, budgets and seeds
``fedhetero bench``    benchmarks (``reparam``, ``round``, ``memory``)
``fedhetero info``     algorithms, models, datasets and versions
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = ["main"]


def _console():
    from rich.console import Console

    return Console(stderr=False, highlight=False)


def _fmt_macs(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v / 1e6:.3f}"


def _fmt_bytes(v: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if v < 1024 or unit == "GB":
            return f"{v:.1f} {unit}" if unit != "B" else f"{int(v)} B"
        v /= 1024
    return str(v)  # pragma: no cover


def _fmt_acc(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.2f}"


def default_out_dir(cfg: Any) -> Path:
    return Path("runs") / f"{cfg.algorithm.name}-{cfg.data.dataset}-{cfg.model.name}-s{cfg.seed}"


def _train(args: argparse.Namespace) -> int:
    from fedhetero.config import load_config
    from fedhetero.engine import Engine

    console = _console()
    out = Path(args.out) if args.out else None
    if args.resume:
        if out is None:
            cfg0 = load_config(args.config, args.set)
            out = default_out_dir(cfg0)
        cfg = load_config(args.config, args.set) if (args.config or args.set) else None
        engine = Engine(cfg, out, resume=True, progress=not args.quiet, console=console)
    else:
        cfg = load_config(args.config, args.set)
        out = out or default_out_dir(cfg)
        engine = Engine(cfg, out, progress=not args.quiet, console=console)
    cfg = engine.cfg
    if not args.quiet:
        console.print(
            f"[bold]fedhetero train[/bold]: {cfg.algorithm.name} on {cfg.data.dataset} "
            f"({cfg.data.partition}, {cfg.data.num_clients} clients), model {cfg.model.name}, "
            f"{cfg.train.rounds} rounds → {out}"
        )
    result = engine.run()
    print_summary(console, result.summary, out)
    return 0


def print_summary(console: Any, summary: dict[str, Any], out: Path | None = None) -> None:
    from rich.table import Table

    table = Table(title=f"{summary['algorithm']}: final accuracy {_fmt_acc(summary['final_accuracy'])} %")
    for col in ("tier", "ratio", "budget MFLOPs", "trained MFLOPs", "fits", "client-rounds", "accuracy %"):
        table.add_column(col, justify="right")
    for name, t in summary["tiers"].items():
        table.add_row(
            name,
            f"{t['ratio']:g}×",
            _fmt_macs(t["budget_macs"]),
            _fmt_macs(t["macs"]),
            "—" if t["fits_budget"] is None else ("yes" if t["fits_budget"] else "NO"),
            str(t["client_rounds"]),
            _fmt_acc(t["accuracy"]),
        )
    console.print(table)
    console.print(
        f"best accuracy {_fmt_acc(summary['best_accuracy'])} %, mean of last 5 "
        f"{_fmt_acc(summary['mean_last5_accuracy'])} %, bytes sent {_fmt_bytes(summary['bytes_total'])}, "
        f"plain model {_fmt_macs(summary['plain_macs'])} MFLOPs (MACs/sample), wall {summary['wall_s']:.1f} s"
        + (f"; run directory {out}" if out else "")
    )


def _compare(args: argparse.Namespace) -> int:
    from fedhetero.compare import run_comparison

    console = _console()
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
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
    )
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.what == "reparam":
        from reparam.bench import main as bench_main

        return int(bench_main(args.rest) or 0)
    from fedhetero import bench

    if args.what == "round":
        return int(bench.round_main(args.rest) or 0)
    if args.what == "memory":
        return int(bench.memory_main(args.rest) or 0)
    raise SystemExit(f"unknown benchmark {args.what!r}")  # pragma: no cover


def _info(args: argparse.Namespace) -> int:
    import torch

    import fedhetero
    from fedhetero.algorithms import get_algorithm, list_algorithms
    from models import list_models

    console = _console()
    console.print(f"fedhetero {fedhetero.__version__}, torch {torch.__version__}")
    console.print("[bold]algorithms[/bold]:")
    for name in list_algorithms():
        cls = get_algorithm(name)
        doc = (cls.__doc__ or "").strip().splitlines()
        scen = ",".join(sorted(cls.adapts_to))
        console.print(f"  {name:<16} {doc[0] if doc else ''} [dim](budgets: {scen})[/dim]")
    console.print("[bold]models[/bold]: " + ", ".join(list_models()))
    console.print("[bold]datasets[/bold]: digits (bundled), cifar10, cifar100, dermamnist, synthetic")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedhetero",
        description="Federated learning across clients with very different compute, "
        "built on lossless structural re-parameterization.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "train",
        help="run one federated training job",
        description="Run one federated job. With no arguments: the embedded default "
        "(digits, Dirichlet beta=0.5, 3 tiers 1:2:3, DynamicFL).",
    )
    p.add_argument("--config", help="YAML config file (see examples/configs/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field, e.g. --set train.rounds=50 (repeatable)")
    p.add_argument("--out", help="run directory (default: runs/<algorithm>-<dataset>-<model>-s<seed>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
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
    p.add_argument("--out", help="output directory (default: runs/compare-<dataset>-<model>)")
    p.add_argument("--resume", action="store_true", help="reuse finished runs and resume unfinished ones")
    p.add_argument("--no-plot", action="store_true", help="do not write PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=_compare)

    p = sub.add_parser("bench", help="benchmarks: reparam | round | memory", description="Benchmarks measured side by side in one run; pass --help after the name for its options.")
    p.add_argument("what", choices=["reparam", "round", "memory"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of the benchmark")
    p.set_defaults(func=_bench)

    p = sub.add_parser("info", help="list algorithms, models and datasets")
    p.set_defaults(func=_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from fedhetero.config import ConfigError

    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"fedhetero: config error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"fedhetero: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedhetero: interrupted; continue with --resume", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
