"""Closed-form forward MACs of plain convolutions, DBB branches, blocks and whole models.

Convention (the project's FLOPs convention): **forward multiply-accumulates per sample** of
``Conv2d`` and ``Linear`` layers, with eval-mode geometry at the given input size. Bias additions,
BatchNorm, activations, pooling, padding and residual additions count 0. One multiply-add counts
once, so ``torch.utils.flop_counter.FlopCounterMode`` reports exactly twice these numbers.

Per-layer formulas (per sample):

* ``Conv2d(C, O, (K_h, K_w), groups g)``: ``H_o · W_o · O · (C / g) · K_h · K_w``;
* ``Linear(in, out)``: ``T · in · out`` with ``T`` positions (1 for a flattened vector).

Per-branch costs of a Diverse Branch Block on a host conv ``C → O`` with input ``H × W`` and output
``H_o × W_o`` (internal width ``D`` of ``1x1_kxk``: ``C``, or ``2C`` for depthwise convs):

============  ===============================================================
``kxk``       ``H_o W_o · O · (C/g) · K_h K_w``
``1x1``       ``H_o W_o · O · (C/g)``
``1xk``       ``H_o W_o · O · (C/g) · K_w``
``kx1``       ``H_o W_o · O · (C/g) · K_h``
``1x1_kxk``   ``H W · D · (C/g)  +  H_o W_o · O · (D/g) · K_h K_w`` (stage 1 at input resolution)
``1x1_avg``   dense path ``H W · O · (C/g)``; depthwise path (``g = C = O``) ``0``
``identity``  ``0``
============  ===============================================================

Each formula is the :meth:`~reparam.kinds.BranchKind.macs` of its kind in the branch-kind registry
(a registered custom kind brings its own). Branches that read an input window (a crop of an
unpadded conv's input) run at the host output resolution, so the formulas hold for them unchanged.

All functions are pure Python arithmetic except :func:`input_sizes` and :func:`model_macs`, which
run one eval-mode, ``no_grad`` forward pass of a batch of one sample with forward hooks (the model's
train/eval flags are restored afterwards).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import torch
from torch import nn

from .block import DiverseBranchBlock
from .builtin_kinds import KINDS
from .errors import ReparamError
from .kind_1x1_kxk import default_internal as _default_internal
from .kinds import BranchKind, get_kind, is_kind, kind_names

__all__ = [
    "BRANCH_KINDS",
    "conv_output_hw",
    "conv_macs",
    "default_internal",
    "branch_macs",
    "block_macs",
    "input_sizes",
    "model_macs",
    "layer_macs",
    "measure",
    "train_macs",
    "plan_macs",
]

#: the built-in kinds, :data:`reparam.KINDS` (every registered kind: :func:`reparam.kinds.kind_names`)
BRANCH_KINDS: tuple[str, ...] = KINDS


class _Geo(NamedTuple):
    in_channels: int
    out_channels: int
    kernel_size: tuple[int, int]
    stride: tuple[int, int]
    padding: Any  # tuple[int, int] | str
    dilation: tuple[int, int]
    groups: int


def _pair(v: Any, name: str) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(x, int) for x in v):
        return (int(v[0]), int(v[1]))
    if isinstance(v, (tuple, list)) and len(v) == 1 and isinstance(v[0], int):
        return (int(v[0]), int(v[0]))
    raise TypeError(f"{name} must be an int or a pair of ints, got {v!r}")


def _geo(g: Any) -> _Geo:
    """Normalise a ``ConvGeometry``, an ``nn.Conv2d`` or any object with conv attributes."""
    try:
        padding = g.padding
        if not isinstance(padding, str):
            padding = _pair(padding, "padding")
        return _Geo(
            int(g.in_channels),
            int(g.out_channels),
            _pair(g.kernel_size, "kernel_size"),
            _pair(g.stride, "stride"),
            padding,
            _pair(g.dilation, "dilation"),
            int(g.groups),
        )
    except AttributeError as exc:
        raise TypeError(
            "geometry must be a ConvGeometry, an nn.Conv2d or an object with in_channels, "
            f"out_channels, kernel_size, stride, padding, dilation and groups; got {type(g).__name__}"
        ) from exc


def _hw(in_hw: Any) -> tuple[int, int]:
    if isinstance(in_hw, int) and not isinstance(in_hw, bool):
        return (in_hw, in_hw)
    if (
        isinstance(in_hw, (tuple, list, torch.Size))
        and len(in_hw) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in in_hw)
    ):
        return (int(in_hw[0]), int(in_hw[1]))
    raise TypeError(f"in_hw must be an int or an (H, W) pair of ints, got {in_hw!r}")


def conv_output_hw(geometry: Any, in_hw: Any) -> tuple[int, int]:
    """Output ``(H_o, W_o)`` of a conv: ``⌊(L + 2p − d(k − 1) − 1)/s⌋ + 1`` per axis.

    ``padding="same"`` keeps the size (stride 1); ``padding="valid"`` means 0.
    """
    g = _geo(geometry)
    h, w = _hw(in_hw)
    if isinstance(g.padding, str):
        if g.padding == "same":
            return (h, w)
        if g.padding == "valid":
            pad = (0, 0)
        else:
            raise ReparamError(f"padding must be 'same', 'valid' or ints, got {g.padding!r}")
    else:
        pad = g.padding
    out = []
    for length, k, s, p, d in zip((h, w), g.kernel_size, g.stride, pad, g.dilation):
        out.append((length + 2 * p - d * (k - 1) - 1) // s + 1)
    if out[0] <= 0 or out[1] <= 0:
        raise ReparamError(f"input {h}x{w} is too small for this conv (output {out[0]}x{out[1]})")
    return (out[0], out[1])


def conv_macs(geometry_or_conv: Any, in_hw: Any) -> int:
    """Forward MACs per sample of one conv: ``H_o · W_o · O · (C/g) · K_h · K_w``."""
    g = _geo(geometry_or_conv)
    ho, wo = conv_output_hw(g, in_hw)
    return ho * wo * g.out_channels * (g.in_channels // g.groups) * g.kernel_size[0] * g.kernel_size[1]


def default_internal(geometry: Any) -> int:
    """Internal width ``D`` of ``1x1_kxk``: ``2C`` for depthwise convs, ``C`` otherwise."""
    return _default_internal(_geo(geometry))


def _kind(name: str) -> BranchKind:
    if not is_kind(name):
        raise ReparamError(f"kind must be one of {kind_names()}, got {name!r}")
    return get_kind(name)


def branch_macs(kind: str, geometry: Any, in_hw: Any, internal: int | None = None, **options: Any) -> int:
    """Forward MACs per sample of one DBB branch on a host conv with ``geometry`` and input ``in_hw``.

    Args:
        kind: a registered kind (built in: ``"kxk", "1x1", "1x1_kxk", "1x1_avg", "1xk", "kx1",
            "identity"``).
        geometry: the host (main) conv geometry (``ConvGeometry`` or ``nn.Conv2d``).
        in_hw: input ``(H, W)`` of the host conv (an int means square).
        internal: internal width ``D`` of ``1x1_kxk`` (default: ``2C`` depthwise, else ``C``).
        options: further build options of the kind (e.g. ``path`` of ``1x1_avg``).

    The value does not check applicability (whether the branch can exist on this geometry, see
    :func:`reparam.kinds.applicability`); it is the cost the branch would have if it exists.
    """
    k = _kind(kind)
    g = _geo(geometry)
    h, w = _hw(in_hw)
    out_hw = conv_output_hw(g, (h, w))
    if internal is not None:
        options["internal"] = internal
    return int(k.macs(g, (h, w), out_hw, options))


# --------------------------------------------------------------------------------------------
# blocks


def _is_block(m: nn.Module) -> bool:
    return isinstance(m, DiverseBranchBlock)


def _nested_blocks(module: nn.Module) -> list[DiverseBranchBlock]:
    """Outermost DiverseBranchBlocks strictly inside ``module``."""
    found: list[DiverseBranchBlock] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, DiverseBranchBlock):
                found.append(child)
            else:
                visit(child)

    visit(module)
    return found


def block_macs(block: nn.Module, in_hw: Any) -> int:
    """Forward MACs per sample of a ``DiverseBranchBlock`` (sum over its present branches).

    A merged/deployed block (no branches left, only a conv) costs its conv. A nested block inside
    the anchor (or inside the second stage of ``1x1_kxk``) contributes its own block cost in place
    of the conv it replaced.
    """
    if not isinstance(block, DiverseBranchBlock):
        if isinstance(block, nn.Conv2d):
            return conv_macs(block, in_hw)
        raise TypeError(f"block must be a DiverseBranchBlock or nn.Conv2d, got {type(block).__name__}")
    g = _geo(block.geometry)
    h, w = _hw(in_hw)
    names = block.branch_names
    if not names:  # deployed form: the block holds one merged conv
        for m in block.modules():
            if isinstance(m, nn.Conv2d):
                return conv_macs(m, (h, w))
        return 0
    total = 0
    out_hw = conv_output_hw(g, (h, w))
    for name in names:
        kind = _kind(name)
        branch = block.branches[name]
        cost = int(kind.module_macs(branch, g, (h, w), out_hw))
        nested = _nested_blocks(branch)
        if nested and kind.nested_conv is None:
            raise ReparamError(f"nested block inside branch {name!r}, whose kind has no nestable conv")
        for nb in nested:
            # the nested block replaces the branch's K×K conv: its input size is the kind's
            nb_hw = kind.nested_input_hw(g, (h, w))
            cost += block_macs(nb, nb_hw) - conv_macs(_geo(nb.geometry), nb_hw)
        total += cost
    return total


# --------------------------------------------------------------------------------------------
# hook-based measurement


def _shape_input(input_shape: Sequence[int]) -> tuple[int, ...]:
    if not isinstance(input_shape, (tuple, list)) or not all(isinstance(v, int) and v > 0 for v in input_shape):
        raise TypeError(f"input_shape must be a tuple of positive ints (C, H, W), got {input_shape!r}")
    return tuple(input_shape)


def _probe(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    for p in model.parameters():
        return p.dtype, p.device
    for b in model.buffers():
        if b.is_floating_point():
            return b.dtype, b.device
    return torch.get_default_dtype(), torch.device("cpu")


def _run_once(
    model: nn.Module, input_shape: Sequence[int], hooks: Iterable[tuple[nn.Module, Any]], *, grad: bool = False
) -> None:
    """One eval-mode forward of a single zero sample with ``hooks`` attached; train/eval flags are
    restored. ``grad=True`` keeps autograd on (hooks can then see which inputs require grad)."""
    shape = _shape_input(input_shape)
    dtype, device = _probe(model)
    handles = [m.register_forward_hook(fn) for m, fn in hooks]
    flags = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.set_grad_enabled(grad):
            model(torch.zeros((1, *shape), dtype=dtype, device=device))
    finally:
        for h in handles:
            h.remove()
        for m, t in flags.items():
            m.training = t


def _hooks_for(model: nn.Module, sizes: dict | None, macs: dict | None) -> list:
    hooks = []
    for path, m in model.named_modules():
        want_size = sizes is not None and (isinstance(m, nn.Conv2d) or _is_block(m))
        want_macs = macs is not None and isinstance(m, (nn.Conv2d, nn.Linear))
        if not (want_size or want_macs):
            continue

        def hook(mod, inp, out, path=path, want_size=want_size, want_macs=want_macs):
            if want_size:
                x = inp[0] if inp else None
                if path not in sizes and isinstance(x, torch.Tensor) and x.dim() >= 3:
                    sizes[path] = (int(x.shape[-2]), int(x.shape[-1]))
            if want_macs:
                if isinstance(mod, nn.Conv2d):
                    k = mod.kernel_size[0] * mod.kernel_size[1]
                    mac = out[0].numel() * (mod.in_channels // mod.groups) * k  # O·H_o·W_o·(C/g)·K
                else:
                    mac = (out[0].numel() if out.dim() > 1 else out.numel()) * mod.in_features
                macs[path] = macs.get(path, 0) + mac

        hooks.append((m, hook))
    return hooks


def _signature(model: nn.Module, input_shape: Sequence[int]) -> tuple:
    """What the measured sizes and MACs depend on: the module tree, every conv's geometry and every
    weight's shape (not the values)."""
    parts: list[Any] = [tuple(input_shape), type(model).__qualname__]
    for path, m in model.named_modules():
        w = getattr(m, "weight", None)
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else ()
        if isinstance(m, nn.Conv2d):
            parts.append((path, "Conv2d", shape, m.stride, m.padding, m.dilation, m.groups))
        else:
            parts.append((path, type(m).__qualname__, shape))
    return tuple(parts)


