"""Fed-ensemble: K global models trained by random permutations (Shi, Lai, Al Kontar,
Chowdhury; 2021).

The server keeps K independently initialised global models. The clients are split once, at
random (seeded), into K strata of near-equal size. Rounds come in periods of K: at the start of a
period the server draws a random permutation σ of the K models, and in round j of the period
(j = 0..K−1) a sampled client of stratum s trains model ``(σ[s] + j) mod K``. Within a round every
model is assigned to exactly one stratum, and over a period every stratum trains every model once
(a Latin square), so each model sees all of the data. Each client downloads and trains only its
one model, with plain local SGD (the FedAvg client); the server averages, per model, the uploads
of the clients that trained it (a model nobody trained this round stays as it was).

Inference averages the K models' predicted class probabilities; the evaluated module returns
their logarithm, so accuracy and cross-entropy are those of the averaged prediction. With K = 1
every client trains the one model and the method is FedAvg bit for bit (the lone model's logits
are returned as they are).

Default K = 5, a small ensemble in the range the paper studies; the communication and local
compute per client equal FedAvg's whatever K is, and inference costs K forward passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from fedhetero.core.exchange.aggregation import weighted_average
from fedhetero.core.method.algorithm import Algorithm
from fedhetero.core.common.options import MethodOptions, option
from fedhetero.core.exchange.types import ClientInfo, ClientResult, ClientTask

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import Context

__all__ = ["EnsembleModel", "FedEnsemble", "FedEnsembleOptions"]


@dataclass(frozen=True)
class FedEnsembleOptions(MethodOptions):
    num_models: int = option(5, ge=1)  # K: models in the ensemble


class EnsembleModel(nn.Module):
    """The mean of the members' softmax outputs, returned as log-probabilities (usable as logits
    by argmax and cross-entropy); a single member's logits are returned unchanged."""

    def __init__(self, members: list[nn.Module]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.members) == 1:
            return self.members[0](x)
        probs = torch.stack([torch.softmax(m(x), dim=1) for m in self.members]).mean(0)
        return torch.log(probs.clamp_min(torch.finfo(probs.dtype).tiny))


class FedEnsemble(Algorithm):
    """K global models permuted over client strata each round; inference averages their
    predictions."""

    name = "fedensemble"
    summary = (
        "K global models rotate over client strata by random permutations so that each sees all the data; "
        "inference averages their predicted probabilities."
    )
    paper = "Shi, Lai, Al Kontar, Chowdhury; arXiv 2021"
    Options = FedEnsembleOptions

    # ---------------------------------------------------------------- server half
    def setup(self, ctx: "Context") -> None:
        k = int(self.options.num_models)
        # built in turn from the seeded init stream: member 0 is FedAvg's initial model
        self.global_model = EnsembleModel([ctx.build_model() for _ in range(k)])
        order = ctx.rng("algorithm", 0).permutation(ctx.cfg.data.num_clients)
        self.stratum = np.empty(ctx.cfg.data.num_clients, dtype=np.int64)
        self.stratum[order] = np.arange(ctx.cfg.data.num_clients) % k

    @property
    def members(self) -> nn.ModuleList:
        assert isinstance(self.global_model, EnsembleModel)
        return self.global_model.members

    def assignment(self, ctx: "Context", rnd: int) -> dict[int, int]:
        """Model index of every stratum in round ``rnd`` (1-based): the period's permutation
        shifted by the round's position in the period."""
        k = len(self.members)
        period, j = divmod(int(rnd) - 1, k)
        sigma = ctx.rng("algorithm", 1, period).permutation(k)
        return {s: int((sigma[s] + j) % k) for s in range(k)}

    def configure(self, ctx: "Context", clients: list[ClientInfo]) -> list[ClientTask]:
        states = [dict(m.state_dict()) for m in self.members]
        tasks = []
        for c in clients:
            member = self.assignment(ctx, c.round)[int(self.stratum[c.cid])]
            tasks.append(self.task(ctx, c, {"state": states[member], "member": member}))
        return tasks

    def aggregate(self, ctx: "Context", results: list[ClientResult]) -> None:
        if not results:
            return
        groups: dict[int, list[ClientResult]] = {}
        for r in results:
            groups.setdefault(self._member_of(ctx, r), []).append(r)
        for member, rs in sorted(groups.items()):
            self.members[member].load_state_dict(weighted_average([r.state for r in rs], ctx.aggregation_weights(rs)))

    def _member_of(self, ctx: "Context", result: ClientResult) -> int:
        return self.assignment(ctx, ctx.round)[int(self.stratum[result.cid])]
