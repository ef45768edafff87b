"""A federated algorithm of your own, in one file: FedAvgM (FedAvg with server momentum, Hsu et al.
2019) written against fedhetero's client-task interface.

Run it on any back end by naming the file and class:

    fedhetero train --set algorithm.name=examples/my_algorithm.py:FedAvgM \
        --set algorithm.options.server_momentum=0.9 --set engine.backend=process

The walk-through is docs/write_your_own_algorithm.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedhetero.algorithms import Algorithm, ClientResult, ClientTask
from fedhetero.algorithms.base import payload_bytes, state_bytes, weighted_average
from fedhetero.config import ConfigError


@dataclass(frozen=True)
class FedAvgMOptions:
    server_momentum: float = 0.9  # β of the server's momentum buffer
    server_lr: float = 1.0  # step size applied to the momentum buffer

    def __post_init__(self) -> None:
        if not 0 <= self.server_momentum < 1:
            raise ConfigError(f"algorithm.options.server_momentum: must be in [0, 1), got {self.server_momentum}")
        if not self.server_lr > 0:
            raise ConfigError(f"algorithm.options.server_lr: must be > 0, got {self.server_lr}")


class FedAvgM(Algorithm):
    """Clients upload their model delta; the server averages the deltas and steps with momentum."""

    name = "fedavgm"
    Options = FedAvgMOptions

    # ---------------------------------------------------------------- server half
    def setup(self, ctx) -> None:
        self.global_model = ctx.build_model()
        # momentum on the parameters; BatchNorm statistics are averaged as in FedAvg
        self.velocity = {k: torch.zeros_like(v) for k, v in self.global_model.named_parameters()}

    def configure(self, ctx, clients):
        state = dict(self.global_model.state_dict())
        return [self.task(ctx, c, {"state": state}) for c in clients]

    def aggregate(self, ctx, results: list[ClientResult]) -> None:
        if not results:
            return
        mean_delta = weighted_average([r.state for r in results], ctx.aggregation_weights(results))
        new = {}
        for key, value in self.global_model.state_dict().items():
            if key in self.velocity:
                self.velocity[key].mul_(self.options.server_momentum).add_(mean_delta[key])
                new[key] = value + self.options.server_lr * self.velocity[key]
            elif key in mean_delta:  # floating buffers (BatchNorm statistics): plain average
                new[key] = value + mean_delta[key]
            else:  # integer buffers (BatchNorm's batch counter): the first client's
                new[key] = results[0].payload["buffers"][key]
        self.global_model.load_state_dict(new)

    def state_dict(self) -> dict[str, Any]:
        return {"global_model": self.global_model.state_dict(), "velocity": self.velocity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_model.load_state_dict(state["global_model"])
        self.velocity = {k: v.clone() for k, v in state["velocity"].items()}

    # ---------------------------------------------------------------- client half
    def client_update(self, ctx, task: ClientTask, state: dict[str, Any] | None) -> ClientResult:
        """Runs on a fresh instance with only the options set: everything comes from the task."""
        model = ctx.template("model", ctx.build_model)
        model.load_state_dict(task.payload["state"])
        report = ctx.train(model, task, ctx.cfg.train.local_epochs)
        trained = model.state_dict()
        sent = task.payload["state"]
        delta = {k: trained[k] - sent[k] for k in trained if trained[k].is_floating_point()}
        buffers = {k: v for k, v in trained.items() if not v.is_floating_point()}
        return ClientResult(
            cid=task.cid,
            num_samples=task.num_samples,
            state=delta,
            payload={"buffers": buffers},
            macs=ctx.macs(model),
            budget_macs=task.budget_macs,
            bytes_up=state_bytes(delta) + state_bytes(buffers),
            bytes_down=payload_bytes(task.payload),
            tier=task.tier,
            metrics=report,
        )
