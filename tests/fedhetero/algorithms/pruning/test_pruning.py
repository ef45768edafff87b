"""Structured pruning: HRank ranks, FedAP rates, Taylor/magnitude criteria, budget plans, surgery."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fedhetero.algorithms.pruning import (
    POLICIES,
    BudgetError,
    ChannelMacs,
    aggregate_rates,
    aggregation_weights,
    dataset_prune_rate,
    fedap_group_rates,
    fedap_layer_rates,
    fedap_prune,
    feature_map_ranks,
    hrank_keep,
    hrank_scores,
    kept_count,
    layer_rates_from_threshold,
    magnitude_scores,
    magnitude_threshold,
    plan_for_budget,
    plan_from_rates,
    plateau_rate,
    prunable_groups,
    prune,
    prune_order,
    rank_points,
    slice_tensors,
    spectral_gap_rate,
    spectral_mass_above,
    taylor_bn_scores,
)
from fedhetero.core.hetero.submodel import (
    SubmodelSpec,
    extract_state,
    finalize,
    gather,
    init_buffers,
    masked_state,
    scatter,
    scatter_add_,
)
from fedhetero.models import build_model
from fedhetero.models.groups import CLASSES, INPUT, GroupLayout
from reparam.flops import model_macs

ZOO = ["lenet5", "cnn", "vgg11", "resnet18", "googlenet"]
# narrower copies keep every structural feature (groups, flatten, residuals, concats) but run faster
WIDTH = {"lenet5": 1.0, "cnn": 1.0, "vgg11": 0.5, "resnet18": 0.5, "googlenet": 0.25}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _randomize_bn(model: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.running_mean.copy_(torch.randn(n, generator=g))
                m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
                m.weight.copy_(torch.rand(n, generator=g) + 0.5)
                m.bias.copy_(torch.randn(n, generator=g))


def _random_keep(model: nn.Module, groups: list[str], seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = model.channel_groups().sizes
    out = {}
    for name in groups:
        d = sizes[name]
        k = int(torch.randint(1, d + 1, (1,), generator=g))
        out[name] = torch.randperm(d, generator=g)[:k]
    return out


# ------------------------------------------------------------------------------------------ surgery
@pytest.mark.parametrize("name", ZOO)
def test_rate_zero_is_identity(name: str) -> None:
    torch.manual_seed(0)
    size = 16 if name == "googlenet" else 32
    model = build_model(name, input_size=size, width=WIDTH[name]).eval()
    _randomize_bn(model)
    groups = prunable_groups(model, "group")
    scores = magnitude_scores(model, groups)
    spec = plan_from_rates(model, scores, {g: 0.0 for g in groups})
    assert spec.is_full()
    pruned, _ = prune(model, spec)
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        assert torch.equal(pruned(x), model(x))
    assert all(torch.equal(a, b) for a, b in zip(pruned.state_dict().values(), model.state_dict().values()))
    # a budget at (or above) the full model also gives the identity plan
    full = model_macs(model, (3, size, size))
    assert plan_for_budget(model, (3, size, size), full).is_full()


@pytest.mark.parametrize(
    "name,norm,policy",
    [
        ("lenet5", "none", "block_internal_only"),
        ("cnn", "none", "block_internal_only"),
        ("cnn", "bn", "block_internal_only"),
        ("vgg11", "none", "block_internal_only"),
        ("vgg11", "bn", "block_internal_only"),
        ("resnet18", "bn", "block_internal_only"),
        ("resnet18", "bn", "group"),
        ("resnet18", "none", "group"),
        ("googlenet", "bn", "group"),
    ],
)
def test_pruned_equals_masked_model_in_eval(name: str, norm: str, policy: str) -> None:
    torch.manual_seed(0)
    size = 16 if name == "googlenet" else 32
    model = build_model(name, norm=norm, input_size=size, width=WIDTH[name]).double().eval()
    _randomize_bn(model)
    spec = SubmodelSpec(model, _random_keep(model, prunable_groups(model, policy)))
    pruned, _ = prune(model, spec)
    masked = build_model(name, norm=norm, input_size=size, width=WIDTH[name]).double().eval()
    masked.load_state_dict(masked_state(model.state_dict(), spec))
    x = torch.randn(2, 3, size, size, dtype=torch.float64)
    with torch.no_grad():
        out, ref, full = pruned(x), masked(x), model(x)
    assert rel_err(out, ref) <= 1e-10
    assert rel_err(full, ref) > 1e-3  # pruning really changed the function
    # BN weights and running statistics are sliced, not reset
    for path, mod in pruned.named_modules():
        if isinstance(mod, nn.BatchNorm2d):
            parent = model.get_submodule(path)
            group = spec.groups.dims[f"{path}.weight"][0][0][0]
            kept = spec.kept(group)
            assert torch.equal(mod.running_mean, parent.running_mean[kept])
            assert torch.equal(mod.running_var, parent.running_var[kept])
            assert torch.equal(mod.weight, parent.weight[kept])
    # closed-form MACs of the plan == hook counter == FlopCounterMode / 2 on the built model
    macs = ChannelMacs(model, (3, size, size)).macs(spec)
    assert macs == model_macs(pruned, (3, size, size))
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        pruned(x[:1])
    assert fc.get_total_flops() == 2 * macs


def test_block_internal_only_keeps_residual_widths() -> None:
    model = build_model("resnet18")
    internal = prunable_groups(model, "block_internal_only")
    everything = prunable_groups(model, "group")
    assert internal == [g for g in everything if g.endswith(".conv1")]
    assert set(everything) - set(internal) == {"layer1", "layer2", "layer3", "layer4"}
    assert len(internal) == 8
    # googlenet and vgg have no residual groups: both policies agree
    for name in ("vgg11", "googlenet", "cnn"):
        m = build_model(name)
        assert prunable_groups(m, "block_internal_only") == prunable_groups(m, "group")
    with pytest.raises(ValueError, match="policy"):
        prunable_groups(model, "mask")


def test_fc_column_mapping_after_flatten() -> None:
    # CNN: fc1 reads conv3 with s = 16 columns per channel; LeNet5: s = 25
    for name, group, fc, s in (("cnn", "conv3", "fc1", 16), ("lenet5", "conv2", "fc1", 25)):
        model = build_model(name, norm="none")
        kept = torch.tensor([1, 4, 5])
        pruned, spec = prune(model, {group: kept})
        cols = torch.cat([torch.arange(j * s, (j + 1) * s) for j in kept.tolist()])
        assert torch.equal(pruned.get_submodule(fc).weight, model.get_submodule(fc).weight[:, cols])


def test_scatter_back_of_pruned_update_then_gather() -> None:
    torch.manual_seed(0)
    model = build_model("resnet18", width=0.25)
    spec = SubmodelSpec(model, _random_keep(model, prunable_groups(model, "group"), seed=3))
    pruned, _ = prune(model, spec)
    update = {k: v + torch.randn_like(v) if v.is_floating_point() else v + 1
              for k, v in pruned.state_dict().items()}
    glob = model.state_dict()
    back = scatter(glob, update, spec)
    again = gather(back, spec)
    assert all(torch.equal(again[k], update[k]) for k in update)
    # count-based averaging with this one client: kept positions take the update, the rest stays
    s, c = init_buffers(glob)
    scatter_add_(s, c, update, spec)
    new = finalize(glob, s, c)
    assert all(torch.equal(gather(new, spec)[k], update[k].to(new[k].dtype)) for k in update
               if update[k].is_floating_point())
    w = "layer1.0.conv1.weight"
    dropped = torch.ones(glob[w].shape[0], dtype=torch.bool)
    dropped[spec.kept("layer1.0.conv1")] = False
    assert torch.equal(new[w][dropped], glob[w][dropped])
    # momentum-like partial dicts slice the same way
    mom = {k: torch.randn_like(v) for k, v in model.named_parameters()}
    sliced = slice_tensors(mom, spec)
    ref = extract_state({**glob, **mom}, spec)
    assert all(torch.equal(sliced[k], ref[k]) for k in mom)


def test_successive_prunings_compose() -> None:
    torch.manual_seed(0)
    model = build_model("vgg11", norm="bn", width=0.25).eval()
    spec1 = SubmodelSpec(model, _random_keep(model, prunable_groups(model), seed=4))
    p1, _ = prune(model, spec1)
    spec2 = SubmodelSpec(p1, _random_keep(p1, prunable_groups(p1), seed=5))
    p2, _ = prune(p1, spec2)
    direct, _ = prune(model, spec1.compose(spec2))
    assert all(torch.equal(a, b) for a, b in zip(p2.state_dict().values(), direct.state_dict().values()))


# ------------------------------------------------------------------------------------------ budget
@pytest.mark.parametrize("name", ZOO)
def test_budget_plan_fits_and_uses_most_of_it(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(name)
    with torch.device("meta"):
        meta = build_model(name)
    cm = ChannelMacs(model, (3, 32, 32))
    assert cm.full_macs == model_macs(meta, (3, 32, 32))
    policies = POLICIES if name == "resnet18" else ("block_internal_only",)
    for policy in policies:
        for ratio in (0.75, 0.5, 0.3):
            budget = ratio * cm.full_macs
            spec = plan_for_budget(model, (3, 32, 32), budget, policy=policy, macs_model=cm)
            built, _ = prune(meta, spec)  # the same plan applied to a shape-only copy
            real = model_macs(built, (3, 32, 32))
            assert real == cm.macs(spec) <= budget
            assert real >= 0.9 * budget, (name, policy, ratio, real / budget)
            assert not spec.is_full()
            if policy == "block_internal_only" and name == "resnet18":
                assert all(spec.is_full(g) for g in ("layer1", "layer2", "layer3", "layer4"))


def test_budget_plan_methods_guards_and_errors() -> None:
    model = build_model("cnn", norm="none")
    cm = ChannelMacs(model, (3, 32, 32))
    scores = magnitude_scores(model)
    budget = 0.5 * cm.full_macs
    uni = plan_for_budget(model, (3, 32, 32), budget, scores, method="uniform", fill=False, macs_model=cm)
    assert cm.macs(uni) <= budget
    rounded = plan_for_budget(model, (3, 32, 32), budget, scores, round_to=8, macs_model=cm)
    assert all(k % 8 == 0 or k == model.channel_groups().sizes[g] for g, k in rounded.sizes.items()
               if g not in (INPUT, CLASSES))
    capped = plan_for_budget(model, (3, 32, 32), 0.6 * cm.full_macs, scores, max_prune_ratio=0.5,
                             macs_model=cm)
    assert all(capped.sizes[g] >= 16 for g in ("conv1",)) and capped.sizes["conv2"] >= 32
    # the kept channels are the best-scored ones of their group
    for g in ("conv1", "conv2", "conv3"):
        k = rounded.sizes[g]
        if k < model.channel_groups().sizes[g]:
            best = torch.sort(torch.argsort(scores[g], stable=True)[-k:]).values
            assert torch.equal(rounded.kept(g), best)
    with pytest.raises(BudgetError, match="budget_macs"):
        plan_for_budget(model, (3, 32, 32), 1000, scores, macs_model=cm)
    with pytest.raises(ValueError, match="method"):
        plan_for_budget(model, (3, 32, 32), budget, scores, method="random")
    with pytest.raises(ValueError, match="scores"):
        plan_for_budget(model, (3, 32, 32), budget, {"conv1": torch.ones(3)})


# ------------------------------------------------------------------------------------------ HRank
def _low_rank_maps(ranks: list[list[int]], size: int = 6, seed: int = 0) -> torch.Tensor:
    """Non-negative (N, C, size, size) maps with the given exact ranks (sums of positive outer products
    of orthogonal-support vectors)."""
    g = torch.Generator().manual_seed(seed)
    n, c = len(ranks), len(ranks[0])
    out = torch.zeros(n, c, size, size)
    for i in range(n):
        for j in range(c):
            for r in range(ranks[i][j]):
                u = torch.zeros(size)
                v = torch.zeros(size)
                u[r] = 1.0 + torch.rand(1, generator=g).item()
                v[(r + 1) % size] = 1.0 + torch.rand(1, generator=g).item()
                out[i, j] += torch.outer(u, v) * (1 + r)
    return out


def test_feature_map_ranks_hand_computed() -> None:
    ranks = [[0, 1, 3, 6], [2, 2, 5, 4], [6, 0, 1, 3]]
    maps = _low_rank_maps(ranks)
    got = feature_map_ranks(maps)
    assert got.dtype == torch.int64
    assert got.tolist() == ranks
    # agrees with svdvals thresholding at the matrix_rank default tolerance; half input is cast
    a = torch.randn(4, 3, 5, 7)
    a[0, 0] = torch.outer(torch.randn(5), torch.randn(7))
    sv = torch.linalg.svdvals(a)
    tol = sv[..., :1] * max(5, 7) * torch.finfo(torch.float32).eps
    assert torch.equal(feature_map_ranks(a), (sv > tol).sum(-1))
    assert torch.equal(feature_map_ranks(a.half()), feature_map_ranks(a.half().float()))


class _IdentityNet(nn.Module):
    """1x1 identity conv -> ReLU -> (second conv) so that the post-ReLU maps are the (non-negative)
    inputs themselves."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 1, bias=False)
        self.act = nn.ReLU()
        self.head = nn.Conv2d(c, 2, 1)
        with torch.no_grad():
            self.conv.weight.copy_(torch.eye(c).view(c, c, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.conv(x)))

    def channel_groups(self):  # noqa: ANN201
        lay = GroupLayout(self)
        lay.conv("conv", INPUT, "mid")
        lay.conv("head", "mid", CLASSES)
        return lay.build()


