"""FedAvg (McMahan et al., 2017) on the plain global model.

Every client trains the full global model regardless of its budget, so clients whose budget is
below the model's FLOPs are recorded as over budget; the baselines' budget-matched variant is
``fedavg_small`` (every client trains the model that fits the smallest tier).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedhetero.algorithms.base import Algorithm

__all__ = ["FedAvg", "FedAvgSmall"]


class FedAvg(Algorithm):
    """Sample-weighted averaging of full local models (the engine's default hooks)."""

    name = "fedavg"


@dataclass(frozen=True)
class FedAvgSmallOptions:
    width: float | None = None  # None: the widest model that fits the smallest tier's budget


class FedAvgSmall(Algorithm):
    """FedAvg where everybody trains the model that fits the smallest tier (budget-matched)."""

    name = "fedavg_small"
    Options = FedAvgSmallOptions

    def min_budget_macs(self, ctx) -> float | None:
        """Budget-matched (``width`` null): the narrowest width's MACs. A ``width`` given by hand
        is trained by everybody whatever their budget (as FedAvg does): no floor."""
        if self.options.width is not None:
            return None
        from fedhetero.algorithms._widths import narrowest_width_macs

        return narrowest_width_macs(ctx)

    def setup(self, ctx) -> None:
        width = self.options.width
        if width is None:
            from fedhetero import budget as budget_mod

            budget_mod.check_budgets(ctx.cfg, self, ctx)  # a smallest tier no width fits: one error naming it
            width = ctx.width_for_budget(ctx.min_budget_macs())
        self.width = width
        self.global_model = ctx.build_model(width=width)

    def configure(self, ctx, clients):
        tasks = super().configure(ctx, clients)
        for t in tasks:
            t.payload["width"] = self.width
        return tasks
