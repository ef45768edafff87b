"""Channel-group sub-models: kept-index specs, extraction, physical sub-models and count-based scatter.

Every zoo model describes its channel structure with ``model.channel_groups()``
(:class:`fedhetero.models.groups.ChannelGroups`): for each state-dict key, which channel group indexes dim 0 and
dim 1 (a Linear after a channel-major flatten reads each channel as ``H·W`` consecutive features; a
layer after a concat reads an ordered list of groups; identity residuals share one group; ``input`` and
``classes`` are never sliced). A :class:`SubmodelSpec` chooses the kept channel indices of every group
(sorted ``LongTensor``s relative to the parent), and everything else follows from it:

* :func:`prefix_spec` (HeteroFL nested ``⌈C·s⌉`` prefix), :func:`rolling_spec` (FedRolex cyclic
  window), :func:`random_spec` (one random subset per group, so residual ties stay aligned) and
  arbitrary index sets (structured pruning);
* :func:`extract_state` / :func:`gather` slice a parent state dict; :func:`submodel_from` builds the
  physically smaller model whose ``state_dict()`` equals that slice (BN running statistics included);
* :func:`scatter_add_` + :func:`finalize` (or :class:`SubmodelAggregator`) average sub-model updates
  into global-shaped ``sum``/``count`` buffers; a coordinate nobody updated (``count == 0``) keeps its
  previous value bit for bit, it is never zeroed. Optional classifier masking counts only the rows of
  classes in a client's label set;
* :func:`scatter` writes a sub-state back into a parent state; ``gather(scatter(g, s, spec), spec) == s``
  and ``scatter(g, gather(g, spec), spec) == g`` exactly.

Exactness: slicing, scattering and the masked-forward identity are index operations (bit-exact).
Averages are accumulated in float64 buffers by default and rounded once to the entry's dtype.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import numpy as np
import torch
from torch import Tensor, nn

from fedhetero.models.groups import CLASSES, INPUT, ChannelGroups, DimMap, scale_channels

__all__ = [
    "ChannelGroups",
    "SubmodelSpec",
    "channel_groups_of",
    "keep_count",
    "full_spec",
    "prefix_spec",
    "rolling_spec",
    "random_spec",
    "extract_state",
    "gather",
    "scatter",
    "submodel_from",
    "masked_state",
    "init_buffers",
    "scatter_add_",
    "finalize",
    "SubmodelAggregator",
    "INPUT",
    "CLASSES",
]

GroupsLike = Union[ChannelGroups, nn.Module]
Weight = Union[float, Mapping[str, Union[float, Tensor]]]


def channel_groups_of(model_or_groups: GroupsLike) -> ChannelGroups:
    """Return ``model.channel_groups()`` for a model, or the :class:`ChannelGroups` itself."""
    if isinstance(model_or_groups, ChannelGroups):
        return model_or_groups
    fn = getattr(model_or_groups, "channel_groups", None)
    if not callable(fn):
        raise TypeError(
            "expected a ChannelGroups or a model with a channel_groups() method, got "
            f"{type(model_or_groups).__name__}"
        )
    groups = fn()
    if not isinstance(groups, ChannelGroups):
        raise TypeError(f"channel_groups() must return ChannelGroups, got {type(groups).__name__}")
    return groups


def keep_count(channels: int, ratio: float) -> int:
    """Number of kept channels at ``ratio``: ``max(1, ceil(channels · ratio))`` (HeteroFL rule)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"ratio must be a number in (0, 1], got {ratio!r}")
    return min(channels, scale_channels(channels, float(ratio)))


def _as_index(group: str, value: Any, size: int) -> Tensor:
    try:
        idx = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"indices of group {group!r} must be a 1-D sequence of ints") from None
    if idx.dim() != 1 or (idx.numel() and (idx.dtype.is_floating_point or idx.dtype == torch.bool)):
        raise ValueError(f"indices of group {group!r} must be a 1-D sequence of ints, got {value!r}")
    idx = idx.to(torch.long).cpu()
    if idx.numel() == 0:
        raise ValueError(f"group {group!r} must keep at least one channel")
    idx, _ = torch.sort(idx)
    if int(idx[0]) < 0 or int(idx[-1]) >= size:
        raise ValueError(f"indices of group {group!r} must lie in [0, {size}), got {idx.tolist()[:8]}…")
    if idx.numel() > 1 and bool((idx[1:] == idx[:-1]).any()):
        raise ValueError(f"indices of group {group!r} contain duplicates")
    return idx


