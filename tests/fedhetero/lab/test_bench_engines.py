"""``fedhetero bench engines`` (fedhetero.lab.bench): every row reported, the parallel bound, and a run
without the second process."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow  # run by: python -m pytest -m slow
def test_bench_engines_without_the_second_process_still_reports_the_rest(tmp_path, capsys, monkeypatch):
    import fedhetero.lab.bench as bench
    from fedhetero.cli import main

    def fail(*args, **kwargs):
        raise OSError("no second process here")

    monkeypatch.setattr(bench, "_Twin", fail)
    out = tmp_path / "b.json"
    rc = main(["bench", "engines", "--clients", "4", "--per-round", "2", "--rounds", "1", "--repeats", "1",
               "--no-flower", "--heavy-epochs", "1", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "no second process here" in text and "skipped" in text
    samples = json.loads(out.read_text())["samples"]
    assert samples["two_local"] == [] and len(samples["process"]) == 1 and min(samples["process"]) > 0


def test_parallel_bound_halves_only_what_two_executors_can_share():
    from fedhetero.lab.bench import parallel_bound

    # 100 s local run: 80 s of client tasks, 10 s evaluation, 10 s other serial work
    assert parallel_bound(100.0, 80.0, 10.0, 100.0, split_eval=False) == pytest.approx(100 / (20 + 40))
    assert parallel_bound(100.0, 80.0, 10.0, 100.0, split_eval=True) == pytest.approx(100 / (10 + 45))
    # two runs at once 20 % slower than one: every shared second costs 1.2
    assert parallel_bound(100.0, 80.0, 10.0, 120.0, split_eval=True) == pytest.approx(100 / (10 + 45 * 1.2))
    # no serial part and no slowdown: exactly two
    assert parallel_bound(50.0, 50.0, 0.0, 50.0, split_eval=False) == pytest.approx(2.0)


@pytest.mark.slow  # run by: python -m pytest -m slow
def test_bench_engines_runs_and_reports_every_row(tmp_path, capsys):
    from fedhetero.cli import main

    out = tmp_path / "b.json"
    rc = main(["bench", "engines", "--clients", "4", "--per-round", "2", "--rounds", "2", "--repeats", "2",
               "--no-flower", "--heavy-epochs", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    for row in ("process / local throughput", "process / local, median of pairs", "local / bare loop time",
                "worker start-up", "process / local, client phase", "two local runs at once / one",
                "process / local bound"):
        assert row in text, row
    data = json.loads(out.read_text())
    samples = data["samples"]
    assert all(len(samples[k]) == 2 and min(samples[k]) > 0 for k in
               ("local", "process", "bare", "heavy_local", "heavy_process", "local_clients", "process_clients",
                "local_eval", "process_eval", "two_local"))
    # the client phase is part of each run's rounds; two runs at once take at least as long as one
    assert all(c < t for c, t in zip(samples["local_clients"], samples["local"]))
    assert all(c < t for c, t in zip(samples["process_clients"], samples["process"]))
    assert all(c + e < t for c, e, t in zip(samples["local_clients"], samples["local_eval"], samples["local"]))
    assert min(samples["two_local"]) >= 0.5 * min(samples["local"])

