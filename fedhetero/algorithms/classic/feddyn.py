"""FedDyn (Acar et al., 2021): federated learning with dynamic regularisation.

Client ``i`` keeps ``g_i`` (the paper's ``∇L_i(θ_i^{t−1})``, zero at first) in its private state and
minimises ``L_i(θ) − ⟨g_i, θ⟩ + α/2·‖θ − θ^{t−1}‖²`` from the global model ``θ^{t−1}``: the terms
enter as their gradient ``−g_i + α·(θ − θ^{t−1})``, added to every step's gradient before the
optimizer step. Afterwards ``g_i ← g_i − α·(θ_i − θ^{t−1})``. Only the model travels, as in FedAvg.

The server keeps ``h`` (one tensor per trainable parameter, in :meth:`FedDyn.state_dict`):

* ``h ← h − α·Σ_{i∈P} w_i·(θ_i − θ^{t−1})`` with ``w_i`` the client's weight in the global
  objective over *all* clients (``1/m`` with uniform aggregation, as in the paper; its share of
  all samples otherwise);
* ``θ^t = Σ_{i∈P} p_i·θ_i − h/α`` (``p_i``: the aggregation weights of the clients that returned).

Floating buffers (BatchNorm statistics) are averaged as in FedAvg.

FedAvg limit: as ``α → 0`` the local objective becomes the plain loss (with no gradient state the
client half is FedAvg's, bit for bit once ``α·‖θ − θ^{t−1}‖`` is below float resolution), but the
server's correction does not vanish: ``h/α = −Σ_{rounds} Σ_{i∈P} w_i·(θ_i − θ^{t−1})`` does not
depend on ``α``. So the α → 0 limit of FedDyn is FedAvg plus the running sum of the weighted mean
client updates; e.g. its first round with full participation and sample weights gives
``2·θ̄ − θ⁰`` where FedAvg gives ``θ̄``. FedDyn has no setting that reduces to FedAvg.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fedhetero.algorithms.classic._common import objective_weights, split_average, zeros_like_params
from fedhetero.core.method.algorithm import Algorithm
from fedhetero.core.common.options import MethodOptions, option
from fedhetero.core.local.objective import GradRule, LocalObjective, LocalPlan, Tensors
from fedhetero.core.exchange.types import ClientResult, ClientTask

if TYPE_CHECKING:  # pragma: no cover

    from fedhetero.core.local.context import ClientContext, Context

__all__ = ["FedDyn", "FedDynOptions"]


@dataclass(frozen=True)
class FedDynOptions(MethodOptions):
    alpha: float = option(0.01, gt=0, note="the server divides by it")  # α, weight of the dynamic regulariser


class FedDyn(Algorithm):
    """FedDyn (see the module docstring)."""

    name = "feddyn"
    summary = (
        "Each client's local loss gets a dynamic linear and quadratic regulariser from its own state, and the"
        " server corrects the average with a running state."
    )
    paper = "Acar et al., ICLR 2021"
    Options = FedDynOptions
    state_fields = ("global_model", "h")

    # ---------------------------------------------------------------- server half
    def setup(self, ctx: "Context") -> None:
        self.global_model = ctx.build_model()
        self.h = zeros_like_params(self.global_model)

    def aggregate(self, ctx: "Context", results: list[ClientResult]) -> None:
        assert self.global_model is not None
        if not results:
            return
        alpha = float(self.options.alpha)
        names = set(self.h)
        p, rest = split_average(ctx, results, names)
        w = objective_weights(ctx, [r.cid for r in results])
        new: dict[str, torch.Tensor] = {}
        for key, x in self.global_model.state_dict().items():
            if key not in names:
                new[key] = rest[key]
                continue
            x64 = x.to(torch.float64)
            mean = torch.zeros_like(x64)
            drift = torch.zeros_like(x64)
            for r, pi, wi in zip(results, p, w):
                theta = r.state[key].to(torch.float64)
                mean.add_(theta, alpha=pi)
                drift.add_(theta - x64, alpha=wi)
            h = self.h[key].to(torch.float64) - alpha * drift
            self.h[key] = h.to(self.h[key].dtype)
            new[key] = (mean - h / alpha).to(x.dtype)
        self.global_model.load_state_dict(new)

    # ---------------------------------------------------------------- client half
    def local_plan(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> LocalPlan:
        alpha = float(self.options.alpha)
        sent = task.payload["state"]
        if state and "grad" in state:
            g = state["grad"]
        else:
            g = zeros_like_params(self.client_model(ctx, task, state))

        def finish(result: ClientResult) -> None:
            new_g: dict[str, torch.Tensor] = {}
            for n, g_n in g.items():
                drift = (result.state[n] - sent[n].to(result.state[n])).to("cpu", torch.float64)
                new_g[n] = (g_n.to(torch.float64) - alpha * drift).to(g_n.dtype)
            result.client_state = {"grad": new_g}

        return LocalPlan(ctx.configured_sgd(), objective=LocalObjective(grad=_dynamic(alpha), consts={"anchor": sent, "g": g}, finish=finish))


def _dynamic(alpha: float) -> GradRule:
    """FedDyn's local gradient ``∇f_i(w) − g_i + α·(w − w_anchor)``."""

    def rule(params: Tensors, grads: Tensors, c: dict[str, Any]) -> None:
        for n, grad in grads.items():
            grad.sub_(c["g"][n]).add_(params[n] - c["anchor"][n], alpha=alpha)

    return rule
