"""LeNet-5 for 32×32 (and 28×28) images.

conv5×5(C→6)–ReLU–MaxPool2 → conv5×5(6→16)–ReLU–MaxPool2 → FC(16·s²→120)–ReLU → FC(120→84)–ReLU →
FC(84→classes), ``s = ((input_size − 4)//2 − 4)//2`` (5 at 32×32, 4 at 28×28). With ``norm="bn"`` a
``BatchNorm2d`` follows each conv. No activation on the logits (the FedDUMAP authors' stray ReLU is
dropped). At 3×32×32, 10 classes, ``norm="none"``: 62,006 parameters and 651,720 MACs.

With ``norm="groupnorm1"`` (GroupNorm(1, C) after each conv, convs without bias) this is the CNN of
the DynaComm paper (registry alias ``dynacomm_cnn``): 62,028 parameters at 3×32×32 and 10 classes,
flatten 16·5·5 = 400 (16·4·4 = 256 at 1×28×28, FEMNIST).
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import ConvBNAct, MaxPool2x2, ModelOptions, ZooModel, check_spatial, conv_out
from .groups import CLASSES, INPUT, ChannelGroups, GroupLayout

__all__ = ["LeNet5"]


class LeNet5(ZooModel):
    """LeNet-5 (see the module docstring). ``width`` scales 6, 16, 120 and 84."""

    def build(self, o: ModelOptions) -> None:
        num_classes, in_channels, input_size = o.num_classes, o.in_channels, o.input_size
        s1 = conv_out(input_size, 5)
        p1 = s1 // 2
        s2 = conv_out(p1, 5)
        p2 = s2 // 2
        check_spatial("lenet5", input_size, [s1, p1, s2, p2])
        self._flat_hw = p2 * p2
        c1, c2, f1, f2 = o.ch(6), o.ch(16), o.ch(120), o.ch(84)
        self.conv1 = ConvBNAct(in_channels, c1, 5, opts=o)
        self.conv2 = ConvBNAct(c1, c2, 5, opts=o)
        self.pool = MaxPool2x2()
        self.fc1 = nn.Linear(c2 * self._flat_hw, f1)
        self.fc2 = nn.Linear(f1, f2)
        self.fc3 = nn.Linear(f2, num_classes)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.conv1(x))
        x = self.pool(self.conv2(x))
        x = torch.flatten(x, 1)
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return self.fc3(x)

    def channel_groups(self) -> ChannelGroups:
        """Groups ``conv1``, ``conv2``, ``fc1``, ``fc2`` plus fixed ``input``/``classes``;
        ``fc1`` reads ``conv2`` with repeat ``s²``."""
        lay = GroupLayout(self)
        self.conv1.declare(lay, "conv1", INPUT, "conv1")
        self.conv2.declare(lay, "conv2", "conv1", "conv2")
        lay.linear("fc1", "conv2", "fc1", repeat=self._flat_hw)
        lay.linear("fc2", "fc1", "fc2")
        lay.linear("fc3", "fc2", CLASSES)
        return lay.build()