class SubmodelSpec:
    """Kept channel indices of every channel group of a parent model.

    Parameters
    ----------
    groups:
        the parent's :class:`ChannelGroups` (or the parent model itself).
    indices:
        group name -> kept indices (any 1-D int sequence; stored sorted, unique, as ``LongTensor``).
        Groups not mentioned keep all channels. Fixed groups (``input``, ``classes``) may only be given
        in full.

    The spec is immutable in practice (index tensors are private copies), serialisable to JSON
    (:meth:`to_dict`) and to a ``torch.save(..., weights_only=True)``-loadable dict of tensors
    (:meth:`state_dict`); both load with :meth:`from_dict`.
    """

    def __init__(self, groups: GroupsLike, indices: Mapping[str, Any] | None = None) -> None:
        self.groups = channel_groups_of(groups)
        given = dict(indices or {})
        unknown = [g for g in given if g not in self.groups.sizes]
        if unknown:
            raise ValueError(f"unknown channel groups {unknown}; known groups: {self.groups.names}")
        self._idx: dict[str, Tensor] = {}
        for g, size in self.groups.sizes.items():
            if g in given:
                idx = _as_index(g, given[g], size)
                if g in self.groups.fixed and idx.numel() != size:
                    raise ValueError(f"group {g!r} is fixed and must keep all {size} channels")
                self._idx[g] = idx
            else:
                self._idx[g] = torch.arange(size)
        self._pos_cache: dict[tuple[DimMap, tuple[int, ...] | None], tuple[Tensor, Tensor]] = {}

    # ------------------------------------------------------------------ queries
    def kept(self, group: str) -> Tensor:
        """Sorted kept indices of ``group`` (a copy)."""
        try:
            return self._idx[group].clone()
        except KeyError:
            raise ValueError(f"unknown channel group {group!r}; known groups: {self.groups.names}") from None

    @property
    def indices(self) -> dict[str, Tensor]:
        """group -> kept indices (copies)."""
        return {g: i.clone() for g, i in self._idx.items()}

    @property
    def sizes(self) -> dict[str, int]:
        """Kept channel count of every group (the sub-model's group sizes)."""
        return {g: int(i.numel()) for g, i in self._idx.items()}

    def is_full(self, group: str | None = None) -> bool:
        """Whether ``group`` (or every group) keeps all its channels."""
        names = [group] if group is not None else list(self._idx)
        return all(self._idx[g].numel() == self.groups.sizes[g] for g in names)

    def ratio(self, group: str) -> float:
        """Kept fraction of ``group``."""
        return self._idx[group].numel() / self.groups.sizes[group]

    def compose(self, child: SubmodelSpec) -> SubmodelSpec:
        """Indices of a sub-sub-model relative to this spec's parent: ``kept[child.kept]``.

        ``child`` must be a spec of the sub-model described by ``self`` (its group sizes equal
        :attr:`sizes`).
        """
        if child.groups.sizes != self.sizes or set(child.groups.dims) != set(self.groups.dims):
            raise ValueError("child spec does not describe this spec's sub-model (group sizes differ)")
        return SubmodelSpec(self.groups, {g: self._idx[g][child._idx[g]] for g in self._idx})

    def positions(self, dimmap: DimMap, labels: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(parent positions, sub positions)`` of one tensor dimension described by ``dimmap``.

        With ``labels``, positions of the ``classes`` group whose class is not in ``labels`` are left
        out of both tensors.
        """
        lab_key = None if labels is None else tuple(int(v) for v in labels.tolist())
        cached = self._pos_cache.get((dimmap, lab_key))
        if cached is not None:
            return cached
        g_parts, l_parts = [], []
        g_off = l_off = 0
        for group, rep in dimmap:
            kept = self._idx[group]
            local = torch.arange(kept.numel())
            if labels is not None and group == CLASSES:
                mask = torch.isin(kept, labels)
                kept, local = kept[mask], local[mask]
            ar = torch.arange(rep)
            g_parts.append((g_off + kept[:, None] * rep + ar).reshape(-1))
            l_parts.append((l_off + local[:, None] * rep + ar).reshape(-1))
            g_off += self.groups.sizes[group] * rep
            l_off += self._idx[group].numel() * rep
        out = (torch.cat(g_parts), torch.cat(l_parts))
        self._pos_cache[(dimmap, lab_key)] = out
        return out

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form: ``{"groups": ..., "indices": {group: [int, ...]}}`` (full groups
        are omitted from ``indices``)."""
        return {
            "groups": self.groups.to_dict(),
            "indices": {g: i.tolist() for g, i in self._idx.items() if not self.is_full(g)},
        }

    def state_dict(self) -> dict[str, Any]:
        """Like :meth:`to_dict` but with ``LongTensor`` indices (loads with ``weights_only=True``)."""
        return {
            "groups": self.groups.to_dict(),
            "indices": {g: i.clone() for g, i in self._idx.items() if not self.is_full(g)},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SubmodelSpec:
        """Inverse of :meth:`to_dict` and :meth:`state_dict`."""
        if not isinstance(data, Mapping) or "groups" not in data:
            raise ValueError("SubmodelSpec.from_dict expects a mapping with 'groups' and 'indices'")
        return cls(ChannelGroups.from_dict(data["groups"]), data.get("indices", {}))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SubmodelSpec):
            return NotImplemented
        return self.groups == other.groups and all(
            torch.equal(self._idx[g], other._idx[g]) for g in self._idx
        )

    __hash__ = None  # type: ignore[assignment]  # unhashable (it defines __eq__); typeshed wants a method

    def __repr__(self) -> str:
        parts = [f"{g}: {self._idx[g].numel()}/{n}" for g, n in self.groups.sizes.items() if not self.is_full(g)]
        return f"SubmodelSpec({', '.join(parts) or 'full'})"


# ---------------------------------------------------------------------------------- extractors
def full_spec(model: GroupsLike) -> SubmodelSpec:
    """The identity spec (every channel kept)."""
    return SubmodelSpec(model)


def _by_ratio(model: GroupsLike, ratio: float, pick: Callable[[str, int, int], Tensor]) -> SubmodelSpec:
    groups = channel_groups_of(model)
    keep_count(1, ratio)  # validates ratio
    return SubmodelSpec(
        groups, {g: pick(g, n, keep_count(n, ratio)) for g, n in groups.sizes.items() if g not in groups.fixed}
    )


def prefix_spec(model: GroupsLike, ratio: float) -> SubmodelSpec:
    """HeteroFL nested slice: the first ``max(1, ⌈C·ratio⌉)`` channels of every non-fixed group.

    A width-``r`` zoo model built from scratch has exactly the sizes of ``prefix_spec(width-1 model, r)``.
    """
    return _by_ratio(model, ratio, lambda g, n, k: torch.arange(k))


def rolling_spec(model: GroupsLike, ratio: float, offset: int) -> SubmodelSpec:
    """FedRolex cyclic window: ``k = ⌈C·ratio⌉`` consecutive channels starting at ``offset mod C``
    (wrapping around), stored sorted. Every group uses the same ``offset``; identity-tied groups are
    one group, so residual additions stay aligned. Upstream's window at server round ``t`` is
    ``offset = -t``."""
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
        raise ValueError(f"offset must be an integer, got {offset!r}")
    return _by_ratio(model, ratio, lambda g, n, k: (int(offset) % n + torch.arange(k)) % n)


def random_spec(
    model: GroupsLike, ratio: float, generator: torch.Generator | np.random.Generator
) -> SubmodelSpec:
    """One uniformly random ``⌈C·ratio⌉``-subset per group (drawn in forward group order from
    ``generator``, a ``torch.Generator`` or ``numpy.random.Generator``)."""
    if isinstance(generator, np.random.Generator):
        def pick(g: str, n: int, k: int) -> Tensor:
            return torch.as_tensor(generator.permutation(n)[:k], dtype=torch.long)
    elif isinstance(generator, torch.Generator):
        def pick(g: str, n: int, k: int) -> Tensor:
            return torch.randperm(n, generator=generator)[:k]
    else:
        raise TypeError(
            f"generator must be a torch.Generator or numpy.random.Generator, got {type(generator).__name__}"
        )
    return _by_ratio(model, ratio, pick)


# ---------------------------------------------------------------------------------- slicing
def _resolve(groups_or_spec: ChannelGroups | SubmodelSpec | nn.Module, spec: SubmodelSpec | None) -> SubmodelSpec:
    if spec is None:
        if not isinstance(groups_or_spec, SubmodelSpec):
            raise TypeError("pass a SubmodelSpec (as extract_state(state, spec) or (state, groups, spec))")
        return groups_or_spec
    if not isinstance(spec, SubmodelSpec):
        raise TypeError(f"spec must be a SubmodelSpec, got {type(spec).__name__}")
    if isinstance(groups_or_spec, SubmodelSpec):
        raise TypeError("expected a ChannelGroups or a model with a channel_groups() method, got SubmodelSpec")
    groups = channel_groups_of(groups_or_spec)
    if groups != spec.groups:
        raise ValueError("the channel groups passed do not match the ones the spec was made for")
    return spec


def _index_plan(
    spec: SubmodelSpec, key: str, ndim: int, labels: Tensor | None
) -> list[tuple[int, Tensor, Tensor]]:
    try:
        dims = spec.groups.dims[key]
    except KeyError:
        raise ValueError(f"state key {key!r} is not described by the channel groups") from None
    plan = []
    for axis, dm in enumerate(dims):
        if dm is not None and axis < ndim:
            gpos, lpos = spec.positions(dm, labels)
            plan.append((axis, gpos, lpos))
    return plan


def _check_keys(spec: SubmodelSpec, state: Mapping[str, Tensor], what: str) -> None:
    missing = [k for k in spec.groups.dims if k not in state]
    extra = [k for k in state if k not in spec.groups.dims]
    if missing or extra:
        raise ValueError(f"{what} does not match the channel groups: missing {missing[:5]}, unexpected {extra[:5]}")


def extract_state(
    global_state: Mapping[str, Tensor],
    groups_or_spec: ChannelGroups | SubmodelSpec | nn.Module,
    spec: SubmodelSpec | None = None,
) -> dict[str, Tensor]:
    """Slice a parent (global-shaped) state dict to the sub-model of ``spec``.

    Call as ``extract_state(state, groups, spec)`` or ``extract_state(state, spec)``. Returns new
    tensors (never views of ``global_state``); keys in the order of the groups description.
    """
    spec = _resolve(groups_or_spec, spec)
    spec.groups.check_state(global_state)
    out: dict[str, Tensor] = {}
    for key in spec.groups.dims:
        t = global_state[key]
        for axis, gpos, _ in _index_plan(spec, key, t.dim(), None):
            t = t.index_select(axis, gpos.to(t.device))
        out[key] = t.clone() if t is global_state[key] else t
    return out


def gather(global_state: Mapping[str, Tensor], spec: SubmodelSpec) -> dict[str, Tensor]:
    """Same as :func:`extract_state` ``(global_state, spec)``."""
    return extract_state(global_state, spec)


def _broadcast_index(plan: list[tuple[int, Tensor, Tensor]], device: torch.device) -> tuple[Tensor, ...]:
    """Broadcastable advanced-index tuple for the leading dims of ``plan`` (dims 0..n-1 all present)."""
    n = len(plan)
    index: list[Tensor] = []
    for axis, (a, g, _) in enumerate(sorted(plan, key=lambda p: p[0])):
        if a != axis:  # pragma: no cover - _plan_full guarantees contiguous leading dims
            raise AssertionError("index plan must cover leading dims")
        shape = [1] * n
        shape[axis] = -1
        index.append(g.to(device).view(shape))
    return tuple(index)


def _plan_full(plan: list[tuple[int, Tensor, Tensor]], shape: Sequence[int]) -> list[tuple[int, Tensor, Tensor]]:
    """Add a full index for dim 0 when only dim 1 is sliced (index_put_ needs leading indices)."""
    axes = {a for a, _, _ in plan}
    if plan and 0 not in axes:
        full = torch.arange(shape[0])
        plan = [(0, full, full)] + plan
    return plan


def _take_local(value: Tensor, plan: list[tuple[int, Tensor, Tensor]]) -> Tensor:
    for axis, _, lpos in plan:
        if lpos.numel() != value.shape[axis] or not torch.equal(lpos, torch.arange(value.shape[axis])):
            value = value.index_select(axis, lpos.to(value.device))
    return value


def _check_sub(spec: SubmodelSpec, key: str, sub: Tensor, parent_shape: Sequence[int]) -> None:
    want = list(parent_shape)
    for axis, dm in enumerate(spec.groups.dims[key]):
        if dm is not None and axis < len(want):
            want[axis] = sum(spec._idx[g].numel() * r for g, r in dm)
    if list(sub.shape) != want:
        raise ValueError(f"sub-state[{key!r}] has shape {tuple(sub.shape)}, the spec expects {tuple(want)}")


def scatter(
    global_state: Mapping[str, Tensor],
    sub_state: Mapping[str, Tensor],
    spec: SubmodelSpec,
    *,
    inplace: bool = False,
) -> dict[str, Tensor]:
    """Write ``sub_state`` into the kept positions of ``global_state`` (other positions untouched).

    Returns a new dict of new tensors unless ``inplace=True`` (then ``global_state``'s tensors are
    written and returned in a new dict). Exact: ``gather(scatter(g, s, spec), spec) == s``.
    """
    spec.groups.check_state(global_state)
    _check_keys(spec, sub_state, "sub_state")
    out: dict[str, Tensor] = {}
    for key in spec.groups.dims:
        dst = global_state[key] if inplace else global_state[key].clone()
        src = sub_state[key]
        plan = _index_plan(spec, key, dst.dim(), None)
        _check_sub(spec, key, src, dst.shape)
        if not plan:
            dst.copy_(src)
        else:
            plan = _plan_full(plan, dst.shape)
            dst.index_put_(_broadcast_index(plan, dst.device), src.to(dst.dtype))
        out[key] = dst
    return out


# ---------------------------------------------------------------------------------- sub-models
def _pair(size: tuple[int, ...]) -> tuple[int, int]:
    """A 2-D convolution's kernel size, stride, padding or dilation (``_ConvNd`` types them as
    tuples of any length)."""
    h, w = size
    return h, w


def _resized(module: nn.Module, shapes: dict[str, torch.Size], path: str) -> nn.Module | None:
    """A fresh module of ``module``'s kind with the sliced shapes, or ``None`` if unchanged."""
    tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
    current = {n: t.shape for n, t in tensors if t is not None}
    if all(current.get(n) == s for n, s in shapes.items()):
        return None
    p = next(iter(list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))))
    device, dtype = p.device, (p.dtype if p.is_floating_point() else None)
    if isinstance(module, nn.Conv2d):
        if module.groups != 1:
            raise ValueError(f"{path}: cannot slice a grouped convolution (groups={module.groups})")
        out_c, in_c = shapes["weight"][0], shapes["weight"][1]
        padding = module.padding if isinstance(module.padding, str) else _pair(module.padding)
        new: nn.Module = nn.Conv2d(
            in_c, out_c, _pair(module.kernel_size), _pair(module.stride), padding, _pair(module.dilation), 1,
            bias=module.bias is not None, padding_mode=module.padding_mode, device=device, dtype=dtype,
        )
    elif isinstance(module, nn.Linear):
        out_f, in_f = shapes["weight"]
        new = nn.Linear(in_f, out_f, bias=module.bias is not None, device=device, dtype=dtype)
    elif isinstance(module, nn.modules.batchnorm._BatchNorm):
        n = next(s[0] for name, s in shapes.items() if len(s) == 1)
        new = type(module)(
            n, eps=module.eps, momentum=module.momentum, affine=module.affine,
            track_running_stats=module.track_running_stats, device=device, dtype=dtype,
        )
    elif isinstance(module, nn.GroupNorm) and module.num_groups == 1:
        # GroupNorm(1, C) has one statistics group whatever C is, so it resizes like BatchNorm
        n = next(s[0] for name, s in shapes.items() if len(s) == 1)
        new = nn.GroupNorm(1, n, eps=module.eps, affine=module.affine, device=device, dtype=dtype)
    else:
        raise TypeError(
            f"{path}: cannot resize a {type(module).__name__}; sub-models support Conv2d, Linear, "
            "BatchNorm and GroupNorm(1, C) layers"
        )
    new.train(module.training)
    for name, param in new.named_parameters(recurse=False):
        param.requires_grad_(getattr(module, name).requires_grad)
    return new


