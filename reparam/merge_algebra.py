"""The merge algebra shared by the branch kinds: effective conv and norm parameters and the
in-place accumulation of equivalent pairs into one kernel.

:meth:`~reparam.DiverseBranchBlock.merge` sums the branches' equivalent pairs without autograd, in
place, in a compute dtype and, for large kernels, in chunks of output rows
(:meth:`~reparam.kinds.BranchKind.accumulate`). The kinds build their terms from these pieces:

* :func:`conv_kernel_bias` — the effective ``(weight, bias)`` of a conv-like module (a plain conv,
  a weight-standardised host conv, an identity-based 1×1 or a nested block);
* :func:`bn_scale_shift` — a BatchNorm in eval mode as ``t·z + shift``;
* :func:`acc_shape`, :func:`full_acc`, :func:`take_rows`, :func:`add_term` — the accumulator of a
  (chunked) merge and how a term is added to it.

The differentiable transforms (``fuse_bn``, ``embed_kernel``, ...) are in :mod:`reparam.transforms`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .errors import ReparamError
from .geometry import ConvGeometry
from .hostforms import _standardized, standardized_kernel
from .layers import IdentityBasedConv1x1
from .transforms import bn_stats

__all__ = ["conv_kernel_bias", "bn_scale_shift", "acc_shape", "full_acc", "take_rows", "add_term"]


def conv_kernel_bias(
    module: nn.Module, dtype: torch.dtype | None = None, *, fast: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Effective ``(weight, bias)`` of a conv-like module: a plain ``Conv2d`` (for a
    weight-standardised host conv, the standardised kernel it applies, see
    :mod:`reparam.hostforms`), an :class:`~reparam.layers.IdentityBasedConv1x1` (``R + I``) or a
    nested block (its equivalent pair; ``fast`` uses the non-differentiable float64 accumulation of
    :meth:`DiverseBranchBlock.merge`)."""
    nested: Any = module
    if hasattr(nested, "_equivalent"):  # nested DiverseBranchBlock
        pair: tuple[Tensor, Tensor] = nested._merged_pair(dtype or torch.float64) if fast else nested._equivalent(dtype)
        return pair
    b: Tensor | None
    if isinstance(module, IdentityBasedConv1x1):
        w = module.effective_weight()
        b = None
    elif isinstance(module, nn.Conv2d):
        w, b = module.weight, module.bias
        if type(module) is not nn.Conv2d and _standardized(module):
            # the kernel a weight-standardised host conv applies, in the merge dtype (fast: float64)
            w = standardized_kernel(module, dtype if dtype is not None else (torch.float64 if fast else None))
    else:
        raise ReparamError(f"expected a conv module, got {type(module).__name__}")
    if dtype is not None:
        w = w.to(dtype)
        b = None if b is None else b.to(dtype)
    return w, b


def bn_scale_shift(bn: nn.Module, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(t, shift)`` with ``BN(z) = t·z + shift`` in eval mode (``t = γ/σ``, ``shift = β − t·μ``)."""
    s = bn_stats(bn)
    t = torch.rsqrt(s.var.to(dtype) + s.eps)
    if s.gamma is not None:
        t = s.gamma.to(dtype) * t
    shift = -t * s.mean.to(dtype)
    if s.beta is not None:
        shift = shift + s.beta.to(dtype)
    return t, shift


def acc_shape(geometry: ConvGeometry, rows: slice | None = None) -> tuple[int, int, int, int]:
    """Shape of the merge accumulator: the weight shape, or its output rows ``rows`` (a chunk)."""
    o, cg, kh, kw = geometry.weight_shape
    if rows is not None:
        o = len(range(*rows.indices(o)))
    return (o, cg, kh, kw)


def full_acc(acc: Tensor | None, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """A writable full-size accumulator from ``None`` or a broadcastable ``(O, C/g, 1, 1)`` one."""
    if acc is None:
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    if tuple(acc.shape) != tuple(shape):
        return acc.expand(shape).contiguous()
    return acc


def take_rows(rows: slice | None, *tensors: Any) -> tuple[Any, ...]:
    """The output rows ``rows`` of each tensor (``None`` stays ``None``; ``rows=None`` keeps all)."""
    if rows is None:
        return tensors
    return tuple(None if t is None else t[rows] for t in tensors)


def add_term(acc: Tensor | None, term: Tensor, shape: tuple[int, ...], row_scale: Tensor | None = None) -> Tensor:
    """``acc + term`` (times ``row_scale`` when given), ``term`` laid out as ``shape`` once viewed
    through its own shape. ``acc`` may be None or a broadcast ``(O, C/g, 1, 1)`` term: a new
    full-size accumulator is returned then; otherwise ``acc`` is added to in place."""
    full = acc is not None and tuple(acc.shape) == tuple(shape)
    out = acc if acc is not None and full else torch.empty(shape, dtype=term.dtype, device=term.device)
    view = out.view(term.shape)
    if full:
        if row_scale is None:
            view.add_(term)
        else:
            view.addcmul_(term, row_scale)
        return out
    if row_scale is None:
        view.copy_(term)
    else:
        torch.mul(term, row_scale, out=view)
    return out if acc is None else out.add_(acc)
