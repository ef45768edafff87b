"""A method's local objective: what it adds to plain local SGD, written once.

Most methods change local training in one of two ways: a term added to every step's gradient
(FedProx's proximal pull, SCAFFOLD's control variates, FedDyn's linear and proximal terms,
FedACG's regulariser) or a term added to the loss that compares the model's outputs with those
of frozen reference models (MOON's contrastive loss, DynInit's distillation from a teacher). A
method states that term once, as a :class:`LocalObjective` its ``local_objective`` hook returns,
and the framework applies it to one model (:meth:`~fedhetero.core.context.ClientContext.train`)
or to a round's clients trained together (:class:`~fedhetero.core.cohort.Cohort`).

The rules are written for one client and must use elementwise operations only (and reductions
over the last axis): in a cohort every tensor they see carries a leading client axis. A rule
reads per-client values only through :attr:`LocalObjective.consts` (the framework stacks them
across a cohort), never through its closure, which may hold only the method's options:

* ``grad(params, grads, c)`` adds to ``grads`` in place (``params`` and ``grads`` by parameter
  name, ``c`` the objective's constants moved to the parameters' device and dtype); it runs after
  every backward, without autograd, before clipping and the optimiser step;
* ``loss(batch)`` returns the term added to the mean cross-entropy of the step, reducing over the
  batch with :meth:`Batch.mean`; ``batch.out`` is the model's output (or its penultimate features
  with ``representation="features"``) and :meth:`Batch.ref` the same for a reference model.

:attr:`LocalObjective.finish` runs on the client's :class:`~fedhetero.core.types.ClientResult`
after the upload is built (control-variate updates, the state a client keeps): per-task values
live in the objective, never on the algorithm instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Sequence

import torch
from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.types import ClientResult

__all__ = [
    "Batch", "GradRule", "LocalObjective", "LocalSGD", "LossRule", "Tensors", "cohort_rules", "move_consts", "proximal",
    "rules_key", "stack_consts",
]

Tensors = Mapping[str, torch.Tensor]
GradRule = Callable[[Tensors, Tensors, dict[str, Any]], None]
LossRule = Callable[["Batch"], torch.Tensor]


@dataclass(frozen=True)
class LocalSGD:
    """The plain SGD a method's local training runs, stated so that a cohort of clients can run it
    too (:meth:`~fedhetero.core.algorithm.Algorithm.local_optimizer`): what
    :class:`torch.optim.SGD` gets (``lr``, ``momentum``, ``weight_decay``, ``nesterov``; no
    dampening), or with ``momentum_form="ema"`` the ``(1−β)``-dampened buffer started at zero
    (``m ← β·m + (1−β)·d``, so the first step moves by ``lr·(1−β)·d``: the FedDU family's device
    momentum), the gradient-norm ``clip`` applied before each step, and ``persistent``: the
    client's momentum buffers are loaded from its last round and kept for its next
    (``train.optimizer_state: persistent``). ``classes``: the cross-entropy sees only these
    classes' logits, the others replaced by ``class_fill`` (HeteroFL's masked loss; per client,
    so clients with different sets still share a cohort). ``carried``: the momentum buffers start
    from those the method hands the client (:meth:`~fedhetero.core.algorithm.Algorithm.local_momentum`)
    and the trained ones are reported (FedDA's transmitted momentum). ``masked``: the parameters
    are multiplied by the masks the method hands the client
    (:meth:`~fedhetero.core.algorithm.Algorithm.local_masks`) before the first step and after
    every step, so masked entries stay zero (IMC's pruning masks)."""

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

    def shared(self) -> "LocalSGD":
        """What clients of one cohort must share (everything but their own ``classes``)."""
        return replace(self, classes=None) if self.classes is not None else self


@dataclass
class LocalObjective:
    """What a client's local training adds to plain cross-entropy SGD (see the module docstring).

    ``consts``: per-client values the rules read — a tensor, or a dict of tensors by parameter
    name (only the trainable parameters' entries are kept). ``references``: frozen models (state
    dicts of the configured model at full width) whose outputs :meth:`Batch.ref` returns.
    ``representation``: ``"features"`` makes ``batch.out`` and ``batch.ref`` the penultimate
    features (the logits for a model without hidden layers)."""

    grad: GradRule | None = None
    loss: LossRule | None = None
    consts: dict[str, Any] = field(default_factory=dict)
    references: dict[str, Mapping[str, torch.Tensor]] = field(default_factory=dict)
    representation: Literal["logits", "features"] = "logits"
    finish: Callable[["ClientResult"], None] | None = None


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
    ) -> None:
        self.out = out
        self.c = consts
        self._ref = ref
        self._mean = mean
        self._records = records
        self._refs: dict[str, torch.Tensor] = {}

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
