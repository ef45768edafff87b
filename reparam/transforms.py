"""Pure tensor transforms of structural re-parameterization (the kernel algebra every merge uses).

One side-effect-free function per transform of the Diverse Branch Block paper:

=======================  =========================================================================
``fuse_bn``              T-I: fold a BatchNorm (eval statistics) into the preceding conv
``unfold_bn``            inverse of T-I with chosen BN statistics (folding and re-solving branches)
``add_branches``         T-II: sum of parallel equivalent pairs
``merge_1x1_kxk``        T-III: sequential 1×1 → K×K, any groups, one vectorised einsum
``concat_depth``         T-IV: depth concatenation
``avg_kernel``           T-V: average pooling as a grouped conv kernel
``embed_kernel``         T-VI: embed a smaller kernel into the main kernel size (per-axis offsets)
``check_alignment``      the alignment rule of T-VI (which branch geometries can be embedded)
``branch_window``        the input window (crop or extra padding) that aligns a smaller kernel
``window_input``         apply such a window to an input
``identity_kernel``      identity as a K×K kernel (any groups)
``merge_kxk_kxk_valid``  K×K → K×K, exact only for the pad-once ("valid") composition
``value_pad``            pad an intermediate with a per-channel value (the value-padding rule)
=======================  =========================================================================

Every function is exact math: a merged pair computes what the branches compute **in eval mode**
(BatchNorm running statistics are used). Results follow the dtype and device of the input tensors
(float64, bfloat16, CUDA, ...); no numpy and no float32-only constants are used. All functions are
differentiable in their tensor arguments. Impossible requests raise a :class:`~reparam.errors.ReparamError`
subclass whose message says why.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Sequence, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import AlignmentError, NotMergeableError, ReparamError
from .geometry import ConvGeometry
from .hostforms import verified_norm_act

__all__ = [
    "merge_dtype",
    "BNStats",
    "bn_stats",
    "bn_impurity",
    "fuse_bn",
    "unfold_bn",
    "add_branches",
    "merge_1x1_kxk",
    "concat_depth",
    "avg_kernel",
    "embed_kernel",
    "check_alignment",
    "Window",
    "branch_window",
    "window_input",
    "identity_kernel",
    "check_identity",
    "merge_kxk_kxk_valid",
    "value_pad",
]

Pair = tuple[Tensor, Tensor]


# ---------------------------------------------------------------------------------------------
# BatchNorm statistics


class BNStats(NamedTuple):
    """Eval-mode statistics of a BatchNorm-like layer.

    ``gamma``/``beta`` are ``None`` for ``affine=False`` (they then act as 1 and 0).
    """

    mean: Tensor
    var: Tensor
    gamma: Tensor | None
    beta: Tensor | None
    eps: float


def bn_stats(bn: Any) -> BNStats:
    """Extract eval statistics from ``BatchNorm2d``, ``SyncBatchNorm``, torchvision's
    ``FrozenBatchNorm2d``, :class:`~reparam.layers.FrozenIdentityBN` or a :class:`BNStats`.

    Raises:
        NotMergeableError: GroupNorm / LayerNorm / InstanceNorm (statistics depend on the input),
            a BN with ``track_running_stats=False`` (no eval statistics exist), or any other module.
    """
    if isinstance(bn, BNStats):
        return bn
    if isinstance(bn, (nn.GroupNorm, nn.LayerNorm, nn.modules.instancenorm._InstanceNorm, nn.LocalResponseNorm)):
        raise NotMergeableError(
            f"{type(bn).__name__} cannot be folded into a conv: its statistics depend on the input"
        )
    if not isinstance(bn, nn.Module) or not hasattr(bn, "eps"):
        raise NotMergeableError(f"expected a BatchNorm-like module, got {type(bn).__name__}")
    mean = getattr(bn, "running_mean", None)
    var = getattr(bn, "running_var", None)
    if mean is None or var is None:
        raise NotMergeableError(
            f"{type(bn).__name__} has track_running_stats=False: no eval statistics exist; "
            "convert the BN (track running statistics) or keep the branch unmerged"
        )
    gamma = getattr(bn, "weight", None)
    beta = getattr(bn, "bias", None)
    return BNStats(mean, var, gamma, beta, float(cast(float, bn.eps)))


#: BatchNorm classes (by name) whose forward adds optional ``drop`` and ``act`` layers after the
#: normalisation (timm's norm+activation layers); they are a plain BN when both are identities
_NORM_ACT_CLASSES = ("BatchNormAct2d", "SyncBatchNormAct", "FrozenBatchNormAct2d")
#: BatchNorm-like classes from other libraries whose forward is the BN formula alone
_PURE_BN_NAMES = ("FrozenBatchNorm2d", "FrozenIdentityBN")
_TORCH_BN_FORWARDS = (nn.modules.batchnorm._BatchNorm.forward, nn.BatchNorm2d.forward, nn.SyncBatchNorm.forward)


def bn_impurity(bn: Any) -> str | None:
    """Why ``bn`` is not a plain per-channel affine map in eval mode (``None`` when it is).

    A BN subclass that applies an activation or dropout after normalising (timm's
    ``BatchNormAct2d`` with ``act=ReLU``, ...) is not linear, so it can neither be folded into the
    preceding conv nor serve as the anchor norm of a block; folding it would silently drop the
    activation. Torch's BatchNorm classes, ``FrozenBatchNorm2d`` and subclasses that keep torch's
    forward are plain; norm+activation layers (timm's, or ones whose form
    :func:`reparam.hostforms.norm_act_reason` proved) are plain when their ``act`` and ``drop``
    layers are identities; any other subclass that overrides ``forward`` is treated as not plain.
    """
    if isinstance(bn, BNStats):
        return None
    cls = type(bn)
    name = cls.__name__
    if name in _PURE_BN_NAMES:
        return None
    if name in _NORM_ACT_CLASSES or hasattr(bn, "act") or hasattr(bn, "drop"):
        extra = [
            f"{attr}={type(getattr(bn, attr)).__name__}"
            for attr in ("drop", "act")
            if getattr(bn, attr, None) is not None and not isinstance(getattr(bn, attr), nn.Identity)
        ]
        if extra:
            return (
                f"{name} applies {' and '.join(extra)} after normalising: it is not a linear map, "
                "so it cannot be folded into the conv (that would drop the activation)"
            )
        if name in _NORM_ACT_CLASSES or verified_norm_act(bn):
            return None
    if isinstance(bn, nn.modules.batchnorm._BatchNorm) and getattr(cls, "forward", None) not in _TORCH_BN_FORWARDS:
        return f"{name} overrides BatchNorm's forward: it is not known to be a plain per-channel affine map"
    return None


def _vec(t: Tensor | None, like: Tensor, fill: float, n: int) -> Tensor:
    if t is None:
        return torch.full((n,), fill, dtype=like.dtype, device=like.device)
    return t.to(dtype=like.dtype, device=like.device)


def merge_dtype(param_dtype: torch.dtype, compute_dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype a merge computes in: ``compute_dtype`` when given, else the parameters' own dtype,
    at least float32 (float64 for float64 models: exact to ~1e-15; float32 for float32, float16
    and bfloat16 models). For a float32 model, float64 arithmetic only makes the merged weights
    correctly rounded: the merged model's output error stays that of the float32 forward itself
    (on a trained ResNet-18: 6.1e-7 relative with float64, 7.3e-7 with float32), at twice the
    arithmetic cost."""
    if compute_dtype is not None:
        return compute_dtype
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def fuse_bn(kernel: Tensor, bias: Tensor | None, bn: Any) -> Pair:
    """T-I: fold a BatchNorm into the preceding conv.

    ``K_o = (γ_o/σ_o)·W_o``, ``b_o = β_o + (γ_o/σ_o)·(c_o − μ_o)``, ``σ = sqrt(v + eps)``.

    Args:
        kernel: conv weight ``(O, C/g, K_h, K_w)``; the result has its dtype and device.
        bias: conv bias ``(O,)`` or ``None`` (treated as 0).
        bn: a BatchNorm-like module or :class:`BNStats` (see :func:`bn_stats`).

    Exact in eval mode (uses running statistics).
    """
    s = bn_stats(bn)
    n = kernel.shape[0]
    if s.mean.shape != (n,):
        raise ReparamError(f"BN has {s.mean.numel()} channels but the kernel has {n} output channels")
    mean = _vec(s.mean, kernel, 0.0, n)
    std = torch.sqrt(_vec(s.var, kernel, 1.0, n) + s.eps)
    gamma = _vec(s.gamma, kernel, 1.0, n)
    beta = _vec(s.beta, kernel, 0.0, n)
    t = gamma / std
    fused_k = kernel * t.reshape(-1, 1, 1, 1)
    if bias is None:
        fused_b = beta - t * mean
    else:
        fused_b = beta + t * (bias.to(dtype=kernel.dtype, device=kernel.device) - mean)
    return fused_k, fused_b


