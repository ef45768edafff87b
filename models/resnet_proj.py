"""ResNet-18 with a projection head: the DynInit study's CIFAR model.

timm's ``resnet18`` with its standard ImageNet stem (7×7 stride-2 conv and max-pool, also on 32×32
inputs) and its classifier removed (512 pooled features) → Linear(512→512)–ReLU–Linear(512→256)
(the projection head, whose output MOON uses as the representation) → Linear(256→classes). At 10
classes: 11,573,066 parameters. The study starts from ImageNet weights: without network access put
a ``resnet18`` state dict in a file and name it with ``model.weights`` (loaded into the backbone).
``width`` and ``norm`` are accepted for the common interface; only ``width = 1`` and BatchNorm are
supported.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import resolve_options

__all__ = ["ResNet18Proj"]


class ResNet18Proj(nn.Module):
    """timm ResNet-18 backbone + 512-512-256 projection head + classifier."""

    def __init__(
        self,
        *,
        num_classes: int = 10,
        in_channels: int = 3,
        width: float = 1.0,
        norm: str = "bn",
        input_size: int = 32,
        conv_bias: bool | None = None,
        track_running_stats: bool = True,
        init: str = "torch",
    ) -> None:
        super().__init__()
        o = resolve_options(
            num_classes=num_classes, in_channels=in_channels, width=width, norm=norm,
            input_size=input_size, conv_bias=conv_bias, track_running_stats=track_running_stats,
            init=init,
        )
        if o.width != 1.0 or norm != "bn":
            raise ValueError("resnet18_proj supports width 1 and norm 'bn' only (it is timm's resnet18)")
        from fedhetero._compat import import_timm

        timm = import_timm()
        self.num_classes, self.in_channels, self.width, self.input_size = num_classes, in_channels, 1.0, input_size
        self.backbone = timm.create_model("resnet18", pretrained=False, num_classes=0, in_chans=in_channels)
        self.head = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 256))
        self.classifier = nn.Linear(256, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.head(self.backbone(x)))
