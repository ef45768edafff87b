"""Back ends that execute client tasks.

The run loop (:class:`fedhetero.engine.Engine`) owns sampling, aggregation, evaluation, metrics
and checkpoints; a back end only runs :class:`~fedhetero.algorithms.base.ClientTask` objects and
returns one :class:`Outcome` per task, **sorted by client id**, whatever order the work finished
in. That is what makes every back end give the numbers of ``local``:

* ``local`` — in this process, one task after another (the reference).
* ``process`` — the server process and a pool of persistent worker processes on this machine
  (:mod:`fedhetero.engines.process`).
* ``flower`` — Flower's simulation or deployment engine (:mod:`fedhetero.integrations.flower`,
  extra ``fedhetero[flower]``), made by the integration inside its ServerApp and handed to the
  engine: the core never imports an integration.

Every back end runs a task through :func:`run_task`, which applies injected faults, times the
client and turns an exception into a failed :class:`Outcome` instead of stopping the run.
"""

from __future__ import annotations

import abc
import math
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from fedhetero.context import derive_seed, merge_optimizer_state, split_optimizer_state

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.algorithms.base import Algorithm, ClientResult, ClientTask
    from fedhetero.config import FaultConfig, RunConfig
    from fedhetero.context import ClientContext

__all__ = [
    "Backend",
    "InjectedFault",
    "LocalBackend",
    "Outcome",
    "DROP_KINDS",
    "check_result",
    "drop_kind",
    "injected_fault",
    "make_backend",
    "run_task",
    "upload_fault",
]


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


def injected_fault(cfg: "RunConfig", task: "ClientTask") -> str | None:
    """The fault ``engine.inject_faults`` assigns to this (round, client, step), or None.

    Seeded by the master seed, so the same clients fail on every back end and on resume."""
    faults: FaultConfig = cfg.engine.inject_faults
    if faults.rate <= 0:
        return None
    rng = np.random.default_rng(derive_seed(cfg.seed, "faults", task.round, task.cid, task.step))
    if rng.random() >= faults.rate:
        return None
    return str(faults.kinds[int(rng.integers(len(faults.kinds)))])


def _poison(state: dict[str, torch.Tensor]) -> None:
    for value in state.values():
        if torch.is_floating_point(value) and value.numel():
            value.view(-1)[0] = float("nan")
            return


def run_task(
    make_algorithm: Callable[[], "Algorithm"],
    ctx: "ClientContext",
    task: "ClientTask",
    state: dict[str, Any] | None,
    *,
    hang_seconds: float | None = None,
) -> Outcome:
    """Run one client task on a fresh algorithm instance; never raises for the client's faults.

    ``hang_seconds``: how long an injected ``hang`` blocks (a worker process is killed by its pool
    long before; in-process the back end then reports the time-out)."""
    t0 = time.perf_counter()
    fault = injected_fault(ctx.cfg, task)
    try:
        if fault == "raise":
            raise InjectedFault(f"injected fault in client {task.cid}, round {task.round}")
        if fault == "hang":
            limit = ctx.cfg.engine.client_timeout_s or 0.0
            time.sleep(hang_seconds if hang_seconds is not None else limit * 1.05 + 0.01)
        algorithm = make_algorithm()
        ctx.timers = {}
        # the trainer's persistent momentum buffers travel in the client state beside the
        # algorithm's own, which the client half sees without them
        state, buffers = split_optimizer_state(state)
        with ctx.client_scope(task, optimizer_state=buffers):
            result = algorithm.client_update(ctx, task, state)
            result.client_state = merge_optimizer_state(result.client_state, state, ctx.optimizer_state())
        result.timers = dict(ctx.timers)
        if fault == "nan":
            _poison(result.state)
        return _checked(task, result, time.perf_counter() - t0)
    except Exception as exc:  # a failing client is dropped from its round, not fatal
        kind = "injected" if isinstance(exc, InjectedFault) else "internal_error"
        return Outcome(
            task, None, f"{type(exc).__name__}: {exc}", time.perf_counter() - t0, traceback.format_exc(), kind=kind
        )


def run_together(
    make_algorithm: Callable[[], "Algorithm"],
    ctx: "ClientContext",
    tasks: "list[ClientTask]",
    states: dict[int, dict[str, Any] | None],
) -> list[Outcome] | None:
    """The tasks of one exchange as one vectorised cohort (``engine.vectorize``; see
    :mod:`fedhetero.cohort`), or None to run them one by one: when vectorising is off, faults are
    injected or time-outs enforced (both are per client), the algorithm does not offer it, or it
    fails (the one-by-one run then reports which client failed)."""
    e = ctx.cfg.engine
    if not e.vectorize or e.inject_faults.rate > 0 or e.client_timeout_s is not None or len(tasks) < 2:
        return None
    ordered = sorted(tasks, key=lambda t: t.cid)
    t0 = time.perf_counter()
    try:
        algorithm = make_algorithm()
        ctx.timers = {}
        private = []
        for t in ordered:
            state, buffers = split_optimizer_state(states.get(t.cid))
            if buffers:
                return None
            private.append(state)
        with ctx.client_scope(ordered[0]):
            results = algorithm.client_update_many(ctx, ordered, private)
    except Exception:  # run one by one, which attributes the failure to its client
        return None
    if results is None:
        return None
    share = (time.perf_counter() - t0) / len(ordered)
    for r in results:
        r.timers = {}
    return [_checked(t, r, share) for t, r in zip(ordered, results)]


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


