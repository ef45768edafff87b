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
  :mod:`fedhetero.algorithms.features` finds it with a hook). The zoo models have no projection
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
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from fedhetero.algorithms.features import FeatureTap, has_hidden_layers, penultimate
from fedhetero.core.algorithm import Algorithm
from fedhetero.core.cohort import plain_results, train_cohort
from fedhetero.core.config import MethodOptions, option
from fedhetero.core.types import ClientResult, ClientTask

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.cohort import Cohort
    from fedhetero.core.context import ClientContext

__all__ = ["Moon", "MoonOptions", "moon_contrastive_loss", "representation"]


@dataclass(frozen=True)
class MoonOptions(MethodOptions):
    mu: float = option(1.0, ge=0)  # μ: weight of the model-contrastive term
    tau: float = option(0.5, gt=0)  # τ: temperature of the cosine similarities


def moon_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """MOON's model-contrastive loss, averaged over the batch: cross-entropy of the logits
    ``[cos(z, z_glob), cos(z, z_prev)] / τ`` with the positive (global) pair as the target."""
    z = z.flatten(1)
    pos = F.cosine_similarity(z, z_glob.flatten(1), dim=1)
    neg = F.cosine_similarity(z, z_prev.flatten(1), dim=1)
    logits = torch.stack([pos, neg], dim=1) / tau
    target = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
    return F.cross_entropy(logits, target)


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
    Options = MoonOptions

    def client_update(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> ClientResult:
        model = self.client_model(ctx, task)
        if not state:  # no previous local model yet: plain cross-entropy (see the module docstring)
            report = self.local_train(ctx, task, model)
        else:
            report = self._contrastive_train(ctx, task, model, state)
        result = self.upload(ctx, task, model, report)
        result.client_state = dict(result.state)  # this round's local model is next round's z_prev
        return result

    def _frozen(self, ctx: "ClientContext", key: str, state: dict[str, torch.Tensor]) -> nn.Module:
        frozen = ctx.reusable(("moon", key), ctx.build_model)
        frozen.load_state_dict(state)
        frozen.eval()
        return frozen

    def _contrastive_train(self, ctx: "ClientContext", task: ClientTask, model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        mu, tau = float(self.options.mu), float(self.options.tau)
        glob = self._frozen(ctx, "global", task.payload["state"])
        prev = self._frozen(ctx, "previous", state)
        use_logits = not has_hidden_layers(model, ctx.num_classes)
        con_sum: list[torch.Tensor] = []

        with FeatureTap(model, ctx.num_classes, capture_input=True) as tap:

            def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                x = tap.input
                assert x is not None  # the tap saw this step's forward
                with torch.no_grad():
                    if use_logits:
                        z_glob, z_prev = glob(x), prev(x)
                    else:
                        z_glob, z_prev = penultimate(glob, x, ctx.num_classes), penultimate(prev, x, ctx.num_classes)
                feats = out if use_logits else tap.features
                assert feats is not None and z_glob is not None and z_prev is not None  # the tap saw the forward
                con = moon_contrastive_loss(feats, z_glob, z_prev, tau)
                con_sum.append(con.detach())
                return F.cross_entropy(out, y) + mu * con

            report = ctx.train(model, task, ctx.cfg.train.local_epochs, loss_fn=loss_fn)
        if con_sum:
            report["contrastive_loss"] = float(torch.stack(con_sum).mean())
        return report

    def client_update_many(
        self, ctx: "ClientContext", tasks: list[ClientTask], states: list[dict[str, Any] | None]
    ) -> list[ClientResult] | None:
        """Vectorised MOON for models whose representation is their logits (see the module
        docstring); None (one by one) for models with hidden layers."""
        if has_hidden_layers(self.client_model(ctx, tasks[0]), ctx.num_classes):
            return None
        sent: dict[str, torch.Tensor] | None = tasks[0].payload.get("state")
        if sent is None or any(t.payload.get("state") is not sent for t in tasks):
            return None  # one global model per round
        mu, tau = float(self.options.mu), float(self.options.tau)

        def extra(co: "Cohort") -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
            glob = ctx.reusable(("moon", "global"), ctx.build_model)
            glob.load_state_dict(sent)
            glob.eval()
            prev = co.stacked([s or sent for s in states])
            has_prev = torch.tensor([1.0 if s else 0.0 for s in states], dtype=ctx.dtype, device=ctx.device)

            def term(out: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
                z_glob = co.shared_forward(glob, x)
                with torch.no_grad():
                    z_prev = co.forward(prev, x)
                pos = F.cosine_similarity(out, z_glob, dim=-1)
                neg = F.cosine_similarity(out, z_prev, dim=-1)
                con = -torch.log_softmax(torch.stack([pos, neg], dim=-1) / tau, dim=-1)[..., 0]
                return mu * has_prev * (con * mask).sum(1) / mask.sum(1).clamp_min(1.0)

            return term

        done = train_cohort(self, ctx, tasks, extra_loss=extra)
        if done is None:
            return None
        results = plain_results(ctx, tasks, *done)
        for r in results:
            r.client_state = dict(r.state)
        return results
