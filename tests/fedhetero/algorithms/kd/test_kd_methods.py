"""The knowledge-distillation baselines: FedDF, FedET and DS-FL.

End-to-end: every method trains on a tiny synthetic run and records accuracy, per-tier accuracy,
bytes and a model that fits each client's budget; they need public data; resume. Unit level:
FedET's consensus targets and DS-FL's ERA.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from fedhetero.algorithms import get_algorithm
from fedhetero.algorithms.kd.dsfl import era
from fedhetero.algorithms.kd.fedet import consensus_targets
from fedhetero.core.common.options import ConfigError
from fedhetero.core.run.engine import Engine
from _util import budget_method_cfg, client_half_from_the_task_alone, metrics_rows, run_within_budgets


FAST_OPTIONS = {
    "feddf": {"kd_steps": 4, "kd_batch_size": 16},
    "fedet": {"server_steps": 4, "server_batch_size": 16, "rep_dim": 16},
    "dsfl": {"subset_size": 24, "kd_epochs": 1, "kd_batch_size": 12},
}


def _cfg(algorithm: str, options: dict | None = None, **over: dict) -> object:
    return budget_method_cfg(algorithm, FAST_OPTIONS[algorithm] if options is None else options, **over)


_rows = metrics_rows


# ---------------------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("algorithm", ["feddf", "fedet", "dsfl"])
def test_method_trains_end_to_end_within_budgets(tmp_path, algorithm):
    cfg = _cfg(algorithm)
    engine, rows, clients, macs = run_within_budgets(tmp_path, cfg)
    # bytes are the tensors actually sent: tier models grow with the model, DS-FL sends
    # probabilities on the open-data subset (+ 8 bytes per index)
    if algorithm == "dsfl":
        assert all(c["bytes_up"] == 24 * 10 * 4 + 24 * 8 for c in clients)
    else:
        smallest = min(clients, key=lambda c: c["macs"])
        largest = max(clients, key=lambda c: c["macs"])
        assert smallest["bytes_up"] < largest["bytes_up"] and smallest["bytes_down"] < largest["bytes_down"]
    # every tier's deployed model fits that tier's budget; larger tiers deploy larger models
    algo, ctx = engine.algorithm, engine.ctx
    models = algo.eval_models(ctx)
    tier_macs = {t.name: ctx.macs(models[f"tier:{t.name}"]) for t in cfg.budget.tiers if f"tier:{t.name}" in models}
    assert set(tier_macs) == {"small", "medium", "large"} or algorithm == "dsfl"
    for t in cfg.budget.tiers:
        if t.name in tier_macs:
            assert tier_macs[t.name] <= t.ratio * ctx.plain_macs


@pytest.mark.parametrize("algorithm", ["feddf", "fedet", "dsfl"])
def test_client_half_runs_from_the_task_alone(tmp_path, algorithm):
    scenario = "decreasing" if "decreasing" in get_algorithm(algorithm).adapts_to else "static"
    cfg = _cfg(algorithm, budget={"scenario": scenario, "change": 0.3}, train={"local_epochs": 3})
    client_half_from_the_task_alone(cfg, tmp_path, keeps_client_state=algorithm == "dsfl")


@pytest.mark.parametrize("algorithm", ["feddf", "fedet", "dsfl"])
def test_kd_methods_need_public_data(tmp_path, algorithm):
    cfg = _cfg(algorithm, data={"public_fraction": 0.0})
    with pytest.raises(ConfigError, match="data.public_fraction"):
        Engine(cfg, tmp_path, progress=False).run()


@pytest.mark.parametrize("algorithm", ["dsfl"])
def test_resume_equals_uninterrupted(tmp_path, algorithm):
    cfg = _cfg(algorithm, train={"rounds": 2, "checkpoint_every": 1})
    Engine(cfg, tmp_path / "full", progress=False, shared_splits=True).run()
    Engine(cfg, tmp_path / "cut", progress=False, shared_splits=True, stop_after=1).run()
    Engine(None, tmp_path / "cut", resume=True, progress=False, shared_splits=True).run()
    a, b = _rows(tmp_path / "full"), _rows(tmp_path / "cut")
    assert [r["round"] for r in b] == [1, 2]
    for ra, rb in zip(a, b):
        assert ra["accuracy"] == rb["accuracy"] and ra["tier_accuracy"] == rb["tier_accuracy"]
        assert [c["loss"] for c in ra["clients"]] == [c["loss"] for c in rb["clients"]]


# ---------------------------------------------------------------------------------------- KD pieces
def test_fedet_consensus_and_diversity_targets():
    # 3 teachers, 2 samples, 3 classes
    logits = torch.tensor(
        [
            [[4.0, 0.0, 0.0], [0.0, 3.0, 0.0]],
            [[3.0, 0.0, 0.0], [0.0, 0.0, 0.1]],  # sample 1: unconfident, disagrees
            [[5.0, 0.0, 0.0], [0.0, 2.0, 0.0]],
        ]
    )
    y, div, has = consensus_targets(logits)
    assert y.tolist() == [0, 1]
    assert has.tolist() == [False, True]  # everyone agrees on sample 0
    assert torch.allclose(div[1], logits[1, 1])  # the only dissenter's logits
    p = F.softmax(logits, 2)
    conf = p.var(2, unbiased=False)
    w = conf / conf.sum(0)
    assert (w[:, 1, None] * p[:, 1]).sum(0).argmax().item() == 1


def test_dsfl_era_sharpens_the_average():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64)
    q = era(probs, 0.1)
    assert torch.allclose(q, F.softmax(probs / 0.1, 1))
    ent = lambda t: -(t * t.log()).sum(1)  # noqa: E731
    assert bool((ent(q) < ent(probs)).all())
    assert torch.allclose(q.sum(1), torch.ones(2, dtype=torch.float64))
