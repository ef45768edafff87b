"""Resume: a resumed run ends with the numbers of an uninterrupted one, or is refused with one line;
never a silently wrong result. What may change on resume: where clients run and how failing
clients are handled."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fedhetero.cli import main
from fedhetero.core.common.config import config_hash, config_hashes
from fedhetero.core.common.configfile import load_config
from fedhetero.core.run.engine import Engine
from fedhetero.core.common.rundir import RunDirError

from _util import strip_wall

SMALL = [
    "data.dataset=synthetic", "data.synthetic_size=120", "data.num_clients=4", "data.min_partition_size=5",
    "model.width=0.25", "train.rounds=3", "train.local_epochs=1", "algorithm.name=scaffold", "threads=1",
    "train.sample_rate=0.5",
]


def _cfg(*extra: str):
    return load_config(None, SMALL + list(extra))


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _resume_cli(capsys, run: Path, *extra: str) -> tuple[int, str]:
    rc = main(["train", "--out", str(run), "--resume", "--quiet", *extra])
    return rc, capsys.readouterr().err


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    """An uninterrupted run (the reference)."""
    out = tmp_path_factory.mktemp("full") / "r"
    Engine(_cfg(), out, progress=False).run()
    return out


def _stopped(tmp_path: Path, after: int = 2) -> Path:
    run = tmp_path / "r"
    Engine(_cfg(), run, progress=False, stop_after=after).run()
    return run


def test_resume_is_bit_equal_after_rows_written_past_the_checkpoint(tmp_path, full, capsys):
    run = _stopped(tmp_path)
    rows = _metrics(run)
    # a kill after round 3's row was appended but before its checkpoint: the row is cut on resume
    extra = dict(rows[-1], round=3)
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps(extra) + "\n" + '{"round": 4, "cut')
    rc, err = _resume_cli(capsys, run)
    assert rc == 0, err
    assert strip_wall(_metrics(run)) == strip_wall(_metrics(full))


@pytest.mark.parametrize("damage", ["deleted", "emptied", "row removed", "checkpointed line cut", "row edited"])
def test_a_damaged_metrics_log_is_refused(tmp_path, capsys, damage):
    run = _stopped(tmp_path)
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    if damage == "deleted":
        path.unlink()
    elif damage == "emptied":
        path.write_text("")
    elif damage == "row removed":
        path.write_text(lines[1])
    elif damage == "checkpointed line cut":
        path.write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    else:
        row = json.loads(lines[0])
        row["accuracy"] = 0.99
        path.write_text(json.dumps(row) + "\n" + lines[1])
    rc, err = _resume_cli(capsys, run)
    assert rc == 2
    assert len(err.strip().splitlines()) == 1
    assert "metrics.jsonl does not hold the 2 rounds" in err
    assert not (run / "summary.json").exists()


def test_a_later_checkpoint_copied_in_is_refused(tmp_path, full, capsys):
    run = _stopped(tmp_path, after=1)
    shutil.copy(full / "checkpoint.pt", run / "checkpoint.pt")  # round 3 of the same config
    rc, err = _resume_cli(capsys, run)
    assert rc == 2 and "does not hold the 3 rounds" in err
    assert not (run / "summary.json").exists()


def test_an_earlier_checkpoint_of_a_finished_run_is_refused_when_client_state_moved_on(tmp_path, capsys):
    run = tmp_path / "r"
    Engine(_cfg(), run, progress=False, stop_after=1).run()
    early = (run / "checkpoint.pt").read_bytes()
    Engine(None, run, resume=True, progress=False).run()
    (run / "checkpoint.pt").write_bytes(early)
    rc, err = _resume_cli(capsys, run)
    assert rc == 2 and "client_state" in err and "does not match the checkpoint of round 1" in err


def test_deleted_client_state_is_refused(tmp_path, capsys):
    run = _stopped(tmp_path)
    assert any((run / "client_state").iterdir())  # SCAFFOLD keeps client control variates
    shutil.rmtree(run / "client_state")
    rc, err = _resume_cli(capsys, run)
    assert rc == 2 and "does not match the checkpoint of round 2" in err and "is missing or changed" in err


def test_a_damaged_client_state_file_is_one_line_naming_it(tmp_path, capsys):
    run = tmp_path / "r"
    Engine(_cfg("train.sample_rate=1.0"), run, progress=False, stop_after=2).run()
    files = sorted((run / "client_state").rglob("r*.pt"))
    # same size, other bytes: passes the manifest, fails to load when the client is sampled
    for f in files:
        f.write_bytes(b"\0" * f.stat().st_size)
    rc, err = _resume_cli(capsys, run)
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1
    assert "client_state/client_" in err and "is damaged" in err and "PytorchStreamReader" not in err.split("(")[0]


def test_resume_from_a_checkpoint_written_before_marks_existed(tmp_path, full):
    """Run directories written by earlier versions (no metrics mark, no client-state manifest, the
    older config hash) still resume, bit-equal."""
    run = _stopped(tmp_path)
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    del ckpt["metrics"], ckpt["client_states"]
    (old,) = config_hashes(_cfg()) - {config_hash(_cfg())}  # the hash an earlier version recorded
    assert old != config_hash(_cfg())
    ckpt["config_hash"] = old
    torch.save(ckpt, run / "checkpoint.pt")
    meta = json.loads((run / "run.json").read_text())
    meta["config_hash"] = old
    (run / "run.json").write_text(json.dumps(meta))
    Engine(None, run, resume=True, progress=False).run()
    assert strip_wall(_metrics(run)) == strip_wall(_metrics(full))


# ---------------------------------------------------------------------------- what may change on resume


def test_failure_handling_may_change_on_resume(tmp_path, capsys, full):
    run = tmp_path / "r"
    rc = main(["train", "--out", str(run), "--quiet", *[a for s in SMALL for a in ("--set", s)],
               "--set", "engine.inject_faults.rate=1.0", "--set", "engine.inject_faults.kinds=[raise]"])
    err = capsys.readouterr().err
    assert rc == 1 and "no round was checkpointed yet" in err and "last checkpoint is kept" not in err
    # fix the cause on resume: the faults of the drill, the minimum and the time-out may change
    rc, err = _resume_cli(capsys, run, "--set", "engine.inject_faults.rate=0", "--set", "engine.min_clients=2",
                          "--set", "engine.client_timeout_s=600")
    assert rc == 0, err
    saved = load_config(run / "config.yaml")  # the run, and a later resume, go on with the new values
    assert (saved.engine.inject_faults.rate, saved.engine.min_clients, saved.engine.client_timeout_s) == (0.0, 2, 600.0)
    assert strip_wall(_metrics(run)) == strip_wall(_metrics(full))


def test_a_numbers_relevant_change_on_resume_is_refused_naming_the_field(tmp_path, capsys):
    run = _stopped(tmp_path)
    rc, err = _resume_cli(capsys, run, "--set", "train.lr=0.5")
    assert rc == 2 and "train.lr" in err and "may change on resume" in err


def test_resume_and_overwrite_together_are_refused(tmp_path, capsys):
    run = _stopped(tmp_path)
    rc = main(["train", "--out", str(run), "--resume", "--overwrite", "--quiet"])
    assert rc == 2 and "choose one" in capsys.readouterr().err


def test_resume_refuses_a_config_changed_while_it_starts(tmp_path, monkeypatch):
    run = _stopped(tmp_path)
    eng = Engine(None, run, resume=True, progress=False)
    p = run / "config.yaml"
    p.write_text(p.read_text().replace("rounds: 3", "rounds: 4"))
    with pytest.raises(RunDirError):
        eng.run()


# ---------------------------------------------------------------------------- defaults that changed
def test_run_json_records_every_method_option_with_its_default(tmp_path):
    run = _stopped(tmp_path, after=1)
    recorded = json.loads((run / "run.json").read_text())["algorithm_options"]
    from fedhetero.algorithms.classic.scaffold import ScaffoldOptions  # the SMALL job's method

    assert set(recorded) == {f for f in ScaffoldOptions.__dataclass_fields__}


def test_a_run_made_with_another_default_is_refused_on_resume_naming_the_option(tmp_path, capsys, full):
    """A method option whose default changed after the run was made: resuming it with the new
    default would continue another run than the one on disk, so it is refused, naming the option,
    the value it was made with and the one it would get. A grid never reuses such a run either."""
    from fedhetero.lab.grid import pending

    run = _stopped(tmp_path)
    meta = json.loads((run / "run.json").read_text())
    name = sorted(meta["algorithm_options"])[0]
    meta["algorithm_options"][name] = "made-with-another-default"
    (run / "run.json").write_text(json.dumps(meta))
    rc, err = _resume_cli(capsys, run)
    assert rc != 0 and f"algorithm.options.{name}='made-with-another-default'" in err and "--overwrite" in err
    # a finished run with the options recorded as now is reused by a grid; one made with others is not
    done = tmp_path / "done"
    shutil.copytree(full, done)
    runs = {"done": SMALL}
    assert pending(tmp_path, runs, None) == {} and pending(tmp_path, runs, _config_file(tmp_path)) == {}
    meta = json.loads((done / "run.json").read_text())
    meta["algorithm_options"][name] = "made-with-another-default"
    (done / "run.json").write_text(json.dumps(meta))
    assert list(pending(tmp_path, runs, _config_file(tmp_path))) == ["done"]


def _config_file(tmp_path: Path) -> str:
    """An empty base config file: the grid's runs are its SMALL overrides."""
    path = tmp_path / "base.yaml"
    path.write_text("{}\n")
    return str(path)


def test_a_dynamicfl_run_made_before_runs_recorded_their_options_is_refused_when_its_defaults_changed(tmp_path, capsys):
    """DynamicFL's defaults changed (block_step sum → mean, rep_scale gamma → calibrated) before
    runs recorded their options: a run directory without that record, whose config does not set
    them, was made with the earlier ones and is not continued with the new; one that sets them
    explicitly continues."""
    base = ["data.num_clients=4", "train.rounds=2", "train.sample_rate=1.0", "threads=1",
            "algorithm.name=dynamicfl", "train.local_epochs=1"]
    for name, extra in (("unset", []), ("set", ["algorithm.options.block_step=mean", "algorithm.options.rep_scale=calibrated"])):
        run = tmp_path / name
        Engine(load_config(None, base + extra), run, progress=False, stop_after=1).run()
        meta = json.loads((run / "run.json").read_text())
        del meta["algorithm_options"]  # as a run directory of the earlier versions
        (run / "run.json").write_text(json.dumps(meta))
        rc, err = _resume_cli(capsys, run)
        if name == "unset":
            assert rc != 0 and "algorithm.options.rep_scale='gamma'" in err and "algorithm.options.block_step='sum'" in err
        else:
            assert rc == 0, err
