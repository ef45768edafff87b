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

from fedhetero.algorithms import Algorithm, ClientResult, ClientTask, MethodOptions, option, weighted_average


@dataclass(frozen=True)
class FedAvgMOptions(MethodOptions):
    # what each option accepts is declared with it; a bad value is one error naming the option
    server_momentum: float = option(0.9, ge=0, lt=1)  # β of the server's momentum buffer
    server_lr: float = option(1.0, gt=0)  # step size applied to the momentum buffer


class FedAvgM(Algorithm):
    """Clients upload their model delta; the server averages the deltas and steps with momentum."""

    name = "fedavgm"
    Options = FedAvgMOptions
    state_fields = ("global_model", "velocity")  # what a checkpoint keeps, restored on --resume

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

    # ---------------------------------------------------------------- client half
    # The default client half builds the model from task.payload["state"] and trains it with the
    # configured local SGD (one client alone, or a round's clients in batched cohorts); only what
    # travels back differs: the delta, not the model.
    def upload(self, ctx, task: ClientTask, model, report: dict[str, Any]) -> ClientResult:
        """Runs on a fresh instance with only the options set: everything comes from the task."""
        trained = model.state_dict()
        sent = task.payload["state"]
        delta = {k: trained[k] - sent[k] for k in trained if trained[k].is_floating_point()}
        buffers = {k: v.clone() for k, v in trained.items() if not v.is_floating_point()}
        # the task's id, samples, tier and budget, and the bytes both ways, are filled in
        return ClientResult.of(task, delta, payload={"buffers": buffers}, macs=ctx.macs(model), metrics=report)