_MEASURE_CACHE: dict[tuple, tuple[dict[str, tuple[int, int]], dict[str, int]]] = {}


def measure(model: nn.Module, input_shape: Sequence[int]) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """:func:`input_sizes` and :func:`layer_macs` from one forward pass.

    Results are cached by the model's structure signature (module tree, conv geometry, weight
    shapes, input shape), so re-measuring an unchanged structure costs no forward pass; fresh
    dicts are returned every time."""
    key = _signature(model, input_shape)
    hit = _MEASURE_CACHE.get(key)
    if hit is None:
        sizes: dict[str, tuple[int, int]] = {}
        macs: dict[str, int] = {}
        _run_once(model, input_shape, _hooks_for(model, sizes, macs))
        if len(_MEASURE_CACHE) > 2048:
            _MEASURE_CACHE.clear()
        hit = _MEASURE_CACHE[key] = (sizes, macs)
    return dict(hit[0]), dict(hit[1])


def input_sizes(model: nn.Module, input_shape: Sequence[int]) -> dict[str, tuple[int, int]]:
    """Input ``(H, W)`` of every ``Conv2d`` and every ``DiverseBranchBlock``, keyed by module path.

    One eval-mode, ``no_grad`` forward pass of one sample of shape ``input_shape = (C, H, W)``.
    A module called several times keeps its first call. The path of a block is the path of the
    conv it replaced in the host model.
    """
    return measure(model, input_shape)[0]


