"""Which kernel a branch's convolution and BatchNorm run: for convolutions oneDNN's, PyTorch's native
GEMM convolution for narrow ones, or a matrix product where the kernel covers the input; for a
branch's training-mode BatchNorm, statistics computed here where PyTorch's CPU kernel is slow for
the shape (:func:`batch_norm`).

On CPU, ``F.conv2d`` hands float convolutions to oneDNN, whose kernels keep channels in blocks of
16 (AVX-512). A branch with fewer channels than that pays for the padded block and for reordering
its activations into and out of it, whatever its multiply-adds: measured on one thread at batch
32, a 1×1 conv of 1 → 6 channels on 28×28 maps costs 0.33–1.4 ms forward and backward in oneDNN
against 0.04–0.14 ms in PyTorch's native convolution (one matrix product per sample, or an
``unfold`` and one matrix product), a 5×1 conv of 6 → 16 channels 0.22 against 0.18 ms. Expanded
blocks of small models (LeNet-5: 1 → 6 and 6 → 16 channels) are made of such convolutions.

:func:`conv2d` is ``F.conv2d`` with that choice made from the shapes alone (deterministic: the same
call always takes the same kernel, on every back end):

* the native kernel for a ``groups = 1``, ``dilation = 1`` convolution on CPU in float32/float64
  whose kernel has a side of 1 (``1×1``, ``1×K``, ``K×1``) and fewer than
  :data:`NARROW_CHANNELS` input or output channels, or that has **one** input channel and an input
  that needs its gradient (oneDNN computes that gradient in a 16-channel block: a 5×5 conv of
  1 → 6 channels 1.28 against 0.75 ms);
* oneDNN (``F.conv2d``) for everything else, where it is the faster one (a 5×5 conv of 6 → 16
  channels 0.45 against 0.66 ms; a 1×1 conv of 64 → 64 channels on 32×32 maps at batch 64,
  7.8 against 24.8 ms).

* a matrix product (``F.linear``) for a ``groups = 1`` convolution on CPU in float32/float64 whose
  kernel covers its whole unpadded input (one output position per sample: a 1×1 conv on a 1×1
  map, as the cropped branch convs of torchvision's ResNet-18 at 32×32 input run in its last
  stage): oneDNN takes 1.5 ms forward and backward for a 512 → 512 one at batch 64, the product
  0.7 ms (0.59 against 0.23 ms at 256 channels).

Before any of them runs, :func:`crop_dead_taps` drops the kernel rows and columns that only ever meet the
zero padding: on small maps a padded conv reads part of its kernel nowhere (a 3×3 kernel with
padding 1 on a 1×1 map reads its centre alone, as torchvision's ResNet-18 at 32×32 input does in its
last stage), and oneDNN would still multiply the padding. Those taps add exact zeros and get a zero
weight gradient either way (measured there: a 512 → 512 branch conv on 1×1 maps, batch 64, forward
and backward, about 3.9 → 1 ms).

All compute the same convolution; they round differently (a float64 convolution agrees to about
1e-15 relative). Under tracing, scripting, ``torch.compile``, autocast, a dispatch mode (e.g.
``FlopCounterMode``), a ``torch.func`` transform or forward-mode AD (the native kernel has no
batching or forward-mode rule), and when :func:`native_convs` switches it off, ``F.conv2d`` runs as
before.
:func:`run_conv` applies it to a branch's ``nn.Conv2d`` unless that module has hooks (hook-based
tools then see the module run). Every branch conv of a block goes through it except the anchor's,
which runs its host conv as the plain model does, so that a zero-γ expansion stays bit-exact.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _mod
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["NARROW_CHANNELS", "batch_norm", "batch_norm_form", "batch_norms", "conv2d", "crop_dead_taps", "matmul_preferred", "native_conv_preferred", "native_convs", "native_convs_enabled", "run_conv"]

#: oneDNN's channel block on AVX-512 CPUs: convolutions narrower than this pay for the padded block
NARROW_CHANNELS = 16

_STATE = {"enabled": True}
_BN_STATE = {"enabled": True}
_FLOATS = (torch.float32, torch.float64)


def native_convs_enabled() -> bool:
    """Whether :func:`conv2d` may choose the native kernel (default ``True``)."""
    return _STATE["enabled"]


@contextlib.contextmanager
def switched(state: dict[str, bool], enabled: bool) -> Iterator[None]:
    """Set ``state["enabled"]`` for the duration of a ``with`` block (restored on exit)."""
    old = state["enabled"]
    state["enabled"] = bool(enabled)
    try:
        yield
    finally:
        state["enabled"] = old


def native_convs(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Context manager that lets :func:`conv2d` choose the native kernel, or not (restored on exit);
    e.g. to time oneDNN alone. The choice is made when a convolution runs forward; its backward
    follows the forward's kernel."""
    return switched(_STATE, enabled)


