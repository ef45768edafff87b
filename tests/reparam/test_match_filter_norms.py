"""``reparam.match_filter_norms``: scaling a conv that a BatchNorm follows, with the BN's running
statistics, keeps the model's function while each filter takes the reference filter's norm.

Properties over random float64 conv → BN stacks (with and without conv bias, affine and not,
random running statistics, random reference norms over four orders of magnitude, zero filters on
either side): the eval function is unchanged to rounding; the training-mode function to the BN's
``eps``; every filter has its reference's norm unless the variance floor raised its factor (then
that channel's running variance is zero); channels whose factor is 1 are bit for bit unchanged.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import reparam


def _stack(seed: int, bias: bool, affine: bool) -> nn.Sequential:
    g = torch.Generator().manual_seed(seed)
    m = nn.Sequential(
        nn.Conv2d(3, 6, 3, bias=bias), nn.BatchNorm2d(6, affine=affine), nn.ReLU(),
        nn.Conv2d(6, 5, 3, padding=1, bias=bias), nn.BatchNorm2d(5, affine=affine),
    ).double()
    with torch.no_grad():
        for mod in m:
            if isinstance(mod, nn.Conv2d):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=g, dtype=torch.float64))
            if isinstance(mod, nn.BatchNorm2d):
                n = mod.num_features
                mod.running_mean.copy_(torch.randn(n, generator=g, dtype=torch.float64))
                mod.running_var.copy_(torch.rand(n, generator=g, dtype=torch.float64) * 4 + 1e-3)
                if affine:
                    mod.weight.copy_(torch.randn(n, generator=g, dtype=torch.float64))
                    mod.bias.copy_(torch.randn(n, generator=g, dtype=torch.float64))
    return m


@settings(max_examples=30, database=None, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), bias=st.booleans(), affine=st.booleans(),
       log_scale=st.floats(-2.0, 2.0), zero_model=st.booleans(), zero_ref=st.booleans(), same=st.booleans())
def test_match_filter_norms_keeps_the_function_and_takes_the_reference_norms(seed, bias, affine, log_scale, zero_model, zero_ref, same):
    model = _stack(seed, bias, affine)
    g = torch.Generator().manual_seed(seed + 1)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        # reference filters: random directions, norms spread around 10**log_scale (per channel)
        w = ref["3.weight"]
        spread = torch.exp(torch.randn(w.shape[0], 1, 1, 1, generator=g, dtype=torch.float64))
        ref["3.weight"] = torch.randn(w.shape, generator=g, dtype=torch.float64) * spread * 10**log_scale
        if not same:
            ref["0.weight"] = ref["0.weight"] * 10 ** (-log_scale)
        if zero_ref:
            ref["3.weight"][1].zero_()
        if zero_model:
            model[3].weight[2].zero_()
    before = copy.deepcopy(model)
    x = torch.randn(8, 3, 9, 9, generator=g, dtype=torch.float64)
    model.eval(), before.eval()
    with torch.no_grad():
        y0 = before(x)
    factors = reparam.match_filter_norms(model, ref)
    assert set(factors) == {"0", "3"}
    with torch.no_grad():
        y1 = model(x)
    assert (y1 - y0).abs().max() <= 1e-10 * y0.abs().max().clamp_min(1.0)
    # training mode normalises by the batch's own statistics: free of the conv's scale but for
    # eps (a scaled batch variance near eps moves the output), so compare without it
    trained, trained_before = copy.deepcopy(model).train(), copy.deepcopy(before).train()  # a forward moves the statistics
    for m in (*trained, *trained_before):
        if isinstance(m, nn.BatchNorm2d):
            m.eps = 1e-300
    with torch.no_grad():
        t0, t1 = trained_before(x), trained(x)
    assert (t1 - t0).abs().max() <= 1e-10 * t0.abs().max().clamp_min(1.0)
    for path in ("0", "3"):
        conv, bn, old_conv, old_bn = model[int(path)], model[int(path) + 1], before[int(path)], before[int(path) + 1]
        c = factors[path]
        n_new = conv.weight.detach().flatten(1).norm(dim=1)
        n_ref = ref[f"{path}.weight"].flatten(1).norm(dim=1)
        n_old = old_conv.weight.detach().flatten(1).norm(dim=1)
        moved = c != 1.0
        floored = moved & (bn.running_var == 0)
        exact = moved & ~floored
        assert torch.allclose(n_new[exact], n_ref[exact], rtol=1e-12, atol=0)
        assert bool((c > 0).all())
        # channels left alone: bit for bit
        assert torch.equal(conv.weight[~moved], old_conv.weight[~moved])
        assert torch.equal(bn.running_var[~moved], old_bn.running_var[~moved])
        assert torch.equal(bn.running_mean[~moved], old_bn.running_mean[~moved])
        # a zero filter on either side keeps its scale
        assert bool((c[(n_old == 0) | (n_ref == 0)] == 1.0).all())


def test_a_factor_below_the_variance_floor_is_raised_to_it_and_the_function_stays():
    model = _stack(0, True, True)
    model[1].running_var.fill_(1e-6)  # v + eps ≈ 1.1e-5: any c² below eps/(v+eps) ≈ 0.91 is floored
    ref = {"0.weight": model[0].weight.detach() * 1e-3}
    before = copy.deepcopy(model).eval()
    model.eval()
    x = torch.randn(4, 3, 9, 9, dtype=torch.float64)
    factors = reparam.match_filter_norms(model, ref, {"0": "1"})
    eps = model[1].eps
    assert torch.allclose(factors["0"], torch.full((6,), (eps / (1e-6 + eps)) ** 0.5, dtype=torch.float64), rtol=1e-12)
    assert bool((model[1].running_var == 0).all())
    with torch.no_grad():
        assert torch.allclose(model(x), before(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("reference", ["missing", "other shape"])
def test_convs_the_reference_does_not_hold_are_left_alone(reference):
    model = _stack(1, False, True)
    before = copy.deepcopy(model)
    ref = {} if reference == "missing" else {"0.weight": torch.ones(6, 3, 5, 5, dtype=torch.float64)}
    assert reparam.match_filter_norms(model, ref) == {}
    for a, b in zip(model.state_dict().values(), before.state_dict().values()):
        assert torch.equal(a, b)


@settings(max_examples=15, database=None, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), bias=st.booleans(), log_scale=st.floats(-2.0, 2.0))
def test_with_inputs_the_statistics_are_measured_and_training_mode_starts_from_the_eval_function(seed, bias, log_scale):
    """Measured on one batch, every BN's statistics are that batch's, so training mode on it
    (batch statistics) computes what eval mode computes; the eval function and the filter norms
    are as without inputs."""
    model = _stack(seed, bias, True)
    g = torch.Generator().manual_seed(seed + 2)
    ref = {k: v * 10**log_scale for k, v in model.state_dict().items() if k.endswith("weight") and v.dim() == 4}
    x = torch.randn(16, 3, 9, 9, generator=g, dtype=torch.float64)
    before = copy.deepcopy(model).eval()
    with torch.no_grad():
        y0 = before(x)
        assert (copy.deepcopy(before).train()(x) - y0).abs().max() > 1e-3 * y0.abs().max()  # random stats: not yet
    reparam.match_filter_norms(model, ref, inputs=x)
    model.eval()
    with torch.no_grad():
        y1 = model(x)
        t1 = copy.deepcopy(model).train()(x)
    scale = y0.abs().max().clamp_min(1.0)
    assert (y1 - y0).abs().max() <= 1e-10 * scale
    assert (t1 - y1).abs().max() <= 1e-9 * scale
    for path in ("0", "3"):
        n_new = model[int(path)].weight.detach().flatten(1).norm(dim=1)
        assert torch.allclose(n_new, ref[f"{path}.weight"].flatten(1).norm(dim=1), rtol=1e-12)
