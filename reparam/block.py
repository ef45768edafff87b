"""The Diverse Branch Block: named branches around an anchor conv, with exact growth, merge,
fold and re-solve.

Exactness guarantees:

* :meth:`DiverseBranchBlock.from_conv` and :meth:`~DiverseBranchBlock.add_branch` with
  ``init="zero_gamma"`` are **bit-exact in train and eval mode**: the anchor is the original conv
  (+ original BN, or a :class:`~reparam.layers.FrozenIdentityBN`), and every new branch ends in a
  BN with ``γ = β = 0`` that outputs exact zeros; running statistics of the anchor evolve exactly as
  those of the original layer.
* :meth:`~DiverseBranchBlock.merge`, :meth:`~DiverseBranchBlock.remove_branch` and
  :meth:`~DiverseBranchBlock.load_plain` are **exact in eval mode** (up to rounding: float64
  ``rel_err`` ~1e-15, float32 ~1e-7); they use running statistics. ``merge`` computes in the
  parameter dtype (at least float32; ``compute_dtype=torch.float64`` for correctly rounded float32
  weights), the others in float64, and refuses (``ReparamModeError``) while a BN of the block is in
  training mode unless ``require_eval=False``.
* ``anchor_norm="calibrated"`` and ``"batchnorm"`` are eval-exact up to rounding only.

Forward order is fixed (the registry order of :mod:`reparam.kinds`, ``KINDS`` for the built-ins):
the anchor output plus each further branch output, in that order (adding the exact zeros of a
zero-γ branch leaves the anchor output bit-identical). There is no data-dependent control flow, so
``torch.fx`` and ``torch.compile`` work on the block.

Everything kind-specific (applicability, construction and options, merge terms, nesting) is looked
up in the branch-kind registry, so a registered custom kind works in a block like a built-in one.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any, Iterable, Iterator, Mapping, Sequence, cast

import torch
from torch import Tensor, nn

from . import fused, patchfold
from .builtin_kinds import KINDS
from .kind_conv import ConvBNBranch
from .kinds import anchor_name, applicability, default_kinds, get_kind, is_kind, kind_names, make_branch
from .layers import FrozenIdentityBN
from .merge_algebra import acc_shape
from .changes import StructureChange
from .errors import AlignmentError, NotMergeableError, ReparamError, ReparamModeError
from .geometry import ConvGeometry
from .hostforms import ConvForm, as_same_pad, conv_form, is_genuine_conv, pad_same
from .transforms import BNStats, add_branches, bn_impurity, bn_stats, fuse_bn, merge_dtype

__all__ = ["DiverseBranchBlock", "DEFAULT_BRANCHES", "DEPTHWISE_BRANCHES", "ANCHOR_NORMS", "ANCHOR_STATS", "INITS"]

logger = logging.getLogger("reparam")

#: the built-in default branch sets (the kinds flagged ``in_default`` / ``in_depthwise_default``;
#: with custom kinds registered: :func:`reparam.kinds.default_kinds`)
DEFAULT_BRANCHES: tuple[str, ...] = default_kinds()
DEPTHWISE_BRANCHES: tuple[str, ...] = default_kinds(depthwise=True)
ANCHOR_NORMS: tuple[str, ...] = ("frozen_identity", "calibrated", "batchnorm")
#: new-branch initialisations: "zero_gamma" keeps the function (train and eval mode), "random_resolve"
#: keeps it in eval mode (ordinary init, anchor re-solved), "random" does not keep it (ordinary init
#: of every new branch, the anchor untouched: the DBB paper's own training set-up, for a model that
#: is trained from scratch)
INITS: tuple[str, ...] = ("zero_gamma", "random_resolve", "random")
ANCHOR_STATS: tuple[str, ...] = ("keep", "rescale", "adopt", "identity")


_WS_ANCHOR = (
    "the anchor conv is weight-standardised (its kernel is standardised per output channel, hence has zero "
    "mean and a fixed norm per channel), so it cannot be made to hold another kernel"
)


def _is_bn(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.batchnorm._BatchNorm)


def _as_batches(inputs: Any, what: str) -> list[Any]:
    """``inputs`` (a tensor or an iterable of tensors) as a non-empty list of batches."""
    batches = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    if not batches:
        raise ReparamError(f"{what} is empty")
    return batches


@contextlib.contextmanager
def _training_mode(module: nn.Module) -> Iterator[None]:
    """``module`` in training mode for the block, then its modes and buffers (BatchNorm
    statistics, batch counts) as they were: a forward in between leaves no trace."""
    modes = [(m, m.training) for m in module.modules()]
    kept = [(b, b.clone()) for b in module.buffers()]
    module.train()
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in kept:
                b.copy_(v)
        for m, mode in modes:
            m.training = mode


def _channel_moments(fn: Any, batches: Sequence[Any], channels: int, device: Any, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per-channel mean and biased variance (float64) of ``fn``'s output over ``batches`` (pooled
    over samples and positions, as BatchNorm's training statistics are)."""
    count = 0
    mean = torch.zeros(channels, dtype=torch.float64, device=device)
    m2 = torch.zeros_like(mean)
    for x in batches:
        if not isinstance(x, Tensor):
            raise ReparamError(f"calibration input must hold tensors, got {type(x).__name__}")
        z = fn(x.to(device=device, dtype=dtype))
        n_b = z.numel() // channels
        # sums accumulated in float64 without a float64 copy of the output (several times
        # cheaper): the batch mean, then the squares about its rounding to the output's dtype,
        # corrected to the mean itself (Σ(z−m)² = Σ(z−a)² − n·(m−a)²)
        bm = z.sum(dim=(0, 2, 3), dtype=torch.float64) / n_b
        shift = bm.to(z.dtype)
        d = z - shift.view(1, -1, 1, 1)
        bm2 = (d * d).sum(dim=(0, 2, 3), dtype=torch.float64) - n_b * (bm - shift.double()) ** 2
        delta = bm - mean
        total = count + n_b
        mean = mean + delta * (n_b / total)
        m2 = m2 + bm2 + delta**2 * (count * n_b / total)
        count = total
    return mean, m2 / count


def _inner_stats(stats: Any) -> str:
    """What a nested anchor's (or a conv+BN pair's) own re-solve does with its BN: ``"rescale"``
    passes down; every other mode keeps the inner statistics."""
    return "rescale" if stats == "rescale" else "keep"


def _writable_beta(bn: nn.Module) -> bool:
    return not isinstance(bn, FrozenIdentityBN) and getattr(bn, "bias", None) is not None


def check_request(branches: Any, what: str = "branches") -> None:
    """Raise :class:`ReparamError` unless ``branches`` is a branch request :meth:`DiverseBranchBlock.from_conv`
    accepts: ``None``, ``"default"``, ``"all"``, a kind, an iterable of kinds or a mapping ``kind →
    options`` with known options (``what`` names the argument in the message)."""
    names = kind_names()
    if branches is None or (isinstance(branches, str) and branches in ("default", "all")):
        return
    if isinstance(branches, str):
        if not is_kind(branches):
            raise ReparamError(
                f"{what} must be None, 'default', 'all', a kind or an iterable of kinds from {names}; "
                f"got {branches!r}"
            )
        return
    if isinstance(branches, Mapping):
        items = list(branches.items())
    else:
        try:
            items = [(k, None) for k in branches]
        except TypeError:
            raise ReparamError(f"{what} must be an iterable of kinds from {names}, got {branches!r}") from None
    for kind, opts in items:
        if not is_kind(kind):
            raise ReparamError(f"{what}: unknown branch kind {kind!r}; accepted values: {names}")
        if opts is not None:
            if not isinstance(opts, Mapping):
                raise ReparamError(f"{what}: the options of branch {kind!r} must be a mapping, got {opts!r}")
            bad = set(opts) - set(get_kind(kind).options)
            if bad:
                raise ReparamError(f"{what}: unknown options {sorted(bad)} for branch {kind!r}; "
                                   f"accepted: {sorted(get_kind(kind).options)}")


def _normalise_request(main: ConvGeometry, branches: Any) -> tuple[dict[str, dict[str, Any]], bool]:
    """-> ({kind: options} in forward order without the anchor, explicit?)."""
    check_request(branches)
    names = kind_names()
    if branches is None or branches == "default":
        return {k: {} for k in default_kinds(main.is_depthwise) if not get_kind(k).anchor}, False
    if branches == "all":
        return {k: {} for k in names if not get_kind(k).anchor}, False
    if isinstance(branches, str):
        branches = [branches]
    items = [(k, dict(v or {})) for k, v in branches.items()] if isinstance(branches, Mapping) else [(k, {}) for k in branches]
    out = {k: opts for k, opts in items if not get_kind(k).anchor}
    return {k: out[k] for k in names if k in out}, True


