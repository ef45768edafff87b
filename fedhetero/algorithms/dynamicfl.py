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
   block's main branch so the block equals ω_g's conv exactly (Eq. 4); train one epoch recording
   S_g; ζ ← DYMM(ε; S_g, S_l) within the budget (Eqs. 12–16); train E−1 epochs recording S_l;
4. merge ζ into the plain structure (Eq. 10) and upload; the server averages plain tensors (Eq. 11).

Dynamic budgets: when the engine announces a changed budget (after the second local epoch), the
client adapts on the spot — folding the lowest-saliency branches to shrink, adding branches to
grow — both function-preserving in eval mode.

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
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

import reparam
from fedhetero.algorithms.base import (
    Algorithm,
    ClientInfo,
    ClientResult,
    ClientTask,
    payload_bytes,
    state_bytes,
    weighted_average,
)
from reparam.changes import StructureChange, apply_to_optimizer
from reparam.dymm import dymm, shrink_to_budget
from reparam.invariants import check_gradients, check_optimizer, check_same_function
from reparam.planning import best_additions, expandable_convs, fill_to_budget, first_plan, grow_to_budget
from reparam.saliency import SaliencyMeter

# the planners moved to reparam.planning; these names stay importable from here
__all__ = ["DynamicFL", "DynamicFLOptions", "grow_to_budget", "fill_to_budget", "first_plan", "best_additions"]


