"""Branch modules of the Diverse Branch Block.

Each branch is a small ``nn.Module`` with

* ``forward(x)``: the branch's training-time computation (no activation inside);
* ``equivalent_kernel_bias(geometry, dtype=None)``: a pair ``(K, b)`` at the **main** kernel size
  such that, in eval mode, ``branch(x) == conv2d(x, K, b, main geometry)``; differentiable, computed
  in ``dtype`` (default: the parameter dtype);
* ``last_bn``: the BatchNorm whose ``γ = β = 0`` makes a new branch output exactly 0 in train and
  eval mode (zero-γ growth).

The forward of every branch is exact as written; the equivalent pair is exact in eval mode only
(it uses running statistics). :class:`FrozenIdentityBN` is the identity bit for bit in every mode.

Built-in branch kinds (``KINDS`` is also their fixed forward order); each is a
:class:`~reparam.kinds.BranchKind` registered at the end of this module:

============  ====================================================================================
``kxk``       anchor: host conv → host BN (``conv_bn`` mode) or → :class:`FrozenIdentityBN` / BN
``1x1``       ``Conv2d(C, O, 1, stride s, padding P − d(K−1)/2, groups g)`` → BN
``1x1_kxk``   ``1×1 (C→D)`` → BN → value pad ``P`` → ``K×K (D→O, stride s, dilation d)`` → BN
``1x1_avg``   dense: ``1×1 (C→O)`` → BN → value pad → ``AvgPool(K, s)`` → BN; depthwise: pool → BN
``1xk``       ``Conv2d(C, O, (1, K_w))`` → BN;   ``kx1``: ``Conv2d(C, O, (K_h, 1))`` → BN
``identity``  ``BatchNorm2d(C)``
============  ====================================================================================

Input windows. ``1x1``, ``1xk``, ``kx1`` and ``identity`` read the main conv's centre taps. When
the main padding is too small to centre them with a padding of their own (an unpadded conv such
as LeNet-5's valid 5×5, or a padding below ``d(K−1)/2``), the branch first takes a window of the
input (:func:`~reparam.transforms.branch_window`: a crop, for ``identity`` also extra padding) and
then runs its conv with padding 0 and the main stride. The window is exactly the part of the input
the centre taps read, so the branch still equals its embedded kernel under the main geometry
(forward exact in train and eval mode; the merge exact in eval mode). ``crop=False`` restores the
classic rule that refuses these geometries.
"""

from __future__ import annotations

import abc

import math
from typing import Any, Mapping

import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import AlignmentError, ReparamError
from .geometry import ConvGeometry
from .hostforms import _standardized, standardized_kernel
from .kinds import BranchKind, _register_builtin, get_kind, is_kind, kind_names
from .transforms import (
    Window,
    avg_kernel,
    bn_stats,
    branch_window,
    check_alignment,
    check_identity,
    embed_kernel,
    fuse_bn,
    identity_kernel,
    merge_1x1_kxk,
    value_pad,
    window_input,
)

__all__ = [
    "KINDS",
    "FrozenIdentityBN",
    "IdentityBasedConv1x1",
    "ConvBNBranch",
    "OneByOneKxKBranch",
    "AvgBranch",
    "IdentityBranch",
    "branch_geometry",
    "conv_layout",
    "applicability",
    "make_branch",
    "AnchorKind",
    "CentredConvKind",
    "OneByOneKxKKind",
    "AvgKind",
    "IdentityKind",
    "conv_kernel_bias",
    "bn_scale_shift",
]

KINDS: tuple[str, ...] = ("kxk", "1x1", "1x1_kxk", "1x1_avg", "1xk", "kx1", "identity")

# value padding is a leaf for torch.fx (it slice-assigns into a fresh tensor)
torch.fx.wrap("value_pad")
torch.fx.wrap("_box_mean")
torch.fx.wrap("window_input")

_PAD_MODE = {"reflect": "reflect", "replicate": "replicate", "circular": "circular"}


# ---------------------------------------------------------------------------------------------
# norm and conv building blocks


class FrozenIdentityBN(nn.Module):
    """A BatchNorm-shaped identity: ``weight = 1, bias = 0, running_mean = 0, running_var = 1 − eps``.

    Its forward always evaluates the eval-mode BN formula and never updates statistics. Because
    ``sqrt((1 − eps) + eps)`` rounds to exactly 1, the output equals the input bit for bit (float64,
    float32; bfloat16/float16 round back to the input). It is **not** a ``BatchNorm`` subclass, so
    SyncBatchNorm conversion and "freeze BN" utilities leave it alone. It has no trainable
    parameters; ``is_norm = True`` lets optimizer-grouping code treat it as a norm layer.
    """

    is_norm = True

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if num_features <= 0:
            raise ReparamError(f"num_features must be positive, got {num_features}")
        self.num_features = int(num_features)
        self.eps = float(eps)
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.register_buffer("weight", torch.ones(num_features, **kw))
        self.register_buffer("bias", torch.zeros(num_features, **kw))
        self.register_buffer("running_mean", torch.zeros(num_features, **kw))
        self.register_buffer("running_var", torch.full((num_features,), 1.0 - self.eps, **kw))

    def forward(self, x: Tensor) -> Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)

    def _apply(self, fn: Any, recurse: bool = True) -> "FrozenIdentityBN":  # type: ignore[override]
        # keep running_var == 1 - eps exactly in the new dtype (a float32 value cast to float64 is not)
        rv = self.running_var
        was_identity = rv.is_floating_point() and rv.device.type != "meta" and bool(
            torch.all(rv == torch.tensor(1.0 - self.eps, dtype=rv.dtype, device=rv.device))
        )
        out = super()._apply(fn, recurse)
        if was_identity and self.running_var.is_floating_point() and self.running_var.device.type != "meta":
            with torch.no_grad():
                self.running_var.fill_(1.0 - self.eps)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}"


class IdentityBasedConv1x1(nn.Conv2d):
    """A 1×1 conv ``C → C`` (groups ``g``) whose effective weight is ``weight + I``.

    ``weight`` is the residual ``R`` (initialised to 0); ``I`` is a non-persistent buffer created
    with the weight's dtype and device, so it follows ``.to()`` and is absent from ``state_dict()``.
    """

    def __init__(
        self,
        channels: int,
        groups: int = 1,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            in_channels=channels,
            out_channels=channels,
            kernel_size=1,
            stride=1,
            padding=0,
            groups=groups,
            bias=False,
            device=device,
            dtype=dtype,
        )
        nn.init.zeros_(self.weight)
        self.register_buffer(
            "id_tensor",
            identity_kernel(channels, 1, groups, dtype=self.weight.dtype, device=self.weight.device),
            persistent=False,
        )

    def effective_weight(self) -> Tensor:
        """``R + I`` in the weight's dtype."""
        return self.weight + self.id_tensor.to(self.weight.dtype)

    def forward(self, x: Tensor) -> Tensor:
        return F.conv2d(x, self.effective_weight(), None, 1, 0, 1, self.groups)


