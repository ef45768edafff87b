"""The accounting part of a round's metrics row: per-client entries, traffic and simulated time.

The engine builds one row per round (``metrics.jsonl``): what the method reports
(:meth:`Algorithm.round_metrics`), the evaluation, and what :func:`account_round` adds from the
clients' results — one entry per client (tier, budget and MACs, bytes, samples, the client's own
metrics and ``wall_s``, the wall time of its tasks where they ran: a batched cohort's time is
shared equally among its clients, Flower's includes the messages), the bytes of the round and of
the run so far, and the round's simulated wall time under the device time model
(:mod:`fedhetero.core.hetero.timemodel`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from fedhetero.core.common.config import TrainConfig
from fedhetero.core.hetero.timemodel import ClientCost, TimeModel
from fedhetero.core.exchange.types import ClientInfo, ClientResult

__all__ = ["account_round", "client_entry", "is_jsonable", "sample_passes"]

#: the device time model every run reports its simulated time under
TIME_MODEL = TimeModel()


def is_jsonable(v: Any) -> bool:
    """Whether a client's metric goes into the row as it is (numbers, strings, None)."""
    return isinstance(v, (int, float, str, bool)) or v is None


def client_entry(u: ClientResult, tier: str, wall_s: float | None = None) -> dict[str, Any]:
    """One client's entry of a round's row (``tier``: the sampled tier, when the result has none;
    ``wall_s``: the wall time of the client's tasks in the round, where the back end measured it)."""
    entry = {
        "cid": u.cid,
        "tier": u.tier or tier,
        "budget_macs": float(u.budget_macs),
        "macs": int(u.macs),
        "fits_budget": bool(u.macs <= u.budget_macs * (1 + 1e-9)),
        "bytes_up": int(u.bytes_up),
        "bytes_down": int(u.bytes_down),
        "num_samples": int(u.num_samples),
        **{k: v for k, v in u.metrics.items() if is_jsonable(v)},
    }
    if wall_s is not None:
        entry["wall_s"] = round(float(wall_s), 4)
    return entry


def sample_passes(train: TrainConfig, num_samples: int, steps: Any = None) -> float:
    """Samples a client pushed through its model this round (for the simulated time; from a result
    or a round's client entry): its reported optimizer ``steps`` times the batch size when it
    trained a fixed number of steps, else its ``num_samples`` times the local epochs."""
    if getattr(train, "local_steps", None):
        n = int(steps) if isinstance(steps, (int, float)) else int(train.local_steps or 0)
        return float(n * train.batch_size)
    return float(num_samples * train.local_epochs)


def account_round(
    row: dict[str, Any],
    clients: Sequence[ClientInfo],
    updates: Sequence[ClientResult],
    train: TrainConfig,
    previous: dict[str, Any] | None,
    seconds: Mapping[int, float] | None = None,
) -> None:
    """Add the clients' entries, the simulated time and the traffic of a round to its ``row``
    (``previous``: the row before it, for the running totals; ``seconds``: by client id, the wall
    time of its tasks in the round, each entry's ``wall_s``)."""
    by_cid = {c.cid: c for c in clients}
    walls = seconds or {}
    row["clients"] = [client_entry(u, by_cid[u.cid].tier, walls.get(u.cid)) for u in updates]
    row["sim_s"] = TIME_MODEL.round_seconds(
        ClientCost(
            macs_per_sample=float(u.macs),
            sample_passes=sample_passes(train, u.num_samples, u.metrics.get("steps")),
            bytes_up=float(u.bytes_up),
            bytes_down=float(u.bytes_down),
        )
        for u in updates
    )
    row["sim_time_s"] = (previous["sim_time_s"] if previous else 0.0) + row["sim_s"]
    row["bytes_up"] = int(sum(u.bytes_up for u in updates))
    row["bytes_down"] = int(sum(u.bytes_down for u in updates))
    row["bytes_total"] = int((previous["bytes_total"] if previous else 0) + row["bytes_up"] + row["bytes_down"])
