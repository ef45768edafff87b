"""`fedhetero compare`: same clients/data/budgets/seeds for every method, N/A where it cannot adapt."""

import csv
import json

import yaml

from fedhetero.cli import main


def _write_cfg(path, scenario="static"):
    cfg = {
        "seed": 5,
        "data": {"dataset": "synthetic", "synthetic_size": 200, "num_clients": 6, "min_partition_size": 5},
        "model": {"name": "lenet5", "width": 0.5},
        "train": {"rounds": 2, "sample_rate": 0.5, "local_epochs": 1, "batch_size": 16, "target_accuracy": 0.05},
        "budget": {"scenario": scenario},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_compare_same_setup_and_outputs(tmp_path):
    cfg = _write_cfg(tmp_path / "c.yaml")
    out = tmp_path / "cmp"
    rc = main(["compare", "--config", str(cfg), "--algorithms", "fedavg,dynamicfl", "--seeds", "2", "--out", str(out), "--quiet", "--no-plot"])
    assert rc == 0
    rows = json.loads((out / "comparison.json").read_text())["rows"]
    assert [r["algorithm"] for r in rows] == ["fedavg", "dynamicfl"]
    for r in rows:
        assert r["status"] == "ok" and r["seeds"] == 2
        assert 0.0 <= r["final_accuracy_mean"] <= 1.0 and r["final_accuracy_std"] >= 0.0
        assert r["reached_target"] == 2  # 5 % accuracy is reached at once
    with (out / "comparison.csv").open() as fh:
        assert len(list(csv.DictReader(fh))) == 2
    # identical partitions, tiers and sampled clients for both methods, per seed
    for seed in (5, 6):
        a = json.loads((out / "fedavg" / f"seed{seed}" / "run.json").read_text())
        b = json.loads((out / "dynamicfl" / f"seed{seed}" / "run.json").read_text())
        assert a["client_samples"] == b["client_samples"] and a["tiers"] == b["tiers"]
        ma = [json.loads(l) for l in (out / "fedavg" / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()]
        mb = [json.loads(l) for l in (out / "dynamicfl" / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()]
        assert [[c["cid"] for c in r["clients"]] for r in ma] == [[c["cid"] for c in r["clients"]] for r in mb]
        assert [[c["budget_macs"] for c in r["clients"]] for r in ma] == [[c["budget_macs"] for c in r["clients"]] for r in mb]
    s5 = json.loads((out / "fedavg" / "seed5" / "run.json").read_text())
    s6 = json.loads((out / "fedavg" / "seed6" / "run.json").read_text())
    assert s5["tiers"] != s6["tiers"] or s5["client_samples"] != s6["client_samples"]


def test_compare_reports_na_for_methods_that_cannot_adapt(tmp_path):
    cfg = _write_cfg(tmp_path / "c.yaml", scenario="increasing")
    out = tmp_path / "cmp"
    assert main(["compare", "--config", str(cfg), "--algorithms", "fedavg,dynamicfl", "--out", str(out), "--quiet", "--no-plot"]) == 0
    rows = {r["algorithm"]: r for r in json.loads((out / "comparison.json").read_text())["rows"]}
    assert rows["fedavg"]["status"] == "N/A" and "final_accuracy_mean" not in rows["fedavg"]
    assert not (out / "fedavg").exists()  # never run, never a made-up number
    assert rows["dynamicfl"]["status"] == "ok"
    with (out / "comparison.csv").open() as fh:
        fed = [r for r in csv.DictReader(fh) if r["algorithm"] == "fedavg"][0]
    assert fed["final_accuracy_mean"] == "N/A"


def test_compare_unknown_algorithm_is_one_clear_error(tmp_path, capsys):
    cfg = _write_cfg(tmp_path / "c.yaml")
    assert main(["compare", "--config", str(cfg), "--algorithms", "fedavg,nope", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "algorithm.name" in err and "nope" in err


def test_compare_reports_kappa_for_dynacomm(tmp_path):
    cfg = _write_cfg(tmp_path / "c.yaml")
    out = tmp_path / "cmp"
    rc = main(["compare", "--config", str(cfg), "--algorithms", "fedavg,dynacomm", "--out", str(out), "--quiet", "--no-plot"])
    assert rc == 0
    rows = {r["algorithm"]: r for r in json.loads((out / "comparison.json").read_text())["rows"]}
    assert "kappa_code_mean" not in rows["fedavg"]
    summary = json.loads((out / "dynacomm" / "seed5" / "summary.json").read_text())
    assert rows["dynacomm"]["kappa_code_mean"] == summary["kappa_code"]
    assert 0 < rows["dynacomm"]["kappa_code_mean"] <= 1


def test_compare_goes_on_when_a_method_fails(tmp_path):
    cfg = _write_cfg(tmp_path / "c.yaml")
    out = tmp_path / "cmp"
    rc = main(["compare", "--config", str(cfg), "--algorithms", "fedavg,fedprox", "--out", str(out), "--quiet", "--no-plot",
               "--set", "train.lr=1e30"])
    assert rc == 0
    rows = {r["algorithm"]: r for r in json.loads((out / "comparison.json").read_text())["rows"]}
    for name in ("fedavg", "fedprox"):
        assert rows[name]["status"].startswith("failed") and "non-finite" in rows[name]["reason"]