def test_hrank_scores_average_ranks_over_batches() -> None:
    ranks = [[0, 1, 3, 6], [2, 2, 5, 4], [6, 0, 1, 3], [1, 1, 1, 1], [5, 0, 2, 3]]
    maps = _low_rank_maps(ranks)
    model = _IdentityNet(4).train()
    batches = [maps[:2], (maps[2:4], torch.zeros(2)), maps[4:]]
    scores = hrank_scores(model, batches)
    assert model.training  # mode restored
    expected = torch.tensor(ranks, dtype=torch.float64).mean(0)
    assert torch.allclose(scores["mid"], expected, atol=1e-12, rtol=0)
    limited = hrank_scores(model, batches, max_batches=1)
    assert torch.allclose(limited["mid"], torch.tensor(ranks[:2], dtype=torch.float64).mean(0))
    pts = rank_points(model)
    assert [p.node for p in pts["mid"]] == ["act"]


def test_hrank_stable_order_and_floor_rule() -> None:
    scores = torch.tensor([3.0, 1.0, 1.0, 2.0, 1.0, 5.0])
    assert prune_order(scores).tolist() == [1, 2, 4, 3, 0, 5]
    # floor(0.5 * 6) = 3 pruned: the three tied 1.0 channels, lower index first
    assert hrank_keep(scores, 0.5).tolist() == [0, 3, 5]
    assert hrank_keep(scores, 0.49).tolist() == [0, 3, 4, 5]  # floor(2.94) = 2 pruned: 1, 2
    assert hrank_keep(scores, 1.0).tolist() == [5]  # min_channels = 1
    assert hrank_keep(scores, 1.0, min_channels=2).tolist() == [0, 5]
    assert hrank_keep(scores, 0.9, max_prune_ratio=0.5).tolist() == [0, 3, 5]


