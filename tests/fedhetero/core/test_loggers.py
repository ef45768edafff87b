"""Experiment loggers (``loggers: [tensorboard, mlflow]``): what they log equals ``metrics.jsonl`` and
``summary.json``, read back with each tool's own reader; a resume never logs a step twice; the names
and the optional packages are checked before a run starts, naming the field and the extra; loggers
leave the config hash alone; ``--overwrite`` clears their folders and nothing else."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from fedhetero.cli import main
from fedhetero.core.run import loggers as L
from fedhetero.core.common.config import config_hash, config_hashes
from fedhetero.core.common.options import ConfigError
from fedhetero.core.common.configfile import load_config
from fedhetero.core.run.engine import Engine
from fedhetero.core.common.rundir import LOGGER_DIRS, RUN_ENTRIES, clear_run, inspect_dir

from _util import metrics_rows

SMALL = [
    "data.dataset=synthetic", "data.synthetic_size=120", "data.num_clients=4", "data.min_partition_size=5",
    "model.width=0.25", "train.local_epochs=1", "train.sample_rate=1.0", "threads=1",
]


def _cfg(*extra: str):
    return load_config(None, SMALL + list(extra))


def _sets(*extra: str) -> list[str]:
    return [a for s in SMALL + list(extra) for a in ("--set", s)]


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _needs(*packages: str) -> None:
    """Skip unless ``packages`` are installed (found without importing them: MLflow reads its
    telemetry setting when first imported, which the logger sets first)."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}: pip install -e \".[loggers]\"")


# ---------------------------------------------------------------------------- readers (each tool's own)


def _tensorboard(run: Path):
    """The run's TensorBoard data as TensorBoard reads it, with nothing purged (a step logged twice
    would show)."""
    _needs("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0},
                           purge_orphaned_data=False)
    acc.Reload()
    return acc


def _mlflow(run: Path):
    """``(client, the active run, the deleted runs)`` of the run's MLflow store, read with MLflow's client."""
    _needs("mlflow")
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("fedhetero")
    active = client.search_runs([exp.experiment_id])
    assert len(active) == 1
    deleted = client.search_runs([exp.experiment_id], run_view_type=ViewType.DELETED_ONLY)
    return client, active[0], deleted


def _expected(rows: list[dict]) -> dict[str, dict[int, float]]:
    """tag -> {round: value}: every scalar the loggers log for the rows, by round."""
    out: dict[str, dict[int, float]] = {}
    for row in rows:
        for tag, value in L.round_scalars(row).items():
            out.setdefault(tag, {})[row["round"]] = value
    return out


def _f32(x: float) -> float:
    return float(np.float32(x))  # TensorBoard's scalars are 32-bit floats


# ---------------------------------------------------------------------------- what a round logs


def test_round_scalars_are_the_numbers_of_the_row():
    row = {
        "round": 3, "accuracy": 0.5, "loss": float("nan"), "skipped": False, "note": "text", "high_group": [1, 2],
        "tier_accuracy": {"small": 0.25, "large": 0.75}, "timers": {"client_phase": 1.5, "evaluate": 0.25},
        "bytes_up": 100, "dropped": [{"cid": 9, "tier": "small", "kind": "timeout"}],
        "clients": [
            {"cid": 0, "tier": "small", "macs": 50, "budget_macs": 100.0, "loss": 2.0, "fits_budget": True},
            {"cid": 1, "tier": "small", "macs": 100, "budget_macs": 100.0, "loss": 1.0, "fits_budget": True},
            {"cid": 2, "tier": "large", "macs": 200, "budget_macs": 400.0, "loss": 3.0, "fits_budget": True},
        ],
    }
    assert L.round_scalars(row) == {
        "accuracy": 0.5,  # loss is NaN (null in metrics.jsonl); bools, text and lists are no scalars
        "tier_accuracy/small": 0.25, "tier_accuracy/large": 0.75,
        "timers/client_phase": 1.5, "timers/evaluate": 0.25,
        "bytes_up": 100.0,
        "clients/count": 3.0, "clients/dropped": 1.0,
        "clients/count/small": 2.0, "clients/count/large": 1.0,
        "clients/macs/small": 75.0, "clients/macs/large": 200.0,
        "clients/budget_macs/small": 100.0, "clients/budget_macs/large": 400.0,
        "clients/budget_use/small": 0.75, "clients/budget_use/large": 0.5,
        "clients/loss/small": 1.5, "clients/loss/large": 3.0,
    }
    assert L.summary_scalars({"rounds": 3, "final_accuracy": 0.5, "time_to_target": None, "tiers": {"a": {"macs": 2}}}) == {
        "summary/rounds": 3.0, "summary/final_accuracy": 0.5, "summary/tiers/a/macs": 2.0,
    }


