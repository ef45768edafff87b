"""The command line: help texts, one-line errors, train + resume through the CLI."""

import json
import subprocess
import sys

import pytest

from fedhetero.cli import bench, build_parser, main
from fedhetero.lab import ablation, dyninit_table


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


def test_no_command_prints_the_overview(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fedhetero") and "dynamicfl-ablation" in out


BENCH_OPTIONS = {
    "reparam": ["--merge-repeats", "--no-tune-malloc", "tv-resnet18"],
    "reparam-gain": ["--widths", "--inits", "--no-kinds", "--train-samples"],
    "round": ["--per-round", "--dynamicfl-rounds"],
    "memory": ["--rounds", "--algorithm"],
    "engines": ["--workers", "--no-flower", "--heavy-epochs"],
    "selector": ["--exhaustive-max", "--ga-mutation", "genetic"],
    "vectorize": ["--clients", "--samples", "--no-flower"],
}


@pytest.mark.parametrize("what", sorted(BENCH_OPTIONS))
def test_bench_help_shows_the_options(what, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", what, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: fedhetero bench {what} ")
    for option in BENCH_OPTIONS[what] + ["--json"]:
        assert option in out


def test_bench_lists_its_benchmarks(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for what in BENCH_OPTIONS:
        assert f"    {what} " in out
    with pytest.raises(SystemExit) as exc:
        main(["bench"])  # a benchmark must be named
    assert exc.value.code == 2


def test_the_choices_are_the_labs():
    """The parser names the lab's choices without importing the lab (torch, reparam, numpy)."""
    assert bench.SELECTORS == pytest.importorskip("fedhetero.lab.bench_selector").SELECTORS
    assert bench.REPARAM_MODELS == pytest.importorskip("fedhetero.lab.bench_reparam").MODELS


@pytest.mark.parametrize("command, names", [("dyninit-table", dyninit_table.METHODS), ("dynamicfl-ablation", ablation.CHOICES)])
def test_table_commands_parse_in_the_tree(command, names, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: fedhetero {command} ") and "--no-run" in out and "--jobs" in out
    args = build_parser().parse_args([command, "--set", "train.rounds=1", "--no-run"])
    assert args.set == ["train.rounds=1"] and args.no_run
    assert (args.methods if command == "dyninit-table" else args.choices) == ",".join(names)


def test_an_unknown_option_is_reported_by_its_command(capsys):
    for argv in (["bench", "round", "--bogus"], ["dyninit-table", "--bogus"], ["train", "--bogus"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"fedhetero {' '.join(argv[:-1])}: error: unrecognized arguments: --bogus" in err


def test_the_parser_leaves_the_heavy_modules_alone():
    """``fedhetero --help`` builds the whole tree without the lab, the engine or Flower."""
    heavy = ["flwr", "fedhetero.core.run.engine", "fedhetero.core.run.compare", "fedhetero.lab.ablation",
             "fedhetero.lab.bench", "fedhetero.lab.bench_reparam", "fedhetero.lab.bench_gain", "fedhetero.lab.bench_selector",
             "fedhetero.lab.dyninit_table"]
    code = f"import sys; from fedhetero.cli import build_parser; build_parser(); print([m for m in {heavy} if m in sys.modules])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


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


def test_the_same_command_twice_prints_the_finished_run_and_exits_0(tmp_path, capsys):
    """A run directory holding this very run, finished (the same config hash): its table from
    summary.json, one line on how to run it again, exit 0, no file touched. Another config, or an
    unfinished run, is refused as before."""
    sets = [
        "--set", "data.dataset=synthetic", "--set", "data.synthetic_size=120", "--set", "data.num_clients=4",
        "--set", "data.min_partition_size=5", "--set", "model.width=0.25", "--set", "train.rounds=2",
        "--set", "train.local_epochs=1",
    ]
    out = tmp_path / "run"
    assert main(["train", *sets, "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    files = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir() if p.is_file()}
    assert main(["train", *sets, "--out", str(out), "--quiet"]) == 0
    said = capsys.readouterr()
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir() if p.is_file()} == files
    summary = json.loads((out / "summary.json").read_text())
    assert f"final accuracy {100 * summary['final_accuracy']:.2f} %" in said.out
    assert "already held this run, finished" in said.out and "--overwrite" in said.out and "--out" in said.out
    assert "seed" in said.out and said.err == ""
    # another config in the same directory: refused, exit 2
    assert main(["train", *sets, "--set", "train.lr=0.02", "--out", str(out), "--quiet"]) == 2
    assert "already holds a finished run" in capsys.readouterr().err
    # the same config, unfinished (summary.json gone): refused with the advice to resume
    (out / "summary.json").unlink()
    assert main(["train", *sets, "--out", str(out), "--quiet"]) == 2
    assert "continue it with --resume" in capsys.readouterr().err


def test_info_lists_algorithms(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("dynamicfl", "fedavg", "heterofl", "fedrolex", "feddumap"):
        assert name in out
    assert build_parser().prog == "fedhetero"
