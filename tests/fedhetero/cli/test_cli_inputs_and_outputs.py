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
from fedhetero.core.common.configfile import load_config
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
    rc = main(["train", *_sets("train.lr=0.02"), "--out", str(out), "--quiet"])  # another run
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


def _seed_run(root, name, algo, alpha, seed, final, val, options=None):
    """A finished (or, with `final` None, unfinished) run directory as seed_table.py reads it."""
    import json

    import yaml

    d = root / name
    d.mkdir()
    cfg = {"seed": seed, "data": {"alpha": alpha, "data_dir": f"/x/{name}"}, "algorithm": {"name": algo}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    if options is not None:
        (d / "run.json").write_text(json.dumps({"algorithm_options": options}))
    if final is not None:
        (d / "summary.json").write_text(json.dumps({
            "final_accuracy": final, "mean_last5_accuracy": final - 0.01, "best_accuracy": final + 0.01,
            "final_val_accuracy": val}))
    return d


def test_seed_table_gives_mean_and_std_over_seeds_per_config(tmp_path):
    """Runs equal but for the seed form one row (mean ± sample std); a row is named by what
    differs between rows; an unfinished run is listed, not averaged."""
    def run(name, algo, alpha, seed, final, val, options=None):
        return _seed_run(tmp_path, name, algo, alpha, seed, final, val, options)

    dirs = [run("a0", "fedavg", 0.5, 0, 0.80, 0.81), run("a1", "fedavg", 0.5, 1, 0.84, 0.85),
            run("b0", "fedavg", 0.1, 0, 0.70, None), run("d0", "dynamicfl", 0.5, 0, 0.90, 0.9, {"step": "mean"}),
            run("d1", "dynamicfl", 0.5, 0, 0.60, 0.6, {"step": "sum"}), run("u", "fedavg", 0.5, 2, None, None)]
    script = ROOT / "examples" / "seed_table.py"
    r = subprocess.run([sys.executable, str(script), *map(str, dirs)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = {line.split(" | ")[0].lstrip("| "): line for line in r.stdout.splitlines() if line.startswith("| ")}
    two = rows["algorithm.name=fedavg, data.alpha=0.5"]
    # mean 82.00, sample std of (80, 84) = 2.83; last 5: 81.00; best 83.00; val 83.00 ± 2.83
    assert "| 0, 1 | 82.00 ± 2.83 | 81.00 ± 2.83 | 83.00 ± 2.83 | 83.00 ± 2.83 | 80.00 / 81.00, 84.00 / 85.00 |" in two
    assert "| 0 | 70.00 | 69.00 | 71.00 | – | 70.00 / – |" in rows["algorithm.name=fedavg, data.alpha=0.1"]
    assert "90.00" in rows["algorithm.name=dynamicfl, data.alpha=0.5, algorithm.options.step=mean"]
    assert "60.00" in rows["algorithm.name=dynamicfl, data.alpha=0.5, algorithm.options.step=sum"]
    assert f"not finished (no summary.json): {dirs[-1]}" in r.stdout
    bad = subprocess.run([sys.executable, str(script), str(tmp_path / "missing")], capture_output=True, text=True)
    assert bad.returncode == 2 and "config.yaml" in bad.stderr and "Traceback" not in bad.stderr


def test_seed_table_pairs_a_reference_with_each_other_row_seed_by_seed(tmp_path):
    """`--against` subtracts each other row from the reference row of the same β, over the seeds
    both ran (paired), and names a reference no run matches."""
    def run(name, algo, alpha, seed, final, val, options=None):
        return _seed_run(tmp_path, name, algo, alpha, seed, final, val, options)

    dirs = [run("d0", "dynamicfl", 0.5, 0, 0.80, 0.81), run("d1", "dynamicfl", 0.5, 1, 0.86, 0.85),
            # a method without options records {}: the same setting as a run that records none
            run("f0", "fedavg", 0.5, 0, 0.79, 0.80), run("f1", "fedavg", 0.5, 1, 0.83, 0.85, options={}),
            run("f2", "fedavg", 0.5, 2, 0.99, 0.99),  # no DynamicFL seed 2: left out of the pairs
            run("h1", "heterofl", 0.5, 1, 0.87, None),
            run("g0", "fedavg", 0.1, 0, 0.50, 0.50)]  # no DynamicFL at β 0.1: no row
    script = ROOT / "examples" / "seed_table.py"
    r = subprocess.run([sys.executable, str(script), *map(str, dirs), "--against", "algorithm.name=dynamicfl"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    second = r.stdout.split("| reference |")[1]
    pairs = [line for line in second.splitlines() if line.startswith("| algorithm.name=dynamicfl, data.alpha=0.5 | ")]
    assert len(pairs) == 2, r.stdout
    # test: 80 - 79 = +1, 86 - 83 = +3 -> +2.00 ± 1.41; val: +1, 0 -> +0.50 ± 0.71
    assert "| algorithm.name=fedavg, data.alpha=0.5 | 0, 1 | +2.00 ± 1.41 | +2.00 ± 1.41 | +2.00 ± 1.41 | +0.50 ± 0.71 |" in pairs[0]
    # HeteroFL has one common seed and no validation figure
    assert "| algorithm.name=heterofl, data.alpha=0.5 | 1 | -1.00 | -1.00 | -1.00 | – |" in pairs[1]
    assert "data.alpha=0.1" not in second
    none = subprocess.run([sys.executable, str(script), *map(str, dirs), "--against", "algorithm.name=moon"],
                          capture_output=True, text=True)
    assert none.returncode == 2 and "algorithm.name=moon" in none.stderr and "Traceback" not in none.stderr
    bad = subprocess.run([sys.executable, str(script), *map(str, dirs), "--against", "dynamicfl"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr


def test_seed_table_names_a_tier_list_by_names_ratios_and_shares():
    import importlib.util

    spec = importlib.util.spec_from_file_location("seed_table", ROOT / "examples" / "seed_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tiers = '[{"name": "small", "ratio": 1.0, "share": 0.3333333333333333}, {"name": "large", "ratio": 3.0, "share": 0.6666666666666667}]'
    assert module._shown(tiers) == "[small 1.0× (0.33), large 3.0× (0.67)]"
    assert module._shown('[{"a": 1}]') == '[{"a": 1}]' and module._shown(0.5) == 0.5