class DiverseBranchBlock(nn.Module):
    """A conv expanded into named parallel branches whose sum equals one conv in eval mode.

    Attributes:
        geometry: the main conv geometry (also the geometry of the merged conv).
        mode: ``"conv_bn"`` (anchor = host conv + host BN) or ``"conv"`` (host conv without BN).
        anchor_norm: ``"original"`` (conv_bn mode), ``"frozen_identity"``, ``"calibrated"`` or ``"batchnorm"``.
        branches: ``nn.ModuleDict`` keyed by kind, in forward order (:func:`reparam.kinds.kind_names`);
            the anchor (``"kxk"``, :func:`reparam.kinds.anchor_name`) is present until the block is
            deployed (:meth:`switch_to_deploy`), after which it is empty.
        bn_path / host_path: module paths of the host BN and conv (set by ``reparam.expand``).
        depth / max_depth: nesting depth of this block and the limit for nested growth.
        crop: whether branches may read an input window (a crop of the input, see
            :func:`reparam.kind_conv.conv_layout`) where their own padding cannot align them; ``False`` keeps the
            classic rule (unpadded convs then admit only ``1x1_kxk`` and ``1x1_avg``).
        gamma_floor: γ guard of the anchor inverse: re-solving the anchor divides by its BN's γ,
            so ``|γ|`` is kept at least this large.
        same_pad: the host conv pads with TensorFlow's ``SAME`` rule at every call (timm's
            ``Conv2dSame``; :mod:`reparam.hostforms`): the anchor (the host conv) pads itself, the
            other branches read the input padded the same way, and the merged conv is a
            :class:`~reparam.hostforms.SamePadConv2d`.

    What code reads from a conv, a block answers like the conv it replaced (as timm's
    re-parameterisable blocks keep ``in_chs`` / ``out_chs`` and their convs' hyper-parameters):
    ``in_channels``, ``out_channels``, ``kernel_size``, ``stride``, ``padding``, ``dilation``,
    ``groups``, ``padding_mode`` from :attr:`geometry` (tuples, as ``nn.Conv2d`` stores them), and
    ``weight`` / ``bias``: the anchor conv's own parameters (the host conv's, same objects; after
    :meth:`switch_to_deploy`, the merged conv's). So ``block.weight.device`` / ``.dtype`` /
    ``.shape`` are the conv's, and code that collects ``module.weight`` for an optimizer group or a
    weight-decay rule still finds the host parameter. They are *not* the block's equivalent kernel
    (the sum of all branches): that is :meth:`get_equivalent_kernel_bias`. ``bias`` is ``None``
    when the host conv had none (conv+BN blocks), although the block's function has a bias.

    State-dict keys: ``branches.<kind>.<sub>.<param>``, e.g. ``branches.1x1_kxk.bn2.running_var``.
    """

    #: TF "same" padding of the input at each call (set from the host conv; see the class docstring)
    same_pad: bool = False
    #: the form of the host conv (:class:`~reparam.hostforms.ConvForm`), recorded at construction
    host_form: ConvForm | None = None
    #: conv mode with a new bias (``new_bias``): the BatchNorms downstream that absorb the merged
    #: bias in the host layout, ``[{"bn": path, "offset": int, "through": 1x1 conv path | None}]``
    #: (set by ``reparam.expand``, see :func:`reparam.pairs.find_bias_sinks`; empty: none)
    bias_sink: tuple[dict[str, Any], ...] = ()

    #: the built-in kinds; registered custom kinds are listed by :func:`reparam.kinds.kind_names`
    KINDS: tuple[str, ...] = KINDS

    #: the merged conv once the block is deployed (:meth:`switch_to_deploy`; it always has a bias)
    reparam_conv: nn.Conv2d | None

    def __init__(
        self,
        geometry: ConvGeometry,
        branches: Mapping[str, nn.Module],
        *,
        mode: str = "conv_bn",
        anchor_norm: str = "original",
        depth: int = 0,
        max_depth: int = 2,
        gamma_floor: float = 1e-3,
        bn_path: str | None = None,
        host_path: str | None = None,
        new_bias: bool = False,
        crop: bool = True,
    ) -> None:
        super().__init__()
        if mode not in ("conv_bn", "conv"):
            raise ReparamError(f"mode must be 'conv_bn' or 'conv', got {mode!r}")
        if anchor_name() not in branches:
            raise ReparamError(f"a DiverseBranchBlock needs the anchor branch {anchor_name()!r}")
        unknown = [k for k in branches if not is_kind(k)]
        if unknown:
            raise ReparamError(f"unknown branch kinds {unknown}; accepted values: {kind_names()}")
        self.geometry = geometry
        self.mode = mode
        self.anchor_norm = anchor_norm
        self.depth = int(depth)
        self.max_depth = int(max_depth)
        self.gamma_floor = float(gamma_floor)
        self.bn_path = bn_path
        self.host_path = host_path
        self.new_bias = bool(new_bias)
        self.crop = bool(crop)
        self.branches = nn.ModuleDict({k: branches[k] for k in kind_names() if k in branches})
        self.register_module("reparam_conv", None)
        self._order: tuple[str, ...] = tuple(self.branches.keys())

    # ------------------------------------------------------------------------------ construction
    @classmethod
    def from_conv(
        cls,
        conv: nn.Conv2d,
        bn: nn.Module | None = None,
        branches: Any = None,
        *,
        anchor_norm: str = "frozen_identity",
        calibration_input: Tensor | Iterable[Tensor] | None = None,
        init: str = "zero_gamma",
        allow_new_bias: bool = False,
        generator: torch.Generator | None = None,
        gamma_floor: float = 1e-3,
        max_depth: int = 2,
        depth: int = 0,
        crop: bool = True,
    ) -> "DiverseBranchBlock":
        """Expand ``conv`` (+ ``bn``) into a block computing exactly the same function.

        Args:
            conv: the host ``nn.Conv2d``; it becomes the anchor conv (same object and parameters).
            bn: the BatchNorm consuming only ``conv``'s output (``conv_bn`` mode; same object and
                statistics), or ``None`` (``conv`` mode: the conv must have a bias).
            branches: ``None``/``"default"`` (the default set, inapplicable kinds skipped with an
                INFO log), ``"all"`` (every applicable kind), or an iterable of kinds / a mapping
                ``kind -> options`` (explicit: an inapplicable kind raises ``AlignmentError``).
                Options: ``1x1_kxk``: ``internal``, ``identity_init``; ``1x1_avg``: ``path``.
            anchor_norm: ``conv`` mode only: ``"frozen_identity"`` (bit-exact train+eval),
                ``"calibrated"`` (a real BN set from ``calibration_input``, eval-exact up to
                rounding) or ``"batchnorm"`` (BN reset to γ=1, β=0, μ=0, v=1−eps; eval-exact).
            calibration_input: input batch (or iterable of batches) of ``conv`` for ``"calibrated"``.
            init: ``"zero_gamma"`` (bit-exact train+eval), ``"random_resolve"`` (ordinary last-BN
                init, anchor re-solved; eval-exact only) or ``"random"`` (ordinary init, the anchor
                untouched: the function changes; for a model about to be trained from scratch).
            allow_new_bias: accept a conv without bias and without BN by giving it a zero bias
                (changes the host layer's parameter set).
            generator: RNG of the new branches' conv initialisation.
            crop: allow input-window branches (``1x1``, ``1xk``, ``kx1``, ``identity`` on convs
                whose padding cannot centre them, e.g. unpadded convs); ``False``: classic rule.

        Raises:
            NotMergeableError: not a plain ``Conv2d``; BN without running statistics; no bias and
                no BN without ``allow_new_bias``.
            AlignmentError: an explicitly requested branch is not applicable.
        """
        form = conv_form(conv)
        if isinstance(form, str):
            raise NotMergeableError(form)
        geometry = ConvGeometry.from_conv(conv)
        if init not in INITS:
            raise ReparamError(f"init must be one of {INITS}, got {init!r}")
        if init == "random_resolve" and form.standardized:
            raise NotMergeableError(_WS_ANCHOR + " (init='random_resolve' re-solves it); use init='zero_gamma'")
        p = conv.weight
        factory: dict[str, Any] = {"device": p.device, "dtype": p.dtype}
        if bn is not None:
            stats = bn_stats(bn)  # refuses norms without running statistics
            impure = bn_impurity(bn)
            if impure is not None:
                raise NotMergeableError(impure)
            n = getattr(bn, "num_features", None) or stats.mean.numel()
            if n != geometry.out_channels:
                raise ReparamError(f"bn has {n} channels but the conv has {geometry.out_channels} outputs")
        else:
            if anchor_norm not in ANCHOR_NORMS:
                raise ReparamError(f"anchor_norm must be one of {ANCHOR_NORMS}, got {anchor_norm!r}")
            if conv.bias is None and not allow_new_bias:
                raise NotMergeableError(
                    "conv has no bias and no following BatchNorm: the merged bias of the block would "
                    "have nowhere to go; pass allow_new_bias=True (adds a bias to the layer) or expand "
                    "it together with its BN"
                )
        # validate the request before anything is modified
        requested, explicit = _normalise_request(geometry, branches)
        reasons = applicability(geometry, crop=crop)
        kinds: dict[str, dict[str, Any]] = {}
        for kind, opts in requested.items():
            if reasons[kind] is not None:
                if explicit:
                    raise AlignmentError(reasons[kind])
                logger.info("skipping branch %s: %s", kind, reasons[kind])
                continue
            kinds[kind] = opts
        new_bias = False
        if bn is not None:
            mode, norm_name, norm, eps = "conv_bn", "original", bn, float(cast(float, bn.eps))
        else:
            mode, norm_name, eps = "conv", anchor_norm, 1e-5
            norm = cls._make_anchor_norm(conv, anchor_norm, calibration_input, eps, factory)
            if conv.bias is None:
                conv.bias = nn.Parameter(torch.zeros(geometry.out_channels, **factory))
                geometry = geometry.replace(bias=True)
                new_bias = True
        anchor = anchor_name()
        block = cls(
            geometry,
            {anchor: ConvBNBranch(anchor, conv, norm)},
            mode=mode,
            anchor_norm=norm_name,
            depth=depth,
            max_depth=max_depth,
            gamma_floor=gamma_floor,
            new_bias=new_bias,
            crop=crop,
        )
        block.same_pad, block.host_form = form.same_pad, form
        block._set_mode_flag(conv.training)
        target = None
        if init == "random_resolve":
            target = block._merged_pair(torch.float64)
        for kind, opts in kinds.items():
            block._insert(kind, block._new_branch(kind, opts, eps, zero_last=init == "zero_gamma", generator=generator))
        if target is not None and len(block._order) > 1:
            block._solve_for_total(*target, stats="keep")
        return block

    @classmethod
    def from_spec(
        cls, conv: nn.Conv2d, bn: nn.Module | None, spec: Mapping[str, Any]
    ) -> "DiverseBranchBlock":
        """Rebuild the structure recorded by :meth:`spec` around ``conv`` (+ ``bn``), with fresh
        branch parameters (load a state dict afterwards)."""
        try:
            mode = spec["mode"]
            anchor_norm = spec.get("anchor_norm", "original")
            branch_specs = dict(spec["branches"])
        except (KeyError, TypeError) as exc:
            raise ReparamError(f"invalid block spec {spec!r}: {exc}") from exc
        if mode == "conv_bn" and bn is None:
            raise ReparamError("block spec has mode 'conv_bn' but no BatchNorm was given")
        if mode == "conv":
            bn = None
            if conv.bias is None and spec.get("new_bias", False):
                conv.bias = nn.Parameter(torch.zeros(conv.out_channels, device=conv.weight.device, dtype=conv.weight.dtype))
        form = conv_form(conv)
        if isinstance(form, str):
            raise NotMergeableError(form)
        recorded_form = dict(spec.get("host_form", {}) or {})
        if recorded_form != ({} if form.plain else form.to_dict()):
            raise ReparamError(
                f"the conv is {form.describe()} but the block spec records "
                f"{ConvForm(**recorded_form).describe() if recorded_form else 'a plain conv'}"
            )
        geometry = ConvGeometry.from_conv(conv)
        recorded = spec.get("geometry")
        if recorded is not None and ConvGeometry.from_dict(recorded) != geometry:
            raise ReparamError(
                f"conv geometry {geometry.to_dict()} does not match the spec's geometry {recorded}"
            )
        p = conv.weight
        factory: dict[str, Any] = {"device": p.device, "dtype": p.dtype}
        eps = float(spec.get("eps", bn.eps if bn is not None else 1e-5))
        norm: nn.Module
        if mode == "conv_bn":
            assert bn is not None  # refused above
            norm = bn
        elif anchor_norm == "frozen_identity":
            norm = FrozenIdentityBN(geometry.out_channels, eps, **factory)
        elif anchor_norm in ("calibrated", "batchnorm"):
            norm = nn.BatchNorm2d(geometry.out_channels, eps=eps, **factory)
        else:
            raise ReparamError(f"unknown anchor_norm {anchor_norm!r} in block spec")
        anchor = anchor_name()
        block = cls(
            geometry,
            {anchor: ConvBNBranch(anchor, conv, norm)},
            mode=mode,
            anchor_norm=anchor_norm,
            depth=int(spec.get("depth", 0)),
            max_depth=int(spec.get("max_depth", 2)),
            gamma_floor=float(spec.get("gamma_floor", 1e-3)),
            bn_path=spec.get("bn_path"),
            new_bias=bool(spec.get("new_bias", False)),
            # specs written before input windows existed hold only kinds that need none
            crop=bool(spec.get("crop", True)),
        )
        block.same_pad, block.host_form = form.same_pad, form
        block.bias_sink = tuple(dict(s) for s in spec.get("bias_sink", ()) or ())
        block._set_mode_flag(conv.training)
        unknown = [k for k in branch_specs if not is_kind(k)]
        if unknown:
            raise ReparamError(f"block spec names unknown branch kinds {unknown}; accepted values: {kind_names()}")
        for kind in kind_names():
            if get_kind(kind).anchor or kind not in branch_specs:
                continue
            accepted = get_kind(kind).options
            opts = {k: v for k, v in dict(branch_specs[kind] or {}).items() if k in accepted}
            block._insert(kind, block._new_branch(kind, opts, eps, zero_last=True, generator=None))
        for name, sub in dict(spec.get("nested", {}) or {}).items():
            block.grow_nested(name, spec=sub)
        if spec.get("deployed", False):
            block.switch_to_deploy(require_eval=False)
        return block

    @staticmethod
    def _make_anchor_norm(
        conv: nn.Conv2d,
        anchor_norm: str,
        calibration_input: Tensor | Iterable[Tensor] | None,
        eps: float,
        factory: dict[str, Any],
    ) -> nn.Module:
        o = conv.out_channels
        if anchor_norm == "frozen_identity":
            return FrozenIdentityBN(o, eps, **factory)
        bn = nn.BatchNorm2d(o, eps=eps, **factory)
        bn.train(conv.training)
        running_mean, running_var = cast(Tensor, bn.running_mean), cast(Tensor, bn.running_var)
        with torch.no_grad():
            running_mean.zero_()
            running_var.fill_(1.0 - eps)
            bn.weight.fill_(1.0)
            bn.bias.zero_()
        if anchor_norm == "batchnorm":
            return bn
        if calibration_input is None:
            raise ReparamError("anchor_norm='calibrated' needs calibration_input (input batches of the conv)")
        batches = _as_batches(calibration_input, "calibration_input")
        with torch.no_grad():
            mean, var = _channel_moments(conv, batches, o, conv.weight.device, conv.weight.dtype)
            ok = var > eps
            rm = torch.where(ok, mean, torch.zeros_like(mean)).to(running_mean.dtype)
            rv = torch.where(ok, var - eps, torch.full_like(var, 1.0 - eps)).to(running_var.dtype)
            running_mean.copy_(rm)
            running_var.copy_(rv)
            bn.weight.copy_(torch.where(ok.to(rv.device), torch.sqrt(rv + eps), torch.ones_like(rv)))
            bn.bias.copy_(rm)
        n_fallback = int((~ok).sum())
        if n_fallback:
            logger.info("calibrated anchor: %d channel(s) with variance <= eps use identity statistics", n_fallback)
        return bn

    def _set_mode_flag(self, training: bool) -> None:
        """Set the train/eval flag of the block and its branch containers without touching the host
        modules' own flags (a host BN kept in eval mode inside a training model stays so)."""
        self.training = training
        self.branches.training = training
        for branch in self.branches.values():
            branch.training = training

    def _factory(self) -> dict[str, Any]:
        """Device and dtype of new modules: those of the anchor conv weight."""
        p = self._factory_weight()
        return {"device": p.device, "dtype": p.dtype}

    def _factory_weight(self) -> Tensor:
        if self.reparam_conv is not None:
            return self.reparam_conv.weight
        conv = self.anchor.conv
        return conv._factory_weight() if isinstance(conv, DiverseBranchBlock) else cast(nn.Conv2d, conv).weight

    def _new_branch(
        self, kind: str, opts: Mapping[str, Any], eps: float, *, zero_last: bool, generator: torch.Generator | None
    ) -> nn.Module:
        allowed = get_kind(kind).options
        bad = set(opts) - set(allowed)
        if bad:
            raise ReparamError(f"unknown options {sorted(bad)} for branch {kind!r}; accepted: {sorted(allowed)}")
        branch = make_branch(
            kind,
            self.geometry,
            eps=eps,
            momentum=0.1,
            zero_last=zero_last,
            generator=generator,
            crop=self.crop,
            options=opts,
            **self._factory(),
        )
        branch.train(self.training)
        return branch

    def _insert(self, kind: str, branch: nn.Module) -> None:
        items = dict(self.branches.items())
        items[kind] = branch
        for k in list(self.branches.keys()):
            del self.branches[k]
        for k in kind_names():
            if k in items:
                self.branches[k] = items[k]
        self._order = tuple(self.branches.keys())

    def _delete(self, kind: str) -> nn.Module:
        branch = self.branches[kind]
        del self.branches[kind]
        self._order = tuple(self.branches.keys())
        return branch

    def _present_anchor(self) -> ConvBNBranch | None:
        """The anchor branch, ``None`` once the block is deployed."""
        name = anchor_name()
        return cast(ConvBNBranch, self.branches[name]) if name in self.branches else None

    def _anchor_standardized(self) -> bool:
        """Whether the anchor conv is a weight-standardised host conv (:mod:`reparam.hostforms`)."""
        anchor = self._present_anchor()
        if self.reparam_conv is not None or anchor is None:
            return False
        conv = anchor.conv
        if type(conv) is nn.Conv2d or isinstance(conv, DiverseBranchBlock):
            return False
        form = conv_form(conv)
        return isinstance(form, ConvForm) and form.standardized

    def _require_writable_anchor(self, what: str) -> None:
        if self._anchor_standardized():
            raise NotMergeableError(f"{what}: {_WS_ANCHOR}; merge with target='deploy' instead")

    # ------------------------------------------------------------------------------ properties
    @property
    def anchor(self) -> ConvBNBranch:
        """The anchor branch ``kxk`` (host conv → norm)."""
        anchor = self._present_anchor()
        if anchor is None:
            raise ReparamError("the block is deployed; it has no branches left")
        return anchor

    @property
    def branch_names(self) -> list[str]:
        """Present kinds in forward order (empty once deployed)."""
        return list(self._order)

    @property
    def is_merged(self) -> bool:
        """True after :meth:`switch_to_deploy` (the block then holds one conv)."""
        return self.reparam_conv is not None

    deployed = is_merged

    def applicable(self) -> list[str]:
        """Kinds applicable to this geometry (their kernels embed exactly), in forward order."""
        return [k for k, r in applicability(self.geometry, crop=self.crop).items() if r is None]

    def extra_repr(self) -> str:
        g = self.geometry
        return (
            f"{g.in_channels}, {g.out_channels}, kernel_size={g.kernel_size}, stride={g.stride}, "
            f"padding={g.padding}, dilation={g.dilation}, groups={g.groups}, mode={self.mode!r}, "
            f"anchor_norm={self.anchor_norm!r}, deployed={self.is_merged}"
        )

    # ------------------------------------------------------------------------------ forward
    def forward(self, x: Tensor) -> Tensor:
        if self.reparam_conv is not None:
            return self.reparam_conv(x)
        if self.same_pad:
            return self._forward_same_pad(x)
        if self.training and len(self._order) > 1:
            if patchfold.usable(self, x):
                return patchfold.block_forward(self, x)
            if fused.usable(self, x):
                return fused.block_forward(self, x)
        order = self._order
        out = self.branches[order[0]](x)
        if len(order) > 1:
            out = out + self.branches[order[1]](x)  # a fresh tensor: later sums accumulate in place
            for name in order[2:]:
                out = out.add_(self.branches[name](x))
        return out

    def _forward_same_pad(self, x: Tensor) -> Tensor:
        """The anchor (the host conv, which pads itself) on ``x``, every other branch on ``x``
        padded by TensorFlow's ``SAME`` rule (then a padding-0 conv's input); same sum order."""
        order = self._order
        xp = pad_same(x, self.geometry.kernel_size, self.geometry.stride, self.geometry.dilation) if len(order) > 1 else x
        anchor = anchor_name()
        outs = (self.branches[n](x if n == anchor else xp) for n in order)
        out = next(outs)
        if len(order) > 1:
            out = out + next(outs)  # a fresh tensor: later sums accumulate in place
            for y in outs:
                out = out.add_(y)
        return out

    # ------------------------------------------------------------------------------ conv attributes
    @property
    def in_channels(self) -> int:
        return self.geometry.in_channels

    @property
    def out_channels(self) -> int:
        return self.geometry.out_channels

    @property
    def kernel_size(self) -> tuple[int, int]:
        return self.geometry.kernel_size

    @property
    def stride(self) -> tuple[int, int]:
        return self.geometry.stride

    @property
    def padding(self) -> tuple[int, int]:
        return self.geometry.padding

    @property
    def dilation(self) -> tuple[int, int]:
        return self.geometry.dilation

    @property
    def groups(self) -> int:
        return self.geometry.groups

    @property
    def padding_mode(self) -> str:
        return self.geometry.padding_mode

    def _host_conv_module(self) -> nn.Conv2d:
        if self.reparam_conv is not None:
            return self.reparam_conv
        conv = self.anchor.conv
        if isinstance(conv, DiverseBranchBlock):  # nested block: its own anchor
            return conv._host_conv_module()
        return cast(nn.Conv2d, conv)

    def _deployed_pair(self) -> tuple[Tensor, Tensor]:
        """Weight and bias of the merged conv of a deployed block."""
        conv = cast(nn.Conv2d, self.reparam_conv)
        return conv.weight, cast(Tensor, conv.bias)

    @property
    def weight(self) -> Tensor:
        """The anchor conv's weight (the host conv's parameter; see the class docstring)."""
        return self._host_conv_module().weight

    @property
    def bias(self) -> Tensor | None:
        """The anchor conv's bias, ``None`` when it has none (see the class docstring)."""
        return self._host_conv_module().bias

    # ------------------------------------------------------------------------------ equivalent pairs
    def _equivalent(self, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        if self.reparam_conv is not None:
            w, b = self._deployed_pair()
            return (w, b) if dtype is None else (w.to(dtype), b.to(dtype))
        pairs = [get_kind(n).kernel_bias(self.branches[n], self.geometry, dtype) for n in self._order]
        return add_branches(pairs)

    #: elements of one chunk of the merge accumulator (2 MiB in float64): the chunked merge writes
    #: each chunk of output rows straight into the target conv, so its float64 temporaries stay in
    #: cache instead of making several passes over a full-size float64 kernel
    MERGE_CHUNK_ELEMENTS: int = 1 << 18

    @torch.no_grad()
    def _merged_pair(
        self,
        dtype: torch.dtype = torch.float64,
        names: Iterable[str] | None = None,
        out: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Non-differentiable equivalent pair accumulated in place in ``dtype`` (the merge path).

        ``names`` restricts the sum to some branches (default: all present). With ``out`` (a weight
        and a bias tensor of the merged conv, any dtype) the pair is computed in chunks of output
        channels, each cast into ``out`` as soon as it is complete; ``out`` is returned.
        """
        if self.reparam_conv is not None:
            w, b = self._deployed_pair()
            if out is not None:
                out[0].copy_(w)
                out[1].copy_(b)
                return out
            return w.to(dtype, copy=True), b.to(dtype, copy=True)
        chosen = list(self._order if names is None else [n for n in self._order if n in set(names)])
        # kinds whose kernel is a broadcast (O, C/g, 1, 1) term go first (the next term expands it)
        chosen.sort(key=lambda n: not get_kind(n).broadcast_merge)
        device = self._factory()["device"]
        if out is None:
            return self._accumulate(chosen, dtype, device, None)
        # chunks keep a wider compute dtype's temporaries in cache; in the output's own dtype the
        # whole kernel at once measured faster (fewer, larger products and passes)
        chunks = self._row_chunks() if dtype.itemsize > out[0].dtype.itemsize else [None]
        terms = None
        if len(chunks) > 1:  # per-branch vectors once, not once per chunk
            terms = {n: get_kind(n).merge_terms(self.branches[n], self.geometry, dtype) for n in chosen}
        for rows in chunks:
            k, b = self._accumulate(chosen, dtype, device, rows, terms)
            target = (out[0], out[1]) if rows is None else (out[0][rows], out[1][rows])
            target[0].copy_(k)
            target[1].copy_(b)
        return out

    def _row_chunks(self) -> list[slice | None]:
        """Output-row chunks of about :attr:`MERGE_CHUNK_ELEMENTS` elements; each lies inside one
        group or covers whole groups. ``[None]`` when the kernel is one chunk."""
        o, cg, kh, kw = self.geometry.weight_shape
        per_group = o // self.geometry.groups
        rows = max(1, self.MERGE_CHUNK_ELEMENTS // (cg * kh * kw))
        if rows >= o:
            return [None]
        if rows >= per_group:  # whole groups per chunk
            step = (rows // per_group) * per_group
            return [slice(s, min(o, s + step)) for s in range(0, o, step)]
        # chunks inside each group
        return [slice(g0 + s, min(g0 + per_group, g0 + s + rows)) for g0 in range(0, o, per_group) for s in range(0, per_group, rows)]

    def _accumulate(
        self, chosen: Sequence[str], dtype: torch.dtype, device: Any, rows: slice | None,
        terms: Mapping[str, Any] | None = None,
    ) -> tuple[Tensor, Tensor]:
        shape = acc_shape(self.geometry, rows)
        bias = torch.zeros(shape[0], dtype=dtype, device=device)
        acc: Tensor | None = None
        for n in chosen:
            t = None if terms is None else terms[n]
            acc = get_kind(n).accumulate(self.branches[n], acc, bias, self.geometry, rows, t)
        if acc is None:
            acc = torch.zeros(shape, dtype=dtype, device=device)
        elif tuple(acc.shape) != shape:
            acc = acc.expand(shape).contiguous()
        return acc, bias

    def get_equivalent_kernel_bias(self) -> tuple[Tensor, Tensor]:
        """``(K, b)`` of the whole block in the parameter dtype; differentiable; eval-exact."""
        return self._equivalent(None)

    def branch_kernel_bias(self, name: str, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """Equivalent pair of one branch at the main kernel size (differentiable, eval-exact)."""
        self._require_branch(name)
        return get_kind(name).kernel_bias(self.branches[name], self.geometry, dtype)

    def branch_parameters(self, name: str) -> list[nn.Parameter]:
        """Trainable parameters of one branch (for the anchor: the host conv and BN parameters)."""
        self._require_branch(name)
        return [p for p in self.branches[name].parameters() if p.requires_grad]

    def _require_branch(self, name: str) -> None:
        if not is_kind(name):
            raise ReparamError(f"unknown branch {name!r}; accepted values: {kind_names()}")
        if name not in self.branches:
            raise ReparamError(f"branch {name!r} is not present (present: {self.branch_names})")

    # ------------------------------------------------------------------------------ merge
    def _check_eval(self) -> None:
        for name, m in self.named_modules():
            if _is_bn(m) and m.training:
                raise ReparamModeError(
                    f"BatchNorm {name!r} of the block is in training mode; merging is exact in eval mode "
                    "only (it uses running statistics): call model.eval() first, or pass require_eval=False"
                )

    def merge(
        self, *, require_eval: bool = True, compute_dtype: torch.dtype | None = None, consume: bool = False
    ) -> nn.Conv2d:
        """The plain ``nn.Conv2d`` (with bias) equal to this block in eval mode (a
        :class:`~reparam.hostforms.SamePadConv2d` when the host conv pads with TF's "same" rule).

        Built with keyword arguments from :attr:`geometry`, computed in ``compute_dtype`` (default:
        the parameter dtype, at least float32; see :func:`reparam.transforms.merge_dtype`) and cast
        to the parameter dtype and device; the parameters are trainable. Idempotent: a deployed
        block returns its conv.

        The block itself is not modified unless ``consume=True``: then the merged kernel is written
        into the storage of the anchor kernel (same shape, read chunk by chunk before it is
        overwritten), which saves allocating and faulting in a new kernel. Use it only when the block
        is discarded or deployed right after (``switch_to_deploy`` and ``reparam.merge(model,
        inplace=True)`` do); the consumed block no longer computes its old function.

        Raises:
            ReparamModeError: a BN of the block is in training mode and ``require_eval`` is True.
        """
        if self.reparam_conv is not None:
            return self.reparam_conv
        if require_eval:
            self._check_eval()
        factory = self._factory()
        with torch.no_grad():
            storage = self._consumable_anchor_weight(factory) if consume else None
            conv = self.geometry.make_conv(bias=True, initialize=False, weight=storage, **factory)
            self._merged_pair(merge_dtype(conv.weight.dtype, compute_dtype), out=(conv.weight, cast(Tensor, conv.bias)))
        if self.same_pad:
            as_same_pad(conv)
        conv.train(self.training)
        return conv

    def _consumable_anchor_weight(self, factory: Mapping[str, Any]) -> Tensor | None:
        """The anchor kernel's tensor when the merged kernel may be written into it, else ``None``."""
        anchor = self._present_anchor()
        conv = anchor.conv if anchor is not None else None
        if type(conv) is not nn.Conv2d:
            return None
        w = conv.weight.detach()
        same = tuple(w.shape) == self.geometry.weight_shape and w.dtype == factory["dtype"]
        return w if same and w.device == torch.device(factory["device"]) and w.is_contiguous() else None

    def switch_to_deploy(self, *, require_eval: bool = True) -> None:
        """In place: replace the branches by one merged conv (``reparam_conv``). Idempotent."""
        if self.reparam_conv is not None:
            return
        conv = self.merge(require_eval=require_eval, consume=True)
        for k in list(self.branches.keys()):
            del self.branches[k]
        self._order = ()
        self.reparam_conv = conv

    def reparameterize(self) -> None:
        """Alias of :meth:`switch_to_deploy` (timm's verb)."""
        self.switch_to_deploy()

    # ------------------------------------------------------------------------------ anchor solve
    def _solve_anchor(self, k_t: Tensor, b_t: Tensor, stats: str | BNStats = "keep", conv_bias_t: Tensor | None = None) -> list[nn.Parameter]:
        """Set the anchor so that its eval pair is ``(k_t, b_t)`` (float64). Returns overwritten params."""
        self._require_writable_anchor("re-solving the anchor")
        anchor = self.anchor
        conv: Any = anchor.conv  # a conv, or a nested block
        bn: Any = anchor.bn  # a BatchNorm-like norm or a FrozenIdentityBN
        overwritten: list[nn.Parameter] = []
        f64 = torch.float64

        def write(t: Tensor | None, value: Tensor) -> None:
            if t is None:
                raise ReparamError("internal: nowhere to write an anchor value")
            t.copy_(value.to(t.dtype))
            if isinstance(t, nn.Parameter) and not any(t is q for q in overwritten):
                overwritten.append(t)

        with torch.no_grad():
            if isinstance(stats, BNStats) or stats == "identity":
                if isinstance(bn, FrozenIdentityBN):
                    if isinstance(stats, BNStats):
                        raise ReparamError(
                            "anchor_stats='adopt' needs a BatchNorm anchor; this block's anchor norm is a "
                            "FrozenIdentityBN (use 'keep')"
                        )
                else:
                    n = bn.running_mean.numel()
                    eps = float(bn.eps)
                    if isinstance(stats, BNStats):
                        mean, var = stats.mean, stats.var
                        gamma = stats.gamma if stats.gamma is not None else torch.ones(n)
                        beta = stats.beta if stats.beta is not None else torch.zeros(n)
                        if abs(stats.eps - eps) > 0:
                            bn.eps = stats.eps
                    else:
                        mean, var = torch.zeros(n), torch.full((n,), 1.0 - eps, dtype=f64)
                        gamma, beta = torch.ones(n), torch.zeros(n)
                    bn.running_mean.copy_(mean.to(bn.running_mean.dtype))
                    bn.running_var.copy_(var.to(bn.running_var.dtype))
                    if getattr(bn, "weight", None) is not None:
                        write(bn.weight, gamma)
                    if getattr(bn, "bias", None) is not None:
                        write(bn.bias, beta)
                    if isinstance(stats, BNStats) and conv_bias_t is not None and not isinstance(conv, DiverseBranchBlock) and conv.bias is not None:
                        write(conv.bias, conv_bias_t)
            nested = isinstance(conv, DiverseBranchBlock)
            inner = conv._merged_pair(f64) if nested else None  # a nested anchor's eval pair, once
            if stats == "rescale":
                self._rescale_anchor_gamma(inner[0] if inner is not None else conv.weight.detach().to(f64), bn, k_t, write)
            # gamma guard: the inverse below divides by γ; keep |γ| >= gamma_floor
            gamma_t = getattr(bn, "weight", None)
            if gamma_t is not None and not isinstance(bn, FrozenIdentityBN):
                small = gamma_t.abs() < self.gamma_floor
                n_small = int(small.sum())
                if n_small:
                    sign = torch.where(gamma_t < 0, -torch.ones_like(gamma_t), torch.ones_like(gamma_t))
                    write(gamma_t, torch.where(small, sign * self.gamma_floor, gamma_t))
                    logger.info("gamma guard: %d anchor channel(s) clamped to |gamma| = %g", n_small, self.gamma_floor)
            s = bn_stats(bn)
            dev = k_t.device
            n = k_t.shape[0]
            mu = s.mean.to(f64)
            sigma = torch.sqrt(s.var.to(f64) + s.eps)
            gamma = s.gamma.to(f64) if s.gamma is not None else torch.ones(n, dtype=f64, device=dev)
            beta = s.beta.to(f64) if s.beta is not None else torch.zeros(n, dtype=f64, device=dev)
            w = k_t * (sigma / gamma).reshape(-1, 1, 1, 1)
            if nested:
                assert inner is not None
                if _writable_beta(bn):
                    # β takes the bias; the nested block keeps its own (its output's mean, which the
                    # anchor BN's running mean describes, does not move)
                    c = inner[1].to(dev)
                    write(bn.bias, b_t - (gamma / sigma) * (c - mu))
                else:
                    c = mu + (sigma / gamma) * (b_t - beta)
                for p in conv.load_plain(w, c, anchor_stats=_inner_stats(stats)).overwritten:
                    if not any(p is q for q in overwritten):
                        overwritten.append(p)
            elif _writable_beta(bn):
                c = conv.bias.to(f64) if conv.bias is not None else torch.zeros_like(mu)
                write(bn.bias, b_t - (gamma / sigma) * (c - mu))
                write(conv.weight, w)
            elif conv.bias is not None:
                write(conv.bias, mu + (sigma / gamma) * (b_t - beta))
                write(conv.weight, w)
            else:
                # BN without affine parameters and conv without bias: move the running mean
                bn.running_mean.copy_((-(sigma / gamma) * (b_t - beta)).to(bn.running_mean.dtype))
                write(conv.weight, w)
        return overwritten

    @staticmethod
    def _rescale_anchor_gamma(w_old: Tensor, bn: Any, k_t: Tensor, write: Any) -> None:
        """``anchor_stats="rescale"``: set the anchor BN's ``γ`` so that the anchor solve keeps the
        norm of each of the anchor conv's filters; the running statistics stay.

        The anchor's eval kernel is ``(γ/σ)·W``; a target ``A`` is met by ``W = A·σ/γ``. Keeping
        ``γ`` puts every change of scale into ``W``, and the BN's running variance then follows
        ``W`` in training, so a target larger than the trained ``γ`` multiplies the conv's scale
        round after round. Here ``γ_c = sign(γ_c)·σ_c·‖A_c‖/‖W_c‖`` (per output channel ``c``), so
        ``W_c = A_c·‖W_c‖/‖A_c‖``: the filter keeps its norm, the running statistics stay
        consistent with it, and ``γ`` carries the target's scale as it does in training. Channels
        with a zero filter or a zero target keep their ``γ``. ``w_old``: the anchor conv's kernel
        before the solve (:meth:`_anchor_kernel`)."""
        gamma_t = getattr(bn, "weight", None)
        if gamma_t is None or isinstance(bn, FrozenIdentityBN):
            return
        f64 = torch.float64
        n_old = w_old.flatten(1).norm(dim=1).to(k_t.device)
        n_new = k_t.to(f64).flatten(1).norm(dim=1)
        s = bn_stats(bn)
        sigma = torch.sqrt(s.var.detach().to(f64) + s.eps).to(k_t.device)
        g_old = gamma_t.detach().to(f64).to(k_t.device)
        sign = torch.where(g_old < 0, -torch.ones_like(g_old), torch.ones_like(g_old))
        g_new = sign * sigma * n_new / n_old.clamp_min(torch.finfo(f64).tiny)
        ok = (n_old > 0) & (n_new > 0) & torch.isfinite(g_new) & (g_new != 0)
        write(gamma_t, torch.where(ok, g_new, g_old))

    def _anchor_kernel(self, dtype: torch.dtype = torch.float64) -> Tensor:
        """The anchor conv's kernel before its BN (a nested anchor: its merged kernel), detached."""
        conv = self.anchor.conv
        if isinstance(conv, DiverseBranchBlock):
            return conv._merged_pair(dtype)[0]
        return cast(nn.Conv2d, conv).weight.detach().to(dtype, copy=True)

    def calibrate_anchor(self, inputs: Tensor | Iterable[Tensor]) -> StructureChange:
        """Measure the anchor BN's running statistics on ``inputs`` (batches of this block's input)
        and re-solve the anchor so that the block's eval function is unchanged (eval-exact up to
        rounding).

        The statistics are those of the anchor conv's output in training mode (a nested block's
        branches normalised by their batch statistics), as the anchor BN sees it when training
        starts; each anchor filter keeps its norm and ``γ`` takes the scale (``"rescale"``). After
        a re-solve from another model's weights (REP), training mode on such data then starts from
        the eval function instead of from the stale statistics' scale. Channels whose variance is
        not above the BN's ``eps`` keep their statistics. A no-op for an anchor without a
        BatchNorm of its own (``FrozenIdentityBN``) and for a deployed block.
        """
        if self.reparam_conv is not None:
            return StructureChange(paths=self._path_list())
        anchor = self.anchor
        bn: Any = anchor.bn
        if isinstance(bn, FrozenIdentityBN) or not isinstance(getattr(bn, "running_var", None), Tensor):
            return StructureChange(paths=self._path_list())
        self._require_writable_anchor("calibrating the anchor")
        batches = _as_batches(inputs, "calibrate_anchor: inputs")
        with torch.no_grad():
            target = self._merged_pair(torch.float64)
            # the anchor conv's training-mode output; a plain conv's does not depend on the mode,
            # a nested block's does, and updates its own statistics, which are put back after
            conv = anchor.conv
            factory = self._factory()
            with _training_mode(conv):
                mean, var = _channel_moments(conv, batches, self.geometry.out_channels, factory["device"], factory["dtype"])
            # the batch's biased variance: training normalises by sqrt(var + eps), and so does eval
            ok = var > float(bn.eps)
            bn.running_mean.copy_(torch.where(ok, mean, bn.running_mean.to(mean.dtype)).to(bn.running_mean.dtype))
            bn.running_var.copy_(torch.where(ok, var, bn.running_var.to(var.dtype)).to(bn.running_var.dtype))
        overwritten = self._solve_for_total(*target, stats="rescale")
        return StructureChange(overwritten=overwritten, paths=self._path_list())

    def _pairs_except(self, names: Sequence[str], dtype: torch.dtype) -> tuple[Tensor, Tensor] | None:
        rest = [n for n in self._order if n not in names]
        return self._merged_pair(dtype, rest) if rest else None

    def _solve_for_total(self, k_total: Tensor, b_total: Tensor, *, stats: str | BNStats = "keep", conv_bias_t: Tensor | None = None) -> list[nn.Parameter]:
        """Re-solve the anchor so the whole block's eval pair is ``(k_total, b_total)``."""
        with torch.no_grad():
            rest = self._pairs_except([anchor_name()], torch.float64)
            k_t, b_t = k_total.to(torch.float64), b_total.to(torch.float64)
            if rest is not None:
                k_t = k_t - rest[0]
                b_t = b_t - rest[1]
        return self._solve_anchor(k_t, b_t, stats, conv_bias_t)

    def _path_list(self) -> list[str]:
        return [self.host_path] if self.host_path is not None else []

    # ------------------------------------------------------------------------------ structure changes
    def _reference(self, p: nn.Parameter, owner: nn.Module) -> nn.Parameter:
        """The anchor parameter whose optimizer group a new parameter ``p`` of module ``owner`` joins:
        conv weights -> anchor conv weight; BN weights -> anchor BN weight; BN biases -> anchor BN
        bias (conv mode: anchor conv bias); the anchor conv weight when no such parameter exists."""
        conv: Any = self.anchor.conv  # a conv, or a nested block
        conv_w = cast(nn.Parameter, conv._factory_weight() if isinstance(conv, DiverseBranchBlock) else conv.weight)
        if isinstance(owner, nn.Conv2d):
            return conv_w
        bn: Any = self.anchor.bn
        is_weight = getattr(owner, "weight", None) is p
        conv_bias = None if isinstance(conv, DiverseBranchBlock) else getattr(conv, "bias", None)  # not a nested block's
        candidates = [getattr(bn, "weight", None)] if is_weight else [getattr(bn, "bias", None), conv_bias]
        for c in candidates:
            if isinstance(c, nn.Parameter):
                return c
        return conv_w

    def _added(self, branch: nn.Module) -> list[tuple[nn.Parameter, nn.Parameter]]:
        out = []
        for m in branch.modules():
            for p in m.parameters(recurse=False):
                out.append((p, self._reference(p, m)))
        return out

    def add_branch(
        self,
        kind: str,
        *,
        init: str = "zero_gamma",
        generator: torch.Generator | None = None,
        **options: Any,
    ) -> StructureChange:
        """Add a branch of ``kind``.

        ``init="zero_gamma"``: the new branch's last BN has ``γ = β = 0``; the block output is
        bit-identical in train and eval mode. ``init="random_resolve"``: ordinary init and the anchor
        re-solved so the eval output is unchanged (eval-exact only; DynamicFL Eq. 16).
        ``init="random"``: ordinary init, the anchor untouched (the output changes).

        Returns:
            StructureChange: the new parameters (each with the anchor parameter of the same kind as
            reference) and, for ``random_resolve``, the overwritten anchor parameters.

        Raises:
            ReparamError: unknown or already present kind, deployed block.
            AlignmentError: the kind is not applicable to this geometry.
        """
        if self.reparam_conv is not None:
            raise ReparamError("cannot add a branch to a deployed block")
        if not is_kind(kind):
            raise ReparamError(f"unknown branch kind {kind!r}; accepted values: {kind_names()}")
        if kind in self.branches:
            raise ReparamError(f"branch {kind!r} is already present")
        if init not in INITS:
            raise ReparamError(f"init must be one of {INITS}, got {init!r}")
        reason = get_kind(kind).reason(self.geometry, crop=self.crop)
        if reason is not None:
            raise AlignmentError(reason)
        target = None
        if init == "random_resolve":
            target = self._merged_pair(torch.float64)
        eps = float(getattr(self.anchor.bn, "eps", 1e-5))
        branch = self._new_branch(kind, options, eps, zero_last=init == "zero_gamma", generator=generator)
        self._insert(kind, branch)
        change = StructureChange(added=self._added(branch), paths=self._path_list())
        if target is not None:
            change.overwritten.extend(self._solve_for_total(*target, stats="keep"))
        return change

    def remove_branch(self, name: str) -> StructureChange:
        """Fold branch ``name`` into the anchor and delete it (eval-exact).

        ``W_a ← W_a + (σ_a/γ_a)·K_r``, ``β_a ← β_a + b_r`` (conv mode: conv bias). The anchor BN's
        running statistics are untouched; ``γ`` only changes where the γ guard clamps it.

        Raises:
            ReparamError: ``name`` is the anchor, absent, or the block is deployed.
        """
        if self.reparam_conv is not None:
            raise ReparamError("cannot remove a branch from a deployed block")
        if name == anchor_name():
            raise ReparamError(f"the anchor branch {name!r} cannot be removed")
        self._require_branch(name)
        self._require_writable_anchor(f"removing branch {name!r}")
        k_a, b_a = self._merged_pair(torch.float64, [anchor_name()])
        k_r, b_r = self._merged_pair(torch.float64, [name])
        branch = self._delete(name)
        overwritten = self._solve_anchor(k_a + k_r, b_a + b_r, "keep")
        removed = list(branch.parameters())
        return StructureChange(removed=removed, overwritten=overwritten, paths=self._path_list())

    def fold_all(self) -> StructureChange:
        """Fold every non-anchor branch into the anchor at once (eval-exact)."""
        if self.reparam_conv is not None:
            raise ReparamError("cannot fold a deployed block")
        others = [n for n in self._order if n != anchor_name()]
        if not others:
            return StructureChange(paths=self._path_list())
        self._require_writable_anchor("folding the branches into the anchor")
        k, b = self._merged_pair(torch.float64)
        removed: list[nn.Parameter] = []
        for n in others:
            removed.extend(self._delete(n).parameters())
        overwritten = self._solve_anchor(k, b, "keep")
        return StructureChange(removed=removed, overwritten=overwritten, paths=self._path_list())

    def load_plain(
        self,
        weight: Tensor,
        bias: Tensor | None,
        *,
        anchor_stats: str = "keep",
        target_bn: Any = None,
    ) -> StructureChange:
        """Re-solve the anchor so the block equals the plain layer ``conv(weight, bias)`` (followed by
        ``target_bn`` when given) in eval mode; every other branch keeps its parameters and BN
        statistics (DynamicFL ``REP(global, local)``).

        Args:
            weight, bias: the target conv's parameters (main geometry shape; ``bias`` may be None).
            anchor_stats: ``"keep"`` (anchor BN keeps γ, μ, v and conv bias), ``"rescale"`` (anchor
                BN keeps μ and v; each anchor conv filter keeps its norm and γ takes the target's
                scale, so repeated re-solves cannot grow the conv weights), ``"adopt"`` (anchor BN
                takes ``target_bn``'s statistics and the anchor conv the target bias) or
                ``"identity"`` (anchor BN reset to γ=1, β=0, μ=0, v=1−eps).
            target_bn: BatchNorm (module or :class:`BNStats`) following the target conv, if any.

        Exact in eval mode up to rounding; the γ guard clamps |γ| < ``gamma_floor`` (the anchor
        inverse divides by γ).

        Raises:
            ReparamError: shape mismatch, unknown ``anchor_stats``, ``"adopt"`` without ``target_bn``.
        """
        if anchor_stats not in ANCHOR_STATS:
            raise ReparamError(f"anchor_stats must be one of {ANCHOR_STATS}, got {anchor_stats!r}")
        self._require_writable_anchor("load_plain")
        shape = self.geometry.weight_shape
        if tuple(weight.shape) != shape:
            raise ReparamError(f"weight has shape {tuple(weight.shape)}, expected {shape}")
        if bias is not None and tuple(bias.shape) != (shape[0],):
            raise ReparamError(f"bias has shape {tuple(bias.shape)}, expected ({shape[0]},)")
        dev = self._factory()["device"]
        f64 = torch.float64
        w_t = weight.detach().to(device=dev, dtype=f64)
        b_conv = torch.zeros(shape[0], dtype=f64, device=dev) if bias is None else bias.detach().to(device=dev, dtype=f64)
        tstats = None
        if target_bn is not None:
            s = bn_stats(target_bn)
            tstats = BNStats(
                s.mean.detach().to(dev, f64), s.var.detach().to(dev, f64),
                None if s.gamma is None else s.gamma.detach().to(dev, f64),
                None if s.beta is None else s.beta.detach().to(dev, f64), s.eps,
            )
            k_t, b_t = fuse_bn(w_t, b_conv, tstats)
        else:
            k_t, b_t = w_t, b_conv
        if anchor_stats == "adopt" and tstats is None:
            raise ReparamError("anchor_stats='adopt' needs target_bn (the target layer's BatchNorm)")
        if self.reparam_conv is not None:
            w, b = self._deployed_pair()
            with torch.no_grad():
                w.copy_(k_t)
                b.copy_(b_t)
            return StructureChange(overwritten=[cast(nn.Parameter, w), cast(nn.Parameter, b)], paths=self._path_list())
        stats: str | BNStats = tstats if anchor_stats == "adopt" else anchor_stats  # type: ignore[assignment]
        overwritten = self._solve_for_total(k_t, b_t, stats=stats, conv_bias_t=b_conv if anchor_stats == "adopt" else None)
        return StructureChange(overwritten=overwritten, paths=self._path_list())

    # ------------------------------------------------------------------------------ nesting
    def nested_block(self, name: str) -> "DiverseBranchBlock | None":
        """The nested block inside branch ``name``'s ``K×K`` conv, or ``None``."""
        attr = get_kind(name).nested_conv if is_kind(name) else None
        if attr is None or name not in self.branches:
            return None
        conv = getattr(self.branches[name], attr, None)
        return conv if isinstance(conv, DiverseBranchBlock) else None

    def nestable(self) -> list[str]:
        """Present branches whose ``K×K`` conv nested growth may still expand (depth limit, not
        nested yet, ``max(K) > 1``), in forward order."""
        if self.reparam_conv is not None or self.depth + 1 >= self.max_depth:
            return []
        out = []
        for name in self._order:
            attr = get_kind(name).nested_conv
            conv = getattr(self.branches[name], attr, None) if attr is not None else None
            if conv is not None and is_genuine_conv(conv) and max(conv.kernel_size) > 1:
                out.append(name)
        return out

    def nested_crop(self, name: str) -> bool:
        """The input-window policy a nested block in branch ``name`` gets."""
        return self.crop and get_kind(name).nested_crop

    def grow_nested(self, name: str, branches: Any = None, *, spec: Mapping[str, Any] | None = None,
                    generator: torch.Generator | None = None) -> StructureChange:
        """Expand the K×K conv of branch ``name`` (a kind with a ``nested_conv``: the anchor ``"kxk"``
        or ``"1x1_kxk"``) into a nested block in ``conv`` mode (zero-γ growth: bit-exact in train and
        eval mode). A bias-free conv gets a zero bias, which the host branch's BN absorbs when
        flattened. Limited by ``max_depth``."""
        if self.reparam_conv is not None:
            raise ReparamError("cannot grow a deployed block")
        self._require_branch(name)
        attr = get_kind(name).nested_conv
        if attr is None:
            nestable = [k for k in kind_names() if get_kind(k).nested_conv is not None]
            raise ReparamError(f"nested growth is defined for {nestable}, got {name!r}")
        if self.depth + 1 >= self.max_depth:
            raise ReparamError(f"max_depth={self.max_depth} reached (this block has depth {self.depth})")
        branch = self.branches[name]
        conv = getattr(branch, attr)
        if not isinstance(conv, nn.Conv2d):
            raise ReparamError(f"the conv of branch {name!r} is already nested")
        if not is_genuine_conv(conv):
            raise NotMergeableError(
                f"the conv of branch {name!r} is a {type(conv).__name__} (a host conv subclass with its own forward); "
                "nested growth needs a plain nn.Conv2d"
            )
        if max(conv.kernel_size) <= 1:
            raise ReparamError("only KxK convs with max(K) > 1 can be grown")
        had_bias = conv.bias is not None
        # taken before wrapping: a bias-free conv gets a new bias *on the same module*, and that
        # bias is new to every optimizer even though it is a parameter of ``conv`` afterwards
        before = {id(p) for p in conv.parameters()}
        if spec is not None:
            nested = DiverseBranchBlock.from_spec(conv, None, {**dict(spec), "new_bias": not had_bias})
        else:
            nested = DiverseBranchBlock.from_conv(
                conv, None, branches, allow_new_bias=True, generator=generator,
                depth=self.depth + 1, max_depth=self.max_depth, gamma_floor=self.gamma_floor,
                crop=self.nested_crop(name),
            )
        nested.depth = self.depth + 1
        nested.max_depth = self.max_depth
        setattr(branch, attr, nested)
        added = [(p, self._reference(p, m)) for m in nested.modules() for p in m.parameters(recurse=False)
                 if id(p) not in before]
        return StructureChange(added=added, paths=self._path_list())

    def add_nested_branch(
        self, name: str, kind: str, *, init: str = "zero_gamma", generator: torch.Generator | None = None
    ) -> StructureChange:
        """Add a branch of ``kind`` inside the ``K×K`` conv of branch ``name``, turning that conv
        into a nested block first when it is not one yet (:meth:`grow_nested` with the anchor only).

        ``init="zero_gamma"``: bit-exact in train and eval mode; ``"random_resolve"``: the nested
        anchor is re-solved, eval-exact.

        Raises:
            ReparamError: as :meth:`grow_nested` and :meth:`add_branch` (depth limit, kind present).
            AlignmentError: ``kind`` does not fit the nested conv.
        """
        change = StructureChange(paths=self._path_list())
        inner = self.nested_block(name)
        if inner is None:
            attr = get_kind(name).nested_conv if is_kind(name) else None
            conv = getattr(self.branches[name], attr, None) if attr is not None and name in self.branches else None
            if isinstance(conv, nn.Conv2d):
                reason = get_kind(kind).reason(ConvGeometry.from_conv(conv), crop=self.nested_crop(name)) if is_kind(kind) else None
                if reason is not None:
                    raise AlignmentError(reason)
            change.extend(self.grow_nested(name, []))
            inner = self.nested_block(name)
            if inner is None:  # pragma: no cover - grow_nested either nests or raises
                raise ReparamError(f"internal: branch {name!r} was not nested")
        return change.extend(inner.add_branch(kind, init=init, generator=generator))

    def flatten_nested(self, name: str) -> StructureChange:
        """Merge the nested block of branch ``name`` back into a plain conv (eval-exact).

        The host conv object is kept (its weight is overwritten) when the nested block's anchor is
        that conv; when the anchor is itself nested (or the block was deployed), a new conv takes
        its place and is reported as added. When the nested block gave a
        bias-free conv a bias, that bias is absorbed into the branch BN's running mean
        (``μ ← μ − b``, exact in eval mode; in train mode a per-channel constant before a BN cancels).
        """
        self._require_branch(name)
        branch = self.branches[name]
        kind = get_kind(name)
        attr = kind.nested_conv
        nested = getattr(branch, attr) if attr is not None else None
        if attr is None or not isinstance(nested, DiverseBranchBlock):
            raise ReparamError(f"branch {name!r} has no nested block")
        k, b = nested._merged_pair(torch.float64)
        host: Any = None if nested.is_merged else nested.anchor.conv
        kept: set[int] = set()  # a new conv (the nested anchor is nested itself, or deployed): all new
        if host is None or isinstance(host, DiverseBranchBlock):
            host = nested.geometry.make_conv(bias=not nested.new_bias, initialize=False, **nested._factory())
        else:
            kept = {id(p) for p in host.parameters()}
        removed = [p for p in nested.parameters() if id(p) not in kept]
        with torch.no_grad():
            host.weight.copy_(k)
            if nested.new_bias:
                bn = getattr(branch, kind.nested_norm or "bn")
                bn.running_mean.copy_((bn.running_mean.to(torch.float64) - b).to(bn.running_mean.dtype))
                if host.bias is not None:
                    removed.append(host.bias)
                    host.bias = None
            else:
                host.bias.copy_(b)
        host.train(nested.training)
        # references before the swap: a new conv may replace the anchor's own (nested) conv
        added = [(p, self._reference(p, host)) for p in host.parameters() if id(p) not in kept]
        setattr(branch, attr, host)
        overwritten = [p for p in host.parameters() if id(p) in kept]
        return StructureChange(added=added, removed=removed, overwritten=overwritten, paths=self._path_list())

    # ------------------------------------------------------------------------------ host form
    def to_host(self, *, require_eval: bool = True) -> tuple[nn.Conv2d, nn.Module | None]:
        """In place: the host layer(s) this block replaced, holding the block's function (eval-exact).

        ``conv_bn`` mode: every branch is folded into the anchor (its BN statistics untouched) and
        ``(anchor conv, anchor BN)`` is returned; ``conv`` mode: ``(biased conv, None)``, also for a
        block with a :attr:`bias_sink` (``reparam.merge(model, target="host")`` then moves the bias
        into the sink BatchNorms and drops it). A host conv of a subclass with its own forward (TF
        "same" padding, :mod:`reparam.hostforms`) comes back as that class (the anchor itself, or a
        copy of it holding the merged kernel); only a deployed block gives a
        :class:`~reparam.hostforms.SamePadConv2d` instead.

        Raises:
            NotMergeableError: the anchor conv is weight-standardised (timm's ``StdConv2d``,
                ``ScaledStdConv2d``): a standardised kernel cannot hold the merged kernel, so the
                host layout cannot be restored exactly; :meth:`merge` (``target="deploy"``) can.
        """
        self._require_writable_anchor("restoring the host layout")
        if require_eval:
            self._check_eval()
        if self.reparam_conv is not None:
            conv = self.reparam_conv
            if self.mode == "conv":
                return conv, None
            host_conv = self.geometry.make_conv(**self._factory())
            if self.same_pad:
                as_same_pad(host_conv)
            bn = nn.BatchNorm2d(self.geometry.out_channels, **self._factory())
            weight, bias = self._deployed_pair()
            with torch.no_grad():
                host_conv.weight.copy_(weight)
                if host_conv.bias is not None:
                    host_conv.bias.zero_()
                cast(Tensor, bn.running_var).fill_(1.0 - bn.eps)
                bn.bias.copy_(bias)
            host_conv.train(self.training)
            bn.train(self.training)
            return host_conv, bn
        if self.mode == "conv":
            merged = self.merge(require_eval=False)
            anchor_conv = self.anchor.conv
            if isinstance(anchor_conv, nn.Conv2d) and not is_genuine_conv(anchor_conv) and anchor_conv.bias is not None:
                host = copy.deepcopy(anchor_conv)  # the host class (it pads itself), holding the merged pair
                with torch.no_grad():
                    host.weight.copy_(merged.weight)
                    cast(Tensor, host.bias).copy_(cast(Tensor, merged.bias))
                return host, None
            return merged, None
        if isinstance(self.anchor.conv, DiverseBranchBlock):
            self.flatten_nested(anchor_name())
        self.fold_all()
        return cast(nn.Conv2d, self.anchor.conv), self.anchor.bn

    # ------------------------------------------------------------------------------ spec
    def spec(self) -> dict[str, Any]:
        """JSON-serialisable record of this block's structure (enough to rebuild it around a plain
        conv and load its state dict strictly)."""
        branches: dict[str, dict[str, Any]] = {}
        nested: dict[str, Any] = {}
        for name in self._order:
            br = self.branches[name]
            kind = get_kind(name)
            branches[name] = {} if kind.anchor else kind.options_of(br)
            inner = self.nested_block(name)
            if inner is not None:
                nested[name] = inner.spec()
        anchor = self._present_anchor()
        anchor_bn = anchor.bn if anchor is not None else None
        out: dict[str, Any] = {
            "mode": self.mode,
            "bn_path": self.bn_path,
            "depth": self.depth,
            "max_depth": self.max_depth,
            "geometry": self.geometry.to_dict(),
            "anchor_norm": self.anchor_norm,
            "eps": float(getattr(anchor_bn, "eps", 1e-5)) if anchor_bn is not None else 1e-5,
            "gamma_floor": self.gamma_floor,
            "new_bias": self.new_bias,
            "crop": self.crop,
            "branches": branches,
            "nested": nested,
            "deployed": self.is_merged,
        }
        if self.host_form is not None and not self.host_form.plain:
            out["host_form"] = self.host_form.to_dict()
        if self.bias_sink:
            out["bias_sink"] = [dict(s) for s in self.bias_sink]
        return out
