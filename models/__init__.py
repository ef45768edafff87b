"""Model zoo of the reproduced papers (torch only): LeNet-5, the FedDUMAP CNN, VGG-11, CIFAR ResNet-18
and CIFAR GoogLeNet, all built from standard ``Conv2d`` + ``BatchNorm2d`` (+ ReLU) modules (or
``GroupNorm(1, C)`` with ``norm="groupnorm1"``), a pre-activation ResNet-18, plus
multinomial logistic regression (``logreg``); each has a ``channel_groups()`` description for
sub-model slicing."""

from .cnn import CNN
from .googlenet import GoogLeNet, Inception
from .groups import CLASSES, INPUT, ChannelGroups, DimMap, GroupLayout, Segment, scale_channels
from .lenet import LeNet5
from .logreg import LogReg
from .preact_resnet import PreActBlock, PreActResNet18
from .registry import build_model, canonical_name, list_models, register_model, unregister_model
from .resnet import BasicBlock, ResNet, ResNet18
from .vgg import VGG11

__all__ = [
    "build_model",
    "list_models",
    "canonical_name",
    "register_model",
    "unregister_model",
    "LeNet5",
    "LogReg",
    "CNN",
    "VGG11",
    "ResNet",
    "ResNet18",
    "BasicBlock",
    "PreActResNet18",
    "PreActBlock",
    "GoogLeNet",
    "Inception",
    "ChannelGroups",
    "GroupLayout",
    "DimMap",
    "Segment",
    "INPUT",
    "CLASSES",
    "scale_channels",
]
