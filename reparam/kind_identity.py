"""The ``identity`` branch kind: ``BatchNorm2d(C)`` on the block input (needs ``C == O``, stride 1
and an odd kernel), merged as an identity kernel at the centre tap.

On a conv that does not preserve the size (an unpadded conv, or a padding below ``d(K−1)/2``) the
branch reads the input window the main conv's centre taps read (a crop, or extra padding;
:func:`~reparam.transforms.branch_window`), so it still equals its kernel under the main geometry.
"""

from __future__ import annotations

from typing import Any, Mapping, cast

import torch
import torch.fx
from torch import Tensor, nn

from .errors import AlignmentError
from .geometry import ConvGeometry
from .kinds import BranchKind, builtin_kind, Fusion
from .kernels import batch_norm
from .layers import new_bn, normalise_window
from .merge_algebra import acc_shape, bn_scale_shift, full_acc, take_rows
from .transforms import Window, bn_stats, branch_window, check_identity, fuse_bn, identity_kernel, window_input


__all__ = ["IdentityBranch", "IdentityKind", "identity_window"]

# cropping or padding the input is a leaf for torch.fx
torch.fx.wrap("window_input")


class IdentityBranch(nn.Module):
    """``BatchNorm2d(C)`` on the input (needs ``C == O``, stride 1 and an odd kernel); on a conv
    that does not preserve the size, on the input window its centre taps read (``window``)."""

    kind = "identity"

    def __init__(self, bn: nn.Module, window: Window | None = None, padding_mode: str = "zeros") -> None:
        super().__init__()
        self.bn = bn
        self.window = normalise_window(window)
        self.padding_mode = padding_mode

    @property
    def last_bn(self) -> nn.Module:
        return self.bn

    def forward(self, x: Tensor) -> Tensor:
        if self.window is not None:
            x = window_input(x, self.window, self.padding_mode)
        return batch_norm(self.bn, x)

    def equivalent_kernel_bias(self, geometry: ConvGeometry, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        s = bn_stats(self.bn)
        ref = s.mean
        dt = dtype if dtype is not None else (s.gamma.dtype if s.gamma is not None else ref.dtype)
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
        """In-place accumulation on the centre tap of the diagonal; see
        :meth:`~reparam.kind_conv.ConvBNBranch.accumulate_`."""
        acc = full_acc(acc, acc_shape(geometry, rows), bias)
        t, shift = take_rows(rows, *(terms or self.merge_terms(geometry, bias.dtype)))
        c = geometry.in_channels
        start, stop, _ = (0, c, 1) if rows is None else rows.indices(c)
        cpg = c // geometry.groups
        kh, kw = geometry.kernel_size
        idx = torch.arange(start, stop, device=acc.device)
        acc[idx - start, idx % cpg, kh // 2, kw // 2] += t
        bias.add_(shift)
        return acc


def identity_window(main: ConvGeometry, crop: bool) -> Window | None:
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


@builtin_kind
class IdentityKind(BranchKind):
    """``identity``: a BN on the input (on its centre-tap window when the conv changes the size).
    In the fused training forward its BN is folded into the block's shared 1×1 conv
    (:meth:`reparam.fused.FusedForward.identity_bn`)."""

    name = "identity"
    order = 60
    in_default = True
    in_depthwise_default = True

    def reason(self, main: ConvGeometry, *, crop: bool = True) -> str | None:
        try:
            identity_window(main, crop)
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
        window = identity_window(main, crop)
        return IdentityBranch(new_bn(main.in_channels, eps, momentum, dict(factory)), window, main.padding_mode)

    def macs(self, geometry: Any, in_hw: tuple[int, int], out_hw: tuple[int, int], options: Mapping[str, Any]) -> int:
        return 0

    @torch.no_grad()
    def merge_terms(self, branch: nn.Module, geometry: ConvGeometry, dtype: torch.dtype) -> Any:
        return cast(IdentityBranch, branch).merge_terms(geometry, dtype)

    @torch.no_grad()
    def accumulate(
        self, branch: nn.Module, acc: Tensor | None, bias: Tensor, geometry: ConvGeometry,
        rows: slice | None = None, terms: Any = None,
    ) -> Tensor:
        return cast(IdentityBranch, branch).accumulate_(acc, bias, geometry, rows, terms)

    def fused_forward(self, branch: nn.Module, x: Tensor, fusion: "Fusion") -> Tensor | None:
        br = cast(IdentityBranch, branch)
        return fusion.identity_bn(br, br.bn, br.window, br.padding_mode)
