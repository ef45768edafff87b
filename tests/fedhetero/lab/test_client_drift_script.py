"""examples/client_drift.py: one more round from a finished run's end, per tier. With every client
of every tier it is the round the run would have run next (full participation): the mean of the
uploads is the global model of the same run one round longer, for FedAvg and for DynamicFL (whose
clients start from their stored states). The run directory is left as it was."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
from _util import load_example

from fedhetero.core.common.config import from_dict
from fedhetero.core.run.engine import Engine


def _load():
    return load_example("client_drift")


def _cfg(algorithm: str, rounds: int):
    return from_dict({
        "seed": 3, "threads": 1,
        "data": {"num_clients": 6},
        "train": {"rounds": rounds, "sample_rate": 1.0, "local_epochs": 1},
        "engine": {"vectorize": False},
        "algorithm": {"name": algorithm},
    })


def _digest(folder):
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(folder)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("algorithm", ["fedavg", "dynamicfl"])
def test_every_client_one_more_round_is_the_runs_next_round(tmp_path, algorithm):
    short = Engine(_cfg(algorithm, 2), tmp_path / "short", progress=False).run()
    longer = Engine(_cfg(algorithm, 3), tmp_path / "long", progress=False).run()
    before = _digest(tmp_path / "short")
    res = _load().drift(tmp_path / "short", clients_per_tier=6)
    assert _digest(tmp_path / "short") == before
    assert res["global_accuracy"] == pytest.approx(100 * short.summary["final_accuracy"], abs=1e-9)
    assert res["all_tiers_mean_accuracy"] == pytest.approx(100 * longer.summary["final_accuracy"], abs=1e-9)
    assert sum(t["clients"] for t in res["tiers"].values()) == 6
    for row in res["tiers"].values():
        assert row["relative_change"] and all(math.isfinite(v) and v > 0 for v in row["relative_change"].values())
        assert 0 <= row["upload_accuracy"] <= 100 and 0 <= row["mean_upload_accuracy"] <= 100


def test_a_run_without_a_final_model_is_refused_with_its_path(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(SystemExit, match="no final_model.pt"):
        _load().drift(tmp_path / "run", 2)


def test_the_command_line_prints_each_tier(tmp_path, capsys):
    Engine(_cfg("fedavg", 1), tmp_path / "run", progress=False).run()
    assert _load().main([str(tmp_path / "run"), "--clients", "2", "--json", str(tmp_path / "d.json")]) == 0
    out = capsys.readouterr().out
    assert "global model:" in out and "mean of every tier's uploads:" in out
    saved = json.loads((tmp_path / "d.json").read_text())
    assert set(saved) == {"global_accuracy", "tiers", "all_tiers_mean_accuracy"}
    assert all(row["clients"] == 2 for row in saved["tiers"].values())


def test_a_method_of_sub_models_is_refused_by_name(tmp_path):
    Engine(_cfg("heterofl", 1), tmp_path / "run", progress=False).run()
    with pytest.raises(SystemExit, match="heterofl: .* uploads of the whole global model"):
        _load().drift(tmp_path / "run", 6)
