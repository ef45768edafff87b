"""What travels between the server and its clients, and the accounting of it.

* :class:`ClientInfo`, :class:`ClientTask` — what the engine knows of a sampled client and what the
  server sends it; :class:`ClientResult` — what a client sends back; :class:`Outcome` — how a task
  ended (a result, or why there is none: one of :data:`DROP_KINDS`).
* :func:`state_bytes`, :func:`payload_bytes`, :func:`packed_copy` — bytes on the wire.
* :func:`check_result`, :func:`upload_fault` — whether an upload may be aggregated.
* :func:`derive_seed` — the per-concern random streams of a run (:data:`CONCERNS`).
* :func:`split_optimizer_state`, :func:`merge_optimizer_state` — the persistent optimiser buffers
  a back end keeps beside a client's private state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors  # one call each (DDP's)

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.hetero.submodel import SubmodelSpec

__all__ = [
    "CONCERNS",
    "DROP_KINDS",
    "OPTIMIZER_STATE_KEY",
    "ClientInfo",
    "ClientResult",
    "ClientTask",
    "InjectedFault",
    "NoOptions",
    "Outcome",
    "check_result",
    "derive_seed",
    "merge_optimizer_state",
    "nonfinite_entries",
    "packed_copy",
    "payload_bytes",
    "split_optimizer_state",
    "state_bytes",
    "upload_fault",
]


@dataclass
class ClientInfo:
    """What the engine tells an algorithm about one sampled client in one round."""

    cid: int
    tier: str
    ratio: float  # tier budget ratio r (multiple of the plain global model's forward MACs)
    budget_macs: float  # absolute forward MACs per sample allowed this round
    num_samples: int
    round: int
    budget_after_change: float | None = None  # dynamic scenarios: budget from local epoch 3 on
    lr: float | None = None  # local learning rate sent by the server (None: the configured schedule)
    # an exchange that runs before round ``round`` proper (e.g. DynInit's gradient round at a
    # session start): the client state it writes is what the round's own tasks see
    prelude: bool = False


@dataclass
class ClientTask(ClientInfo):
    """One client's unit of work for one round: everything the client half may use besides its
    own data and private state. ``payload`` holds what the server sends (tensors, numbers,
    strings and lists of them: it must survive a trip to another process); ``seed`` is the
    per-(round, client) seed torch's generator is set to before the client runs."""

    seed: int = 0
    payload: dict[str, Any] = field(default_factory=dict)
    step: int = 0  # exchange index inside a round (methods with several exchanges per round)


@dataclass
class ClientResult:
    """What one client returns after its task: the upload and its accounting, plus its new
    private state (``client_state``; None keeps the previous one)."""

    cid: int
    num_samples: int
    state: dict[str, torch.Tensor]
    spec: "SubmodelSpec | None" = None  # channel indices when ``state`` is a sub-model's state
    macs: int = 0  # forward MACs per sample of the model the client trained
    budget_macs: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    tier: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    payload: dict[str, Any] = field(default_factory=dict)
    client_state: dict[str, Any] | None = None
    timers: dict[str, float] = field(default_factory=dict)

    def send(self, **payload: Any) -> None:
        """Add entries to what travels up besides the state, counting their bytes."""
        self.payload.update(payload)
        self.bytes_up += payload_bytes(payload)

    @classmethod
    def of(
        cls,
        task: "ClientTask",
        state: dict[str, torch.Tensor],
        *,
        macs: int,
        payload: dict[str, Any] | None = None,
        metrics: dict[str, Any] | None = None,
        client_state: dict[str, Any] | None = None,
        spec: "SubmodelSpec | None" = None,
        bytes_up: int | None = None,
        bytes_down: int | None = None,
    ) -> "ClientResult":
        """The result of ``task`` with its accounting filled in: the client's id, samples, tier and
        budget from the task; bytes up = the upload's state and payload, bytes down = what the task
        carried (pass ``bytes_up`` / ``bytes_down`` where a method's wire format differs)."""
        payload = {} if payload is None else payload
        return cls(
            cid=task.cid,
            num_samples=task.num_samples,
            state=state,
            spec=spec,
            macs=macs,
            budget_macs=task.budget_macs,
            bytes_up=state_bytes(state) + payload_bytes(payload) if bytes_up is None else bytes_up,
            bytes_down=payload_bytes(task.payload) if bytes_down is None else bytes_down,
            tier=task.tier,
            metrics={} if metrics is None else dict(metrics),
            payload=payload,
            client_state=client_state,
        )


@dataclass(frozen=True)
class NoOptions:
    """Options of an algorithm that has none."""


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of a state dict as sent over the wire (numel × element size of every tensor)."""
    return int(sum(t.numel() * t.element_size() for t in state.values()))


def packed_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A detached copy of ``state`` whose tensors of each (dtype, device) are consecutive views of
    one new flat buffer, in key order (contiguous layout). One copy per buffer instead of one per
    tensor, and what a flat consumer wants: :class:`WeightedMean` folds such a state without
    gathering it, and the process back end sends each buffer as one piece."""
    groups: dict[tuple[Any, Any], list[str]] = {}
    for key, v in state.items():
        groups.setdefault((v.dtype, v.device), []).append(key)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for keys in groups.values():
            tensors = [state[k] for k in keys]
            flat = _flatten_dense_tensors(tensors)
            if len(tensors) == 1:  # flattening a single tensor returns a view of it, not a copy
                flat = flat.clone()
            out.update(zip(keys, _unflatten_dense_tensors(flat, tensors)))
    return {k: out[k] for k in state}


