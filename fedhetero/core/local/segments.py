"""A client's local training in segments, and segments of several clients trained as one cohort.

Some methods change the model between epochs of one local round (DynamicFL grows and folds
branches after the first epoch), so their local training is no single plan
(:class:`~fedhetero.core.local.objective.LocalPlan`). They state it as a generator instead
(:meth:`Algorithm.local_segments <fedhetero.core.method.algorithm.Algorithm.local_segments>`): it
yields :class:`LocalSegment` values — epochs ``first … last−1`` on a model with its optimizer —
receives what the trainer reports for each (``{"loss", "steps"}``, and ``"cohort"``, the number
of clients it trained with, when it trained in a cohort; as
:meth:`ClientContext.train <fedhetero.core.local.context.ClientContext.train>` returns it), does
what it does between them, and returns the client's upload. :func:`run_segments` runs one client's
segments one after another (its one-by-one local training); :func:`train_segments` advances a
round's clients in lockstep and trains, at each step, the segments that coincide — the same
structure (:func:`~fedhetero.core.local.cohort.structure_key`), the same epochs — as one batched
:class:`~fedhetero.core.local.cohort.Cohort`, the others alone.

What must hold, and is checked where it is cheap:

* a client's numbers do not depend on which way its segments trained, up to the order of
  floating-point sums: the cohort runs each client's own batches in its own order, its SGD is the
  configured one (an optimizer that is not — another learning rate, several groups — trains
  alone), its momentum buffers go in and come back out through the client's own optimizer, and
  the segment's rule (:class:`SegmentRule`) does, for the stacked gradients, what the segment's
  ``after_backward`` does for one model;
* a client's random numbers do not depend on the others: each client's code runs in its own
  client scope, its generator's state carried from one of its pieces to the next, so a client
  whose segments all train alone draws exactly what its one-by-one run draws;
* each client's wall time and timers are its own: the time of a cohort is shared equally among
  its clients, everything else is timed per client;
* a client's model is its own while the clients overlap: the process's one reusable instance
  (:meth:`~fedhetero.core.local.context.RunContext.reusable`, which the default ``client_model``
  loads) is handed out as a copy per call meanwhile.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator, Mapping, Protocol, Sequence

import torch
from torch import nn

from fedhetero.core.local.cohort import Cohort, client_bytes, cohort_supported, epoch_batches, plan_cohorts, structure_key
from fedhetero.core.local.objective import LocalObjective, LocalSGD
from fedhetero.data.batches import num_batches

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.exchange.types import ClientResult, ClientTask
    from fedhetero.core.local.context import ClientContext

__all__ = ["LocalSegment", "SegmentRule", "Segments", "run_segments", "train_alone", "train_segments"]


@dataclass
class SegmentRule:
    """What a segment's ``after_backward`` does, for a cohort of clients at once: ``grad`` gets the
    stacked parameters and loss gradients by name (``(C, *shape)``, client ``c`` at row ``c``) after
    every backward pass and may change the gradients in place; ``epoch_end`` runs after each epoch,
    once the clients' models hold their trained state, and hands each client what the rule
    gathered (a saliency meter's sums)."""

    grad: Callable[[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]], None]
    epoch_end: Callable[[], None]


