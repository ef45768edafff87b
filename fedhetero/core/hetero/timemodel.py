"""Simulated training time, smoothed "final accuracy" and time to target, as in the FedDUMAP paper.

The FedDUMAP paper reports *simulated* time, not wall-clock (authors' code, ``utils/cal_time.py``)::

    comm_time  = (P_0·4 B·10 devices / 2^20) / (50/8 MB/s) + (P_0·4 B·10 devices / 2^20) / (100/8 MB/s)
    train_time = 2.3 s (CNN), 8.0 s (VGG), 10.1 s (ResNet), 1.3 s (LeNet)   per round, unpruned
    round_time = train_time·MFLOPs_t/MFLOPs_0 + comm_time·params_t/params_0
    cum_time(0) = 0,  cum_time(i) = cum_time(i-1) + round_time(i)

Two ways to use it:

* :func:`paper_round_seconds` / :func:`paper_cumulative_times`: the formula above verbatim, for
  like-for-like comparisons with the paper's tables (CNN 3.42 s, VGG 97.3 s, LeNet 1.87 s per round).
* :class:`TimeModel`: the same model expressed from first principles for heterogeneous clients.
  Compute time = ``train_macs_factor × MACs/sample × samples processed / (device MACs/s × speed)``;
  communication time = bytes / link bandwidth (uplink 50 Mbit/s, downlink 100 Mbit/s, "MB" =
  2^20 bytes, as in the paper's code). Devices compute in parallel (the round waits for the slowest)
  and, by default, share the server's link, so transfers add up — which is what the paper's
  "× 10 devices" expresses. The default device speed is calibrated so that the paper's CNN client
  (4,548,608 MACs, 400 samples × 5 epochs) takes exactly the paper's 2.3 s; with the defaults a
  round of 10 such clients costs exactly :func:`paper_round_seconds` for the CNN.

Which of the two bandwidths is the uplink is not stated by the paper; we read the slower (50 Mbit/s)
as the uplink. The sum is the same for symmetric traffic.

Accuracy (authors' code): "final accuracy" is the maximum of the Savitzky–Golay(window 39, order
3)-smoothed accuracy curve with values rounded to 3 decimals. Time to target: the cumulative time at the
first index whose (smoothed) accuracy reaches the target, ``None`` if never.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

__all__ = [
    "PAPER_TRAIN_SECONDS",
    "PAPER_CNN_MACS",
    "PAPER_CNN_SAMPLE_PASSES",
    "DEFAULT_DEVICE_MACS_PER_S",
    "ClientCost",
    "TimeModel",
    "TimeModelError",
    "paper_comm_seconds",
    "paper_round_seconds",
    "paper_cumulative_times",
    "cumulative_times",
    "smooth_accuracy",
    "smoothed_final_accuracy",
    "time_to_target",
    "rounds_to_target",
    "times_faster",
]


class TimeModelError(ValueError):
    """Invalid argument to the time model or the accuracy summaries."""


#: Per-round device training time of the unpruned models (FedDUMAP authors' code, ``cal_time.py``).
PAPER_TRAIN_SECONDS: dict[str, float] = {"cnn": 2.3, "vgg": 8.0, "resnet": 10.1, "lenet": 1.3}
#: Forward MACs per 32×32 sample of the FedDUMAP CNN on CIFAR-10 (the paper's "4.5 MFLOPs").
PAPER_CNN_MACS = 4_548_608
#: Samples processed per device per round in the paper: n_k = 400 images × E = 5 epochs.
PAPER_CNN_SAMPLE_PASSES = 400 * 5
_TRAIN_FACTOR = 3.0
#: Training throughput (forward-MAC units per second, × ``train_macs_factor``) of a speed-1 device:
#: calibrated so the paper's CNN client takes 2.3 s per round.
DEFAULT_DEVICE_MACS_PER_S = _TRAIN_FACTOR * PAPER_CNN_MACS * PAPER_CNN_SAMPLE_PASSES / PAPER_TRAIN_SECONDS["cnn"]


def _pos(name: str, value: float, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TimeModelError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise TimeModelError(f"{name} must be {'>= 0' if allow_zero else '> 0'} and finite, got {value!r}")
    return v


# --------------------------------------------------------------------------------------------------
# General model
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientCost:
    """What one client does in a round, for :meth:`TimeModel.round_seconds`.

    ``macs_per_sample``: forward MACs per sample of the model it trains; ``sample_passes``: samples
    processed (local samples × epochs, or steps × batch size); ``bytes_up``/``bytes_down``: bytes
    sent to / received from the server; ``speed``: device speed relative to the reference device.
    """

    macs_per_sample: float
    sample_passes: float
    bytes_up: float = 0.0
    bytes_down: float = 0.0
    speed: float = 1.0


@dataclass(frozen=True)
class TimeModel:
    """Simulated round time from FLOPs and bytes (defaults: the FedDUMAP authors' time model).

    Attributes
    ----------
    uplink_mbit_s, downlink_mbit_s:
        link bandwidths in Mbit/s (50 and 100).
    megabyte:
        bytes per "MB" in the bandwidth conversion (2^20, as the authors' code).
    bytes_per_param:
        4 (float32); used by :meth:`model_bytes`.
    device_macs_per_s:
        training throughput of a speed-1 device (see :data:`DEFAULT_DEVICE_MACS_PER_S`).
    train_macs_factor:
        training cost per sample in forward MACs (3: forward + backward ≈ 3 × forward).
    shared_link:
        True (paper): all clients' transfers share the server link, so communication times add up
        and the round time is ``max_k compute_k + Σ_k comm_k``. False: independent links, round time
        ``max_k (compute_k + comm_k)``.
    """

    uplink_mbit_s: float = 50.0
    downlink_mbit_s: float = 100.0
    megabyte: float = float(2**20)
    bytes_per_param: int = 4
    device_macs_per_s: float = DEFAULT_DEVICE_MACS_PER_S
    train_macs_factor: float = _TRAIN_FACTOR
    shared_link: bool = True

    def __post_init__(self) -> None:
        for name in ("uplink_mbit_s", "downlink_mbit_s", "megabyte", "device_macs_per_s", "train_macs_factor"):
            _pos(name, getattr(self, name))
        if isinstance(self.bytes_per_param, bool) or not isinstance(self.bytes_per_param, int) or self.bytes_per_param < 1:
            raise TimeModelError(f"bytes_per_param must be a positive int, got {self.bytes_per_param!r}")

    def model_bytes(self, num_params: int) -> int:
        """Bytes of a model with ``num_params`` parameters."""
        return int(_pos("num_params", num_params, allow_zero=True)) * self.bytes_per_param

    def upload_seconds(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` from a client to the server."""
        return _pos("nbytes", nbytes, allow_zero=True) / self.megabyte / (self.uplink_mbit_s / 8.0)

    def download_seconds(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` from the server to a client."""
        return _pos("nbytes", nbytes, allow_zero=True) / self.megabyte / (self.downlink_mbit_s / 8.0)

    def comm_seconds(self, bytes_up: float, bytes_down: float) -> float:
        return self.upload_seconds(bytes_up) + self.download_seconds(bytes_down)

    def compute_seconds(self, macs_per_sample: float, sample_passes: float, *, speed: float = 1.0) -> float:
        """Seconds of local training: ``factor·macs·passes / (device_macs_per_s·speed)``."""
        macs = _pos("macs_per_sample", macs_per_sample, allow_zero=True)
        passes = _pos("sample_passes", sample_passes, allow_zero=True)
        return self.train_macs_factor * macs * passes / (self.device_macs_per_s * _pos("speed", speed))

    def client_seconds(self, cost: ClientCost) -> tuple[float, float]:
        """``(compute, communication)`` seconds of one client."""
        return (
            self.compute_seconds(cost.macs_per_sample, cost.sample_passes, speed=cost.speed),
            self.comm_seconds(cost.bytes_up, cost.bytes_down),
        )

    def round_seconds(self, clients: Iterable[ClientCost]) -> float:
        """Simulated duration of one synchronous round (0 for no clients)."""
        parts = [self.client_seconds(c) for c in clients]
        if not parts:
            return 0.0
        if self.shared_link:
            return max(p[0] for p in parts) + sum(p[1] for p in parts)
        return max(p[0] + p[1] for p in parts)


def cumulative_times(round_seconds: Iterable[float]) -> np.ndarray:
    """``[0, t_1, t_1 + t_2, …]``: time after ``i`` rounds (length ``R + 1``, float64)."""
    arr = np.asarray(list(round_seconds), dtype=np.float64)
    if arr.ndim != 1 or not np.all(np.isfinite(arr)) or (arr < 0).any():
        raise TimeModelError("round_seconds must be finite non-negative numbers")
    return np.concatenate(([0.0], np.cumsum(arr)))


# --------------------------------------------------------------------------------------------------
# The paper's formula, verbatim
# --------------------------------------------------------------------------------------------------


def paper_comm_seconds(
    num_params: int,
    *,
    clients_per_round: int = 10,
    bytes_per_param: int = 4,
    uplink_mbit_s: float = 50.0,
    downlink_mbit_s: float = 100.0,
    megabyte: float = float(2**20),
) -> float:
    """``(P·4·10/2^20)/(50/8) + (P·4·10/2^20)/(100/8)`` seconds per round (FedDUMAP authors' code)."""
    mb = _pos("num_params", num_params, allow_zero=True) * bytes_per_param * clients_per_round / megabyte
    return mb / (_pos("uplink_mbit_s", uplink_mbit_s) / 8.0) + mb / (_pos("downlink_mbit_s", downlink_mbit_s) / 8.0)


def paper_round_seconds(
    train_seconds: float | str,
    num_params_ref: int,
    *,
    macs_ratio: float = 1.0,
    params_ratio: float = 1.0,
    train_multiplier: float = 1.0,
    clients_per_round: int = 10,
    bytes_per_param: int = 4,
    uplink_mbit_s: float = 50.0,
    downlink_mbit_s: float = 100.0,
) -> float:
    """One round of the paper's time model.

    ``train_seconds``: seconds per round of the unpruned model, or a key of
    :data:`PAPER_TRAIN_SECONDS` (``"cnn"``, ``"vgg"``, ``"resnet"``, ``"lenet"``);
    ``num_params_ref``: parameters ``P_0`` of the unpruned model; ``macs_ratio`` =
    ``MFLOPs_t/MFLOPs_0`` and ``params_ratio`` = ``params_t/params_0`` after pruning;
    ``train_multiplier``: e.g. ``min(p%, 5) + 1`` for Data-sharing.
    """
    if isinstance(train_seconds, str):
        if train_seconds not in PAPER_TRAIN_SECONDS:
            raise TimeModelError(
                f"train_seconds must be a number or one of {sorted(PAPER_TRAIN_SECONDS)}, got {train_seconds!r}"
            )
        train_seconds = PAPER_TRAIN_SECONDS[train_seconds]
    train = _pos("train_seconds", train_seconds, allow_zero=True) * _pos("train_multiplier", train_multiplier, allow_zero=True)
    comm = paper_comm_seconds(
        num_params_ref, clients_per_round=clients_per_round, bytes_per_param=bytes_per_param,
        uplink_mbit_s=uplink_mbit_s, downlink_mbit_s=downlink_mbit_s,
    )
    return train * _pos("macs_ratio", macs_ratio, allow_zero=True) + comm * _pos("params_ratio", params_ratio, allow_zero=True)


def paper_cumulative_times(
    num_rounds: int,
    train_seconds: float | str,
    num_params_ref: int,
    *,
    macs_ratios: float | Sequence[float] = 1.0,
    params_ratios: float | Sequence[float] = 1.0,
    **kwargs: float,
) -> np.ndarray:
    """``cum_time(0..num_rounds)`` of the paper's model; per-round ratios (length ``num_rounds``,
    entry ``i`` for round ``i + 1``) let the model shrink after pruning. Extra keyword arguments go
    to :func:`paper_round_seconds`."""
    if isinstance(num_rounds, bool) or not isinstance(num_rounds, int) or num_rounds < 0:
        raise TimeModelError(f"num_rounds must be an int >= 0, got {num_rounds!r}")
    m = np.broadcast_to(np.asarray(macs_ratios, dtype=np.float64), (num_rounds,))
    p = np.broadcast_to(np.asarray(params_ratios, dtype=np.float64), (num_rounds,))
    per_round = [
        paper_round_seconds(train_seconds, num_params_ref, macs_ratio=float(m[i]), params_ratio=float(p[i]), **kwargs)  # type: ignore[arg-type]
        for i in range(num_rounds)
    ]
    return cumulative_times(per_round)


# --------------------------------------------------------------------------------------------------
# Accuracy summaries
# --------------------------------------------------------------------------------------------------


def _acc_array(accs: Sequence[float] | np.ndarray, name: str = "acc_history") -> np.ndarray:
    arr = np.asarray(accs, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise TimeModelError(f"{name} must be a non-empty 1-D sequence of accuracies")
    if not np.all(np.isfinite(arr)):
        raise TimeModelError(f"{name} must hold finite numbers")
    return arr


def smooth_accuracy(
    acc_history: Sequence[float],
    window: int = 39,
    *,
    polyorder: int = 3,
    decimals: int | None = 3,
    has_initial: bool = False,
) -> np.ndarray:
    """Savitzky–Golay-smoothed accuracy curve as the paper's authors compute it.

    The values (after the first one when ``has_initial``: the pre-training accuracy ``a_0``, which
    is put back unsmoothed in front) are smoothed with ``scipy.signal.savgol_filter(window,
    polyorder)`` (mode ``"interp"``) and rounded to ``decimals``. A curve shorter than ``window``
    uses the largest odd window that fits; if that window is not larger than ``polyorder`` the
    values are only rounded.
    """
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1 or window % 2 == 0:
        raise TimeModelError(f"window must be a positive odd int, got {window!r}")
    if isinstance(polyorder, bool) or not isinstance(polyorder, (int, np.integer)) or polyorder < 0:
        raise TimeModelError(f"polyorder must be an int >= 0, got {polyorder!r}")
    arr = _acc_array(acc_history)
    head, body = (arr[:1], arr[1:]) if has_initial else (arr[:0], arr)
    w = min(int(window), len(body) if len(body) % 2 else len(body) - 1)
    if w > polyorder and w > 1:
        from scipy.signal import savgol_filter  # deferred: scipy's import time, for smoothing only

        body = savgol_filter(body, w, int(polyorder), mode="interp")
    if decimals is not None:
        body = np.round(body, decimals)
    return np.concatenate((head, body))


def smoothed_final_accuracy(
    acc_history: Sequence[float],
    window: int = 39,
    *,
    polyorder: int = 3,
    decimals: int | None = 3,
    has_initial: bool = False,
) -> float:
    """The paper's "final accuracy": the maximum of :func:`smooth_accuracy` (authors' code).

    This is a smoothed best-over-rounds value, not the last round; report the raw last-round and raw
    maximum accuracy next to it.
    """
    return float(np.max(smooth_accuracy(acc_history, window, polyorder=polyorder, decimals=decimals, has_initial=has_initial)))


def rounds_to_target(accs: Sequence[float] | np.ndarray, target: float) -> int | None:
    """First index ``i`` with ``accs[i] >= target``; ``None`` if never."""
    arr = _acc_array(accs, "accs")
    hit = np.flatnonzero(arr >= float(target))
    return int(hit[0]) if hit.size else None


def time_to_target(times: Sequence[float], accs: Sequence[float], target: float) -> float | None:
    """``times[i]`` at the first ``i`` with ``accs[i] >= target``; ``None`` if never reached.

    ``times`` and ``accs`` must be aligned (same length; entry ``i`` after ``i`` rounds when both
    start at round 0). Pass the smoothed curve (:func:`smooth_accuracy`) to follow the paper.
    """
    t = np.asarray(times, dtype=np.float64)
    a = _acc_array(accs, "accs")
    if t.ndim != 1 or t.shape != a.shape:
        raise TimeModelError(f"times and accs must have the same length, got {t.shape} and {a.shape}")
    i = rounds_to_target(a, target)
    return None if i is None else float(t[i])


def times_faster(t_base: float | None, t_ours: float | None) -> float | None:
    """The paper's "X times faster": ``T_base/T_ours − 1`` (checked against its tables); ``None`` if
    either is missing."""
    if t_base is None or t_ours is None:
        return None
    return _pos("t_base", t_base) / _pos("t_ours", t_ours) - 1.0
