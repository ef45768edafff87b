"""The method interface: a server half and a client half.

A method subclasses :class:`Algorithm`. The defaults are FedAvg on the global model, so a method
overrides only what differs. The hooks, by how often a method needs them:

* **Declarations** (class attributes): :attr:`~Algorithm.name`, :attr:`~Algorithm.Options` (a frozen
  dataclass, validated against the config's ``algorithm.options`` before a run starts),
  :attr:`~Algorithm.state_fields` (the server state a checkpoint keeps), :attr:`~Algorithm.adapts_to`
  (budget scenarios), :attr:`~Algorithm.server_data` / :attr:`~Algorithm.public_data` (the splits it
  trains on), :attr:`~Algorithm.supports_submodels`.
* **Server half** (sees the server's :class:`~fedhetero.core.context.Context`): :meth:`setup` (the
  global model and server state), :meth:`configure` (one :class:`ClientTask` per sampled client:
  what the server sends), :meth:`aggregate` (the new global model from the
  :class:`ClientResult` list). Optional: :meth:`server_update`; :meth:`run_round` for several
  exchanges per round (each one :meth:`Context.execute`); :meth:`session_start` /
  :meth:`skip_round` under device sessions; :meth:`round_metrics` / :meth:`summary_metrics` /
  :meth:`eval_models` for what it reports; :meth:`min_budget_macs` for the smallest budget it
  can train within (and :attr:`~Algorithm.trains_below_floor` when budgets that fall below it
  are part of its protocol).
* **Client half**: :meth:`client_update` runs from the task, the client's own data and its own
  private state only, on a *fresh instance* built from the options (never set up), in this
  process, in a worker process or on a Flower node, so it cannot see the server's objects. The
  default is :meth:`client_model` → local training → :meth:`upload`. A method that adds a
  gradient or loss term to local SGD returns it from :meth:`local_objective`, written once for one
  model and for a round's clients trained together (:mod:`fedhetero.core.objective`); a method
  that trains differently overrides :meth:`local_train` (or :meth:`client_update`). What a client
  keeps between rounds is returned as ``ClientResult.client_state`` and handed back the next time
  it is sampled (the embedded back ends keep it in the on-disk store, Flower in the node's state);
  per-task values live in the objective or in locals, never on ``self``.

:meth:`ClientResult.of <fedhetero.core.types.ClientResult.of>` fills in a result's accounting, and
:meth:`Algorithm.state_dict` / :meth:`Algorithm.load_state_dict` derive resume state from
:attr:`~Algorithm.state_fields`.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from fedhetero.core.aggregation import weighted_average
from fedhetero.core.cohort import client_bytes, client_steps, plan_cohorts, structure_key, train_cohort
from fedhetero.core.context import ClientContext, Context, RunContext
from fedhetero.core.objective import LocalObjective, LocalPhase, LocalSGD, rules_key
from fedhetero.core.types import (
    ClientInfo,
    ClientResult,
    ClientTask,
    NoOptions,
    derive_seed,
    merge_optimizer_state,
    packed_copy,
    payload_bytes,
    state_bytes,
)

__all__ = [
    "AUTO_MIN_STEPS",
    "Algorithm",
]

#: ``engine.vectorize: null`` on a CPU batches clients of at least this many local steps: a cohort's
#: set-up (each client's model, state and upload, the stacked model's load) is repaid over its steps,
#: and clients of a few steps (digits' Dirichlet splits, 6 steps a round) trained slower batched
AUTO_MIN_STEPS = 10


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

        :func:`fedhetero.core.budget.check_budgets` refuses, before the first round, a tier whose budget
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
        :meth:`local_train` with the :meth:`local_objective` and :meth:`upload`, then the
        objective's ``finish``; override it, or those hooks."""
        model = self.client_model(ctx, task, state)
        objective = self.local_objective(ctx, task, state)
        if objective is None:
            report = self.local_train(ctx, task, model)
        elif type(self).local_train is Algorithm.local_train:
            report = ctx.train(model, task, ctx.cfg.train.local_epochs, objective=objective)
        else:
            raise TypeError(f"{type(self).__name__} overrides both local_train and local_objective; "
                            "a local_train of its own applies its terms itself")
        result = self.upload(ctx, task, model, report)
        if objective is not None and objective.finish is not None:
            objective.finish(result)
        return result

    def local_objective(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> LocalObjective | None:
        """What this client's local training adds to plain cross-entropy SGD (default: nothing):
        a gradient or loss term written once for one model and for a cohort of clients trained
        together, plus what to do with the result (:mod:`fedhetero.core.objective`)."""
        return None

    def client_update_many(
        self, ctx: "ClientContext", tasks: list[ClientTask], states: list[dict[str, Any] | None],
        optimizer_states: list[dict[str, Any] | None] | None = None,
    ) -> list[ClientResult | None]:
        """Not a hook: the client halves of several tasks of one exchange, trained in batched
        cohorts (:mod:`fedhetero.core.cohort`) where they can be, with the same numbers as
        :meth:`client_update` up to the order of floating-point sums. Returns one entry per task:
        its result, or None for a task the back end then runs one by one.

        A task can join a cohort when the method keeps the default client half
        (:meth:`default_client_half`) and its local training is plain SGD
        (:meth:`local_optimizer`); a model made of independent members (:meth:`local_members`)
        joins as one trainee per member, and a phase of SGD before the local training
        (:meth:`local_prelude`) runs in the cohort first. Trainees are grouped by their model's structure (so
        width methods group by width), SGD settings and objective rules, then by their number of
        steps (:func:`~fedhetero.core.cohort.plan_cohorts`), cohorts capped by
        ``engine.cohort_memory_mb``; :meth:`client_model` and :meth:`upload` run per task as
        they do one by one, and a task any of whose members found no cohort runs one by one.
        ``optimizer_states``: each client's kept momentum buffers."""
        out: list[ClientResult | None] = [None] * len(tasks)
        if not self.default_client_half() or len(tasks) < 2:
            return out
        e = ctx.cfg.engine
        auto_cpu = e.vectorize is None and ctx.device.type == "cpu"
        smallest = e.min_cohort if auto_cpu else 2
        steps_of = [client_steps(ctx, t.cid) for t in tasks]
        if auto_cpu:  # a cohort's own cost is repaid over a client's steps: short clients one by one
            steps_of = [n if n >= AUTO_MIN_STEPS else 0 for n in steps_of]
        if sum(n > 0 for n in steps_of) < smallest:
            return out
        kept_in = optimizer_states or [None] * len(tasks)
        groups: dict[Any, list[_Trainee]] = {}
        parts: dict[int, tuple[int, LocalSGD, LocalObjective | None]] = {}
        for i, (task, state) in enumerate(zip(tasks, states)):
            if steps_of[i] == 0:
                continue
            with ctx.client_scope(task):
                model = self.client_model(ctx, task, state)
                sgd = self.local_optimizer(ctx, task)
                if sgd is None:
                    continue
                objective = self.local_objective(ctx, task, state)
                members = self.local_members(ctx, task, model) or [model]
                if not _members_batch(model, members, sgd, objective):
                    continue
                schedule = self.local_schedule(ctx, task)
                if schedule is not None:
                    if not schedule:
                        continue
                    steps_of[i] = len(schedule)
                    if auto_cpu and steps_of[i] < AUTO_MIN_STEPS:
                        continue
                start = self.local_momentum(ctx, task) if sgd.carried else kept_in[i]
                if sgd.carried and start is None and sgd.persistent:
                    start = kept_in[i]  # no buffers handed over: the client's kept ones
                masks = self.local_masks(ctx, task) if sgd.masked else None
                prelude = self.local_prelude(ctx, task, model)
                if prelude is not None and (len(members) > 1 or _has_dropout(model)):
                    continue  # one mask stream runs through both phases: one by one
                parts[i] = (len(members), sgd, objective)
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
            for plan in plan_cohorts([steps_of[m.task] for m in members_of_key], min_size=smallest, max_size=cap):
                chosen = [members_of_key[k] for k in plan]
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
        for i, (n, sgd, objective) in parts.items():
            if not all((i, k) in trained for k in range(n)):
                continue  # a member found no cohort: the whole task runs one by one
            task = tasks[i]
            with ctx.client_scope(task):
                model = self.client_model(ctx, task, states[i])
                members = self.local_members(ctx, task, model) or [model]
                for k, member in enumerate(members):
                    member.load_state_dict(trained[(i, k)][0])
                report = _joint_report([trained[(i, k)][1] for k in range(n)])
                buffers = trained[(i, 0)][2]
                if sgd.carried:
                    report["momentum"] = buffers
                result = self.upload(ctx, task, model, report)
                if objective is not None and objective.finish is not None:
                    objective.finish(result)
            kept = None
            if ctx.cfg.train.optimizer_state == "persistent" and (not sgd.carried or sgd.persistent):
                kept = buffers if buffers is not None and sgd.keep else kept_in[i]
            result.client_state = merge_optimizer_state(result.client_state, states[i], kept)
            out[i] = result
        return out

    def local_optimizer(self, ctx: "ClientContext", task: ClientTask) -> LocalSGD | None:
        """The plain SGD this method's :meth:`local_train` runs for ``task``, or None when it
        trains otherwise; called in the task's client scope, right after :meth:`client_model`
        built the task's model. A cohort of clients
        (:meth:`client_update_many`) runs what it returns in place of :meth:`local_train`, so a
        method that overrides :meth:`local_train` with plain SGD at other settings (another
        learning rate, no momentum) says so here, and stays exact (the tests compare both
        paths). Default: the configured local SGD (:meth:`ClientContext.configured_sgd`) when
        :meth:`local_train` is not overridden, else None."""
        if type(self).local_train is not Algorithm.local_train:
            return None
        return ctx.configured_sgd()

    def local_members(self, ctx: "ClientContext", task: ClientTask, model: nn.Module) -> list[nn.Module] | None:
        """The independent members of ``model`` that local training trains, or None (default):
        the model is one. A method whose model is an ensemble of members that never meet in
        training — the loss is the sum of each member's own cross-entropy on the client's batch,
        as SplitMix's bases — returns them, so that a cohort trains every member as a trainee of
        its own on that client's batches. Such a task batches only without gradient clipping
        (its norm spans the members), dropout (one stream feeds the members in turn), kept or
        carried momentum and a local objective; it runs one by one otherwise."""
        return None

    def local_masks(self, ctx: "ClientContext", task: ClientTask) -> dict[str, torch.Tensor] | None:
        """The masks (by parameter name) that ``task``'s parameters are multiplied by before and
        after every local step, when :meth:`local_optimizer` says ``masked`` (IMC's pruning
        masks). Default: None."""
        return None

    def local_schedule(self, ctx: "ClientContext", task: ClientTask) -> list[torch.Tensor] | None:
        """The batches of ``task``'s local training, as rows of the training set in the order it
        takes them, when they are not its own data's epochs (Data-sharing adds the server's
        shared samples); the loss it reports is that of the steps the shared trainer reports (its
        last epoch; with ``train.local_steps``, the last ``1/train.local_epochs`` of them).
        Default: None."""
        return None

    def local_prelude(self, ctx: "ClientContext", task: ClientTask, model: nn.Module) -> LocalPhase | None:
        """The phase of plain SGD on other inputs, towards soft targets, that ``task``'s local
        training runs before its own (DS-FL's distillation on open data), as a
        :class:`~fedhetero.core.objective.LocalPhase`, so that a cohort runs it too; called
        after :meth:`local_optimizer` said how the local training itself goes. Default: None."""
        return None

    def local_momentum(self, ctx: "ClientContext", task: ClientTask) -> dict[str, torch.Tensor] | None:
        """The momentum buffers (by parameter name) the local SGD of ``task`` starts from, when
        :meth:`local_optimizer` says ``carried`` (FedDA's transmitted momentum); a cohort then
        returns the trained buffers in the report's ``momentum``, as the method's own local
        training does. Default: None."""
        return None

    def default_client_half(self) -> bool:
        """Whether the client half is the default :meth:`client_update` (through
        :meth:`client_model`, local training and :meth:`upload`), whose training a cohort can
        replace; a method that hands its client half to another (DynInit's host) says so."""
        return type(self).client_update is Algorithm.client_update

    def client_model(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None = None) -> nn.Module:
        """The model this client trains (default: the configured model, at ``payload["width"]``
        when given, loaded with ``task.payload["state"]``)."""
        width = task.payload.get("width")
        model = ctx.reusable(("model", width), lambda: ctx.build_model(width=width))
        model.load_state_dict(task.payload["state"])
        return model

    def local_train(self, ctx: "ClientContext", task: ClientTask, model: nn.Module) -> dict[str, Any]:
        """Local training (default: the configured epochs of SGD through the shared trainer). A
        method that only adds a gradient or loss term returns it from :meth:`local_objective`
        instead, which also serves a cohort of clients trained together."""
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
        """Everything needed to resume: the :attr:`state_fields` (tensors and JSON-able values)."""
        return {name: _save(getattr(self, name)) for name in self.state_fields}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the :attr:`state_fields` saved by :meth:`state_dict`."""
        for name in self.state_fields:
            setattr(self, name, _load(getattr(self, name, None), state[name]))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the :attr:`state_fields`, by dotted name, walked as :func:`_save`
        walks them but without copies (the engine checks them for finiteness every round)."""
        out: dict[str, torch.Tensor] = {}
        for name in self.state_fields:
            _tensors(name, getattr(self, name, None), out)
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


class _Trainee(NamedTuple):
    """One model a cohort trains: a task's model, or one member of it (:meth:`Algorithm.local_members`)."""

    task: int  # index into the exchange's tasks
    member: int
    model: nn.Module
    initial: dict[str, torch.Tensor]
    sgd: LocalSGD
    objective: LocalObjective | None
    momentum: Any  # buffers it starts from (kept or carried), or None
    schedule: list[torch.Tensor] | None  # its batches when the method states them
    masks: dict[str, torch.Tensor] | None
    prelude: LocalPhase | None  # the phase its local training runs first


def _has_dropout(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules())


def _members_batch(model: nn.Module, members: list[nn.Module], sgd: LocalSGD, objective: LocalObjective | None) -> bool:
    """Whether a task whose model trains as ``members`` (:meth:`Algorithm.local_members`) can
    join cohorts with the same numbers as its one-by-one run."""
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

