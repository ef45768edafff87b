"""Invariants of structural changes, checked in code.

Every structural operation (expand, add a branch, nested growth, fold, shrink to a budget, re-solve
from plain weights) must keep four things true; each function below checks one of them and raises
:class:`InvariantError` naming what broke. They are cheap enough to run after every change in a
verification run, and the property tests run them after every step of random operation sequences.

1. :func:`check_optimizer` — the optimizer holds exactly the model's trainable parameters: none
   missing (it would never be trained), none stale (a removed branch's parameter still stepped),
   none twice; and no optimizer state belongs to a parameter outside the optimizer.
2. :func:`check_gradients` — after a backward pass every trainable parameter has a gradient (a
   parameter outside the autograd graph is never trained, whatever the optimizer holds).
3. :func:`check_same_function` (after REP) — the client model computes the global model's function
   in eval mode.
4. :func:`check_same_function` (at upload) — the merged upload computes the trained client model's
   function in eval mode.
5. :func:`check_anchor_scale` (after a REP with ``anchor_stats="rescale"``) — no anchor conv filter
   grew: the re-solve put the global kernel's scale into the anchor BN's ``γ``, so the conv's scale
   (and with it the running variance) cannot compound from round to round.

Tolerances of the function checks are relative to the output scale and follow the dtype
(:func:`reparam.testing.default_rtol`: 1e-10 in float64).
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

import torch
from torch import Tensor, nn

from .errors import ReparamError
from .testing import default_rtol, rel_err

__all__ = [
    "InvariantError",
    "optimizer_mismatch",
    "check_optimizer",
    "check_gradients",
    "function_error",
    "check_same_function",
    "anchor_filter_norms",
    "check_anchor_scale",
]


class InvariantError(ReparamError):
    """A structural invariant does not hold: a bug in the code that changed the structure."""


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters(remove_duplicate=True)}


def optimizer_mismatch(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[str]]:
    """What separates ``optimizer``'s parameters from ``model``'s trainable parameters.

    Returns a dict of lists (all empty when the invariant holds):
    ``missing`` (names of trainable parameters in no group), ``stale`` (shapes of optimizer
    parameters that are not trainable parameters of the model), ``duplicated`` (names held twice),
    ``orphan_state`` (shapes of parameters with optimizer state but in no group).
    """
    names = _names(model)
    trainable = {id(p) for _, p in model.named_parameters() if p.requires_grad}
    held: dict[int, int] = {}
    held_params: dict[int, Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            held[id(p)] = held.get(id(p), 0) + 1
            held_params[id(p)] = p
    missing = sorted(names[i] for i in trainable if i not in held)
    stale = [
        names.get(i, f"<not in the model, shape {tuple(held_params[i].shape)}>")
        for i in held
        if i not in trainable
    ]
    duplicated = sorted(names.get(i, "?") for i, n in held.items() if n > 1)
    orphan = [f"shape {tuple(p.shape)}" for p in optimizer.state if id(p) not in held]
    return {"missing": missing, "stale": stale, "duplicated": duplicated, "orphan_state": orphan}


def _summary(items: list[str], limit: int = 4) -> str:
    head = ", ".join(items[:limit])
    return head + (f", … ({len(items)} in all)" if len(items) > limit else "")


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, *, where: str = "") -> None:
    """Invariant 1: ``optimizer`` holds exactly ``model``'s trainable parameters, each once, and
    keeps no state for a parameter it no longer holds.

    Raises:
        InvariantError: naming the missing / stale / duplicated parameters.
    """
    bad = optimizer_mismatch(model, optimizer)
    problems = [f"{kind} {_summary(items)}" for kind, items in bad.items() if items]
    if problems:
        at = f" after {where}" if where else ""
        raise InvariantError(f"optimizer out of step with the model{at}: " + "; ".join(problems))


def check_gradients(model: nn.Module, *, where: str = "") -> None:
    """Invariant 2: after a backward pass every trainable parameter of ``model`` has a gradient
    (zero is fine: a zero-γ branch gets exact zeros at first; ``None`` means it is not in the
    graph and can never be trained).

    Raises:
        InvariantError: naming the parameters without a gradient.
    """
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if missing:
        at = f" after {where}" if where else ""
        raise InvariantError(f"trainable parameters without a gradient{at}: {_summary(missing)}")


def _as_eval(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    m = copy.deepcopy(model)
    if dtype is not None:
        m = m.to(dtype)
    return m.eval()


def function_error(a: nn.Module, b: nn.Module, inputs: Any, *, dtype: torch.dtype | None = None) -> float:
    """Scale-relative maximum error of ``a``'s eval-mode output against ``b``'s on ``inputs``,
    computed on copies (cast to ``dtype`` when given); neither model is changed."""
    ca, cb = _as_eval(a, dtype), _as_eval(b, dtype)
    xs: Iterable[Any] = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    xs = [x.to(dtype) if dtype is not None and isinstance(x, Tensor) and x.is_floating_point() else x for x in xs]
    with torch.no_grad():
        return rel_err(ca(*xs), cb(*xs))


def check_same_function(
    a: nn.Module,
    b: nn.Module,
    inputs: Any,
    *,
    dtype: torch.dtype | None = None,
    rtol: float | None = None,
    where: str = "",
) -> float:
    """Invariants 3 and 4: ``a`` computes ``b``'s function in eval mode, to ``rtol`` relative to the
    output scale (default: :func:`~reparam.testing.default_rtol` of the dtype compared in).
    Returns the error.

    Raises:
        InvariantError: the error exceeds the tolerance.
    """
    err = function_error(a, b, inputs, dtype=dtype)
    if dtype is None:
        dtype = next((p.dtype for p in a.parameters() if p.is_floating_point()), torch.float32)
    tol = default_rtol(dtype) if rtol is None else rtol
    if not err <= tol:
        at = f" {where}" if where else ""
        raise InvariantError(f"functions differ{at}: relative error {err:.3g} > {tol:.3g} ({dtype})")
    return err


def anchor_filter_norms(model: nn.Module) -> dict[str, Tensor]:
    """Per-output-channel norms (float64) of the anchor conv kernel of every block of ``model``
    (nested ones included) whose anchor has a BatchNorm with a ``γ``, by module path. A nested
    anchor contributes its merged kernel."""
    from .block import DiverseBranchBlock, FrozenIdentityBN

    out = {}
    for path, m in model.named_modules():
        if not isinstance(m, DiverseBranchBlock) or m.is_merged:
            continue
        bn = m.anchor.bn
        if isinstance(bn, FrozenIdentityBN) or getattr(bn, "weight", None) is None:
            continue
        with torch.no_grad():
            out[path] = m._anchor_kernel().flatten(1).norm(dim=1)
    return out


def check_anchor_scale(before: dict[str, Tensor], model: nn.Module, *, rtol: float = 1e-6, where: str = "") -> None:
    """Invariant 5: no anchor filter of ``model`` is longer than in ``before``
    (:func:`anchor_filter_norms` taken before a REP with ``anchor_stats="rescale"``), to ``rtol``;
    filters that were exactly zero are not compared.

    Raises:
        InvariantError: naming the blocks whose anchor filters grew, and by how much.
    """
    grew = []
    for path, norms in anchor_filter_norms(model).items():
        old = before.get(path)
        if old is None or old.shape != norms.shape:
            continue
        # a filter that was exactly zero has no norm to keep (its channel keeps its γ)
        over = (norms > old * (1 + rtol)) & (old > 0)
        if bool(over.any()):
            ratio = float((norms[over] / old[over]).max())
            grew.append(f"{path or '<model>'} (x{ratio:.3g})")
    if grew:
        at = f" {where}" if where else ""
        raise InvariantError(f"anchor conv filters grew{at}: {_summary(grew)}")
