"""Budget planning: which branches a model grows to use a MAC budget (knapsack planners).

DYMM (:mod:`reparam.dymm`) decides from saliency which branches to fold and where to grow; these
planners fill what budget is left with as many MACs as the branch set allows:

* :func:`best_additions` — 0/1 knapsack over ``(key, cost)`` items (largest total cost that fits);
* :func:`first_plan` — DynamicFL Eq. 2's first-round plan: "bottom to up"
  (:func:`reparam.dymm.plan_bottom_up`), replaced by the knapsack-best branch set when the greedy
  walk leaves more than 5 % of the reachable budget unused;
* :func:`fill_to_budget` — grow missing branches (exact zero-γ growth) into unused budget;
* :func:`grow_to_budget` — grow after a budget increase, blocks ordered by saliency, then fill.

Grow modes. ``"block"`` adds branch kinds to the blocks of the host convs. ``"nested"`` may also grow
branches inside a branch's ``K×K`` conv — the anchor's conv and the second stage of ``1x1_kxk``
(:meth:`~reparam.DiverseBranchBlock.grow_nested`) — which the budget can pay for once the flat
branch set is exhausted (e.g. LeNet-5's 3× tier: its flat set reaches about 2.4× the plain model).
Every growth is zero-γ growth, bit-exact in train and eval mode; every plan fits its budget
(closed-form MACs of :mod:`reparam.flops`, which equal the measured ones).
"""

from __future__ import annotations

from typing import Any, Collection, Sequence

import numpy as np
from torch import nn

from ._tree import iter_blocks
from .block import DiverseBranchBlock
from .changes import StructureChange
from .dymm import applicable_kinds, plan_bottom_up
from .errors import ReparamError
from .flops import conv_output_hw, input_sizes, model_macs
from .geometry import ConvGeometry
from .hostforms import conv_form
from .kinds import anchor_name, applicability, get_kind, kind_names

__all__ = [
    "GROW_MODES",
    "best_additions",
    "expandable_convs",
    "candidate_costs",
    "nested_candidates",
    "first_plan",
    "fill_to_budget",
    "grow_to_budget",
]

#: ``"block"``: grow branch kinds of the host convs' blocks; ``"nested"``: also inside a branch's K×K conv
GROW_MODES: tuple[str, ...] = ("block", "nested")

Key = tuple[str, str]
HW = tuple[int, int]


def _check_mode(grow_mode: str) -> None:
    if grow_mode not in GROW_MODES:
        raise ReparamError(f"grow_mode must be one of {GROW_MODES}, got {grow_mode!r}")


def _growable(kind: str, kinds: Collection[str] | None) -> bool:
    """A kind the fill and growth steps may add: flagged ``in_fill`` and, when ``kinds`` is given,
    one of them."""
    return get_kind(kind).in_fill and (kinds is None or kind in kinds)


def expandable_convs(model: nn.Module) -> list[tuple[str, nn.Conv2d]]:
    """Convs of a plain model that a first-round plan may expand (1 < max(K) ≤ 5; conv subclasses
    only when :func:`reparam.hostforms.conv_form` knows their form)."""
    return [
        (path, m)
        for path, m in model.named_modules()
        if isinstance(m, nn.Conv2d) and not isinstance(m, DiverseBranchBlock) and 1 < max(m.kernel_size) <= 5
        and not isinstance(conv_form(m), str)
    ]


