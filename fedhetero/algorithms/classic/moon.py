"""MOON: model-contrastive federated learning (Li, He, Song; CVPR 2021).

Every client trains the full global model (as FedAvg) with the local loss

    ℓ = CE(f(x), y) + μ · ℓ_con,
    ℓ_con = −log( exp(sim(z, z_glob)/τ) / (exp(sim(z, z_glob)/τ) + exp(sim(z, z_prev)/τ)) ),

averaged over the batch, where ``sim`` is the cosine similarity and ``z``, ``z_glob``, ``z_prev``
are the representations of the batch under the model being trained, the global model the round
started from (the positive pair) and the client's own model from the last round it took part in
(the negative pair). The server averages the uploaded models as FedAvg does.

Choices for the zoo models:

* the representation is the input of the model's final classifier (the penultimate features;
  :mod:`fedhetero.core.local.features` finds it with a hook). The zoo models have no projection
  head, so MOON's head is not added: the contrastive loss acts on the features the classifier
  reads. A model that is its classifier alone (logistic regression) has no features but its input,
  which is the same for all three models; there the logits are the representation, as in the
  DynInit study's MNIST runs;
* the global and previous models compute their representations in eval mode, without gradients;
* a client that has not trained before has no previous model: its local loss is plain
  cross-entropy. With a single negative that equals the global model's representation the
  contrastive term is a constant (log 2) with zero gradient, and MOON's reference code runs the
  first round with no negative at all, so both readings train the same model;
* the previous local model is the client's private state (its full state dict, returned as
  ``client_state``), kept with the client between rounds and across resumes.

Defaults: μ = 1 (the contrastive weight the DynInit study runs MOON with, and MOON's own value
for CIFAR-100 and Tiny-ImageNet; MOON uses 5 on CIFAR-10) and τ = 0.5 (MOON's temperature for
every data set). μ = 0 trains exactly FedAvg's models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from fedhetero.core.method.algorithm import Algorithm
from fedhetero.core.common.options import MethodOptions, option
from fedhetero.core.local.features import has_hidden_layers, penultimate
from fedhetero.core.local.objective import Batch, LocalObjective, LocalPlan, LossRule
from fedhetero.core.exchange.types import ClientResult, ClientTask

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import ClientContext

__all__ = ["Moon", "MoonOptions", "contrastive_per_sample", "moon_contrastive_loss", "representation"]


@dataclass(frozen=True)
class MoonOptions(MethodOptions):
    mu: float = option(1.0, ge=0)  # μ: weight of the model-contrastive term
    tau: float = option(0.5, gt=0)  # τ: temperature of the cosine similarities


def moon_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """MOON's model-contrastive loss, averaged over the batch: cross-entropy of the logits
    ``[cos(z, z_glob), cos(z, z_prev)] / τ`` with the positive (global) pair as the target."""
    return contrastive_per_sample(z.flatten(1), z_glob.flatten(1), z_prev.flatten(1), tau).mean()


def contrastive_per_sample(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """MOON's loss of every sample (representations on the last axis; any leading axes)."""
    pos = F.cosine_similarity(z, z_glob, dim=-1)
    neg = F.cosine_similarity(z, z_prev, dim=-1)
    return -torch.log_softmax(torch.stack([pos, neg], dim=-1) / tau, dim=-1)[..., 0]


def representation(model: nn.Module, x: torch.Tensor, num_classes: int | None = None) -> torch.Tensor:
    """MOON's representation of ``x`` under ``model``: the penultimate features, or the logits for
    a model without hidden layers."""
    if has_hidden_layers(model, num_classes):
        return penultimate(model, x, num_classes)
    return model(x)


class Moon(Algorithm):
    """FedAvg plus MOON's model-contrastive loss between the local, global and previous local
    representations."""

    name = "moon"
    summary = (
        "FedAvg plus a model-contrastive loss that pulls a client's representations towards the global "
        "model's and away from its previous local model's."
    )
    paper = "Li, He, Song; CVPR 2021"
    Options = MoonOptions

    def local_plan(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> LocalPlan:
        """The contrastive term against the global model (positive) and the client's previous
        model (negative); a client without a previous model trains plain cross-entropy (its term
        is weighted by zero, so a cohort may mix both kinds of client)."""
        sent = task.payload["state"]

        def finish(result: ClientResult) -> None:
            result.client_state = dict(result.state)  # this round's local model is next round's z_prev

        return LocalPlan(ctx.configured_sgd(), objective=LocalObjective(
            loss=_contrastive(float(self.options.mu), float(self.options.tau)),
            consts={"has_previous": 1.0 if state else 0.0},
            references={"global": sent, "previous": state or sent},
            representation="features",
            finish=finish,
        ))


def _contrastive(mu: float, tau: float) -> LossRule:
    """``μ·ℓ_con`` of the batch (see the module docstring), zero for a client without a previous
    model."""

    def rule(b: Batch) -> torch.Tensor:
        con = b.mean(contrastive_per_sample(b.out, b.ref("global"), b.ref("previous"), tau))
        b.record("contrastive_loss", con)
        return mu * b.c["has_previous"] * con

    return rule