def test_hrank_residual_group_points_are_block_outputs() -> None:
    model = build_model("resnet18", width=0.125)
    pts = rank_points(model)
    assert [p.module for p in pts["layer1"]] == ["conv1", "layer1.0.conv2", "layer1.1.conv2"]
    assert [p.through_add for p in pts["layer1"]] == [False, True, True]
    assert [p.module for p in pts["layer2"]] == ["layer2.0.conv2", "layer2.1.conv2"]  # projection deduped
    assert all(p.activation for ps in pts.values() for p in ps)
    x = torch.rand(6, 3, 32, 32)
    scores = hrank_scores(model, [x[:3], x[3:]])
    assert set(scores) == set(prunable_groups(model, "group"))
    assert all(float(s.min()) >= 0 and float(s.max()) <= 32 for s in scores.values())


# ------------------------------------------------------------------------------------------ FedAP rates
def test_formula15_weights_and_aggregation() -> None:
    sizes, js = [4000, 400, 400], [0.01, 0.5, 0.2]
    w = aggregation_weights(sizes, js)
    raw = np.array([4000 / 0.0101, 400 / 0.5001, 400 / 0.2001])
    assert np.allclose(w, raw / raw.sum(), rtol=1e-14, atol=0)
    assert abs(w.sum() - 1) <= 1e-15
    p = aggregate_rates([0.3, 0.9, 0.6], sizes, js)
    assert abs(p - float((raw / raw.sum()) @ np.array([0.3, 0.9, 0.6]))) <= 1e-15
    with pytest.raises(ValueError, match="rates"):
        aggregate_rates([0.3, 1.2, 0.1], sizes, js)
    with pytest.raises(ValueError, match="sizes"):
        aggregation_weights([1, 2], [0.1])


