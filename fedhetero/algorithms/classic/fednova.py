"""FedNova (Wang et al., 2020): normalised averaging for clients with unequal local work.

Client ``i`` trains like FedAvg (``τ_i`` local steps: its epochs × batches, or
``train.local_steps``) and reports ``τ_i`` and ``a_i = ‖a_i‖₁``, the total weight its steps give
to the gradients they took: ``a_i = τ_i`` for plain SGD; with heavy-ball momentum ``ρ`` and a
buffer that starts at zero, ``a_i = [τ_i − ρ·(1 − ρ^τ_i)/(1 − ρ)]/(1 − ρ)``; with Nesterov
momentum ``a_i = τ_i + ρ·[τ_i − ρ·(1 − ρ^τ_i)/(1 − ρ)]/(1 − ρ)``. (``ρ`` is ``train.momentum``,
0 with ``train.optimizer_state: none``; a buffer carried over from the last round under
``persistent`` adds work these formulas do not count.)

The server turns each update into a normalised one, ``d_i = (x − y_i)/a_i``, and steps
``x ← x − τ_eff·Σ_i p_i·d_i`` with ``τ_eff = Σ_i p_i·a_i`` (``p_i``: the aggregation weights of
the clients that returned), i.e. ``x ← Σ_i p_i c_i y_i + (Σ_i p_i (1 − c_i))·x`` with
``c_i = τ_eff/a_i``. When every client did the same work (``c_i = 1``) this is exactly FedAvg's
weighted average, bit for bit. Floating buffers (BatchNorm statistics) are averaged as in FedAvg.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fedhetero.algorithms.classic._common import param_names, split_average
from fedhetero.core.method.algorithm import Algorithm
from fedhetero.core.exchange.types import ClientResult, ClientTask

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import ClientContext, Context

__all__ = ["FedNova", "normalizing_factor"]


def normalizing_factor(steps: int, momentum: float = 0.0, nesterov: bool = False) -> float:
    """``‖a_i‖₁`` of ``steps`` SGD steps with momentum ``momentum`` (buffer starting at zero)."""
    tau, rho = float(steps), float(momentum)
    if rho == 0.0:
        return tau
    heavy = (tau - rho * (1.0 - rho**tau) / (1.0 - rho)) / (1.0 - rho)
    return tau + rho * heavy if nesterov else heavy


class FedNova(Algorithm):
    """FedNova (see the module docstring)."""

    name = "fednova"
    summary = (
        "Normalised averaging: each update is divided by the client's amount of local work before averaging, "
        "so unequal local steps do not bias the model."
    )
    paper = "Wang et al., NeurIPS 2020"

    # ---------------------------------------------------------------- server half
    def aggregate(self, ctx: "Context", results: list[ClientResult]) -> None:
        assert self.global_model is not None
        if not results:
            return
        names = set(param_names(self.global_model))
        weights = ctx.aggregation_weights(results)
        total = float(sum(weights))
        _, rest = split_average(ctx, results, names)
        a = [float(r.payload["a"]) for r in results]
        # τ_eff = Σ p_i a_i; equal a_i give τ_eff = a exactly (and so FedAvg's average bit for bit)
        tau_eff = a[0] if len(set(a)) == 1 else sum(float(w) * ai for w, ai in zip(weights, a)) / total
        ratio = [tau_eff / ai if ai > 0 else 0.0 for ai in a]  # c_i; a client that took no step moved nothing
        coef = [float(w) / total * ci for w, ci in zip(weights, ratio)]
        keep = sum(float(w) / total * (1.0 - ci) for w, ci in zip(weights, ratio))
        new: dict[str, torch.Tensor] = {}
        for key, x in self.global_model.state_dict().items():
            if key not in names:
                new[key] = rest[key]
                continue
            acc = torch.zeros_like(x, dtype=torch.float64)
            for r, ci in zip(results, coef):
                acc.add_(r.state[key].to(torch.float64), alpha=ci)
            if keep != 0.0:
                acc.add_(x.to(torch.float64), alpha=keep)
            new[key] = acc.to(x.dtype)
        self.global_model.load_state_dict(new)

    # ---------------------------------------------------------------- client half
    # Local training is the configured SGD (so a round's clients can train as one cohort); the
    # normalising factor follows from the steps it took.
    def upload(self, ctx: "ClientContext", task: ClientTask, model: nn.Module, result: dict[str, Any]) -> ClientResult:
        res = super().upload(ctx, task, model, result)
        steps = int(result["steps"])
        a = normalizing_factor(steps, ctx.local_momentum(), ctx.cfg.train.nesterov)
        res.payload = {"a": float(a), "tau": steps}
        res.metrics["a"] = float(a)
        return res
