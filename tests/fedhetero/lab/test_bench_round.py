"""``fedhetero bench round``'s paper-protocol part (fedhetero.lab.bench.paper_rounds): FedAvg and
DynamicFL at the DynamicFL paper's protocol side by side, with the ratio of their clients' MACs."""

from __future__ import annotations

import pytest

from fedhetero.cli import main
from fedhetero.lab.bench import paper_config, paper_rounds, paper_table


def test_the_paper_config_is_the_shipped_one(tmp_path):
    from pathlib import Path

    from fedhetero.core.common.config import to_dict
    from fedhetero.core.common.configfile import load_config

    root = Path(__file__).resolve().parents[3]
    shipped = to_dict(load_config(root / "examples/configs/fmnist_dynamicfl_paper.yaml",
                                  ["data.data_dir=D", "train.rounds=4", "train.eval_every=4", "train.checkpoint_every=4"]))
    assert to_dict(paper_config("dynamicfl", 4, "D")) == shipped
    # FedAvg without batched cohorts: the same protocol, FedAvg, engine.vectorize off
    one = to_dict(paper_config("fedavg-one-by-one", 4, "D"))
    assert one["algorithm"]["name"] == "fedavg" and one["engine"]["vectorize"] is False
    assert to_dict(paper_config("fedavg", 4, "D"))["engine"]["vectorize"] is None
    batched = to_dict(paper_config("dynamicfl-batched", 4, "D"))  # DynamicFL's cohorts on a CPU too
    assert batched == {**shipped, "engine": {**shipped["engine"], "vectorize": True}}
    # the device the rounds train on: the CPU unless a GPU's rows are asked for
    assert shipped["device"] == "cpu"
    assert to_dict(paper_config("dynamicfl", 4, "D", device="cuda")) == {**shipped, "device": "cuda"}


def test_paper_rounds_report_time_and_macs_of_both_methods(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDHETERO_DATA_DIR", str(tmp_path / "none"))  # no Fashion-MNIST: synthetic images
    out = paper_rounds(rounds=2, warmup=2, data_root=None, images=1800)
    assert not out["fashion_mnist"] and "synthetic" in out["data"]
    fedavg, dyn = out["algorithms"]["fedavg"], out["algorithms"]["dynamicfl"]
    for r in (fedavg, dyn):  # only the two rounds after the warm-up are timed
        assert len(r["rounds_s"]) == 2 and r["round_s"] == pytest.approx(sum(r["rounds_s"]) / 2) and r["clients"] == 18
    # after two rounds of 9 of 90 clients, most of rounds 3 and 4's clients are first-timers
    assert 0.5 < out["first_time_share"] <= 1.0
    # FedAvg trains the plain model; DynamicFL's tiers 1 : 2 : 3 train about twice its MACs on average
    assert out["mac_ratio"] == pytest.approx(dyn["client_macs"] / fedavg["client_macs"])
    assert 1.5 < out["mac_ratio"] < 3.0
    assert out["dynamicfl_over_fedavg"] == pytest.approx(dyn["round_s"] / fedavg["round_s"])
    assert "rep" in dyn["timers_s"] and "merge" in dyn["timers_s"]
    from rich.console import Console
    import io

    buf = io.StringIO()
    Console(file=buf, width=200).print(paper_table(out))
    assert "DynamicFL / FedAvg" in buf.getvalue() and "target ≤ 1.3" in buf.getvalue()


def test_bench_round_offers_the_paper_rounds(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "round", "--help"])
    text = capsys.readouterr().out
    assert "--paper-rounds" in text and "--paper-warmup" in text and "--data-root" in text
    assert "dynamicfl_over_fedavg" in text


