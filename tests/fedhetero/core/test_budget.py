"""FLOPs counters, width planner, tiers and dynamic budget schedules."""

from __future__ import annotations

import io
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from torch import nn

from fedhetero.core.hetero.budget import (
    DEFAULT_TIERS,
    DEFAULT_WIDTH_GRID,
    HETEROFL_LEVELS,
    BudgetSchedule,
    Tier,
    assign_tiers,
    count_params,
    fvcore_macs,
    largest_width,
    macs,
    tier_budgets,
    width_cost,
    width_grid,
)
from fedhetero.models import build_model
from reparam.flops import model_macs as hook_macs  # the closed-form (hook) counter


# ------------------------------------------------------------------ counters
def test_counters_restore_mode_and_are_silent() -> None:
    m = build_model("resnet18", width=0.125).train()
    m.layer1.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = fvcore_macs(m, (3, 32, 32))
        b = macs(m, (3, 32, 32))
    assert a == b == hook_macs(m, [3, 32, 32])
    assert caught == []
    assert m.training and not m.layer1.training and m.layer2.training


def test_counts_are_per_sample_and_ignore_bn() -> None:
    plain = build_model("cnn", norm="none")
    bn = build_model("cnn", norm="bn")
    assert macs(plain, (3, 32, 32)) == macs(bn, (3, 32, 32)) == fvcore_macs(bn, (3, 32, 32)) == 4_548_608
    assert macs(bn.double(), (3, 32, 32)) == 4_548_608  # dtype follows the model


def test_count_params() -> None:
    m = build_model("lenet5", norm="none")
    assert count_params(m) == 62_006
    m.fc3.weight.requires_grad_(False)
    assert count_params(m, trainable_only=True) == 62_006 - 840
    shared = nn.Sequential(m.fc3, m.fc3)
    assert count_params(shared) == 850


