"""``algorithm.options.verify`` checks DynamicFL's structural invariants in every task and stops a
task that breaks one: each check is shown to fire on the bug it exists for (an optimizer not
updated after a structural change, a client model not re-solved to the global model, an upload
that is not the trained model), and to stay silent on the real code."""

from __future__ import annotations

import pytest

import reparam
from fedhetero.core.config import from_dict
from fedhetero.core.context import RunError
from fedhetero.core.engine import Engine


def _cfg(**options):
    return from_dict(
        {
            "seed": 0,
            "threads": 1,
            "data": {"num_clients": 4},
            "train": {"rounds": 2, "sample_rate": 1.0, "local_epochs": 2},
            "algorithm": {"name": "dynamicfl", "options": {"verify": True, **options}},
        }
    )


def test_verify_passes_on_the_real_code_and_records_both_errors(tmp_path):
    res = Engine(_cfg(), tmp_path / "run", progress=False).run()
    clients = [c for r in res.metrics for c in r["clients"]]
    assert len(clients) == 8 and res.summary["dropped_clients"] == 0
    assert all(0 <= c["lossless_out"] <= 1e-5 for c in clients)
    returning = [c for c in clients if c["mode"] == "dymm"]
    assert returning and all(0 <= c["lossless_in"] <= 1e-5 for c in returning)


def test_an_optimizer_left_behind_by_a_structural_change_stops_the_task(tmp_path, monkeypatch):
    monkeypatch.setattr("fedhetero.algorithms.dynamicfl.algorithm.apply_to_optimizer", lambda opt, change: None)
    with pytest.raises(RunError, match=r"InvariantError: optimizer out of step with the model after DYMM"):
        Engine(_cfg(), tmp_path / "run", progress=False).run()


def test_a_client_model_not_equal_to_the_global_model_stops_the_task(tmp_path, monkeypatch):
    monkeypatch.setattr(reparam, "rep_to_local", lambda *a, **k: None)  # REP forgotten
    with pytest.raises(RunError, match=r"InvariantError: functions differ after REP"):
        Engine(_cfg(), tmp_path / "run", progress=False).run()


def test_an_upload_that_is_not_the_trained_model_stops_the_task(tmp_path, monkeypatch):
    real = reparam.merge

    def wrong_merge(model, *a, **k):
        plain = real(model, *a, **k)
        for m in plain.modules():
            if isinstance(m, reparam.DiverseBranchBlock) or getattr(m, "bias", None) is None:
                continue
            m.bias.data.add_(1.0)  # a merge that loses a branch's bias
            break
        return plain

    monkeypatch.setattr(reparam, "merge", wrong_merge)
    with pytest.raises(RunError, match=r"InvariantError: functions differ at upload"):
        Engine(_cfg(), tmp_path / "run", progress=False).run()


@pytest.mark.slow  # run by: python -m pytest -m slow
def test_without_verify_the_checks_do_not_run(tmp_path, monkeypatch, lenient):
    """Without ``verify`` the checks cost nothing, and the run does not stop (what a user's run
    does); the invariant tests and verify runs are where such a bug is caught."""
    monkeypatch.setattr("fedhetero.algorithms.dynamicfl.algorithm.apply_to_optimizer", lambda opt, change: None)
    res = Engine(_cfg(verify=False), tmp_path / "run", progress=False).run()
    assert res.summary["dropped_clients"] == 0