def unfold_bn(kernel: Tensor, bias: Tensor, bn: Any, conv_bias: Tensor | None = None) -> Pair:
    """Inverse of T-I: the conv weight and BN ``β`` that reproduce ``(kernel, bias)`` in eval mode
    while the BN keeps its ``(γ, μ, v)`` and the conv keeps ``conv_bias``.

    ``W = (σ/γ)·K``, ``β = b − (γ/σ)·(c − μ)``.

    Raises:
        ReparamError: some ``γ`` is exactly 0 (no inverse exists; clamp ``|γ|`` away from 0 first,
            as the blocks' γ guard does).
    """
    s = bn_stats(bn)
    n = kernel.shape[0]
    mean = _vec(s.mean, kernel, 0.0, n)
    std = torch.sqrt(_vec(s.var, kernel, 1.0, n) + s.eps)
    gamma = _vec(s.gamma, kernel, 1.0, n)
    if bool((gamma == 0).any()):
        raise ReparamError(
            "unfold_bn: some BN gamma is exactly 0, so the inverse does not exist; clamp gamma away "
            "from 0 first (as the blocks' gamma guard does)"
        )
    w = kernel * (std / gamma).reshape(-1, 1, 1, 1)
    c = torch.zeros_like(mean) if conv_bias is None else conv_bias.to(dtype=kernel.dtype, device=kernel.device)
    beta = bias.to(dtype=kernel.dtype, device=kernel.device) - (gamma / std) * (c - mean)
    return w, beta


