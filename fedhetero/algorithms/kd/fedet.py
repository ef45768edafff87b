"""FedET: heterogeneous ensemble knowledge transfer (Cho, Manoel, Joshi, Sim, Dimitriadis; IJCAI 2022).

Small client models of several sizes train a larger server model by **weighted consensus
distillation with diversity regularisation** on unlabeled public data (the paper's abstract); the
DynamicFL paper calls it a bi-directional transfer between server and client models. No official
code exists; the round below follows the structure of a third-party implementation (its
``FedET_Server`` class), unverified against the paper.

Models: one model per tier (the configured architecture at the largest width fitting the tier's
FLOPs budget, parameterised independently) and one server model with the largest tier's
architecture. Every model ends in a **shared representation layer** of identical shape: the
zoo model's classifier is replaced by a projection ``Linear(features, D)`` + ReLU (tier-specific)
followed by the shared ``Linear(D, K)`` classifier (``head``). The projection and head are part of
every model's measured MACs, so each tier's model still fits its budget.

Round:

1. each sampled client trains its tier's model with cross-entropy (the shared trainer);
2. the server's shared layer starts as the mean of the returned models' shared layers;
3. every public sample ``x`` and returned model ``m``: ``p_m(x) = softmax``; confidence
   ``c_m(x)`` = variance of ``p_m(x)`` across classes (``confidence="logprob"``: of the
   log-probabilities, as the third-party code); weight ``w_m = c_m / Σ c``;
4. consensus label ``y*(x) = argmax_k Σ_m w_m(x)·p_m(x)_k``;
5. diversity target ``d(x)``: confidence-weighted mean of the logits of the models whose own argmax
   differs from ``y*``; no diversity term where every model agrees;
6. the server model trains ``server_steps`` batches of the public data on
   ``CE(f(x), y*) + λ·KL(softmax(d) ‖ softmax(f))`` (SGD, ``server_lr``);
7. each tier model becomes the within-tier FedAvg of its returned models (sample-weighted or
   uniform per ``train.aggregation``) and receives the server's shared layer
   (``transfer_back="share"``); ``transfer_back="kd"`` instead distils the server model into
   every tier model on the public data for ``server_steps`` batches.

Evaluation: the global model is the server model; each tier deploys its tier model.
Dynamic budgets: a client gets, at round start, the largest tier model fitting its budget; it
cannot change model during local training, so ``adapts_to = {static}`` (paper Table 2).
Communication: each client downloads and uploads its full tier model; public data is pre-shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from fedhetero.algorithms.kd._common import (
    ModelFamily,
    distill,
    kd_loss,
    logits_on,
    member_model,
    member_payload,
    member_result,
    member_teachers,
    public_batches,
    public_indices,
)
from fedhetero.core.hetero import budget as budget_mod
from fedhetero.core.exchange.aggregation import weighted_average
from fedhetero.core.method.algorithm import Algorithm
from fedhetero.core.common.options import MethodOptions, option
from fedhetero.core.hetero.submodel import channel_groups_of
from fedhetero.core.exchange.types import ClientInfo, ClientResult, ClientTask
from fedhetero.core.hetero.widths import narrowest_width_macs

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import ClientContext, Context, RunContext

__all__ = ["FedET", "FedETOptions", "SharedHeadModel", "consensus_targets", "with_shared_head"]


class SharedHeadModel(nn.Module):
    """``head(body(x))``: a backbone ending in a ``D``-dim representation and the shared classifier."""

    def __init__(self, body: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.body = body
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def with_shared_head(model: nn.Module, dim: int, num_classes: int) -> SharedHeadModel:
    """Replace ``model``'s classifier (the layer producing the ``classes`` group) by
    ``Linear(features, dim)`` + ReLU and append the shared ``Linear(dim, num_classes)`` head."""
    groups = channel_groups_of(model)
    paths = [
        k[: -len(".weight")]
        for k, (d0, _) in groups.dims.items()
        if k.endswith(".weight") and d0 is not None and any(g == "classes" for g, _ in d0)
    ]
    linears = [p for p in paths if isinstance(model.get_submodule(p), nn.Linear)]
    if len(linears) != 1:
        raise ValueError(f"FedET needs exactly one Linear classifier producing the classes, found {paths}")
    path = linears[0]
    old = model.get_submodule(path)
    assert isinstance(old, nn.Linear)
    dt, dev = old.weight.dtype, old.weight.device  # the new layers in the model's dtype
    proj = nn.Sequential(nn.Linear(old.in_features, dim, dtype=dt, device=dev), nn.ReLU())
    parent_path, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, child, proj)
    return SharedHeadModel(model, nn.Linear(dim, num_classes, dtype=dt, device=dev))


@torch.no_grad()
def consensus_targets(
    teacher_logits: torch.Tensor, confidence: str = "prob"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted consensus and diversity targets from ``(M, B, K)`` teacher logits.

    Returns ``(y_star (B,), diversity_logits (B, K), has_diversity (B,) bool)``: ``w_m ∝`` variance
    across classes of each teacher's probabilities (or log-probabilities), ``y* = argmax Σ w·p``,
    diversity = confidence-weighted mean logits of the teachers disagreeing with ``y*``.
    """
    probs = F.softmax(teacher_logits, dim=2)
    score = probs if confidence == "prob" else F.log_softmax(teacher_logits, dim=2)
    conf = score.var(dim=2, unbiased=False)  # (M, B)
    w = conf / conf.sum(0, keepdim=True).clamp_min(1e-12)
    y_star = (w.unsqueeze(2) * probs).sum(0).argmax(1)
    disagree = teacher_logits.argmax(2) != y_star.unsqueeze(0)  # (M, B)
    wd = conf * disagree
    total = wd.sum(0)
    has = total > 0
    div = (wd.unsqueeze(2) * teacher_logits).sum(0) / total.clamp_min(1e-12).unsqueeze(1)
    return y_star, div, has