def _pair(v: int | tuple[int, ...] | list[int]) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    return (int(v[0]), int(v[1])) if len(v) == 2 else (int(v[0]), int(v[0]))


def plain_context(x: Tensor) -> bool:
    """No tracer, compiler, autocast, dispatch mode or ``torch.func`` transform is watching."""
    if torch.jit.is_scripting() or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False
    if torch.is_autocast_enabled(x.device.type):
        return False
    if _transformed():  # the modules' own operators, whose rules the transform knows
        return False
    return _get_current_dispatch_mode() is None


#: functorch's stack of active transforms (``None`` when none is on); looked up once, not per call
_PEEK_TRANSFORM = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", lambda: None)


def _transformed() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``…) or forward-mode AD is on."""
    return _PEEK_TRANSFORM() is not None or getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0


def _cpu_float(x: Any) -> bool:
    """A plain (no subclass, no fx proxy) 4-d float32/float64 tensor on the CPU: what the kernel
    choices here apply to (other devices keep PyTorch's operators)."""
    return type(x) is Tensor and x.device.type == "cpu" and x.dim() == 4 and x.dtype in _FLOATS


def native_conv_preferred(x: Tensor, weight: Tensor, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
                          groups: int = 1) -> bool:
    """Whether :func:`conv2d` runs this convolution with the native kernel (see the module docstring)."""
    if not _STATE["enabled"] or groups != 1 or isinstance(padding, str) or not _cpu_float(x) or weight.dtype != x.dtype:
        return False  # a tensor subclass or an fx proxy gets F.conv2d, as it would without us
    if _pair(dilation) != (1, 1) or not plain_context(x):
        return False
    out_ch, in_ch, kh, kw = weight.shape
    narrow = (kh == 1 or kw == 1) and min(in_ch, out_ch) < NARROW_CHANNELS
    return narrow or (in_ch == 1 and x.requires_grad)


def matmul_preferred(x: Tensor, weight: Tensor, padding: Any = 0, dilation: Any = 1, groups: int = 1) -> bool:
    """Whether :func:`conv2d` runs this convolution as a matrix product: its kernel covers the whole
    unpadded input, so each sample has one output position, the product of its flattened input with
    the flattened kernel (see the module docstring)."""
    if not _STATE["enabled"] or groups != 1 or isinstance(padding, str) or not _cpu_float(x) or weight.dtype != x.dtype:
        return False
    if _pair(padding) != (0, 0) or tuple(x.shape[2:]) != tuple(weight.shape[2:]):
        return False
    if _pair(dilation) != (1, 1) and tuple(weight.shape[2:]) != (1, 1):
        return False  # a dilated kernel spans more than its size
    return plain_context(x)


def _live_taps(size: int, k: int, s: int, p: int, d: int) -> tuple[int, int, int] | None:
    """``(first, last, padding)``: the kernel taps along one side that read the input (not only its
    zero padding) in some output window, and the padding that keeps the output windows where they
    were once the others are dropped; ``None`` when every tap is live or the cropped conv would not
    have the same output size."""
    out = (size + 2 * p - d * (k - 1) - 1) // s + 1
    if out < 1:
        return None
    # tap u reads rows i·s + u·d − p (i < out): live when some of them lie in [0, size)
    live = [u for u in range(k) if u * d - p + (out - 1) * s >= 0 and u * d - p <= size - 1]
    if not live or (live[0], live[-1]) == (0, k - 1):
        return None
    first, last = live[0], live[-1]
    pad = p - first * d
    if pad < 0 or (size + 2 * pad - d * (last - first) - 1) // s + 1 != out:
        return None
    return first, last, pad


def crop_dead_taps(x: Tensor, weight: Tensor, stride: Any, padding: Any, dilation: Any) -> tuple[Tensor, Any]:
    """``(weight, padding)`` of the same zero-padded convolution without the kernel rows and columns
    that only ever meet padding (a 3×3 kernel with padding 1 on a 1×1 map reads its centre alone):
    such taps add exact zeros, so dropping them changes nothing but the cost (and the order of the
    sums, hence rounding). Their weight gradient is zero either way. Returns the arguments as they
    were when no tap is dead."""
    if type(x) is not Tensor or isinstance(padding, str) or x.dim() != 4 or weight.dim() != 4:
        return weight, padding  # an fx proxy or a tensor subclass gets the convolution as written
    (sh, sw), (ph, pw), (dh, dw) = _pair(stride), _pair(padding), _pair(dilation)
    if ph == 0 and pw == 0:
        return weight, padding
    kh, kw = int(weight.shape[2]), int(weight.shape[3])
    rows = _live_taps(int(x.shape[2]), kh, sh, ph, dh) if ph else None
    cols = _live_taps(int(x.shape[3]), kw, sw, pw, dw) if pw else None
    if (rows is None and cols is None) or not plain_context(x):  # a tracer would record one input size's kernel
        return weight, padding
    r0, r1, ph = rows if rows is not None else (0, kh - 1, ph)
    c0, c1, pw = cols if cols is not None else (0, kw - 1, pw)
    return weight[:, :, r0:r1 + 1, c0:c1 + 1], (ph, pw)


def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1) -> Tensor:
    """``F.conv2d`` with the kernel chosen from the shapes (module docstring) and the taps that only
    meet padding dropped (:func:`crop_dead_taps`); same arguments."""
    weight, padding = crop_dead_taps(x, weight, stride, padding, dilation)
    if matmul_preferred(x, weight, padding, dilation, groups):
        n, o = int(x.shape[0]), int(weight.shape[0])
        return F.linear(x.reshape(n, -1), weight.reshape(o, -1), bias).view(n, o, 1, 1)
    if native_conv_preferred(x, weight, stride, padding, dilation, groups):
        # the native backward needs a contiguous input (a cropped window is a strided view) and a
        # weight with the standard strides: given channels-last ones (a model moved to channels-last
        # memory; even a 1×1 weight's, which `.contiguous()` keeps) it returns a wrong weight gradient
        w = weight.reshape(weight.shape[0], -1).view(weight.shape)  # a view unless the layout differs
        native = torch._C._nn.thnn_conv2d  # type: ignore[attr-defined]  # not in torch's stubs
        out: Tensor = native(x.contiguous(), w, list(weight.shape[2:]), bias, list(_pair(stride)), list(_pair(padding)))
        return out
    return F.conv2d(x, weight, bias, stride, padding, dilation, groups)


