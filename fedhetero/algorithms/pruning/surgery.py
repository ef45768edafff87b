"""Structured channel surgery and pruning plans on top of :mod:`fedhetero.core.hetero.submodel`.

A pruning plan is a :class:`fedhetero.core.hetero.submodel.SubmodelSpec` (channel group → kept indices, sorted,
relative to the parent model); the pruned model is ``submodel_from(model, spec)``, which slices conv
and linear weights on both sides (a linear layer after a flatten loses the ``H·W`` columns of each
removed channel; a layer after a concat loses the right piece), and copies BN weights, biases **and
running statistics**. Residual additions are respected because tied channels form one group.

- :func:`prunable_groups`: which groups a policy may prune. ``"block_internal_only"`` (default for
  residual nets) excludes residual groups (groups written by more than one conv, e.g. a ResNet stage's
  stem/projection and every block's second conv); ``"group"`` prunes those with one kept set per group.
- :class:`ChannelMacs`: forward MACs per sample as a closed form of the kept counts, on the
  producer and the consumer side (a tracing counter would count masked filters as dense work):
  ``MAC_l = c_l · C_out,kept · C_in,kept`` with ``c_l = H_out·W_out·k_h·k_w`` or the linear position count;
  built once per architecture from :func:`reparam.flops.layer_macs`.
- :func:`plan_from_rates` (per-group rates → spec, HRank-style count rule), :func:`fedap_group_rates`
  (per-conv FedAP rates → per-group rates), :func:`plan_for_budget` (largest plan whose MACs fit a
  budget, verified on the built model), :func:`prune` and :func:`fedap_prune` (sequential or
  all-ranks-first FedAP surgery).
"""

from __future__ import annotations

import copy
import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable, TypedDict

import numpy as np
import torch
from torch import Tensor, nn

from fedhetero.core.hetero.submodel import SubmodelSpec, channel_groups_of, submodel_from
from fedhetero.models.groups import ChannelGroups
from reparam.flops import layer_macs, model_macs

from .hrank import hrank_keep, hrank_scores, prune_order
from .rates import kept_count
from .taylor import magnitude_scores, taylor_bn_scores

__all__ = [
    "POLICIES",
    "CRITERIA",
    "BUDGET_METHODS",
    "BudgetError",
    "ChannelMacs",
    "prunable_groups",
    "group_producers",
    "compute_scores",
    "keep_indices",
    "plan_from_counts",
    "plan_from_rates",
    "fedap_group_rates",
    "plan_for_budget",
    "prune",
    "fedap_prune",
    "slice_tensors",
]

POLICIES = ("block_internal_only", "group")
CRITERIA = ("magnitude", "hrank", "taylor_bn")
BUDGET_METHODS = ("threshold", "uniform")
FEDAP_ORDERS = ("sequential", "all_ranks_first")


class BudgetError(ValueError):
    """No plan allowed by the guards fits the requested budget."""


# --------------------------------------------------------------------------------- groups
def group_producers(model_or_groups: nn.Module | ChannelGroups, group: str) -> list[str]:
    """Module paths of the layers whose weight's output channels are ``group``.

    With a model, only ``Conv2d``/``Linear`` modules are listed; with a :class:`ChannelGroups`, every
    weight whose two leading dims are grouped (convs and linears).
    """
    cg = channel_groups_of(model_or_groups)
    modules = dict(model_or_groups.named_modules()) if isinstance(model_or_groups, nn.Module) else {}
    out = []
    for key in cg.producers(group):
        d0, d1 = cg.dims[key]
        if d1 is None or not key.endswith(".weight"):
            continue
        path = key[: -len(".weight")]
        if modules and not isinstance(modules.get(path), (nn.Conv2d, nn.Linear)):
            continue
        out.append(path)
    return out


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


