"""SplitMix: split the model into base networks and mix them per budget
(Hong, Wang, Lyu, Zhou, Jain, Kumar, Lin; ICLR 2022).

Base-model split (as upstream ``illidanlab/SplitMix``): the global model is ``M``
**independent base networks**, each the whole architecture at the atom width ρ, with its own
stem, BNs and classifier, independently initialised. ρ defaults to the smallest tier's width (the
largest width whose MACs fit the smallest tier's budget; ``atom_width`` overrides it). A client
with budget ``B`` trains ``n = ⌊B / MACs(base)⌋`` bases (capped at ``M``); ``M`` is the ``n`` of the
largest tier, so every client's ensemble fits its budget in absolute FLOPs.

Which bases: a server-side shuffled cyclic sampler over base indices gives each client its first
base; the other ``n − 1`` are drawn without replacement from the remaining bases (per round and
client from the ``algorithm`` stream). Over rounds this balances how often each base is trained.

Local step (``train_slimmable``): the same minibatch goes through every selected base, each base
has its own cross-entropy, the gradients accumulate (disjoint parameters) and one optimizer step
is taken; the optimizer is re-created every round.

Aggregation: each base is averaged over the clients that trained it, weighted by client
training-set size (``weighting="samples"``, upstream); a base nobody trained keeps its value. BN
running statistics are averaged like weights (``num_batches_tracked`` copied).

Inference at a tier: the mean of the logits of the tier's first ``n`` bases; the global model is
the ensemble of all ``M`` bases.

Dynamic budgets: when the budget drops during local training (from local epoch 3 on), the client
keeps the largest prefix of its selected bases that fits and trains only those for the remaining
epochs (uploading only those); if not even one base fits it stops local training there. Budget
increases are ignored. ``adapts_to = {static, decreasing}`` (DynamicFL paper, Table 2).

Differences from upstream: slim ratios / atom ratio are derived from FLOPs budgets instead of a
width list; local iterations are the client's own epochs (upstream: mean batches × epochs); dual
BN, adversarial training and ``rescale_init``/``rescale_layer`` are not implemented;
``--sort_bases`` is not implemented (tiers take the first bases).

Communication: ``bytes_down`` is the selected bases' state, ``bytes_up`` the trained bases' state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedhetero.core.hetero import budget as budget_mod
from fedhetero.core.exchange.aggregation import weighted_average
from fedhetero.core.method.algorithm import Algorithm
from fedhetero.core.common.options import MethodOptions, option
from fedhetero.core.local.objective import LocalPlan
from fedhetero.core.exchange.types import ClientInfo, ClientResult, ClientTask
from fedhetero.core.hetero.widths import WidthPlanner, narrowest_width_macs

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import ClientContext, Context, RunContext

__all__ = ["BaseEnsemble", "SplitMix", "SplitMixOptions", "ensemble_loss"]


class BaseEnsemble(nn.Module):
    """An ensemble of base networks whose prediction is the mean of their logits.

    With :attr:`stack_outputs` set and in train mode, ``forward`` returns the stacked logits
    ``(n, B, K)`` so that :func:`ensemble_loss` can give every base its own cross-entropy.
    """

    def __init__(self, bases: list[nn.Module], ids: list[int]) -> None:
        super().__init__()
        if not bases or len(bases) != len(ids):
            raise ValueError("BaseEnsemble needs at least one base and one id per base")
        self.bases = nn.ModuleList(bases)
        self.ids = [int(i) for i in ids]
        self.stack_outputs = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = torch.stack([b(x) for b in self.bases])
        if self.training and self.stack_outputs:
            return outs
        return outs.mean(0)


def ensemble_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Sum over bases of each base's cross-entropy (``out`` is ``(n, B, K)``)."""
    if out.dim() == 2:
        return F.cross_entropy(out, y)
    total = F.cross_entropy(out[0], y)
    for o in out[1:]:
        total = total + F.cross_entropy(o, y)
    return total


@dataclass(frozen=True)
class SplitMixOptions(MethodOptions):
    """SplitMix options (defaults: upstream ``fed_splitmix.py``; atom width from the tier budgets)."""

    atom_width: float | None = option(None, gt=0, le=64)  # width of one base (None: the smallest tier's width)
    weighting: Literal["samples", "uniform"] = "samples"


