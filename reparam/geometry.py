"""Convolution geometry: the single source of truth for every conv this package builds.

:class:`ConvGeometry` is a frozen dataclass recorded from a host ``nn.Conv2d``. Merged convs and
branch convs are constructed from it with **keyword arguments only** (:meth:`ConvGeometry.make_conv`),
so ``padding``, ``dilation``, ``groups`` and ``padding_mode`` can never land in the wrong slot or be
forgotten (the merged conv of a block has exactly the host's output shape).

Nothing in this module computes; it only validates and records.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import nn

from .errors import AlignmentError, NotMergeableError, ReparamError

__all__ = ["ConvGeometry", "PADDING_MODES"]

PADDING_MODES: tuple[str, ...] = ("zeros", "reflect", "replicate", "circular")


def _pair(value: Any, name: str) -> tuple[int, int]:
    if isinstance(value, bool):
        raise ReparamError(f"{name} must be an int or a pair of ints, got {value!r}")
    if isinstance(value, int):
        return (value, value)
    if isinstance(value, (tuple, list)):
        if len(value) == 1 and isinstance(value[0], int) and not isinstance(value[0], bool):
            return (int(value[0]), int(value[0]))
        if len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return (int(value[0]), int(value[1]))
    raise ReparamError(f"{name} must be an int or a pair of ints, got {value!r}")


_BLANK_CONVS: dict[tuple[Any, ...], nn.Conv2d] = {}


def _blank_conv(g: "ConvGeometry", dtype: torch.dtype | None) -> nn.Conv2d:
    """A new ``nn.Conv2d`` of geometry ``g`` whose parameters are still on the meta device.

    Constructing a conv runs its initialisers even on the meta device; a merge builds one conv per
    block, so a meta template per geometry is built once and each new conv copies its attribute
    dictionary (with fresh containers) instead.
    """
    dtype = dtype or torch.get_default_dtype()
    kwargs: dict[str, Any] = {
        "in_channels": g.in_channels, "out_channels": g.out_channels, "kernel_size": g.kernel_size,
        "stride": g.stride, "padding": g.padding, "dilation": g.dilation, "groups": g.groups,
        "bias": g.bias, "padding_mode": g.padding_mode,
    }
    key = (*kwargs.values(), dtype)
    template = _BLANK_CONVS.get(key)
    if template is None:
        template = _BLANK_CONVS[key] = nn.Conv2d(**kwargs, device="meta", dtype=dtype)
    conv = nn.Conv2d.__new__(nn.Conv2d)
    conv.__dict__.update(
        {k: v.copy() if isinstance(v, (dict, set, list)) else v for k, v in template.__dict__.items()}
    )
    return conv


@dataclass(frozen=True)
class ConvGeometry:
    """Geometry of a 2-d convolution ``G = (C, O, g, K, s, P, d, padding_mode)`` plus ``bias``.

    Padding is always symmetric integers per axis (``padding="valid"`` is recorded as 0; a
    ``padding="same"`` conv is accepted when it pads symmetrically).
    """

    in_channels: int
    out_channels: int
    kernel_size: tuple[int, int]
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1
    padding_mode: str = "zeros"
    bias: bool = False

    def __post_init__(self) -> None:
        for name in ("kernel_size", "stride", "padding", "dilation"):
            object.__setattr__(self, name, _pair(getattr(self, name), name))
        for name in ("in_channels", "out_channels", "groups"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ReparamError(f"{name} must be a positive int, got {v!r}")
        if any(k <= 0 for k in self.kernel_size):
            raise ReparamError(f"kernel_size must be positive, got {self.kernel_size}")
        if any(s <= 0 for s in self.stride):
            raise ReparamError(f"stride must be positive, got {self.stride}")
        if any(d <= 0 for d in self.dilation):
            raise ReparamError(f"dilation must be positive, got {self.dilation}")
        if any(p < 0 for p in self.padding):
            raise ReparamError(f"padding must be non-negative, got {self.padding}")
        if self.in_channels % self.groups or self.out_channels % self.groups:
            raise ReparamError(
                f"groups={self.groups} must divide in_channels={self.in_channels} and "
                f"out_channels={self.out_channels}"
            )
        if self.padding_mode not in PADDING_MODES:
            raise ReparamError(f"padding_mode must be one of {PADDING_MODES}, got {self.padding_mode!r}")
        object.__setattr__(self, "bias", bool(self.bias))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_conv(cls, conv: nn.Module) -> "ConvGeometry":
        """Record the geometry of a plain ``nn.Conv2d``.

        Raises:
            NotMergeableError: ``conv`` is not a plain 2-d convolution (``Conv1d``, ``Conv3d``,
                ``ConvTranspose2d``, quantised / fake-quant or uninitialised lazy convs).
            AlignmentError: ``padding="same"`` that pads asymmetrically (even effective kernel).
        """
        if not isinstance(conv, nn.Conv2d):
            raise NotMergeableError(
                f"expected an nn.Conv2d, got {type(conv).__name__}; Conv1d, Conv3d and transposed convs "
                "are out of scope in v1"
            )
        mod = type(conv).__module__
        if mod.startswith("torch.ao.") or mod.startswith("torch.nn.qat") or mod.startswith("torch.nn.quantized") or (
            hasattr(conv, "weight_fake_quant")
        ):
            raise NotMergeableError(
                f"{type(conv).__name__} is a quantised or fake-quant conv; out of scope in v1 "
                "(merge before quantisation)"
            )
        if isinstance(conv, nn.modules.lazy.LazyModuleMixin) and conv.has_uninitialized_params():
            raise NotMergeableError("lazy conv has uninitialised parameters; run one forward pass first")
        k = _pair(tuple(conv.kernel_size), "kernel_size")
        d = _pair(tuple(conv.dilation), "dilation")
        pad = conv.padding
        if isinstance(pad, str):
            if pad == "valid":
                pad = (0, 0)
            elif pad == "same":
                total = [di * (ki - 1) for di, ki in zip(d, k)]
                if any(t % 2 for t in total):
                    raise AlignmentError(
                        f"padding='same' with effective kernel {tuple(t + 1 for t in total)} pads "
                        "asymmetrically (more on the high side); not supported in v1 - use an odd "
                        "kernel or explicit integer padding"
                    )
                pad = (total[0] // 2, total[1] // 2)
            else:  # pragma: no cover - torch validates this itself
                raise ReparamError(f"unknown padding {pad!r}")
        return cls(
            in_channels=int(conv.in_channels),
            out_channels=int(conv.out_channels),
            kernel_size=k,
            stride=_pair(tuple(conv.stride), "stride"),
            padding=_pair(tuple(pad), "padding"),
            dilation=d,
            groups=int(conv.groups),
            padding_mode=str(conv.padding_mode),
            bias=conv.bias is not None,
        )

    def replace(self, **changes: Any) -> "ConvGeometry":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def make_conv(
        self,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        initialize: bool = True,
        weight: torch.Tensor | None = None,
        **overrides: Any,
    ) -> nn.Conv2d:
        """Build an ``nn.Conv2d`` with keyword arguments taken from this geometry.

        ``overrides`` may replace any field (``bias=True`` for a merged conv, ...). Parameters are
        trainable; they are initialised by PyTorch unless ``initialize=False`` (uninitialised
        memory, for callers that overwrite every value, e.g. a merged conv). With
        ``initialize=False``, ``weight`` gives the weight's storage (a tensor of the weight shape).
        """
        g = self.replace(**overrides) if overrides else self
        if not initialize:
            conv = _blank_conv(g, dtype)
            if weight is None:
                weight = torch.empty(conv.weight.shape, device=device, dtype=conv.weight.dtype)
            elif tuple(weight.shape) != tuple(conv.weight.shape):
                raise ReparamError(f"make_conv: weight has shape {tuple(weight.shape)}, expected {tuple(conv.weight.shape)}")
            conv.weight = nn.Parameter(weight)
            if conv.bias is not None:
                conv.bias = nn.Parameter(torch.empty(conv.bias.shape, device=device, dtype=conv.weight.dtype))
            return conv
        return nn.Conv2d(
            in_channels=g.in_channels,
            out_channels=g.out_channels,
            kernel_size=g.kernel_size,
            stride=g.stride,
            padding=g.padding,
            dilation=g.dilation,
            groups=g.groups,
            bias=g.bias,
            padding_mode=cast(Literal["zeros", "reflect", "replicate", "circular"], g.padding_mode),
            device=device,
            dtype=dtype,
        )

    # ------------------------------------------------------------------ derived facts
    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        """``(O, C/g, K_h, K_w)``."""
        return (self.out_channels, self.in_channels // self.groups, *self.kernel_size)

    @property
    def is_depthwise(self) -> bool:
        """``g == C == O > 1``."""
        return self.groups > 1 and self.groups == self.in_channels == self.out_channels

    @property
    def preserves_size(self) -> bool:
        """Stride 1 and ``2P == d(K − 1)`` on both axes (output size equals input size)."""
        return self.stride == (1, 1) and all(
            2 * p == d * (k - 1) for p, d, k in zip(self.padding, self.dilation, self.kernel_size)
        )

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """JSON form used in the structure records of :func:`reparam.structure` (so that a model
        can be rebuilt from a plain copy and a state dict)."""
        return {
            "in": self.in_channels,
            "out": self.out_channels,
            "kernel": list(self.kernel_size),
            "stride": list(self.stride),
            "padding": list(self.padding),
            "dilation": list(self.dilation),
            "groups": self.groups,
            "padding_mode": self.padding_mode,
            "bias": self.bias,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ConvGeometry":
        """Inverse of :meth:`to_dict`."""
        try:
            return cls(
                in_channels=int(data["in"]),
                out_channels=int(data["out"]),
                kernel_size=tuple(data["kernel"]),
                stride=tuple(data.get("stride", (1, 1))),
                padding=tuple(data.get("padding", (0, 0))),
                dilation=tuple(data.get("dilation", (1, 1))),
                groups=int(data.get("groups", 1)),
                padding_mode=str(data.get("padding_mode", "zeros")),
                bias=bool(data.get("bias", False)),
            )
        except (KeyError, TypeError) as exc:
            raise ReparamError(f"invalid geometry record {data!r}: {exc}") from exc
