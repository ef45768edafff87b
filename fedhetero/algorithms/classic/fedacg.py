"""FedACG: federated learning with accelerated client gradient (Kim, Kim, Han; CVPR 2024).

The server keeps the global model ``w`` and a momentum ``m`` (zero at the start). Round ``t``:

1. it broadcasts the lookahead model ``θ₀ = w + λ·m``;
2. every sampled client starts from ``θ₀`` and minimises ``CE + (β/2)·‖θ − θ₀‖²`` with the shared
   local trainer (the regulariser's gradient ``β·(θ − θ₀)`` is added to each step's gradient);
3. with the aggregation weights ``p_k`` (sample counts, or uniform as configured) the server sets
   ``m ← λ·m + Σ_k p_k·(θ_k − θ₀)`` and ``w ← w + m``.

Since ``θ₀ = w + λ·m``, the new global model is exactly ``Σ_k p_k·θ_k``, the plain average of the
returned models; the server computes it that way (the weighted average of the engine, accumulated
in float64) and takes the momentum as ``m = w_new − w_old``, which equals the update above. So
λ = β = 0 trains FedAvg's models bit for bit.

Momentum and lookahead act on the parameters. BatchNorm running statistics are averaged as in
FedAvg and sent as they are (a lookahead on running variances could make them negative).

Notation follows the paper: ``lam`` is λ, the momentum that also sets the lookahead, and ``beta``
is β, the weight of the regulariser. Defaults λ = 0.85 and β = 0.001 are the authors' released
configuration (server momentum 0.85, client regulariser weight 1e-3); the DynInit study runs FedACG
with λ = 0.5 and β = 0.1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fedhetero.core.exchange.aggregation import weighted_average
from fedhetero.core.method.algorithm import Algorithm
from fedhetero.core.common.options import MethodOptions, option
from fedhetero.core.local.objective import LocalObjective, LocalPlan, proximal
from fedhetero.core.exchange.types import ClientInfo, ClientResult, ClientTask

if TYPE_CHECKING:  # pragma: no cover

    from fedhetero.core.local.context import ClientContext, Context

__all__ = ["FedACG", "FedACGOptions", "lookahead_state"]


@dataclass(frozen=True)
class FedACGOptions(MethodOptions):
    lam: float = option(0.85, ge=0, lt=1)  # λ: server momentum; the broadcast lookahead is w + λ·m
    beta: float = option(0.001, ge=0)  # β: weight of the client regulariser (β/2)·‖θ − θ₀‖²


def lookahead_state(
    state: dict[str, torch.Tensor], momentum: dict[str, torch.Tensor], lam: float
) -> dict[str, torch.Tensor]:
    """``w + λ·m`` for the entries that have a momentum; the others (buffers) as they are."""
    return {k: torch.add(v, momentum[k], alpha=lam) if k in momentum else v for k, v in state.items()}


class FedACG(Algorithm):
    """Lookahead broadcast, regularised local training and server momentum."""

    name = "fedacg"
    summary = (
        "The server broadcasts a lookahead model along its momentum, clients train regularised towards it, "
        "and the server updates the momentum from the average."
    )
    paper = "Kim, Kim, Han; CVPR 2024"
    Options = FedACGOptions
    state_fields = ("global_model", "momentum")

    # ---------------------------------------------------------------- server half
    def setup(self, ctx: "Context") -> None:
        self.global_model = ctx.build_model()
        self.momentum = {k: torch.zeros_like(p) for k, p in self.global_model.named_parameters()}

    def configure(self, ctx: "Context", clients: list[ClientInfo]) -> list[ClientTask]:
        assert self.global_model is not None
        state = lookahead_state(dict(self.global_model.state_dict()), self.momentum, float(self.options.lam))
        return [self.task(ctx, c, {"state": state}) for c in clients]

    def aggregate(self, ctx: "Context", results: list[ClientResult]) -> None:
        assert self.global_model is not None
        if not results:
            return
        old = {k: v.detach().clone() for k, v in self.global_model.state_dict().items()}
        new = weighted_average([r.state for r in results], ctx.aggregation_weights(results))
        for k in self.momentum:
            # w + λ·m + Σ p_k (θ_k − θ₀) = Σ p_k θ_k, so the new momentum is the model's step
            self.momentum[k] = (new[k].to(torch.float64) - old[k].to(torch.float64)).to(old[k].dtype)
        self.global_model.load_state_dict(new)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The declared fields, with the momentum checked against the model and put back on the
        parameters' device and dtype (a checkpoint is read onto the CPU)."""
        missing = set(self.momentum) ^ set(state["momentum"])
        if missing:
            raise KeyError(f"fedacg momentum does not fit the model: {sorted(missing)[:3]}")
        like = self.momentum
        super().load_state_dict(state)
        self.momentum = {k: self.momentum[k].to(v.device, v.dtype) for k, v in like.items()}

    # ---------------------------------------------------------------- client half
    def local_plan(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> LocalPlan:
        # the regulariser's anchor θ₀ is the state the task carries, where every client starts
        return LocalPlan(ctx.configured_sgd(), objective=LocalObjective(grad=proximal(float(self.options.beta)), consts={"anchor": task.payload["state"]}))