class SplitMix(Algorithm):
    """SplitMix with FLOPs-budgeted numbers of independent base networks."""

    name = "splitmix"
    summary = (
        "The global model is split into independent narrow base networks; each client trains as many bases as"
        " its budget allows and inference averages them."
    )
    paper = "Hong et al., ICLR 2022"
    Options = SplitMixOptions
    adapts_to = frozenset({"static", "decreasing"})
    # the base is sized to the smallest tier, so a budget that falls below one base is the
    # method's ordinary case (the client stops local training, or trains one base over budget)
    trains_below_floor = True

    def min_budget_macs(self, ctx: "RunContext") -> float | None:
        """One base's MACs: at ``atom_width`` when set, else at the narrowest width the atom width
        can take (a tier below it could not train a single base within its budget)."""
        return narrowest_width_macs(ctx, width=self.options.atom_width)

    def setup(self, ctx: "Context") -> None:
        # a tier below one base: one error naming it (instead of the planner's, mid-set-up)
        budget_mod.check_budgets(ctx.cfg, self, ctx)
        planner = WidthPlanner(ctx)
        self.atom_width = float(self.options.atom_width or planner.width_for(ctx.min_budget_macs()))
        self.bases: list[nn.Module] = [ctx.build_model(width=self.atom_width)]
        self.base_macs = ctx.macs(self.bases[0])
        self.tier_bases = {t.name: self.bases_for(t.ratio * ctx.plain_macs, cap=False) for t in ctx.cfg.budget.tiers}
        self.num_bases = max(1, max(self.tier_bases.values()))
        for _ in range(self.num_bases - 1):
            self.bases.append(ctx.build_model(width=self.atom_width))
        self.global_model = BaseEnsemble(self.bases, list(range(self.num_bases)))
        self._queue: list[int] = []
        self._refills = 0

    def bases_for(self, budget_macs: float, cap: bool = True) -> int:
        """``⌊budget / MACs(base)⌋`` (capped at the number of bases when ``cap``)."""
        n = int(np.floor(float(budget_macs) * (1 + 1e-9) / self.base_macs))
        return min(n, self.num_bases) if cap else n

    # ------------------------------------------------------------------ base sampling
    def _next_first(self, ctx: "Context") -> int:
        if not self._queue:
            rng = ctx.rng("algorithm", ctx.round, ctx.cfg.data.num_clients + self._refills)
            self._refills += 1
            self._queue = [int(i) for i in rng.permutation(self.num_bases)]
        return self._queue.pop(0)

    def select_bases(self, ctx: "Context", client: ClientInfo, n: int) -> list[int]:
        """Base ids for ``client``: the cyclic sampler's next base, then ``n−1`` others at random."""
        first = self._next_first(ctx)
        rest = [i for i in range(self.num_bases) if i != first]
        rng = ctx.rng("algorithm", ctx.round, client.cid)
        others = [rest[int(i)] for i in rng.permutation(len(rest))[: max(n - 1, 0)]]
        return [first, *others]

    # ------------------------------------------------------------------ server: client tasks
    def configure(self, ctx: "Context", clients: list[ClientInfo]) -> list[ClientTask]:
        """Per client: its bases (``⌊B / MACs(base)⌋`` of them, at least one, recorded as over
        budget when none fits) and their states; in dynamic scenarios also how many of them fit
        the budget after the change."""
        tasks = []
        for client in clients:
            n = self.bases_for(client.budget_macs)
            ids = self.select_bases(ctx, client, max(n, 1))
            payload: dict[str, Any] = {
                "ids": ids,
                "states": [self.bases[i].state_dict() for i in ids],
                "width": self.atom_width,
                "over_budget": n < 1,
            }
            if client.budget_after_change is not None:
                payload["keep_after_change"] = self.bases_for(client.budget_after_change)
            tasks.append(self.task(ctx, client, payload))
        return tasks

    # ------------------------------------------------------------------ client half
    # Runs on a fresh instance; ``self._client`` is that task's working state.
    def client_model(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None = None) -> nn.Module:
        p = task.payload
        width = float(p["width"])
        bases = []
        for base_state in p["states"]:
            base = ctx.template(("splitmix-base", width), lambda: ctx.build_model(width=width))
            base.load_state_dict(base_state)
            bases.append(base)
        model = BaseEnsemble(bases, [int(i) for i in p["ids"]])
        self._client = {"over_budget": bool(p["over_budget"]), "macs": ctx.macs(model)}
        return model

    def local_train(self, ctx: "ClientContext", client: ClientTask, model: nn.Module, plan: LocalPlan | None) -> dict[str, Any]:
        assert isinstance(model, BaseEnsemble)
        info = self._client
        epochs = ctx.cfg.train.local_epochs
        change_at = 2
        after = client.budget_after_change
        model.stack_outputs = True
        try:
            if after is None or epochs <= change_at or info["macs"] <= after * (1 + 1e-9):
                return ctx.train(model, client, epochs, loss_fn=ensemble_loss)
            res = ctx.train(model, client, change_at, loss_fn=ensemble_loss)
            keep = int(client.payload["keep_after_change"])
            if keep < 1:
                info["stopped_early"] = True
                return res
            if keep < len(model.bases):
                model.bases = nn.ModuleList(list(model.bases)[:keep])
                model.ids = model.ids[:keep]
            info["macs_after_change"] = ctx.macs(model)
            res2 = ctx.train(model, client, epochs - change_at, loss_fn=ensemble_loss, first_epoch=change_at)
            res2["steps"] = int(res.get("steps", 0)) + int(res2.get("steps", 0))
            return res2
        finally:
            model.stack_outputs = False

    def local_plan(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> LocalPlan | None:
        """The configured SGD, which :meth:`local_train` runs on every base, each base a member
        trained on its own cross-entropy (:func:`ensemble_loss`), so a cohort trains each as a
        trainee of its own on the client's batches; None when the budget changes during the
        round (bases are then dropped mid-way: one by one)."""
        if task.budget_after_change is not None:
            return None
        return LocalPlan(ctx.configured_sgd(), members=_bases)

    def upload(
        self, ctx: "ClientContext", client: ClientTask, model: nn.Module, result: dict[str, Any]
    ) -> ClientResult:
        assert isinstance(model, BaseEnsemble)
        info = self._client
        state = {
            f"{gid}.{k}": v.detach().clone()
            for gid, base in zip(model.ids, model.bases)
            for k, v in base.state_dict().items()
        }
        metrics: dict[str, Any] = dict(result)
        metrics["num_bases"] = len(model.ids)
        if info["over_budget"]:
            metrics["over_budget"] = True
        for key in ("macs_after_change", "stopped_early"):
            if key in info:
                metrics[key] = info[key]
        if client.budget_after_change is not None:
            final = info.get("macs_after_change", info["macs"])
            fits = final <= client.budget_after_change * (1 + 1e-9)
            metrics["fits_after_change"] = bool(info.get("stopped_early", False) or fits)
        return ClientResult.of(client, state, macs=info["macs"], payload={"bases": list(model.ids)}, metrics=metrics)

    # ------------------------------------------------------------------ server
    def aggregate(self, ctx: "Context", updates: list[ClientResult]) -> None:
        """Each base: weighted mean over the clients that trained it; untouched bases unchanged."""
        ordered = sorted(updates, key=lambda u: u.cid)
        for gid, base in enumerate(self.bases):
            mine = [u for u in ordered if gid in u.payload["bases"]]
            if not mine:
                continue
            prefix = f"{gid}."
            states = [{k[len(prefix):]: v for k, v in u.state.items() if k.startswith(prefix)} for u in mine]
            if self.options.weighting == "samples":
                weights = [float(u.num_samples) for u in mine]
            else:
                weights = [1.0] * len(mine)
            base.load_state_dict(weighted_average(states, weights))

    # ------------------------------------------------------------------ evaluation & state
    def eval_models(self, ctx: "Context") -> dict[str, nn.Module]:
        assert self.global_model is not None
        out: dict[str, nn.Module] = {"global": self.global_model}
        for tier, n in self.tier_bases.items():
            n = max(1, min(n, self.num_bases))
            out[f"tier:{tier}"] = (
                self.global_model if n == self.num_bases else BaseEnsemble(self.bases[:n], list(range(n)))
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "bases": [b.state_dict() for b in self.bases],
            "queue": torch.as_tensor(self._queue, dtype=torch.long),
            "refills": int(self._refills),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for b, s in zip(self.bases, state["bases"]):
            b.load_state_dict(s)
        self._queue = [int(i) for i in state["queue"].tolist()]
        self._refills = int(state["refills"])


def _bases(model: nn.Module) -> list[nn.Module]:
    """The independent members of a client's ensemble: its bases."""
    assert isinstance(model, BaseEnsemble)
    return list(model.bases)
