"""``fedhetero dyninit-table`` (fedhetero.lab.dyninit_table): the grid of runs, reuse of finished runs, the
tables and the time-to-accuracy cells of seeds that never reach the target."""

from __future__ import annotations

import json

import numpy as np
from _util import SESSION_BASE


BASE = SESSION_BASE


# ---------------------------------------------------------------------------- the table command
def test_dyninit_table_command(tmp_path):
    """The grid runner: runs every cell once (Continuous shared by hosts with one learning rate),
    reuses finished runs, writes both tables, the numbers and the session plot."""
    from fedhetero.cli import main
    from fedhetero.lab.dyninit_table import plan_runs

    cfg = tmp_path / "base.yaml"
    cfg.write_text(json.dumps({**BASE, "engine": {"vectorize": True}}))
    runs = plan_runs([0.0], [0.5], ["fedavg", "fedprox"], ["dyninit", "continuous", "previous", "average"], [1])
    assert len(runs) == 8 and len(set(runs.values())) == 7  # one Continuous run for both hosts
    args = ["dyninit-table", "--config", str(cfg), "--out", str(tmp_path / "t"), "--overlaps", "0.0", "--alphas", "0.5",
            "--hosts", "fedavg,fedprox", "--seeds", "1", "--jobs", "1"]
    assert main(args) == 0
    table = (tmp_path / "t" / "table_transitions.md").read_text()
    assert "Proposed (ours)" in table and "| 0 | 0.5 | fedprox | 2 |" in table
    tta = (tmp_path / "t" / "table_time_to_accuracy.md").read_text()
    assert "| Previous |" in tta
    res = json.loads((tmp_path / "t" / "results.json").read_text())
    assert res["missing_runs"] == [] and res["energy_per_round"]["energy_j"] > 0
    cell = res["cells"][0]["transitions"]["2"]
    assert set(cell) == {"dyninit", "continuous", "previous", "average"}
    assert (tmp_path / "t" / "accuracy_sessions.png").stat().st_size > 1000
    stamp = (tmp_path / "t" / runs[(0.0, 0.5, "fedavg", "dyninit", 1)] / "summary.json").stat().st_mtime
    assert main(args) == 0  # everything reused
    assert (tmp_path / "t" / runs[(0.0, 0.5, "fedavg", "dyninit", 1)] / "summary.json").stat().st_mtime == stamp


def test_time_to_accuracy_table_shows_seeds_that_never_reach_the_target(tmp_path):
    """A baseline that never reaches rho x DynInit's session peak in one seed is shown as such
    (not as inf), and its other columns average the seeds that reach it."""
    from fedhetero.lab.dyninit_table import build_table

    curves = {  # session 4 (after the 2nd transition) accuracy per round, two seeds
        ("dyninit", 1): [0.90, 0.91, 0.92], ("dyninit", 2): [0.90, 0.90, 0.90],
        ("previous", 1): [0.10, 0.50, 0.90], ("previous", 2): [0.10, 0.20, 0.30],
    }
    runs = {}
    for (m, sd), acc in curves.items():
        name = f"{m}-s{sd}"
        runs[(0.0, 0.3, "fedavg", m, sd)] = name
        d = tmp_path / name
        d.mkdir()
        (d / "summary.json").write_text(json.dumps({"transition_2_accuracy": float(np.mean(acc))}))
        (d / "metrics.jsonl").write_text("\n".join(json.dumps({"session": 4, "accuracy": a}) for a in acc))
    res = build_table(tmp_path, runs, transitions=(2,), rho=0.95)
    row = next(line for line in res["tta"].splitlines() if "| Previous |" in line)
    # seed 1 reaches 0.95 x 0.92 = 0.874 at round 3, seed 2 never reaches 0.855
    assert "| 3.0 (1 of 2 seeds never) | 3.0× |" in row
    assert "inf" not in res["tta"]
