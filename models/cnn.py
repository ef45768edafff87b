"""The FedDUMAP CNN.

conv3×3(C→32, valid)–ReLU–MaxPool2 → conv3×3(32→64)–ReLU–MaxPool2 → conv3×3(64→64)–ReLU → flatten →
FC(64·s²→64)–ReLU → FC(64→classes). Spatial sizes at 32: 32→30→15→13→6→4 (``s = 4``, 1024 features);
at 28: 28→26→13→11→5→3 (``s = 3``). With ``norm="bn"`` a ``BatchNorm2d`` follows each conv.
At 3×32×32, 10 classes, ``norm="none"``: 122,570 parameters and 4,548,608 MACs.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import ConvBNAct, MaxPool2x2, ModelOptions, ZooModel, check_spatial, conv_out
from .groups import CLASSES, INPUT, ChannelGroups, GroupLayout

__all__ = ["CNN"]


class CNN(ZooModel):
    """The FedDUMAP CNN (see the module docstring). ``width`` scales 32, 64, 64 and the 64-unit FC."""

    def build(self, o: ModelOptions) -> None:
        num_classes, in_channels, input_size = o.num_classes, o.in_channels, o.input_size
        s1 = conv_out(input_size, 3)
        p1 = s1 // 2
        s2 = conv_out(p1, 3)
        p2 = s2 // 2
        s3 = conv_out(p2, 3)
        check_spatial("cnn", input_size, [s1, p1, s2, p2, s3])
        self._flat_hw = s3 * s3
        c1, c2, c3, f1 = o.ch(32), o.ch(64), o.ch(64), o.ch(64)
        self.conv1 = ConvBNAct(in_channels, c1, 3, opts=o)
        self.conv2 = ConvBNAct(c1, c2, 3, opts=o)
        self.conv3 = ConvBNAct(c2, c3, 3, opts=o)
        self.pool = MaxPool2x2()
        self.fc1 = nn.Linear(c3 * self._flat_hw, f1)
        self.fc2 = nn.Linear(f1, num_classes)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.conv1(x))
        x = self.pool(self.conv2(x))
        x = self.conv3(x)
        x = torch.flatten(x, 1)
        x = self.relu(self.fc1(x))
        return self.fc2(x)

    def channel_groups(self) -> ChannelGroups:
        """Groups ``conv1``–``conv3``, ``fc1`` plus fixed ``input``/``classes``; ``fc1`` reads
        ``conv3`` with repeat ``s²`` (16 at 32×32)."""
        lay = GroupLayout(self)
        self.conv1.declare(lay, "conv1", INPUT, "conv1")
        self.conv2.declare(lay, "conv2", "conv1", "conv2")
        self.conv3.declare(lay, "conv3", "conv2", "conv3")
        lay.linear("fc1", "conv3", "fc1", repeat=self._flat_hw)
        lay.linear("fc2", "fc1", CLASSES)
        return lay.build()
