"""FedAP: federated adaptive structured pruning, once, at a configured round (Algorithm 3).

Right after round ``prune_round`` completes (before round ``prune_round + 1`` samples devices, as
in the authors' code; default 30, the paper's round, ``-1`` disables) the server:

1. computes a per-dataset expected pruning rate ``p*_k`` for the server (``k = 0``) and **every**
   device ``k = 1..N`` on the current global model ``W'`` with one batch of ``hessian_batch`` (100)
   samples of ``D_k``: ``slq_plateau`` (default, the authors'-code heuristic; the spectral mass
   above the first plateau of the SLQ Hessian density), ``spectral_gap`` (paper-literal
   ``m_k/d_k`` at the first gap wider than ``4ℒ_k``, with ``W`` = the initial global model) or
   ``fixed``; lines 2–4;
2. aggregates them with Formula 15, ``p* = Σ_k w_k p*_k`` with ``w_k ∝ n_k / (D(P_k) + ε)``, the
   server included (``ε = 1e-4``, the authors' code); line 5;
3. turns ``p*`` into the global magnitude threshold ``𝒱`` = the ``⌊ℳ·p*⌋``-th smallest ``|v|`` over
   all trainable tensors (biases and norm parameters too, as in the authors' code) and gives each
   conv layer ``l`` the rate ``p*_l`` = fraction of its weights (biases not counted) with
   ``|v| < 𝒱``, all on the unpruned model; lines 6–11;
4. removes in each conv layer the ``⌊p*_l·d_l⌋`` filters (at least ``min_filters_per_layer`` kept)
   whose post-ReLU feature maps on ``hrank_samples`` (500) server images have the lowest average
   matrix rank (HRank), layer after layer (``sequential``) or all ranks first; lines 12–15;
5. physically removes them with the consumer layers' input channels, so the FLOPs really drop —
   the pruned model keeps the surviving weights and is trained by everybody for the remaining
   rounds; FedDUM's server momentum buffer is sliced with the same indices.

The numerical pieces live in :mod:`fedhetero.algorithms.pruning` (Hessian/SLQ rates, Formula 15, threshold,
HRank ranks, surgery); this module orchestrates them inside the round loop and records what the
paper reports: after pruning every client's ``metrics`` carry ``prune_p_star`` and the realised
per-layer rate ``prune_rate/<group>``; ``macs`` (forward MACs per sample) and ``params`` of every
update drop accordingly; the full audit (every ``p*_k``, the Formula-15 weights, ``𝒱``, every
``p*_l``, kept filter counts, MACs and parameters before/after) is :attr:`PruningMixin.prune_report`,
part of the checkpointed algorithm state.

Devices cannot rebuild the pruned architecture from the config alone: after pruning every task's
payload carries ``pruned``, the kept channel indices of the pruned groups (plain lists, relative to
the configured model), next to the pruned model's ``state``; the client half rebuilds the
architecture with :func:`pruned_model` (cached per process) and loads the state.

FedAP alone (this module's :class:`FedAP`) is FedAvg with the pruning step and no server update
(the paper's FedAP ablation variant; authors' code ``central_train = 0``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from fedhetero.algorithms.feddumap._common import FamilyOptions, NonIIDStats, ServerDataAlgorithm
from fedhetero.algorithms.pruning.rates import (
    aggregate_rates,
    aggregation_weights,
    dataset_prune_rate,
    layer_rates_from_threshold,
    magnitude_threshold,
)
from fedhetero.algorithms.pruning.surgery import fedap_prune, group_producers, prunable_groups
from fedhetero.core.common.options import MethodOptions, option
from fedhetero.core.hetero.submodel import SubmodelSpec, channel_groups_of, submodel_from
from fedhetero.core.exchange.types import ClientInfo, ClientTask
from fedhetero.data.batches import random_crop_flip

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import ClientContext, Context

__all__ = [
    "RateOptions",
    "PruneOptions",
    "FedAPOptions",
    "FedAP",
    "PruningMixin",
    "estimate_global_rate",
    "conv_layer_rates",
    "pruned_model",
    "rank_batches",
]


@dataclass(frozen=True)
class RateOptions(MethodOptions):
    """Options of Algorithm 3 lines 2–11, shared with IMC.

    ``prune_round`` (30; −1 disables; pruning runs before round ``prune_round + 1``),
    ``prune_rate_mode`` (step 1 of the module docstring), ``fixed_prune_rate`` (mode ``fixed``),
    ``hessian_batch``, ``slq_iters``/``slq_probes`` (``null`` = 50/1 for ``slq_plateau``, 100/4 for
    ``spectral_gap``), ``slq_grid``, ``slq_kernel_var``, ``plateau_*``, ``gap_factor``,
    ``lipschitz_power_iters``, ``eps_formula15`` (Formula 15's ε) and ``threshold_params`` (which
    tensors define ``𝒱``).
    """

    prune_round: int = option(30, ge=-1, note="-1: disabled")
    prune_rate_mode: Literal["slq_plateau", "spectral_gap", "fixed"] = "slq_plateau"
    fixed_prune_rate: float = option(0.6, ge=0, le=1)
    hessian_batch: int = option(100, ge=1)
    slq_iters: int | None = option(None, ge=1)
    slq_probes: int | None = option(None, ge=1)
    slq_grid: int = option(10_000, ge=2)
    slq_kernel_var: float = option(1e-5, gt=0)
    plateau_inc0: float = option(0.1, gt=0)
    plateau_tol: float = option(0.005, gt=0)
    plateau_len: int = option(4, ge=2)
    plateau_max_halvings: int = option(20, ge=0)
    gap_factor: float = option(4.0, gt=0)
    lipschitz_power_iters: int = option(20, ge=1)
    eps_formula15: float = option(1e-4, gt=0)
    threshold_params: Literal["all_trainable", "conv_weights_only"] = "all_trainable"


@dataclass(frozen=True)
class PruneOptions(RateOptions):
    """FedAP options: :class:`RateOptions` plus the structured part (lines 12–15).

    ``layer_rate_rule`` (``threshold`` = Algorithm 3 lines 6–11; ``uniform`` = every conv gets ``p*``
    directly, the HRank baseline), ``hrank_samples`` / ``hrank_batch`` (500 = 5 × 100 server
    images), ``hrank_augment`` (False; True mimics the authors' code), ``prune_order``
    (``sequential`` ranks each layer after the earlier ones are pruned, as the authors' code does),
    ``resnet_prune_policy`` (``block_internal_only`` never prunes residual groups, ``group``
    prunes them with one kept set per group) and ``min_filters_per_layer``.
    """

    layer_rate_rule: Literal["threshold", "uniform"] = "threshold"
    hrank_samples: int = option(500, ge=1)
    hrank_batch: int = option(100, ge=1)
    hrank_augment: bool = False
    prune_order: Literal["sequential", "all_ranks_first"] = "sequential"
    resnet_prune_policy: Literal["block_internal_only", "group"] = "block_internal_only"
    min_filters_per_layer: int = option(1, ge=1)


@dataclass(frozen=True)
class FedAPOptions(PruneOptions, FamilyOptions):
    """FedAP = FedAvg (plain-SGD devices, no server update) + the one-shot pruning of Algorithm 3."""


# ==================================================================================== pieces
def _hessian_batch(ctx: "Context", indices: np.ndarray, size: int, key: int) -> tuple[Tensor, Tensor]:
    """``size`` samples of ``train[indices]`` drawn without replacement (clean, no augmentation)."""
    idx = np.asarray(indices, dtype=np.int64)
    rng = ctx.rng("algorithm", int(ctx.round), 1, int(key))
    if len(idx) > size:
        idx = np.sort(rng.choice(idx, size=size, replace=False))
    t = torch.as_tensor(idx, device=ctx.data.train.images.device)
    return ctx.data.train.images[t].to(ctx.device, ctx.dtype), ctx.data.train.labels[t].to(ctx.device)


def estimate_global_rate(
    ctx: "Context",
    model: nn.Module,
    options: Any,
    stats: NonIIDStats,
    *,
    init_model: nn.Module | None = None,
) -> dict[str, Any]:
    """Algorithm 3 lines 2–5: every ``p*_k`` (server first, then devices ``0..N−1``) and Formula 15.

    Returns a JSON-ready report with ``p_star``, ``mode``, and for ``slq_plateau``/``spectral_gap``
    the lists ``participants``, ``sizes``, ``degrees``, ``rates``, ``weights``, ``conventions`` and
    ``fallbacks``. In mode ``fixed`` ``p_star = fixed_prune_rate`` and nothing is computed.
    """
    mode = options.prune_rate_mode
    if mode == "fixed":
        return {"mode": "fixed", "p_star": float(options.fixed_prune_rate)}
    server = getattr(ctx.data, "server_indices", None)
    parts: list[tuple[str, np.ndarray, float, float]] = []
    if server is not None and len(server):
        parts.append(("server", np.asarray(server), float(len(server)), float(stats.server_js)))
    for k, idx in enumerate(ctx.data.client_indices):
        parts.append((f"client{k}", np.asarray(idx), float(len(idx)), float(stats.client_js[k])))
    rates, conventions, fallbacks = [], [], []
    for key, (_, idx, _, _) in enumerate(parts):
        batch = _hessian_batch(ctx, idx, int(options.hessian_batch), key)
        est = dataset_prune_rate(
            model, batch, mode=mode, fixed_rate=float(options.fixed_prune_rate), init_model=init_model,
            probes=options.slq_probes, steps=options.slq_iters, grid=int(options.slq_grid),
            var=float(options.slq_kernel_var), plateau_inc0=float(options.plateau_inc0),
            plateau_tol=float(options.plateau_tol), plateau_len=int(options.plateau_len),
            plateau_max_halvings=int(options.plateau_max_halvings), gap_factor=float(options.gap_factor),
            lipschitz_iters=int(options.lipschitz_power_iters),
            generator=ctx.torch_generator("algorithm", int(ctx.round), 2, key),
        )
        rates.append(float(est.rate))
        conventions.append(est.convention)
        fallbacks.append(bool(est.fallback))
    sizes = [p[2] for p in parts]
    degrees = [p[3] for p in parts]
    eps = float(options.eps_formula15)
    return {
        "mode": mode,
        "p_star": aggregate_rates(rates, sizes, degrees, eps),
        "participants": [p[0] for p in parts],
        "sizes": sizes,
        "degrees": degrees,
        "rates": rates,
        "weights": [float(w) for w in aggregation_weights(sizes, degrees, eps)],
        "conventions": conventions,
        "fallbacks": fallbacks,
    }


def _prunable(model: nn.Module, policy: str) -> tuple[list[str], list[str]]:
    """``(groups, conv paths)`` FedAP may prune: conv-produced groups under ``policy``."""
    groups = prunable_groups(model, policy)
    modules = dict(model.named_modules())
    convs: list[str] = []
    for g in groups:
        for p in group_producers(model, g):
            if isinstance(modules.get(p), nn.Conv2d) and p not in convs:
                convs.append(p)
    return groups, convs


def conv_layer_rates(
    model: nn.Module, p_star: float, options: Any
) -> tuple[dict[str, float], float | None]:
    """Per-conv target rates ``p*_l`` (lines 6–11) and the threshold ``𝒱`` (``None`` for ``uniform``).

    ``threshold``: ``𝒱`` = ``⌊ℳ·p*⌋``-th smallest ``|v|`` over ``threshold_params``; ``p*_l`` = the
    fraction of the conv's weights (bias excluded) strictly below ``𝒱``. ``uniform``: ``p*_l = p*``.
    Only convs FedAP may prune are listed. Computed on the given (unpruned) model.
    """
    _, convs = _prunable(model, options.resnet_prune_policy)
    if options.layer_rate_rule == "uniform":
        return {c: float(p_star) for c in convs}, None
    thr = magnitude_threshold(model, float(p_star), options.threshold_params)
    return layer_rates_from_threshold(model, thr, convs), thr


def rank_batches(ctx: "Context", options: Any) -> list[Tensor]:
    """The HRank inputs: ``hrank_samples`` server images in batches of ``hrank_batch``.

    A random subset of the server set (``ctx.rng("algorithm", round, 3)``), clean unless
    ``hrank_augment``. Without server data the first device's data is used (the paper: "one device
    computes the ranks and uploads them").
    """
    server = getattr(ctx.data, "server_indices", None)
    idx = np.asarray(server if server is not None and len(server) else ctx.data.client_indices[0], dtype=np.int64)
    rng = ctx.rng("algorithm", int(ctx.round), 3)
    idx = rng.permutation(idx)[: int(options.hrank_samples)]
    x = ctx.data.train.images[torch.as_tensor(idx, device=ctx.data.train.images.device)]
    if options.hrank_augment:
        gen = ctx.torch_generator("algorithm", int(ctx.round), 4)
        x = random_crop_flip(x, padding=4, flip=True, fill=ctx.data.train.pixel_fill(), generator=gen)
    x = x.to(ctx.device, ctx.dtype)  # the model computes in the run's dtype (float64 too)
    b = int(options.hrank_batch)
    return [x[i : i + b] for i in range(0, x.shape[0], b)]


def pruned_model(ctx: "ClientContext", kept: dict[str, list[int]]) -> nn.Module:
    """A copy of the configured model pruned to ``kept`` (group -> kept channel indices, as in
    :meth:`SubmodelSpec.to_dict`), weights unspecified (load a state into it). The pruned
    architecture is built once per process and copied from then on (torch's RNG left alone)."""
    key = ("fedap-pruned", tuple(sorted((str(g), tuple(int(i) for i in ix)) for g, ix in kept.items())))

    def make() -> nn.Module:
        full = ctx.build_model()
        return submodel_from(full, SubmodelSpec(full, kept))

    return ctx.template(key, make)


def _params(model: nn.Module) -> int:
    return int(sum(p.numel() for p in model.parameters()))


# ==================================================================================== mixin
class PruningMixin(ServerDataAlgorithm):
    """One-shot FedAP pruning inside the FedDUMAP round loop; list it before the round-loop class
    it extends (``class FedDUAP(PruningMixin, FedDU)``).

    State: :attr:`prune_spec` (kept channel indices relative to the unpruned model; ``None`` before
    pruning) and :attr:`prune_report`; both are checkpointed, and :meth:`load_state_dict` rebuilds
    the pruned architecture before loading the weights. After pruning the task payload carries the
    kept indices (``pruned``) and the client half rebuilds the pruned architecture from them.
    """

    prune_spec: SubmodelSpec | None = None
    prune_report: dict[str, Any] | None = None
    _initial_state: dict[str, Tensor] | None = None

    def setup(self, ctx: "Context") -> None:
        super().setup(ctx)
        assert self.global_model is not None
        if self.options.prune_rate_mode == "spectral_gap":
            self._initial_state = {k: v.detach().clone() for k, v in self.global_model.state_dict().items()}

    def before_round(self, ctx: "Context", clients: list[ClientInfo]) -> None:
        super().before_round(ctx, clients)
        pr = int(self.options.prune_round)
        if pr >= 0 and int(ctx.round) == pr + 1 and self.prune_spec is None:
            with ctx.timer("fedap"):
                self.prune_now(ctx)
        if self.prune_report is not None:
            rm = self.round_extras
            rm["prune_p_star"] = float(self.prune_report["p_star"])
            for g, r in self.prune_report["group_rates"].items():
                rm[f"prune_rate/{g}"] = float(r)

    def prune_now(self, ctx: "Context") -> None:
        """Run Algorithm 3 on the current global model and replace it by the pruned model."""
        o = self.options
        model = self.global_model
        assert model is not None and self.stats is not None
        init_model = None
        if o.prune_rate_mode == "spectral_gap":
            assert self._initial_state is not None
            init_model = copy.deepcopy(model)
            init_model.load_state_dict(self._initial_state)
        report = estimate_global_rate(ctx, model, o, self.stats, init_model=init_model)
        layer_rates, thr = conv_layer_rates(model, report["p_star"], o)
        batches = rank_batches(ctx, o)
        pruned, spec = fedap_prune(model, layer_rates, batches, order=o.prune_order, policy=o.resnet_prune_policy,
                                   min_channels=int(o.min_filters_per_layer), max_batches=None)
        groups, _ = _prunable(model, o.resnet_prune_policy)
        before = channel_groups_of(model).sizes
        kept = spec.sizes
        report.update({
            "round": int(ctx.round) - 1,
            "threshold": thr,
            "layer_rule": o.layer_rate_rule,
            "layer_target_rates": {k: float(v) for k, v in layer_rates.items()},
            "group_rates": {g: 1.0 - kept[g] / before[g] for g in groups},
            "filters_before": {g: int(before[g]) for g in groups},
            "filters_kept": {g: int(kept[g]) for g in groups},
            "macs_before": int(ctx.macs(model)),
            "macs_after": int(ctx.macs(pruned)),
            "params_before": _params(model),
            "params_after": _params(pruned),
        })
        self._on_pruned(spec)
        self.global_model = pruned
        self.prune_spec = spec
        self.prune_report = report
        self._initial_state = None

    # ------------------------------------------------------------------ tasks
    def round_payload(self, ctx: "Context") -> dict[str, Any]:
        out = super().round_payload(ctx)
        if self.prune_spec is not None:
            out["pruned"] = self.prune_spec.to_dict()["indices"]
        return out

    def client_model(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None = None) -> nn.Module:
        kept = task.payload.get("pruned")
        if kept is None:
            return super().client_model(ctx, task, state)
        model = pruned_model(ctx, kept)
        model.load_state_dict(task.payload["state"])
        return model

    def _on_pruned(self, spec: SubmodelSpec) -> None:
        """Hook for other per-parameter server state to slice with the kept channels (FedDUMAP's
        server momentum); called before the pruned model replaces the global one."""

    # ------------------------------------------------------------------ persistence
    # Hand-written: the spec is saved in its own serialised form and, on loading, turns the
    # configured architecture into the pruned one before the weights load; the initial state is
    # saved only while it is kept (``spectral_gap`` before pruning).
    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["prune_spec"] = None if self.prune_spec is None else self.prune_spec.state_dict()
        out["prune_report"] = self.prune_report
        if self._initial_state is not None:
            out["initial_state"] = self._initial_state
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        spec_state = state.get("prune_spec")
        if spec_state is not None and self.prune_spec is None:
            assert self.global_model is not None
            spec = SubmodelSpec.from_dict(spec_state)
            self.global_model = submodel_from(self.global_model, SubmodelSpec(self.global_model, spec.indices))
            self.prune_spec = spec
        super().load_state_dict(state)
        self.prune_report = state.get("prune_report")
        init = state.get("initial_state")
        if init is not None:
            self._initial_state = dict(init)
        elif spec_state is not None:
            self._initial_state = None


class FedAP(PruningMixin, ServerDataAlgorithm):
    """FedAP (Algorithm 3, Formula 15): FedAvg with plain-SGD devices and no server update, pruned
    once after ``prune_round`` rounds with layer-adaptive rates from the Hessian spectrum and HRank
    filter choice on server data."""

    server_data = "optional"  # pruning needs no server data; FedDU steps are not part of FedAP
    name = "fedap"
    summary = (
        "FedAvg whose global model is pruned once after prune_round rounds, with layer rates from Hessian "
        "spectra aggregated over devices and HRank filter choice."
    )
    paper = "Liu, Jia, Zhang, Yun, Wang et al., ACM TIST (FedDUMAP; journal version of FedDUAP, Zhang et al., IJCAI 2022), Algorithm 3"
    Options = FedAPOptions
