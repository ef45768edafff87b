"""``fedhetero bench vectorize`` (fedhetero.lab.bench_vectorize): the table, the JSON, the FLOP count,
the data it finds, and whether a batched row really ran as a cohort. Tiny settings only (a few
images per client, two or three clients, Flower left out)."""

from __future__ import annotations

import json
import re

import pytest

from fedhetero.cli import build_parser, main

bv = pytest.importorskip("fedhetero.lab.bench_vectorize")

TINY = ["--clients", "2,3", "--rounds", "2", "--samples", "8", "--threads", "1", "--no-flower"]
COLUMNS = ("clients/round", "one after another, clients/s", "batched, clients/s", "speedup",
           "Flower sim, clients/s", "GFLOP/s one after another", "GFLOP/s batched", "GFLOP/s Flower")


@pytest.fixture(autouse=True)
def _no_data_dir(tmp_path, monkeypatch):
    """Synthetic data unless a test names a folder: a ./data of the developer's is not read."""
    monkeypatch.setenv("FEDHETERO_DATA_DIR", str(tmp_path / "nothing-here"))


def _tiny(**kw):
    args = {"clients": [2, 3], "rounds": 2, "samples": 8, "threads": 1, "flower": False, "model": "logreg"}
    return bv.run_benchmark(**{**args, **kw})


def test_command_prints_the_table_and_writes_the_json(tmp_path, capsys):
    path = tmp_path / "out" / "v.json"
    assert main(["bench", "vectorize", *TINY, "--json", str(path)]) == 0
    out, err = capsys.readouterr()
    flat = " ".join(out.split())
    for column in COLUMNS:
        assert column in out
    assert re.search(r"│\s+2 │", out) and re.search(r"│\s+3 │", out)
    assert "Flower: skipped (--no-flower)" in flat
    assert "data: synthetic 1×28×28 images" in flat and "8 training images per client" in flat
    assert "peak:" in flat and "matmuls" in flat and "convolutions" in flat
    # what is measured and how long it takes, up front; progress while it runs
    head = err.splitlines()[0]
    assert head.startswith("fedhetero bench vectorize: FedAvg, lenet5 (bn), 8 images of 1×28×28 per client")
    assert re.search(r"takes roughly \d+ (s|min)", head)
    progress = [line for line in err.splitlines()[1:] if re.match(r"\s*\d+\.\d s  ", line)]
    steps = [line.split("s  ", 1)[1][:5] for line in progress if "s  [" in line]
    assert steps == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"] and progress[-1].endswith("s  done")

    res = json.loads(path.read_text())
    assert set(res["speedup"]) == set(res["clients_per_s"]) == set(res["gflops"]) == {"2", "3"}
    for key in ("2", "3"):
        speed, status = res["speedup"][key], res["cohort"][key]
        assert (speed is None) == (status == bv.FELL_BACK)
        assert set(res["clients_per_s"][key]) == {"one_by_one", "batched", "flower"}
        assert res["clients_per_s"][key]["flower"] is None and res["clients_per_s"][key]["one_by_one"] > 0
        assert res["images_per_client"][key] == 8
    assert res["peak_gflops"] > 0 and res["device"] == "cpu" and res["threads"] == 1
    assert res["data"].startswith("synthetic") and res["job"]["model"]["norm"] == "bn"


