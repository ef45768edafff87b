"""Fused training forward of a :class:`~reparam.DiverseBranchBlock` (same function, fewer passes).

In training mode every branch BatchNorm normalises with batch statistics, so a block with five
branches makes seven passes of BatchNorm over activation-sized tensors, pads two intermediates by
copying them, and pools one with a stride-1 window sum. On CPU those memory-bound passes, not the
convolutions, are what makes an expanded block slower per multiply-accumulate than a plain conv.
This module evaluates the same function with fewer of them:

* **BN folding by channel moments.** For a 1×1 conv ``y = W x`` (any groups, padding 0) the batch
  statistics of ``y`` follow from the channel mean ``x̄`` and covariance ``Σ`` of the input:
  ``mean(y) = W x̄``, ``var(y) = diag(W Σ Wᵀ)``. One Gram matrix of ``x`` therefore gives the batch
  statistics of every BN that follows a 1×1 stage on the block input (``1x1``, ``1x1_kxk``'s first
  BN, ``1x1_avg``'s first BN) and of the ``identity`` branch BN (``W = I``). Each of these BNs
  becomes a per-channel scale folded into its conv (``t·W``, bias ``β − t·W x̄``), so its
  normalisation pass disappears; running statistics are updated exactly as ``nn.BatchNorm2d``
  does (momentum or cumulative average, unbiased variance). ``1x1`` and ``identity`` then share
  one 1×1 conv.
* **1x1_kxk without a padded copy.** ``conv(value_pad(z), K)`` equals
  ``conv(z, K, padding=P) + conv(R, K)``, with ``R`` a single-sample tensor that holds the pad value
  on its border ring, so the branch convolves ``z`` with implicit zero padding and adds a
  ``(1, O, H', W')`` map. When it is cheaper than computing ``z`` (large spatial size), the folded
  first stage is also merged into the ``K×K`` kernel (T-III on the weights), and the branch is one
  ``K×K`` conv on the block input.
* **Pooling.** The average pool of the value-padded intermediate is a zero-padded mean filter (a
  depthwise transposed conv at stride 1, a depthwise conv otherwise) plus the value times a fixed
  map of the padded fraction of each window. With the first stage folded, the pool commutes with
  the 1×1 conv, so the block input is pooled and the conv runs at the output resolution (4× fewer
  positions at stride 2).

The branch BatchNorms that are not folded (the last BN of ``1x1_kxk`` and ``1x1_avg``, and every
BN where folding does not pay) run through :func:`reparam.kernels.batch_norm`, as they do in the
branch modules' own forwards; the anchor's BN runs as its module.

Branches that read an input window (``1x1`` or ``identity`` on an unpadded conv, see
:mod:`reparam.kind_conv`) are folded the same way, with the moments of their window.

Each branch kind says how its branches take part (:meth:`~reparam.kinds.BranchKind.fused_forward`):
the centred convs and ``identity`` hand their folded BN to :class:`FusedForward`, ``1x1_kxk`` and
``1x1_avg`` run :func:`one_by_one_kxk` and :func:`avg`, the anchor and custom kinds run their
module.

Everything is differentiable with ordinary autograd (the Gram matrix has a custom backward that
writes one gradient tensor), exact in real arithmetic, and equal to the per-branch forward to
rounding (tests: float64 relative error ≤ 1e-10 of outputs, input and parameter gradients and
running statistics). The fused path is used only where it is sure to compute the same thing:
training mode, floating inputs of float32/float64, outputs of at least
:data:`FUSED_MIN_OUTPUT_ELEMENTS` elements or :data:`FUSED_MIN_MACS` host multiply-adds per call (below both its fixed cost exceeds what it saves), no
forward hooks anywhere in the block (hook-based tools such as FLOP counters see the per-branch
modules), not under tracing/scripting/``torch.compile``/autocast/a dispatch mode/a ``torch.func``
transform.
Everything else runs the branch modules as before. Eval mode
is untouched. :func:`fused_training` switches the path off, e.g. to time the per-branch forward.
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import kernels
from .kinds import get_kind
from .layers import IdentityBasedConv1x1, pad_value
from .transforms import Window, avg_kernel, merge_1x1_kxk, value_pad, window_input

__all__ = [
    "fused_training",
    "fused_training_enabled",
    "channel_moments",
    "FusedForward",
    "FOLD_MIN_POSITIONS_PER_CHANNEL",
    "FUSED_MIN_OUTPUT_ELEMENTS",
    "FUSED_MIN_MACS",
]

_STATE = {"enabled": True}

#: the Gram matrix costs ``M·C²`` multiply-adds and the folds a fixed number of small operations, the
#: BN passes they replace (four per block with the default branches) ``M·C`` memory traffic each; BN
#: folding is used when the number of positions ``M = N·H·W`` is at least this many times the input
#: channels. Measured per block, forward and backward, batch 64, 2 threads (folded / BN passes):
#: 128 channels on 16×16 maps (M/C = 128) 93 / 96 ms, at stride 2 66 / 74 ms; 64 on 8×8 (64)
#: 10.3 / 10.1 ms; 128 on 8×8 (32) 28.9 / 27.8; 256 on 8×8 (16) 88 / 83; 512 on 8×8 (8) 323 / 299.
#: Whole models, interleaved: torchvision's resnet18 at 32×32 190.7 / 186.3 / 184.7 ms per step
#: for 8 / 64 / 128, the CIFAR ResNet-18 1,673 / 1,698 ms for 128 / 256 (and 8 ≈ 128).
FOLD_MIN_POSITIONS_PER_CHANNEL = 128

#: the fused forward replaces passes over activations by a fixed number of small tensor operations;
#: below this many output elements per call (e.g. LeNet-5 on 32×32 digits) the per-branch forward
#: is faster and is used instead (measured: 1.2–1.3× slower fused at 0.05–0.13 M elements, break-even
#: near 0.26 M, 6 % faster at 4 M for a single block, more in a whole model)
FUSED_MIN_OUTPUT_ELEMENTS = 1 << 18

#: ... unless the host conv's multiply-adds per call reach this many: wide convs on small maps
#: (torchvision's resnet18 at 32×32: 512 channels on 1×1 maps, 32 K output elements, 151 M
#: multiply-adds) spend their time in convolutions, which the fused forward makes cheaper (no padded
#: intermediate copy, one 1×1 conv for the folded branches); measured there 1.64 → 1.40 times the
#: plain model's time per multiply-add. LeNet-5's blocks (3–5 M at batch 32) stay per-branch at
#: any batch size (their outputs pass the element threshold first).
FUSED_MIN_MACS = 1 << 26


def fused_training_enabled() -> bool:
    """Whether blocks use the fused training forward (default ``True``)."""
    return _STATE["enabled"]


def fused_training(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Context manager that switches the fused training forward on or off (restored on exit)."""
    return kernels.switched(_STATE, enabled)


