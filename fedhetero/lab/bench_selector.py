"""``fedhetero bench selector``: DynaComm's group selectors side by side.

For each number of active clients ``n`` (10, 50, 100 by default) the benchmark draws ``repeats``
rounds of ``n`` clients from a label-Dirichlet partition of a balanced pool (``--population``
clients, default ``10·n`` so that ``n`` is the paper's C = 0.1 of the federation; ``--samples``
samples per client, ``--classes`` classes, concentration ``--alpha``) and runs, on the same round,
every selector of :mod:`fedhetero.algorithms.dynacomm.selection`:

* ``ensemble_dp`` — the default selector (``--orders`` random client orders);
* ``exhaustive`` — every subset, only where ``n <= --exhaustive-max`` (2^n subsets);
* ``random`` — a uniformly random subset of the size ``ensemble_dp`` picked (the paper's Random);
* ``genetic`` — the genetic algorithm (``--ga-population``, ``--ga-iterations``,
  ``--ga-mutation``).

It reports, per selector and ``n``, the mean KL divergence reached (pooled label distribution of
the chosen group against the pool's class frequencies), the mean group size and the median and
maximum wall time of one call. Without ``--beta`` the selectors are unconstrained (the setting of
the paper's selector-quality figures); ``--beta B`` allows at most ``⌊B·n⌋`` high-frequency clients
(Dynamic-β). The default selector's targets are 10 ms at ``n = 10`` and 1 s at ``n = 100``.
``--json PATH`` writes every number.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedhetero.algorithms.dynacomm import selection as dynacomm
from fedhetero.data.partition import dirichlet, label_histograms

__all__ = ["SELECTORS", "TARGETS_S", "print_table", "run_benchmark"]

#: Time targets of the default selector per call (seconds) by number of active clients.
TARGETS_S = {10: 0.010, 100: 1.0}
SELECTORS = ("ensemble_dp", "exhaustive", "random", "genetic")


def _budget(n: int, beta: float | None) -> dynacomm.Budget | None:
    if beta is None:
        return None
    return dynacomm.Budget(client=(1.0,) * n, server=float(math.floor(beta * n)), nu_high=1.0, nu_low=0.0)


def run_benchmark(
    clients: Sequence[int] = (10, 50, 100),
    *,
    repeats: int = 3,
    population: int | None = None,
    samples: int = 500,
    classes: int = 10,
    alpha: float = 0.1,
    beta: float | None = None,
    orders: int = 10,
    exhaustive_max: int = 12,
    ga_population: int = 50,
    ga_iterations: int = 200,
    ga_mutation: float = 0.01,
    selectors: Sequence[str] = SELECTORS,
    seed: int = 0,
) -> dict[str, Any]:
    """Run the benchmark and return a JSON-ready dict (``rows``: one per client count and
    selector with ``kl_mean``, ``size_mean``, ``time_median_s``, ``time_max_s``; ``skipped`` rows
    say why a selector did not run)."""
    if not clients or min(clients) < 1 or repeats < 1 or classes < 1 or samples < 1:
        raise ValueError("clients, repeats, classes and samples must be positive")
    unknown = sorted(set(selectors) - set(SELECTORS))
    if unknown:
        raise ValueError(f"unknown selector(s) {unknown}; accepted: {', '.join(SELECTORS)}")
    rng = np.random.default_rng(seed)

    def call(
        name: str, h: np.ndarray, global_dist: np.ndarray, budget: dynacomm.Budget | None, sel_seed: int
    ) -> tuple[list[int], float]:
        if name == "ensemble_dp":
            return dynacomm.select_ensemble_dp(
                h, global_dist, budget, orders=orders, rng=np.random.default_rng(sel_seed)
            )
        if name == "exhaustive":
            return dynacomm.select_brute_force(h, global_dist, budget, max_clients=exhaustive_max)
        return dynacomm.select_ga(
            h, global_dist, budget, rng=np.random.default_rng(sel_seed), population=ga_population,
            iterations=ga_iterations, mutation_prob=ga_mutation,
        )

    rows: list[dict[str, Any]] = []
    for n in clients:
        m = max(int(population), n) if population is not None else 10 * n
        labels = rng.permutation(np.arange(m * samples) % classes)
        hists = label_histograms(labels, dirichlet(labels, m, alpha, rng, min_size=1), classes)
        global_dist = np.bincount(labels, minlength=classes) / len(labels)
        budget = _budget(n, beta)
        stats: dict[str, dict[str, list[float]]] = {s: {"kl": [], "size": [], "time": []} for s in selectors}
        for r in range(repeats):
            active = np.sort(rng.choice(m, size=n, replace=False))
            h = hists[active]
            sel_seed = seed * 100_003 + n * 1_009 + r
            dp_size: int | None = None
            for name in SELECTORS:  # fixed order: random needs the size ensemble_dp picked
                if name not in selectors:
                    if name == "ensemble_dp" and "random" in selectors:
                        dp_size = len(call("ensemble_dp", h, global_dist, budget, sel_seed)[0])
                    continue
                if name == "exhaustive" and n > exhaustive_max:
                    continue
                if name == "random":
                    size = dp_size or 0
                    t0 = time.perf_counter()
                    members, d = dynacomm.select_random(
                        h, global_dist, size, budget, rng=np.random.default_rng(sel_seed)
                    )
                else:
                    t0 = time.perf_counter()
                    members, d = call(name, h, global_dist, budget, sel_seed)
                elapsed = time.perf_counter() - t0
                if name == "ensemble_dp":
                    dp_size = len(members)
                stats[name]["kl"].append(d)
                stats[name]["size"].append(len(members))
                stats[name]["time"].append(elapsed)
        for name in selectors:
            st = stats[name]
            row: dict[str, Any] = {"clients": int(n), "selector": name}
            if not st["time"]:
                row["skipped"] = f"exhaustive search runs only up to {exhaustive_max} clients (2^n subsets)"
            else:
                row.update(
                    kl_mean=float(np.mean(st["kl"])),
                    kl_max=float(np.max(st["kl"])),
                    size_mean=float(np.mean(st["size"])),
                    time_median_s=float(statistics.median(st["time"])),
                    time_max_s=float(max(st["time"])),
                    calls=len(st["time"]),
                )
                row["population"] = m
                if name == "ensemble_dp" and n in TARGETS_S:
                    row["target_s"] = TARGETS_S[n]
                    row["meets_target"] = bool(row["time_median_s"] <= TARGETS_S[n])
            rows.append(row)
    return {
        "settings": {
            "clients": [int(c) for c in clients], "repeats": repeats, "population": population,
            "samples": samples, "classes": classes, "alpha": alpha, "beta": beta, "orders": orders,
            "exhaustive_max": exhaustive_max, "ga_population": ga_population, "ga_iterations": ga_iterations,
            "ga_mutation": ga_mutation, "seed": seed,
        },
        "rows": rows,
    }


def print_table(result: dict[str, Any]) -> None:
    """Print the rows of :func:`run_benchmark` as a table."""
    s = result["settings"]
    pop = "10·n" if s["population"] is None else s["population"]
    beta = "none (unconstrained)" if s["beta"] is None else f"Dynamic-{s['beta']}"
    print(
        f"DynaComm group selectors: Dir({s['alpha']}) over {pop} clients × {s['samples']} samples, "
        f"{s['classes']} classes, budget {beta}, {s['repeats']} rounds per client count"
    )
    print(f"{'clients':>7}  {'selector':<12} {'KL mean':>9} {'KL max':>9} {'size':>6} {'ms/call':>10} "
          f"{'max ms':>10}  target")
    for row in result["rows"]:
        if "skipped" in row:
            print(f"{row['clients']:>7}  {row['selector']:<12} skipped: {row['skipped']}")
            continue
        target = ""
        if "target_s" in row:
            target = f"≤ {1000 * row['target_s']:g} ms: {'met' if row['meets_target'] else 'MISSED'}"
        print(
            f"{row['clients']:>7}  {row['selector']:<12} {row['kl_mean']:>9.4f} {row['kl_max']:>9.4f} "
            f"{row['size_mean']:>6.1f} {1000 * row['time_median_s']:>10.2f} {1000 * row['time_max_s']:>10.2f}  "
            f"{target}"
        )
