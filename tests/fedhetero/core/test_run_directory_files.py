"""The files of a run directory on resume: an emptied or edited config, a metrics line cut by a kill or
damaged, a forged checkpoint, a missing checkpoint and stale temporary files; the directory's lock."""

from __future__ import annotations

import io

import pytest
import torch

from fedhetero.core.common.configfile import load_config
from fedhetero.core.run.engine import Engine
from fedhetero.core.common.rundir import RunDirError, RunLock, read_metrics


SMALL = [
    "data.dataset=synthetic", "data.synthetic_size=120", "data.num_clients=4", "data.min_partition_size=5",
    "model.width=0.25", "train.rounds=3", "train.local_epochs=1", "algorithm.name=fedavg",
]


def _cfg(*extra: str):
    return load_config(None, SMALL + list(extra))


# ---------------------------------------------------------------------------- run directories
def test_empty_config_refuses_resume(tmp_path):
    Engine(_cfg(), tmp_path / "r", progress=False, stop_after=2).run()
    (tmp_path / "r" / "config.yaml").write_text("")
    with pytest.raises(RunDirError, match="empty"):
        Engine(None, tmp_path / "r", resume=True, progress=False)


def test_edited_config_refuses_resume(tmp_path):
    Engine(_cfg(), tmp_path / "r", progress=False, stop_after=2).run()
    p = tmp_path / "r" / "config.yaml"
    p.write_text(p.read_text().replace("rounds: 3", "rounds: 5"))
    with pytest.raises(RunDirError, match="changed after the run started"):
        Engine(None, tmp_path / "r", resume=True, progress=False)


def test_partial_last_metrics_line_is_dropped_and_run_resumes(tmp_path):
    full = Engine(_cfg(), tmp_path / "full", progress=False).run()
    Engine(_cfg(), tmp_path / "r", progress=False, stop_after=2).run()
    with open(tmp_path / "r" / "metrics.jsonl", "a") as fh:
        fh.write('{"round": 3, "accur')  # killed inside an append
    res = Engine(None, tmp_path / "r", resume=True, progress=False).run()
    assert res.summary["rounds"] == 3
    assert res.summary["final_accuracy"] == full.summary["final_accuracy"]
    assert res.summary["bytes_total"] == full.summary["bytes_total"]
    assert res.summary["resumed_from_round"] == 2
    assert [r["round"] for r in read_metrics(tmp_path / "r" / "metrics.jsonl")] == [1, 2, 3]


def test_damaged_middle_metrics_line_is_an_error(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"round": 1}\nxx\n{"round": 3}\n')
    with pytest.raises(RunDirError, match="line 2"):
        read_metrics(p)


def test_run_directory_is_locked(tmp_path):
    (tmp_path / "r").mkdir()
    lock = RunLock(tmp_path / "r").acquire()
    try:
        with pytest.raises(RunDirError, match="in use"):
            Engine(_cfg(), tmp_path / "r", progress=False).run()
    finally:
        lock.release()
    Engine(_cfg(), tmp_path / "r", progress=False).run()  # free again


def test_stale_temp_files_are_removed(tmp_path):
    Engine(_cfg(), tmp_path / "r", progress=False, stop_after=1).run()
    stale = [tmp_path / "r" / ".checkpoint.pt.tmp123", tmp_path / "r" / "client_state" / ".x.pt.tmp9"]
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"partial")
    Engine(None, tmp_path / "r", resume=True, progress=False).run()
    assert not any(p.exists() for p in stale)


def test_resume_reports_where_it_starts_and_counts_all_wall_time(tmp_path):
    from rich.console import Console

    buf = io.StringIO()
    Engine(_cfg(), tmp_path / "r", progress=False, stop_after=2).run()
    res = Engine(None, tmp_path / "r", resume=True, progress=True, console=Console(file=buf)).run()
    assert "resumed from round 2" in buf.getvalue()
    assert res.summary["wall_s"] >= sum(r["wall_s"] for r in res.metrics)


def test_resume_without_checkpoint_says_so(tmp_path):
    from rich.console import Console

    Engine(_cfg("train.checkpoint_every=5"), tmp_path / "r", progress=False, stop_after=1).run()
    buf = io.StringIO()
    res = Engine(None, tmp_path / "r", resume=True, progress=True, console=Console(file=buf)).run()
    assert "no checkpoint yet" in buf.getvalue()
    assert res.summary["rounds"] == 3


@pytest.mark.parametrize("forge", ["nan", "round"])
def test_forged_checkpoint_is_refused(tmp_path, forge):
    Engine(_cfg(), tmp_path / "r", progress=False, stop_after=2).run()
    path = tmp_path / "r" / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    if forge == "nan":
        key = next(iter(state["algorithm"]["global_model"]))
        state["algorithm"]["global_model"][key].fill_(float("nan"))
    else:
        state["round"] = 10**6
    torch.save(state, path)
    with pytest.raises(RunDirError, match="damaged"):
        Engine(None, tmp_path / "r", resume=True, progress=False).run()
