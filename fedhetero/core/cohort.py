"""Vectorised local training: the clients of a round trained together, as one batched model.

With many clients per round and a small model (logistic regression, a small CNN), a round on one
core is dominated by per-client overhead: building an optimiser, a few small matrix products per
step, Python between them. :class:`Cohort` stacks the clients' parameters along a leading axis
and trains them together: a step draws every client's own next batch (the same batches, in the
same order, as :meth:`~fedhetero.core.context.ClientContext.train` would), pads them to one size,
runs the model on all clients at once with :func:`torch.func.vmap`, and applies SGD with momentum,
weight decay and Nesterov exactly as :class:`torch.optim.SGD` does, client by client. The sum of
the clients' mean losses has, as its gradient with respect to client ``i``'s parameters, client
``i``'s own gradient, so each client follows its own trajectory; the numbers equal the one-by-one
trainer's up to the order of floating-point sums. A model whose forward is ``linear(flatten(x))``
(it declares ``flat_linear``, e.g. ``logreg``) runs as one batched product with a hand-written
gradient instead of through ``vmap``, and every step gathers its batches into one reused buffer.

Algorithms opt in with ``client_update_many`` (FedAvg, FedProx, SCAFFOLD, MOON, FedACG, DynInit);
the local back end calls it when ``engine.vectorize`` is on and :func:`cohort_supported` holds:
no floating buffers (no BatchNorm running statistics), no dropout, no gradient clipping, no
persistent optimiser state, no augmentation, every client with data and a model of one shape.
Anything else runs client by client as before.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedhetero.core.types import ClientResult, payload_bytes, state_bytes
from fedhetero.data.batches import num_batches

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.context import ClientContext
    from fedhetero.core.types import ClientTask

__all__ = ["Cohort", "cohort_supported"]


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
    t = ctx.cfg.train
    if len(tasks) < 2 or t.clip_grad_norm is not None or t.optimizer_state == "persistent" or ctx.cfg.data.augment:
        return False
    if any(torch.is_floating_point(b) for b in model.buffers()):
        return False
    if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules()):
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
        self.params = {n: v.clone().requires_grad_(True) for n, v in self.start.items()}
        self.frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
        self.buffers = dict(model.named_buffers())
        lin = _flat_linear(model)
        self._linear = (lin + ".weight", lin + ".bias") if lin and set(self.names) == {lin + ".weight", lin + ".bias"} else None

    # ------------------------------------------------------------------ forward
    def forward(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The model of every client on its own batch: ``x`` is ``(C, B, …)``, the output ``(C, B, …)``."""
        if self._linear is not None:
            w, b = self._linear
            return _StackedLinear.apply(x.flatten(2), params[w], params[b])

        def one(p: dict[str, torch.Tensor], xb: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(self.model, {**p, **self.frozen, **self.buffers}, (xb,))

        return torch.func.vmap(one)(params, x)

    def shared_forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One model (global, teacher) on every client's batch, without gradients."""
        c, b = x.shape[:2]
        with torch.no_grad():
            out = model(x.reshape(c * b, *x.shape[2:]))
        return out.reshape(c, b, *out.shape[1:])

    # ------------------------------------------------------------------ data
    def _schedules(self) -> list[list[torch.Tensor]]:
        """Each client's batches (as rows of the training set) in the order the one-by-one
        trainer takes them."""
        ctx, t = self.ctx, self.ctx.cfg.train
        bs = t.batch_size
        out = []
        for task in self.tasks:
            seq: list[torch.Tensor] = []
            if t.local_steps is None:
                for e in range(t.local_epochs):
                    rows = ctx.client_epoch_rows(task.cid, e)
                    seq.extend(rows[k: k + bs] for k in range(0, int(rows.numel()), bs))
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
    def train(
        self,
        lr: float,
        grad_hook: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], None] | None = None,
        extra_loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> list[dict[str, Any]]:
        """Local SGD for every client. ``grad_hook(params, grads)`` adds to the gradients before
        the step (what ``after_backward`` does one by one); ``extra_loss(out, x, mask)`` returns
        a ``(C,)`` term added to each client's mean cross-entropy. Returns each client's report
        (``loss`` of its last epoch, ``steps``)."""
        ctx, t = self.ctx, self.ctx.cfg.train
        momentum = ctx.local_momentum()
        wd, nesterov = t.weight_decay, t.nesterov
        seqs = self._schedules()
        steps = [len(s) for s in seqs]
        c = len(seqs)
        bufs: dict[str, torch.Tensor | None] = {n: None for n in self.names}
        losses: list[list[tuple[float, int]]] = [[] for _ in range(c)]
        dev, dt = ctx.device, ctx.dtype
        images, labels = ctx.data.train.images, ctx.data.train.labels
        for step in range(max(steps)):
            active = torch.tensor([step < n for n in steps], device=dev)
            size = max(int(seqs[i][step].numel()) for i in range(c) if step < steps[i])
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
            y = labels.index_select(0, flat).reshape(c, size).to(dev)
            mask = mask.to(dev)
            counts = mask.sum(1).clamp_min(1.0)
            out = self.forward(self.params, x)
            ce = F.cross_entropy(out.reshape(c * size, -1), y.reshape(-1), reduction="none").reshape(c, size)
            per = (ce * mask).sum(1) / counts
            if extra_loss is not None:
                per = per + extra_loss(out, x, mask)
            grads = torch.autograd.grad(per.sum(), [self.params[n] for n in self.names])
            g = dict(zip(self.names, grads))
            with torch.no_grad():
                if grad_hook is not None:
                    grad_hook(self.params, g)
                for n in self.names:
                    p = self.params[n]
                    d = g[n]
                    if wd:
                        d = d.add(p, alpha=wd)
                    if momentum:
                        prev = bufs[n]
                        buf = d.clone() if prev is None else prev * momentum + d
                        if prev is not None:  # a client past its last step keeps its buffer
                            shape = (c,) + (1,) * (buf.dim() - 1)
                            buf = torch.where(active.view(shape), buf, prev)
                        bufs[n] = buf
                        d = d.add(buf, alpha=momentum) if nesterov else buf
                    shape = (c,) + (1,) * (d.dim() - 1)
                    p.sub_(d * active.view(shape).to(d.dtype), alpha=lr)
            for i in range(c):
                if step < steps[i]:
                    losses[i].append((float(per[i].detach()), int(mask[i].sum())))
        reports = []
        for i in range(c):
            keep = [losses[i][s] for s in self._last_epoch_steps(steps[i]) if s < len(losses[i])]
            seen = sum(n for _, n in keep)
            reports.append({"loss": sum(v * n for v, n in keep) / seen if seen else float("nan"), "steps": steps[i]})
        return reports

    def state(self, i: int) -> dict[str, torch.Tensor]:
        """Client ``i``'s trained state dict (parameters and the model's other entries)."""
        out = {}
        for k, v in self.model.state_dict().items():
            out[k] = self.params[k][i].detach().clone() if k in self.params else v.detach().clone()
        return out

    def stacked(self, states: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The parameters of per-client states stacked like :attr:`params`."""
        return {n: torch.stack([s[n].to(self.ctx.device, self.ctx.dtype) for s in states]) for n in self.names}


# ---------------------------------------------------------------------------- helpers for algorithms
HookFactory = Callable[[Cohort], Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], None]]


def train_cohort(
    algorithm: Any,
    ctx: "ClientContext",
    tasks: "Sequence[ClientTask]",
    *,
    hook: HookFactory | None = None,
    extra_loss: Callable[[Cohort], Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] | None = None,
) -> tuple[Cohort, list[dict[str, Any]]] | None:
    """Train the clients of ``tasks`` together from the global state each task carries
    (``payload["state"]``, one width for all), with the algorithm's gradient ``hook`` and
    ``extra_loss`` built for the cohort; None when :func:`cohort_supported` says no."""
    width = tasks[0].payload.get("width")
    if any(t.payload.get("width") != width or "state" not in t.payload for t in tasks):
        return None
    model = algorithm.client_model(ctx, tasks[0])
    if not cohort_supported(ctx, model, tasks):
        return None
    co = Cohort(ctx, model, tasks, [t.payload["state"] for t in tasks])
    reports = co.train(ctx.lr_at(), hook(co) if hook else None, extra_loss(co) if extra_loss else None)
    return co, reports


def proximal_hook(weight: float) -> HookFactory:
    """Gradient of ``weight/2·‖w − w_start‖²`` (FedProx's proximal term, FedACG's regulariser)."""

    def make(co: Cohort) -> Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], None]:
        def hook(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
            for n in co.names:
                grads[n].add_(params[n].detach() - co.start[n], alpha=weight)

        return hook

    return make


def plain_results(ctx: "ClientContext", tasks: "Sequence[ClientTask]", co: Cohort,
                  reports: list[dict[str, Any]]) -> list[Any]:
    """One :class:`ClientResult` per task as :meth:`Algorithm.upload` makes them."""
    macs = ctx.macs(co.model)
    out = []
    for i, task in enumerate(tasks):
        state = co.state(i)
        out.append(ClientResult(
            cid=task.cid, num_samples=task.num_samples, state=state, macs=macs,
            budget_macs=task.budget_macs, bytes_up=state_bytes(state), bytes_down=payload_bytes(task.payload),
            tier=task.tier, metrics=dict(reports[i]),
        ))
    return out