def global_hooks() -> bool:
    """Whether any global module hook is registered (``torch.nn.modules.module``)."""
    return bool(
        getattr(_mod, "_global_forward_hooks", None)
        or getattr(_mod, "_global_forward_pre_hooks", None)
        or getattr(_mod, "_global_backward_hooks", None)
    )


def hooked(m: nn.Module) -> bool:
    """Whether ``m`` has hooks of its own (forward, forward-pre or backward)."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks)


def plain_conv(m: Any) -> bool:
    """Whether ``m`` is an ``nn.Conv2d`` itself (no subclass), zero-padded, without hooks: a conv
    whose forward may be computed from its parameters instead of calling it."""
    return type(m) is nn.Conv2d and m.padding_mode == "zeros" and not hooked(m)


def run_conv(conv: nn.Module, x: Tensor) -> Tensor:
    """A branch's conv module on ``x``: a plain ``nn.Conv2d`` (:func:`plain_conv`, no global hooks
    either) through :func:`conv2d`; anything else (a nested block, a subclass, a hooked module) as
    ``conv(x)``."""
    if type(x) is Tensor and plain_conv(conv) and not global_hooks():
        c = cast(nn.Conv2d, conv)
        return conv2d(x, c.weight, c.bias, c.stride, c.padding, c.dilation, c.groups)
    out: Tensor = conv(x)
    return out


# ---------------------------------------------------------------------------------------------
# training-mode BatchNorm of a branch

#: :func:`batch_norm` computes the statistics itself from this many elements, on maps of at least
#: :data:`BN_STATS_MIN_POSITIONS` positions: PyTorch's CPU kernel gathers them channel by channel.
#: Measured, forward and backward, batch 64, two threads (one thread): 382 against 322 µs (669
#: against 414) at 64 channels on 8×8 maps, 8.1 against 5.8 ms (14.5 against 9.3) on 32×32; at half
#: the elements the two are even on two threads (128 channels on 4×4: 239 against 280 µs)
BN_STATS_MIN_ELEMENTS = 1 << 18
BN_STATS_MIN_POSITIONS = 16
#: ... with at least this many channels: narrow BatchNorms (the calibration forward of LeNet-5's
#: blocks on large batches, for one) keep PyTorch's kernel and their numbers bit for bit; the gain
#: there is small on two threads (64 × 6 × 28 × 28: 476 against 430 µs), larger on one (748 against 418)
BN_STATS_MIN_CHANNELS = NARROW_CHANNELS
#: ... and on maps of 2 to :data:`BN_FLAT_MAX_POSITIONS` positions with at least
#: :data:`BN_FLAT_MIN_CHANNELS` channels it runs the whole BatchNorm, backward included, on the
#: ``(N, C·H·W)`` view, where PyTorch's kernel is slowest (64 × 256 × 2 × 2: 587 against 394 µs on
#: two threads, 1,084 against 300 on one; 64 channels: 188 against 214 µs on two threads; on 1×1
#: maps PyTorch's is the faster one)
BN_FLAT_MAX_POSITIONS = 4
BN_FLAT_MIN_CHANNELS = 128


def batch_norms(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Context manager that switches :func:`batch_norm`'s own forms on or off (restored on exit)."""
    return switched(_BN_STATE, enabled)


