"""``fedhetero compare``: several algorithms on identical clients, data, budgets and seeds.

Every algorithm runs from the same resolved config except ``algorithm.name`` (and the seed, which
varies over ``seeds`` runs identically for every algorithm), so partitions, tier assignment,
sampling and budgets are the same streams for every method (the engine derives each from the seed
and its concern only). A method that cannot follow the configured dynamic-budget scenario is
reported as N/A, never run with a made-up number.

Outputs in the comparison directory: ``compare.json`` (the settings, written first), one run
directory per (algorithm, seed), ``comparison.json``, ``comparison.csv``, and with matplotlib
installed (the ``plot`` extra) ``accuracy.png`` (accuracy against round) and ``tiers.png`` (per-tier
accuracy). The directory is locked while a comparison runs; one that holds another comparison is
never replaced without ``overwrite``, and ``resume`` continues only a comparison of the same
settings.
"""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import yaml
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from fedhetero.core.hetero.budget import check_budgets
from fedhetero.core.common.config import RunConfig, config_hash, from_dict, to_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.common.configfile import _yaml_problem, apply_overrides, load_config, parse_yaml
from fedhetero.core.local.context import ClientContext, RunError, build_data
from fedhetero.core.run.engine import Engine, check_splits
from fedhetero.core.method.registry import build_algorithm, get_algorithm
from fedhetero.core.run.reports import deploys_one_model
from fedhetero.core.common.rundir import RunDirError, RunLock, atomic_write_text, clear_run, inspect_dir, read_metrics

__all__ = ["accuracy_curves", "compare_settings", "comparison_rows", "default_compare_dir", "run_comparison", "tier_bars",
           "tiers_figure"]


def _cfg_for(base: RunConfig, algorithm: str, seed: int, options: dict[str, Any] | None = None) -> RunConfig:
    data = to_dict(base)
    if data["algorithm"]["name"] != algorithm:
        data["algorithm"] = {"name": algorithm, "options": {}}
    data["algorithm"]["options"].update(options or {})
    data["seed"] = seed
    return from_dict(data)


