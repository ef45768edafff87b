"""fedhetero's Flower ServerApp: fedhetero's own round loop on Flower's runtime.

``main(grid, context)`` reads the run settings from the Flower App's run config and runs a
:class:`~fedhetero.core.run.engine.Engine` whose client tasks go to the SuperNodes through a
:class:`~fedhetero.integrations.flower.backend.FlowerBackend`. Sampling, seeds, aggregation,
evaluation, metrics, checkpoints and resume are fedhetero's (Flower's ``Strategy.start`` is not
used: it has no resume and samples node ids without a seed).

Run-config keys (``[tool.flwr.app.config]`` of the Flower App, or ``flwr run --run-config``):

``config``            the fedhetero config: a YAML/JSON file path on the ServerApp's machine, or the
                      YAML/JSON text itself (empty: the defaults)
``set``               ``key=value`` overrides separated by ``;`` (e.g. ``"train.rounds=3; seed=1"``)
``out-dir``           the run directory on the ServerApp's machine (use an absolute path)
``resume``            continue the run in ``out-dir`` from its last checkpoint
``overwrite``         replace a run already in ``out-dir``
``num-supernodes``    nodes to wait for before round 1 (0: whatever is connected)
``node-wait-s``       how long to wait for them
``delivery-grace-s``  transport allowance added to ``engine.client_timeout_s``
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import Context

from fedhetero.core.common.config import RunConfig
from fedhetero.core.common.options import ConfigError
from fedhetero.integrations.flower._common import (
    parse_config,
    run_config_get,
    split_overrides,
)
from fedhetero.core.run.engine import Engine
from fedhetero.core.run.resume import resume_config
from fedhetero.core.run.reports import default_out_dir, plot_run
from fedhetero.integrations.flower.backend import FlowerBackend

import fedhetero

# an app Flower loads is an entry point: torchvision and timm import here with the pinned install
fedhetero._torchvision_importable()

try:  # flwr >= 1.21
    from flwr.serverapp import Grid, ServerApp
except ImportError:  # pragma: no cover - older flwr
    from flwr.server import Grid, ServerApp  # type: ignore[no-redef]

__all__ = ["ServerSettings", "app", "make_server_app", "run_server", "settings_from_run_config"]

log = logging.getLogger("flwr.fedhetero")


@dataclass
class ServerSettings:
    """What the ServerApp runs: the config (None with ``resume``: the run directory's), where, and
    how long to wait for nodes."""

    config: RunConfig | None
    out_dir: Path
    resume: bool = False
    overwrite: bool = False  # replace a run already in out_dir
    num_nodes: int | None = None
    node_wait_s: float = 120.0
    delivery_grace_s: float = 10.0
    stop_after: int | None = None  # stop (as if killed) after this round: tests and drills
    progress: bool = False
    route: str = "partition-id"  # "node-order" in simulation: nodes are interchangeable, no query
    overrides: tuple[str, ...] = ()  # with resume and no config: applied to the saved config


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def settings_from_run_config(run_config: Mapping[str, Any]) -> ServerSettings:
    """:class:`ServerSettings` from a Flower run config (see the module docstring for the keys)."""
    resume = _as_bool(run_config_get(run_config, "resume", False))
    text = str(run_config_get(run_config, "config", "") or "")
    overrides = split_overrides(str(run_config_get(run_config, "set", "") or ""))
    cfg = None if resume and not text else parse_config(text, overrides)
    out = str(run_config_get(run_config, "out-dir", "") or "")
    if not out:
        if cfg is None:
            raise ConfigError("flower: resume needs out-dir (the run directory to continue)")

        out = str(default_out_dir(cfg))
    nodes = int(run_config_get(run_config, "num-supernodes", 0) or 0)
    stop_after = int(run_config_get(run_config, "stop-after", 0) or 0)
    return ServerSettings(
        config=cfg,
        out_dir=Path(out).expanduser().resolve(),
        resume=resume,
        overwrite=_as_bool(run_config_get(run_config, "overwrite", False)),
        num_nodes=nodes or None,
        node_wait_s=float(run_config_get(run_config, "node-wait-s", 120.0)),
        delivery_grace_s=float(run_config_get(run_config, "delivery-grace-s", 10.0)),
        stop_after=stop_after or None,
        overrides=tuple(overrides) if cfg is None else (),
    )


def _on_flower(cfg: RunConfig) -> RunConfig:
    """The config with ``engine.backend: flower`` (not part of the config hash: resumable either way)."""
    if cfg.engine.backend == "flower":
        return cfg
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, backend="flower"))


def run_server(grid: Grid, settings: ServerSettings, console: Any = None) -> Any:
    """Run (or resume) the job on the nodes ``grid`` reaches; returns the
    :class:`~fedhetero.core.run.engine.RunResult`."""
    cfg = settings.config
    if cfg is None:
        if not settings.resume:
            raise ConfigError("flower: no config given")
        # the saved config with the overrides, checked as `fedhetero train --resume` checks it
        cfg = resume_config(settings.out_dir, None, list(settings.overrides))[0]
    cfg = _on_flower(cfg)
    backend = FlowerBackend(
        cfg,
        grid,
        num_nodes=settings.num_nodes,
        node_wait_s=settings.node_wait_s,
        delivery_grace_s=settings.delivery_grace_s,
        route=settings.route,
    )
    log.info(
        "fedhetero: %s on %s (%d clients, %d rounds) -> %s%s",
        cfg.algorithm.name, cfg.data.dataset, cfg.data.num_clients, cfg.train.rounds, settings.out_dir,
        " (resuming)" if settings.resume else "",
    )
    engine = Engine(
        cfg,
        settings.out_dir,
        resume=settings.resume,
        overwrite=settings.overwrite,
        progress=settings.progress,
        console=console,
        stop_after=settings.stop_after,
        backend=backend,
    )
    result = engine.run()
    s = result.summary
    if s:
        log.info(
            "fedhetero: done: final accuracy %.4f, all clients within budget: %s, dropped clients: %d, wall %.1f s",
            s["final_accuracy"] if s["final_accuracy"] is not None else float("nan"),
            s["all_fit_budget"], s["dropped_clients"], s["wall_s"],
        )
        # accuracy.png, as `fedhetero train` writes it (needs the plot extra on this machine)
        plot = plot_run(console, result, settings.out_dir, cfg)
        if plot is not None:
            log.info("fedhetero: plot %s", plot)
        elif console is None and importlib.util.find_spec("matplotlib") is None:
            log.info("fedhetero: no plot written (install the plot extra: pip install 'fedhetero[plot]')")
    return result


def make_server_app(settings: ServerSettings, sink: Callable[[Any], None] | None = None, console: Any = None) -> ServerApp:
    """A ServerApp that runs ``settings`` (for the in-process simulation); ``sink`` receives the
    :class:`~fedhetero.core.run.engine.RunResult`."""
    server = ServerApp()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        result = run_server(grid, settings, console)
        if sink is not None:
            sink(result)

    return server


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point of the Flower App: the settings come from the run config."""
    run_server(grid, settings_from_run_config(context.run_config))