def submodel_from(model: nn.Module, spec: SubmodelSpec, state: Mapping[str, Tensor] | None = None) -> nn.Module:
    """A physically smaller copy of ``model`` keeping the channels of ``spec``.

    Its ``state_dict()`` equals ``extract_state(state or model.state_dict(), spec)`` exactly (BN
    running statistics and counters included), its ``channel_groups()`` reports the kept sizes, and in
    eval mode its output equals ``model`` loaded with :func:`masked_state` (up to float summation order).
    ``model`` is not modified. Only ``Conv2d`` (``groups=1``), ``Linear`` and BatchNorm layers are resized.
    """
    groups = channel_groups_of(model)
    if groups != spec.groups:
        raise ValueError("spec was made for a model with different channel groups")
    sub_state = extract_state(model.state_dict() if state is None else state, spec)
    sub = copy.deepcopy(model)
    by_module: dict[str, dict[str, torch.Size]] = {}
    for key, t in sub_state.items():
        path, _, name = key.rpartition(".")
        by_module.setdefault(path, {})[name] = t.shape
    for path, shapes in by_module.items():
        module = sub.get_submodule(path)
        new = _resized(module, shapes, path)
        if new is None:
            continue
        parent_path, _, child = path.rpartition(".")
        setattr(sub.get_submodule(parent_path) if parent_path else sub, child, new)
    sub.load_state_dict(sub_state, strict=True)
    return sub


