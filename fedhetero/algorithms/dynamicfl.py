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
from fedhetero.algorithms.base import Algorithm, ClientInfo, ClientUpdate, state_bytes, weighted_average
from reparam.changes import apply_to_optimizer
from reparam.dymm import dymm, plan_bottom_up, shrink_to_budget
from reparam.saliency import SaliencyMeter
from reparam.testing import rel_err

__all__ = ["DynamicFL", "DynamicFLOptions", "grow_to_budget"]


@dataclass(frozen=True)
class DynamicFLOptions:
    anchor_norm: Literal["calibrated", "frozen_identity", "batchnorm"] = "calibrated"
    calibration_batches: int = 4
    saliency: Literal["synflow", "snip", "grad_norm"] = "synflow"
    saliency_params: Literal["all", "conv_weights"] = "all"
    use_abs: bool = True
    small_q: float = 0.3
    large_q: float = 0.7
    max_new_per_round: int | None = None
    init: Literal["zero_gamma", "random_resolve"] = "zero_gamma"
    first_plan: Literal["bottom_up", "saliency"] = "bottom_up"
    sub_model_criterion: Literal["hrank", "magnitude"] = "hrank"
    verify: bool = False  # record the lossless-transfer errors per client (costs two forwards)


def _skey(key: tuple[str, str]) -> str:
    return f"{key[0]}|{key[1]}"


def _unskey(key: str) -> tuple[str, str]:
    path, name = key.rsplit("|", 1)
    return path, name


def grow_to_budget(
    model: nn.Module,
    scores: dict[tuple[str, str], float],
    budget_macs: float,
    input_shape: tuple[int, ...],
    *,
    init: str = "zero_gamma",
) -> reparam.StructureChange:
    """Add branches (zero-γ, exact) to the blocks with the highest saliency while the budget allows.

    Blocks are visited by the largest |score| of their present branches (anchor-only blocks last);
    each takes its missing applicable branch kinds, cheapest first, while the model still fits.
    """
    from reparam.flops import model_macs

    change = reparam.StructureChange([], [], [], [])
    blocks = dict(reparam.iter_blocks(model))
    if not blocks:
        return change
    sizes = reparam.flops.input_sizes(model, input_shape)

    def block_score(path: str) -> float:
        vals = [abs(v) for (p, _), v in scores.items() if p == path]
        return max(vals) if vals else 0.0

    current = model_macs(model, input_shape)
    for path in sorted(blocks, key=block_score, reverse=True):
        block = blocks[path]
        missing = [k for k in block.applicable() if k not in block.branch_names]
        costs = {k: reparam.flops.branch_macs(k, block.geometry, sizes[path]) for k in missing}
        for kind in sorted(missing, key=lambda k: costs[k]):
            if current + costs[kind] <= budget_macs:
                change.extend(block.add_branch(kind, init=init))
                current += costs[kind]
    return change


