"""FedAvg (McMahan et al., 2017) on the plain global model.

Every client trains the full global model regardless of its budget, so clients whose budget is
below the model's FLOPs are recorded as over budget; the baselines' budget-matched variant is
``fedavg_small`` (every client trains the model that fits the smallest tier).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fedhetero.core.hetero import budget as budget_mod
from fedhetero.core.method.algorithm import Algorithm
from fedhetero.core.common.options import MethodOptions, option
from fedhetero.core.exchange.types import ClientInfo, ClientTask
from fedhetero.core.hetero.widths import narrowest_width_macs

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import Context, RunContext

__all__ = ["FedAvg", "FedAvgSmall"]


class FedAvg(Algorithm):
    """Sample-weighted averaging of full local models (the engine's default hooks)."""

    name = "fedavg"
    summary = (
        "Every client trains the full global model on its own data and the server takes the sample-weighted "
        "average of the returned models."
    )
    paper = "McMahan et al., AISTATS 2017"


@dataclass(frozen=True)
class FedAvgSmallOptions(MethodOptions):
    width: float | None = option(None, gt=0, le=64)  # None: the widest model that fits the smallest tier's budget


class FedAvgSmall(Algorithm):
    """FedAvg where everybody trains the model that fits the smallest tier (budget-matched)."""

    name = "fedavg_small"
    summary = (
        "FedAvg in which every client trains the narrower model that fits the smallest tier's budget (the "
        "budget-matched baseline)."
    )
    paper = "McMahan et al., AISTATS 2017 (FedAvg), run budget-matched"
    Options = FedAvgSmallOptions

    def min_budget_macs(self, ctx: "RunContext") -> float | None:
        """Budget-matched (``width`` null): the narrowest width's MACs. A ``width`` given by hand
        is trained by everybody whatever their budget (as FedAvg does): no floor."""
        if self.options.width is not None:
            return None

        return narrowest_width_macs(ctx)

    def setup(self, ctx: "Context") -> None:
        width = self.options.width
        if width is None:
            budget_mod.check_budgets(ctx.cfg, self, ctx)  # a smallest tier no width fits: one error naming it
            width = ctx.width_for_budget(ctx.min_budget_macs())
        self.width = width
        self.global_model = ctx.build_model(width=width)

    def configure(self, ctx: "Context", clients: list[ClientInfo]) -> list[ClientTask]:
        tasks = super().configure(ctx, clients)
        for t in tasks:
            t.payload["width"] = self.width
        return tasks
