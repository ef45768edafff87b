"""Client partitions of a labelled pool.

Every partitioner takes the labels of the pool and a ``numpy.random.Generator`` (the data-partition
stream, concern 0 of the seed table) and returns ``list[np.ndarray]``: one sorted int64 index
array per client. Guarantees, checked by :func:`validate_partition`:

* disjoint: no index belongs to two clients;
* complete: every index ``0..n-1`` belongs to some client;
* no empty client;
* reproducible: the same labels, arguments and generator state give the same arrays.

Partitioners
------------
``iid``
    a uniform random split into near-equal parts (sizes differ by at most 1).
``dirichlet``
    per class, client shares drawn from ``Dir(alpha·1)``; redrawn until every client holds
    ``min_size`` samples, at most ``max_retries`` times, then repaired deterministically (common
    partitioners hang or leave empty clients at small ``alpha``). Never hangs, never divides by zero.
``shards``
    FedAvg/FedDUMAP sort-and-shard: sort by label, cut into ``num_clients·shards_per_client``
    contiguous shards, give each client ``shards_per_client`` random shards (so at most that many
    labels per client).
``kshards``
    HeteroFL/SemiFL "non-iid-l-K" label shards (the DynaComm paper's "K classes"): every class is
    cut into ``K·M/C`` shards of near-equal size and each client receives ``K`` shards drawn at
    random from all ``K·M`` of them (two may come from the same class). Unlike ``shards``, a shard
    never straddles two classes, whatever the class sizes.
``pathological``
    exactly ``classes_per_client`` distinct classes per client (HeteroFL's "non-iid-n"); each
    class is split evenly among the clients that hold it.
``natural``
    one client per writer, from a per-sample writer id (LEAF FEMNIST's ``users``): all writers in
    ascending id order when ``num_clients`` equals their number, otherwise ``num_clients`` writers
    drawn at random (the other writers' samples then belong to no client, so this partitioner
    alone may be incomplete).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import numpy as np

from .errors import DataConfigError

__all__ = [
    "PARTITIONS",
    "iid",
    "dirichlet",
    "shards",
    "kshards",
    "pathological",
    "natural",
    "overlap_label_split",
    "session_groups",
    "make_partition",
    "label_histograms",
    "partition_stats",
    "validate_partition",
]

log = logging.getLogger(__name__)

PARTITIONS: tuple[str, ...] = ("iid", "dirichlet", "shards", "kshards", "pathological", "natural", "session_groups")


# --------------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------------


def _labels(labels: Any) -> np.ndarray:
    try:
        arr = np.asarray(labels.detach().cpu().numpy() if hasattr(labels, "detach") else labels)
    except Exception as exc:  # noqa: BLE001
        raise DataConfigError(f"labels must be a 1-D array of class ids: {exc}") from exc
    if arr.ndim != 1:
        raise DataConfigError(f"labels must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise DataConfigError(f"labels must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        raise DataConfigError("labels must be >= 0")
    return arr


def _rng(rng: Any) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise TypeError(
            f"rng must be a numpy.random.Generator (the data-partition stream), got {type(rng).__name__}"
        )
    return rng


def _count(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise DataConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _clients(num_clients: Any, n: int) -> int:
    num_clients = _count("num_clients", num_clients)
    if num_clients > n:
        raise DataConfigError(
            f"num_clients={num_clients} (config: data.num_clients) exceeds the {n} samples available "
            f"to the clients; every client needs at least one sample"
        )
    return num_clients


def _from_owner(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Client index lists (sorted) from an owner-per-sample array."""
    order = np.argsort(owner, kind="stable")  # stable: indices stay ascending within a client
    sizes = np.bincount(owner, minlength=num_clients)
    return [part.astype(np.int64, copy=False) for part in np.split(order, np.cumsum(sizes)[:-1])]


# --------------------------------------------------------------------------------------------------
# Partitioners
# --------------------------------------------------------------------------------------------------


