"""Building blocks of the branch modules: the norms and convs they are made of, their
initialisation and the training-time operations they share (value padding, the stride-1 mean
filter, input windows).

* :class:`FrozenIdentityBN` — a BatchNorm-shaped identity (the anchor norm of a conv without BN);
* :class:`IdentityBasedConv1x1` — a 1×1 conv whose effective weight is ``weight + I``;
* :func:`new_bn`, :func:`kaiming_` — the norm and the conv initialisation of a new branch;
* :func:`pad_value`, :func:`pad_intermediate` — the value-padding rule of an intermediate;
* :func:`box_mean` — the stride-1 mean filter of the average branch;
* :func:`normalise_window` — an input window in normal form (``None`` for none).

The forward of every module here is exact as written; :class:`FrozenIdentityBN` is the identity bit
for bit in every mode.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor, nn

from . import kernels
from .errors import ReparamError
from .transforms import Window, bn_stats, identity_kernel, value_pad

__all__ = [
    "FrozenIdentityBN",
    "IdentityBasedConv1x1",
    "PAD_MODE",
    "new_bn",
    "kaiming_",
    "pad_value",
    "pad_intermediate",
    "box_mean",
    "normalise_window",
]

# value padding is a leaf for torch.fx (it slice-assigns into a fresh tensor)
torch.fx.wrap("value_pad")

#: ``F.pad`` modes of the conv padding modes other than ``"zeros"``
PAD_MODE = {"reflect": "reflect", "replicate": "replicate", "circular": "circular"}


class FrozenIdentityBN(nn.Module):
    """A BatchNorm-shaped identity: ``weight = 1, bias = 0, running_mean = 0, running_var = 1 − eps``.

    Its forward always evaluates the eval-mode BN formula and never updates statistics. Because
    ``sqrt((1 − eps) + eps)`` rounds to exactly 1, the output equals the input bit for bit (float64,
    float32; bfloat16/float16 round back to the input). It is **not** a ``BatchNorm`` subclass, so
    SyncBatchNorm conversion and "freeze BN" utilities leave it alone. It has no trainable
    parameters; ``is_norm = True`` lets optimizer-grouping code treat it as a norm layer.
    """

    is_norm = True
    weight: Tensor
    bias: Tensor
    running_mean: Tensor
    running_var: Tensor

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
        self.register_buffer("weight", torch.ones(num_features, device=device, dtype=dtype))
        self.register_buffer("bias", torch.zeros(num_features, device=device, dtype=dtype))
        self.register_buffer("running_mean", torch.zeros(num_features, device=device, dtype=dtype))
        self.register_buffer("running_var", torch.full((num_features,), 1.0 - self.eps, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)

    def _apply(self, fn: Any, recurse: bool = True) -> "FrozenIdentityBN":
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

    id_tensor: Tensor

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
        return kernels.conv2d(x, self.effective_weight(), None, 1, 0, 1, self.groups)


def new_bn(n: int, eps: float, momentum: float | None, factory: dict[str, Any]) -> nn.BatchNorm2d:
    """The BatchNorm of a new branch (affine, PyTorch's initialisation)."""
    return nn.BatchNorm2d(n, eps=eps, momentum=momentum, affine=True, **factory)


def kaiming_(weight: Tensor, generator: torch.Generator | None) -> None:
    """Kaiming normal, fan-out, ReLU gain (DyRep's branch init), in place; from ``generator`` when
    given."""
    fan_out = weight.shape[0] * weight.shape[2] * weight.shape[3]
    std = math.sqrt(2.0 / fan_out)
    with torch.no_grad():
        if generator is None:
            weight.normal_(0.0, std)
        else:
            weight.copy_(torch.randn(weight.shape, generator=generator, dtype=weight.dtype, device=generator.device).to(weight.device) * std)


def pad_value(bn: nn.Module) -> Tensor:
    """Per-channel output of ``bn`` for a zero input, from running statistics (value-padding rule)."""
    s = bn_stats(bn)
    scale = torch.rsqrt(s.var + s.eps)
    if s.gamma is not None:
        scale = s.gamma * scale
    value = -s.mean * scale
    if s.beta is not None:
        value = s.beta + value
    return value


def pad_intermediate(z: Tensor, padding: tuple[int, int], mode: str, bn: nn.Module) -> Tensor:
    """Pad the intermediate ``z`` (the output of ``bn``) by ``padding``: with ``bn``'s value for a
    zero input (:func:`pad_value`) under zero padding, else with the conv's padding mode."""
    if padding == (0, 0):
        return z
    if mode == "zeros":
        return value_pad(z, padding, pad_value(bn))
    ph, pw = padding
    return F.pad(z, (pw, pw, ph, ph), mode=PAD_MODE[mode])


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
    gradient), two shifted passes instead of one zero-filled tensor per tap. Written for
    ``torch.func`` too (``setup_context``; ``vmap`` runs it per sample)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(z: Tensor, kh: int, kw: int) -> Tensor:  # type: ignore[override]  # autograd.Function's own signature
        return _box_sum(z, kh, kw).mul_(1.0 / (kh * kw))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.kernel = (inputs[1], inputs[2])

    @staticmethod
    def jvp(ctx: Any, tz: Tensor, *_: Any) -> Tensor:
        return _BoxMean.forward(tz, *ctx.kernel)  # linear: the tangent's mean filter

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]  # autograd.Function's own signature
        kh, kw = ctx.kernel
        padded = F.pad(grad, (kw - 1, kw - 1, kh - 1, kh - 1))
        return _box_sum(padded, kh, kw).mul_(1.0 / (kh * kw)), None, None


def box_mean(z: Tensor, kernel_size: tuple[int, int]) -> Tensor:
    """Stride-1 ``K_h × K_w`` mean filter without padding: the same function as
    ``F.avg_pool2d(z, K, 1)``, several times faster on CPU (forward and backward), and, like pooling,
    not a multiply-accumulate for FLOP counters."""
    out: Tensor = _BoxMean.apply(z, int(kernel_size[0]), int(kernel_size[1]))
    return out


def normalise_window(window: Any) -> Window | None:
    """A normalised window (``None`` for no window or an all-zero one)."""
    if window is None:
        return None
    (t, b), (left, right) = window
    w = ((int(t), int(b)), (int(left), int(right)))
    return None if w == ((0, 0), (0, 0)) else w
