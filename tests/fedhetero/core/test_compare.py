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


def test_per_tier_accuracy_follows_one_rule_for_every_method(tmp_path, capsys, monkeypatch):
    """A method whose tiers all deploy its one global model (FedAvg, DynamicFL) shows no per-tier
    accuracy, whatever its tiers trained; a method with a model per tier (HeteroFL) does. Without
    such a method, the table has no per-tier accuracy column at all."""
    monkeypatch.setenv("COLUMNS", "400")
    cfg = _write_cfg(tmp_path / "c.yaml")
    out = tmp_path / "cmp"
    assert main(["compare", "--config", str(cfg), "--algorithms", "fedavg,dynamicfl,heterofl", "--out", str(out),
                 "--no-plot"]) == 0
    rows = {r["algorithm"]: r for r in json.loads((out / "comparison.json").read_text())["rows"]}
    assert (rows["fedavg"]["one_model"], rows["dynamicfl"]["one_model"], rows["heterofl"]["one_model"]) == (
        True, True, False)
    for name in rows:
        summary = json.loads((out / name / "seed5" / "summary.json").read_text())
        assert summary["one_model"] is rows[name]["one_model"]
    # DynamicFL's tiers trained different MACs, yet deploy one model
    dyn = json.loads((out / "dynamicfl" / "seed5" / "summary.json").read_text())["tiers"]
    assert len({t["macs"] for t in dyn.values()}) > 1
    text = capsys.readouterr().out
    table = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
             for line in text.splitlines() if line.startswith("│") and line.split("│")[1].strip() in rows}
    header = next(line for line in text.splitlines() if line.startswith("┃") and "final acc" in line)
    tiers = [c.strip()[: -len(" acc %")] for c in header.split("┃")[1:-1] if c.strip().endswith(" acc %")]
    assert tiers == ["final", "small", "medium", "large"]
    for name in ("fedavg", "dynamicfl"):
        assert table[name][1:4] == ["—"] * 3  # no per-tier accuracy
    assert all(c != "—" for c in table["heterofl"][1:4])
    assert "every tier deploys the method's one model" in text
    # only one-model methods: no per-tier accuracy column
    assert main(["compare", "--config", str(cfg), "--algorithms", "fedavg,dynamicfl", "--out", str(tmp_path / "two"),
                 "--no-plot"]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("┃") and "final acc" in line)
    assert "small acc" not in header and "small MMACs" in header
