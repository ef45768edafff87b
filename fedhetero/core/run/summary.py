"""A run's ``summary.json``: final, best and smoothed accuracy, validation, time and traffic to a
target, per-tier numbers, drops, from the rows of every round."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from fedhetero.core.common.config import RunConfig
from fedhetero.core.hetero.sessions import session_summary
from fedhetero.core.hetero.timemodel import smoothed_final_accuracy

#: environment variable that turns internal errors from dropped clients into a stopped run
STRICT_ENV = "FEDHETERO_STRICT"
#: evaluations the summary's ``smoothed_final_accuracy`` smooths over (the FedDUMAP paper's window);
#: a run with fewer evaluations reports none
SMOOTHING_WINDOW = 39



__all__ = ["summarize"]


def summarize(cfg: RunConfig, history: list[dict[str, Any]], plain_macs: int, wall: float) -> dict[str, Any]:
    """Final numbers of a run: accuracy (final, best, smoothed), per-tier budgets and FLOPs, bytes."""
    evals = [r for r in history if "accuracy" in r]
    accs = [r["accuracy"] for r in evals]
    # drops by (tier, class) in one pass (see fedhetero.core.run.backend.DROP_KINDS); a row written before
    # drops had a class counts its drops as "unclassified"
    drops_by = Counter(
        (d.get("tier"), str(d.get("kind", "unclassified"))) for r in history for d in r.get("dropped", ())
    )
    kinds = sorted({k for _, k in drops_by})
    by_kind = {k: sum(n for (_, kk), n in drops_by.items() if kk == k) for k in kinds}
    tiers: dict[str, dict[str, Any]] = {}
    for t in cfg.budget.tiers:
        rows = [c for r in history for c in r["clients"] if c["tier"] == t.name]
        tiers[t.name] = {
            "ratio": t.ratio,
            "budget_macs": float(np.mean([c["budget_macs"] for c in rows])) if rows else t.ratio * plain_macs,
            "macs": float(np.mean([c["macs"] for c in rows])) if rows else None,
            "fits_budget": bool(all(c["fits_budget"] for c in rows)) if rows else None,
            "client_rounds": len(rows),
            "bytes_up": int(sum(c["bytes_up"] for c in rows)),
            "bytes_down": int(sum(c["bytes_down"] for c in rows)),
            "accuracy": evals[-1]["tier_accuracy"].get(t.name) if evals else None,
            "dropped": sum(drops_by.get((t.name, k), 0) for k in kinds),
            "internal_errors": drops_by.get((t.name, "internal_error"), 0),
        }
    k = min(5, len(accs))
    client_macs = [c["macs"] for r in history for c in r["clients"]]
    target = cfg.train.target_accuracy
    reached = None
    if target is not None and evals:
        hit = [r for r in evals if r["accuracy"] >= target]
        reached = hit[0] if hit else None
    smoothed = None
    if len(accs) >= SMOOTHING_WINDOW:
        # the FedDUMAP paper's "final accuracy" (its authors' code): the peak of the accuracy curve
        # smoothed by a Savitzky-Golay filter (window 39 evaluations, cubic), rounded to 3 decimals.
        # A shorter run has no such window: one cut to the run's length fits one cubic to the whole
        # run, whose peak was just the best accuracy again, so it reports none (null).
        smoothed = float(smoothed_final_accuracy(accs, window=SMOOTHING_WINDOW, polyorder=3))
        # the cubic can overshoot at the end of a rising curve: never more than a round reached
        smoothed = min(smoothed, max(accs))
    return {
        "algorithm": cfg.algorithm.name,
        "rounds": len(history),
        "final_accuracy": accs[-1] if accs else None,
        "best_accuracy": max(accs) if accs else None,
        "mean_last5_accuracy": float(np.mean(accs[-k:])) if accs else None,
        **_val_summary(evals),
        "plain_macs": plain_macs,
        "tiers": tiers,
        "smoothed_final_accuracy": smoothed,
        "target_accuracy": target,
        "rounds_to_target": reached["round"] if reached else None,
        "time_to_target": reached["sim_time_s"] if reached else None,
        "sim_time_s": history[-1]["sim_time_s"] if history else 0.0,
        "mean_client_macs": float(np.mean(client_macs)) if client_macs else None,
        "bytes_total": history[-1]["bytes_total"] if history else 0,
        "bytes_up": int(sum(r["bytes_up"] for r in history)),
        "bytes_down": int(sum(r["bytes_down"] for r in history)),
        "all_fit_budget": bool(all(c["fits_budget"] for r in history for c in r["clients"])),
        "dropped_clients": int(sum(by_kind.values())),
        # internal errors are bugs, not device faults: counted apart
        "dropped_by_kind": by_kind,
        "internal_errors": by_kind.get("internal_error", 0),
        "wall_s": round(wall, 3),
        **(session_summary(history, cfg.sessions.transition_window) if cfg.sessions.count else {}),
    }


def _val_summary(evals: list[dict[str, Any]]) -> dict[str, Any]:
    """Validation accuracy (final, best, mean of the last 5 evaluations) when the run has a
    validation hold-out."""
    vals = [r["val_accuracy"] for r in evals if "val_accuracy" in r]
    if not vals:
        return {}
    return {"final_val_accuracy": vals[-1], "best_val_accuracy": max(vals),
            "mean_last5_val_accuracy": float(np.mean(vals[-min(5, len(vals)):]))}


