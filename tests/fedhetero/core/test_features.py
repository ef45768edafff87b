"""The classifier/feature hook the methods share (fedhetero.core.local.features) on every zoo model, and
MOON's representation built on it."""

from __future__ import annotations

import pytest
import torch

from fedhetero.core.local.features import classifier_of, has_hidden_layers, penultimate
from fedhetero.algorithms.classic.moon import representation
from fedhetero.models import build_model, list_models


CLASSIFIERS = {"lenet5": "fc3", "cnn": "fc2", "vgg11": "classifier.4", "resnet18": "fc", "googlenet": "fc", "logreg": "fc"}


@pytest.mark.parametrize("name", list_models())
def test_classifier_and_features_of_every_zoo_model(name):
    torch.manual_seed(0)
    model = build_model(name, num_classes=10, in_channels=3, width=0.25, input_size=32).eval()
    found, head = classifier_of(model)
    if name in CLASSIFIERS:
        assert found == CLASSIFIERS[name]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        z = penultimate(model, x)
        assert z.shape == (2, head.in_features)
        assert torch.equal(head(z), model(x))
        # MOON contrasts the penultimate features; a model that is its classifier alone (its
        # "features" are the raw input, equal for every model) contrasts its logits
        if has_hidden_layers(model):
            assert torch.equal(representation(model, x), z)
        else:
            assert torch.equal(z, x.flatten(1))
            assert torch.equal(representation(model, x), model(x))
    assert not model._forward_pre_hooks and not head._forward_pre_hooks  # hooks removed
