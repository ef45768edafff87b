"""``global_form: host``: the global model keeps the model's BatchNorms. A client's main branch
adopts the global BN, the client uploads its model merged back into the host layout, and the
server averages convs and BNs as FedAvg does, so that DynamicFL with every tier at 1× *is*
FedAvg; with branches and sub-models every client still runs, exactly re-solved and merged."""

from __future__ import annotations

import pytest
import torch

from fedhetero.core.common.config import from_dict
from fedhetero.core.run.engine import Engine

ONE_TIER = [{"name": "all", "ratio": 1.0, "share": 1.0}]


def _cfg(name, tiers, **options):
    return from_dict(
        {
            "seed": 0,
            "threads": 1,
            "data": {"num_clients": 4},
            "train": {"rounds": 3, "sample_rate": 1.0, "local_epochs": 2},
            "budget": {"tiers": tiers},
            "algorithm": {"name": name, "options": options},
        }
    )


def _final(run_dir):
    state = torch.load(run_dir / "final_model.pt", weights_only=False)
    return state.get("state", state)


def test_dynamicfl_at_1x_with_a_host_form_global_model_is_fedavg_bit_for_bit(tmp_path):
    fedavg = Engine(_cfg("fedavg", ONE_TIER), tmp_path / "fedavg", progress=False).run()
    dyn = Engine(_cfg("dynamicfl", ONE_TIER, global_form="host"), tmp_path / "dyn", progress=False).run()
    a, b = _final(tmp_path / "fedavg"), _final(tmp_path / "dyn")
    assert list(a) == list(b) and any(k.endswith("running_var") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    modes = {c["mode"] for r in dyn.metrics for c in r["clients"]}
    assert modes == {"first", "dymm"}  # returning clients went through REP, and it changed nothing
    assert dyn.summary["final_accuracy"] == fedavg.summary["final_accuracy"]


@pytest.mark.slow
def test_a_host_form_global_model_keeps_the_batchnorm_through_every_kind_of_client(tmp_path):
    tiers = [{"name": "s", "ratio": 0.5, "share": 0.34}, {"name": "m", "ratio": 1.0, "share": 0.33},
             {"name": "l", "ratio": 3.0, "share": 0.33}]
    res = Engine(_cfg("dynamicfl", tiers, global_form="host", verify=True), tmp_path / "run", progress=False).run()
    assert res.summary["dropped_clients"] == 0 and res.summary["internal_errors"] == 0
    clients = [c for r in res.metrics for c in r["clients"]]
    assert {c["mode"] for c in clients} >= {"first", "dymm", "pruned"}
    # verify: every client started equal to the global model and uploaded what it trained
    assert all(0 <= c["lossless_out"] <= 1e-5 for c in clients)
    assert all(0 <= c["lossless_in"] <= 1e-5 for c in clients if c["mode"] == "dymm")
    from fedhetero.core.local.context import client_context

    host_keys = list(client_context(_cfg("fedavg", ONE_TIER)).build_model().state_dict())
    assert list(_final(tmp_path / "run")) == host_keys
    assert all(c["fits_budget"] for c in clients)


@pytest.mark.slow
def test_a_host_form_global_model_follows_budgets_that_change_mid_round(tmp_path):
    """Budgets falling by 60 % after the second epoch: clients fold branches or switch to a pruned
    sub-model on the spot, and their uploads still go back into the host layout."""
    cfg = from_dict({
        "seed": 0, "threads": 1, "data": {"num_clients": 4},
        "train": {"rounds": 3, "sample_rate": 1.0, "local_epochs": 3},
        "budget": {"scenario": "decreasing", "change": 0.6,
                   "tiers": [{"name": "m", "ratio": 1.2, "share": 0.5}, {"name": "l", "ratio": 2.0, "share": 0.5}]},
        "algorithm": {"name": "dynamicfl", "options": {"global_form": "host", "verify": True}},
    })
    res = Engine(cfg, tmp_path / "run", progress=False).run()
    assert res.summary["dropped_clients"] == 0 and res.summary["internal_errors"] == 0
    clients = [c for r in res.metrics for c in r["clients"]]
    assert any(c["mode"] == "pruned" for c in clients)
    assert all(0 <= c["lossless_out"] <= 1e-5 for c in clients)
    assert res.summary["final_accuracy"] > 0.5


def _conv_filter_norms(state):
    return {k: state[k].double().flatten(1).norm(dim=1) for k in state if k.endswith("conv.weight")}


@pytest.mark.parametrize("host_scale", ["calibrated", "global", "merged"])
def test_host_form_uploads_take_the_global_filter_norms_times_what_training_did(tmp_path, monkeypatch, host_scale):
    """With branches, the host-layout merge writes them into the main conv in units of its running
    deviation, so the conv's scale can compound round after round. ``host_scale: calibrated`` and
    ``global`` give each uploaded filter the norm of the global filter the client started from,
    times the factor by which local training's steps changed the client's anchor filter (what a
    FedAvg client's filter goes through), with the BN statistics measured or scaled along; the
    function stays. ``merged`` uploads the merged convs as they are: their norms are another."""
    from fedhetero.algorithms.dynamicfl.algorithm import DynamicFL

    seen: list[tuple[dict | None, dict, dict]] = []  # (growth, global state, upload)
    real_upload = DynamicFL._upload

    def spying(self, run, report):
        result = real_upload(self, run, report)
        seen.append((run.growth, {k: v.clone() for k, v in run.plain.state_dict().items()}, result.state))
        return result

    monkeypatch.setattr(DynamicFL, "_upload", spying)
    tiers = [{"name": "m", "ratio": 2.0, "share": 0.5}, {"name": "l", "ratio": 3.0, "share": 0.5}]
    # blocks stepping by the sum of their branches' steps (the form this compounding was found in):
    # the mean moves the merged convs less, and their norms' departure with them
    res = Engine(_cfg("dynamicfl", tiers, global_form="host", host_scale=host_scale, verify=True, block_step="sum"),
                 tmp_path / "run", progress=False).run()
    assert res.summary["dropped_clients"] == 0 and res.summary["internal_errors"] == 0
    clients = [c for r in res.metrics for c in r["clients"]]
    assert all(0 <= c["lossless_out"] <= 1e-5 for c in clients)  # the scaling kept the function
    assert len(seen) == 12
    errors, training = [], []
    for growth, start, upload in seen:
        for k, n in _conv_filter_norms(start).items():
            target = n * (growth[k.removesuffix(".weight")].to(n) if growth is not None else 1.0)
            errors.append(float(((_conv_filter_norms(upload)[k] - target).abs() / target).max()))
            if growth is not None:
                training.append(float((growth[k.removesuffix(".weight")] - 1).abs().max()))
    if host_scale != "merged":
        assert max(errors) < 1e-5
        assert 1e-4 < max(training) < 5.0  # training moved the norms, by a bounded factor
    else:
        assert max(errors) > 0.05  # a merged conv leaves the global filter's norm
