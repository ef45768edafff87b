"""``fedhetero info``: one complete line per algorithm, model and data set, from their declarations."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedhetero.algorithms import BUILTIN, Algorithm, get_algorithm, list_algorithms
from fedhetero.cli import main
from fedhetero.cli.info import DATASET_NOTES, MODEL_NOTES, algorithm_line, budget_support
from fedhetero.core.common.config import SCENARIOS
from fedhetero.data import DATASETS
from fedhetero.models import list_models

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_every_method_declares_a_summary_and_a_paper(name):
    assert name in list_algorithms()
    cls = get_algorithm(name)
    # declared on the class itself: a subclass must not show its parent's line
    assert "summary" in vars(cls) and "paper" in vars(cls), name
    summary, paper = cls.summary, cls.paper
    assert summary.strip() == summary and summary.endswith(".") and len(summary) > 40, summary
    assert "\n" not in summary and "…" not in summary and "module docstring" not in summary
    assert paper.strip() == paper and len(paper) > 10 and "\n" not in paper and "…" not in paper, paper
    assert not paper.endswith("."), "info adds the full stop"


def test_every_registered_model_and_dataset_has_a_description():
    # equal sets: a newly registered name without a description fails, and so does a stale entry
    assert set(MODEL_NOTES) == set(list_models())
    assert set(DATASET_NOTES) == set(DATASETS)
    assert "svhn" in DATASETS
    for note in (*MODEL_NOTES.values(), *DATASET_NOTES.values()):
        assert note.endswith(".") and "\n" not in note and "…" not in note, note


def test_budgets_are_derived_from_the_declarations():
    class Mine(Algorithm):
        """A method of my own.

        More about it."""

        name = "mine_for_info"
        adapts_to = frozenset({"random", "static"})
        supports_submodels = True

    assert budget_support(Mine) == "static, random; sub-models for budgets below the plain model"
    line = algorithm_line("mine_for_info", Mine).plain
    assert line == "  mine_for_info  A method of my own. Budgets: static, random; sub-models for budgets below the plain model."
    for name in BUILTIN:
        cls = get_algorithm(name)
        scenarios = budget_support(cls).split(";")[0].split(", ")
        assert set(scenarios) == set(cls.adapts_to) and scenarios == [s for s in SCENARIOS if s in scenarios]
        assert ("sub-models" in budget_support(cls)) == cls.supports_submodels


def _check_listing(out: str) -> None:
    assert "…" not in out
    lines = out.splitlines()

    def line_of(name: str) -> str:
        found = [line for line in lines if line.startswith(f"  {name} ")]
        assert len(found) == 1, (name, found)
        return found[0]

    for name in BUILTIN:
        cls = get_algorithm(name)
        line = line_of(name)
        assert f" {cls.summary} Paper: {cls.paper}. Budgets: {budget_support(cls)}." in line, line
    for names, notes in ((list_models(), MODEL_NOTES), (DATASETS, DATASET_NOTES)):
        for name in names:
            assert line_of(name).endswith(f" {notes[name]}")
    assert line_of("svhn")


def test_info_piped_prints_every_line_whole():
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "FORCE_COLOR", "TTY_COMPATIBLE")}
    r = subprocess.run([sys.executable, "-m", "fedhetero.cli", "info"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    _check_listing(r.stdout)


def test_info_lines_stay_whole_in_narrow_columns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")  # a console width the lines do not fit: never cut or wrapped
    assert main(["info"]) == 0
    _check_listing(capsys.readouterr().out)
