"""VGG-11 with the CIFAR head used by FedDUMAP.

conv3×3 (padding 1) with channel plan [64, M, 128, M, 256, 256, M, 512, 512, M, 512, 512, M], ReLU after
every conv (``BatchNorm2d`` before it when ``norm="bn"``); then FC(512·s²→512)–ReLU–FC(512→512)–ReLU–
FC(512→classes). The five max-pools use ``ceil_mode=True`` so that 28×28 inputs reach 1×1
(28→14→7→4→2→1) exactly as 32×32 inputs do; at even sizes ceil and floor agree, so the 32×32 model is
the usual one. At 3×32×32, 10 classes, ``norm="none"``: 9,750,922 parameters and 153,293,824 MACs.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import ConvBNAct, ModelOptions, ZooModel, check_spatial, conv_out
from .groups import CLASSES, INPUT, ChannelGroups, GroupLayout

__all__ = ["VGG11", "VGG11_PLAN"]

VGG11_PLAN: tuple[int | str, ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class VGG11(ZooModel):
    """VGG-11 (see the module docstring). ``width`` scales every conv and the two hidden FCs."""

    def build(self, o: ModelOptions) -> None:
        num_classes, in_channels, input_size = o.num_classes, o.in_channels, o.input_size
        layers: list[nn.Module] = []
        self._convs: list[str] = []
        c_in, size, sizes = in_channels, input_size, []
        for item in VGG11_PLAN:
            if item == "M":
                layers.append(nn.MaxPool2d(2, ceil_mode=True))
                size = conv_out(size, 2, 2, ceil=True)
                sizes.append(size)
            else:
                c_out = o.ch(int(item))
                self._convs.append(f"features.{len(layers)}")
                layers.append(ConvBNAct(c_in, c_out, 3, padding=1, opts=o))
                c_in = c_out
        check_spatial("vgg11", input_size, sizes)
        self._flat_hw = size * size
        self.features = nn.Sequential(*layers)
        f = o.ch(512)
        self.classifier = nn.Sequential(
            nn.Linear(c_in * self._flat_hw, f),
            nn.ReLU(),
            nn.Linear(f, f),
            nn.ReLU(),
            nn.Linear(f, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)

    def channel_groups(self) -> ChannelGroups:
        """One group per conv (named by its path, e.g. ``features.0``), ``classifier.0`` and
        ``classifier.2`` for the hidden FCs, plus fixed ``input``/``classes``."""
        lay = GroupLayout(self)
        prev = INPUT
        for path in self._convs:
            unit = self.features.get_submodule(path.split(".", 1)[1])
            assert isinstance(unit, ConvBNAct)
            unit.declare(lay, path, prev, path)
            prev = path
        lay.linear("classifier.0", prev, "classifier.0", repeat=self._flat_hw)
        lay.linear("classifier.2", "classifier.0", "classifier.2")
        lay.linear("classifier.4", "classifier.2", CLASSES)
        return lay.build()
