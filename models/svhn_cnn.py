"""The SVHN CNN of the DynInit study.

[conv3×3(C→32, pad 1)–norm–ReLU, conv3×3(32→32, pad 1)–norm–ReLU, MaxPool2] →
[conv3×3(32→64)–norm–ReLU, conv3×3(64→64)–norm–ReLU, MaxPool2] → [conv3×3(64→128)–norm–ReLU,
MaxPool2] → flatten → FC(128·s²→256)–ReLU–Dropout(0.4) → FC(256→classes). At 3×32×32 (``s = 4``,
2048 features), 10 classes and BatchNorm: 667,178 parameters (the convs keep their biases, as in
the study, unless ``conv_bias=False``).
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import ConvBNAct, MaxPool2x2, ModelOptions, ZooModel, check_spatial
from .groups import CLASSES, INPUT, ChannelGroups, GroupLayout

__all__ = ["SVHNCNN"]


class SVHNCNN(ZooModel):
    """The SVHN CNN (see the module docstring); ``width`` scales every conv and the 256-unit FC."""

    # the study's convs keep their biases before the norm (667,178 parameters)
    option_defaults = {"conv_bias": True}

    def build(self, o: ModelOptions, *, dropout: float = 0.4) -> None:
        num_classes, in_channels, input_size = o.num_classes, o.in_channels, o.input_size
        s = input_size // 8
        check_spatial("svhn_cnn", input_size, [input_size // 2, input_size // 4, s])
        self._flat_hw = s * s
        c1, c2, c3, f1 = o.ch(32), o.ch(64), o.ch(128), o.ch(256)
        self.conv1 = ConvBNAct(in_channels, c1, 3, padding=1, opts=o)
        self.conv2 = ConvBNAct(c1, c1, 3, padding=1, opts=o)
        self.conv3 = ConvBNAct(c1, c2, 3, padding=1, opts=o)
        self.conv4 = ConvBNAct(c2, c2, 3, padding=1, opts=o)
        self.conv5 = ConvBNAct(c2, c3, 3, padding=1, opts=o)
        self.pool = MaxPool2x2()
        self.fc1 = nn.Linear(c3 * self._flat_hw, f1)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(f1, num_classes)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.conv2(self.conv1(x)))
        x = self.pool(self.conv4(self.conv3(x)))
        x = self.pool(self.conv5(x))
        x = torch.flatten(x, 1)
        x = self.drop(self.relu(self.fc1(x)))
        return self.fc2(x)

    def channel_groups(self) -> ChannelGroups:
        """Groups ``conv1``…``conv5`` and ``fc1`` plus the fixed ``input``/``classes``; ``fc1``
        reads ``conv5`` with repeat ``s²`` (16 at 32×32)."""
        lay = GroupLayout(self)
        self.conv1.declare(lay, "conv1", INPUT, "conv1")
        self.conv2.declare(lay, "conv2", "conv1", "conv2")
        self.conv3.declare(lay, "conv3", "conv2", "conv3")
        self.conv4.declare(lay, "conv4", "conv3", "conv4")
        self.conv5.declare(lay, "conv5", "conv4", "conv5")
        lay.linear("fc1", "conv5", "fc1", repeat=self._flat_hw)
        lay.linear("fc2", "fc1", CLASSES)
        return lay.build()