def _uniform_density(xs: np.ndarray, pieces: list[tuple[float, float, float]]) -> np.ndarray:
    d = np.zeros_like(xs)
    for a, b, mass in pieces:
        d += np.where((xs >= a) & (xs < b), mass / (b - a), 0.0)
    return d / (d.sum() * (xs[1] - xs[0]))


def test_plateau_rule_on_hand_made_spectra() -> None:
    xs = np.linspace(-1.5, 4.5, 60001)
    # mass 0.5 below 0, 0.2 on [0, 0.05], 0.3 on [2, 2.5]: ratio(0)=0.5, then flat at 0.3 from t = 0.1
    d = _uniform_density(xs, [(-1, 0, 0.5), (0, 0.05, 0.2), (2, 2.5, 0.3)])
    assert abs(spectral_mass_above(xs, d, 0.0) - 0.5) <= 1e-3
    assert abs(plateau_rate(xs, d) - 0.3) <= 1e-3
    # ratio halves within the first step -> inc is halved 7 times (0.1/128 ~ 7.8e-4 < 0.005/6)
    d2 = _uniform_density(xs, [(0, 0.1, 0.6), (3, 4, 0.4)])
    expected = 1 - 6 * 3 * 0.1 / 128
    assert abs(plateau_rate(xs, d2) - expected) <= 1e-3
    # with no halvings allowed the guard returns the last ratio of the failed scan (0.4 at t = 0.1)
    assert abs(plateau_rate(xs, d2, max_halvings=0) - 0.4) <= 1e-3


