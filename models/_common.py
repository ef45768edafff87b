"""Shared building blocks and argument checks for the model zoo (torch only)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .groups import GroupLayout, scale_channels

__all__ = [
    "NORMS",
    "INITS",
    "ModelOptions",
    "ZooModel",
    "ConvBNAct",
    "MaxPool2x2",
    "make_norm",
    "is_norm",
    "resolve_options",
    "conv_out",
    "check_spatial",
    "apply_init",
]

#: ``bn``: BatchNorm2d after every conv; ``groupnorm1``: GroupNorm(1, C) (normalisation over
#: C×H×W per sample, per-channel affine; the DynaComm paper's "layer normalization"); ``none``.
NORMS = ("bn", "groupnorm1", "none")
INITS = ("torch", "kaiming_out")


class ModelOptions:
    """Validated constructor options shared by every zoo model."""

    __slots__ = (
        "num_classes",
        "in_channels",
        "width",
        "norm",
        "input_size",
        "conv_bias",
        "track_running_stats",
        "init",
    )

    def __init__(
        self,
        num_classes: int,
        in_channels: int,
        width: float,
        norm: str,
        input_size: int,
        conv_bias: bool,
        track_running_stats: bool,
        init: str,
    ) -> None:
        self.num_classes = num_classes
        self.in_channels = in_channels
        self.width = width
        self.norm = norm
        self.input_size = input_size
        self.conv_bias = conv_bias
        self.track_running_stats = track_running_stats
        self.init = init

    def ch(self, channels: int) -> int:
        """Hidden channel count scaled by ``width`` (see :func:`models.groups.scale_channels`)."""
        return scale_channels(channels, self.width)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def resolve_options(
    *,
    num_classes: int = 10,
    in_channels: int = 3,
    width: float = 1.0,
    norm: str = "bn",
    input_size: int = 32,
    conv_bias: bool | None = None,
    track_running_stats: bool = True,
    init: str = "torch",
) -> ModelOptions:
    """Validate the common options; ``conv_bias=None`` means "bias exactly when ``norm='none'``"."""
    _check_int("num_classes", num_classes, 1)
    _check_int("in_channels", in_channels, 1)
    _check_int("input_size", input_size, 1)
    if isinstance(width, bool) or not isinstance(width, (int, float)) or not width > 0:
        raise ValueError(f"width must be a positive number, got {width!r}")
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    if conv_bias is None:
        conv_bias = norm == "none"
    if not isinstance(conv_bias, bool):
        raise ValueError(f"conv_bias must be True, False or None, got {conv_bias!r}")
    if not isinstance(track_running_stats, bool):
        raise ValueError(f"track_running_stats must be a bool, got {track_running_stats!r}")
    return ModelOptions(
        num_classes, in_channels, float(width), norm, input_size, conv_bias, track_running_stats, init
    )


class ZooModel(nn.Module):
    """The constructor every zoo model shares: the common keyword options (``num_classes``,
    ``in_channels``, ``width``, ``norm``, ``input_size``, ``conv_bias``, ``track_running_stats``,
    ``init``), validated into a :class:`ModelOptions`; the attributes ``num_classes``,
    ``in_channels``, ``width`` and ``input_size``; then :meth:`build` lays out the model's layers
    (with the model's own keyword options, e.g. the SVHN CNN's ``dropout``) and the ``init`` is
    applied. ``in_channels`` and ``input_size`` default to 3 and 32, ``conv_bias`` to "exactly
    when ``norm='none'``", unless the model's :attr:`option_defaults` says otherwise."""

    #: the model's own defaults for the common options it is built with when they are not given
    option_defaults: dict[str, Any] = {}

    def __init__(
        self,
        *,
        num_classes: int = 10,
        in_channels: int | None = None,
        width: float = 1.0,
        norm: str = "bn",
        input_size: int | None = None,
        conv_bias: bool | None = None,
        track_running_stats: bool = True,
        init: str = "torch",
        **options: Any,
    ) -> None:
        super().__init__()
        own = self.option_defaults
        o = resolve_options(
            num_classes=num_classes,
            in_channels=own.get("in_channels", 3) if in_channels is None else in_channels,
            width=width,
            norm=norm,
            input_size=own.get("input_size", 32) if input_size is None else input_size,
            conv_bias=own.get("conv_bias") if conv_bias is None else conv_bias,
            track_running_stats=track_running_stats,
            init=init,
        )
        self.num_classes, self.in_channels, self.width, self.input_size = (
            o.num_classes, o.in_channels, o.width, o.input_size,
        )
        self.build(o, **options)
        apply_init(self, o.init)

    #: lays out the model's layers: ``build(self, o)`` with the validated options ``o``, plus the
    #: model's own keyword options (the SVHN CNN's ``dropout``, ResNet's ``num_blocks``)
    build: Callable[..., None]


