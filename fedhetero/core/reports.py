"""What a finished run reports: its run directory's default name, the summary table and the plot.

Shared by the command line and the integrations (Flower's simulation and ServerApp print the same
table), so it lives apart from the CLI, which nothing in the runtime imports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from fedhetero.core.config import config_hash

__all__ = ["default_out_dir", "plot_run", "print_summary"]


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
    other settings land in other directories."""
    algo = Path(cfg.algorithm.name.split(":")[-1]).name
    return Path("runs") / f"{algo}-{cfg.data.dataset}-{cfg.model.name}-s{cfg.seed}-{config_hash(cfg)[:8]}"


def plot_run(console: Any, result: Any, out: Path) -> None:
    """accuracy.png beside the metrics (needs the plot extra; otherwise a hint)."""
    try:
        import matplotlib  # deferred: the optional plot extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.print("no plot written: install the plot extra with pip install 'fedhetero\\[plot]'")
        return
    rows = [r for r in result.metrics if r.get("accuracy") is not None]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["round"] for r in rows], [100 * r["accuracy"] for r in rows], label="global")
    tiers = sorted({t for r in rows for t in r.get("tier_accuracy", {})})
    for t in tiers:
        vals = [100 * r["tier_accuracy"][t] for r in rows if t in r.get("tier_accuracy", {})]
        if vals != [100 * r["accuracy"] for r in rows]:
            ax.plot([r["round"] for r in rows], vals, label=f"tier {t}", alpha=0.7)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(result.summary.get("algorithm", ""))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=120)
    plt.close(fig)


def print_summary(console: Any, summary: dict[str, Any], out: Path | None = None) -> None:
    # user strings (method, tier names) are printed literally, never read as rich markup
    table = Table(title=Text(f"{summary['algorithm']}: final accuracy {_fmt_acc(summary['final_accuracy'])} %"))
    drops = bool(summary.get("dropped_clients"))
    cols = ["tier", "ratio", "budget MMACs", "trained MMACs", "fits", "client-rounds", "sent up", "sent down", "accuracy %"]
    if drops:
        cols[6:6] = ["dropped", "internal errors"]
    for col in cols:
        table.add_column(col, justify="right")
    for name, t in summary["tiers"].items():
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
            _fmt_acc(t["accuracy"]),
        )
    console.print(table)
    dropped = summary.get("dropped_clients") or 0
    errors = summary.get("internal_errors") or 0
    console.print(
        f"best accuracy {_fmt_acc(summary['best_accuracy'])} %, mean of last 5 "
        f"{_fmt_acc(summary['mean_last5_accuracy'])} %, sent {_fmt_bytes(summary.get('bytes_up', 0))} up + "
        f"{_fmt_bytes(summary.get('bytes_down', 0))} down, plain model {_fmt_macs(summary['plain_macs'])} MMACs "
        f"per sample (multiply-accumulates), wall {summary['wall_s']:.1f} s"
        + (f", {dropped} client-rounds dropped (see metrics.jsonl)" if dropped else "")
        + (f", of which {errors} by an internal error (a bug: please report it)" if errors else "")
        + (f"; run directory {out}" if out else ""),
        markup=False,
    )
