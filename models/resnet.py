"""CIFAR ResNet-18.

Stem: conv3×3(C→64, stride 1, padding 1)–BN–ReLU, no max-pool. Four stages of two ``BasicBlock``s with
widths 64/128/256/512, stride 2 at the start of stages 2–4; a block whose shape changes gets a
``downsample`` shortcut (conv1×1 + BN). Global average pooling, then FC(512→classes). With
``norm="none"`` every BN is dropped and convs get biases (``norm="groupnorm1"``: GroupNorm(1, C)
in place of every BN); ``conv_bias=True`` with ``norm="bn"`` gives the
FedDUMAP authors' variant (convs with bias followed by BN). Forward MACs at 3×32×32: 555,417,600 in the
convs plus ``512·classes`` in the FC (555,468,800 with 100 classes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ._common import ModelOptions, ZooModel, check_spatial, conv_out, is_norm, make_norm
from .groups import CLASSES, INPUT, ChannelGroups, GroupLayout

__all__ = ["BasicBlock", "ResNet", "ResNet18"]


def _norm(channels: int, o: ModelOptions) -> nn.Module:
    return make_norm(channels, o)


class BasicBlock(nn.Module):
    """Two 3×3 conv+BN with an identity or ``downsample`` (1×1 conv + BN) shortcut."""

    def __init__(self, in_channels: int, channels: int, stride: int, o: ModelOptions) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=o.conv_bias)
        self.bn1 = _norm(channels, o)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=o.conv_bias)
        self.bn2 = _norm(channels, o)
        self.relu = nn.ReLU()
        self.downsample: nn.Sequential | None = None
        if stride != 1 or in_channels != channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride, bias=o.conv_bias), _norm(channels, o)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu(out + shortcut)

    def declare(self, lay: GroupLayout, path: str, inputs: str, out: str) -> None:
        """Block-internal group ``<path>.conv1``; output group ``out`` (tied to ``inputs`` when the
        shortcut is the identity)."""
        mid = f"{path}.conv1"
        lay.conv(f"{path}.conv1", inputs, mid)
        if is_norm(self.bn1):
            lay.norm(f"{path}.bn1", mid)
        lay.conv(f"{path}.conv2", mid, out)
        if is_norm(self.bn2):
            lay.norm(f"{path}.bn2", out)
        if self.downsample is not None:
            lay.conv(f"{path}.downsample.0", inputs, out)
            if is_norm(self.downsample[1]):
                lay.norm(f"{path}.downsample.1", out)
        elif inputs != out:
            raise ValueError(f"{path}: identity shortcut must tie {inputs!r} and {out!r}")


class ResNet(ZooModel):
    """CIFAR-style ResNet with ``BasicBlock``s (see the module docstring)."""

    # the stages, registered by name in ``__init__``
    layer1: nn.Sequential
    layer2: nn.Sequential
    layer3: nn.Sequential
    layer4: nn.Sequential

    def build(self, o: ModelOptions, *, num_blocks: Sequence[int] = (2, 2, 2, 2)) -> None:
        num_classes, in_channels, input_size = o.num_classes, o.in_channels, o.input_size
        if len(num_blocks) != 4 or any(int(n) < 1 for n in num_blocks):
            raise ValueError(f"num_blocks must be 4 positive integers, got {tuple(num_blocks)!r}")
        size, sizes = input_size, []
        for _ in range(3):
            size = conv_out(size, 3, 2, 1)
            sizes.append(size)
        check_spatial("resnet", input_size, sizes)
        c = o.ch(64)
        self.conv1 = nn.Conv2d(in_channels, c, 3, 1, 1, bias=o.conv_bias)
        self.bn1 = _norm(c, o)
        self.relu = nn.ReLU()
        c_in = c
        for stage, (base, n) in enumerate(zip((64, 128, 256, 512), num_blocks), start=1):
            c_out = o.ch(base)
            blocks = []
            for i in range(int(n)):
                stride = 2 if (i == 0 and stage > 1) else 1
                blocks.append(BasicBlock(c_in, c_out, stride, o))
                c_in = c_out
            self.add_module(f"layer{stage}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)

    def channel_groups(self) -> ChannelGroups:
        """Residual groups ``layer1``..``layer4`` (``layer1`` also holds the stem output), one
        block-internal group ``layerK.i.conv1`` per block, plus fixed ``input``/``classes``."""
        lay = GroupLayout(self)
        lay.conv("conv1", INPUT, "layer1")
        if is_norm(self.bn1):
            lay.norm("bn1", "layer1")
        prev = "layer1"
        for stage, layer in enumerate((self.layer1, self.layer2, self.layer3, self.layer4), start=1):
            out = f"layer{stage}"
            for i, block in enumerate(layer):
                assert isinstance(block, BasicBlock)
                block.declare(lay, f"{out}.{i}", prev, out)
                prev = out
        lay.linear("fc", prev, CLASSES)
        return lay.build()


class ResNet18(ResNet):
    """CIFAR ResNet-18: :class:`ResNet` with ``num_blocks=(2, 2, 2, 2)``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(num_blocks=(2, 2, 2, 2), **kwargs)
