"""Pure functions behind the DynaComm method (:mod:`fedhetero.algorithms.dynacomm.algorithm`).

DynaComm (Le et al., "DynamicFL: Federated Learning with Dynamic Communication Resource
Allocation", IEEE BigData 2024; called DynaComm here to tell it from the re-parameterisation
method of the same name) gives every active client the same number ``L`` of local SGD steps per
round. A *high-frequency group* of clients synchronises with the server every ``I_high`` steps,
the others every ``I_low`` steps, and everyone at step ``L``.

This module holds everything that needs no model:

* local steps and synchronisation schedules (:func:`default_local_steps`, :func:`sync_points`,
  :func:`nu_code`, :func:`nu_paper`, :func:`kappa_round`);
* the group heterogeneity measure (:func:`pooled_distribution`, :func:`kl_divergence`,
  :func:`group_distance`);
* budget feasibility (:class:`Budget`);
* the group selectors: ensemble dynamic programming over random client orders
  (:func:`select_ensemble_dp`, the default), exhaustive search (:func:`select_brute_force`), a
  uniformly random subset of a given size (:func:`select_random`) and a small genetic algorithm
  (:func:`select_ga`).

Communication cost κ is counted in model exchanges (one upload plus one download per
synchronisation) and normalised by ``|active clients|·L``, the cost of synchronising after every
local step. Two counts of synchronisations per round are provided: ``ν_paper(I) = ⌈L/I⌉`` (the
rule training follows by default: sync when ``l mod I == 0`` or ``l == L``) and
``ν_code(I) = ⌈(L−1)/I⌉`` (the authors' code skips a sync that would fall on step ``L−1``; this
count reproduces the κ values printed in the paper, e.g. 0.996 for interval 1 with L = 250).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

__all__ = [
    "INTERVAL_LETTERS",
    "Budget",
    "default_local_steps",
    "group_distance",
    "kappa_round",
    "kl_divergence",
    "nu_code",
    "nu_paper",
    "parse_interval",
    "pooled_distribution",
    "select_brute_force",
    "select_ensemble_dp",
    "select_ga",
    "select_random",
    "sync_points",
]

#: The paper's interval letters (local steps between synchronisations).
INTERVAL_LETTERS = {"a": 1, "b": 4, "c": 16, "d": 32, "e": 64, "f": 128, "g": 256}


# ---------------------------------------------------------------------------- schedules and κ
def default_local_steps(num_train: int, num_clients: int, epochs: int, batch_size: int) -> int:
    """``L = ⌊N_train·E/(M·B)⌋``: the mean number of local steps E epochs take (FedNova-style
    equal work), at least 1. 250 for CIFAR (50,000, M=100, E=5, B=10), 3221 for FEMNIST."""
    if num_clients < 1 or batch_size < 1:
        raise ValueError("num_clients and batch_size must be positive")
    return max(1, (int(num_train) * int(epochs)) // (int(num_clients) * int(batch_size)))


def parse_interval(value: int | str) -> int:
    """An interval given as a letter a–g or as a positive integer (steps)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a letter a-g or a positive integer, got {value!r}")
    if isinstance(value, str):
        key = value.strip().lower()
        if key in INTERVAL_LETTERS:
            return INTERVAL_LETTERS[key]
        if key.isdigit() and int(key) >= 1:
            return int(key)
        raise ValueError(f"expected a letter a-g or a positive integer, got {value!r}")
    if isinstance(value, int) and value >= 1:
        return int(value)
    raise ValueError(f"expected a letter a-g or a positive integer, got {value!r}")


