"""Budget planning (reparam.planning) and nested growth.

* The knapsack is exact up to its resolution and always fits.
* Budget use per tier and grow mode on LeNet-5 and the FedDUMAP CNN (3×32×32, the plain models of
  DynamicFL): every plan fits its budget; the 2× tier uses ≥ 90 % of it in both grow modes, the 3×
  tier ≥ 90 % with nested growth (LeNet-5's flat branch set stops near 2.4× the plain model).
* Lossless transfer stays exact with nested blocks: the planned model equals the plain model (eval,
  bit for bit), merging it back equals it (rel_err ≤ 1e-10), and REP(global, local) makes it equal
  another global model (rel_err ≤ 1e-10).
* DYMM's ``grow_mode="nested"`` grows inside K×K convs once a block's flat kinds are exhausted.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from fedhetero import models
import reparam
from reparam.dymm import applicable_kinds, dymm
from reparam.flops import model_macs
from reparam.geometry import ConvGeometry
from reparam.planning import best_additions, fill_to_budget, first_plan, grow_to_budget, nested_candidates
from reparam.testing import randomize_bn_, rel_err

F64 = torch.float64
SHAPE = (3, 32, 32)
TOL = 1e-10


def _plain(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return reparam.merge(models.build_model(name).eval()).to(F64)


def _nested_paths(model: torch.nn.Module) -> list[str]:
    return [p for p, b in reparam.iter_blocks(model, nested=True) if b.depth > 0]


def test_best_additions_is_a_fitting_knapsack() -> None:
    items = [("a", 70), ("b", 41), ("c", 38), ("d", 29), ("e", 12), ("f", 5)]
    for cap in (0, 4, 50, 80, 100, 151, 200):
        chosen = best_additions(items, cap, resolution=10_000)
        total = sum(c for k, c in items if k in chosen)
        best = max(
            (sum(c for _, c in sub) for r in range(len(items) + 1) for sub in itertools.combinations(items, r)
             if sum(c for _, c in sub) <= cap),
            default=0,
        )
        assert total <= cap and total == best, (cap, chosen)
    assert best_additions([("x", 10), ("y", 10)], 10) == ["x"]  # ties keep the earlier item


@pytest.mark.parametrize("name", ["lenet5", "cnn"])
def test_budget_use_per_tier_and_grow_mode_with_lossless_transfer(name, gen) -> None:
    plain = _plain(name).eval()
    other = _plain(name, seed=1).eval()  # a different global model for REP(global, local)
    base = model_macs(plain, SHAPE)
    x = torch.randn(4, *SHAPE, generator=gen, dtype=F64)
    with torch.no_grad():
        y_plain, y_other = plain(x), other(x)
    fractions = {}
    for ratio, mode in itertools.product((2.0, 3.0), ("block", "nested")):
        budget = ratio * base
        model = reparam.expand(plain, plan=first_plan(plain, budget, SHAPE), anchor_norm="batchnorm")
        if mode == "nested":
            fill_to_budget(model, budget, SHAPE, grow_mode="nested")
        else:
            assert not _nested_paths(model)
        macs = model_macs(model, SHAPE)
        assert macs <= budget
        fractions[(ratio, mode)] = macs / budget
        model.eval()
        with torch.no_grad():
            assert torch.equal(model(x), y_plain)  # zero-γ growth, nested included
        randomize_bn_(model, gen)
        with torch.no_grad():
            y = model(x)
            assert rel_err(reparam.merge(model)(x), y) <= TOL  # upload: merged equals trained
            reparam.rep_to_local(other, model)  # download: local structure, global function
            assert rel_err(model(x), y_other) <= TOL
    assert fractions[(2.0, "block")] >= 0.9 and fractions[(2.0, "nested")] >= 0.9, fractions
    assert fractions[(3.0, "nested")] >= 0.9, fractions
    assert fractions[(3.0, "nested")] >= fractions[(3.0, "block")]


def test_nested_growth_sites_and_specs_round_trip(gen) -> None:
    plain = _plain("lenet5")
    full = reparam.expand(plain, plan=lambda p, conv, bn: applicable_kinds(ConvGeometry.from_conv(conv)),
                          anchor_norm="batchnorm")
    sizes = reparam.flops.input_sizes(full, SHAPE)
    items = nested_candidates(full, sizes)
    sites = {(p, n) for (p, n, _), _ in items}
    c1, c2 = "conv1.conv", "conv2.conv"  # LeNet-5's conv paths
    assert sites == {(c1, "kxk"), (c1, "1x1_kxk"), (c2, "kxk"), (c2, "1x1_kxk")}
    # the anchor's conv keeps the input-window kinds; 1x1_kxk's padded second stage does not
    assert {k for (p, n, k), _ in items if (p, n) == (c1, "kxk")} == {"1x1", "1x1_kxk", "1x1_avg", "1xk", "kx1"}
    assert {k for (p, n, k), _ in items if (p, n) == (c1, "1x1_kxk")} == {"1x1_kxk", "1x1_avg"}
    block = dict(reparam.iter_blocks(full))[c1]
    block.add_nested_branch("kxk", "1x1", generator=gen)
    block.add_nested_branch("1x1_kxk", "1x1_avg", generator=gen)
    assert block.nested_block("1x1_kxk").crop is False and block.nested_block("kxk").crop is True
    with pytest.raises(reparam.AlignmentError, match="crop"):
        block.nested_block("1x1_kxk").add_branch("1x1")
    randomize_bn_(full, gen)
    spec = reparam.structure(full)
    assert set(spec["blocks"][c1]["nested"]) == {"kxk", "1x1_kxk"}
    rebuilt = reparam.build(copy.deepcopy(plain), spec)
    rebuilt.load_state_dict(full.state_dict(), strict=True)
    x = torch.randn(2, *SHAPE, generator=gen, dtype=F64)
    full.eval()
    rebuilt.eval()
    with torch.no_grad():
        assert torch.equal(rebuilt(x), full(x))
        deploy = reparam.merge_state_dict(full.state_dict(), spec)
        merged = reparam.merge(full)
        merged.load_state_dict(deploy, strict=True)
        assert rel_err(merged(x), full(x)) <= TOL


def test_dymm_grows_nested_once_the_flat_kinds_are_exhausted(gen) -> None:
    plain = _plain("lenet5").eval()
    base = model_macs(plain, SHAPE)
    full = reparam.expand(plain, plan=lambda p, conv, bn: applicable_kinds(ConvGeometry.from_conv(conv)),
                          anchor_norm="batchnorm")
    randomize_bn_(full, gen)
    keys = [(p, n) for p, b in reparam.iter_blocks(full) for n in b.branch_names if n != "kxk"]
    s_l = {k: 1.0 + i for i, k in enumerate(keys)}
    s_g = {k: 5.0 for k in keys}  # nothing small globally: no branch is redundant, none is folded
    s_l[("conv1.conv", "1x1")], s_g[("conv1.conv", "1x1")] = 0.0, 100.0  # small locally, large globally: important
    x = torch.randn(2, *SHAPE, generator=gen, dtype=F64)
    budget = 3.0 * base
    block_mode = copy.deepcopy(full)
    rep_block = dymm(block_mode, s_l, s_g, budget, SHAPE, grow_mode="block")
    assert rep_block.grown == []  # every applicable kind is there already
    before = copy.deepcopy(full)
    report = dymm(full, s_l, s_g, budget, SHAPE, grow_mode="nested")
    assert report.grown and all(p.startswith("conv1.conv.branches.") for p, _ in report.grown)
    assert report.fits and report.macs_after == model_macs(full, SHAPE) <= budget
    assert report.macs_after > rep_block.macs_after
    for train in (False, True):  # zero-γ nested growth: bit-exact in both modes
        a, b = copy.deepcopy(before).train(train), copy.deepcopy(full).train(train)
        with torch.no_grad():
            assert torch.equal(a(x), b(x))
    # the nested blocks take part in later rounds like any block: fold one of their branches
    path, kind = report.grown[0]
    s_l2 = {(p, n): 10.0 for p, b in reparam.iter_blocks(full, nested=True) for n in b.branch_names}
    s_l2[(path, kind)] = 0.0
    rep2 = reparam.dymm.shrink_to_budget(full, s_l2, report.macs_after - 1, SHAPE)
    assert (path, kind) in rep2.shrunk and rep2.fits
    with pytest.raises(ValueError, match="grow_mode"):
        dymm(full, s_l, s_g, budget, SHAPE, grow_mode="deep")


def test_grow_to_budget_nested_after_a_budget_increase(gen) -> None:
    plain = _plain("lenet5").eval()
    base = model_macs(plain, SHAPE)
    model = reparam.expand(plain, plan=first_plan(plain, 2.0 * base, SHAPE), anchor_norm="batchnorm").eval()
    x = torch.randn(2, *SHAPE, generator=gen, dtype=F64)
    with torch.no_grad():
        y = model(x)
    scores = {(p, n): 1.0 for p, b in reparam.iter_blocks(model) for n in b.branch_names}
    change = grow_to_budget(model, scores, 3.0 * base, SHAPE, grow_mode="nested")
    assert change.added and _nested_paths(model)
    assert 0.9 * 3.0 * base <= model_macs(model, SHAPE) <= 3.0 * base
    with torch.no_grad():
        assert torch.equal(model(x), y)
    with pytest.raises(ValueError, match="grow_mode"):
        fill_to_budget(model, base, SHAPE, grow_mode="deep")