def test_spectral_gap_rule_on_hand_made_spectrum() -> None:
    xs = np.linspace(-0.5, 6.5, 7001)
    d = _uniform_density(xs, [(0.5, 1.0, 0.6), (5.0, 6.0, 0.4)])
    # gap (1, 5) of width 4 > 4·0.5: mass below the gap over non-null mass = 0.6
    assert abs(spectral_gap_rate(xs, d, 0.5) - 0.6) <= 2e-3
    assert spectral_gap_rate(xs, d, 1.5) is None  # 4·1.5 = 6 > gap width


def test_magnitude_threshold_and_layer_rates_hand_made() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 1, bias=True), nn.Conv2d(2, 2, 1, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([1.0, -2.0]).view(2, 1, 1, 1))
        model[0].bias.copy_(torch.tensor([0.5, 8.0]))
        model[1].weight.copy_(torch.tensor([[3.0, -4.0], [5.0, 6.0]]).view(2, 2, 1, 1))
    # |values| sorted: 0.5 1 2 3 4 5 6 8 (R = 8)
    assert magnitude_threshold(model, 0.5) == 3.0  # floor(8*0.5) = 4th smallest
    assert magnitude_threshold(model, 0.0) == 0.5  # index clamped to 1
    assert magnitude_threshold(model, 0.1) == 0.5  # floor(0.8) -> 1 -> nothing strictly below
    assert magnitude_threshold(model, 0.5, "conv_weights_only") == 3.0  # 1 2 3 4 5 6 -> 3rd
    rates = layer_rates_from_threshold(model, 3.0)
    assert rates == {"0": 1.0, "1": 0.0}  # bias 0.5 is not counted for layer 0
    assert fedap_layer_rates(model, 0.75) == {"0": 1.0, "1": 0.5}  # threshold = 6th smallest = 5
    assert layer_rates_from_threshold(model, magnitude_threshold(model, 0.1)) == {"0": 0.0, "1": 0.0}


