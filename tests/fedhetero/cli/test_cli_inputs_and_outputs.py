"""The command line's inputs and outputs: an existing run is not overwritten without asking, the default
run directory follows the overrides, the final table, a bad value or an unreadable config is one
line with exit code 2 and leaves nothing, ``--version``, a bad compare option fails before any run,
the bench help, and the results-table script's usage message."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import fedhetero
from fedhetero.cli import default_out_dir, main
from fedhetero.core.config import load_config
from _util import ROOT


SMALL = [
    "data.dataset=synthetic", "data.synthetic_size=120", "data.num_clients=4", "data.min_partition_size=5",
    "model.width=0.25", "train.rounds=3", "train.local_epochs=1", "algorithm.name=fedavg",
]


def _cfg(*extra: str):
    return load_config(None, SMALL + list(extra))


def _sets(*extra: str) -> list[str]:
    out = []
    for s in SMALL + list(extra):
        out += ["--set", s]
    return out


def test_existing_run_is_not_overwritten_without_asking(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["train", *_sets(), "--out", str(out), "--quiet"]) == 0
    before = (out / "summary.json").read_text()
    rc = main(["train", *_sets(), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--resume" in err and "--overwrite" in err and len(err.splitlines()) == 1
    assert (out / "summary.json").read_text() == before
    assert main(["train", *_sets(), "--out", str(out), "--quiet", "--overwrite"]) == 0


def test_default_dir_depends_on_overrides():
    assert default_out_dir(_cfg()) != default_out_dir(_cfg("train.lr=0.01"))
    assert default_out_dir(_cfg()) == default_out_dir(_cfg())


def test_final_table_names_macs_and_bytes_per_tier(tmp_path, capsys):
    assert main(["train", *_sets(), "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "MMACs" in out and "MFLOPs" not in out and "sent up" in out and "MiB" in out or "KiB" in out
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    for t in summary["tiers"].values():
        assert t["bytes_up"] > 0 and t["bytes_down"] > 0
    assert summary["bytes_up"] + summary["bytes_down"] == summary["bytes_total"]


# ---------------------------------------------------------------------------- bad inputs
BAD = [
    "train.lr=.inf", "train.lr=1e400", "model.width=1e-9", "seed=-1", "device=cudafoo", "threads=100000",
    "train.rounds=100000000000000000000", "train.local_epochs=100000000", "budget.tiers=[{name: '', ratio: 1, share: 1}]",
    "budget.tiers=[{name: a, ratio: .inf, share: 1}]", "algorithm.options.small_q=5", "algorithm.options.large_q=.nan",
    "algorithm.options.calibration_batches=0", "algorithm.options.max_new_per_round=-1", "model.name=resnet50",
    "data.num_clients=5000", "algorithm.name=nosuch", "budget.scenario=random\n",
]


@pytest.mark.parametrize("bad", BAD)
def test_bad_value_is_one_line_exit_2_and_leaves_nothing(tmp_path, capsys, bad):
    out = tmp_path / "never"
    sets = ["--set", "train.rounds=1", "--set", bad] if "rounds" not in bad else ["--set", bad]
    if bad.startswith("budget.scenario"):
        sets = ["--set", "algorithm.name=fedavg", "--set", "budget.scenario=random"]
    rc = main(["train", *sets, "--out", str(out), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


def test_unreadable_config_is_one_line(tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root reads every file; permission errors cannot be produced")
    p = tmp_path / "c.yaml"
    p.write_text("seed: 1\n")
    p.chmod(0)
    assert main(["train", "--config", str(p), "--quiet"]) == 2


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and fedhetero.__version__ in capsys.readouterr().out


def test_bad_compare_option_fails_before_any_run(tmp_path, capsys):
    rc = main(["compare", "--algorithms", "fedavg,dynamicfl", "--option", "dynamicfl.anchr_norm=x",
               "--out", str(tmp_path / "c"), "--quiet", *_sets()])
    assert rc == 2 and "anchr_norm" in capsys.readouterr().err
    assert not (tmp_path / "c" / "fedavg").exists()


def test_bench_help_names_the_command():
    for what in ("round", "engines", "reparam"):
        r = subprocess.run([sys.executable, "-m", "fedhetero.cli", "bench", what, "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and f"fedhetero bench {what}" in r.stdout and "python -m" not in r.stdout
        assert len(r.stdout.strip().splitlines()) > 3


def test_results_table_without_arguments_is_a_usage_message():
    script = ROOT / "examples" / "results_table.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert r.returncode == 2 and "usage:" in r.stderr and "Traceback" not in r.stderr
