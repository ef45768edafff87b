"""Run directories you can trust: a run directory never makes fedhetero run code, two runs never
share one, and nothing fedhetero did not write is deleted or replaced (train and compare)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fedhetero.cli import main
from fedhetero.core.common.configfile import load_config
from fedhetero.core.run.engine import Engine
from fedhetero.core.common.rundir import RunDirError, RunLock, inspect_dir
from _util import ROOT

SMALL = [
    "data.dataset=synthetic", "data.synthetic_size=120", "data.num_clients=4", "data.min_partition_size=5",
    "model.width=0.25", "train.rounds=2", "train.local_epochs=1", "algorithm.name=fedavg", "threads=1",
]


def _cfg(*extra: str):
    return load_config(None, SMALL + list(extra))


def _sets(*extra: str) -> list[str]:
    return [a for s in SMALL + list(extra) for a in ("--set", s)]


def _cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    err = capsys.readouterr().err
    return rc, err


# ---------------------------------------------------------------------------- no code from a run directory

EVIL = '''
from pathlib import Path
Path({marker!r}).write_text("ran")
from fedhetero.algorithms.classic.fedavg import FedAvg
class Evil(FedAvg):
    name = "evil"
'''


def _plant(tmp_path: Path, run: Path) -> Path:
    """Point a finished run's config.yaml at a file beside it that marks when it runs."""
    marker = tmp_path / "ran.txt"
    (run / "evil.py").write_text(EVIL.format(marker=str(marker)))
    cfg_path = run / "config.yaml"
    data = yaml.safe_load(cfg_path.read_text())
    data["algorithm"]["name"] = f"{run / 'evil.py'}:Evil"
    cfg_path.write_text(yaml.safe_dump(data, sort_keys=False))
    return marker


@pytest.mark.parametrize("run_json", ["removed", "recomputed"])
def test_resume_never_imports_code_that_only_the_run_directory_names(tmp_path, capsys, run_json):
    run = tmp_path / "r"
    Engine(_cfg(), run, progress=False).run()
    marker = _plant(tmp_path, run)
    if run_json == "removed":
        (run / "run.json").unlink()
    else:  # the attacker recomputes the recorded hash too
        from fedhetero.core.common.config import config_hash

        meta = json.loads((run / "run.json").read_text())
        meta["config_hash"] = config_hash(load_config(run / "config.yaml"))
        (run / "run.json").write_text(json.dumps(meta))
    rc, err = _cli(capsys, "train", "--out", str(run), "--resume", "--quiet")
    assert rc == 2
    assert "never makes fedhetero import code" in err and "--set algorithm.name=" in err
    assert len(err.strip().splitlines()) == 1
    assert not marker.exists()
    with pytest.raises(RunDirError, match="name it again"):
        Engine(None, run, resume=True, progress=False)
    assert not marker.exists()


def test_a_method_from_a_file_resumes_when_named_again(tmp_path, capsys):
    name = f"{ROOT / 'examples' / 'my_algorithm.py'}:FedAvgM"
    full = Engine(_cfg(f"algorithm.name={name}"), tmp_path / "full", progress=False).run()
    Engine(_cfg(f"algorithm.name={name}"), tmp_path / "r", progress=False, stop_after=1).run()
    rc, err = _cli(capsys, "train", "--out", str(tmp_path / "r"), "--resume", "--quiet")
    assert rc == 2 and "name it again" in err
    rc, err = _cli(capsys, "train", "--out", str(tmp_path / "r"), "--resume", "--quiet", "--set", f"algorithm.name={name}")
    assert rc == 0, err
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["final_accuracy"] == full.summary["final_accuracy"]


def test_package_module_class_names_load(tmp_path):
    res = Engine(_cfg("algorithm.name=fedhetero.algorithms.classic.fedavg:FedAvg", "train.rounds=1"), tmp_path / "r",
                 progress=False).run()
    assert res.summary["rounds"] == 1


# ---------------------------------------------------------------------------- one run per directory


def test_the_lock_is_taken_before_set_up(tmp_path, monkeypatch):
    run = tmp_path / "r"
    run.mkdir()
    calls = []
    monkeypatch.setattr(Engine, "setup", lambda self: calls.append(1))
    with RunLock(run):
        with pytest.raises(RunDirError, match="in use"):
            Engine(_cfg(), run, progress=False).run()
    assert calls == []  # refused before any set-up work


