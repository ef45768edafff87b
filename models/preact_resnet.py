"""Pre-activation ResNet-18 (the DynaComm paper's ResNet-18).

Stem: conv3×3(C→64, stride 1, padding 1), no norm and no max-pool. Four stages of two
``PreActBlock``s with widths 64/128/256/512, stride 2 at the start of stages 2–4. A block computes
``a = relu(norm1(x))``, ``out = conv2(relu(norm2(conv1(a))))`` and returns ``out + shortcut``, where
the shortcut is a 1×1 conv applied to ``a`` when the shape changes and ``x`` itself otherwise. Head:
norm, ReLU, global average pooling, FC(512→classes).

``norm`` is ``"groupnorm1"`` (GroupNorm(1, C) everywhere: the paper's setting), ``"bn"`` or
``"none"``. Convs carry a bias only when ``norm="none"`` (unless ``conv_bias`` says otherwise).
The convs are the same as in the post-activation :class:`~models.resnet.ResNet18`, so forward MACs
at 3×32×32 are 555,417,600 plus ``512·classes`` in the FC. Norms sit before the convs, so
``reparam``'s conv+BN pair detection finds nothing to expand in this model.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import ModelOptions, ZooModel, check_spatial, conv_out, is_norm, make_norm
from .groups import CLASSES, INPUT, ChannelGroups, GroupLayout

__all__ = ["PreActBlock", "PreActResNet18"]


class PreActBlock(nn.Module):
    """norm → ReLU → conv3×3 → norm → ReLU → conv3×3, plus an identity or 1×1-conv shortcut."""

    def __init__(self, in_channels: int, channels: int, stride: int, o: ModelOptions) -> None:
        super().__init__()
        self.norm1 = make_norm(in_channels, o)
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=o.conv_bias)
        self.norm2 = make_norm(channels, o)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=o.conv_bias)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module | None = None
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Conv2d(in_channels, channels, 1, stride, bias=o.conv_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.relu(self.norm1(x))
        skip = x if self.shortcut is None else self.shortcut(a)
        out = self.conv1(a)
        out = self.conv2(self.relu(self.norm2(out)))
        return out + skip

    def declare(self, lay: GroupLayout, path: str, inputs: str, out: str) -> None:
        """Block-internal group ``<path>.conv1``; output group ``out`` (tied to ``inputs`` when the
        shortcut is the identity). ``norm1`` normalises the input group."""
        mid = f"{path}.conv1"
        if is_norm(self.norm1):
            lay.norm(f"{path}.norm1", inputs)
        lay.conv(f"{path}.conv1", inputs, mid)
        if is_norm(self.norm2):
            lay.norm(f"{path}.norm2", mid)
        lay.conv(f"{path}.conv2", mid, out)
        if self.shortcut is not None:
            lay.conv(f"{path}.shortcut", inputs, out)
        elif inputs != out:
            raise ValueError(f"{path}: identity shortcut must tie {inputs!r} and {out!r}")


class PreActResNet18(ZooModel):
    """Pre-activation ResNet-18 (see the module docstring). ``width`` scales 64/128/256/512."""

    def build(self, o: ModelOptions) -> None:
        num_classes, in_channels, input_size = o.num_classes, o.in_channels, o.input_size
        size, sizes = input_size, []
        for _ in range(3):
            size = conv_out(size, 3, 2, 1)
            sizes.append(size)
        check_spatial("preact_resnet18", input_size, sizes)
        c = o.ch(64)
        self.conv1 = nn.Conv2d(in_channels, c, 3, 1, 1, bias=o.conv_bias)
        c_in = c
        stages: list[nn.Sequential] = []
        for stage, base in enumerate((64, 128, 256, 512), start=1):
            c_out = o.ch(base)
            blocks = []
            for i in range(2):
                stride = 2 if (i == 0 and stage > 1) else 1
                blocks.append(PreActBlock(c_in, c_out, stride, o))
                c_in = c_out
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.norm = make_norm(c_in, o)
        self.relu = nn.ReLU()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.relu(self.norm(x))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)

    def channel_groups(self) -> ChannelGroups:
        """Residual groups ``layer1``..``layer4`` (``layer1`` also holds the stem output), one
        block-internal group ``layerK.i.conv1`` per block, plus fixed ``input``/``classes``."""
        lay = GroupLayout(self)
        lay.conv("conv1", INPUT, "layer1")
        prev = "layer1"
        for stage, layer in enumerate((self.layer1, self.layer2, self.layer3, self.layer4), start=1):
            out = f"layer{stage}"
            for i, block in enumerate(layer):
                assert isinstance(block, PreActBlock)
                block.declare(lay, f"{out}.{i}", prev, out)
                prev = out
        if is_norm(self.norm):
            lay.norm("norm", prev)
        lay.linear("fc", prev, CLASSES)
        return lay.build()
