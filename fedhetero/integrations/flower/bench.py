"""What fedhetero's Flower back end costs next to Flower's own FedAvg.

Both functions run the same FedAvg job in Flower's simulation engine (Ray, one CPU per ClientApp,
the same number of SuperNodes) and return its wall seconds, Ray's start-up included:

* :func:`time_ours`: fedhetero's ServerApp and ClientApp (:func:`~.simulation.simulate`): our round
  loop, sampling, encoding, per-round evaluation and checkpoints;
* :func:`time_flower_fedavg`: Flower's ``flwr.serverapp.strategy.FedAvg`` (``Strategy.start``)
  with a minimal ClientApp in this module that trains with the same torch code (fedhetero's local
  trainer on the same client partition, seeds and hyper-parameters), Flower's aggregation, and the
  same central evaluation after every round.

Same model, data partition, rounds, clients per round, local epochs and learning rate; the clients
sampled differ (Flower samples nodes with Python's ``random``), so only the times are compared.
``fedhetero bench engines`` prints their ratio.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp.strategy import FedAvg

from fedhetero.core.common.config import RunConfig, from_dict, to_dict
from fedhetero.core.local.context import client_context
from fedhetero.core.exchange.types import ClientTask, derive_seed
from fedhetero.integrations.flower.codec import record_int
from fedhetero.integrations.flower.simulation import simulate

try:  # flwr >= 1.21
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
except ImportError:  # pragma: no cover - older flwr
    from flwr.client import ClientApp  # type: ignore[no-redef]
    from flwr.server import Grid, ServerApp  # type: ignore[no-redef]

if TYPE_CHECKING:
    from flwr.app.typing import MetricRecordValues

__all__ = ["fedavg_config", "time_flower_fedavg", "time_ours"]


def fedavg_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` as the FedAvg job both timings run (evaluation every round, one checkpoint)."""
    return dataclasses.replace(
        cfg,
        algorithm=dataclasses.replace(cfg.algorithm, name="fedavg", options={}),
        train=dataclasses.replace(cfg.train, eval_every=1, checkpoint_every=max(1, cfg.train.rounds)),
    )


def _nodes(cfg: RunConfig, supernodes: int | None) -> int:
    return int(supernodes or cfg.data.num_clients)


def time_ours(cfg: RunConfig, supernodes: int | None = None, *, num_cpus: int | None = None) -> float:
    """Wall seconds of the FedAvg job through fedhetero's FlowerBackend in the simulation engine."""
    job = fedavg_config(cfg)
    with tempfile.TemporaryDirectory(prefix="fedhetero-bench-") as tmp:
        t0 = time.perf_counter()
        simulate(job, Path(tmp) / "run", _nodes(job, supernodes), num_cpus=num_cpus)
        return time.perf_counter() - t0


# ---------------------------------------------------------------------------------- Flower's FedAvg
_SIDE: dict[str, Any] = {}


def _client_context(cfg_json: str) -> Any:
    hit = _SIDE.get(cfg_json)
    if hit is None:
        cfg = from_dict(json.loads(cfg_json))
        torch.set_num_threads(cfg.threads or 1)
        _SIDE.clear()
        hit = _SIDE[cfg_json] = client_context(cfg)
    return hit


#: The minimal ClientApp of the comparison: load the arrays, train with fedhetero's trainer on the
#: node's partition, send the arrays back with ``num-examples`` (what FedAvg weights by).
fedavg_client = ClientApp()


@fedavg_client.train()
def _train(msg: Message, context: Context) -> Message:
    conf = msg.content.config_records["config"]
    ctx = _client_context(str(conf["fedhetero-config"]))
    cfg = ctx.cfg
    cid = int(context.node_config["partition-id"])
    rnd = record_int(conf["server-round"])
    n = len(ctx.data.client_indices[cid])
    model = ctx.build_model()
    model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    task = ClientTask(
        cid=cid, tier="", ratio=1.0, budget_macs=float(ctx.plain_macs), num_samples=n, round=rnd,
        seed=derive_seed(cfg.seed, "client", rnd, cid),
    )
    with ctx.client_scope(task):
        report = ctx.train(model, task, cfg.train.local_epochs)
    metrics: dict[str, MetricRecordValues] = {"num-examples": n}
    if isinstance(report.get("loss"), (int, float)):
        metrics["train-loss"] = float(report["loss"])
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)})
    return Message(content, reply_to=msg)


def _fedavg_server(job: RunConfig, nodes: int) -> ServerApp:
    server = ServerApp()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        ctx = client_context(job)  # central evaluation on the server, as fedhetero's engine does
        with ctx.seeded("init", 1):
            model = ctx.build_model()
        k = max(1, round(job.train.sample_rate * nodes))

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if server_round == 0:  # Flower also evaluates the initial model; fedhetero does not
                return None
            model.load_state_dict(arrays.to_torch_state_dict())
            res = ctx.evaluate(model)
            return MetricRecord({"accuracy": float(res["accuracy"]), "loss": float(res["loss"])})

        strategy = FedAvg(fraction_train=k / nodes, fraction_evaluate=0.0, min_train_nodes=k, min_available_nodes=nodes)
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(model.state_dict()),
            num_rounds=job.train.rounds,
            train_config=ConfigRecord({"fedhetero-config": json.dumps(to_dict(job)), "lr": float(job.train.lr)}),
            evaluate_fn=evaluate,
        )

    return server


def time_flower_fedavg(cfg: RunConfig, supernodes: int | None = None, *, num_cpus: int | None = None) -> float:
    """Wall seconds of the same FedAvg job through Flower's ``FedAvg`` strategy in the simulation
    engine (node ``p`` trains client ``p``'s partition, so ``supernodes`` must equal the number
    of clients)."""
    # deferred: flwr.simulation imports Ray, slow to load; only this timing needs it
    from flwr.simulation import run_simulation

    job = fedavg_config(cfg)
    nodes = _nodes(job, supernodes)
    if nodes != job.data.num_clients:
        raise ValueError(
            f"time_flower_fedavg: Flower's FedAvg samples nodes, so each of the {job.data.num_clients} clients "
            f"needs its own SuperNode (got supernodes={nodes})"
        )
    cpus = max(1, min(int(num_cpus or job.engine.workers or os.cpu_count() or 1), nodes))
    saved = os.environ.get("PYTHONPATH")
    t0 = time.perf_counter()
    try:
        run_simulation(
            server_app=_fedavg_server(job, nodes),
            client_app=fedavg_client,
            num_supernodes=nodes,
            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": cpus}},
        )
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    return time.perf_counter() - t0