def test_a_run_started_later_never_replaces_one_that_holds_the_directory(tmp_path):
    """Two CLI runs into one --out, the first with a slow set-up: exactly one runs, the other is
    refused (before the lock came first, the slow one replaced the finished one; both exited 0)."""
    out = tmp_path / "r"
    cmd = [sys.executable, "-m", "fedhetero.cli", "train", "--out", str(out), "--quiet", *_sets()]
    slow = subprocess.Popen(cmd[:-len(_sets())] + _sets("data.synthetic_size=20000", "train.rounds=1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    fast = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    slow_out, slow_err = slow.communicate(timeout=300)
    codes = sorted([slow.returncode, fast.returncode])
    assert codes == [0, 2], (slow_err, fast.stderr)
    loser = slow_err if slow.returncode else fast.stderr
    assert "in use by another fedhetero run" in loser or "already holds" in loser
    winner_rounds = 1 if slow.returncode == 0 else 2
    assert json.loads((out / "summary.json").read_text())["rounds"] == winner_rounds


def test_a_failed_set_up_leaves_no_new_directory(tmp_path, capsys):
    rc, err = _cli(capsys, "train", "--out", str(tmp_path / "new" / "r"), "--quiet", *_sets("model.name=lenet5",
                                                                                              "data.dataset=cifar10",
                                                                                              f"data.data_dir={tmp_path}"))
    assert rc == 2
    assert not (tmp_path / "new" / "r").exists()


# ---------------------------------------------------------------------------- nothing lost


def test_a_directory_that_is_not_a_run_is_refused_even_with_overwrite(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    for extra in ([], ["--overwrite"]):
        rc, err = _cli(capsys, "train", "--out", str(out), "--quiet", *_sets(), *extra)
        assert rc == 2 and "not a fedhetero run directory" in err and "notes.txt" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "my notes"


def test_leftovers_of_a_run_without_its_config_are_never_replaced_silently(tmp_path, capsys):
    run = tmp_path / "r"
    Engine(_cfg(), run, progress=False).run()
    for name in ("config.yaml", "metrics.jsonl", "checkpoint.pt", "summary.json"):
        (run / name).unlink()
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert {"final_model.pt", "model.json", "run.json"} <= set(before)
    rc, err = _cli(capsys, "train", "--out", str(run), "--quiet", *_sets())
    assert rc == 2 and "config.yaml is missing" in err and "--overwrite" in err and "--resume" not in err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    # --resume does not send the user back: it says the run cannot be continued and what to do
    rc, err = _cli(capsys, "train", "--out", str(run), "--resume", "--quiet")
    assert rc == 2 and "cannot be continued" in err and "--overwrite" in err and "without --resume" not in err
    # --overwrite replaces exactly the run's own files
    rc, err = _cli(capsys, "train", "--out", str(run), "--quiet", "--overwrite", *_sets())
    assert rc == 0, err
    assert json.loads((run / "summary.json").read_text())["rounds"] == 2


def test_overwrite_never_deletes_a_file_fedhetero_did_not_write(tmp_path, capsys):
    run = tmp_path / "r"
    Engine(_cfg(), run, progress=False).run()
    (run / "client_state").mkdir(exist_ok=True)
    (run / "client_state" / "notes.txt").write_text("keep")
    rc, err = _cli(capsys, "train", "--out", str(run), "--quiet", "--overwrite", *_sets())
    assert rc == 2 and "client_state/notes.txt" in err
    assert (run / "client_state" / "notes.txt").read_text() == "keep"
    assert (run / "summary.json").is_file()  # the finished run is untouched too


def test_inspect_dir_sorts_a_runs_files_from_others(tmp_path):
    run = tmp_path / "r"
    Engine(_cfg("algorithm.name=scaffold"), run, progress=False).run()
    state = inspect_dir(run)
    assert state.foreign == []
    assert {"config.yaml", "metrics.jsonl", "checkpoint.pt", "summary.json", "client_state", "run.json",
            "partition.npz", "final_model.pt", "model.json"} <= set(state.run_entries)
    (run / "client_state" / "client_000000" / "extra.bin").write_bytes(b"x")
    (run / "sub").mkdir()
    assert inspect_dir(run).foreign == ["client_state/client_000000/extra.bin", "sub/"]


# ---------------------------------------------------------------------------- compare


def _compare(capsys, out: Path, algorithms: str, *extra: str) -> tuple[int, str]:
    return _cli(capsys, "compare", "--algorithms", algorithms, "--out", str(out), "--quiet", "--no-plot",
                *_sets("train.rounds=1"), *extra)


def test_compare_never_replaces_an_earlier_comparison(tmp_path, capsys):
    out = tmp_path / "cmp"
    rc, err = _compare(capsys, out, "fedavg")
    assert rc == 0, err
    csv_before = (out / "comparison.csv").read_text()
    run_before = (out / "fedavg" / "seed0" / "summary.json").read_text()
    rc, err = _compare(capsys, out, "fedavg,fedprox")
    assert rc == 2 and "already holds a comparison" in err
    assert (out / "comparison.csv").read_text() == csv_before
    assert (out / "fedavg" / "seed0" / "summary.json").read_text() == run_before
    # --resume continues only a comparison of the same settings
    rc, err = _compare(capsys, out, "fedavg,fedprox", "--resume")
    assert rc == 2 and "other settings" in err and "algorithms" in err
    rc, err = _compare(capsys, out, "fedavg", "--resume")
    assert rc == 0, err
    assert (out / "fedavg" / "seed0" / "summary.json").read_text() == run_before  # reused, not re-run
    # --overwrite replaces it
    rc, err = _compare(capsys, out, "fedavg,fedprox", "--overwrite")
    assert rc == 0, err
    assert "fedprox" in (out / "comparison.csv").read_text()


def test_compare_refuses_foreign_files_and_a_locked_directory(tmp_path, capsys):
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "paper.pdf").write_bytes(b"%PDF")
    rc, err = _compare(capsys, out, "fedavg", "--overwrite")
    assert rc == 2 and "paper.pdf" in err
    (out / "paper.pdf").unlink()
    with RunLock(out):
        rc, err = _compare(capsys, out, "fedavg")
    assert rc == 2 and "in use" in err


def test_compare_default_directory_depends_on_the_settings(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for algos in ("fedavg", "fedprox"):
        rc, err = _cli(capsys, "compare", "--algorithms", algos, "--quiet", "--no-plot", *_sets("train.rounds=1"))
        assert rc == 0, err
    dirs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(dirs) == 2 and all(d.startswith("compare-synthetic-lenet5-") for d in dirs)


def test_a_directory_in_use_says_so_and_never_advises_resuming_it(tmp_path):
    """A directory whose run is still going (another process holds its lock) is refused as in use,
    naming that process, never with advice to continue it with --resume (which would then fail as
    in use); once the lock is free the same directory gets the advice again."""
    run = tmp_path / "r"
    Engine(_cfg("train.rounds=3"), run, progress=False, stop_after=1).run()  # an unfinished run
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from fedhetero.core.common.rundir import RunLock; "
         "lock = RunLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(60)", str(run)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError) as err:
            Engine(_cfg("train.rounds=3"), run, progress=False)
        assert f"in use by another fedhetero run (pid {holder.pid})" in str(err.value)
        assert "--resume" not in str(err.value)
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(RunDirError, match="already holds an unfinished run.*continue it with --resume"):
        Engine(_cfg("train.rounds=3"), run, progress=False)


def test_the_banner_comes_after_the_check(tmp_path, capsys):
    """A bad method name is one error line; nothing was said about a run that never starts."""
    code = main(["train", *_sets("algorithm.name=fedavgg"), "--out", str(tmp_path / "never")])
    out, err_text = capsys.readouterr()
    assert code == 2 and "fedhetero train:" not in out
    assert "algorithm.name: unknown algorithm 'fedavgg'" in err_text and not (tmp_path / "never").exists()


def test_a_clean_end_leaves_no_lock_file(tmp_path):
    """The lock file belongs to a run in progress: a finished run, or one stopped after some rounds,
    leaves none behind; the directory is not in use afterwards."""
    for name, extra in (("done", {}), ("stopped", {"stop_after": 1})):
        run = tmp_path / name
        Engine(_cfg("train.rounds=2"), run, progress=False, **extra).run()
        assert not (run / ".lock").exists() and RunLock.holder(run) is None
