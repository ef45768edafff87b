"""A method's local objective: what it adds to plain local SGD, written once.

Most methods change local training in one of two ways: a term added to every step's gradient
(FedProx's proximal pull, SCAFFOLD's control variates, FedDyn's linear and proximal terms,
FedACG's regulariser) or a term added to the loss that compares the model's outputs with those
of frozen reference models (MOON's contrastive loss, DynInit's distillation from a teacher). A
method states that term once, as the :class:`LocalObjective` of the :class:`LocalPlan` its
``local_plan`` hook returns, and the framework applies it to one model (:meth:`~fedhetero.core.local.context.ClientContext.train`)
or to a round's clients trained together (:class:`~fedhetero.core.local.cohort.Cohort`).

The rules are written for one client and must use elementwise operations only (and reductions
over the last axis): in a cohort every tensor they see carries a leading client axis. A rule
reads per-client values only through :attr:`LocalObjective.consts` (the framework stacks them
across a cohort), never through its closure, which may hold only the method's options:

* ``grad(params, grads, c)`` adds to ``grads`` in place (``params`` and ``grads`` by parameter
  name, ``c`` the objective's constants moved to the parameters' device and dtype); it runs after
  every backward, without autograd, before clipping and the optimiser step;
* ``loss(batch)`` returns the term added to the mean cross-entropy of the step, reducing over the
  batch with :meth:`Batch.mean`; ``batch.out`` is the model's output (or its penultimate features
  with ``representation="features"``) and :meth:`Batch.ref` the same for a reference model. A
  rule that draws random numbers per client or runs the client's own layers on other inputs
  (FedGen's generated features through the client's classifier) does so through
  :meth:`Batch.each` (per-client values of :attr:`LocalObjective.own`, such as each client's random
  generator, stacked across a cohort), :meth:`Batch.linear` (the client's own linear layer) and
  :attr:`Batch.labels`.

:attr:`LocalObjective.finish` runs on the client's :class:`~fedhetero.core.exchange.types.ClientResult`
after the upload is built (control-variate updates, the state a client keeps): per-task values
live in the objective, never on the algorithm instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Sequence

import torch
from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.exchange.types import ClientResult

__all__ = [
    "Batch", "GradRule", "LocalObjective", "LocalPhase", "LocalPlan", "LocalSGD", "LossRule", "Tensors", "cohort_rules", "move_consts", "proximal",
    "rules_key", "stack_consts",
]

Tensors = Mapping[str, torch.Tensor]
GradRule = Callable[[Tensors, Tensors, dict[str, Any]], None]
LossRule = Callable[["Batch"], torch.Tensor]


@dataclass(frozen=True)
class LocalSGD:
    """The plain SGD a method's local training runs, stated so that a cohort of clients can run it
    too (``LocalPlan.sgd``): what
    :class:`torch.optim.SGD` gets (``lr``, ``momentum``, ``weight_decay``, ``nesterov``; no
    dampening), or with ``momentum_form="ema"`` the ``(1−β)``-dampened buffer started at zero
    (``m ← β·m + (1−β)·d``, so the first step moves by ``lr·(1−β)·d``: the FedDU family's device
    momentum), the gradient-norm ``clip`` applied before each step, and ``persistent``: the
    client's momentum buffers are loaded from its last round and kept for its next
    (``train.optimizer_state: persistent``). ``classes``: the cross-entropy sees only these
    classes' logits, the others replaced by ``class_fill`` (HeteroFL's masked loss; per client,
    so clients with different sets still share a cohort). ``carried``: the momentum buffers start
    from those the method hands the client (``LocalPlan.momentum``)
    and the trained ones are reported (FedDA's transmitted momentum). ``masked``: the parameters
    are multiplied by the masks the method hands the client
    (``LocalPlan.masks``) before the first step and after
    every step, so masked entries stay zero (IMC's pruning masks). With ``carried`` and
    ``persistent`` the buffers start from the client's kept ones where the method hands it none,
    and ``keep`` says whether the trained ones are kept for its next round (else the kept ones
    stay: DynaComm keeps them only after a round's last exchange). ``loss_over``: the steps whose
    loss the report gives, sample-weighted: those of the last epoch (the shared trainer's
    report) or ``"all"`` of them (a window of steps, DynaComm's); ``"steps"``: the plain mean
    of every step's batch mean (a distillation phase's, :class:`LocalPhase`)."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    clip: float | None = None
    persistent: bool = False
    momentum_form: Literal["torch", "ema"] = "torch"
    classes: tuple[int, ...] | None = None
    class_fill: float = 0.0
    carried: bool = False
    masked: bool = False
    keep: bool = True
    loss_over: Literal["last_epoch", "all", "steps"] = "last_epoch"

    def shared(self) -> "LocalSGD":
        """What clients of one cohort must share (everything but their own ``classes``)."""
        return replace(self, classes=None) if self.classes is not None else self


@dataclass
class LocalPhase:
    """A phase of plain SGD that a client runs before its local training, on other inputs than
    its own data with soft targets (DS-FL's distillation towards the server's soft labels on
    open data; ``LocalPlan.prelude``): ``sgd`` (its report's
    loss is ``sgd.loss_over``'s), the phase's ``images`` and the ``targets`` (one probability
    vector per image) its loss is ``KL(target ‖ softmax(output))`` towards (batch mean), the
    ``schedule`` of batches as rows of ``images``, and ``report``: the name the loss is reported
    under. ``key``: what clients whose phases train together share (their ``images`` and
    ``targets`` are then equal: the method guarantees it, e.g. one broadcast per round)."""

    sgd: LocalSGD
    images: torch.Tensor
    targets: torch.Tensor
    schedule: list[torch.Tensor]
    report: str
    key: Any


@dataclass
class LocalObjective:
    """What a client's local training adds to plain cross-entropy SGD (see the module docstring).

    ``consts``: per-client values the rules read — a tensor, or a dict of tensors by parameter
    name (only the trainable parameters' entries are kept). ``references``: frozen models (state
    dicts of the configured model at full width) whose outputs :meth:`Batch.ref` returns.
    ``representation``: ``"features"`` makes ``batch.out`` and ``batch.ref`` the penultimate
    features (the logits for a model without hidden layers). ``own``: a per-client value the loss
    rule uses as it is, never stacked (a random generator), through :meth:`Batch.each`."""

    grad: GradRule | None = None
    loss: LossRule | None = None
    consts: dict[str, Any] = field(default_factory=dict)
    references: dict[str, Mapping[str, torch.Tensor]] = field(default_factory=dict)
    representation: Literal["logits", "features"] = "logits"
    finish: Callable[["ClientResult"], None] | None = None
    own: Any = None


@dataclass(frozen=True)
class LocalPlan:
    """A client's local training as a value (:meth:`Algorithm.local_plan
    <fedhetero.core.method.algorithm.Algorithm.local_plan>`): what one client trains alone and a round's
    clients train together in batched cohorts (:mod:`fedhetero.core.local.runner`).

    ``sgd``: the plain SGD it runs (:class:`LocalSGD`). ``objective``: what it adds to the
    cross-entropy (:class:`LocalObjective`). ``members``: the independent members of the model
    that train on their own cross-entropy on the client's batches (SplitMix's bases), as a
    function of the model; None: the model is one. ``masks``: by parameter name, what the
    parameters are multiplied by before and after every step (with ``sgd.masked``; IMC's pruning
    masks). ``schedule``: the batches, as rows of the training set in the order they are taken,
    when they are not the client's own data's epochs (Data-sharing's shared samples, DynaComm's
    window); its report's loss is the steps' the shared trainer reports. ``prelude``: a phase of
    SGD on other inputs before it (:class:`LocalPhase`, DS-FL's distillation). ``momentum``: the
    buffers by parameter name the SGD starts from (with ``sgd.carried``; FedDA's transmitted
    momentum), the trained ones reported under ``momentum``."""

    sgd: LocalSGD
    objective: LocalObjective | None = None
    members: Callable[[nn.Module], Sequence[nn.Module]] | None = None
    masks: Mapping[str, torch.Tensor] | None = None
    schedule: Sequence[torch.Tensor] | None = None
    prelude: LocalPhase | None = None
    momentum: Mapping[str, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.sgd.masked and self.masks is None:
            raise ValueError("LocalPlan: sgd.masked needs the masks")
        if self.masks is not None and not self.sgd.masked:
            raise ValueError("LocalPlan: masks are applied only with sgd.masked")
        if self.momentum is not None and not self.sgd.carried:
            raise ValueError("LocalPlan: momentum handed over needs sgd.carried")


class Batch:
    """What a loss rule sees of one step: the output, the reference models' outputs, the
    constants and the per-client mean over the batch."""

    def __init__(
        self,
        out: torch.Tensor,
        consts: dict[str, Any],
        ref: Callable[[str], torch.Tensor],
        mean: Callable[[torch.Tensor], torch.Tensor],
        records: dict[str, list[torch.Tensor]],
        *,
        labels: torch.Tensor | None = None,
        params: Mapping[str, torch.Tensor] | None = None,
        own: Any = None,
        rows: Sequence[int] | None = None,
    ) -> None:
        self.out = out
        self.c = consts
        self._ref = ref
        self._mean = mean
        self._records = records
        self._refs: dict[str, torch.Tensor] = {}
        #: the batch's labels (``out.shape[:-1]``; a padded row's label is arbitrary)
        self.labels = labels
        self._params = params or {}
        self._own = own
        #: None for one client; in a cohort, each client's number of real rows in this batch
        self.rows = list(rows) if rows is not None else None

    def each(self, draw: Callable[[Any, int], Sequence[torch.Tensor]], padded: Sequence[bool]) -> list[torch.Tensor]:
        """``draw(own, rows)`` for the client (its :attr:`LocalObjective.own` and its batch's
        number of rows), returning tensors; in a cohort, called client by client (not for a
        client whose steps are done) and each tensor stacked along a leading client axis, the
        ones marked ``padded`` (their first axis counts the batch's rows) padded with zeros to
        the cohort's batch size."""
        if self.rows is None:
            return list(draw(self._own, int(self.out.shape[0])))
        size = int(self.out.shape[1])
        values = [draw(own, n) if n > 0 else None for own, n in zip(self._own, self.rows)]
        first = next(v for v in values if v is not None)
        out = []
        for k, pad in enumerate(padded):
            like = first[k]
            shape = ((size,) + tuple(like.shape[1:])) if pad else tuple(like.shape)
            stacked = torch.zeros((len(values), *shape), dtype=like.dtype, device=like.device)
            for i, v in enumerate(values):
                if v is not None:
                    stacked[i, : v[k].shape[0]] = v[k]
            out.append(stacked)
        return out

    def linear(self, name: str, z: torch.Tensor) -> torch.Tensor:
        """The client's own linear layer ``name`` (its current weight and bias, with their
        gradients) applied to ``z`` (``(n, in)``; in a cohort ``(C, n, in)``, each client's rows
        through its own layer)."""
        w, b = self._params[f"{name}.weight"], self._params[f"{name}.bias"]
        if self.rows is None:
            return torch.nn.functional.linear(z, w, b)
        return torch.baddbmm(b.unsqueeze(1), z, w.transpose(1, 2))

    def record(self, name: str, value: torch.Tensor) -> None:
        """Report ``value`` (one per client, as :meth:`mean` returns) in the client's metrics as
        ``name``: its mean over the local steps."""
        self._records.setdefault(name, []).append(value.detach())

    def ref(self, name: str) -> torch.Tensor:
        """The output of reference model ``name`` on this batch (no gradient), computed once."""
        if name not in self._refs:
            self._refs[name] = self._ref(name)
        return self._refs[name]

    def mean(self, per_sample: torch.Tensor) -> torch.Tensor:
        """The mean over the batch of a per-sample value (shape ``out.shape[:-1]``): a scalar for
        one client, one value per client in a cohort."""
        return self._mean(per_sample)


def move_consts(consts: dict[str, Any], params: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """One client's constants on its parameters' device and dtype: a tensor next to the first
    parameter, a dict of tensors entry by entry (trainable parameters' entries only)."""
    first = next(iter(params.values()))
    out: dict[str, Any] = {}
    for key, value in consts.items():
        if isinstance(value, Mapping):
            out[key] = {n: value[n].to(device=p.device, dtype=p.dtype) for n, p in params.items()}
        else:
            out[key] = torch.as_tensor(value).to(device=first.device, dtype=first.dtype)
    return out


def stack_consts(per_client: Sequence[dict[str, Any]], names: Sequence[str], device: Any, dtype: torch.dtype) -> dict[str, Any]:
    """The constants of a cohort's clients stacked along a leading client axis."""
    out: dict[str, Any] = {}
    for key, value in per_client[0].items():
        if isinstance(value, Mapping):
            out[key] = {n: torch.stack([c[key][n].to(device, dtype) for c in per_client]) for n in names}
        else:
            out[key] = torch.stack([torch.as_tensor(c[key]).to(device, dtype) for c in per_client])
    return out


def _code(rule: Callable[..., Any] | None) -> Any:
    return None if rule is None else getattr(rule, "__code__", rule)


def rules_key(objective: LocalObjective | None) -> tuple[Any, ...] | None:
    """What objectives that can share a cohort have in common (see :func:`cohort_rules`)."""
    if objective is None:
        return None
    o = objective
    return (_code(o.grad), _code(o.loss), tuple(sorted(o.consts)), tuple(sorted(o.references)), o.representation)


def cohort_rules(objectives: Sequence[LocalObjective | None]) -> LocalObjective | None | bool:
    """The objective a cohort applies to every client: None when no client has one, the first
    client's when all share their rules (the same code, constants and references by name), and
    False when they differ (the clients then train one by one)."""
    first = objectives[0]
    if first is None:
        return None if all(o is None for o in objectives) else False
    for o in objectives[1:]:
        if o is None or _code(o.grad) != _code(first.grad) or _code(o.loss) != _code(first.loss):
            return False
        if set(o.consts) != set(first.consts) or set(o.references) != set(first.references):
            return False
        if o.representation != first.representation:
            return False
    return first


def frozen_reference(ctx: Any, name: str, state: Mapping[str, torch.Tensor]) -> nn.Module:
    """Reference model ``name`` loaded with ``state`` in eval mode (one cached instance per name)."""
    model: nn.Module = ctx.reusable(("reference", name), ctx.build_model)
    model.load_state_dict(state)
    model.eval()
    return model


def proximal(weight: float) -> GradRule:
    """The gradient ``weight·(w − anchor)`` of ``weight/2·‖w − anchor‖²`` (FedProx's proximal
    term, FedACG's regulariser), the anchor being the constant ``"anchor"``."""

    def rule(params: Tensors, grads: Tensors, c: dict[str, Any]) -> None:
        for n, g in grads.items():
            g.add_(params[n] - c["anchor"][n], alpha=weight)

    return rule
