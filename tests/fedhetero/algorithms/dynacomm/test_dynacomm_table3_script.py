"""examples/dynacomm_table3.py: the markdown tables of docs/results.md's DynaComm Table 3 section,
built from run directories (here fake ones with hand-made summaries)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _util import load_example


def _load():
    return load_example("dynacomm_table3")


def _run(path: Path, best: float, final: float, kappa: float | None = None, size: float | None = None, nbytes: int = 1000) -> None:
    path.mkdir(parents=True)
    summary = {"best_accuracy": best, "final_accuracy": final, "bytes_total": nbytes}
    if kappa is not None:
        summary.update({"kappa_code": kappa, "mean_high_group_size": size})
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "config.yaml").write_text("train:\n  local_steps: 40\n")


def test_tables_from_run_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for s, shift in ((0, 0.0), (1, 0.02)):
        _run(tmp_path / f"sgd-s{s}", 0.77 + shift, 0.76 + shift, 0.975, 10.0)
        for x in "abc":
            for m in ("fix", "dynamic"):
                for b in ("0.3", "0.6", "0.9"):
                    _run(tmp_path / f"{x}-g-{m}-{b}-s{s}", 0.70 + shift, 0.69, 0.25 if m == "fix" else 0.31, 2.5)
        for algo, nbytes in (("fedavg", 1000), ("scaffold", 2000), ("fedgen", 1500), ("fedprox", 1000)):
            _run(tmp_path / "baselines" / algo / f"seed{s}", 0.65 + shift, 0.64, nbytes=nbytes)
    assert _load().main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "seeds 0, 1 (L = 40)" in out
    assert "| DynamicSGD | – | – | 78.0 ± 1.0 | ″ | 0.975 | 77.2 (0.3) | ″ | 0.996 | 27.0 (0.5) | ″ | 0.996 |" in out
    assert "| DynamicAvg | b-g | 0.6 | 71.0 ± 1.0 | 71.0 ± 1.0 | 0.250 / 0.310 | 68.8 (0.1) | 68.4 (0.6) | 0.112 / 0.131 |" in out
    # baselines: κ from bytes relative to FedAvg's, over L
    assert "| FedAvg | – | – | 66.0 ± 1.0 | ″ | 0.025 |" in out
    assert "| SCAFFOLD | – | – | 66.0 ± 1.0 | ″ | 0.050 |" in out
    assert "| FedGen | – | – | 66.0 ± 1.0 | ″ | 0.037 |" in out
    assert "| FedDyn | – | – | — | ″ | — |" in out  # not run
    assert "| c-g | 0.9 | 2.50 | 2.50 |" in out
    assert "| DynamicAvg | a-g | 0.3 | 69.0 ± 0.0 | 69.0 ± 0.0 |" in out  # final-round table
    assert "per seed (seed 0 / seed 1)" in out
    assert "| b-g | Dynamic | +5.0 / +5.0 | +5.0 / +5.0 | +5.0 / +5.0 |" in out  # paired with FedAvg's seed


def test_missing_runs_are_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _load().main([str(tmp_path)]) == 2
    assert "no finished sgd-s<seed> run" in capsys.readouterr().err
