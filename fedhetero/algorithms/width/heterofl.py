"""HeteroFL: computation- and communication-efficient FL for heterogeneous clients
(Diao, Ding, Tarokh; ICLR 2021).

Global model and sub-models (absolute FLOPs budgets, the same for every method): the global model
is the configured architecture widened to the largest width that fits the largest tier's budget
(the largest width fitting ``ctx.max_budget_macs()``, ≈ √3 × for a 1:2:3 tier set; HeteroFL's
r_g; searched by :class:`~fedhetero.core.hetero.widths.WidthPlanner` on a 1/16 grid that extends above
width 1). A client with budget ``B`` trains the nested **prefix** sub-model at the largest width whose
forward MACs fit ``B`` (never wider than the global model): for every channel group the first
``C_sub`` channels, where ``C_sub`` are the hidden sizes of the zoo model built at that width, so
the client's model *is* an ordinary width-``w`` network and its MACs are measured, not estimated.

Faithful to upstream (``src/fed.py``, ``src/models/*.py``):

* **Masked per-element averaging** (``combine``): global-shaped ``sum``/``count`` buffers,
  clients in sorted id order, each weight averaged over the clients that trained it; a coordinate
  nobody trained keeps its previous value bit for bit (never zeroed); **uniform** client weights
  (``weighting="samples"`` is an option).
* **Classifier rows masked by label set**: rows (weight) and entries (bias) of the classifier are
  added and counted only for classes present in the client's data; during local training the
  logits of absent classes are set to ``mask_fill`` (0, not −∞, as upstream) before the
  cross-entropy.
* **Static BN** (``bn="sbn_central"``, the default): clients train with batch statistics and no
  running buffers (``track_running_stats=False``), so no BN buffers are exchanged; for evaluation
  the server loads the weights into a copy with running statistics and ``momentum=None``
  (cumulative average), runs one pass over the pooled training data of the clients in train mode
  without gradients, then evaluates in eval mode. Statistics are width-specific: every evaluated
  width gets its own pass. ``bn="batch"`` evaluates with test-batch statistics; ``bn="fedavg"``
  tracks running statistics locally and averages them like weights (coverage-masked).
* **Scaler**: during training, the output of every layer that produces hidden channels (the place
  where the normalisation sits) is divided by ``s = w / r_g``; identity in eval mode and at
  ``s = 1``.
* **Gradient-norm clipping at 1** (``clip_grad``); the optimizer is re-created every round.

Differences from upstream: levels and mix strings are replaced by the engine's tiers and budgets
(each tier's width is derived from its FLOPs budget); ``fix``/``dynamic`` level assignment is the
engine's tier assignment and budget scenario; the sBN pass runs over the clients' pooled training
data without augmentation; per-tier accuracy (the DynamicFL fairness protocol) deploys each tier's
prefix sub-model with its own sBN statistics.

Dynamic budgets: when a client's budget drops during local training (``budget_after_change``,
from local epoch 3 on) below the MACs of its sub-model, it prunes to the nested prefix of its
sub-model that fits the new budget and trains that for the remaining epochs (a fresh optimizer);
it uploads the narrower model. An increased budget is ignored (the sub-model cannot grow in the
middle of a round). Hence ``adapts_to = {static, decreasing}`` (DynamicFL paper, Table 2).

Communication: ``bytes_down`` is the sub-model slice sent to the client, ``bytes_up`` the trained
sub-model it returns (no BN buffers under sBN; the label set it reports is not counted).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedhetero.core.hetero import budget as budget_mod
from fedhetero.core.method.algorithm import Algorithm
from fedhetero.core.common.options import MethodOptions, option
from fedhetero.core.local.objective import LocalPlan
from fedhetero.core.hetero.submodel import (
    SubmodelAggregator,
    SubmodelSpec,
    channel_groups_of,
    extract_state,
    submodel_from,
)
from fedhetero.core.exchange.types import ClientInfo, ClientResult, ClientTask, state_bytes
from fedhetero.core.hetero.widths import WidthPlanner, narrowest_width_macs
from fedhetero.data import iterate_batches

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import ClientContext, Context, RunContext
    from fedhetero.models.groups import ChannelGroups

__all__ = [
    "HeteroFL",
    "HeteroFLOptions",
    "WidthSlicedAlgorithm",
    "attach_scaler",
    "masked_cross_entropy",
    "spec_for_sizes",
    "static_bn_model",
    "width_model",
]

BN_POLICIES = ("sbn_central", "batch", "fedavg")


# ---------------------------------------------------------------------------------------- building blocks
def spec_for_sizes(
    groups: "ChannelGroups",
    sizes: dict[str, int],
    pick: Callable[[str, int, int], torch.Tensor] | None = None,
) -> SubmodelSpec:
    """A :class:`SubmodelSpec` of ``groups`` keeping ``sizes[g]`` channels of every non-fixed group.

    ``pick(group, C, k)`` returns the kept indices (default: the prefix ``0..k-1``). Used instead
    of a ratio so that the sub-model has exactly the sizes of the zoo model at the client's width.
    """
    if pick is None:
        def pick(g: str, n: int, k: int) -> torch.Tensor:
            return torch.arange(k)
    out: dict[str, torch.Tensor] = {}
    for g, n in groups.sizes.items():
        if g in groups.fixed:
            continue
        k = int(sizes[g])
        if not 1 <= k <= n:
            raise ValueError(f"group {g!r}: cannot keep {k} of {n} channels")
        out[g] = pick(g, n, k)
    return SubmodelSpec(groups, out)


def masked_cross_entropy(
    labels: torch.Tensor, num_classes: int, fill: float = 0.0
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Cross-entropy with the logits of classes outside ``labels`` replaced by ``fill``.

    HeteroFL's ``mask=1`` training loss (upstream fills with 0, not −∞).
    """
    keep = torch.zeros(num_classes, dtype=torch.bool)
    keep[torch.as_tensor(labels, dtype=torch.long)] = True

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mask = keep.to(out.device)
        return F.cross_entropy(out.masked_fill(~mask, float(fill)), y)

    return loss


