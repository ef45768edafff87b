"""Baselines of the FedDUMAP paper that use the shared server data or FedAP's pieces.

All run in the FedDUMAP round loop (:class:`~fedhetero.algorithms.feddumap._common.ServerDataAlgorithm`):
per-round learning-rate decay ``lr_decay``, plain-SGD devices unless stated, n_k-weighted averaging.
What a device needs besides ``w^{t−1}`` and ``η_t`` travels in its task payload: Data-sharing's
shared sample indices (and the bytes of their one-time transfer), FedDA's global momentum, IMC's
masks.

- ``data_sharing`` (Zhao et al. 2018; D-S): the server data is sent to the devices once; each device
  trains on its own data plus a fixed random subset of ``min(n_0, shared_samples)`` server samples
  (authors' ``datashare.py``: 2000). The one-time transfer of those samples is counted in the
  device's first ``bytes_down``; ``samples_processed`` and ``train_time_factor`` (the paper's
  ``min(p%, 5) + 1``) are recorded for the time model.
- ``hybrid_fl`` (Yoshida et al. 2020): the server is one more participant of FedAvg: it trains ``E``
  epochs on ``D_0`` from ``w^{t−1}`` and joins the weighted average with weight ``n_0``.
- ``feddu_sm`` (ServerM, FedDU-SM; the paper combines each momentum baseline with FedDU, so the
  rows of its Tables 10/11 are read as these combinations): FedDU + server momentum over the
  pseudo-gradient (Formulas 12, 8), plain local SGD.
- ``feddu_dm`` (DeviceM, FedDU-DM): FedDU + the reset-per-round dampened device momentum of
  Formula 11, no server momentum.
- ``feddu_da`` (FedDA, FedDU-DA): FedDU + momentum on both sides with the optimiser state
  transmitted (Formula 10; authors' option "fsgdm"): devices start their momentum from the global
  buffer, upload model **and** momentum, the server averages both (n_k weights). Communication is
  twice FedAvg's in both directions.
- ``hrank_fl`` (HRank inside FL, Figure 9): FedAP's procedure with a fixed uniform rate
  ``fixed_prune_rate`` for every conv (0.2/0.4/0.6/0.8 in the paper; default 0.6) and HRank filter
  choice on server data; no server update.
- ``imc`` (IMC, ref. 62; authors' ``lt.py``): at ``prune_round`` the Hessian-based rates are
  aggregated with Formula 15 into ``p*`` and the global model is pruned **unstructured** by the
  global magnitude threshold ``𝒱`` (a mask kept through local training and aggregation); no server
  update, no FLOP reduction. ``bytes_up``/``bytes_down`` count only unmasked entries (what a sparse
  transfer needs; index overhead ignored); ``params_remaining`` is recorded.

Not implemented here: FedKT, PruneFL (the FedDUMAP paper only cites them, with no settings) and
FedDF (see the knowledge-distillation baselines of the toolkit).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from fedhetero.algorithms.feddumap._common import (
    DampedMomentumSGD,
    FamilyOptions,
    ServerDataAlgorithm,
    samples_processed,
    sgd_epochs,
)
from fedhetero.algorithms.feddumap.fedap import PruneOptions, PruningMixin, RateOptions, estimate_global_rate
from fedhetero.algorithms.feddumap.feddu import FedDU, FedDUOptions
from fedhetero.algorithms.feddumap.feddum import FedDUM, FedDUMOptions
from fedhetero.algorithms.pruning.rates import magnitude_threshold
from fedhetero.core.exchange.aggregation import weighted_average
from fedhetero.core.common.options import option
from fedhetero.core.local.objective import LocalPlan
from fedhetero.core.method.algorithm import Exchanges
from fedhetero.core.exchange.types import ClientInfo, ClientResult, ClientTask, state_bytes
from fedhetero.data.batches import epoch_order

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import ClientContext, Context

__all__ = [
    "DataSharing",
    "DataSharingOptions",
    "HybridFL",
    "HybridFLOptions",
    "FedDUServerM",
    "FedDUServerMOptions",
    "FedDUDeviceM",
    "FedDUDeviceMOptions",
    "FedDUDA",
    "FedDUDAOptions",
    "HRankFL",
    "HRankFLOptions",
    "IMC",
    "IMCOptions",
    "imc_masks",
]


# ==================================================================================== Data-sharing
@dataclass(frozen=True)
class DataSharingOptions(FamilyOptions):
    """``shared_samples``: server samples sent to each device (``min(n_0, shared_samples)``)."""

    shared_samples: int = option(2000, ge=0)


class DataSharing(ServerDataAlgorithm):
    """Data-sharing (Zhao et al., 2018): devices train on local data plus a shared server subset."""

    name = "data_sharing"
    summary = "Devices train on their own data plus a fixed random subset of the server data, sent to them once."
    paper = "Zhao et al., arXiv 2018 (a baseline of the FedDUMAP paper)"
    Options = DataSharingOptions
    #: ``served``: the devices that already received their shared samples
    state_fields = (*ServerDataAlgorithm.state_fields, "served")

    def __init__(self, options: Any | None = None) -> None:
        super().__init__(options)
        self.served: list[int] = []

    def shared_indices(self, ctx: "Context", cid: int) -> np.ndarray:
        """The device's fixed shared subset (drawn once from ``ctx.rng("algorithm", 0, 5, cid)``)."""
        idx = self.server_indices(ctx)
        if idx is None or self.options.shared_samples == 0:
            return np.zeros(0, dtype=np.int64)
        k = min(len(idx), int(self.options.shared_samples))
        rng = ctx.rng("algorithm", 0, 5, int(cid))
        return np.sort(rng.choice(idx, size=k, replace=False)).astype(np.int64)

    # ------------------------------------------------------------------ server half
    def before_round(self, ctx: "Context", clients: list[ClientInfo]) -> None:
        super().before_round(ctx, clients)
        n_dev = float(sum(len(ix) for ix in ctx.data.client_indices))
        idx = self.server_indices(ctx)
        n0 = 0 if idx is None else len(idx)
        self.round_extras["train_time_factor"] = float(min(100.0 * n0 / n_dev, 5.0) + 1.0) if n_dev else 1.0

    def client_payload(self, ctx: "Context", client: ClientInfo, common: dict[str, Any]) -> dict[str, Any]:
        """Adds ``shared`` (the device's shared server-sample indices, a list) and ``shared_bytes``
        (the bytes of sending those samples: non-zero only until the device has received them)."""
        out = super().client_payload(ctx, client, common)
        shared = self.shared_indices(ctx, client.cid)
        out["shared"] = [int(i) for i in shared]
        sent = 0
        if len(shared) and int(client.cid) not in self.served:
            x = ctx.data.train.images
            per = x[0].numel() * x.element_size() + ctx.data.train.labels.element_size()
            sent = int(len(shared) * per)
        out["shared_bytes"] = sent
        return out

    def run_round(self, ctx: "Context", clients: list[ClientInfo]) -> Exchanges:
        updates = yield from super().run_round(ctx, clients)
        for u in updates:  # the devices that received their shared samples this round
            if u.metrics.get("shared_samples", 0) and int(u.cid) not in self.served:
                self.served.append(int(u.cid))
        return updates

    # ------------------------------------------------------------------ client half
    def local_train(self, ctx: "ClientContext", task: ClientTask, model: nn.Module, plan: LocalPlan | None) -> dict[str, Any]:
        t = ctx.cfg.train
        opt = self.device_optimizer(ctx, task, model)
        return sgd_epochs(ctx, model, self._local_indices(ctx, task), t.local_epochs, opt, concern="data",
                          keys=(int(task.round), int(task.cid)), steps=t.local_steps, clip=t.clip_grad_norm)

    @staticmethod
    def _local_indices(ctx: "ClientContext", task: ClientTask) -> np.ndarray:
        """The device's own training rows, then its shared server samples."""
        shared = np.asarray(task.payload["shared"], dtype=np.int64)
        return np.concatenate([np.asarray(ctx.data.client_indices[task.cid], dtype=np.int64), shared])

    def local_plan(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> LocalPlan | None:
        """The device SGD of :meth:`local_train` on its batches (:meth:`_schedule`)."""
        sgd = self.device_sgd(ctx, task)
        return None if sgd is None else LocalPlan(sgd, schedule=self._schedule(ctx, task))

    def _schedule(self, ctx: "ClientContext", task: ClientTask) -> list[Tensor]:
        """:meth:`local_train`'s batches: every pass a fresh order of the device's own and shared
        samples, from the stream of (round, device, pass); ``train.local_epochs`` passes, or
        ``train.local_steps`` steps."""
        t = ctx.cfg.train
        idx = torch.as_tensor(self._local_indices(ctx, task))
        bs = int(t.batch_size)
        out: list[Tensor] = []
        e = 0
        while (e < int(t.local_epochs)) if t.local_steps is None else (len(out) < int(t.local_steps)):
            rows = epoch_order(ctx.data.train, idx, ctx.torch_generator("data", int(task.round), int(task.cid), e))
            if not rows.numel():
                break
            out.extend(rows[k: k + bs] for k in range(0, int(rows.numel()), bs))
            e += 1
        return out if t.local_steps is None else out[: int(t.local_steps)]

    def upload(self, ctx: "ClientContext", task: ClientTask, model: nn.Module, result: dict[str, Any]) -> ClientResult:
        upd = super().upload(ctx, task, model, result)
        s = len(task.payload["shared"])
        upd.metrics["shared_samples"] = s
        upd.num_samples = int(task.num_samples) + s
        upd.metrics["samples_processed"] = samples_processed(ctx, upd.num_samples, result)
        upd.bytes_down += int(task.payload.get("shared_bytes", 0))
        return upd


# ==================================================================================== Hybrid-FL
@dataclass(frozen=True)
class HybridFLOptions(FamilyOptions):
    """``server_epochs`` / ``server_batch_size``: ``null`` = ``train.local_epochs`` / ``train.batch_size``."""

    server_epochs: int | None = option(None, ge=1)
    server_batch_size: int | None = option(None, ge=1)


class HybridFL(ServerDataAlgorithm):
    """Hybrid-FL (Yoshida et al., 2020): the server data is one more FedAvg participant (weight n_0)."""

    name = "hybrid_fl"
    summary = (
        "The server trains on its own data from the last global model and joins the FedAvg average as one "
        "more participant, weighted by its sample count."
    )
    paper = "Yoshida et al., IEEE ICC 2020 (a baseline of the FedDUMAP paper)"
    Options = HybridFLOptions

    def aggregate(self, ctx: "Context", updates: list[ClientResult]) -> None:
        assert self.global_model is not None
        idx = self.server_indices(ctx)
        states = [u.state for u in updates]
        weights = ctx.aggregation_weights(updates)
        if idx is not None:
            server_model = copy.deepcopy(self.global_model)  # w^{t-1}: aggregation has not happened yet
            with ctx.timer("hybrid_server"):
                res = self.train_on_server(ctx, server_model)
            states.append(server_model.state_dict())
            weights.append(1.0 if ctx.cfg.train.aggregation == "uniform" else float(len(idx)))
            self.round_extras["hybrid_server_loss"] = float(res["loss"])
        if states:
            self.global_model.load_state_dict(weighted_average(states, weights))


# ==================================================================================== momentum baselines
@dataclass(frozen=True)
class FedDUServerMOptions(FedDUMOptions):
    """FedDU-SM: FedDUM's options with ``device_momentum`` β' = 0 (plain local SGD)."""

    device_momentum: float = 0.0


class FedDUServerM(FedDUM):
    """ServerM / FedDU-SM: FedDU + server momentum only (Formulas 12 and 8); plain local SGD."""

    name = "feddu_sm"
    summary = "FedDU plus server momentum over the pseudo-gradient only, with plain local SGD on the devices (ServerM)."
    paper = "a momentum baseline of the FedDUMAP paper (Liu, Jia, Zhang, Yun, Wang et al., ACM TIST)"
    Options = FedDUServerMOptions


@dataclass(frozen=True)
class FedDUDeviceMOptions(FedDUOptions):
    """FedDU-DM: FedDU's options with ``device_momentum`` β' = 0.9 (Formula 11, reset every round)."""

    device_momentum: float = 0.9


class FedDUDeviceM(FedDU):
    """DeviceM / FedDU-DM: FedDU + device-side momentum only (Formula 11), no server momentum."""

    name = "feddu_dm"
    summary = "FedDU plus dampened device-side momentum only, reset every round, with no server momentum (DeviceM)."
    paper = "a momentum baseline of the FedDUMAP paper (Liu, Jia, Zhang, Yun, Wang et al., ACM TIST)"
    Options = FedDUDeviceMOptions


@dataclass(frozen=True)
class FedDUDAOptions(FedDUOptions):
    """FedDU-DA: FedDU's options; ``device_momentum`` β' = 0.9 is the shared momentum's coefficient."""

    device_momentum: float = 0.9


class FedDUDA(FedDU):
    """FedDA / FedDU-DA (Formula 10): momentum on devices and server with the buffer transmitted.

    Devices start from ``m'^{t,0} = m^t`` (the global buffer, zero at first), run dampened SGDM
    (Formula 10, the ``device_momentum_impl`` of FedDUM), and upload the model and the final buffer;
    the server averages both with the n_k weights (``m^{t+1} = Σ (n_k/n') m'_k``) and then applies the
    FedDU step to the model. ``bytes_up`` and ``bytes_down`` include the momentum.
    """

    name = "feddu_da"
    summary = (
        "FedDU plus momentum on devices and server with the buffer transmitted both ways, which doubles "
        "communication (FedDA)."
    )
    paper = "a momentum baseline of the FedDUMAP paper (Liu, Jia, Zhang, Yun, Wang et al., ACM TIST)"
    Options = FedDUDAOptions
    #: ``global_momentum``: the averaged buffer ``m^t`` (empty before the first aggregation)
    state_fields = (*FedDU.state_fields, "global_momentum")

    def __init__(self, options: Any | None = None) -> None:
        super().__init__(options)
        self.global_momentum: dict[str, Tensor] = {}

    # ------------------------------------------------------------------ server half
    def round_payload(self, ctx: "Context") -> dict[str, Any]:
        """Adds ``momentum``: the global buffer ``m^t`` (zeros before the first aggregation)."""
        out = super().round_payload(ctx)
        assert self.global_model is not None
        if not self.global_momentum:
            out["momentum"] = {n: torch.zeros_like(p) for n, p in self.global_model.named_parameters() if p.requires_grad}
        else:
            out["momentum"] = dict(self.global_momentum)
        return out

    # ------------------------------------------------------------------ client half
    def device_optimizer(self, ctx: "ClientContext", task: ClientTask, model: nn.Module) -> torch.optim.Optimizer:
        beta = float(self.options.device_momentum)
        wd = float(ctx.cfg.train.weight_decay)
        lr = float(task.payload["lr"])
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        if self.options.device_momentum_impl == "torch_sgd" and beta > 0:
            opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=lr, momentum=beta, dampening=beta,
                                                         weight_decay=wd)
        else:
            opt = DampedMomentumSGD(params, lr=lr, beta=beta, weight_decay=wd)
        start = task.payload["momentum"]
        for n, p in named:
            opt.state[p]["momentum_buffer"] = start[n].to(device=p.device, dtype=p.dtype).clone()
        return opt

    def local_train(self, ctx: "ClientContext", task: ClientTask, model: nn.Module, plan: LocalPlan | None) -> dict[str, Any]:
        opt = self.device_optimizer(ctx, task, model)
        res = dict(ctx.train(model, task, ctx.cfg.train.local_epochs, optimizer=opt))
        res["momentum"] = {n: opt.state[p]["momentum_buffer"].detach().clone()
                           for n, p in model.named_parameters() if p.requires_grad}
        return res

    def local_plan(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> LocalPlan | None:
        """Formula 10's device SGD for a cohort: the dampened buffer started at the global one and
        carried back up. Both ``device_momentum_impl`` forms step alike from a given buffer
        (``m ← β'·m + (1−β')·d``); without momentum the uploaded buffer is the last step's
        direction, which only :meth:`local_train` keeps (one by one)."""
        if float(self.options.device_momentum) == 0.0:
            return None
        sgd = self.device_sgd(ctx, task, given_buffer=True)
        return None if sgd is None else LocalPlan(replace(sgd, carried=True), momentum=task.payload.get("momentum"))

    def upload(self, ctx: "ClientContext", task: ClientTask, model: nn.Module, result: dict[str, Any]) -> ClientResult:
        """Model and final momentum go up; ``bytes_down`` (the payload: model and global momentum)
        already counts the momentum sent down."""
        momentum = result.pop("momentum")
        upd = super().upload(ctx, task, model, result)
        upd.payload["momentum"] = momentum
        extra = state_bytes(momentum)
        upd.bytes_up += extra
        upd.metrics["momentum_bytes"] = extra
        return upd

    def aggregate(self, ctx: "Context", updates: list[ClientResult]) -> None:
        super().aggregate(ctx, updates)
        if updates:
            weights = ctx.aggregation_weights(updates)
            self.global_momentum = weighted_average([u.payload["momentum"] for u in updates], weights)


# ==================================================================================== HRank in FL
@dataclass(frozen=True)
class HRankFLOptions(PruneOptions, FamilyOptions):
    """HRank at a fixed uniform rate: ``prune_rate_mode = "fixed"``, ``layer_rate_rule = "uniform"``,
    ``fixed_prune_rate`` 0.6 (the paper sweeps 0.2/0.4/0.6/0.8)."""

    prune_rate_mode: Literal["slq_plateau", "spectral_gap", "fixed"] = "fixed"
    layer_rate_rule: Literal["threshold", "uniform"] = "uniform"


class HRankFL(PruningMixin, ServerDataAlgorithm):
    """HRank (Lin et al., 2020) inside FedAvg: after ``prune_round`` rounds every conv loses
    ``⌊p·d_l⌋`` filters of lowest average feature-map rank on server data (fixed uniform rate)."""

    server_data = "optional"
    name = "hrank_fl"
    summary = (
        "FedAvg whose global model loses a fixed share of every conv's filters after prune_round rounds, "
        "those of lowest feature-map rank (HRank) on server data."
    )
    paper = "HRank: Lin et al., CVPR 2020 (a baseline of the FedDUMAP paper)"
    Options = HRankFLOptions


# ==================================================================================== IMC
@dataclass(frozen=True)
class IMCOptions(RateOptions, FamilyOptions):
    """IMC options: FedAP's rate options (Algorithm 3 lines 2–7); the mask covers ``threshold_params``."""


def _threshold_names(model: nn.Module, threshold_params: str) -> list[str]:
    if threshold_params == "all_trainable":
        return [n for n, p in model.named_parameters() if p.requires_grad]
    return [f"{m}.weight" for m, mod in model.named_modules() if isinstance(mod, nn.Conv2d)]


def imc_masks(model: nn.Module, p_star: float, threshold_params: str = "all_trainable") -> dict[str, Tensor]:
    """Global unstructured magnitude masks: keep ``|v| ≥ 𝒱`` with ``𝒱`` the ``⌊ℳ·p*⌋``-th smallest
    ``|v|`` over ``threshold_params`` (the entries strictly below ``𝒱`` are pruned, as in FedAP's
    per-layer rates). Returns parameter name → bool mask."""
    thr = magnitude_threshold(model, float(p_star), threshold_params)
    params = dict(model.named_parameters())
    return {n: params[n].detach().abs() >= thr for n in _threshold_names(model, threshold_params)}


def _apply_masks(model: nn.Module, masks: dict[str, Tensor] | None) -> None:
    """Zero the masked entries of ``model``'s parameters in place (no-op without masks)."""
    if not masks:
        return
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, m in masks.items():
            params[n].mul_(m.to(device=params[n].device, dtype=params[n].dtype))


def _sparse_bytes(state: dict[str, Tensor], masks: dict[str, Tensor]) -> int:
    """Bytes of ``state`` sent sparsely: only the unmasked entries of masked tensors."""
    total = 0
    for k, t in state.items():
        m = masks.get(k)
        total += (int(m.sum()) if m is not None else t.numel()) * t.element_size()
    return int(total)


class IMC(ServerDataAlgorithm):
    """IMC (Zhang et al., NeurIPS 2021) as the FedDUMAP baseline: Formula-15-aggregated Hessian
    rate, then one-shot global unstructured magnitude pruning (masks) after ``prune_round`` rounds."""

    server_data = "optional"
    name = "imc"
    summary = (
        "FedAvg whose global model is pruned once, unstructured, by a global magnitude threshold at a "
        "Hessian-based rate aggregated over devices; the mask is kept from then on."
    )
    paper = "IMC: Zhang et al., NeurIPS 2021 (a baseline of the FedDUMAP paper)"
    Options = IMCOptions
    #: ``masks``: parameter name → bool mask (empty before pruning); ``prune_report``: its audit
    state_fields = (*ServerDataAlgorithm.state_fields, "masks", "prune_report")

    def __init__(self, options: Any | None = None) -> None:
        super().__init__(options)
        self.masks: dict[str, Tensor] = {}
        self.prune_report: dict[str, Any] | None = None

    def apply_masks(self, model: nn.Module) -> None:
        _apply_masks(model, self.masks)

    def before_round(self, ctx: "Context", clients: list[ClientInfo]) -> None:
        pr = int(self.options.prune_round)
        assert self.global_model is not None and self.stats is not None
        if pr >= 0 and int(ctx.round) == pr + 1 and not self.masks:
            with ctx.timer("imc"):
                report = estimate_global_rate(ctx, self.global_model, self.options, self.stats)
                self.masks = imc_masks(self.global_model, report["p_star"], self.options.threshold_params)
                self.apply_masks(self.global_model)
            total = sum(m.numel() for m in self.masks.values())
            kept = sum(int(m.sum()) for m in self.masks.values())
            report.update({"round": int(ctx.round) - 1, "masked_fraction": 1.0 - kept / max(total, 1)})
            self.prune_report = report
        if self.prune_report is not None:
            self.round_extras["prune_p_star"] = float(self.prune_report["p_star"])
            self.round_extras["imc_masked_fraction"] = float(self.prune_report["masked_fraction"])

    def after_aggregate(self, ctx: "Context") -> None:
        assert self.global_model is not None
        self.apply_masks(self.global_model)

    def round_payload(self, ctx: "Context") -> dict[str, Any]:
        """Adds ``masks`` (parameter name -> bool mask) once the model is pruned."""
        out = super().round_payload(ctx)
        if self.masks:
            out["masks"] = dict(self.masks)
        return out

    # ------------------------------------------------------------------ client half
    def device_optimizer(self, ctx: "ClientContext", task: ClientTask, model: nn.Module) -> torch.optim.Optimizer:
        opt = super().device_optimizer(ctx, task, model)
        masks = task.payload.get("masks")
        if masks:
            _apply_masks(model, masks)
            opt.register_step_post_hook(lambda *_: _apply_masks(model, masks))
        return opt

    def local_plan(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> LocalPlan | None:
        """The family's device SGD, with the masks (:meth:`device_optimizer`'s post-step hook)
        applied before and after every step once the model is pruned."""
        sgd = self.device_sgd(ctx, task)
        if sgd is None:
            return None
        masks = task.payload.get("masks") or None
        return LocalPlan(replace(sgd, masked=masks is not None), masks=masks)

    def upload(self, ctx: "ClientContext", task: ClientTask, model: nn.Module, result: dict[str, Any]) -> ClientResult:
        """With masks, ``bytes_up`` / ``bytes_down`` count the unmasked entries only (a sparse
        transfer; the masks themselves are not counted, as before)."""
        upd = super().upload(ctx, task, model, result)
        masks = task.payload.get("masks")
        if masks:
            upd.bytes_up = _sparse_bytes(upd.state, masks)
            upd.bytes_down = _sparse_bytes(task.payload["state"], masks)
            total = sum(p.numel() for p in model.parameters())
            upd.metrics["params_remaining"] = int(total - sum(int((~m).sum()) for m in masks.values()))
        return upd
