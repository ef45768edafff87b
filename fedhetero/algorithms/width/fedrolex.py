"""FedRolex: model-heterogeneous FL with rolling sub-model extraction
(Alam, Liu, Yan, Zhang; NeurIPS 2022).

Everything is HeteroFL (:mod:`fedhetero.algorithms.width.heterofl`: absolute FLOPs budgets, the widened
global model, sub-models with exactly the zoo sizes of the client's width, masked per-element
averaging where untouched coordinates keep their value, label-masked classifier rows and masked
cross-entropy, static BN, Scaler, gradient clipping, the decreasing-budget adaptation) **except
which channel indices a client gets**:

* ``mode="roll"`` (the method, default): at server round ``t`` (0-based, ``t = round − 1``) a
  channel group with ``C`` global channels keeps the cyclic window of ``k`` consecutive indices
  starting at offset ``(−t) mod C`` (upstream rolls ``arange(C)`` by ``t`` and takes the first
  ``k``). The window advances one channel per round, wraps around, and all groups share the round
  counter, so identity-tied groups (one group) stay aligned.
* ``mode="random"``: one uniformly random ``k``-subset per channel group per (round, client),
  drawn from the ``algorithm`` random stream (not per layer as upstream's ``ResnetServerRandom``,
  which misaligns residual additions).
* ``mode="static"``: the prefix, i.e. HeteroFL.

Aggregation weighting: ``uniform`` (upstream ``avg``, default), ``samples``, or ``width`` (each
client weighted by its rate ``w / r_g``). Upstream's ``updates``/``updates_width`` and
``--overlap`` are not implemented.

Evaluation: the global model, and per tier the prefix sub-model at the tier's width, each with
sBN statistics re-estimated at its width (upstream's in-loop numbers use test-batch statistics;
``bn="batch"`` reproduces that protocol).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

import torch

from fedhetero.algorithms.width.heterofl import WidthSlicedAlgorithm
from fedhetero.core.common.options import MethodOptions, option
from fedhetero.core.exchange.types import ClientInfo, ClientResult

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import Context

__all__ = ["FedRolex", "FedRolexOptions", "rolling_window"]


def rolling_window(channels: int, keep: int, round_index: int) -> torch.Tensor:
    """Sorted kept indices of FedRolex's window at 0-based server round ``round_index``:
    ``{(−t + j) mod C : j < k}``."""
    if not 1 <= keep <= channels:
        raise ValueError(f"keep must be in [1, {channels}], got {keep}")
    start = (-int(round_index)) % channels
    return torch.sort((start + torch.arange(keep)) % channels).values


@dataclass(frozen=True)
class FedRolexOptions(MethodOptions):
    """FedRolex options (defaults: upstream ``roll`` with ``--weighting avg``)."""

    mode: Literal["roll", "random", "static"] = "roll"
    weighting: Literal["uniform", "samples", "width"] = "uniform"
    bn: Literal["sbn_central", "batch", "fedavg"] = "sbn_central"
    scaler: bool = True
    mask_classifier: bool = True
    mask_fill: float = 0.0
    clip_grad: float | None = option(1.0, gt=0)
    sbn_batch_size: int | None = option(None, ge=1)


class FedRolex(WidthSlicedAlgorithm):
    """FedRolex: HeteroFL with a rolling (or random / static) channel window."""

    name = "fedrolex"
    summary = (
        "HeteroFL with a channel window that rolls one channel further every round, so every channel of the "
        "global model gets trained."
    )
    paper = "Alam, Liu, Yan, Zhang; NeurIPS 2022"
    Options = FedRolexOptions

    def pick(self, ctx: "Context", client: ClientInfo | None) -> Callable[[str, int, int], torch.Tensor] | None:
        """Server side (in :meth:`configure`): the window of server round ``ctx.round``, or the
        random subset of (round, client); the client receives the sliced state only."""
        mode = self.options.mode
        if client is None or mode == "static":
            return None
        if mode == "roll":
            t = ctx.round - 1

            def roll(g: str, n: int, k: int) -> torch.Tensor:
                return rolling_window(n, k, t)

            return roll
        rng = ctx.rng("algorithm", ctx.round, client.cid)

        def random(g: str, n: int, k: int) -> torch.Tensor:
            return torch.as_tensor(rng.permutation(n)[:k], dtype=torch.long)

        return random

    def client_weight(self, update: ClientResult) -> float:
        if self.options.weighting == "width":
            return float(update.payload["width"]) / self.global_width
        return super().client_weight(update)
