"""The shared local trainer: local SGD on one client's data, as every method's client half uses it.

:class:`LocalTrainer` belongs to a :class:`~fedhetero.core.local.context.ClientContext` (the server's
context has none): the configured optimiser (learning-rate schedule, momentum, Nesterov, weight
decay, clipping), the client's batches in an order seeded by (round, client, epoch), ``local_steps``,
persistent momentum buffers (``train.optimizer_state: persistent``) and a method's
:class:`~fedhetero.core.local.objective.LocalObjective`.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from fedhetero.core.local.features import FeatureTap, has_hidden_layers, penultimate
from fedhetero.core.local.objective import Batch, LocalObjective, LocalSGD, frozen_reference, move_consts
from fedhetero.data import iterate_batches, num_batches
from fedhetero.data.batches import epoch_order

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.common.config import RunConfig
    from fedhetero.core.exchange.types import ClientInfo
    from fedhetero.data import FederatedData

__all__ = ["LocalTrainer"]


class TrainerContext(Protocol):
    """What the trainer reads from the client context that owns it
    (:class:`~fedhetero.core.local.context.ClientContext`, which builds the trainer, so it is named here
    by what it offers rather than imported)."""

    cfg: "RunConfig"
    data: "FederatedData"
    device: torch.device
    dtype: torch.dtype
    num_classes: int
    round: int
    current_client: "ClientInfo | None"

    def lr_at(self, rnd: int | None = None) -> float:
        """The learning rate of round ``rnd`` (default: the current one)."""

    def local_momentum(self) -> float:
        """The momentum of the local SGD."""

    def torch_generator(self, concern: str, *keys: int) -> torch.Generator:
        """A generator seeded from the run's seed, the concern and the keys."""