# ---------------------------------------------------------------------------------------------
# T-II and T-IV


def _pairs(pairs: Iterable[Pair] | Pair) -> list[Pair]:
    items: list[Any] = list(pairs)
    if len(items) == 2 and all(isinstance(t, Tensor) for t in items) and items[0].dim() == 4:
        return [(items[0], items[1])]  # a single pair was passed
    return [cast(Pair, tuple(p)) for p in items]


def add_branches(pairs: Iterable[Pair]) -> Pair:
    """T-II: ``K = Σ K_i``, ``b = Σ b_i`` of parallel branches already embedded at one kernel size.

    Raises:
        ReparamError: no pairs, or shapes / dtypes differ (embed with :func:`embed_kernel` first).
    """
    items = _pairs(pairs)
    if not items:
        raise ReparamError("add_branches needs at least one (kernel, bias) pair")
    k0, b0 = items[0]
    for k, b in items[1:]:
        if k.shape != k0.shape or b.shape != b0.shape:
            raise ReparamError(
                f"add_branches: kernel shapes differ ({tuple(k.shape)} vs {tuple(k0.shape)}); "
                "embed every branch at the main kernel size first"
            )
        if k.dtype != k0.dtype:
            raise ReparamError(f"add_branches: dtypes differ ({k.dtype} vs {k0.dtype})")
    kernel = k0
    bias = b0
    for k, b in items[1:]:
        kernel = kernel + k
        bias = bias + b
    return kernel, bias


