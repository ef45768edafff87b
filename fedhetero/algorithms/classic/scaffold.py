"""SCAFFOLD (Karimireddy et al., 2020): control variates that correct client drift.

The server keeps a control variate ``c`` and every client ``i`` its own ``c_i`` (zero at first,
kept in the client's private state); both have one tensor per trainable parameter. In a round
the server sends the global model ``x`` and ``c``; the client runs its local steps from ``x`` and
returns its model ``y_i`` and ``Δc_i``. Each way two model-sized tensors travel, and
``bytes_up``/``bytes_down`` count both.

``variant: standard`` (the paper, option II):

* local step on ``g(y) − c_i + c`` (the correction is added to the gradient before the optimizer
  step; weight decay, momentum and clipping apply as configured);
* ``c_i⁺ = c_i − c + (x − y_i)/(K·η)`` with ``K`` the local steps taken and ``η`` the round's
  local learning rate; ``Δc_i = c_i⁺ − c_i``;
* server: ``x ← x + η_g·Σ_i p_i·(y_i − x)`` (``p_i`` the aggregation weights of the clients that
  returned, ``η_g = server_lr``) and ``c ← c + Σ_i w_i·Δc_i`` with ``w_i`` the client's weight in
  the global objective over *all* clients (``1/N`` with uniform aggregation, as in the paper;
  its share of all samples otherwise), so ``c`` stays the weighted mean of every ``c_i``.

``variant: dyninit`` (what the DynInit authors' code runs, needed to match their SCAFFOLD
numbers): local steps are plain SGD, without the ``c − c_i`` correction; ``Δc_i`` is computed as
above; the server steps ``x ← x + η·η_g·Σ_i p_i·(y_i − x)``, scaled by the round's *client*
learning rate ``η``, and ``c ← c + Σ_i p_i·Δc_i`` with the weights of the clients that returned.

Floating buffers (BatchNorm statistics) are averaged as in FedAvg. With ``train.momentum`` the
local step count ``K`` still normalises ``x − y_i`` as the paper's option II does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from fedhetero.algorithms.classic._common import objective_weights, split_average, zeros_like_params
from fedhetero.core.method.algorithm import Algorithm
from fedhetero.core.common.options import MethodOptions, option
from fedhetero.core.local.objective import LocalObjective, LocalPlan, Tensors
from fedhetero.core.exchange.types import ClientInfo, ClientResult, ClientTask

if TYPE_CHECKING:  # pragma: no cover

    from fedhetero.core.local.context import ClientContext, Context

__all__ = ["Scaffold", "ScaffoldOptions"]


@dataclass(frozen=True)
class ScaffoldOptions(MethodOptions):
    variant: Literal["standard", "dyninit"] = "standard"
    server_lr: float = option(1.0, gt=0)  # η_g, the global step size


def _control_update(
    names: list[str],
    sent: dict[str, torch.Tensor],
    trained: dict[str, torch.Tensor],
    c: dict[str, torch.Tensor],
    c_i: dict[str, torch.Tensor],
    steps: int,
    lr: float,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Option II: ``Δc_i = (x − y_i)/(K·η) − c`` (zero when no step was taken) and ``c_i + Δc_i``."""
    delta_c: dict[str, torch.Tensor] = {}
    new_c_i: dict[str, torch.Tensor] = {}
    for n in names:
        if steps > 0:
            drift = (sent[n] - trained[n]).to("cpu", torch.float64) / (steps * lr)
            dc = (drift - c[n].to(torch.float64)).to(c_i[n].dtype)
        else:
            dc = torch.zeros_like(c_i[n])
        delta_c[n] = dc
        new_c_i[n] = c_i[n] + dc
    return delta_c, new_c_i


class Scaffold(Algorithm):
    """SCAFFOLD with option-II control variates (see the module docstring)."""

    name = "scaffold"
    summary = (
        "Server and client control variates correct every local step for client drift (the paper's option "
        "II); two model-sized tensors travel each way."
    )
    paper = "Karimireddy et al., ICML 2020"
    Options = ScaffoldOptions
    state_fields = ("global_model", "c")

    # ---------------------------------------------------------------- server half
    def setup(self, ctx: "Context") -> None:
        self.global_model = ctx.build_model()
        self.c = zeros_like_params(self.global_model)

    def configure(self, ctx: "Context", clients: list[ClientInfo]) -> list[ClientTask]:
        assert self.global_model is not None
        state = dict(self.global_model.state_dict())
        control = dict(self.c)
        return [self.task(ctx, c, {"state": state, "c": control}) for c in clients]

    def aggregate(self, ctx: "Context", results: list[ClientResult]) -> None:
        assert self.global_model is not None
        if not results:
            return
        names = set(self.c)
        p, rest = split_average(ctx, results, names)
        if self.options.variant == "standard":
            step = float(self.options.server_lr)
            wc = objective_weights(ctx, [r.cid for r in results])
        else:
            step = float(self.options.server_lr) * ctx.lr_at()
            wc = p
        new: dict[str, torch.Tensor] = {}
        for key, x in self.global_model.state_dict().items():
            if key not in names:
                new[key] = rest[key]
                continue
            x64 = x.to(torch.float64)
            acc = torch.zeros_like(x64)
            for r, pi in zip(results, p):
                acc.add_(r.state[key].to(torch.float64) - x64, alpha=pi)
            new[key] = (x64 + step * acc).to(x.dtype)
            dc = torch.zeros_like(self.c[key], dtype=torch.float64)
            for r, wi in zip(results, wc):
                dc.add_(r.payload["delta_c"][key].to(torch.float64), alpha=wi)
            self.c[key] = (self.c[key].to(torch.float64) + dc).to(self.c[key].dtype)
        self.global_model.load_state_dict(new)

    # ---------------------------------------------------------------- client half
    def local_plan(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> LocalPlan:
        c = task.payload["c"]
        c_i = state["c_i"] if state and "c_i" in state else {n: torch.zeros_like(v, device="cpu") for n, v in c.items()}
        lr = ctx.lr_at()

        def finish(result: ClientResult) -> None:
            steps = int(result.metrics["steps"])
            delta_c, new_c_i = _control_update(list(c), task.payload["state"], result.state, c, c_i, steps, lr)
            result.send(delta_c=delta_c)
            result.client_state = {"c_i": new_c_i}

        if self.options.variant != "standard":  # the DynInit authors' variant: plain local SGD
            return LocalPlan(ctx.configured_sgd(), objective=LocalObjective(finish=finish))
        return LocalPlan(ctx.configured_sgd(), objective=LocalObjective(grad=_corrected, consts={"correction": {n: c[n] - c_i[n] for n in c}}, finish=finish))


def _corrected(params: Tensors, grads: Tensors, c: dict[str, Any]) -> None:
    """SCAFFOLD's local step direction ``g(y) + c − c_i``."""
    for n, g in grads.items():
        g.add_(c["correction"][n])