def test_mlflow_names_keep_what_mlflow_accepts():
    assert L._mlflow_name("clients/budget_use/tier 1") == "clients/budget_use/tier 1"
    assert L._mlflow_name("tier_accuracy/a#b") == "tier_accuracy/a_b"
    assert L._mlflow_name("tier_accuracy/..") == "tier_accuracy/_"


# ---------------------------------------------------------------------------- names, packages, hash


def test_the_registry_is_the_one_list_of_names():
    assert set(L.logger_names()) >= {"tensorboard", "mlflow"}
    for name in L.logger_names():
        folder = getattr(L.logger_class(name), "folder", None)
        assert folder is None or (folder in LOGGER_DIRS and folder in RUN_ENTRIES), name
    with pytest.raises(TypeError, match="not a Logger subclass"):
        L.register_logger("x")(dict)  # type: ignore[arg-type]


def test_an_unknown_logger_is_one_config_error_naming_the_field(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"^loggers\[1\]: must be one of 'tensorboard', 'mlflow'.*, got 'tensorbord'$"):
        _cfg("loggers=[mlflow, tensorbord]")
    with pytest.raises(ConfigError, match=r"^loggers: expected a list, got 'tensorboard'$"):
        _cfg("loggers=tensorboard")
    with pytest.raises(ConfigError, match=r"^loggers: names a logger twice"):
        _cfg("loggers=[tensorboard, tensorboard]")
    out = tmp_path / "r"
    rc = main(["train", "--out", str(out), "--quiet", *_sets("loggers=[wandb]")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("fedhetero: config error: loggers[0]: must be one of")
    assert not out.exists()


@pytest.mark.parametrize("name, package", [("tensorboard", "tensorboard"), ("mlflow", "mlflow"), ("mlflow", "sqlalchemy")])
def test_a_missing_package_names_the_extra(tmp_path, capsys, monkeypatch, name, package):
    monkeypatch.setitem(sys.modules, package, None)  # find_spec() then reports it missing
    out = tmp_path / "r"
    with pytest.raises(ConfigError, match=rf"^loggers\[0\]: the {name} logger needs {package}, which is not installed: "
                                          r'pip install "fedhetero\[loggers\]"'):
        Engine(_cfg(f"loggers=[{name}]", "train.rounds=1"), out, progress=False)
    rc = main(["train", "--out", str(out), "--quiet", *_sets(f"loggers=[{name}]", "train.rounds=1")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "fedhetero[loggers]" in err[0] and "loggers[0]" in err[0]
    assert not out.exists()  # refused before the run directory was made


def test_loggers_leave_the_config_hash_alone():
    base = _cfg()
    for names in ("[tensorboard]", "[mlflow, tensorboard]"):
        cfg = _cfg(f"loggers={names}")
        assert config_hash(cfg) == config_hash(base)
        assert config_hashes(cfg) == config_hashes(base)


# ---------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> Path:
    """A run with both loggers stopped after round 3 whose last checkpoint is round 2 (so round 3
    was logged and is run again), then resumed from the command line to round 4."""
    _needs("tensorboard", "mlflow", "sqlalchemy", "alembic")
    run = tmp_path_factory.mktemp("loggers") / "r"
    cfg = _cfg("loggers=[tensorboard, mlflow]", "train.rounds=4", "train.checkpoint_every=2")
    Engine(cfg, run, progress=False, stop_after=3).run()
    assert [r["round"] for r in metrics_rows(run)] == [1, 2, 3]
    before = _tensorboard(run)
    assert [e.step for e in before.Scalars("accuracy")] == [1, 2, 3]
    rc = main(["train", "--out", str(run), "--resume", "--quiet"])
    assert rc == 0
    return run


def test_tensorboard_holds_each_round_once_with_the_values_of_metrics_jsonl(resumed):
    rows = metrics_rows(resumed)
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    acc = _tensorboard(resumed)
    expected = _expected(rows)
    summary = L.summary_scalars(_summary(resumed))
    assert set(acc.Tags()["scalars"]) == set(expected) | set(summary)
    for tag, by_round in expected.items():
        events = acc.Scalars(tag)
        assert [e.step for e in events] == sorted(by_round), tag  # each step once, in order
        assert [e.value for e in events] == [_f32(by_round[s]) for s in sorted(by_round)], tag
    # the named metrics, read straight from the rows
    for r in rows:
        step = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in ("accuracy", "loss", "bytes_up", "bytes_down")}
        assert step["accuracy"][r["round"]] == _f32(r["accuracy"])
        assert step["loss"][r["round"]] == _f32(r["loss"])
        assert step["bytes_up"][r["round"]] == _f32(r["bytes_up"])
        assert step["bytes_down"][r["round"]] == _f32(r["bytes_down"])
        for tier, value in r["tier_accuracy"].items():
            assert {e.step: e.value for e in acc.Scalars(f"tier_accuracy/{tier}")}[r["round"]] == _f32(value)
        for timer, value in r["timers"].items():
            assert {e.step: e.value for e in acc.Scalars(f"timers/{timer}")}[r["round"]] == _f32(value)
        for tier in {c["tier"] for c in r["clients"]}:
            mine = [c for c in r["clients"] if c["tier"] == tier]
            use = math.fsum(c["macs"] / c["budget_macs"] for c in mine) / len(mine)
            assert {e.step: e.value for e in acc.Scalars(f"clients/budget_use/{tier}")}[r["round"]] == _f32(use)
    for tag, value in summary.items():
        assert [(e.step, e.value) for e in acc.Scalars(tag)] == [(4, _f32(value))], tag
    assert "config" in acc.Tags()["tensors"]  # the resolved config, as text at step 0
    assert len(list((resumed / "tensorboard").iterdir())) == 1  # the resume left one event file


def test_mlflow_holds_each_round_once_with_the_values_of_metrics_jsonl(resumed):
    rows = metrics_rows(resumed)
    client, run, deleted = _mlflow(resumed)
    # the first MLflow run held round 3, which the resume ran again: it was replaced
    assert len(deleted) == 1
    assert run.info.status == "FINISHED" and run.info.run_name == "r"
    assert run.data.params["train.rounds"] == "4" and run.data.params["loggers"] == '["tensorboard", "mlflow"]'
    assert run.data.tags["fedhetero.config_hash"] == config_hash(_cfg("train.rounds=4", "train.checkpoint_every=2"))
    expected = _expected(rows)
    summary = L.summary_scalars(_summary(resumed))
    assert set(run.data.metrics) == set(expected) | set(summary)
    for tag, by_round in expected.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag))
        assert history == sorted(by_round.items()), tag  # each step once, the exact values
    for r in rows:
        assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "accuracy")}[r["round"]] == r["accuracy"]
        assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "timers/client_phase")}[r["round"]] \
            == r["timers"]["client_phase"]
    for tag, value in summary.items():
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag)] == [(4, value)], tag