def parse_options(items: list[str], algorithms: list[str]) -> dict[str, dict[str, Any]]:
    """``["fedap.prune_round=10", …]`` → ``{"fedap": {"prune_round": 10}}`` (values parsed as YAML)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        algo, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"--option {item!r}: expected ALGORITHM.option=value")
        if algo not in algorithms:
            raise ConfigError(f"--option {item!r}: {algo!r} is not among --algorithms ({', '.join(algorithms)})")
        try:
            out.setdefault(algo, {})[name] = parse_yaml(raw)
        except ConfigError as exc:
            raise ConfigError(f"--option {item!r}: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"--option {item!r}: the value is not valid YAML ({_yaml_problem(exc)})") from None
    return out


def _mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None
    return float(np.mean(vals)), float(np.std(vals))


def comparison_rows(results: dict[str, list[dict[str, Any] | None]], tiers: list[str]) -> list[dict[str, Any]]:
    """One row per algorithm: mean ± std over seeds of the summaries (None entries = N/A)."""
    rows = []
    for algo, maybe in results.items():
        summaries = [s for s in maybe if s is not None]
        if len(summaries) < len(maybe):
            rows.append({"algorithm": algo, "status": "N/A"})
            continue
        failed = [s for s in summaries if s.get("status") == "failed"]
        if failed:  # a diverged or failed run: no mean over the seeds that survived
            rows.append({
                "algorithm": algo,
                "status": f"failed ({len(failed)} of {len(summaries)} seeds)",
                "reason": failed[0]["reason"],
            })
            continue
        acc_m, acc_s = _mean_std([s["final_accuracy"] for s in summaries])
        last5_m, last5_s = _mean_std([s["mean_last5_accuracy"] for s in summaries])
        # client-rounds dropped over all seeds, and how many of them by an internal error (a bug:
        # the method's numbers then do not mean what they should, so its status says so)
        dropped = int(sum(s.get("dropped_clients") or 0 for s in summaries))
        errors = int(sum(s.get("internal_errors") or 0 for s in summaries))
        row: dict[str, Any] = {
            "algorithm": algo,
            "status": "ok" if errors == 0 else "internal errors",
            "seeds": len(summaries),
            "dropped_client_rounds": dropped,
            "internal_errors": errors,
            "final_accuracy_mean": acc_m,
            "final_accuracy_std": acc_s,
            "last5_accuracy_mean": last5_m,
            "last5_accuracy_std": last5_s,
            "client_macs_mean": float(np.mean([s["mean_client_macs"] for s in summaries])),
            "sim_time_s_mean": float(np.mean([s["sim_time_s"] for s in summaries])),
            "bytes_total_mean": float(np.mean([s["bytes_total"] for s in summaries])),
            "wall_s_mean": float(np.mean([s["wall_s"] for s in summaries])),
            "all_fit_budget": all(s["all_fit_budget"] for s in summaries),
            # every tier deploys the global model: no per-tier accuracy to show (the same rule as
            # fedhetero train's table)
            "one_model": all(deploys_one_model(s) for s in summaries),
        }
        for t in tiers:
            m, sd = _mean_std([s["tiers"][t]["accuracy"] for s in summaries])
            row[f"acc_{t}_mean"] = m
            row[f"acc_{t}_std"] = sd
            row[f"macs_{t}_mean"] = _mean_std([s["tiers"][t]["macs"] for s in summaries])[0]
            row[f"budget_{t}"] = summaries[0]["tiers"][t]["budget_macs"]
        kappas = [s["kappa_code"] for s in summaries if s.get("kappa_code") is not None]
        if len(kappas) == len(summaries):  # communication cost of methods that report it (DynaComm)
            row["kappa_code_mean"] = float(np.mean(kappas))
            row["kappa_paper_mean"] = float(np.mean([s.get("kappa_paper", np.nan) for s in summaries]))
        keys = sorted(k for k in summaries[0] if k.startswith("transition_") and k.endswith("_accuracy"))
        for k in keys:  # runs with sessions (DynInit): accuracy after each transition
            m, sd = _mean_std([s.get(k) for s in summaries])
            row[f"{k}_mean"], row[f"{k}_std"] = m, sd
        ttt = [s["time_to_target"] for s in summaries if s.get("time_to_target") is not None]
        row["time_to_target_mean"] = float(np.mean(ttt)) if len(ttt) == len(summaries) else None
        row["reached_target"] = len(ttt)
        rows.append(row)
    return rows


def _pct(m: float | None, s: float | None = None) -> str:
    if m is None:
        return "—"
    return f"{100 * m:.2f}" + (f" ± {100 * s:.2f}" if s is not None else "")


def run_comparison(
    *,
    config: str | Path | RunConfig | None,
    overrides: list[str],
    algorithms: list[str],
    seeds: int = 1,
    out: Path | None = None,
    plot: bool = True,
    console: Any = None,
    progress: bool = True,
    resume: bool = False,
    options: list[str] | None = None,
    overwrite: bool = False,
) -> list[dict[str, Any]]:
    """Run the comparison and write its files; returns the table rows.

    ``config``: a YAML file, a resolved config or None (the defaults), with ``overrides`` applied;
    ``options`` are ``ALGORITHM.option=value`` strings for individual methods."""
    if not algorithms:
        raise ConfigError("--algorithms: give at least one algorithm name")
    if seeds < 1:
        raise ConfigError("--seeds: must be at least 1")
    for a in algorithms:
        get_algorithm(a)  # fail fast on unknown names
    if isinstance(config, RunConfig):
        base = from_dict(apply_overrides(to_dict(config), overrides)) if overrides else config
    else:
        base = load_config(config, overrides)
    per_algo = parse_options(options or [], algorithms)

    ctx = None
    for a in algorithms:  # every option, needed split and budget checked before anything runs
        cfg_a = _cfg_for(base, a, base.seed, per_algo.get(a))
        algo = build_algorithm(cfg_a)
        check_splits(cfg_a, type(algo), allow_unused=True)
        if base.budget.scenario in type(algo).adapts_to:  # else reported as N/A
            ctx = ctx or ClientContext(base, build_data(base), torch.device(base.device))
            check_budgets(cfg_a, algo, ctx)
    settings = compare_settings(base, algorithms, seeds, per_algo)
    out = out or default_compare_dir(base, settings)
    created = not out.exists()
    _check_compare_dir(out, settings, resume=resume, overwrite=overwrite)
    out.mkdir(parents=True, exist_ok=True)
    lock = RunLock(out).acquire()
    try:
        _check_compare_dir(out, settings, resume=resume, overwrite=overwrite)  # again, under the lock
        if overwrite and not resume:
            _clear_compare_dir(out)
        atomic_write_text(out / _SETTINGS, json.dumps(settings, indent=2, sort_keys=True))
        created = False
        return _run_all(out, base, algorithms, seeds, per_algo, plot=plot, console=console, progress=progress,
                        resume=resume)
    finally:
        lock.release()
        if created and [q.name for q in out.iterdir()] == [".lock"]:
            (out / ".lock").unlink()
            out.rmdir()


def compare_settings(base: RunConfig, algorithms: list[str], seeds: int, per_algo: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What identifies a comparison (``compare.json``): the config hash, algorithms, seeds and options."""
    return {"config_hash": config_hash(base), "algorithms": algorithms, "seeds": seeds, "options": per_algo}