@dataclass
class LocalSegment:
    """Epochs ``first … last−1`` of a client's local round on ``model`` with ``optimizer`` (the
    configured SGD of :meth:`ClientContext.make_optimizer
    <fedhetero.core.local.context.ClientContext.make_optimizer>`). ``after_backward`` and
    ``on_epoch_end`` as :meth:`ClientContext.train <fedhetero.core.local.context.ClientContext.train>`
    takes them (``on_epoch_end`` must return None when the segment may train in a cohort).
    ``cohort``: the same work as ``after_backward`` for a cohort of such segments (given them, in
    the cohort's order, it returns their :class:`SegmentRule`, or None: alone); None: the segment
    always trains alone. ``own``: what the rule reads of this client (its saliency meter)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    first: int
    last: int
    after_backward: Callable[[nn.Module], None] | None = None
    on_epoch_end: Callable[[int, nn.Module, torch.optim.Optimizer], Any] | None = None
    cohort: Callable[[Sequence["LocalSegment"]], SegmentRule | None] | None = None
    own: Any = None


#: a client's local training in segments: yields them, receives each one's report, returns the upload
Segments = Generator[LocalSegment, dict[str, Any], "ClientResult"]


class SegmentedHalf(Protocol):
    """The part of a method's client half :func:`train_segments` calls."""

    def local_segments(self, ctx: "ClientContext", task: "ClientTask", state: dict[str, Any] | None) -> Segments | None:
        """The client's local training as segments, or None: it trains in its own way."""


def train_alone(ctx: "ClientContext", task: "ClientTask", segment: LocalSegment) -> dict[str, Any]:
    """One segment of one client, by the shared trainer."""
    return ctx.train(segment.model, task, segment.last - segment.first, optimizer=segment.optimizer,
                     after_backward=segment.after_backward, on_epoch_end=segment.on_epoch_end,
                     first_epoch=segment.first)


def run_segments(ctx: "ClientContext", task: "ClientTask", segments: Segments) -> "ClientResult":
    """One client's segments one after another (in its client scope, which the caller holds);
    returns its upload."""
    try:
        segment = next(segments)
        while True:
            segment = segments.send(train_alone(ctx, task, segment))
    except StopIteration as done:
        return done.value


@dataclass
class _Client:
    """One client's progress through its segments in :func:`train_segments`."""

    index: int
    task: "ClientTask"
    segments: Segments | None = None
    pending: LocalSegment | None = None
    result: "ClientResult | None" = None
    rng: torch.Tensor | None = None
    cuda_rng: torch.Tensor | None = None
    timers: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    @contextlib.contextmanager
    def scope(self, ctx: "ClientContext") -> Iterator[None]:
        """This client's scope, its random state where its last piece left it, its own timers."""
        t0 = time.perf_counter()
        held, ctx.timers = ctx.timers, self.timers
        try:
            with ctx.client_scope(self.task):
                if self.rng is not None:
                    torch.set_rng_state(self.rng)
                cuda = ctx.device.type == "cuda"
                if cuda and self.cuda_rng is not None:
                    torch.cuda.set_rng_state(self.cuda_rng, ctx.device)
                try:
                    yield
                finally:
                    self.rng = torch.get_rng_state()
                    if cuda:
                        self.cuda_rng = torch.cuda.get_rng_state(ctx.device)
        finally:
            ctx.timers = held
            self.seconds += time.perf_counter() - t0

    def advance(self, report: dict[str, Any] | None) -> None:
        """Run the client's code up to its next segment (or its upload)."""
        assert self.segments is not None
        try:
            self.pending = next(self.segments) if report is None else self.segments.send(report)
        except StopIteration as done:
            self.pending, self.result = None, done.value


def train_segments(algorithm: SegmentedHalf, ctx: "ClientContext", tasks: "Sequence[ClientTask]",
                   states: Sequence[dict[str, Any] | None], *, smallest: int = 2,
                   ) -> dict[int, tuple["ClientResult", float, dict[str, float]]]:
    """The tasks whose method states their local training as segments, advanced in lockstep: at
    each step the pending segments are grouped by structure and epochs, groups of ``smallest`` or
    more clients train as batched cohorts (capped by ``engine.cohort_memory_mb``, split by their
    number of steps as :func:`~fedhetero.core.local.cohort.plan_cohorts` splits plans), the rest
    alone; clients are held in windows of at most that memory. Returns, by index into ``tasks``,
    each such task's upload, its wall seconds and its timers; the others are not in it."""
    held, ctx.overlapping_clients = ctx.overlapping_clients, True  # a reusable model is no longer one client's
    try:
        return _lockstep(algorithm, ctx, tasks, states, smallest)
    finally:
        ctx.overlapping_clients = held


