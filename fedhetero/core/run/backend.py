"""Back ends that execute client tasks.

The run loop (:class:`fedhetero.core.run.engine.Engine`) owns sampling, aggregation, evaluation, metrics
and checkpoints; a back end only runs :class:`~fedhetero.core.method.algorithm.ClientTask` objects and
returns one :class:`Outcome` per task, **sorted by client id**, whatever order the work finished
in. That is what makes every back end give the numbers of ``local``:

* ``local`` — in this process, one task after another (the reference).
* ``process`` — the server process and a pool of persistent worker processes on this machine
  (:mod:`fedhetero.backends.process`).
* ``flower`` — Flower's simulation or deployment engine (:mod:`fedhetero.integrations.flower`,
  extra ``fedhetero[flower]``), made by the integration inside its ServerApp and handed to the
  engine: the core never imports an integration.

Every back end runs a task through :func:`run_task`, which applies injected faults, times the
client and turns an exception into a failed :class:`Outcome` instead of stopping the run.
"""

from __future__ import annotations

import abc
import time
import warnings
import traceback
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from fedhetero.core.common.config import BACKENDS, EXTERNAL_BACKENDS, backend_names
from fedhetero.core.common.options import ConfigError
from fedhetero.core.local.runner import train_cohorts
from fedhetero.core.exchange.types import (
    InjectedFault,
    Outcome,
    derive_seed,
    merge_optimizer_state,
    split_optimizer_state,
    upload_fault,
)

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.method.algorithm import Algorithm
    from fedhetero.core.common.config import FaultConfig, RunConfig
    from fedhetero.core.local.context import ClientContext
    from fedhetero.core.exchange.types import ClientResult, ClientTask

__all__ = [
    "BACKENDS",
    "Backend",
    "CohortFallbackWarning",
    "EXTERNAL_BACKENDS",
    "backend_names",
    "drop_kind",
    "injected_fault",
    "make_backend",
    "register_backend",
    "run_task",
]


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


class CohortFallbackWarning(RuntimeWarning):
    """A batched cohort failed and its tasks ran one by one instead (the one-by-one run then
    attributes a client's own failure to it; a failure of the cohort itself is a bug)."""


def run_together(
    make_algorithm: Callable[[], "Algorithm"],
    ctx: "ClientContext",
    tasks: "list[ClientTask]",
    states: dict[int, dict[str, Any] | None],
) -> dict[int, Outcome]:
    """The tasks of one exchange that train in vectorised cohorts (``engine.vectorize``; see
    :mod:`fedhetero.core.local.runner`), by client id; the
    back end runs the others one by one. Nothing is batched when vectorising is off, faults are
    injected or time-outs enforced (both are per client), or the batched run fails (the
    one-by-one run then reports which client failed)."""
    e = ctx.cfg.engine
    if e.vectorize is False or e.inject_faults.rate > 0 or e.client_timeout_s is not None or len(tasks) < 2:
        return {}
    ordered = sorted(tasks, key=lambda t: t.cid)
    t0 = time.perf_counter()
    try:
        algorithm = make_algorithm()
        ctx.timers = {}
        private, buffers = [], []
        for t in ordered:
            state, kept = split_optimizer_state(states.get(t.cid))
            private.append(state)
            buffers.append(kept)
        measured: dict[int, tuple[float, dict[str, float]]] = {}
        results = train_cohorts(algorithm, ctx, ordered, private, buffers, measured)
    except Exception as exc:  # run one by one, which attributes the failure to its client
        warnings.warn(f"engine.vectorize: the batched run of {len(ordered)} clients failed "
                      f"({type(exc).__name__}: {exc}); they run one by one", CohortFallbackWarning, stacklevel=2)
        return {}
    together = [(i, t, r) for i, (t, r) in enumerate(zip(ordered, results)) if r is not None]
    if not together:
        return {}
    # tasks timed on their own (segments) keep their time and timers; the rest share what is left
    own = sum(measured[i][0] for i, _, _ in together if i in measured)
    shared = [i for i, _, _ in together if i not in measured]
    share = max(time.perf_counter() - t0 - own, 0.0) / max(len(shared), 1)
    out = {}
    for i, t, r in together:
        seconds, timers = measured.get(i, (share, {}))
        r.timers = dict(timers)
        out[t.cid] = _checked(t, r, seconds)
    return out


def run_tasks(
    make_algorithm: Callable[[], "Algorithm"],
    ctx: "ClientContext",
    tasks: "list[ClientTask]",
    states: dict[int, dict[str, Any] | None],
    on_done: Callable[[Outcome], None] | None = None,
    **one_by_one: Any,
) -> list[Outcome]:
    """Every task of ``tasks`` in this process, in client-id order: those that train in cohorts
    (:func:`run_together`) first, then the others one by one (:func:`run_task`, given
    ``one_by_one``); ``on_done`` is called on each outcome as it is ready."""
    done = run_together(make_algorithm, ctx, tasks, states)
    if on_done is not None:
        for cid in sorted(done):
            on_done(done[cid])
    out = []
    for task in sorted(tasks, key=lambda t: t.cid):
        if task.cid not in done:
            done[task.cid] = run_task(make_algorithm, ctx, task, states.get(task.cid), **one_by_one)
            if on_done is not None:
                on_done(done[task.cid])
        out.append(done[task.cid])
    return out


def _checked(task: "ClientTask", result: "ClientResult", seconds: float) -> Outcome:
    """The outcome of a finished task, its upload checked here (where the task ran)."""
    bad = upload_fault(result)
    return Outcome(task, None if bad else result, bad, seconds, checked=True, kind="non_finite" if bad else None)


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


# The names (BACKENDS: a Registry whose built-in entries are ``"module:Class"`` names, not imports:
# the core imports no back end; EXTERNAL_BACKENDS: ``flower``, built by the Flower integration
# inside its ServerApp and handed to the engine) live in fedhetero.core.common.config, which checks
# engine.backend against them.


def register_backend(name: str, target: str) -> None:
    """Make ``engine.backend: name`` build ``target`` (``"module:Class"``; the class takes
    ``(cfg, data)``): ``BACKENDS.add`` for a name the Flower integration does not take."""
    if name in EXTERNAL_BACKENDS:
        raise ValueError(f"a back end named {name!r} already exists")
    BACKENDS.add(name, target)


def make_backend(cfg: "RunConfig", data: Any) -> Backend:
    """The back end ``cfg.engine.backend`` names."""
    name = cfg.engine.backend
    if name in EXTERNAL_BACKENDS:
        raise ConfigError(f"engine.backend: {name!r} {EXTERNAL_BACKENDS[name]}")
    if name not in BACKENDS:
        raise ConfigError(f"engine.backend: unknown back end {name!r}; available: {', '.join(backend_names())}")
    backend: Backend = BACKENDS.get(name)(cfg, data)
    return backend
