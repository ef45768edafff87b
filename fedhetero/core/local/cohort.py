"""Vectorised local training: the clients of a round trained together, as one batched model.

With many clients per round and a small model (logistic regression, a small CNN), a round on one
core is dominated by per-client overhead: building an optimiser, a few small operations per step,
Python between them. :class:`Cohort` trains the clients together: a step draws every client's own
next batch (the same batches, in the same order, as the one-by-one trainer would), pads them to
one size, runs every client's model on its own batch at once, and applies SGD with momentum,
weight decay, Nesterov and per-client gradient clipping exactly as :class:`torch.optim.SGD` and
:func:`torch.nn.utils.clip_grad_norm_` do, client by client. The sum of the clients' mean losses
has, as its gradient with respect to client ``i``'s parameters, client ``i``'s own gradient, so
each client follows its own trajectory; the numbers equal the one-by-one trainer's up to the order
of floating-point sums.

How the clients' models run at once, by model:

* a model whose forward is ``linear(flatten(x))`` (it declares ``flat_linear``, e.g. ``logreg``):
  one batched product with a hand-written gradient;
* a model :func:`~fedhetero.core.local.stacking.stack_model` can stack (convolutions, linear layers,
  BatchNorm, GroupNorm, and whatever acts per channel between them: the zoo's CNNs): one stacked
  model holding the clients side by side along the channel axis, channels-last for images; each
  client keeps its own BatchNorm batch and running statistics, and padded rows stay out of them;
* any other model without floating buffers: :func:`torch.func.vmap` over the clients' parameters.

A method's local objective (:mod:`fedhetero.core.local.objective`: FedProx's and FedACG's proximal pull,
SCAFFOLD's correction, FedDyn's terms, MOON's and DynInit's losses against reference models) is
applied to the clients' parameters by the same rule the one-by-one trainer uses; dropout draws each
client's masks from the stream its own run draws them from (bit for bit on a CPU); momentum
buffers kept between rounds (``train.optimizer_state: persistent``) come in and go out per client.

Which clients train together (:func:`fedhetero.core.local.runner.train_cohorts`): a task whose method
states its local training as a plan (:meth:`~fedhetero.core.method.algorithm.Algorithm.local_plan`: the
configured SGD, or the FedDU family's at the server's rate, and what it adds) joins; they are
grouped by model structure
(:func:`structure_key`: a pruned or narrower model trains with its like), SGD settings and
objective rules, then by their number of steps (:func:`plan_cohorts`: a cohort steps until its
longest client is done, so clients of very different lengths go to different cohorts), each
cohort capped by ``engine.cohort_memory_mb`` (:func:`client_bytes`). With ``engine.vectorize``
null (the default) a CPU batches cohorts of ``engine.min_cohort`` clients or more, each of
:data:`~fedhetero.core.local.runner.AUTO_MIN_STEPS` local steps or more (fewer clients, or shorter
ones, were no faster than one by one), a GPU of two or more. Every other task — augmentation, a client half of
the method's own, a model the cohort cannot run, too few clients of a kind — runs one by one.
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedhetero.core.local.features import classifier_of, has_hidden_layers, penultimate
from fedhetero.core.local.objective import Batch, LocalObjective, LocalPhase, LocalSGD, cohort_rules, frozen_reference, stack_consts
from fedhetero.core.local.stacking import client_shapes, load_clients, stack_model, stacked_dropouts, stacked_layers, views
from fedhetero.core.exchange.types import derive_seed
from fedhetero.data.batches import num_batches

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import ClientContext
    from fedhetero.core.exchange.types import ClientTask

__all__ = [
    "Cohort", "client_bytes", "client_generator", "client_steps", "cohort_supported", "epoch_batches", "plan_cohorts",
    "structure_key", "train_cohort",
]


class _StackedLinear(torch.autograd.Function):
    """``x @ w.T + b`` for a stack of linear models: ``x`` ``(C, B, D)``, ``w`` ``(C, K, D)``,
    ``b`` ``(C, K)``. The weight gradient is formed as ``g.T @ x`` (``(C, K, D)`` directly): the
    generic autograd of a batched product forms ``x.T @ g`` and transposes it, which on a CPU is
    about three times slower for the wide, short products of a linear classifier."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        gx = torch.bmm(g, w) if ctx.needs_input_grad[0] else None
        gw = torch.bmm(g.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        gb = g.sum(1) if ctx.needs_input_grad[2] else None
        return gx, gw, gb


_SCRATCH = threading.local()


def _scratch(like: torch.Tensor, rows: int) -> torch.Tensor:
    """A reused ``(rows, *like.shape[1:])`` buffer for gathered batches: a fresh tensor of tens of
    megabytes each step costs more (page faults of a new allocation) than the gather itself."""
    key = (like.dtype, like.device, tuple(like.shape[1:]))
    held = getattr(_SCRATCH, "buffers", None)
    if held is None:
        held = _SCRATCH.buffers = {}
    buf = held.get(key)
    if buf is None or buf.shape[0] < rows:
        buf = held[key] = torch.empty((rows, *like.shape[1:]), dtype=like.dtype, device=like.device)
    return buf[:rows]


def client_generator(ctx: "ClientContext", task: "ClientTask") -> torch.Generator:
    """A generator in the state torch's default generator (of the run's device) is in when the
    client scope of ``task`` starts: where its one-by-one run draws dropout masks from."""
    gen = torch.Generator(device=ctx.device)
    gen.manual_seed(derive_seed(ctx.cfg.seed, "client", task.round, task.cid))
    return gen


def _hook_key(hook: Callable[..., Any]) -> Any:
    """A forward hook as part of a cache key: its code and the plain values it closes over (a
    HeteroFL scaler's rate), so the same hook made for another client finds the same entry."""
    code = getattr(hook, "__code__", None)
    cells = tuple(c.cell_contents for c in (getattr(hook, "__closure__", None) or ()))
    if code is None or not all(isinstance(v, (int, float, str, bool, type(None))) for v in cells):
        return id(hook)
    return code, cells


def _stacked_for(ctx: "ClientContext", model: nn.Module, clients: int) -> nn.Module | None:
    """The stacked copy of ``model`` for ``clients`` clients (see :mod:`fedhetero.core.local.stacking`),
    built once per architecture and cohort size in this process and checked against the clients'
    own models once per architecture (at three clients); None when the model cannot be stacked."""
    arch = (str(ctx.dtype), str(ctx.device), structure_key(model),
            tuple((name, tuple(_hook_key(h) for h in m._forward_hooks.values()))
                  for name, m in model.named_modules() if m._forward_hooks))
    key = ("stacked", clients, *arch)
    if key in ctx.cache:
        ctx.cache[key] = ctx.cache.pop(key)  # most recently used last
    else:
        held = [k for k in ctx.cache if isinstance(k, tuple) and k and k[0] == "stacked"]
        for old in held[: max(0, len(held) + 1 - STACKED_KEPT)]:  # the least recently used go
            del ctx.cache[old]
        checked = ("stacking-checked", *arch)
        state = torch.get_rng_state()
        try:
            if checked not in ctx.cache:
                ctx.cache[checked] = stack_model(model, 3, tuple(ctx.input_shape)) is not None
            stacked = stack_model(model, clients, tuple(ctx.input_shape), check=False) if ctx.cache[checked] else None
        finally:
            torch.set_rng_state(state)
        if stacked is not None:
            for name, p in stacked.named_parameters():  # frozen parameters stay frozen
                p.requires_grad_(model.get_parameter(name).requires_grad)
            stacked = stacked.to(ctx.device, ctx.dtype)
            if any(p.dim() == 4 for p in stacked.parameters()):
                stacked = stacked.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # Module.to accepts it; the stubs do not say so
        ctx.cache[key] = stacked
    return ctx.cache[key]


#: stacked models kept per process (built once per architecture and cohort size): a method whose
#: clients train many structures (DynamicFL's grown branches) would otherwise keep one of each
STACKED_KEPT = 16


def _clip_per_client(grads: dict[str, torch.Tensor], max_norm: float) -> None:
    """Each client's gradients scaled as :func:`torch.nn.utils.clip_grad_norm_` scales one
    model's: by ``max_norm / (‖g‖ + 1e-6)`` when that is below 1 (``‖g‖`` over all its
    parameters)."""
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()])  # (names, C)
    total = norms.norm(dim=0)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads.values():
        g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))


