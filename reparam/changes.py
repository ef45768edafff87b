"""Records of structural changes and the optimizer surgery that follows them.

Every structural operation of this package (adding a branch, folding a branch into the anchor,
re-solving the anchor from plain weights) returns a :class:`StructureChange`. The record lists
the parameters that appeared, disappeared or had their value replaced, so that an optimizer (and
anything else that holds per-parameter state) can be brought up to date with
:func:`apply_to_optimizer` without rebuilding it.

Guarantees of :func:`apply_to_optimizer`:

* removed parameters are deleted from their group **by identity**, together with their state
  (momentum buffers, Adam moments, ``step``);
* added parameters are appended to the group that holds their reference parameter, so they
  inherit that group's learning rate, weight decay, momentum, betas, ...; they start without state;
* overwritten parameters lose their state (when ``reset_overwritten_state``), because the old
  moments refer to a different parameterisation;
* ``add_param_group`` is never called, so learning-rate schedulers built earlier keep scheduling
  every group correctly (their ``base_lrs`` keep their length).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn

from .errors import ReparamError

__all__ = ["StructureChange", "apply_to_optimizer"]


@dataclass
class StructureChange:
    """What a structural operation did to the set of trainable parameters.

    Attributes:
        added: ``(new_param, reference_param)`` pairs; the new parameter should join the
            optimizer group that holds ``reference_param``.
        removed: parameters that no longer take part in the model.
        overwritten: parameters that still exist but whose value was replaced (e.g. the anchor
            after a fold or a re-solve).
        paths: module paths of the blocks that changed.
    """

    added: list[tuple[nn.Parameter, nn.Parameter]] = field(default_factory=list)
    removed: list[nn.Parameter] = field(default_factory=list)
    overwritten: list[nn.Parameter] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)

    def extend(self, other: "StructureChange") -> "StructureChange":
        """Append ``other``'s records to this one in place and return ``self``.

        Sequential changes compose: a parameter added by an earlier change and removed by a later
        one disappears from ``added`` (it never needs to reach an optimizer), and a parameter that
        is removed is no longer listed as overwritten. Paths keep their first-seen order without
        duplicates.
        """
        if not isinstance(other, StructureChange):
            raise TypeError(f"other must be a StructureChange, got {type(other).__name__}")
        removed_ids = {id(p) for p in other.removed}
        added_here = {id(p) for p, _ in self.added}
        # parameters created by ``self`` and removed by ``other`` cancel out
        self.added = [(p, ref) for p, ref in self.added if id(p) not in removed_ids]
        for p in other.removed:
            if id(p) not in added_here and not _contains(self.removed, p):
                self.removed.append(p)
        for p, ref in other.added:
            if not any(q is p for q, _ in self.added):
                self.added.append((p, ref))
        all_removed = {id(p) for p in self.removed} | removed_ids
        self.overwritten = [p for p in self.overwritten if id(p) not in all_removed]
        for p in other.overwritten:
            if id(p) not in all_removed and not _contains(self.overwritten, p):
                self.overwritten.append(p)
        for path in other.paths:
            if path not in self.paths:
                self.paths.append(path)
        return self

    def is_empty(self) -> bool:
        """True when the change adds, removes and overwrites nothing."""
        return not (self.added or self.removed or self.overwritten)

    def summary(self) -> dict:
        """JSON-able counts and paths."""
        return {
            "added": len(self.added),
            "removed": len(self.removed),
            "overwritten": len(self.overwritten),
            "paths": list(self.paths),
        }


def _contains(params: Iterable[torch.Tensor], p: torch.Tensor) -> bool:
    return any(q is p for q in params)


def apply_to_optimizer(
    optimizer: torch.optim.Optimizer,
    change: StructureChange,
    reset_overwritten_state: bool = True,
    *,
    missing_reference: str = "error",
) -> None:
    """Bring ``optimizer`` up to date with ``change`` in place.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (SGD with momentum, Adam(W), ...).
        change: the record returned by a structural operation (or several, combined with
            :meth:`StructureChange.extend`).
        reset_overwritten_state: drop the state of overwritten parameters.
        missing_reference: what to do with an added parameter whose reference parameter is in no
            group: ``"error"`` (raise ``ReparamError``, a ``ValueError``), ``"skip"`` (leave it out of the optimizer,
            e.g. a frozen part of the model) or ``"first_group"`` (append it to group 0).

    Groups are resolved before anything is removed, so a reference parameter removed by the same
    change still places its replacement; a reference parameter added by the same change (in any
    order) places the parameters that refer to it in its own group. Adding a parameter that the optimizer already holds is a
    no-op (idempotent). ``add_param_group`` is never called.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(change, StructureChange):
        raise TypeError(f"change must be a StructureChange, got {type(change).__name__}")
    if missing_reference not in ("error", "skip", "first_group"):
        raise ReparamError(
            f"missing_reference must be one of 'error', 'skip', 'first_group', got {missing_reference!r}"
        )

    removed_ids = {id(p) for p in change.removed}

    # 1. resolve the target group of every added parameter first. A reference may itself be added
    #    by the same change (a nested block's new anchor bias, then a branch grown beside it), in
    #    any order: resolve repeatedly until nothing more can be placed.
    where: dict[int, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for q in group["params"]:
            where.setdefault(id(q), gi)
    pending = [(p, ref) for p, ref in change.added if id(p) not in removed_ids and id(p) not in where]
    placements: list[tuple[nn.Parameter, int]] = []
    while pending:
        left: list[tuple[nn.Parameter, nn.Parameter]] = []
        for p, ref in pending:
            if id(p) in where:  # listed twice
                continue
            target = where.get(id(ref))
            if target is None:
                left.append((p, ref))
                continue
            where[id(p)] = target
            placements.append((p, target))
        if len(left) == len(pending):
            break
        pending = left
    for p, ref in pending:
        if id(p) in where:
            continue
        if missing_reference == "error":
            raise ReparamError(
                "apply_to_optimizer: the reference parameter of an added parameter "
                f"(shape {tuple(ref.shape)}) is in no optimizer group and is not added by the change; "
                "pass missing_reference='skip' or 'first_group' to place it otherwise"
            )
        if missing_reference == "skip":
            continue
        where[id(p)] = 0
        placements.append((p, 0))

    # 2. removed: delete by identity, with their state
    if removed_ids:
        for group in optimizer.param_groups:
            group["params"] = [q for q in group["params"] if id(q) not in removed_ids]
        for p in change.removed:
            optimizer.state.pop(p, None)

    # 3. added: append to the reference's group, no state
    for p, gi in placements:
        optimizer.param_groups[gi]["params"].append(p)
        optimizer.state.pop(p, None)

    # 4. overwritten: old moments refer to a different parameterisation
    if reset_overwritten_state:
        for p in change.overwritten:
            if id(p) not in removed_ids:
                optimizer.state.pop(p, None)
