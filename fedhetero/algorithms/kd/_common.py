"""Shared pieces of the knowledge-distillation baselines (FedDF, FedET, DS-FL).

* :class:`ModelFamily` — one model per tier: the configured architecture at the largest width
  whose forward MACs fit the tier's budget (absolute budgets, ``ratio × plain MACs``); the largest
  member is the server model (the DynamicFL paper's protocol for its KD baselines).
* :func:`public_indices` — the unlabeled public split of the training set
  (``data.public_fraction > 0``) with a clear error when it is missing.
* :func:`public_batches` — an endless, seeded stream of public images (labels are never read).
* :func:`kd_loss` / :func:`soft_kd_loss` — temperature-scaled KL divergence to teacher logits or
  to teacher probabilities.
* :func:`distill` — the generic student loop (optimizer, optional cosine schedule, gradient
  clipping, optional early stopping on a labeled validation split, best-state restore).
* :func:`member_payload` / :func:`member_model` / :func:`member_result` / :func:`member_teachers`
  — a tier-model exchange: what the server sends, the client's copy, its upload, and the
  server's teachers rebuilt from the uploads.

Nothing here reads client data; distillation runs on the server or on the public split.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedhetero.core.exchange.types import ClientInfo, ClientResult, ClientTask
from fedhetero.core.hetero.widths import WidthPlanner

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import ClientContext, Context, RunContext

__all__ = [
    "FamilyMember",
    "ModelFamily",
    "PublicDataError",
    "distill",
    "kd_loss",
    "logits_on",
    "member_model",
    "member_payload",
    "member_result",
    "member_teachers",
    "public_batches",
    "public_indices",
    "public_source",
    "soft_kd_loss",
]


class PublicDataError(ValueError):
    """A distillation method was configured without an unlabeled public split."""


def public_indices(ctx: "Context", method: str) -> np.ndarray:
    """Indices (into :func:`public_source`) of the unlabeled public split; raise when absent.

    The split is carved out of the training set by the data module when ``data.public_fraction
    > 0`` and is removed from every client's data. Labels of these samples are never used.
    """
    idx = getattr(ctx.data, "public_indices", None)
    if idx is None or len(idx) == 0:
        raise PublicDataError(
            f"algorithm {method!r} distils on unlabeled public data: set data.public_fraction > 0 "
            f"(e.g. 0.1) so that a public split of the training set is held out"
        )
    return np.asarray(idx, dtype=np.int64)


def public_source(ctx: "RunContext") -> Any:
    """The dataset the public indices refer to (``data.public_dataset``, else ``data.train``)."""
    src = getattr(ctx.data, "public_dataset", None)
    return src if src is not None else ctx.data.train


def public_batches(
    ctx: "RunContext", indices: np.ndarray | Sequence[int], batch_size: int, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless stream of ``(x, position)`` batches over the public indices.

    ``position`` indexes ``indices`` (so callers can look up per-sample targets); epochs are
    reshuffled with ``generator``. Images are moved to ``ctx.device`` in the run's dtype.
    """
    idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
    images = public_source(ctx).images
    for pos in public_positions(int(idx.numel()), batch_size, generator):
        x = images[idx[pos].to(images.device)]
        yield x.to(ctx.device, ctx.dtype, non_blocking=True), pos


