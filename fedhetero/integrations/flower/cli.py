"""``fedhetero flower``: run a job on Flower (extra ``fedhetero[flower]``).

``fedhetero flower simulate``  run a job in Flower's simulation engine on this machine
``fedhetero flower app DIR``   write a Flower App for ``flwr run`` on a SuperLink with SuperNodes

This module imports Flower only when a command runs, so the main CLI works without the extra.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from fedhetero.core.common.configfile import load_config
from fedhetero.core.common.console import make_console
from fedhetero.core.run.reports import default_out_dir, print_summary
from fedhetero.integrations.flower import require_flwr
from fedhetero.integrations.flower.deploy import flower_config, write_app

__all__ = ["add_parser", "handle"]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (see examples/configs/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --out")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``flower`` command (with ``simulate`` and ``app``) to a ``add_subparsers()`` object."""
    parser = subparsers.add_parser(
        "flower",
        help="run on Flower: simulate | app (needs fedhetero[flower])",
        description="Run fedhetero's client tasks on Flower's simulation or deployment engine. "
        "fedhetero keeps its own round loop, seeds, checkpoints and metrics: the numbers equal the "
        "local back end's. Needs the extra: pip install \"fedhetero[flower]\".",
    )
    sub = parser.add_subparsers(dest="flower_command", metavar="COMMAND")

    p = sub.add_parser(
        "simulate",
        help="run a job in Flower's simulation engine (Ray) on this machine",
        description="Run one job with its clients on simulated SuperNodes (Ray actors, one CPU each).",
    )
    _common(p)
    p.add_argument("--out", help="run directory (default: runs/<algorithm>-<dataset>-<model>-s<seed>)")
    p.add_argument("--supernodes", type=int, default=None, help="simulated SuperNodes (default: one per client)")
    p.add_argument("--cpus", type=int, default=None, help="CPUs for Ray (default: engine.workers or the machine's cores)")
    p.add_argument("--gpus-per-client", type=float, default=0.0, help="GPU share of one ClientApp (CUDA runs)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(func=handle)

    p = sub.add_parser(
        "app",
        help="write a Flower App (pyproject.toml) for `flwr run` on a SuperLink",
        description="Write a Flower App folder whose pyproject.toml points Flower at fedhetero's "
        "ServerApp and ClientApp and carries the run settings; submit it with "
        "`flwr run DIR <connection> --stream` (see docs/flower.md).",
    )
    p.add_argument("dir", help="folder to write the Flower App into")
    _common(p)
    p.add_argument("--out", help="run directory on the SuperLink's machine (made absolute)")
    p.add_argument("--supernodes", type=int, default=0, help="SuperNodes to wait for before round 1 (0: those connected)")
    p.add_argument("--node-wait-s", type=float, default=120.0, help="how long to wait for them (default 120)")
    p.add_argument("--superlink", metavar="HOST:PORT", help="also write the flwr connection 'fedhetero' for this SuperLink into $FLWR_HOME/config.toml")
    p.set_defaults(func=handle)
    parser.set_defaults(func=lambda args: (parser.print_help(), 0)[1])
    return parser


def _simulate(args: argparse.Namespace, console: Any) -> int:
    # deferred: the simulation imports Flower (the optional extra), which handle() has found installed
    from fedhetero.integrations.flower.simulation import simulate

    # on --resume without --config: the saved config, with the --set overrides applied to it
    cfg = None if args.resume and not args.config else load_config(args.config, args.set)
    if args.out:
        out = Path(args.out)
    elif cfg is not None:
        out = default_out_dir(cfg)
    else:
        raise SystemExit("fedhetero flower simulate: --resume needs --out (the run directory)")
    resources = {"num_cpus": 1.0, "num_gpus": float(args.gpus_per_client)}
    result = simulate(
        cfg,
        out,
        args.supernodes,
        args.resume,
        overwrite=args.overwrite,
        num_cpus=args.cpus,
        client_resources=resources,
        progress=not args.quiet,
        console=console,
        overrides=list(args.set) if cfg is None else None,
    )
    if result.summary:
        print_summary(console, result.summary, out, metrics=result.metrics)
        plot = Path(out) / "accuracy.png"
        if plot.is_file():  # written by the ServerApp (fedhetero.integrations.flower.server_app.run_server)
            console.print(f"plot: {plot} (accuracy and loss by round)", markup=False)
    return 0


def _app(args: argparse.Namespace, console: Any) -> int:
    cfg = None if args.resume and not (args.config or args.set) else load_config(args.config, args.set)
    if args.resume and not args.out:
        raise SystemExit("fedhetero flower app: --resume needs --out (the run directory)")
    path = write_app(
        args.dir,
        cfg,
        out_dir=args.out,
        num_supernodes=args.supernodes,
        resume=args.resume,
        overwrite=args.overwrite,
        node_wait_s=args.node_wait_s,
    )
    console.print(f"wrote {path}")
    if args.superlink:
        home = os.environ.get("FLWR_HOME") or str(Path.home() / ".flwr")
        conf = flower_config(home, args.superlink)
        console.print(f"wrote the flwr connection 'fedhetero' ({args.superlink}) to {conf}")
    console.print(f"submit it with: flwr run {args.dir} fedhetero --stream")
    return 0


def handle(args: argparse.Namespace) -> int:
    """Run ``fedhetero flower <command>``."""
    console = make_console(highlight=False)
    command = getattr(args, "flower_command", None)
    if command is None:
        return 0
    try:
        require_flwr()
    except ImportError as exc:
        print(f"fedhetero flower: {exc}", file=sys.stderr)
        return 2
    if command == "simulate":
        return _simulate(args, console)
    if command == "app":
        return _app(args, console)
    raise SystemExit(f"unknown flower command {command!r}")  # pragma: no cover