def payload_bytes(payload: Any) -> int:
    """Bytes of every tensor in a (nested) task payload: what the server sent."""
    if isinstance(payload, torch.Tensor):
        return int(payload.numel() * payload.element_size())
    if isinstance(payload, dict):
        return sum(payload_bytes(v) for v in payload.values())
    if isinstance(payload, (list, tuple)):
        return sum(payload_bytes(v) for v in payload)
    return 0


#: Key under which ``train.optimizer_state: persistent`` keeps a client's SGD momentum buffers in
#: its private state. The back ends strip it before the client half sees its state and add it back
#: to what the client half returns, so algorithms never handle it.
OPTIMIZER_STATE_KEY = "__optimizer_state__"


def split_optimizer_state(state: dict[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``(algorithm's state, optimizer buffers)`` of a client's stored private state."""
    if not state or OPTIMIZER_STATE_KEY not in state:
        return state, None
    rest = {k: v for k, v in state.items() if k != OPTIMIZER_STATE_KEY}
    return (rest or None), state[OPTIMIZER_STATE_KEY]


def merge_optimizer_state(
    returned: dict[str, Any] | None, previous: dict[str, Any] | None, buffers: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The client state to store: what the client half returned (None: its ``previous`` state)
    plus the optimizer ``buffers`` (nothing changes when there are none)."""
    if buffers is None:
        return returned
    base = returned if returned is not None else (previous or {})
    return {**base, OPTIMIZER_STATE_KEY: buffers}


#: Stable ids of the random concerns (never reorder: they define the streams).
CONCERNS = {
    "partition": 1,
    "tiers": 2,
    "sample": 3,
    "budget": 4,
    "init": 5,
    "data": 6,
    "client": 7,
    "server": 8,
    "algorithm": 9,
    "eval": 10,
    "faults": 11,
    "prelude": 12,  # data order of prelude exchanges (DynInit's gradient round)
}


def derive_seed(master: int, concern: str, *keys: int) -> int:
    """A 63-bit seed for one concern (and e.g. round, client) of the master seed."""
    seq = np.random.SeedSequence(master, spawn_key=(CONCERNS[concern], *(int(k) for k in keys)))
    return int(seq.generate_state(1, dtype=np.uint64)[0] >> 1)


class InjectedFault(RuntimeError):
    """Raised by a client task chosen by ``engine.inject_faults`` to fail."""


#: Why a client was dropped from a round. ``injected``: ``engine.inject_faults`` chose the task;
#: ``timeout``: it ran past ``engine.client_timeout_s``; ``lost``: the worker process or Flower node
#: running it died or could not be reached (what a device failure looks like); ``non_finite``: it
#: uploaded NaN or infinity (training diverged); ``internal_error``: the task raised an exception
#: from the project's own code (or a method's) — a bug, never a device fault.
DROP_KINDS = ("injected", "timeout", "lost", "non_finite", "internal_error")


@dataclass
class Outcome:
    """One task's end: the result, or why there is none (``error``), and its wall time."""

    task: "ClientTask"
    result: "ClientResult | None"
    error: str | None = None
    seconds: float = 0.0
    detail: str = ""  # a traceback, for the log
    #: True when the process that ran the task already checked that its upload is finite (an
    #: outcome of our own workers; the server then skips the check, which ran in parallel there)
    checked: bool = False
    #: the class of ``error`` (one of :data:`DROP_KINDS`), set where the error arose
    kind: str | None = None


def _finite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not torch.is_floating_point(value) or bool(torch.isfinite(value).all())
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return True


def _all_finite(state: dict[str, Any]) -> bool:
    """Whether every floating tensor of a state is finite.

    One fused call computes the norm of every tensor (a NaN or an infinity anywhere makes its
    tensor's norm non-finite); only when a norm is not finite, which a finite tensor can also give
    by overflowing, are the elements themselves checked. A check per tensor cost about as much as a
    small client's training on digits."""
    by_dtype: dict[Any, list[torch.Tensor]] = {}
    for v in state.values():
        if isinstance(v, torch.Tensor) and torch.is_floating_point(v) and v.numel():
            by_dtype.setdefault((v.dtype, v.device), []).append(v)
    for group in by_dtype.values():
        try:
            norms = torch._foreach_norm(group)
            if bool(torch.isfinite(torch.stack(norms)).all()):
                continue
        except (RuntimeError, TypeError, AttributeError):  # a dtype the fused norm does not take
            pass
        if not all(bool(torch.isfinite(t).all()) for t in group):
            return False
    return all(_finite(v) for v in state.values() if not isinstance(v, torch.Tensor))


def nonfinite_entries(state: dict[str, Any]) -> str | None:
    """The first (up to three) entries of ``state`` holding a NaN or an infinity, as one line
    (``"a, b, c, …"``), or None when all are finite."""
    if _all_finite(state):
        return None
    bad = [k for k, v in state.items() if not _finite(v)]
    return ", ".join(bad[:3]) + (", …" if len(bad) > 3 else "")


def upload_fault(result: "ClientResult") -> str | None:
    """Why a client's upload cannot be aggregated (a non-finite tensor), or None."""
    bad = nonfinite_entries(result.state)
    if bad is not None:
        return f"non-finite upload ({bad})"
    if not _finite(result.payload):
        return "non-finite upload (payload)"
    return None


def check_result(outcome: Outcome, timeout_s: float | None) -> str | None:
    """Why an outcome must be dropped (an error, a time-out, a non-finite upload), or None."""
    if outcome.error is not None:
        return outcome.error
    if timeout_s is not None and outcome.seconds > timeout_s:
        return f"timeout: {outcome.seconds:.2f} s > engine.client_timeout_s={timeout_s:g}"
    res = outcome.result
    assert res is not None
    return None if outcome.checked else upload_fault(res)
