"""reparam.testing: assert_equivalent follows the models' dtype and gives train-mode forwards the same
random numbers; perturb_ leaves no initial value behind.

The README example compares a merged float32 torchvision ResNet-18 with its expanded model using
the defaults; a float64 tolerance applied to float32 weights made that fail, and so did dropout in
train mode (two forwards drawing different masks).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import reparam
from reparam.testing import assert_equivalent, default_rtol, perturb_, rel_err


def _small_resnet_like(dtype: torch.dtype = torch.float32) -> nn.Module:
    class Block(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(c)
            self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(c)

        def forward(self, x):
            return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))

    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        *[Block(16) for _ in range(4)],
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5), nn.Linear(16, 10),
    ).to(dtype)


def test_defaults_follow_float32_models(tv) -> None:
    """The README example as written: untrained float32 torchvision resnet18, default arguments."""
    torch.manual_seed(0)
    model = tv.models.resnet18()
    expanded = reparam.expand(model)
    expanded.eval()
    plain = reparam.merge(expanded)
    x = torch.randn(2, 3, 64, 64)
    err = assert_equivalent(plain, expanded, x)
    assert err <= default_rtol(torch.float32)


def test_float32_weights_get_the_float32_tolerance_even_in_float64() -> None:
    gen = torch.Generator().manual_seed(0)
    expanded = perturb_(reparam.expand(_small_resnet_like()), gen).eval()
    plain = reparam.merge(expanded)
    x = torch.randn(2, 3, 16, 16, generator=gen)
    assert assert_equivalent(plain, expanded, x) <= 1e-5
    # converting float32 weights to float64 does not make them float64-exact: float32 tolerance
    assert assert_equivalent(plain, expanded, x, dtype=torch.float64) <= 1e-5
    # a float64 model keeps the tight tolerance, and a real mismatch still fails in float32
    e64 = perturb_(reparam.expand(_small_resnet_like(torch.float64)), gen).eval()
    assert assert_equivalent(reparam.merge(e64), e64, x.double()) <= 1e-10
    broken = copy.deepcopy(plain)
    with torch.no_grad():
        broken[-1].bias[0] += 1e-3 * expanded(x).abs().max()  # a mismatch of 1e-3 of the output scale
    with pytest.raises(AssertionError):
        assert_equivalent(broken, expanded, x)


def test_train_mode_uses_the_same_random_numbers_and_keeps_the_callers_stream() -> None:
    torch.manual_seed(0)
    model = _small_resnet_like()
    expanded = reparam.expand(model)  # bit-exact in train mode, dropout included
    x = torch.randn(4, 3, 8, 8)
    state = torch.get_rng_state()
    assert assert_equivalent(model, expanded, x, mode="train") == 0.0
    assert torch.equal(torch.get_rng_state(), state), "the caller's random stream must be left as it was"
    # without the shared state the two dropout masks differ: the check is not vacuous
    model.train(), expanded.train()
    with torch.no_grad():
        assert rel_err(model(x), expanded(x)) > 1e-3


def test_perturb_moves_every_parameter_and_statistic() -> None:
    expanded = reparam.expand(_small_resnet_like())
    before = {k: v.clone() for k, v in expanded.state_dict().items() if v.is_floating_point()}
    perturb_(expanded, torch.Generator().manual_seed(3))
    after = expanded.state_dict()
    assert [k for k in before if torch.equal(before[k], after[k])] == []