def default_compare_dir(base: RunConfig, settings: dict[str, Any]) -> Path:
    """``runs/compare-<dataset>-<model>-<settings hash>``: comparisons of other settings land elsewhere."""
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    return Path("runs") / f"compare-{base.data.dataset}-{base.model.name}-{key}"


#: the comparison's own files besides its run directories <algorithm>/seed<N>/
_SETTINGS = "compare.json"
_COMPARE_FILES = (_SETTINGS, "comparison.json", "comparison.csv", "accuracy.png", "tiers.png")


def _run_dirs(out: Path) -> list[Path]:
    return sorted(s for a in out.iterdir() if a.is_dir() for s in a.iterdir() if s.is_dir() and s.name.startswith("seed"))


def _check_compare_dir(out: Path, settings: dict[str, Any], *, resume: bool, overwrite: bool) -> None:
    """Refuse a directory the comparison may not use: anything that is not a comparison's; another
    comparison without ``overwrite``; on ``resume``, a comparison of other settings."""
    if not out.exists():
        return
    if not out.is_dir():
        raise RunDirError(f"{out} is not a directory")
    foreign = []
    held = False
    for p in sorted(out.iterdir()):
        if p.name == ".lock" or (p.name in _COMPARE_FILES and p.is_file()):
            held = held or p.name != ".lock"
        elif p.is_dir() and any(p.iterdir()) and all(s.is_dir() and s.name.startswith("seed") for s in p.iterdir()):
            held = True
            for run in p.iterdir():
                foreign += [f"{p.name}/{run.name}/{f}" for f in inspect_dir(run).foreign]
        else:
            foreign.append(p.name + ("/" if p.is_dir() else ""))
    if foreign:
        raise RunDirError(
            f"{out} holds files that are not part of a fedhetero comparison ({', '.join(foreign[:5])}); fedhetero "
            "never deletes or replaces files it did not write: choose an empty or new --out"
        )
    if not held:
        return
    if resume:
        try:
            saved = json.loads((out / _SETTINGS).read_text())
        except (OSError, json.JSONDecodeError):
            raise RunDirError(f"--resume: {out} holds no readable {_SETTINGS}; it cannot be continued") from None
        now = json.loads(json.dumps(settings))  # as written to the file (tuples as lists)
        diff = [k for k in ("config_hash", "algorithms", "seeds", "options") if saved.get(k) != now.get(k)]
        if diff:
            what = ", ".join("the config" if k == "config_hash" else k for k in diff)
            raise RunDirError(
                f"--resume: {out} holds a comparison with other settings ({what} differ); continue it with the "
                "same --config/--set/--algorithms/--seeds/--option, or choose another --out"
            )
    elif not overwrite:
        raise RunDirError(
            f"{out} already holds a comparison; continue it with --resume (same settings), replace it with "
            "--overwrite, or choose another --out"
        )


def _clear_compare_dir(out: Path) -> None:
    """Delete what a comparison wrote (its files and run directories; nothing else is there)."""
    for run in _run_dirs(out):
        clear_run(run)
        (run / ".lock").unlink(missing_ok=True)
        run.rmdir()
    for algo in [p for p in out.iterdir() if p.is_dir()]:
        algo.rmdir()
    for name in _COMPARE_FILES:
        (out / name).unlink(missing_ok=True)