def _lockstep(algorithm: SegmentedHalf, ctx: "ClientContext", tasks: "Sequence[ClientTask]",
              states: Sequence[dict[str, Any] | None], smallest: int,
              ) -> dict[int, tuple["ClientResult", float, dict[str, float]]]:
    """The clients in windows: a window takes clients until the memory they hold (their models,
    by :func:`~fedhetero.core.local.cohort.client_bytes`) reaches ``engine.cohort_memory_mb``,
    then runs to its uploads, so that a round of many large models is not held at once."""
    out: dict[int, tuple["ClientResult", float, dict[str, float]]] = {}
    budget = ctx.cfg.engine.cohort_memory_mb * 2**20
    window: list[_Client] = []
    held = 0
    for i, (task, state) in enumerate(zip(tasks, states)):
        c = _Client(i, task)
        with c.scope(ctx):
            c.segments = algorithm.local_segments(ctx, task, state)
            if c.segments is None:
                continue
            c.advance(None)
        window.append(c)
        if c.pending is not None:
            held += client_bytes(ctx, c.pending.model)
        if held >= budget:
            out.update(_run_window(ctx, window, smallest))
            window, held = [], 0
    out.update(_run_window(ctx, window, smallest))
    return out


def _run_window(ctx: "ClientContext", clients: list[_Client], smallest: int,
                ) -> dict[int, tuple["ClientResult", float, dict[str, float]]]:
    """Advance ``clients`` in lockstep to their uploads (see :func:`train_segments`)."""
    while True:
        pending = [c for c in clients if c.pending is not None]
        if not pending:
            break
        reports: dict[int, dict[str, Any]] = {}
        groups: dict[Any, list[_Client]] = {}
        for c in pending:
            seg = c.pending
            assert seg is not None
            if seg.cohort is not None:
                groups.setdefault((structure_key(seg.model), seg.first, seg.last), []).append(c)
        for members in groups.values():
            if len(members) < smallest:
                continue
            model = members[0].pending.model  # type: ignore[union-attr]
            cap = max(1, int(ctx.cfg.engine.cohort_memory_mb * 2**20 // max(1, client_bytes(ctx, model))))
            steps = [_segment_steps(ctx, c) for c in members]
            for cohort in plan_cohorts(steps, min_size=smallest, max_size=cap):
                chosen = [members[k] for k in cohort]
                t0, own = time.perf_counter(), sum(c.seconds for c in chosen)
                done = _train_cohort(ctx, chosen)
                if done is None:
                    continue
                # the cohort's time, less what its clients' own code took inside it (timed apart)
                inner = sum(c.seconds for c in chosen) - own
                share = max(time.perf_counter() - t0 - inner, 0.0) / len(chosen)
                for c, report in zip(chosen, done):
                    reports[c.index] = report
                    c.seconds += share
        for c in pending:
            if c.index not in reports:
                assert c.pending is not None
                with c.scope(ctx):
                    reports[c.index] = train_alone(ctx, c.task, c.pending)
        for c in pending:
            with c.scope(ctx):
                c.advance(reports[c.index])
    out = {}
    for c in clients:
        assert c.result is not None
        out[c.index] = (c.result, c.seconds, dict(c.timers))
    return out


def _segment_steps(ctx: "ClientContext", c: _Client) -> int:
    """Optimizer steps of a client's pending segment (its epochs' batches)."""
    seg = c.pending
    assert seg is not None
    return (seg.last - seg.first) * num_batches(len(ctx.data.client_indices[c.task.cid]), ctx.cfg.train.batch_size)


def _configured(sgd: LocalSGD, seg: LocalSegment) -> bool:
    """Whether the segment's optimizer is ``sgd`` (the configured SGD) over the model's trainable
    parameters (what the cohort runs)."""
    groups = seg.optimizer.param_groups
    if type(seg.optimizer) is not torch.optim.SGD or len(groups) != 1:
        return False
    g = groups[0]
    trainable = [p for p in seg.model.parameters() if p.requires_grad]
    return (g["lr"] == sgd.lr and g["momentum"] == sgd.momentum and g["weight_decay"] == sgd.weight_decay
            and bool(g["nesterov"]) == sgd.nesterov and g.get("dampening", 0) == 0 and not g.get("maximize", False)
            and len(g["params"]) == len(trainable) and all(a is b for a, b in zip(g["params"], trainable)))


def _buffers(seg: LocalSegment) -> dict[str, torch.Tensor]:
    """The momentum buffers of the segment's optimizer, by parameter name."""
    out = {}
    for name, p in seg.model.named_parameters():
        buf = seg.optimizer.state[p].get("momentum_buffer") if p in seg.optimizer.state else None
        if isinstance(buf, torch.Tensor):
            out[name] = buf
    return out


def _set_buffers(seg: LocalSegment, buffers: dict[str, torch.Tensor]) -> None:
    for name, p in seg.model.named_parameters():
        if name in buffers:
            seg.optimizer.state[p]["momentum_buffer"] = buffers[name].to(p.device, p.dtype)


def _train_cohort(ctx: "ClientContext", chosen: list[_Client]) -> list[dict[str, Any]] | None:
    """The pending segments of ``chosen`` (one structure, the same epochs) as one cohort, epoch by
    epoch; each client's model and optimizer then hold what its segment trained. None (nothing
    changed) when they cannot train as one."""
    segs = [c.pending for c in chosen]
    assert all(s is not None for s in segs)
    first = segs[0]
    assert first is not None and first.cohort is not None
    tasks = [c.task for c in chosen]
    t = ctx.cfg.train
    if t.local_steps is not None or not cohort_supported(ctx, first.model, tasks):
        return None
    if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in first.model.modules()):
        return None  # a stacked dropout draws from streams that would not carry over between segments
    configured = ctx.configured_sgd()  # the round's (the clients' scopes have set it)
    if not all(_configured(configured, s) for s in segs):  # type: ignore[arg-type]
        return None
    rule = first.cohort(segs)  # type: ignore[arg-type]
    if rule is None:
        return None
    # the cohort runs in the first client's scope (the round's settings and data stream), piece by
    # piece: the clients' own random states are restored whenever their own code runs again
    with ctx.client_scope(tasks[0]):
        co = Cohort.build(ctx, first.model, tasks, [s.model.state_dict() for s in segs])  # type: ignore[union-attr]
    if co is None:
        return None
    sgd = replace(configured, carried=True, persistent=False, masked=False, loss_over="all")
    objective = LocalObjective(grad=lambda params, grads, _consts: rule.grad(params, grads))
    buffers: list[dict[str, torch.Tensor] | None] = [_buffers(s) for s in segs]  # type: ignore[arg-type]
    steps = [0] * len(segs)
    reports: list[dict[str, Any]] = []
    for e in range(first.first, first.last):
        with ctx.client_scope(tasks[0]):
            schedules: list[list[torch.Tensor] | None] = [epoch_batches(ctx, task.cid, e) for task in tasks]
            reports = co.train(sgd, objective, None, buffers, schedules=schedules)
        out = co.momentum_out
        for j, s in enumerate(segs):
            assert s is not None
            s.model.load_state_dict(co.state(j))
            if out is not None:
                _set_buffers(s, out[j])
            steps[j] += int(reports[j]["steps"])
        buffers = list(out) if out is not None else [None] * len(segs)
        rule.epoch_end()
        for c, s in zip(chosen, segs):
            assert s is not None
            if s.on_epoch_end is not None:
                with c.scope(ctx):
                    if s.on_epoch_end(e, s.model, s.optimizer) is not None:
                        raise RuntimeError("a segment trained in a cohort changed its optimizer after an epoch")
    return [{"loss": float(r["loss"]), "steps": n, "cohort": len(chosen)} for r, n in zip(reports, steps)]
