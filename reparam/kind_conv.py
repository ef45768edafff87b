"""The conv → BN branch kinds: the anchor ``kxk`` and the centred convs ``1x1``, ``1xk``, ``kx1``.

============  ====================================================================================
``kxk``       anchor: host conv → host BN (``conv_bn`` mode) or → :class:`~reparam.layers.FrozenIdentityBN` / BN
``1x1``       ``Conv2d(C, O, 1, stride s, padding P − d(K−1)/2, groups g)`` → BN
``1xk``       ``Conv2d(C, O, (1, K_w))`` → BN;   ``kx1``: ``Conv2d(C, O, (K_h, 1))`` → BN
============  ====================================================================================

All four are a :class:`ConvBNBranch`. Input windows: ``1x1``, ``1xk`` and ``kx1`` read the main
conv's centre taps. When the main padding is too small to centre them with a padding of their own
(an unpadded conv such as LeNet-5's valid 5×5, or a padding below ``d(K−1)/2``), the branch first
takes a window of the input (a crop, :func:`conv_layout`) and then runs its conv with padding 0 and
the main stride. The window is exactly the part of the input the centre taps read, so the branch
still equals its embedded kernel under the main geometry (forward exact in train and eval mode; the
merge exact in eval mode). ``crop=False`` restores the classic rule that refuses these geometries.
"""

from __future__ import annotations

import abc
from typing import Any, Mapping, cast

import torch
import torch.fx
from torch import Tensor, nn

from .errors import AlignmentError, ReparamError
from .geometry import ConvGeometry
from .kernels import batch_norm, run_conv
from .kinds import BranchKind, anchor_name, builtin_kind, Fusion, get_kind, is_kind
from .layers import kaiming_, new_bn, normalise_window
from .merge_algebra import acc_shape, bn_scale_shift, conv_kernel_bias, full_acc, take_rows
from .transforms import Window, check_alignment, embed_kernel, fuse_bn, window_input


__all__ = [
    "ConvBNBranch",
    "conv_layout",
    "branch_geometry",
    "AnchorKind",
    "CentredConvKind",
    "OneByOneKind",
    "OneByKKind",
    "KByOneKind",
]

# cropping the input is a leaf for torch.fx
torch.fx.wrap("window_input")


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
        self.window = normalise_window(window)
        self.padding_mode = padding_mode

    def forward(self, x: Tensor) -> Tensor:
        if self.window is not None:
            x = window_input(x, self.window, self.padding_mode)
        # the anchor runs its host conv's and BN's own kernels (expansion stays bit-exact); the
        # other branches let reparam.kernels choose them for their shapes
        if self.kind == anchor_name():
            out: Tensor = self.bn(self.conv(x))
            return out
        return batch_norm(self.bn, run_conv(self.conv, x))

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
        w, t, b = take_rows(rows, *(terms or self.merge_terms(geometry, dt)))
        bias.add_(b)
        kh, kw = w.shape[2:]
        scale = t.view(-1, 1, 1, 1)
        shape = acc_shape(geometry, rows)
        if (kh, kw) == geometry.kernel_size and (acc is None or tuple(acc.shape) != shape):
            # one pass: promote, scale and add the broadcast accumulator (type promotion to ``dt``)
            return torch.mul(w, scale) if acc is None else torch.addcmul(acc, w, scale)
        acc = full_acc(acc, shape, bias)
        oh, ow = self.offset
        acc[:, :, oh : oh + kh, ow : ow + kw].addcmul_(w, scale)
        return acc


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
    window = normalise_window((win[0], win[1]))
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


def _kernel_pair(geometry: Any) -> tuple[int, int]:
    k = geometry.kernel_size
    return (k, k) if isinstance(k, int) else (int(k[0]), int(k[1]))


class _ConvBNKind(BranchKind):
    """A kind whose modules are :class:`ConvBNBranch`: merged by the module's own in-place
    accumulation."""

    @torch.no_grad()
    def merge_terms(self, branch: nn.Module, geometry: ConvGeometry, dtype: torch.dtype) -> Any:
        return cast(ConvBNBranch, branch).merge_terms(geometry, dtype)

    @torch.no_grad()
    def accumulate(
        self, branch: nn.Module, acc: Tensor | None, bias: Tensor, geometry: ConvGeometry,
        rows: slice | None = None, terms: Any = None,
    ) -> Tensor:
        return cast(ConvBNBranch, branch).accumulate_(acc, bias, geometry, rows, terms)


@builtin_kind
class AnchorKind(_ConvBNKind):
    """``kxk``: the host conv and its norm (built by the block around the host conv, never by
    :func:`~reparam.kinds.make_branch`; it runs as is in the fused training forward, so a zero-γ
    expansion stays bit-exact in training)."""

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

    def build(self, main: ConvGeometry, **kwargs: Any) -> nn.Module:  # type: ignore[override]  # never called with build options
        raise ReparamError("the anchor 'kxk' is the host conv; it is created by DiverseBranchBlock.from_conv")

    def macs(self, geometry: Any, in_hw: tuple[int, int], out_hw: tuple[int, int], options: Mapping[str, Any]) -> int:
        kh, kw = _kernel_pair(geometry)
        return out_hw[0] * out_hw[1] * int(geometry.out_channels) * (int(geometry.in_channels) // int(geometry.groups)) * kh * kw


class CentredConvKind(_ConvBNKind):
    """``conv → BN`` whose kernel (:meth:`branch_kernel`, each axis 1 or the main size) is centred
    in the main kernel, on an input window where the main padding is too small
    (:func:`conv_layout`). In the fused training forward a ``1×1`` kernel's BN is folded into the
    block's shared 1×1 conv (:meth:`reparam.fused.FusedForward.conv_bn`)."""

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
        kaiming_(conv.weight, generator)
        bn = new_bn(main.out_channels, eps, momentum, dict(factory))
        return ConvBNBranch(self.name, conv, bn, offset, window, main.padding_mode)

    def macs(self, geometry: Any, in_hw: tuple[int, int], out_hw: tuple[int, int], options: Mapping[str, Any]) -> int:
        kh, kw = self.branch_kernel(_kernel_pair(geometry))
        return out_hw[0] * out_hw[1] * int(geometry.out_channels) * (int(geometry.in_channels) // int(geometry.groups)) * kh * kw

    def fused_forward(self, branch: nn.Module, x: Tensor, fusion: "Fusion") -> Tensor | None:
        br = cast(ConvBNBranch, branch)
        return fusion.conv_bn(br, br.conv, br.bn, br.window, br.padding_mode)


@builtin_kind
class OneByOneKind(CentredConvKind):
    """``1x1``."""

    name = "1x1"
    order = 10
    in_default = True
    in_first_plan = True

    def branch_kernel(self, main_kernel: tuple[int, int]) -> tuple[int, int]:
        return (1, 1)


@builtin_kind
class OneByKKind(CentredConvKind):
    """``1xk``: ``(1, K_w)``."""

    name = "1xk"
    order = 40

    def branch_kernel(self, main_kernel: tuple[int, int]) -> tuple[int, int]:
        return (1, main_kernel[1])


@builtin_kind
class KByOneKind(CentredConvKind):
    """``kx1``: ``(K_h, 1)``."""

    name = "kx1"
    order = 50

    def branch_kernel(self, main_kernel: tuple[int, int]) -> tuple[int, int]:
        return (main_kernel[0], 1)