def batch_stats_bn(bn: Any) -> bool:
    """A plain ``BatchNorm2d`` (no subclass, no hooks of its own) that normalises with batch
    statistics in this forward."""
    return type(bn) is nn.BatchNorm2d and bn.training and not hooked(bn)


def batch_norm_form(bn: nn.Module, x: Tensor) -> str | None:
    """``"stats"``, ``"flat"`` or ``None`` (the module's own forward): which form :func:`batch_norm`
    runs ``bn`` on ``x`` in, from the shapes alone (see :func:`batch_norm`)."""
    if not _BN_STATE["enabled"] or not batch_stats_bn(bn) or global_hooks():
        return None
    if not _cpu_float(x) or not x.is_contiguous() or (bn.weight is not None and bn.weight.dtype != x.dtype) or not plain_context(x):
        return None
    n, c, h, w = (int(d) for d in x.shape)
    if n * h * w <= 1:
        return None  # the module raises its own error
    if h * w >= BN_STATS_MIN_POSITIONS and x.numel() >= BN_STATS_MIN_ELEMENTS and c >= BN_STATS_MIN_CHANNELS:
        return "stats"
    if 2 <= h * w <= BN_FLAT_MAX_POSITIONS and c >= BN_FLAT_MIN_CHANNELS:
        return "flat"
    return None


class _StatsBatchNorm(torch.autograd.Function):
    """Batch statistics from reductions over the contiguous ``(N, C, H·W)`` view (the mean, then the
    centred sum of squares), the normalisation by PyTorch's eval-mode kernel with them, the backward
    by PyTorch's training-mode backward kernel from the same statistics."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        n, c = x.shape[:2]
        xv = x.view(n, c, -1)
        m = n * xv.shape[2]
        mean = xv.sum(2).sum(0).div_(m)
        var = torch.linalg.vector_norm(xv - mean.view(1, c, 1), dim=2).square_().sum(0).div_(m)
        y = torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, False)
        ctx.save_for_backward(x, weight, mean, torch.rsqrt(var + eps))
        ctx.eps = eps
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _gm: Any, _gv: Any) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:  # type: ignore[override]
        # PyTorch's training-mode backward is itself twice differentiable (its double backward
        # takes the saved statistics as functions of the input), so create_graph needs nothing here
        x, weight, mean, invstd = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, dw, db = torch.ops.aten.native_batch_norm_backward(
            grad.contiguous(), x, weight, None, None, mean, invstd, True, ctx.eps,
            [need[0], weight is not None and need[1], need[2]],
        )
        return dx, dw, db, None


def _differentiable_grads(ctx: Any, grad: Tensor, x: Tensor, weight: Tensor | None,
                          bias: Tensor | None) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
    """The gradients when the flat form's backward is itself differentiated (``create_graph``, e.g.
    Hessian-vector products): those of PyTorch's own training-mode BatchNorm recomputed on the saved
    input, so that their dependence on the batch statistics is part of the graph (the written-out
    backward treats the statistics, computed inside ``forward``, as constants)."""
    need = ctx.needs_input_grad[:3]
    inputs = [t for t, n in zip((x, weight, bias), need) if n and t is not None]
    with torch.enable_grad():
        y = F.batch_norm(x, None, None, weight, bias, True, 0.0, ctx.eps)
    grads = iter(torch.autograd.grad(y, inputs, grad, create_graph=True))
    dx, dw, db = (next(grads) if n and t is not None else None for t, n in zip((x, weight, bias), need))
    return dx, dw, db, None


def _per_channel(v: Tensor, positions: int) -> Tensor:
    """A per-channel vector repeated over each channel's positions: ``(C·H·W,)``."""
    return v.repeat_interleave(positions)


