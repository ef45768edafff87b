"""The algorithm interface: a server half and a client half.

An algorithm is one module in :mod:`fedhetero.algorithms` that subclasses :class:`Algorithm`.

**Server half** (runs with the engine, sees the server's :class:`~fedhetero.context.Context`):
:meth:`Algorithm.setup` creates the global model and server state; :meth:`Algorithm.configure`
turns the sampled clients into one :class:`ClientTask` each (what the server sends: model state,
budget, hyper-parameters, the per-(round, client) seed); :meth:`Algorithm.aggregate` and
:meth:`Algorithm.server_update` make the new global model from the :class:`ClientResult` list;
:meth:`Algorithm.state_dict` / :meth:`Algorithm.load_state_dict` make it resumable.
:meth:`Algorithm.run_round` is the template (configure → execute → aggregate → server update);
methods with several exchanges per round call :meth:`Context.execute` several times.

**Client half** (:meth:`Algorithm.client_update`) runs from the task, the client's own data and its
own private state only. The engine calls it on a *fresh instance* built from the options (never
set up), in this process, in a worker process or on a Flower node, so it cannot see the server's
objects. What a client keeps between rounds is returned as ``ClientResult.client_state`` and
handed back to it the next time it is sampled (the embedded engines keep it in the on-disk store,
Flower in the node's state).

Every algorithm declares its options as a dataclass (:attr:`Algorithm.Options`); the config's
``algorithm.options`` mapping is validated against it before a run starts, so an unknown or
mistyped option is reported up front with the field name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.context import ClientContext, Context
    from fedhetero.submodel import SubmodelSpec

__all__ = [
    "Algorithm",
    "ClientInfo",
    "ClientResult",
    "ClientTask",
    "ClientUpdate",
    "NoOptions",
    "packed_copy",
    "payload_bytes",
    "state_bytes",
    "WeightedMean",
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
    lr: float | None = None  # local learning rate sent by the server (None: the configured schedule)
    # an exchange that runs before round ``round`` proper (e.g. DynInit's gradient round at a
    # session start): the client state it writes is what the round's own tasks see
    prelude: bool = False


@dataclass
class ClientTask(ClientInfo):
    """One client's unit of work for one round: everything the client half may use besides its
    own data and private state. ``payload`` holds what the server sends (tensors, numbers,
    strings and lists of them: it must survive a trip to another process); ``seed`` is the
    per-(round, client) seed torch's generator is set to before the client runs."""

    seed: int = 0
    payload: dict[str, Any] = field(default_factory=dict)
    step: int = 0  # exchange index inside a round (methods with several exchanges per round)


@dataclass
class ClientResult:
    """What one client returns after its task: the upload and its accounting, plus its new
    private state (``client_state``; None keeps the previous one)."""

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
    client_state: dict[str, Any] | None = None
    timers: dict[str, float] = field(default_factory=dict)


#: The earlier name of :class:`ClientResult`.
ClientUpdate = ClientResult


