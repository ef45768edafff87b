"""Host layers that are not plain torch layers, and how :mod:`reparam` treats them exactly.

**Conv subclasses.** A subclass of ``nn.Conv2d`` whose class overrides ``forward`` or
``_conv_forward`` may compute anything (timm's ``StdConv2d`` standardises its weight, ``Conv2dSame``
pads from the input size at every call), so reparam never takes it for a plain conv. Its form is
identified instead (:func:`conv_form`): on a copy of the module with random parameters, its train-
and eval-mode outputs on probe inputs of three sizes per axis are compared with four candidate
functions, and the first that matches is its form:

=====================  ==========================================================================
plain                  ``conv2d(x, W)`` with the module's own padding (a subclass that only logs)
weight-standardised    ``conv2d(x, WS(W))``, ``WS(W)_o = (W_o − mean W_o)/sqrt(var W_o + eps)``,
                       times ``gain·scale`` when the module has them (timm's ``StdConv2d``,
                       ``ScaledStdConv2d``; attributes ``eps``, ``gain``, ``scale``)
TF "same" padding      ``conv2d(pad(x), W)`` with the padding TensorFlow's ``SAME`` computes from
                       the input size (timm's ``Conv2dSame``, and the standardised ``...Same``)
both                   weight-standardised with TF "same" padding
=====================  ==========================================================================

A conv whose output matches none of them (or whose weight is parametrized with
``torch.nn.utils.parametrize``) is left plain, with the reason. What each form means for a block:

* the host conv stays the block's anchor conv (same object, same forward): expansion stays
  bit-exact in train and eval mode;
* the anchor's kernel in every merge is the kernel the conv really applies (the standardised,
  gain-scaled kernel for weight-standardised convs), computed in the merge's dtype;
* TF "same" padding: the block pads its input the same way for its other branches, which then see a
  padding-0 conv's input; the merged conv is a :class:`SamePadConv2d` (a biased ``Conv2d`` that pads
  the same way), and ``target="host"`` gives back a conv of the host class;
* weight-standardised anchors cannot be written to (a standardised kernel has zero mean per output
  channel, so it cannot hold an arbitrary merged kernel): ``target="deploy"`` merges them exactly
  into a plain conv, while ``target="host"``, :meth:`~reparam.DiverseBranchBlock.fold_all`,
  ``remove_branch``, ``load_plain`` and ``init="random_resolve"`` refuse with
  :class:`~reparam.errors.NotMergeableError`.

**Norm+activation BatchNorms.** A BatchNorm subclass (or a ``FrozenBatchNorm2d``-like module) with
``act`` and/or ``drop`` submodules, whose forward is ``act(drop(batch_norm(x)))`` (timm's
``BatchNormAct2d``, ``SyncBatchNormAct``, ``FrozenBatchNormAct2d``), pairs with its conv. The form is
proven the same way (:func:`norm_act_reason`: on a copy, with ``drop`` and ``act`` replaced by two
non-commuting affine maps, the output in train and eval mode must equal the composition, and the
rest must be torch's BatchNorm). :func:`split_norm_act` moves ``act`` and ``drop`` out of the BN
into a :class:`NormActTail`, which takes the BN's place in the model; the BN, now a plain BN, is
absorbed by the block. :meth:`NormActTail.restore_into` puts them back (``target="host"``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ConvForm",
    "PLAIN",
    "conv_form",
    "is_genuine_conv",
    "effective_kernel",
    "standardized_kernel",
    "same_padding",
    "pad_same",
    "SamePadConv2d",
    "as_same_pad",
    "NormActTail",
    "norm_act_reason",
    "split_norm_act",
]

_FORM_CACHE = "_reparam_conv_form"
_NORM_ACT_MARK = "_reparam_norm_act"
#: probe results shared by modules of one class with equal scalar attributes (the probe's outcome
#: depends on the class's code and those attributes only; parameters are randomised for the probe)
_SHARED: dict[tuple, Any] = {}
_SHARED_MAX = 4096


def _scalar_state(m: nn.Module, skip: tuple[str, ...] = ()) -> tuple:
    items = []
    for k, v in m.__dict__.items():
        if k.startswith("_") or k in skip:
            continue
        if isinstance(v, (bool, int, float, str, type(None))) or (
            isinstance(v, tuple) and all(isinstance(e, (bool, int, float, str)) for e in v)
        ):
            items.append((k, v))
    children = tuple((n, type(c)) for n, c in m.named_children())
    return (type(m), tuple(sorted(items)), children)


def _shared(key: tuple, compute: Any) -> Any:
    try:
        hit = _SHARED[key]
    except TypeError:  # unhashable attribute value
        return compute()
    except KeyError:
        if len(_SHARED) >= _SHARED_MAX:
            _SHARED.clear()
        hit = _SHARED[key] = compute()
    return hit


@dataclass(frozen=True)
class ConvForm:
    """What a conv module computes: ``conv2d`` of its input with its kernel, where the kernel is the
    weight or its standardisation (``standardized``) and the input is padded by the module's
    ``padding`` or, with ``same_pad``, by TensorFlow's ``SAME`` rule at every call."""

    standardized: bool = False
    same_pad: bool = False

    @property
    def plain(self) -> bool:
        return not (self.standardized or self.same_pad)

    def to_dict(self) -> dict[str, bool]:
        return {"standardized": self.standardized, "same_pad": self.same_pad}

    def describe(self) -> str:
        parts = [p for p, on in (("weight-standardised", self.standardized), ("TF 'same' padding", self.same_pad)) if on]
        return " with ".join(parts) if parts else "plain"


