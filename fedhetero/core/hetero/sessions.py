"""Sessions: federated training under device arrival and departure.

A run with ``sessions.count = S`` is a schedule of S sessions of ``sessions.rounds = T`` rounds;
the set of available devices is fixed inside a session and changes only at a *transition* (the
boundary between two sessions). The schedule is data: ``sessions.devices`` lists the device ids
of every session; without it ``sessions.schedule: alternate`` splits the clients into two halves,
A (the first half of the ids) and B, used A, B, A, … . ``data.partition: session_groups`` gives
the two halves disjoint-ish label sets with a per-device Dirichlet inside each group
(:func:`fedhetero.data.partition.session_groups`).

This module holds the pure parts: the schedule, the transition
metrics (transition accuracy, time-to-accuracy, accumulated accuracy gain) and the wireless
latency/energy model used to put a price on rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = [
    "EnergyModel",
    "Schedule",
    "accumulated_gain",
    "session_summary",
    "time_to_accuracy",
    "transition_accuracy",
]


# ---------------------------------------------------------------------------- schedule
@dataclass(frozen=True)
class Schedule:
    """``devices[s]``: the sorted device ids available in session ``s`` (0-based); every
    session lasts ``rounds`` rounds. Round ``r`` (1-based) is in session ``(r−1) // rounds``."""

    devices: tuple[tuple[int, ...], ...]
    rounds: int

    @classmethod
    def from_config(cls, count: int, rounds: int, num_clients: int, schedule: str = "alternate",
                    devices: Sequence[Sequence[int]] | None = None) -> "Schedule":
        if devices:
            sets = tuple(tuple(sorted({int(d) for d in s})) for s in devices)
            if len(sets) != count:
                raise ValueError(f"sessions.devices lists {len(sets)} sessions, sessions.count is {count}")
            for i, s in enumerate(sets):
                if not s:
                    raise ValueError(f"sessions.devices[{i}] is empty")
                if s[0] < 0 or s[-1] >= num_clients:
                    raise ValueError(f"sessions.devices[{i}] has ids outside [0, {num_clients})")
            return cls(sets, rounds)
        if schedule != "alternate":
            raise ValueError(f"unknown sessions.schedule {schedule!r}")
        half = num_clients // 2
        if half < 1:
            raise ValueError("sessions.schedule alternate needs at least 2 clients")
        groups = (tuple(range(half)), tuple(range(half, 2 * half)))
        return cls(tuple(groups[s % 2] for s in range(count)), rounds)

    @property
    def count(self) -> int:
        return len(self.devices)

    def session_of(self, rnd: int) -> int:
        """0-based session of 1-based round ``rnd``."""
        return min(max(int(rnd) - 1, 0) // self.rounds, self.count - 1)

    def round_in_session(self, rnd: int) -> int:
        """1-based position of round ``rnd`` inside its session."""
        return (max(int(rnd) - 1, 0) % self.rounds) + 1

    def first_round(self, session: int) -> int:
        return session * self.rounds + 1


# ---------------------------------------------------------------------------- metrics
def transition_accuracy(acc: Sequence[float], window: int = 10) -> float:
    """Mean accuracy over the first ``window`` rounds of a session (``acc`` in round order)."""
    vals = [float(a) for a in list(acc)[:window]]
    return float(np.mean(vals)) if vals else float("nan")


def time_to_accuracy(acc: Sequence[float], target: float, offset: int = 0) -> float:
    """``T_ρ``: the first 1-based round whose accuracy reaches ``target`` (``inf`` when none),
    plus ``offset`` rounds charged in front (DynInit's extra gradient rounds, when charged)."""
    for i, a in enumerate(acc):
        if float(a) >= target:
            return float(i + 1 + offset)
    return math.inf


def accumulated_gain(acc: Sequence[float], reference: Sequence[float]) -> float:
    """``Σ_t (acc(t) − reference(t))`` in percentage points over the common rounds."""
    n = min(len(acc), len(reference))
    return float(sum(100.0 * (float(acc[i]) - float(reference[i])) for i in range(n)))


# ---------------------------------------------------------------------------- latency / energy
@dataclass(frozen=True)
class EnergyModel:
    """Per-round latency and energy of synchronous FL over a single wireless cell.

    Devices lie uniformly in an annulus (``d_min`` … ``cell_radius`` metres) around the base
    station (the server); 3GPP UMi street-canyon line-of-sight path loss at ``carrier_ghz`` with
    log-normal shadowing; Rayleigh small-scale fading that follows a Gauss–Markov process with
    correlation ``ρ = J₀(2π f_d τ)`` from slot to slot (Doppler ``f_d`` from the device speed);
    OFDMA with the system bandwidth split equally among the devices. A device's downlink (uplink)
    time is the first time the Shannon rate summed over slots has carried the model's bits; its
    computation time is ``N_p·φ·e·B/(f·χ)`` and its computation energy ``ξ·(N_p·φ·e·B/χ)·f²``.

    ``round_cost`` returns the round latency (the slowest device) and two energy sums: the
    uplink-plus-computation energy over the devices (what the published per-round figures match)
    and the total with the downlink receive energy.
    """

    carrier_ghz: float = 3.5
    cell_radius: float = 250.0
    d_min: float = 10.0
    h_bs: float = 10.0
    h_ut: float = 1.5
    h_e: float = 1.0
    shadowing_db: float = 4.0
    speed_mps: float = 10.0
    bandwidth_hz: float = 100e6
    noise_dbm_hz: float = -174.0
    p_server_w: float = 20.0
    p_tx_w: float = 0.2
    p_rx_w: float = 0.1
    slot_s: float = 0.5e-3
    cpu_hz: float = 1e9
    flops_per_cycle: float = 8.0
    xi: float = 1e-28

    @property
    def breakpoint_m(self) -> float:
        """The path-loss breakpoint distance ``d'_BP = 4·h'_BS·h'_UT·f_c/c`` (≈ 210 m)."""
        return 4.0 * (self.h_bs - self.h_e) * (self.h_ut - self.h_e) * self.carrier_ghz * 1e9 / 3e8

    @property
    def doppler_hz(self) -> float:
        return self.speed_mps * self.carrier_ghz * 1e9 / 3e8

    @property
    def fading_correlation(self) -> float:
        """``ρ = J₀(2π·f_d·τ)`` (≈ 0.967 at 10 m/s, 3.5 GHz, 0.5 ms slots)."""
        x = 2.0 * math.pi * self.doppler_hz * self.slot_s
        return _bessel_j0(x)

    def path_loss_db(self, d2d: np.ndarray) -> np.ndarray:
        d2d = np.asarray(d2d, dtype=np.float64)
        d3d = np.sqrt(d2d ** 2 + (self.h_bs - self.h_ut) ** 2)
        fc = self.carrier_ghz
        bp = self.breakpoint_m
        pl1 = 32.4 + 21.0 * np.log10(d3d) + 20.0 * np.log10(fc)
        pl2 = (32.4 + 40.0 * np.log10(d3d) + 20.0 * np.log10(fc)
               - 9.5 * np.log10(bp ** 2 + (self.h_bs - self.h_ut) ** 2))
        return np.where(d2d <= bp, pl1, pl2)

    def _transfer_seconds(self, bits: float, psi: np.ndarray, power: float, w: float, noise: float, rho: float,
                          gen: np.random.Generator, max_slots: int, chunk: int = 4096) -> np.ndarray:
        """Per device: the time until the Shannon rate summed over slots has carried ``bits``
        (NaN past ``max_slots``). The Gauss–Markov fading is generated a chunk of slots at a time
        with a first-order recursive filter."""
        from scipy.signal import lfilter  # deferred: scipy's import time, for the energy model only

        k = len(psi)
        h = (gen.normal(size=k) + 1j * gen.normal(size=k)) / np.sqrt(2.0)
        sent = np.zeros(k)
        done = np.full(k, np.nan)
        innov = np.sqrt(1.0 - rho ** 2)
        start = 0
        while start < max_slots and np.isnan(done).any():
            n = min(chunk, max_slots - start)
            e = (gen.normal(size=(n, k)) + 1j * gen.normal(size=(n, k))) / np.sqrt(2.0)
            if start == 0:
                e[0] = h / innov  # the first slot is the initial draw itself
                series = lfilter([innov], [1.0, -rho], e, axis=0)
            else:
                series = lfilter([innov], [1.0, -rho], e, axis=0, zi=(rho * h)[None, :])[0]
            h = series[-1]
            rate = w * np.log2(1.0 + power * psi[None, :] * np.abs(series) ** 2 / noise) * self.slot_s
            total = sent[None, :] + np.cumsum(rate, axis=0)
            for j in np.flatnonzero(np.isnan(done)):
                hit = np.searchsorted(total[:, j], bits)
                if hit < n:
                    done[j] = (start + hit + 1) * self.slot_s
            sent = total[-1]
            start += n
        return done

    def compute_seconds(self, params: float, flops_per_param: float, steps: int, batch: int) -> float:
        return params * flops_per_param * steps * batch / (self.cpu_hz * self.flops_per_cycle)

    def compute_joules(self, params: float, flops_per_param: float, steps: int, batch: int) -> float:
        return self.xi * (params * flops_per_param * steps * batch / self.flops_per_cycle) * self.cpu_hz ** 2

    def round_cost(self, params: int, flops_per_param: float, devices: int, steps: int = 5, batch: int = 128,
                   rng: np.random.Generator | int = 0, bits_per_param: int = 32,
                   max_slots: int = 10**6) -> dict[str, float]:
        """One round with ``devices`` devices sending a model of ``params`` parameters."""
        gen = np.random.default_rng(rng) if not isinstance(rng, np.random.Generator) else rng
        k = int(devices)
        bits = float(bits_per_param) * float(params)
        u = gen.random(k)
        d2d = np.sqrt(self.d_min ** 2 + u * (self.cell_radius ** 2 - self.d_min ** 2))
        loss_db = self.path_loss_db(d2d) + gen.normal(0.0, self.shadowing_db, k)
        psi = 10.0 ** (-loss_db / 10.0)
        w = self.bandwidth_hz / k
        noise = 10.0 ** ((self.noise_dbm_hz - 30.0) / 10.0) * w
        rho = self.fading_correlation
        t_dl = self._transfer_seconds(bits, psi, self.p_server_w, w, noise, rho, gen, max_slots)
        t_ul = self._transfer_seconds(bits, psi, self.p_tx_w, w, noise, rho, gen, max_slots)
        t_comp = self.compute_seconds(params, flops_per_param, steps, batch)
        e_comp = self.compute_joules(params, flops_per_param, steps, batch)
        latency = t_dl + t_comp + t_ul
        e_up = self.p_tx_w * t_ul + e_comp
        return {
            "latency_s": float(np.nanmax(latency)),
            "mean_device_latency_s": float(np.nanmean(latency)),
            "energy_j": float(np.nansum(e_up)),
            "energy_with_downlink_j": float(np.nansum(e_up + self.p_rx_w * t_dl)),
        }


#: Per-round latency (s) and energy (kJ) implied by the published time-to-accuracy table, for
#: parity with it (rounds × constant): TinyImageNet/ResNet-34 and SVHN/CNN with 100 devices.
PUBLISHED_ROUND_COST: dict[str, tuple[float, float]] = {
    "tinyimagenet": (113.6, 1.429),
    "svhn": (6.88, 0.0777),
}


def _bessel_j0(x: float) -> float:
    """Bessel function of the first kind, order 0 (power series; exact to double precision for
    the small arguments used here, |x| < 20)."""
    total, term, k = 1.0, 1.0, 0
    while True:
        k += 1
        term *= -(x * x / 4.0) / (k * k)
        total += term
        if abs(term) < 1e-17 * max(1.0, abs(total)):
            return total


def session_summary(history: Sequence[dict[str, Any]], window: int = 10) -> dict[str, Any]:
    """Per-session numbers from a run's metrics rows: the mean accuracy of the first ``window``
    evaluated rounds of each session (``start_accuracy``; for sessions after the first this is
    the accuracy right after a transition), its final and best accuracy, and the same on the full
    test set."""
    out: list[dict[str, Any]] = []
    sessions = sorted({int(r["session"]) for r in history if "session" in r})
    for s in sessions:
        rows = [r for r in history if r.get("session") == s and "accuracy" in r]
        if not rows:
            out.append({"session": s, "skipped": True})
            continue
        acc = [float(r["accuracy"]) for r in rows]
        full = [float(r.get("accuracy_full", r["accuracy"])) for r in rows]
        out.append({
            "session": s,
            "start_accuracy": transition_accuracy(acc, window),
            "start_accuracy_full": transition_accuracy(full, window),
            "final_accuracy": acc[-1],
            "best_accuracy": max(acc),
        })
    return {"sessions": out}