def _run_all(
    out: Path,
    base: RunConfig,
    algorithms: list[str],
    seeds: int,
    per_algo: dict[str, dict[str, Any]],
    *,
    plot: bool,
    console: Any,
    progress: bool,
    resume: bool,
) -> list[dict[str, Any]]:
    tiers = [t.name for t in base.budget.tiers]
    results: dict[str, list[dict[str, Any] | None]] = {}
    histories: dict[str, list[list[dict[str, Any]]]] = {}
    for algo in algorithms:
        cls = get_algorithm(algo)
        results[algo] = []
        histories[algo] = []
        if base.budget.scenario not in cls.adapts_to:
            if console is not None:
                console.print(f"[yellow]{escape(algo)}[/yellow]: cannot follow the '{base.budget.scenario}' budget scenario → N/A")
            results[algo] = [None]
            continue
        for s in range(seeds):
            cfg = _cfg_for(base, algo, base.seed + s, per_algo.get(algo))
            run_dir = out / algo / f"seed{base.seed + s}"
            done = run_dir / "summary.json"
            if resume and done.is_file():
                summary = json.loads(done.read_text())
                hist = read_metrics(run_dir / "metrics.jsonl")
            else:
                if console is not None and progress:
                    console.print(f"[bold]{escape(algo)}[/bold] seed {base.seed + s}")
                can_resume = resume and (run_dir / "checkpoint.pt").is_file()
                engine = Engine(
                    None if can_resume else cfg, run_dir, resume=can_resume, progress=progress, console=console,
                    overwrite=not can_resume,  # the comparison owns its run directories
                    shared_splits=True,
                )
                try:
                    res = engine.run()
                except RunError as exc:  # one method diverging must not stop the comparison
                    reason = str(exc).splitlines()[0]
                    if console is not None:
                        console.print(f"{algo} seed {base.seed + s}: failed: {reason}", markup=False, style="yellow")
                    results[algo].append({"status": "failed", "reason": reason})
                    histories[algo].append(read_metrics(run_dir / "metrics.jsonl"))
                    continue
                summary, hist = res.summary, res.metrics
            results[algo].append(summary)
            histories[algo].append(hist)
    rows = comparison_rows(results, tiers)
    _write(out, rows, base, algorithms, seeds, per_algo)
    if console is not None:
        table = Table(title=f"{base.data.dataset} / {base.model.name} / {base.data.partition}"
                      + (f" β={base.data.alpha:g}" if base.data.partition == "dirichlet" else "")
                      + f" / budgets {base.budget.scenario} / {seeds} seed(s)")
        table.add_column("algorithm")
        table.add_column("final acc %", justify="right")
        # per-tier accuracies only for methods whose tiers deploy models of their own
        tier_acc = any(r.get("one_model") is False for r in rows)
        if any(r.get("one_model") for r in rows) and tier_acc:
            table.caption = Text("—: every tier deploys the method's one model (its accuracy: final acc %)")
        for t in tiers if tier_acc else ():
            table.add_column(Text(f"{t} acc %"), justify="right")
        for t in tiers:
            table.add_column(Text(f"{t} MMACs"), justify="right")
        table.add_column("client MMACs", justify="right")
        if base.train.target_accuracy is not None:
            table.add_column(f"time to {100 * base.train.target_accuracy:g} % (sim s)", justify="right")
        show_kappa = any("kappa_code_mean" in r for r in rows)
        if show_kappa:
            table.add_column("κ", justify="right")
        table.add_column("bytes/run", justify="right")
        table.add_column("dropped", justify="right")
        table.add_column("errors", justify="right")
        table.add_column("wall s", justify="right")
        for r in rows:
            if "final_accuracy_mean" not in r:  # N/A or failed
                cell = "N/A" if r["status"] == "N/A" else r["status"]
                table.add_row(Text(r["algorithm"]), cell, *(["—"] * ((1 + tier_acc) * len(tiers) + 5
                                                                     + (base.train.target_accuracy is not None) + show_kappa)))
                continue
            ttt_cell = []
            if base.train.target_accuracy is not None:
                t = r["time_to_target_mean"]
                ttt_cell = ["not reached" if t is None else f"{t:.1f}"]
            table.add_row(
                Text(r["algorithm"]),
                _pct(r["final_accuracy_mean"], r["final_accuracy_std"] if seeds > 1 else None),
                *[("—" if r["one_model"] else _pct(r[f"acc_{t}_mean"])) for t in (tiers if tier_acc else ())],
                *[("—" if r[f"macs_{t}_mean"] is None else f"{r[f'macs_{t}_mean'] / 1e6:.3f}") for t in tiers],
                f"{r['client_macs_mean'] / 1e6:.3f}",
                *ttt_cell,
                *([f"{r['kappa_code_mean']:.4f}" if "kappa_code_mean" in r else "—"] if show_kappa else []),
                f"{r['bytes_total_mean'] / 2**20:.1f} MiB",
                str(r["dropped_client_rounds"]),
                str(r["internal_errors"]),
                f"{r['wall_s_mean']:.1f}",
            )
        console.print(table)
    plots = _plot(out, histories, tiers, console, title=_plot_title(base, seeds)) if plot else []
    if console is not None:
        written = [out / "comparison.csv", out / "comparison.json", *plots]
        console.print(f"written: {', '.join(str(p) for p in written)}", markup=False)
    return rows


