"""Error classes of the ``reparam`` package.

Every refusal of this package is a :class:`ReparamError`, itself a :class:`ValueError`, so callers
that validate input with ``except ValueError`` keep working. Messages say *why* an operation is not
exact and what to do instead.

* :class:`AlignmentError`: a branch cannot be embedded into the main kernel (stride, dilation,
  groups, padding mode, parity or padding mismatch; identity branch on a size-changing conv, ...).
* :class:`NotMergeableError`: the requested structure is not linear-equivalent to one conv (no
  running statistics, nonlinear pooling, padded K×K→K×K chains, out-of-scope layer types, ...).
* :class:`ReparamModeError`: an operation that is exact only in eval mode was asked while a
  BatchNorm is in training mode.
"""

from __future__ import annotations

__all__ = ["ReparamError", "AlignmentError", "NotMergeableError", "ReparamModeError"]


class ReparamError(ValueError):
    """Base class of every error raised by ``reparam``."""


class AlignmentError(ReparamError):
    """A branch's geometry does not align with the main conv (different stride or channels, a
    parity or padding mismatch, taps that fall outside or between the main kernel's taps), so it
    cannot be embedded into the main kernel exactly."""


class NotMergeableError(ReparamError):
    """A structure cannot be merged into one convolution exactly."""


class ReparamModeError(ReparamError):
    """An eval-mode-only operation was requested while a BatchNorm is in training mode."""
