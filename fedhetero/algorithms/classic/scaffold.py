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
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch
from torch import nn

from fedhetero.algorithms.classic._common import objective_weights, param_names, split_average, zeros_like_params
from fedhetero.core.algorithm import Algorithm
from fedhetero.core.cohort import train_cohort
from fedhetero.core.config import MethodOptions, option
from fedhetero.core.types import ClientInfo, ClientResult, ClientTask

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.cohort import Cohort
    from fedhetero.core.context import ClientContext, Context

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
    def client_update(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> ClientResult:
        model = self.client_model(ctx, task, state)
        names = param_names(model)
        c = task.payload["c"]
        c_i = state["c_i"] if state and "c_i" in state else zeros_like_params(model)
        sent = {n: task.payload["state"][n].detach().clone() for n in names}
        params = dict(model.named_parameters())
        after_backward: Callable[[nn.Module], None] | None = None
        if self.options.variant == "standard":
            correction = [
                (params[n], (c[n] - c_i[n]).to(device=params[n].device, dtype=params[n].dtype)) for n in names
            ]

            def corrected(_model: nn.Module) -> None:
                for p, corr in correction:
                    if p.grad is not None:
                        p.grad.add_(corr)

            after_backward = corrected

        lr = ctx.lr_at()
        report = ctx.train(model, task, ctx.cfg.train.local_epochs, after_backward=after_backward)
        steps = int(report["steps"])
        trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
        delta_c, new_c_i = _control_update(names, sent, trained, c, c_i, steps, lr)
        return ClientResult.of(
            task, trained, macs=ctx.macs(model), payload={"delta_c": delta_c}, metrics=report,
            client_state={"c_i": new_c_i},
        )

    def client_update_many(
        self, ctx: "ClientContext", tasks: list[ClientTask], states: list[dict[str, Any] | None]
    ) -> list[ClientResult] | None:
        standard = self.options.variant == "standard"
        keep: dict[str, Any] = {}

        def hook(co: "Cohort") -> Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], None]:
            zeros = {n: torch.zeros_like(co.start[n][0], device="cpu") for n in co.names}
            keep["c_i"] = [dict(s["c_i"]) if s and "c_i" in s else dict(zeros) for s in states]
            corr = {
                n: torch.stack([(t.payload["c"][n] - ci[n]).to(co.start[n]) for t, ci in zip(tasks, keep["c_i"])])
                for n in co.names
            }

            def add(_params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
                if standard:
                    for n in co.names:
                        grads[n].add_(corr[n])

            return add

        done = train_cohort(self, ctx, tasks, hook=hook)
        if done is None:
            return None
        co, reports = done
        lr = ctx.lr_at()
        macs = ctx.macs(co.model)
        out = []
        for i, task in enumerate(tasks):
            trained = co.state(i)
            steps = int(reports[i]["steps"])
            delta_c, new_c_i = _control_update(
                co.names, task.payload["state"], trained, task.payload["c"], keep["c_i"][i], steps, lr
            )
            out.append(ClientResult.of(
                task, trained, macs=macs, payload={"delta_c": delta_c}, metrics=reports[i],
                client_state={"c_i": new_c_i},
            ))
        return out
