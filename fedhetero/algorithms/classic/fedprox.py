"""FedProx (Li et al., 2020): FedAvg whose clients minimise their loss plus a proximal term.

Client ``i`` minimises ``f_i(w) + μ/2·‖w − w_g‖²`` over the trainable parameters, ``w_g`` being the
global model it received. The proximal term enters as its gradient ``μ·(w − w_g)``, added to every
step's gradient before the optimizer step (and before clipping), so the reported loss is the data
loss alone. The server averages as FedAvg does; with ``μ = 0`` FedProx is FedAvg bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fedhetero.core.method.algorithm import Algorithm
from fedhetero.core.common.options import MethodOptions, option
from fedhetero.core.local.objective import LocalObjective, LocalPlan, proximal
from fedhetero.core.exchange.types import ClientTask

if TYPE_CHECKING:  # pragma: no cover

    from fedhetero.core.local.context import ClientContext

__all__ = ["FedProx", "FedProxOptions"]


@dataclass(frozen=True)
class FedProxOptions(MethodOptions):
    mu: float = option(0.01, ge=0)  # weight μ of the proximal term μ/2·‖w − w_global‖²


class FedProx(Algorithm):
    """FedAvg with the proximal term in the local objective."""

    name = "fedprox"
    summary = (
        "FedAvg whose clients add a proximal term towards the received global model to their local loss, "
        "which limits client drift."
    )
    paper = "Li et al., MLSys 2020"
    Options = FedProxOptions

    def local_plan(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> LocalPlan:
        return LocalPlan(ctx.configured_sgd(), objective=LocalObjective(grad=proximal(float(self.options.mu)), consts={"anchor": task.payload["state"]}))