def test_kept_count_guards() -> None:
    assert kept_count(10, 0.29) == 8
    assert kept_count(100, 0.29) == 71  # floor(29) pruned, not int(28.999...)
    assert kept_count(10, 1.0) == 1
    assert kept_count(10, 1.0, min_channels=3) == 3
    assert kept_count(10, 0.9, max_prune_ratio=0.5) == 5
    assert kept_count(64, 0.3, round_to=8) == 48  # 64 - 19 = 45 -> 48
    assert kept_count(10, 0.0, round_to=8) == 10
    with pytest.raises(ValueError, match="rate"):
        kept_count(10, 1.5)
    with pytest.raises(ValueError, match="round_to"):
        kept_count(10, 0.5, round_to=0)


def test_dataset_prune_rate_modes_on_tiny_model() -> None:
    torch.manual_seed(0)
    model = build_model("lenet5", norm="none", width=0.5)
    init = build_model("lenet5", norm="none", width=0.5)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    est = dataset_prune_rate(model, (x, y), steps=12, grid=2000, generator=torch.Generator().manual_seed(0))
    assert est.mode == "slq_plateau" and est.convention == "mass_above_plateau"
    assert 0.0 <= est.rate <= 1.0 and est.details["lambda_max"] > 0
    assert model.training and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    gap = dataset_prune_rate(model, (x, y), mode="spectral_gap", init_model=init, probes=1, steps=12,
                             grid=2000, lipschitz_iters=5, generator=torch.Generator().manual_seed(0))
    assert gap.mode == "spectral_gap" and 0.0 <= gap.rate <= 1.0 and gap.details["lipschitz"] > 0
    assert gap.fallback == (gap.convention == "mass_above_plateau")
    fixed = dataset_prune_rate(model, None, mode="fixed", fixed_rate=0.4)
    assert fixed.rate == 0.4
    with pytest.raises(ValueError, match="mode"):
        dataset_prune_rate(model, (x, y), mode="imc")
    with pytest.raises(ValueError, match="init_model"):
        dataset_prune_rate(model, (x, y), mode="spectral_gap")


