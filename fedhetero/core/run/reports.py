"""What a finished run reports: its run directory's default name, the summary table and the plot.

Shared by the command line and the integrations (Flower's simulation and ServerApp print the same
table), so it lives apart from the CLI, which nothing in the runtime imports.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml
from rich.table import Table
from rich.text import Text

from fedhetero.core.common.config import config_hash, to_dict

__all__ = ["default_out_dir", "deploys_one_model", "plot_run", "plot_series", "plot_title", "print_summary", "run_settings", "summary_view"]


def _fmt_macs(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v / 1e6:.3f}"


def _fmt_bytes(v: float) -> str:
    """Binary units, named as such (KiB, MiB, GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if v < 1024 or unit == "GiB":
            return f"{v:.1f} {unit}" if unit != "B" else f"{int(v)} B"
        v /= 1024
    return str(v)  # pragma: no cover


def _fmt_acc(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.2f}"


def default_out_dir(cfg: Any) -> Path:
    """``runs/<algorithm>-<dataset>-<model>-s<seed>-<hash>``: the short config hash makes runs with
    other settings land in other directories. A back end other than ``local`` adds ``-<back end>``:
    the back end is not part of the hash (the numbers are the same on every back end, and it may
    change on resume), but a run on another back end is another run, so it gets a directory of its
    own instead of being refused as the finished run of the default directory."""
    algo = Path(cfg.algorithm.name.split(":")[-1]).name
    name = f"{algo}-{cfg.data.dataset}-{cfg.model.name}-s{cfg.seed}-{config_hash(cfg)[:8]}"
    backend = cfg.engine.backend
    return Path("runs") / (name if backend == "local" else f"{name}-{backend}")


def run_settings(cfg: Any = None, out: Path | None = None) -> dict[str, Any]:
    """The run's config as plain data: ``cfg`` (a :class:`~fedhetero.core.common.config.RunConfig` or a
    dict), else the ``config.yaml`` of the run directory ``out``; ``{}`` when neither is at hand."""
    if cfg is not None:
        return cfg if isinstance(cfg, dict) else to_dict(cfg)
    if out is not None:
        try:
            data = yaml.safe_load((Path(out) / "config.yaml").read_text())
        except (OSError, yaml.YAMLError):
            return {}
        return data if isinstance(data, dict) else {}
    return {}


def _on_session_classes(settings: dict[str, Any]) -> bool:
    """Whether the run's accuracy is measured on the test classes of the session's devices."""
    sessions = settings.get("sessions") or {}
    return bool(sessions.get("count")) and bool(sessions.get("eval_on_session_classes", True))


def plot_title(summary: dict[str, Any], settings: dict[str, Any]) -> str:
    """``<method> on <dataset> (<model>), seed <seed>`` (the parts the settings hold)."""
    algo = summary.get("algorithm") or (settings.get("algorithm") or {}).get("name", "")
    data = (settings.get("data") or {}).get("dataset")
    model = (settings.get("model") or {}).get("name")
    title = str(algo)
    if data:
        title += f" on {data}" + (f" ({model})" if model else "")
    if settings.get("seed") is not None:
        title += f", seed {settings['seed']}"
    return title


def _series(rows: list[dict[str, Any]], key: str, scale: float = 1.0) -> list[tuple[int, float]]:
    return [(int(r["round"]), scale * float(r[key])) for r in rows if r.get(key) is not None]


def plot_series(metrics: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """What accuracy.png plots, from a run's metrics rows: ``{"accuracy": {label: [(round, %)]},
    "loss": {label: [(round, loss)]}}``.

    Accuracy: on the test set (with sessions, on the session's classes and on all classes), on the
    validation hold-out when the run has one, and the model each tier deploys where it is not the
    global one (a tier whose accuracy equals the global model's on the full test set at every
    evaluation deploys the same model: no line of its own). Loss: the test loss (likewise), the
    validation loss, and the clients' training loss (mean over the round's clients, weighted by
    their samples)."""
    evals = [r for r in metrics if r.get("accuracy") is not None and not r.get("skipped")]
    acc: dict[str, list[tuple[int, float]]] = {}
    loss: dict[str, list[tuple[int, float]]] = {}
    sessions = any("accuracy_full" in r for r in evals)
    if sessions:
        acc["test, session's classes"] = _series(evals, "accuracy_session", 100)
        acc["test, all classes"] = _series(evals, "accuracy_full", 100)
        full = {int(r["round"]): r.get("accuracy_full") for r in evals}
        test_loss, full_loss = _series(evals, "loss"), _series(evals, "loss_full")
        if test_loss != full_loss:  # the run reports the session's classes (sessions.eval_on_session_classes)
            loss["test, session's classes"] = test_loss
        loss["test, all classes"] = full_loss
        main = "test, all classes"
    else:
        acc["test"] = _series(evals, "accuracy", 100)
        full = {int(r["round"]): r.get("accuracy") for r in evals}
        loss["test"] = _series(evals, "loss")
        main = "test"
    if any("val_accuracy" in r for r in evals):
        acc["validation"] = _series(evals, "val_accuracy", 100)
        loss["validation"] = _series(evals, "val_loss")
    tiers = list(dict.fromkeys(t for r in evals for t in r.get("tier_accuracy") or {}))
    same = []
    for t in tiers:
        vals = [(int(r["round"]), r["tier_accuracy"][t]) for r in evals if t in (r.get("tier_accuracy") or {})]
        if any(v != full.get(rnd) for rnd, v in vals):
            acc[f"tier {t} (deployed model)"] = [(rnd, 100 * float(v)) for rnd, v in vals]
        else:
            same.append(t)
    if same and len(same) < len(tiers):  # some tiers deploy the global model, others their own
        acc = {(f"{k} (global model = tier {', '.join(same)})" if k == main else k): v for k, v in acc.items()}
    train = []
    for r in metrics:
        clients = [c for c in r.get("clients") or () if _finite(c.get("loss"))]
        weight = sum(max(int(c.get("num_samples") or 0), 0) for c in clients)
        if clients:
            mean = (sum(float(c["loss"]) * int(c.get("num_samples") or 0) for c in clients) / weight if weight
                    else sum(float(c["loss"]) for c in clients) / len(clients))
            train.append((int(r["round"]), mean))
    if train:
        loss["training (clients' mean)"] = train
    return {"accuracy": {k: v for k, v in acc.items() if v}, "loss": {k: v for k, v in loss.items() if v}}


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def plot_run(console: Any, result: Any, out: Path, cfg: Any = None) -> Path | None:
    """Write accuracy.png beside the metrics: accuracy and loss against round (see
    :func:`plot_series`) under the method, data set, model and seed (``cfg``, else the run
    directory's config.yaml). Returns its path; ``None`` when nothing was written (no evaluated
    round, or no matplotlib: then a hint on ``console`` when given)."""
    try:
        # deferred: the optional plot extra; a Figure of its own, never pyplot's global state
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        if console is not None:
            console.print("no plot written: install the plot extra with pip install 'fedhetero\\[plot]'")
        return None
    series = plot_series(result.metrics)
    if not series["accuracy"]:
        return None
    fig = Figure(figsize=(7, 6.5), layout="constrained")
    ax_acc, ax_loss = fig.subplots(2, 1, sharex=True)
    for label, points in series["accuracy"].items():
        ax_acc.plot(*zip(*points), label=label, alpha=1.0 if label.startswith(("test", "validation")) else 0.75)
    ax_acc.set_ylabel("accuracy (%)")
    ax_acc.grid(alpha=0.3)
    ax_acc.legend(loc="best", fontsize="small")
    for label, points in series["loss"].items():
        ax_loss.plot(*zip(*points), label=label)
    ax_loss.set_ylabel("loss")
    values = [v for points in series["loss"].values() for _, v in points]
    if values and min(values) > 0 and max(values) / min(values) > 30:  # e.g. training far below test loss
        ax_loss.set_yscale("log")
    ax_loss.set_xlabel("round")
    ax_loss.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_loss.grid(alpha=0.3)
    if series["loss"]:
        ax_loss.legend(loc="best", fontsize="small")
    fig.suptitle(plot_title(result.summary, run_settings(cfg, out)))
    path = Path(out) / "accuracy.png"
    fig.savefig(path, dpi=120)
    return path


#: what the accuracies of a run were measured on (:func:`summary_view`)
TEST_SET = "the test set"
SESSION_CLASSES = "the session's test classes"


def deploys_one_model(summary: dict[str, Any], metrics: list[dict[str, Any]] | None = None) -> bool:
    """Whether every tier of a run deploys one model, the global one: the rule for showing
    per-tier accuracies, the same for every method, in ``fedhetero train``'s table and in
    ``fedhetero compare``'s. The run records it (``summary.json``'s ``one_model``: no tier has a
    model of its own). A summary written before that field existed is judged by its numbers:
    the tiers' accuracies are equal (at every evaluation of ``metrics`` when given, else at the
    end) and the tiers that trained trained the same MACs."""
    tiers = summary.get("tiers") or {}
    if not tiers:
        return False
    if summary.get("one_model") is not None:
        return bool(summary["one_model"])
    accs = [t.get("accuracy") for t in tiers.values()]
    macs = {t.get("macs") for t in tiers.values() if t.get("macs") is not None}
    same = None not in accs and len(set(accs)) == 1 and len(macs) <= 1
    for row in metrics or ():
        if same and row.get("tier_accuracy"):
            same = len({row["tier_accuracy"].get(t) for t in tiers}) == 1
    return same


def summary_view(summary: dict[str, Any], settings: dict[str, Any] | None = None,
                 metrics: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """What the final table shows for a run, only what means something for it:

    * ``accuracy_on``: the set the final accuracy was measured on (:data:`SESSION_CLASSES` with
      sessions and ``sessions.eval_on_session_classes``, else :data:`TEST_SET`); per-tier
      accuracies are always measured on the full test set (``tier_accuracy_on``);
    * ``same_model``: every tier deploys one model (:func:`deploys_one_model`);
    * ``tier_accuracy``: whether the table has a per-tier accuracy column (not when ``same_model``
      and the title gives that one number: the final accuracy, or named by its set when the final
      accuracy is measured on another);
    * ``full_test_accuracy``: that number (on the full test set) when the final accuracy is
      measured on another set, else ``None``;
    * ``merge_tiers``: whether the tiers share one row (they differ in nothing the table shows
      but their client-rounds and bytes: ``same_model``, one budget, no drops).
    """
    settings = settings or {}
    tiers = summary.get("tiers") or {}
    accs = [t.get("accuracy") for t in tiers.values()]
    same_model = deploys_one_model(summary, metrics)
    on = SESSION_CLASSES if _on_session_classes(settings) else TEST_SET
    budgets = {(t.get("ratio"), t.get("budget_macs")) for t in tiers.values()}
    fits = {t.get("fits_budget") for t in tiers.values() if t.get("fits_budget") is not None}
    return {
        "accuracy_on": on,
        "tier_accuracy_on": TEST_SET,
        "same_model": same_model,
        # one model everywhere: its accuracy is the final one, or the title names it by its set
        "tier_accuracy": not same_model or (on == TEST_SET and accs[0] != summary.get("final_accuracy")),
        "full_test_accuracy": accs[0] if same_model and on != TEST_SET else None,
        "merge_tiers": (same_model and len(tiers) > 1 and len(budgets) == 1 and len(fits) <= 1
                        and not summary.get("dropped_clients")),
    }


def _title(summary: dict[str, Any], view: dict[str, Any]) -> str:
    text = f"{summary['algorithm']}: final accuracy {_fmt_acc(summary['final_accuracy'])} %"
    if view["accuracy_on"] != TEST_SET:
        text += f" on {view['accuracy_on']}"
        if view["full_test_accuracy"] is not None:
            text += f", {_fmt_acc(view['full_test_accuracy'])} % on the full test set"
    if summary.get("final_val_accuracy") is not None:
        text += f" (validation {_fmt_acc(summary['final_val_accuracy'])} %)"
    return text


def print_summary(console: Any, summary: dict[str, Any], out: Path | None = None, cfg: Any = None,
                  metrics: list[dict[str, Any]] | None = None) -> None:
    """The final table (one row per tier, or one for all tiers when they differ in nothing it
    shows; see :func:`summary_view`) and the closing line. ``cfg``: the run's config (else the
    run directory's config.yaml), for the set each accuracy was measured on; ``metrics``: the
    run's rows, to tell tiers that deploy one model from tiers whose models scored alike once."""
    view = summary_view(summary, run_settings(cfg, out), metrics)
    # user strings (method, tier names) are printed literally, never read as rich markup
    table = Table(title=Text(_title(summary, view)))
    if view["same_model"] and not view["tier_accuracy"] and len(summary["tiers"]) > 1:
        table.caption = Text("every tier deploys the same model (its accuracy is in the title): no per-tier column")
    drops = bool(summary.get("dropped_clients"))
    cols = ["tier", "ratio", "budget MMACs", "trained MMACs", "fits", "client-rounds", "sent up", "sent down"]
    if view["tier_accuracy"]:
        on_other = view["accuracy_on"] != view["tier_accuracy_on"]
        cols.append("accuracy % (full test set)" if on_other else "accuracy %")
    if drops:
        cols[6:6] = ["dropped", "internal errors"]
    for col in cols:
        table.add_column(col, justify="right")
    rows = list(summary["tiers"].items())
    if view["merge_tiers"]:
        ran = [t for _, t in rows if t.get("client_rounds")] or [rows[0][1]]
        rows = [(", ".join(name for name, _ in rows), {
            **ran[0],
            "client_rounds": sum(t["client_rounds"] for _, t in rows),
            "bytes_up": sum(t.get("bytes_up", 0) for _, t in rows),
            "bytes_down": sum(t.get("bytes_down", 0) for _, t in rows),
        })]
    for name, t in rows:
        extra = [str(t.get("dropped", 0)), str(t.get("internal_errors", 0))] if drops else []
        table.add_row(
            Text(name),
            f"{t['ratio']:g}×",
            _fmt_macs(t["budget_macs"]),
            _fmt_macs(t["macs"]),
            "—" if t["fits_budget"] is None else ("yes" if t["fits_budget"] else "NO"),
            str(t["client_rounds"]),
            *extra,
            _fmt_bytes(t.get("bytes_up", 0)),
            _fmt_bytes(t.get("bytes_down", 0)),
            *([_fmt_acc(t["accuracy"])] if view["tier_accuracy"] else []),
        )
    console.print(table)
    dropped = summary.get("dropped_clients") or 0
    errors = summary.get("internal_errors") or 0
    console.print(
        f"best accuracy {_fmt_acc(summary['best_accuracy'])} %, mean of last 5 "
        f"{_fmt_acc(summary['mean_last5_accuracy'])} %"
        + (f" (on {view['accuracy_on']})" if view["accuracy_on"] != TEST_SET else "")
        + f", sent {_fmt_bytes(summary.get('bytes_up', 0))} up + "
        f"{_fmt_bytes(summary.get('bytes_down', 0))} down, plain model {_fmt_macs(summary['plain_macs'])} MMACs "
        f"per sample (multiply-accumulates), wall {summary['wall_s']:.1f} s"
        + (f", {dropped} client-rounds dropped (see metrics.jsonl)" if dropped else "")
        + (f", of which {errors} by an internal error (a bug: please report it)" if errors else "")
        + (f"; run directory {out}" if out else ""),
        markup=False,
    )