class _FlatBatchNorm(torch.autograd.Function):
    """The whole BatchNorm on the ``(N, C·H·W)`` view, for small maps: a channel's few positions lie
    next to each other, so per-channel reductions and scalings run over long contiguous rows."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        n, c = x.shape[:2]
        length = x.numel() // (n * c)
        m = n * length
        x2 = x.view(n, c * length)
        mean = x2.sum(0).view(c, length).sum(1).div_(m)
        xc = x2 - _per_channel(mean, length)
        var = (xc * xc).sum(0).view(c, length).sum(1).div_(m)
        invstd = torch.rsqrt(var + eps)
        scale = invstd if weight is None else invstd * weight
        y = xc * _per_channel(scale, length)
        if bias is not None:
            y.add_(_per_channel(bias, length))
        ctx.save_for_backward(x, weight, bias, xc, invstd)
        ctx.eps = eps
        ctx.mark_non_differentiable(mean, var)
        return y.view_as(x), mean, var

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _gm: Any, _gv: Any) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:  # type: ignore[override]
        x, weight, bias, xc, invstd = ctx.saved_tensors
        if torch.is_grad_enabled():
            return _differentiable_grads(ctx, grad, x, weight, bias)
        n, cl = xc.shape
        c = invstd.shape[0]
        length, m = cl // c, n * (cl // c)
        g2 = grad.reshape(n, cl)
        db = g2.sum(0).view(c, length).sum(1)
        dot = (g2 * xc).sum(0).view(c, length).sum(1)  # Σ g·(x − mean) per channel
        need = ctx.needs_input_grad
        dx = None
        if need[0]:  # γ/σ · (g − mean(g) − x̂·mean(g·x̂))
            k = invstd if weight is None else weight * invstd
            dx = g2 * _per_channel(k, length)
            dx.addcmul_(xc, _per_channel(-k * invstd * invstd * dot / m, length)).sub_(_per_channel(k * db / m, length))
            dx = dx.view(grad.shape)
        dw = dot * invstd if weight is not None and need[1] else None
        return dx, dw, db if need[2] else None, None


def update_running_stats(bn: nn.BatchNorm2d, mean: Tensor, var: Tensor, m: int) -> None:
    """The running-statistics update of ``nn.BatchNorm2d`` in training mode, from the batch mean and
    biased variance over ``m`` values per channel (momentum or cumulative average, unbiased variance)."""
    if not bn.track_running_stats or bn.running_mean is None or bn.running_var is None:
        return
    with torch.no_grad():
        factor = 0.0 if bn.momentum is None else float(bn.momentum)
        if bn.num_batches_tracked is not None:
            bn.num_batches_tracked.add_(1)
            if bn.momentum is None:
                factor = 1.0 / float(bn.num_batches_tracked)
        bn.running_mean.mul_(1.0 - factor).add_(mean.detach().to(bn.running_mean.dtype), alpha=factor)
        unbiased = var.detach() * (m / (m - 1))
        bn.running_var.mul_(1.0 - factor).add_(unbiased.to(bn.running_var.dtype), alpha=factor)


def batch_norm(bn: nn.Module, x: Tensor) -> Tensor:
    """``bn(x)`` for a branch's training-mode ``nn.BatchNorm2d``, faster where PyTorch's CPU kernel is
    slow for the shape (:func:`batch_norm_form`): on maps of 16 positions or more, 2^18 elements or
    more and 16 channels or more the statistics are computed here (``"stats"``); on maps of 2 to 4
    positions with 128 channels or more the whole BatchNorm runs on the ``(N, C·H·W)`` view
    (``"flat"``); elsewhere, and for anything but a plain CPU float BatchNorm in training mode, the
    module runs itself. The same function (float64 outputs, first and second derivatives and running
    statistics within 1e-10–1e-12 of the module's), rounded differently. The anchor keeps its module
    (expansion stays bit-exact)."""
    form = batch_norm_form(bn, x)
    if form is None:
        out: Tensor = bn(x)
        return out
    b = cast(nn.BatchNorm2d, bn)
    fn = _StatsBatchNorm if form == "stats" else _FlatBatchNorm
    y, mean, var = fn.apply(x, b.weight, b.bias, b.eps)
    update_running_stats(b, mean, var, x.numel() // x.shape[1])
    return cast(Tensor, y)
