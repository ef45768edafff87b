"""What a run's final table and plots show, decided from its numbers (no pixels compared): the
per-tier columns and rows that mean something for the run and the set each accuracy was measured
on (:func:`summary_view`), the lines of accuracy.png (:func:`plot_series`) and its title, the
comparison's curves and per-tier bars with their legend beside the bars, and the missing plot extra."""

from __future__ import annotations

import io
import sys
from types import SimpleNamespace

import pytest
from rich.console import Console

from fedhetero.core.run.compare import accuracy_curves, tier_bars, tiers_figure
from fedhetero.core.common.config import from_dict
from fedhetero.core.run.reports import (
    SESSION_CLASSES,
    TEST_SET,
    plot_run,
    plot_series,
    plot_title,
    print_summary,
    run_settings,
    summary_view,
)

SESSIONS = {"sessions": {"count": 3, "eval_on_session_classes": True}}


def _tier(acc, macs=1e6, ratio=1.0, budget=1e6, fits=True, rounds=4):
    return {"accuracy": acc, "macs": macs, "ratio": ratio, "budget_macs": budget, "fits_budget": fits,
            "client_rounds": rounds, "bytes_up": 10, "bytes_down": 10, "dropped": 0, "internal_errors": 0}


def _summary(tiers, final=0.9, **extra):
    return {"algorithm": "m", "final_accuracy": final, "best_accuracy": final, "mean_last5_accuracy": final,
            "plain_macs": 1e6, "wall_s": 1.0, "bytes_up": 20, "bytes_down": 20, "tiers": tiers, **extra}


# ---------------------------------------------------------------------------- the final table
def test_tiers_with_their_own_models_keep_rows_and_accuracy():
    s = _summary({"small": _tier(0.6, 1e5, 1, 1e5), "large": _tier(0.9, 1e6, 3, 3e5)})
    v = summary_view(s, {})
    assert (v["same_model"], v["tier_accuracy"], v["merge_tiers"]) == (False, True, False)
    assert v["accuracy_on"] == v["tier_accuracy_on"] == TEST_SET and v["full_test_accuracy"] is None


def test_one_model_measured_on_another_set_goes_to_the_title():
    """DynInit: every tier deploys the global model, evaluated on the full test set; the final
    accuracy is on the session's test classes."""
    s = _summary({"small": _tier(0.5088, 1e4, 1, 1e4), "medium": _tier(0.5088, 1e4, 2, 2e4),
                  "large": _tier(0.5088, 1e4, 3, 3e4)}, final=0.9459)
    v = summary_view(s, SESSIONS)
    assert v["accuracy_on"] == SESSION_CLASSES and v["tier_accuracy_on"] == TEST_SET
    assert v["same_model"] and not v["tier_accuracy"] and v["full_test_accuracy"] == 0.5088
    assert not v["merge_tiers"]  # the budgets differ: one row per tier
    buf = io.StringIO()
    print_summary(Console(file=buf, width=300, color_system=None), s, cfg=SESSIONS)
    text = buf.getvalue()
    assert "m: final accuracy 94.59 % on the session's test classes, 50.88 % on the full test set" in text
    assert "50.88" not in "".join(line for line in text.splitlines() if line.startswith("│"))
    assert "mean of last 5 94.59 % (on the session's test classes)" in text


def test_sessions_measured_on_all_classes_need_no_label():
    s = _summary({"a": _tier(0.9), "b": _tier(0.9)})
    v = summary_view(s, {"sessions": {"count": 3, "eval_on_session_classes": False}})
    assert v["accuracy_on"] == TEST_SET and v["full_test_accuracy"] is None and not v["tier_accuracy"]


def test_equal_final_accuracies_of_different_models_are_told_apart_by_the_history():
    s = _summary({"a": _tier(0.9), "b": _tier(0.9)})
    assert summary_view(s, {})["same_model"]
    history = [{"round": 1, "tier_accuracy": {"a": 0.4, "b": 0.5}}, {"round": 2, "tier_accuracy": {"a": 0.9, "b": 0.9}}]
    v = summary_view(s, {}, history)
    assert not v["same_model"] and v["tier_accuracy"] and not v["merge_tiers"]