def test_fedap_prune_sequential_and_all_ranks_first() -> None:
    torch.manual_seed(0)
    model = build_model("cnn", norm="none").eval()
    layer_rates = fedap_layer_rates(model, 0.5)
    assert set(layer_rates) == {"conv1.conv", "conv2.conv", "conv3.conv"}
    x = torch.rand(40, 3, 32, 32)
    batches = [x[:20], x[20:]]
    for order in ("sequential", "all_ranks_first"):
        pruned, spec = fedap_prune(model, layer_rates, batches, order=order)
        for g, path in (("conv1", "conv1.conv"), ("conv2", "conv2.conv"), ("conv3", "conv3.conv")):
            d = model.channel_groups().sizes[g]
            assert spec.sizes[g] == d - math.floor(layer_rates[path] * d + 1e-9)
        assert spec.is_full("fc1")
        masked = build_model("cnn", norm="none").eval()
        masked.load_state_dict(masked_state(model.state_dict(), spec))
        with torch.no_grad():
            assert rel_err(pruned(x[:4]), masked(x[:4])) <= 1e-5
    # all_ranks_first keeps the HRank top channels of the unpruned model
    _, spec = fedap_prune(model, layer_rates, batches, order="all_ranks_first")
    scores = hrank_scores(model, batches)
    assert torch.equal(spec.kept("conv2"), hrank_keep(scores["conv2"], layer_rates["conv2.conv"]))
    # residual groups take the weight-count-weighted producer rate
    res = build_model("resnet18", width=0.125)
    lr = fedap_layer_rates(res, 0.3)
    rates = fedap_group_rates(res, lr, ["layer2"])
    w = {p: res.get_submodule(p).weight.numel() for p in ("layer2.0.conv2", "layer2.0.downsample.0", "layer2.1.conv2")}
    assert abs(rates["layer2"] - sum(lr[p] * n for p, n in w.items()) / sum(w.values())) <= 1e-12


# ------------------------------------------------------------------------------------------ Taylor
def test_taylor_bn_equals_gate_gradient_squared() -> None:
    torch.manual_seed(0)
    model = build_model("cnn", norm="bn", width=0.25).eval()
    _randomize_bn(model)
    batches = [(torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))) for _ in range(2)]
    scores = taylor_bn_scores(model, batches, ["conv1", "conv2"])
    # explicit gates z_c = 1 after each BN
    expected = {"conv1": torch.zeros(8, dtype=torch.float64), "conv2": torch.zeros(16, dtype=torch.float64)}
    for x, y in batches:
        gates = {g: torch.ones(n, requires_grad=True) for g, n in (("conv1", 8), ("conv2", 16))}
        hooks = [model.get_submodule(f"{g}.bn").register_forward_hook(
            lambda m, i, o, z=z: o * z.view(1, -1, 1, 1)) for g, z in gates.items()]
        loss = F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, list(gates.values()))
        for h in hooks:
            h.remove()
        for (g, _), gr in zip(gates.items(), grads):
            expected[g] += gr.double() ** 2
    for g in expected:
        assert rel_err(scores[g], expected[g] / 2) <= 1e-5
    # without BN the gate sits on the conv output
    plain = build_model("cnn", norm="none", width=0.25).eval()
    s2 = taylor_bn_scores(plain, batches[:1], ["conv2"])
    z = torch.ones(16, requires_grad=True)
    h = plain.get_submodule("conv2.conv").register_forward_hook(lambda m, i, o: o * z.view(1, -1, 1, 1))
    (gz,) = torch.autograd.grad(F.cross_entropy(plain(batches[0][0]), batches[0][1]), [z])
    h.remove()
    assert rel_err(s2["conv2"], gz.double() ** 2) <= 1e-4
    assert all(p.grad is None for p in model.parameters())


def test_magnitude_scores_sum_over_producers() -> None:
    model = build_model("resnet18", width=0.125)
    s = magnitude_scores(model, ["layer2", "layer1.0.conv1"])
    w = model.layer1[0].conv1.weight.detach().double()
    assert torch.allclose(s["layer1.0.conv1"], w.abs().sum((1, 2, 3)))
    ref = sum(model.get_submodule(p).weight.detach().double().abs().sum((1, 2, 3))
              for p in ("layer2.0.conv2", "layer2.0.downsample.0", "layer2.1.conv2"))
    assert torch.allclose(s["layer2"], ref)
