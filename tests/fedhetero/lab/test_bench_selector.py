"""``fedhetero bench selector`` with tiny sizes: the printed table and the JSON are sane."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedhetero.cli import main
from fedhetero.lab.bench_selector import run_benchmark


def test_tiny_run_prints_and_writes_sane_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sel.json"
    rc = main([
        "bench", "selector", "--clients", "6", "14", "--repeats", "2", "--population", "20", "--samples", "40",
        "--ga-population", "12", "--ga-iterations", "10", "--orders", "3", "--exhaustive-max", "8",
        "--json", str(out),
    ])
    assert rc == 0
    text = capsys.readouterr().out
    for word in ("ensemble_dp", "exhaustive", "random", "genetic", "KL mean", "ms/call"):
        assert word in text
    assert "skipped" in text  # exhaustive does not run at 14 clients
    result = json.loads(out.read_text())
    rows = {(r["clients"], r["selector"]): r for r in result["rows"]}
    assert set(rows) == {(n, s) for n in (6, 14) for s in ("ensemble_dp", "exhaustive", "random", "genetic")}
    assert "skipped" in rows[(14, "exhaustive")]
    for key, row in rows.items():
        if "skipped" in row:
            continue
        assert row["calls"] == 2
        assert 0.0 <= row["kl_mean"] <= row["kl_max"] < math.log(10) + 1e-9  # KL to uniform ≤ ln C
        assert 1 <= row["size_mean"] <= key[0]
        assert 0.0 < row["time_median_s"] <= row["time_max_s"] < 30.0
    # exhaustive is the optimum: no selector beats it on the same rounds
    best = rows[(6, "exhaustive")]["kl_mean"]
    for s in ("ensemble_dp", "random", "genetic"):
        assert rows[(6, s)]["kl_mean"] >= best - 1e-12
    # random draws a subset of the size ensemble_dp picked
    for n in (6, 14):
        assert rows[(n, "random")]["size_mean"] == rows[(n, "ensemble_dp")]["size_mean"]


def test_budget_caps_the_group_size() -> None:
    res = run_benchmark([10], repeats=2, population=20, samples=40, beta=0.3, orders=2,
                        ga_population=8, ga_iterations=5, selectors=["ensemble_dp", "exhaustive"])
    for row in res["rows"]:
        assert row["size_mean"] <= 3
    dp, ex = res["rows"]
    assert dp["kl_mean"] >= ex["kl_mean"] - 1e-12
    assert dp["target_s"] == 0.010 and isinstance(dp["meets_target"], bool)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        run_benchmark([0])
    with pytest.raises(SystemExit):
        main(["bench", "selector", "--selectors", "annealing"])