def best_additions(items: Sequence[tuple[Any, int]], capacity: float, resolution: int = 4000) -> list[Any]:
    """0/1 knapsack: the subset of ``(key, cost)`` items with the largest total cost ≤ ``capacity``.

    Costs are scaled to ``resolution`` units of the capacity and rounded **up**, so the chosen set
    always fits exactly; the optimum is within one unit per item of the true one. Ties keep the
    earlier items (the input order expresses preference).
    """
    if capacity <= 0 or not items:
        return []
    unit = capacity / resolution
    cap = resolution
    w = [max(1, int(-(-c // unit))) if c > 0 else 0 for _, c in items]
    best = np.full(cap + 1, -1, dtype=np.int64)
    best[0] = 0
    take = np.zeros((len(items), cap + 1), dtype=bool)
    for i, ((_, c), wi) in enumerate(zip(items, w)):
        if wi > cap:
            continue
        cand = np.full(cap + 1, -1, dtype=np.int64)
        cand[wi:] = np.where(best[:-wi or None] >= 0, best[:-wi or None] + int(c), -1) if wi > 0 else best + int(c)
        better = cand > best
        take[i] = better
        best = np.where(better, cand, best)
    j = int(np.argmax(best))
    chosen = []
    for i in range(len(items) - 1, -1, -1):
        if take[i, j]:
            chosen.append(items[i][0])
            j -= w[i]
    return chosen[::-1]


def candidate_costs(
    model: nn.Module, input_shape: Sequence[int], blocks_only: bool, sizes: dict[str, HW] | None = None,
    kinds: Collection[str] | None = None,
) -> list[tuple[Key, int]]:
    """(conv or block path, kind) → forward MACs of adding that branch, in forward order.

    ``blocks_only``: the kinds each (outermost) block lacks; otherwise every applicable kind of
    every expandable plain conv. ``sizes`` (conv input sizes by path,
    :func:`reparam.flops.input_sizes`) may be passed in: they depend on the architecture only, not
    on the branches a block carries. ``kinds``: only these branch kinds (default: all)."""
    sizes = sizes if sizes is not None else input_sizes(model, input_shape)
    items: list[tuple[Key, int]] = []
    if blocks_only:
        for path, block in iter_blocks(model):
            out_hw = conv_output_hw(block.geometry, sizes[path])
            for kind in block.applicable():
                if kind not in block.branch_names and _growable(kind, kinds):
                    items.append(((path, kind), int(get_kind(kind).macs(block.geometry, sizes[path], out_hw, {}))))
        return items
    for path, conv in expandable_convs(model):
        geo = ConvGeometry.from_conv(conv)
        out_hw = conv_output_hw(geo, sizes[path])
        for kind in applicable_kinds(geo):
            if not get_kind(kind).anchor and (kinds is None or kind in kinds):
                items.append(((path, kind), int(get_kind(kind).macs(geo, sizes[path], out_hw, {}))))
    return items


def _nested_sites(model: nn.Module, sizes: dict[str, HW]) -> list[tuple[str, DiverseBranchBlock, str, ConvGeometry, HW]]:
    """``(block path, block, branch, conv geometry, conv input size)`` of every conv nested growth
    may expand or extend (an outermost block's nestable conv, or its existing nested block)."""
    sites = []
    for path, block in iter_blocks(model):
        if block.is_merged or path not in sizes:
            continue
        nestable = set(block.nestable())
        for name in block.branch_names:
            inner = block.nested_block(name)
            if inner is None and name not in nestable:
                continue
            kind = get_kind(name)
            if inner is not None:
                geo = inner.geometry
            else:
                assert kind.nested_conv is not None  # a nestable branch names its K×K conv
                geo = ConvGeometry.from_conv(getattr(block.branches[name], kind.nested_conv))
            sites.append((path, block, name, geo, kind.nested_input_hw(block.geometry, sizes[path])))
    return sites


def nested_candidates(
    model: nn.Module, sizes: dict[str, HW], kinds: Collection[str] | None = None
) -> list[tuple[tuple[str, str, str], int]]:
    """((block path, branch, kind), MACs) of every branch nested growth could add, in forward order:
    kinds applicable to a nestable ``K×K`` conv (under its nested input-window policy) that its
    nested block lacks (of ``kinds`` when given). ``sizes``: input sizes of the outermost blocks."""
    items: list[tuple[tuple[str, str, str], int]] = []
    for path, block, name, geo, hw in _nested_sites(model, sizes):
        inner = block.nested_block(name)
        present = set(inner.branch_names) if inner is not None else {anchor_name()}
        out_hw = conv_output_hw(geo, hw)
        for kind, reason in applicability(geo, crop=block.nested_crop(name)).items():
            k = get_kind(kind)
            if reason is None and not k.anchor and kind not in present and _growable(kind, kinds):
                items.append(((path, name, kind), int(k.macs(geo, hw, out_hw, {}))))
    return items


def first_plan(
    plain: nn.Module, budget_macs: float, input_shape: Sequence[int], fill: bool = True,
    kinds: Collection[str] | None = None,
) -> dict[str, tuple[str, ...]]:
    """Eq. 2's first-round plan: every expandable conv gets its anchor; branches are added
    "bottom to up" (:func:`reparam.dymm.plan_bottom_up`). When that greedy walk leaves more than 5 %
    of the reachable budget unused (discrete branch costs can block it), the plan is replaced by the
    knapsack-best set of branches, so a client trains as much of its budget as the branch set
    allows. (Nested growth cannot be written as a plan: follow with :func:`fill_to_budget`.)
    ``kinds``: the branch kinds the plan may use (default: all).
    """
    base = model_macs(plain, tuple(input_shape))
    anchor = anchor_name()
    plan: dict[str, tuple[str, ...]] = {path: (anchor,) for path, _ in expandable_convs(plain)}
    if kinds is None:
        greedy = plan_bottom_up(plain, budget_macs, input_shape)
    else:
        allowed = set(kinds) | {anchor}
        greedy = plan_bottom_up(
            plain, budget_macs, input_shape,
            candidate_set=[k for k in kind_names() if get_kind(k).in_first_plan and k in allowed],
            fill=[k for k in kind_names() if get_kind(k).in_fill and k in allowed],
        )
    plan.update({p: tuple(k) for p, k in greedy.items()})
    if not fill:
        return plan
    items = candidate_costs(plain, input_shape, blocks_only=False, kinds=kinds)
    extra = {key: c for key, c in items}
    used = sum(extra.get((p, k), 0) for p, kinds in plan.items() for k in kinds if k != anchor)
    reachable = min(budget_macs - base, sum(extra.values()))
    if reachable <= 0 or used >= 0.95 * reachable:
        return plan
    chosen = best_additions(items, budget_macs - base)
    if sum(extra[k] for k in chosen) <= used:
        return plan
    plan = {path: (anchor,) for path, _ in expandable_convs(plain)}
    for path, kind in chosen:
        plan[path] = plan[path] + (kind,)
    return plan


def _outer_sizes(model: nn.Module, input_shape: Sequence[int], sizes: dict[str, HW] | None) -> dict[str, HW]:
    if sizes is not None and all(path in sizes for path, _ in iter_blocks(model)):
        return sizes
    return input_sizes(model, tuple(input_shape))


def fill_to_budget(
    model: nn.Module,
    budget_macs: float,
    input_shape: Sequence[int],
    *,
    init: str = "zero_gamma",
    sizes: dict[str, HW] | None = None,
    current_macs: int | None = None,
    grow_mode: str = "block",
    kinds: Collection[str] | None = None,
) -> StructureChange:
    """Grow missing branches (exact zero-γ growth) so the model uses as much of ``budget_macs`` as
    the branch set allows: a knapsack over the missing branches of every block and, with
    ``grow_mode="nested"``, over the branches nested growth can add inside the blocks' ``K×K``
    convs (flat branches first on ties). A second pass fills room that a new ``1x1_kxk`` opened.
    ``kinds``: only these branch kinds are grown (default: all).
    """
    _check_mode(grow_mode)
    change = StructureChange()
    current = model_macs(model, tuple(input_shape)) if current_macs is None else current_macs
    sizes = _outer_sizes(model, input_shape, sizes)
    for _ in range(2 if grow_mode == "nested" else 1):
        room = budget_macs - current
        if room <= 0:
            break
        items: list[tuple[Any, int]] = [(("flat", *key), c) for key, c in candidate_costs(model, input_shape, True, sizes, kinds)]
        if grow_mode == "nested":
            items += [(("nested", *key), c) for key, c in nested_candidates(model, sizes, kinds)]
        costs = {key: c for key, c in items}
        blocks = dict(iter_blocks(model))
        chosen = best_additions(items, room)
        for key in chosen:
            if key[0] == "flat":
                change.extend(blocks[key[1]].add_branch(key[2], init=init))
            else:
                change.extend(blocks[key[1]].add_nested_branch(key[2], key[3], init=init))
            current += costs[key]
        if not any(key[0] == "flat" for key in chosen):
            break  # nothing new to nest into
    return change


def grow_to_budget(
    model: nn.Module,
    scores: dict[Key, float],
    budget_macs: float,
    input_shape: Sequence[int],
    *,
    init: str = "zero_gamma",
    grow_mode: str = "block",
    kinds: Collection[str] | None = None,
) -> StructureChange:
    """Grow after a budget increase: blocks are visited by the largest |score| of their present
    branches; each takes its missing kinds (of ``kinds`` when given), cheapest first, while the
    model fits; then the rest of the budget is filled (:func:`fill_to_budget`, nested growth too
    with ``grow_mode="nested"``)."""
    _check_mode(grow_mode)
    change = StructureChange()
    blocks = dict(iter_blocks(model))
    if not blocks:
        return change
    sizes = input_sizes(model, tuple(input_shape))

    def block_score(path: str) -> float:
        vals = [abs(v) for (p, _), v in scores.items() if p == path]
        return max(vals) if vals else 0.0

    current = model_macs(model, tuple(input_shape))
    for path in sorted(blocks, key=block_score, reverse=True):
        block = blocks[path]
        missing = [k for k in block.applicable() if k not in block.branch_names and _growable(k, kinds)]
        out_hw = conv_output_hw(block.geometry, sizes[path])
        costs = {k: get_kind(k).macs(block.geometry, sizes[path], out_hw, {}) for k in missing}
        for kind in sorted(missing, key=lambda k: costs[k]):
            if current + costs[kind] <= budget_macs:
                change.extend(block.add_branch(kind, init=init))
                current += costs[kind]
    return change.extend(
        fill_to_budget(model, budget_macs, input_shape, init=init, sizes=sizes, current_macs=current, grow_mode=grow_mode,
                       kinds=kinds)
    )