class LocalTrainer:
    """Local SGD for the client its context runs (see the module docstring)."""

    def __init__(self, ctx: TrainerContext) -> None:
        self.ctx = ctx
        # train.optimizer_state: persistent — the current client's momentum buffers by parameter
        # name, and the optimizers made here whose buffers are kept
        self._momentum: dict[str, torch.Tensor] | None = None
        self._live: tuple[nn.Module, torch.optim.Optimizer] | None = None  # the optimizer training now
        self._tracked_optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()

    def start_client(self, optimizer_state: dict[str, Any] | None) -> None:
        """A new client: its momentum buffers from its last round (or none)."""
        self._momentum = dict(optimizer_state) if optimizer_state else None
        self._live = None
        self._tracked_optimizers = weakref.WeakSet()

    def end_client(self) -> None:
        self.start_client(None)

    def make_optimizer(self, model: nn.Module, lr: float | None = None) -> torch.optim.Optimizer:
        """The configured local SGD for ``model``'s trainable parameters: learning rate of the
        round (:meth:`lr_at`) unless ``lr`` is given, momentum (Nesterov when ``train.nesterov``),
        weight decay. With ``train.optimizer_state: persistent`` the momentum buffers the client
        kept from its last round are loaded (matched by parameter name and shape; a parameter
        whose shape changed starts a new buffer), and :meth:`train` keeps them again."""
        sgd = self.configured_sgd()
        momentum = sgd.momentum
        opt = torch.optim.SGD(
            [p for p in model.parameters() if p.requires_grad],
            lr=sgd.lr if lr is None else lr,
            momentum=momentum,
            weight_decay=sgd.weight_decay,
            nesterov=sgd.nesterov,
            # one call per update over all parameters (PyTorch loops over them in Python on CPU by
            # default): the same arithmetic bit for bit, 0.55 -> 0.36 ms a step for 94 parameters
            foreach=True,
        )
        if sgd.persistent:
            source = self._momentum if self._live is None else self._buffers(*self._live)
            self._tracked_optimizers.add(opt)
            for name, p in model.named_parameters():
                buf = (source or {}).get(name)
                if p.requires_grad and isinstance(buf, torch.Tensor) and buf.shape == p.shape:
                    opt.state[p]["momentum_buffer"] = buf.detach().to(device=p.device, dtype=p.dtype).clone()
        return opt

    def configured_sgd(self) -> LocalSGD:
        """The configured local SGD of this round (what :meth:`make_optimizer` builds and
        :meth:`train` clips by), as a cohort of clients runs it too."""
        t = self.ctx.cfg.train
        momentum = self.ctx.local_momentum()
        return LocalSGD(lr=self.ctx.lr_at(), momentum=momentum, weight_decay=t.weight_decay, nesterov=t.nesterov,
                        clip=t.clip_grad_norm, persistent=t.optimizer_state == "persistent" and momentum > 0)

    @staticmethod
    def _buffers(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in model.named_parameters():
            buf = opt.state[p].get("momentum_buffer") if p in opt.state else None
            if isinstance(buf, torch.Tensor):
                out[name] = buf
        return out

    def _keep_momentum(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        """Track ``opt`` (while it trains, a new optimizer starts from its buffers) and copy its
        buffers as the client's to keep."""
        if opt not in self._tracked_optimizers:
            return
        self._momentum = {k: v.detach().to("cpu").clone() for k, v in self._buffers(model, opt).items()}

    def optimizer_state(self) -> dict[str, torch.Tensor] | None:
        """The current client's momentum buffers to keep (``train.optimizer_state: persistent``):
        those of the last optimizer :meth:`make_optimizer` made and :meth:`train` used, or the
        ones it brought when it trained none; None in the other modes."""
        if self.ctx.cfg.train.optimizer_state != "persistent":
            return None
        return self._momentum

    def client_batches(self, cid: int, epoch: int, batch_size: int | None = None):
        """The client's shuffled batches for one local epoch (order from (round, client, epoch))."""
        return iterate_batches(
            self.ctx.data.train,
            self.ctx.data.client_indices[cid],
            batch_size or self.ctx.cfg.train.batch_size,
            generator=self._epoch_generator(cid, epoch),
            shuffle=True,
            augment=self.ctx.cfg.data.augment,
        )

    def client_epoch_rows(self, cid: int, epoch: int) -> torch.Tensor:
        """The training rows of one local epoch of client ``cid`` in :meth:`client_batches`'s order
        (without augmentation); batch ``k`` is rows ``[k·B, (k+1)·B)``."""
        return epoch_order(self.ctx.data.train, self.ctx.data.client_indices[cid], generator=self._epoch_generator(cid, epoch))

    def _epoch_generator(self, cid: int, epoch: int) -> torch.Generator:
        """The generator of a local epoch's order: from (round, client, epoch), on a stream of its
        own for prelude exchanges."""
        prelude = self.ctx.current_client is not None and self.ctx.current_client.prelude
        return self.ctx.torch_generator("prelude" if prelude else "data", self.ctx.round, cid, epoch)

    def train(
        self,
        model: nn.Module,
        client: ClientInfo,
        epochs: int,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        after_backward: Callable[[nn.Module], None] | None = None,
        on_epoch_end: Callable[[int, nn.Module, torch.optim.Optimizer], Any] | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        first_epoch: int = 0,
        objective: LocalObjective | None = None,
    ) -> dict[str, Any]:
        """Local SGD: ``epochs`` passes over the client's data.

        ``after_backward(model)`` runs after every backward and before the optimizer step (saliency
        meters and gradient corrections hook in here); then the gradient norm is clipped to
        ``train.clip_grad_norm`` when set. ``on_epoch_end(epoch, model, optimizer)`` runs after each
        epoch and may return a new optimizer (after a structure change). ``first_epoch`` numbers
        the epochs for the data order when one local round is split over several calls.
        ``objective`` adds a method's gradient and loss terms (:mod:`fedhetero.core.local.objective`):
        its loss term to ``loss_fn``'s, its gradient term before ``after_backward`` runs.

        With ``train.local_steps`` set, the local round of ``train.local_epochs`` epochs is
        ``local_steps`` optimizer steps instead: epoch ``e`` becomes steps
        ``⌊local_steps·e/E⌋ … ⌊local_steps·(e+1)/E⌋ − 1`` (so a round split over calls by epochs
        gets its proportional share of steps), and step ``s`` takes the batches in order, pass
        after pass: batch ``s mod B`` of pass ``⌊s/B⌋`` (``B`` batches per pass), each pass in the
        order :meth:`client_batches` gives that epoch number.

        Returns ``{"loss": mean loss of the last epoch, "steps": optimizer steps taken}``.
        """
        model.train()
        t = self.ctx.cfg.train
        opt = optimizer if optimizer is not None else self.make_optimizer(model)
        if opt in self._tracked_optimizers:
            self._live = (model, opt)
        if objective is not None:
            return self._train_objective(
                model, client, epochs, objective, optimizer=opt, after_backward=after_backward,
                on_epoch_end=on_epoch_end, loss_fn=loss_fn, first_epoch=first_epoch,
            )
        loss_fn = loss_fn or F.cross_entropy
        clip = t.clip_grad_norm
        losses: list[torch.Tensor] = []
        sizes: list[int] = []
        steps = 0

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            nonlocal steps
            x = x.to(self.ctx.device, self.ctx.dtype, non_blocking=True)
            y = y.to(self.ctx.device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            if after_backward is not None:
                after_backward(model)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
            opt.step()
            losses.append(loss.detach())
            sizes.append(int(y.shape[0]))
            steps += 1

        def epoch_end(e: int) -> None:
            nonlocal opt
            if on_epoch_end is not None:
                new_opt = on_epoch_end(e, model, opt)
                if isinstance(new_opt, torch.optim.Optimizer):
                    self._keep_momentum(model, opt)
                    opt = new_opt
                    self._live = (model, opt) if opt in self._tracked_optimizers else None

        if t.local_steps is None:
            for e in range(first_epoch, first_epoch + epochs):
                losses, sizes = [], []
                for x, y in self.client_batches(client.cid, e):
                    step(x, y)
                epoch_end(e)
        else:
            per_pass = num_batches(len(self.ctx.data.client_indices[client.cid]), t.batch_size)
            E = t.local_epochs
            s = t.local_steps * first_epoch // E
            batches: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None
            current = -1
            for e in range(first_epoch, first_epoch + epochs):
                stop = t.local_steps * (e + 1) // E
                if stop > s:
                    losses, sizes = [], []
                while s < stop:
                    p, pos = divmod(s, per_pass)
                    if p != current or batches is None:
                        batches, current = iter(self.client_batches(client.cid, p)), p
                        for _ in range(pos):  # resume a pass mid-way (a split local round)
                            next(batches)
                    step(*next(batches))
                    s += 1
                epoch_end(e)
        self._keep_momentum(model, opt)
        self._live = None
        seen = sum(sizes)
        mean_loss = float(sum(float(l) * n for l, n in zip(losses, sizes)) / seen) if seen else float("nan")
        return {"loss": mean_loss, "steps": steps}

    def _train_objective(
        self,
        model: nn.Module,
        client: ClientInfo,
        epochs: int,
        objective: LocalObjective,
        *,
        optimizer: torch.optim.Optimizer,
        after_backward: Callable[[nn.Module], None] | None,
        on_epoch_end: Callable[[int, nn.Module, torch.optim.Optimizer], Any] | None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
        first_epoch: int,
    ) -> dict[str, Any]:
        """:meth:`train` with a method's objective applied to this one model (its loss term
        added to ``loss_fn``, cross-entropy by default)."""
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        consts = move_consts(objective.consts, params)
        grad_rule, loss_rule = objective.grad, objective.loss
        hook = after_backward
        if grad_rule is not None:

            def hook(m: nn.Module) -> None:
                with torch.no_grad():
                    grad_rule(params, {n: p.grad for n, p in params.items() if p.grad is not None}, consts)
                if after_backward is not None:
                    after_backward(m)

        if loss_rule is None:
            return self.train(model, client, epochs, optimizer=optimizer, after_backward=hook,
                              on_epoch_end=on_epoch_end, loss_fn=loss_fn, first_epoch=first_epoch)
        base = loss_fn or F.cross_entropy
        features = objective.representation == "features" and has_hidden_layers(model, self.ctx.num_classes)
        refs = {name: frozen_reference(self.ctx, name, state) for name, state in objective.references.items()}
        seen: dict[str, torch.Tensor] = {}
        records: dict[str, list[torch.Tensor]] = {}
        handle = model.register_forward_pre_hook(lambda _m, args: seen.__setitem__("x", args[0]))
        tap = FeatureTap(model, self.ctx.num_classes) if features else contextlib.nullcontext()

        def ref(name: str) -> torch.Tensor:
            with torch.no_grad():
                return penultimate(refs[name], seen["x"], self.ctx.num_classes) if features else refs[name](seen["x"])

        def combined(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            z = tap.features if isinstance(tap, FeatureTap) else out
            assert z is not None  # the tap saw this step's forward
            return base(out, y) + loss_rule(Batch(z, consts, ref, torch.mean, records, labels=y, params=params,
                                                  own=objective.own))

        try:
            with tap:
                report = self.train(model, client, epochs, optimizer=optimizer, after_backward=hook,
                                    on_epoch_end=on_epoch_end, loss_fn=combined, first_epoch=first_epoch)
        finally:
            handle.remove()
        for name, values in records.items():
            report[name] = float(torch.stack(values).mean())
        return report

