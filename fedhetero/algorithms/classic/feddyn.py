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
from torch import nn

from fedhetero.algorithms.classic._common import objective_weights, param_names, split_average, zeros_like_params
from fedhetero.core.algorithm import Algorithm
from fedhetero.core.config import MethodOptions, option
from fedhetero.core.types import ClientResult, ClientTask

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.context import ClientContext, Context

__all__ = ["FedDyn", "FedDynOptions"]


@dataclass(frozen=True)
class FedDynOptions(MethodOptions):
    alpha: float = option(0.01, gt=0, note="the server divides by it")  # α, weight of the dynamic regulariser


class FedDyn(Algorithm):
    """FedDyn (see the module docstring)."""

    name = "feddyn"
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
    def client_update(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> ClientResult:
        alpha = float(self.options.alpha)
        model = self.client_model(ctx, task, state)
        names = param_names(model)
        g = state["grad"] if state and "grad" in state else zeros_like_params(model)
        params = dict(model.named_parameters())
        terms = [
            (params[n], task.payload["state"][n].detach().clone(), g[n].to(device=params[n].device, dtype=params[n].dtype))
            for n in names
        ]

        def after_backward(_model: nn.Module) -> None:
            with torch.no_grad():
                for p, anchor, g_i in terms:
                    if p.grad is not None:
                        p.grad.sub_(g_i).add_(p - anchor, alpha=alpha)

        report = ctx.train(model, task, ctx.cfg.train.local_epochs, after_backward=after_backward)
        trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
        new_g: dict[str, torch.Tensor] = {}
        for n, (_, anchor, _g) in zip(names, terms):
            new_g[n] = (g[n].to(torch.float64) - alpha * (trained[n] - anchor).to("cpu", torch.float64)).to(g[n].dtype)
        return ClientResult.of(task, trained, macs=ctx.macs(model), metrics=report, client_state={"grad": new_g})