def test_bad_input_shape() -> None:
    m = build_model("cnn", width=0.25)
    for bad in ((3, 0, 32), "3x32x32", ()):
        with pytest.raises(ValueError, match="input_shape"):
            macs(m, bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ width planner
def test_width_grid() -> None:
    assert len(DEFAULT_WIDTH_GRID) == 16 and DEFAULT_WIDTH_GRID[0] == 0.0625 and DEFAULT_WIDTH_GRID[-1] == 1.0
    assert set(HETEROFL_LEVELS) <= set(DEFAULT_WIDTH_GRID)
    g = width_grid(step=0.25, max_width=3**0.5)
    assert g[-1] == pytest.approx(3**0.5) and 1.5 in g and 0.125 in g


def counting_builder(name: str, calls: list[float]):
    def build(width: float) -> nn.Module:
        calls.append(width)
        return build_model(name, width=width)

    return build


def test_largest_width_respects_flops_budget() -> None:
    calls: list[float] = []
    build = counting_builder("cnn", calls)
    shape = (3, 32, 32)
    half = macs(build_model("cnn", width=0.5), shape)
    assert largest_width(build, half, shape) == 0.5
    w = largest_width(build, half - 1, shape)
    assert w < 0.5
    assert width_cost(build, w, shape)[0] <= half - 1
    full = macs(build_model("cnn"), shape)
    assert largest_width(build, full * 10, shape) == 1.0
    # every width is measured once (cache), and binary search measures few widths
    assert len(calls) == len(set(calls)) <= 10
    n = len(calls)
    largest_width(build, half, shape)
    assert len(calls) == n


def test_flops_only_budget_changes_width_and_params_budget_is_separate() -> None:
    build = counting_builder("vgg11", [])
    shape = (3, 32, 32)
    grid = (0.25, 0.5, 0.75, 1.0)
    m_half, p_half = width_cost(build, 0.5, shape)
    m_full, p_full = width_cost(build, 1.0, shape)
    # params fit the full model, FLOPs only the half model -> half
    assert largest_width(build, m_half, shape, grid, budget_params=p_full) == 0.5
    # FLOPs fit the full model, params only the half model -> half ("and vice versa")
    assert largest_width(build, m_full, shape, grid, budget_params=p_half) == 0.5
    assert largest_width(build, m_full, shape, grid, budget_params=p_full) == 1.0
    assert largest_width(build, m_full, shape, grid) == 1.0


def test_largest_width_errors() -> None:
    build = counting_builder("lenet5", [])
    with pytest.raises(ValueError, match="no width"):
        largest_width(build, 10, (3, 32, 32))
    with pytest.raises(ValueError, match="budget_macs"):
        largest_width(build, 0, (3, 32, 32))
    with pytest.raises(ValueError, match="grid"):
        largest_width(build, 1e9, (3, 32, 32), grid=[0.0, 0.5])


# ------------------------------------------------------------------ tiers
def test_default_tiers() -> None:
    assert [(t.name, t.ratio) for t in DEFAULT_TIERS] == [("small", 1.0), ("medium", 2.0), ("large", 3.0)]
    assert sum(t.share for t in DEFAULT_TIERS) == pytest.approx(1.0)
    assert tier_budgets(DEFAULT_TIERS, 1000) == {"small": 1000.0, "medium": 2000.0, "large": 3000.0}


def test_assign_tiers_exact_proportions_and_determinism() -> None:
    names = assign_tiers(90, DEFAULT_TIERS, np.random.default_rng(0))
    assert Counter(names) == {"small": 30, "medium": 30, "large": 30}
    assert names == assign_tiers(90, DEFAULT_TIERS, np.random.default_rng(0))
    assert names != assign_tiers(90, DEFAULT_TIERS, np.random.default_rng(1))
    tiers = [Tier("a", 1, 0.5), Tier("b", 2, 0.3), Tier("c", 3, 0.2)]
    assert Counter(assign_tiers(10, tiers, 3)) == {"a": 5, "b": 3, "c": 2}
    # largest remainder, ties to the earlier tier
    assert Counter(assign_tiers(7, DEFAULT_TIERS, 3)) == {"small": 3, "medium": 2, "large": 2}
    assert Counter(assign_tiers(2, DEFAULT_TIERS, 3)) == {"small": 1, "medium": 1}
    # a tier with share 0 gets nobody
    assert "b" not in assign_tiers(9, [Tier("a", 1, 1.0), Tier("b", 2, 0.0)], 0)


def test_assign_tiers_iid() -> None:
    names = assign_tiers(30_000, DEFAULT_TIERS, np.random.default_rng(0), method="iid")
    counts = Counter(names)
    assert all(abs(counts[t.name] / 30_000 - 1 / 3) < 0.01 for t in DEFAULT_TIERS)
    with pytest.raises(ValueError, match="method"):
        assign_tiers(3, DEFAULT_TIERS, 0, method="blocks")


def test_bad_tiers_name_the_field() -> None:
    with pytest.raises(ValueError, match="budget.tiers"):
        assign_tiers(10, [Tier("a", 1, 0.5), Tier("b", 2, 0.3)], 0)
    with pytest.raises(ValueError, match="budget.tiers"):
        assign_tiers(10, [Tier("a", 1, 0.5), Tier("a", 2, 0.5)], 0)
    with pytest.raises(ValueError, match="budget.tiers"):
        Tier("a", 0.0, 1.0)
    with pytest.raises(ValueError, match="budget.tiers"):
        Tier("a", 1.0, -0.1)
    with pytest.raises(ValueError, match="num_clients"):
        assign_tiers(0, DEFAULT_TIERS, 0)


# ------------------------------------------------------------------ dynamic budgets
def test_static_schedule() -> None:
    s = BudgetSchedule("static")
    assert not s.dynamic
    assert s.ratios(0, 2.0, 1, 0) == (2.0, None)
    assert s.ratios(0, 2.0, 5, 1) == (2.0, None)


def test_increasing_and_decreasing_compound_per_participation() -> None:
    inc = BudgetSchedule("increasing", change=0.05)
    r0, a0 = inc.ratios(4, 3.0, round=1, participation=0)
    assert (r0, a0) == (3.0, pytest.approx(3.15))
    r1, a1 = inc.ratios(4, 3.0, round=7, participation=1)
    assert r1 == a0 and a1 == pytest.approx(3.0 * 1.05**2)
    assert inc.current(4, 3.0) == a1 and inc.current(5, 3.0) == 3.0
    dec = BudgetSchedule("decreasing", change=0.05)
    assert dec.ratios(0, 1.0, 1, 0) == (1.0, pytest.approx(0.95))
    assert dec.ratios(0, 1.0, 2, 1) == (pytest.approx(0.95), pytest.approx(0.9025))


def test_schedule_clamps_and_is_idempotent() -> None:
    s = BudgetSchedule("increasing", change=0.5, min_ratio=0.5, max_ratio=4.0)
    seen = [s.ratios(1, 2.0, t, t) for t in range(4)]
    assert [r for r, _ in seen] == [2.0, 3.0, 4.0, 4.0]
    assert [a for _, a in seen] == [3.0, 4.0, 4.0, 4.0]
    d = BudgetSchedule("decreasing", change=0.5, min_ratio=0.5)
    assert [d.ratios(1, 1.0, t)[1] for t in range(3)] == [0.5, 0.5, 0.5]
    # the same key again returns the stored pair without compounding
    assert s.ratios(1, 2.0, 3, 3) == (4.0, 4.0)
    i = BudgetSchedule("increasing")
    first = i.ratios(2, 1.0, 3, 0)
    assert i.ratios(2, 1.0, 3, 0) == first
    i.ratios(2, 1.0, 9, 1)
    with pytest.raises(ValueError, match="decrease"):
        i.ratios(2, 1.0, 9, 0)


def test_random_schedule() -> None:
    s = BudgetSchedule("random", change=0.05)
    factors = []
    for t in range(400):
        r, a = s.ratios(0, 1.0, t, t, np.random.default_rng([7, t]))
        factors.append(round(a / r, 12))
    assert set(factors) == {1.05, 0.95}
    assert 150 < factors.count(1.05) < 250
    again = BudgetSchedule("random", change=0.05)
    b = [again.ratios(0, 1.0, t, t, np.random.default_rng([7, t])) for t in range(5)]
    c = BudgetSchedule("random", change=0.05)
    assert b == [c.ratios(0, 1.0, t, t, np.random.default_rng([7, t])) for t in range(5)]
    with pytest.raises(ValueError, match="rng"):
        BudgetSchedule("random").ratios(0, 1.0, 1, 0)


def test_schedule_state_round_trip_and_validation() -> None:
    s = BudgetSchedule("increasing")
    for c in range(3):
        s.ratios(c, 1.0 + c, 1, 0)
    buf = io.BytesIO()
    torch.save({"ratios": s.state()}, buf)
    buf.seek(0)
    t = BudgetSchedule("increasing")
    t.load_state(torch.load(buf, weights_only=True)["ratios"])
    assert [t.ratios(c, 1.0 + c, 2, 1) for c in range(3)] == [s.ratios(c, 1.0 + c, 2, 1) for c in range(3)]
    for kwargs, field in (
        ({"scenario": "sometimes"}, "budget.scenario"),
        ({"change": 1.5}, "budget.change"),
        ({"min_ratio": 2.0, "max_ratio": 1.0}, "budget.min_ratio"),
    ):
        with pytest.raises(ValueError, match=field):
            BudgetSchedule(**kwargs)
