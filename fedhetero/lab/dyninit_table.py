"""``fedhetero dyninit-table``: the DynInit study's transition table on a data set you have.

Runs (or reuses) every cell of the grid label overlap × Dirichlet α × host algorithm × method
(DynInit, Continuous, Previous, Average) × seed from one base config (by default
``examples/configs/fmnist_dyninit.yaml``), in parallel worker processes, then prints and writes:

* ``table_transitions.md``: accuracy (mean ± std over the seeds) over the first rounds after the
  2nd and 4th transitions, next to the published Fashion-MNIST numbers;
* ``table_time_to_accuracy.md``: rounds to reach ρ × DynInit's best accuracy in the session
  (main-training rounds; "charged" adds DynInit's extra gradient rounds), the speed-up, the
  accumulated accuracy gain of DynInit over each baseline, and the latency and energy those rounds
  cost under the wireless model of :class:`fedhetero.core.hetero.sessions.EnergyModel`;
* ``results.json`` (every number) and, with matplotlib, ``accuracy_sessions.png`` (accuracy over
  rounds of the four methods for the first cell, session boundaries marked).

Continuous trains FedAvg-style whatever the host (as in the study), so its runs are shared by the
hosts that use the same learning rate. Finished runs are reused; an interrupted table is continued
by running the command again.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from fedhetero.core.common.configfile import load_config
from fedhetero.core.common.console import make_console
from fedhetero.core.local.context import client_context
from fedhetero.core.common.rundir import finite_json
from fedhetero.core.hetero.sessions import EnergyModel
from fedhetero.lab.grid import run_grid

__all__ = ["METHODS", "PAPER_FMNIST", "build_table", "plan_runs", "run_table"]

METHODS = ("dyninit", "continuous", "previous", "average")
LABEL = {"dyninit": "Proposed", "continuous": "Continuous", "previous": "Previous", "average": "Average"}
HOST_OPTIONS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "fedprox": {"mu": 1.0},
    "scaffold": {"variant": "dyninit"},
    "moon": {"mu": 1.0, "tau": 1.0},
    "fedacg": {"lam": 0.5, "beta": 0.1},
}
# the study's Fashion-MNIST learning rates (initial rate, final rate as a fraction of it)
HOST_LR: dict[str, tuple[float, float]] = {"scaffold": (0.03, 0.9)}
DEFAULT_LR = (0.003, 0.3)

#: Published Fashion-MNIST rows (100 devices; accuracy % after the 2nd and 4th transitions):
#: (overlap, alpha, host) -> {method: (2nd, 4th)}.
PAPER_FMNIST: dict[tuple[float, float, str], dict[str, tuple[float, float]]] = {
    (0.0, 0.3, "moon"): {"dyninit": (83.13, 84.88), "continuous": (59.36, 64.58), "previous": (77.09, 79.48), "average": (77.84, 80.04)},
    (0.0, 0.3, "fedprox"): {"dyninit": (83.19, 84.22), "continuous": (59.36, 64.58), "previous": (77.74, 79.90), "average": (78.57, 80.52)},
    (0.0, 0.3, "scaffold"): {"dyninit": (77.80, 79.88), "continuous": (65.94, 74.69), "previous": (47.74, 53.64), "average": (47.93, 60.72)},
    (0.0, 0.3, "fedacg"): {"dyninit": (85.10, 85.82), "continuous": (59.36, 64.58), "previous": (77.61, 80.01), "average": (80.44, 82.22)},
    (0.0, 0.7, "moon"): {"dyninit": (83.29, 84.89), "continuous": (60.72, 65.36), "previous": (77.59, 79.86), "average": (78.32, 80.26)},
    (0.0, 0.7, "fedprox"): {"dyninit": (83.33, 84.29), "continuous": (60.72, 65.36), "previous": (78.16, 80.28), "average": (78.93, 80.72)},
    (0.0, 0.7, "scaffold"): {"dyninit": (78.43, 80.49), "continuous": (68.57, 70.81), "previous": (47.32, 53.02), "average": (48.45, 61.01)},
    (0.0, 0.7, "fedacg"): {"dyninit": (85.17, 85.81), "continuous": (60.72, 65.36), "previous": (78.03, 80.45), "average": (80.68, 82.41)},
    (0.2, 0.3, "moon"): {"dyninit": (82.88, 84.30), "continuous": (72.53, 75.78), "previous": (74.83, 77.15), "average": (76.78, 79.48)},
    (0.2, 0.3, "fedprox"): {"dyninit": (82.91, 83.81), "continuous": (72.53, 75.78), "previous": (75.55, 77.63), "average": (77.69, 79.96)},
    (0.2, 0.3, "scaffold"): {"dyninit": (77.35, 79.45), "continuous": (69.90, 70.79), "previous": (55.82, 61.12), "average": (50.39, 61.10)},
    (0.2, 0.3, "fedacg"): {"dyninit": (84.63, 85.36), "continuous": (72.53, 75.78), "previous": (76.09, 77.92), "average": (79.21, 81.54)},
    (0.2, 0.7, "moon"): {"dyninit": (83.02, 84.36), "continuous": (73.73, 76.53), "previous": (75.38, 77.54), "average": (77.31, 79.79)},
    (0.2, 0.7, "fedprox"): {"dyninit": (83.04, 83.95), "continuous": (73.73, 76.53), "previous": (75.99, 78.06), "average": (78.14, 80.22)},
    (0.2, 0.7, "scaffold"): {"dyninit": (77.88, 79.85), "continuous": (74.14, 74.03), "previous": (55.77, 60.69), "average": (50.02, 60.68)},
    (0.2, 0.7, "fedacg"): {"dyninit": (84.70, 85.41), "continuous": (73.73, 76.53), "previous": (76.45, 78.31), "average": (79.65, 81.82)},
}


def _lr(host: str) -> tuple[float, float]:
    lr, ratio = HOST_LR.get(host, DEFAULT_LR)
    return lr, lr * ratio


def cell_overrides(overlap: float, alpha: float, host: str, method: str, seed: int) -> list[str]:
    """``--set`` overrides of one run."""
    lr, lr_min = _lr(host)
    opts = HOST_OPTIONS.get(host, {})
    flow = "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in opts.items()) + "}"
    return [
        f"data.group_overlap={overlap}", f"data.alpha={alpha}", f"seed={seed}",
        f"train.lr={lr}", f"train.lr_min={lr_min}",
        f"algorithm.options.host={host}", f"algorithm.options.host_options={flow}",
        f"algorithm.options.init={method}",
    ]


def plan_runs(overlaps: list[float], alphas: list[float], hosts: list[str], methods: list[str],
              seeds: list[int]) -> dict[tuple[float, float, str, str, int], str]:
    """Cell → run name; Continuous runs are shared by the hosts with the same learning rate (it
    trains FedAvg-style whatever the host)."""
    out = {}
    for o in overlaps:
        for a in alphas:
            for h in hosts:
                for m in methods:
                    for s in seeds:
                        who = f"lr{_lr(h)[0]:g}" if m == "continuous" else h
                        out[(o, a, h, m, s)] = f"o{o:g}-a{a:g}/{who}-{m}/s{s}"
    return out


def _load(out_dir: Path) -> dict[str, Any] | None:
    path = out_dir / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary["_acc"] = {
        int(r["session"]): [float(x["accuracy"]) for x in rows if x.get("session") == r["session"] and "accuracy" in x]
        for r in rows if "session" in r
    }
    return summary


def _ms(vals: list[float]) -> tuple[float, float]:
    return float(np.mean(vals)), float(np.std(vals))


def build_table(out: Path, runs: dict[tuple[float, float, str, str, int], str], *, transitions: tuple[int, ...] = (2, 4),
                rho: float = 0.95, pilot: int = 1, grad_rounds: int = 1, energy: dict[str, float] | None = None) -> dict[str, Any]:
    """Read the runs and write the two tables and ``results.json``; returns the numbers."""
    summaries = {key: _load(out / name) for key, name in runs.items()}
    cells = sorted({k[:3] for k in runs})
    seeds = sorted({k[4] for k in runs})
    methods = [m for m in METHODS if any(k[3] == m for k in runs)]
    lines = [
        "| overlap | α | host | transition | " + " | ".join(f"{LABEL[m]} (ours)" for m in methods)
        + " | " + " | ".join(f"{LABEL[m]} (paper)" for m in methods) + " |",
        "|---|---|---|---|" + "---|" * (2 * len(methods)),
    ]
    numbers: dict[str, Any] = {"cells": []}
    tta_lines = [
        "| overlap | α | host | transition | method | rounds to target | speed-up | speed-up (charged) | "
        "accumulated gain of DynInit (pp) | latency (s) | energy (kJ) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for o, a, h in cells:
        cell: dict[str, Any] = {"overlap": o, "alpha": a, "host": h, "transitions": {}}
        for k in transitions:
            row = [f"{o:g}", f"{a:g}", h, str(k)]
            ours, paper = [], []
            tnum: dict[str, Any] = {}
            for m in methods:
                got = [s.get(f"transition_{k}_accuracy") for s in (summaries.get((o, a, h, m, sd)) for sd in seeds) if s]
                vals = [float(v) for v in got if v is not None]
                if vals:
                    mean, std = _ms([100 * v for v in vals])
                    ours.append(f"{mean:.2f} ± {std:.2f}")
                    tnum[m] = {"mean": mean, "std": std, "seeds": len(vals)}
                else:
                    ours.append("–")
                ref = PAPER_FMNIST.get((o, a, h), {}).get(m)
                paper.append(f"{ref[0 if k == 2 else 1]:.2f}" if ref and k in (2, 4) else "–")
            lines.append("| " + " | ".join(row + ours + paper) + " |")
            # time to accuracy and accumulated gain, per seed, against DynInit's session peak
            session = pilot + k + 1
            tta: dict[str, list[float]] = {m: [] for m in methods}
            gain: dict[str, list[float]] = {m: [] for m in methods}
            for sd in seeds:
                prop = summaries.get((o, a, h, "dyninit", sd))
                if not prop or session not in prop["_acc"]:
                    continue
                target = rho * max(prop["_acc"][session])
                for m in methods:
                    s = summaries.get((o, a, h, m, sd))
                    if not s or session not in s["_acc"]:
                        continue
                    acc = s["_acc"][session]
                    hit = next((i + 1 for i, v in enumerate(acc) if v >= target), math.inf)
                    tta[m].append(float(hit))
                    gain[m].append(sum(100 * (p - q) for p, q in zip(prop["_acc"][session], acc)))
            base = float(np.mean(tta["dyninit"])) if tta.get("dyninit") else math.nan
            for m in methods:
                if not tta[m]:
                    continue
                # a seed that never reaches the target within the session is shown as such; the
                # other columns average the seeds that reach it
                reached = [v for v in tta[m] if math.isfinite(v)]
                never = len(tta[m]) - len(reached)
                rr = float(np.mean(reached)) if reached else math.inf
                lat = rr * energy["latency_s"] if energy else math.nan
                en = rr * energy["energy_j"] / 1000 if energy else math.nan
                speed = "–" if m == "dyninit" else f"{rr / base:.1f}×"
                charged = "–" if m == "dyninit" else f"{rr / (base + grad_rounds):.1f}×"
                g = "–" if m == "dyninit" else f"{np.mean(gain[m]):+.1f}"
                rounds = f"{rr:.1f}" + (f" ({never} of {len(tta[m])} seeds never)" if never and reached else "")
                if not reached:
                    rounds, speed, charged = "never", "–", "–"
                tta_lines.append(f"| {o:g} | {a:g} | {h} | {k} | {LABEL[m]} | {rounds} | {speed} | {charged} | {g} | "
                                 + (f"{lat:.2f} | {en:.4f} |" if reached else "– | – |"))
                tnum.setdefault(m, {}).update({
                    "rounds_to_target": rr if reached else None,  # over the seeds that reach it
                    "seeds_never_reaching_target": never,
                    "accumulated_gain_of_dyninit": float(np.mean(gain[m])),
                })
            cell["transitions"][k] = tnum
        numbers["cells"].append(cell)
    (out / "table_transitions.md").write_text("\n".join(lines) + "\n")
    (out / "table_time_to_accuracy.md").write_text("\n".join(tta_lines) + "\n")
    failed = [name for key, name in runs.items() if summaries.get(key) is None]
    numbers["missing_runs"] = failed
    numbers["energy_per_round"] = energy
    (out / "results.json").write_text(json.dumps(finite_json(numbers), indent=2))
    return {"transitions": "\n".join(lines), "tta": "\n".join(tta_lines), "numbers": numbers}


def plot_sessions(out: Path, run_dirs: dict[str, Path], path: Path) -> bool:
    """Accuracy over rounds of several runs with the session boundaries marked (matplotlib)."""
    try:  # deferred: matplotlib is optional (the plot is skipped without it) and slow to import
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bounds: set[int] = set()
    for label, d in run_dirs.items():
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
        pts = [(r["round"], 100 * r["accuracy"]) for r in rows if "accuracy" in r]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, lw=1.2)
        bounds.update(r["round"] for r in rows if r.get("session_round") == 1 and r["round"] > 1)
    for b in sorted(bounds):
        ax.axvline(b - 0.5, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy on the session's classes (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run_table(*, config: str, overrides: list[str], out: str | Path, overlaps: list[float], alphas: list[float],
              hosts: list[str], methods: list[str], seeds: list[int], jobs: int, rho: float, run: bool) -> int:
    """``fedhetero dyninit-table``: run (with ``run``) the grid's unfinished runs from the base
    ``config`` with ``overrides``, ``jobs`` at a time, into ``out``; write and print both tables;
    returns the exit status (1 when runs are missing, 2 for an unknown method)."""
    console = make_console()
    base = load_config(config, overrides=overrides)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    bad = [m for m in methods if m not in METHODS]
    if bad:
        console.print(f"[red]unknown method(s) {', '.join(bad)}; choose from {', '.join(METHODS)}[/red]")
        return 2
    runs = plan_runs(overlaps, alphas, hosts, methods, seeds)
    grid: dict[str, list[str]] = {}
    for key, name in runs.items():
        grid.setdefault(name, list(overrides) + cell_overrides(key[0], key[1], key[2], key[3], key[4]))
    wall = 0.0
    if run:
        done = run_grid(config, grid, out, jobs, report=lambda line: console.print(line, markup=False, highlight=False))
        wall = done["wall_s"]
    devices = len(base.sessions.devices[0]) if base.sessions.devices else base.data.num_clients // 2
    ctx = client_context(base)
    model = ctx.build_model()
    params = sum(p.numel() for p in model.parameters())
    phi = 2.0 * ctx.plain_macs / params  # forward FLOPs per parameter
    steps = max(1, math.ceil(np.mean([len(ix) for ix in ctx.data.client_indices]) / base.train.batch_size)) * base.train.local_epochs
    cost = EnergyModel().round_cost(params, phi, devices, steps=steps, batch=base.train.batch_size, rng=0)
    res = build_table(out, runs, rho=rho, grad_rounds=1, energy=cost)
    console.print(res["transitions"], markup=False, highlight=False, soft_wrap=True)
    console.print(res["tta"], markup=False, highlight=False, soft_wrap=True)
    first = next(iter(runs))
    plotted = plot_sessions(out, {LABEL[m]: out / runs[(first[0], first[1], first[2], m, first[4])] for m in methods
                                  if (out / runs[(first[0], first[1], first[2], m, first[4])] / "metrics.jsonl").is_file()},
                            out / "accuracy_sessions.png")
    console.print(f"runs took {wall / 60:.1f} min; tables in {out}" + ("; plot accuracy_sessions.png" if plotted else ""), highlight=False)
    return 0 if not res["numbers"]["missing_runs"] else 1
