"""DynamicFL model modulation: first-round expansion plans, ``DYMM`` and budget shrinking.

* :func:`plan_bottom_up` — DynamicFL Eq. 2 ("from bottom to up"): walk the expandable convs of a
  plain model in forward order from the input, give each the full default branch set while the MAC
  budget allows, then fill the remaining budget with the cheapest single branches that fit. The
  plan is a mapping ``conv path -> branch kinds`` for :func:`reparam.expand`; expanding with it
  gives a model whose forward MACs (:func:`reparam.flops.model_macs`) are at most the budget.
* :func:`dymm` — DynamicFL Eq. 6 (dynamic model modulation): classify the
  non-anchor branches by the quantiles of the local (``S_l``) and global (``S_g``) saliencies into
  redundant / important / common, fold the redundant ones into their block's anchor (eval-exact,
  Eq. 15), then grow the blocks of the important branches (highest ``S_g`` first) with the branch
  kinds they lack while the budget allows (Eq. 16 with zero-γ growth by default: exact in train
  and eval mode). If the model exceeds the budget, the lowest-``S_l`` branches are folded until it
  fits.
* :func:`shrink_to_budget` — DynamicFL Eq. 9: fold the lowest-``S_l`` branches until the model fits.

Every structural operation preserves the model's eval-mode function (folds are exact up to
rounding; zero-γ growth is bit-exact). The returned :class:`DymmReport` carries the combined
:class:`~reparam.changes.StructureChange` for :func:`update_optimizer`.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from .block import DiverseBranchBlock
from .errors import ReparamError
from .changes import StructureChange, apply_to_optimizer
from .flops import block_macs, branch_macs, conv_output_hw, measure, model_macs
from .builtin_kinds import KINDS
from .kinds import anchor_name, applicability, flagged, get_kind, is_kind, kind_names

__all__ = [
    "DEFAULT_SET",
    "plan_bottom_up",
    "applicable_kinds",
    "classify_branches",
    "dymm",
    "shrink_to_budget",
    "DymmReport",
    "update_optimizer",
]

#: the built-in phase-1 set of :func:`plan_bottom_up`: the built-in kinds flagged ``in_first_plan``
DEFAULT_SET: tuple[str, ...] = tuple(k for k in KINDS if get_kind(k).in_first_plan)
_INITS = ("zero_gamma", "random_resolve")
_GROW_MODES = ("block", "nested")

Key = tuple[str, str]


# --------------------------------------------------------------------------------------------
# helpers


def _iter_blocks(model: nn.Module) -> list[tuple[str, DiverseBranchBlock]]:
    return [(p, m) for p, m in model.named_modules() if isinstance(m, DiverseBranchBlock)]


def _names(block: DiverseBranchBlock) -> list[str]:
    return block.branch_names


def _check_kinds(kinds: Iterable[str], arg: str) -> tuple[str, ...]:
    if isinstance(kinds, str):
        raise TypeError(f"{arg} must be a sequence of branch kinds, not a string")
    out = tuple(kinds)
    bad = [k for k in out if not is_kind(k)]
    if bad:
        raise ReparamError(f"{arg} contains unknown branch kinds {bad}; accepted: {kind_names()}")
    return out


def _check_budget(budget_macs: Any) -> float:
    if isinstance(budget_macs, bool) or not isinstance(budget_macs, (int, float)):
        raise TypeError(f"budget_macs must be a number of MACs, got {type(budget_macs).__name__}")
    if not math.isfinite(budget_macs) or budget_macs < 0:
        raise ReparamError(f"budget_macs must be finite and >= 0, got {budget_macs!r}")
    return float(budget_macs)


def _pair(v: Any) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def applicable_kinds(geometry: Any) -> tuple[str, ...]:
    """Branch kinds applicable to a host conv (those whose geometry can be embedded in the host
    kernel exactly, see :func:`reparam.kinds.applicability`), in forward order.

    ``geometry`` is a ``ConvGeometry`` or an ``nn.Conv2d``. Returns ``()`` for convs that cannot
    be expanded (``K = 1`` or a geometry the package refuses).
    """
    from .geometry import ConvGeometry

    if isinstance(geometry, nn.Conv2d):
        try:
            geometry = ConvGeometry.from_conv(geometry)
        except ReparamError:
            return ()
    if not isinstance(geometry, ConvGeometry):
        raise TypeError(f"geometry must be a ConvGeometry or an nn.Conv2d, got {type(geometry).__name__}")
    if max(geometry.kernel_size) <= 1:
        return ()
    reasons = applicability(geometry)
    return tuple(k for k in kind_names() if reasons.get(k) is None)


def _block_applicable(block: DiverseBranchBlock) -> tuple[str, ...]:
    return tuple(block.applicable())


def _match(path: str, patterns: Iterable[str] | None) -> bool:
    return any(fnmatch.fnmatchcase(path, pat) for pat in (patterns or ()))


def _expandable_convs(
    model: nn.Module, input_shape: Sequence[int]
) -> tuple[int, list[tuple[str, nn.Conv2d, tuple[int, int]]]]:
    """Plain convs in forward (first-call) order with their input size, that ``expand`` can take.

    A conv qualifies when ``1 < max(K) <= 5``, it is outside any block, called exactly once, and
    has a bias or is paired with a following BatchNorm (``reparam.find_conv_bn_pairs``).
    Also returns the model's forward MACs per sample (measured in the same pass).
    """
    from .pairs import find_conv_bn_pairs

    inside_block: set[str] = set()
    for path, m in model.named_modules():
        if isinstance(m, DiverseBranchBlock):
            inside_block.update(f"{path}.{sub}" if path else sub for sub, _ in m.named_modules() if sub)
            inside_block.add(path)
    convs = {p: m for p, m in model.named_modules() if isinstance(m, nn.Conv2d) and p not in inside_block}
    order: list[str] = []
    hw: dict[str, tuple[int, int]] = {}
    calls: dict[str, int] = {}

    def conv_hook(path: str):
        def hook(mod, inp):
            calls[path] = calls.get(path, 0) + 1
            if path not in hw:
                order.append(path)
                hw[path] = (int(inp[0].shape[-2]), int(inp[0].shape[-1]))

        return hook

    macs = 0

    def mac_hook(mod, inp, out):
        nonlocal macs
        if isinstance(mod, nn.Conv2d):
            macs += out[0].numel() * (mod.in_channels // mod.groups) * mod.kernel_size[0] * mod.kernel_size[1]
        else:
            macs += (out[0].numel() if out.dim() > 1 else out.numel()) * mod.in_features

    handles = [m.register_forward_pre_hook(conv_hook(p)) for p, m in convs.items()]
    handles += [m.register_forward_hook(mac_hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    dtype, device = torch.get_default_dtype(), torch.device("cpu")
    for p in model.parameters():
        dtype, device = p.dtype, p.device
        break
    example = torch.zeros((2, *input_shape), dtype=dtype, device=device)
    flags = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            model(example[:1])
    finally:
        for h in handles:
            h.remove()
        for m, t in flags.items():
            m.training = t
    pairs = find_conv_bn_pairs(model, example).convs
    result = []
    for path in order:
        conv = convs[path]
        if not (1 < max(_pair(conv.kernel_size)) <= 5) or calls[path] != 1:
            continue
        if path not in pairs:  # a conv subclass whose form reparam does not know (never expanded)
            continue
        if conv.bias is None and pairs.get(path) is None:
            continue
        result.append((path, conv, hw[path]))
    return macs, result


# --------------------------------------------------------------------------------------------
# first-round plan


def plan_bottom_up(
    model: nn.Module,
    budget_macs: float,
    input_shape: Sequence[int],
    *,
    candidate_set: Iterable[str] | None = None,
    fill: Iterable[str] | None = None,
    include: Iterable[str] | None = None,
    exclude: Iterable[str] | None = None,
    free_branches: str = "expanded_only",
) -> dict[str, tuple[str, ...]]:
    """Plan a lossless expansion of a plain model "from bottom to up" within a MAC budget.

    Args:
        model: the plain model (convs not yet expanded; existing blocks are left out of the plan).
        budget_macs: absolute forward MACs per sample allowed for the expanded model.
        input_shape: ``(C, H, W)`` of one sample.
        candidate_set: the full set each conv gets in phase 1 (filtered by applicability);
            default: the registered kinds flagged ``in_first_plan`` (``DEFAULT_SET`` for the
            built-ins); on depthwise convs only those also in the depthwise default set.
        fill: branch kinds allowed in phase 2; default: the registered kinds flagged ``in_fill``.
        include / exclude: module-path globs restricting which convs may be expanded.
        free_branches: zero-MAC branches (``identity``, depthwise ``1x1_avg``) are added only to
            convs that the plan expands anyway (``"expanded_only"``, default, so a budget equal to the
            plain model's MACs gives an empty plan), to every applicable conv (``"always"``) or never
            (``"never"``).

    Phase 1 walks the expandable convs in forward order and gives each the applicable part of
    ``candidate_set`` while the whole set fits; it stops at the first conv whose set does not fit.
    Phase 2 considers every remaining ``(conv, kind)`` with ``kind`` in ``fill`` and adds the
    cheapest ones that fit (ascending MAC cost; ties: forward order, then branch order). When a
    largest-first pass over the same options packs more of the leftover budget, that selection is
    used instead (so tiers above 1 use the budget well, e.g. >= 90 % on LeNet-5, the FedDUMAP CNN
    and ResNet-18 whenever the branch set is not exhausted). Zero-MAC branches follow
    ``free_branches``.

    Returns ``{conv path: kinds}`` (kinds in forward order, the anchor ``"kxk"`` first) for convs that get at
    least one extra branch. Guaranteed: ``model_macs(expand(model, plan)) <= budget_macs`` whenever
    the plain model fits; an empty plan otherwise.
    """
    budget = _check_budget(budget_macs)
    cand = _check_kinds(flagged(lambda k: k.in_first_plan) if candidate_set is None else candidate_set, "candidate_set")
    fill_kinds = _check_kinds(flagged(lambda k: k.in_fill) if fill is None else fill, "fill")
    if free_branches not in ("expanded_only", "always", "never"):
        raise ReparamError(
            f"free_branches must be 'expanded_only', 'always' or 'never', got {free_branches!r}"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    input_shape = tuple(input_shape)
    macs, convs = _expandable_convs(model, input_shape)
    used = float(macs)
    if used > budget:
        return {}
    if include is not None:
        convs = [c for c in convs if _match(c[0], include)]
    if exclude is not None:
        convs = [c for c in convs if not _match(c[0], exclude)]

    plan: dict[str, set[str]] = {}
    applic = {path: applicable_kinds(conv) for path, conv, _ in convs}
    cost = {
        (path, k): branch_macs(k, conv, hw)
        for path, conv, hw in convs
        for k in applic[path]
        if not get_kind(k).anchor
    }
    free_ok = free_branches != "never"

    # phase 1: full set, bottom up, while it fits
    for path, conv, _hw in convs:
        kinds = [k for k in cand if not get_kind(k).anchor and k in applic[path]]
        if conv.groups == conv.in_channels == conv.out_channels and conv.groups > 1:
            # the depthwise default set omits the (mergeable) 1x1 branch
            kinds = [k for k in kinds if get_kind(k).in_depthwise_default]
        kinds = [k for k in kinds if cost[(path, k)] > 0 or free_ok]
        total = sum(cost[(path, k)] for k in kinds)
        if not kinds:
            continue
        if used + total > budget:
            break
        if total == 0 and free_branches == "expanded_only":
            continue
        plan[path] = set(kinds)
        used += total

    # phase 2: single branches that still fit. Two greedy orders are tried — cheapest first (the
    # spec's "cheapest branches that fit") and largest first (first-fit decreasing, which packs a
    # large leftover better) — and the one that uses more of the budget wins (ties: cheapest first).
    index = {path: i for i, (path, _, _) in enumerate(convs)}
    position = {k: i for i, k in enumerate(kind_names())}
    options = [
        (cost[(path, k)], index[path], position[k], path, k)
        for path, _, _ in convs
        for k in fill_kinds
        if not get_kind(k).anchor and k in applic[path] and k not in plan.get(path, ())
    ]
    options.sort()
    paid = [o for o in options if o[0] > 0]
    best: tuple[float, list[tuple]] | None = None
    for order in (paid, sorted(paid, key=lambda o: (-o[0], o[1], o[2]))):
        spent, chosen = used, []
        for o in order:
            if spent + o[0] <= budget:
                chosen.append(o)
                spent += o[0]
        if best is None or spent > best[0]:
            best = (spent, chosen)
    assert best is not None
    used = best[0]
    for _, _, _, path, k in best[1]:
        plan.setdefault(path, set()).add(k)
    if free_ok:
        for c, _, _, path, k in options:
            if c == 0 and (free_branches == "always" or path in plan):
                plan.setdefault(path, set()).add(k)

    anchor = anchor_name()
    return {
        path: tuple([anchor] + [k for k in kind_names() if k != anchor and k in kinds])
        for path, kinds in sorted(plan.items(), key=lambda kv: index[kv[0]])
    }


# --------------------------------------------------------------------------------------------
# classification


def _quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default method)."""
    v = sorted(values)
    if not v:
        return float("nan")
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _check_q(small_q: float, large_q: float) -> None:
    for name, q in (("small_q", small_q), ("large_q", large_q)):
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 <= q <= 1.0:
            raise ReparamError(f"{name} must be a number in [0, 1], got {q!r}")
    if small_q > large_q:
        raise ReparamError(f"small_q ({small_q}) must not exceed large_q ({large_q})")


def classify_branches(
    keys: Iterable[Key],
    s_local: Mapping[Key, float],
    s_global: Mapping[Key, float],
    *,
    use_abs: bool = True,
    small_q: float = 0.3,
    large_q: float = 0.7,
) -> tuple[dict[Key, str], dict[str, float]]:
    """Classify branches as ``"redundant"``, ``"important"`` or ``"common"``.

    DynamicFL's rule: a small local saliency marks a branch the client does not need, a large
    global saliency one worth growing.

    Among ``keys`` (the non-anchor branches of one client model) "small" means strictly below the
    ``small_q`` quantile of that signal and "large" strictly above the ``large_q`` quantile
    (linear interpolation; quantiles over the keys that have a score). Redundant: ``S_l`` small and
    ``S_g`` small; important: ``S_l`` small and ``S_g`` large; common: the rest, including branches
    missing from either score map. Returns the classes and the four thresholds.
    """
    _check_q(small_q, large_q)
    keys = list(keys)
    f = abs if use_abs else (lambda x: x)
    loc = {k: f(float(s_local[k])) for k in keys if k in s_local}
    glo = {k: f(float(s_global[k])) for k in keys if k in s_global}
    for name, d in (("s_local", loc), ("s_global", glo)):
        bad = [k for k, v in d.items() if not math.isfinite(v)]
        if bad:
            raise ReparamError(f"{name} has non-finite scores for {bad[:3]}")
    thr = {
        "local_small": _quantile(list(loc.values()), small_q),
        "local_large": _quantile(list(loc.values()), large_q),
        "global_small": _quantile(list(glo.values()), small_q),
        "global_large": _quantile(list(glo.values()), large_q),
    }
    classes: dict[Key, str] = {}
    for k in keys:
        if k not in loc or k not in glo:
            classes[k] = "common"
            continue
        l_small = loc[k] < thr["local_small"]
        g_small = glo[k] < thr["global_small"]
        g_large = glo[k] > thr["global_large"]
        if l_small and g_small:
            classes[k] = "redundant"
        elif l_small and g_large:
            classes[k] = "important"
        else:
            classes[k] = "common"
    return classes, thr


# --------------------------------------------------------------------------------------------
# report


@dataclass
class DymmReport:
    """What :func:`dymm` / :func:`shrink_to_budget` did.

    Attributes:
        classified: class of every non-anchor branch that was considered.
        folded: redundant branches folded into their anchor (Eq. 15).
        grown: ``(block path, kind)`` branches added (Eq. 16).
        shrunk: branches folded to meet the budget (lowest ``S_l`` first).
        macs_before / macs_after: forward MACs per sample before and after.
        budget: the MAC budget.
        fits: ``macs_after <= budget``.
        thresholds: the quantile thresholds used for classification.
        change: the combined structure change (for :func:`update_optimizer`).
    """

    classified: dict[Key, str] = field(default_factory=dict)
    folded: list[Key] = field(default_factory=list)
    grown: list[Key] = field(default_factory=list)
    shrunk: list[Key] = field(default_factory=list)
    macs_before: int = 0
    macs_after: int = 0
    budget: float = 0.0
    fits: bool = True
    thresholds: dict[str, float] = field(default_factory=dict)
    change: StructureChange = field(default_factory=StructureChange)

    def to_dict(self) -> dict:
        """JSON-able summary (keys ``"path:branch"``; the change as counts and paths)."""

        def k(key: Key) -> str:
            return f"{key[0]}:{key[1]}"

        def num(v: float) -> float | None:
            return None if isinstance(v, float) and not math.isfinite(v) else v

        return {
            "classified": {k(key): c for key, c in self.classified.items()},
            "counts": {
                c: sum(1 for v in self.classified.values() if v == c)
                for c in ("redundant", "important", "common")
            },
            "folded": [k(x) for x in self.folded],
            "grown": [k(x) for x in self.grown],
            "shrunk": [k(x) for x in self.shrunk],
            "macs_before": int(self.macs_before),
            "macs_after": int(self.macs_after),
            "budget": float(self.budget),
            "fits": bool(self.fits),
            "thresholds": {name: num(v) for name, v in self.thresholds.items()},
            "change": self.change.summary(),
        }


def update_optimizer(
    optimizer: torch.optim.Optimizer,
    report_or_change: DymmReport | StructureChange,
    reset_overwritten_state: bool = True,
) -> None:
    """Apply a :class:`DymmReport`'s (or a bare :class:`StructureChange`'s) change to ``optimizer``."""
    change = report_or_change.change if isinstance(report_or_change, DymmReport) else report_or_change
    apply_to_optimizer(optimizer, change, reset_overwritten_state=reset_overwritten_state)


# --------------------------------------------------------------------------------------------
# modulation


class _Tracker:
    """Closed-form MAC bookkeeping of a model under block surgery."""

    def __init__(self, model: nn.Module, input_shape: Sequence[int]) -> None:
        self.model = model
        self.input_shape = tuple(input_shape)
        self.sizes, layers = measure(model, self.input_shape)
        self.macs = int(sum(layers.values()))
        self.blocks = dict(_iter_blocks(model))

    def cost(self, path: str) -> int:
        return block_macs(self.blocks[path], self.sizes[path])

    def present(self, path: str, name: str) -> bool:
        """The branch still exists (a nested block vanishes with the branch that held it)."""
        block = self.blocks.get(path)
        if block is None or name not in _names(block):
            return False
        try:
            return self.model.get_submodule(path) is block
        except AttributeError:
            return False

    def fold(self, path: str, name: str, change: StructureChange) -> bool:
        if not self.present(path, name):
            return False
        block = self.blocks[path]
        before = self.cost(path)
        change.extend(block.remove_branch(name))
        self.macs += self.cost(path) - before
        return True

    def grow_cost(self, path: str, kind: str) -> int:
        block = self.blocks[path]
        return branch_macs(kind, block.geometry, self.sizes[path])

    def grow(self, path: str, kind: str, init: str, change: StructureChange) -> None:
        block = self.blocks[path]
        before = self.cost(path)
        change.extend(block.add_branch(kind, init=init))
        self.macs += self.cost(path) - before

    def nested_site(self, path: str, name: str) -> tuple[str, Any, tuple[int, int]] | None:
        """``(nested block path, conv geometry, conv input size)`` of branch ``name``'s K×K conv
        when nested growth may add to it, else ``None``."""
        from .geometry import ConvGeometry

        block = self.blocks[path]
        k = get_kind(name)
        if k.nested_conv is None or path not in self.sizes:
            return None
        inner = block.nested_block(name)
        if inner is None and name not in block.nestable():
            return None
        geo = inner.geometry if inner is not None else ConvGeometry.from_conv(getattr(block.branches[name], k.nested_conv))
        return f"{path}.branches.{name}.{k.nested_conv}", geo, k.nested_input_hw(block.geometry, self.sizes[path])

    def nested_cost(self, path: str, name: str, kind: str) -> int | None:
        site = self.nested_site(path, name)
        if site is None:
            return None
        _, geo, hw = site
        return int(get_kind(kind).macs(geo, hw, conv_output_hw(geo, hw), {}))

    def grow_nested(self, path: str, name: str, kind: str, init: str, change: StructureChange) -> None:
        site = self.nested_site(path, name)
        assert site is not None
        block = self.blocks[path]
        before = self.cost(path)
        change.extend(block.add_nested_branch(name, kind, init=init))
        self.macs += self.cost(path) - before
        inner = block.nested_block(name)
        if inner is not None:  # later folds and growth see the nested block like any other
            self.blocks[site[0]] = inner
            self.sizes[site[0]] = site[2]

    def measure(self) -> int:
        self.macs = int(model_macs(self.model, self.input_shape))
        return self.macs


def _score_order(keys: Iterable[Key], s_local: Mapping[Key, float], use_abs: bool) -> list[Key]:
    """Keys in folding order: unscored first, then ascending (|)S_l(|); ties by path/name."""
    f = abs if use_abs else (lambda x: x)

    def sort_key(k: Key) -> tuple:
        if k not in s_local:
            return (0, 0.0, k)
        return (1, f(float(s_local[k])), k)

    return sorted(keys, key=sort_key)


def _nested_applicability(block: DiverseBranchBlock) -> dict[str, dict[str, str | None]]:
    """Per nestable (or nested) branch of ``block``: applicability of every kind to its K×K conv
    under its nested input-window policy (the anchor kind reported as absent)."""
    from .geometry import ConvGeometry

    out: dict[str, dict[str, str | None]] = {}
    nestable = set(block.nestable())
    for name in _names(block):
        inner = block.nested_block(name)
        attr = get_kind(name).nested_conv
        if attr is None or (inner is None and name not in nestable):
            continue
        geo = inner.geometry if inner is not None else ConvGeometry.from_conv(getattr(block.branches[name], attr))
        reasons = applicability(geo, crop=block.nested_crop(name))
        out[name] = {k: ("anchor" if get_kind(k).anchor else r) for k, r in reasons.items()}
    return out


def _non_anchor(model: nn.Module) -> list[Key]:
    anchor = anchor_name()
    return [(p, n) for p, b in _iter_blocks(model) for n in _names(b) if n != anchor]


def _fold_until_fits(
    tracker: _Tracker,
    s_local: Mapping[Key, float],
    budget: float,
    use_abs: bool,
    change: StructureChange,
    report: DymmReport,
) -> None:
    for key in _score_order(_non_anchor(tracker.model), s_local, use_abs):
        if tracker.macs <= budget:
            break
        if tracker.fold(key[0], key[1], change):
            report.shrunk.append(key)
    if report.shrunk:
        tracker.measure()
        # closed form and measurement agree for every branch layout of this package; this loop
        # only matters if they ever did not
        for key in _score_order(_non_anchor(tracker.model), s_local, use_abs):
            if tracker.macs <= budget:
                break
            if tracker.fold(key[0], key[1], change):
                report.shrunk.append(key)
                tracker.measure()


def _check_scores(name: str, s: Any) -> Mapping[Key, float]:
    if not isinstance(s, Mapping):
        raise TypeError(f"{name} must be a mapping (block path, branch name) -> float, got {type(s).__name__}")
    return s


def dymm(
    model: nn.Module,
    s_local: Mapping[Key, float],
    s_global: Mapping[Key, float],
    budget_macs: float,
    input_shape: Sequence[int],
    *,
    use_abs: bool = True,
    small_q: float = 0.3,
    large_q: float = 0.7,
    max_new_per_round: int | None = None,
    init: str = "zero_gamma",
    pool: Iterable[str] | None = None,
    regrow_folded: bool = False,
    grow_mode: str = "block",
) -> DymmReport:
    """Dynamic model modulation (DynamicFL Eq. 6), in place: fold redundant branches, grow
    important ones, stay within the MAC budget.

    Args:
        model: a model with ``DiverseBranchBlock`` modules (the temporary model ``ε``).
        s_local: ``S_l`` per ``(block path, branch name)`` (last local epoch of the previous round).
        s_global: ``S_g`` per ``(block path, branch name)`` (the epoch trained on ``ε``).
        budget_macs: absolute forward MACs per sample allowed.
        input_shape: ``(C, H, W)`` of one sample.
        use_abs: classify on absolute scores (default) or signed ones.
        small_q / large_q: the quantiles for "small" and "large".
        max_new_per_round: cap on the number of branches grown (``None``: no cap).
        init: new-branch initialisation, ``"zero_gamma"`` (exact in train and eval mode) or
            ``"random_resolve"`` (paper-literal Eq. 16, exact in eval mode only).
        pool: branch kinds growth may add (filtered by each block's applicability); default: the
            registered kinds flagged ``growable``.
        regrow_folded: allow growth to re-add a kind folded from the same block in this call.
        grow_mode: ``"block"`` grows kinds of the important branch's block; ``"nested"`` then also
            grows kinds inside that block's ``K×K`` convs (the anchor's conv, ``1x1_kxk``'s second
            stage; :meth:`~reparam.DiverseBranchBlock.add_nested_branch`), each only if it fits.

    Steps: (1) classify the non-anchor branches (:func:`classify_branches`); (2) fold every
    redundant branch into its block's anchor; (3) if the model exceeds the budget, fold branches in
    ascending ``S_l`` order until it fits (no growth then); otherwise (4) for the important branches
    in descending ``S_g`` order, add to their block the kinds it lacks (forward order), each only if
    it fits the budget, up to ``max_new_per_round``.

    Guarantees: the eval-mode function of the model is unchanged (up to rounding of the folds);
    ``report.macs_after <= budget_macs`` unless even the all-anchor model exceeds it
    (``report.fits`` is then ``False``). A block left with only its anchor stays a block.
    """
    budget = _check_budget(budget_macs)
    s_local = _check_scores("s_local", s_local)
    s_global = _check_scores("s_global", s_global)
    _check_q(small_q, large_q)
    if init not in _INITS:
        raise ReparamError(f"init must be one of {_INITS}, got {init!r}")
    if max_new_per_round is not None and (
        isinstance(max_new_per_round, bool) or not isinstance(max_new_per_round, int) or max_new_per_round < 0
    ):
        raise ReparamError(f"max_new_per_round must be None or an int >= 0, got {max_new_per_round!r}")
    pool = _check_kinds(flagged(lambda k: k.growable) if pool is None else pool, "pool")
    if grow_mode not in _GROW_MODES:
        raise ReparamError(f"grow_mode must be one of {_GROW_MODES}, got {grow_mode!r}")

    tracker = _Tracker(model, input_shape)
    change = StructureChange()
    keys = _non_anchor(model)
    classes, thr = classify_branches(
        keys, s_local, s_global, use_abs=use_abs, small_q=small_q, large_q=large_q
    )
    report = DymmReport(classified=classes, macs_before=tracker.macs, budget=budget, thresholds=thr)

    # (2) fold redundant branches into their anchor (Eq. 15)
    folded_kinds: dict[str, set[str]] = {}
    for key in keys:
        if classes[key] == "redundant" and tracker.fold(key[0], key[1], change):
            report.folded.append(key)
            folded_kinds.setdefault(key[0], set()).add(key[1])

    # (3) over budget: fold lowest S_l until it fits
    if tracker.macs > budget:
        _fold_until_fits(tracker, s_local, budget, use_abs, change, report)
    else:
        # (4) grow the blocks of important branches, highest S_g first (Eq. 16)
        f = abs if use_abs else (lambda x: x)
        important = [k for k in keys if classes[k] == "important"]
        important.sort(key=lambda k: (-f(float(s_global[k])), k))
        seen: set[str] = set()
        added = 0
        cap = math.inf if max_new_per_round is None else max_new_per_round
        for path, name in important:
            if path in seen or not tracker.present(path, name):
                continue
            seen.add(path)
            block = tracker.blocks[path]
            present = set(_names(block))
            applicable = _block_applicable(block)
            for kind in kind_names():
                if added >= cap:
                    break
                if get_kind(kind).anchor or kind in present or kind not in applicable or kind not in pool:
                    continue
                if not regrow_folded and kind in folded_kinds.get(path, ()):
                    continue
                if tracker.macs + tracker.grow_cost(path, kind) > budget:
                    continue
                tracker.grow(path, kind, init, change)
                report.grown.append((path, kind))
                added += 1
            if grow_mode != "nested":
                continue
            nested_reasons = _nested_applicability(block)
            for name in _names(block):
                for kind in kind_names():
                    if added >= cap:
                        break
                    if kind not in pool or nested_reasons.get(name, {}).get(kind, "absent") is not None:
                        continue
                    inner = block.nested_block(name)
                    if inner is not None and kind in _names(inner):
                        continue
                    cost = tracker.nested_cost(path, name, kind)
                    if cost is None or tracker.macs + cost > budget:
                        continue
                    site = tracker.nested_site(path, name)
                    assert site is not None
                    tracker.grow_nested(path, name, kind, init, change)
                    report.grown.append((site[0], kind))  # (nested block path, kind)
                    added += 1

    report.macs_after = tracker.measure()
    if report.macs_after > budget:  # only if closed form and measurement ever disagree
        for key in reversed(list(report.grown)):
            if tracker.macs <= budget:
                break
            if tracker.fold(key[0], key[1], change):
                report.grown.remove(key)
                tracker.measure()
        if tracker.macs > budget:
            _fold_until_fits(tracker, s_local, budget, use_abs, change, report)
        report.macs_after = tracker.measure()
    report.fits = report.macs_after <= budget
    report.change = change
    return report


def shrink_to_budget(
    model: nn.Module,
    s_local: Mapping[Key, float],
    budget_macs: float,
    input_shape: Sequence[int],
    *,
    use_abs: bool = True,
) -> DymmReport:
    """Fold the lowest-``S_l`` branches until the model fits the budget (DynamicFL Eq. 9), in place.

    Branches without a score are folded first, then ascending ``|S_l|`` (signed with
    ``use_abs=False``). Every fold is eval-exact. Follow with ``reparam.rep_to_local`` to make the
    model equal the new global model. ``report.fits`` is ``False`` when even the all-anchor model
    exceeds the budget.
    """
    budget = _check_budget(budget_macs)
    s_local = _check_scores("s_local", s_local)
    tracker = _Tracker(model, input_shape)
    change = StructureChange()
    report = DymmReport(macs_before=tracker.macs, budget=budget)
    if tracker.macs > budget:
        _fold_until_fits(tracker, s_local, budget, use_abs, change, report)
    report.macs_after = tracker.measure()
    report.fits = report.macs_after <= budget
    report.change = change
    return report
