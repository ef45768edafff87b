"""The ``1x1_avg`` branch kind: dense ``1×1 (C→O) → BN → value pad → AvgPool(K, s) → BN``, or on a
depthwise conv ``pad → AvgPool(K, s) → BN``; merged by transform V (the pool as a kernel)."""

from __future__ import annotations

from typing import Any, Mapping, cast

import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor, nn

from . import fused
from .errors import ReparamError
from .geometry import ConvGeometry
from .kernels import batch_norm, run_conv
from .kinds import BranchKind, builtin_kind, Fusion
from .layers import PAD_MODE, box_mean, kaiming_, new_bn, pad_intermediate
from .merge_algebra import acc_shape, bn_scale_shift, conv_kernel_bias, take_rows
from .transforms import avg_kernel, bn_stats, fuse_bn


__all__ = ["AvgBranch", "AvgKind"]

# the stride-1 mean filter is a leaf for torch.fx (a custom autograd function)
torch.fx.wrap("box_mean")


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
            return box_mean(z, self.kernel_size)
        return F.avg_pool2d(z, self.kernel_size, self.stride, 0, False, True, None)

    def forward(self, x: Tensor) -> Tensor:
        if self.path == "dense":
            z = batch_norm(self.bn1, run_conv(self.conv, x))
            z = pad_intermediate(z, self.padding, self.padding_mode, self.bn1)
            return batch_norm(self.bn2, self._pool(z))
        ph, pw = self.padding
        kh, kw = self.kernel_size
        if self.padding_mode == "zeros" and self.stride != (1, 1) and 2 * ph <= kh and 2 * pw <= kw:
            return batch_norm(self.bn, F.avg_pool2d(x, self.kernel_size, self.stride, self.padding, False, True, None))
        mode = "constant" if self.padding_mode == "zeros" else PAD_MODE[self.padding_mode]
        if (ph, pw) != (0, 0):
            x = F.pad(x, (pw, pw, ph, ph), mode=mode)
        return batch_norm(self.bn, self._pool(x))

    def equivalent_kernel_bias(self, geometry: ConvGeometry, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        kh, kw = self.kernel_size
        if self.path == "dense":
            w1, c1 = conv_kernel_bias(self.conv, dtype)
            k1, b1 = fuse_bn(w1, c1, self.bn1)
            # the pool averages each channel of the intermediate separately, so T-III with the
            # pool kernel reduces to spreading the 1x1 kernel over the window (no O x O product)
            k = k1.expand(-1, -1, kh, kw) / (kh * kw)
            return fuse_bn(k, b1, self.bn2)
        s = bn_stats(self.bn)
        ref = s.mean
        dt = dtype if dtype is not None else (s.gamma.dtype if s.gamma is not None else ref.dtype)
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
        """In-place accumulation (a broadcast add over the window); see
        :meth:`~reparam.kind_conv.ConvBNBranch.accumulate_`."""
        k1, b = take_rows(rows, *(terms or self.merge_terms(geometry, bias.dtype)))
        bias.add_(b)
        if acc is None:
            return cast(Tensor, k1)  # broadcast over the window; the next branch expands it
        if tuple(acc.shape) != acc_shape(geometry, rows):
            return acc + k1
        return acc.add_(k1)


@builtin_kind
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
        for k, d, axis in zip(main.kernel_size, main.dilation, ("height", "width")):
            if k > 1 and d > 1:
                return f"1x1_avg: dilation {d} on the {axis} axis (average pooling has no dilation)"
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
        avg_path = options.get("path")
        path = avg_path or ("depthwise" if main.is_depthwise else "dense")
        if path == "depthwise" and not main.is_depthwise:
            raise ReparamError("avg_path='depthwise' needs a depthwise conv (groups == in == out)")
        if path == "dense":
            conv = nn.Conv2d(in_channels=c, out_channels=o, kernel_size=1, groups=g, bias=False, **fk)
            kaiming_(conv.weight, generator)
            return AvgBranch(
                "dense", main.kernel_size, main.stride, main.padding, main.padding_mode,
                new_bn(o, eps, momentum, fk), conv, new_bn(o, eps, momentum, fk),
            )
        if path == "depthwise":
            return AvgBranch(
                "depthwise", main.kernel_size, main.stride, main.padding, main.padding_mode,
                new_bn(o, eps, momentum, fk),
            )
        raise ReparamError(f"avg_path must be 'dense' or 'depthwise', got {avg_path!r}")

    def options_of(self, branch: nn.Module) -> dict[str, Any]:
        return {"path": cast(AvgBranch, branch).path}

    def macs(self, geometry: Any, in_hw: tuple[int, int], out_hw: tuple[int, int], options: Mapping[str, Any]) -> int:
        c, o, g = int(geometry.in_channels), int(geometry.out_channels), int(geometry.groups)
        path = options.get("path") or ("depthwise" if (g > 1 and g == c == o) else "dense")
        # the pool counts 0; the dense path's 1x1 stage runs at input resolution
        return 0 if path == "depthwise" else in_hw[0] * in_hw[1] * o * (c // g)

    @torch.no_grad()
    def merge_terms(self, branch: nn.Module, geometry: ConvGeometry, dtype: torch.dtype) -> Any:
        return cast(AvgBranch, branch).merge_terms(geometry, dtype)

    @torch.no_grad()
    def accumulate(
        self, branch: nn.Module, acc: Tensor | None, bias: Tensor, geometry: ConvGeometry,
        rows: slice | None = None, terms: Any = None,
    ) -> Tensor:
        return cast(AvgBranch, branch).accumulate_(acc, bias, geometry, rows, terms)

    def fused_forward(self, branch: nn.Module, x: Tensor, fusion: "Fusion") -> Tensor | None:
        return fused.avg(branch, x, fusion.moments)