class DynamicFL(Algorithm):
    """DynamicFL: FLOPs-budgeted clients grown by lossless re-parameterization, plain global model."""

    name = "dynamicfl"
    Options = DynamicFLOptions
    adapts_to = frozenset({"static", "increasing", "decreasing", "random"})
    supports_submodels = True

    # ------------------------------------------------------------------ server
    def setup(self, ctx) -> None:
        model = ctx.build_model()
        model.eval()
        self.global_model = reparam.merge(model, target="deploy")
        self._plain_keys = list(self.global_model.state_dict())

    # ------------------------------------------------------------------ client
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
        plain = copy.deepcopy(self.global_model)
        plan = plan_bottom_up(plain, client.budget_macs, ctx.input_shape)
        calib = self._calibration_batch(ctx, client) if self.options.anchor_norm == "calibrated" else None
        with ctx.timer("rep"):
            model = reparam.expand(
                plain,
                plan=plan,
                inplace=True,
                anchor_norm=self.options.anchor_norm,
                calibration_input=calib,
            )
        return model

    def _restore(self, ctx, stored: dict[str, Any]) -> nn.Module:
        model = reparam.build(copy.deepcopy(self.global_model), stored["structure"])
        model.load_state_dict(stored["state"], strict=True)
        return model

    def client_model(self, ctx, client: ClientInfo) -> nn.Module:
        stored = ctx.store.get(client.cid, before_round=ctx.round)
        self._s_local: dict[tuple[str, str], float] = {}
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
                reparam.rep_to_local(self.global_model, model)
        model.train()
        if self.options.verify:
            self._verify_in = self._check(ctx, model, self.global_model)
        return model

    def _check(self, ctx, a: nn.Module, b: nn.Module) -> float:
        x = next(iter(ctx.client_batches(ctx.current_client.cid, epoch=10_001)))[0].to(ctx.device, ctx.dtype)
        wa, wb = a.training, b.training
        a.eval()
        b.eval()
        with torch.no_grad():
            err = rel_err(a(x), b(x))
        a.train(wa)
        b.train(wb)
        return float(err)

    def _meter(self, model: nn.Module) -> SaliencyMeter:
        return SaliencyMeter(model, metric=self.options.saliency, params=self.options.saliency_params)

    def _adapt_budget(self, ctx, client: ClientInfo, model: nn.Module, meter: SaliencyMeter, opt) -> None:
        """Follow a changed budget on the spot (after the second local epoch)."""
        new_budget = client.budget_after_change
        if new_budget is None:
            return
        scores = meter.values() or self._s_local
        current = ctx.macs(model)
        with ctx.timer("dymm"):
            model.eval()
            if current > new_budget:
                change = shrink_to_budget(model, scores, new_budget, ctx.input_shape)
                change = change.change if hasattr(change, "change") else change
            else:
                change = grow_to_budget(model, scores, new_budget, ctx.input_shape, init=self.options.init)
            model.train()
        apply_to_optimizer(opt, change)
        meter.refresh()
        self._budget = new_budget

    def local_train(self, ctx, client: ClientInfo, model: nn.Module) -> dict[str, Any]:
        E = ctx.cfg.train.local_epochs
        meter = self._meter(model)
        self._budget = client.budget_macs
        report: dict[str, Any] = {"mode": self._mode}

        def on_epoch_end(epoch: int, m: nn.Module, opt) -> None:
            # epoch numbering is global over the local round: 0 .. E-1
            if epoch == 1:
                self._adapt_budget(ctx, client, m, meter, opt)
            if epoch < E - 1:
                meter.reset()  # S_l is the saliency of the last epoch

        if self._mode in ("first", "shrink") or E == 1:
            res = ctx.train(model, client, E, after_backward=lambda _m: meter.after_backward(), on_epoch_end=on_epoch_end)
        else:
            # one epoch on ε recording S_g, then DYMM, then E−1 epochs recording S_l
            res = ctx.train(model, client, 1, after_backward=lambda _m: meter.after_backward())
            s_global = meter.values()
            opt = res["optimizer"]
            with ctx.timer("dymm"):
                model.eval()
                rep = dymm(
                    model,
                    self._s_local,
                    s_global,
                    client.budget_macs,
                    ctx.input_shape,
                    use_abs=self.options.use_abs,
                    small_q=self.options.small_q,
                    large_q=self.options.large_q,
                    max_new_per_round=self.options.max_new_per_round,
                    init=self.options.init,
                )
                model.train()
            apply_to_optimizer(opt, rep.change)
            meter.refresh()
            meter.reset()
            report.update(folded=len(rep.folded), grown=len(rep.grown))
            res = ctx.train(
                model,
                client,
                E - 1,
                optimizer=opt,
                after_backward=lambda _m: meter.after_backward(),
                on_epoch_end=on_epoch_end,
                first_epoch=1,
            )
        self._s_local = meter.values()
        report["loss"] = res["loss"]
        report["branches"] = sum(len(b.branch_names) for _, b in reparam.iter_blocks(model))
        return report

    def upload(self, ctx, client: ClientInfo, model: nn.Module, result: dict[str, Any]) -> ClientUpdate:
        model.eval()
        trained_macs = ctx.macs(model)
        with ctx.timer("merge"):
            plain = reparam.merge(model, target="deploy")
        if self.options.verify:
            result["lossless_in"] = self._verify_in
            result["lossless_out"] = self._check(ctx, plain, model)
        state = {k: v.detach().clone() for k, v in plain.state_dict().items()}
        if list(state) != self._plain_keys:
            raise RuntimeError("dynamicfl: the merged client model does not have the global model's keys")
        ctx.store.put(
            client.cid,
            {
                "structure": reparam.structure(model),
                "state": model.state_dict(),
                "s_local": {_skey(k): float(v) for k, v in self._s_local.items()},
            },
            ctx.round,
        )
        return ClientUpdate(
            cid=client.cid,
            num_samples=client.num_samples,
            state=state,
            macs=trained_macs,
            budget_macs=float(getattr(self, "_budget", client.budget_macs)),
            bytes_up=state_bytes(state),
            bytes_down=state_bytes(self.global_model.state_dict()),
            tier=client.tier,
            metrics={k: v for k, v in result.items() if k != "optimizer"},
        )

    def aggregate(self, ctx, updates: list[ClientUpdate]) -> None:
        if not updates:
            return
        weights = ctx.aggregation_weights(updates)
        self.global_model.load_state_dict(weighted_average([u.state for u in updates], weights))