def layer_macs(model: nn.Module, input_shape: Sequence[int]) -> dict[str, int]:
    """Forward MACs per sample of every leaf ``Conv2d``/``Linear`` call, keyed by module path.

    Modules called several times in one forward pass are summed. Convs inside blocks are included
    under their full path (e.g. ``layer1.0.conv1.branches.1x1.conv``).
    """
    return measure(model, input_shape)[1]


def model_macs(model: nn.Module, input_shape: Sequence[int]) -> int:
    """Forward MACs per sample of ``model`` (every ``Conv2d`` and ``Linear`` call, blocks included).

    One eval-mode, ``no_grad`` forward pass with a batch of one sample of shape
    ``input_shape = (C, H, W)``; train/eval flags are restored afterwards. A merged or deployed
    block is just a conv and is counted as one.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    return int(sum(layer_macs(model, input_shape).values()))


def train_macs(model: nn.Module, input_shape: Sequence[int]) -> int:
    """Training MACs per sample: forward + weight gradient + input gradient (where needed).

    ``Σ_l (2 + needs_input_grad_l) · MAC_l``, where a layer needs the input gradient unless its
    input does not require grad (the first layer on raw data, or layers after a frozen prefix).
    Layers without trainable parameters get no weight-gradient term. Measured with one forward pass
    in eval mode with autograd on (no backward is run).
    """
    total = 0
    hooks = []

    def make(path: str, mod: nn.Module):
        def hook(m, inp, out):
            nonlocal total
            x = inp[0]
            if isinstance(m, nn.Conv2d):
                k = m.kernel_size[0] * m.kernel_size[1]
                mac = out[0].numel() * (m.in_channels // m.groups) * k
            else:
                per_sample = out[0].numel() if out.dim() > 1 else out.numel()
                mac = per_sample * m.in_features
            w_grad = any(p.requires_grad for p in m.parameters(recurse=False))
            # the weight of an identity-based stage may be computed; count its grad via the input
            total += mac * (1 + int(w_grad) + int(bool(getattr(x, "requires_grad", False))))

        return hook

    for path, m in model.named_modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            hooks.append((m, make(path, m)))
    _run_once(model, input_shape, hooks, grad=True)
    return int(total)


def plan_macs(
    geometries: Mapping[str, Any], sizes: Mapping[str, Any], plan: Mapping[str, Iterable[str]]
) -> int:
    """Extra forward MACs of ``plan`` (conv path → kinds) over the plain convs it expands."""
    extra = 0
    for path, kinds in plan.items():
        for kind in kinds:
            if not _kind(kind).anchor:
                extra += branch_macs(kind, geometries[path], sizes[path])
    return extra
