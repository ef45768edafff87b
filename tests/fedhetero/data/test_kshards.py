"""K label shards per client (HeteroFL/SemiFL "non-iid-l-K", the DynaComm paper's "K classes")."""

from __future__ import annotations

import numpy as np
import pytest

from fedhetero.core.common.config import DataConfig
from fedhetero.data.errors import DataConfigError
from fedhetero.data.partition import PARTITIONS, kshards, label_histograms, make_partition, shards, validate_partition


def _cifar_like(per_class: int = 5000, classes: int = 10, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(classes), per_class))


def _shard_sizes(class_size: int, per_class: int) -> list[int]:
    return [len(p) for p in np.array_split(np.arange(class_size), per_class)]


def _shards_of(counts: np.ndarray, sizes_per_class: dict[int, list[int]]) -> int:
    """How many whole shards a client's per-class counts consist of (asserts the counts are sums of
    distinct shard sizes of that class; balanced classes make this a division)."""
    total = 0
    for c, count in enumerate(counts):
        if count == 0:
            continue
        sizes = sizes_per_class[c]
        assert len(set(sizes)) == 1, "test helper expects equal shard sizes"
        assert count % sizes[0] == 0, f"class {c}: {count} is not a whole number of shards"
        total += count // sizes[0]
    return total


@pytest.mark.parametrize("k", [1, 2])
def test_cifar_numbers_each_client_gets_exactly_k_shards(k: int) -> None:
    y = _cifar_like()
    parts = kshards(y, 100, k, np.random.default_rng(1))
    validate_partition(parts, len(y))
    hist = label_histograms(y, parts, 10)
    assert (hist.sum(axis=1) == 500).all()  # every client holds 500 samples
    sizes = {c: _shard_sizes(5000, k * 100 // 10) for c in range(10)}
    assert sizes[0][0] == 500 // k
    assert all(_shards_of(row, sizes) == k for row in hist)
    if k == 1:
        assert ((hist > 0).sum(axis=1) == 1).all()  # one whole class each
    else:
        assert ((hist > 0).sum(axis=1) <= 2).all()
        assert set(np.unique(hist)) <= {0, 250, 500}


def test_a_client_can_draw_two_shards_of_one_class() -> None:
    y = _cifar_like(per_class=100, classes=10)
    seen_double = False
    for seed in range(10):
        hist = label_histograms(y, kshards(y, 100, 2, np.random.default_rng(seed)), 10)
        seen_double |= bool(((hist > 0).sum(axis=1) == 1).any())
    assert seen_double


def test_shards_never_straddle_classes_unlike_sort_and_shard() -> None:
    # unbalanced classes: 30, 50 and 70 samples; M = 5, K = 3 → 5 shards per class
    y = np.repeat(np.arange(3), [30, 50, 70])
    parts = kshards(y, 5, 3, np.random.default_rng(0))
    validate_partition(parts, len(y))
    hist = label_histograms(y, parts, 3)
    for c, size in enumerate([30, 50, 70]):
        shard = size // 5
        assert (hist[:, c] % shard == 0).all()
    # every client holds exactly K = 3 whole shards (their sizes depend on the classes drawn)
    assert (sum(hist[:, c] // (s // 5) for c, s in enumerate([30, 50, 70])) == 3).all()
    # the sort-and-shard partition cuts the label-sorted pool into 15 pieces of 10: some straddle
    old = label_histograms(y, shards(y, 5, 3, np.random.default_rng(0)), 3)
    assert not all((old[:, c] % (s // 5) == 0).all() for c, s in enumerate([30, 50, 70]))


def test_reproducible_and_dispatched() -> None:
    y = _cifar_like(per_class=50)
    a = make_partition("kshards", y, 20, np.random.default_rng(3), shards_per_client=2)
    b = kshards(y, 20, 2, np.random.default_rng(3))
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    assert "kshards" in PARTITIONS
    assert DataConfig(partition="kshards").partition == "kshards"


def test_infeasible_arguments_are_clear_errors() -> None:
    y = _cifar_like(per_class=50)
    with pytest.raises(DataConfigError, match="multiple of 10"):
        kshards(y, 7, 1, np.random.default_rng(0))
    with pytest.raises(DataConfigError, match="fewer than its"):
        kshards(np.repeat(np.arange(2), [2, 40]), 4, 2, np.random.default_rng(0))


def test_build_federated_data_records_k() -> None:
    from fedhetero.data import build_federated_data

    opts = {"num_samples": 400, "num_test": 20, "num_classes": 10, "input_shape": (1, 8, 8)}
    fed = build_federated_data("synthetic", num_clients=10, partition="kshards", shards=2, rng=0, min_size=1,
                               dataset_options=opts)
    assert fed.info["partition"] == "kshards" and fed.info["shards_per_client"] == 2
    assert (fed.label_hists().sum(axis=1) == 40).all()
