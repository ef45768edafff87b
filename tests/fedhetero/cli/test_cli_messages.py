"""A clean terminal and one line per bad input: run-stop messages without tracebacks, user strings
printed literally, a full disk named as such, the exact command that continues a run."""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import subprocess
import uuid

import pytest

from fedhetero.cli import main
from fedhetero.core.common.configfile import load_config
from fedhetero.core.run.engine import Engine
from fedhetero.core.common.rundir import DiskFullError, RunDirError, atomic_write_text, writing

SMALL = [
    "data.dataset=synthetic", "data.synthetic_size=120", "data.num_clients=4", "data.min_partition_size=5",
    "model.width=0.25", "train.rounds=2", "train.local_epochs=1", "algorithm.name=fedavg", "threads=1",
]


def _sets(*extra: str) -> list[str]:
    return [a for s in SMALL + list(extra) for a in ("--set", s)]


def _train(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["train", *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# ---------------------------------------------------------------------------- run-stop messages


@pytest.mark.parametrize("faults", [["engine.inject_faults.rate=1.0"],
                                    ["engine.inject_faults.rate=0.5", "engine.min_clients=1000"]])
def test_a_stopped_run_says_why_in_one_line_without_a_traceback(tmp_path, capsys, monkeypatch, faults):
    monkeypatch.delenv("FEDHETERO_DEBUG", raising=False)
    rc, _, err = _train(capsys, "--out", str(tmp_path / "r"), "--quiet", *_sets(*faults))
    assert rc == 1
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err and "fewer than engine.min_clients" in err
    assert "FEDHETERO_DEBUG=1" in err and "--resume" in err
    # with FEDHETERO_DEBUG the first failure's traceback follows
    monkeypatch.setenv("FEDHETERO_DEBUG", "1")
    rc, _, err = _train(capsys, "--out", str(tmp_path / "r2"), "--quiet", *_sets(*faults))
    assert rc == 1 and "Traceback" in err and "InjectedFault" in err


def test_the_stop_message_names_the_checkpoint_that_is_kept(tmp_path, capsys):
    run = tmp_path / "r"
    Engine(load_config(None, SMALL), run, progress=False, stop_after=1).run()
    rc, _, err = _train(capsys, "--out", str(run), "--resume", "--quiet", "--set", "engine.inject_faults.rate=1.0")
    assert rc == 1 and "its checkpoint of round 1 is kept" in err


def _interrupted_then_continued(capsys, monkeypatch, *argv: str) -> list[str]:
    """Run ``fedhetero train argv`` as interrupted (Ctrl-C) once round 1 is checkpointed, check the
    one line it prints, run the command that line gives and return that command."""
    checkpoint = Engine._checkpoint

    def interrupted(self, rnd):
        checkpoint(self, rnd)
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(Engine, "_checkpoint", interrupted)
        rc, _, err = _train(capsys, *argv)
    assert rc == 130
    prefix = "fedhetero: interrupted; continue with: "
    assert err.startswith(prefix) and len(err.strip().splitlines()) == 1, err
    command = shlex.split(err.strip()[len(prefix):])
    assert command[:2] == ["fedhetero", "train"]
    rc, _, err = _train(capsys, *command[2:], "--quiet")
    assert rc == 0, err
    return command


def test_interrupting_prints_the_exact_command_that_continues(tmp_path, capsys, monkeypatch):
    out = tmp_path / "my runs" / "r"
    command = _interrupted_then_continued(capsys, monkeypatch, "--out", str(out), "--quiet", *_sets())
    assert shlex.join(command) == f"fedhetero train --out '{out}' --resume"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_round"] == 1 and summary["rounds"] == 2
    # a resumed run interrupted again: its --set (fields that may change on resume) are given again
    (out / "summary.json").unlink()
    (out / "checkpoint.pt").unlink()
    command = _interrupted_then_continued(capsys, monkeypatch, "--out", str(out), "--resume", "--quiet",
                                          "--set", "engine.min_clients=2")
    assert shlex.join(command) == f"fedhetero train --out '{out}' --resume --set engine.min_clients=2"


def test_interrupting_a_method_of_your_own_names_it_again(tmp_path, capsys, monkeypatch):
    algo = tmp_path / "my_algo.py"
    algo.write_text("from fedhetero.algorithms.classic.fedavg import FedAvg\n\nclass Mine(FedAvg):\n    pass\n")
    out = tmp_path / "r"
    command = _interrupted_then_continued(capsys, monkeypatch, "--out", str(out), "--quiet",
                                          *_sets(f"algorithm.name={algo}:Mine"))
    assert command[2:] == ["--out", str(out), "--resume", "--set", f"algorithm.name={algo}:Mine"]


def test_interrupting_before_the_run_is_on_disk_gives_the_command_again(tmp_path, capsys, monkeypatch):
    """Interrupted during the set-up (say, while the data loads), a run has written nothing that
    --resume could continue: the command that continues it is the one given, with its --out."""
    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr("fedhetero.core.run.engine.build_data", interrupted)
    out = tmp_path / "my runs" / "r"
    rc, _, err = _train(capsys, "--quiet", *_sets(), "--out", str(out))
    assert rc == 130 and not out.exists()
    sets = " ".join(f"--set {shlex.quote(s)}" for s in SMALL)
    assert err.strip() == f"fedhetero: interrupted; continue with: fedhetero train {sets} --out '{out}'"
    monkeypatch.undo()
    rc, _, err = _train(capsys, *shlex.split(err.strip().split(": ", 2)[2])[2:], "--quiet")
    assert rc == 0, err
    assert json.loads((out / "summary.json").read_text())["rounds"] == 2


# ---------------------------------------------------------------------------- user strings, literally


@pytest.mark.parametrize("tier", ["a[/]", "[small]", "[bold]x"])
def test_tier_names_are_printed_literally(tmp_path, capsys, monkeypatch, tier):
    monkeypatch.setenv("COLUMNS", "250")  # a table wide enough to hold every cell whole
    rc, out, err = _train(capsys, "--out", str(tmp_path / "r"), *_sets(f"budget.tiers=[{{name: '{tier}', ratio: 1, share: 1}}]"))
    assert rc == 0, err
    assert tier in out
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["tiers"][tier]["client_rounds"] > 0


def test_an_out_directory_with_brackets_starts_and_is_named_literally(tmp_path, capsys):
    out = tmp_path / "x[/]y"
    rc, stdout, err = _train(capsys, "--out", str(out), *_sets())
    assert rc == 0, err
    assert str(out) in stdout.replace("\n", "")
    assert (out / "summary.json").is_file()


def test_compare_prints_method_and_tier_names_literally(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    # HeteroFL deploys a model per tier, so its table has the per-tier accuracy column too
    rc = main(["compare", "--algorithms", "heterofl", "--out", str(tmp_path / "c"), "--quiet", "--no-plot",
               *_sets("train.rounds=1", "budget.tiers=[{name: '[small]', ratio: 0.5, share: 0.5}, {name: big, ratio: 1, share: 0.5}]")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "[small] acc %" in out and "[small] MMACs" in out


# ---------------------------------------------------------------------------- the disk


def test_a_failed_write_on_a_full_disk_says_so(tmp_path, monkeypatch):
    target = tmp_path / "metrics.jsonl"
    with pytest.raises(DiskFullError, match="the disk is full.*--resume"):
        with writing(target, tmp_path / ".x.tmp1"):
            raise OSError(errno.ENOSPC, "No space left on device")
    # torch.save reports a short write as a RuntimeError; the free space decides
    usage = type(shutil.disk_usage("/"))  # (total, used, free)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9, 0))
    with pytest.raises(DiskFullError):
        with writing(target):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
    # another write error names the file, not a full disk
    monkeypatch.undo()
    with pytest.raises(RunDirError, match="could not be written") as info:
        with writing(target):
            raise OSError(errno.EACCES, "Permission denied")
    assert not isinstance(info.value, DiskFullError)
    # the temporary file of an atomic write is removed
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(DiskFullError):
        atomic_write_text(target, "x")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (needs root, as CI and this project's machines run; skipped elsewhere)."""
    mnt = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                                            capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_run_on_a_full_disk_stops_with_one_line_and_resumes_when_space_is_freed(small_disk, tmp_path, capsys):
    run = small_disk / "r"
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (1536 * 1024))  # leave about half a MiB: set-up fits, a checkpoint does not
    rc, _, err = _train(capsys, "--out", str(run), "--quiet", *_sets("model.width=1", "train.rounds=3"))
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1
    assert "the disk is full" in err and "--resume" in err and "enforce fail" not in err
    assert not [p for p in run.iterdir() if ".tmp" in p.name]  # no half-written file left
    filler.unlink()
    rc, _, err = _train(capsys, "--out", str(run), "--resume", "--quiet")
    assert rc == 0, err
    assert json.loads((run / "summary.json").read_text())["rounds"] == 3


def test_a_directory_as_out_that_is_a_file_is_one_line(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    rc, _, err = _train(capsys, "--out", str(f), "--quiet", *_sets())
    assert rc == 2 and len(err.strip().splitlines()) == 1 and str(f) in err



def test_a_learning_rate_the_dtype_cannot_hold_is_a_config_error(tmp_path, capsys):
    rc, _, err = _train(capsys, "--out", str(tmp_path / "r"), "--quiet", *_sets("train.lr=1e308"))
    assert rc == 2 and err.startswith("fedhetero: config error: train.lr:") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_compare_refuses_a_budget_one_method_cannot_meet_before_any_method_runs(tmp_path, capsys):
    rc = main(["compare", "--algorithms", "fedavg,heterofl", "--out", str(tmp_path / "c"), "--quiet", "--no-plot",
               *_sets("train.rounds=1", "budget.tiers=[{name: a, ratio: 0.001, share: 1}]")])
    err = capsys.readouterr().err
    assert rc == 2 and "budget.tiers[0].ratio: heterofl cannot train within" in err
    assert not (tmp_path / "c").exists()  # fedavg did not run first


def test_a_bad_option_value_names_the_option(tmp_path, capsys):
    rc = main(["compare", "--algorithms", "fedprox", "--out", str(tmp_path / "c"), "--quiet", "--no-plot",
               "--option", "fedprox.mu=[1", *_sets("train.rounds=1")])
    err = capsys.readouterr().err
    assert rc == 2 and "--option 'fedprox.mu=[1'" in err and len(err.strip().splitlines()) == 1