def test_a_logger_turned_on_at_a_resume_is_given_the_earlier_rounds(tmp_path, capsys):
    _needs("tensorboard")
    run = tmp_path / "r"
    Engine(_cfg("train.rounds=3", "algorithm.name=fedavg"), run, progress=False, stop_after=2).run()
    recorded = json.loads((run / "run.json").read_text())["config_hash"]
    # a run directory made before loggers existed: its config.yaml has no loggers field
    text = (run / "config.yaml").read_text()
    assert "loggers: []\n" in text
    (run / "config.yaml").write_text(text.replace("loggers: []\n", ""))
    rc = main(["train", "--out", str(run), "--resume", "--quiet", "--set", "loggers=[tensorboard]"])
    assert rc == 0, capsys.readouterr().err
    assert json.loads((run / "run.json").read_text())["config_hash"] == recorded
    assert load_config(run / "config.yaml").loggers == ("tensorboard",)  # a later resume goes on with it
    acc = _tensorboard(run)
    rows = metrics_rows(run)
    assert [(e.step, e.value) for e in acc.Scalars("accuracy")] == [(r["round"], _f32(r["accuracy"])) for r in rows]
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3]


def test_the_cli_writes_tensorboard_files_under_the_run_directory(tmp_path, capsys):
    _needs("tensorboard")
    out = tmp_path / "r"
    rc = main(["train", "--out", str(out), "--quiet", *_sets("loggers=[tensorboard]", "train.rounds=2", "algorithm.name=fedavg")])
    assert rc == 0, capsys.readouterr().err
    files = list((out / "tensorboard").iterdir())
    assert len(files) == 1 and files[0].name.startswith("events.out.tfevents.")
    assert [e.step for e in _tensorboard(out).Scalars("accuracy")] == [1, 2]
    assert (out / "metrics.jsonl").is_file() and len(metrics_rows(out)) == 2  # metrics.jsonl as before
    # --overwrite replaces the run, its loggers' folders included
    rc = main(["train", "--out", str(out), "--quiet", "--overwrite", *_sets("train.rounds=1", "algorithm.name=fedavg")])
    assert rc == 0, capsys.readouterr().err
    assert not (out / "tensorboard").exists()


