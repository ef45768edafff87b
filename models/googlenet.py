"""GoogLeNet for 32×32 inputs (the common CIFAR layout).

Pre-layer conv3×3(C→192, padding 1)–BN–ReLU, inception modules a3, b3, max-pool(3, 2, 1), a4–e4,
max-pool(3, 2, 1), a5, b5, global average pooling and FC(1024→classes). An inception module concatenates
four branches along channels: 1×1; 1×1 → 3×3; 1×1 → 3×3 → 3×3 (the "5×5" branch as two 3×3 convs); and
max-pool(3, 1, 1) → 1×1. Every conv is followed by BN (when ``norm="bn"``) and ReLU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ._common import ConvBNAct, ModelOptions, ZooModel, check_spatial, conv_out
from .groups import CLASSES, INPUT, ChannelGroups, GroupLayout

__all__ = ["Inception", "GoogLeNet", "GOOGLENET_PLAN"]

# name: (n1x1, n3x3red, n3x3, n5x5red, n5x5, pool_planes); "M" = max-pool(3, 2, 1)
GOOGLENET_PLAN: tuple[tuple[str, tuple[int, int, int, int, int, int]] | str, ...] = (
    ("a3", (64, 96, 128, 16, 32, 32)),
    ("b3", (128, 128, 192, 32, 96, 64)),
    "M",
    ("a4", (192, 96, 208, 16, 48, 64)),
    ("b4", (160, 112, 224, 24, 64, 64)),
    ("c4", (128, 128, 256, 24, 64, 64)),
    ("d4", (112, 144, 288, 32, 64, 64)),
    ("e4", (256, 160, 320, 32, 128, 128)),
    "M",
    ("a5", (256, 160, 320, 32, 128, 128)),
    ("b5", (384, 192, 384, 48, 128, 128)),
)


class Inception(nn.Module):
    """Four parallel branches concatenated along channels (order b1, b2, b3, b4)."""

    def __init__(self, in_channels: int, planes: Sequence[int], o: ModelOptions) -> None:
        super().__init__()
        n1, n3r, n3, n5r, n5, npool = planes
        self.b1 = ConvBNAct(in_channels, n1, 1, opts=o)
        self.b2 = nn.Sequential(
            ConvBNAct(in_channels, n3r, 1, opts=o), ConvBNAct(n3r, n3, 3, padding=1, opts=o)
        )
        self.b3 = nn.Sequential(
            ConvBNAct(in_channels, n5r, 1, opts=o),
            ConvBNAct(n5r, n5, 3, padding=1, opts=o),
            ConvBNAct(n5, n5, 3, padding=1, opts=o),
        )
        self.b4 = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), ConvBNAct(in_channels, npool, 1, opts=o))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1)

    def declare(self, lay: GroupLayout, path: str, inputs: Sequence[str]) -> list[str]:
        """Declare the seven conv groups; return the output concat ``[b1, b2.1, b3.2, b4.1]``."""
        def unit(branch: nn.Sequential, i: int) -> ConvBNAct:
            m = branch[i]
            assert isinstance(m, ConvBNAct)
            return m

        self.b1.declare(lay, f"{path}.b1", inputs, f"{path}.b1")
        unit(self.b2, 0).declare(lay, f"{path}.b2.0", inputs, f"{path}.b2.0")
        unit(self.b2, 1).declare(lay, f"{path}.b2.1", f"{path}.b2.0", f"{path}.b2.1")
        unit(self.b3, 0).declare(lay, f"{path}.b3.0", inputs, f"{path}.b3.0")
        unit(self.b3, 1).declare(lay, f"{path}.b3.1", f"{path}.b3.0", f"{path}.b3.1")
        unit(self.b3, 2).declare(lay, f"{path}.b3.2", f"{path}.b3.1", f"{path}.b3.2")
        unit(self.b4, 1).declare(lay, f"{path}.b4.1", inputs, f"{path}.b4.1")
        return [f"{path}.b1", f"{path}.b2.1", f"{path}.b3.2", f"{path}.b4.1"]


class GoogLeNet(ZooModel):
    """CIFAR GoogLeNet (see the module docstring). ``width`` scales every conv width."""

    def build(self, o: ModelOptions) -> None:
        num_classes, in_channels, input_size = o.num_classes, o.in_channels, o.input_size
        size = input_size
        sizes = [size]
        self.pre = ConvBNAct(in_channels, o.ch(192), 3, padding=1, opts=o)
        c_in = o.ch(192)
        self._order: list[str] = []
        pools = 0
        for item in GOOGLENET_PLAN:
            if isinstance(item, str):  # "M"
                pools += 1
                self.add_module(f"pool{pools}", nn.MaxPool2d(3, stride=2, padding=1))
                self._order.append(f"pool{pools}")
                size = conv_out(size, 3, 2, 1)
                sizes.append(size)
            else:
                name, planes = item
                block = Inception(c_in, [o.ch(p) for p in planes], o)
                self.add_module(name, block)
                self._order.append(name)
                c_in = sum(o.ch(p) for i, p in enumerate(planes) if i in (0, 2, 4, 5))
        check_spatial("googlenet", input_size, sizes)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        for name in self._order:
            x = self.get_submodule(name)(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)

    def channel_groups(self) -> ChannelGroups:
        """``pre`` plus seven groups per inception module (``a3.b1``, ``a3.b2.0``, ``a3.b2.1``,
        ``a3.b3.0``, ``a3.b3.1``, ``a3.b3.2``, ``a3.b4.1``, …); a module's input is the ordered list of
        its predecessor's four output groups; fixed ``input``/``classes``."""
        lay = GroupLayout(self)
        self.pre.declare(lay, "pre", INPUT, "pre")
        prev: list[str] = ["pre"]
        for name in self._order:
            block = self.get_submodule(name)
            if isinstance(block, Inception):
                prev = block.declare(lay, name, prev)
        lay.linear("fc", prev, CLASSES)
        return lay.build()