def test_bench_round_writes_the_ratios_at_the_top_of_its_json(tmp_path, monkeypatch, capsys):
    import functools
    import json

    import fedhetero.lab.bench as bench

    monkeypatch.setenv("FEDHETERO_DATA_DIR", str(tmp_path / "none"))
    monkeypatch.setattr(bench, "paper_rounds", functools.partial(bench.paper_rounds, images=1800))
    out = tmp_path / "r.json"
    assert main(["bench", "round", "--clients", "4", "--per-round", "2", "--rounds", "1", "--repeats", "1",
                 "--dynamicfl-rounds", "1", "--paper-rounds", "2", "--paper-warmup", "1", "--threads", "1",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    p = data["paper_protocol"]
    assert data["dynamicfl_over_fedavg"] == p["dynamicfl_over_fedavg"] > 0
    assert data["mac_ratio"] == p["mac_ratio"] > 1
    printed = capsys.readouterr().out
    assert "DynamicFL / FedAvg" in printed
    # where the time goes, tier by tier: each tier's time per training sample and MACs over FedAvg's
    assert set(p["tiers"]) <= {"small", "medium", "large"} and p["tiers"]
    for t in p["tiers"].values():
        assert t["time_ratio"] > 0 and t["mac_ratio"] >= 1 - 1e-9
        assert t["time_per_mac"] == pytest.approx(t["time_ratio"] / t["mac_ratio"])
    assert "tier / FedAvg, per training sample" in printed
    # FedAvg without its batched cohorts, for the ratio DynamicFL's one-by-one clients meet
    assert p["dynamicfl_over_fedavg_one_by_one"] == pytest.approx(
        p["algorithms"]["dynamicfl"]["round_s"] / p["algorithms"]["fedavg-one-by-one"]["round_s"])
    assert "FedAvg one by one" in printed


def test_the_paper_table_shows_the_timers_per_round():
    """``timers_s`` holds sums over the timed rounds; the table divides them by the rounds, so that
    they read beside the per-round seconds (a 4-round sum of 0.34 s of REP is 0.085 s a round)."""
    import io

    from rich.console import Console

    out = {
        "rounds": 4, "warmup": 30, "threads": 1, "data": "Fashion-MNIST", "first_time_share": 0.06,
        "algorithms": {
            "fedavg": {"round_s": 0.84, "timers_s": {"client_phase": 3.39}, "client_macs": 281640.0},
            "dynamicfl": {"round_s": 3.17, "timers_s": {"rep": 0.34, "dymm": 0.12, "merge": 0.04}, "client_macs": 601280.0},
        },
        "dynamicfl_over_fedavg": 3.17 / 0.84, "mac_ratio": 601280.0 / 281640.0,
    }
    buf = io.StringIO()
    Console(file=buf, width=250).print(paper_table(out))
    text = buf.getvalue()
    assert "s per round" in text
    assert "0.085 / 0.030 / 0.010" in text and "0.000 / 0.000 / 0.000" in text
    assert "0.34 / 0.12" not in text


def test_tier_costs_and_ratios_from_client_entries():
    """Per tier: wall seconds over the training samples pushed through the model (samples × epochs)
    and the mean MACs, each over the baseline's pooled over its tiers (one model for all)."""
    from fedhetero.core.common.config import TrainConfig
    from fedhetero.lab.bench import tier_costs, tier_ratios

    train = TrainConfig(local_epochs=3)

    base = tier_costs([
        {"tier": "small", "wall_s": 0.3, "num_samples": 100, "macs": 1000},
        {"tier": "large", "wall_s": 0.9, "num_samples": 300, "macs": 1000},
    ], train)
    assert base["small"]["us_per_sample"] == pytest.approx(1e6 * 0.3 / 300)
    assert base["large"]["samples"] == 900 and base["large"]["macs"] == 1000
    method = tier_costs([
        {"tier": "small", "wall_s": 0.36, "num_samples": 100, "macs": 1000},
        {"tier": "large", "wall_s": 1.0, "num_samples": 100, "macs": 3000},
        {"tier": "large", "wall_s": 2.0, "num_samples": 100, "macs": 3000},
    ], train)
    r = tier_ratios(method, base)
    # the baseline: 1.2 s over 1,200 samples, 1,000 µs a sample, 1,000 MACs
    assert r["small"] == pytest.approx({"time_ratio": 1.2, "mac_ratio": 1.0, "time_per_mac": 1.2})
    assert r["large"] == pytest.approx({"time_ratio": 5.0, "mac_ratio": 3.0, "time_per_mac": 5.0 / 3.0})


def test_bench_round_paper_only_times_the_paper_rounds_alone(tmp_path, monkeypatch, capsys):
    import functools
    import json

    import fedhetero.lab.bench as bench

    def no_engine_rows(*a, **k):
        raise AssertionError("--paper-only ran the engine-vs-bare rows")

    monkeypatch.setenv("FEDHETERO_DATA_DIR", str(tmp_path / "none"))
    monkeypatch.setattr(bench, "paper_rounds", functools.partial(bench.paper_rounds, images=1800))
    monkeypatch.setattr(bench, "_engine_rows", no_engine_rows)
    out = tmp_path / "r.json"
    assert main(["bench", "round", "--paper-only", "--paper-rounds", "1", "--paper-warmup", "1",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert "engine_s" not in data and "dynamicfl_shares" not in data
    assert data["paper_protocol"]["device"] == "cpu" and data["dynamicfl_over_fedavg"] > 0
    assert "DynamicFL / FedAvg" in capsys.readouterr().out


def test_bench_round_refuses_what_it_cannot_run_with_one_line(capsys):
    import torch

    # --paper-only without paper rounds would time nothing
    assert main(["bench", "round", "--paper-only", "--paper-rounds", "0"]) == 2  # a config error
    assert "--paper-only needs paper-protocol rounds" in capsys.readouterr().err
    if not torch.cuda.is_available():  # told before the CPU rows run, not minutes later
        assert main(["bench", "round", "--device", "cuda"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs a CUDA device")
def test_paper_rounds_run_on_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDHETERO_DATA_DIR", str(tmp_path / "none"))
    out = paper_rounds(rounds=1, warmup=1, data_root=None, images=1800, device="cuda")
    assert out["device"] == "cuda" and out["mac_ratio"] > 1 and out["dynamicfl_over_fedavg"] > 0


def test_paper_rounds_say_how_often_dynamicfl_batched(tmp_path, monkeypatch):
    """``cohort_epoch_share``: the share of DynamicFL's client-epochs that trained in batched
    cohorts — none one by one (a CPU's default), some with its cohorts on (``dynamicfl-batched``:
    in the first rounds every tier's clients start from the same plan)."""
    monkeypatch.setenv("FEDHETERO_DATA_DIR", str(tmp_path / "none"))
    out = paper_rounds(rounds=1, warmup=1, data_root=None, images=1800, algorithms=("dynamicfl", "dynamicfl-batched"))
    assert out["algorithms"]["dynamicfl"]["cohort_epoch_share"] == 0
    assert 0 < out["algorithms"]["dynamicfl-batched"]["cohort_epoch_share"] <= 1


def test_paper_rounds_refuse_an_algorithm_named_twice():
    from fedhetero.core.common.options import ConfigError

    # the results are keyed by name: the second run would silently replace the first
    with pytest.raises(ConfigError, match="each algorithm once"):
        paper_rounds(rounds=1, warmup=0, data_root=None, images=100, algorithms=("dynamicfl", "dynamicfl"))
