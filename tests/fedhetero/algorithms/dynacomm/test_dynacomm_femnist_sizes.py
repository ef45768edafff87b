"""DynaComm sanity values at FEMNIST's sizes (62 classes, 644,210 training images, L = 3221):
the group KL of single-class and k-class groups, and the pooled-label KL of ten random clients
under the Dirichlet partitions the paper uses on FEMNIST, which its selector figures put at about
1.5, 0.4 and 0.15 for Dir(0.01), Dir(0.1) and Dir(0.3) (a check of the partitioner and the KL
together). Only the pure functions are imported, not the engine."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedhetero.algorithms.dynacomm import selection as dc
from fedhetero.data.partition import dirichlet, label_histograms

FEMNIST_CLASSES = 62
FEMNIST_TRAIN = 644_210


def _one_class_hists(classes: int, per_client: int = 300) -> np.ndarray:
    return np.eye(classes) * per_client


def test_kl_of_single_and_k_class_groups_with_62_classes() -> None:
    uniform = np.full(FEMNIST_CLASSES, 1 / FEMNIST_CLASSES)
    hists = _one_class_hists(FEMNIST_CLASSES)
    assert dc.group_distance(hists, [17], uniform) == pytest.approx(math.log(62))  # 4.127
    assert math.log(62) == pytest.approx(4.1271, abs=1e-4)
    for k in (1, 2, 5, 10, 31, 61, 62):
        assert dc.group_distance(hists, list(range(k)), uniform) == pytest.approx(math.log(62 / k), abs=1e-12)
    # a skewed global distribution (FEMNIST's digits are far more frequent than its letters):
    # a one-class group scores -log p_c; a group whose classes appear in their global proportions
    # scores -log of the classes' total share
    glob = np.r_[np.full(10, 5.0), np.ones(26), np.full(26, 0.7)]
    glob /= glob.sum()
    for c in (0, 9, 10, 61):
        assert dc.group_distance(hists, [c], glob) == pytest.approx(-math.log(glob[c]))
    members = [0, 3, 12, 40, 55]
    prop = np.diag(glob * 10_000)  # client c holds class c in its global proportion
    assert dc.group_distance(prop, members, glob) == pytest.approx(-math.log(glob[members].sum()))
    assert dc.group_distance(prop, list(range(62)), glob) == pytest.approx(0.0, abs=1e-12)


def test_femnist_steps_syncs_and_kappa() -> None:
    L = dc.default_local_steps(FEMNIST_TRAIN, 100, 5, 10)
    assert L == 3221
    intervals = [dc.parse_interval(x) for x in "abcdefg"]
    assert [dc.nu_code(i, L) for i in intervals] == [3220, 805, 202, 101, 51, 26, 13]
    assert [dc.nu_paper(i, L) for i in intervals] == [3221, 806, 202, 101, 51, 26, 13]
    # interval g still synchronises 13 times per round at L = 3221 (the last one at step L)
    g = dc.sync_points(256, L, "paper")
    assert len(g) == 13 and g[-1] == L and g[:2] == [256, 512]
    # a FedAvg-like client (one exchange per round) costs 1/3221 ≈ 0.0003, not the printed 0.004
    assert dc.kappa_round([1] * 10, 10, L) == pytest.approx(1 / 3221) and round(1 / 3221, 4) == 0.0003
    # Dynamic-0.3 a-g with three high-frequency clients: (3·3220 + 7·13) / (10·3221)
    assert dc.kappa_round([3220] * 3 + [13] * 7, 10, L) == pytest.approx(0.3027, abs=1e-4)


def _femnist_like_labels() -> tuple[np.ndarray, np.ndarray]:
    """644,210 labels over 62 classes, digits five times and lower-case letters 0.7 times as
    frequent as upper-case ones (roughly FEMNIST's imbalance)."""
    freq = np.r_[np.full(10, 5.0), np.ones(26), np.full(26, 0.7)]
    counts = np.floor(freq / freq.sum() * FEMNIST_TRAIN).astype(np.int64)
    counts[0] += FEMNIST_TRAIN - counts.sum()
    y = np.repeat(np.arange(FEMNIST_CLASSES), counts)
    return y, counts / counts.sum()


@pytest.mark.parametrize("alpha, expected, tol", [(0.01, 1.5, 0.3), (0.1, 0.4, 0.12), (0.3, 0.15, 0.07)])
def test_pooled_kl_of_ten_clients_under_femnist_dirichlet(alpha: float, expected: float, tol: float) -> None:
    y, glob = _femnist_like_labels()
    assert len(y) == FEMNIST_TRAIN
    rng = np.random.default_rng(0)
    values = []
    for _ in range(2):  # two partitions, 40 rounds of ten active clients each (C = 0.1, M = 100)
        parts = dirichlet(y, 100, alpha, rng, min_size=10, self_balancing=True)  # the authors' N/M cap
        assert min(len(p) for p in parts) >= 10
        hists = label_histograms(y, parts, FEMNIST_CLASSES).astype(np.float64)
        for _ in range(40):
            active = rng.choice(100, size=10, replace=False)
            values.append(dc.group_distance(hists, [int(a) for a in active], glob))
    mean = float(np.mean(values))
    assert abs(mean - expected) <= tol, f"Dir({alpha}): mean pooled KL {mean:.3f}, expected about {expected}"


def test_pooled_kl_falls_as_alpha_grows() -> None:
    y, glob = _femnist_like_labels()
    means = []
    for alpha in (0.01, 0.1, 0.3, 1.0):
        rng = np.random.default_rng(1)
        hists = label_histograms(y, dirichlet(y, 100, alpha, rng, min_size=10, self_balancing=True), 62).astype(float)
        means.append(np.mean([dc.group_distance(hists, list(rng.choice(100, 10, replace=False)), glob) for _ in range(40)]))
    assert means == sorted(means, reverse=True) and means[-1] < 0.1


def test_selector_on_62_classes_never_beats_exhaustive_and_stays_close() -> None:
    rng = np.random.default_rng(3)
    y, glob = _femnist_like_labels()
    hists = label_histograms(y, dirichlet(y, 100, 0.1, rng, min_size=10, self_balancing=True), 62).astype(float)
    gaps = []
    for _ in range(5):
        active = hists[rng.choice(100, size=10, replace=False)]
        budget = dc.Budget(client=(3220.0,) * 10, server=3220.0 * 10, nu_high=3220.0, nu_low=13.0)
        _, d_dp = dc.select_ensemble_dp(active, glob, budget, orders=10, rng=rng)
        _, d_bf = dc.select_brute_force(active, glob, budget)
        assert d_dp >= d_bf - 1e-12
        gaps.append(d_dp - d_bf)
    assert float(np.mean(gaps)) < 0.05