def _flat_linear(model: nn.Module) -> str | None:
    """Name of the one :class:`~torch.nn.Linear` of a model whose forward is
    ``linear(flatten(x))`` (it says so with a ``flat_linear`` attribute), else None."""
    name = getattr(model, "flat_linear", None)
    if not isinstance(name, str):
        return None
    layer = model.get_submodule(name)
    if not isinstance(layer, nn.Linear) or layer.bias is None:
        return None
    return name


def cohort_supported(ctx: "ClientContext", model: nn.Module, tasks: "Sequence[ClientTask]") -> bool:
    """Whether these tasks can be trained as one :class:`Cohort` with the same numbers."""
    if len(tasks) < 2 or ctx.cfg.data.augment:
        return False
    first = tasks[0]
    if any(x.round != first.round or x.lr != first.lr or x.prelude != first.prelude for x in tasks):
        return False
    return all(len(ctx.data.client_indices[x.cid]) > 0 for x in tasks)


class Cohort:
    """Clients trained together: ``params[name]`` has one row per client (see the module
    docstring). ``initial``: each client's starting state (the same dict may be repeated)."""

    def __init__(self, ctx: "ClientContext", model: nn.Module, tasks: "Sequence[ClientTask]",
                 initial: Sequence[dict[str, torch.Tensor]]) -> None:
        self.ctx = ctx
        self.model = model
        self.tasks = list(tasks)
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        dev, dt = ctx.device, ctx.dtype
        self.start = {n: torch.stack([s[n].to(dev, dt) for s in initial]) for n in self.names}
        self.frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
        self.buffers = dict(model.named_buffers())
        self.objectives: list[LocalObjective] = []
        lin = _flat_linear(model)
        self._linear = (lin + ".weight", lin + ".bias") if lin and set(self.names) == {lin + ".weight", lin + ".bias"} else None
        self.stacked: nn.Module | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._tapped: dict[str, torch.Tensor] | None = None  # the stacked classifier's input (_tap)
        if self._linear is None:
            self.stacked = _stacked_for(ctx, model, len(self.tasks))
        if self.stacked is not None:
            load_clients(self.stacked, [dict(s) for s in initial])
            self.stacked.train()
            self._views = views(self.stacked, client_shapes(model), len(self.tasks))
            self._leaves = dict(self.stacked.named_parameters())
            self.params = {n: self._views[n] for n in self.names}
            self._norms = stacked_layers(self.stacked)
        else:
            if any(torch.is_floating_point(b) for b in self.buffers.values()):
                raise ValueError("a model with floating buffers needs a stacked copy")
            if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules()):
                raise ValueError("a model with dropout needs a stacked copy (each client's own masks)")
            if any(isinstance(m, nn.modules.batchnorm._NormBase) for m in model.modules()):
                raise ValueError("a model with batch statistics needs a stacked copy (padded rows stay out of them)")
            self.params = {n: v.clone().requires_grad_(True) for n, v in self.start.items()}

    @classmethod
    def build(cls, ctx: "ClientContext", model: nn.Module, tasks: "Sequence[ClientTask]",
              initial: Sequence[dict[str, torch.Tensor]]) -> "Cohort | None":
        """A cohort, or None when the model cannot be trained as one (floating buffers, such as
        BatchNorm statistics, in a model :func:`~fedhetero.core.local.stacking.stack_model` refuses)."""
        try:
            return cls(ctx, model, tasks, initial)
        except ValueError:
            return None

    # ------------------------------------------------------------------ forward
    def forward(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The model of every client on its own batch: ``x`` is ``(C, B, …)``, the output ``(C, B, …)``."""
        if self._linear is not None:
            w, b = self._linear
            return _StackedLinear.apply(x.flatten(2), params[w], params[b])
        if self.stacked is not None:
            return self._stacked_forward(x, None if params is self.params else params)

        def one(p: dict[str, torch.Tensor], xb: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(self.model, {**p, **self.frozen, **self.buffers}, (xb,))

        return torch.func.vmap(one)(params, x)

    def _stacked_forward(self, x: torch.Tensor, state: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """The stacked model on ``x`` ``(C, B, …)``: the clients' batches side by side along the
        channel axis (channels-last for images). ``state``: other per-client tensors (``(C, …)``,
        reference models) to run in eval mode instead of the clients' own."""
        assert self.stacked is not None
        c, b = x.shape[:2]
        xs = x.transpose(0, 1).reshape(b, c * x.shape[2], *x.shape[3:])
        if xs.dim() == 4:
            xs = xs.contiguous(memory_format=torch.channels_last)
        if state is None:
            out = self.stacked(xs)
        else:
            own = self.stacked.state_dict(keep_vars=True)
            swapped = {k: v.reshape(own[k].shape) for k, v in state.items()}
            self.stacked.eval()
            try:
                out = torch.func.functional_call(self.stacked, swapped, (xs,))
            finally:
                self.stacked.train()
        return out.reshape(b, c, -1).transpose(0, 1)

    def shared_forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One model (global, teacher) on every client's batch, without gradients."""
        c, b = x.shape[:2]
        with torch.no_grad():
            out = model(x.reshape(c * b, *x.shape[2:]))
        return out.reshape(c, b, *out.shape[1:])

    # ------------------------------------------------------------------ data
    def _schedules(self, given: Sequence[list[torch.Tensor] | None] | None = None) -> list[list[torch.Tensor]]:
        """Each client's batches (as rows of the training set) in the order the one-by-one
        trainer takes them; ``given``: a client's own batches where its method states them
        (``LocalPlan.schedule``)."""
        ctx, t = self.ctx, self.ctx.cfg.train
        bs = t.batch_size
        out = []
        for j, task in enumerate(self.tasks):
            seq: list[torch.Tensor] = []
            own = given[j] if given is not None else None
            if own is not None:
                seq.extend(own)
            elif t.local_steps is None:
                for e in range(t.local_epochs):
                    seq.extend(epoch_batches(ctx, task.cid, e))
            else:
                per_pass = num_batches(len(ctx.data.client_indices[task.cid]), bs)
                passes: dict[int, torch.Tensor] = {}
                for s in range(t.local_steps):
                    p, pos = divmod(s, per_pass)
                    if p not in passes:
                        passes[p] = ctx.client_epoch_rows(task.cid, p)
                    seq.append(passes[p][pos * bs: (pos + 1) * bs])
            out.append(seq)
        return out

    def _last_epoch_steps(self, steps: int) -> range:
        """Steps whose losses the one-by-one trainer reports (its last epoch's)."""
        t = self.ctx.cfg.train
        if t.local_steps is None:
            per = steps // t.local_epochs
            return range(steps - per, steps)
        e = t.local_epochs
        return range(t.local_steps * (e - 1) // e, t.local_steps)

    # ------------------------------------------------------------------ training
    def train(self, sgd: LocalSGD, objective: LocalObjective | None = None,
              consts: dict[str, Any] | None = None,
              momentum_buffers: Sequence[Mapping[str, torch.Tensor] | None] | None = None,
              classes: Sequence[Sequence[int] | None] | None = None,
              masks: Sequence[Mapping[str, torch.Tensor] | None] | None = None,
              schedules: Sequence[list[torch.Tensor] | None] | None = None,
              source: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[dict[str, Any]]:
        """Local SGD as ``sgd`` states it for every client, with the method's ``objective`` (its
        rules applied to the stacked parameters, ``consts`` the clients' constants stacked by
        :func:`~fedhetero.core.local.objective.stack_consts`). ``momentum_buffers``: each client's
        buffers from its last round (``sgd.persistent``) or from the method (``sgd.carried``; a parameter without one, or whose shape
        changed, starts a new buffer, as :class:`torch.optim.SGD` does); the buffers to keep are
        left in :attr:`momentum_out`. ``classes``: each client's classes the cross-entropy sees
        (the others' logits set to ``sgd.class_fill``; None: all). ``masks``: each client's
        parameter masks (``sgd.masked``; a parameter without one is not masked), applied before
        the first step and after every step. ``schedules``: each client's batches where its
        method states them (None: its own epochs). ``source``: ``(images, targets)`` the schedules'
        rows index instead of the training set, the targets one probability vector per image (a
        :class:`~fedhetero.core.local.objective.LocalPhase`; the loss is then ``KL(target ‖
        softmax(output))``). Returns each client's report (``loss`` over the steps
        ``sgd.loss_over`` says, ``steps``)."""
        grad_rule = objective.grad if objective is not None else None
        loss_rule = objective.loss if objective is not None else None
        c_all = consts or {}
        # a rule on the penultimate features (MOON): the stacked classifier's input, per client
        features = (objective is not None and loss_rule is not None and objective.representation == "features"
                    and has_hidden_layers(self.model, self.ctx.num_classes))
        refs = self._references(objective, features) if objective is not None and loss_rule is not None else {}
        records: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        ctx = self.ctx
        lr, momentum, wd, nesterov, clip = sgd.lr, sgd.momentum, sgd.weight_decay, sgd.nesterov, sgd.clip
        ema = sgd.momentum_form == "ema"
        seqs = self._schedules(schedules)
        steps = [len(s) for s in seqs]
        c = len(seqs)
        dev, dt = ctx.device, ctx.dtype
        bufs: dict[str, torch.Tensor | None] = {n: None for n in self.names}
        carry = sgd.persistent or sgd.carried
        if momentum and carry and momentum_buffers is not None and any(b is not None for b in momentum_buffers):
            for n in self.names:  # zeros where a client has none: the first step's 0·m + d is d
                shape = tuple(self.params[n].shape[1:])
                kept = [(b or {}).get(n) for b in momentum_buffers]
                bufs[n] = torch.stack([k.to(dev, dt) if isinstance(k, torch.Tensor) and tuple(k.shape) == shape
                                       else torch.zeros(shape, device=dev, dtype=dt) for k in kept])
        held = self._stacked_masks(masks) if sgd.masked and masks is not None else {}
        with torch.no_grad():
            for n, m in held.items():
                self.params[n].mul_(m)
        losses: list[list[tuple[float, int]]] = [[] for _ in range(c)]
        images, labels = (ctx.data.train.images, ctx.data.train.labels) if source is None else source
        soft = labels.is_floating_point()
        seen_logits = None
        if classes is not None:  # (C, 1, K): the logits each client's loss sees
            seen_logits = torch.ones((c, 1, ctx.num_classes), dtype=torch.bool, device=dev)
            for i, own in enumerate(classes):
                if own is not None:
                    seen_logits[i, 0] = False
                    seen_logits[i, 0, torch.as_tensor(list(own), dtype=torch.long, device=dev)] = True
        drops = stacked_dropouts(self.stacked) if self.stacked is not None else []
        if drops:  # each client's masks from the stream its own model would draw them from
            gens = [client_generator(ctx, task) for task in self.tasks]
            for drop in drops:
                drop.generators = gens
        for step in range(max(steps)):
            active = torch.tensor([step < n for n in steps], device=dev)
            real = [int(seqs[i][step].numel()) if step < steps[i] else 0 for i in range(c)]  # each client's rows
            size = max(real)
            rows = torch.zeros((c, size), dtype=torch.long)
            mask = torch.zeros((c, size), dtype=dt)
            for i in range(c):
                if step < steps[i]:
                    r = seqs[i][step]
                    rows[i, : r.numel()] = r
                    mask[i, : r.numel()] = 1.0
            flat = rows.reshape(-1).to(images.device)
            gathered = _scratch(images, flat.numel())
            torch.index_select(images, 0, flat, out=gathered)
            x = gathered.reshape(c, size, *images.shape[1:]).to(dev, dt)
            y = labels.index_select(0, flat).reshape(c, size, *labels.shape[1:]).to(dev)
            mask = mask.to(dev)
            counts = mask.sum(1).clamp_min(1.0)
            if self.stacked is not None:  # BatchNorm leaves padded rows out of its statistics
                partial = any(0 < n < size for n in real)  # a short batch: masked statistics
                idle = None if partial or all(real) else ~active  # else only whole clients idle
                for norm in self._norms:
                    norm.mask = mask.t() if partial else None
                    norm.idle = idle
                if drops:
                    for drop in drops:
                        drop.rows = real
            out = self.forward(self.params, x)
            logits = out if seen_logits is None else out.masked_fill(~seen_logits, float(sgd.class_fill))
            if soft:  # KL(target ‖ softmax(output)) of each row, as F.kl_div sums it
                logp = F.log_softmax(logits.reshape(c * size, -1), dim=1)
                ce = F.kl_div(logp, y.reshape(c * size, -1).to(logp.dtype), reduction="none").sum(1).reshape(c, size)
            else:
                ce = F.cross_entropy(logits.reshape(c * size, -1), y.reshape(-1), reduction="none").reshape(c, size)
            per = (ce * mask).sum(1) / counts
            if loss_rule is not None:

                def masked_mean(v: torch.Tensor, mask: torch.Tensor = mask, counts: torch.Tensor = counts) -> torch.Tensor:
                    return (v * mask).sum(1) / counts

                def ref(name: str, x: torch.Tensor = x) -> torch.Tensor:
                    return refs[name](x)

                step_records: dict[str, list[torch.Tensor]] = {}  # this step's values
                rep = self._classifier_input(c) if features else out
                per = per + loss_rule(Batch(rep, c_all, ref, masked_mean, step_records, labels=y, params=self.params,
                                            own=[o.own for o in self.objectives], rows=real))
                for name, values in step_records.items():
                    records.setdefault(name, []).append((values[-1], active))
            if self.stacked is not None:
                grads = torch.autograd.grad(per.sum(), [self._leaves[n] for n in self.names])
                g = {n: gr.view(self.params[n].shape) for n, gr in zip(self.names, grads)}
            else:
                grads = torch.autograd.grad(per.sum(), [self.params[n] for n in self.names])
                g = dict(zip(self.names, grads))
            with torch.no_grad():
                if grad_rule is not None:
                    grad_rule(self.params, g, c_all)
                if clip is not None:
                    _clip_per_client(g, clip)
                for n in self.names:
                    p = self.params[n]
                    d = g[n]
                    if wd:
                        d = d.add(p, alpha=wd)
                    if momentum:
                        prev = bufs[n]
                        if ema:  # m ← β·m + (1−β)·d from m = 0
                            buf = d * (1.0 - momentum) if prev is None else prev * momentum + d * (1.0 - momentum)
                        else:
                            buf = d.clone() if prev is None else prev * momentum + d
                        if prev is not None:  # a client past its last step keeps its buffer
                            shape = (c,) + (1,) * (buf.dim() - 1)
                            buf = torch.where(active.view(shape), buf, prev)
                        bufs[n] = buf
                        d = d.add(buf, alpha=momentum) if nesterov else buf
                    shape = (c,) + (1,) * (d.dim() - 1)
                    p.sub_(d * active.view(shape).to(d.dtype), alpha=lr)
                    if n in held:
                        p.mul_(held[n])
            for i in range(c):
                if step < steps[i]:
                    losses[i].append((float(per[i].detach()), int(mask[i].sum())))
        for drop in drops:
            drop.generators = drop.rows = None
        for norm in self._norms if self.stacked is not None else []:  # the stacked model is kept for later cohorts
            norm.mask = norm.idle = None
        self.momentum_out = None
        if momentum and carry:
            self.momentum_out = [{n: b[i].detach().to("cpu").clone() for n, b in bufs.items() if b is not None}
                                 for i in range(c)]
        reports = []
        for i in range(c):
            if sgd.loss_over == "steps":  # the plain mean of the steps' batch means
                mean = sum(v for v, _ in losses[i]) / len(losses[i]) if losses[i] else float("nan")
                reports.append({"loss": mean, "steps": steps[i]})
                continue
            if sgd.loss_over == "all":
                keep = losses[i]
            else:
                keep = [losses[i][s] for s in self._last_epoch_steps(steps[i]) if s < len(losses[i])]
            seen = sum(n for _, n in keep)
            reports.append({"loss": sum(v * n for v, n in keep) / seen if seen else float("nan"), "steps": steps[i]})
        for name, recorded in records.items():  # what the rules recorded: each client's mean over its steps
            total = torch.stack([v * a.to(v.dtype) for v, a in recorded]).sum(0)
            count = torch.stack([a.to(total.dtype) for _, a in recorded]).sum(0).clamp_min(1.0)
            for i, report in enumerate(reports):
                report[name] = float(total[i] / count[i])
        return reports

    def _stacked_masks(self, masks: Sequence[Mapping[str, torch.Tensor] | None]) -> dict[str, torch.Tensor]:
        """The clients' parameter masks stacked like :attr:`params` (ones where a client has
        none), for the parameters any client masks."""
        dev, dt = self.ctx.device, self.ctx.dtype
        out = {}
        for n in self.names:
            if not any(m is not None and n in m for m in masks):
                continue
            ones = torch.ones(self.params[n].shape[1:], device=dev, dtype=dt)
            out[n] = torch.stack([m[n].to(dev, dt) if m is not None and n in m else ones for m in masks])
        return out

    def _tap(self) -> dict[str, torch.Tensor]:
        """Where the stacked model's classifier leaves its input on every forward (one hook per
        stacked model, which the process keeps between cohorts)."""
        assert self.stacked is not None
        if self._tapped is None:
            head: Any = self.stacked.get_submodule(classifier_of(self.model, self.ctx.num_classes)[0])
            tapped = getattr(head, "_cohort_input", None)
            if tapped is None:
                tapped = {}
                head.register_forward_pre_hook(lambda _m, args, t=tapped: t.__setitem__("z", args[0]))
                head._cohort_input = tapped
            self._tapped = tapped
        return self._tapped

    def _classifier_input(self, clients: int) -> torch.Tensor:
        """The penultimate features of the latest stacked forward, ``(C, B, D)``."""
        z = self._tap().pop("z")
        return z.reshape(z.shape[0], clients, -1).transpose(0, 1)

    def _references(self, objective: LocalObjective, features: bool = False) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        """Each reference model as a function of the cohort's batches: one shared model when
        every client has the same state, else the clients' own stacked; with ``features``, their
        penultimate features instead of their outputs."""
        out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        if features:
            self._tap()
        for name in objective.references:
            states = [o.references[name] for o in self.objectives]
            if all(s is states[0] for s in states):
                shared = frozen_reference(self.ctx, name, states[0])

                def common(x: torch.Tensor, m: nn.Module = shared) -> torch.Tensor:
                    if not features:
                        return self.shared_forward(m, x)
                    c, b = x.shape[:2]
                    with torch.no_grad():
                        z = penultimate(m, x.reshape(c * b, *x.shape[2:]), self.ctx.num_classes)
                    return z.reshape(c, b, *z.shape[1:])

                out[name] = common
            else:
                if self.stacked is not None:  # every entry, buffers too: references run in eval mode
                    keys = list(self._views)
                    dev, dt = self.ctx.device, self.ctx.dtype
                    stacked = {k: torch.stack([s[k].to(dev, dt if s[k].is_floating_point() else s[k].dtype)
                                               for s in states]) for k in keys}
                else:
                    stacked = self.stacked_params([dict(s) for s in states])

                def own(x: torch.Tensor, p: dict[str, torch.Tensor] = stacked) -> torch.Tensor:
                    with torch.no_grad():
                        y = self.forward(p, x)
                    return self._classifier_input(x.shape[0]) if features else y

                out[name] = own
        return out

    def state(self, i: int) -> dict[str, torch.Tensor]:
        """Client ``i``'s trained state dict (parameters and the model's other entries)."""
        out = {}
        for k, v in self.model.state_dict().items():
            if k in self._views:
                out[k] = self._views[k][i].detach().clone()
            else:
                out[k] = self.params[k][i].detach().clone() if k in self.params else v.detach().clone()
        return out

    def stacked_params(self, states: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The parameters of per-client states stacked like :attr:`params`."""
        return {n: torch.stack([s[n].to(self.ctx.device, self.ctx.dtype) for s in states]) for n in self.names}


# ---------------------------------------------------------------------------- the framework's entry
def epoch_batches(ctx: "ClientContext", cid: int, epoch: int) -> list[torch.Tensor]:
    """Client ``cid``'s batches of local epoch ``epoch``, as rows of the training set, in the order
    the one-by-one trainer takes them (in the client scope of the round)."""
    rows = ctx.client_epoch_rows(cid, epoch)
    bs = ctx.cfg.train.batch_size
    return [rows[k: k + bs] for k in range(0, int(rows.numel()), bs)]


def client_steps(ctx: "ClientContext", cid: int) -> int:
    """Optimizer steps client ``cid``'s local round takes (0 without data)."""
    t = ctx.cfg.train
    n = len(ctx.data.client_indices[cid])
    if n == 0:
        return 0
    return int(t.local_steps) if t.local_steps is not None else t.local_epochs * num_batches(n, t.batch_size)


def plan_cohorts(steps: Sequence[int], *, min_size: int, max_size: int, slack: float = 0.25) -> list[list[int]]:
    """Which clients (indices into ``steps``, each client's optimizer steps) to train together.

    A cohort steps all its clients until the longest is done, so clients are taken longest first
    and a cohort grows while the steps it runs (``size × its longest``) stay within ``1 + slack``
    of the steps its clients need; a run of such clients longer than ``max_size`` is cut into
    nearly equal cohorts. Cohorts smaller than ``min_size`` are left out (trained one by one), as
    are clients without steps. Each cohort lists its clients longest first, ties by index."""
    if min_size < 1 or max_size < 1:
        raise ValueError("plan_cohorts: min_size and max_size must be at least 1")
    def runs(order: list[int]) -> list[list[int]]:  # longest first; a new run where padding would pass the bound
        out: list[list[int]] = []
        for i in order:
            if out and (len(out[-1]) + 1) * steps[out[-1][0]] <= (1.0 + slack) * (sum(steps[j] for j in out[-1]) + steps[i]):
                out[-1].append(i)
            else:
                out.append([i])
        return out

    out = []
    for run in runs(sorted((i for i, n in enumerate(steps) if n > 0), key=lambda i: (-steps[i], i))):
        parts = -(-len(run) // max_size)
        bounds = [round(k * len(run) / parts) for k in range(parts + 1)]
        for k in range(parts):  # a part of a run may pad more than the run: bound it again
            out.extend(runs(run[bounds[k]: bounds[k + 1]]))
    return [g for g in out if len(g) >= min_size]


def structure_key(model: nn.Module) -> tuple[Any, ...]:
    """What clients trained as one cohort must share: the model's class and every state entry's
    name, shape and dtype, which parameters train, and the class of every submodule (a layer
    whose forward differs with the same entries, such as an identity-based 1×1 conv beside a plain
    one, is another structure)."""
    return (type(model).__module__, type(model).__qualname__,
            tuple((k, tuple(v.shape), str(v.dtype)) for k, v in model.state_dict().items()),
            tuple(n for n, p in model.named_parameters() if p.requires_grad),
            tuple(type(m).__qualname__ for m in model.modules()))


def client_bytes(ctx: "ClientContext", model: nn.Module) -> int:
    """Estimated memory one client adds to a cohort: its parameters four times (weights,
    gradients, momentum, start) and three times the activations of a batch (forward outputs
    kept for the backward, their gradients, the gathered input), in the run's dtype."""
    key = ("cohort-bytes", structure_key(model), str(ctx.dtype), ctx.cfg.train.batch_size)
    if key not in ctx.cache:
        outputs = [0]
        handles = [m.register_forward_hook(lambda _m, _i, o: outputs.__setitem__(0, outputs[0] + (
            o.numel() if isinstance(o, torch.Tensor) else 0))) for m in model.modules() if not list(m.children())]
        was = model.training
        try:
            model.eval()
            with torch.no_grad():
                p = next(model.parameters(), None)
                x = torch.zeros((1, *ctx.input_shape), dtype=p.dtype if p is not None else ctx.dtype,
                                device=p.device if p is not None else ctx.device)
                model(x)
        finally:
            model.train(was)
            for h in handles:
                h.remove()
        per_sample = outputs[0] + math.prod(ctx.input_shape)
        params = sum(p.numel() for p in model.parameters())
        size = torch.empty((), dtype=ctx.dtype).element_size()
        ctx.cache[key] = int(size * (4 * params + 3 * per_sample * ctx.cfg.train.batch_size))
    return int(ctx.cache[key])


def train_cohort(
    ctx: "ClientContext",
    model: nn.Module,
    tasks: "Sequence[ClientTask]",
    objectives: "Sequence[LocalObjective | None]",
    initial: Sequence[Mapping[str, torch.Tensor]],
    sgds: Sequence[LocalSGD],
    momentum_buffers: Sequence[Mapping[str, torch.Tensor] | None] | None = None,
    schedules: Sequence[list[torch.Tensor] | None] | None = None,
    masks: Sequence[Mapping[str, torch.Tensor] | None] | None = None,
    preludes: "Sequence[LocalPhase | None] | None" = None,
) -> tuple[Cohort, list[dict[str, Any]]] | None:
    """Train the clients of ``tasks`` together, each from its ``initial`` state, with its SGD
    (``sgds``: alike but for each client's ``classes``) and their objectives' shared rules; None when :func:`cohort_supported` says no or the objectives
    cannot share a cohort. Runs in the client scope of the first task (the round and the data
    stream of the exchange). ``schedules``: each client's batches when its method gives them
    (None: its own epochs); ``masks``: each client's parameter masks (``sgd.masked``);
    ``preludes``: each client's phase before its local training (all None, or all alike: their
    ``key``), whose loss goes into the report under its ``report`` name."""
    if not cohort_supported(ctx, model, tasks):
        return None
    rules = cohort_rules(objectives)
    if rules is False:
        return None
    objective = rules if isinstance(rules, LocalObjective) else None
    co = Cohort.build(ctx, model, tasks, [dict(s) for s in initial])
    if co is None:
        return None
    if objective is not None and objective.loss is not None and objective.representation == "features" \
            and has_hidden_layers(model, ctx.num_classes) and co.stacked is None:
        return None  # penultimate features are tapped from a stacked model only: one by one
    co.objectives = [o for o in objectives if o is not None]
    consts = None
    if objective is not None and objective.consts:
        consts = stack_consts([o.consts for o in co.objectives], co.names, ctx.device, ctx.dtype)
    if any(s.shared() != sgds[0].shared() for s in sgds):
        return None
    classes = [s.classes for s in sgds] if any(s.classes is not None for s in sgds) else None
    first = preludes[0] if preludes else None
    if first is not None:
        assert preludes is not None
        if any(p is None or p.key != first.key or p.sgd.shared() != first.sgd.shared() for p in preludes):
            return None
        before = co.train(first.sgd.shared(), schedules=[p.schedule for p in preludes if p is not None],
                          source=(first.images, first.targets))
    reports = co.train(sgds[0].shared(), objective, consts, momentum_buffers, classes, masks, schedules)
    if first is not None:
        for report, done in zip(reports, before):
            report[first.report] = done["loss"]
    return co, reports