def conv_kernel_bias(
    module: nn.Module, dtype: torch.dtype | None = None, *, fast: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Effective ``(weight, bias)`` of a conv-like module: a plain ``Conv2d`` (for a
    weight-standardised host conv, the standardised kernel it applies, see
    :mod:`reparam.hostforms`), an :class:`IdentityBasedConv1x1` (``R + I``) or a nested block (its equivalent pair; ``fast`` uses
    the non-differentiable float64 accumulation of :meth:`DiverseBranchBlock.merge`)."""
    if hasattr(module, "_equivalent"):  # nested DiverseBranchBlock
        if fast:
            return module._merged_pair(dtype or torch.float64)  # type: ignore[operator]
        return module._equivalent(dtype)  # type: ignore[operator]
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


def _full_acc(acc: Tensor | None, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """A writable full-size accumulator from ``None`` or a broadcastable ``(O, C/g, 1, 1)`` one."""
    if acc is None:
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    if tuple(acc.shape) != tuple(shape):
        return acc.expand(shape).contiguous()
    return acc


def _take(rows: slice | None, *tensors: Tensor | None) -> tuple[Any, ...]:
    """The output rows ``rows`` of each tensor (``None`` stays ``None``; ``rows=None`` keeps all)."""
    if rows is None:
        return tensors
    return tuple(None if t is None else t[rows] for t in tensors)


def _new_bn(n: int, eps: float, momentum: float | None, factory: dict[str, Any]) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(n, eps=eps, momentum=momentum, affine=True, **factory)


def _pad_value(bn: nn.Module) -> Tensor:
    """Per-channel output of ``bn`` for a zero input, from running statistics (value-padding rule)."""
    mean, var = bn.running_mean, bn.running_var
    weight, bias = bn.weight, bn.bias
    scale = torch.rsqrt(var + bn.eps)
    if weight is not None:
        scale = weight * scale
    value = -mean * scale
    if bias is not None:
        value = bias + value
    return value


def _box_sum(z: Tensor, kh: int, kw: int) -> Tensor:
    """``K_h × K_w`` window sums of ``z`` (stride 1, no padding) as shifted adds; a fresh tensor."""
    if kw > 1:
        acc = z[..., : 1 - kw] + z[..., 1 : (2 - kw) or None]
        for j in range(2, kw):
            acc = acc.add_(z[..., j : (j + 1 - kw) or None])
        z = acc
    if kh > 1:
        acc = z[..., : 1 - kh, :] + z[..., 1 : (2 - kh) or None, :]
        for i in range(2, kh):
            acc = acc.add_(z[..., i : (i + 1 - kh) or None, :])
        z = acc
    return z if kh * kw > 1 else z.clone()


class _BoxMean(torch.autograd.Function):
    """Stride-1 mean filter. The backward is the transposed filter (a box sum of the zero-padded
    gradient), two shifted passes instead of one zero-filled tensor per tap."""

    @staticmethod
    def forward(ctx: Any, z: Tensor, kh: int, kw: int) -> Tensor:  # type: ignore[override]
        ctx.kernel = (kh, kw)
        return _box_sum(z, kh, kw).mul_(1.0 / (kh * kw))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        kh, kw = ctx.kernel
        padded = F.pad(grad, (kw - 1, kw - 1, kh - 1, kh - 1))
        return _box_sum(padded, kh, kw).mul_(1.0 / (kh * kw)), None, None


def _box_mean(z: Tensor, kernel_size: tuple[int, int]) -> Tensor:
    """Stride-1 ``K_h × K_w`` mean filter without padding: the same function as
    ``F.avg_pool2d(z, K, 1)``, several times faster on CPU (forward and backward), and, like pooling,
    not a multiply-accumulate for FLOP counters."""
    return _BoxMean.apply(z, int(kernel_size[0]), int(kernel_size[1]))


def _pad_intermediate(z: Tensor, padding: tuple[int, int], mode: str, bn: nn.Module) -> Tensor:
    if padding == (0, 0):
        return z
    if mode == "zeros":
        return value_pad(z, padding, _pad_value(bn))
    ph, pw = padding
    return F.pad(z, (pw, pw, ph, ph), mode=_PAD_MODE[mode])


# ---------------------------------------------------------------------------------------------
# branches


def _window(window: Any) -> Window | None:
    """A normalised window (``None`` for no window or an all-zero one)."""
    if window is None:
        return None
    (t, b), (left, right) = window
    w = ((int(t), int(b)), (int(left), int(right)))
    return None if w == ((0, 0), (0, 0)) else w


class ConvBNBranch(nn.Module):
    """``conv → bn`` (kinds ``kxk``, ``1x1``, ``1xk``, ``kx1``), optionally on an input window.

    ``offset`` is the embedding position of the branch kernel inside the main kernel; ``window``
    (``((top, bottom), (left, right))``, negative = crop) the input window the conv reads when its
    own padding cannot align it (see the module docstring).
    """

    def __init__(
        self,
        kind: str,
        conv: nn.Module,
        bn: nn.Module,
        offset: tuple[int, int] = (0, 0),
        window: Window | None = None,
        padding_mode: str = "zeros",
    ) -> None:
        super().__init__()
        self.kind = kind
        self.conv = conv
        self.bn = bn
        self.offset = (int(offset[0]), int(offset[1]))
        self.window = _window(window)
        self.padding_mode = padding_mode

    def forward(self, x: Tensor) -> Tensor:
        if self.window is not None:
            x = window_input(x, self.window, self.padding_mode)
        return self.bn(self.conv(x))

    @property
    def last_bn(self) -> nn.Module:
        return self.bn

    def equivalent_kernel_bias(self, geometry: ConvGeometry, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        w, c = conv_kernel_bias(self.conv, dtype)
        k, b = fuse_bn(w, c, self.bn)
        return embed_kernel(k, geometry.kernel_size, self.offset), b

    @torch.no_grad()
    def merge_terms(self, geometry: ConvGeometry, dtype: torch.dtype) -> tuple[Any, ...]:
        """Per-branch quantities of :meth:`accumulate_` computed once per merge: ``(W, t, b)``."""
        w, c = conv_kernel_bias(self.conv, fast=True)
        t, shift = bn_scale_shift(self.bn, dtype)
        return w, t, shift if c is None else shift + t * c.to(dtype)

    @torch.no_grad()
    def accumulate_(
        self, acc: Tensor | None, bias: Tensor, geometry: ConvGeometry, rows: slice | None = None,
        terms: tuple[Any, ...] | None = None,
    ) -> Tensor:
        """Add this branch's equivalent pair to ``acc`` (``(O, C/g, K_h, K_w)``, the compute dtype)
        and ``bias`` in place, without autograd. Returns ``acc`` (allocated when ``None``).

        ``rows`` restricts the pair to a chunk of output channels (``acc`` and ``bias`` then hold
        only those rows; the chunked merge keeps its compute-dtype temporaries cache-sized) and
        ``terms`` passes :meth:`merge_terms` computed once for all chunks."""
        dt = bias.dtype
        w, t, b = _take(rows, *(terms or self.merge_terms(geometry, dt)))
        bias.add_(b)
        kh, kw = w.shape[2:]
        scale = t.view(-1, 1, 1, 1)
        shape = acc_shape(geometry, rows)
        if (kh, kw) == geometry.kernel_size and (acc is None or tuple(acc.shape) != shape):
            # one pass: promote, scale and add the broadcast accumulator (type promotion to ``dt``)
            return torch.mul(w, scale) if acc is None else torch.addcmul(acc, w, scale)
        acc = _full_acc(acc, shape, bias)
        oh, ow = self.offset
        acc[:, :, oh : oh + kh, ow : ow + kw].addcmul_(w, scale)
        return acc


class OneByOneKxKBranch(nn.Module):
    """``1×1 (C→D, groups g) → BN → value pad P → K×K (D→O, stride s, dilation d, padding 0) → BN``.

    With ``D == C`` the first stage is an :class:`IdentityBasedConv1x1` (the branch starts as a
    ``K×K`` conv); otherwise (depthwise default ``D = 2C``) a plain 1×1 conv.
    """

    kind = "1x1_kxk"

    def __init__(
        self,
        conv1: nn.Conv2d,
        bn1: nn.Module,
        conv2: nn.Module,
        bn2: nn.Module,
        padding: tuple[int, int],
        padding_mode: str,
    ) -> None:
        super().__init__()
        self.conv1 = conv1
        self.bn1 = bn1
        self.conv2 = conv2
        self.bn2 = bn2
        self.padding = (int(padding[0]), int(padding[1]))
        self.padding_mode = padding_mode

    @property
    def internal(self) -> int:
        """Internal width ``D``."""
        return int(self.bn1.num_features)

    @property
    def internal_channels(self) -> int:
        return self.internal

    @property
    def last_bn(self) -> nn.Module:
        return self.bn2

    def forward(self, x: Tensor) -> Tensor:
        z = self.bn1(self.conv1(x))
        z = _pad_intermediate(z, self.padding, self.padding_mode, self.bn1)
        return self.bn2(self.conv2(z))

    def equivalent_kernel_bias(self, geometry: ConvGeometry, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        w1, c1 = conv_kernel_bias(self.conv1, dtype)
        k1, b1 = fuse_bn(w1, c1, self.bn1)
        w2, c2 = conv_kernel_bias(self.conv2, dtype)
        k2, b2 = fuse_bn(w2, c2, self.bn2)
        return merge_1x1_kxk(k1, b1, k2, b2, geometry.groups)

    @torch.no_grad()
    def merge_terms(self, geometry: ConvGeometry, dtype: torch.dtype) -> tuple[Any, ...]:
        """The branch's share of the merged pair, computed once per merge in ``dtype``.

        Two forms (see :meth:`accumulate_`):

        * ``("scale", W2, t2, scale, b, b1 per tap)`` when the first stage is an identity-based 1×1
          whose residual ``R`` is exactly zero (a freshly grown branch): the composition is then an
          elementwise scale of ``W2``, ``K[o, c, :] = t2[o]·t1[c]·W2[o, c, :]``, and no matrix
          product is needed.
        * ``("gemm", left, W2, t2, b)`` otherwise (a trained residual or a plain first stage):
          ``left`` (per group ``(C/g + 1) × D/g``) holds ``(A·diag(t1))ᵀ`` with ``b1`` as its last
          row. :meth:`accumulate_` multiplies it, for the output rows of its chunk, by ``W2`` with
          its rows scaled by ``t2`` (taps and output rows as the long dimension): one matrix product
          per chunk and group, whose extra row is ``Σ_d W2·b1`` per tap for the bias. Computing the
          product chunk by chunk keeps its operands and result in cache, where the transposing
          passes around it cost a fraction of what they cost on whole kernels. For a dense conv in
          float32 on the CPU the same product is a 1×1 convolution of ``W2`` (its ``O`` rows as a
          batch of ``D``-channel images of the kernel's size) with ``left`` as the weight
          (:func:`_compose_by_conv`).
        """
        g = geometry.groups
        o, cg = geometry.out_channels, geometry.in_channels // g
        opg = o // g
        t1, b1 = bn_scale_shift(self.bn1, dtype)
        w2, c2 = conv_kernel_bias(self.conv2, fast=True)
        t2, shift2 = bn_scale_shift(self.bn2, dtype)
        dg = w2.shape[1]
        taps = w2.shape[2] * w2.shape[3]
        identity_based = isinstance(self.conv1, IdentityBasedConv1x1)
        if identity_based:
            a, c1 = self.conv1.weight.detach(), None  # the residual R; I is added in ``dtype`` below
        else:
            a, c1 = conv_kernel_bias(self.conv1, fast=True)
        if c1 is not None:
            b1 = b1 + t1 * c1.to(dtype)
        bias = shift2 if c2 is None else shift2 + t2 * c2.to(dtype)
        if identity_based and not bool(a.ne(0).any()):
            # identity part only: K[o, c', :] += t2[o] * t1[d=c'] * W2[o, c', :]
            scale = (t2.view(g, opg, 1) * t1.view(g, 1, dg)).view(o, dg, 1, 1)
            # the first stage's bias through the K×K kernel, Σ_d,taps W2[o, d, :]·b1[d], is added
            # per chunk of rows (where W2 is in cache in the compute dtype), b1 repeated over taps
            b1_taps = b1.view(g, dg, 1).expand(g, dg, taps).reshape(g, -1, 1)
            return ("scale", w2, t2, scale, bias, b1_taps)
        # left operand (g, C/g + 1, D/g): rows c = (A·diag(t1))ᵀ, last row = b1. An identity-based
        # stage is A = R + I with I added here, in the compute dtype (R + 1 in float32 would round)
        left = torch.empty((g, cg + 1, dg), dtype=dtype, device=t1.device)
        torch.mul(a.reshape(g, dg, cg).transpose(1, 2), t1.view(g, 1, dg), out=left[:, :cg])
        if identity_based:
            left[:, :cg].diagonal(dim1=1, dim2=2).add_(t1.view(g, dg))
        left[:, cg].copy_(b1.view(g, dg))
        return ("gemm", left, w2, t2, bias)

    @torch.no_grad()
    def accumulate_(
        self, acc: Tensor | None, bias: Tensor, geometry: ConvGeometry, rows: slice | None = None,
        terms: tuple[Any, ...] | None = None,
    ) -> Tensor:
        """In-place accumulation of T-III; see :meth:`ConvBNBranch.accumulate_` (a chunk of
        ``rows`` lies inside one group or covers whole groups).

        With an identity-based first stage whose residual is zero the composition is an elementwise
        multiply-add; otherwise the product for the chunk's output rows is computed here from the
        operands :meth:`merge_terms` prepared, and added with its output rows moved in front of the
        input channels."""
        dt = bias.dtype
        g = geometry.groups
        o_all = geometry.out_channels
        o, cg, kh, kw = acc_shape(geometry, rows)
        opg = o_all // g  # output rows per group
        g0, gn = 0, g  # first group and groups in this chunk
        r0, r1 = 0, opg  # rows of the group when the chunk lies inside one group
        if rows is not None:
            start, stop = rows.indices(o_all)[:2]
            g0 = start // opg
            if (stop - 1) // opg == g0:  # a chunk inside one group
                gn = 1
                r0, r1 = start - g0 * opg, stop - g0 * opg
            else:  # whole groups
                gn = (stop - start) // opg
        terms = terms or self.merge_terms(geometry, dt)
        if terms[0] == "gemm":
            _, left, w2, t2, b = terms
            w2, t2, b = _take(rows, w2, t2, b)
            if g == 1 and _compose_by_conv(dt, bias.device):
                term, row_scale = _composed_by_conv(bias, left[0], w2, t2, b, cg)
            else:
                term, row_scale = _composed_by_product(bias, left[g0 : g0 + gn], w2, t2, b, r1 - r0), None
            return _add_term(acc, term, (o, cg, kh, kw), row_scale)
        _, w2, t2, scale, b, b1_taps = terms
        w2, t2, scale, b = _take(rows, w2, t2, scale, b)
        w2 = w2.to(dt)  # once per chunk: used by the identity part and the bias
        dg = w2.shape[1]
        opg = r1 - r0
        acc = _full_acc(acc, (o, cg, kh, kw), bias)
        acc.addcmul_(w2, scale)
        through = torch.bmm(w2.view(gn, opg, dg * kh * kw), b1_taps[g0 : g0 + gn]).view(o)
        bias.add_(b).addcmul_(t2, through)
        return acc


def _compose_by_conv(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the ``1x1_kxk`` composition of a dense conv runs as a convolution: float32 on a CPU
    with oneDNN, whose convolution (vectorised for the machine, e.g. AVX-512) ran the product at
    twice the speed of the BLAS matrix product here. float64 (no oneDNN kernel) and other devices
    (where a float32 convolution may use TF32) use the matrix product, as does a process that
    disabled oneDNN or allowed it reduced float32 precision (``fp32_precision`` bf16/tf32)."""
    if dtype != torch.float32 or device.type != "cpu":
        return False
    onednn = torch.backends.mkldnn
    if not (onednn.is_available() and onednn.enabled):
        return False
    full = ("none", "ieee")
    conv = getattr(onednn, "conv", None)
    return getattr(onednn, "fp32_precision", "none") in full and getattr(conv, "fp32_precision", "none") in full


def _composed_by_conv(
    bias: Tensor, left: Tensor, w2: Tensor, t2: Tensor, b: Tensor, cg: int
) -> tuple[Tensor, Tensor]:
    """The composed kernel ``Σ_d W2[o, d, :]·left[c, d]`` (``n × C × K_h × K_w``, to be scaled by the
    returned ``t2`` per output row) by a convolution; its bias row goes into ``bias`` here.

    ``W2`` (``n × D × K_h × K_w``) in channels-last layout is a batch of ``n`` images of ``D``
    channels; ``left`` (``(C + 1) × D``) is the weight of a 1×1 convolution over them, whose output
    channel ``c`` at each tap is the composed kernel and whose channel ``C`` is ``Σ_d W2·b1``."""
    x = w2.to(torch.float32).contiguous(memory_format=torch.channels_last)
    y = F.conv2d(x, left.reshape(left.shape[0], left.shape[1], 1, 1))
    bias.add_(b + t2 * y[:, cg].sum((1, 2)))
    return y[:, :cg], t2.view(-1, 1, 1, 1)


def _composed_by_product(bias: Tensor, left: Tensor, w2: Tensor, t2: Tensor, b: Tensor, n: int) -> Tensor:
    """The composed kernel, rows scaled by ``t2``, by a batched matrix product over the ``gn``
    groups of ``left`` (``gn × (C/g + 1) × D/g``), as a ``(gn, n, C/g, taps)`` view (``n`` output rows
    per group); its bias row goes into ``bias`` here."""
    gn, cg1, dg = left.shape
    taps = w2.shape[2] * w2.shape[3]
    # right operand (gn, D/g, n·taps): W2's rows scaled by t2 and transposed; cast first,
    # contiguously, then one transposing pass in the compute dtype (a transposing cast of float32
    # ran at half that speed)
    right = torch.empty((gn, dg, n, taps), dtype=left.dtype, device=left.device)
    torch.mul(w2.reshape(gn, n, dg, taps).to(left.dtype).transpose(1, 2), t2.view(gn, 1, n, 1), out=right)
    prod = torch.bmm(left, right.view(gn, dg, n * taps)).view(gn, cg1, n, taps)
    bias.add_(b + prod[:, cg1 - 1].sum(-1).reshape(-1))
    return prod[:, : cg1 - 1].transpose(1, 2)


def _add_term(acc: Tensor | None, term: Tensor, shape: tuple[int, ...], row_scale: Tensor | None = None) -> Tensor:
    """``acc + term`` (times ``row_scale`` when given), ``term`` laid out as ``shape`` once viewed
    through its own shape. ``acc`` may be None or a broadcast ``(O, C/g, 1, 1)`` term: a new
    full-size accumulator is returned then; otherwise ``acc`` is added to in place."""
    full = acc is not None and tuple(acc.shape) == tuple(shape)
    out = acc if full else torch.empty(shape, dtype=term.dtype, device=term.device)
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


class AvgBranch(nn.Module):
    """Average-pool branch.

    ``path="dense"``: ``1×1 (C→O, groups g) → BN → value pad P → AvgPool(K, stride s) → BN``.
    ``path="depthwise"`` (``g == C == O``): ``pad P → AvgPool(K, stride s) → BN`` (zero or
    ``padding_mode`` padding, ``count_include_pad=True``).

    The pool has no parameters and no module: stride 1 is evaluated as shifted sums (the same
    function as ``AvgPool2d``, several times faster on CPU), other strides with ``F.avg_pool2d``.
    Neither is a multiply-accumulate for FLOP counters (pooling counts 0 by the project convention).
    """

    kind = "1x1_avg"

    def __init__(
        self,
        path: str,
        kernel_size: tuple[int, int],
        stride: tuple[int, int],
        padding: tuple[int, int],
        padding_mode: str,
        bn2: nn.Module,
        conv: nn.Conv2d | None = None,
        bn1: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if path not in ("dense", "depthwise"):
            raise ReparamError(f"path must be 'dense' or 'depthwise', got {path!r}")
        self.path = path
        self.kernel_size = (int(kernel_size[0]), int(kernel_size[1]))
        self.stride = (int(stride[0]), int(stride[1]))
        self.padding = (int(padding[0]), int(padding[1]))
        self.padding_mode = padding_mode
        if path == "dense":
            if conv is None or bn1 is None:
                raise ReparamError("the dense average path needs conv and bn1")
            self.conv = conv
            self.bn1 = bn1
            self.bn2 = bn2
        else:
            self.bn = bn2
    @property
    def last_bn(self) -> nn.Module:
        return self.bn2 if self.path == "dense" else self.bn

    def _pool(self, z: Tensor) -> Tensor:
        """Average pool (no padding) of an already padded input."""
        if self.stride == (1, 1):
            return _box_mean(z, self.kernel_size)
        return F.avg_pool2d(z, self.kernel_size, self.stride, 0, False, True, None)

    def forward(self, x: Tensor) -> Tensor:
        if self.path == "dense":
            z = self.bn1(self.conv(x))
            z = _pad_intermediate(z, self.padding, self.padding_mode, self.bn1)
            return self.bn2(self._pool(z))
        ph, pw = self.padding
        kh, kw = self.kernel_size
        if self.padding_mode == "zeros" and self.stride != (1, 1) and 2 * ph <= kh and 2 * pw <= kw:
            return self.bn(F.avg_pool2d(x, self.kernel_size, self.stride, self.padding, False, True, None))
        mode = "constant" if self.padding_mode == "zeros" else _PAD_MODE[self.padding_mode]
        if (ph, pw) != (0, 0):
            x = F.pad(x, (pw, pw, ph, ph), mode=mode)
        return self.bn(self._pool(x))

    def equivalent_kernel_bias(self, geometry: ConvGeometry, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        kh, kw = self.kernel_size
        if self.path == "dense":
            w1, c1 = conv_kernel_bias(self.conv, dtype)
            k1, b1 = fuse_bn(w1, c1, self.bn1)
            # the pool averages each channel of the intermediate separately, so T-III with the
            # pool kernel reduces to spreading the 1x1 kernel over the window (no O x O product)
            k = k1.expand(-1, -1, kh, kw) / (kh * kw)
            return fuse_bn(k, b1, self.bn2)
        ref = self.bn.running_mean
        dt = dtype if dtype is not None else (self.bn.weight.dtype if self.bn.weight is not None else ref.dtype)
        k = avg_kernel(geometry.out_channels, self.kernel_size, geometry.groups, dtype=dt, device=ref.device)
        return fuse_bn(k, None, self.bn)

    @torch.no_grad()
    def merge_terms(self, geometry: ConvGeometry, dtype: torch.dtype) -> tuple[Any, ...]:
        """``(k1, b)``: the ``(O, C/g, 1, 1)`` kernel spread over the window and the bias."""
        kh, kw = self.kernel_size
        o, cg = geometry.out_channels, geometry.in_channels // geometry.groups
        if self.path == "dense":
            w1, c1 = conv_kernel_bias(self.conv, fast=True)
            t1, b1 = bn_scale_shift(self.bn1, dtype)
            if c1 is not None:
                b1 = b1 + t1 * c1.to(dtype)
            t2, shift2 = bn_scale_shift(self.bn2, dtype)
            k1 = (w1.reshape(o, cg).to(dtype) * (t1 * t2 / (kh * kw)).view(-1, 1)).view(o, cg, 1, 1)
            return k1, shift2 + t2 * b1
        t, shift = bn_scale_shift(self.bn, dtype)  # depthwise: C/g == 1
        return (t / (kh * kw)).view(o, 1, 1, 1), shift

    @torch.no_grad()
    def accumulate_(
        self, acc: Tensor | None, bias: Tensor, geometry: ConvGeometry, rows: slice | None = None,
        terms: tuple[Any, ...] | None = None,
    ) -> Tensor:
        """In-place accumulation (a broadcast add over the window); see :meth:`ConvBNBranch.accumulate_`."""
        k1, b = _take(rows, *(terms or self.merge_terms(geometry, bias.dtype)))
        bias.add_(b)
        if acc is None:
            return k1  # broadcast over the window; the next branch expands it
        if tuple(acc.shape) != acc_shape(geometry, rows):
            return acc + k1
        return acc.add_(k1)


class IdentityBranch(nn.Module):
    """``BatchNorm2d(C)`` on the input (needs ``C == O``, stride 1 and an odd kernel); on a conv
    that does not preserve the size, on the input window its centre taps read (``window``)."""

    kind = "identity"

    def __init__(self, bn: nn.Module, window: Window | None = None, padding_mode: str = "zeros") -> None:
        super().__init__()
        self.bn = bn
        self.window = _window(window)
        self.padding_mode = padding_mode

    @property
    def last_bn(self) -> nn.Module:
        return self.bn

    def forward(self, x: Tensor) -> Tensor:
        if self.window is not None:
            x = window_input(x, self.window, self.padding_mode)
        return self.bn(x)

    def equivalent_kernel_bias(self, geometry: ConvGeometry, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        ref = self.bn.running_mean
        dt = dtype if dtype is not None else (self.bn.weight.dtype if self.bn.weight is not None else ref.dtype)
        k = identity_kernel(geometry.in_channels, geometry.kernel_size, geometry.groups, dtype=dt, device=ref.device)
        return fuse_bn(k, None, self.bn)

    @torch.no_grad()
    def merge_terms(self, geometry: ConvGeometry, dtype: torch.dtype) -> tuple[Any, ...]:
        """``(t, shift)`` of the BN."""
        return bn_scale_shift(self.bn, dtype)

    @torch.no_grad()
    def accumulate_(
        self, acc: Tensor | None, bias: Tensor, geometry: ConvGeometry, rows: slice | None = None,
        terms: tuple[Any, ...] | None = None,
    ) -> Tensor:
        """In-place accumulation on the centre tap of the diagonal; see :meth:`ConvBNBranch.accumulate_`."""
        acc = _full_acc(acc, acc_shape(geometry, rows), bias)
        t, shift = _take(rows, *(terms or self.merge_terms(geometry, bias.dtype)))
        c = geometry.in_channels
        start, stop, _ = (0, c, 1) if rows is None else rows.indices(c)
        cpg = c // geometry.groups
        kh, kw = geometry.kernel_size
        idx = torch.arange(start, stop, device=acc.device)
        acc[idx - start, idx % cpg, kh // 2, kw // 2] += t
        bias.add_(shift)
        return acc


# ---------------------------------------------------------------------------------------------
# applicability and construction


def conv_layout(
    main: ConvGeometry, kernel_size: tuple[int, int], *, crop: bool = True, name: str = "branch"
) -> tuple[ConvGeometry, Window | None, tuple[int, int]]:
    """Layout of a ``conv → BN`` branch whose kernel (``kernel_size``, each axis 1 or the main
    size) is centred in the main kernel: ``(conv geometry, input window or None, offset)``.

    A unit axis takes the padding ``P − d(K − 1)/2`` that centres it (dilation 1); a full axis
    keeps the main padding and dilation. Where that padding would be negative the axis gets padding
    0 and a crop of the input instead (``crop=True``), so the branch reads exactly the main conv's
    centre taps.

    Raises:
        AlignmentError: parity mismatch (even ``K`` on a unit axis: no centre tap), or a negative
            padding with ``crop=False``.
    """
    ks: list[int] = []
    pads: list[int] = []
    dils: list[int] = []
    offs: list[int] = []
    win: list[tuple[int, int]] = []
    for axis, big_k, k, p, d in zip(("height", "width"), main.kernel_size, kernel_size, main.padding, main.dilation):
        if k == big_k:
            ks.append(k)
            pads.append(p)
            dils.append(d)
            offs.append(0)
            win.append((0, 0))
            continue
        if k != 1 or (big_k - k) % 2:
            raise AlignmentError(
                f"{name}: parity mismatch on the {axis} axis: a size-{k} branch does not centre in kernel "
                f"size {big_k} with dilation {d} (no centre tap)"
            )
        j0 = (big_k - k) // 2
        q = p - d * j0
        ks.append(k)
        dils.append(1)
        offs.append(j0)
        if q >= 0:
            pads.append(q)
            win.append((0, 0))
        elif crop:
            pads.append(0)
            win.append((q, q))
        else:
            raise AlignmentError(
                f"{name}: required branch padding on the {axis} axis is {q} < 0 (main padding {p} is not "
                f"centred: P must be >= d(K-1)/2 = {d * j0}); negative padding needs an input crop "
                "(crop=True)"
            )
    geo = main.replace(kernel_size=(ks[0], ks[1]), padding=(pads[0], pads[1]), dilation=(dils[0], dils[1]), bias=False)
    window = _window((win[0], win[1]))
    # a padded layout is validated by the alignment rule; a windowed one reads the centre taps by
    # construction (transforms.branch_window gives the same crop for its unit axes)
    offset = check_alignment(main, geo) if window is None else (offs[0], offs[1])
    return geo, window, offset


def branch_geometry(kind: str, main: ConvGeometry) -> ConvGeometry:
    """Geometry of the single conv of a centred-conv kind (``1x1``, ``1xk``, ``kx1``) on ``main``
    under the classic rule (no input window): the unit axes take the padding that centres them in
    the main kernel, so the branch reads the main conv's centre taps.

    Raises:
        AlignmentError: the branch does not align (parity mismatch or negative padding).
    """
    k = get_kind(kind) if is_kind(kind) else None
    if not isinstance(k, CentredConvKind):
        raise ReparamError(f"branch_geometry covers centred-conv kinds such as '1x1', '1xk', 'kx1', got {kind!r}")
    return conv_layout(main, k.branch_kernel(main.kernel_size), crop=False, name=kind)[0]


def _avg_reason(main: ConvGeometry) -> str | None:
    for k, d, axis in zip(main.kernel_size, main.dilation, ("height", "width")):
        if k > 1 and d > 1:
            return f"1x1_avg: dilation {d} on the {axis} axis (average pooling has no dilation)"
    return None


def _identity_window(main: ConvGeometry, crop: bool) -> Window | None:
    """Input window of the identity branch (``None``: the conv preserves the size).

    Raises:
        AlignmentError: channels differ, stride ≠ 1, even kernel, or (``crop=False``) a conv that
            does not preserve the size.
    """
    if main.preserves_size or not crop:
        check_identity(main)
        return None
    centred = tuple(d * (k - 1) // 2 for k, d in zip(main.kernel_size, main.dilation))
    check_identity(main.replace(padding=centred))  # channels, stride, odd kernel
    return branch_window(main, (1, 1), ((main.kernel_size[0] - 1) // 2, (main.kernel_size[1] - 1) // 2))


def applicability(main: ConvGeometry, *, crop: bool = True) -> dict[str, str | None]:
    """For every registered kind (forward order): ``None`` if it is applicable to ``main``, else the
    reason it is not. ``crop`` allows input-window branches (see the module docstring)."""
    return {name: get_kind(name).reason(main, crop=crop) for name in kind_names()}


def _kaiming_(weight: Tensor, generator: torch.Generator | None) -> None:
    # Kaiming normal, fan-out, ReLU gain (DyRep's branch init)
    fan_out = weight.shape[0] * weight.shape[2] * weight.shape[3]
    std = math.sqrt(2.0 / fan_out)
    with torch.no_grad():
        if generator is None:
            weight.normal_(0.0, std)
        else:
            weight.copy_(torch.randn(weight.shape, generator=generator, dtype=weight.dtype, device=generator.device).to(weight.device) * std)


def make_branch(
    kind: str,
    main: ConvGeometry,
    *,
    eps: float = 1e-5,
    momentum: float | None = 0.1,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    internal: int | None = None,
    identity_init: bool | None = None,
    avg_path: str | None = None,
    zero_last: bool = True,
    generator: torch.Generator | None = None,
    crop: bool = True,
    options: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Create a new (non-anchor) branch of the registered ``kind`` for the main geometry.

    Convs get Kaiming-normal fan-out init (identity-based residuals 0); inner BNs PyTorch defaults;
    the last BN ``γ = β = 0`` when ``zero_last`` (the branch then outputs exactly 0 in train and eval
    mode). Build options: ``options`` (any kind), or the keywords ``internal``/``identity_init``
    (``1x1_kxk``) and ``avg_path`` (``1x1_avg``, option ``path``).

    Raises:
        AlignmentError: the kind is not applicable to ``main`` (reason in the message).
        ReparamError: unknown kind or option, or a bad option value.
    """
    if not is_kind(kind) or get_kind(kind).anchor:
        accepted = tuple(n for n in kind_names() if not get_kind(n).anchor)
        raise ReparamError(f"kind must be one of {accepted}, got {kind!r}")
    k = get_kind(kind)
    opts = dict(options or {})
    for key, value in (("internal", internal), ("identity_init", identity_init), ("path", avg_path)):
        if value is not None:
            opts[key] = value
    bad = set(opts) - set(k.options)
    if bad:
        raise ReparamError(f"unknown options {sorted(bad)} for branch {kind!r}; accepted: {sorted(k.options)}")
    reason = k.reason(main, crop=crop)
    if reason is not None:
        raise AlignmentError(reason)
    factory: dict[str, Any] = {"device": device, "dtype": dtype}
    branch = k.build(main, eps=eps, momentum=momentum, factory=factory, generator=generator, crop=crop, options=opts)
    if zero_last:
        last = branch.last_bn
        with torch.no_grad():
            last.weight.zero_()  # type: ignore[union-attr, operator]
            last.bias.zero_()  # type: ignore[union-attr, operator]
    return branch


# ---------------------------------------------------------------------------------------------
# the built-in kinds


def _default_internal(geometry: Any) -> int:
    c, o, g = int(geometry.in_channels), int(geometry.out_channels), int(geometry.groups)
    return 2 * c if (g > 1 and g == c == o) else c


def _kernel_pair(geometry: Any) -> tuple[int, int]:
    k = geometry.kernel_size
    return (k, k) if isinstance(k, int) else (int(k[0]), int(k[1]))


class AnchorKind(BranchKind):
    """``kxk``: the host conv and its norm (built by the block, never by :func:`make_branch`)."""

    name = "kxk"
    order = 0
    anchor = True
    in_default = True
    in_depthwise_default = True
    in_first_plan = True
    in_fill = False
    growable = False
    nested_conv = "conv"
    nested_norm = "bn"

    def reason(self, main: ConvGeometry, *, crop: bool = True) -> str | None:
        return None

    def build(self, main: ConvGeometry, **kwargs: Any) -> nn.Module:  # type: ignore[override]
        raise ReparamError("the anchor 'kxk' is the host conv; it is created by DiverseBranchBlock.from_conv")

    def macs(self, geometry: Any, in_hw: tuple[int, int], out_hw: tuple[int, int], options: Mapping[str, Any]) -> int:
        kh, kw = _kernel_pair(geometry)
        return out_hw[0] * out_hw[1] * int(geometry.out_channels) * (int(geometry.in_channels) // int(geometry.groups)) * kh * kw


class CentredConvKind(BranchKind):
    """``conv → BN`` whose kernel (:meth:`branch_kernel`, each axis 1 or the main size) is centred
    in the main kernel, on an input window where the main padding is too small
    (:func:`conv_layout`)."""

    in_fill = True

    @abc.abstractmethod
    def branch_kernel(self, main_kernel: tuple[int, int]) -> tuple[int, int]:
        """The branch kernel size for a main kernel size."""

    def reason(self, main: ConvGeometry, *, crop: bool = True) -> str | None:
        try:
            conv_layout(main, self.branch_kernel(main.kernel_size), crop=crop, name=self.name)
        except AlignmentError as exc:
            return str(exc)
        return None

    def build(
        self,
        main: ConvGeometry,
        *,
        eps: float,
        momentum: float | None,
        factory: Mapping[str, Any],
        generator: torch.Generator | None,
        crop: bool,
        options: Mapping[str, Any],
    ) -> nn.Module:
        geo, window, offset = conv_layout(main, self.branch_kernel(main.kernel_size), crop=crop, name=self.name)
        conv = geo.make_conv(bias=False, **factory)
        _kaiming_(conv.weight, generator)
        bn = _new_bn(main.out_channels, eps, momentum, dict(factory))
        return ConvBNBranch(self.name, conv, bn, offset, window, main.padding_mode)

    def macs(self, geometry: Any, in_hw: tuple[int, int], out_hw: tuple[int, int], options: Mapping[str, Any]) -> int:
        kh, kw = self.branch_kernel(_kernel_pair(geometry))
        return out_hw[0] * out_hw[1] * int(geometry.out_channels) * (int(geometry.in_channels) // int(geometry.groups)) * kh * kw


class OneByOneKind(CentredConvKind):
    """``1x1``."""

    name = "1x1"
    order = 10
    in_default = True
    in_first_plan = True

    def branch_kernel(self, main_kernel: tuple[int, int]) -> tuple[int, int]:
        return (1, 1)


class OneByKKind(CentredConvKind):
    """``1xk``: ``(1, K_w)``."""

    name = "1xk"
    order = 40

    def branch_kernel(self, main_kernel: tuple[int, int]) -> tuple[int, int]:
        return (1, main_kernel[1])


class KByOneKind(CentredConvKind):
    """``kx1``: ``(K_h, 1)``."""

    name = "kx1"
    order = 50

    def branch_kernel(self, main_kernel: tuple[int, int]) -> tuple[int, int]:
        return (main_kernel[0], 1)


class OneByOneKxKKind(BranchKind):
    """``1x1_kxk``: options ``internal`` (width ``D``) and ``identity_init``."""

    name = "1x1_kxk"
    order = 20
    in_default = True
    in_depthwise_default = True
    in_first_plan = True
    options = frozenset({"internal", "identity_init"})
    nested_conv = "conv2"
    nested_norm = "bn2"
    # the second stage already reads the value-padded intermediate (padding 0): its nested block
    # keeps the classic rule and gets only {kxk, 1x1_kxk, 1x1_avg}, whose merges need no window of
    # the padded copy (the outer block's own centred kinds reach the same functions)
    nested_crop = False

    def reason(self, main: ConvGeometry, *, crop: bool = True) -> str | None:
        return None

    def build(
        self,
        main: ConvGeometry,
        *,
        eps: float,
        momentum: float | None,
        factory: Mapping[str, Any],
        generator: torch.Generator | None,
        crop: bool,
        options: Mapping[str, Any],
    ) -> nn.Module:
        c, o, g = main.in_channels, main.out_channels, main.groups
        fk = dict(factory)
        internal = options.get("internal")
        d = (2 * c if main.is_depthwise else c) if internal is None else int(internal)
        if d <= 0 or d % g:
            raise ReparamError(f"internal must be a positive multiple of groups={g}, got {internal!r}")
        identity_init = options.get("identity_init")
        use_id = (d == c) if identity_init is None else bool(identity_init)
        if use_id and d != c:
            raise ReparamError(f"identity_init needs internal == in_channels ({c}), got {d}")
        if use_id:
            conv1: nn.Conv2d = IdentityBasedConv1x1(c, g, **fk)
        else:
            conv1 = nn.Conv2d(in_channels=c, out_channels=d, kernel_size=1, groups=g, bias=False, **fk)
            _kaiming_(conv1.weight, generator)
        conv2 = nn.Conv2d(
            in_channels=d,
            out_channels=o,
            kernel_size=main.kernel_size,
            stride=main.stride,
            padding=0,
            dilation=main.dilation,
            groups=g,
            bias=False,
            **fk,
        )
        _kaiming_(conv2.weight, generator)
        return OneByOneKxKBranch(
            conv1, _new_bn(d, eps, momentum, fk), conv2, _new_bn(o, eps, momentum, fk), main.padding, main.padding_mode
        )

    def options_of(self, branch: nn.Module) -> dict[str, Any]:
        return {"internal": int(branch.internal), "identity_init": isinstance(branch.conv1, IdentityBasedConv1x1)}  # type: ignore[attr-defined]

    def macs(self, geometry: Any, in_hw: tuple[int, int], out_hw: tuple[int, int], options: Mapping[str, Any]) -> int:
        g = int(geometry.groups)
        internal = options.get("internal")
        d = _default_internal(geometry) if internal is None else int(internal)
        if d <= 0 or d % g:
            raise ReparamError(f"internal must be a positive multiple of groups={g}, got {internal!r}")
        kh, kw = _kernel_pair(geometry)
        cin_g = int(geometry.in_channels) // g
        return in_hw[0] * in_hw[1] * d * cin_g + out_hw[0] * out_hw[1] * int(geometry.out_channels) * (d // g) * kh * kw

    def nested_input_hw(self, geometry: Any, in_hw: tuple[int, int]) -> tuple[int, int]:
        # the second stage sees the intermediate value-padded by P
        pad = geometry.padding if not isinstance(geometry.padding, str) else (0, 0)
        ph, pw = (pad, pad) if isinstance(pad, int) else (int(pad[0]), int(pad[1]))
        return (in_hw[0] + 2 * ph, in_hw[1] + 2 * pw)


class AvgKind(BranchKind):
    """``1x1_avg``: option ``path`` (``"dense"`` or ``"depthwise"``)."""

    name = "1x1_avg"
    order = 30
    in_default = True
    in_depthwise_default = True
    in_first_plan = True
    options = frozenset({"path"})
    broadcast_merge = True

    def reason(self, main: ConvGeometry, *, crop: bool = True) -> str | None:
        return _avg_reason(main)

    def build(
        self,
        main: ConvGeometry,
        *,
        eps: float,
        momentum: float | None,
        factory: Mapping[str, Any],
        generator: torch.Generator | None,
        crop: bool,
        options: Mapping[str, Any],
    ) -> nn.Module:
        c, o, g = main.in_channels, main.out_channels, main.groups
        fk = dict(factory)
        avg_path = options.get("path")
        path = avg_path or ("depthwise" if main.is_depthwise else "dense")
        if path == "depthwise" and not main.is_depthwise:
            raise ReparamError("avg_path='depthwise' needs a depthwise conv (groups == in == out)")
        if path == "dense":
            conv = nn.Conv2d(in_channels=c, out_channels=o, kernel_size=1, groups=g, bias=False, **fk)
            _kaiming_(conv.weight, generator)
            return AvgBranch(
                "dense", main.kernel_size, main.stride, main.padding, main.padding_mode,
                _new_bn(o, eps, momentum, fk), conv, _new_bn(o, eps, momentum, fk),
            )
        if path == "depthwise":
            return AvgBranch(
                "depthwise", main.kernel_size, main.stride, main.padding, main.padding_mode,
                _new_bn(o, eps, momentum, fk),
            )
        raise ReparamError(f"avg_path must be 'dense' or 'depthwise', got {avg_path!r}")

    def options_of(self, branch: nn.Module) -> dict[str, Any]:
        return {"path": branch.path}  # type: ignore[attr-defined]

    def macs(self, geometry: Any, in_hw: tuple[int, int], out_hw: tuple[int, int], options: Mapping[str, Any]) -> int:
        c, o, g = int(geometry.in_channels), int(geometry.out_channels), int(geometry.groups)
        path = options.get("path") or ("depthwise" if (g > 1 and g == c == o) else "dense")
        # the pool counts 0; the dense path's 1x1 stage runs at input resolution
        return 0 if path == "depthwise" else in_hw[0] * in_hw[1] * o * (c // g)


class IdentityKind(BranchKind):
    """``identity``: a BN on the input (on its centre-tap window when the conv changes the size)."""

    name = "identity"
    order = 60
    in_default = True
    in_depthwise_default = True

    def reason(self, main: ConvGeometry, *, crop: bool = True) -> str | None:
        try:
            _identity_window(main, crop)
        except AlignmentError as exc:
            return f"identity: {exc}"
        return None

    def build(
        self,
        main: ConvGeometry,
        *,
        eps: float,
        momentum: float | None,
        factory: Mapping[str, Any],
        generator: torch.Generator | None,
        crop: bool,
        options: Mapping[str, Any],
    ) -> nn.Module:
        window = _identity_window(main, crop)
        return IdentityBranch(_new_bn(main.in_channels, eps, momentum, dict(factory)), window, main.padding_mode)

    def macs(self, geometry: Any, in_hw: tuple[int, int], out_hw: tuple[int, int], options: Mapping[str, Any]) -> int:
        return 0


for _kind in (AnchorKind(), OneByOneKind(), OneByOneKxKKind(), AvgKind(), OneByKKind(), KByOneKind(), IdentityKind()):
    _register_builtin(_kind)
assert kind_names() == KINDS