def nu_paper(interval: int, L: int) -> int:
    """Synchronisations per round under the paper's rule: ``⌈L/min(I, L)⌉``."""
    return -(-int(L) // min(int(interval), int(L)))


def nu_code(interval: int, L: int) -> int:
    """Synchronisations per round as the authors' code counts them: ``⌈(L−1)/min(I, L)⌉``
    (at least 1: the end-of-round sync always happens)."""
    return max(1, -(-(int(L) - 1) // min(int(interval), int(L))))


def sync_points(interval: int, L: int, rule: str = "paper") -> list[int]:
    """The local steps (1-based, after the step) at which a client with ``interval`` syncs.

    ``paper``: every ``l`` with ``l mod I == 0``, and ``L``. ``code``: the authors' event list
    ``[1, 1+I, 1+2I, … (< L), L+1]`` read as "sync after step e−1": the multiples of ``I`` up to
    ``L−2``, and ``L``; its length is :func:`nu_code`."""
    I = min(int(interval), int(L))
    last = L if rule == "paper" else L - 2
    if rule not in ("paper", "code"):
        raise ValueError(f"unknown sync rule {rule!r}")
    points = list(range(I, last + 1, I))
    if not points or points[-1] != L:
        points.append(L)
    return points


def kappa_round(nus: Sequence[float], num_active: int, L: int) -> float:
    """Normalised server cost of one round: ``Σ_m ν_m / (|active|·L)`` (clients that do not
    communicate count 0 but stay in the denominator)."""
    if num_active < 1:
        return 0.0
    return float(sum(nus)) / (num_active * L)


# ---------------------------------------------------------------------------- heterogeneity
def pooled_distribution(hists: np.ndarray, members: Sequence[int]) -> np.ndarray:
    """Label distribution of a group: the members' class counts summed, then normalised (the
    |D_m|-weighted mean of their label distributions)."""
    counts = np.asarray(hists, dtype=np.float64)[list(members)].sum(axis=0)
    total = counts.sum()
    if total <= 0:
        raise ValueError("a group with no samples has no label distribution")
    return counts / total


def kl_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """``KL(p ‖ q) = Σ_c p_c·log(p_c/q_c)``, natural log, ``0·log 0 = 0``."""
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    mask = p > 0
    if np.any(q[mask] <= 0):
        return math.inf
    return float(np.sum(p[mask] * np.log(p[mask] / q[mask])))


def group_distance(hists: np.ndarray, members: Sequence[int], global_dist: np.ndarray, distance: str = "kl") -> float:
    """How far a group's pooled label distribution is from the global one: ``kl`` (the paper)
    or ``squared_l2``."""
    p = pooled_distribution(hists, members)
    if distance == "kl":
        return kl_divergence(p, global_dist)
    if distance == "squared_l2":
        return float(np.sum((p - np.asarray(global_dist, dtype=np.float64)) ** 2))
    raise ValueError(f"unknown distance {distance!r}")


# ---------------------------------------------------------------------------- budgets
@dataclass(frozen=True)
class Budget:
    """Communication budgets of one round, in synchronisations per round (units of 2·|W|).

    ``client``: τ_m of each candidate client (index into the round's client list);
    ``server``: τ_g; ``nu_high``/``nu_low``: synchronisations of the two groups;
    ``semantics``: ``high_count`` checks, as the authors' code does, that a new member can afford
    high frequency (τ_m ≥ ν_high) and that the members' budgets sum to at most τ_g;
    ``total_cost`` checks the literal constraint of the paper's problem: every member can afford
    ν_high and the whole round's cost ``|z|·ν_high + (n−|z|)·ν_low`` is at most τ_g."""

    client: tuple[float, ...]
    server: float
    nu_high: float
    nu_low: float
    semantics: str = "high_count"

    def capable(self, m: int) -> bool:
        return self.client[m] >= self.nu_high

    def feasible(self, members: Sequence[int]) -> bool:
        if not all(self.capable(m) for m in members):
            return False
        if self.semantics == "high_count":
            return sum(self.client[m] for m in members) <= self.server + 1e-9
        if self.semantics == "total_cost":
            k = len(members)
            cost = k * self.nu_high + (len(self.client) - k) * self.nu_low
            return cost <= self.server + 1e-9
        raise ValueError(f"unknown budget semantics {self.semantics!r}")


def _unconstrained(n: int) -> Budget:
    return Budget(client=(1.0,) * n, server=float(n), nu_high=1.0, nu_low=0.0)


# ---------------------------------------------------------------------------- selectors
Result = tuple[list[int], float]


def _dp_one_order(
    order: Sequence[int],
    score: Callable[[list[int]], float],
    budget: Budget,
    fixed_size: int | None,
) -> Result:
    """One pass of the selector's table over ``order``: cell (i, j) keeps the best feasible set
    of exactly j clients drawn from the first i (one candidate per cell, so this is a heuristic:
    the distance is not additive). Returns the best cell of the last row over every size (or of
    size ``fixed_size``)."""
    n = len(order)
    inf = math.inf
    prev: list[tuple[float, list[int]]] = [(inf, []) for _ in range(n + 1)]
    prev[0] = (0.0, [])
    for i in range(1, n + 1):
        new = m = order[i - 1]
        cur = list(prev)  # option 1: skip client order[i-1]
        for j in range(1, i + 1):
            base_kl, base = prev[j - 1]
            if j > 1 and base_kl == inf:
                continue  # no set of j−1 clients to extend
            cand = base + [new]
            if not budget.capable(m) or not budget.feasible(cand):
                continue
            d = score(cand)
            if d < cur[j][0]:
                cur[j] = (d, cand)
        prev = cur
    sizes = range(1, n + 1) if fixed_size is None else [fixed_size]
    best_kl, best = inf, list[int]()
    for j in sizes:
        if 1 <= j <= n and prev[j][0] < best_kl:
            best_kl, best = prev[j]
    return sorted(best), best_kl


def select_ensemble_dp(
    hists: np.ndarray,
    global_dist: np.ndarray,
    budget: Budget | None = None,
    *,
    orders: int = 10,
    rng: np.random.Generator | None = None,
    distance: str = "kl",
    fixed_size: int | None = None,
) -> Result:
    """The default group selector: the single-order table of :func:`_dp_one_order` over
    ``orders`` uniformly random client orders; the best result wins (strict ``<``: the first
    minimum on ties). Returns ``(members, distance)``; ``([], inf)`` when no non-empty set is
    feasible (every client is then low-frequency)."""
    n = len(hists)
    budget = budget or _unconstrained(n)
    rng = rng if rng is not None else np.random.default_rng(0)
    cache: dict[tuple[int, ...], float] = {}

    def score(members: list[int]) -> float:
        key = tuple(sorted(members))
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = group_distance(hists, key, global_dist, distance)
        return hit

    best: list[int] = []
    best_kl = math.inf
    for _ in range(max(1, int(orders))):
        order = [int(x) for x in rng.permutation(n)]
        members, d = _dp_one_order(order, score, budget, fixed_size)
        if d < best_kl:
            best, best_kl = members, d
    return best, best_kl


def select_brute_force(
    hists: np.ndarray,
    global_dist: np.ndarray,
    budget: Budget | None = None,
    *,
    distance: str = "kl",
    fixed_size: int | None = None,
    max_clients: int = 20,
) -> Result:
    """Exhaustive search over every non-empty feasible subset (smaller subsets first, then in
    lexicographic order; the first minimum wins). Refuses more than ``max_clients`` clients."""
    n = len(hists)
    if n > max_clients:
        raise ValueError(f"exhaustive search over {n} clients is too slow (at most {max_clients})")
    budget = budget or _unconstrained(n)
    best: list[int] = []
    best_kl = math.inf
    sizes = range(1, n + 1) if fixed_size is None else [fixed_size]
    for k in sizes:
        for members in itertools.combinations(range(n), k):
            if not budget.feasible(members):
                continue
            d = group_distance(hists, members, global_dist, distance)
            if d < best_kl:
                best, best_kl = list(members), d
    return best, best_kl


def select_random(
    hists: np.ndarray,
    global_dist: np.ndarray,
    size: int,
    budget: Budget | None = None,
    *,
    rng: np.random.Generator | None = None,
    distance: str = "kl",
) -> Result:
    """A uniformly random subset of ``size`` clients drawn from those able to afford high
    frequency (the paper's Random baseline uses the size the selector picked)."""
    n = len(hists)
    budget = budget or _unconstrained(n)
    rng = rng if rng is not None else np.random.default_rng(0)
    pool = [m for m in range(n) if budget.capable(m)]
    size = min(int(size), len(pool))
    if size <= 0:
        return [], math.inf
    members = sorted(int(m) for m in rng.choice(pool, size=size, replace=False))
    return members, group_distance(hists, members, global_dist, distance)


def select_ga(
    hists: np.ndarray,
    global_dist: np.ndarray,
    budget: Budget | None = None,
    *,
    rng: np.random.Generator | None = None,
    distance: str = "kl",
    population: int = 50,
    iterations: int = 200,
    mutation_prob: float = 0.01,
    fixed_size: int | None = None,
) -> Result:
    """A small genetic algorithm over membership bit-strings: tournament selection of parents,
    uniform crossover, bit-flip mutation with ``mutation_prob`` per bit, the best individual
    kept (elitism). Infeasible or empty strings score +inf. Returns the best feasible set seen."""
    n = len(hists)
    budget = budget or _unconstrained(n)
    rng = rng if rng is not None else np.random.default_rng(0)
    cache: dict[tuple[int, ...], float] = {}

    def fitness(bits: np.ndarray) -> float:
        members = tuple(int(i) for i in np.flatnonzero(bits))
        hit = cache.get(members)
        if hit is None:
            ok = members and budget.feasible(members) and (fixed_size is None or len(members) == fixed_size)
            hit = cache[members] = group_distance(hists, members, global_dist, distance) if ok else math.inf
        return hit

    pop = rng.random((population, n)) < 0.5
    scores = np.array([fitness(b) for b in pop])
    for _ in range(iterations):
        elite = pop[int(np.argmin(scores))].copy()
        children = [elite]
        while len(children) < population:
            a, b = rng.integers(0, population, 2), rng.integers(0, population, 2)
            pa = pop[a[0]] if scores[a[0]] <= scores[a[1]] else pop[a[1]]
            pb = pop[b[0]] if scores[b[0]] <= scores[b[1]] else pop[b[1]]
            mask = rng.random(n) < 0.5
            child = np.where(mask, pa, pb) ^ (rng.random(n) < mutation_prob)
            children.append(child)
        pop = np.array(children)
        scores = np.array([fitness(b) for b in pop])
    if not cache:
        return [], math.inf
    members, d = min(cache.items(), key=lambda kv: kv[1])
    return (list(members), d) if d < math.inf else ([], math.inf)