def iid(labels: Any, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Uniform random split into ``num_clients`` parts whose sizes differ by at most one.

    ``labels`` may be the label array or the pool size ``n`` as an int.
    """
    n = _count("labels", labels, 0) if isinstance(labels, (int, np.integer)) else len(_labels(labels))
    num_clients = _clients(num_clients, n)
    perm = _rng(rng).permutation(n)
    return [np.sort(p).astype(np.int64) for p in np.array_split(perm, num_clients)]


def dirichlet(
    labels: Any,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 10,
    max_retries: int = 100,
    *,
    self_balancing: bool = False,
    report: dict[str, Any] | None = None,
) -> list[np.ndarray]:
    """Label-Dirichlet partition, robust to empty clients (bounded redraws, then a repair step).

    1. For each class present, draw shares ``p ~ Dir(alpha·1_N)``. With ``self_balancing`` the share
       of clients already holding more than ``n/N`` samples is zeroed; shares are renormalised, and
       if they are all zero (or not finite) the class is split uniformly instead.
    2. The class's shuffled indices are cut at ``floor(cumsum(p)·n_c)``.
    3. If every client holds ``>= min_size`` samples, stop; otherwise redraw (at most
       ``max_retries`` redraws after the first draw).
    4. Repair: starting from the draw with the largest minimum size, under-filled clients (in
       ascending id) receive samples chosen at random (with ``rng``) from the currently largest
       client (lowest id on ties), never taking a donor below ``min_size``. The number of moved
       samples is logged and stored in ``report["moved"]``.

    ``report`` (optional dict) receives ``attempts``, ``moved`` and ``min_size``.

    Raises
    ------
    DataConfigError
        ``num_clients·min_size > n`` (checked up front), ``alpha <= 0``, bad counts.
    """
    y = _labels(labels)
    n = len(y)
    num_clients = _clients(num_clients, n)
    rng = _rng(rng)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.floating, np.integer)):
        raise DataConfigError(f"alpha must be a positive float, got {alpha!r}")
    alpha = float(alpha)
    if not np.isfinite(alpha) or alpha <= 0:
        raise DataConfigError(f"alpha must be a positive finite float, got {alpha!r}")
    min_size = _count("min_size", min_size, 0)
    max_retries = _count("max_retries", max_retries, 0)
    if num_clients * min_size > n:
        raise DataConfigError(
            f"min_size={min_size} (config: data.min_partition_size) is infeasible with "
            f"num_clients={num_clients} (config: data.num_clients): every client needs {min_size} "
            f"samples, {num_clients * min_size} in all, but the clients' pool holds {n}; lower "
            f"data.min_partition_size or data.num_clients"
        )
    min_required = max(min_size, 1)  # an empty client is never acceptable
    class_idx = [np.flatnonzero(y == c) for c in np.unique(y)]
    share_vec = np.full(num_clients, alpha)
    uniform = np.full(num_clients, 1.0 / num_clients)
    target = n / num_clients

    best_owner: np.ndarray | None = None
    best_min = -1
    attempts = 0
    for _ in range(max_retries + 1):
        attempts += 1
        owner = np.empty(n, dtype=np.int64)
        sizes = np.zeros(num_clients, dtype=np.int64)
        for idx in class_idx:
            perm = rng.permutation(idx)
            p = rng.dirichlet(share_vec)
            if self_balancing:
                p = np.where(sizes > target, 0.0, p)
            total = p.sum()
            p = p / total if np.isfinite(total) and total > 0 and np.all(np.isfinite(p)) else uniform
            cuts = np.clip((np.cumsum(p)[:-1] * len(perm)).astype(np.int64), 0, len(perm))
            counts = np.diff(np.concatenate(([0], cuts, [len(perm)])))
            owner[perm] = np.repeat(np.arange(num_clients), counts)
            sizes += counts
        cur_min = int(sizes.min())
        if cur_min > best_min:
            best_owner, best_min = owner, cur_min
        if cur_min >= min_required:
            break
    assert best_owner is not None
    owner = best_owner
    moved = 0
    if best_min < min_required:
        sizes = np.bincount(owner, minlength=num_clients)
        for u in range(num_clients):
            while sizes[u] < min_required:
                donor = int(np.argmax(sizes))
                give = int(min(min_required - sizes[u], sizes[donor] - min_required))
                # give >= 1: if every other client held <= min_required, the total would be < n.
                pool = np.flatnonzero(owner == donor)
                chosen = rng.choice(pool, size=give, replace=False)
                owner[chosen] = u
                sizes[donor] -= give
                sizes[u] += give
                moved += give
        log.info(
            "dirichlet partition: no draw in %d reached min_size=%d; repaired by moving %d samples",
            attempts, min_required, moved,
        )
    if report is not None:
        report.update({"attempts": attempts, "moved": moved, "min_size": min_required})
    return _from_owner(owner, num_clients)


def shards(
    labels: Any,
    num_clients: int,
    shards_per_client: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Sort-and-shard partition (FedAvg; the FedDUMAP paper's device split).

    The pool is shuffled, stably sorted by label, and cut into ``S = num_clients·shards_per_client``
    contiguous shards of near-equal size (``np.array_split``: sizes differ by at most one, so every
    sample is used). Each client receives ``shards_per_client`` shards from a random permutation of
    the shard ids. E.g. 40,000 CIFAR-10 images, 100 clients, 2 shards → 200 shards of 200 images.
    """
    y = _labels(labels)
    n = len(y)
    num_clients = _clients(num_clients, n)
    spc = _count("shards_per_client", shards_per_client)
    rng = _rng(rng)
    total = num_clients * spc
    if total > n:
        raise DataConfigError(
            f"num_clients·shards_per_client = {total} shards exceeds the {n} samples; lower "
            f"shards_per_client"
        )
    perm = rng.permutation(n)
    ordered = perm[np.argsort(y[perm], kind="stable")]
    pieces = np.array_split(ordered, total)
    assignment = rng.permutation(total).reshape(num_clients, spc)
    return [np.sort(np.concatenate([pieces[s] for s in row])).astype(np.int64) for row in assignment]


def kshards(
    labels: Any,
    num_clients: int,
    shards_per_client: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """``K = shards_per_client`` label shards per client (HeteroFL/SemiFL "non-iid-l-K").

    With ``C`` classes present and ``M = num_clients``, each class's shuffled samples are cut into
    ``K·M/C`` shards (``np.array_split``: sizes differ by at most one, every sample is used); the
    ``K·M`` shards are dealt in a random order, ``K`` to each client. CIFAR-10 with M = 100:
    K = 1 gives every client one whole class (500 images), K = 2 two shards of 250.

    Raises
    ------
    DataConfigError
        ``K·M`` is not a multiple of ``C`` (each class must be cut into a whole number of shards), or
        a class has fewer samples than shards (a shard would be empty).
    """
    y = _labels(labels)
    n = len(y)
    num_clients = _clients(num_clients, n)
    k = _count("shards_per_client", shards_per_client)
    rng = _rng(rng)
    present = np.unique(y)
    c = len(present)
    total = k * num_clients
    if total % c:
        raise DataConfigError(
            f"kshards cuts each of the {c} classes into shards_per_client·num_clients/{c} shards, so "
            f"shards_per_client·num_clients = {total} must be a multiple of {c}"
        )
    per_class = total // c
    pieces: list[np.ndarray] = []
    for cl in present:
        idx = rng.permutation(np.flatnonzero(y == cl))
        if len(idx) < per_class:
            raise DataConfigError(
                f"class {int(cl)} has {len(idx)} samples, fewer than its {per_class} shards; lower "
                f"shards_per_client or num_clients"
            )
        pieces.extend(np.array_split(idx, per_class))
    assignment = rng.permutation(total).reshape(num_clients, k)
    return [np.sort(np.concatenate([pieces[s] for s in row])).astype(np.int64) for row in assignment]


def pathological(
    labels: Any,
    num_clients: int,
    classes_per_client: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Exactly ``classes_per_client`` distinct classes per client (HeteroFL "non-iid-n").

    Classes are dealt cyclically from a random class permutation to a random client order, so each
    class is held by ``floor`` or ``ceil`` of ``N·k/C`` clients; each class's shuffled samples are
    split evenly (``np.array_split``) among its holders.

    Raises
    ------
    DataConfigError
        ``classes_per_client`` exceeds the number of classes present, ``num_clients·k`` is smaller
        than the number of classes (some samples would be left out), or a class has fewer samples
        than holders (a client would miss a class it was dealt).
    """
    y = _labels(labels)
    n = len(y)
    num_clients = _clients(num_clients, n)
    k = _count("classes_per_client", classes_per_client)
    rng = _rng(rng)
    present = np.unique(y)
    c = len(present)
    if k > c:
        raise DataConfigError(f"classes_per_client={k} exceeds the {c} classes present")
    if num_clients * k < c:
        raise DataConfigError(
            f"num_clients·classes_per_client = {num_clients * k} < {c} classes: some classes would "
            f"belong to no client; raise classes_per_client"
        )
    class_order = present[rng.permutation(c)]
    client_order = rng.permutation(num_clients)
    holders: dict[int, list[int]] = {int(cl): [] for cl in present}
    slot = 0
    for cid in client_order:
        for _ in range(k):
            holders[int(class_order[slot % c])].append(int(cid))
            slot += 1
    owner = np.empty(n, dtype=np.int64)
    for cl in present:
        idx = rng.permutation(np.flatnonzero(y == cl))
        hs = holders[int(cl)]
        if len(idx) < len(hs):
            raise DataConfigError(
                f"class {int(cl)} has {len(idx)} samples but is dealt to {len(hs)} clients; lower "
                f"classes_per_client or num_clients"
            )
        for cid, piece in zip(hs, np.array_split(idx, len(hs))):
            owner[piece] = cid
    return _from_owner(owner, num_clients)


def natural(
    writers: Any,
    num_clients: int,
    rng: np.random.Generator,
    *,
    report: dict[str, Any] | None = None,
) -> list[np.ndarray]:
    """One client per writer: client ``k`` holds every sample of the ``k``-th chosen writer.

    ``writers`` gives each sample's writer as a non-negative int (e.g. the index of its LEAF user
    name). With ``W`` distinct writers, ``num_clients == W`` takes them all in ascending id order
    (``rng`` is not used); ``num_clients < W`` draws ``num_clients`` writers uniformly without
    replacement and orders them by id, and the samples of the writers left out belong to no
    client. ``report`` (optional dict) receives ``writers`` (the chosen writer ids, client order),
    ``writers_available`` (``W``) and ``unused_samples``.

    Raises
    ------
    DataConfigError
        ``num_clients`` exceeds the number of writers (a writer cannot be split into clients).
    """
    w = np.asarray(writers)
    if w.ndim != 1 or (w.size and not np.issubdtype(w.dtype, np.integer)):
        raise DataConfigError(f"writers must be a 1-D array of integer writer ids, got shape {w.shape}, dtype {w.dtype}")
    w = w.astype(np.int64, copy=False)
    if w.size and w.min() < 0:
        raise DataConfigError("writer ids must be >= 0")
    num_clients = _count("num_clients", num_clients)
    rng = _rng(rng)
    present = np.unique(w)
    if num_clients > len(present):
        raise DataConfigError(
            f"num_clients={num_clients} exceeds the {len(present)} writers in the pool; the natural "
            f"partition makes one client per writer, so set num_clients to at most {len(present)}"
        )
    chosen = present if num_clients == len(present) else np.sort(rng.choice(present, size=num_clients, replace=False))
    order = np.argsort(w, kind="stable")  # stable: indices stay ascending within a writer
    starts = np.searchsorted(w[order], chosen, side="left")
    ends = np.searchsorted(w[order], chosen, side="right")
    parts = [order[a:b].astype(np.int64) for a, b in zip(starts, ends)]
    if report is not None:
        report.update({
            "writers": [int(v) for v in chosen],
            "writers_available": int(len(present)),
            "unused_samples": int(len(w) - sum(len(p) for p in parts)),
        })
    return parts


# ---------------------------------------------------------------------------- session groups
def overlap_label_split(num_classes: int, overlap: float) -> tuple[list[int], list[int]]:
    """Labels of group A and group B for a cross-group label overlap ``o`` in [0, 1).

    ``o = 0``: A gets the lower half of the labels, B the upper half. Otherwise, with
    ``G = ⌊L/(2−o)⌋`` labels per group of which ``O = ⌊G·o⌋`` are shared and ``U = G − O`` are
    a group's own: A = labels ``[0, U+O)``, B = labels ``[U, 2U+O)``; labels from ``2U+O`` on are
    unused (10 classes, o = 0.2: A = 0..4, B = 4..8). ``O = 0`` falls back to halves."""
    if not 0.0 <= overlap < 1.0:
        raise ValueError(f"overlap must be in [0, 1), got {overlap}")
    if num_classes < 2:
        raise ValueError("two groups need at least 2 classes")
    labels = list(range(num_classes))
    half = num_classes // 2
    if overlap == 0.0:
        return labels[:half], labels[half:]
    g = int(math.floor(num_classes / (2.0 - overlap)))
    o = int(math.floor(g * overlap))
    u = g - o
    if o == 0:
        return labels[:half], labels[half:]
    return labels[: u + o], labels[u: 2 * u + o]


def _fill_group(labels: np.ndarray, classes: Sequence[int], num_devices: int, alpha: float,
                rng: np.random.Generator) -> list[np.ndarray]:
    """Every sample of ``classes`` dealt to ``num_devices`` devices with balanced quotas; device
    ``k`` draws its class mix ``p_k ~ Dir(α)`` and fills its quota by drawing a class from ``p_k``
    and taking the next sample of that class's shuffled pool (any class with samples left once
    ``3·|classes| + 5`` draws in a row hit empty pools)."""
    pools = [list(rng.permutation(np.flatnonzero(labels == c))) for c in classes]
    total = sum(len(p) for p in pools)
    base, extra = divmod(total, num_devices)
    quotas = [base + (1 if k < extra else 0) for k in range(num_devices)]
    out: list[np.ndarray] = []
    patience = 3 * len(classes) + 5
    for quota in quotas:
        p = rng.dirichlet(np.full(len(classes), float(alpha)))
        cdf = np.cumsum(p)
        got: list[int] = []
        misses = 0
        while len(got) < quota:
            j = min(int(np.searchsorted(cdf, rng.random(), side="right")), len(classes) - 1)
            if pools[j]:
                got.append(int(pools[j].pop()))
                misses = 0
                continue
            misses += 1
            if misses >= patience:
                j = next(i for i, pool in enumerate(pools) if pool)
                got.append(int(pools[j].pop()))
                misses = 0
        out.append(np.sort(np.asarray(got, dtype=np.int64)))
    return out


def session_groups(labels: Any, num_clients: int, overlap: float, alpha: float,
                   rng: np.random.Generator) -> list[np.ndarray]:
    """Two device groups for arrival/departure experiments: clients ``[0, N/2)`` form group A and
    hold the labels :func:`overlap_label_split` gives A, clients ``[N/2, N)`` group B with B's.
    Inside a group every sample of its labels goes to its devices (:func:`_fill_group`); the
    samples of shared labels are dealt independently in each group, so a sample can be held by one
    device of A and one of B."""
    y = np.asarray(labels).reshape(-1)
    if num_clients < 2 or num_clients % 2:
        raise ValueError(f"session_groups needs an even number of clients (two equal groups), got {num_clients}")
    num_classes = int(y.max()) + 1
    a_cls, b_cls = overlap_label_split(num_classes, overlap)
    n = num_clients // 2
    return _fill_group(y, a_cls, n, alpha, rng) + _fill_group(y, b_cls, n, alpha, rng)


def make_partition(
    name: str,
    labels: Any,
    num_clients: int,
    rng: np.random.Generator,
    *,
    alpha: float = 0.5,
    shards_per_client: int = 2,
    classes_per_client: int = 2,
    min_size: int = 10,
    max_retries: int = 100,
    self_balancing: bool = False,
    report: dict[str, Any] | None = None,
    writers: Any = None,
    overlap: float = 0.0,
) -> list[np.ndarray]:
    """Dispatch to one of :data:`PARTITIONS` by name, passing only the arguments it uses.

    ``writers`` (one writer id per entry of ``labels``) is what ``natural`` partitions by; it is
    required there and ignored by the others."""
    if name == "iid":
        return iid(labels, num_clients, rng)
    if name == "session_groups":  # two device groups for sessions (sessions.count); uses overlap
        try:
            return session_groups(labels, num_clients, overlap, alpha, rng)
        except ValueError as exc:
            raise DataConfigError(str(exc)) from None
    if name == "dirichlet":
        return dirichlet(
            labels, num_clients, alpha, rng, min_size, max_retries,
            self_balancing=self_balancing, report=report,
        )
    if name == "shards":
        return shards(labels, num_clients, shards_per_client, rng)
    if name == "kshards":
        return kshards(labels, num_clients, shards_per_client, rng)
    if name == "pathological":
        return pathological(labels, num_clients, classes_per_client, rng)
    if name == "natural":
        if writers is None:
            raise DataConfigError(
                "the natural partition makes one client per writer and needs each sample's writer "
                "(writers=...); this pool has none"
            )
        if len(np.asarray(writers)) != len(_labels(labels)):
            raise DataConfigError("writers must give one writer per label")
        return natural(writers, num_clients, rng, report=report)
    raise DataConfigError(f"unknown partition {name!r}; accepted: {', '.join(PARTITIONS)}")


# --------------------------------------------------------------------------------------------------
# Statistics and checks
# --------------------------------------------------------------------------------------------------


def label_histograms(
    labels: Any, client_indices: Sequence[np.ndarray], num_classes: int | None = None
) -> np.ndarray:
    """``N×C`` int64 matrix: row ``k`` counts the labels of client ``k``."""
    y = _labels(labels)
    if num_classes is None:
        num_classes = int(y.max()) + 1 if y.size else 0
    out = np.zeros((len(client_indices), num_classes), dtype=np.int64)
    for k, idx in enumerate(client_indices):
        out[k] = np.bincount(y[np.asarray(idx, dtype=np.int64)], minlength=num_classes)[:num_classes]
    return out


def partition_stats(
    labels: Any, client_indices: Sequence[np.ndarray], num_classes: int | None = None
) -> dict[str, Any]:
    """JSON-ready summary: sizes, label histograms, classes per client, empty-class counts."""
    hist = label_histograms(labels, client_indices, num_classes)
    sizes = hist.sum(axis=1)
    present = (hist > 0).sum(axis=1)
    return {
        "num_clients": int(len(client_indices)),
        "num_classes": int(hist.shape[1]),
        "sizes": [int(s) for s in sizes],
        "min_size": int(sizes.min()) if len(sizes) else 0,
        "max_size": int(sizes.max()) if len(sizes) else 0,
        "mean_size": float(sizes.mean()) if len(sizes) else 0.0,
        "empty_clients": int((sizes == 0).sum()),
        "classes_per_client": [int(v) for v in present],
        "empty_class_counts": [int(hist.shape[1] - v) for v in present],
        "label_hist": hist.tolist(),
    }


def validate_partition(
    client_indices: Sequence[np.ndarray], n: int, *, complete: bool = True
) -> None:
    """Raise :class:`DataConfigError` unless the parts are disjoint, in ``[0, n)``, non-empty and
    (when ``complete``) cover every index exactly once."""
    seen = np.zeros(n, dtype=np.int64)
    for k, idx in enumerate(client_indices):
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size == 0:
            raise DataConfigError(f"client {k} is empty")
        if idx.min() < 0 or idx.max() >= n:
            raise DataConfigError(f"client {k} holds indices outside [0, {n})")
        np.add.at(seen, idx, 1)
    if (seen > 1).any():
        raise DataConfigError(f"{int((seen > 1).sum())} indices belong to more than one client")
    if complete and (seen == 0).any():
        raise DataConfigError(f"{int((seen == 0).sum())} indices belong to no client")
