"""Branch kinds of the Diverse Branch Block: one class per kind, one registry.

A branch kind is everything the package needs to know about one kind of branch, in one place:

* its ``name`` (the key in :attr:`DiverseBranchBlock.branches` and in structure specs) and its
  position in the fixed forward ``order``;
* :meth:`BranchKind.reason`: whether it fits a conv geometry (``None``) or why not;
* :meth:`BranchKind.build`: a new branch module for a main geometry;
* :meth:`BranchKind.macs`: its closed-form forward MACs per sample (the FLOPs convention of
  :mod:`reparam.flops`);
* :meth:`BranchKind.kernel_bias` / :meth:`BranchKind.merge_terms` / :meth:`BranchKind.accumulate`:
  its equivalent pair at the main kernel size, i.e. how it merges into the main kernel;
* :meth:`BranchKind.fused_forward`: its share of the fused training forward of a block
  (:mod:`reparam.fused`; default: the branch's own forward);
* flags that the default branch sets, :func:`reparam.dymm.plan_bottom_up` and
  :func:`reparam.dymm.dymm` read (``in_default``, ``in_first_plan``, ``in_fill``, ``growable``),
  ``anchor`` (the block's host conv), and where nested growth may expand a conv of the branch
  (``nested_conv``).

:class:`~reparam.DiverseBranchBlock`, :mod:`reparam.flops`, :mod:`reparam.fused`,
:mod:`reparam.dymm` and :mod:`reparam.planning` read kinds from here only, so a new kind is one
subclass of :class:`BranchKind` plus :func:`register_kind`::

    class Centre3x3(reparam.BranchKind):
        name = "3x3"
        ...
    reparam.register_kind(Centre3x3())

The seven built-in kinds (``kxk, 1x1, 1x1_kxk, 1x1_avg, 1xk, kx1, identity``; the list is
:data:`reparam.KINDS`) are defined next to their branch modules, one module per family
(:mod:`reparam.kind_conv`, :mod:`reparam.kind_1x1_kxk`, :mod:`reparam.kind_avg`,
:mod:`reparam.kind_identity`), each class registered where it is defined; ``import reparam``
registers them all. They cannot be unregistered or replaced, and only the built-in ``kxk`` is the
``anchor``.

A branch module built by a kind must provide ``forward(x)`` (no activation inside),
``equivalent_kernel_bias(geometry, dtype=None) -> (K, b)`` (a kernel at the main kernel size and a
bias such that, in eval mode, the branch equals ``conv2d(x, K, b)`` with the main geometry) and
``last_bn`` (the norm whose ``γ = β = 0`` makes a new branch output exact zeros).
"""

from __future__ import annotations

import abc
import contextlib
import itertools
from typing import Any, Callable, Iterator, Mapping, Protocol, TypeVar, cast, overload

import torch
from torch import Tensor, nn

from .errors import AlignmentError, ReparamError
from .geometry import ConvGeometry


__all__ = [
    "BranchKind",
    "register_kind",
    "unregister_kind",
    "get_kind",
    "is_kind",
    "kind_names",
    "branch_kinds",
    "kind_registered",
    "default_kinds",
    "anchor_name",
    "flagged",
    "applicability",
    "make_branch",
]

HW = tuple[int, int]


class Fusion(Protocol):
    """What a kind's :meth:`BranchKind.fused_forward` may hand its computation to: one fused
    training forward of a block (:class:`reparam.fused.FusedForward`, which imports this module,
    not the other way round). ``moments``: the block input's channel moments, or None when BN
    folding does not pay off."""

    moments: Any

    def conv_bn(self, branch: nn.Module, conv: nn.Module, bn: nn.Module, window: Any, padding_mode: str) -> Tensor | None:
        """A ``conv → bn`` branch folded into the block's shared 1×1 conv, or run as its own."""

    def identity_bn(self, branch: nn.Module, bn: nn.Module, window: Any, padding_mode: str) -> Tensor | None:
        """A BN on the block input, folded, or run as ``branch(x)``."""


