"""The server's and the public data (fedhetero.data.server): the JS divergence and non-IID degree
against hand-computed and published values, the server split's classes, sizes and degree, and the
public split."""

from __future__ import annotations

import numpy as np
import pytest

from fedhetero.data import (
    DataConfigError,
    js_divergence,
    non_iid_degree,
    split_public,
    split_server,
)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def balanced_labels(n: int, c: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.arange(n) % c)


# ------------------------------------------------------------------------------------------------
# JS non-IID degree and server / public splits
# ------------------------------------------------------------------------------------------------
def test_js_hand_computed_two_and_three_classes():
    # p = [1, 0], q = [.5, .5]: m = [.75, .25]
    expect2 = 0.5 * np.log2(1 / 0.75) + 0.5 * (0.5 * np.log2(0.5 / 0.75) + 0.5 * np.log2(0.5 / 0.25))
    assert abs(js_divergence([1, 0], [0.5, 0.5]) - expect2) < 1e-12
    assert abs(expect2 - 0.3112781244591328) < 1e-12
    # p = [1, 0, 0], q uniform: ½·log2(3/2) + ½·(1/3) = 0.45914791...
    expect3 = 0.5 * np.log2(1.5) + 0.5 / 3
    assert abs(js_divergence([1, 0, 0], [1, 1, 1]) - expect3) < 1e-12
    assert abs(js_divergence([1, 0, 0], [1, 1, 1], base="e") - expect3 * np.log(2)) < 1e-12
    # counts or probabilities; symmetric; identical -> 0; disjoint -> 1 (base 2)
    assert abs(js_divergence([30, 10, 0], [2, 1, 1]) - js_divergence([0.75, 0.25, 0], [0.5, 0.25, 0.25])) < 1e-12
    assert abs(js_divergence([3, 1, 0], [1, 1, 2]) - js_divergence([1, 1, 2], [3, 1, 0])) < 1e-12
    assert js_divergence([2, 2, 1], [4, 4, 2]) == 0.0
    assert abs(js_divergence([1, 0], [0, 1]) - 1.0) < 1e-12
    with pytest.raises(DataConfigError):
        js_divergence([0, 0], [1, 1])


def test_non_iid_degree_paper_check_values():
    uni10 = np.full(10, 0.1)
    two = [1, 1] + [0] * 8
    five = [1] * 5 + [0] * 5
    assert round(non_iid_degree(two, uni10), 3) == 0.610
    assert round(non_iid_degree(five, uni10), 3) == 0.311
    assert non_iid_degree(np.ones(10), uni10) == 0.0
    uni100 = np.ones(100)
    assert round(non_iid_degree([1] * 20 + [0] * 80, uni100), 3) == 0.610
    assert round(non_iid_degree([1] * 50 + [0] * 50, uni100), 3) == 0.311
    rows = non_iid_degree(np.array([two, five]), uni10)
    assert rows.shape == (2,) and abs(rows[0] - non_iid_degree(two, uni10)) < 1e-15
    # rounding frequencies to 3 decimals (authors' code) changes the value only slightly
    third = [1, 1, 1] + [0] * 7
    r = non_iid_degree(third, uni10, round_decimals=3)
    assert r != non_iid_degree(third, uni10) and abs(r - non_iid_degree(third, uni10)) < 1e-2


def test_split_server_classes_sizes_and_degree():
    y = balanced_labels(5000, 10)
    s = split_server(y, 1000, rng(4), classes=5)
    assert len(s.indices) == 1000 and len(s.classes) == 5
    counts = np.bincount(y[s.indices], minlength=10)
    assert sorted(counts[list(s.classes)].tolist()) == [200] * 5
    assert counts.sum() == counts[list(s.classes)].sum()
    assert len(np.intersect1d(s.indices, s.remaining)) == 0
    assert np.array_equal(np.union1d(s.indices, s.remaining), np.arange(5000))
    expect = non_iid_degree(np.bincount(y[s.indices], minlength=10), np.bincount(y[s.remaining], minlength=10))
    assert abs(s.non_iid_degree - expect) < 1e-15
    # same generator state -> same split
    s2 = split_server(y, 1000, rng(4), classes=5)
    assert np.array_equal(s.indices, s2.indices) and s.classes == s2.classes
    # fraction of data and of classes, explicit list
    s3 = split_server(y, 0.1, rng(), classes=0.2)
    assert len(s3.indices) == 500 and len(s3.classes) == 2
    s4 = split_server(y, 30, rng(), classes=[1, 7])
    assert set(np.unique(y[s4.indices])) == {1, 7} and len(s4.indices) == 30
    with pytest.raises(DataConfigError, match="exceeds"):
        split_server(y, 1200, rng(), classes=[1, 2])
    with pytest.raises(DataConfigError, match="server_classes"):
        split_server(y, 10, rng(), classes=11)


def test_split_server_paper_degrees_with_uniform_devices():
    # device pool uniform over 10 classes; server from 5 (2) classes -> 0.311 (0.610)
    y = balanced_labels(20_000, 10)
    dev, tail = np.arange(15_000), np.arange(15_000, 20_000)
    glob = np.bincount(y[dev], minlength=10)
    for k, expect in ((5, 0.311), (2, 0.610)):
        s = split_server(y, 1000, rng(k), classes=k, pool=tail)
        assert np.all(s.indices >= 15_000)
        assert round(non_iid_degree(np.bincount(y[s.indices], minlength=10), glob), 2) == round(expect, 2)


def test_split_public():
    pub, rest = split_public(100, 0.1, rng())
    assert len(pub) == 10 and len(rest) == 90 and len(np.intersect1d(pub, rest)) == 0
    pub2, _ = split_public(100, 0.1, rng())
    assert np.array_equal(pub, pub2)
    none, all_ = split_public(np.arange(5, 15), 0, rng())
    assert len(none) == 0 and np.array_equal(all_, np.arange(5, 15))
