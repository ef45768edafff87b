"""The client runner for a round's clients trained together: each client's
:class:`~fedhetero.core.local.objective.LocalPlan`, trained in batched cohorts.

A method says *what* a client trains (:meth:`Algorithm.local_plan
<fedhetero.core.method.algorithm.Algorithm.local_plan>`); one client trains it alone through
:meth:`Algorithm.local_train <fedhetero.core.method.algorithm.Algorithm.local_train>`, and
:func:`train_cohorts` trains the plans of an exchange's clients side by side
(:mod:`fedhetero.core.local.cohort`), with the same numbers up to the order of floating-point sums.
The back ends call it before running what is left one by one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch import nn

from fedhetero.core.local.cohort import client_bytes, client_steps, plan_cohorts, structure_key, train_cohort
from fedhetero.core.local.objective import LocalObjective, LocalPhase, LocalPlan, LocalSGD, rules_key
from fedhetero.core.local.segments import Segments, train_segments
from fedhetero.core.exchange.types import ClientResult, ClientTask, merge_optimizer_state

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import ClientContext

__all__ = ["AUTO_MIN_STEPS", "ClientHalf", "train_cohorts"]

#: ``engine.vectorize: null`` on a CPU batches clients of at least this many local steps: a cohort's
#: set-up (each client's model, state and upload, the stacked model's load) is repaid over its steps,
#: and clients of a few steps (digits' Dirichlet splits, 6 steps a round) trained slower batched
AUTO_MIN_STEPS = 10


class ClientHalf(Protocol):
    """The part of a method's client half the runner calls
    (:class:`~fedhetero.core.method.algorithm.Algorithm`, whose room sits above this one, so it is
    named here by what it offers)."""

    def local_plan(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> LocalPlan | None:
        """What the client trains, or None: it trains alone."""

    def client_model(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None = None) -> nn.Module:
        """The model the client trains."""

    def upload(self, ctx: "ClientContext", task: ClientTask, model: nn.Module, result: dict[str, Any]) -> ClientResult:
        """What travels back to the server."""

    def local_segments(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> Segments | None:
        """The client's local training as segments (:mod:`fedhetero.core.local.segments`), or None."""


class _Trainee(NamedTuple):
    """One model a cohort trains: a task's model, or one member of it (``LocalPlan.members``)."""

    task: int  # index into the exchange's tasks
    member: int
    model: nn.Module
    initial: dict[str, torch.Tensor]
    sgd: LocalSGD
    objective: LocalObjective | None
    momentum: Any  # buffers it starts from (kept or carried), or None
    schedule: list[torch.Tensor] | None  # its batches when the plan states them
    masks: dict[str, torch.Tensor] | None
    prelude: LocalPhase | None  # the phase its local training runs first


