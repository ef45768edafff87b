"""FedProx (Li et al., 2020): FedAvg whose clients minimise their loss plus a proximal term.

Client ``i`` minimises ``f_i(w) + μ/2·‖w − w_g‖²`` over the trainable parameters, ``w_g`` being the
global model it received. The proximal term enters as its gradient ``μ·(w − w_g)``, added to every
step's gradient before the optimizer step (and before clipping), so the reported loss is the data
loss alone. The server averages as FedAvg does; with ``μ = 0`` FedProx is FedAvg bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fedhetero.core.algorithm import Algorithm
from fedhetero.core.cohort import plain_results, proximal_hook, train_cohort
from fedhetero.core.config import MethodOptions, option
from fedhetero.core.types import ClientResult, ClientTask

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.context import ClientContext

__all__ = ["FedProx", "FedProxOptions"]


@dataclass(frozen=True)
class FedProxOptions(MethodOptions):
    mu: float = option(0.01, ge=0)  # weight μ of the proximal term μ/2·‖w − w_global‖²


class FedProx(Algorithm):
    """FedAvg with the proximal term in the local objective."""

    name = "fedprox"
    Options = FedProxOptions

    def local_train(self, ctx: "ClientContext", task: ClientTask, model: nn.Module) -> dict[str, Any]:
        mu = float(self.options.mu)
        pairs = [(p, p.detach().clone()) for p in model.parameters() if p.requires_grad]

        def proximal(_model: nn.Module) -> None:
            with torch.no_grad():
                for p, anchor in pairs:
                    if p.grad is not None:
                        p.grad.add_(p - anchor, alpha=mu)

        return ctx.train(model, task, ctx.cfg.train.local_epochs, after_backward=proximal)

    def client_update_many(
        self, ctx: "ClientContext", tasks: list[ClientTask], states: list[dict[str, Any] | None]
    ) -> list[ClientResult] | None:
        done = train_cohort(self, ctx, tasks, hook=proximal_hook(float(self.options.mu)))
        return None if done is None else plain_results(ctx, tasks, *done)
