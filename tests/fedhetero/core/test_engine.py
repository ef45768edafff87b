"""Engine behaviour: resume equals an uninterrupted run, bad input is reported, metrics recorded."""

import json

import pytest

from fedhetero.core.common.config import from_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.run.engine import Engine


def _cfg(**over):
    base = {
        "seed": 3,
        "data": {"dataset": "synthetic", "synthetic_size": 240, "num_clients": 6, "min_partition_size": 5},
        "model": {"name": "lenet5", "width": 0.5},
        "train": {"rounds": 4, "sample_rate": 0.5, "local_epochs": 1, "batch_size": 16, "checkpoint_every": 2},
        "algorithm": {"name": "fedavg"},
    }
    for k, v in over.items():
        base.setdefault(k, {}).update(v) if isinstance(v, dict) else base.__setitem__(k, v)
    return from_dict(base)


@pytest.mark.parametrize("algorithm", ["fedavg", "dynamicfl"])
def test_resume_equals_uninterrupted(tmp_path, algorithm):
    cfg = _cfg(algorithm={"name": algorithm})
    full = Engine(cfg, tmp_path / "full", progress=False).run()
    # "kill" after round 3 (checkpoint at round 2): round 3's work must be redone identically
    Engine(cfg, tmp_path / "cut", progress=False, stop_after=3).run()
    resumed = Engine(None, tmp_path / "cut", resume=True, progress=False).run()
    a = [json.loads(l) for l in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(l) for l in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert ra["accuracy"] == rb["accuracy"]
        assert ra["loss"] == rb["loss"]
        assert [c["cid"] for c in ra["clients"]] == [c["cid"] for c in rb["clients"]]
        assert [c["loss"] for c in ra["clients"]] == [c["loss"] for c in rb["clients"]]
    assert full.summary["final_accuracy"] == resumed.summary["final_accuracy"]


def test_same_seed_same_numbers_other_seed_differs(tmp_path):
    a = Engine(_cfg(), tmp_path / "a", progress=False).run().summary
    b = Engine(_cfg(), tmp_path / "b", progress=False).run().summary
    c = Engine(_cfg(seed=4), tmp_path / "c", progress=False).run().summary
    assert a["final_accuracy"] == b["final_accuracy"]
    assert (a["final_accuracy"], a["bytes_total"]) != (c["final_accuracy"], c["bytes_total"]) or a != c


def test_metrics_record_budget_and_flops_per_client(tmp_path):
    res = Engine(_cfg(), tmp_path, progress=False).run()
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for r in rows:
        assert len(r["clients"]) == 3
        for c in r["clients"]:
            assert c["budget_macs"] > 0 and c["macs"] > 0 and c["bytes_up"] > 0
    assert (tmp_path / "summary.json").is_file() and (tmp_path / "config.yaml").is_file()
    assert set(res.summary["tiers"]) == {"small", "medium", "large"}


@pytest.mark.parametrize("backend", ["local", "process"])
def test_each_client_entry_has_its_tasks_wall_time(tmp_path, backend):
    """A client entry's ``wall_s`` is the wall time of its tasks in the round: positive, and on the
    local back end (tasks one after another) the round's entries add up to no more than the client
    phase that ran them; the process back end reports the time where each task ran."""
    cfg = _cfg(engine={"backend": backend, "workers": 2}, train={"rounds": 2})
    res = Engine(cfg, tmp_path, progress=False).run()
    for r in res.metrics:
        walls = [c["wall_s"] for c in r["clients"]]
        assert len(walls) == 3 and all(w > 0 for w in walls)
        if backend == "local":
            assert sum(walls) <= r["timers"]["client_phase"] + 1e-3


def test_missing_dataset_names_what_to_put_where(tmp_path):
    cfg = _cfg(data={"dataset": "cifar10", "data_dir": str(tmp_path / "nodata")})
    with pytest.raises(FileNotFoundError) as exc:
        Engine(cfg, tmp_path / "run", progress=False).run()
    msg = str(exc.value)
    assert "cifar-10-batches-py" in msg and "data_dir" in msg


def test_unknown_algorithm_and_option_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="algorithm.name"):
        Engine(_cfg(algorithm={"name": "nope"}), tmp_path, progress=False).run()
    with pytest.raises(ConfigError, match="algorithm.options.bogus"):
        Engine(_cfg(algorithm={"name": "dynamicfl", "options": {"bogus": 1}}), tmp_path, progress=False).run()


def test_resume_refuses_a_different_config(tmp_path):
    Engine(_cfg(), tmp_path, progress=False, stop_after=1).run()
    with pytest.raises(ConfigError, match="differs"):
        Engine(_cfg(train={"rounds": 9}), tmp_path, resume=True, progress=False)
