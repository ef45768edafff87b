"""DynamicFL end to end: lossless transfer both ways, budget adherence, dynamic budgets."""

import json

import pytest

import reparam
from fedhetero.config import from_dict
from fedhetero.engine import Engine
from models import build_model
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
    for c in _clients(tmp_path):
        assert c["macs"] <= c["budget_macs"] * (1 + 1e-12), c
        assert c["lossless_in"] <= 1e-10 and c["lossless_out"] <= 1e-10, c
