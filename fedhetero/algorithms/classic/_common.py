"""Helpers shared by the classic FL methods (FedProx, SCAFFOLD, FedDyn, FedNova).

These methods treat the trainable parameters differently from the rest of the state dict: the
parameters get the method's correction (control variates, dynamic regulariser, normalised step),
floating buffers (BatchNorm running statistics) are averaged as in FedAvg, and integer buffers
(BatchNorm's batch counter) take the first client's value, as :func:`weighted_average` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fedhetero.core.exchange.aggregation import weighted_average
from fedhetero.core.exchange.types import ClientResult

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import RunContext

__all__ = ["objective_weights", "param_names", "split_average", "zeros_like_params"]


def param_names(model: nn.Module) -> list[str]:
    """Names of the trainable parameters (the entries a correction applies to)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def zeros_like_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """A zero tensor per trainable parameter, on the CPU (control variates, gradient states)."""
    return {n: torch.zeros_like(p, device="cpu") for n, p in model.named_parameters() if p.requires_grad}


def objective_weights(ctx: "RunContext", cids: list[int]) -> list[float]:
    """Each client's weight in the global objective ``Σ_i w_i f_i`` over *all* clients: its share
    of all training samples (``train.aggregation: samples``) or ``1/N`` (``uniform``). Server
    states that track a mean over every client (SCAFFOLD's c, FedDyn's h) are updated with these
    weights, so with partial participation they stay the weighted mean of all client states."""
    if ctx.cfg.train.aggregation == "uniform":
        n = len(ctx.data.client_indices)
        return [1.0 / n] * len(cids)
    total = float(sum(len(ix) for ix in ctx.data.client_indices))
    return [len(ctx.data.client_indices[c]) / total for c in cids]


def split_average(
    ctx: "RunContext", results: list[ClientResult], params: set[str]
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The normalised aggregation weights ``p_i`` (sample or uniform, as configured) and the
    FedAvg average of every state entry that is not a trainable parameter."""
    weights = ctx.aggregation_weights(results)
    total = float(sum(weights))
    rest_keys = [k for k in results[0].state if k not in params]
    rest: dict[str, Any] = {}
    if rest_keys:
        rest = weighted_average([{k: r.state[k] for k in rest_keys} for r in results], weights)
    return [float(w) / total for w in weights], rest
