"""FedDU: federated dynamic server update on shared server data (FedDUMAP paper, Algorithm 1).

The server holds a shared, insensitive labelled set ``D_0`` (``data.server_fraction > 0``). After
the n_k-weighted average ``w^{t-1/2}`` of the selected devices' models (Formula 5), the server moves
the aggregate toward a model trained on ``D_0`` with a step that is set every round from the
accuracy of the aggregate on ``D_0``, the Jensen–Shannon non-IID degrees (Formulas 2–3) of the
server data and of the selected devices' pooled data, and a decay in the round index (Formula 7).

Default (the authors' code form, written as an interpolation — exactly Formula 4 with the
FedNova-normalised server gradient of Formula 6)::

    ratio^t = n_0·JS(P̄'^t) / (n_0·JS(P̄'^t) + n'·JS(P_0))
    α^t     = f'(acc^t) · ratio^t · C · decay^(t-1)          # = τ_eff^t / τ   (Formula 7 / τ)
    w_srv   = E epochs of plain SGD on D_0 from w^{t-1/2}     # τ = ⌈n_0/B⌉·E steps
    w^t     = w^{t-1/2} + α^t · (w_srv − w^{t-1/2})          # Formula 4, since τ·η·ḡ_0 = w^{t-1/2} − w_srv

The server step is skipped when ``α^t ≤ alpha_min`` (1e-3, authors' code) or when there is no
server data (then FedDU is FedAvg). ``f'(acc) = 1 − acc`` (the better candidate of the paper's
Table 3), ``C = 1`` (Table 4), ``decay = 0.99`` (the authors' launch scripts), the first round uses
``decay^0`` (as the authors' code does), ``acc^t`` is the clean eval-mode top-1 accuracy of
``w^{t-1/2}`` on the whole server set (the authors' code evaluates with augmentation; the effect is
small). Device and server learning rates decay by ``lr_decay`` (0.99) per round:
``η_t = η_0 · lr_decay^(t-1)`` (the paper's η = 0.1 "with a decay rate of 0.99").

The shared round loop of the FedDUMAP family (:class:`ServerDataAlgorithm`), the formulas above
(:func:`fprime`, :func:`importance_ratio`, :func:`feddu_alpha`, :func:`interpolate_states`,
:func:`server_steps`), :class:`NonIIDStats`, :func:`sgd_epochs` and :class:`FamilyOptions` live in
:mod:`fedhetero.algorithms.feddumap._common` and are re-exported here. FedDU's server step runs in the
server half; the devices run plain SGD at ``η_t`` from their task payload.

Recorded per round (in every client's ``metrics``, hence in ``metrics.jsonl``): ``lr``,
``feddu_alpha`` (α^t, the dynamic step as a fraction of τ), ``feddu_tau_eff`` (α^t·τ),
``feddu_server_acc`` (acc^t), ``feddu_ratio``, ``feddu_js_selected`` (JS(P̄'^t)) and
``feddu_server_step`` (1 when the server step ran). ``macs`` of every update is the forward MACs per
sample of the model the client trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from fedhetero.algorithms.feddumap._common import (
    FPRIMES,
    FamilyOptions,
    NonIIDStats,
    ServerDataAlgorithm,
    feddu_alpha,
    fprime,
    importance_ratio,
    interpolate_states,
    server_steps,
    sgd_epochs,
)
from fedhetero.core.common.options import option

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import Context

__all__ = [
    "FPRIMES",
    "FamilyOptions",
    "FedDUOptions",
    "FedDUStaticOptions",
    "FedDU",
    "FedDUStatic",
    "ServerDataAlgorithm",
    "NonIIDStats",
    "fprime",
    "importance_ratio",
    "feddu_alpha",
    "interpolate_states",
    "sgd_epochs",
    "server_steps",
]


# ==================================================================================== options
@dataclass(frozen=True)
class FedDUOptions(FamilyOptions):
    """FedDU options: ``server_update`` (``interpolate`` = the Formula 4 step above, ``none`` =
    FedAvg), ``fprime`` (``1-acc`` or ``1/(acc+eps)``), ``fprime_eps``, ``C``, ``decay`` (τ_eff decay),
    ``decay_index_base`` (0: the first round uses ``decay^0``), ``alpha_min`` (skip threshold),
    ``server_acc_augment`` (True mimics the authors' code), ``server_epochs`` /
    ``server_batch_size`` (``null`` = ``train.local_epochs`` / ``train.batch_size``)."""

    server_update: Literal["interpolate", "none"] = "interpolate"
    fprime: Literal["1-acc", "1/(acc+eps)"] = "1-acc"
    fprime_eps: float = option(1e-4, gt=0)
    C: float = option(1.0, ge=0)
    decay: float = option(0.99, gt=0, le=1)
    decay_index_base: int = option(0, choices=(0, 1))
    alpha_min: float = option(1e-3, ge=0)
    server_acc_augment: bool = False
    server_epochs: int | None = option(None, ge=1)
    server_batch_size: int | None = option(None, ge=1)


@dataclass(frozen=True)
class FedDUStaticOptions(FedDUOptions):
    """FedDU-S (the paper's static variant): a constant ``τ_eff`` server steps, i.e.
    ``α = tau_eff / τ`` every round (``tau_eff = τ`` re-trains the aggregate fully on ``D_0``)."""

    tau_eff: float = option(10.0, ge=0)


# ==================================================================================== FedDU
class FedDU(ServerDataAlgorithm):
    """FedDU (Algorithm 1): FedAvg of plain-SGD devices, then the dynamic server update of
    Formula 4 with ``τ_eff`` from Formula 7, implemented as the interpolation of the module
    docstring."""

    name = "feddu"
    summary = (
        "FedAvg of plain-SGD devices, then a step towards a model trained on shared server data, sized every "
        "round from accuracy, non-IID degree and a decay."
    )
    paper = "Liu, Jia, Zhang, Yun, Wang et al., ACM TIST (FedDUMAP; journal version of FedDUAP, Zhang et al., IJCAI 2022), Algorithm 1"
    Options = FedDUOptions


class FedDUStatic(ServerDataAlgorithm):
    """FedDU-S (the paper's Table 2): FedDU with a static ``τ_eff``, i.e. a constant
    ``α = τ_eff / τ`` (the normalised server gradient of Formula 6 still averages all τ steps).

    ``α`` exceeds 1 when ``tau_eff > τ`` (Formula 4 then extrapolates along the averaged server
    gradient); the paper's settings (τ_eff ∈ {5, 10, 20, n_0E/B}, τ ≥ 200) never do.
    """

    name = "feddu_static"
    summary = (
        "FedDU with a constant server step (a static effective step count) in place of the dynamic one: the "
        "paper's FedDU-S ablation."
    )
    paper = "Liu, Jia, Zhang, Yun, Wang et al., ACM TIST (FedDUMAP; journal version of FedDUAP, Zhang et al., IJCAI 2022), Table 2"
    Options = FedDUStaticOptions

    def step_alpha(self, ctx: "Context", acc: float, ratio: float) -> float:
        idx = self.server_indices(ctx)
        tau = server_steps(len(idx) if idx is not None else 0, self.server_batch_size(ctx), self.server_epochs(ctx))
        return float(self.options.tau_eff) / tau if tau else 0.0