def test_help_names_the_options(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "vectorize", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in ("--clients", "--rounds", "--samples", "--threads", "--device", "--data-root", "--no-flower",
                   "--json", "--set"):
        assert option in out
    args = build_parser().parse_args(["bench", "vectorize"])
    assert (args.clients, args.rounds, args.samples, args.threads, args.device) == ([10, 50, 100], 2, 600, 2, "cpu")
    for bad in (["--clients", "10,x"], ["--clients", "0"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "vectorize", *bad])


def test_training_flops_of_a_known_case():
    # 3 × forward (forward + twice as much backward) × 2 FLOPs per MAC × images
    assert bv.training_flops(1000, 600) == 3 * 1000 * 2 * 600 == 3_600_000
    assert bv.training_flops(281_640, 10 * 600) == pytest.approx(1.01390e10, rel=1e-5)


def test_gflops_are_the_round_flops_over_the_client_phase():
    res = _tiny(clients=[2])
    row = res["rows"]["2"]["one_by_one"]
    best = min(row["client_phase_s"][1:])
    flops = bv.training_flops(res["forward_macs"], 2 * 8)
    assert row["round_flops"] == flops
    assert res["gflops"]["2"]["one_by_one"] == pytest.approx(flops / best / 1e9)
    assert res["clients_per_s"]["2"]["one_by_one"] == pytest.approx(2 / best)


def test_a_batched_row_that_ran_as_a_cohort_reports_a_speedup(capsys):
    res = _tiny()  # logistic regression: no BatchNorm, vectorised today
    for key in ("2", "3"):
        assert res["cohort"][key] == "cohort"
        trained: dict[int, int] = {}
        for rnd, n in res["rows"][key]["cohort_calls"]:
            trained[rnd] = trained.get(rnd, 0) + n
        assert trained == {1: int(key), 2: int(key)}  # every client of every round, the warm-up's too
        cps = res["clients_per_s"][key]
        assert res["speedup"][key] == pytest.approx(cps["batched"] / cps["one_by_one"])
    bv.print_table(res)
    out = capsys.readouterr().out
    table = out.split("\ndata:")[0]
    assert bv.FELL_BACK not in table and len(re.findall(r"\d\.\d\d×", table)) == 2


def test_a_batched_row_that_fell_back_says_so(capsys):
    # per-client time-outs are enforced client by client: the engine runs the round one by one
    res = _tiny(overrides=["engine.client_timeout_s=600"])
    for key in ("2", "3"):
        assert res["cohort"][key] == bv.FELL_BACK and res["speedup"][key] is None
        assert res["rows"][key]["cohort_calls"] == []
        assert res["clients_per_s"][key]["batched"] > 0  # still measured, only not called a speedup
    bv.print_table(res)
    table = capsys.readouterr().out.split("\ndata:")[0]
    assert table.count(bv.FELL_BACK) == 2 and "×" not in table


def test_cohort_status_counts_the_timed_rounds_only():
    assert bv.cohort_status([], [2, 3], 5) == (bv.FELL_BACK, 0)
    assert bv.cohort_status([(1, 5)], [2, 3], 5) == (bv.FELL_BACK, 0)  # only the warm-up round
    assert bv.cohort_status([(2, 5), (3, 5)], [2, 3], 5) == ("cohort", 2)
    assert bv.cohort_status([(2, 3), (2, 2), (3, 5)], [2, 3], 5) == ("cohort", 2)  # two cohorts in round 2
    assert bv.cohort_status([(2, 5)], [2, 3], 5) == ("partly", 1)
    assert bv.batched_share([(2, 5), (3, 2), (3, 1), (1, 5)], [2, 3], 5) == "80 %"


def test_the_wrapper_is_removed_after_the_block():
    from fedhetero.core.local.cohort import Cohort

    original = Cohort.train
    with bv.count_cohort_calls() as calls:
        assert Cohort.train is not original
    assert Cohort.train is original and calls == []


def test_fashion_mnist_is_used_when_its_files_are_there(tmp_path):
    source = bv.load_source(str(tmp_path / "empty"), images=30, test=10)
    assert source["data"].startswith("synthetic") and "no Fashion-MNIST IDX files in" in source["data"]
    assert source["train"][0].shape == (30, 28, 28) and source["test"][0].shape == (10, 28, 28)
    root = tmp_path / "fmnist"
    assert bv.write_idx_set(root, source, 24) == 24
    found = bv.load_source(str(root), images=30, test=10)
    assert found["data"].startswith("Fashion-MNIST") and found["fashion_mnist"]
    assert (found["train"][0] == source["train"][0][:24]).all()  # the bytes survive the round trip
    res = _tiny(clients=[3], rounds=1, data_root=str(root))
    assert res["data"].startswith("Fashion-MNIST") and res["images_per_client"]["3"] == 8
    assert res["statistic"] == "best timed round (no warm-up round)"


def test_flower_time_per_round_leaves_the_start_up_out(monkeypatch, capsys):
    seen = []

    def fake_flower(cfg, supernodes=None, *, num_cpus=None):
        seen.append((cfg.train.rounds, cfg.threads, supernodes, num_cpus, cfg.data.num_clients))
        return 10.0 + 2.0 * cfg.train.rounds  # 10 s of start-up, 2 s a round

    monkeypatch.setattr(bv, "_flower_timer", lambda flower: (fake_flower, None))
    res = _tiny(clients=[3], rounds=3, threads=2, flower=True)
    # a one-round and a three-round run, one SuperNode per client, one thread per ClientApp, 2 at once
    assert seen == [(1, 1, 3, 2, 3), (3, 1, 3, 2, 3)]
    assert res["clients_per_s"]["3"]["flower"] == pytest.approx(3 / 2.0)
    assert res["gflops"]["3"]["flower"] == pytest.approx(res["rows"]["3"]["one_by_one"]["round_flops"] / 2.0 / 1e9)
    bv.print_table(res)
    out = " ".join(capsys.readouterr().out.split())
    assert "Ray's start-up excluded" in out and "Flower n/a" not in out

    monkeypatch.setattr(bv, "_flower_timer", lambda flower: (lambda cfg, **kw: 12.0, None))  # rounds cost nothing
    res = _tiny(clients=[2], flower=True)
    assert res["clients_per_s"]["2"]["flower"] is None and res["gflops"]["2"]["flower"] is None
    bv.print_table(res)
    assert "Flower n/a" in " ".join(capsys.readouterr().out.split())
