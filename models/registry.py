"""Model registry: ``build_model(name, ...)`` and ``list_models()``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, overload

from torch import nn

from .cnn import CNN
from .googlenet import GoogLeNet
from .lenet import LeNet5
from .logreg import LogReg
from .preact_resnet import PreActResNet18
from .resnet import ResNet18
from .resnet_proj import ResNet18Proj
from .svhn_cnn import SVHNCNN
from .vgg import VGG11

__all__ = ["build_model", "canonical_name", "list_models", "register_model", "unregister_model"]

_F = TypeVar("_F", bound=Callable[..., nn.Module])

_MODELS: dict[str, Callable[..., nn.Module]] = {
    "lenet5": LeNet5,
    "cnn": CNN,
    "vgg11": VGG11,
    "resnet18": ResNet18,
    "preact_resnet18": PreActResNet18,
    "googlenet": GoogLeNet,
    "logreg": LogReg,
    "svhn_cnn": SVHNCNN,
    "resnet18_proj": ResNet18Proj,
}
_ALIASES = {
    "lenet": "lenet5",
    "vgg": "vgg11",
    "resnet": "resnet18",
    "feddumapcnn": "cnn",
    # the DynaComm paper's CNN is LeNet-5 (6/16 5×5 convs, FC 120/84); use it with norm="groupnorm1"
    "dynacommcnn": "lenet5",
    "preactresnet": "preact_resnet18",
    "preactresnet18": "preact_resnet18",
    "logisticregression": "logreg",
    "mlr": "logreg",
}


# canonical names written without "_" (the lookup key drops "-" and "_")
_CANONICAL = {name.replace("_", ""): name for name in _MODELS}


@overload
def register_model(name: str, factory: None = None, *, replace: bool = False) -> Callable[[_F], _F]: ...


@overload
def register_model(name: str, factory: _F, *, replace: bool = False) -> _F: ...


def register_model(name: str, factory: Callable[..., nn.Module] | None = None, *, replace: bool = False) -> Any:
    """Make ``factory`` buildable as ``model.name: <name>`` (it is called with the keyword
    arguments of :func:`build_model`'s model section: ``num_classes``, ``in_channels``, …).
    A name already taken is refused unless ``replace``. Returns ``factory``; without it, a
    decorator (``@register_model("mine")`` on a class or function)."""
    if factory is None:
        return lambda f: register_model(name, f, replace=replace)
    key = name.lower().replace("-", "").replace("_", "")
    if not key or not callable(factory):
        raise ValueError(f"register_model: a name and a callable are needed, got {name!r}, {factory!r}")
    taken = _CANONICAL.get(key) or _ALIASES.get(key)
    if taken is not None and not replace:
        raise ValueError(f"register_model: {name!r} is already the model {taken!r}; pass replace=True")
    canonical = taken if taken is not None and taken in _MODELS else name
    _MODELS[canonical] = factory
    _CANONICAL[canonical.replace("_", "").lower()] = canonical
    return factory


def unregister_model(name: str) -> None:
    """Forget a model added with :func:`register_model`."""
    key = canonical_name(name)
    del _MODELS[key]
    _CANONICAL.pop(key.replace("_", "").lower(), None)


def list_models() -> list[str]:
    """Canonical names accepted by :func:`build_model` (sorted)."""
    return sorted(_MODELS)


def canonical_name(name: str) -> str:
    """Normalise ``name`` (case, ``-``/``_`` ignored, aliases ``lenet``, ``vgg``, ``resnet``).

    Raises ``ValueError`` listing the accepted names when ``name`` is unknown.
    """
    if not isinstance(name, str):
        raise ValueError(f"model name must be a string, one of {list_models()}, got {name!r}")
    key = name.lower().replace("-", "").replace("_", "")
    key = _ALIASES.get(key, key)
    key = _CANONICAL.get(key, key)
    if key not in _MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {list_models()}")
    return key


def build_model(
    name: str,
    *,
    num_classes: int = 10,
    in_channels: int = 3,
    width: float = 1.0,
    norm: str = "bn",
    input_size: int = 32,
    conv_bias: bool | None = None,
    track_running_stats: bool = True,
    init: str = "torch",
) -> nn.Module:
    """Build a zoo model.

    Parameters
    ----------
    name:
        one of :func:`list_models` (``lenet5``, ``cnn``, ``vgg11``, ``resnet18``,
        ``preact_resnet18``, ``googlenet``, ``logreg``, ``svhn_cnn``, ``resnet18_proj``);
        ``dynacomm_cnn`` is an alias of ``lenet5``.
    num_classes, in_channels:
        logits and image channels (never scaled by ``width``).
    width:
        multiplier of every hidden channel/unit count; sizes are ``max(1, ceil(c·width))``.
    norm:
        ``"bn"`` (conv → BatchNorm2d → ReLU), ``"groupnorm1"`` (conv → GroupNorm(1, C) → ReLU; the
        DynaComm paper's models) or ``"none"`` (conv with bias → ReLU; the FedDUMAP models).
    input_size:
        square input side (32 for CIFAR, 28 for DermaMNIST); flatten sizes follow from it.
    conv_bias:
        conv biases; ``None`` = exactly when ``norm="none"``.
    track_running_stats:
        passed to every BatchNorm2d (``False`` for HeteroFL's static BN during local training).
    init:
        ``"torch"`` (PyTorch defaults) or ``"kaiming_out"`` (conv N(0, 2/(k²·C_out)), bias 0).

    The result is deterministic given ``torch.manual_seed`` and exposes ``channel_groups()``.
    """
    cls = _MODELS[canonical_name(name)]
    return cls(
        num_classes=num_classes,
        in_channels=in_channels,
        width=width,
        norm=norm,
        input_size=input_size,
        conv_bias=conv_bias,
        track_running_stats=track_running_stats,
        init=init,
    )
