"""FedDF: ensemble distillation for robust model fusion (Lin, Kong, Stich, Jaggi; NeurIPS 2020).

Model prototypes are our tiers: each tier owns one model, the configured architecture at the
largest width whose forward MACs fit the tier's budget (``ratio × plain MACs``), parameterised
independently; the largest is the global (server) model, as the DynamicFL paper prescribes for its
KD baselines. One round:

1. every sampled client trains its tier's model locally with plain cross-entropy (the shared
   trainer), starting from the tier's current model;
2. per tier, the student starts from the FedAvg of the returned models of that tier — uniform
   weights (buffers included) as in the FedDF code; ``student_init="samples"`` weights by sample
   count; a tier without returned models starts from its previous model;
3. the teachers are all returned client models, of every tier, in eval mode; the distillation
   target of a public image is the mean of the teachers' logits ("AvgLogits");
4. each tier's student minimises ``T²·KL(softmax(target/T) ‖ softmax(student/T))`` on batches of
   the unlabeled public split (``data.public_fraction``), with Adam (lr 1e-3) cosine-annealed over
   the step budget, gradient-norm clipping at 5, for up to ``kd_steps`` steps; when the server
   holds labeled data (``data.server_fraction > 0``) the student is validated every
   ``validate_every`` steps, training stops after ``patience`` steps without improvement and the
   best student is kept (the FedDF README's protocol); without it the full step budget runs;
5. each tier's student is sent to that tier's clients next round.

Differences from upstream: the teachers' ensemble logits are computed once per round on the whole
public split (the teachers are fixed during distillation, so this equals computing them per batch);
the student trains in train mode (its BN statistics follow the public data, as upstream).

Dynamic budgets: a client receives, at the start of a round, the largest family member that fits
its budget (its own tier's member in static runs); it cannot change model in the middle of local
training, so ``adapts_to`` is only ``static`` (DynamicFL paper, Table 2).

Communication: each client downloads and uploads its full tier model (parameters and buffers).
The public data is assumed to be pre-shared and is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
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
    public_source,
)
from fedhetero.core.hetero import budget as budget_mod
from fedhetero.core.exchange.aggregation import weighted_average
from fedhetero.core.method.algorithm import Algorithm
from fedhetero.core.common.options import MethodOptions, option
from fedhetero.core.exchange.types import ClientInfo, ClientResult, ClientTask
from fedhetero.core.hetero.widths import narrowest_width_macs

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import ClientContext, Context, RunContext

__all__ = ["FedDF", "FedDFOptions"]


@dataclass(frozen=True)
class FedDFOptions(MethodOptions):
    """FedDF options (defaults: the FedDF README / code)."""

    kd_steps: int = option(10_000, ge=1)  # step budget per tier student (the dynamicfl_paper preset uses 1000)
    kd_batch_size: int = option(128, ge=1)
    kd_lr: float = option(1e-3, gt=0)  # Adam, cosine-annealed over kd_steps
    temperature: float = option(1.0, gt=0)
    clip_grad: float = option(5.0, gt=0)
    validate_every: int = option(100, ge=1)  # only with labeled server data
    patience: int = option(1_000, ge=0)  # steps without improvement before stopping (README value)
    early_stopping: bool = True  # needs data.server_fraction > 0
    student_init: Literal["uniform", "samples"] = "uniform"


class FedDF(Algorithm):
    """FedDF with one prototype per tier and AvgLogits ensemble distillation on public data."""

    name = "feddf"
    summary = (
        "One model per budget tier; the server fuses each tier's model by ensemble distillation from all "
        "returned models (averaged logits) on unlabelled public data."
    )
    paper = "Lin, Kong, Stich, Jaggi; NeurIPS 2020"
    public_data = "required"
    server_data = "optional"  # early stopping of the distillation on server data, when given
    Options = FedDFOptions
    adapts_to = frozenset({"static"})
    state_fields = ("tier_models",)  # the global model is the largest tier's model

    def min_budget_macs(self, ctx: "RunContext") -> float | None:
        """The narrowest family member's MACs (width ``model.width / 16``)."""
        return narrowest_width_macs(ctx)

    def setup(self, ctx: "Context") -> None:
        budget_mod.check_budgets(ctx.cfg, self, ctx)  # a tier no member fits: one error naming it
        self.public = public_indices(ctx, self.name)
        self.family = ModelFamily(ctx)
        self.tier_models: dict[str, nn.Module] = {}
        for member in self.family.members:
            self.tier_models[member.tier] = self.family.build(ctx, member.width)
        self.global_model = self.tier_models[self.family.server.tier]
        self._teachers: list[nn.Module] = []
        self._last_kd: dict[str, Any] = {}

    # ------------------------------------------------------------------ server: client tasks
    def configure(self, ctx: "Context", clients: list[ClientInfo]) -> list[ClientTask]:
        """Each client receives the tier model that fits its budget."""
        return [self.task(ctx, c, member_payload(self.family, self.tier_models, c)) for c in clients]

    # ------------------------------------------------------------------ client half
    def member_build(self, ctx: "RunContext", width: float) -> nn.Module:
        """A fresh family member at ``width`` (both halves: it depends on the config only)."""
        return ctx.build_model(width=width)

    def client_model(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None = None) -> nn.Module:
        width = float(task.payload["width"])
        return member_model(ctx, width, lambda: self.member_build(ctx, width), task.payload["state"], self.name)

    def upload(self, ctx: "ClientContext", task: ClientTask, model: nn.Module, result: dict[str, Any]) -> ClientResult:
        return member_result(ctx, task, model, result)

    # ------------------------------------------------------------------ server
    def aggregate(self, ctx: "Context", updates: list[ClientResult]) -> None:
        """Per tier: the student initialisation (FedAvg of the tier's returned models); every
        returned model becomes a teacher."""
        self._teachers = member_teachers(ctx, self.family, updates, lambda w: self.member_build(ctx, w), self.name)
        for tier, model in self.tier_models.items():
            mine = [u for u in updates if u.payload.get("member") == tier]
            if not mine:
                continue
            if self.options.student_init == "samples":
                weights = [float(u.num_samples) for u in mine]
            else:
                weights = [1.0] * len(mine)
            model.load_state_dict(weighted_average([u.state for u in mine], weights))

    def server_update(self, ctx: "Context") -> None:
        """Distil the teachers' averaged logits into every tier's student."""
        teachers, self._teachers = self._teachers, []
        if not teachers:
            return
        opts = self.options
        with ctx.timer("distill"):
            target = self._ensemble_logits(ctx, teachers)
            val = getattr(ctx.data, "server_indices", None)
            use_val = opts.early_stopping and val is not None and len(val) > 0
            self._last_kd = {}
            for k, member in enumerate(self.family.members):
                student = self.tier_models[member.tier]
                gen = ctx.torch_generator("server", ctx.round, k)
                batches = public_batches(ctx, self.public, opts.kd_batch_size, gen)

                def loss_fn(out: torch.Tensor, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
                    return kd_loss(out, target[pos].to(out.device), opts.temperature)

                optimizer = torch.optim.Adam(student.parameters(), lr=opts.kd_lr)
                self._last_kd[member.tier] = distill(
                    ctx,
                    student,
                    batches,
                    loss_fn,
                    opts.kd_steps,
                    optimizer=optimizer,
                    cosine=True,
                    clip_grad=opts.clip_grad,
                    validate_every=opts.validate_every if use_val else 0,
                    patience=opts.patience,
                    val_indices=val if use_val else None,
                )

    @torch.no_grad()
    def _ensemble_logits(self, ctx: "Context", teachers: list[nn.Module]) -> torch.Tensor:
        """Mean teacher logits on every public image (row ``i`` = ``self.public[i]``)."""
        images = public_source(ctx).images
        idx = torch.as_tensor(self.public)
        bs = ctx.cfg.train.eval_batch_size
        chunks = []
        for start in range(0, len(idx), bs):
            x = images[idx[start : start + bs].to(images.device)].to(ctx.device, ctx.dtype)
            acc = torch.zeros((x.shape[0], ctx.num_classes), dtype=torch.float64, device=ctx.device)
            for t in teachers:
                acc += logits_on(t, x).to(torch.float64)
            chunks.append((acc / len(teachers)).to(torch.float32).cpu())
        return torch.cat(chunks)

    # ------------------------------------------------------------------ evaluation & state
    def eval_models(self, ctx: "Context") -> dict[str, nn.Module]:
        out: dict[str, nn.Module] = {"global": self.tier_models[self.family.server.tier]}
        for tier, model in self.tier_models.items():
            out[f"tier:{tier}"] = model
        return out
