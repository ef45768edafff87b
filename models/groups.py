"""Channel groups: which channel space indexes each dimension of each state-dict tensor.

A *channel group* is a set of channel positions that must be kept or dropped together when a model is
sliced into a narrower sub-model (HeteroFL/FedRolex width slices, structured pruning). Every model of
the zoo declares its groups through ``model.channel_groups()``, which returns a :class:`ChannelGroups`:

* ``sizes`` maps each group name to its channel count in *this* model (computed from the current
  module shapes, so a physically sliced sub-model reports its own, smaller sizes).
* ``dims`` maps every state-dict key to ``(dim0, dim1)``. Each entry is ``None`` (that dimension is
  never sliced) or a :data:`DimMap`: an ordered tuple of ``(group, repeat)`` segments. The dimension is
  the concatenation of the segments; channel ``c`` of a segment with repeat ``s`` owns the ``s``
  consecutive positions ``offset + c*s … offset + c*s + s - 1`` (``s = H*W`` for a linear layer after a
  channel-major flatten, ``1`` otherwise). Concatenated outputs (GoogLeNet inception modules) are
  several segments; an identity residual *ties* groups simply by using the same group name for the
  block input and output.
* ``fixed`` names the groups that are never sliced: ``"input"`` (image channels) and ``"classes"``
  (logits).

This module is pure Python (no torch import at module level) so that ``models`` stays torch-only and
``fedhetero`` can consume the description without knowing the architectures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "INPUT",
    "CLASSES",
    "Segment",
    "DimMap",
    "ChannelGroups",
    "GroupLayout",
    "scale_channels",
]

INPUT = "input"
CLASSES = "classes"

Segment = tuple[str, int]
"""``(group name, repeat)``: one contiguous piece of a tensor dimension."""

DimMap = tuple[Segment, ...]
"""Ordered segments whose concatenation is one tensor dimension."""


def scale_channels(channels: int, width: float) -> int:
    """Hidden channel count at ``width``: ``max(1, ceil(channels * width))``.

    The ceiling matches HeteroFL's slicing rule (a width-``r`` model built from scratch has the same
    hidden sizes as the ``r`` prefix slice of the width-1 model). A relative tolerance of ``1e-9``
    guards against float noise (``100 * 0.07`` gives 7, not 8).
    """
    if not isinstance(width, (int, float)) or isinstance(width, bool) or not width > 0:
        raise ValueError(f"width must be a positive number, got {width!r}")
    exact = channels * float(width)
    rounded = round(exact)
    if abs(exact - rounded) <= 1e-9 * max(1.0, abs(exact)):
        value = int(rounded)
    else:
        value = int(-(-exact // 1))
    return max(1, value)


def _norm_dimmap(value: Any) -> DimMap | None:
    if value is None:
        return None
    if isinstance(value, str):
        return ((value, 1),)
    out = []
    for seg in value:
        if isinstance(seg, str):
            out.append((seg, 1))
        else:
            g, r = seg
            out.append((str(g), int(r)))
    return tuple(out)


@dataclass(frozen=True)
class ChannelGroups:
    """Channel-group description of one model (see the module docstring).

    Attributes
    ----------
    sizes:
        group name -> channel count, in forward order of first appearance.
    dims:
        state-dict key -> ``(dim0, dim1)``; each a :data:`DimMap` or ``None``.
    fixed:
        groups never sliced (``"input"``, ``"classes"``).
    """

    sizes: Mapping[str, int]
    dims: Mapping[str, tuple[DimMap | None, DimMap | None]]
    fixed: frozenset[str] = field(default_factory=lambda: frozenset({INPUT, CLASSES}))

    # ------------------------------------------------------------------ queries
    @property
    def names(self) -> list[str]:
        """All group names in forward order."""
        return list(self.sizes)

    @property
    def prunable(self) -> list[str]:
        """Groups that may be sliced (every group except ``fixed``), in forward order."""
        return [g for g in self.sizes if g not in self.fixed]

    def dim_length(self, dimmap: DimMap) -> int:
        """Length of a tensor dimension described by ``dimmap`` at this model's sizes."""
        return sum(self.sizes[g] * r for g, r in dimmap)

    def producers(self, group: str) -> list[str]:
        """State keys whose dim 0 contains ``group`` (weights, biases, BN tensors)."""
        return [k for k, (d0, _) in self.dims.items() if d0 is not None and any(g == group for g, _ in d0)]

    def consumers(self, group: str) -> list[str]:
        """State keys whose dim 1 reads ``group`` (next convs, projection shortcuts, the classifier)."""
        return [k for k, (_, d1) in self.dims.items() if d1 is not None and any(g == group for g, _ in d1)]

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` unless ``state`` has exactly these keys with matching sliced dims."""
        missing = [k for k in self.dims if k not in state]
        extra = [k for k in state if k not in self.dims]
        if missing or extra:
            raise ValueError(
                f"state dict does not match the channel groups: missing keys {missing[:5]}, "
                f"unexpected keys {extra[:5]}"
            )
        for key, (d0, d1) in self.dims.items():
            shape = tuple(state[key].shape)
            for axis, dm in ((0, d0), (1, d1)):
                if dm is None:
                    continue
                want = self.dim_length(dm)
                if len(shape) <= axis or shape[axis] != want:
                    raise ValueError(
                        f"state[{key!r}] has shape {shape}; channel groups expect dim {axis} = {want} "
                        f"(segments {list(dm)})"
                    )

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (lists and plain scalars only)."""
        return {
            "sizes": dict(self.sizes),
            "dims": {
                k: [None if d is None else [[g, r] for g, r in d] for d in (d0, d1)]
                for k, (d0, d1) in self.dims.items()
            },
            "fixed": sorted(self.fixed),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ChannelGroups:
        """Inverse of :meth:`to_dict`."""
        try:
            sizes = {str(k): int(v) for k, v in data["sizes"].items()}
            dims = {
                str(k): (_norm_dimmap(v[0]), _norm_dimmap(v[1])) for k, v in data["dims"].items()
            }
            fixed = frozenset(data.get("fixed", (INPUT, CLASSES)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a ChannelGroups dict: {exc}") from None
        return cls(sizes=sizes, dims=dims, fixed=fixed)


class GroupLayout:
    """Helper with which a model declares its channel groups from its current modules.

    Usage inside a model's ``channel_groups()``::

        lay = GroupLayout(self)
        lay.conv("features.0", INPUT, "c1")          # weight (c1, input), bias (c1)
        lay.norm("features.1", "c1")                 # BN weight/bias/running stats (c1), counter None
        lay.linear("fc", "c3", CLASSES, repeat=16)   # flatten of a 4x4 map
        return lay.build()

    Group sizes are read from the modules (``out_channels``, ``num_features``, ``out_features``); a
    group declared by several producers (a residual tie) must have the same size everywhere.
    """

    def __init__(self, model: Any) -> None:
        self._modules = dict(model.named_modules())
        self._sizes: dict[str, int] = {}
        self._dims: dict[str, tuple[DimMap | None, DimMap | None]] = {}

    def _module(self, path: str) -> Any:
        try:
            return self._modules[path]
        except KeyError:
            raise ValueError(f"channel-group layout names unknown module {path!r}") from None

    def _size(self, group: str, size: int, where: str) -> None:
        old = self._sizes.get(group)
        if old is None:
            self._sizes[group] = int(size)
        elif old != size:
            raise ValueError(
                f"channel group {group!r} has size {old} but {where} gives {size} (tied groups must agree)"
            )

    def _local(self, path: str, module: Any, d0: DimMap | None, d1: DimMap | None) -> None:
        for name, tensor in list(module.named_parameters(recurse=False)) + list(
            module.named_buffers(recurse=False)
        ):
            if tensor is None:
                continue
            key = f"{path}.{name}" if path else name
            if tensor.dim() == 0:
                self._dims[key] = (None, None)
            elif tensor.dim() == 1:
                self._dims[key] = (d0, None)
            else:
                self._dims[key] = (d0, d1)

    def _in_map(self, inputs: str | Sequence[str], repeat: int, total: int, where: str) -> DimMap:
        groups = [inputs] if isinstance(inputs, str) else list(inputs)
        dm = tuple((g, int(repeat)) for g in groups)
        if len(groups) == 1 and groups[0] not in self._sizes:
            if total % repeat:
                raise ValueError(f"{where}: input length {total} is not a multiple of repeat {repeat}")
            self._size(groups[0], total // repeat, where)
        unknown = [g for g in groups if g not in self._sizes]
        if unknown:
            raise ValueError(f"{where}: input groups {unknown} are used before being produced")
        got = sum(self._sizes[g] * r for g, r in dm)
        if got != total:
            raise ValueError(f"{where}: input length {total} != channel groups {dm} ({got})")
        return dm

    def conv(self, path: str, inputs: str | Sequence[str], out: str) -> None:
        """Declare a ``Conv2d`` (dense, ``groups == 1``) reading ``inputs`` and producing ``out``."""
        m = self._module(path)
        if getattr(m, "groups", 1) != 1:
            raise ValueError(f"{path}: grouped convolutions are not supported by channel groups")
        d1 = self._in_map(inputs, 1, int(m.in_channels), path)
        self._size(out, int(m.out_channels), path)
        self._local(path, m, ((out, 1),), d1)

    def norm(self, path: str, group: str) -> None:
        """Declare a per-channel norm (``BatchNorm2d`` or ``GroupNorm``) on ``group``."""
        m = self._module(path)
        channels = getattr(m, "num_features", None)
        if channels is None:
            channels = m.num_channels  # GroupNorm
        self._size(group, int(channels), path)
        self._local(path, m, ((group, 1),), None)

    def linear(self, path: str, inputs: str | Sequence[str], out: str, repeat: int = 1) -> None:
        """Declare a ``Linear`` reading ``inputs`` (each channel spanning ``repeat`` features)."""
        m = self._module(path)
        d1 = self._in_map(inputs, repeat, int(m.in_features), path)
        self._size(out, int(m.out_features), path)
        self._local(path, m, ((out, 1),), d1)

    def input(self, channels: int) -> None:
        """Declare the image-channel group size explicitly (optional)."""
        self._size(INPUT, channels, "input")

    def build(self) -> ChannelGroups:
        """Return the finished :class:`ChannelGroups`."""
        return ChannelGroups(sizes=dict(self._sizes), dims=dict(self._dims))

