"""Server data, the public (unlabelled) split, and the Jensen–Shannon non-IID degree.

Non-IID degree (FedDUMAP, formulas 2–3)::

    D(P_k) = ½·KL(P_k ‖ P_m) + ½·KL(P̄ ‖ P_m),   P_m = ½·(P_k + P̄)
    KL(P_i ‖ P_j) = Σ_y P_i(y)·log(P_i(y) / P_j(y))

with label histograms normalised to sum to 1, terms with ``P_i(y) = 0`` contributing 0, and
**log base 2** by default (so ``D ∈ [0, 1]``); base ``e`` is an option. The reference ``P̄`` is the
``n_k``-weighted pooled label distribution of all devices, the server excluded. Check values
against a uniform 10-class reference: 2 classes → 0.610, 5 classes → 0.311, 10 classes → 0.

Server split (FedDUMAP authors' code): ``n_0`` samples drawn from ``share_l`` randomly chosen
classes, ``n_0/share_l`` per class. Public split (for the distillation baselines): a random
hold-out fraction of the training set whose labels are never used; it is removed for all methods.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from .errors import DataConfigError

__all__ = [
    "ServerSplit",
    "js_divergence",
    "non_iid_degree",
    "label_distribution",
    "resolve_server_classes",
    "split_server",
    "split_public",
]


# --------------------------------------------------------------------------------------------------
# Jensen–Shannon divergence
# --------------------------------------------------------------------------------------------------


def _log_base(base: float | str) -> float:
    if base == "e" or (isinstance(base, (int, float)) and not isinstance(base, bool) and math.isclose(base, math.e)):
        return 1.0
    if isinstance(base, bool) or not isinstance(base, (int, float)) or base <= 0 or base == 1:
        raise DataConfigError(f"base must be 2, 'e' (or math.e) or another positive number != 1, got {base!r}")
    return math.log(float(base))


def _as_dist(x: Any, name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim not in (1, 2) or arr.shape[-1] == 0:
        raise DataConfigError(f"{name} must be a non-empty 1-D histogram or a 2-D stack of them")
    if not np.all(np.isfinite(arr)) or (arr < 0).any():
        raise DataConfigError(f"{name} must hold finite non-negative counts or probabilities")
    total = arr.sum(axis=-1, keepdims=True)
    if (total <= 0).any():
        raise DataConfigError(f"{name} must have a positive total (an empty histogram has no distribution)")
    return arr / total


def _kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Σ p·ln(p/q) over the last axis with 0·ln(0/q) = 0 (q > 0 wherever p > 0 by construction)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0) / np.where(q > 0, q, 1.0)), 0.0)
    return terms.sum(axis=-1)


def _js(p: np.ndarray, q: np.ndarray, base: float | str) -> np.ndarray:
    m = 0.5 * (p + q)
    return (0.5 * _kl(p, m) + 0.5 * _kl(q, m)) / _log_base(base)


def js_divergence(p: Any, q: Any, *, base: float | str = 2) -> float:
    """Jensen–Shannon divergence between two histograms (normalised here to sum to 1).

    Symmetric, ``0`` iff ``p == q`` after normalisation, at most ``1`` in base 2 (``ln 2`` in base
    ``e``). Counts or probabilities are both accepted.
    """
    pp, qq = _as_dist(p, "p"), _as_dist(q, "q")
    if pp.ndim != 1 or qq.ndim != 1 or pp.shape != qq.shape:
        raise DataConfigError(f"p and q must be 1-D of equal length, got {pp.shape} and {qq.shape}")
    return max(float(_js(pp, qq, base)), 0.0)


def non_iid_degree(
    client_label_dist: Any,
    global_dist: Any,
    *,
    base: float | str = 2,
    round_decimals: int | None = None,
) -> float | np.ndarray:
    """FedDUMAP non-IID degree ``D(P_k) = JS(P_k, P̄)`` (formulas 2–3).

    Parameters
    ----------
    client_label_dist:
        label histogram (counts or probabilities) of one client, the server or a pooled set of
        clients; a 2-D array gives one degree per row.
    global_dist:
        the reference ``P̄``: pooled label histogram of all devices, server excluded (see
        :func:`label_distribution`).
    base:
        logarithm base, ``2`` (default, the paper's values) or ``"e"``.
    round_decimals:
        round the normalised class frequencies to this many decimals first (``3`` mimics the
        authors' code); ``None`` (default) uses exact frequencies.

    Returns a float for a 1-D input, an array of floats for a 2-D input.
    """
    p = _as_dist(client_label_dist, "client_label_dist")
    q = _as_dist(global_dist, "global_dist")
    if q.ndim != 1 or p.shape[-1] != q.shape[0]:
        raise DataConfigError(
            f"global_dist must be 1-D with {p.shape[-1]} classes, got shape {q.shape}"
        )
    if round_decimals is not None:
        p, q = np.round(p, round_decimals), np.round(q, round_decimals)
    out = np.maximum(_js(p, np.broadcast_to(q, p.shape), base), 0.0)
    return float(out) if p.ndim == 1 else out


def label_distribution(
    labels: Any, num_classes: int, indices: Sequence[np.ndarray] | np.ndarray | None = None
) -> np.ndarray:
    """Normalised label distribution of ``labels[indices]`` (``indices`` may be a list of index
    arrays, whose union — with multiplicity — is pooled, i.e. the ``n_k``-weighted ``P̄``)."""
    y = np.asarray(labels, dtype=np.int64)
    if indices is not None:
        if isinstance(indices, np.ndarray) and indices.dtype != object:
            y = y[indices.astype(np.int64)]
        else:
            parts = [np.asarray(i, dtype=np.int64) for i in indices]
            y = y[np.concatenate(parts)] if parts else y[:0]
    counts = np.bincount(y, minlength=num_classes).astype(np.float64)[:num_classes]
    if counts.sum() <= 0:
        raise DataConfigError("no samples to build a label distribution from")
    return counts / counts.sum()


# --------------------------------------------------------------------------------------------------
# Server and public splits
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSplit:
    """Result of :func:`split_server`.

    ``indices`` (sorted) are the server set; ``remaining`` (sorted) the rest of the pool, in the
    same index space as the pool given; ``classes`` the classes the server set was drawn from;
    ``non_iid_degree`` is ``JS(P_0, P_remaining)`` (base 2), which equals the paper's ``D(P_0)``
    when every remaining sample goes to a device (``nan`` when either side is empty).
    """

    indices: np.ndarray
    remaining: np.ndarray
    classes: tuple[int, ...]
    non_iid_degree: float


def _size(name: str, size: Any, n: int) -> int:
    if isinstance(size, bool):
        raise DataConfigError(f"{name} must be a fraction in [0, 1) or a count >= 1, got {size!r}")
    if isinstance(size, (int, np.integer)):
        count = int(size)
        if count < 0 or count > n:
            raise DataConfigError(f"{name} must be a count in [0, {n}], got {size!r}")
        return count
    if isinstance(size, (float, np.floating)):
        frac = float(size)
        if not 0.0 <= frac < 1.0:
            raise DataConfigError(
                f"{name} must be a fraction in [0, 1) (or an int count), got {size!r}"
            )
        return int(round(frac * n))
    raise DataConfigError(f"{name} must be a fraction (float) or a count (int), got {size!r}")


def resolve_server_classes(
    classes: Any, present: Iterable[int], rng: np.random.Generator
) -> tuple[int, ...]:
    """Which classes the server set covers.

    ``None`` → every class present; an int ``k`` → ``k`` random classes; a float in ``(0, 1]`` → that
    fraction of the classes present (rounded, at least one); a sequence → exactly those classes.
    Random choices use ``rng``; the result is sorted.
    """
    present_arr = np.asarray(sorted(int(c) for c in present), dtype=np.int64)
    c = len(present_arr)
    if classes is None:
        return tuple(int(v) for v in present_arr)
    if isinstance(classes, bool):
        raise DataConfigError(f"server_classes must be None, an int, a fraction or a list, got {classes!r}")
    if isinstance(classes, (int, np.integer)):
        k = int(classes)
        if not 1 <= k <= c:
            raise DataConfigError(f"server_classes must be an int in [1, {c}], got {classes!r}")
    elif isinstance(classes, (float, np.floating)):
        if not 0.0 < float(classes) <= 1.0:
            raise DataConfigError(f"server_classes as a fraction must lie in (0, 1], got {classes!r}")
        k = max(1, int(round(float(classes) * c)))
    else:
        try:
            chosen = sorted({int(v) for v in classes})
        except TypeError as exc:
            raise DataConfigError(
                f"server_classes must be None, an int, a fraction or a list of class ids, got {classes!r}"
            ) from exc
        missing = sorted(set(chosen) - set(present_arr.tolist()))
        if not chosen or missing:
            raise DataConfigError(
                f"server_classes lists classes with no samples in the pool: {missing or 'empty list'}"
            )
        return tuple(chosen)
    return tuple(int(v) for v in np.sort(rng.choice(present_arr, size=k, replace=False)))


def split_server(
    labels: Any,
    size: float | int,
    rng: np.random.Generator,
    *,
    classes: Any = None,
    balance: str = "equal",
    pool: np.ndarray | None = None,
) -> ServerSplit:
    """Split a server set off a labelled pool (before partitioning the rest among devices).

    Parameters
    ----------
    labels:
        labels of the whole training set.
    size:
        a fraction of the pool in ``[0, 1)`` (float) or a count (int).
    classes:
        class coverage, see :func:`resolve_server_classes`.
    balance:
        ``"equal"`` (default; authors' code): ``size/len(classes)`` samples per class (the first
        ``size mod len(classes)`` classes in the random class order get one more; a class short of
        samples gives its shortfall to the others); ``"proportional"``: a uniform random subset of
        the pool restricted to ``classes``.
    pool:
        restrict the draw to these indices (default: the whole set). ``remaining`` is the pool minus
        the server set.

    Returns
    -------
    ServerSplit
        deterministic given ``rng``'s state.
    """
    y = np.asarray(labels, dtype=np.int64)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    pool_idx = np.arange(len(y), dtype=np.int64) if pool is None else np.sort(np.asarray(pool, np.int64))
    if balance not in ("equal", "proportional"):
        raise DataConfigError(f"balance must be 'equal' or 'proportional', got {balance!r}")
    n0 = _size("server size", size, len(pool_idx))
    pool_labels = y[pool_idx]
    chosen = resolve_server_classes(classes, np.unique(pool_labels), rng)
    if n0 == 0:
        return ServerSplit(np.zeros(0, np.int64), pool_idx, chosen, float("nan"))
    by_class = {c: pool_idx[pool_labels == c] for c in chosen}
    available = sum(len(v) for v in by_class.values())
    if n0 > available:
        raise DataConfigError(
            f"server size {n0} exceeds the {available} pool samples of server_classes {list(chosen)}"
        )
    if balance == "proportional":
        cand = np.sort(np.concatenate([by_class[c] for c in chosen]))
        server = np.sort(rng.choice(cand, size=n0, replace=False))
    else:
        order = [chosen[i] for i in rng.permutation(len(chosen))]
        quota = {c: n0 // len(order) + (1 if i < n0 % len(order) else 0) for i, c in enumerate(order)}
        # Give the shortfall of small classes to the others, round-robin in the same order.
        short = 0
        for c in order:
            if quota[c] > len(by_class[c]):
                short += quota[c] - len(by_class[c])
                quota[c] = len(by_class[c])
        while short > 0:
            progressed = False
            for c in order:
                if short and quota[c] < len(by_class[c]):
                    quota[c] += 1
                    short -= 1
                    progressed = True
            if not progressed:  # pragma: no cover - excluded by the availability check
                raise DataConfigError("server size exceeds the samples of server_classes")
        parts = [rng.choice(by_class[c], size=quota[c], replace=False) for c in order]
        server = np.sort(np.concatenate(parts)).astype(np.int64)
    remaining = np.setdiff1d(pool_idx, server, assume_unique=True)
    num_classes = int(y.max()) + 1
    if len(remaining):
        degree = non_iid_degree(
            np.bincount(y[server], minlength=num_classes),
            np.bincount(y[remaining], minlength=num_classes),
        )
    else:
        degree = float("nan")
    return ServerSplit(server, remaining, chosen, float(degree))


def split_public(
    n_or_pool: int | np.ndarray, fraction: float | int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Hold out an unlabelled public set (for the distillation baselines): a uniform random subset.

    ``n_or_pool`` is the pool size or the pool's indices; ``fraction`` a fraction in ``[0, 1)`` or
    an int count. Returns ``(public, remaining)``, both sorted. Labels of the public set must not be
    used by any method (the container exposes its images only).
    """
    pool = np.arange(n_or_pool, dtype=np.int64) if isinstance(n_or_pool, (int, np.integer)) else np.sort(
        np.asarray(n_or_pool, dtype=np.int64)
    )
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    k = _size("public_fraction", fraction, len(pool))
    if k == 0:
        return np.zeros(0, np.int64), pool
    public = np.sort(rng.choice(pool, size=k, replace=False))
    return public, np.setdiff1d(pool, public, assume_unique=True)