# ---------------------------------------------------------------------------------------------
# channel moments


class _ChannelMoments(torch.autograd.Function):
    """``(mean, cov)`` over ``(N, H, W)`` of an ``(N, C, H, W)`` tensor; biased covariance."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        n, c = x.shape[:2]
        xv = x.reshape(n, c, -1)
        m = xv.shape[0] * xv.shape[2]
        mean = xv.sum(dim=(0, 2)) / m
        if xv.shape[2] >= c:  # per-sample Grams are small next to x: batched product, then sum
            gram = torch.bmm(xv, xv.transpose(1, 2)).sum(0)
        else:  # small maps, many channels: one (C, M) product
            flat = xv.transpose(0, 1).reshape(c, m)
            gram = flat @ flat.T
        cov = gram.div_(m).sub_(torch.outer(mean, mean))
        ctx.save_for_backward(x, mean)
        return mean, cov

    @staticmethod
    def backward(ctx: Any, g_mean: Tensor | None, g_cov: Tensor | None) -> Tensor:  # type: ignore[override]
        # d/dx_i: (1/M)(G + Gᵀ)(x_i − x̄) + g_mean/M, written into one tensor
        x, mean = ctx.saved_tensors
        n, c = x.shape[:2]
        xv = x.reshape(n, c, -1)
        m = xv.shape[0] * xv.shape[2]
        shift = torch.zeros_like(mean) if g_mean is None else g_mean / m
        if g_cov is None:
            return shift.view(1, c, 1, 1).expand_as(x).contiguous()
        sym = (g_cov + g_cov.T) / m
        dx = torch.bmm(sym.expand(n, c, c), xv)
        dx.add_((shift - sym @ mean).view(1, c, 1))
        return dx.view_as(x)


def channel_moments(x: Tensor) -> tuple[Tensor, Tensor]:
    """Differentiable channel mean ``(C,)`` and biased covariance ``(C, C)`` of ``x`` over ``(N, H, W)``."""
    return _ChannelMoments.apply(x)


class _Moments:
    """Lazily computed channel moments of the block input (and of its strided sub-grid, and of the
    input window a branch reads)."""

    def __init__(self, x: Tensor) -> None:
        self.x = x
        self._cache: dict[tuple[Any, ...], tuple[Tensor, Tensor, int]] = {}

    def get(
        self, stride: tuple[int, int] = (1, 1), window: Window | None = None, padding_mode: str = "zeros"
    ) -> tuple[Tensor, Tensor, int]:
        key = (stride, window, padding_mode if window is not None else "")
        if key not in self._cache:
            x = self.x if window is None else window_input(self.x, window, padding_mode)
            x = x if stride == (1, 1) else x[:, :, :: stride[0], :: stride[1]]
            mean, cov = channel_moments(x)
            self._cache[key] = (mean, cov, x.shape[0] * x.shape[2] * x.shape[3])
        return self._cache[key]


def _windowed(x: Tensor, window: Window | None, padding_mode: str) -> Tensor:
    """The input a branch reads: ``x`` or its input ``window``."""
    return x if window is None else window_input(x, window, padding_mode)


# ---------------------------------------------------------------------------------------------
# folding


def _fold(bn: nn.BatchNorm2d, weight: Tensor, groups: int, moments: tuple[Tensor, Tensor, int]) -> tuple[Tensor, Tensor]:
    """``(t·W, β − t·W x̄)`` with ``BN(conv1x1(x, W) + c) == conv1x1(x, t·W) + (β − t·W x̄)`` (batch
    statistics; a conv bias ``c`` cancels). ``weight`` is ``(O, C/g, 1, 1)``; updates running stats."""
    mean, cov, m = moments
    o, cg = weight.shape[:2]
    g = int(groups)
    w = weight.reshape(g, o // g, cg)
    mu_g = mean.view(g, cg, 1)
    # the g diagonal (C/g × C/g) blocks, one view for every group layout (depthwise: g = C)
    cov_g = cov.view(g, cg, g, cg).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    y_mean = torch.matmul(w, mu_g).reshape(o)
    y_var = (torch.matmul(w, cov_g) * w).sum(-1).reshape(o).clamp_min(0)
    return _scale_shift(bn, weight, y_mean, y_var, m)


def _fold_identity(bn: nn.BatchNorm2d, moments: tuple[Tensor, Tensor, int]) -> tuple[Tensor, Tensor]:
    """Per-channel ``(t, shift)`` of a batch-statistics BN applied to the input itself."""
    mean, cov, m = moments
    return _scale_shift(bn, None, mean, torch.diagonal(cov).clamp_min(0), m)


def _scale_shift(bn: nn.BatchNorm2d, weight: Tensor | None, y_mean: Tensor, y_var: Tensor, m: int) -> tuple[Tensor, Tensor]:
    if m <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got {m}")
    kernels.update_running_stats(bn, y_mean, y_var, m)
    t = torch.rsqrt(y_var + bn.eps)
    if bn.weight is not None:
        t = t * bn.weight
    shift = -t * y_mean
    if bn.bias is not None:
        shift = shift + bn.bias
    if weight is None:
        return t, shift
    return weight * t.view(-1, 1, 1, 1), shift


def _ring_inside(inside: Tensor | None, value: Tensor, padding: tuple[int, int], size: tuple[int, int]) -> Tensor:
    """``(1, D, H + 2P_h, W + 2P_w)``: ``value`` on the border ring, ``inside`` (or 0) in the interior
    (:func:`~reparam.transforms.value_pad` of a constant map; differentiable in both)."""
    d = value.shape[0]
    base = value.new_zeros(1, d, *size) if inside is None else inside.to(value.dtype).view(1, d, 1, 1).expand(1, d, *size)
    return value_pad(base, padding, value)


def _box(channels: int, kernel: tuple[int, int], like: Tensor) -> Tensor:
    """The depthwise mean-filter kernel ``(C, 1, K_h, K_w)`` (T-V with groups = C)."""
    return avg_kernel(channels, kernel, channels, dtype=like.dtype, device=like.device)


class _BoxFilter(torch.autograd.Function):
    """Stride-1 mean filter with zero padding ``P ≤ K − 1``, as a depthwise transposed conv.

    A constant kernel is its own flip, so the correlation equals the transposed conv with padding
    ``K − 1 − P``, and its adjoint is the transposed conv with padding ``P``. oneDNN runs depthwise
    transposed convs several times faster than the forward depthwise conv in NCHW, so both passes use
    them."""

    @staticmethod
    def forward(ctx: Any, z: Tensor, kernel: tuple[int, int], padding: tuple[int, int]) -> Tensor:  # type: ignore[override]
        (kh, kw), (ph, pw) = kernel, padding
        ctx.kernel, ctx.padding = kernel, padding
        c = z.shape[1]
        return F.conv_transpose2d(z, _box(c, kernel, z), None, 1, (kh - 1 - ph, kw - 1 - pw), 0, c)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        c = grad.shape[1]
        return F.conv_transpose2d(grad, _box(c, ctx.kernel, grad), None, 1, ctx.padding, 0, c), None, None


def box_filter(z: Tensor, kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int]) -> Tensor:
    """``AvgPool(K, s, P)`` with ``count_include_pad`` (zero padding) for any ``P``."""
    out_hw = [(size + 2 * p - k) // s + 1 for size, k, s, p in zip(_hw(z), kernel, stride, padding)]
    if all(0 <= p <= k - 1 and size <= k - p and (o - 1) * s <= p
           for size, k, s, p, o in zip(_hw(z), kernel, stride, padding, out_hw)):
        # every window covers the whole map (torchvision's ResNet-18 at 32×32 input: 3×3 windows on
        # its 2×2 and 1×1 maps), so each output is the map's sum over K_h·K_w: 0.47 ms forward and
        # backward at 64 × 256 × 2 × 2 as a depthwise conv
        out = z.sum((2, 3), keepdim=True) * (1.0 / (kernel[0] * kernel[1]))
        return out if out_hw == [1, 1] else out.expand(-1, -1, *out_hw).contiguous()
    if stride == (1, 1) and padding[0] <= kernel[0] - 1 and padding[1] <= kernel[1] - 1:
        return _BoxFilter.apply(z, tuple(kernel), tuple(padding))
    c = z.shape[1]
    return kernels.conv2d(z, _box(c, kernel, z), None, stride, padding, 1, c)


def _padded_fraction(size: tuple[int, int], kernel: tuple[int, int], stride: tuple[int, int],
                     padding: tuple[int, int], like: Tensor) -> Tensor:
    """``(1, 1, H', W')``: the fraction of each pooling window that lies in the padding."""
    ring = _ring_inside(None, torch.ones(1, dtype=like.dtype, device=like.device), padding, size)
    return kernels.conv2d(ring, _box(1, kernel, like), None, stride)


def pool_value_padded(z: Tensor, value: Tensor | None, kernel: tuple[int, int], stride: tuple[int, int],
                      padding: tuple[int, int]) -> Tensor:
    """``AvgPool(K, s)`` (``count_include_pad``) of ``z`` padded by ``padding`` with the per-channel
    ``value`` (zeros for ``None``): a zero-padded mean filter plus ``value ×`` the padded fraction."""
    out = box_filter(z, kernel, stride, padding)
    if value is not None and padding != (0, 0):
        frac = _padded_fraction(_hw(z), kernel, stride, padding, z)
        out = out.add_(value.to(z.dtype).view(1, -1, 1, 1) * frac)
    return out


def conv_value_padded(z: Tensor, conv: nn.Conv2d, value: Tensor, padding: tuple[int, int],
                      inside: Tensor | None = None, weight: Tensor | None = None) -> Tensor:
    """``conv(value_pad(z + inside), conv.weight)`` for ``conv`` with padding 0, computed as a
    zero-padded conv of ``z`` plus the single-sample conv of the ring tensor (which also carries the
    constant ``inside`` and the conv bias). ``weight`` replaces the weight applied to ``z`` (merged
    first stage); the ring always uses ``conv.weight``."""
    w = conv.weight if weight is None else weight
    out = kernels.conv2d(z, w, None, conv.stride, padding, conv.dilation, conv.groups)
    ring = _ring_inside(inside, value.to(z.dtype), padding, _hw(z))
    corr = kernels.conv2d(ring, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)
    return out.add_(corr)


# ---------------------------------------------------------------------------------------------
# applicability


_hooked = kernels.hooked
_batch_bn = kernels.batch_stats_bn
_bn = kernels.batch_norm
_global_hooks = kernels.global_hooks
_plain_conv = kernels.plain_conv


def usable(module: nn.Module, x: Any) -> bool:
    """Whether the fused training forward may run ``module`` (a block or a branch) on ``x``."""
    if not _STATE["enabled"] or not module.training or not isinstance(x, Tensor):
        return False
    if x.dim() != 4 or x.dtype not in (torch.float32, torch.float64) or x.is_complex():
        return False
    if _global_hooks() or not kernels.plain_context(x):  # tracers, compilers, autocast, dispatch modes
        return False
    geometry = getattr(module, "geometry", None)
    if geometry is not None:
        n, _, h, w = x.shape
        (sh, sw) = geometry.stride
        (kh, kw) = geometry.kernel_size
        out = n * geometry.out_channels * ((h + sh - 1) // sh) * ((w + sw - 1) // sw)
        macs = out * (geometry.in_channels // geometry.groups) * kh * kw
        if out < FUSED_MIN_OUTPUT_ELEMENTS and macs < FUSED_MIN_MACS:
            return False
    return not any(_hooked(m) for m in module.modules())


# ---------------------------------------------------------------------------------------------
# branches


def _is_1x1(conv: Any) -> bool:
    return (
        isinstance(conv, nn.Conv2d)
        and tuple(conv.kernel_size) == (1, 1)
        and tuple(conv.padding) == (0, 0)
        and conv.padding_mode == "zeros"
        and not _hooked(conv)
    )


def _hw(t: Tensor) -> tuple[int, int]:
    """The spatial size ``(H, W)`` of ``t``."""
    return (int(t.shape[-2]), int(t.shape[-1]))


def _first_stage_weight(conv: nn.Module) -> Tensor:
    return conv.effective_weight() if isinstance(conv, IdentityBasedConv1x1) else cast(Tensor, conv.weight)


def one_by_one_kxk(branch: Any, x: Tensor, moments: _Moments | None) -> Tensor:
    """``1x1_kxk`` branch in training mode (see the module docstring)."""
    conv1, bn1, conv2 = branch.conv1, branch.bn1, branch.conv2
    padding = branch.padding
    if branch.padding_mode != "zeros" or not _plain_conv(conv2) or tuple(conv2.padding) != (0, 0):
        return branch(x)
    if moments is None or not (_is_1x1(conv1) and tuple(conv1.stride) == (1, 1) and _batch_bn(bn1)):
        z = _bn(bn1, kernels.run_conv(conv1, x))
        return _bn(branch.bn2, conv_value_padded(z, conv2, pad_value(bn1), padding))
    a, shift = _fold(bn1, _first_stage_weight(conv1), conv1.groups, moments.get())
    value = pad_value(bn1)  # after the running-statistics update, as in the per-branch forward
    o, _, kh, kw = conv2.weight.shape
    n, _, h, w = x.shape
    if conv1.groups == conv2.groups and n * h * w >= 2 * o * kh * kw:
        merged, _ = _merge_first_stage(a, conv2.weight, conv2.groups)
        return _bn(branch.bn2, conv_value_padded(x, conv2, value, padding, inside=shift, weight=merged))
    z = kernels.conv2d(x, a, shift, 1, 0, 1, conv1.groups)
    return _bn(branch.bn2, conv_value_padded(z, conv2, value, padding))


def _merge_first_stage(a: Tensor, k2: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    k, b = merge_1x1_kxk(a, None, k2, None, groups)
    return k.contiguous(), b  # the einsum leaves a permuted layout; oneDNN would copy activations for it


def avg(branch: Any, x: Tensor, moments: _Moments | None) -> Tensor:
    """``1x1_avg`` branch in training mode (see the module docstring)."""
    if branch.padding_mode != "zeros":
        return branch(x)
    if branch.path == "depthwise":
        return _bn(branch.bn, pool_value_padded(x, None, branch.kernel_size, branch.stride, branch.padding))
    conv, bn1 = branch.conv, branch.bn1
    if moments is not None and _is_1x1(conv) and tuple(conv.stride) == (1, 1) and _batch_bn(bn1):
        a, shift = _fold(bn1, conv.weight, conv.groups, moments.get())
        value = pad_value(bn1)
        if branch.stride != (1, 1) or x.shape[1] <= a.shape[0]:
            # the pool commutes with the folded 1×1 conv: pool the input (no wider than the
            # intermediate, or strided), then convolve at the output resolution;
            # pool(pad_v(Ax + b)) = A·pool_0(x) + b + (v − b)·frac
            pooled = box_filter(x, branch.kernel_size, branch.stride, branch.padding)
            y = kernels.conv2d(pooled, a, shift, 1, 0, 1, conv.groups)
            if branch.padding != (0, 0):
                frac = _padded_fraction(_hw(x), branch.kernel_size, branch.stride, branch.padding, x)
                y = y.add_((value.to(x.dtype) - shift).view(1, -1, 1, 1) * frac)
            return _bn(branch.bn2, y)
        z = kernels.conv2d(x, a, shift, 1, 0, 1, conv.groups)
    else:
        z = _bn(bn1, kernels.run_conv(conv, x))
        value = pad_value(bn1)
    return _bn(branch.bn2, pool_value_padded(z, value, branch.kernel_size, branch.stride, branch.padding))


# ---------------------------------------------------------------------------------------------
# block


class FusedForward:
    """One fused training forward of a block on the input ``x``: its channel moments (when BN
    folding pays off, ``moments``; else ``None``) and the 1×1 branches folded into one grouped 1×1
    conv. Each branch kind contributes through
    :meth:`~reparam.kinds.BranchKind.fused_forward`, which may call :meth:`conv_bn` or
    :meth:`identity_bn`; :meth:`finish` returns what was handed over."""

    def __init__(self, x: Tensor) -> None:
        n, c, h, w = x.shape
        self.x = x
        self.fold_ok = n * h * w > 1 and n * h * w >= FOLD_MIN_POSITIONS_PER_CHANNEL * c
        self.moments = _Moments(x) if self.fold_ok else None
        self._lin_w: Tensor | None = None  # folded 1x1 (+ identity) as one grouped 1x1 conv
        self._lin_b: Tensor | None = None
        self._lin_geo: tuple[tuple[int, int], int, Window | None] | None = None  # (stride, groups, input window)
        self._lin_x = x  # the input (window) the folded 1x1 conv reads
        self._identity: tuple[nn.BatchNorm2d, Window | None, str] | None = None

    def conv_bn(self, branch: nn.Module, conv: nn.Module, bn: nn.Module, window: Window | None,
                padding_mode: str) -> Tensor | None:
        """A ``conv → bn`` branch on its input ``window``: a 1×1 conv (padding 0) followed by a
        batch-statistics BN is folded into the shared 1×1 conv (``None``; the first such branch
        starts it) or run as its own folded conv; any other runs as ``branch(x)``."""
        x = self.x
        if self.moments is None or not (_is_1x1(conv) and _batch_bn(bn)):
            out: Tensor = branch(x)
            return out
        conv2d, batch_bn = cast(nn.Conv2d, conv), cast(nn.BatchNorm2d, bn)
        xin = _windowed(x, window, padding_mode)
        hin, win = xin.shape[-2:]
        stride = (int(conv2d.stride[0]), int(conv2d.stride[1]))
        if not x.shape[0] * ((hin - 1) // stride[0] + 1) * ((win - 1) // stride[1] + 1) > 1:
            out = branch(x)
            return out
        a, shift = _fold(batch_bn, conv2d.weight, conv2d.groups, self.moments.get(stride, window, padding_mode))
        if self._lin_w is None:
            self._lin_w, self._lin_b, self._lin_geo, self._lin_x = a, shift, (stride, conv2d.groups, window), xin
            return None
        return kernels.conv2d(xin, a, shift, stride, 0, 1, conv2d.groups)

    def identity_bn(self, branch: nn.Module, bn: nn.Module, window: Window | None, padding_mode: str) -> Tensor | None:
        """A BN on the input ``window``: with batch statistics it is folded (``None``; into the
        shared 1×1 conv when that reads the same window at stride 1, see :meth:`finish`); otherwise
        it runs as ``branch(x)``."""
        x = self.x
        if self.moments is not None and _batch_bn(bn):
            hin, win = _windowed(x, window, padding_mode).shape[-2:]
            if x.shape[0] * hin * win > 1:
                self._identity = (cast(nn.BatchNorm2d, bn), window, padding_mode)
                return None
        out: Tensor = branch(x)
        return out

    def finish(self) -> list[Tensor]:
        """The outputs of the branches handed over by :meth:`conv_bn` and :meth:`identity_bn`."""
        parts: list[Tensor] = []
        lin_w, lin_b, lin_geo = self._lin_w, self._lin_b, self._lin_geo
        if self._identity is not None and self.moments is not None:
            bn, window, padding_mode = self._identity
            x = self.x
            t, shift = _fold_identity(bn, self.moments.get((1, 1), window, padding_mode))
            if lin_w is not None and lin_b is not None and lin_geo is not None and lin_geo[0] == (1, 1) and lin_geo[2] == window:
                c = x.shape[1]
                cpg = lin_w.shape[1]
                idx = torch.arange(c, device=x.device)
                eye = torch.zeros_like(lin_w).index_put_((idx, idx % cpg, idx.new_zeros(c), idx.new_zeros(c)), t)
                lin_w = lin_w + eye
                lin_b = lin_b + shift
            else:
                parts.append(torch.addcmul(shift.view(1, -1, 1, 1), _windowed(x, window, padding_mode), t.view(1, -1, 1, 1)))
        if lin_w is not None and lin_geo is not None:
            parts.append(kernels.conv2d(self._lin_x, lin_w, lin_b, lin_geo[0], 0, 1, lin_geo[1]))
        return parts


def block_forward(block: Any, x: Tensor) -> Tensor:
    """The fused training forward of a block whose :func:`usable` check passed: each branch's
    :meth:`~reparam.kinds.BranchKind.fused_forward` in forward order, then what the branches handed
    over (:meth:`FusedForward.finish`), summed in that order."""
    fusion = FusedForward(x)
    parts: list[Tensor] = []
    for name in block.branch_names:
        part = get_kind(name).fused_forward(block.branches[name], x, fusion)
        if part is not None:
            parts.append(part)
    parts.extend(fusion.finish())
    out = parts[0] + parts[1] if len(parts) > 1 else parts[0]
    for p in parts[2:]:
        out = out.add_(p)
    return out
