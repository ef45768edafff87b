"""FedDUM: FedDU with decoupled momentum on devices and server (FedDUMAP paper, Algorithm 2).

Device side (Formula 11): local SGD with ``(1−β')``-dampened momentum whose buffer
restarts at zero every round::

    m'^{t,0} = 0,  w'^{t,0} = w^{t−1}
    m'^{t,t'} = β'·m'^{t,t'−1} + (1−β')·g'(w'^{t,t'−1});   w'^{t,t'} = w'^{t,t'−1} − η'·m'^{t,t'}

written by hand (:class:`DampedMomentumSGD`, defined with the shared round loop in
:mod:`fedhetero.algorithms.feddumap._common` and re-exported here) so that the first step moves by
``η'(1−β')g``; devices upload their model only, so communication equals FedAvg's (``bytes_up`` =
model bytes). The optimiser is built in the client half from the options and ``η_t`` in the task.

Server side (Formula 12 as printed is circular, so its pseudo-gradient is read as the old global
model minus the FedDU output, as the text describes; then Formula 8)::

    w^{t−½} = Σ_k (n_k/n')·w'_k                 # aggregate of device models
    w̃^t     = FedDU(w^{t−½})                    # the FedDU interpolation, the same α^t
    g^t     = w^{t−1} − w̃^t                     # pseudo-gradient = total displacement
    m^t     = β·m^{t−1} + (1−β)·g^t             # Formula 8, (1−β)-dampened; m^1 = g^1 (first_grad)
    w^t     = w^{t−1} − η_s·m^t

with ``β = 0.9`` (the authors' conference code's server momentum), ``η_s = 1`` (``g^t`` is already a
model displacement) and ``β' = 0.9``; the paper gives none of them. The momentum runs over the model's
parameters; buffers (BN running statistics) take ``w̃^t``'s values. It is accumulated in float64.
With ``β = β' = 0`` FedDUM equals FedDU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Literal

import torch
from torch import Tensor

from fedhetero.algorithms.feddumap._common import DampedMomentumSGD, ServerDataAlgorithm
from fedhetero.algorithms.feddumap.feddu import FedDUOptions
from fedhetero.core.common.options import option

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import Context

__all__ = [
    "MOMENTUM_INITS",
    "DampedMomentumSGD",
    "FedDUMOptions",
    "FedDUM",
    "ServerMomentumMixin",
    "server_momentum_step",
]

MOMENTUM_INITS = ("first_grad", "zero", "bias_correct")


def server_momentum_step(
    prev: dict[str, Tensor],
    tilde: dict[str, Tensor],
    momentum: dict[str, Tensor] | None,
    *,
    beta: float = 0.9,
    lr: float = 1.0,
    init: str = "first_grad",
    count: int = 1,
    keys: Iterable[str] | None = None,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """One server momentum update (Formula 8 on the pseudo-gradient of Formula 12, read as ``w^{t−1} − w̃^t``).

    ``prev`` = ``w^{t−1}``, ``tilde`` = ``w̃^t`` (the FedDU output), ``momentum`` = ``m^{t−1}``
    (float64, ``None`` before the first update), ``count`` = the 1-based number of this update.
    Over ``keys`` (default: every floating entry of ``tilde``)::

        g = w^{t−1} − w̃^t
        m = g                    if momentum is None and init == "first_grad"
        m = β·m + (1−β)·g        otherwise (m^0 = 0 for "zero" and "bias_correct")
        m̂ = m / (1 − β^count)    for "bias_correct", else m̂ = m
        w^t = w^{t−1} − lr·m̂

    Everything is computed in float64. Returns ``(w^t state, m^t)``; entries outside ``keys`` take
    ``tilde``'s values. With ``β = 0`` and ``lr = 1``, ``w^t = w̃^t`` (bit-exact for float32
    models up to float64 rounding of the difference, which is exact in practice).
    """
    if init not in MOMENTUM_INITS:
        raise ValueError(f"init must be one of {MOMENTUM_INITS}, got {init!r}")
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"beta must be in [0, 1), got {beta!r}")
    names = [k for k, v in tilde.items() if torch.is_floating_point(v)] if keys is None else list(keys)
    new_state = {k: v.clone() for k, v in tilde.items()}
    new_m: dict[str, Tensor] = {}
    for k in names:
        w_prev = prev[k].to(torch.float64)
        g = w_prev - tilde[k].to(torch.float64)
        if momentum is None or k not in momentum:
            m = g.clone() if init == "first_grad" else (1.0 - beta) * g
        else:
            m = beta * momentum[k].to(torch.float64) + (1.0 - beta) * g
        step = m / (1.0 - beta ** int(count)) if (init == "bias_correct" and beta > 0) else m
        new_state[k] = (w_prev - float(lr) * step).to(tilde[k].dtype)
        new_m[k] = m
    return new_state, new_m


@dataclass(frozen=True)
class FedDUMOptions(FedDUOptions):
    """FedDUM options: FedDU's, plus ``server_momentum`` β (0.9), ``server_lr`` η_s (1.0),
    ``server_momentum_init`` (``first_grad``; ``zero``, ``bias_correct``); ``device_momentum`` β'
    defaults to 0.9."""

    device_momentum: float = 0.9
    server_momentum: float = option(0.9, ge=0, lt=1, note="β")
    server_lr: float = option(1.0, gt=0, note="η_s")
    server_momentum_init: Literal["first_grad", "zero", "bias_correct"] = "first_grad"


class ServerMomentumMixin(ServerDataAlgorithm):
    """Server momentum over the pseudo-gradient ``w^{t−1} − w̃^t`` (Formulas 8 and 12); list it
    before the round-loop class it extends (``class FedDUM(ServerMomentumMixin, ServerDataAlgorithm)``).

    Keeps ``server_momentum_buffer`` (parameter name → float64 tensor) and the update count; both
    are checkpointed. FedDUMAP slices the buffer with the kept channel indices when it prunes.
    """

    server_momentum_buffer: dict[str, Tensor] | None = None
    server_momentum_count: int = 0

    def after_server_update(self, ctx: "Context", prev_state: dict[str, Tensor]) -> None:
        super().after_server_update(ctx, prev_state)
        model = self.global_model
        assert model is not None
        keys = [n for n, _ in model.named_parameters()]
        self.server_momentum_count += 1
        state, m = server_momentum_step(
            prev_state, model.state_dict(), self.server_momentum_buffer,
            beta=float(self.options.server_momentum), lr=float(self.options.server_lr),
            init=str(self.options.server_momentum_init), count=self.server_momentum_count,
            keys=keys,
        )
        model.load_state_dict(state)
        self.server_momentum_buffer = m
        norm = math.sqrt(float(sum((v * v).sum() for v in m.values()))) if m else 0.0
        self.round_extras["server_momentum_norm"] = norm

    # Hand-written: the buffer is saved under "server_momentum" (an empty dict before the first
    # update), the name earlier checkpoints use.
    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["server_momentum"] = {} if self.server_momentum_buffer is None else dict(self.server_momentum_buffer)
        out["server_momentum_count"] = int(self.server_momentum_count)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        m = state.get("server_momentum") or {}
        self.server_momentum_buffer = dict(m) if m else None
        self.server_momentum_count = int(state.get("server_momentum_count", 0))


class FedDUM(ServerMomentumMixin, ServerDataAlgorithm):
    """FedDUM (Algorithm 2): devices run Formula 11 (dampened SGDM, buffer reset every round, only
    the model is uploaded); the server applies FedDU (Formula 4/7) and then momentum over the
    pseudo-gradient (Formulas 12 and 8)."""

    name = "feddum"
    summary = (
        "FedDU with decoupled momentum: dampened momentum SGD on the devices, reset every round, and server "
        "momentum over the FedDU pseudo-gradient."
    )
    paper = "Liu, Jia, Zhang, Yun, Wang et al., ACM TIST (FedDUMAP; journal version of FedDUAP, Zhang et al., IJCAI 2022), Algorithm 2"
    Options = FedDUMOptions