def test_one_shared_model_other_than_the_final_one_keeps_its_column():
    v = summary_view(_summary({"a": _tier(0.7), "b": _tier(0.7)}, final=0.9), {})
    assert v["same_model"] and v["tier_accuracy"]


def test_tiers_that_differ_in_nothing_share_one_row():
    s = _summary({"a": _tier(0.9, rounds=3), "b": _tier(0.9, rounds=5), "c": _tier(0.9, macs=None, fits=None, rounds=0)})
    assert summary_view(s, {})["merge_tiers"]
    assert not summary_view({**s, "dropped_clients": 2}, {})["merge_tiers"]
    assert not summary_view({**s, "tiers": {**s["tiers"], "c": _tier(0.9, budget=2e6)}}, {})["merge_tiers"]
    buf = io.StringIO()
    print_summary(Console(file=buf, width=300, color_system=None), s)
    rows = [line.split("│") for line in buf.getvalue().splitlines() if line.startswith("│")]
    assert len(rows) == 1 and rows[0][1].strip() == "a, b, c" and rows[0][6].strip() == "8"
    assert rows[0][5].strip() == "yes"  # the tiers that trained fit


def test_the_recorded_deployment_decides_the_per_tier_column_for_every_method():
    """One rule: the per-tier accuracy column is shown when the tiers deploy models of their own
    (the run records ``one_model``), whatever the tiers trained. DynamicFL's tiers train 1×, 2×
    and 3× MACs and deploy one model: no column, as for FedAvg; models of their own that scored
    alike keep it."""
    tiers = {"small": _tier(0.8, 1e5, 1, 1e5), "medium": _tier(0.8, 2e5, 2, 2e5), "large": _tier(0.8, 3e5, 3, 3e5)}
    for one_model, column in ((True, False), (False, True)):
        s = _summary(tiers, final=0.8, one_model=one_model)
        v = summary_view(s, {})
        assert (v["same_model"], v["tier_accuracy"]) == (one_model, column)
        buf = io.StringIO()
        print_summary(Console(file=buf, width=300, color_system=None), s)
        text = buf.getvalue()
        assert ("accuracy %" in text) is column
        assert ("every tier deploys the same model" in text) is one_model
        assert len([line for line in text.splitlines() if line.startswith("│")]) == 3  # budgets differ


# ---------------------------------------------------------------------------- accuracy.png
def _client(loss, n):
    return {"cid": 0, "tier": "a", "loss": loss, "num_samples": n}


def test_plot_series_of_a_run_with_tier_models_and_validation():
    rows = [
        {"round": 1, "clients": [_client(2.0, 10), _client(1.0, 30)], "accuracy": 0.5, "loss": 1.5,
         "val_accuracy": 0.45, "val_loss": 1.6, "tier_accuracy": {"small": 0.3, "medium": 0.4, "large": 0.5}},
        {"round": 2, "clients": [_client(float("nan"), 10), _client(0.5, 10)]},  # no evaluation
        {"round": 3, "clients": [], "accuracy": 0.7, "loss": 1.0, "val_accuracy": 0.6, "val_loss": 1.2,
         "tier_accuracy": {"small": 0.5, "medium": 0.6, "large": 0.7}},
    ]
    s = plot_series(rows)
    assert s["accuracy"] == {
        "test (global model = tier large)": [(1, 50.0), (3, 70.0)],
        "validation": [(1, 45.0), (3, 60.0)],
        "tier small (deployed model)": [(1, 30.0), (3, 50.0)],
        "tier medium (deployed model)": [(1, 40.0), (3, 60.0)],
    }
    assert s["loss"]["test"] == [(1, 1.5), (3, 1.0)] and s["loss"]["validation"] == [(1, 1.6), (3, 1.2)]
    # the clients' training loss, weighted by their samples; a non-finite one left out
    assert s["loss"]["training (clients' mean)"] == [(1, pytest.approx(1.25)), (2, 0.5)]