def masked_state(global_state: Mapping[str, Tensor], spec: SubmodelSpec) -> dict[str, Tensor]:
    """Copy of ``global_state`` with every non-kept channel silenced at its producers.

    Rows (dim 0) of non-kept channels are zeroed in conv/linear weights and biases and in BN weight
    and bias, so those channels are exactly 0 after BN and ReLU in train and eval mode; the model with
    this state computes the same function as :func:`submodel_from` (which makes it the reference the
    pruning tests compare physically pruned models against). BN running statistics are left unchanged.
    """
    spec.groups.check_state(global_state)
    out = {k: v.clone() for k, v in global_state.items()}
    for key, (d0, _) in spec.groups.dims.items():
        if d0 is None or key.endswith(("running_mean", "running_var")):
            continue
        t = out[key]
        if not t.is_floating_point():
            continue
        gpos, _ = spec.positions(d0)
        mask = torch.ones(t.shape[0], dtype=torch.bool)
        mask[gpos] = False
        t[mask.to(t.device)] = 0
    return out


# ---------------------------------------------------------------------------------- aggregation
def init_buffers(
    global_state: Mapping[str, Tensor], dtype: torch.dtype = torch.float64
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Zero ``sum`` and ``count`` buffers shaped like ``global_state`` (``dtype``, same device)."""
    s = {k: torch.zeros(v.shape, dtype=dtype, device=v.device) for k, v in global_state.items()}
    c = {k: torch.zeros(v.shape, dtype=dtype, device=v.device) for k, v in global_state.items()}
    return s, c


def _labels_tensor(labels: Sequence[int] | Tensor | None, spec: SubmodelSpec) -> Tensor | None:
    if labels is None:
        return None
    t = torch.as_tensor(labels)
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"labels must be a 1-D sequence of class indices, got {labels!r}")
    t = torch.unique(t.to(torch.long).cpu())
    n = spec.groups.sizes.get(CLASSES)
    if n is None:
        raise ValueError("labels given but the model has no 'classes' group")
    if t.numel() and (int(t[0]) < 0 or int(t[-1]) >= n):
        raise ValueError(f"labels must lie in [0, {n}), got {t.tolist()}")
    return t


def scatter_add_(
    sum_buf: dict[str, Tensor],
    count_buf: dict[str, Tensor],
    sub_state: Mapping[str, Tensor],
    spec: SubmodelSpec,
    weight: Weight = 1.0,
    *,
    labels: Sequence[int] | Tensor | None = None,
) -> None:
    """Add one client's sub-model state into global-shaped buffers (in place).

    ``sum[pos] += w · sub`` and ``count[pos] += w`` at the parent positions of ``spec``. ``weight`` is
    one number or a mapping ``key -> number | tensor broadcastable to the sub tensor`` (missing keys
    use 1). With ``labels``, rows of the ``classes`` group (classifier weight rows and bias entries)
    are added and counted only for classes in ``labels``. Scalars (``num_batches_tracked``) are added
    whole. Iterate clients in a fixed (sorted) order for bit-reproducible sums.
    """
    _check_keys(spec, sub_state, "sub_state")
    lab = _labels_tensor(labels, spec)
    for key in spec.groups.dims:
        sbuf, cbuf = sum_buf[key], count_buf[key]
        src = sub_state[key]
        plan = _index_plan(spec, key, sbuf.dim(), lab)
        _check_sub(spec, key, src, sbuf.shape)
        w = weight.get(key, 1.0) if isinstance(weight, Mapping) else weight
        val = src.to(device=sbuf.device, dtype=sbuf.dtype)
        wt = torch.as_tensor(w, dtype=sbuf.dtype, device=sbuf.device)
        if not plan:
            sbuf.add_(val * wt)
            cbuf.add_(torch.ones_like(val) * wt)
            continue
        weighted = torch.ones_like(val) * wt
        val = _take_local(val * wt, plan)
        weighted = _take_local(weighted, plan)
        if any(g.numel() == 0 for _, g, _ in plan):
            continue
        plan = _plan_full(plan, sbuf.shape)
        index = _broadcast_index(plan, sbuf.device)
        sbuf.index_put_(index, val, accumulate=True)
        cbuf.index_put_(index, weighted, accumulate=True)


def finalize(
    global_state: Mapping[str, Tensor], sum_buf: Mapping[str, Tensor], count_buf: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """New state: ``sum / count`` where ``count > 0`` (cast to each entry's dtype; integers rounded),
    the old value bit-identical where ``count == 0``. Returns new tensors."""
    out: dict[str, Tensor] = {}
    for key, old in global_state.items():
        s, c = sum_buf[key], count_buf[key]
        hit = c > 0
        mean = torch.where(hit, s / torch.where(hit, c, torch.ones_like(c)), torch.zeros_like(s))
        if not old.is_floating_point():
            mean = torch.round(mean)
        new = old.clone()
        new[hit] = mean[hit].to(old.dtype)
        out[key] = new
    return out


class SubmodelAggregator:
    """Count-based averaging of sub-model updates (HeteroFL/FedRolex ``combine``).

    ``agg = SubmodelAggregator(global_state); agg.add(state, spec, weight, labels=...); new = agg.result()``.
    ``spec=None`` means a global-shaped (full) update.
    """

    def __init__(
        self,
        global_state: Mapping[str, Tensor],
        groups: GroupsLike | None = None,
        *,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        self.global_state = dict(global_state)
        self._full = None if groups is None else full_spec(groups)
        self.sum, self.count = init_buffers(global_state, dtype)

    def add(
        self,
        state: Mapping[str, Tensor],
        spec: SubmodelSpec | None = None,
        weight: Weight = 1.0,
        *,
        labels: Sequence[int] | Tensor | None = None,
    ) -> None:
        """Accumulate one update (see :func:`scatter_add_`)."""
        if spec is None:
            if self._full is None:
                raise ValueError("spec=None needs the aggregator to be built with groups=")
            spec = self._full
        scatter_add_(self.sum, self.count, state, spec, weight, labels=labels)

    def result(self) -> dict[str, Tensor]:
        """The averaged state (:func:`finalize`)."""
        return finalize(self.global_state, self.sum, self.count)