def prunable_groups(model: nn.Module, policy: str = "block_internal_only", *, include_linear: bool = False) -> list[str]:
    """Groups that ``policy`` allows to prune, in forward order.

    Only groups produced by ``Conv2d`` layers (and, with ``include_linear``, hidden ``Linear`` layers);
    never the fixed ``input``/``classes`` groups. ``"block_internal_only"`` also excludes groups
    written by more than one layer (residual groups); ``"group"`` keeps them.
    """
    _check_policy(policy)
    cg = channel_groups_of(model)
    modules = dict(model.named_modules())
    out = []
    for g in cg.prunable:
        prods = group_producers(cg, g)
        kinds = [type(modules.get(p)) for p in prods]
        if not prods or not all(issubclass(k, (nn.Conv2d, nn.Linear)) for k in kinds):
            continue
        has_conv = any(issubclass(k, nn.Conv2d) for k in kinds)
        if not has_conv and not include_linear:
            continue
        if policy == "block_internal_only" and len(prods) > 1:
            continue
        out.append(g)
    return out


# --------------------------------------------------------------------------------- MACs
def _meta_copy(model: nn.Module) -> nn.Module:
    """A structural copy of ``model`` on the meta device (no weight data is copied)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _count_macs(model: nn.Module, input_shape: Sequence[int], per_layer: bool = False) -> Any:
    """:func:`reparam.flops.model_macs` / ``layer_macs`` run on a meta copy (shapes only); falls back
    to the real model if the meta forward fails."""
    fn = layer_macs if per_layer else model_macs
    try:
        return fn(_meta_copy(model), tuple(input_shape))
    except Exception:  # noqa: BLE001 - an op without a meta kernel: count on the real model
        return fn(model, tuple(input_shape))


class ChannelMacs:
    """Closed-form forward MACs per sample as a function of group sizes.

    Built once per architecture and input shape (one hook pass of :func:`reparam.flops.layer_macs`):
    every ``Conv2d``/``Linear`` call contributes ``c_l · out_l · in_l`` with ``out_l``/``in_l`` linear
    in the group sizes (``Σ size[g]·repeat`` over the dimension's segments). Exact for zoo models
    (dense convs); layers not described by the channel groups contribute a constant.
    """

    def __init__(self, model: nn.Module, input_shape: Sequence[int]) -> None:
        cg = channel_groups_of(model)
        self.groups: ChannelGroups = cg
        self.input_shape = tuple(int(v) for v in input_shape)
        per_layer = _count_macs(model, self.input_shape, per_layer=True)
        names = cg.names
        self._index = {g: i for i, g in enumerate(names)}
        self.full_sizes = np.array([cg.sizes[g] for g in names], dtype=np.int64)
        rows_out, rows_in, coef = [], [], []
        const = 0
        modules = dict(model.named_modules())
        for path, mac in per_layer.items():
            key = f"{path}.weight" if path else "weight"
            dims = cg.dims.get(key)
            m = modules[path]
            if dims is None or dims[0] is None or dims[1] is None or getattr(m, "groups", 1) != 1:
                const += int(mac)
                continue
            a_out = np.zeros(len(names), dtype=np.int64)
            a_in = np.zeros(len(names), dtype=np.int64)
            for g, r in dims[0]:
                a_out[self._index[g]] += r
            for g, r in dims[1]:
                a_in[self._index[g]] += r
            full = int(a_out @ self.full_sizes) * int(a_in @ self.full_sizes)
            if full == 0 or mac % full:
                raise ValueError(f"{path}: MACs {mac} are not a multiple of out·in = {full}")
            rows_out.append(a_out)
            rows_in.append(a_in)
            coef.append(mac // full)
        self._a_out = np.array(rows_out, dtype=np.int64).reshape(-1, len(names))
        self._a_in = np.array(rows_in, dtype=np.int64).reshape(-1, len(names))
        self._coef = np.array(coef, dtype=np.int64)
        self._const = const
        self.full_macs = self.macs()

    def vector(self, sizes: Mapping[str, int] | None = None) -> np.ndarray:
        """Group sizes as a vector (full size for groups not given)."""
        v = self.full_sizes.copy()
        if sizes:
            for g, k in sizes.items():
                if g not in self._index:
                    raise ValueError(f"sizes: unknown channel group {g!r}")
                v[self._index[g]] = int(k)
        return v

    def macs_vector(self, v: np.ndarray) -> int:
        """MACs for a size vector (see :meth:`vector`)."""
        return int((self._coef * (self._a_out @ v) * (self._a_in @ v)).sum()) + self._const

    def macs(self, sizes: Mapping[str, int] | SubmodelSpec | None = None) -> int:
        """Forward MACs per sample with ``sizes`` (group → kept count, or a spec); others full."""
        if isinstance(sizes, SubmodelSpec):
            sizes = sizes.sizes
        return self.macs_vector(self.vector(sizes))


# --------------------------------------------------------------------------------- scores
def compute_scores(
    model: nn.Module,
    groups: Sequence[str],
    criterion: str = "magnitude",
    batches: Iterable[Any] | None = None,
    **kwargs: Any,
) -> dict[str, Tensor]:
    """Per-channel scores of ``groups`` with ``criterion`` (``magnitude`` is data-free; ``hrank`` and
    ``taylor_bn`` need ``batches``; extra keyword arguments go to the criterion)."""
    if criterion not in CRITERIA:
        raise ValueError(f"criterion must be one of {CRITERIA}, got {criterion!r}")
    if not groups:
        return {}
    if criterion == "magnitude":
        return magnitude_scores(model, groups, **kwargs)
    if batches is None:
        raise ValueError(f"criterion={criterion!r} needs batches of data")
    if criterion == "hrank":
        return hrank_scores(model, batches, groups, **kwargs)
    return taylor_bn_scores(model, batches, groups, **kwargs)


def _check_scores(cg: ChannelGroups, scores: Mapping[str, Tensor], allowed: Sequence[str]) -> dict[str, Tensor]:
    out = {}
    allowed_set = set(allowed)
    for g, s in scores.items():
        if g not in cg.sizes:
            raise ValueError(f"scores: unknown channel group {g!r}; known: {cg.names}")
        if g not in allowed_set:
            continue
        s = torch.as_tensor(s).detach().to(torch.float64).cpu().reshape(-1)
        if s.numel() != cg.sizes[g]:
            raise ValueError(f"scores[{g!r}] has {s.numel()} entries, the group has {cg.sizes[g]} channels")
        if not torch.isfinite(s).all():
            raise ValueError(f"scores[{g!r}] contains non-finite values")
        out[g] = s
    return out


def keep_indices(scores: Tensor, keep: int) -> Tensor:
    """The ``keep`` highest-scored channels (sorted ascending); ties: lower index pruned first."""
    order = prune_order(scores)
    d = order.numel()
    if not 1 <= keep <= d:
        raise ValueError(f"keep must be in 1..{d}, got {keep}")
    return torch.sort(order[d - keep :]).values


def plan_from_counts(model: nn.Module, scores: Mapping[str, Tensor], counts: Mapping[str, int]) -> SubmodelSpec:
    """Spec keeping, in each group of ``counts``, that many highest-scored channels."""
    cg = channel_groups_of(model)
    idx = {}
    for g, k in counts.items():
        if g not in scores:
            raise ValueError(f"counts: group {g!r} has no scores")
        if int(k) < cg.sizes[g]:
            idx[g] = keep_indices(torch.as_tensor(scores[g]), int(k))
    return SubmodelSpec(cg, idx)


def plan_from_rates(
    model: nn.Module,
    scores: Mapping[str, Tensor],
    rates: Mapping[str, float],
    *,
    min_channels: int = 1,
    max_prune_ratio: float | None = None,
    round_to: int = 1,
) -> SubmodelSpec:
    """Spec pruning ``⌊rate·d⌋`` lowest-scored channels of each group in ``rates`` (HRank count rule,
    stable ascending order, guards of :func:`fedhetero.algorithms.pruning.rates.kept_count`)."""
    cg = channel_groups_of(model)
    idx = {}
    for g, r in rates.items():
        if g not in cg.sizes or g in cg.fixed:
            raise ValueError(f"rates: {g!r} is not a prunable channel group of the model")
        if g not in scores:
            raise ValueError(f"rates: group {g!r} has no scores")
        s = torch.as_tensor(scores[g])
        if s.numel() != cg.sizes[g]:
            raise ValueError(f"scores[{g!r}] has {s.numel()} entries, the group has {cg.sizes[g]} channels")
        idx[g] = hrank_keep(s, float(r), min_channels=min_channels, max_prune_ratio=max_prune_ratio,
                            round_to=round_to)
    return SubmodelSpec(cg, idx)


def fedap_group_rates(model: nn.Module, layer_rates: Mapping[str, float], groups: Sequence[str]) -> dict[str, float]:
    """Per-group rate from per-conv FedAP rates (keyed by conv module path).

    A group written by one conv takes that conv's rate; a residual group (``policy="group"``) takes the
    weight-count-weighted mean of its producers' rates (the pooled fraction of small weights).
    """
    modules = dict(model.named_modules())
    out = {}
    for g in groups:
        prods = [p for p in group_producers(model, g) if p in layer_rates]
        if not prods:
            raise ValueError(f"layer_rates has no rate for any producer of group {g!r}")
        num = sum(float(layer_rates[p]) * modules[p].weight.numel() for p in prods)
        den = sum(modules[p].weight.numel() for p in prods)
        out[g] = num / den
    return out


# --------------------------------------------------------------------------------- budget
def _allowed_counts(d: int, *, min_channels: int, max_prune_ratio: float | None, round_to: int) -> list[int]:
    lo = kept_count(d, 1.0, min_channels=min_channels, max_prune_ratio=max_prune_ratio, round_to=round_to)
    vals = sorted({k for k in range(lo, d + 1) if k % round_to == 0 or k == d} | {lo})
    return vals


def _snap_up(k: int, allowed: list[int]) -> int:
    for v in allowed:
        if v >= k:
            return v
    return allowed[-1]


def plan_for_budget(
    model: nn.Module,
    input_shape: Sequence[int],
    budget_macs: float,
    scores: Mapping[str, Tensor] | None = None,
    *,
    policy: str = "block_internal_only",
    criterion: str = "magnitude",
    batches: Iterable[Any] | None = None,
    method: str = "threshold",
    include_linear: bool = False,
    min_channels: int = 1,
    max_prune_ratio: float | None = None,
    round_to: int = 1,
    fill: bool = True,
    verify: bool = True,
    macs_model: ChannelMacs | None = None,
) -> SubmodelSpec:
    """The largest pruning plan (by the chosen rule) whose forward MACs fit ``budget_macs``.

    Parameters
    ----------
    model, input_shape:
        the parent model and the per-sample input shape ``(C, H, W)``.
    budget_macs:
        absolute forward MACs per sample allowed (``r ×`` the plain model's MACs).
    scores:
        per-channel scores by group (higher = more important); groups not allowed by ``policy`` are
        ignored. ``None``: computed with ``criterion`` (``magnitude`` data-free; ``hrank``/``taylor_bn``
        need ``batches``).
    method:
        ``"threshold"`` (default): scores are normalised by their group mean and one
        global threshold decides every group's keep count; ``"uniform"``: one rate for every group.
        Either way the monotone 1-D parameter is bisected for the largest plan with ``MACs ≤ budget``.
    fill:
        afterwards, greedily add back the best-scored pruned channels (normalised score order) while
        the plan still fits, so that most of the budget is used.
    min_channels, max_prune_ratio, round_to:
        guards on every group's kept count (at least ``min_channels``, at most ``⌊max_prune_ratio·d⌋``
        pruned, counts a multiple of ``round_to`` or the full size).
    verify:
        build the pruned model (on the meta device: shapes only) and check with
        :func:`reparam.flops.model_macs` that its MACs equal the closed form and fit the budget
        (raises ``RuntimeError`` otherwise).

    Returns the :class:`SubmodelSpec` (the identity spec when the full model fits). Raises
    :class:`BudgetError` when even the smallest allowed plan exceeds the budget.
    """
    _check_policy(policy)
    if method not in BUDGET_METHODS:
        raise ValueError(f"method must be one of {BUDGET_METHODS}, got {method!r}")
    if isinstance(budget_macs, bool) or not isinstance(budget_macs, (int, float)) or not budget_macs > 0:
        raise ValueError(f"budget_macs must be a positive number, got {budget_macs!r}")
    cg = channel_groups_of(model)
    cm = macs_model if macs_model is not None else ChannelMacs(model, input_shape)
    allowed_groups = prunable_groups(model, policy, include_linear=include_linear)
    if scores is None:
        scores = compute_scores(model, allowed_groups, criterion, batches)
    sc = _check_scores(cg, scores, allowed_groups)
    names = [g for g in allowed_groups if g in sc]
    full = cm.full_macs
    if full <= budget_macs or not names:
        if full > budget_macs:
            raise BudgetError(f"budget_macs={budget_macs:.6g} is below the model's {full} MACs and no group "
                              f"can be pruned under policy={policy!r}")
        return SubmodelSpec(cg)
    d = {g: cg.sizes[g] for g in names}
    allowed = {g: _allowed_counts(d[g], min_channels=min_channels, max_prune_ratio=max_prune_ratio,
                                  round_to=round_to) for g in names}
    idx = {g: cm._index[g] for g in names}
    base = cm.vector()

    def macs_of(counts: Mapping[str, int]) -> int:
        v = base.copy()
        for g, k in counts.items():
            v[idx[g]] = k
        return cm.macs_vector(v)

    smallest = {g: allowed[g][0] for g in names}
    if macs_of(smallest) > budget_macs:
        raise BudgetError(
            f"budget_macs={budget_macs:.6g} cannot be met: the smallest plan allowed by min_channels="
            f"{min_channels}, max_prune_ratio={max_prune_ratio}, round_to={round_to} under policy="
            f"{policy!r} needs {macs_of(smallest)} MACs (full model {full})"
        )
    norm = {}
    for g in names:
        s = sc[g]
        mean = float(s.mean())
        norm[g] = s / mean if mean > 0 else torch.ones_like(s)

    if method == "threshold":
        cands = np.unique(np.concatenate([norm[g].numpy() for g in names]))

        def counts_at(i: int) -> dict[str, int]:  # i = -1: keep everything
            tau = -math.inf if i < 0 else float(cands[i])
            return {g: _snap_up(int((norm[g] > tau).sum()), allowed[g]) for g in names}

        lo, hi = -1, len(cands) - 1  # counts_at(hi) keeps the minimum everywhere -> fits
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if macs_of(counts_at(mid)) <= budget_macs:
                hi = mid
            else:
                lo = mid
        counts = counts_at(hi)
    else:
        def counts_rate(rate: float) -> dict[str, int]:
            return {g: _snap_up(kept_count(d[g], rate, min_channels=min_channels,
                                           max_prune_ratio=max_prune_ratio, round_to=round_to), allowed[g])
                    for g in names}

        lo_r, hi_r = 0.0, 1.0
        for _ in range(60):
            mid_r = (lo_r + hi_r) / 2
            if macs_of(counts_rate(mid_r)) <= budget_macs:
                hi_r = mid_r
            else:
                lo_r = mid_r
        counts = counts_rate(hi_r)
        if macs_of(counts) > budget_macs:
            counts = dict(smallest)

    if fill:
        counts = _greedy_fill(counts, names, norm, allowed, macs_of, budget_macs)
    spec = plan_from_counts(model, sc, counts)
    predicted = macs_of(counts)
    if verify:
        built = submodel_from(_meta_copy(model), spec)
        real = _count_macs(built, input_shape)
        if real != predicted or real > budget_macs:
            raise RuntimeError(f"plan_for_budget: built model has {real} MACs, predicted {predicted}, "
                               f"budget {budget_macs}")
    return spec


def _greedy_fill(counts: dict[str, int], names: Sequence[str], norm: Mapping[str, Tensor],
                 allowed: Mapping[str, list[int]], macs_of: Callable[[Mapping[str, int]], int],
                 budget: float) -> dict[str, int]:
    counts = dict(counts)
    order = {g: prune_order(norm[g]) for g in names}

    def next_value(g: str) -> tuple[float, int] | None:
        k = counts[g]
        steps = [v for v in allowed[g] if v > k]
        if not steps:
            return None
        d = order[g].numel()
        # the channel that would be added next: best-scored pruned one
        return float(norm[g][order[g][d - k - 1]]), steps[0]

    heap: list[tuple[float, int, str, int]] = []
    for i, g in enumerate(names):
        nv = next_value(g)
        if nv is not None:
            heapq.heappush(heap, (-nv[0], i, g, nv[1]))
    while heap:
        _, i, g, new_k = heapq.heappop(heap)
        trial = dict(counts)
        trial[g] = new_k
        if macs_of(trial) <= budget:
            counts = trial
            nv = next_value(g)
            if nv is not None:
                heapq.heappush(heap, (-nv[0], i, g, nv[1]))
    return counts


# --------------------------------------------------------------------------------- surgery
def prune(model: nn.Module, spec: SubmodelSpec | Mapping[str, Any]) -> tuple[nn.Module, SubmodelSpec]:
    """Physically prune ``model`` to the channels of ``spec`` (a spec or group → kept indices).

    Returns ``(pruned_model, spec)``; the pruned model is a new module (``model`` is untouched) whose
    state equals ``extract_state(model.state_dict(), spec)`` exactly (conv/linear slices on both sides,
    BN weights, biases and running statistics), in the same train/eval mode. In eval mode its output
    equals ``model`` loaded with :func:`fedhetero.core.hetero.submodel.masked_state` (pruned channels silenced at
    their producers). Indices are relative to ``model``; compose successive prunings with
    ``parent_spec.compose(spec)``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(spec, SubmodelSpec):
        if not isinstance(spec, Mapping):
            raise TypeError("spec must be a SubmodelSpec or a mapping group -> kept indices")
        spec = SubmodelSpec(model, spec)
    return submodel_from(model, spec), spec


def slice_tensors(tensors: Mapping[str, Tensor], spec: SubmodelSpec) -> dict[str, Tensor]:
    """Slice any subset of state-shaped tensors (e.g. a server momentum buffer keyed like the
    parameters) with ``spec``'s kept indices; keys must be state-dict keys of the parent model."""
    out = {}
    for key, t in tensors.items():
        dims = spec.groups.dims.get(key)
        if dims is None:
            raise ValueError(f"tensors: {key!r} is not a state key described by the channel groups")
        for axis, dm in enumerate(dims):
            if dm is not None and axis < t.dim():
                gpos, _ = spec.positions(dm)
                t = t.index_select(axis, gpos.to(t.device))
        out[key] = t.clone() if t is tensors[key] else t
    return out


class _Guards(TypedDict):
    """The guards :func:`kept_count` and :func:`plan_from_rates` apply to every group."""

    min_channels: int
    max_prune_ratio: float | None
    round_to: int


def fedap_prune(
    model: nn.Module,
    layer_rates: Mapping[str, float],
    batches: Sequence[Any],
    *,
    order: str = "sequential",
    policy: str = "block_internal_only",
    min_channels: int = 1,
    max_prune_ratio: float | None = None,
    round_to: int = 1,
    max_batches: int | None = 5,
) -> tuple[nn.Module, SubmodelSpec]:
    """FedAP surgery (Algorithm 3, lines 12–15): HRank filter choice at per-conv rates.

    ``layer_rates`` are the per-conv rates ``p*_l`` of :func:`fedhetero.algorithms.pruning.rates.fedap_layer_rates`
    computed on the unpruned model, keyed by conv module path. ``batches`` is a re-iterable sequence
    (5 × 100 server images by default). ``order="sequential"`` (authors' code) prunes groups in forward
    order and computes each group's ranks on the model with the earlier groups already pruned;
    ``"all_ranks_first"`` (original HRank) ranks everything on the unpruned model. Returns the pruned
    model and its spec relative to ``model``.
    """
    if order not in FEDAP_ORDERS:
        raise ValueError(f"order must be one of {FEDAP_ORDERS}, got {order!r}")
    names = [g for g in prunable_groups(model, policy)
             if any(p in layer_rates for p in group_producers(model, g))]
    rates = fedap_group_rates(model, layer_rates, names)
    guards: _Guards = {"min_channels": min_channels, "max_prune_ratio": max_prune_ratio, "round_to": round_to}
    if order == "all_ranks_first":
        scores = hrank_scores(model, batches, names, max_batches=max_batches)
        spec = plan_from_rates(model, scores, rates, **guards)
        return prune(model, spec)
    total = SubmodelSpec(model)
    current = model
    for g in names:
        if kept_count(channel_groups_of(current).sizes[g], rates[g], **guards) == channel_groups_of(current).sizes[g]:
            continue
        scores = hrank_scores(current, batches, [g], max_batches=max_batches)
        step = plan_from_rates(current, scores, {g: rates[g]}, **guards)
        current, _ = prune(current, step)
        total = total.compose(step)
    if current is model:
        current = submodel_from(model, total)
    return current, total
