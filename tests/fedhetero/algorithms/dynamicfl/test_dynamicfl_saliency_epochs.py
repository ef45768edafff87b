"""DynamicFL's saliency meter records only the epochs whose values are read: S_g (the epoch before
DYMM), S_l (the last epoch) and the epoch before a budget change; an epoch whose values would be
reset at its end is not recorded, and nothing a run computes changes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fedhetero.algorithms.dynamicfl.algorithm import DynamicFL, DynamicFLOptions
from fedhetero.core.common.config import from_dict
from fedhetero.core.run.engine import Engine
from reparam.saliency import SaliencyMeter
from _util import dotted


def _cfg(vectorize=False, saliency="synflow", **over):
    data = {
        "seed": 3, "threads": 1, "dtype": "float64",
        "data": {"dataset": "synthetic", "synthetic_size": 320, "num_clients": 4, "min_partition_size": 20},
        "model": {"name": "lenet5", "norm": "bn"},
        "train": {"rounds": 2, "sample_rate": 1.0, "batch_size": 16, "lr": 0.05, "local_epochs": 3, "momentum": 0.9},
        "budget": {"tiers": [{"name": "a", "ratio": 2.0, "share": 0.5}, {"name": "b", "ratio": 3.0, "share": 0.5}]},
        "engine": {"vectorize": vectorize},
        "algorithm": {"name": "dynamicfl", "options": {"saliency": saliency}},
    }
    return from_dict(dotted(data, over))


@pytest.mark.parametrize("saliency, expected", [
    # (epoch, last of its segment, E) -> recorded
    ("synflow", {(0, 1, 3): True,   # S_g: the epoch before DYMM ends its segment
                 (1, 3, 3): False,  # the middle epoch: reset at its end, never read
                 (2, 3, 3): True,   # S_l: the last epoch
                 (0, 3, 3): False,  # a first visit: one segment of E epochs
                 (0, 2, 3): False, (1, 2, 3): True,  # a budget change at epoch 2 reads the epoch before it
                 (0, 1, 1): True, (0, 5, 5): False, (3, 5, 5): False, (4, 5, 5): True}),
    ("random", {(1, 3, 3): True, (0, 3, 3): True, (3, 5, 5): True}),  # its draws are a stream: every step
])
def test_which_epochs_the_meter_records(saliency, expected):
    algo = DynamicFL(DynamicFLOptions(saliency=saliency))
    assert {k: algo._records(*k) for k in expected} == expected


def _run(tmp: Path, cfg, monkeypatch, always: bool) -> tuple[dict[str, torch.Tensor], list[dict], int]:
    calls = [0]
    real = SaliencyMeter.after_backward

    def counted(self, *a, **k):
        calls[0] += 1
        return real(self, *a, **k)

    with monkeypatch.context() as mp:
        mp.setattr(SaliencyMeter, "after_backward", counted)
        if always:  # the meter records every step, as before
            mp.setattr(DynamicFL, "_records", lambda self, epoch, last, epochs: True)
        res = Engine(cfg, str(tmp), progress=False).run()
    saved = torch.load(tmp / "final_model.pt", weights_only=True)
    clients = [{k: v for k, v in c.items() if k not in ("wall_s", "timers")} for r in res.metrics for c in r["clients"]]
    return saved.get("state", saved), clients, calls[0]


@pytest.mark.parametrize("saliency, over", [
    ("synflow", {}),
    ("grad_norm", {"budget.scenario": "increasing"}),  # a budget change reads the epoch before it
    ("random", {}),
])
def test_skipping_unread_epochs_changes_nothing(tmp_path, monkeypatch, saliency, over):
    cfg = _cfg(saliency=saliency, **over)
    final, clients, calls = _run(tmp_path / "now", cfg, monkeypatch, always=False)
    final_all, clients_all, calls_all = _run(tmp_path / "all", cfg, monkeypatch, always=True)
    assert final.keys() == final_all.keys()
    assert all(torch.equal(final[k], final_all[k]) for k in final)  # bit for bit
    assert clients == clients_all  # the same DYMM decisions, losses and MACs
    steps = sum(math.ceil(c["num_samples"] / 16) for c in clients)  # one epoch of every task
    assert calls_all == 3 * steps
    if saliency == "random":
        assert calls == calls_all
    elif saliency == "synflow":
        # a returning client (DYMM) records epochs 0 and 2, a first-time one epoch 2
        kept = sum(math.ceil(c["num_samples"] / 16) * (2 if c["mode"] == "dymm" else 1) for c in clients)
        assert calls == kept < calls_all
    else:
        assert calls < calls_all


def test_cohorts_skip_the_same_epochs(tmp_path, monkeypatch):
    """In a batched cohort the rule's saliency work follows the same epochs: the batched run
    equals the one-by-one run (float64, up to the order of sums)."""
    from fedhetero.algorithms.dynamicfl import algorithm as module

    seen: list[bool] = []
    real = module.DynamicFL._cohort_rule

    def spied(self, segments, epochs):
        rule = real(self, segments, epochs)
        if rule is not None:  # whether the meter records the cohort's first epoch
            seen.append(self._records(segments[0].first, segments[0].last, epochs))
        return rule

    monkeypatch.setattr(module.DynamicFL, "_cohort_rule", spied)
    res = Engine(_cfg(vectorize=True), str(tmp_path / "batched"), progress=False).run()
    one = Engine(_cfg(vectorize=False), str(tmp_path / "one"), progress=False).run()
    assert seen and not all(seen)  # some cohorts started in an epoch the meter does not record
    a = torch.load(tmp_path / "batched" / "final_model.pt", weights_only=True)
    b = torch.load(tmp_path / "one" / "final_model.pt", weights_only=True)
    a, b = a.get("state", a), b.get("state", b)
    for k, v in a.items():
        if v.is_floating_point():
            assert torch.allclose(v, b[k], rtol=1e-9, atol=1e-9 * float(v.abs().max())), k
    structure = ("mode", "branches", "grown", "folded", "filled")
    ca = [{k: c.get(k) for k in structure} for r in res.metrics for c in r["clients"]]
    cb = [{k: c.get(k) for k in structure} for r in one.metrics for c in r["clients"]]
    assert ca == cb
