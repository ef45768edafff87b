"""DS-FL: distillation-based semi-supervised FL (Itahara, Nishio, Koda, Morikura, Yamamoto; IEEE TMC).

Clients exchange **model outputs on an unlabeled open dataset** instead of parameters, and the
server sharpens the averaged outputs by **entropy reduction aggregation (ERA)**. The procedure
follows the public reimplementations BlazeFL and SCARLET (their defaults are unverified against the
paper).

* No parameter exchange: every client keeps **its own model across rounds** as its private client
  state (``ClientResult.client_state``, handed back the next time it is sampled); its architecture
  is its tier's family member (the configured model at the largest width fitting the tier's FLOPs
  budget), initialised on first participation.
* The server holds a global model (the largest member) trained only by distillation.
* The open pool is the unlabeled public split (``data.public_fraction``). Each round the server
  draws a subset ``S_t`` of ``subset_size`` indices (``algorithm`` stream) and broadcasts it.

Round ``t``, each sampled client: (1) if global soft labels ``q_{t−1}`` exist, distil on
``S_{t−1}`` towards them (KL, ``kd_epochs`` epochs, SGD ``kd_lr``, batch ``kd_batch_size``);
(2) train on its private data (cross-entropy, the shared trainer's epochs); (3) predict softmax
probabilities on ``S_t`` (eval mode) and upload them. Server: average the probabilities per sample,
apply ERA ``q = softmax(mean / T)`` with ``T = era_temperature`` (``aggregation="sa"`` skips the
sharpening), distil the global model on ``S_t`` towards ``q`` (same KD settings), and keep
``(S_t, q_t)`` for the next round.

Evaluation: the server evaluates what it holds, its global model. The clients' models are their
private state and never leave them (they upload probabilities only), so there is no per-tier model
on the server: every tier deploys the global model, as for any method without tier models, and the
tier accuracies are the global model's.

Dynamic budgets: a client's model is fixed (it persists across rounds), so ``adapts_to = {static}``.
Communication: upload ``|S_t|·K·4`` bytes of probabilities plus 8 bytes per index; download the
previous soft labels with their indices plus the new indices. Public images are pre-shared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedhetero.algorithms.kd._common import (
    ModelFamily,
    distill,
    public_batches,
    public_indices,
    public_positions,
    public_source,
    soft_kd_loss,
)
from fedhetero.core.hetero import budget as budget_mod
from fedhetero.core.method.algorithm import Algorithm
from fedhetero.core.common.options import MethodOptions, option
from fedhetero.core.local.objective import LocalPhase, LocalPlan, LocalSGD
from fedhetero.core.exchange.types import ClientInfo, ClientResult, ClientTask
from fedhetero.core.hetero.widths import narrowest_width_macs

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import ClientContext, Context, RunContext

__all__ = ["DSFL", "DSFLOptions", "era"]

_INDEX_BYTES = 8


def era(mean_probs: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy reduction aggregation: ``softmax(mean_probs / T)`` (applied to probabilities)."""
    return F.softmax(mean_probs / float(temperature), dim=1)


@dataclass(frozen=True)
class DSFLOptions(MethodOptions):
    """DS-FL options (SCARLET / BlazeFL defaults, unverified against the paper)."""

    subset_size: int = option(1000, ge=1)  # |S_t| drawn from the open pool each round
    kd_epochs: int = option(5, ge=1)
    kd_lr: float = option(0.1, gt=0)
    kd_batch_size: int = option(100, ge=1)
    era_temperature: float = option(0.1, gt=0)
    aggregation: Literal["era", "sa"] = "era"