@dataclass(frozen=True)
class FedETOptions(MethodOptions):
    """FedET options (third-party defaults, unverified against the paper)."""

    rep_dim: int = option(128, ge=1)  # D: size of the shared representation
    server_steps: int = option(128, ge=1)  # τ
    server_lr: float = option(5e-3, gt=0)  # SGD
    server_batch_size: int = option(64, ge=1)
    diversity_weight: float = option(0.05, ge=0)  # λ
    temperature: float = option(1.0, gt=0)
    confidence: Literal["prob", "logprob"] = "prob"
    transfer_back: Literal["share", "kd"] = "share"


class FedET(Algorithm):
    """FedET: tier models with a shared head; a larger server model trained by weighted consensus
    distillation with diversity regularisation."""

    name = "fedet"
    summary = (
        "Tier models with a shared head train a larger server model by weighted consensus distillation with "
        "diversity regularisation on unlabelled public data."
    )
    paper = "Cho et al., IJCAI 2022"
    public_data = "required"
    Options = FedETOptions
    adapts_to = frozenset({"static"})
    state_fields = ("server_model", "tier_models")  # the global model is the server model

    def min_budget_macs(self, ctx: "RunContext") -> float | None:
        """The narrowest family member's MACs (width ``model.width / 16``, shared head included)."""
        return narrowest_width_macs(ctx, lambda width: self.member_build(ctx, width, device=False))

    def setup(self, ctx: "Context") -> None:
        budget_mod.check_budgets(ctx.cfg, self, ctx)  # a tier no member fits: one error naming it
        self.public = public_indices(ctx, self.name)
        self.family = ModelFamily(ctx, lambda width: self.member_build(ctx, width, device=False))
        # built as ``self.family.build`` does (the member on the device), typed with its head
        self.tier_models: dict[str, SharedHeadModel] = {m.tier: self.member_build(ctx, m.width) for m in self.family.members}
        self.server_model = self.member_build(ctx, self.family.server.width)
        self.global_model = self.server_model
        self._teachers: list[nn.Module] = []

    def member_build(self, ctx: "RunContext", width: float, device: bool = True) -> SharedHeadModel:
        """A fresh family member at ``width``: the zoo model with the shared head (both halves: it
        depends on the config and options only)."""
        model = with_shared_head(ctx.build_model(width=width), self.options.rep_dim, ctx.num_classes)
        return model.to(ctx.device) if device else model

    # ------------------------------------------------------------------ server: client tasks
    def configure(self, ctx: "Context", clients: list[ClientInfo]) -> list[ClientTask]:
        """Each client receives the tier model that fits its budget."""
        return [self.task(ctx, c, member_payload(self.family, self.tier_models, c)) for c in clients]

    # ------------------------------------------------------------------ client half
    def client_model(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None = None) -> nn.Module:
        width = float(task.payload["width"])
        key = (self.name, self.options.rep_dim)
        return member_model(ctx, width, lambda: self.member_build(ctx, width), task.payload["state"], key)

    def upload(self, ctx: "ClientContext", task: ClientTask, model: nn.Module, result: dict[str, Any]) -> ClientResult:
        return member_result(ctx, task, model, result)

    # ------------------------------------------------------------------ server
    def aggregate(self, ctx: "Context", updates: list[ClientResult]) -> None:
        """Server head ← mean of the returned heads; tier models ← within-tier FedAvg; every
        returned model becomes a teacher."""
        if not updates:
            return
        key = (self.name, self.options.rep_dim)
        self._teachers = member_teachers(ctx, self.family, updates, lambda w: self.member_build(ctx, w), key)
        heads = [{k[len("head."):]: v for k, v in u.state.items() if k.startswith("head.")} for u in updates]
        self.server_model.head.load_state_dict(weighted_average(heads, [1.0] * len(heads)))
        for tier, model in self.tier_models.items():
            mine = [u for u in sorted(updates, key=lambda u: u.cid) if u.payload.get("member") == tier]
            if mine:
                model.load_state_dict(weighted_average([u.state for u in mine], ctx.aggregation_weights(mine)))

    def server_update(self, ctx: "Context") -> None:
        teachers, self._teachers = self._teachers, []
        if not teachers:
            return
        opts = self.options
        with ctx.timer("distill"):
            gen = ctx.torch_generator("server", ctx.round, 0)
            batches = public_batches(ctx, self.public, opts.server_batch_size, gen)

            def server_loss(out: torch.Tensor, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
                logits = torch.stack([logits_on(t, x) for t in teachers])
                y_star, div, has = consensus_targets(logits, opts.confidence)
                loss = F.cross_entropy(out, y_star)
                if opts.diversity_weight > 0 and bool(has.any()):
                    loss = loss + opts.diversity_weight * kd_loss(out[has], div[has], opts.temperature)
                return loss

            opt = torch.optim.SGD(self.server_model.parameters(), lr=opts.server_lr)
            self._last_kd = distill(ctx, self.server_model, batches, server_loss, opts.server_steps, optimizer=opt)
            head = self.server_model.head.state_dict()
            for k, model in enumerate(self.tier_models.values()):
                if opts.transfer_back == "share":
                    model.head.load_state_dict(head)
                    continue
                teacher = self.server_model
                g = ctx.torch_generator("server", ctx.round, k + 1)

                def back_loss(
                    out: torch.Tensor, x: torch.Tensor, pos: torch.Tensor, teacher: nn.Module = teacher
                ) -> torch.Tensor:
                    return kd_loss(out, logits_on(teacher, x), opts.temperature)

                opt_t = torch.optim.SGD(model.parameters(), lr=opts.server_lr)
                distill(ctx, model, public_batches(ctx, self.public, opts.server_batch_size, g), back_loss,
                        opts.server_steps, optimizer=opt_t)

    # ------------------------------------------------------------------ evaluation & state
    def eval_models(self, ctx: "Context") -> dict[str, nn.Module]:
        out: dict[str, nn.Module] = {"global": self.server_model}
        for tier, model in self.tier_models.items():
            out[f"tier:{tier}"] = model
        return out
