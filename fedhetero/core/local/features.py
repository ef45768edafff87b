"""The classifier of a zoo model and the features it reads (the penultimate representation).

Representation-level methods (MOON's contrastive loss, FedGen's generator) need the features a
model hands to its final classifier. Every zoo model ends in one ``nn.Linear`` that maps those
features to the class logits (LeNet-5 ``fc3``, the CNN ``fc2``, VGG-11 ``classifier.4``, ResNet-18
and GoogLeNet ``fc``), so instead of editing the models this module finds that layer and records
its input with a forward pre-hook:

* :func:`classifier_of` — the final classifier (the last ``nn.Linear`` in module order whose
  output size is the number of classes) and its path in the state dict;
* :class:`FeatureTap` — a context manager that records the classifier's input (and, optionally,
  the model's own input) on every forward while it is open;
* :func:`penultimate` — one forward, returning the features;
* :func:`has_hidden_layers` — False for a model that is its classifier alone (logistic
  regression), whose "features" are the raw input.

The hooks only read tensors; they never change what the model computes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["FeatureTap", "classifier_of", "has_hidden_layers", "penultimate"]


def classifier_of(model: nn.Module, num_classes: int | None = None) -> tuple[str, nn.Linear]:
    """``(path, module)`` of the model's final classifier.

    The last ``nn.Linear`` (in registration order) whose ``out_features`` equals the number of
    classes (``num_classes``, else the model's ``num_classes`` attribute); when the class count is
    unknown, the last ``nn.Linear``. Raises ``ValueError`` for a model without one."""
    classes = num_classes if num_classes is not None else getattr(model, "num_classes", None)
    found: tuple[str, nn.Linear] | None = None
    last: tuple[str, nn.Linear] | None = None
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last = (path, module)
            if classes is None or module.out_features == int(classes):
                found = (path, module)
    hit = found if classes is not None else last
    if hit is None:
        raise ValueError(
            f"{type(model).__name__} has no nn.Linear classifier"
            + (f" with {classes} outputs" if classes is not None else "")
            + "; representation-level methods need one"
        )
    return hit


def has_hidden_layers(model: nn.Module, num_classes: int | None = None) -> bool:
    """Whether the model has parameters outside its final classifier (False for logistic
    regression, where the classifier reads the flattened input)."""
    _, head = classifier_of(model, num_classes)
    own = {id(p) for p in head.parameters()}
    return any(id(p) not in own for p in model.parameters())


class FeatureTap:
    """Records the classifier's input (``features``) and, with ``capture_input``, the model's
    input (``input``) of the latest forward, while the ``with`` block is open::

        with FeatureTap(model) as tap:
            logits = model(x)
        z = tap.features        # the penultimate representation, with its autograd graph
    """

    def __init__(self, model: nn.Module, num_classes: int | None = None, capture_input: bool = False) -> None:
        self.model = model
        self.path, self.classifier = classifier_of(model, num_classes)
        self.capture_input = capture_input
        self.features: torch.Tensor | None = None
        self.input: torch.Tensor | None = None
        self._handles: list[Any] = []

    def _on_classifier(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.features = args[0]

    def _on_model(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.input = args[0]

    def __enter__(self) -> "FeatureTap":
        self._handles.append(self.classifier.register_forward_pre_hook(self._on_classifier))
        if self.capture_input:
            self._handles.append(self.model.register_forward_pre_hook(self._on_model))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.features = None
        self.input = None


def penultimate(model: nn.Module, x: torch.Tensor, num_classes: int | None = None) -> torch.Tensor:
    """The features ``model`` hands to its classifier for input ``x`` (one forward pass)."""
    with FeatureTap(model, num_classes) as tap:
        model(x)
        z = tap.features
    assert z is not None
    return z
