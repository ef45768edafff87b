"""The federated view of a dataset: who holds which training samples.

:func:`build_federated_data` performs, in this order and all with one data-partition generator:

1. load the train and test splits into memory;
2. hold out the unlabelled public set of the distillation baselines (removed for every method, so
   all methods train on the same data);
3. hold out the validation set (``val_fraction``, stratified by class), when there is one;
4. split off the server set (the FedDUMAP paper's shared server data; size and class coverage
   configurable);
5. partition the remaining pool among the clients.

Every index in :class:`FederatedData` refers to rows of ``train`` (``public_indices`` refers to
rows of ``public_dataset`` when a separate public source is used). The client, server, public and
validation sets are pairwise disjoint. Rows may stay unused: the tail of a ``device_pool`` that
the server does not draw, and the writers ``natural`` leaves out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from torch import Tensor

from .datasets import ArrayDataset, load_dataset
from .errors import DataConfigError
from .partition import PARTITIONS, make_partition, partition_stats
from .server import label_distribution, non_iid_degree, split_public, split_server

__all__ = ["FederatedData", "build_federated_data", "save_partition", "load_partition"]


@dataclass(eq=False)
class FederatedData:
    """Train/test tensors plus the federated split of the training set.

    Attributes
    ----------
    train, test:
        in-memory datasets.
    client_indices:
        one sorted int64 array of ``train`` rows per client (never empty).
    server_indices:
        rows of ``train`` held by the server (labelled; FedDU-style methods), or ``None``.
    public_indices:
        rows of :attr:`public_dataset` forming the unlabelled public set (KD baselines), or ``None``.
    public_dataset:
        where the public images come from; ``None`` means ``train``.
    val_indices:
        rows of ``train`` held out as a validation set (no client or server sees them; choose
        settings on it, never on the test set), or ``None``.
    info:
        JSON-ready description (partition name and arguments, server classes, sources, repair
        counts), for ``run.json``.
    """

    train: ArrayDataset
    test: ArrayDataset
    client_indices: list[np.ndarray]
    server_indices: np.ndarray | None = None
    public_indices: np.ndarray | None = None
    public_dataset: ArrayDataset | None = None
    info: dict[str, Any] = field(default_factory=dict)
    val_indices: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.train.num_classes != self.test.num_classes or self.train.input_shape != self.test.input_shape:
            raise DataConfigError("train and test must share num_classes and input_shape")
        self.client_indices = [np.asarray(i, dtype=np.int64) for i in self.client_indices]
        if not self.client_indices:
            raise DataConfigError("client_indices must list at least one client")
        if self.public_dataset is not None and self.public_dataset.input_shape != self.train.input_shape:
            raise DataConfigError(
                f"public dataset input shape {self.public_dataset.input_shape} differs from the "
                f"training set's {self.train.input_shape}"
            )

    # ---- basic facts ---------------------------------------------------------------------------

    @property
    def num_classes(self) -> int:
        return self.train.num_classes

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return self.train.input_shape

    @property
    def num_clients(self) -> int:
        return len(self.client_indices)

    def _cid(self, cid: int) -> int:
        if isinstance(cid, bool) or not isinstance(cid, (int, np.integer)) or not 0 <= cid < self.num_clients:
            raise DataConfigError(f"cid must be an int in [0, {self.num_clients}), got {cid!r}")
        return int(cid)

    def client_num_samples(self, cid: int) -> int:
        """``n_k``: number of training samples of client ``cid``."""
        return int(len(self.client_indices[self._cid(cid)]))

    def client_label_hist(self, cid: int) -> np.ndarray:
        """Label counts of client ``cid`` (int64, length ``num_classes``)."""
        return self.train.label_histogram(self.client_indices[self._cid(cid)])

    def client_label_set(self, cid: int) -> np.ndarray:
        """Sorted classes present at client ``cid`` (HeteroFL/FedRolex classifier masking)."""
        return np.flatnonzero(self.client_label_hist(cid) > 0)

    def label_hists(self) -> np.ndarray:
        """``N×C`` label counts of all clients."""
        return np.stack([self.client_label_hist(k) for k in range(self.num_clients)])

    @property
    def num_server_samples(self) -> int:
        return 0 if self.server_indices is None else int(len(self.server_indices))

    def server_label_hist(self) -> np.ndarray:
        if self.server_indices is None:
            return np.zeros(self.num_classes, dtype=np.int64)
        return self.train.label_histogram(self.server_indices)

    # ---- non-IID degrees -------------------------------------------------------------------------

    def global_label_dist(self) -> np.ndarray:
        """``P̄``: the ``n_k``-weighted pooled label distribution of all clients (server excluded)."""
        return label_distribution(self.train.labels_np, self.num_classes, self.client_indices)

    def client_non_iid_degree(
        self, cid: int, *, base: float | str = 2, round_decimals: int | None = None
    ) -> float:
        """``D(P_k) = JS(P_k, P̄)``."""
        return float(non_iid_degree(
            self.client_label_hist(cid), self.global_label_dist(), base=base, round_decimals=round_decimals
        ))

    def pooled_non_iid_degree(
        self, cids: Any, *, base: float | str = 2, round_decimals: int | None = None
    ) -> float:
        """``D(P̄'^t)``: degree of the union of the given clients' data (FedDUMAP formula 7)."""
        hist = sum((self.client_label_hist(int(c)) for c in cids), np.zeros(self.num_classes, np.int64))
        return float(non_iid_degree(hist, self.global_label_dist(), base=base, round_decimals=round_decimals))

    def server_non_iid_degree(
        self, *, base: float | str = 2, round_decimals: int | None = None
    ) -> float | None:
        """``D(P_0)``; ``None`` without server data."""
        if not self.num_server_samples:
            return None
        return float(non_iid_degree(
            self.server_label_hist(), self.global_label_dist(), base=base, round_decimals=round_decimals
        ))

    # ---- public data -----------------------------------------------------------------------------

    def public_inputs(self) -> Tensor | None:
        """Images of the public set (labels are deliberately not exposed); ``None`` if absent."""
        if self.public_indices is None or not len(self.public_indices):
            return None
        src = self.public_dataset if self.public_dataset is not None else self.train
        return src.images[np.asarray(self.public_indices, dtype=np.int64)]

    # ---- reporting -------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """JSON-ready partition summary (sizes, histograms, degrees, server/public facts)."""
        stats = partition_stats(self.train.labels_np, self.client_indices, self.num_classes)
        degrees = non_iid_degree(self.label_hists(), self.global_label_dist())
        stats.update(
            {
                "dataset": self.train.name,
                "train_size": len(self.train),
                "test_size": len(self.test),
                "client_non_iid_degree": [float(d) for d in np.atleast_1d(degrees)],
                "server_size": self.num_server_samples,
                "server_label_hist": self.server_label_hist().tolist(),
                "server_non_iid_degree": self.server_non_iid_degree(),
                "public_size": 0 if self.public_indices is None else int(len(self.public_indices)),
            }
        )
        stats.update({k: v for k, v in self.info.items() if k not in stats})
        return stats


# --------------------------------------------------------------------------------------------------
# Builder
# --------------------------------------------------------------------------------------------------


def _generator(rng: np.random.Generator | int) -> np.random.Generator:
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool) and rng >= 0:
        # concern 0 of the seed table: data partition
        return np.random.default_rng(np.random.SeedSequence(int(rng), spawn_key=(0,)))
    raise TypeError(f"rng must be a numpy.random.Generator or a non-negative int seed, got {rng!r}")


def _device_pool(spec: Any, n: int) -> int | None:
    if spec is None:
        return None
    if isinstance(spec, bool):
        raise DataConfigError(f"device_pool must be None, a fraction in (0, 1] or a count, got {spec!r}")
    if isinstance(spec, (int, np.integer)):
        if not 1 <= spec <= n:
            raise DataConfigError(f"device_pool must be a count in [1, {n}], got {spec!r}")
        return int(spec)
    if isinstance(spec, (float, np.floating)) and 0.0 < spec <= 1.0:
        return max(1, int(round(float(spec) * n)))
    raise DataConfigError(f"device_pool must be None, a fraction in (0, 1] or a count, got {spec!r}")


def build_federated_data(
    dataset: str | tuple[ArrayDataset, ArrayDataset],
    data_dir: str | os.PathLike[str] | None = None,
    num_clients: int = 10,
    partition: str = "dirichlet",
    alpha: float = 0.5,
    shards: int = 2,
    server_fraction: float | int = 0.0,
    server_classes: Any = None,
    public_fraction: float | int = 0.0,
    rng: np.random.Generator | int = 0,
    *,
    classes_per_client: int = 2,
    min_size: int = 10,
    max_retries: int = 100,
    self_balancing: bool = False,
    server_balance: str = "equal",
    group_overlap: float = 0.0,
    device_pool: float | int | None = None,
    public_source: str | None = None,
    download: bool = False,
    normalize: bool = True,
    dataset_options: Mapping[str, Any] | None = None,
    val_fraction: float = 0.0,
) -> FederatedData:
    """Load a dataset and split its training set among public, server and clients.

    Parameters
    ----------
    dataset:
        a name for :func:`load_dataset`, or a ready ``(train, test)`` pair.
    data_dir, download, normalize, dataset_options:
        passed to :func:`load_dataset`.
    num_clients:
        ``N``.
    partition:
        one of :data:`~fedhetero.data.partition.PARTITIONS`; ``alpha`` (Dirichlet),
        ``shards`` (shards per client; also ``kshards``' K), ``classes_per_client`` (pathological), ``min_size``,
        ``max_retries`` and ``self_balancing`` (Dirichlet) configure it; ``group_overlap`` is the
        label overlap of ``session_groups``' two device groups. ``natural`` makes one client per
        writer of the client pool and needs a dataset that records writers
        (:attr:`ArrayDataset.writers`: ``femnist``); with fewer clients than writers it draws
        ``num_clients`` writers at random and leaves the others' samples unused.
    server_fraction:
        server set size: a fraction of the whole training set (float in ``[0, 1)``) or a count
        (int); ``0`` means no server data. (FedDUMAP's ``n_0 = p·40000`` is a count.)
    server_classes:
        server class coverage: ``None`` (all), an int count, a fraction of classes, or a list.
    server_balance:
        ``"equal"`` samples per server class (authors' code) or ``"proportional"``.
    device_pool:
        FedDUMAP protocol: only the first ``device_pool`` training rows (count, or fraction of the
        training set) go to devices and the server draws from the rows after them; rows of the tail
        not drawn by the server are unused. ``None`` (default): one shared pool.
    public_fraction:
        unlabelled hold-out of the training set (fraction or count) for KD baselines; removed before
        everything else. Ignored when ``public_source`` is given.
    val_fraction:
        validation hold-out: this fraction of the training set, stratified by class, removed after
        the public split and before everything else (``0``: none; the generator draws nothing, so
        the other splits are those of a run without it).
    public_source:
        another dataset name whose whole training split is the public set (e.g. ``"cifar100"`` for
        CIFAR-10, the usual pairing for distillation baselines); it must have the same input shape.
    rng:
        the data-partition generator (concern 0), or an int master seed from which it is derived
        as ``SeedSequence(seed, spawn_key=(0,))``.

    Returns
    -------
    FederatedData
        deterministic given the arguments and ``rng``'s state.
    """
    gen = _generator(rng)
    if partition not in PARTITIONS:
        raise DataConfigError(f"partition must be one of {', '.join(PARTITIONS)}, got {partition!r}")
    opts = dict(dataset_options or {})
    if isinstance(dataset, str):
        train = load_dataset(dataset, data_dir=data_dir, split="train", download=download, normalize=normalize, **opts)
        test = load_dataset(dataset, data_dir=data_dir, split="test", download=download, normalize=normalize, **opts)
    elif isinstance(dataset, tuple) and len(dataset) == 2 and all(isinstance(d, ArrayDataset) for d in dataset):
        train, test = dataset
    else:
        raise DataConfigError(
            f"dataset must be a dataset name or a (train, test) pair of ArrayDataset, got {type(dataset).__name__}"
        )
    for part, ds in (("training", train), ("test", test)):
        if not len(ds):  # a run would train on nothing or report accuracy 0 and loss 0 every round
            raise DataConfigError(f"the {part} split of {ds.name or 'the given dataset'} is empty (0 samples)")
    n = len(train)
    labels = train.labels_np
    if partition == "natural" and train.writers is None:
        raise DataConfigError(
            f"partition 'natural' makes one client per writer, but the {train.name or 'given'} dataset "
            f"records no writers; use a dataset with writers (femnist) or another partition"
        )
    info: dict[str, Any] = {
        "partition": partition,
        "num_clients": int(num_clients) if isinstance(num_clients, (int, np.integer)) else num_clients,
    }

    # 1. public hold-out (removed for all methods)
    public_dataset: ArrayDataset | None = None
    public_idx: np.ndarray | None = None
    pool = np.arange(n, dtype=np.int64)
    if public_source is not None:
        public_dataset = load_dataset(
            public_source, data_dir=data_dir, split="train", download=download, normalize=normalize
        )
        public_idx = np.arange(len(public_dataset), dtype=np.int64)
        info["public_source"] = f"{public_source}:train"
    elif not (isinstance(public_fraction, (int, float)) and not isinstance(public_fraction, bool) and public_fraction == 0):
        public_idx, pool = split_public(pool, public_fraction, gen)
        info["public_source"] = f"{train.name or 'train'}:holdout"
        if not len(public_idx):
            public_idx = None

    # 1b. validation hold-out (stratified: every class in its share)
    val_idx: np.ndarray | None = None
    if val_fraction:
        if not 0.0 < float(val_fraction) < 1.0:
            raise DataConfigError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
        picked = []
        for c in np.unique(labels[pool]):
            rows = pool[labels[pool] == c]
            k = int(round(float(val_fraction) * len(rows)))
            if k:
                picked.append(gen.choice(rows, size=k, replace=False))
        val_idx = np.sort(np.concatenate(picked)) if picked else np.zeros(0, np.int64)
        pool = np.setdiff1d(pool, val_idx, assume_unique=True)
        info["val_samples"] = int(len(val_idx))

    # 2. server split
    dp = _device_pool(device_pool, n)
    server_idx: np.ndarray | None = None
    if dp is not None:
        device_rows = pool[pool < dp]
        server_pool = pool[pool >= dp]
        info["device_pool"] = dp
    else:
        device_rows = server_pool = pool
    is_zero = isinstance(server_fraction, (int, float)) and not isinstance(server_fraction, bool) and server_fraction == 0
    if not is_zero:
        size = server_fraction
        if isinstance(size, (float, np.floating)):
            if not 0.0 <= float(size) < 1.0:
                raise DataConfigError(
                    f"server_fraction must be a fraction in [0, 1) or an int count, got {size!r}"
                )
            size = int(round(float(size) * n))  # a fraction of the whole training set
        split = split_server(
            labels, size, gen, classes=server_classes, balance=server_balance, pool=server_pool
        )
        server_idx = split.indices if len(split.indices) else None
        info["server_classes"] = list(split.classes)
        device_rows = split.remaining if dp is None else device_rows
    # 3. partition the device pool
    report: dict[str, Any] = {}
    parts = make_partition(
        partition, labels[device_rows], num_clients, gen,
        alpha=alpha, shards_per_client=shards, classes_per_client=classes_per_client,
        min_size=min_size, max_retries=max_retries, self_balancing=self_balancing, report=report,
        overlap=group_overlap,
        writers=None if train.writers is None else train.writers[device_rows],
    )
    client_indices = [device_rows[p] for p in parts]
    if partition == "dirichlet":
        info.update({"alpha": float(alpha), "min_partition_size": int(min_size), "max_retries": int(max_retries),
                     "attempts": report.get("attempts"), "repaired_samples": report.get("moved")})
    elif partition in ("shards", "kshards"):
        info["shards_per_client"] = int(shards)
    elif partition == "pathological":
        info["classes_per_client"] = int(classes_per_client)
    elif partition == "natural":
        names = train.writer_names
        info.update({
            "writers_available": report.get("writers_available"),
            "unused_samples": report.get("unused_samples"),
            "client_writers": [names[w] if names is not None else int(w) for w in report.get("writers", [])],
        })
    elif partition == "session_groups":
        info.update({"alpha": float(alpha), "group_overlap": float(group_overlap)})
    return FederatedData(
        train=train,
        test=test,
        client_indices=client_indices,
        server_indices=server_idx,
        public_indices=public_idx,
        public_dataset=public_dataset,
        info=info,
        val_indices=val_idx if val_idx is not None and len(val_idx) else None,
    )


# --------------------------------------------------------------------------------------------------
# Persistence (run directory: partition.npz)
# --------------------------------------------------------------------------------------------------


def save_partition(data: FederatedData, path: str | os.PathLike[str]) -> None:
    """Write client/server/public indices and label histograms to ``path`` (``.npz``, no pickle)."""
    sizes = np.array([len(i) for i in data.client_indices], dtype=np.int64)
    empty = np.zeros(0, np.int64)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(
        tmp,
        client_offsets=np.concatenate(([0], np.cumsum(sizes))).astype(np.int64),
        client_indices=np.concatenate(data.client_indices).astype(np.int64),
        label_hist=data.label_hists(),
        server_indices=empty if data.server_indices is None else np.asarray(data.server_indices, np.int64),
        public_indices=empty if data.public_indices is None else np.asarray(data.public_indices, np.int64),
        val_indices=empty if data.val_indices is None else np.asarray(data.val_indices, np.int64),
    )
    os.replace(tmp, path)


def load_partition(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a file written by :func:`save_partition`: ``client_indices`` (list), ``server_indices``,
    ``public_indices`` (``None`` when empty) and ``label_hist``."""
    with np.load(path, allow_pickle=False) as z:
        offsets = z["client_offsets"]
        flat = z["client_indices"]
        out = {
            "client_indices": [flat[offsets[i]: offsets[i + 1]].copy() for i in range(len(offsets) - 1)],
            "label_hist": z["label_hist"].copy(),
            "server_indices": z["server_indices"].copy() if len(z["server_indices"]) else None,
            "public_indices": z["public_indices"].copy() if len(z["public_indices"]) else None,
            "val_indices": z["val_indices"].copy() if "val_indices" in z.files and len(z["val_indices"]) else None,
        }
    return out