def train_cohorts(
    algorithm: ClientHalf, ctx: "ClientContext", tasks: list[ClientTask], states: list[dict[str, Any] | None],
    optimizer_states: list[dict[str, Any] | None] | None = None,
    measured: dict[int, tuple[float, dict[str, float]]] | None = None,
) -> list[ClientResult | None]:
    """The client halves of several tasks of one exchange, trained in batched cohorts where they
    can be. Returns one entry per task: its result, or None for a task the back end then runs one
    by one (:meth:`Algorithm.client_update`).

    A task joins a cohort when its method states a plan (:meth:`Algorithm.local_plan`); a plan
    of independent members joins as one trainee per member, and a plan's phase before the local
    training runs in the cohort first. Trainees are grouped by their model's structure (so width
    methods group by width), SGD settings and objective rules, then by their number of steps
    (:func:`~fedhetero.core.local.cohort.plan_cohorts`), cohorts capped by
    ``engine.cohort_memory_mb``; :meth:`Algorithm.client_model` and :meth:`Algorithm.upload`
    run per task as they do one by one, and a task any of whose members found no cohort runs
    one by one. ``optimizer_states``: each client's kept momentum buffers.

    A method that states its local training as segments (:meth:`Algorithm.local_segments`,
    DynamicFL's epochs around DYMM) has its tasks advanced together by
    :func:`~fedhetero.core.local.segments.train_segments`, coinciding segments batched, where
    small cohorts pay: with ``engine.vectorize: true``, or on a GPU by default (on a CPU the
    coinciding structures of such a round are too few and too small: those tasks run one by one).
    Their wall seconds and timers, measured per client, go into ``measured`` by task index."""
    out: list[ClientResult | None] = [None] * len(tasks)
    if len(tasks) < 2:
        return out
    e = ctx.cfg.engine
    auto_cpu = e.vectorize is None and ctx.device.type == "cpu"
    smallest = e.min_cohort if auto_cpu else 2
    if not auto_cpu and ctx.cfg.train.optimizer_state != "persistent":
        for i, (result, seconds, timers) in train_segments(algorithm, ctx, tasks, states, smallest=smallest).items():
            out[i] = result
            if measured is not None:
                measured[i] = (seconds, timers)
    steps_of = [client_steps(ctx, t.cid) for t in tasks]
    if auto_cpu:  # a cohort's own cost is repaid over a client's steps: short clients one by one
        steps_of = [n if n >= AUTO_MIN_STEPS else 0 for n in steps_of]
    if sum(n > 0 for n in steps_of) < smallest:
        return out
    kept_in = optimizer_states or [None] * len(tasks)
    groups: dict[Any, list[_Trainee]] = {}
    parts: dict[int, tuple[int, LocalPlan]] = {}
    for i, (task, state) in enumerate(zip(tasks, states)):
        if steps_of[i] == 0 or out[i] is not None:
            continue
        with ctx.client_scope(task):
            plan = algorithm.local_plan(ctx, task, state)
            if plan is None:
                continue
            model = algorithm.client_model(ctx, task, state)
            sgd, objective = plan.sgd, plan.objective
            members = _members(plan, model)
            if not _members_batch(model, members, sgd, objective):
                continue
            schedule = None if plan.schedule is None else list(plan.schedule)
            if schedule is not None:
                if not schedule:
                    continue
                steps_of[i] = len(schedule)
                if auto_cpu and steps_of[i] < AUTO_MIN_STEPS:
                    continue
            start = plan.momentum if sgd.carried else kept_in[i]
            if sgd.carried and start is None and sgd.persistent:
                start = kept_in[i]  # no buffers handed over: the client's kept ones
            masks = dict(plan.masks) if sgd.masked and plan.masks is not None else None
            prelude = plan.prelude
            if prelude is not None and (len(members) > 1 or _has_dropout(model)):
                continue  # one mask stream runs through both phases: one by one
            parts[i] = (len(members), plan)
            phase = None if prelude is None else (prelude.key, prelude.sgd.shared(), len(prelude.schedule))
            for k, member in enumerate(members):
                initial = {n: v.detach().clone() for n, v in member.state_dict().items()}
                key = (structure_key(member), sgd.shared(), task.round, task.prelude, rules_key(objective), phase)
                groups.setdefault(key, []).append(
                    _Trainee(i, k, member, initial, sgd, objective, start, schedule, masks, prelude))
    trained: dict[tuple[int, int], tuple[dict[str, torch.Tensor], dict[str, Any], Any]] = {}
    for members_of_key in groups.values():
        model = members_of_key[0].model
        cap = max(1, int(e.cohort_memory_mb * 2**20 // max(1, client_bytes(ctx, model))))
        for cohort in plan_cohorts([steps_of[m.task] for m in members_of_key], min_size=smallest, max_size=cap):
            chosen = [members_of_key[k] for k in cohort]
            sub = [tasks[m.task] for m in chosen]
            with ctx.client_scope(sub[0]):
                done = train_cohort(ctx, model, sub, [m.objective for m in chosen], [m.initial for m in chosen],
                                    [m.sgd for m in chosen], [m.momentum for m in chosen],
                                    [m.schedule for m in chosen], [m.masks for m in chosen],
                                    [m.prelude for m in chosen])
            if done is None:
                continue
            co, reports = done
            for j, m in enumerate(chosen):
                buffers = co.momentum_out[j] if co.momentum_out is not None else None
                trained[(m.task, m.member)] = (co.state(j), dict(reports[j]), buffers)
    for i, (n, plan) in parts.items():
        if not all((i, k) in trained for k in range(n)):
            continue  # a member found no cohort: the whole task runs one by one
        task, sgd, objective = tasks[i], plan.sgd, plan.objective
        with ctx.client_scope(task):
            model = algorithm.client_model(ctx, task, states[i])
            for k, member in enumerate(_members(plan, model)):
                member.load_state_dict(trained[(i, k)][0])
            report = _joint_report([trained[(i, k)][1] for k in range(n)])
            buffers = trained[(i, 0)][2]
            if sgd.carried:
                report["momentum"] = buffers
            result = algorithm.upload(ctx, task, model, report)
            if objective is not None and objective.finish is not None:
                objective.finish(result)
        kept = None
        if ctx.cfg.train.optimizer_state == "persistent" and (not sgd.carried or sgd.persistent):
            kept = buffers if buffers is not None and sgd.keep else kept_in[i]
        result.client_state = merge_optimizer_state(result.client_state, states[i], kept)
        out[i] = result
    return out


def _members(plan: LocalPlan, model: nn.Module) -> list[nn.Module]:
    return [model] if plan.members is None else list(plan.members(model))


def _has_dropout(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules())


def _members_batch(model: nn.Module, members: list[nn.Module], sgd: LocalSGD, objective: LocalObjective | None) -> bool:
    """Whether a task whose model trains as ``members`` (``LocalPlan.members``) can join cohorts
    with the same numbers as its one-by-one run."""
    if len(members) == 1 and members[0] is model:
        return True
    if sgd.persistent or sgd.carried or sgd.masked or objective is not None:
        return False  # buffers, masks and rules are named by the model's parameters, not the members'
    if len(members) > 1 and (sgd.clip is not None or _has_dropout(model)):
        return False  # one norm over all members; one mask stream drawn member after member
    return True


def _joint_report(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """A task's report from its members': the loss is their sum (the ensemble's loss is the sum
    of the members' cross-entropies), the steps are shared."""
    if len(reports) == 1:
        return reports[0]
    return {"loss": float(sum(r["loss"] for r in reports)), "steps": reports[0]["steps"]}
