"""Client partitions (fedhetero.data.partition): IID, Dirichlet, shards and pathological splits are
disjoint, complete, non-empty and reproducible, with the sizes and label skew each promises."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from fedhetero.data import (
    DataConfigError,
    dirichlet,
    iid,
    label_histograms,
    make_partition,
    non_iid_degree,
    partition_stats,
    pathological,
    shards,
    validate_partition,
)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def balanced_labels(n: int, c: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.arange(n) % c)


# ------------------------------------------------------------------------------------------------
# partitions
# ------------------------------------------------------------------------------------------------
PARTITION_CASES = {
    "iid": dict(),
    "dirichlet": dict(alpha=0.5),
    "shards": dict(shards_per_client=2),
    "pathological": dict(classes_per_client=3),
}


@pytest.mark.parametrize("name", sorted(PARTITION_CASES))
def test_partitions_disjoint_complete_nonempty_reproducible(name):
    y = balanced_labels(3000, 10)
    kw = PARTITION_CASES[name]
    a = make_partition(name, y, 37, rng(5), **kw)
    b = make_partition(name, y, 37, rng(5), **kw)
    c = make_partition(name, y, 37, rng(6), **kw)
    assert len(a) == 37
    validate_partition(a, len(y))  # raises unless disjoint, complete, non-empty
    all_idx = np.concatenate(a)
    assert len(all_idx) == len(y) and np.array_equal(np.sort(all_idx), np.arange(len(y)))
    assert min(len(p) for p in a) >= 1
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    assert any(not np.array_equal(p, q) for p, q in zip(a, c))
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in a)


def test_iid_sizes_equal():
    parts = iid(np.zeros(103, np.int64), 10, rng())
    sizes = sorted(len(p) for p in parts)
    assert sizes[0] == 10 and sizes[-1] == 11 and sum(sizes) == 103


def test_dirichlet_small_alpha_fast_no_empty_and_repaired():
    y = balanced_labels(50_000, 10)
    report: dict = {}
    t0 = time.perf_counter()
    parts = dirichlet(y, 100, 0.01, rng(0), min_size=10, max_retries=100, report=report)
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0
    validate_partition(parts, len(y))
    assert min(len(p) for p in parts) >= 10
    assert report["attempts"] == 101 and report["moved"] > 0
    # the same call repairs identically
    again = dirichlet(y, 100, 0.01, rng(0), min_size=10, max_retries=100)
    assert all(np.array_equal(p, q) for p, q in zip(parts, again))


def test_dirichlet_tight_min_size_and_infeasible():
    y = balanced_labels(200, 4)
    parts = dirichlet(y, 20, 0.001, rng(2), min_size=10, max_retries=3)
    validate_partition(parts, 200)
    assert [len(p) for p in parts] == [10] * 20
    with pytest.raises(DataConfigError, match="min_size"):
        dirichlet(y, 21, 0.5, rng(), min_size=10)
    with pytest.raises(DataConfigError, match="alpha"):
        dirichlet(y, 4, 0.0, rng())
    with pytest.raises(TypeError, match="rng"):
        dirichlet(y, 4, 0.5, 0)


def test_dirichlet_alpha_controls_skew():
    y = balanced_labels(20_000, 10)
    glob = np.full(10, 0.1)
    skewed = dirichlet(y, 20, 0.05, rng(1))
    even = dirichlet(y, 20, 1000.0, rng(1))
    h_skew = label_histograms(y, skewed, 10)
    h_even = label_histograms(y, even, 10)
    js_skew = non_iid_degree(h_skew, glob)
    js_even = non_iid_degree(h_even, glob)
    assert float(np.mean(js_skew)) > 0.4
    assert float(np.max(js_even)) < 0.01
    assert float(np.mean((h_skew > 0).sum(1))) < 5
    assert np.all((h_even > 0).sum(1) == 10)
    sizes = h_even.sum(1)
    assert sizes.max() / sizes.min() < 1.2  # near-uniform sizes too


def test_dirichlet_self_balancing():
    y = balanced_labels(5000, 10)
    plain = dirichlet(y, 10, 0.1, rng(3))
    bal = dirichlet(y, 10, 0.1, rng(3), self_balancing=True)
    validate_partition(bal, 5000)
    spread = lambda parts: np.std([len(p) for p in parts])  # noqa: E731
    assert spread(bal) < spread(plain)


def test_shards_label_count_and_sizes():
    y = balanced_labels(40_000, 10)
    parts = shards(y, 100, 2, rng(0))
    assert all(len(p) == 400 for p in parts)
    hist = label_histograms(y, parts, 10)
    assert np.all((hist > 0).sum(1) <= 2)
    with pytest.raises(DataConfigError, match="shards"):
        shards(y[:50], 30, 2, rng())


def test_pathological_exact_classes():
    y = balanced_labels(1000, 10)
    parts = pathological(y, 15, 3, rng(0))
    hist = label_histograms(y, parts, 10)
    assert np.all((hist > 0).sum(1) == 3)
    with pytest.raises(DataConfigError, match="classes_per_client"):
        pathological(y, 3, 2, rng())


def test_partition_stats_and_unknown_name():
    y = balanced_labels(100, 5)
    parts = iid(y, 4, rng())
    st = partition_stats(y, parts, 5)
    assert st["sizes"] == [25, 25, 25, 25] and st["empty_clients"] == 0
    assert np.array(st["label_hist"]).sum() == 100
    assert st["empty_class_counts"] == [5 - k for k in st["classes_per_client"]]
    json.dumps(st)
    with pytest.raises(DataConfigError, match="accepted"):
        make_partition("quantity", y, 4, rng())
    with pytest.raises(DataConfigError, match="more than one client"):
        validate_partition([np.array([0, 1]), np.array([1, 2])], 3)