def upload_fault(result: "ClientResult") -> str | None:
    """Why a client's upload cannot be aggregated (a non-finite tensor), or None."""
    if not _all_finite(result.state):
        bad = [k for k, v in result.state.items() if not _finite(v)]
        return f"non-finite upload ({', '.join(bad[:3])}{', …' if len(bad) > 3 else ''})"
    if not _finite(result.payload):
        return "non-finite upload (payload)"
    return None


def _checked(task: "ClientTask", result: "ClientResult", seconds: float) -> Outcome:
    """The outcome of a finished task, its upload checked here (where the task ran)."""
    bad = upload_fault(result)
    return Outcome(task, None if bad else result, bad, seconds, checked=True, kind="non_finite" if bad else None)


def check_result(outcome: Outcome, timeout_s: float | None) -> str | None:
    """Why an outcome must be dropped (an error, a time-out, a non-finite upload), or None."""
    if outcome.error is not None:
        return outcome.error
    if timeout_s is not None and outcome.seconds > timeout_s:
        return f"timeout: {outcome.seconds:.2f} s > engine.client_timeout_s={timeout_s:g}"
    res = outcome.result
    assert res is not None
    return None if outcome.checked else upload_fault(res)


def drop_kind(cfg: "RunConfig", outcome: Outcome, reason: str) -> str:
    """The class (one of :data:`DROP_KINDS`) of a drop that :func:`check_result` gave ``reason``
    for. A task that ``engine.inject_faults`` chose counts as injected however its fault showed
    (an exception, a NaN upload, or a hang that timed out)."""
    if injected_fault(cfg, outcome.task) is not None:
        return "injected"
    if outcome.error is None:  # finished, and dropped by the checks of the process that collects it
        return "timeout" if reason.startswith("timeout") else "non_finite"
    return outcome.kind or "lost"


class Backend(abc.ABC):
    """Executes client tasks; :meth:`run` returns one :class:`Outcome` per task, sorted by client
    id. ``states`` maps a client id to its private state from earlier rounds (or None)."""

    name = "base"

    @abc.abstractmethod
    def run(
        self,
        algorithm: "Algorithm",
        tasks: "list[ClientTask]",
        states: dict[int, dict[str, Any] | None],
        on_done: Callable[[Outcome], None] | None = None,
    ) -> list[Outcome]:
        """Run the tasks; one outcome per task, sorted by client id. ``on_done`` is called with
        each outcome as soon as it is known, in any order (progress, uploads averaged as they
        come)."""

    def close(self) -> None:  # noqa: B027 - optional: back ends without resources need nothing
        """Release workers or connections (idempotent)."""


class LocalBackend(Backend):
    """In this process, one client after another, on a client context of its own (it shares the
    read-only data set with the server but none of its state)."""

    name = "local"

    def __init__(self, cfg: "RunConfig", data: Any) -> None:
        from fedhetero.context import ClientContext

        self.cfg = cfg
        self.ctx = ClientContext(cfg, data, torch.device(cfg.device))

    def run(self, algorithm, tasks, states, on_done=None):  # type: ignore[no-untyped-def]
        cls, options = type(algorithm), algorithm.options
        together = run_together(lambda: cls(options), self.ctx, tasks, states)
        if together is not None:
            if on_done is not None:
                for o in together:
                    on_done(o)
            return together
        out = []
        for task in sorted(tasks, key=lambda t: t.cid):
            out.append(run_task(lambda: cls(options), self.ctx, task, states.get(task.cid)))
            if on_done is not None:
                on_done(out[-1])
        return out


def make_backend(cfg: "RunConfig", data: Any) -> Backend:
    """The back end ``cfg.engine.backend`` names (``flower``: made by the integration, passed in)."""
    name = cfg.engine.backend
    if name == "local":
        return LocalBackend(cfg, data)
    if name == "process":
        from fedhetero.engines.process import ProcessBackend

        return ProcessBackend(cfg, data)
    if name == "flower":
        # the Flower integration builds its back end inside its ServerApp and hands it to the
        # engine; the core never imports an integration
        from fedhetero.config import ConfigError

        raise ConfigError(
            "engine.backend: 'flower' runs inside a Flower ServerApp; start it with "
            "`fedhetero flower simulate` or `flwr run` (see the README), or choose local/process"
        )
    raise ValueError(f"unknown back end {name!r}")  # pragma: no cover - the config validates it
