"""Faulty clients: injected faults are dropped and recorded, too few survivors stop the run, the fault
settings are checked, and an upload is checked where its task ran."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fedhetero.core.common.config import from_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.local.context import RunError
from fedhetero.core.run.engine import Engine
from fedhetero.core.method.registry import get_algorithm
from fedhetero.core.run.backend import injected_fault
from _util import fedavg_cfg


_cfg = fedavg_cfg


def _run(tmp_path: Path, cfg, tag: str, **kw):
    eng = Engine(cfg, tmp_path / tag, progress=False, **kw)
    res = eng.run()
    return eng, res


@pytest.mark.parametrize("backend", ["local", "process"])
def test_faulty_clients_are_dropped_and_recorded(tmp_path, backend):
    faults = {"rate": 0.3, "kinds": ["raise", "nan"]}
    cfg = from_dict(
        {
            "seed": 3,
            "threads": 1,
            "data": {"num_clients": 20},
            "train": {"rounds": 4, "sample_rate": 0.5, "local_epochs": 1},
            "algorithm": {"name": "dynamicfl"},
            "engine": {"backend": backend, "workers": 2, "inject_faults": faults},
        }
    )
    eng, res = _run(tmp_path, cfg, backend)
    assert res.summary["rounds"] == 4
    for v in eng.algorithm.global_model.state_dict().values():
        assert torch.isfinite(v.float()).all()
    assert math.isfinite(res.summary["final_accuracy"]) and res.summary["best_accuracy"] > 0.2  # it trained
    total_dropped = 0
    for row in res.metrics:
        sampled = eng.sample_clients(row["round"])
        expected = {}
        for cid in sampled:
            task = eng.algorithm.task(eng.ctx, eng.client_info(cid, row["round"]), {})
            kind = injected_fault(cfg, task)
            if kind is not None:
                expected[cid] = kind
        dropped = {d["cid"]: d["reason"] for d in row["dropped"]}
        assert set(dropped) == set(expected)
        for cid, kind in expected.items():
            assert ("InjectedFault" in dropped[cid]) if kind == "raise" else dropped[cid].startswith("non-finite")
        assert {c["cid"] for c in row["clients"]} == set(sampled) - set(expected)
        total_dropped += len(dropped)
    assert total_dropped >= 3  # 30 % of 40 client-rounds
    assert res.summary["dropped_clients"] == total_dropped
    # metrics.jsonl is valid JSON and names who was dropped and why
    rows = [json.loads(line) for line in (tmp_path / backend / "metrics.jsonl").read_text().splitlines()]
    assert sum(len(r["dropped"]) for r in rows) == total_dropped


def test_too_few_clients_stop_the_run_with_a_message(tmp_path):
    cfg = _cfg("fedavg", "local", rounds=2, min_clients=2, inject_faults={"rate": 1.0, "kinds": ["raise"]})
    with pytest.raises(RunError, match="engine.min_clients=2"):
        _run(tmp_path, cfg, "none")


def test_hang_needs_a_timeout():
    with pytest.raises(ConfigError, match="engine.inject_faults.kinds"):
        _cfg(inject_faults={"rate": 0.5, "kinds": ["hang"]})
    with pytest.raises(ConfigError, match="engine.inject_faults.rate"):
        _cfg(inject_faults={"rate": 1.5})
    with pytest.raises(ConfigError, match="engine.backend"):
        _cfg(backend="ray")


def test_upload_check_runs_where_the_task_ran():
    """run_task checks the upload itself (in a worker, in parallel) and marks the outcome, so the
    server does not check it again; an outcome built elsewhere (Flower) is still checked."""
    from fedhetero.core.exchange.types import ClientResult
    from fedhetero.core.exchange.types import Outcome, check_result, upload_fault

    def result(value):
        return ClientResult(cid=0, num_samples=1, state={"w": torch.full((4,), value), "n": torch.tensor(3)},
                            macs=1, budget_macs=1.0, bytes_up=0, bytes_down=0)

    assert upload_fault(result(1.0)) is None
    # a finite tensor whose norm overflows is still finite
    assert upload_fault(result(3e38)) is None
    assert upload_fault(result(float("nan"))) == "non-finite upload (w)"
    assert upload_fault(result(float("-inf"))) == "non-finite upload (w)"
    half = result(1.0)
    half.state["h"] = torch.tensor([1.0, float("inf")], dtype=torch.float16)
    assert upload_fault(half) == "non-finite upload (h)"
    bad = result(float("nan"))
    assert check_result(Outcome(None, bad), None) == "non-finite upload (w)"  # type: ignore[arg-type]
    assert check_result(Outcome(None, bad, checked=True), None) is None  # type: ignore[arg-type]


def test_a_non_finite_server_update_stops_the_run_at_its_round(tmp_path, monkeypatch):
    """Invariant: after every round the server's state is finite. A server update that leaves a NaN
    stops the run in that round, naming the entry, before the round is evaluated or checkpointed
    (not one round later as every client's "non-finite upload"); the last checkpoint resumes."""
    cfg = _cfg("fedavg", "local", rounds=4)
    cls = get_algorithm("fedavg")
    plain = cls.server_update

    def poisoned(self, ctx):
        plain(self, ctx)
        if ctx.round == 3:
            with torch.no_grad():
                next(self.global_model.parameters()).view(-1)[0] = float("nan")

    with monkeypatch.context() as patch:
        patch.setattr(cls, "server_update", poisoned)
        with pytest.raises(RunError) as err:
            Engine(cfg, tmp_path / "nan", progress=False).run()
    msg = str(err.value)
    assert msg.startswith("round 3: the server's update left non-finite values in global_model.")
    assert "checkpoint of round 2 is kept" in msg and "train.lr" in msg
    rows = (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["round"] for r in rows] == [1, 2]
    # the kept checkpoint is finite and resumes to the run that never met the NaN
    resumed = Engine(cfg, tmp_path / "nan", progress=False, resume=True).run()
    clean = Engine(cfg, tmp_path / "clean", progress=False).run()
    assert [r["round"] for r in resumed.metrics] == [1, 2, 3, 4]
    assert resumed.summary["final_accuracy"] == clean.summary["final_accuracy"]


def test_state_tensors_walk_every_checkpointed_field():
    """The finiteness check sees modules, tensors and dicts or lists of them, by dotted name."""
    from fedhetero.core.method.algorithm import Algorithm, state_tensors

    class Two(Algorithm):
        state_fields = ("global_model", "c", "tiers", "count")

    alg = Two()
    alg.global_model = torch.nn.Linear(2, 1)
    alg.c = {"w": torch.zeros(3), "nested": [torch.ones(1), torch.tensor([1, 2])]}
    alg.tiers = {"small": torch.nn.BatchNorm1d(2)}
    alg.count = 7
    got = state_tensors(alg)
    assert set(got) == {
        "global_model.weight", "global_model.bias", "c.w", "c.nested.0", "c.nested.1",
        "tiers.small.weight", "tiers.small.bias", "tiers.small.running_mean", "tiers.small.running_var",
        "tiers.small.num_batches_tracked",
    }
    # references, not copies
    assert got["global_model.weight"].data_ptr() == alg.global_model.weight.data_ptr()
    assert got["c.w"] is alg.c["w"]
