"""The algorithm interface.

An algorithm is one module in :mod:`fedhetero.algorithms` that subclasses :class:`Algorithm`. The
engine owns sampling, data, budgets, evaluation, metrics and checkpoints; the algorithm owns only
what differs between methods. :meth:`Algorithm.run_round` is the template the engine calls once per
round; methods with several exchanges per round override it.

Every algorithm declares its options as a dataclass (:attr:`Algorithm.Options`); the config's
``algorithm.options`` mapping is validated against it before a run starts, so an unknown or
mistyped option is reported up front with the field name.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.engine import Context
    from fedhetero.submodel import SubmodelSpec

__all__ = [
    "Algorithm",
    "ClientInfo",
    "ClientUpdate",
    "NoOptions",
    "state_bytes",
    "weighted_average",
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


@dataclass
class ClientUpdate:
    """What one client sends to the server after local training."""

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


@dataclass(frozen=True)
class NoOptions:
    """Options of an algorithm that has none."""


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of a state dict as sent over the wire (numel × element size of every tensor)."""
    return int(sum(t.numel() * t.element_size() for t in state.values()))


def weighted_average(
    states: list[dict[str, torch.Tensor]], weights: list[float]
) -> dict[str, torch.Tensor]:
    """Weighted mean of identically shaped state dicts, accumulated in float64.

    Integer buffers (e.g. BatchNorm's ``num_batches_tracked``) take the value of the first state.
    """
    if not states:
        raise ValueError("weighted_average needs at least one state")
    if len(states) != len(weights):
        raise ValueError("weighted_average: one weight per state is required")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weighted_average: weights must sum to a positive number")
    out: dict[str, torch.Tensor] = {}
    for key, ref in states[0].items():
        if not torch.is_floating_point(ref):
            out[key] = ref.clone()
            continue
        acc = torch.zeros_like(ref, dtype=torch.float64)
        for st, w in zip(states, weights):
            acc.add_(st[key].to(torch.float64), alpha=float(w) / total)
        out[key] = acc.to(ref.dtype)
    return out


class Algorithm:
    """Base class of every federated algorithm.

    Subclasses set :attr:`name`, optionally :attr:`Options` (a dataclass) and :attr:`adapts_to`
    (the dynamic budget scenarios the method can follow; the comparison reports N/A for the
    others), and override the hooks they need. The defaults implement FedAvg on the global model.
    """

    name: ClassVar[str] = "base"
    Options: ClassVar[type] = NoOptions
    adapts_to: ClassVar[frozenset[str]] = frozenset({"static"})
    #: True when clients with budgets below the plain model get a pruned sub-model.
    supports_submodels: ClassVar[bool] = False

    def __init__(self, options: Any | None = None) -> None:
        self.options = options if options is not None else self.Options()
        self.global_model: nn.Module | None = None

    # ------------------------------------------------------------------ hooks
    def setup(self, ctx: "Context") -> None:
        """Create :attr:`global_model` (and any server state)."""
        self.global_model = ctx.build_model()

    def client_model(self, ctx: "Context", client: ClientInfo) -> nn.Module:
        """The model this client trains this round (default: a copy of the global model)."""
        assert self.global_model is not None
        return copy.deepcopy(self.global_model)

    def local_train(self, ctx: "Context", client: ClientInfo, model: nn.Module) -> dict[str, Any]:
        """Local training (default: the configured epochs of SGD through the shared trainer)."""
        return ctx.train(model, client, ctx.cfg.train.local_epochs)

    def upload(
        self, ctx: "Context", client: ClientInfo, model: nn.Module, result: dict[str, Any]
    ) -> ClientUpdate:
        """What travels to the server (default: the full state dict; the client's model is not used
        after its upload, so its tensors are sent without copying)."""
        state = dict(model.state_dict())
        return ClientUpdate(
            cid=client.cid,
            num_samples=client.num_samples,
            state=state,
            macs=ctx.macs(model),
            budget_macs=client.budget_macs,
            bytes_up=state_bytes(state),
            bytes_down=state_bytes(self.global_model.state_dict()) if self.global_model else 0,
            tier=client.tier,
            metrics=dict(result),
        )

    def aggregate(self, ctx: "Context", updates: list[ClientUpdate]) -> None:
        """New global model (default: sample-weighted mean, or uniform if configured)."""
        assert self.global_model is not None
        if not updates:
            return
        weights = ctx.aggregation_weights(updates)
        self.global_model.load_state_dict(weighted_average([u.state for u in updates], weights))

    def server_update(self, ctx: "Context") -> None:
        """Server-side step after aggregation (default: none)."""

    def run_round(self, ctx: "Context", clients: list[ClientInfo]) -> list[ClientUpdate]:
        """One round: every sampled client trains and uploads, then aggregate and server update."""
        updates: list[ClientUpdate] = []
        for client in clients:
            with ctx.client_scope(client):
                model = self.client_model(ctx, client)
                result = self.local_train(ctx, client, model)
                updates.append(self.upload(ctx, client, model, result))
        self.aggregate(ctx, updates)
        self.server_update(ctx)
        return updates

    def eval_models(self, ctx: "Context") -> dict[str, nn.Module]:
        """Models to evaluate: ``"global"`` plus optional ``"tier:<name>"`` entries.

        A tier without its own entry deploys the global model (the DynamicFL protocol).
        """
        assert self.global_model is not None
        return {"global": self.global_model}

    # ------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (tensors and JSON-able values only)."""
        assert self.global_model is not None
        return {"global_model": self.global_model.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.global_model is not None
        self.global_model.load_state_dict(state["global_model"])