# ---------------------------------------------------------------------------- the run directory


def test_logger_folders_are_a_runs_own_and_nothing_else_in_them(tmp_path):
    run = tmp_path / "r"
    (run / "tensorboard").mkdir(parents=True)
    (run / "mlflow").mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    (run / "tensorboard" / "events.out.tfevents.1700000000.host.1.0").write_bytes(b"x")
    (run / "mlflow" / "mlflow.db").write_bytes(b"x")
    (run / "mlflow" / "mlflow.db-journal").write_bytes(b"x")
    state = inspect_dir(run)
    assert state.foreign == [] and {"tensorboard", "mlflow"} <= set(state.run_entries)
    (run / "tensorboard" / "notes.txt").write_text("mine")
    (run / "mlflow" / "artifacts").mkdir()
    assert inspect_dir(run).foreign == ["mlflow/artifacts/", "tensorboard/notes.txt"]
    (run / "tensorboard" / "notes.txt").unlink()
    (run / "mlflow" / "artifacts").rmdir()
    clear_run(run)
    assert list(run.iterdir()) == []


def test_a_finished_run_gets_a_logger_with_resume(tmp_path, capsys):
    _needs("tensorboard", "mlflow", "sqlalchemy", "alembic")
    run = tmp_path / "r"
    assert main(["train", "--out", str(run), "--quiet", *_sets("train.rounds=2", "loggers=[mlflow]")]) == 0
    assert not (run / "tensorboard").exists()
    assert main(["train", "--out", str(run), "--resume", "--quiet", "--set", "loggers=[mlflow, tensorboard]"]) == 0, \
        capsys.readouterr().err
    rows, summary = metrics_rows(run), _summary(run)
    acc = _tensorboard(run)
    assert [(e.step, e.value) for e in acc.Scalars("accuracy")] == [(r["round"], _f32(r["accuracy"])) for r in rows]
    assert [(e.step, e.value) for e in acc.Scalars("summary/final_accuracy")] == [(2, _f32(summary["final_accuracy"]))]
    # the MLflow run held the first summary: made again, with each round and the summary once
    client, mrun, deleted = _mlflow(run)
    assert len(deleted) == 1 and mrun.info.status == "FINISHED"
    history = client.get_metric_history(mrun.info.run_id, "accuracy")
    assert sorted((m.step, m.value) for m in history) == [(r["round"], r["accuracy"]) for r in rows]
    assert [(m.step, m.value) for m in client.get_metric_history(mrun.info.run_id, "summary/wall_s")] == [(2, summary["wall_s"])]
