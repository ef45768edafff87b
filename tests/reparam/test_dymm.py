"""DynamicFL modulation: bottom-up plans, DYMM, shrinking, optimizer surgery."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from torch import nn

from fedhetero import models
import reparam
from reparam.dymm import (
    DymmReport,
    applicable_kinds,
    classify_branches,
    dymm,
    plan_bottom_up,
    shrink_to_budget,
    update_optimizer,
)
from reparam.flops import branch_macs, model_macs
from reparam.testing import randomize_bn_, rel_err

SHAPE16 = (3, 16, 16)
SHAPE32 = (3, 32, 32)


# ------------------------------------------------------------------------ fixtures


def small_resnet(kinds=("kxk", "1x1", "1x1_kxk", "1x1_avg")):
    torch.manual_seed(0)
    plain = models.build_model("resnet18", width=0.25, input_size=16)
    model = reparam.expand(plain, branches=list(kinds)).double()
    randomize_bn_(model, torch.Generator().manual_seed(1))  # non-zero branches, random statistics
    return model.eval()


def keys_of(model):
    return [(p, n) for p, b in reparam.iter_blocks(model) for n in b.branch_names if n != "kxk"]


def scores(keys, seed, signed=True):
    rng = np.random.default_rng(seed)
    vals = rng.normal(size=len(keys)) if signed else rng.random(len(keys))
    return {k: float(v) for k, v in zip(keys, vals)}


def groups_optimizer(model):
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return torch.optim.SGD(
        [{"params": decay, "weight_decay": 5e-4, "lr": 0.05}, {"params": no_decay, "weight_decay": 0.0, "lr": 0.02}],
        lr=0.1,
        momentum=0.9,
    )


def train_step(model, opt, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, *SHAPE16, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (4,), generator=g)
    model.train()
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    model.eval()


def hand_classes(keys, s_l, s_g, small_q=0.3, large_q=0.7, use_abs=True):
    f = np.abs if use_abs else (lambda v: v)
    l = f(np.array([s_l[k] for k in keys]))
    g = f(np.array([s_g[k] for k in keys]))
    ls, gs, gl = np.quantile(l, small_q), np.quantile(g, small_q), np.quantile(g, large_q)
    out = {}
    for k, lv, gv in zip(keys, l, g):
        out[k] = "redundant" if lv < ls and gv < gs else "important" if lv < ls and gv > gl else "common"
    return out


# ------------------------------------------------------------------------ classification


@pytest.mark.parametrize("use_abs", [True, False])
def test_classification_matches_quantile_rule(use_abs):
    keys = [(f"b{i}", k) for i in range(5) for k in ("1x1", "1x1_kxk", "1x1_avg", "identity")]
    s_l, s_g = scores(keys, 0), scores(keys, 1)
    classes, thr = classify_branches(keys, s_l, s_g, use_abs=use_abs)
    assert classes == hand_classes(keys, s_l, s_g, use_abs=use_abs)
    f = np.abs if use_abs else (lambda v: v)
    assert thr["local_small"] == pytest.approx(np.quantile(f(np.array(list(s_l.values()))), 0.3), rel=1e-12)
    assert thr["global_large"] == pytest.approx(np.quantile(f(np.array(list(s_g.values()))), 0.7), rel=1e-12)
    counts = {c: sum(v == c for v in classes.values()) for c in ("redundant", "important", "common")}
    assert sum(counts.values()) == len(keys) and counts["common"] > 0


def test_classification_by_hand_values():
    keys = [("a", str(i)) for i in range(10)]
    s_l = {k: float(i) for i, k in enumerate(keys)}  # 0..9: 30% quantile 2.7 -> 0, 1, 2 small
    s_g = {keys[0]: 0.0, keys[1]: 9.0, keys[2]: 5.0}
    s_g.update({k: float(i) for i, k in enumerate(keys) if i > 2})  # 30%: 2.7, 70%: 6.3
    classes, _ = classify_branches(keys, s_l, s_g)
    assert classes[keys[0]] == "redundant"
    assert classes[keys[1]] == "important"
    assert classes[keys[2]] == "common"  # small S_l, medium S_g
    assert all(classes[k] == "common" for k in keys[3:])
    # a key without a score is common and does not enter the quantiles
    classes2, _ = classify_branches(keys + [("b", "x")], s_l, s_g)
    assert classes2[("b", "x")] == "common" and classes2[keys[0]] == "redundant"
    with pytest.raises(ValueError, match="small_q"):
        classify_branches(keys, s_l, s_g, small_q=1.5)
    with pytest.raises(ValueError, match="must not exceed"):
        classify_branches(keys, s_l, s_g, small_q=0.8, large_q=0.2)


# ------------------------------------------------------------------------ DYMM


def check_optimizer(model, opt, change, groups_before):
    live = {id(p) for p in model.parameters() if p.requires_grad}
    in_opt = [p for g in opt.param_groups for p in g["params"]]
    assert {id(p) for p in in_opt} == live  # nothing stale, nothing missing
    assert len(in_opt) == len(live)  # no duplicates
    assert all(id(p) in live for p in opt.state)
    assert len(opt.param_groups) == 2
    for gi, g in enumerate(opt.param_groups):
        assert {k: v for k, v in g.items() if k != "params"} == groups_before[gi]
    for p, ref in change.added:
        gi = next(i for i, g in enumerate(opt.param_groups) if any(q is p for q in g["params"]))
        assert gi == (0 if p.dim() > 1 else 1)  # conv weights with decay, BN params without
        assert any(q is ref for q in opt.param_groups[gi]["params"])
        assert p not in opt.state


@pytest.mark.parametrize("init", ["zero_gamma", "random_resolve"])
def test_dymm_exact_within_budget_and_optimizer(init):
    model = small_resnet()
    opt = groups_optimizer(model)
    train_step(model, opt)  # momentum state exists before surgery
    randomize_bn_(model, torch.Generator().manual_seed(2))
    groups_before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    keys = keys_of(model)
    s_l, s_g = scores(keys, 3), scores(keys, 4)
    macs0 = model_macs(model, SHAPE16)
    budget = 1.05 * macs0
    x = torch.randn(8, *SHAPE16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = model(x)

    report = dymm(model, s_l, s_g, budget, SHAPE16, init=init)

    with torch.no_grad():
        after = model(x)
    assert rel_err(after, before) <= 1e-10
    assert report.macs_before == macs0
    assert report.macs_after == model_macs(model, SHAPE16) <= budget
    assert report.fits
    expected = hand_classes(keys, s_l, s_g)
    assert report.classified == expected
    redundant = [k for k in keys if expected[k] == "redundant"]
    assert report.folded == redundant and len(redundant) > 0
    present = set(keys_of(model))
    assert not present & set(redundant)
    # growth: kinds lacked by blocks holding an important branch, in descending S_g order
    important_blocks = {k[0] for k in keys if expected[k] == "important"}
    assert report.grown and all(path in important_blocks for path, _ in report.grown)
    assert all(k in present for k in report.grown)
    first = max((k for k in keys if expected[k] == "important"), key=lambda k: abs(s_g[k]))
    assert report.grown[0][0] == first[0]
    # budget was used: no further lacking kind of an important block would fit
    blocks = dict(reparam.iter_blocks(model))
    sizes = reparam.flops.input_sizes(model, SHAPE16)
    for path in important_blocks:
        blk = blocks[path]
        folded_here = {n for p, n in redundant if p == path}
        for kind in applicable_kinds(blk.geometry):
            if kind not in blk.branch_names and kind not in folded_here:
                assert report.macs_after + branch_macs(kind, blk.geometry, sizes[path]) > budget
    # optimizer surgery
    update_optimizer(opt, report)
    check_optimizer(model, opt, report.change, groups_before)
    new_params = [p for p, _ in report.change.added]
    snapshot = [p.detach().clone() for p in new_params]
    train_step(model, opt, seed=1)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(a, p.detach()) for a, p in zip(snapshot, new_params))
    json.dumps(report.to_dict())


def test_dymm_zero_gamma_growth_is_train_exact():
    model = small_resnet()
    keys = keys_of(model)
    # exactly three small S_l (below the 30% quantile), all with large S_g: important, none redundant
    small = keys[:3]
    s_l = {k: (0.01 if k in small else 1.0) for k in keys}
    s_g = {k: (100.0 if k in small else 1.0) for k in keys}
    x = torch.randn(4, *SHAPE16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ref = reparam.merge(model)  # independent copy of the function
    twin = copy.deepcopy(model)
    report = dymm(model, s_l, s_g, 10 * model_macs(model, SHAPE16), SHAPE16, max_new_per_round=2)
    assert report.folded == [] and len(report.grown) == 2
    with torch.no_grad():
        assert rel_err(model(x), ref.eval()(x)) <= 1e-10
    model.train(), twin.train()
    assert torch.equal(model(x), twin(x))  # bit-exact in train mode (batch statistics)


def test_dymm_over_budget_folds_lowest_local_saliency():
    model = small_resnet()
    keys = keys_of(model)
    s_l = scores(keys, 7)
    s_g = {k: 1.0 for k in keys}  # nothing small or large: all common
    macs0 = model_macs(model, SHAPE16)
    budget = 0.8 * macs0
    x = torch.randn(4, *SHAPE16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(x)
    report = dymm(model, s_l, s_g, budget, SHAPE16)
    with torch.no_grad():
        assert rel_err(model(x), before) <= 1e-10
    assert report.folded == [] and report.grown == []
    assert report.shrunk and report.fits and report.macs_after <= budget
    order = sorted(keys, key=lambda k: abs(s_l[k]))
    assert report.shrunk == order[: len(report.shrunk)]
    # minimal: without the last fold it would not fit
    assert report.macs_after + 0 <= budget
    last = report.shrunk[-1]
    blk = dict(reparam.iter_blocks(model))[last[0]]
    sizes = reparam.flops.input_sizes(model, SHAPE16)
    assert report.macs_after + branch_macs(last[1], blk.geometry, sizes[last[0]]) > budget


def test_shrink_to_budget_and_unfittable():
    model = small_resnet()
    keys = keys_of(model)
    s_l = scores(keys, 9)
    del s_l[keys[-1]]  # unscored branches go first
    macs0 = model_macs(model, SHAPE16)
    x = torch.randn(4, *SHAPE16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = model(x)
    report = shrink_to_budget(model, s_l, 0.9 * macs0, SHAPE16)
    assert isinstance(report, DymmReport)
    assert report.shrunk[0] == keys[-1]
    assert report.fits and report.macs_after <= 0.9 * macs0
    with torch.no_grad():
        assert rel_err(model(x), before) <= 1e-10
    # a budget below the plain model: everything folded, does not fit, still exact
    plain_macs = model_macs(reparam.merge(model), SHAPE16)
    report2 = shrink_to_budget(model, s_l, 0.5 * plain_macs, SHAPE16)
    assert not report2.fits and keys_of(model) == []
    assert report2.macs_after == plain_macs
    with torch.no_grad():
        assert rel_err(model(x), before) <= 1e-10
    # within budget: nothing happens
    report3 = shrink_to_budget(model, s_l, 2 * plain_macs, SHAPE16)
    assert report3.shrunk == [] and report3.change.is_empty()


def test_dymm_bad_arguments():
    model = small_resnet()
    with pytest.raises(ValueError, match="init"):
        dymm(model, {}, {}, 1e9, SHAPE16, init="random")
    with pytest.raises(TypeError, match="budget_macs"):
        dymm(model, {}, {}, "1e9", SHAPE16)
    with pytest.raises(ValueError, match="max_new_per_round"):
        dymm(model, {}, {}, 1e9, SHAPE16, max_new_per_round=-1)
    with pytest.raises(TypeError, match="s_local"):
        dymm(model, [1.0], {}, 1e9, SHAPE16)
    with pytest.raises(ValueError, match="pool"):
        dymm(model, {}, {}, 1e9, SHAPE16, pool=["3x3"])


# ------------------------------------------------------------------------ first-round plans


def _exhausted(model, plan, shape):
    from reparam.dymm import _expandable_convs

    _, convs = _expandable_convs(model, shape)
    return all(set(plan.get(p, ())) == set(applicable_kinds(c)) for p, c, _ in convs)


@pytest.mark.parametrize(
    "name,kw",
    [("lenet5", {}), ("lenet5", {"norm": "none"}), ("cnn", {}), ("resnet18", {})],
)
def test_plan_bottom_up_budget_and_use(name, kw):
    torch.manual_seed(0)
    plain = models.build_model(name, **kw)
    base = model_macs(plain, SHAPE32)
    assert plan_bottom_up(plain, base, SHAPE32) == {}  # tier 1 trains the plain model
    assert plan_bottom_up(plain, 0.5 * base, SHAPE32) == {}
    for r in (1.5, 2.0, 3.0):
        budget = r * base
        plan = plan_bottom_up(plain, budget, SHAPE32)
        assert plan and all(kinds[0] == "kxk" for kinds in plan.values())
        expanded = reparam.expand(plain, plan=plan)
        macs = model_macs(expanded, SHAPE32)
        assert macs <= budget, (name, r)
        assert macs >= 0.9 * budget or _exhausted(plain, plan, SHAPE32), (name, r, macs / budget)
    # bottom up: the first conv in forward order gets the full default set first
    plan2 = plan_bottom_up(plain, 2 * base, SHAPE32)
    first = next(iter(plan2))
    assert set(plan2[first]) >= {"kxk", "1x1_kxk", "1x1_avg"}
    x = torch.randn(2, *SHAPE32)
    expanded = reparam.expand(plain, plan=plan2).eval()
    with torch.no_grad():
        assert torch.equal(expanded(x), plain.eval()(x))


def test_plan_ratio_values_resnet18():
    plain = models.build_model("resnet18")
    base = model_macs(plain, SHAPE32)
    plan = plan_bottom_up(plain, 2 * base, SHAPE32)
    # phase 1 gives stem and the first convs the full default set (+ identity where applicable)
    assert set(plan["conv1"]) >= {"kxk", "1x1", "1x1_kxk", "1x1_avg"}
    assert set(plan["layer1.0.conv1"]) >= {"kxk", "1x1", "1x1_kxk", "1x1_avg", "identity"}
    assert "identity" not in plan["conv1"]  # 3 -> 64 channels
    always = plan_bottom_up(plain, base, SHAPE32, free_branches="always")
    assert always and all(set(k) == {"kxk", "identity"} for k in always.values())
    assert model_macs(reparam.expand(plain, plan=always), SHAPE32) == base
    excl = plan_bottom_up(plain, 2 * base, SHAPE32, exclude=["layer1.*"])
    assert not any(p.startswith("layer1.") for p in excl)
    with pytest.raises(ValueError, match="candidate_set"):
        plan_bottom_up(plain, base, SHAPE32, candidate_set=["3x3"])
    with pytest.raises(ValueError, match="free_branches"):
        plan_bottom_up(plain, base, SHAPE32, free_branches="sometimes")