def public_positions(n: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """The positions (into ``n`` public indices) of :func:`public_batches`' batches: an endless
    stream, each pass over the ``n`` in an order drawn from ``generator``."""
    if n == 0:
        raise PublicDataError("the public split is empty")
    while True:
        perm = torch.randperm(n, generator=generator)
        for start in range(0, n, batch_size):
            yield perm[start : start + batch_size]


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``T² · KL(softmax(teacher/T) ‖ softmax(student/T))``, averaged over the batch."""
    t = float(temperature)
    target = F.softmax(teacher_logits.detach() / t, dim=1)
    return soft_kd_loss(student_logits, target, t)


def soft_kd_loss(student_logits: torch.Tensor, target_probs: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``T² · KL(target ‖ softmax(student/T))`` for given target probabilities (batch mean)."""
    t = float(temperature)
    logp = F.log_softmax(student_logits / t, dim=1)
    return F.kl_div(logp, target_probs.detach(), reduction="batchmean") * (t * t)


@torch.no_grad()
def logits_on(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Eval-mode logits of ``model`` on ``x`` (the model's train/eval flag is restored)."""
    was = model.training
    model.eval()
    out = model(x)
    model.train(was)
    return out


def member_payload(family: "ModelFamily", tier_models: Mapping[str, nn.Module], client: ClientInfo) -> dict[str, Any]:
    """Server side: what a client receives, the tier model that fits its budget (its tier name,
    width and state)."""
    member = family.for_budget(client.budget_macs, client.tier)
    return {"member": member.tier, "width": member.width, "state": tier_models[member.tier].state_dict()}


def member_model(
    ctx: "RunContext", width: float, make: Callable[[], nn.Module], state: dict[str, torch.Tensor], key: Any
) -> nn.Module:
    """A copy of the family member at ``width`` (per-process template built by ``make``, cached
    under ``key``) loaded with ``state``."""
    model = ctx.template(("kd-member", key, float(width)), make)
    model.load_state_dict(state)
    return model


def member_result(ctx: "ClientContext", task: ClientTask, model: nn.Module, result: dict[str, Any]) -> ClientResult:
    """Client side: the upload of a trained family member (its full state; ``payload["member"]``
    names the tier model it trained)."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    macs = ctx.macs(model)
    metrics = dict(result)
    metrics["member"] = task.payload["member"]
    if task.budget_after_change is not None:
        metrics["fits_after_change"] = bool(macs <= task.budget_after_change * (1 + 1e-9))
    return ClientResult.of(task, state, macs=macs, payload={"member": task.payload["member"]}, metrics=metrics)


def member_teachers(
    ctx: "Context", family: "ModelFamily", results: list[ClientResult], build: Callable[[float], nn.Module], key: Any
) -> list[nn.Module]:
    """Server side: the returned client models (in eval mode, in client-id order), rebuilt from
    their uploads, as the teachers of the server's distillation."""
    teachers = []
    for u in sorted(results, key=lambda u: u.cid):
        width = family.by_tier[u.payload["member"]].width
        model = member_model(ctx, width, functools.partial(build, width), u.state, key)
        model.eval()
        teachers.append(model)
    return teachers


@dataclass(frozen=True)
class FamilyMember:
    """One tier's model in a KD family."""

    tier: str
    width: float
    macs: int


class ModelFamily:
    """Per-tier model widths under absolute FLOPs budgets.

    ``builder(width)`` must return a fresh model of the family at ``width`` (default: the
    configured architecture via ``ctx.build_model``). Each tier gets the largest width whose
    forward MACs fit ``ratio × ctx.plain_macs``. Members are ordered by MACs; :attr:`server` is
    the largest.
    """

    def __init__(self, ctx: "Context", builder: Callable[[float], nn.Module] | None = None) -> None:
        self._builder = builder
        self.planner = WidthPlanner(ctx, builder)
        members: list[FamilyMember] = []
        for tier in ctx.cfg.budget.tiers:
            width = self.planner.width_for(tier.ratio * ctx.plain_macs)
            members.append(FamilyMember(tier.name, width, self.planner.macs_at(width)))
        self.members: list[FamilyMember] = sorted(members, key=lambda m: (m.macs, m.width))
        self.by_tier: dict[str, FamilyMember] = {m.tier: m for m in members}

    def build(self, ctx: "Context", width: float) -> nn.Module:
        """A fresh member at ``width`` on ``ctx.device``."""
        if self._builder is None:
            return ctx.build_model(width=width)
        return self._builder(width).to(ctx.device, ctx.dtype)

    @property
    def server(self) -> FamilyMember:
        """The largest member (the server / global model's architecture)."""
        return self.members[-1]

    def for_budget(self, budget_macs: float, tier: str | None = None) -> FamilyMember:
        """The member a client with ``budget_macs`` receives.

        Its own tier's member when that fits; otherwise the largest member that fits; when none
        fits, the smallest (the client is then recorded as over budget).
        """
        limit = float(budget_macs) * (1 + 1e-9)
        if tier is not None and tier in self.by_tier and self.by_tier[tier].macs <= limit:
            own = self.by_tier[tier]
            bigger = [m for m in self.members if m.macs <= limit and m.macs > own.macs]
            if not bigger:
                return own
        fitting = [m for m in self.members if m.macs <= limit]
        return fitting[-1] if fitting else self.members[0]


def _cosine(step: int, total: int, base: float) -> float:
    return 0.5 * base * (1.0 + math.cos(math.pi * min(step, total) / max(total, 1)))


def distill(
    ctx: "RunContext",
    student: nn.Module,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None],
    steps: int,
    *,
    optimizer: torch.optim.Optimizer,
    cosine: bool = False,
    clip_grad: float | None = None,
    validate_every: int = 0,
    patience: int = 0,
    val_indices: np.ndarray | None = None,
) -> dict[str, Any]:
    """Train ``student`` (train mode) for up to ``steps`` batches of ``batches``.

    ``loss_fn(student_logits, x, position)`` returns the loss of one batch (or ``None`` to skip the
    batch). With ``cosine`` the learning rate follows a cosine from its initial value to 0 over
    ``steps``. With ``val_indices`` (labeled server data) and ``validate_every > 0`` the student is
    evaluated every ``validate_every`` steps, the best state is kept, and training stops after
    ``patience`` steps without improvement; the best state is loaded at the end.
    """
    student.train()
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    use_val = val_indices is not None and len(val_indices) > 0 and validate_every > 0
    best_acc = -1.0
    best_state: dict[str, torch.Tensor] | None = None
    best_step = 0
    done = 0
    total = torch.zeros((), dtype=torch.float64)
    for step in range(steps):
        if cosine:
            for g, lr in zip(optimizer.param_groups, base_lrs):
                g["lr"] = _cosine(step, steps, lr)
        x, pos = next(batches)
        out = student(x)
        loss = loss_fn(out, x, pos)
        if loss is None:
            continue
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip_grad is not None:
            torch.nn.utils.clip_grad_norm_(student.parameters(), clip_grad)
        optimizer.step()
        total += loss.detach().to(torch.float64)
        done += 1
        if use_val and (step + 1) % validate_every == 0:
            acc = ctx.evaluate(student, ctx.data.train, val_indices)["accuracy"]
            student.train()
            if acc > best_acc:
                best_acc, best_step = acc, step + 1
                best_state = copy.deepcopy(student.state_dict())
            elif patience > 0 and step + 1 - best_step >= patience:
                break
    if best_state is not None:
        student.load_state_dict(best_state)
    for g, lr in zip(optimizer.param_groups, base_lrs):
        g["lr"] = lr
    return {"kd_steps": done, "kd_loss": float(total / max(done, 1)), "kd_best_val": best_acc if use_val else None}