def conv_out(size: int, kernel: int, stride: int = 1, padding: int = 0, *, ceil: bool = False) -> int:
    """Output length of a conv/pool along one axis (dilation 1), with torch's rounding rule: floor,
    or ceil where the last window must start inside the input or the left padding."""
    num = size + 2 * padding - kernel + ((stride - 1) if ceil else 0)
    out = num // stride + 1
    if ceil and (out - 1) * stride >= size + padding:
        out -= 1
    return max(out, 0)


def check_spatial(model: str, input_size: int, sizes: Sequence[int]) -> None:
    """Raise a clear error when a feature map of ``model`` would vanish at ``input_size``."""
    if min(sizes) < 1:
        raise ValueError(
            f"input_size={input_size} is too small for {model} (feature map sizes {list(sizes)})"
        )


def make_norm(channels: int, opts: ModelOptions) -> nn.Module:
    """The per-layer normalisation ``opts.norm`` asks for: ``BatchNorm2d(C)``, ``GroupNorm(1, C)``
    or ``Identity``."""
    if opts.norm == "bn":
        return nn.BatchNorm2d(channels, track_running_stats=opts.track_running_stats)
    if opts.norm == "groupnorm1":
        return nn.GroupNorm(1, channels)
    return nn.Identity()


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a normalisation layer with per-channel parameters (BN or GroupNorm)."""
    return isinstance(module, (nn.BatchNorm2d, nn.GroupNorm))


class ConvBNAct(nn.Module):
    """``Conv2d`` → norm (``BatchNorm2d``, ``GroupNorm(1, C)`` or nothing) → ``ReLU`` (optional).

    Standard modules only, so the conv+BN pair is found by ``reparam``'s fx/hook pair detection
    (a conv followed by GroupNorm is no such pair: re-parameterisation leaves it alone).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        padding: int = 0,
        *,
        opts: ModelOptions,
        act: bool = True,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(
            in_channels, out_channels, kernel_size, stride=stride, padding=padding, bias=opts.conv_bias
        )
        self.bn: nn.Module = make_norm(out_channels, opts)
        self.act: nn.Module = nn.ReLU() if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))

    def declare(self, lay: GroupLayout, path: str, inputs: str | Sequence[str], out: str) -> None:
        """Declare this unit's channel groups (conv reads ``inputs`` and writes ``out``)."""
        lay.conv(f"{path}.conv", inputs, out)
        if is_norm(self.bn):
            lay.norm(f"{path}.bn", out)


class MaxPool2x2(nn.MaxPool2d):
    """``nn.MaxPool2d(2)`` that, where no gradient is recorded (evaluation), takes the maximum of
    the window's four strided views instead of calling PyTorch's pooling kernel: the same values (a
    maximum is exact and NaN propagates alike), cheaper on CPU for the NCHW feature maps of the
    zoo's CNNs. Training, fx proxies and small inputs take the kernel as before."""

    _MIN_ELEMENTS = 1 << 14  # below this the kernel's lower overhead wins

    def __init__(self) -> None:
        super().__init__(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or type(x) is not torch.Tensor or x.dim() != 4 or x.numel() < self._MIN_ELEMENTS:
            return super().forward(x)
        h, w = x.shape[2] // 2 * 2, x.shape[3] // 2 * 2  # floor mode: a last odd row or column is dropped
        top = torch.maximum(x[:, :, 0:h:2, 0:w:2], x[:, :, 0:h:2, 1:w:2])
        return torch.maximum(top, torch.maximum(x[:, :, 1:h:2, 0:w:2], x[:, :, 1:h:2, 1:w:2]))


def apply_init(model: nn.Module, init: str) -> None:
    """Re-initialise convs: ``"torch"`` keeps PyTorch defaults; ``"kaiming_out"`` draws conv weights
    from N(0, 2/(k_h·k_w·C_out)) with zero conv bias (the FedDUMAP authors' CNN/VGG init)."""
    if init == "torch":
        return
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
