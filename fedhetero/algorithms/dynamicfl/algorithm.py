"""DynamicFL by structural re-parameterization (Algorithm 1 of "Everyone Counts: Fair and
Accurate Heterogeneous Federated Learning with Resource-Adaptive Model Modulation").

The server holds a **plain** global model ω_g (every conv+BN folded into one biased conv). A client
with a FLOPs budget of ``r`` × the plain model trains a multi-branch model that computes exactly the
global function when it starts, modulates its structure with gradient saliency, and uploads the
merged plain weights:

1. first time sampled: ζ ← REP(ω_g) — expand "bottom to up" to the budget (Eq. 2); train E epochs,
   S_l ← saliency of the last epoch;
2. budget below the stored structure's cost: ζ ← REP(ω_g, S_l) — fold the lowest-S_l branches
   until it fits (Eq. 9), re-solve to equal ω_g; train E epochs;
3. otherwise ε ← REP(ω_g, ζ) — keep the stored structure and branch statistics, re-solve each
   block's main branch so the block equals ω_g's conv exactly (Eq. 4; each main-branch filter keeps
   its norm and its BN's γ takes the global kernel's scale, ``rep_scale``); train one epoch recording
   S_g; ζ ← DYMM(ε; S_g, S_l) within the budget (Eqs. 12–16); train E−1 epochs, S_l ← saliency of
   the last (the meter records only the epochs whose values are read);
4. merge ζ into the plain structure (Eq. 10) and upload; the server averages plain tensors (Eq. 11).

Dynamic budgets: when the engine announces a changed budget (after the second local epoch), the
client adapts on the spot — folding the lowest-saliency branches to shrink, adding branches to
grow — both function-preserving in eval mode.

With ``global_form: host`` the global model keeps the model's BatchNorms instead: main branches
adopt the global BN, uploads are merged back into the host layout, and the server averages convs
and BNs (DynamicFL at 1× is then FedAvg).

Budget planning (the first-round plan and the knapsack fills) lives in :mod:`reparam.planning`.
With ``grow_mode: nested`` the planners and DYMM may also grow branches inside a branch's K×K conv
(nested blocks), exact like every other growth, so high tiers use their budget once the flat
branch set is exhausted.

Clients with a budget below the plain model (``r < 1``) train a structurally pruned sub-model
chosen by HRank ranks or filter magnitude; their update is scattered back by channel index and
averaged per element with the clients that trained each weight.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generator, Literal, Mapping, Sequence

import torch
from torch import nn

import reparam
from fedhetero.algorithms.pruning.rates import kept_count
from fedhetero.algorithms.pruning.surgery import ChannelMacs, plan_for_budget, prunable_groups
from fedhetero.core.exchange.aggregation import weighted_average
from fedhetero.core.method.algorithm import Algorithm
from fedhetero.core.common.options import OPTIONS_PATH, MethodOptions, option, require
from fedhetero.core.hetero.submodel import SubmodelAggregator, SubmodelSpec, submodel_from
from fedhetero.core.exchange.types import ClientResult, ClientTask, state_bytes
from fedhetero.core.local.segments import LocalSegment, SegmentRule, Segments, run_segments
from reparam.changes import StructureChange, apply_to_optimizer
from reparam.dymm import dymm, shrink_to_budget
from reparam.invariants import anchor_filter_norms, check_anchor_scale, check_gradients, check_optimizer, check_same_function
from reparam.kinds import anchor_name, get_kind, kind_names
from reparam.planning import expandable_convs, fill_to_budget, first_plan, grow_to_budget
from reparam.saliency import SaliencyMeter

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import ClientContext, Context, RunContext

__all__ = ["DynamicFL", "DynamicFLOptions"]


@dataclass(frozen=True)
class DynamicFLOptions(MethodOptions):
    # "batchnorm": the anchor BN of a wrapped plain conv starts at γ=1, β=0, μ=0, v=1−ε (eval-exact;
    # trains with normalised activations). Measured on digits (LeNet-5, 20 rounds, 2 seeds) it beats
    # the "calibrated" set-up (BN statistics taken from a few client batches, so train mode starts
    # at the plain conv's scale) by 5–7 points at β = 0.1, 0.5 and 5; see CHANGELOG.
    anchor_norm: Literal["calibrated", "frozen_identity", "batchnorm"] = "batchnorm"
    calibration_batches: int = option(4, ge=1)
    # a returning client's anchor BN: "private" keeps the BN statistics (and γ, β) it trained with
    # in its private state and re-solves the anchor conv around them; "reset" starts the anchor BN
    # from γ=1, β=0, μ=0, v=1−ε every round (as on a client's first round)
    bn_stats: Literal["private", "reset"] = "private"
    # with ``bn_stats: private``, where REP puts a change of the global kernel's scale: "gamma" into
    # the anchor BN's γ (each anchor conv filter keeps its norm, consistent with the kept running
    # variance); "weights" into the anchor conv's weights (γ kept); "calibrated": as "gamma", then
    # the anchor BN's running statistics are measured on ``calibration_batches`` of the client's
    # data and the anchor re-solved (eval-exact), so training mode starts from the global function.
    # With kept statistics a client's training-mode output is the global one scaled by the ratio of
    # its old statistics to those of the new weights, and that ratio compounds over rounds:
    # "weights" overflowed float32 at round 176 of 200 (Fashion-MNIST, LeNet-5, 3 epochs), "gamma"
    # grew conv2's γ from ~1 to ~14 between rounds 120 and 150 of the same run. "calibrated" is
    # the default (with ``block_step: mean``): chosen on the validation split at the paper's
    # protocol, where "gamma" with "sum" collapsed to chance at two of three β
    rep_scale: Literal["gamma", "weights", "calibrated"] = "calibrated"
    # the global model's form: "plain" (Algorithm 1: every conv+BN folded into one biased conv; a
    # client re-inserts a BN of its own) or "host" (the model as built, BatchNorms kept: a client's
    # main branch adopts the global BN's γ, β and statistics, the client uploads its model merged
    # back into the host layout, and the server averages convs and BNs as FedAvg does; at 1× this
    # is FedAvg). With "host", bn_stats and rep_scale do not apply
    global_form: Literal["plain", "host"] = "plain"
    # with ``global_form: host``, what a client uploads for a conv+BN that took other branches in
    # the merge. "calibrated": each of its filters is scaled to the norm of the global filter it
    # started from times the factor by which local training's steps changed the client's anchor
    # filter (as a FedAvg client's filter changes), and the BN's statistics are measured on
    # ``calibration_batches`` of the client's data with γ, β re-solved (the eval function does not
    # change; training mode then starts from it). "global": the same scaling, the statistics
    # scaled along. "merged": the merged layers as they are. The merge writes the other branches
    # into the conv in units of its running deviation, so with "merged" the conv's scale and that
    # deviation grow together round after round (overflow at round 178 of 200, Fashion-MNIST,
    # LeNet-5, 3 epochs). Pinning each filter to the global filter's norm without the training
    # factor collapsed the same run by round 20: averaging shrinks the norms, nothing grows them,
    # and behind a BatchNorm a shrinking filter trains at a growing effective learning rate
    host_scale: Literal["calibrated", "global", "merged"] = "calibrated"
    # a returning client's stored branches (besides the anchor): "keep" (Algorithm 1: their trained
    # parameters and statistics; the anchor is re-solved to make up the difference to ω_g) or
    # "reset": each restarts from a zero output (its last BN's γ = β = 0, as a newly grown branch)
    # while the structure and S_l stay, so the anchor carries ω_g alone and nothing cancels it
    stored_branches: Literal["keep", "reset"] = "keep"
    # how far a block's SGD step moves its merged kernel. "sum" (Algorithm 1; DBB training): every
    # branch takes the full step, so a block of B branches moves its merged kernel by the sum of
    # the branches' steps, about B times the anchor's alone. "mean": each parameter's loss gradient
    # inside a block is divided by the block's branch count (times that of any block it is nested
    # in; reparam.branch_step_scales), so the merged kernel moves by the mean of the branches'
    # steps; weight decay is not scaled, and a block of the anchor alone trains as before (1x is
    # unchanged). With rep_scale "calibrated" it removes the late dips at the paper's length, and
    # on its validation split it is the better form on every seed, while "sum" with "gamma"
    # collapsed to chance at beta 0.1 and 5; so "mean" is the default. On short runs the larger
    # steps of "sum" can score higher (the digits default job; docs/results.md has the numbers)
    block_step: Literal["sum", "mean"] = "mean"
    # "random": scores drawn at random (seeded per round and client): the structure without saliency
    saliency: Literal["synflow", "snip", "grad_norm", "random"] = "synflow"
    saliency_params: Literal["all", "conv_weights"] = "all"
    use_abs: bool = True
    small_q: float = option(0.3, ge=0, le=1, note="a quantile")
    large_q: float = option(0.7, ge=0, le=1, note="a quantile")
    max_new_per_round: int | None = option(None, ge=0)
    init: Literal["zero_gamma", "random_resolve"] = "zero_gamma"
    first_plan: Literal["bottom_up", "saliency"] = "bottom_up"
    sub_model_criterion: Literal["hrank", "magnitude"] = "hrank"
    fill_budget: bool = True  # after DYMM / in the first plan, grow branches into unused budget
    # "nested": planners and DYMM may also grow branches inside a branch's K×K conv (exact), so a
    # tier whose flat branch set is exhausted (LeNet-5 at 3×) still uses its budget; "block": only
    # the host convs' own branch kinds (LeNet-5's 3× tier then trains about 0.8 of its budget)
    grow_mode: Literal["block", "nested"] = "nested"
    # branch kinds the client models may use besides the anchor (null: every registered kind)
    branches: tuple[str, ...] | None = option(None, choices=kind_names)
    # check the structural invariants in every task and stop it with an InvariantError (an internal
    # error) when one fails: after every structural change the optimizer holds exactly the model's
    # trainable parameters, the first step after it gives each of them a gradient, the client model
    # starts equal to the global model and uploads what it trained (eval mode, to the dtype's
    # tolerance), and REP grows no anchor conv filter (``rep_scale: gamma`` or ``calibrated``); the two function
    # errors are recorded per client (costs two forwards and a copy)
    verify: bool = False

    #: the defaults before the form chosen at the paper's protocol became the default
    earlier_defaults: ClassVar[Mapping[str, Any]] = {"rep_scale": "gamma", "block_step": "sum"}

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.small_q <= self.large_q,
            f"{OPTIONS_PATH}.small_q",
            f"must be <= large_q={self.large_q}, got {self.small_q}",
        )
        require(
            self.branches is None or any(not get_kind(k).anchor for k in self.branches),
            f"{OPTIONS_PATH}.branches",
            f"must name at least one branch kind besides the anchor, got {list(self.branches or ())}",
        )


@dataclass
class _Task:
    """One client task's working state, from REP to the upload (made by
    :meth:`DynamicFL.client_update` and handed to each of its steps)."""

    ctx: ClientContext
    task: ClientTask
    plain: nn.Module  # ω_g in the plain architecture
    mode: str = "first"  # "first", "shrink", "dymm" or "pruned" (Algorithm 1's cases)
    s_local: dict[tuple[str, str], float] = field(default_factory=dict)  # S_l by (block path, branch)
    spec: SubmodelSpec | None = None  # the pruned sub-model's channels (mode "pruned")
    budget: float = 0.0  # the budget the client trains within (it may change mid-round)
    model: nn.Module | None = None  # the model being trained (local training may replace it)
    verify_in: float | None = None  # with ``verify``: function error after REP
    meters: int = 0  # saliency meters made so far (each draws its own stream with ``saliency: random``)
    # host form: by block path, the factor by which local training's steps changed each anchor
    # filter's norm (the product over the segments between structural changes); NaN for a block
    # that changed shape (a switch to a pruned sub-model); None before the first segment
    growth: dict[str, torch.Tensor] | None = None


def _skey(key: tuple[str, str]) -> str:
    return f"{key[0]}|{key[1]}"


def _unskey(key: str) -> tuple[str, str]:
    path, name = key.rsplit("|", 1)
    return path, name


def _global_architecture(ctx, form: str = "plain") -> nn.Module:
    """A copy of the global model's architecture, from a per-process template: ``"plain"`` (every
    conv+BN folded into one biased conv) or ``"host"`` (the configured model as built)."""

    def make() -> nn.Module:
        model = ctx.build_model()
        model.eval()
        return model if form == "host" else reparam.merge(model, target="deploy")

    return ctx.template(f"dynamicfl-{form}", make)


def _input_sizes(ctx, plain: nn.Module) -> dict:
    """Conv input sizes of the architecture (they do not depend on the branches; cached)."""
    if "dynamicfl-sizes" not in ctx.cache:
        ctx.cache["dynamicfl-sizes"] = reparam.flops.input_sizes(plain, ctx.input_shape)
    return ctx.cache["dynamicfl-sizes"]


def _smallest_pruned_macs(ctx) -> float:
    """MACs of the smallest sub-model :func:`~fedhetero.algorithms.pruning.surgery.plan_for_budget` can give
    the plain architecture with DynamicFL's settings (policy ``block_internal_only``, convs only,
    at least one channel per group, no rounding); the plain model's MACs when nothing can be
    pruned. Cached per process (it depends on the architecture only)."""
    key = "dynamicfl-min-macs"
    if key not in ctx.cache:
        # the architecture only, built apart: the per-process template holds the initial global
        # weights, drawn in set-up from the run's seeded stream (this may run before it)
        plain = reparam.merge(ctx.build_model().eval(), target="deploy")
        cm = ChannelMacs(plain, ctx.input_shape)
        groups = prunable_groups(plain, "block_internal_only")
        sizes = cm.groups.sizes
        ctx.cache[key] = float(cm.macs({g: kept_count(int(sizes[g]), 1.0) for g in groups}))
    return float(ctx.cache[key])


class DynamicFL(Algorithm):
    """DynamicFL: FLOPs-budgeted clients grown by lossless re-parameterization, plain global model."""

    name = "dynamicfl"
    summary = (
        "Clients train models grown above (or pruned below) the plain global model to fit their FLOPs budgets"
        " by lossless re-parameterization, merged back for averaging."
    )
    paper = (
        "\"Everyone Counts: Fair and Accurate Heterogeneous Federated Learning with Resource-Adaptive Model "
        "Modulation\" (anonymous, under review), Algorithm 1"
    )
    Options = DynamicFLOptions
    adapts_to = frozenset({"static", "increasing", "decreasing", "random"})
    supports_submodels = True

    # ------------------------------------------------------------------ budgets
    def min_budget_macs(self, ctx: RunContext) -> float | None:
        """A client below the plain model trains a pruned sub-model (:meth:`_pruned`, and
        :meth:`_to_pruned` when its budget falls mid-round): the smallest plan
        :func:`~fedhetero.algorithms.pruning.surgery.plan_for_budget` allows keeps one channel of every group
        it may prune (``block_internal_only``: residual groups stay whole). Its MACs are the floor;
        a lower budget would stop every such client with a ``BudgetError``."""
        return _smallest_pruned_macs(ctx)

    # ------------------------------------------------------------------ server
    def setup(self, ctx: Context) -> None:
        self.global_model = _global_architecture(ctx, self.options.global_form)

    # ------------------------------------------------------------------ client
    # One task's working state lives in a :class:`_Task` made by :meth:`client_update` and passed
    # to the steps below; nothing of a task is kept on the instance. What depends on the
    # architecture only (plain template, first-round plans, conv input sizes) is cached in the
    # client context, once per process.
    def client_update(self, ctx: ClientContext, task: ClientTask, state: dict[str, Any] | None) -> ClientResult:
        """REP (or a pruned sub-model), Algorithm 1's local epochs, then the merged upload: the
        segments of :meth:`local_segments`, trained one after another."""
        return run_segments(ctx, task, self._segments(ctx, task, state))

    def local_plan(self, ctx: ClientContext, task: ClientTask, state: dict[str, Any] | None) -> None:
        """None: the structure changes between epochs (DYMM), so no single plan states the local
        training; :meth:`local_segments` does."""
        return None

    def local_segments(self, ctx: ClientContext, task: ClientTask, state: dict[str, Any] | None) -> Segments | None:
        """REP, Algorithm 1's epochs as segments split where the structure may change (after DYMM's
        global epoch, after the second epoch when the budget changes), and the merged upload.
        Coinciding segments of a round's clients (the same structure, the same epochs) train as one
        batched cohort, the saliency meter and the blocks' step scaling applied to the stacked
        gradients (:meth:`_cohort_rule`); with ``verify`` or ``saliency: random`` every segment
        trains alone (the checks and the random values are per model)."""
        return self._segments(ctx, task, state)

    def _segments(self, ctx: ClientContext, task: ClientTask, state: dict[str, Any] | None) -> Segments:
        run = self._task(ctx, task)
        model = self._client_model(run, state)
        report = yield from self._local_train(run, model)
        return self._upload(run, report)

    def client_model(self, ctx: ClientContext, task: ClientTask, state: dict[str, Any] | None = None) -> nn.Module:
        """The model this client would train on ``task`` from its private ``state`` (what
        :meth:`client_update` starts local training from)."""
        return self._client_model(self._task(ctx, task), state)

    def _task(self, ctx: ClientContext, task: ClientTask) -> _Task:
        """A task's working state, holding the global model the server sent (in its form)."""
        run = _Task(ctx, task, _global_architecture(ctx, self.options.global_form))
        run.plain.load_state_dict(task.payload["state"])
        return run

    def _calibration(self, run: _Task) -> torch.Tensor | None:
        """The input a new anchor BN takes its statistics from (``anchor_norm: calibrated`` only:
        ``calibration_batches`` batches of the client's data); None otherwise."""
        if self.options.anchor_norm != "calibrated":
            return None
        return self._own_batches(run)

    def _own_batches(self, run: _Task) -> torch.Tensor:
        """``calibration_batches`` batches of the client's own data, as one tensor."""
        xs = []
        for x, _ in run.ctx.client_batches(run.task.cid, epoch=10_000):
            xs.append(x)
            if len(xs) >= self.options.calibration_batches:
                break
        return torch.cat(xs).to(run.ctx.device, run.ctx.dtype)

    def _expand_first(self, run: _Task) -> nn.Module:
        ctx, budget = run.ctx, run.task.budget_macs
        plain = copy.deepcopy(run.plain)
        kinds = self.options.branches
        key = ("dynamicfl-plan", round(float(budget), 3), self.options.fill_budget, tuple(kinds or ()))
        if key not in ctx.cache:
            ctx.cache[key] = first_plan(plain, budget, ctx.input_shape, fill=self.options.fill_budget, kinds=kinds)
        plan = ctx.cache[key]
        calib = self._calibration(run)
        with ctx.timer("rep"):
            model = reparam.expand(
                plain,
                plan=plan,
                inplace=True,
                anchor_norm=self.options.anchor_norm,
                calibration_input=calib,
                init=self.options.init,
            )
        if self.options.fill_budget and self.options.grow_mode == "nested":
            # a plan cannot hold nested blocks: grow them into what the flat plan left unused
            with ctx.timer("rep"):
                fill_to_budget(
                    model, budget, ctx.input_shape, init=self.options.init,
                    sizes=_input_sizes(ctx, run.plain), grow_mode="nested", kinds=kinds,
                )
        return model

    def _restore(self, run: _Task, stored: dict[str, Any]) -> nn.Module:
        model = reparam.build(copy.deepcopy(run.plain), stored["structure"])
        model.load_state_dict(stored["state"], strict=True)
        return model

    def _pruned(self, run: _Task) -> nn.Module:
        """A budget below the plain model: a structurally pruned sub-model of ω_g (HRank ranks of
        the client's own data, or filter magnitude), trained with BN on every conv."""
        ctx = run.ctx
        crit = self.options.sub_model_criterion
        batches = None
        if crit == "hrank":
            batches = [x.to(ctx.device, ctx.dtype) for x, _ in ctx.client_batches(run.task.cid, epoch=10_002, batch_size=100)][:2]
        with ctx.timer("prune"):
            run.spec = plan_for_budget(run.plain, ctx.input_shape, run.task.budget_macs, criterion=crit, batches=batches)
            sub = submodel_from(run.plain, run.spec)
        calib = self._calibration(run)
        plan = {path: ("kxk",) for path, _ in expandable_convs(sub)}
        with ctx.timer("rep"):
            return reparam.expand(sub, plan=plan, inplace=True, anchor_norm=self.options.anchor_norm, calibration_input=calib)

    def _client_model(self, run: _Task, stored: dict[str, Any] | None) -> nn.Module:
        """The model the client trains: a pruned sub-model below the plain model's budget, else ζ
        (first round: REP(ω_g); later: the stored structure, shrunk to the budget when needed,
        re-solved to equal ω_g)."""
        ctx, budget = run.ctx, run.task.budget_macs
        if budget < ctx.plain_macs * (1 - 1e-9):
            run.mode = "pruned"
            model = self._pruned(run)
            model.train()
            return model
        if stored is None:
            run.mode = "first"
            model = self._expand_first(run)
        else:
            run.s_local = {_unskey(k): float(v) for k, v in stored["s_local"].items()}
            model = self._restore(run, stored)
            if ctx.macs(model) > budget:
                run.mode = "shrink"
                with ctx.timer("dymm"):
                    shrink_to_budget(model, run.s_local, budget, ctx.input_shape)
            else:
                run.mode = "dymm"
            if self.options.stored_branches == "reset":
                self._reset_branches(model)
            stats = self._rep_anchor_stats()
            norms = anchor_filter_norms(model) if self.options.verify and stats == "rescale" else None
            with ctx.timer("rep"):
                model.eval()
                reparam.rep_to_local(run.plain, model, anchor_stats=stats)
            if norms is not None:  # invariant 5: REP did not grow the anchor convs
                check_anchor_scale(norms, model, where=f"by REP ({run.mode})")
            if stats == "rescale" and self.options.rep_scale == "calibrated":
                with ctx.timer("rep"):
                    reparam.calibrate_anchors(model, self._own_batches(run), source=run.plain)
        model.train()
        if self.options.verify:
            run.verify_in = self._check(run, model, run.plain, f"after REP ({run.mode}): client model vs global model")
        return model

    def _anchor_norms(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Anchor filter norms by block path where the host-form upload scales by them, else None."""
        if self.options.global_form != "host" or self.options.host_scale == "merged":
            return None
        return anchor_filter_norms(model)

    @staticmethod
    def _record_growth(run: _Task, before: dict[str, torch.Tensor] | None, after: dict[str, torch.Tensor] | None) -> None:
        """Compose into ``run.growth`` how one training segment changed each anchor filter's norm."""
        if before is None or after is None:
            return
        growth = run.growth if run.growth is not None else {}
        for path, n0 in before.items():
            n1 = after.get(path)
            if n1 is None or n1.shape != n0.shape or (path in growth and growth[path].shape != n0.shape):
                growth[path] = torch.full_like(n0, float("nan"))  # changed shape: no factor
                continue
            g = torch.where(n0 > 0, n1 / n0.clamp_min(torch.finfo(n0.dtype).tiny), torch.ones_like(n0))
            growth[path] = growth[path] * g if path in growth else g
        run.growth = growth

    def _host_targets(self, run: _Task, model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """With ``host_scale`` other than ``merged``: what each host conv that takes other branches
        in the merge is scaled to (the global filter it started from, times its anchor's training
        factor ``run.growth``; by ``<conv path>.weight``) and its BN path; a block of the anchor
        alone uploads what it trained, so that DynamicFL at 1× stays FedAvg."""
        targets: dict[str, torch.Tensor] = {}
        pairs: dict[str, str] = {}
        if self.options.global_form != "host" or self.options.host_scale == "merged" or not run.growth:
            return targets, pairs
        start = submodel_from(run.plain, run.spec) if run.spec is not None and run.mode == "pruned" else run.plain
        sd = start.state_dict()
        for path, blk in reparam.iter_blocks(model):
            conv, g = blk.host_path or path, run.growth.get(path)
            w = sd.get(conv + ".weight")
            if not blk.bn_path or g is None or w is None or g.numel() != w.shape[0] or not bool(torch.isfinite(g).all()):
                continue
            if len(blk.branch_names) > 1 or blk.nested_block(anchor_name()) is not None:
                targets[conv + ".weight"] = w.detach().to(torch.float64) * g.to(w.device).view(-1, *([1] * (w.dim() - 1)))
                pairs[conv] = blk.bn_path
        return targets, pairs

    @staticmethod
    def _reset_branches(model: nn.Module) -> None:
        """``stored_branches: reset``: every non-anchor branch of the outermost blocks outputs 0
        (its last BN's γ = β = 0), in train and eval mode alike; REP then re-solves the anchor."""
        with torch.no_grad():
            for _, blk in reparam.iter_blocks(model):  # the outermost blocks
                for name in blk.branch_names:
                    if name != anchor_name():
                        last: Any = blk.branches[name].last_bn
                        last.weight.zero_()
                        last.bias.zero_()

    def _merge_target(self) -> str:
        """The layout a client merges its model into for the upload (the global model's form)."""
        return "host" if self.options.global_form == "host" else "deploy"

    def _rep_anchor_stats(self) -> str:
        """What REP does with a returning client's anchor BatchNorm (``global_form``, ``bn_stats``,
        ``rep_scale``): with a host-form global model the anchor adopts the global BN."""
        if self.options.global_form == "host":
            return "adopt"
        if self.options.bn_stats == "reset":
            return "identity"
        return "keep" if self.options.rep_scale == "weights" else "rescale"

    def _check(self, run: _Task, a: nn.Module, b: nn.Module, where: str) -> float:
        """Invariants 3 and 4: ``a`` computes ``b``'s function in eval mode on a batch of the
        client's data, to the tolerance of the run's dtype (on copies; raises InvariantError)."""
        ctx = run.ctx
        x = next(iter(ctx.client_batches(run.task.cid, epoch=10_001)))[0].to(ctx.device, ctx.dtype)
        return float(check_same_function(a, b, x, where=where))

    def _verify_optimizer(self, model: nn.Module, opt: torch.optim.Optimizer, where: str) -> None:
        """Invariant 1 (with ``verify``): the optimizer holds exactly the model's trainable parameters."""
        if self.options.verify:
            check_optimizer(model, opt, where=where)

    def _apply(self, model: nn.Module, opt: torch.optim.Optimizer, change: StructureChange, where: str) -> None:
        """Bring ``opt`` up to date with a structural change of ``model`` (and check it)."""
        apply_to_optimizer(opt, change)
        self._verify_optimizer(model, opt, where)

    def _meter(self, run: _Task, model: nn.Module) -> SaliencyMeter:
        gen = None
        if self.options.saliency == "random":
            run.meters += 1  # a fresh stream per meter of the task
            gen = run.ctx.torch_generator("algorithm", int(run.task.round), int(run.task.cid), run.meters)
        return SaliencyMeter(model, metric=self.options.saliency, params=self.options.saliency_params, generator=gen)

    def _to_pruned(self, run: _Task, model: nn.Module, budget: float) -> nn.Module:
        """Switch mid-round to a pruned sub-model when the budget falls below the plain model:
        merge the current model (eval-exact), prune it by filter magnitude to the budget and wrap it
        with BN again. The spec stays relative to the global model (composed with an earlier one)."""
        ctx = run.ctx
        model.eval()
        plain = reparam.merge(model, target=self._merge_target())
        with ctx.timer("prune"):
            spec = plan_for_budget(plain, ctx.input_shape, budget, criterion="magnitude")
            sub = submodel_from(plain, spec)
        run.spec = spec if run.spec is None else run.spec.compose(spec)
        plan = {path: ("kxk",) for path, _ in expandable_convs(sub)}
        calib = self._calibration(run)
        with ctx.timer("rep"):
            new = reparam.expand(sub, plan=plan, inplace=True, anchor_norm=self.options.anchor_norm, calibration_input=calib)
        new.train()
        run.mode = "pruned"
        return new

    def _adapt_budget(
        self, run: _Task, model: nn.Module, meter: SaliencyMeter, opt: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Follow a changed budget on the spot (after the second local epoch): shrink by folding
        the lowest-saliency branches, grow by adding branches (both eval-exact), or switch to a
        pruned sub-model when the budget falls below the plain model. Returns (model, optimizer)."""
        ctx = run.ctx
        assert run.task.budget_after_change is not None
        new_budget = float(run.task.budget_after_change)
        run.budget = new_budget
        scores = meter.values() or run.s_local
        current = ctx.macs(model)
        anchors_only = ctx.macs(reparam.merge(model.eval(), target="deploy"))
        model.train()
        if new_budget < anchors_only * (1 - 1e-9):
            new = self._to_pruned(run, model, new_budget)
            new_opt = ctx.make_optimizer(new)
            self._verify_optimizer(new, new_opt, "the switch to a pruned sub-model")
            return new, new_opt
        with ctx.timer("dymm"):
            model.eval()
            change: StructureChange
            if current > new_budget:
                change = shrink_to_budget(model, scores, new_budget, ctx.input_shape).change
            else:
                change = grow_to_budget(
                    model, scores, new_budget, ctx.input_shape, init=self.options.init, grow_mode=self.options.grow_mode,
                    kinds=self.options.branches,
                )
            model.train()
        self._apply(model, opt, change, "the budget change")
        return model, opt

    def _step_scales(self, model: nn.Module) -> list[tuple[nn.Parameter, float]]:
        """With ``block_step: mean``, each block parameter and the factor its loss gradient takes."""
        if self.options.block_step != "mean":
            return []
        scales = reparam.branch_step_scales(model)
        return [(p, scales[name]) for name, p in model.named_parameters() if name in scales]

    @staticmethod
    def _read(epoch: int, last: int, epochs: int) -> bool:
        """Whether the saliency of ``epoch`` (of ``epochs``, in a segment ending at ``last``) is
        read: S_l is the last epoch's, and a segment's last epoch gives what the caller reads next
        (S_g after the global epoch; the scores a budget change folds or grows by). Any other
        epoch's values are reset at its end."""
        return epoch >= epochs - 1 or epoch >= last - 1

    def _records(self, epoch: int, last: int, epochs: int) -> bool:
        """Whether the saliency meter records the steps of ``epoch``: only where they are read
        (:meth:`_read`; the same values, the meter's work on the other epochs saved). ``random``
        records every step (its draws are a stream: skipping some would change the later ones)."""
        return self.options.saliency == "random" or self._read(epoch, last, epochs)

    def _scale_groups(self, model: nn.Module) -> dict[float, list[nn.Parameter]]:
        """The parameters of each step scale (:meth:`_step_scales`), so that a step scales each
        group's gradients at once."""
        groups: dict[float, list[nn.Parameter]] = {}
        for p, scale in self._step_scales(model):
            groups.setdefault(scale, []).append(p)
        return groups

    def _cohort_rule(self, segments: Sequence[LocalSegment], epochs: int) -> SegmentRule | None:
        """What each segment's ``after_backward`` does (the saliency meter reads the loss
        gradients, then the blocks' step scaling), for a cohort of clients of one structure: the
        meter's values per client from the stacked gradients and parameters
        (:meth:`SaliencyMeter.stacked_values <reparam.saliency.SaliencyMeter.stacked_values>`, an
        identity-based 1×1 stage at its effective weight ``R + I``), summed over an epoch's steps
        and handed to each client's meter at the epoch's end, in the epochs the meter records
        (:meth:`_records`; the cohort's segments share their epochs, ``epochs`` of the round); the
        step scales multiply the stacked gradients."""
        meters: list[SaliencyMeter] = [s.own for s in segments]
        epoch, last = [segments[0].first], segments[0].last  # the epoch the cohort trains now
        model = segments[0].model
        names = {p: n for n, p in model.named_parameters()}
        tracked = meters[0].tracked()
        flat: list[tuple[str, torch.Tensor | None]] = []  # the tracked parameters, in the meter's order
        for _key, items in tracked:
            for p, effective in items:
                if p not in names:
                    return None
                offset = None
                if effective is not None:
                    with torch.no_grad():
                        offset = (effective() - p).detach()  # the identity of R + I
                flat.append((names[p], offset))
        products = self.options.saliency != "grad_norm"
        by_scale = {scale: [names[p] for p in group] for scale, group in self._scale_groups(model).items()}
        clients, dev = len(segments), next(model.parameters()).device
        sums = torch.zeros((clients, len(tracked)), dtype=torch.float64, device=dev)
        steps = torch.zeros(clients, dtype=torch.float64, device=dev)
        skipped = torch.zeros_like(steps)

        def grad(params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor]) -> None:
            with torch.no_grad():
                if flat and self._records(epoch[0], last, epochs):
                    thetas = [params[n] if off is None else params[n] + off for n, off in flat] if products else None
                    vals = meters[0].stacked_values([grads[n] for n, _ in flat], thetas)
                    finite = torch.isfinite(vals).all(1)
                    sums.add_(torch.where(finite.unsqueeze(1), vals, torch.zeros_like(vals)))
                    steps.add_(finite.to(torch.float64))
                    skipped.add_((~finite).to(torch.float64))
                for scale, group in by_scale.items():
                    torch._foreach_mul_([grads[n] for n in group], scale)

        def epoch_end() -> None:
            for j, meter in enumerate(meters):
                meter.accumulate(sums[j], float(steps[j]), float(skipped[j]))
            sums.zero_()
            steps.zero_()
            skipped.zero_()
            epoch[0] += 1

        return SegmentRule(grad=grad, epoch_end=epoch_end)

    def _local_train(self, run: _Task, model: nn.Module) -> Generator[LocalSegment, dict[str, Any], dict[str, Any]]:
        """Algorithm 1's local epochs, split where the structure may change (after DYMM's global
        epoch, and after the second epoch when the budget changes): yields each segment, receives
        its training report. Leaves the trained model and its last-epoch saliency S_l in ``run``."""
        ctx, client = run.ctx, run.task
        E = ctx.cfg.train.local_epochs
        run.budget = client.budget_macs
        report: dict[str, Any] = {"mode": run.mode}
        opt = ctx.make_optimizer(model)
        meter = self._meter(run, model)
        self._verify_optimizer(model, opt, f"the optimizer was built ({run.mode})")
        res: dict[str, Any] = {"loss": float("nan")}

        def segment(first: int, last: int) -> Generator[LocalSegment, dict[str, Any], None]:
            """Epochs ``first … last−1`` on the current model, optimizer and saliency meter."""
            nonlocal res
            if last <= first:
                return
            by_scale = self._scale_groups(model)
            unchecked = [self.options.verify]
            recording = [self._records(first, last, E)]

            def after_backward(m: nn.Module) -> None:
                if recording[0]:
                    meter.after_backward()  # saliency reads the loss gradient as it is
                if unchecked[0]:  # invariant 2, on the first step after a structural change
                    unchecked[0] = False
                    check_gradients(model, where=f"the first backward pass of epoch {first}")
                for scale, params in by_scale.items():
                    grads = [p.grad for p in params if p.grad is not None]
                    if grads:
                        torch._foreach_mul_(grads, scale)

            def on_epoch_end(epoch: int, m: nn.Module, opt: torch.optim.Optimizer) -> None:
                if not self._read(epoch, last, E):  # S_l is the last epoch's: start it afresh
                    meter.reset()
                recording[0] = self._records(epoch + 1, last, E)

            before = self._anchor_norms(model)
            batched = not self.options.verify and self.options.saliency != "random"
            res = yield LocalSegment(model, opt, first, last, after_backward=after_backward, on_epoch_end=on_epoch_end,
                                     cohort=functools.partial(self._cohort_rule, epochs=E) if batched else None, own=meter)
            if res.get("cohort"):  # how many of its epochs the client trained in a batched cohort
                report["cohort_epochs"] = report.get("cohort_epochs", 0) + (last - first)
            self._record_growth(run, before, self._anchor_norms(model))

        change_at = 2 if client.budget_after_change is not None and E > 2 else E
        if run.mode == "dymm" and E > 1:
            yield from segment(0, 1)  # one epoch on ε recording S_g
            s_global = meter.values()
            with ctx.timer("dymm"):
                model.eval()
                rep = dymm(
                    model,
                    run.s_local,
                    s_global,
                    client.budget_macs,
                    ctx.input_shape,
                    use_abs=self.options.use_abs,
                    small_q=self.options.small_q,
                    large_q=self.options.large_q,
                    max_new_per_round=self.options.max_new_per_round,
                    init=self.options.init,
                    grow_mode=self.options.grow_mode,
                    pool=self.options.branches,
                )
                change = rep.change
                if self.options.fill_budget:
                    filled = fill_to_budget(
                        model, client.budget_macs, ctx.input_shape, init=self.options.init,
                        sizes=_input_sizes(ctx, run.plain), current_macs=rep.macs_after,
                        grow_mode=self.options.grow_mode, kinds=self.options.branches,
                    )
                    change = change.extend(filled)
                    report["filled"] = len(filled.added)
                model.train()
            self._apply(model, opt, change, "DYMM and the budget fill")
            meter = self._meter(run, model)
            report.update(folded=len(rep.folded), grown=len(rep.grown))
            start = 1
        else:
            start = 0
        yield from segment(start, change_at)
        if change_at < E:
            model, opt = self._adapt_budget(run, model, meter, opt)
            meter = self._meter(run, model)
            yield from segment(change_at, E)
        run.model = model
        run.s_local = meter.values()
        report["mode"] = run.mode
        report["loss"] = res["loss"]
        report["branches"] = sum(len(b.branch_names) for _, b in reparam.iter_blocks(model))
        return report

    def _upload(self, run: _Task, report: dict[str, Any]) -> ClientResult:
        """Eq. 10: store ζ (structure, tensors, S_l) for the next round, merge it into the plain
        structure (eval-exact) and send the plain tensors."""
        ctx, client = run.ctx, run.task
        model = run.model  # local training may have replaced the model (budget below the plain model)
        assert model is not None
        model.eval()
        trained_macs = ctx.macs(model)
        metrics = dict(report)
        private = None
        if run.mode != "pruned":
            private = {
                "structure": reparam.structure(model),
                "state": {k: v.clone() for k, v in model.state_dict().items()},
                "s_local": {_skey(k): float(v) for k, v in run.s_local.items()},
            }
        targets, pairs = self._host_targets(run, model)
        # the trained model is not needed after its upload: merge in place unless verifying
        with ctx.timer("merge"):
            plain = reparam.merge(model, target=self._merge_target(), inplace=not self.options.verify)
            if pairs:
                calib = self._own_batches(run) if self.options.host_scale == "calibrated" else None
                reparam.match_filter_norms(plain, targets, pairs, inputs=calib)
        if self.options.verify:
            if run.verify_in is not None:
                metrics["lossless_in"] = run.verify_in
            metrics["lossless_out"] = self._check(run, plain, model, "at upload: merged upload vs trained client model")
        state = dict(plain.state_dict())
        if run.mode != "pruned" and list(state) != list(run.plain.state_dict()):
            raise RuntimeError("dynamicfl: the merged client model does not have the global model's keys")
        result = ClientResult.of(
            client,
            state,
            macs=trained_macs,
            spec=run.spec if run.mode == "pruned" else None,
            metrics=metrics,
            client_state=private,
            # a pruned client receives only its sub-model's slice of the global model
            bytes_down=state_bytes(state) if run.mode == "pruned" else None,
        )
        result.budget_macs = float(run.budget)  # the budget it ended with (it may change mid-round)
        return result

    def aggregate(self, ctx: Context, updates: list[ClientResult]) -> None:
        """Eq. 11: weighted mean of the plain uploads; pruned sub-model uploads are scattered back by
        channel index and every weight is averaged over the clients that trained it (a weight no
        client trained keeps its value)."""
        assert self.global_model is not None
        if not updates:
            return
        weights = ctx.aggregation_weights(updates)
        if all(u.spec is None for u in updates):
            self.global_model.load_state_dict(weighted_average([u.state for u in updates], weights))
            return

        agg = SubmodelAggregator(self.global_model.state_dict(), groups=self.global_model)
        for u, w in sorted(zip(updates, weights), key=lambda uw: uw[0].cid):
            agg.add(u.state, u.spec, weight=w)
        self.global_model.load_state_dict(agg.result())
