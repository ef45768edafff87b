"""The seven built-in branch kinds, registered on import (``import reparam`` imports this module).

Each kind is one :class:`~reparam.kinds.BranchKind` class in the module of its family, registered
where it is defined; :data:`KINDS` is also their fixed forward order:

============  ===================================================================  =================
kind          branch (``C → O``, main kernel ``K``, stride ``s``, padding ``P``)   module
============  ===================================================================  =================
``kxk``       anchor: host conv → host BN (``conv_bn`` mode) or → frozen identity  ``kind_conv``
              / BN (``conv`` mode)
``1x1``       ``Conv2d(C, O, 1, stride s, padding P − d(K−1)/2, groups g)`` → BN   ``kind_conv``
``1x1_kxk``   ``1×1 (C→D)`` → BN → value pad ``P`` → ``K×K (D→O, s, dilation d)``  ``kind_1x1_kxk``
              → BN
``1x1_avg``   dense: ``1×1 (C→O)`` → BN → value pad → ``AvgPool(K, s)`` → BN;      ``kind_avg``
              depthwise: pool → BN
``1xk``       ``Conv2d(C, O, (1, K_w))`` → BN                                       ``kind_conv``
``kx1``       ``Conv2d(C, O, (K_h, 1))`` → BN                                       ``kind_conv``
``identity``  ``BatchNorm2d(C)``                                                    ``kind_identity``
============  ===================================================================  =================

``1x1``, ``1xk``, ``kx1`` and ``identity`` read the main conv's centre taps; where the main padding
is too small to centre them they read a window of the input instead (see
:mod:`reparam.kind_conv`). Each branch module provides ``forward``, ``equivalent_kernel_bias``
(exact in eval mode) and ``last_bn``, and the in-place ``merge_terms`` / ``accumulate_`` its kind
merges with.
"""

from __future__ import annotations

from . import kind_1x1_kxk, kind_avg, kind_conv, kind_identity
from .kinds import kind_names

__all__ = ["KINDS"]

_FAMILIES = (kind_conv, kind_1x1_kxk, kind_avg, kind_identity)

#: the built-in kinds in their fixed forward order (every registered kind: :func:`reparam.kinds.kind_names`)
KINDS: tuple[str, ...] = kind_names()
