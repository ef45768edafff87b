"""The method interface: a server half and a client half.

A method subclasses :class:`Algorithm`. The defaults are FedAvg on the global model, so a method
overrides only what differs. The hooks, by how often a method needs them:

* **Declarations** (class attributes): :attr:`~Algorithm.name`, :attr:`~Algorithm.Options` (a frozen
  dataclass, validated against the config's ``algorithm.options`` before a run starts),
  :attr:`~Algorithm.state_fields` (the server state a checkpoint keeps), :attr:`~Algorithm.adapts_to`
  (budget scenarios), :attr:`~Algorithm.server_data` / :attr:`~Algorithm.public_data` (the splits it
  trains on), :attr:`~Algorithm.supports_submodels`.
* **Server half** (sees the server's :class:`~fedhetero.core.local.context.Context`): :meth:`setup` (the
  global model and server state), :meth:`configure` (one :class:`ClientTask` per sampled client:
  what the server sends), :meth:`aggregate` (the new global model from the
  :class:`ClientResult` list). Optional: :meth:`server_update`; :meth:`run_round` for several
  exchanges per round (a round is data: it yields each exchange's tasks, the engine runs them);
  :meth:`session_start` /
  :meth:`skip_round` under device sessions; :meth:`round_metrics` / :meth:`summary_metrics` /
  :meth:`eval_models` for what it reports; :meth:`min_budget_macs` for the smallest budget it
  can train within (and :attr:`~Algorithm.trains_below_floor` when budgets that fall below it
  are part of its protocol).
* **Client half**: :meth:`client_update` runs from the task, the client's own data and its own
  private state only, on a *fresh instance* built from the options (never set up), in this
  process, in a worker process or on a Flower node, so it cannot see the server's objects. The
  default is :meth:`local_plan` → :meth:`client_model` → :meth:`local_train` → :meth:`upload`.
  Local training is a value: :meth:`local_plan` returns a
  :class:`~fedhetero.core.local.objective.LocalPlan` (the SGD, and a gradient or loss term, members,
  masks, batches, a phase before it or the momentum it starts from), which one client trains
  alone and a round's clients train together in batched cohorts
  (:mod:`fedhetero.core.local.runner`). A method that trains in a way no plan states overrides
  :meth:`local_train` (or :meth:`client_update`) and returns None from :meth:`local_plan`. What a client
  keeps between rounds is returned as ``ClientResult.client_state`` and handed back the next time
  it is sampled (the embedded back ends keep it in the on-disk store, Flower in the node's state);
  per-task values live in the objective or in locals, never on ``self``.

:meth:`ClientResult.of <fedhetero.core.exchange.types.ClientResult.of>` fills in a result's accounting, and
:meth:`Algorithm.state_dict` / :meth:`Algorithm.load_state_dict` derive resume state from
:attr:`~Algorithm.state_fields`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Generator

import torch
from torch import nn

from fedhetero.core.exchange.aggregation import streamed_mean, weighted_average
from fedhetero.core.local.objective import LocalPlan
from fedhetero.core.local.segments import Segments
from fedhetero.core.exchange.types import (
    ClientInfo,
    ClientResult,
    ClientTask,
    NoOptions,
    derive_seed,
    packed_copy,
    payload_bytes,
    state_bytes,
)

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import ClientContext, Context, RunContext

__all__ = [
    "Algorithm",
    "Exchanges",
    "state_tensors",
]

#: A round (or a session's start) as data: the generator yields each exchange's tasks, the engine
#: runs them on the back end and sends back the results of the clients that succeeded (sorted by
#: client id); what it returns is the round's results.
Exchanges = Generator[list[ClientTask], list[ClientResult], list[ClientResult]]


class Algorithm:
    """Base class of every federated algorithm.

    Subclasses set :attr:`name`, optionally :attr:`Options` (a dataclass) and :attr:`adapts_to`
    (the dynamic budget scenarios the method can follow; the comparison reports N/A for the
    others), and override the hooks they need. The defaults implement FedAvg on the global model.
    """

    name: ClassVar[str] = "base"
    #: What the method does, one sentence ending in a full stop (``fedhetero info`` prints it).
    summary: ClassVar[str] = ""
    #: The paper it comes from: authors, venue and year (``fedhetero info`` prints it).
    paper: ClassVar[str] = ""
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
    #: The server state a checkpoint keeps, by attribute name: :meth:`state_dict` saves each
    #: (a module as its state dict, a dict of modules or tensors entry by entry, a tensor or a
    #: JSON-able value as it is) and :meth:`load_state_dict` restores it in place.
    state_fields: ClassVar[tuple[str, ...]] = ("global_model",)
    #: whether a budget that falls during a run below :meth:`min_budget_macs` is part of the
    #: method's protocol (it stops local training, records the client as over budget) rather than
    #: a configuration it cannot run
    trains_below_floor: ClassVar[bool] = False
    #: what to try when the method's training diverges (the engine's message names it), beside
    #: a smaller ``train.lr``; e.g. a method's own safeguards
    divergence_hint: ClassVar[str] = ""

    def __init__(self, options: Any | None = None) -> None:
        self.options = options if options is not None else self.Options()
        self.global_model: nn.Module | None = None

    # ------------------------------------------------------------------ budgets
    def min_budget_macs(self, ctx: "RunContext") -> float | None:
        """The smallest budget (forward MACs per sample) a client of this method can train
        within: the MACs of the method's smallest model. None (the default): no floor, the method
        meets any budget or does not follow budgets at all.

        :func:`fedhetero.core.hetero.budget.check_budgets` refuses, before the first round, a tier whose budget
        ``ratio × ctx.plain_macs`` is below it (a ``ConfigError`` naming ``budget.tiers[i].ratio``).
        It may be called before or after :meth:`setup` (with the server's context): it depends on
        the config, the options and the context only, and leaves torch's RNG as it found it."""
        return None

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
        fields = {k: getattr(client, k) for k in ClientInfo.__dataclass_fields__}
        return ClientTask(**fields, seed=derive_seed(ctx.cfg.seed, "client", client.round, client.cid), payload=payload, step=step)

    def aggregate(self, ctx: "Context", updates: list[ClientResult]) -> None:
        """New global model (default: sample-weighted mean, or uniform if configured).

        The mean may have been accumulated while the exchange ran (the engine folds every
        exchange's uploads, in client-id order, into a :class:`WeightedMean` as they arrive); it is
        used when ``updates`` are that exchange's results with these weights, bit for bit what
        :func:`weighted_average` gives."""
        assert self.global_model is not None
        if not updates:
            return
        weights = ctx.aggregation_weights(updates)
        mean = streamed_mean(updates, weights)
        if mean is None:
            mean = weighted_average([u.state for u in updates], weights)
        self.global_model.load_state_dict(mean)

    def server_update(self, ctx: "Context") -> None:
        """Server-side step after aggregation (default: none)."""

    def run_round(self, ctx: "Context", clients: list[ClientInfo]) -> Exchanges:
        """One round, as data (:data:`Exchanges`): yield each exchange's tasks and receive the
        results of the clients that succeeded; the engine runs the exchanges on the back end.
        Default: one exchange of :meth:`configure`'s tasks, then :meth:`aggregate` and
        :meth:`server_update`. A method with several exchanges per round yields several (give
        each its own ``step`` in :meth:`task`), or a helper's with ``yield from``."""
        results = yield self.configure(ctx, clients)
        self.aggregate(ctx, results)
        self.server_update(ctx)
        return results

    def session_start(self, ctx: "Context", session: int) -> Exchanges | None:
        """Called before the first round of every session (0-based ``session``) when the run has
        sessions (``sessions.count``); the default keeps the global model as it is. A method that
        runs exchanges there (DynInit's gradient rounds) returns them as :meth:`run_round` does."""
        return None

    def skip_round(self, ctx: "Context", rnd: int) -> bool:
        """True to run no clients in round ``rnd`` (its metrics row says ``skipped``); default
        False."""
        return False

    # ------------------------------------------------------------------ client half
    def client_update(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> ClientResult:
        """The client half: build the model from the task, train it, return the upload.

        Runs on a fresh instance (only :attr:`options` is set) with the client's previous private
        ``state`` (None the first time). The default calls :meth:`local_plan`,
        :meth:`client_model`, :meth:`local_train` with that plan and :meth:`upload`, then the
        plan's objective's ``finish``; a round's clients trained together in batched cohorts
        (:func:`fedhetero.core.local.runner.train_cohorts`) go through the same hooks with the plan
        trained by the cohort instead of :meth:`local_train`. A method that overrides this hook
        runs its whole client half itself, so its :meth:`local_plan` returns None."""
        plan = self.local_plan(ctx, task, state)
        model = self.client_model(ctx, task, state)
        report = self.local_train(ctx, task, model, plan)
        result = self.upload(ctx, task, model, report)
        objective = None if plan is None else plan.objective
        if objective is not None and objective.finish is not None:
            objective.finish(result)
        return result

    def local_segments(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> Segments | None:
        """This client's whole client half as segments of local training, for a method whose
        model changes between epochs of one local round (so that no :meth:`local_plan` states
        it): a generator that builds the model, yields each
        :class:`~fedhetero.core.local.segments.LocalSegment` (epochs on a model with its
        optimizer), receives what training it reported, does what comes between segments and
        returns the upload, as :meth:`client_update` would. Clients advanced together
        (:func:`~fedhetero.core.local.segments.train_segments`) train coinciding segments — the
        same structure, the same epochs — as one batched cohort, with the same numbers up to the
        order of floating-point sums. Such a method's :meth:`client_update` runs the same
        generator alone (:func:`~fedhetero.core.local.segments.run_segments`). Default None: the
        method's clients train as :meth:`client_update` and :meth:`local_plan` say."""
        return None

    def local_plan(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> LocalPlan | None:
        """What this client's local training is, as a value (:class:`~fedhetero.core.local.objective.LocalPlan`):
        the plain SGD it runs and what it adds to it — an objective (a gradient or loss term
        written once for one model and for a cohort), independent members, masks, the batches,
        a phase before it, the momentum it starts from. It is decided from the task and the
        client's state, before :meth:`client_model` builds the model (a part that depends on
        the model, such as its members, is a function of it), in the task's client scope, so
        that a client that trains itself costs nothing more. :meth:`local_train` trains the plan alone; a
        batched cohort trains it with other clients' plans, with the same numbers up to the
        order of floating-point sums (the tests compare both paths for every built-in method).
        None: the method trains in a way no plan states (its own :meth:`local_train` or
        :meth:`client_update`), and its clients train one by one. Default: the configured local
        SGD (:meth:`ClientContext.configured_sgd`), nothing added."""
        return LocalPlan(ctx.configured_sgd())

    def client_model(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None = None) -> nn.Module:
        """The model this client trains (default: the configured model, at ``payload["width"]``
        when given, loaded with ``task.payload["state"]``)."""
        width = task.payload.get("width")
        model = ctx.reusable(("model", width), lambda: ctx.build_model(width=width))
        model.load_state_dict(task.payload["state"])
        return model

    def local_train(self, ctx: "ClientContext", task: ClientTask, model: nn.Module, plan: LocalPlan | None) -> dict[str, Any]:
        """One client's local training, alone (default: the configured epochs of SGD through the
        shared trainer, with the plan's objective). A method whose training differs states it in
        :meth:`local_plan` so that a cohort trains it too, and overrides this hook only where
        one client's training is written otherwise (its own optimiser, a budget that changes
        mid-round); its plan, when it has one, must train the same."""
        objective = None if plan is None else plan.objective
        if objective is None:
            return ctx.train(model, task, ctx.cfg.train.local_epochs)
        return ctx.train(model, task, ctx.cfg.train.local_epochs, objective=objective)

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
        """Everything needed to resume: the :attr:`state_fields` (tensors and JSON-able values)."""
        return {name: _save(getattr(self, name)) for name in self.state_fields}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the :attr:`state_fields` saved by :meth:`state_dict`."""
        for name in self.state_fields:
            setattr(self, name, _load(getattr(self, name, None), state[name]))


def state_tensors(algorithm: Algorithm) -> dict[str, torch.Tensor]:
    """Every tensor of ``algorithm``'s :attr:`~Algorithm.state_fields`, by dotted name, walked as
    :meth:`Algorithm.state_dict` walks them but without copies (the engine checks them for
    finiteness every round)."""
    out: dict[str, torch.Tensor] = {}
    for name in algorithm.state_fields:
        _tensors(name, getattr(algorithm, name, None), out)
    return out


def _save(value: Any) -> Any:
    """A checkpointable copy of one server-state field."""
    if isinstance(value, nn.Module):
        return value.state_dict()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _save(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_save(v) for v in value)
    return value


def _tensors(name: str, value: Any, out: dict[str, torch.Tensor]) -> None:
    """The tensors :func:`_save` would copy from ``value``, by reference, into ``out``."""
    if isinstance(value, nn.Module):
        out.update((f"{name}.{k}", t) for k, t in value.state_dict().items())
    elif isinstance(value, torch.Tensor):
        out[name] = value
    elif isinstance(value, dict):
        for k, v in value.items():
            _tensors(f"{name}.{k}", v, out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _tensors(f"{name}.{i}", v, out)


def _load(current: Any, saved: Any) -> Any:
    """``saved`` restored into the field's ``current`` value: modules load in place (so the
    objects other code holds stay valid), tensors and plain values are replaced."""
    if isinstance(current, nn.Module):
        current.load_state_dict(saved)
        return current
    if isinstance(current, dict) and isinstance(saved, dict) and any(isinstance(v, nn.Module) for v in current.values()):
        for k, v in saved.items():
            current[k] = _load(current.get(k), v)
        return current
    if isinstance(saved, torch.Tensor):
        return saved.detach().clone()
    if isinstance(saved, dict):
        return {k: _load(None, v) for k, v in saved.items()}
    return saved