def concat_depth(pairs: Iterable[Pair]) -> Pair:
    """T-IV: concatenate pairs along the output-channel axis."""
    items = _pairs(pairs)
    if not items:
        raise ReparamError("concat_depth needs at least one (kernel, bias) pair")
    shape = items[0][0].shape[1:]
    if any(k.shape[1:] != shape for k, _ in items):
        raise ReparamError("concat_depth: kernels must agree on every axis but the first")
    return torch.cat([k for k, _ in items], 0), torch.cat([b for _, b in items], 0)


# ---------------------------------------------------------------------------------------------
# T-III


def merge_1x1_kxk(
    kernel1: Tensor, bias1: Tensor | None, kernel2: Tensor, bias2: Tensor | None, groups: int = 1
) -> Pair:
    """T-III: sequential ``1×1 (C→D, groups g) → K×K (D→O, groups g)`` as one ``K×K (C→O)`` conv.

    With views ``A = W1 as (g, D/g, C/g)`` and ``B = W2 as (g, O/g, D/g, K_h, K_w)``:
    ``K = einsum("tdc,todhw->tochw", A, B)`` and ``b = b2 + einsum("todhw,td->to", B, b1)``, one
    vectorised call for dense, grouped, depthwise and channel-multiplier convs.

    Exact for stage 1 with stride 1 and padding 0, stage 2 with padding 0, and the intermediate
    padded by the main padding with the per-channel value ``b1`` (:func:`value_pad`), or with the
    main ``padding_mode`` when that is not ``"zeros"``.

    Raises:
        NotMergeableError: stage 1 is not 1×1, or the channel counts do not match ``groups``.
    """
    if kernel1.dim() != 4 or kernel2.dim() != 4:
        raise NotMergeableError("merge_1x1_kxk expects 4-d conv kernels")
    if tuple(kernel1.shape[2:]) != (1, 1):
        raise NotMergeableError(
            f"merge_1x1_kxk: stage 1 must be 1x1, got {tuple(kernel1.shape[2:])}; two padded KxK convs "
            "in sequence do not merge (use merge_kxk_kxk_valid for the pad-once form)"
        )
    g = int(groups)
    d_total, c_g = kernel1.shape[0], kernel1.shape[1]
    o, d_g, kh, kw = kernel2.shape
    if g <= 0 or d_total % g or o % g or d_g * g != d_total:
        raise NotMergeableError(
            f"merge_1x1_kxk: groups={g} does not fit stage 1 {tuple(kernel1.shape)} and stage 2 "
            f"{tuple(kernel2.shape)} (need D % g == 0, O % g == 0, stage-2 in-channels == D/g)"
        )
    a = kernel1.reshape(g, d_total // g, c_g)
    b = kernel2.reshape(g, o // g, d_g, kh, kw)
    kernel = torch.einsum("tdc,todhw->tochw", a.to(b.dtype), b).reshape(o, c_g, kh, kw)
    if bias2 is None:
        bias = torch.zeros(o, dtype=kernel2.dtype, device=kernel2.device)
    else:
        bias = bias2.to(kernel2.dtype)
    if bias1 is not None:
        extra = torch.einsum("todhw,td->to", b, bias1.to(b.dtype).reshape(g, d_total // g)).reshape(o)
        bias = bias + extra
    return kernel, bias


# ---------------------------------------------------------------------------------------------
# T-V


def avg_kernel(
    channels: int,
    kernel_size: int | Sequence[int],
    groups: int = 1,
    *,
    padding: int | Sequence[int] = 0,
    count_include_pad: bool = True,
    ceil_mode: bool = False,
    divisor_override: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """T-V: an average pool on ``channels`` channels as a grouped conv kernel.

    ``W[o, c', h, w] = 1/(K_h·K_w)`` (or ``1/divisor_override``) if ``c' == o mod (channels/groups)``,
    else 0; the bias is 0. Use the pool's stride and padding for the conv.

    Raises:
        NotMergeableError: ``count_include_pad=False`` with padding > 0 (not linear-equivalent at
            the border) or ``ceil_mode=True`` (partial windows with other divisors).
    """
    kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
    pad = (padding, padding) if isinstance(padding, int) else tuple(padding)
    if ceil_mode:
        raise NotMergeableError("avg pool with ceil_mode=True adds partial windows with other divisors; not linear")
    if not count_include_pad and any(p > 0 for p in pad):
        raise NotMergeableError(
            "avg pool with count_include_pad=False and padding > 0 is not linear-equivalent at the border"
        )
    if channels <= 0 or groups <= 0 or channels % groups:
        raise ReparamError(f"groups={groups} must divide channels={channels}")
    cpg = channels // groups
    value = 1.0 / (divisor_override if divisor_override is not None else kh * kw)
    kernel = torch.zeros(channels, cpg, kh, kw, dtype=dtype, device=device)
    idx = torch.arange(channels, device=kernel.device)
    kernel[idx, idx % cpg] = value
    return kernel


# ---------------------------------------------------------------------------------------------
# T-VI and alignment


def embed_kernel(
    kernel: Tensor, kernel_size: int | Sequence[int], offset: Sequence[int] | None = None
) -> Tensor:
    """T-VI: place ``kernel`` inside a zero kernel of ``kernel_size``.

    Each spatial axis is padded by its own amount (a ``1×3`` kernel embedded in ``3×3`` stays a
    ``3×3``, not ``1×5``). ``offset = (j0_h, j0_w)`` is the top-left position; ``None`` centres the
    kernel, which requires ``K − k`` to be even per axis.

    Raises:
        AlignmentError: parity mismatch, kernel larger than the target, offset out of range.
    """
    kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
    bh, bw = kernel.shape[-2:]
    if bh > kh or bw > kw:
        raise AlignmentError(f"cannot embed a {bh}x{bw} kernel into a smaller {kh}x{kw} kernel")
    if offset is None:
        if (kh - bh) % 2 or (kw - bw) % 2:
            raise AlignmentError(
                f"parity mismatch: a {bh}x{bw} kernel cannot be centred in {kh}x{kw} "
                "(K - k must be even on each axis)"
            )
        oh, ow = (kh - bh) // 2, (kw - bw) // 2
    else:
        oh, ow = int(offset[0]), int(offset[1])
        if oh < 0 or ow < 0 or oh + bh > kh or ow + bw > kw:
            raise AlignmentError(f"offset {tuple(offset)} places a {bh}x{bw} kernel outside {kh}x{kw}")
    if (bh, bw) == (kh, kw):
        return kernel
    # F.pad takes (w_lo, w_hi, h_lo, h_hi): the LAST dim first
    return F.pad(kernel, (ow, kw - bw - ow, oh, kh - bh - oh))


def check_alignment(main: ConvGeometry, branch: ConvGeometry) -> tuple[int, int]:
    """The alignment rule: can ``branch`` be added to ``main`` after embedding its kernel?

    Per axis with main ``(K, s, P, d)`` and branch ``(k, s_b, q, d_b)``: equal stride, equal output
    length for every input length (``2q − d_b(k − 1) == 2P − d(K − 1)``), and branch taps a subset of
    the main taps (offset ``j0 = (P − q)/d`` integer, ``0 ≤ j0 ≤ K − k``, ``d_b == d`` unless
    ``k == 1``). Channels, groups and (when the branch pads) the padding mode must match.

    Returns:
        ``(j0_h, j0_w)``, the embedding offset for :func:`embed_kernel`.

    Raises:
        AlignmentError: naming the mismatching value pair or the required branch padding.
    """
    if (main.in_channels, main.out_channels, main.groups) != (branch.in_channels, branch.out_channels, branch.groups):
        raise AlignmentError(
            f"channels/groups differ: main (C={main.in_channels}, O={main.out_channels}, g={main.groups}) vs "
            f"branch (C={branch.in_channels}, O={branch.out_channels}, g={branch.groups})"
        )
    offsets = []
    for axis, name in ((0, "height"), (1, "width")):
        big_k, s, p, d = main.kernel_size[axis], main.stride[axis], main.padding[axis], main.dilation[axis]
        k, s_b, q, d_b = branch.kernel_size[axis], branch.stride[axis], branch.padding[axis], branch.dilation[axis]
        if s_b != s:
            raise AlignmentError(f"stride differs on the {name} axis: main {s}, branch {s_b}")
        if k > 1 and d_b != d:
            raise AlignmentError(f"dilation differs on the {name} axis: main {d}, branch {d_b}")
        centre_shift = (big_k - k) if k > 1 else d * (big_k - 1)  # twice the offset of centres, in taps
        if centre_shift % 2:
            raise AlignmentError(
                f"parity mismatch on the {name} axis: a size-{k} branch does not centre in a size-{big_k} "
                f"kernel with dilation {d}"
            )
        eff_b = d_b * (k - 1) if k > 1 else 0
        if 2 * q - eff_b != 2 * p - d * (big_k - 1):
            need = (2 * p - d * (big_k - 1) + eff_b) / 2
            raise AlignmentError(
                f"padding on the {name} axis does not align: branch padding {q} but it must be {need:g} "
                f"(P - d(K - k)/2 with P={p}, d={d}, K={big_k}, k={k})"
            )
        if (p - q) % d:
            raise AlignmentError(f"branch taps fall between main taps on the {name} axis (P - q not a multiple of d)")
        j0 = (p - q) // d
        if j0 < 0 or j0 + k > big_k:
            raise AlignmentError(f"branch taps outside the main kernel on the {name} axis (offset {j0})")
        offsets.append(j0)
    if any(q > 0 for q in branch.padding) and branch.padding_mode != main.padding_mode:
        raise AlignmentError(
            f"padding_mode differs: main {main.padding_mode!r}, branch {branch.padding_mode!r}"
        )
    return (offsets[0], offsets[1])


# ---------------------------------------------------------------------------------------------
# input windows: smaller kernels on convs whose padding is too small to centre them

#: signed padding ``((top, bottom), (left, right))`` of an input: positive values pad, negative
#: values crop
Window = tuple[tuple[int, int], tuple[int, int]]


def branch_window(main: ConvGeometry, kernel_size: int | Sequence[int], offset: Sequence[int]) -> Window:
    """The input window that makes a ``k_h × k_w`` conv equal to its embedding in the main conv.

    A branch kernel placed at ``offset = (j0_h, j0_w)`` inside the main ``K_h × K_w`` kernel reads,
    for output ``i`` on one axis, the input positions ``s·i − P_lo + d·(j0 + j)``, ``j < k``. A
    ``k``-tap conv with the main stride ``s``, padding 0 and dilation ``d`` (1 when ``k == 1``) reads
    exactly these positions when its input is the main input padded by ``P_lo − d·j0`` at the start
    and ``P_hi − d·(K − k − j0)`` at the end, a negative amount meaning a crop. Its output length is
    then the main one for every input length, so ``conv(window_input(x, W), K_b)`` equals
    ``conv(x, embed_kernel(K_b, K, offset))`` with the main geometry, with any stride, padding
    (zero, asymmetric or larger than centred) and dilation.

    Returns:
        ``((top, bottom), (left, right))`` signed padding for :func:`window_input`.

    Raises:
        AlignmentError: the kernel does not fit the main kernel at ``offset``.
    """
    kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else (int(kernel_size[0]), int(kernel_size[1]))
    out = []
    for axis, k, j0 in ((0, kh, int(offset[0])), (1, kw, int(offset[1]))):
        big_k, p, d = main.kernel_size[axis], main.padding[axis], main.dilation[axis]
        if k < 1 or j0 < 0 or j0 + k > big_k:
            raise AlignmentError(
                f"a size-{k} kernel at offset {j0} does not fit the size-{big_k} main kernel on the "
                f"{'height' if axis == 0 else 'width'} axis"
            )
        out.append((p - d * j0, p - d * (big_k - k - j0)))
    return (out[0], out[1])


def window_input(x: Tensor, window: Window, padding_mode: str = "zeros") -> Tensor:
    """``x`` padded (positive amounts, with ``padding_mode``) and cropped (negative amounts) by
    ``window = ((top, bottom), (left, right))``. Padding is applied to the uncropped input, so a
    reflect/replicate/circular border is the one the main conv sees. Cropped results are views."""
    (top, bottom), (left, right) = window
    pads = (max(left, 0), max(right, 0), max(top, 0), max(bottom, 0))
    if any(pads):
        mode = "constant" if padding_mode == "zeros" else padding_mode
        x = F.pad(x, pads, mode=mode)
    if top < 0 or bottom < 0 or left < 0 or right < 0:
        x = x[..., max(-top, 0) : (bottom if bottom < 0 else None), max(-left, 0) : (right if right < 0 else None)]
    return x


# ---------------------------------------------------------------------------------------------
# identity


def check_identity(geometry: ConvGeometry) -> None:
    """Raise :class:`AlignmentError` unless an identity branch fits ``geometry``: the identity
    maps each input position to the same output position, which needs ``C == O``, stride 1,
    size-preserving padding ``2P == d(K − 1)`` and an odd ``K`` per axis (a centre tap)."""
    if geometry.in_channels != geometry.out_channels:
        raise AlignmentError(
            f"identity needs in_channels == out_channels, got {geometry.in_channels} != {geometry.out_channels}"
        )
    if geometry.stride != (1, 1):
        raise AlignmentError(f"identity needs stride 1, got {geometry.stride}")
    if any(k % 2 == 0 for k in geometry.kernel_size):
        raise AlignmentError(f"identity needs an odd kernel on each axis, got {geometry.kernel_size}")
    if not geometry.preserves_size:
        raise AlignmentError(
            f"identity needs a size-preserving conv (2P == d(K-1)); padding {geometry.padding}, "
            f"dilation {geometry.dilation}, kernel {geometry.kernel_size}"
        )


def identity_kernel(
    channels: int,
    kernel_size: int | Sequence[int] = 1,
    groups: int = 1,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Identity as a grouped ``K×K`` kernel: ``I[o, c', h, w] = 1`` iff ``c' == o mod (C/g)`` and
    ``(h, w)`` is the centre. Created with the requested dtype and device.

    Raises:
        AlignmentError: even kernel on an axis (no centre tap).
    """
    kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
    if kh % 2 == 0 or kw % 2 == 0:
        raise AlignmentError(f"identity kernel needs odd sizes, got {kh}x{kw}")
    if channels <= 0 or groups <= 0 or channels % groups:
        raise ReparamError(f"groups={groups} must divide channels={channels}")
    cpg = channels // groups
    kernel = torch.zeros(channels, cpg, kh, kw, dtype=dtype, device=device)
    idx = torch.arange(channels, device=kernel.device)
    kernel[idx, idx % cpg, kh // 2, kw // 2] = 1
    return kernel


# ---------------------------------------------------------------------------------------------
# K×K → K×K


def merge_kxk_kxk_valid(
    kernel1: Tensor, bias1: Tensor | None, kernel2: Tensor, bias2: Tensor | None, groups: int = 1
) -> Pair:
    """Compose ``A`` (stride 1, padding 0) then ``B`` (stride s, padding 0) into one conv with kernel
    ``k1 + k2 − 1`` applied to an input padded **once**.

    ``K[o, c, i+i', j+j'] += Σ_m B[o, m, i, j]·A[m, c, i', j']``, ``b = b_B + Σ B·b_A``. Exact only for
    this pad-once form: with "same" padding at each stage the first conv's border outputs depend on
    the input and no single conv reproduces them, so that case must be refused.
    """
    if kernel1.dim() != 4 or kernel2.dim() != 4:
        raise NotMergeableError("merge_kxk_kxk_valid expects 4-d conv kernels")
    g = int(groups)
    m_total, c_g, ah, aw = kernel1.shape
    o, m_g, bh, bw = kernel2.shape
    if g <= 0 or m_total % g or o % g or m_g * g != m_total:
        raise NotMergeableError(
            f"merge_kxk_kxk_valid: groups={g} does not fit {tuple(kernel1.shape)} and {tuple(kernel2.shape)}"
        )
    a = kernel1.reshape(g, m_g, c_g, ah, aw).to(kernel2.dtype)
    b = kernel2.reshape(g, o // g, m_g, bh, bw)
    kernel = kernel2.new_zeros(g, o // g, c_g, ah + bh - 1, aw + bw - 1)
    for i in range(bh):
        for j in range(bw):
            part = torch.einsum("tom,tmchw->tochw", b[..., i, j], a)
            kernel = kernel + F.pad(part, (j, bw - 1 - j, i, bh - 1 - i))
    kernel = kernel.reshape(o, c_g, ah + bh - 1, aw + bw - 1)
    bias = kernel2.new_zeros(o) if bias2 is None else bias2.to(kernel2.dtype)
    if bias1 is not None:
        bias = bias + torch.einsum("tomhw,tm->to", b, bias1.to(b.dtype).reshape(g, m_g)).reshape(o)
    return kernel, bias


# ---------------------------------------------------------------------------------------------
# value padding


class _ValuePad(torch.autograd.Function):
    """Zero-pad (one fast copy of the interior), then write the per-channel value into the border.
    Written for ``torch.func`` too (``setup_context``; ``vmap`` runs it per sample)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, value: Tensor, ph: int, pw: int) -> Tensor:  # type: ignore[override]
        h, w = x.shape[-2:]
        out = F.pad(x, (pw, pw, ph, ph))
        # border += value * 1, interior += value * 0 (exact: adding a signed zero keeps every value)
        mask = torch.ones(h + 2 * ph, w + 2 * pw, dtype=x.dtype, device=x.device)
        mask[ph : ph + h, pw : pw + w] = 0
        return out.addcmul_(value.to(dtype=x.dtype).reshape(1, -1, 1, 1), mask)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        x, value, ph, pw = inputs
        ctx.shape = (ph, pw, *x.shape[-2:])
        ctx.value_dtype = value.dtype

    @staticmethod
    def jvp(ctx: Any, tx: Tensor, tv: Tensor, *_: Any) -> Tensor:
        # linear in (x, value) together: the tangent is the padding of the tangents (an input
        # without one gets zeros, autograd materialises them)
        return _ValuePad.forward(tx, tv, *ctx.shape[:2])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:  # type: ignore[override]
        ph, pw, h, w = ctx.shape
        gx = grad[:, :, ph : ph + h, pw : pw + w] if ctx.needs_input_grad[0] else None
        gv = None
        if ctx.needs_input_grad[1]:
            dims = (0, 2, 3)
            gv = grad.new_zeros(grad.shape[1])
            if ph:
                gv = gv + grad[:, :, :ph, :].sum(dims) + grad[:, :, ph + h :, :].sum(dims)
            if pw:
                gv = gv + grad[:, :, ph : ph + h, :pw].sum(dims) + grad[:, :, ph : ph + h, pw + w :].sum(dims)
            gv = gv.to(ctx.value_dtype)
        return gx, gv, None, None


def value_pad(x: Tensor, padding: tuple[int, int], value: Tensor) -> Tensor:
    """Pad ``x`` (N, C, H, W) by ``padding = (P_h, P_w)`` on both sides with the per-channel ``value``.

    The interior is **copied**, not recomputed, so it is bit-identical to ``x``; the border equals
    ``value`` exactly. Differentiable in ``x`` and ``value`` (the border gradient reaches
    ``value``). This is the padding of the intermediate in a 1×1 → K×K branch: padding the
    intermediate with the first stage's output for a zero input makes the branch equal one K×K conv
    on a zero-padded input, so the branch merges exactly.
    """
    ph, pw = int(padding[0]), int(padding[1])
    if ph == 0 and pw == 0:
        return x
    if value.shape != (x.shape[1],):
        raise ReparamError(f"value_pad: value has shape {tuple(value.shape)}, expected ({x.shape[1]},)")
    return _ValuePad.apply(x, value, ph, pw)
