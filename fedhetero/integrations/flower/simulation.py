"""Run a fedhetero job in Flower's simulation engine (Ray), from Python.

The ServerApp and ClientApp are the same ones a deployment runs; only the runtime differs: the
SuperNodes are virtual and their ClientApps run in Ray actors on this machine (one CPU each by
default).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fedhetero.core.common.config import RunConfig
from fedhetero.core.local.context import RunError
from fedhetero.core.run.resume import resume_config
from fedhetero.integrations.flower.server_app import ServerSettings, make_server_app
from fedhetero.integrations.flower.client_app import app as client_app

__all__ = ["simulate"]


def simulate(
    cfg: RunConfig | None,
    out_dir: str | Path,
    num_supernodes: int | None = None,
    resume: bool = False,
    *,
    overwrite: bool = False,
    stop_after: int | None = None,
    num_cpus: int | None = None,
    client_resources: dict[str, float] | None = None,
    node_wait_s: float = 120.0,
    progress: bool = False,
    console: Any = None,
    verbose: bool = False,
    overrides: list[str] | None = None,
) -> Any:
    """Run (or resume) ``cfg`` on ``num_supernodes`` simulated SuperNodes; returns the
    :class:`~fedhetero.core.run.engine.RunResult`.

    Parameters
    ----------
    cfg:
        the run's config (None with ``resume``: the one saved in ``out_dir``).
    num_supernodes:
        simulated nodes (default: one per client); client ``c`` runs on node ``c % num_supernodes``.
    num_cpus:
        CPUs Ray may use (default: ``engine.workers``, else the machine's cores, at most one per node).
    client_resources:
        resources of one ClientApp (default ``{"num_cpus": 1, "num_gpus": 0}``; on CUDA give e.g.
        ``{"num_cpus": 1, "num_gpus": 0.25}``).
    overwrite:
        replace a run already in ``out_dir``.
    stop_after:
        stop after this round as if killed (tests and drills; continue with ``resume=True``).
    """
    # deferred: flwr.simulation imports Ray, slow to load; only a simulation needs it
    from flwr.simulation import run_simulation

    out = Path(out_dir).expanduser().resolve()
    ref = cfg
    if ref is None:
        if not resume:
            raise ValueError("simulate: cfg is required unless resume=True")
        ref = resume_config(out, None, list(overrides or ()))[0]
    n = int(num_supernodes or ref.data.num_clients)
    if n < 1:
        raise ValueError("simulate: num_supernodes must be at least 1")
    cpus = num_cpus or ref.engine.workers or os.cpu_count() or 1
    cpus = max(1, min(int(cpus), n))
    backend_config: dict[str, Any] = {
        "client_resources": dict(client_resources or {"num_cpus": 1, "num_gpus": 0.0}),
        # the dashboard serves no purpose in a simulation and adds processes to start
        "init_args": {"num_cpus": cpus, "include_dashboard": False},
    }
    settings = ServerSettings(
        config=cfg,
        out_dir=out,
        resume=resume,
        overwrite=overwrite,
        num_nodes=n,
        node_wait_s=node_wait_s,
        delivery_grace_s=10.0,
        stop_after=stop_after,
        progress=progress,
        route="node-order",  # simulated nodes are interchangeable: no query round before round 1
        overrides=tuple(overrides or ()) if cfg is None else (),
    )
    results: list[Any] = []
    server = make_server_app(settings, results.append, console)
    saved = os.environ.get("PYTHONPATH")  # Flower's Ray back end rewrites it for its workers
    try:
        run_simulation(
            server_app=server,
            client_app=client_app,
            num_supernodes=n,
            backend_name="ray",
            backend_config=backend_config,
            verbose_logging=verbose,
        )
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    if not results:
        raise RunError("flower simulation ended without a result; see Flower's log above")
    return results[0]
