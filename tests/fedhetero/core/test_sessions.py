"""Sessions (fedhetero.core.hetero.sessions): the schedule, the engine's session handling (devices, learning rate
restarts, evaluation on the session's classes), the transition metrics, the latency/energy model and
the transition accuracy in compare's rows."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedhetero.core.run.engine import Engine
from fedhetero.core.hetero.sessions import (
    PUBLISHED_ROUND_COST,
    EnergyModel,
    Schedule,
    accumulated_gain,
    time_to_accuracy,
    transition_accuracy,
)
from _util import SESSION_BASE, session_cfg


BASE = SESSION_BASE


_cfg = session_cfg


# ---------------------------------------------------------------------------- schedule and engine
def test_schedule_alternates_and_explicit_devices():
    s = Schedule.from_config(5, 4, 10)
    assert s.devices[0] == s.devices[2] == (0, 1, 2, 3, 4) and s.devices[1] == (5, 6, 7, 8, 9)
    assert [s.session_of(r) for r in (1, 4, 5, 20)] == [0, 0, 1, 4]
    assert [s.round_in_session(r) for r in (1, 4, 5, 8)] == [1, 4, 1, 4]
    e = Schedule.from_config(2, 3, 10, devices=[[3, 1], [0, 9, 9]])
    assert e.devices == ((1, 3), (0, 9))


def test_sessions_sample_devices_restart_lr_and_eval_on_session_classes(tmp_path):
    devices = [[0, 1, 2], [10, 11], [0, 11, 12, 13]]
    cfg = _cfg(**{
        "algorithm": {"name": "fedavg"}, "sessions.count": 3, "sessions.rounds": 4, "train.rounds": 12,
        "sessions.devices": devices,
    })
    eng = Engine(cfg, tmp_path / "r", progress=False)
    res = eng.run()
    rows = res.metrics
    for r in rows:
        assert sorted(c["cid"] for c in r["clients"]) == devices[r["session"] - 1]
        assert r["session_round"] == (r["round"] - 1) % 4 + 1
    # the learning rate restarts at every session
    ctx = eng.ctx
    assert ctx.lr_at(1) == ctx.lr_at(5) == ctx.lr_at(9) == pytest.approx(0.05)
    assert ctx.lr_at(4) == ctx.lr_at(8) < ctx.lr_at(5)
    # session-class accuracy: group A (clients 0..9) holds the lower labels only
    assert all(r["accuracy"] == r["accuracy_session"] for r in rows)
    assert any(r["accuracy"] != r["accuracy_full"] for r in rows)
    idx = ctx.session_test_indices(1)
    labels = eng.data.train.labels_np
    held = set(np.unique(np.concatenate([labels[eng.data.client_indices[c]] for c in devices[1]])).tolist())
    assert set(np.unique(eng.data.test.labels_np[idx]).tolist()) == held
    assert [s["session"] for s in res.summary["sessions"]] == [1, 2, 3]


# ---------------------------------------------------------------------------- metrics
def test_transition_metrics():
    assert transition_accuracy([0.1, 0.2, 0.3, 0.9], window=3) == pytest.approx(0.2)
    assert time_to_accuracy([0.1, 0.5, 0.8, 0.9], 0.8) == 3
    assert time_to_accuracy([0.1, 0.5, 0.8], 0.8, offset=1) == 4
    assert time_to_accuracy([0.1], 0.8) == math.inf
    assert accumulated_gain([0.9, 0.8], [0.5, 0.8, 0.1]) == pytest.approx(40.0)


# ---------------------------------------------------------------------------- latency / energy
def test_energy_model_constants():
    m = EnergyModel()
    assert m.breakpoint_m == pytest.approx(210.0, rel=0.01)
    assert m.doppler_hz == pytest.approx(116.7, rel=0.001)
    assert m.fading_correlation == pytest.approx(0.967, abs=0.001)
    # the published time-to-accuracy rows: rounds × per-round cost
    lat, kj = PUBLISHED_ROUND_COST["tinyimagenet"]
    assert 11 * lat == pytest.approx(1249.4, rel=5e-4) and 11 * kj == pytest.approx(15.72, rel=5e-3)
    assert 150 * lat == pytest.approx(17037.7, rel=5e-4) and 150 * kj == pytest.approx(214.33, rel=5e-3)
    lat, kj = PUBLISHED_ROUND_COST["svhn"]
    assert 52 * lat == pytest.approx(358.1, rel=2e-3) and 52 * kj == pytest.approx(4.04, rel=5e-3)


def test_energy_model_reproduces_published_energy():
    """Uplink plus computation energy summed over 100 devices matches the published per-round
    energy (ResNet-34 at 64x64: 1.43 kJ; the SVHN CNN: 77.7 J) within a few per cent."""
    m = EnergyModel()
    tiny = m.round_cost(21_730_056, 27.69, 100, rng=0)["energy_j"]
    svhn = np.mean([m.round_cost(667_178, 91.04, 100, rng=s)["energy_j"] for s in range(3)])
    assert tiny == pytest.approx(1429.0, rel=0.06)
    assert svhn == pytest.approx(77.7, rel=0.06)
    cost = m.round_cost(667_178, 91.04, 100, rng=0)
    assert cost["energy_with_downlink_j"] > cost["energy_j"] and cost["latency_s"] >= cost["mean_device_latency_s"]


def test_compare_rows_carry_transition_accuracy():
    from fedhetero.core.run.compare import comparison_rows

    base = {"final_accuracy": 0.5, "mean_last5_accuracy": 0.5, "mean_client_macs": 1.0, "sim_time_s": 1.0,
            "bytes_total": 1, "wall_s": 1.0, "all_fit_budget": True, "tiers": {}}
    rows = comparison_rows({"dyninit": [{**base, "transition_2_accuracy": 0.8}, {**base, "transition_2_accuracy": 0.6}]}, [])
    assert rows[0]["transition_2_accuracy_mean"] == pytest.approx(0.7)
    assert rows[0]["transition_2_accuracy_std"] == pytest.approx(0.1)