PLAIN = ConvForm()


# ---------------------------------------------------------------------------------------------
# TF "same" padding


def same_padding(size: tuple[int, int], kernel_size: Any, stride: Any, dilation: Any) -> tuple[int, int, int, int]:
    """``(left, right, top, bottom)``: TensorFlow's ``SAME`` padding of an input of spatial size
    ``size`` (total ``max((⌈i/s⌉ − 1)·s + (k − 1)·d + 1 − i, 0)`` per axis, the smaller half first)."""
    pads = []
    for i, k, s, d in zip(size, kernel_size, stride, dilation):
        total = max((-(-int(i) // int(s)) - 1) * int(s) + (int(k) - 1) * int(d) + 1 - int(i), 0)
        pads.append((total // 2, total - total // 2))
    (top, bottom), (left, right) = pads
    return left, right, top, bottom


def pad_same(x: Tensor, kernel_size: Any, stride: Any, dilation: Any) -> Tensor:
    """``x`` zero-padded by :func:`same_padding` (one ``F.pad``; the input itself when no padding)."""
    pad = same_padding((int(x.shape[-2]), int(x.shape[-1])), kernel_size, stride, dilation)
    return F.pad(x, pad) if any(pad) else x


class SamePadConv2d(nn.Conv2d):
    """A ``Conv2d`` that pads its input with TensorFlow's ``SAME`` rule at every call (then
    ``padding`` 0): the merged form of a block whose host conv pads so (timm's ``Conv2dSame``). Same
    parameters and state-dict keys as ``nn.Conv2d``."""

    def forward(self, x: Tensor) -> Tensor:
        x = pad_same(x, self.kernel_size, self.stride, self.dilation)
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


def as_same_pad(conv: nn.Conv2d) -> nn.Conv2d:
    """``conv`` (a plain ``nn.Conv2d`` with padding 0) turned into a :class:`SamePadConv2d` in place."""
    if type(conv) is not nn.Conv2d or tuple(conv.padding) != (0, 0) or conv.padding_mode != "zeros":
        raise ValueError("as_same_pad needs a plain nn.Conv2d with padding 0 and zero padding mode")
    conv.__class__ = SamePadConv2d
    return conv


# ---------------------------------------------------------------------------------------------
# conv forms


def is_genuine_conv(m: nn.Module) -> bool:
    """An ``nn.Conv2d`` whose class keeps torch's ``forward`` and ``_conv_forward`` and whose weight
    is not parametrized: it computes ``conv2d(x, weight, bias)`` with its own padding."""
    cls = type(m)
    return (
        isinstance(m, nn.Conv2d)
        and cls.forward is nn.Conv2d.forward
        and getattr(cls, "_conv_forward", None) is nn.Conv2d._conv_forward
        and not _parametrized(m)
    )


def _parametrized(m: nn.Module) -> bool:
    return bool(getattr(m, "parametrizations", None))


def _overridden(conv: nn.Module) -> str:
    cls = type(conv)
    names = [n for n in ("forward", "_conv_forward") if getattr(cls, n) is not getattr(nn.Conv2d, n)]
    return " and ".join(f"{cls.__name__}.{n}" for n in names) or cls.__name__


def standardized_kernel(conv: Any, dtype: torch.dtype | None = None, weight: Tensor | None = None) -> Tensor:
    """The kernel a weight-standardised conv applies: per output channel ``(W − mean)/sqrt(var + eps)``
    (biased variance), times ``gain·scale`` when the module has them; in ``dtype`` (default: the
    weight's), differentiable."""
    w: Tensor = conv.weight if weight is None else weight
    if dtype is not None:
        w = w.to(dtype)
    o = int(w.shape[0])
    gain = getattr(conv, "gain", None)
    scale = getattr(conv, "scale", None)
    mult: Tensor | None = None
    if isinstance(gain, Tensor):
        mult = gain.to(w.dtype)
        if isinstance(scale, (int, float)):
            mult = mult * scale
        mult = mult.reshape(-1)
    elif isinstance(scale, (int, float)):
        mult = torch.full((o,), float(scale), dtype=w.dtype, device=w.device)
    k = F.batch_norm(w.reshape(1, o, -1), None, None, weight=mult, training=True, momentum=0.0, eps=float(conv.eps))
    return k.reshape_as(w)


def effective_kernel(conv: Any, dtype: torch.dtype | None = None) -> Tensor:
    """The kernel ``conv`` applies (:func:`standardized_kernel` for weight-standardised convs, else its
    weight), in ``dtype`` (default: the weight's)."""
    if type(conv) is not nn.Conv2d and _standardized(conv):
        return standardized_kernel(conv, dtype)
    w = conv.weight
    return w if dtype is None else w.to(dtype)


def _standardized(conv: nn.Module) -> bool:
    form = conv_form(conv)
    return isinstance(form, ConvForm) and form.standardized


def _cache_key(conv: nn.Module) -> tuple:
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in conv.named_parameters())
    return (_scalar_state(conv), params)


def conv_form(conv: nn.Module) -> ConvForm | str:
    """The :class:`ConvForm` of an ``nn.Conv2d`` (or subclass), or why reparam cannot treat it exactly.

    Genuine ``nn.Conv2d`` modules are :data:`PLAIN` without a probe. For a subclass that overrides
    ``forward`` / ``_conv_forward`` the form is identified on a copy with random parameters (see the
    module docstring); the result is cached on the module (attribute ``_reparam_conv_form``) and
    shared by modules of the same class with equal scalar attributes and parameter shapes (the probe
    randomises the parameters, so its outcome depends on nothing else).
    """
    if not isinstance(conv, nn.Conv2d):
        return f"{type(conv).__name__} is not an nn.Conv2d"
    if _parametrized(conv):
        return (
            f"the weight of this {type(conv).__name__} is parametrized (torch.nn.utils.parametrize): the kernel it "
            "applies is computed from other tensors, so the block could not write it"
        )
    if is_genuine_conv(conv):
        return PLAIN
    if type(conv) is SamePadConv2d:
        return ConvForm(same_pad=True)
    key = _cache_key(conv)
    cached = conv.__dict__.get(_FORM_CACHE)
    if isinstance(cached, tuple) and len(cached) == 2 and cached[0] == key:
        return cached[1]
    form = _shared(("conv",) + key, lambda: _probe_form(conv))
    conv.__dict__[_FORM_CACHE] = (key, form)
    return form


def _probe_tolerance(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-9, torch.float32: 1e-4}.get(dtype, 3e-2)


def _probe_form(conv: nn.Conv2d) -> ConvForm | str:
    name = _overridden(conv)
    try:
        probe = copy.deepcopy(conv)
        dtype = probe.weight.dtype
        if not dtype.is_floating_point:
            return f"{name}: a {dtype} weight; only floating-point convs are expanded"
        gen = torch.Generator().manual_seed(12345)
        with torch.no_grad():
            for p in probe.parameters():
                if p.is_floating_point():
                    r = torch.rand(p.shape, generator=gen, dtype=torch.float64) * 2.0 - 1.0
                    if p.dim() < 4:  # gains, biases: keep away from 0
                        r = r.sign() * (r.abs() + 0.5)
                    p.copy_(r.to(p.device, p.dtype))
        kh, kw = (int(v) for v in conv.kernel_size)
        dh, dw = (int(v) for v in conv.dilation)
        eh, ew = dh * (kh - 1) + 1, dw * (kw - 1) + 1
        c = int(conv.in_channels)
        sizes = [(eh + 2, ew + 3), (eh + 3, ew + 4), (eh + 4, ew + 2)]
        inputs = [
            torch.randn(1, c, h, w, generator=gen, dtype=torch.float64).to(probe.weight.device, dtype) for h, w in sizes
        ]
        outputs = []
        with torch.no_grad():
            for training in (True, False):
                probe.train(training)
                outputs.append([probe(x) for x in inputs])
    except Exception as exc:  # noqa: BLE001 - any failure means "unknown form"
        return f"{name}: probing its forward failed ({type(exc).__name__}: {exc}); its function is unknown"
    ws_ok = isinstance(getattr(conv, "eps", None), (int, float))
    static_ok = True
    same_ok = tuple(conv.padding) == (0, 0) if not isinstance(conv.padding, str) else False
    same_ok = same_ok and conv.padding_mode == "zeros"
    tol = _probe_tolerance(dtype)
    with torch.no_grad():
        kernels = {False: probe.weight}
        if ws_ok:
            try:
                kernels[True] = standardized_kernel(probe)
            except Exception:  # noqa: BLE001 - not a standardisable module after all
                pass
        for same_pad in (False, True):
            if (same_pad and not same_ok) or (not same_pad and not static_ok):
                continue
            for standardized, k in kernels.items():
                ok = True
                for outs in outputs:
                    for x, y in zip(inputs, outs):
                        if same_pad:
                            ref = F.conv2d(pad_same(x, conv.kernel_size, conv.stride, conv.dilation), k, probe.bias,
                                           probe.stride, 0, probe.dilation, probe.groups)
                        else:
                            ref = nn.Conv2d._conv_forward(probe, x, k, probe.bias)
                        if not isinstance(y, Tensor) or y.shape != ref.shape or not _close(y, ref, tol):
                            ok = False
                            break
                    if not ok:
                        break
                if ok:
                    return ConvForm(standardized=standardized, same_pad=same_pad)
    return (
        f"{name} is overridden and its output on probe inputs is none of the forms reparam can merge exactly "
        "(conv2d of the weight or of its standardisation, with static or TF 'same' padding): its function is "
        "unknown, so the conv is left plain"
    )


def _close(a: Tensor, b: Tensor, tol: float) -> bool:
    a64, b64 = a.detach().double(), b.detach().double()
    if not bool(torch.isfinite(a64).all()):
        return False
    scale = float(b64.abs().max()) if b64.numel() else 0.0
    return float((a64 - b64).abs().max()) <= tol * max(scale, 1e-30) if a64.numel() else True


# ---------------------------------------------------------------------------------------------
# norm + activation BatchNorms


class NormActTail(nn.Module):
    """The activation (and drop) of a norm+activation BatchNorm whose BN a block absorbed: it stands
    at the BN's path and computes ``act(drop(x))``, the part of the BN's forward after the
    normalisation. Its submodules keep their names, so state-dict keys (``<bn path>.act.*``) are
    unchanged. ``norm_class`` names the BN's class (for messages)."""

    def __init__(self, parts: dict[str, nn.Module], norm_class: str = "") -> None:
        super().__init__()
        for name in ("drop", "act"):
            if name in parts:
                self.add_module(name, parts[name])
        self.norm_class = norm_class

    def forward(self, x: Tensor) -> Tensor:
        drop = self._modules.get("drop")
        if drop is not None:
            x = drop(x)
        act = self._modules.get("act")
        if act is not None:
            x = act(x)
        return x

    def restore_into(self, bn: nn.Module) -> nn.Module:
        """Put ``act`` / ``drop`` back into ``bn`` (the host layout); returns ``bn``."""
        for name, m in self._modules.items():
            setattr(bn, name, m)
        return bn

    def extra_repr(self) -> str:
        return f"norm_class={self.norm_class!r}" if self.norm_class else ""


class _Affine(nn.Module):
    def __init__(self, scale: float, shift: float) -> None:
        super().__init__()
        self.scale, self.shift = scale, shift

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale + self.shift


def _act_parts(bn: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in bn.named_children() if n in ("act", "drop")}


def _bn_like(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.batchnorm._BatchNorm) or (
        all(isinstance(getattr(m, a, None), Tensor) for a in ("running_mean", "running_var"))
        and isinstance(getattr(m, "eps", None), float)
    )


def norm_act_reason(bn: nn.Module) -> str | None:
    """``None`` when ``bn`` is a norm+activation BatchNorm whose forward is ``act(drop(BN(x)))`` with
    its ``act`` / ``drop`` submodules and a plain BatchNorm ``BN`` (proven on a copy, in train and
    eval mode; the result is cached on the module), else why it is not."""
    name = type(bn).__name__
    parts = _act_parts(bn)
    if not parts or not _bn_like(bn):
        return f"{name} is not a BatchNorm with act/drop submodules"
    key = type(bn)
    cached = bn.__dict__.get(_NORM_ACT_MARK)
    if isinstance(cached, tuple) and len(cached) == 2 and cached[0] is key:
        return cached[1]
    stats = getattr(bn, "running_mean", None)
    shared_key = ("norm_act", _scalar_state(bn, skip=("num_features",)), getattr(stats, "dtype", None))
    reason = _shared(shared_key, lambda: _probe_norm_act(bn, parts))
    bn.__dict__[_NORM_ACT_MARK] = (key, reason)
    return reason


def verified_norm_act(bn: Any) -> bool:
    """Whether :func:`norm_act_reason` proved ``bn`` a norm+activation BatchNorm (cached result only)."""
    cached = getattr(bn, "__dict__", {}).get(_NORM_ACT_MARK)
    return isinstance(cached, tuple) and len(cached) == 2 and cached[0] is type(bn) and cached[1] is None


def _probe_norm_act(bn: Any, parts: dict[str, nn.Module]) -> str | None:
    name = type(bn).__name__
    try:
        n = int(bn.running_mean.numel())
        ref = bn.running_mean
        dtype = ref.dtype if ref.is_floating_point() else torch.float32
        gen = torch.Generator().manual_seed(4321)
        x = (torch.randn(4, n, 3, 5, generator=gen, dtype=torch.float64) * 2 + 0.5).to(ref.device, dtype)
        base: Any = copy.deepcopy(bn)
        with torch.no_grad():
            base.running_mean.copy_((torch.rand(n, generator=gen, dtype=torch.float64) - 0.5).to(dtype))
            base.running_var.copy_((torch.rand(n, generator=gen, dtype=torch.float64) + 0.5).to(dtype))
            for attr in ("weight", "bias"):
                t = getattr(base, attr, None)
                if isinstance(t, Tensor):
                    t.copy_((torch.rand(n, generator=gen, dtype=torch.float64) + 0.5).to(t.dtype))
        standin: Any = copy.deepcopy(base)
        plain: Any = copy.deepcopy(base)
        if "drop" in parts:
            standin.drop, plain.drop = _Affine(2.0, 0.0), nn.Identity()
        if "act" in parts:
            standin.act, plain.act = _Affine(1.0, 1.0), nn.Identity()
        torch_bn: Any = copy.deepcopy(plain) if isinstance(bn, nn.modules.batchnorm._BatchNorm) else None
        tol = _probe_tolerance(dtype)
        with torch.no_grad():
            for training in (True, False):
                for m in (standin, plain) + ((torch_bn,) if torch_bn is not None else ()):
                    m.train(training)
                y_s, y_p = standin(x), plain(x)
                scale = 2.0 if "drop" in parts else 1.0
                shift = 1.0 if "act" in parts else 0.0
                if not _close(y_s, y_p * scale + shift, tol):
                    return (
                        f"{name}'s forward is not act(drop(batch_norm(x))) with its {'/'.join(parts)} submodules; "
                        "it cannot be split into a BatchNorm and an activation"
                    )
                if torch_bn is not None:
                    y_t = nn.modules.batchnorm._BatchNorm.forward(torch_bn, x)
                    if not _close(y_p, y_t, tol) or not _close(plain.running_mean, torch_bn.running_mean, tol):
                        return f"{name}'s normalisation is not torch's BatchNorm"
                else:
                    s = torch.rsqrt(plain.running_var.double() + float(plain.eps))
                    w = getattr(plain, "weight", None)
                    b = getattr(plain, "bias", None)
                    if isinstance(w, Tensor):
                        s = s * w.double()
                    shift_v = -plain.running_mean.double() * s + (b.double() if isinstance(b, Tensor) else 0.0)
                    y_f = x.double() * s.view(1, -1, 1, 1) + shift_v.view(1, -1, 1, 1)
                    if not _close(y_p, y_f, max(tol, 1e-6)):
                        return f"{name}'s normalisation is not a frozen BatchNorm (running statistics only)"
    except Exception as exc:  # noqa: BLE001 - any failure means "unknown form"
        return f"probing {name}'s forward failed ({type(exc).__name__}: {exc})"
    return None


def split_norm_act(bn: nn.Module) -> NormActTail:
    """Move ``act`` / ``drop`` of a proven norm+activation BatchNorm (:func:`norm_act_reason`) into a
    :class:`NormActTail` and leave identities in ``bn`` (which then computes its BatchNorm only)."""
    reason = norm_act_reason(bn)
    if reason is not None:
        raise ValueError(reason)
    parts = _act_parts(bn)
    tail = NormActTail(parts, type(bn).__name__)
    for name in parts:
        setattr(bn, name, nn.Identity())
    return tail