@dataclass(frozen=True)
class DynamicFLOptions:
    # "batchnorm": the anchor BN of a wrapped plain conv starts at γ=1, β=0, μ=0, v=1−ε (eval-exact;
    # trains with normalised activations). Measured on digits (LeNet-5, 20 rounds, 2 seeds) it beats
    # the "calibrated" set-up (BN statistics taken from a few client batches, so train mode starts
    # at the plain conv's scale) by 5–7 points at β = 0.1, 0.5 and 5; see CHANGELOG.
    anchor_norm: Literal["calibrated", "frozen_identity", "batchnorm"] = "batchnorm"
    calibration_batches: int = 4
    # a returning client's anchor BN: "private" keeps the BN statistics (and γ, β) it trained with
    # in its private state and re-solves the anchor conv around them; "reset" starts the anchor BN
    # from γ=1, β=0, μ=0, v=1−ε every round (as on a client's first round)
    bn_stats: Literal["private", "reset"] = "private"
    # "random": scores drawn at random (seeded per round and client): the structure without saliency
    saliency: Literal["synflow", "snip", "grad_norm", "random"] = "synflow"
    saliency_params: Literal["all", "conv_weights"] = "all"
    use_abs: bool = True
    small_q: float = 0.3
    large_q: float = 0.7
    max_new_per_round: int | None = None
    init: Literal["zero_gamma", "random_resolve"] = "zero_gamma"
    first_plan: Literal["bottom_up", "saliency"] = "bottom_up"
    sub_model_criterion: Literal["hrank", "magnitude"] = "hrank"
    fill_budget: bool = True  # after DYMM / in the first plan, grow branches into unused budget
    # "nested": planners and DYMM may also grow branches inside a branch's K×K conv (exact), so a
    # tier whose flat branch set is exhausted (LeNet-5 at 3×) still uses its budget; "block": only
    # the host convs' own branch kinds (LeNet-5's 3× tier then trains about 0.8 of its budget)
    grow_mode: Literal["block", "nested"] = "nested"
    # branch kinds the client models may use besides the anchor (null: every registered kind)
    branches: tuple[str, ...] | None = None
    # check the structural invariants in every task and stop it with an InvariantError (an internal
    # error) when one fails: after every structural change the optimizer holds exactly the model's
    # trainable parameters, the first step after it gives each of them a gradient, the client model
    # starts equal to the global model and uploads what it trained (eval mode, to the dtype's
    # tolerance); the two function errors are recorded per client (costs two forwards and a copy)
    verify: bool = False

    def __post_init__(self) -> None:
        from fedhetero.config import ConfigError

        def bad(name: str, msg: str) -> None:
            raise ConfigError(f"algorithm.options.{name}: {msg}, got {getattr(self, name)!r}")

        if self.calibration_batches < 1:
            bad("calibration_batches", "must be at least 1")
        for name in ("small_q", "large_q"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                bad(name, "a quantile must be in [0, 1]")
        if self.small_q > self.large_q:
            bad("small_q", f"must not exceed large_q={self.large_q}")
        if self.max_new_per_round is not None and self.max_new_per_round < 0:
            bad("max_new_per_round", "must be >= 0 or null")
        if self.branches is not None:
            from reparam.kinds import get_kind, kind_names

            if isinstance(self.branches, str) or not all(isinstance(k, str) for k in self.branches):
                bad("branches", "must be a list of branch kinds")
            unknown = [k for k in self.branches if k not in kind_names()]
            if unknown:
                bad("branches", f"unknown kinds {unknown}; known: {list(kind_names())}")
            if not [k for k in self.branches if not get_kind(k).anchor]:
                bad("branches", "must name at least one branch kind besides the anchor")


def _skey(key: tuple[str, str]) -> str:
    return f"{key[0]}|{key[1]}"


def _unskey(key: str) -> tuple[str, str]:
    path, name = key.rsplit("|", 1)
    return path, name


def _plain_architecture(ctx) -> nn.Module:
    """A copy of the plain (merged) architecture of the configured model, from a per-process
    template: every conv+BN folded into one biased conv."""

    def make() -> nn.Module:
        model = ctx.build_model()
        model.eval()
        return reparam.merge(model, target="deploy")

    return ctx.template("dynamicfl-plain", make)


def _input_sizes(ctx, plain: nn.Module) -> dict:
    """Conv input sizes of the architecture (they do not depend on the branches; cached)."""
    if "dynamicfl-sizes" not in ctx.cache:
        ctx.cache["dynamicfl-sizes"] = reparam.flops.input_sizes(plain, ctx.input_shape)
    return ctx.cache["dynamicfl-sizes"]


def _smallest_pruned_macs(ctx) -> float:
    """MACs of the smallest sub-model :func:`~fedhetero.pruning.surgery.plan_for_budget` can give
    the plain architecture with DynamicFL's settings (policy ``block_internal_only``, convs only,
    at least one channel per group, no rounding); the plain model's MACs when nothing can be
    pruned. Cached per process (it depends on the architecture only)."""
    key = "dynamicfl-min-macs"
    if key not in ctx.cache:
        from fedhetero.pruning.rates import kept_count
        from fedhetero.pruning.surgery import ChannelMacs, prunable_groups

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
    Options = DynamicFLOptions
    adapts_to = frozenset({"static", "increasing", "decreasing", "random"})
    supports_submodels = True

    # ------------------------------------------------------------------ budgets
    def min_budget_macs(self, ctx) -> float | None:
        """A client below the plain model trains a pruned sub-model (:meth:`_pruned`, and
        :meth:`_to_pruned` when its budget falls mid-round): the smallest plan
        :func:`~fedhetero.pruning.surgery.plan_for_budget` allows keeps one channel of every group
        it may prune (``block_internal_only``: residual groups stay whole). Its MACs are the floor;
        a lower budget would stop every such client with a ``BudgetError``."""
        return _smallest_pruned_macs(ctx)

    # ------------------------------------------------------------------ server
    def setup(self, ctx) -> None:
        self.global_model = _plain_architecture(ctx)

    # ------------------------------------------------------------------ client
    # The client half runs on a fresh instance per task; the attributes it sets (``_plain``,
    # ``_mode``, ``_spec``, ``_model``, ``_s_local``, ``_budget``) are that task's working state.
    # What depends on the architecture only (plain template, first-round plans, conv input sizes)
    # is cached in the client context, once per process.
    def _calibration_batch(self, ctx, client: ClientInfo) -> torch.Tensor:
        xs = []
        n = 0
        for x, _ in ctx.client_batches(client.cid, epoch=10_000):
            xs.append(x)
            n += 1
            if n >= self.options.calibration_batches:
                break
        return torch.cat(xs).to(ctx.device, ctx.dtype)

    def _expand_first(self, ctx, client: ClientInfo) -> nn.Module:
        plain = copy.deepcopy(self._plain)
        kinds = self.options.branches
        key = ("dynamicfl-plan", round(float(client.budget_macs), 3), self.options.fill_budget, tuple(kinds or ()))
        if key not in ctx.cache:
            ctx.cache[key] = first_plan(plain, client.budget_macs, ctx.input_shape, fill=self.options.fill_budget, kinds=kinds)
        plan = ctx.cache[key]
        calib = self._calibration_batch(ctx, client) if self.options.anchor_norm == "calibrated" else None
        with ctx.timer("rep"):
            model = reparam.expand(
                plain,
                plan=plan,
                inplace=True,
                anchor_norm=self.options.anchor_norm,
                calibration_input=calib,
            )
        if self.options.fill_budget and self.options.grow_mode == "nested":
            # a plan cannot hold nested blocks: grow them into what the flat plan left unused
            with ctx.timer("rep"):
                fill_to_budget(
                    model, client.budget_macs, ctx.input_shape, init="zero_gamma",
                    sizes=_input_sizes(ctx, self._plain), grow_mode="nested", kinds=kinds,
                )
        return model

    def _restore(self, ctx, stored: dict[str, Any]) -> nn.Module:
        model = reparam.build(copy.deepcopy(self._plain), stored["structure"])
        model.load_state_dict(stored["state"], strict=True)
        return model

    def _pruned(self, ctx, client: ClientInfo) -> nn.Module:
        """A budget below the plain model: a structurally pruned sub-model of ω_g (HRank ranks of
        the client's own data, or filter magnitude), trained with BN on every conv."""
        from fedhetero.pruning.surgery import plan_for_budget
        from fedhetero.submodel import submodel_from

        crit = self.options.sub_model_criterion
        batches = None
        if crit == "hrank":
            batches = [x.to(ctx.device, ctx.dtype) for x, _ in ctx.client_batches(client.cid, epoch=10_002, batch_size=100)][:2]
        with ctx.timer("prune"):
            self._spec = plan_for_budget(
                self._plain, ctx.input_shape, client.budget_macs, criterion=crit, batches=batches
            )
            sub = submodel_from(self._plain, self._spec)
        calib = self._calibration_batch(ctx, client) if self.options.anchor_norm == "calibrated" else None
        plan = {path: ("kxk",) for path, _ in expandable_convs(sub)}
        with ctx.timer("rep"):
            return reparam.expand(sub, plan=plan, inplace=True, anchor_norm=self.options.anchor_norm, calibration_input=calib)

    def client_model(self, ctx, client: ClientTask, state: dict[str, Any] | None = None) -> nn.Module:
        self._ctx, self._round, self._cid = ctx, int(client.round), int(client.cid)
        self._plain = _plain_architecture(ctx)
        self._plain.load_state_dict(client.payload["state"])
        self._s_local: dict[tuple[str, str], float] = {}
        self._spec = None
        self._verify_in = None
        if client.budget_macs < ctx.plain_macs * (1 - 1e-9):
            self._mode = "pruned"
            model = self._pruned(ctx, client)
            model.train()
            return model
        stored = state
        if stored is None:
            self._mode = "first"
            model = self._expand_first(ctx, client)
        else:
            self._s_local = {_unskey(k): float(v) for k, v in stored["s_local"].items()}
            model = self._restore(ctx, stored)
            if ctx.macs(model) > client.budget_macs:
                self._mode = "shrink"
                with ctx.timer("dymm"):
                    shrink_to_budget(model, self._s_local, client.budget_macs, ctx.input_shape)
            else:
                self._mode = "dymm"
            with ctx.timer("rep"):
                model.eval()
                reparam.rep_to_local(self._plain, model, anchor_stats="keep" if self.options.bn_stats == "private" else "identity")
        model.train()
        if self.options.verify:
            self._verify_in = self._check(ctx, model, self._plain, f"after REP ({self._mode}): client model vs global model")
        return model

    def _check(self, ctx, a: nn.Module, b: nn.Module, where: str) -> float:
        """Invariants 3 and 4: ``a`` computes ``b``'s function in eval mode on a batch of the
        client's data, to the tolerance of the run's dtype (on copies; raises InvariantError)."""
        x = next(iter(ctx.client_batches(ctx.current_client.cid, epoch=10_001)))[0].to(ctx.device, ctx.dtype)
        return float(check_same_function(a, b, x, where=where))

    def _verify_optimizer(self, model: nn.Module, opt, where: str) -> None:
        """Invariant 1 (with ``verify``): the optimizer holds exactly the model's trainable parameters."""
        if self.options.verify:
            check_optimizer(model, opt, where=where)

    def _apply(self, model: nn.Module, opt, change: StructureChange, where: str) -> None:
        """Bring ``opt`` up to date with a structural change of ``model`` (and check it)."""
        apply_to_optimizer(opt, change)
        self._verify_optimizer(model, opt, where)

    def _meter(self, model: nn.Module) -> SaliencyMeter:
        gen = None
        if self.options.saliency == "random":
            self._meters = getattr(self, "_meters", 0) + 1  # a fresh stream per meter of the task
            gen = self._ctx.torch_generator("algorithm", self._round, self._cid, self._meters)
        return SaliencyMeter(model, metric=self.options.saliency, params=self.options.saliency_params, generator=gen)

    def _to_pruned(self, ctx, client: ClientInfo, model: nn.Module, budget: float) -> nn.Module:
        """Switch mid-round to a pruned sub-model when the budget falls below the plain model:
        merge the current model (eval-exact), prune it by filter magnitude to the budget and wrap it
        with BN again. The spec stays relative to the global model (composed with an earlier one)."""
        from fedhetero.pruning.surgery import plan_for_budget
        from fedhetero.submodel import submodel_from

        model.eval()
        plain = reparam.merge(model, target="deploy")
        with ctx.timer("prune"):
            spec = plan_for_budget(plain, ctx.input_shape, budget, criterion="magnitude")
            sub = submodel_from(plain, spec)
        self._spec = spec if self._spec is None else self._spec.compose(spec)
        plan = {path: ("kxk",) for path, _ in expandable_convs(sub)}
        calib = self._calibration_batch(ctx, client) if self.options.anchor_norm == "calibrated" else None
        with ctx.timer("rep"):
            new = reparam.expand(sub, plan=plan, inplace=True, anchor_norm=self.options.anchor_norm, calibration_input=calib)
        new.train()
        self._mode = "pruned"
        return new

    def _adapt_budget(self, ctx, client: ClientInfo, model: nn.Module, meter: SaliencyMeter, opt):
        """Follow a changed budget on the spot (after the second local epoch): shrink by folding
        the lowest-saliency branches, grow by adding branches (both eval-exact), or switch to a
        pruned sub-model when the budget falls below the plain model. Returns (model, optimizer)."""
        new_budget = float(client.budget_after_change)
        self._budget = new_budget
        scores = meter.values() or self._s_local
        current = ctx.macs(model)
        anchors_only = ctx.macs(reparam.merge(model.eval(), target="deploy"))
        model.train()
        if new_budget < anchors_only * (1 - 1e-9):
            new = self._to_pruned(ctx, client, model, new_budget)
            new_opt = ctx.make_optimizer(new)
            self._verify_optimizer(new, new_opt, "the switch to a pruned sub-model")
            return new, new_opt
        with ctx.timer("dymm"):
            model.eval()
            if current > new_budget:
                rep = shrink_to_budget(model, scores, new_budget, ctx.input_shape)
                change = rep.change if hasattr(rep, "change") else rep
            else:
                change = grow_to_budget(
                    model, scores, new_budget, ctx.input_shape, init=self.options.init, grow_mode=self.options.grow_mode,
                    kinds=self.options.branches,
                )
            model.train()
        self._apply(model, opt, change, "the budget change")
        return model, opt

    def local_train(self, ctx, client: ClientInfo, model: nn.Module) -> dict[str, Any]:
        """Algorithm 1's local epochs, split where the structure may change (after DYMM's global
        epoch, and after the second epoch when the budget changes)."""
        E = ctx.cfg.train.local_epochs
        self._budget = client.budget_macs
        self._model = model
        report: dict[str, Any] = {"mode": self._mode}
        state = {"model": model, "opt": ctx.make_optimizer(model), "meter": self._meter(model)}
        self._verify_optimizer(model, state["opt"], f"the optimizer was built ({self._mode})")
        res: dict[str, Any] = {"loss": float("nan")}

        def segment(first: int, last: int) -> None:
            nonlocal res
            if last <= first:
                return
            meter = state["meter"]
            after_backward = lambda _m: meter.after_backward()  # noqa: E731 - the step's hook
            if self.options.verify:
                unchecked = [True]

                def after_backward(m: nn.Module) -> None:
                    meter.after_backward()
                    if unchecked[0]:  # invariant 2, on the first step after a structural change
                        unchecked[0] = False
                        check_gradients(state["model"], where=f"the first backward pass of epoch {first}")

            def on_epoch_end(epoch: int, m: nn.Module, opt) -> None:
                # S_l is the saliency of the last epoch: start it afresh after the earlier ones, but
                # never at the end of a segment, whose saliency the caller reads next (S_g after the
                # global epoch; the scores a budget change folds or grows by)
                if epoch < E - 1 and epoch < last - 1:
                    meter.reset()

            res = ctx.train(
                state["model"],
                client,
                last - first,
                optimizer=state["opt"],
                after_backward=after_backward,
                on_epoch_end=on_epoch_end,
                first_epoch=first,
            )

        change_at = 2 if client.budget_after_change is not None and E > 2 else E
        if self._mode == "dymm" and E > 1:
            segment(0, 1)  # one epoch on ε recording S_g
            s_global = state["meter"].values()
            m = state["model"]
            with ctx.timer("dymm"):
                m.eval()
                rep = dymm(
                    m,
                    self._s_local,
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
                        m, client.budget_macs, ctx.input_shape, init=self.options.init,
                        sizes=_input_sizes(ctx, self._plain), current_macs=rep.macs_after,
                        grow_mode=self.options.grow_mode, kinds=self.options.branches,
                    )
                    change = change.extend(filled)
                    report["filled"] = len(filled.added)
                m.train()
            self._apply(m, state["opt"], change, "DYMM and the budget fill")
            state["meter"] = self._meter(m)
            report.update(folded=len(rep.folded), grown=len(rep.grown))
            start = 1
        else:
            start = 0
        segment(start, change_at)
        if change_at < E:
            m, opt = self._adapt_budget(ctx, client, state["model"], state["meter"], state["opt"])
            if m is not state["model"] or opt is not state["opt"]:
                state.update(model=m, opt=opt)
            state["meter"] = self._meter(state["model"])
            segment(change_at, E)
        self._model = state["model"]
        self._s_local = state["meter"].values()
        report["mode"] = self._mode
        report["loss"] = res["loss"]
        report["branches"] = sum(len(b.branch_names) for _, b in reparam.iter_blocks(self._model))
        return report

    def upload(self, ctx, client: ClientTask, model: nn.Module, result: dict[str, Any]) -> ClientResult:
        """Eq. 10: store ζ (structure, tensors, S_l) for the next round, merge it into the plain
        structure (eval-exact) and send the plain tensors."""
        model = self._model  # local training may have replaced the model (budget below the plain model)
        model.eval()
        trained_macs = ctx.macs(model)
        metrics = dict(result)
        private = None
        if self._mode != "pruned":
            private = {
                "structure": reparam.structure(model),
                "state": {k: v.clone() for k, v in model.state_dict().items()},
                "s_local": {_skey(k): float(v) for k, v in self._s_local.items()},
            }
        # the trained model is not needed after its upload: merge in place unless verifying
        with ctx.timer("merge"):
            plain = reparam.merge(model, target="deploy", inplace=not self.options.verify)
        if self.options.verify:
            if self._verify_in is not None:
                metrics["lossless_in"] = self._verify_in
            metrics["lossless_out"] = self._check(ctx, plain, model, "at upload: merged upload vs trained client model")
        state = dict(plain.state_dict())
        if self._mode == "pruned":
            spec, budget, down = self._spec, float(self._budget), state_bytes(state)  # the sub-model slice
        else:
            if list(state) != list(self._plain.state_dict()):
                raise RuntimeError("dynamicfl: the merged client model does not have the global model's keys")
            spec, budget, down = None, float(self._budget), payload_bytes(client.payload)
        return ClientResult(
            cid=client.cid,
            num_samples=client.num_samples,
            state=state,
            spec=spec,
            macs=trained_macs,
            budget_macs=budget,
            bytes_up=state_bytes(state),
            bytes_down=down,
            tier=client.tier,
            metrics=metrics,
            client_state=private,
        )

    def aggregate(self, ctx, updates: list[ClientResult]) -> None:
        """Eq. 11: weighted mean of the plain uploads; pruned sub-model uploads are scattered back by
        channel index and every weight is averaged over the clients that trained it (a weight no
        client trained keeps its value)."""
        if not updates:
            return
        weights = ctx.aggregation_weights(updates)
        if all(u.spec is None for u in updates):
            self.global_model.load_state_dict(weighted_average([u.state for u in updates], weights))
            return
        from fedhetero.submodel import SubmodelAggregator

        agg = SubmodelAggregator(self.global_model.state_dict(), groups=self.global_model)
        for u, w in sorted(zip(updates, weights), key=lambda uw: uw[0].cid):
            agg.add(u.state, u.spec, weight=w)
        self.global_model.load_state_dict(agg.result())
