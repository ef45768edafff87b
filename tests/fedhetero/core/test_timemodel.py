"""Tests of fedhetero.core.hetero.timemodel: the paper's simulated time, smoothing, time to target."""

from __future__ import annotations

import numpy as np
import pytest

from fedhetero.core.hetero.timemodel import (
    PAPER_CNN_MACS,
    PAPER_CNN_SAMPLE_PASSES,
    ClientCost,
    TimeModel,
    TimeModelError,
    cumulative_times,
    paper_comm_seconds,
    paper_cumulative_times,
    paper_round_seconds,
    rounds_to_target,
    smooth_accuracy,
    smoothed_final_accuracy,
    time_to_target,
    times_faster,
)

CNN_PARAMS, VGG_PARAMS, LENET_PARAMS = 122_570, 9_750_922, 62_006


def test_paper_round_times_match_spec():
    # FedDUMAP authors' time model, per round: CNN 3.42 s (1.12 comm), VGG 97.3 s (89.3), LeNet 1.87 s (0.57)
    assert round(paper_round_seconds("cnn", CNN_PARAMS), 2) == 3.42
    assert round(paper_comm_seconds(CNN_PARAMS), 2) == 1.12
    assert round(paper_round_seconds("vgg", VGG_PARAMS), 1) == 97.3
    assert round(paper_comm_seconds(VGG_PARAMS), 1) == 89.3
    assert round(paper_round_seconds("lenet", LENET_PARAMS), 2) == 1.87
    assert round(paper_comm_seconds(LENET_PARAMS), 2) == 0.57
    # exact formula
    mb = CNN_PARAMS * 4 * 10 / 2**20
    assert abs(paper_comm_seconds(CNN_PARAMS) - (mb / (50 / 8) + mb / (100 / 8))) < 1e-12
    # pruning scales each term; data-sharing multiplies training time
    pruned = paper_round_seconds(2.3, CNN_PARAMS, macs_ratio=0.5, params_ratio=0.25, train_multiplier=6)
    assert abs(pruned - (2.3 * 6 * 0.5 + paper_comm_seconds(CNN_PARAMS) * 0.25)) < 1e-12
    with pytest.raises(TimeModelError, match="train_seconds"):
        paper_round_seconds("alexnet", 10)


def test_paper_cumulative_times_and_spec_consequence():
    t = paper_cumulative_times(300, "cnn", CNN_PARAMS)
    assert t.shape == (301,) and t[0] == 0.0
    assert abs(t[10] - 10 * paper_round_seconds("cnn", CNN_PARAMS)) < 1e-9
    # so the paper's FedAvg-CNN time of 838 s to accuracy 0.6 is about 245 rounds
    assert int(np.searchsorted(t, 838.0)) in range(244, 247)
    # the model shrinks after a pruning round
    ratios = np.where(np.arange(4) < 2, 1.0, 0.5)
    tp = paper_cumulative_times(4, 2.0, 0, macs_ratios=ratios)
    assert np.allclose(tp, [0, 2, 4, 5, 6], rtol=0, atol=1e-12)


def test_time_model_reproduces_paper_cnn_round():
    tm = TimeModel()
    cost = ClientCost(PAPER_CNN_MACS, PAPER_CNN_SAMPLE_PASSES, bytes_up=CNN_PARAMS * 4, bytes_down=CNN_PARAMS * 4)
    assert abs(tm.compute_seconds(PAPER_CNN_MACS, PAPER_CNN_SAMPLE_PASSES) - 2.3) < 1e-12
    assert abs(tm.round_seconds([cost] * 10) - paper_round_seconds("cnn", CNN_PARAMS)) < 1e-9
    assert tm.model_bytes(CNN_PARAMS) == CNN_PARAMS * 4


