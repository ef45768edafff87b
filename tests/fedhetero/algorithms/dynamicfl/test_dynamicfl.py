"""DynamicFL end to end: lossless transfer both ways, budget adherence, dynamic budgets."""

import json

import pytest

import reparam
from fedhetero.core.common.config import from_dict
from fedhetero.core.run.engine import Engine
from fedhetero.models import build_model
from reparam.dymm import applicable_kinds
from reparam.flops import model_macs
from reparam.geometry import ConvGeometry


def _max_macs(model_name, width, shape=(3, 32, 32)):
    """MACs of the plain model with every applicable branch on every expandable conv."""
    m = build_model(model_name, num_classes=10, in_channels=shape[0], width=width).eval()
    full = reparam.expand(reparam.merge(m), plan=lambda path, conv, bn: applicable_kinds(ConvGeometry.from_conv(conv)))
    return model_macs(full, shape)


def _cfg(model="lenet5", scenario="static", rounds=3, **algo):
    return from_dict(
        {
            "seed": 1,
            "dtype": "float64",
            "data": {"dataset": "synthetic", "synthetic_size": 240, "num_clients": 6, "min_partition_size": 5},
            "model": {"name": model, "width": 0.5},
            "train": {"rounds": rounds, "sample_rate": 0.5, "local_epochs": 3, "batch_size": 16, "lr": 0.02},
            "budget": {"scenario": scenario},
            "algorithm": {"name": "dynamicfl", "options": {"verify": True, **algo}},
        }
    )


def _clients(path):
    rows = [json.loads(l) for l in (path / "metrics.jsonl").read_text().splitlines()]
    return [c for r in rows for c in r["clients"]]


def test_lossless_transfer_and_budgets(tmp_path):
    Engine(_cfg(rounds=4), tmp_path, progress=False).run()
    clients = _clients(tmp_path)
    modes = {c["mode"] for c in clients}
    assert "first" in modes and "dymm" in modes  # later rounds go through REP(global, local) + DYMM
    for c in clients:
        # the client's model computes the global function when it starts (eval, float64)
        assert c["lossless_in"] <= 1e-10, c
        # the uploaded plain model computes what the trained client model computes
        assert c["lossless_out"] <= 1e-10, c
        assert c["macs"] <= c["budget_macs"] * (1 + 1e-12), c
    plain = min(c["budget_macs"] for c in clients if c["tier"] == "small")
    reachable = _max_macs("lenet5", 0.5)
    assert reachable > 2 * plain  # so the medium tier's budget is reachable
    for c in clients:
        if c["tier"] != "small":
            # tiers above 1 use at least 90 % of their budget where the branch set allows
            assert c["macs"] >= 0.9 * min(c["budget_macs"], reachable), c
        else:
            assert c["macs"] == pytest.approx(plain, rel=1e-12)


@pytest.mark.parametrize("scenario", ["decreasing", "increasing"])
def test_dynamic_budget_followed_and_still_lossless(tmp_path, scenario):
    Engine(_cfg(scenario=scenario, rounds=3), tmp_path, progress=False).run()
    clients = _clients(tmp_path)
    if scenario == "decreasing":
        # a 1x client whose budget falls to 0.95x switches to a pruned sub-model mid-round
        assert any(c["mode"] == "pruned" and c["tier"] == "small" for c in clients)
    for c in clients:
        assert c["macs"] <= c["budget_macs"] * (1 + 1e-12), c
        assert c.get("lossless_in", 0.0) <= 1e-10 and c["lossless_out"] <= 1e-10, c


def test_mixed_tiers_below_and_above_the_plain_model(tmp_path):
    tiers = [
        {"name": n, "ratio": r, "share": 0.2}
        for n, r in (("q", 0.25), ("h", 0.5), ("one", 1.0), ("two", 2.0), ("three", 3.0))
    ]
    cfg = from_dict(
        {
            "seed": 2,
            "data": {"dataset": "synthetic", "synthetic_size": 300, "num_clients": 10, "min_partition_size": 5},
            "model": {"name": "cnn", "width": 0.5},
            "train": {"rounds": 2, "sample_rate": 1.0, "local_epochs": 2, "batch_size": 32},
            "budget": {"tiers": tiers},
            "algorithm": {"name": "dynamicfl", "options": {"verify": True}},
        }
    )
    res = Engine(cfg, tmp_path, progress=False).run()
    clients = _clients(tmp_path)
    assert {c["tier"] for c in clients} == {"q", "h", "one", "two", "three"}
    for c in clients:
        assert c["macs"] <= c["budget_macs"] * (1 + 1e-12), c
        assert c["lossless_out"] <= 1e-4, c  # float32 run: upload equals the trained model
        if c["tier"] in ("q", "h"):
            assert c["mode"] == "pruned"
            assert c["macs"] >= 0.8 * c["budget_macs"], c  # the pruned sub-model uses its budget
    assert res.summary["all_fit_budget"]
    assert 0.0 <= res.summary["final_accuracy"] <= 1.0


@pytest.mark.parametrize("model, scenario", [("lenet5", "static"), ("lenet5", "increasing"), ("cnn", "static")])
def test_nested_growth_uses_the_high_tiers_budgets_and_stays_lossless(tmp_path, model, scenario):
    """grow_mode: nested — LeNet-5's flat branch set stops near 2.4x the plain model; nesting lets the
    3x tier use its budget. The lossless checks stay on: download and upload exact in float64."""
    Engine(_cfg(model=model, rounds=3, scenario=scenario, grow_mode="nested"), tmp_path, progress=False).run()
    clients = _clients(tmp_path)
    assert {"first", "dymm"} <= {c["mode"] for c in clients}
    assert any(c["tier"] == "large" for c in clients)
    for c in clients:
        assert c.get("lossless_in", 0.0) <= 1e-10, c
        assert c["lossless_out"] <= 1e-10, c
        assert c["macs"] <= c["budget_macs"] * (1 + 1e-12), c
        if c["tier"] != "small" and scenario == "static":
            assert c["macs"] >= 0.9 * c["budget_macs"], c


def test_grow_mode_option_is_validated(tmp_path):
    from fedhetero.core.common.options import ConfigError

    with pytest.raises(ConfigError, match="grow_mode"):
        Engine(_cfg(rounds=1, grow_mode="deep"), tmp_path, progress=False).run()
