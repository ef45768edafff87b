"""FedProx (Li et al., 2020): FedAvg whose clients minimise their loss plus a proximal term.

Client ``i`` minimises ``f_i(w) + μ/2·‖w − w_g‖²`` over the trainable parameters, ``w_g`` being the
global model it received. The proximal term enters as its gradient ``μ·(w − w_g)``, added to every
step's gradient before the optimizer step (and before clipping), so the reported loss is the data
loss alone. The server averages as FedAvg does; with ``μ = 0`` FedProx is FedAvg bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedhetero.algorithms.base import Algorithm, ClientTask
from fedhetero.config import ConfigError

__all__ = ["FedProx", "FedProxOptions"]


@dataclass(frozen=True)
class FedProxOptions:
    mu: float = 0.01  # weight μ of the proximal term μ/2·‖w − w_global‖²

    def __post_init__(self) -> None:
        if not self.mu >= 0:
            raise ConfigError(f"algorithm.options.mu: must be >= 0, got {self.mu}")


class FedProx(Algorithm):
    """FedAvg with the proximal term in the local objective."""

    name = "fedprox"
    Options = FedProxOptions

    def local_train(self, ctx, task: ClientTask, model: nn.Module) -> dict[str, Any]:
        mu = float(self.options.mu)
        pairs = [(p, p.detach().clone()) for p in model.parameters() if p.requires_grad]

        def proximal(_model: nn.Module) -> None:
            with torch.no_grad():
                for p, anchor in pairs:
                    if p.grad is not None:
                        p.grad.add_(p - anchor, alpha=mu)

        return ctx.train(model, task, ctx.cfg.train.local_epochs, after_backward=proximal)

    def client_update_many(self, ctx, tasks, states):
        from fedhetero.cohort import plain_results, proximal_hook, train_cohort

        done = train_cohort(self, ctx, tasks, hook=proximal_hook(float(self.options.mu)))
        return None if done is None else plain_results(ctx, tasks, *done)