def test_time_model_heterogeneous_clients():
    tm = TimeModel(uplink_mbit_s=8.0, downlink_mbit_s=16.0, megabyte=1e6, device_macs_per_s=1e9, train_macs_factor=3.0)
    assert abs(tm.upload_seconds(1e6) - 1.0) < 1e-12
    assert abs(tm.download_seconds(1e6) - 0.5) < 1e-12
    assert abs(tm.compute_seconds(1e6, 1000) - 3.0) < 1e-12
    assert abs(tm.compute_seconds(1e6, 1000, speed=2.0) - 1.5) < 1e-12
    fast = ClientCost(1e6, 1000, bytes_up=1e6, bytes_down=0, speed=3.0)  # 1 s compute, 1 s comm
    slow = ClientCost(1e6, 1000, bytes_up=2e6, bytes_down=0, speed=1.0)  # 3 s compute, 2 s comm
    assert abs(tm.round_seconds([fast, slow]) - (3.0 + 3.0)) < 1e-12  # shared link: max compute + Σ comm
    par = TimeModel(uplink_mbit_s=8.0, downlink_mbit_s=16.0, megabyte=1e6, device_macs_per_s=1e9, shared_link=False)
    assert abs(par.round_seconds([fast, slow]) - 5.0) < 1e-12  # slowest client end to end
    assert tm.round_seconds([]) == 0.0
    with pytest.raises(TimeModelError, match="uplink_mbit_s"):
        TimeModel(uplink_mbit_s=0)
    with pytest.raises(TimeModelError, match="speed"):
        tm.compute_seconds(1, 1, speed=0)


def test_cumulative_times():
    assert cumulative_times([1.0, 2.0, 0.5]).tolist() == [0.0, 1.0, 3.0, 3.5]
    with pytest.raises(TimeModelError):
        cumulative_times([1.0, -1.0])


def test_smoothing_matches_savgol_and_rounds():
    from scipy.signal import savgol_filter

    g = np.random.default_rng(0)
    rounds = np.arange(1, 201)
    clean = 0.7 * (1 - np.exp(-rounds / 40))
    noisy = clean + 0.03 * g.standard_normal(200)
    curve = np.concatenate(([0.1], noisy))
    sm = smooth_accuracy(curve, 39, has_initial=True)
    assert sm[0] == 0.1 and sm.shape == (201,)
    assert np.array_equal(sm[1:], np.round(savgol_filter(noisy, 39, 3), 3))
    final = smoothed_final_accuracy(curve, 39, has_initial=True)
    assert final == float(sm.max())
    assert final < float(noisy.max())  # smoothing removes the lucky spikes
    assert abs(final - clean.max()) < 0.02
    # a cubic is reproduced exactly by an order-3 filter; the max is the rounded last value
    cubic = 0.5 + 1e-3 * np.linspace(0, 1, 60) ** 3
    assert smoothed_final_accuracy(cubic, 39) == round(float(cubic[-1]), 3)


def test_smoothing_short_curves_and_validation():
    assert smoothed_final_accuracy([0.2, 0.4, 0.3]) == 0.4  # window 3 <= order 3: only rounding
    assert np.array_equal(smooth_accuracy([0.12345], 39), [0.123])
    short = np.array([0.1, 0.3, 0.2, 0.5, 0.4, 0.6, 0.55])
    from scipy.signal import savgol_filter

    assert np.array_equal(smooth_accuracy(short, 39, decimals=None), savgol_filter(short, 7, 3))
    with pytest.raises(TimeModelError, match="window"):
        smooth_accuracy(short, 40)
    with pytest.raises(TimeModelError, match="acc_history"):
        smooth_accuracy([], 39)


def test_time_to_target():
    times = [0.0, 3.4, 6.8, 10.2, 13.6]
    accs = [0.1, 0.45, 0.58, 0.60, 0.65]
    assert time_to_target(times, accs, 0.6) == 10.2  # >= counts
    assert time_to_target(times, accs, 0.59) == 10.2
    assert time_to_target(times, accs, 0.05) == 0.0
    assert time_to_target(times, accs, 0.7) is None
    assert rounds_to_target(accs, 0.5) == 2 and rounds_to_target(accs, 0.9) is None
    with pytest.raises(TimeModelError, match="same length"):
        time_to_target(times[:-1], accs, 0.5)
    # used with the smoothed curve and the paper's cumulative time
    t = paper_cumulative_times(100, "cnn", CNN_PARAMS)
    acc = np.concatenate(([0.1], 0.7 * (1 - np.exp(-np.arange(1, 101) / 20))))
    sm = smooth_accuracy(acc, 39, has_initial=True)
    i = int(np.flatnonzero(sm >= 0.6)[0])
    assert time_to_target(t, sm, 0.6) == t[i]


def test_times_faster():
    assert abs(times_faster(4447, 248) - 16.93) < 0.01  # "16.9 times faster"
    assert abs(times_faster(6726, 4677) - 0.438) < 0.001  # "43.8% faster"
    assert abs(times_faster(15953, 7980) - 1.0) < 0.001  # "one time faster"
    assert times_faster(None, 3.0) is None