@dataclass(frozen=True)
class NoOptions:
    """Options of an algorithm that has none."""


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of a state dict as sent over the wire (numel × element size of every tensor)."""
    return int(sum(t.numel() * t.element_size() for t in state.values()))


def packed_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A detached copy of ``state`` whose tensors of each (dtype, device) are consecutive views of
    one new flat buffer, in key order (contiguous layout). One copy per buffer instead of one per
    tensor, and what a flat consumer wants: :class:`WeightedMean` folds such a state without
    gathering it, and the process back end sends each buffer as one piece."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors  # one call each (DDP's)

    groups: dict[tuple[Any, Any], list[str]] = {}
    for key, v in state.items():
        groups.setdefault((v.dtype, v.device), []).append(key)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for keys in groups.values():
            tensors = [state[k] for k in keys]
            flat = _flatten_dense_tensors(tensors)
            if len(tensors) == 1:  # flattening a single tensor returns a view of it, not a copy
                flat = flat.clone()
            out.update(zip(keys, _unflatten_dense_tensors(flat, tensors)))
    return {k: out[k] for k in state}


def _flat_run(state: dict[str, torch.Tensor], keys: list[str]) -> torch.Tensor | None:
    """The tensors of ``keys`` as one flat view when they lie back to back, in this order, in one
    contiguous buffer (as :func:`packed_copy` leaves them); else None."""
    first = state[keys[0]]
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    total = 0
    for key in keys:
        t = state[key]
        if t.data_ptr() != end or not t.is_contiguous() or t.untyped_storage().data_ptr() != storage:
            return None
        end += t.nbytes
        total += t.numel()
    return first.as_strided((total,), (1,), first.storage_offset())


def payload_bytes(payload: Any) -> int:
    """Bytes of every tensor in a (nested) task payload: what the server sent."""
    if isinstance(payload, torch.Tensor):
        return int(payload.numel() * payload.element_size())
    if isinstance(payload, dict):
        return sum(payload_bytes(v) for v in payload.values())
    if isinstance(payload, (list, tuple)):
        return sum(payload_bytes(v) for v in payload)
    return 0


class WeightedMean:
    """A weighted mean of identically shaped state dicts, fed one state at a time, accumulated in
    float64 (one flat vector per dtype and device: the same element-wise sums, in the same order,
    as one accumulation per tensor, in a handful of calls instead of three per tensor).

    The weights are known up front (``weights[i]`` for the ``i``-th state added), so a state can be
    folded in as soon as it arrives; :func:`weighted_average` is this class fed with a list.
    Integer buffers (e.g. BatchNorm's ``num_batches_tracked``) take the value of the first state.
    """

    def __init__(self, weights: list[float]) -> None:
        if not weights:
            raise ValueError("weighted_average needs at least one state")
        self.weights = [float(w) for w in weights]
        self.total = float(sum(self.weights))
        if self.total <= 0:
            raise ValueError("weighted_average: weights must sum to a positive number")
        self.count = 0
        self._ref: dict[str, torch.Tensor] = {}
        self._groups: list[tuple[list[str], torch.Tensor]] = []

    def add(self, state: dict[str, torch.Tensor]) -> None:
        """Fold in the next state (the ``count``-th weight applies)."""
        if self.count >= len(self.weights):
            raise ValueError("weighted_average: one weight per state is required")
        alpha = self.weights[self.count] / self.total
        if self.count == 0:
            self._ref = state
            groups: dict[tuple[Any, Any], list[str]] = {}  # floating keys by (dtype, device)
            for key, v in state.items():
                if torch.is_floating_point(v):
                    groups.setdefault((v.dtype, v.device), []).append(key)
            self._groups = [
                (keys, torch.zeros(sum(state[k].numel() for k in keys), dtype=torch.float64, device=state[keys[0]].device))
                for keys in groups.values()
            ]
        else:
            for keys, _ in self._groups:
                for key in keys:
                    if state[key].shape != self._ref[key].shape:
                        raise ValueError(f"weighted_average: {key!r} has shape {tuple(state[key].shape)} in one "
                                         f"state and {tuple(self._ref[key].shape)} in another")
        for keys, acc in self._groups:
            flat = _flat_run(state, keys)
            if flat is None:
                flat = torch.cat([state[k].reshape(-1) for k in keys])
            acc.add_(flat, alpha=alpha)
        self.count += 1

    def result(self) -> dict[str, torch.Tensor]:
        """The mean, with the first state's keys, shapes and dtypes."""
        if self.count != len(self.weights):
            raise ValueError("weighted_average: one weight per state is required")
        ref = self._ref
        out = {key: v.clone() for key, v in ref.items() if not torch.is_floating_point(v)}
        for keys, acc in self._groups:
            flat = acc.to(ref[keys[0]].dtype)  # one (dtype, device) per group
            start = 0
            for key in keys:
                n = ref[key].numel()
                out[key] = flat[start : start + n].view(ref[key].shape)
                start += n
        return {key: out[key] for key in ref}


def weighted_average(
    states: list[dict[str, torch.Tensor]], weights: list[float]
) -> dict[str, torch.Tensor]:
    """Weighted mean of identically shaped state dicts, accumulated in float64 (see
    :class:`WeightedMean`).

    Integer buffers (e.g. BatchNorm's ``num_batches_tracked``) take the value of the first state.
    """
    if not states:
        raise ValueError("weighted_average needs at least one state")
    if len(states) != len(weights):
        raise ValueError("weighted_average: one weight per state is required")
    mean = WeightedMean(weights)
    for st in states:
        mean.add(st)
    return mean.result()


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
    #: Whether the method trains on a labelled server split (``data.server_fraction``) and on an
    #: unlabelled public split (``data.public_fraction``): "required", "optional" or "unused". The
    #: engine refuses a split the method would not use (it would only withhold data from the
    #: clients) and a missing split the method needs.
    server_data: ClassVar[str] = "unused"
    public_data: ClassVar[str] = "unused"

    def __init__(self, options: Any | None = None) -> None:
        self.options = options if options is not None else self.Options()
        self.global_model: nn.Module | None = None

    # ------------------------------------------------------------------ budgets
    def min_budget_macs(self, ctx: "ClientContext") -> float | None:
        """The smallest budget (forward MACs per sample) a client of this method can train
        within: the MACs of the method's smallest model. None (the default): no floor, the method
        meets any budget or does not follow budgets at all.

        :func:`fedhetero.budget.check_budgets` refuses, before the first round, a tier whose budget
        ``ratio × ctx.plain_macs`` is below it (a ``ConfigError`` naming ``budget.tiers[i].ratio``).
        It may be called before or after :meth:`setup` (with the server's context): it depends on
        the config, the options and the context only, and leaves torch's RNG as it found it."""
        return None

    def min_dynamic_budget_macs(self, ctx: "ClientContext") -> float | None:
        """The smallest budget a client's budget may fall to during a run (scenarios
        ``decreasing`` and ``random``: down to ``budget.min_ratio``) without the method failing;
        None: any. The default is :meth:`min_budget_macs`; a method that handles a budget below its
        smallest model as part of its protocol (stops local training, records the client as over
        budget) returns None."""
        return self.min_budget_macs(ctx)

    # ------------------------------------------------------------------ server half
    def setup(self, ctx: "Context") -> None:
        """Create :attr:`global_model` (and any server state)."""
        self.global_model = ctx.build_model()

    def configure(self, ctx: "Context", clients: list[ClientInfo]) -> list[ClientTask]:
        """One task per sampled client (default: the global model's state for everyone)."""
        assert self.global_model is not None
        state = dict(self.global_model.state_dict())
        return [self.task(ctx, c, {"state": state}) for c in clients]

    @staticmethod
    def task(ctx: "Context", client: ClientInfo, payload: dict[str, Any], step: int = 0) -> ClientTask:
        """A :class:`ClientTask` for ``client`` with the per-(round, client) seed filled in."""
        from fedhetero.context import derive_seed

        fields = {k: getattr(client, k) for k in ClientInfo.__dataclass_fields__}
        return ClientTask(**fields, seed=derive_seed(ctx.cfg.seed, "client", client.round, client.cid), payload=payload, step=step)

    def aggregate(self, ctx: "Context", updates: list[ClientResult]) -> None:
        """New global model (default: sample-weighted mean, or uniform if configured).

        The default's mean may have been accumulated while the round ran (the engine streams the
        uploads, in client-id order, into a :class:`WeightedMean` for an algorithm that keeps this
        method); it is used when it covers exactly these updates with these weights."""
        assert self.global_model is not None
        if not updates:
            return
        weights = ctx.aggregation_weights(updates)
        mean = ctx.streamed_mean(updates, weights)
        if mean is None:
            mean = weighted_average([u.state for u in updates], weights)
        self.global_model.load_state_dict(mean)

    @property
    def streams_uploads(self) -> bool:
        """Whether the engine accumulates this algorithm's uploads while a round runs: it keeps the
        default :meth:`run_round` and :meth:`aggregate`, which consume that mean (an algorithm
        with a round of its own may average differently, or not at all)."""
        cls = type(self)
        return cls.aggregate is Algorithm.aggregate and cls.run_round is Algorithm.run_round

    def server_update(self, ctx: "Context") -> None:
        """Server-side step after aggregation (default: none)."""

    def run_round(self, ctx: "Context", clients: list[ClientInfo]) -> list[ClientResult]:
        """One round: configure the sampled clients, run their tasks on the back end, aggregate
        what came back, then the server update."""
        results = ctx.execute(self, self.configure(ctx, clients))
        self.aggregate(ctx, results)
        self.server_update(ctx)
        return results

    def session_start(self, ctx: "Context", session: int) -> None:
        """Called before the first round of every session (0-based ``session``) when the run has
        sessions (``sessions.count``); the default keeps the global model as it is."""

    def skip_round(self, ctx: "Context", rnd: int) -> bool:
        """True to run no clients in round ``rnd`` (its metrics row says ``skipped``); default
        False."""
        return False

    # ------------------------------------------------------------------ client half
    def client_update(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> ClientResult:
        """The client half: build the model from the task, train it, return the upload.

        Runs on a fresh instance (only :attr:`options` is set) with the client's previous private
        ``state`` (None the first time). The default calls :meth:`client_model`,
        :meth:`local_train` and :meth:`upload`; override it, or those hooks."""
        model = self.client_model(ctx, task, state)
        result = self.local_train(ctx, task, model)
        return self.upload(ctx, task, model, result)

    def client_update_many(
        self, ctx: "ClientContext", tasks: list[ClientTask], states: list[dict[str, Any] | None]
    ) -> list[ClientResult] | None:
        """The client halves of several tasks of one round at once (vectorised, see
        :mod:`fedhetero.cohort`), or None when this algorithm or set-up cannot: the back end then
        runs :meth:`client_update` task by task. The default covers algorithms that keep the
        default client hooks (FedAvg)."""
        cls = type(self)
        hooks = ("client_update", "client_model", "local_train", "upload")
        if any(getattr(cls, h) is not getattr(Algorithm, h) for h in hooks):
            return None
        from fedhetero.cohort import plain_results, train_cohort

        done = train_cohort(self, ctx, tasks)
        return None if done is None else plain_results(ctx, tasks, *done)

    def client_model(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None = None) -> nn.Module:
        """The model this client trains (default: the configured model, at ``payload["width"]``
        when given, loaded with ``task.payload["state"]``)."""
        width = task.payload.get("width")
        model = ctx.reusable(("model", width), lambda: ctx.build_model(width=width))
        model.load_state_dict(task.payload["state"])
        return model

    def local_train(self, ctx: "ClientContext", task: ClientTask, model: nn.Module) -> dict[str, Any]:
        """Local training (default: the configured epochs of SGD through the shared trainer)."""
        return ctx.train(model, task, ctx.cfg.train.local_epochs)

    def upload(self, ctx: "ClientContext", task: ClientTask, model: nn.Module, result: dict[str, Any]) -> ClientResult:
        """What travels to the server (default: a copy of the full state dict, packed into one
        buffer per dtype by :func:`packed_copy`; the default :meth:`client_model` reuses one model
        instance per process)."""
        state = packed_copy(model.state_dict())
        return ClientResult(
            cid=task.cid,
            num_samples=task.num_samples,
            state=state,
            macs=ctx.macs(model),
            budget_macs=task.budget_macs,
            bytes_up=state_bytes(state),
            bytes_down=payload_bytes(task.payload),
            tier=task.tier,
            metrics=dict(result),
        )

    def round_metrics(self, ctx: "Context") -> dict[str, Any]:
        """Extra JSON-able fields for this round's row of ``metrics.jsonl`` (default: none), read
        after the round's aggregation and server update."""
        return {}

    def summary_metrics(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """Extra JSON-able fields for ``summary.json`` computed from the rows of every round
        (default: none)."""
        return {}

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