def _plot_title(base: RunConfig, seeds: int) -> str:
    seed = f"seed {base.seed}" if seeds == 1 else f"seeds {base.seed}–{base.seed + seeds - 1} (mean)"
    return f"{base.data.dataset} ({base.model.name}), {seed}"


def _write(out: Path, rows: list[dict[str, Any]], base: RunConfig, algorithms: list[str], seeds: int, options: dict[str, Any]) -> None:
    (out / "comparison.json").write_text(
        json.dumps({"config": to_dict(base), "algorithms": algorithms, "seeds": seeds, "options": options, "rows": rows}, indent=2)
    )
    keys: list[str] = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    with (out / "comparison.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys, restval="N/A")
        w.writeheader()
        for r in rows:
            w.writerow(r)


def accuracy_curves(histories: dict[str, list[list[dict[str, Any]]]]) -> dict[str, tuple[list[int], list[float]]]:
    """accuracy.png's lines: per algorithm, the rounds every seed evaluated and the mean test
    accuracy (%) over the seeds there (a failed seed's shorter history cuts the line)."""
    out = {}
    for algo, runs in histories.items():
        evals = [{r["round"]: r["accuracy"] for r in h if r.get("accuracy") is not None} for h in runs]
        if not evals:
            continue
        rounds = sorted(set.intersection(*(set(e) for e in evals)))
        if rounds:
            out[algo] = (rounds, [100 * float(np.mean([e[r] for e in evals])) for r in rounds])
    return out


def tier_bars(histories: dict[str, list[list[dict[str, Any]]]], tiers: list[str]) -> dict[str, list[float]]:
    """tiers.png's bars: per tier, the final accuracy (%) of the model it deploys for each
    algorithm that ran (mean over its seeds; 0 where none was evaluated)."""
    algos = [a for a, runs in histories.items() if runs]
    bars = {}
    for t in tiers:
        vals = []
        for a in algos:
            last = [h[-1]["tier_accuracy"][t] for h in histories[a] if h and t in (h[-1].get("tier_accuracy") or {})]
            vals.append(100 * float(np.mean(last)) if last else 0.0)
        bars[t] = vals
    return bars


def tiers_figure(histories: dict[str, list[list[dict[str, Any]]]], tiers: list[str], title: str = "") -> Any:
    """The figure of tiers.png (a :class:`matplotlib.figure.Figure`): grouped bars, the legend to
    the right of the axes, where it covers no bar."""
    from matplotlib.figure import Figure  # deferred: the optional plot extra

    algos = [a for a, runs in histories.items() if runs]
    fig = Figure(figsize=(7 + 0.4 * max(len(algos) - 6, 0), 4.5), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / max(len(tiers), 1)
    for i, (t, vals) in enumerate(tier_bars(histories, tiers).items()):
        ax.bar(np.arange(len(algos)) + i * width, vals, width, label=t)
    ax.set_xticks(np.arange(len(algos)) + width * (len(tiers) - 1) / 2, algos, rotation=30, ha="right")
    ax.set_ylabel("accuracy of the deployed model (%)")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"per-tier accuracy, last round: {title}" if title else "per-tier accuracy, last round")
    fig.legend(title="tier", loc="outside right upper")
    return fig


def _plot(out: Path, histories: dict[str, list[list[dict[str, Any]]]], tiers: list[str], console: Any,
          title: str = "") -> list[Path]:
    """Write accuracy.png and tiers.png; returns their paths (none without matplotlib: then a hint)."""
    try:
        from matplotlib.figure import Figure  # deferred: the optional plot extra; no pyplot state
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        if console is not None:
            console.print("[dim]matplotlib not installed (pip install 'fedhetero\\[plot]'): no PNG plots[/dim]")
        return []
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    for algo, (rounds, accs) in accuracy_curves(histories).items():
        ax.plot(rounds, accs, label=algo)
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"test accuracy: {title}" if title else "test accuracy")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(out / "accuracy.png", dpi=120)
    fig = tiers_figure(histories, tiers, title)
    fig.savefig(out / "tiers.png", dpi=120)
    return [out / "accuracy.png", out / "tiers.png"]
