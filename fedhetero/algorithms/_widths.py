"""Width planning moved to :mod:`fedhetero.widths` (the client context uses it too)."""

from fedhetero.widths import WidthPlanner

__all__ = ["WidthPlanner"]
