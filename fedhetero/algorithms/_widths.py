"""Width planning moved to :mod:`fedhetero.widths` (the client context uses it too).

:func:`narrowest_width_macs` is the budget floor of the width-planned methods (HeteroFL, FedRolex,
SplitMix, the KD families): the MACs of the narrowest width their planner can choose.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from torch import nn

from fedhetero.widths import WidthPlanner

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.context import ClientContext

__all__ = ["WidthPlanner", "narrowest_width", "narrowest_width_macs"]


def narrowest_width(ctx: "ClientContext") -> float:
    """The narrowest width a :class:`WidthPlanner` of ``ctx`` searches (``model.width / 16``)."""
    return min(WidthPlanner(ctx)._grid(float(ctx.plain_macs)))


def narrowest_width_macs(
    ctx: "ClientContext", builder: Callable[[float], nn.Module] | None = None, width: float | None = None
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
