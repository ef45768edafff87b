"""Width planning: the widest model of the configured family that fits a budget.

Tier budgets are absolute MACs, ``ratio × plain MACs``, and the large tiers exceed the plain model
(1:2:3 units), so the width-slicing baselines' global model and the KD baselines' larger family
members are *wider* than the configured model (≈ √3 × for 3 units on a conv net).
:class:`WidthPlanner` (used by the client context's ``width_for_budget`` and by the width and KD
methods) searches multiples of ``w0/16`` (``w0`` = the configured width; the HeteroFL levels
``w0·{1, ½, ¼, ⅛, 1/16}`` included), extended far enough to contain every width whose MACs can fit
the budget (MACs grow at least linearly in the width above ``w0``, so
``w ≤ w0 · budget / plain MACs``). :func:`narrowest_width_macs` is the budget floor of the
width-planned methods: the MACs of the narrowest width the planner can choose.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Protocol

from torch import nn

from fedhetero.core.hetero import budget as budget_mod

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.common.config import RunConfig


class WidthContext(Protocol):
    """What width planning reads from the run's context
    (:class:`~fedhetero.core.local.context.RunContext`, which holds a planner, so it is named here by
    what it offers rather than imported)."""

    cfg: "RunConfig"
    cache: dict[Any, Any]
    input_shape: tuple[int, int, int]

    @property
    def plain_macs(self) -> float:
        """The plain model's forward MACs per sample."""

    def build_model(self, width: float | None = None, **overrides: Any) -> nn.Module:
        """The configured model at ``width``."""

__all__ = ["WidthPlanner", "narrowest_width", "narrowest_width_macs"]


class WidthPlanner:
    """Largest width whose measured MACs fit a budget, with results cached per budget.

    ``ctx`` is the server's or a client's context (only the config, the model builder and the plain
    model's MACs are used). ``builder(width)`` builds the model family (default: the configured
    architecture through ``ctx.build_model``); ``step`` is relative to the configured width.
    :meth:`width_for` raises ``ValueError`` when even the narrowest grid width does not fit;
    :meth:`try_width_for` returns ``None`` instead.
    """

    def __init__(
        self, ctx: WidthContext, builder: Callable[[float], nn.Module] | None = None, step: float = 1 / 16
    ) -> None:
        self._ctx = ctx
        self._builder = builder if builder is not None else (lambda w: ctx.build_model(width=w))
        self._w0 = float(ctx.cfg.model.width)
        self._step = float(step) * self._w0
        self._cache: dict[float, float | None] = {}
        self._macs: dict[float, int] = {}

    def grid(self, budget_macs: float) -> tuple[float, ...]:
        ratio = max(1.0, float(budget_macs) / max(float(self._ctx.plain_macs), 1.0))
        top = self._step * math.ceil(self._w0 * ratio / self._step + 1e-9) + self._step
        levels = tuple(self._w0 * lv for lv in budget_mod.HETEROFL_LEVELS)
        return budget_mod.width_grid(self._step, max(top, self._w0), include=(self._w0, *levels))

    def try_width_for(self, budget_macs: float) -> float | None:
        """Largest grid width fitting ``budget_macs``, or ``None`` when nothing fits."""
        key = round(float(budget_macs), 3)
        if key not in self._cache:
            try:
                grid = self.grid(budget_macs)
                width = budget_mod.largest_width(self._builder, float(budget_macs), self._ctx.input_shape, grid)
                self._cache[key] = float(width)
            except ValueError:
                self._cache[key] = None
        return self._cache[key]

    def width_for(self, budget_macs: float) -> float:
        """Largest grid width fitting ``budget_macs`` (``ValueError`` when nothing fits)."""
        w = self.try_width_for(budget_macs)
        if w is None:
            raise ValueError(
                f"no width of the model fits the budget of {float(budget_macs):.6g} MACs per sample"
            )
        return w

    def macs_at(self, width: float) -> int:
        """Forward MACs per sample of the family member at ``width`` (cached)."""
        w = float(width)
        if w not in self._macs:
            self._macs[w] = int(budget_mod.macs(self._builder(w), self._ctx.input_shape))
        return self._macs[w]


def narrowest_width(ctx: WidthContext) -> float:
    """The narrowest width a :class:`WidthPlanner` of ``ctx`` searches (``model.width / 16``)."""
    return min(WidthPlanner(ctx).grid(float(ctx.plain_macs)))


def narrowest_width_macs(
    ctx: WidthContext, builder: Callable[[float], nn.Module] | None = None, width: float | None = None
) -> float:
    """Forward MACs per sample of the family member at ``width`` (default: the narrowest width
    the planner can choose), built by ``builder`` (default: the configured model): the smallest
    budget a width-planned method can meet (cached in ``ctx.cache`` for the configured model)."""
    w = narrowest_width(ctx) if width is None else float(width)
    if builder is not None:
        return float(WidthPlanner(ctx, builder).macs_at(w))
    key = ("budget-floor", w)
    hit = ctx.cache.get(key)
    if hit is None:
        hit = ctx.cache[key] = float(WidthPlanner(ctx).macs_at(w))
    return float(hit)
