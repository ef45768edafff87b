"""Multinomial logistic regression: flatten → Linear(C·H·W → classes).

The linear model the DynInit authors train on MNIST and Fashion-MNIST (at 1×28×28, 10 classes:
7,850 parameters and 7,840 MACs). It has no hidden units, so ``width`` and ``norm`` change nothing
(they are accepted, and validated, like every zoo model's); its channel groups are only the fixed
``input`` and ``classes``, so width slicing and structured pruning leave it whole.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import resolve_options
from .groups import CLASSES, INPUT, ChannelGroups, GroupLayout

__all__ = ["LogReg"]


class LogReg(nn.Module):
    """Multinomial logistic regression (see the module docstring); logits out, no softmax."""

    #: the forward is ``fc(flatten(x))``: vectorised trainers may run it as one batched product
    flat_linear = "fc"

    def __init__(
        self,
        *,
        num_classes: int = 10,
        in_channels: int = 1,
        width: float = 1.0,
        norm: str = "bn",
        input_size: int = 28,
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
        self.num_classes, self.in_channels, self.width, self.input_size = (
            num_classes, in_channels, o.width, input_size,
        )
        self._flat_hw = input_size * input_size
        self.fc = nn.Linear(in_channels * self._flat_hw, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(x, 1))

    def channel_groups(self) -> ChannelGroups:
        """``fc`` reads the fixed ``input`` group (repeat ``H·W``) and writes ``classes``."""
        lay = GroupLayout(self)
        lay.linear("fc", INPUT, CLASSES, repeat=self._flat_hw)
        return lay.build()
