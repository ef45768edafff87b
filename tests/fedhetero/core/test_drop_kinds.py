"""A dropped client says why: a device fault is not a bug, and a bug is never a silent drop.

Every drop in ``metrics.jsonl`` carries a ``kind`` (``fedhetero.core.run.backend.DROP_KINDS``); an exception
from the project's own code (or a method's) is an ``internal_error``, counted apart in
``summary.json``, the final table and ``compare``'s table and CSV, and with ``FEDHETERO_STRICT=1``
(set for the whole test suite) it stops the run.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedhetero.core.run.compare import _write, comparison_rows
from fedhetero.core.common.config import from_dict
from fedhetero.core.local.context import RunError
from fedhetero.core.run.engine import Engine
from fedhetero.core.exchange.types import DROP_KINDS, Outcome, check_result
from fedhetero.core.run.backend import drop_kind, injected_fault

BUGGY = '''
from fedhetero.algorithms.classic.fedavg import FedAvg


class Buggy(FedAvg):
    """FedAvg whose client 3 hits a bug in the method's own code."""

    def local_plan(self, ctx, client, state):
        if client.cid == 3:
            raise IndexError("a bug in the method")
        return super().local_plan(ctx, client, state)
'''


def _cfg(tmp_path: Path, backend: str = "local", name: str | None = None, **engine) -> object:
    if name is None:
        path = tmp_path / "buggy.py"
        path.write_text(BUGGY)
        name = f"{path}:Buggy"
    return from_dict(
        {
            "seed": 1,
            "threads": 1,
            "data": {"num_clients": 6},
            "train": {"rounds": 2, "sample_rate": 1.0, "local_epochs": 1},
            "algorithm": {"name": name},
            "engine": {"backend": backend, "workers": 2, **engine},
        }
    )


@pytest.mark.parametrize("backend", ["local", "process"])
def test_an_exception_from_our_code_is_an_internal_error_not_a_device_fault(tmp_path, lenient, backend):
    res = Engine(_cfg(tmp_path, backend), tmp_path / "run", progress=False).run()
    for row in res.metrics:
        assert [(d["cid"], d["kind"]) for d in row["dropped"]] == [(3, "internal_error")]
        assert row["dropped"][0]["reason"] == "IndexError: a bug in the method"
        assert [c["cid"] for c in row["clients"]] == [0, 1, 2, 4, 5]
    s = res.summary
    assert (s["dropped_clients"], s["internal_errors"], s["dropped_by_kind"]) == (2, 2, {"internal_error": 2})
    assert sum(t["internal_errors"] for t in s["tiers"].values()) == 2
    assert sum(t["dropped"] for t in s["tiers"].values()) == 2
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["internal_errors"] == 2


def test_strict_mode_stops_the_run_on_an_internal_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDHETERO_STRICT", "1")
    with pytest.raises(RunError, match=r"client 3 raised an internal error .*IndexError: a bug in the method"):
        Engine(_cfg(tmp_path), tmp_path / "run", progress=False).run()


def test_injected_faults_are_injected_whatever_they_look_like(tmp_path):
    cfg = _cfg(tmp_path, name="fedavg", inject_faults={"rate": 0.5, "kinds": ["raise", "nan"]})
    res = Engine(cfg, tmp_path / "run", progress=False).run()
    drops = [d for r in res.metrics for d in r["dropped"]]
    assert drops and all(d["kind"] == "injected" for d in drops)
    assert all(d["reason"].startswith(("InjectedFault: injected fault", "non-finite upload")) for d in drops)
    assert res.summary["internal_errors"] == 0 and res.summary["dropped_by_kind"] == {"injected": len(drops)}


def test_drop_kind_of_each_failure(tmp_path):
    cfg = _cfg(tmp_path, name="fedavg")
    task = SimpleNamespace(round=1, cid=0, step=0)
    assert injected_fault(cfg, task) is None
    cases = {
        "internal_error": Outcome(task, None, "KeyError: 'x'", kind="internal_error"),
        "lost": Outcome(task, None, "worker died (exit code -9)", kind="lost"),
        "timeout": Outcome(task, None, "timeout: no answer", kind="timeout"),
        "non_finite": Outcome(task, None, "non-finite upload (w)", checked=True, kind="non_finite"),
    }
    for kind, outcome in cases.items():
        reason = check_result(outcome, None)
        assert reason is not None and drop_kind(cfg, outcome, reason) == kind
    # an error without a class (an older Flower node's reply) is a lost client, never a bug
    assert drop_kind(cfg, Outcome(task, None, "flower: node unavailable"), "flower: node unavailable") == "lost"
    # a finished task dropped by the server's own checks
    late = Outcome(task, SimpleNamespace(state={}, payload=None), None, seconds=9.0, checked=True)
    assert drop_kind(cfg, late, check_result(late, 1.0)) == "timeout"
    assert set(DROP_KINDS) == {"injected", "timeout", "lost", "non_finite", "internal_error"}


def test_final_table_shows_drops_and_internal_errors_per_tier(tmp_path, lenient):
    from rich.console import Console

    from fedhetero.cli import print_summary

    res = Engine(_cfg(tmp_path), tmp_path / "run", progress=False).run()
    buf = io.StringIO()
    print_summary(Console(file=buf, width=200, color_system=None), res.summary)
    text = " ".join(buf.getvalue().split())  # the closing line wraps at the console's width
    assert "dropped" in text and "internal errors" in text
    assert "2 client-rounds dropped (see metrics.jsonl), of which 2 by an internal error" in text


def _summary(errors: int, dropped: int) -> dict:
    tiers = {"small": {"accuracy": 0.5, "macs": 1.0, "budget_macs": 1.0}}
    return {
        "final_accuracy": 0.5, "mean_last5_accuracy": 0.5, "mean_client_macs": 1.0, "sim_time_s": 1.0,
        "bytes_total": 10, "wall_s": 1.0, "all_fit_budget": True, "tiers": tiers,
        "dropped_clients": dropped, "internal_errors": errors,
    }


def test_compare_rows_and_csv_carry_drops_and_internal_errors(tmp_path):
    rows = comparison_rows({"fedavg": [_summary(0, 1), _summary(0, 2)], "dynamicfl": [_summary(2, 2), _summary(0, 0)]}, ["small"])
    by = {r["algorithm"]: r for r in rows}
    assert (by["fedavg"]["status"], by["fedavg"]["dropped_client_rounds"], by["fedavg"]["internal_errors"]) == ("ok", 3, 0)
    assert (by["dynamicfl"]["status"], by["dynamicfl"]["dropped_client_rounds"], by["dynamicfl"]["internal_errors"]) == (
        "internal errors", 2, 2
    )
    _write(tmp_path, rows, _cfg(tmp_path, name="fedavg"), ["fedavg", "dynamicfl"], 2, {})
    with (tmp_path / "comparison.csv").open() as fh:
        got = {r["algorithm"]: (r["status"], r["dropped_client_rounds"], r["internal_errors"]) for r in csv.DictReader(fh)}
    assert got == {"fedavg": ("ok", "3", "0"), "dynamicfl": ("internal errors", "2", "2")}
