"""The command line: help texts, one-line errors, train + resume through the CLI."""

import json

import pytest

from fedhetero.cli import build_parser, main


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("train", "compare", "bench", "info"):
        assert cmd in out
    for cmd in ("train", "compare"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        assert "--set" in capsys.readouterr().out


def test_bad_set_is_one_clear_error(tmp_path, capsys):
    rc = main(["train", "--set", "train.sample_rate=0", "--out", str(tmp_path), "--quiet"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedhetero: config error:") and "train.sample_rate" in err
    assert len(err.splitlines()) == 1


def test_missing_dataset_message(tmp_path, capsys):
    rc = main(["train", "--set", "data.dataset=dermamnist", "--set", f"data.data_dir={tmp_path}", "--out", str(tmp_path / "r"), "--quiet"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "dermamnist.npz" in err and str(tmp_path) in err


def test_train_then_resume_through_cli(tmp_path):
    sets = [
        "--set", "data.dataset=synthetic", "--set", "data.synthetic_size=120", "--set", "data.num_clients=4",
        "--set", "data.min_partition_size=5", "--set", "model.width=0.25", "--set", "train.rounds=2",
        "--set", "train.local_epochs=1", "--set", "algorithm.name=fedavg",
    ]
    out = tmp_path / "run"
    assert main(["train", *sets, "--out", str(out), "--quiet"]) == 0
    first = json.loads((out / "summary.json").read_text())
    assert first["rounds"] == 2
    # resuming a finished run is a no-op that reproduces the summary
    assert main(["train", "--out", str(out), "--resume", "--quiet"]) == 0
    assert json.loads((out / "summary.json").read_text())["final_accuracy"] == first["final_accuracy"]


def test_info_lists_algorithms(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("dynamicfl", "fedavg", "heterofl", "fedrolex", "feddumap"):
        assert name in out
    assert build_parser().prog == "fedhetero"