class BranchKind(abc.ABC):
    """One kind of Diverse Branch Block branch (see the module docstring).

    Class attributes (override in a subclass):
        name: the branch name (a valid ``nn.ModuleDict`` key: no ``"."``).
        order: forward-order position; built-ins use 0–60, so a new kind with the default order
            runs after them (ties: registration order).
        anchor: the block's anchor (its host conv and norm, built by the block, never removed);
            only the built-in ``kxk`` has it.
        in_default / in_depthwise_default: part of the default set for dense/grouped and for
            depthwise convs (``DiverseBranchBlock.from_conv(..., branches=None)``).
        in_first_plan: part of the full set a conv gets in phase 1 of
            :func:`reparam.dymm.plan_bottom_up`.
        in_fill: may be added singly in phase 2 of that plan (and by knapsack fills).
        growable: may be added by :func:`reparam.dymm.dymm`'s growth step.
        options: names of the build options the kind accepts (e.g. ``internal``).
        nested_conv / nested_norm: attributes of the branch's ``K×K`` conv that nested growth may
            turn into a nested block, and of the norm that follows it (``None``: not nestable).
        nested_crop: whether that nested block may use input-window branches (see
            :meth:`reason`).
        broadcast_merge: the branch's merge term is an ``(O, C/g, 1, 1)`` tensor broadcast over
            the window; the merge starts with it (the next term expands it).
    """

    name: str = ""
    order: int = 1000
    anchor: bool = False
    in_default: bool = False
    in_depthwise_default: bool = False
    in_first_plan: bool = False
    in_fill: bool = True
    growable: bool = True
    options: frozenset[str] = frozenset()
    nested_conv: str | None = None
    nested_norm: str | None = None
    nested_crop: bool = True
    broadcast_merge: bool = False

    # ------------------------------------------------------------------ what subclasses define
    @abc.abstractmethod
    def reason(self, main: ConvGeometry, *, crop: bool = True) -> str | None:
        """``None`` when the kind fits ``main`` exactly, else the reason it does not.

        ``crop``: the branch may read a window of the block input (crop it, or pad it further)
        where its own padding would otherwise be negative; with ``crop=False`` such geometries are
        refused (the classic DBB rule)."""

    @abc.abstractmethod
    def build(
        self,
        main: ConvGeometry,
        *,
        eps: float,
        momentum: float | None,
        factory: Mapping[str, Any],
        generator: torch.Generator | None,
        crop: bool,
        options: Mapping[str, Any],
    ) -> nn.Module:
        """A new branch module for the main geometry (applicability already checked); its last
        norm is zeroed afterwards by the caller when the branch must start at zero output.
        ``factory`` holds the ``device`` and ``dtype`` of new parameters."""

    @abc.abstractmethod
    def macs(self, geometry: Any, in_hw: HW, out_hw: HW, options: Mapping[str, Any]) -> int:
        """Forward MACs per sample of the branch on a host conv with ``geometry`` (any object with
        ``in_channels, out_channels, kernel_size, stride, padding, dilation, groups``), host input
        ``in_hw`` and host output ``out_hw``; ``options`` as in :meth:`options_of`."""

    # ------------------------------------------------------------------ defaults
    def options_of(self, branch: nn.Module) -> dict[str, Any]:
        """The build options that rebuild ``branch`` (recorded in structure specs)."""
        return {}

    def module_macs(self, branch: nn.Module, geometry: Any, in_hw: HW, out_hw: HW) -> int:
        """Forward MACs of a present branch (nested blocks are accounted for by the caller)."""
        return self.macs(geometry, in_hw, out_hw, self.options_of(branch))

    def nested_input_hw(self, geometry: Any, in_hw: HW) -> HW:
        """Input size of the nestable conv for a block input of ``in_hw``."""
        return in_hw

    def kernel_bias(self, branch: nn.Module, geometry: ConvGeometry, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """The branch's equivalent pair at the main kernel size (differentiable, eval-exact): the
        module's ``equivalent_kernel_bias``."""
        pair: tuple[Tensor, Tensor] = cast(Any, branch).equivalent_kernel_bias(geometry, dtype)
        return pair

    def merge_terms(self, branch: nn.Module, geometry: ConvGeometry, dtype: torch.dtype) -> Any:
        """Per-merge quantities that :meth:`accumulate` needs for every row chunk, computed once
        per merge in ``dtype`` (``None``: none; the default :meth:`accumulate` needs none)."""
        return None

    @torch.no_grad()
    def accumulate(
        self,
        branch: nn.Module,
        acc: Tensor | None,
        bias: Tensor,
        geometry: ConvGeometry,
        rows: slice | None = None,
        terms: Any = None,
    ) -> Tensor:
        """Add the branch's pair (output rows ``rows``) to ``acc`` and ``bias`` in place, in the
        dtype of ``bias``, without autograd; returns ``acc`` (allocated when ``None``; a broadcast
        ``(O, C/g, 1, 1)`` accumulator is expanded). ``terms``: :meth:`merge_terms`, when the
        caller computed it once for all chunks. The default goes through :meth:`kernel_bias`."""
        k, b = self.kernel_bias(branch, geometry, bias.dtype)
        if rows is not None:
            k, b = k[rows], b[rows]
        bias.add_(b.to(bias.device))
        k = k.detach().to(bias.device)
        if acc is None:
            return k.clone()
        if tuple(acc.shape) != tuple(k.shape):  # a broadcast (O, C/g, 1, 1) accumulator
            return acc + k
        return acc.add_(k)

    def fused_forward(self, branch: nn.Module, x: Tensor, fusion: "Fusion") -> Tensor | None:
        """The branch's output in the fused training forward of its block (:mod:`reparam.fused`),
        or ``None`` when the branch handed its computation to ``fusion`` (which adds it to the
        block output). Must equal ``branch(x)`` up to rounding. Default: ``branch(x)``."""
        out: Tensor = branch(x)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# ---------------------------------------------------------------------------------------------
# registry

_REGISTRY: dict[str, BranchKind] = {}
_SEQUENCE: dict[str, int] = {}
_BUILTIN: set[str] = set()
_ANCHOR: list[str] = []  # the name of the built-in anchor kind, once registered
_NEXT = itertools.count(1)  # registration sequence: ties of ``order`` keep registration order

K = TypeVar("K", bound=type[BranchKind])


@overload
def register_kind(kind: BranchKind, *, replace: bool = False) -> BranchKind: ...


@overload
def register_kind(kind: K, *, replace: bool = False) -> K: ...


def register_kind(kind: Any, *, replace: bool = False) -> Any:
    """Register ``kind`` (an instance of a :class:`BranchKind` subclass); returns it. Given the
    subclass itself (``@register_kind`` on a class whose constructor takes no argument), an
    instance of it is registered and the class is returned: the decorator form.

    Raises:
        ReparamError: not a ``BranchKind``, a bad name, an ``anchor`` kind, or the name is taken
            (``replace=True`` replaces a registered custom kind; built-in kinds cannot be
            replaced).
    """
    if isinstance(kind, type) and issubclass(kind, BranchKind):
        _register(kind(), replace=replace, builtin=False)
        return kind
    return _register(kind, replace=replace, builtin=False)


def builtin_kind(cls: K) -> K:
    """Class decorator of reparam's own kind modules: register an instance of ``cls`` as a
    built-in kind (it can then be neither replaced nor unregistered)."""
    _register(cls(), replace=False, builtin=True)
    return cls


def _register(kind: BranchKind, *, replace: bool, builtin: bool) -> BranchKind:
    if isinstance(kind, type) and issubclass(kind, BranchKind):
        raise ReparamError(f"register an instance of the kind, e.g. register_kind({kind.__name__}()), not the class")
    if not isinstance(kind, BranchKind):
        raise ReparamError(f"kind must be a BranchKind instance, got {type(kind).__name__}")
    name = kind.name
    if not isinstance(name, str) or not name or "." in name:
        raise ReparamError(f"a branch kind needs a non-empty name without '.', got {name!r}")
    if name in _REGISTRY:
        if name in _BUILTIN:
            raise ReparamError(f"branch kind {name!r} is built in and cannot be replaced")
        if not replace:
            raise ReparamError(f"branch kind {name!r} is already registered (pass replace=True to replace it)")
    if kind.anchor and (not builtin or _ANCHOR):
        raise ReparamError(f"branch kind {name!r}: a block has one anchor, the built-in one")
    _REGISTRY[name] = kind
    if name not in _SEQUENCE:
        _SEQUENCE[name] = next(_NEXT)
    if builtin:
        _BUILTIN.add(name)
        if kind.anchor:
            _ANCHOR.append(name)
    return kind


def unregister_kind(name: str) -> BranchKind:
    """Remove a registered custom kind; returns it.

    Blocks that already hold a branch of the kind keep it, but cannot be merged, saved or trained
    (the fused training forward asks the kind) without it; unregister only kinds no live block
    uses.

    Raises:
        ReparamError: unknown or built-in kind.
    """
    if name in _BUILTIN:
        raise ReparamError(f"branch kind {name!r} is built in and cannot be unregistered")
    if name not in _REGISTRY:
        raise ReparamError(f"branch kind {name!r} is not registered; registered: {kind_names()}")
    _SEQUENCE.pop(name, None)
    return _REGISTRY.pop(name)


def kind_names() -> tuple[str, ...]:
    """Names of every registered kind in forward order (``order``, then registration order)."""
    return tuple(sorted(_REGISTRY, key=lambda n: (_REGISTRY[n].order, _SEQUENCE[n])))


def branch_kinds() -> tuple[BranchKind, ...]:
    """Every registered kind in forward order."""
    return tuple(_REGISTRY[n] for n in kind_names())


def get_kind(name: str) -> BranchKind:
    """The registered kind called ``name``.

    Raises:
        ReparamError: unknown name (the message lists the registered kinds).
    """
    kind = _REGISTRY.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ReparamError(f"unknown branch kind {name!r}; accepted values: {kind_names()}")
    return kind


def is_kind(name: Any) -> bool:
    """Whether ``name`` names a registered kind."""
    return isinstance(name, str) and name in _REGISTRY


def anchor_name() -> str:
    """The name of the anchor kind (``"kxk"``): the branch every block holds, its host conv."""
    if not _ANCHOR:  # pragma: no cover - ``import reparam`` registers the built-in kinds
        raise ReparamError("the built-in branch kinds are not registered (import reparam)")
    return _ANCHOR[0]


@contextlib.contextmanager
def kind_registered(kind: BranchKind, *, replace: bool = False) -> Iterator[BranchKind]:
    """Register ``kind`` for the duration of a ``with`` block (tests, experiments)."""
    register_kind(kind, replace=replace)
    try:
        yield kind
    finally:
        if _REGISTRY.get(kind.name) is kind:
            unregister_kind(kind.name)


def default_kinds(depthwise: bool = False) -> tuple[str, ...]:
    """The default branch set (forward order) for dense/grouped or for depthwise convs."""
    return tuple(k.name for k in branch_kinds() if (k.in_depthwise_default if depthwise else k.in_default))


def flagged(flag: Callable[[BranchKind], bool]) -> tuple[str, ...]:
    """Registered kinds (forward order) for which ``flag(kind)`` holds, e.g.
    ``flagged(lambda k: k.in_first_plan)``."""
    return tuple(k.name for k in branch_kinds() if flag(k))


# ---------------------------------------------------------------------------------------------
# operations over the registered kinds


def applicability(main: ConvGeometry, *, crop: bool = True) -> dict[str, str | None]:
    """For every registered kind (forward order): ``None`` if it is applicable to ``main``, else the
    reason it is not. ``crop`` allows input-window branches (branches that read a crop of the
    input where their own padding cannot align them, see :func:`reparam.kind_conv.conv_layout`)."""
    return {k.name: k.reason(main, crop=crop) for k in branch_kinds()}


def make_branch(
    kind: str,
    main: ConvGeometry,
    *,
    eps: float = 1e-5,
    momentum: float | None = 0.1,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    zero_last: bool = True,
    generator: torch.Generator | None = None,
    crop: bool = True,
    options: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Create a new (non-anchor) branch of the registered ``kind`` for the main geometry.

    Convs get Kaiming-normal fan-out init (identity-based residuals 0); inner BNs PyTorch defaults;
    the last BN ``γ = β = 0`` when ``zero_last`` (the branch then outputs exactly 0 in train and eval
    mode). ``options``: the kind's build options (:attr:`BranchKind.options`, e.g. ``internal`` and
    ``identity_init`` of ``1x1_kxk``, ``path`` of ``1x1_avg``).

    Raises:
        AlignmentError: the kind is not applicable to ``main`` (reason in the message).
        ReparamError: unknown kind or option, or a bad option value.
    """
    if not is_kind(kind) or get_kind(kind).anchor:
        accepted = tuple(k.name for k in branch_kinds() if not k.anchor)
        raise ReparamError(f"kind must be one of {accepted}, got {kind!r}")
    k = get_kind(kind)
    opts = dict(options or {})
    bad = set(opts) - set(k.options)
    if bad:
        raise ReparamError(f"unknown options {sorted(bad)} for branch {kind!r}; accepted: {sorted(k.options)}")
    reason = k.reason(main, crop=crop)
    if reason is not None:
        raise AlignmentError(reason)
    factory: dict[str, Any] = {"device": device, "dtype": dtype}
    branch = k.build(main, eps=eps, momentum=momentum, factory=factory, generator=generator, crop=crop, options=opts)
    if zero_last:
        last = cast(nn.Module, branch.last_bn)
        with torch.no_grad():
            cast(Tensor, last.weight).zero_()
            cast(Tensor, last.bias).zero_()
    return branch
