"""Multinomial logistic regression: flatten → Linear(C·H·W → classes).

The linear model the DynInit authors train on MNIST and Fashion-MNIST (at 1×28×28, 10 classes:
7,850 parameters and 7,840 MACs). It has no hidden units, so ``width`` and ``norm`` change nothing
(they are accepted, and validated, like every zoo model's); its channel groups are only the fixed
``input`` and ``classes``, so width slicing and structured pruning leave it whole.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import ModelOptions, ZooModel
from .groups import CLASSES, INPUT, ChannelGroups, GroupLayout

__all__ = ["LogReg"]


class LogReg(ZooModel):
    """Multinomial logistic regression (see the module docstring); logits out, no softmax."""

    #: the forward is ``fc(flatten(x))``: vectorised trainers may run it as one batched product
    flat_linear = "fc"

    option_defaults = {"in_channels": 1, "input_size": 28}

    def build(self, o: ModelOptions) -> None:
        num_classes, in_channels, input_size = o.num_classes, o.in_channels, o.input_size
        self._flat_hw = input_size * input_size
        self.fc = nn.Linear(in_channels * self._flat_hw, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(x, 1))

    def channel_groups(self) -> ChannelGroups:
        """``fc`` reads the fixed ``input`` group (repeat ``H·W``) and writes ``classes``."""
        lay = GroupLayout(self)
        lay.linear("fc", INPUT, CLASSES, repeat=self._flat_hw)
        return lay.build()