def _producers(model: nn.Module) -> list[str]:
    """Module paths of conv/linear layers whose outputs are hidden (non-fixed) channel groups."""
    groups = channel_groups_of(model)
    paths = []
    for key, (d0, _) in groups.dims.items():
        if not key.endswith(".weight") or d0 is None:
            continue
        path = key[: -len(".weight")]
        module = model.get_submodule(path)
        if isinstance(module, (nn.Conv2d, nn.Linear)) and all(g not in groups.fixed for g, _ in d0):
            paths.append(path)
    return paths


def attach_scaler(model: nn.Module, rate: float) -> list[Any]:
    """HeteroFL's Scaler: in train mode divide the output of every hidden-producing conv/linear by
    ``rate``; identity in eval mode. Returns the hook handles (nothing is attached at rate 1)."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if abs(rate - 1.0) <= 1e-12:
        return []
    inv = 1.0 / float(rate)

    def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
        return output * inv if module.training else None

    return [model.get_submodule(p).register_forward_hook(hook) for p in _producers(model)]


@torch.no_grad()
def static_bn_model(
    ctx: "Context",
    width: float,
    state: dict[str, torch.Tensor],
    *,
    policy: str = "sbn_central",
    batch_size: int | None = None,
) -> nn.Module:
    """An evaluation model at ``width`` loaded with ``state`` (weights only under sBN).

    ``sbn_central``: BN layers with running statistics and ``momentum=None`` (cumulative average),
    re-estimated by one pass in train mode, without gradients, over the pooled training data of all
    clients; then eval mode. ``batch``: BN without running statistics, i.e. test-batch statistics
    in eval mode. ``fedavg``: ``state`` already holds averaged running statistics.
    """
    if policy == "batch":
        model = ctx.build_model(width=width, track_running_stats=False)
        model.load_state_dict(state)
        return model.eval()
    model = ctx.build_model(width=width)
    if policy == "fedavg":
        model.load_state_dict(state)
        return model.eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    bad = [k for k in missing if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    if bad or unexpected:
        raise ValueError(f"static BN: state does not match the model (missing {bad[:4]}, unexpected {unexpected[:4]})")
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if bns:
        for m in bns:
            m.momentum = None
            m.reset_running_stats()
        pooled = np.concatenate([np.asarray(i, dtype=np.int64) for i in ctx.data.client_indices])
        model.train()
        bs = batch_size or ctx.cfg.train.batch_size
        for x, _ in iterate_batches(ctx.data.train, pooled, bs, shuffle=False):
            model(x.to(ctx.device, ctx.dtype))
    return model.eval()


# ---------------------------------------------------------------------------------------- options
@dataclass(frozen=True)
class HeteroFLOptions(MethodOptions):
    """HeteroFL options (defaults: upstream ``process_control``)."""

    bn: Literal["sbn_central", "batch", "fedavg"] = "sbn_central"
    scaler: bool = True
    mask_classifier: bool = True  # masked CE locally + label-masked classifier aggregation
    mask_fill: float = 0.0  # value of absent-class logits in the masked CE (upstream: 0)
    weighting: Literal["uniform", "samples"] = "uniform"
    clip_grad: float | None = option(1.0, gt=0)  # gradient-norm clipping (upstream: 1)
    sbn_batch_size: int | None = option(None, ge=1)  # batch size of the sBN statistics pass (None: train.batch_size)


# ---------------------------------------------------------------------------------------- algorithm
_CHANGE_AT = 2  # under a decreasing budget, the budget changes from local epoch 3 on


def width_model(ctx: "RunContext", width: float, track_running_stats: bool) -> nn.Module:
    """A fresh copy of the configured architecture at ``width`` (from a per-process template; the
    client's sub-model and the server's reference for its channel groups)."""
    key = ("width-sliced", float(width), bool(track_running_stats))
    return ctx.template(key, lambda: ctx.build_model(width=width, track_running_stats=track_running_stats))


class WidthSlicedAlgorithm(Algorithm):
    """Shared machinery of the width-slicing baselines (HeteroFL, FedRolex).

    Subclasses choose the kept channels (:meth:`pick`) and the aggregation weight
    (:meth:`client_weight`).

    Server half: :meth:`configure` chooses each client's width and channel indices (kept on the
    server for :meth:`aggregate`, per round) and sends the sliced state, the width, the global
    width (for the Scaler) and, in dynamic scenarios, the narrower width and its group sizes for
    after the budget change. Client half: builds the width-``w`` model, loads the slice, trains it
    and returns its state; when it pruned to the narrower prefix it says so
    (``payload["width_after_change"]``) and the server composes the spec.
    """

    name = "base"
    adapts_to = frozenset({"static", "decreasing"})
    # a budget that falls below the narrowest sub-model is part of the protocol (the client stops
    # local training at the change; a later round starts it on the narrowest tier's model,
    # recorded as over budget)
    trains_below_floor = True
    supports_submodels = True

    # ------------------------------------------------------------------ set-up
    def min_budget_macs(self, ctx: "RunContext") -> float | None:
        """The narrowest sub-model's MACs (width ``model.width / 16``): a client below it would
        train over budget."""
        return narrowest_width_macs(ctx)

    def setup(self, ctx: "Context") -> None:
        # a tier no width fits: one error naming it (instead of the planner's, mid-set-up)
        budget_mod.check_budgets(ctx.cfg, self, ctx)
        self.planner = WidthPlanner(ctx)
        self.global_width = self.planner.width_for(ctx.max_budget_macs())
        self.global_model = self._build(ctx, self.global_width)
        self.groups = channel_groups_of(self.global_model)
        self._sizes: dict[float, dict[str, int]] = {}
        self._macs: dict[float, int] = {}
        self.tier_widths = {t.name: self.width_for(ctx, t.ratio * ctx.plain_macs) for t in ctx.cfg.budget.tiers}
        self._eval_cache: tuple[int, dict[str, nn.Module]] | None = None
        self._round_specs: dict[int, SubmodelSpec] = {}

    def _build(self, ctx: "Context", width: float) -> nn.Module:
        return ctx.build_model(width=width, track_running_stats=self.options.bn == "fedavg")

    def width_for(self, ctx: "Context", budget_macs: float) -> float | None:
        """Largest width (≤ the global width) whose model fits ``budget_macs``; None if none fits."""
        w = self.planner.try_width_for(budget_macs)
        if w is None:
            return None
        w = min(w, self.global_width)
        if self.macs_at(ctx, w) > budget_macs * (1 + 1e-9):
            return None
        return w

    def sizes_at(self, ctx: "Context", width: float) -> dict[str, int]:
        """Channel-group sizes of the zoo model at ``width`` (cached)."""
        if width not in self._sizes:
            m = ctx.build_model(width=width)
            self._sizes[width] = dict(channel_groups_of(m).sizes)
            self._macs[width] = ctx.macs(m)
        return self._sizes[width]

    def macs_at(self, ctx: "Context", width: float) -> int:
        self.sizes_at(ctx, width)
        return self._macs[width]

    # ------------------------------------------------------------------ hooks for subclasses
    def pick(self, ctx: "Context", client: ClientInfo | None) -> Callable[[str, int, int], torch.Tensor] | None:
        """Index chooser for ``client`` (None: prefix). ``client=None`` means deployment/eval."""
        return None

    def client_weight(self, update: ClientResult) -> float:
        if self.options.weighting == "samples":
            return float(update.num_samples)
        return 1.0

    def spec_for(self, ctx: "Context", client: ClientInfo | None, width: float) -> SubmodelSpec:
        return spec_for_sizes(self.groups, self.sizes_at(ctx, width), self.pick(ctx, client))

    # ------------------------------------------------------------------ server: client tasks
    def configure(self, ctx: "Context", clients: list[ClientInfo]) -> list[ClientTask]:
        """Per client: its width (the largest fitting its budget; when none fits, the narrowest
        tier's, recorded as over budget), its channel indices and the sliced global state."""
        assert self.global_model is not None
        state = self.global_model.state_dict()
        self._round_specs = {}
        tasks = []
        for client in clients:
            width = self.width_for(ctx, client.budget_macs)
            over = width is None
            if width is None:  # nothing fits: the narrowest tier's model, recorded as over budget
                fitting = [w for w in self.tier_widths.values() if w is not None]
                width = min(fitting) if fitting else self.global_width
            spec = self.spec_for(ctx, client, width)
            self._round_specs[client.cid] = spec
            payload: dict[str, Any] = {
                "state": extract_state(state, spec),
                "width": width,
                "global_width": self.global_width,
                "over_budget": over,
            }
            if client.budget_after_change is not None:
                # decreasing budgets: the nested prefix the client prunes to (0: nothing fits)
                width2 = self.width_for(ctx, client.budget_after_change)
                payload["width_after_change"] = 0.0 if width2 is None else width2
                if width2 is not None:
                    payload["sizes_after_change"] = dict(self.sizes_at(ctx, width2))
            tasks.append(self.task(ctx, client, payload))
        return tasks

    # ------------------------------------------------------------------ client half
    # Runs on a fresh instance; ``self._client`` is that task's working state.
    def client_model(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None = None) -> nn.Module:
        p = task.payload
        width = float(p["width"])
        model = width_model(ctx, width, self.options.bn == "fedavg")
        model.load_state_dict(p["state"])
        self._client: dict[str, Any] = {
            "width": width,
            "global_width": float(p["global_width"]),
            "macs": ctx.macs(model),
            "over_budget": bool(p["over_budget"]),
        }
        if self.options.mask_classifier:
            self._client["labels"] = torch.as_tensor(ctx.data.client_label_set(task.cid), dtype=torch.long)
        self._client["hooks"] = self._scale(model, width)  # the Scaler is on while the model trains
        return model

    def local_plan(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> LocalPlan | None:
        """The configured SGD with the method's clipping and masked loss, when the client trains
        one model all round (no budget drop that prunes it mid-way) and the method's clipping is
        the only one (both clip one by one)."""
        opts, sgd = self.options, ctx.configured_sgd()
        after = task.budget_after_change
        if not (after is None or ctx.cfg.train.local_epochs <= _CHANGE_AT
                or ctx.macs(width_model(ctx, float(task.payload["width"]), opts.bn == "fedavg")) <= after * (1 + 1e-9)):
            return None
        if opts.clip_grad is not None and sgd.clip is not None:
            return None
        labels = tuple(int(v) for v in ctx.data.client_label_set(task.cid)) if opts.mask_classifier else None
        return LocalPlan(replace(sgd, clip=opts.clip_grad if opts.clip_grad is not None else sgd.clip, classes=labels,
                                 class_fill=float(opts.mask_fill)))

    def _scale(self, model: nn.Module, width: float) -> list[Any]:
        return attach_scaler(model, width / self._client["global_width"]) if self.options.scaler else []

    def local_train(self, ctx: "ClientContext", client: ClientTask, model: nn.Module, plan: LocalPlan | None) -> dict[str, Any]:
        info = self._client
        opts = self.options
        loss_fn = None
        if opts.mask_classifier:
            loss_fn = masked_cross_entropy(info["labels"], ctx.num_classes, opts.mask_fill)
        clip = opts.clip_grad

        def after_backward(m: nn.Module) -> None:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)

        epochs = ctx.cfg.train.local_epochs
        hooks = info.pop("hooks")  # attached by client_model
        change_at = _CHANGE_AT
        after = client.budget_after_change
        if after is None or epochs <= change_at or info["macs"] <= after * (1 + 1e-9):
            res = ctx.train(model, client, epochs, after_backward=after_backward, loss_fn=loss_fn)
            for h in hooks:
                h.remove()
            info["model"] = model
            return res
        # decreasing budget: train two epochs, then prune to the nested prefix that fits
        res = ctx.train(model, client, change_at, after_backward=after_backward, loss_fn=loss_fn)
        for h in hooks:
            h.remove()
        width2 = float(client.payload.get("width_after_change", 0.0))
        if not width2:  # nothing fits the new budget: stop local training here
            info["model"] = model
            info["stopped_early"] = True
            return res
        child = spec_for_sizes(channel_groups_of(model), client.payload["sizes_after_change"])
        model2 = submodel_from(model, child)
        info["width_after_change"] = width2
        info["macs_after_change"] = ctx.macs(model2)
        hooks = self._scale(model2, width2)
        res2 = ctx.train(
            model2, client, epochs - change_at, after_backward=after_backward, loss_fn=loss_fn,
            first_epoch=change_at,
        )
        for h in hooks:
            h.remove()
        info["model"] = model2
        res2["steps"] = int(res.get("steps", 0)) + int(res2.get("steps", 0))
        return res2

    def upload(
        self, ctx: "ClientContext", client: ClientTask, model: nn.Module, result: dict[str, Any]
    ) -> ClientResult:
        info = self._client
        trained = info.get("model", model)  # a cohort trained the model it hands in
        state = {k: v.detach().clone() for k, v in trained.state_dict().items()}
        metrics: dict[str, Any] = dict(result)
        metrics["width"] = info["width"]
        metrics["rate"] = info["width"] / info["global_width"]
        if info["over_budget"]:
            metrics["over_budget"] = True
        for key in ("width_after_change", "macs_after_change", "stopped_early"):
            if key in info:
                metrics[key] = info[key]
        if client.budget_after_change is not None:
            final_macs = info.get("macs_after_change", info["macs"])
            metrics["fits_after_change"] = bool(
                info.get("stopped_early", False) or final_macs <= client.budget_after_change * (1 + 1e-9)
            )
        payload: dict[str, Any] = {"width": info["width"]}
        if "labels" in info:
            payload["labels"] = info["labels"]
        if "width_after_change" in info:
            payload["width_after_change"] = info["width_after_change"]
        # bytes up: the sub-model only (the label set in the payload is not counted)
        return ClientResult.of(
            client, state, macs=info["macs"], payload=payload, metrics=metrics, bytes_up=state_bytes(state)
        )

    # ------------------------------------------------------------------ server
    def result_spec(self, ctx: "Context", update: ClientResult) -> SubmodelSpec:
        """Channel indices of an upload: the client's own (``update.spec``) when it sent one, else
        the spec sent this round, composed with the nested prefix the client pruned to when its
        budget dropped during local training."""
        if update.spec is not None:
            return update.spec
        spec = self._round_specs[update.cid]
        width2 = update.payload.get("width_after_change")
        if width2:
            sub = width_model(ctx, float(update.payload["width"]), self.options.bn == "fedavg")
            sub_groups = channel_groups_of(sub)
            spec = spec.compose(spec_for_sizes(sub_groups, self.sizes_at(ctx, float(width2))))
        return spec

    def aggregate(self, ctx: "Context", updates: list[ClientResult]) -> None:
        """Masked per-element mean over the clients that trained each coordinate."""
        assert self.global_model is not None
        if not updates:
            return
        agg = SubmodelAggregator(self.global_model.state_dict())
        for u in sorted(updates, key=lambda u: u.cid):
            labels = u.payload.get("labels") if self.options.mask_classifier else None
            agg.add(u.state, self.result_spec(ctx, u), self.client_weight(u), labels=labels)
        self.global_model.load_state_dict(agg.result())
        self._eval_cache = None

    # ------------------------------------------------------------------ evaluation
    def deploy(self, ctx: "Context", width: float) -> nn.Module:
        """The evaluated model at ``width``: the prefix slice of the global model with BN handled
        by the configured policy."""
        assert self.global_model is not None
        spec = spec_for_sizes(self.groups, self.sizes_at(ctx, width))
        state = extract_state(self.global_model.state_dict(), spec)
        return static_bn_model(ctx, width, state, policy=self.options.bn, batch_size=self.options.sbn_batch_size)

    def eval_models(self, ctx: "Context") -> dict[str, nn.Module]:
        if self._eval_cache is not None and self._eval_cache[0] == ctx.round:
            return self._eval_cache[1]
        by_width: dict[float, nn.Module] = {}
        with ctx.timer("sbn" if self.options.bn == "sbn_central" else "deploy"):
            by_width[self.global_width] = self.deploy(ctx, self.global_width)
            out: dict[str, nn.Module] = {"global": by_width[self.global_width]}
            for tier, width in self.tier_widths.items():
                if width is None:
                    continue
                if width not in by_width:
                    by_width[width] = self.deploy(ctx, width)
                out[f"tier:{tier}"] = by_width[width]
        self._eval_cache = (ctx.round, out)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._eval_cache = None


class HeteroFL(WidthSlicedAlgorithm):
    """HeteroFL: nested prefix sub-models, masked per-element averaging, static BN and Scaler."""

    name = "heterofl"
    summary = (
        "Each client trains the nested prefix sub-model of a widened global model that fits its FLOPs budget;"
        " every weight is averaged over the clients that trained it."
    )
    paper = "Diao, Ding, Tarokh; ICLR 2021"
    Options = HeteroFLOptions