def test_plot_series_of_a_session_run_with_one_model_has_no_tier_lines():
    rows = [
        {"round": r, "session": 1, "clients": [], "accuracy": a, "accuracy_session": a, "accuracy_full": f,
         "loss": 0.3, "loss_full": 3.0, "tier_accuracy": {"small": f, "medium": f, "large": f}}
        for r, a, f in ((1, 0.9, 0.4), (2, 0.95, 0.5))
    ] + [{"round": 3, "skipped": True, "clients": []}]
    s = plot_series(rows)
    assert s["accuracy"] == {"test, session's classes": [(1, 90.0), (2, 95.0)], "test, all classes": [(1, 40.0), (2, 50.0)]}
    assert s["loss"] == {"test, session's classes": [(1, 0.3), (2, 0.3)], "test, all classes": [(1, 3.0), (2, 3.0)]}


def test_plot_title_names_method_dataset_model_and_seed():
    cfg = from_dict({"seed": 7, "data": {"dataset": "digits"}, "model": {"name": "lenet5"}, "algorithm": {"name": "fedavg"}})
    assert plot_title({"algorithm": "fedavg"}, run_settings(cfg)) == "fedavg on digits (lenet5), seed 7"
    assert plot_title({"algorithm": "x"}, {}) == "x"


def test_plot_run_writes_the_png_or_says_how_to_get_it(tmp_path, monkeypatch):
    rows = [{"round": r, "clients": [_client(1.0 / r, 5)], "accuracy": 0.1 * r, "loss": 2.0 / r,
             "tier_accuracy": {"a": 0.1 * r}} for r in (1, 2, 3)]
    result = SimpleNamespace(metrics=rows, summary={"algorithm": "fedavg"})
    assert plot_run(None, result, tmp_path, {"seed": 1, "data": {"dataset": "digits"}}) == tmp_path / "accuracy.png"
    assert (tmp_path / "accuracy.png").read_bytes().startswith(b"\x89PNG")
    assert plot_run(None, SimpleNamespace(metrics=[], summary={}), tmp_path / "none") is None
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # the plot extra missing
    buf = io.StringIO()
    assert plot_run(Console(file=buf), result, tmp_path / "other") is None
    assert "pip install 'fedhetero[plot]'" in buf.getvalue()


# ---------------------------------------------------------------------------- compare's plots
def _hist(accs, tiers):
    return [{"round": i + 1, "accuracy": a, "tier_accuracy": tiers} for i, a in enumerate(accs)]


def test_comparison_curves_cut_at_a_failed_seed_and_bars_per_tier():
    histories = {
        "fedavg": [_hist([0.2, 0.4, 0.6], {"s": 0.6, "l": 0.6}), _hist([0.4, 0.6], {"s": 0.5, "l": 0.5})],
        "heterofl": [_hist([0.1, 0.3, 0.5], {"s": 0.3, "l": 0.5})],
        "na": [],
    }
    curves = accuracy_curves(histories)
    assert curves["fedavg"][0] == [1, 2] and curves["fedavg"][1] == pytest.approx([30.0, 50.0])
    assert curves["heterofl"] == ([1, 2, 3], pytest.approx([10.0, 30.0, 50.0])) and "na" not in curves
    bars = tier_bars(histories, ["s", "l"])
    assert bars == {"s": [pytest.approx(55.0), pytest.approx(30.0)], "l": [pytest.approx(55.0), pytest.approx(50.0)]}


def test_tiers_legend_covers_no_bar():
    histories = {a: [_hist([0.9], {"small": 0.97, "medium": 0.98, "large": 0.99})] for a in ("fedavg", "heterofl", "x")}
    fig = tiers_figure(histories, ["small", "medium", "large"], "digits (lenet5), seed 0")
    fig.draw_without_rendering()
    (legend,) = fig.legends
    box = legend.get_window_extent()
    ax = fig.axes[0]
    assert box.x0 >= ax.get_window_extent().x1  # right of the axes
    assert len(ax.patches) == 9 and not any(box.overlaps(p.get_window_extent()) for p in ax.patches)
    assert [t.get_text() for t in legend.get_texts()] == ["small", "medium", "large"]
