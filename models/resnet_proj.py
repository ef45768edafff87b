"""ResNet-18 with a projection head: the DynInit study's CIFAR model.

timm's ``resnet18`` with its standard ImageNet stem (7×7 stride-2 conv and max-pool, also on 32×32
inputs) and its classifier removed (512 pooled features) → Linear(512→512)–ReLU–Linear(512→256)
(the projection head, whose output MOON uses as the representation) → Linear(256→classes). At 10
classes: 11,573,066 parameters. The study starts from ImageNet weights: without network access put
a ``resnet18`` state dict in a file and name it with ``model.weights`` (loaded into the backbone).
``width`` scales every channel and head unit (1: timm's resnet18 exactly, whose weights then load);
``norm`` is BatchNorm (default), GroupNorm(1, C) or none.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._common import ModelOptions, ZooModel

__all__ = ["ResNet18Proj"]


class _GroupNorm1(nn.GroupNorm):
    """GroupNorm(1, C) with the norm-layer signature timm calls (channels first)."""

    def __init__(self, num_channels: int, **kw: Any) -> None:
        super().__init__(1, num_channels, **kw)


class ResNet18Proj(ZooModel):
    """timm ResNet-18 backbone + 512-512-256 projection head + classifier."""

    def build(self, o: ModelOptions) -> None:
        num_classes, in_channels, norm = o.num_classes, o.in_channels, o.norm
        from reparam._compat import import_timm  # the zoo never imports fedhetero

        timm = import_timm()
        from timm.models.resnet import BasicBlock, ResNet

        norm_layer: Any = {
            "bn": nn.BatchNorm2d, "groupnorm1": _GroupNorm1, "none": nn.Identity,
        }[norm]
        channels = tuple(o.ch(c) for c in (64, 128, 256, 512))
        # timm's resnet18 (the same module names, so its weights load), at the given width and norm
        # timm types ``block`` as a union its own BasicBlock class does not match
        self.backbone = ResNet(BasicBlock, (2, 2, 2, 2), num_classes=0, in_chans=in_channels,  # type: ignore[arg-type]
                               stem_width=o.ch(64), channels=channels, norm_layer=norm_layer)
        assert timm is not None
        h1, h2 = o.ch(512), o.ch(256)
        self.head = nn.Sequential(nn.Linear(channels[-1], h1), nn.ReLU(), nn.Linear(h1, h2))
        self.classifier = nn.Linear(h2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.head(self.backbone(x)))