class DSFL(Algorithm):
    """DS-FL: per-client persistent models, probability sharing on open data, ERA."""

    name = "dsfl"
    summary = (
        "Clients keep their own models and share only predicted probabilities on open data; the server "
        "sharpens their mean (entropy reduction aggregation) and distils it."
    )
    paper = "Itahara et al., IEEE Transactions on Mobile Computing 2023"
    public_data = "required"
    Options = DSFLOptions
    adapts_to = frozenset({"static"})

    def min_budget_macs(self, ctx: "RunContext") -> float | None:
        """The narrowest family member's MACs (width ``model.width / 16``)."""
        return narrowest_width_macs(ctx)

    def setup(self, ctx: "Context") -> None:
        budget_mod.check_budgets(ctx.cfg, self, ctx)  # a tier no member fits: one error naming it
        self.pool = public_indices(ctx, self.name)
        self.family = ModelFamily(ctx)
        self.global_model = self.family.build(ctx, self.family.server.width)
        self.prev_indices: torch.Tensor | None = None  # S_{t-1}, rows of the public source
        self.prev_q: torch.Tensor | None = None  # q_{t-1}
        self._q: torch.Tensor | None = None  # q_t, from aggregation to the server's distillation
        self._round_subset: tuple[int, torch.Tensor] | None = None

    # ------------------------------------------------------------------ internals
    def subset(self, ctx: "Context") -> torch.Tensor:
        """``S_t``: this round's sorted open-data indices."""
        if self._round_subset is None or self._round_subset[0] != ctx.round:
            rng = ctx.rng("algorithm", ctx.round, 0)
            k = min(self.options.subset_size, len(self.pool))
            chosen = np.sort(rng.choice(len(self.pool), size=k, replace=False))
            self._round_subset = (ctx.round, torch.as_tensor(self.pool[chosen], dtype=torch.long))
        return self._round_subset[1]

    def _kd_steps(self, indices: torch.Tensor) -> int:
        return self.options.kd_epochs * math.ceil(len(indices) / self.options.kd_batch_size)

    def _distill_to(
        self, ctx: "RunContext", model: nn.Module, indices: torch.Tensor, q: torch.Tensor, gen: torch.Generator
    ) -> dict[str, Any]:
        opts = self.options
        steps = self._kd_steps(indices)
        batches = public_batches(ctx, indices.numpy(), opts.kd_batch_size, gen)

        def loss_fn(out: torch.Tensor, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            return soft_kd_loss(out, q[pos].to(out.device))

        opt = torch.optim.SGD(model.parameters(), lr=opts.kd_lr)
        return distill(ctx, model, batches, loss_fn, steps, optimizer=opt)

    @torch.no_grad()
    def _predict(self, ctx: "ClientContext", model: nn.Module, indices: torch.Tensor) -> torch.Tensor:
        images = public_source(ctx).images
        model.eval()
        out = []
        bs = ctx.cfg.train.eval_batch_size
        for start in range(0, len(indices), bs):
            x = images[indices[start : start + bs].to(images.device)].to(ctx.device, ctx.dtype)
            out.append(F.softmax(model(x), dim=1).to(torch.float32).cpu())
        model.train()
        return torch.cat(out)

    # ------------------------------------------------------------------ server: client tasks
    def configure(self, ctx: "Context", clients: list[ClientInfo]) -> list[ClientTask]:
        """Every client receives its model's width, this round's subset ``S_t`` and, after the
        first round, the previous soft labels ``q_{t−1}`` with their indices ``S_{t−1}``."""
        subset = self.subset(ctx)
        tasks = []
        for client in clients:
            payload: dict[str, Any] = {"width": self.family.by_tier[client.tier].width, "subset": subset}
            if self.prev_q is not None and self.prev_indices is not None:
                payload["prev_indices"] = self.prev_indices
                payload["prev_q"] = self.prev_q
            tasks.append(self.task(ctx, client, payload))
        return tasks

    # ------------------------------------------------------------------ client half
    # The client's model is its private state (``client_state``), kept between its rounds.
    def client_model(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None = None) -> nn.Module:
        width = float(task.payload["width"])
        with ctx.seeded("init", 2, task.cid):
            model = ctx.build_model(width=width)
        if state is not None and float(state["width"]) == width:
            model.load_state_dict(state["state"])
        return model

    def local_train(self, ctx: "ClientContext", client: ClientTask, model: nn.Module, plan: LocalPlan | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        p = client.payload
        if "prev_q" in p and "prev_indices" in p:
            gen = self._kd_generator(ctx, client)
            kd = self._distill_to(ctx, model, p["prev_indices"], p["prev_q"], gen)
            out["kd_loss"] = kd["kd_loss"]
        res = ctx.train(model, client, ctx.cfg.train.local_epochs)
        out.update(res)
        return out

    @staticmethod
    def _kd_generator(ctx: "ClientContext", task: ClientTask) -> torch.Generator:
        """The order of the client's distillation batches, from (round, client)."""
        return ctx.torch_generator("client", task.round, task.cid, 1)

    # A cohort runs the same two phases (fedhetero.core.local.cohort): the distillation as a prelude
    # of plain SGD towards q_{t−1}, then the configured local SGD.
    def local_plan(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> LocalPlan:
        """The configured SGD, after the distillation on ``S_{t−1}`` towards ``q_{t−1}`` when
        the task carries them: SGD at ``kd_lr`` without momentum, ``kd_epochs`` passes in the
        client's order; the same open images and soft labels for every client of the round."""
        p = task.payload
        if "prev_q" not in p or "prev_indices" not in p:
            return LocalPlan(ctx.configured_sgd())
        indices = p["prev_indices"]
        opts = self.options
        order = public_positions(len(indices), opts.kd_batch_size, self._kd_generator(ctx, task))
        schedule = [next(order) for _ in range(self._kd_steps(indices))]
        key = ("dsfl-prelude", int(task.round))  # one broadcast of S_{t−1} and q_{t−1} per round
        held = ctx.cache.get("dsfl-prelude")
        if held is None or held[0] != key:  # the round's open images, gathered once per process
            images = public_source(ctx).images
            held = ctx.cache["dsfl-prelude"] = (key, images[indices.to(images.device)])
        prelude = LocalPhase(sgd=LocalSGD(lr=opts.kd_lr, loss_over="steps"), images=held[1],
                             targets=p["prev_q"], schedule=schedule, report="kd_loss", key=key)
        return LocalPlan(ctx.configured_sgd(), prelude=prelude)

    def upload(
        self, ctx: "ClientContext", client: ClientTask, model: nn.Module, result: dict[str, Any]
    ) -> ClientResult:
        subset = client.payload["subset"]
        probs = self._predict(ctx, model, subset)
        width = float(client.payload["width"])
        private = {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "width": width}
        macs = ctx.macs(model)
        metrics = dict(result)
        if client.budget_after_change is not None:
            metrics["fits_after_change"] = bool(macs <= client.budget_after_change * (1 + 1e-9))
        # bytes up: the probabilities and the indices of S_t they belong to (8 bytes each); bytes
        # down: the task's tensors (the index tensors are int64, 8 bytes per index)
        return ClientResult.of(
            client, {"probs": probs}, macs=macs, metrics=metrics, client_state=private,
            bytes_up=probs.numel() * probs.element_size() + _INDEX_BYTES * len(subset),
        )

    # ------------------------------------------------------------------ server
    def aggregate(self, ctx: "Context", updates: list[ClientResult]) -> None:
        """Average the uploaded probabilities on ``S_t`` and apply ERA (or plain averaging)."""
        if not updates:
            return
        stack = torch.stack([u.state["probs"].to(torch.float64) for u in sorted(updates, key=lambda u: u.cid)])
        mean = stack.mean(0)
        q = era(mean, self.options.era_temperature) if self.options.aggregation == "era" else mean
        self._q = q.to(torch.float32)

    def server_update(self, ctx: "Context") -> None:
        assert self.global_model is not None
        q = self._q
        if q is None:
            return
        subset = self.subset(ctx)
        with ctx.timer("distill"):
            gen = ctx.torch_generator("server", ctx.round, 0)
            self._distill_to(ctx, self.global_model, subset, q, gen)
        self.prev_indices, self.prev_q = subset.clone(), q
        self._q = None

    # ------------------------------------------------------------------ state
    # Hand-written: an absent q_{t−1} (before the first aggregation) is saved as an empty tensor.
    def state_dict(self) -> dict[str, Any]:
        assert self.global_model is not None
        return {
            "global_model": self.global_model.state_dict(),
            "prev_indices": self.prev_indices if self.prev_indices is not None else torch.zeros(0, dtype=torch.long),
            "prev_q": self.prev_q if self.prev_q is not None else torch.zeros(0),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s entries (a ``client_tier`` entry of older checkpoints is
        not used any more)."""
        assert self.global_model is not None
        self.global_model.load_state_dict(state["global_model"])
        self.prev_indices = state["prev_indices"] if state["prev_indices"].numel() else None
        self.prev_q = state["prev_q"] if state["prev_q"].numel() else None
