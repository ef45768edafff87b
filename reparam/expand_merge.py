"""Whole-model expansion and merging.

Guarantees:

* :func:`expand` is **bit-exact in train and eval mode** (zero-γ growth): the expanded model
  computes exactly what the input model computed, and its anchor BNs update exactly the same
  running statistics.
* :func:`merge` is **exact in eval mode** (rounding only; computed in the model's dtype, at least
  float32: ~1e-15 relative for float64 models, the float32 forward's own rounding for float32
  ones; ``compute_dtype=torch.float64`` gives correctly rounded float32 weights). ``target="deploy"``
  leaves no BatchNorm after any conv (every block merged, every remaining conv+BN pair folded, BN
  slots become ``nn.Identity``) and folds every BN-only identity branch (RepVGG's
  ``conv(x) + ... + bn(x)``) into the conv it is summed with (its slot becomes
  :class:`FoldedIdentity`); BatchNorms with a built-in activation are folded only as part of a
  block (their activation stays, as a :class:`~reparam.hostforms.NormActTail`), never as a
  remaining pair; ``target="host"`` restores the host model's layer layout and state-dict keys
  (strict load into a freshly built original model), except for weight-standardised host convs,
  which it refuses (:mod:`reparam.hostforms`).
* Conv subclasses with their own forward (timm's ``StdConv2d``, ``Conv2dSame`` ...) are expanded
  only when :func:`reparam.hostforms.conv_form` identifies what they compute; the others are left
  plain with the reason in ``structure(model)["skipped"]``.
* A bias-free conv without a BatchNorm of its own is expanded (conv mode, with a new zero bias)
  when every consumer of its output leads to a BatchNorm that absorbs a per-channel constant (a
  *bias sink*, :func:`reparam.pairs.find_bias_sinks`: through channel concatenations, as in MixNet
  and DenseNet, or through a bias-free 1×1 conv, as in VoVNet); ``target="host"`` moves the merged
  bias into those BatchNorms' running means, so the host keys stay the original ones.

Conv → BN pairs come from :mod:`reparam.pairs`.
"""

from __future__ import annotations

import copy
import fnmatch
import logging
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import Tensor, nn

from ._tree import (
    _INFO_ATTR, _conv_support, _info, _is_block, _is_bn_like, _is_conv, _is_plain_conv, _set_info, _set_module, iter_blocks,
)
from .block import ANCHOR_NORMS, INITS, DiverseBranchBlock, check_request
from .errors import NotMergeableError, ReparamError, ReparamModeError
from .geometry import ConvGeometry
from .hostforms import ConvForm, NormActTail, as_same_pad, effective_kernel, split_norm_act
from .pairs import _identity_fits, find_conv_bn_pairs
from .transforms import bn_impurity, bn_stats, check_identity, fuse_bn, merge_dtype

__all__ = ["SCRATCH_INIT", "FoldedIdentity", "expand", "merge"]

logger = logging.getLogger("reparam")

def _identity_record(model: nn.Module, identity: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """``{BN path: {"into": conv path, "eps": eps}}`` for the structure spec."""
    out: dict[str, dict[str, Any]] = {}
    for bn_path, conv_path in identity.items():
        bn = model.get_submodule(bn_path)
        out[bn_path] = {"into": conv_path, "eps": float(getattr(bn, "eps", 1e-5))}
    return out



class FoldedIdentity(nn.Module):
    """Stands where a BN-only identity branch was after :func:`merge` folded it into the conv at
    path ``into``. Its forward returns a zero scalar (0-dim tensor of the input's dtype and device):
    the model's own sum ``... + branch(x)`` broadcasts it and leaves every value unchanged, so the
    model's forward code keeps working without the BatchNorm. No parameters, no state-dict keys."""

    def __init__(self, into: str = "") -> None:
        super().__init__()
        self.into = into

    def forward(self, x: Tensor) -> Tensor:
        return x.new_zeros(())

    def extra_repr(self) -> str:
        return f"into={self.into!r}"



# ---------------------------------------------------------------------------------------------
# expand


def _matches(path: str, patterns: str | Iterable[str] | None) -> bool:
    if patterns is None:
        return False
    if isinstance(patterns, str):
        patterns = [patterns]
    return any(fnmatch.fnmatchcase(path, p) for p in patterns)


def _default_reason(conv: nn.Conv2d) -> str | None:
    """Why the default plan leaves ``conv`` plain (``None``: it expands it)."""
    kh, kw = conv.kernel_size
    if max(kh, kw) <= 1:
        return (
            "1x1 kernel: the default plan expands kernels with 1 < max(K) <= 5 (a 1x1 conv has no "
            "spatial branches to add); name the conv in a plan to expand it anyway"
        )
    if max(kh, kw) > 5:
        return (
            f"{kh}x{kw} kernel: the default plan expands kernels up to 5x5 (for large kernels, e.g. "
            "ConvNeXt's 7x7 depthwise convs, the extra branches cost far more than they add); name "
            "the conv in a plan to expand it anyway"
        )
    return None


def _capture_inputs(model: nn.Module, paths: list[str], batches: Any) -> dict[str, list[Tensor]]:
    captured: dict[str, list[Tensor]] = {p: [] for p in paths}
    handles = []
    for p in paths:
        m = model.get_submodule(p)

        def hook(mod, inp, p=p):  # type: ignore[no-untyped-def]
            captured[p].append(inp[0].detach())

        handles.append(m.register_forward_pre_hook(hook))
    flags = {m: m.training for m in model.modules()}
    items = [batches] if isinstance(batches, Tensor) else list(batches)
    try:
        model.eval()
        with torch.no_grad():
            for x in items:
                model(*x) if isinstance(x, (tuple, list)) else model(x)
    finally:
        for h in handles:
            h.remove()
        for m, t in flags.items():
            m.training = t
    return captured


#: the ``init`` of ``expand(..., from_scratch=True)``: the one whose merged models measured best
#: when trained from scratch (see docs/results.md, "Where re-parameterization pays")
SCRATCH_INIT = "random"

_PATTERN_HELP = "None, a glob string or an iterable of glob strings"


def _check_expand_arguments(
    *, branches: Any, init: Any, anchor_norm: Any, include: Any, exclude: Any, generator: Any,
    flags: Mapping[str, Any],
) -> None:
    """Check every argument of :func:`expand` that is not checked per conv: a bad value raises
    before anything is copied, naming the accepted values."""
    if init not in INITS:
        raise ReparamError(f"init must be one of {INITS}, got {init!r}")
    if anchor_norm not in ANCHOR_NORMS:
        raise ReparamError(f"anchor_norm must be one of {ANCHOR_NORMS}, got {anchor_norm!r}")
    for name, value in (("include", include), ("exclude", exclude)):
        ok = value is None or isinstance(value, str) or (
            isinstance(value, Iterable) and not isinstance(value, Mapping) and all(isinstance(v, str) for v in value)
        )
        if not ok:
            raise ReparamError(f"{name} must be {_PATTERN_HELP}, got {value!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ReparamError(f"generator must be None or a torch.Generator, got {type(generator).__name__}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ReparamError(f"{name} must be True or False, got {value!r}")
    check_request(branches)


def expand(
    model: nn.Module,
    plan: Mapping[str, Any] | Callable[[str, nn.Conv2d, nn.Module | None], Any] | None = None,
    branches: Any = None,
    *,
    inplace: bool = False,
    anchor_norm: str = "frozen_identity",
    calibration_input: Any = None,
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    init: str | None = None,
    allow_new_bias: bool = False,
    example_input: Any = None,
    generator: torch.Generator | None = None,
    crop: bool = True,
    from_scratch: bool = False,
) -> nn.Module:
    """Expand the convs of an arbitrary model into Diverse Branch Blocks (bit-exact, train and eval).

    Args:
        model: any ``nn.Module`` (torchvision, timm, ``nn.Sequential``, ...).
        plan: ``None`` (every conv with ``1 < max(K) ≤ 5`` gets ``branches``), a mapping
            ``conv path → kinds`` (only those paths; each explicitly requested), or a callable
            ``(path, conv, bn) → kinds | None`` called for every conv (``None`` skips it).
        branches: the kinds for ``plan=None`` (see :meth:`DiverseBranchBlock.from_conv`).
        inplace: modify ``model`` instead of a deep copy.
        anchor_norm, calibration_input: for convs without a following BN (``calibration_input``:
            model input batches, used with ``anchor_norm="calibrated"``).
        include, exclude: module-path globs restricting the convs considered.
        init: how new branches start (:data:`reparam.block.INITS`). Default: ``"zero_gamma"``
            (the function is kept, bit for bit: right for a trained model), or :data:`SCRATCH_INIT`
            with ``from_scratch=True``.
        from_scratch: the model is about to be trained from scratch, so there is no function to
            keep: the default ``init`` becomes :data:`SCRATCH_INIT`, the initialisation whose merged
            models measured best when trained from scratch (``fedhetero bench reparam-gain``).
        allow_new_bias, generator, crop: passed to :meth:`DiverseBranchBlock.from_conv`
            (``crop=False``: no input-window branches, the classic rule).
        example_input: input for the forward probe when the model does not trace with ``torch.fx``.

    Every conv that is left plain is reported with the reason (INFO log and the ``"skipped"``
    mapping ``conv path → reason`` of :func:`structure`): outside the default kernel range
    (1×1, or larger than 5×5 such as ConvNeXt's 7×7 depthwise convs), filtered out by
    ``include``/``exclude`` or the plan, never called, a conv subclass whose computation
    :func:`reparam.hostforms.conv_form` cannot identify, or not expandable exactly. A conv that the
    plan names explicitly and that cannot be expanded raises the reason instead. A conv paired with
    a BN is expanded together with it (the BN slot becomes ``nn.Identity``; for a norm+activation
    BN such as timm's ``BatchNormAct2d``, a :class:`~reparam.hostforms.NormActTail` that applies
    its activation and drop after the block). Weight-standardised convs (timm's ``StdConv2d``,
    ``ScaledStdConv2d``) and convs with TF "same" padding (``Conv2dSame``) are expanded exactly
    (see :mod:`reparam.hostforms`). Convs that are already blocks are left alone (a second expand
    is a no-op).

    A bias-free conv without a BN of its own is expanded in ``conv`` mode with a new bias when its
    output reaches only *bias sinks* (:func:`reparam.pairs.find_bias_sinks`, ``torch.fx`` models
    only): BatchNorms behind channel concatenations or behind one bias-free 1×1 conv, which absorb
    the merged bias exactly; the block records them (``bias_sink``, also in its spec) and
    ``merge(target="host")`` moves the bias there. A 1×1 conv that carries a block's bias to its
    sink is not expanded later (skipped with the reason); expanding it in the same call leaves the
    conv without a sink. Other bias-free convs without BN need ``allow_new_bias=True``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if plan is not None and not isinstance(plan, Mapping) and not callable(plan):
        raise TypeError("plan must be None, a mapping of conv path -> kinds, or a callable (path, conv, bn) -> kinds")
    if init is None:
        init = SCRATCH_INIT if from_scratch else "zero_gamma"
    _check_expand_arguments(
        branches=branches, init=init, anchor_norm=anchor_norm, include=include, exclude=exclude,
        generator=generator, flags={"inplace": inplace, "allow_new_bias": allow_new_bias, "crop": crop,
                                    "from_scratch": from_scratch},
    )
    if isinstance(plan, Mapping):
        for kinds in plan.values():
            if kinds is not None:
                check_request(kinds, "plan values")
    if _is_block(model):
        return model if inplace else copy.deepcopy(model)
    if not inplace:
        model = copy.deepcopy(model)
    if isinstance(model, nn.Conv2d):  # a bare conv is its own (conv-mode) block
        kinds = plan.get("", branches) if isinstance(plan, Mapping) else (plan("", model, None) if plan else branches)
        single = DiverseBranchBlock.from_conv(
            model, None, kinds, anchor_norm=anchor_norm, calibration_input=calibration_input, init=init,
            allow_new_bias=allow_new_bias, generator=generator, crop=crop,
        )
        single.host_path = ""
        return single
    scan = find_conv_bn_pairs(model, example_input)
    info = _info(model)
    requests: list[tuple[str, Any, bool]] = []
    if isinstance(plan, Mapping):
        unknown = [p for p in plan if p not in scan.convs]
        modules = dict(model.named_modules())
        unknown_blocks = [p for p in unknown if p in modules and _is_block(modules[p])]
        if unknown_blocks:
            logger.info("already expanded, left unchanged: %s", unknown_blocks)
        unknown = [p for p in unknown if p not in unknown_blocks]
        unsupported = {p: scan.unsupported[p] for p in unknown if p in scan.unsupported}
        if unsupported:
            raise NotMergeableError(f"plan names convs whose form reparam does not know: {unsupported}")
        if unknown:
            raise ReparamError(f"plan names paths that are not plain Conv2d modules of the model: {unknown}")
    not_requested: dict[str, str] = {}  # conv path -> why it is left plain
    for path, bn_path in scan.convs.items():
        conv = model.get_submodule(path)
        if include is not None and not _matches(path, include):
            not_requested[path] = f"not matched by include={include!r}"
            continue
        if _matches(path, exclude):
            not_requested[path] = f"matched by exclude={exclude!r}"
            continue
        bn = model.get_submodule(bn_path) if bn_path else None
        if isinstance(plan, Mapping):
            if path not in plan or plan[path] is None:
                not_requested[path] = "not named in the plan" if path not in plan else "the plan maps it to None"
                continue
            requests.append((path, plan[path], True))
        elif plan is not None:
            kinds = plan(path, conv, bn)  # type: ignore[arg-type]
            if kinds is None:
                not_requested[path] = "the plan returned None for it"
                continue
            requests.append((path, kinds, True))
        else:
            reason = _default_reason(conv)  # type: ignore[arg-type]
            if reason is None:
                requests.append((path, branches, False))
            else:
                not_requested[path] = reason
    for path, reason in {**scan.unsupported, **not_requested}.items():
        logger.info("conv %s left unexpanded: %s", path, reason)
        info["skipped"][path] = reason
    requested = {p for p, _, _ in requests}
    # 1x1 convs that carry an existing block's bias to its sink BatchNorm stay plain
    carriers = {
        str(s["through"]): (bpath, str(s["bn"]))
        for bpath, blk in iter_blocks(model) for s in blk.bias_sink if s.get("through")
    }
    calib: dict[str, list[Tensor]] = {}
    if anchor_norm == "calibrated":
        need = [p for p, _, _ in requests if scan.convs[p] is None]
        if need:
            if calibration_input is None:
                raise ReparamError("anchor_norm='calibrated' needs calibration_input (model input batches)")
            calib = _capture_inputs(model, need, calibration_input)
    for path, kinds, explicit in requests:
        conv = model.get_submodule(path)
        bn_path = scan.convs[path]
        bn = model.get_submodule(bn_path) if bn_path else None
        reason = None
        if scan.calls.get(path, 0) == 0:
            reason = "the conv is not called in the model's forward pass"
        elif bn is None and scan.calls.get(path, 0) > 1 and anchor_norm == "calibrated":
            reason = "a conv called more than once cannot be calibrated"
        elif path in carriers:
            reason = (
                f"it carries the bias of block {carriers[path][0]} to that block's bias sink {carriers[path][1]} "
                "(see reparam.pairs.find_bias_sinks); expanding it would leave that bias nowhere to go"
            )
        sinks = _usable_sinks(conv, bn, scan.sinks.get(path), requested)  # type: ignore[arg-type]
        block: DiverseBranchBlock | None = None
        tail: NormActTail | None = None
        if reason is None:
            if bn is not None and bn_path in scan.norm_act:
                tail = split_norm_act(bn)  # act/drop stay after the block; the BN is absorbed
            try:
                block = DiverseBranchBlock.from_conv(
                    conv,  # type: ignore[arg-type]
                    bn,
                    kinds,
                    anchor_norm=anchor_norm,
                    calibration_input=calib.get(path),
                    init=init,
                    allow_new_bias=allow_new_bias or bool(sinks),
                    generator=generator,
                    crop=crop,
                )
                if sinks and block.new_bias:
                    block.bias_sink = tuple(sinks)
            except ReparamError as exc:
                if tail is not None:
                    tail.restore_into(bn)  # type: ignore[arg-type]
                note = f"{scan.notes[path]}; " if bn is None and path in scan.notes else ""
                if explicit:
                    raise type(exc)(f"{path}: {note}{exc}") from exc
                reason = f"{note}{exc}"
        if block is None:
            if explicit:
                raise NotMergeableError(f"{path}: {reason}")
            logger.info("conv %s left unexpanded: %s", path, reason)
            info["skipped"][path] = reason
            continue
        block.host_path = path
        block.bn_path = bn_path
        _set_module(model, path, block)
        if bn_path:
            _set_module(model, bn_path, tail if tail is not None else nn.Identity())
        info["skipped"].pop(path, None)
    info["pairs"] = {
        c: b for c, b in scan.pairs.items()
        if b not in scan.norm_act and _foldable_conv(model.get_submodule(c))
    }
    if scan.method == "fx":
        info["identity_bns"] = _identity_record(model, scan.identity)
    else:
        logger.info("BN-only identity branches are found from the torch.fx graph; this model does not trace")
        info.setdefault("identity_bns", {})
    _set_info(model, info)
    return model


def _usable_sinks(
    conv: nn.Conv2d, bn: nn.Module | None, sinks: list[dict[str, Any]] | None, requested: set[str]
) -> list[dict[str, Any]]:
    """The bias sinks a block expanded from ``conv`` records: those of the scan for a bias-free conv
    without BN, unless a sink's 1x1 conv is itself expanded now (then none: every consumer of the
    conv's output must absorb the bias)."""
    if bn is not None or conv.bias is not None or not sinks:
        return []
    if any(s.get("through") in requested for s in sinks):
        return []
    return [dict(s) for s in sinks]


# ---------------------------------------------------------------------------------------------
# merge


def _foldable_conv(m: nn.Module) -> bool:
    """A conv whose remaining BN pair a deploy merge may fold: any conv of known form except a
    weight-standardised one (its BN is left, like its unexpanded conv; see :mod:`reparam.hostforms`)."""
    if not _is_conv(m):
        return False
    form = _conv_support(m)
    return isinstance(form, ConvForm) and not form.standardized


def _fold_pair(conv: nn.Conv2d, bn: nn.Module, compute_dtype: torch.dtype | None) -> nn.Conv2d:
    form = _conv_support(conv)
    if isinstance(form, str) or form.standardized:
        raise NotMergeableError(form if isinstance(form, str) else "a weight-standardised conv keeps its BatchNorm")
    geometry = ConvGeometry.from_conv(conv)
    compute_dtype = merge_dtype(conv.weight.dtype, compute_dtype)
    with torch.no_grad():
        w = effective_kernel(conv, compute_dtype)
        b = None if conv.bias is None else conv.bias.to(compute_dtype)
        k, bias = fuse_bn(w, b, bn)
        new = geometry.make_conv(bias=True, initialize=False, device=conv.weight.device, dtype=conv.weight.dtype)
        new.weight.copy_(k)
        assert new.bias is not None  # built with bias=True
        new.bias.copy_(bias)
    if form.same_pad:
        as_same_pad(new)
    new.train(conv.training)
    return new


def _current_pairs(model: nn.Module, example_input: Any) -> tuple[dict[str, str], dict[str, str]]:
    """The conv→BN pairs still to fold and the BN-only identity branches (BN path → conv path),
    from the record kept by :func:`expand` / :func:`merge` when it is still valid, else scanned."""
    info = getattr(model, _INFO_ATTR, None)
    if isinstance(info, dict) and "pairs" in info:
        pairs = {}
        valid = True
        for c, b in dict(info["pairs"]).items():
            try:
                cm, bm = model.get_submodule(c), model.get_submodule(b)
            except AttributeError:
                valid = False
                break
            if isinstance(bm, (nn.Identity, NormActTail)) or _is_block(cm):
                continue
            if not (_foldable_conv(cm) and _is_bn_like(bm)) or bn_impurity(bm) is not None:
                valid = False
                break
            pairs[c] = b
        if valid:
            identity = {b: str(rec["into"]) for b, rec in dict(info.get("identity_bns", {})).items()}
            return pairs, identity
    scan = find_conv_bn_pairs(model, example_input)
    pairs = {c: b for c, b in scan.pairs.items() if b not in scan.norm_act and _foldable_conv(model.get_submodule(c))}
    return pairs, dict(scan.identity)


def _fold_identity(conv: nn.Conv2d, bn: nn.Module, compute_dtype: torch.dtype | None) -> nn.Conv2d:
    """A biased conv computing ``conv(x) + bn(x)`` in eval mode (identity kernel through the BN)."""
    geometry = ConvGeometry.from_conv(conv)
    compute_dtype = merge_dtype(conv.weight.dtype, compute_dtype)
    check_identity(geometry)
    s = bn_stats(bn)
    with torch.no_grad():
        t = torch.rsqrt(s.var.to(compute_dtype) + s.eps)
        if s.gamma is not None:
            t = s.gamma.to(compute_dtype) * t
        shift = -t * s.mean.to(compute_dtype)
        if s.beta is not None:
            shift = shift + s.beta.to(compute_dtype)
        w = conv.weight.to(compute_dtype, copy=True)
        b = shift if conv.bias is None else conv.bias.to(compute_dtype) + shift
        c = geometry.in_channels
        idx = torch.arange(c, device=w.device)
        kh, kw = geometry.kernel_size
        w[idx, idx % (c // geometry.groups), kh // 2, kw // 2] += t.to(w.device)
        new = geometry.make_conv(bias=True, initialize=False, device=conv.weight.device, dtype=conv.weight.dtype)
        new.weight.copy_(w)
        assert new.bias is not None  # built with bias=True
        new.bias.copy_(b)
    new.train(conv.training)
    return new


def merge(
    model: nn.Module,
    *,
    inplace: bool = False,
    target: str = "deploy",
    require_eval: bool = True,
    example_input: Any = None,
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Merge every block of ``model`` (eval-exact, rounding only).

    Args:
        target: ``"deploy"``: every block becomes one biased ``Conv2d`` at its path, every remaining
            conv+BN pair is folded (BN slot → ``nn.Identity``), so no BatchNorm follows a conv, and
            every BN-only identity branch (:func:`find_identity_branches`) is folded into its conv
            (BN slot → :class:`FoldedIdentity`). A branch whose conv no longer fits is left and
            logged; ``structure(model)["identity_bns"]`` says which were folded.
            ``"host"``: the host layout is restored (``conv_bn`` blocks → the anchor conv at the conv
            path and the anchor BN, carrying the folded branches, at the BN path, with the
            activation / drop of a norm+activation BN put back into it; ``conv`` blocks → a biased
            conv of the host conv's class, or, for a block with bias sinks, a bias-free one whose
            bias is subtracted from the sink BatchNorms' running means); the state-dict keys equal
            those of the original model (except for biases added by ``allow_new_bias=True``).
            Refused (``NotMergeableError``, before anything is changed) when a block's host conv is
            weight-standardised (timm's ``StdConv2d`` / ``ScaledStdConv2d``: a standardised kernel
            cannot hold the merged kernel; ``"deploy"`` merges them exactly into plain convs), when
            a block deployed with ``switch_to_deploy`` had a norm+activation BN, or when a block's
            bias sink is no longer in the model.
        inplace: modify ``model`` instead of a deep copy. The result keeps the train/eval flags.
        require_eval: raise ``ReparamModeError`` when a BN that takes part is in training mode.
        example_input: forward-probe input for untraceable models (pair discovery).
        compute_dtype: the arithmetic's dtype; default: each layer's parameter dtype, at least
            float32 (:func:`reparam.transforms.merge_dtype`). ``torch.float64`` on a float32 model
            gives correctly rounded merged weights at twice the arithmetic cost.

    Idempotent: merging a merged model changes nothing.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if target not in ("deploy", "host"):
        raise ReparamError(f"target must be 'deploy' or 'host', got {target!r}")
    for name, value in (("inplace", inplace), ("require_eval", require_eval)):
        if not isinstance(value, bool):
            raise ReparamError(f"{name} must be True or False, got {value!r}")
    if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
        raise ReparamError(f"compute_dtype must be None or a floating torch.dtype, got {compute_dtype!r}")
    if _is_block(model):
        blk = model if inplace else copy.deepcopy(model)
        if target == "deploy":
            return blk.merge(require_eval=require_eval, compute_dtype=compute_dtype, consume=inplace)  # type: ignore[operator]
        conv, bn = blk.to_host(require_eval=require_eval)  # type: ignore[operator]
        return conv if bn is None else nn.Sequential(conv, bn)
    blocks = list(iter_blocks(model))
    if target == "host":
        _check_host(model, blocks)
    if require_eval:
        for path, blk in blocks:
            try:
                blk._check_eval()
            except ReparamModeError as exc:
                raise ReparamModeError(f"{path}: {exc}") from exc
    if not inplace:
        if target == "deploy":
            # blocks are replaced, not modified: do not copy their internals
            memo = {id(blk): blk for _, blk in blocks if not blk.is_merged}
            model = copy.deepcopy(model, memo)
        else:
            model = copy.deepcopy(model)
        blocks = [(p, model.get_submodule(p)) for p, _ in blocks]  # type: ignore[misc]
    info = _info(model)
    for path, blk in blocks:
        if target == "deploy":
            conv = blk.merge(require_eval=False, compute_dtype=compute_dtype, consume=inplace)
            if blk.is_merged and not inplace:
                conv = copy.deepcopy(conv)
            _set_module(model, path, conv)
        else:
            conv, bn = blk.to_host(require_eval=False)
            if bn is None and blk.bias_sink:
                _move_bias(model, blk.bias_sink, conv)
            _set_module(model, path, conv)
            if bn is not None:
                if not blk.bn_path:
                    raise ReparamError(
                        f"{path}: a conv_bn block without a recorded bn_path cannot be restored to the host "
                        "layout; use target='deploy'"
                    )
                slot = _slot(model, blk.bn_path)
                if isinstance(slot, NormActTail):
                    slot.restore_into(bn)
                _set_module(model, blk.bn_path, bn)
                info["pairs"][path] = blk.bn_path
    if target == "deploy":
        pairs, identity = _current_pairs(model, example_input)
        unfolded: set[str] = set()
        for conv_path, bn_path in pairs.items():
            conv = model.get_submodule(conv_path)
            bn = model.get_submodule(bn_path)
            if require_eval and getattr(bn, "training", False) and isinstance(bn, nn.modules.batchnorm._BatchNorm):
                raise ReparamModeError(
                    f"{bn_path}: BatchNorm in training mode; folding is exact in eval mode only: call model.eval()"
                )
            try:
                new = _fold_pair(conv, bn, compute_dtype)  # type: ignore[arg-type]
            except ReparamError as exc:
                logger.info("pair %s -> %s not folded: %s", conv_path, bn_path, exc)
                unfolded.add(conv_path)
                continue
            _set_module(model, conv_path, new)
            _set_module(model, bn_path, nn.Identity())
        info["pairs"] = {}
        _fold_identities(model, identity, unfolded, require_eval, compute_dtype)
    _set_info(model, info)
    return model


def _slot(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _sink_problem(model: nn.Module, blk: DiverseBranchBlock) -> str | None:
    """Why the bias sinks of ``blk`` (:attr:`DiverseBranchBlock.bias_sink`) cannot take its bias in
    ``model`` (``None``: they can)."""
    c = blk.geometry.out_channels
    for s in blk.bias_sink:
        bn_path, through = str(s.get("bn")), s.get("through")
        bn = _slot(model, bn_path)
        rm = getattr(bn, "running_mean", None)
        if bn is None or not _is_bn_like(bn) or not isinstance(rm, Tensor) or not rm.is_floating_point():
            found = type(bn).__name__ if bn is not None else "no module"
            return f"its bias sink {bn_path!r} is {found}, not a BatchNorm with running statistics"
        width = c
        if through:
            pw = _slot(model, str(through))
            if not (
                isinstance(pw, nn.Conv2d) and _is_plain_conv(pw) and pw.bias is None and tuple(pw.kernel_size) == (1, 1)
                and pw.groups == 1 and pw.in_channels == c
            ):
                found = type(pw).__name__ if pw is not None else "no module"
                return (
                    f"the 1x1 conv {through!r} that carries its bias to {bn_path!r} is {found}, not a bias-free "
                    f"1x1 nn.Conv2d with groups=1 and {c} input channels"
                )
            width = pw.out_channels
        offset = int(s.get("offset", 0))
        if offset < 0 or offset + width > rm.numel():
            return f"its bias sink {bn_path!r} has {rm.numel()} channels, not {width} from offset {offset}"
    return None


def _move_bias(model: nn.Module, sinks: Iterable[Mapping[str, Any]], conv: nn.Conv2d) -> None:
    """Host merge of a block with bias sinks: subtract the merged conv's bias ``b`` from the running
    mean of each sink BatchNorm (``W·b`` through a 1x1 conv ``W``; float64), then drop the bias."""
    if conv.bias is None:
        return
    with torch.no_grad():
        b = conv.bias.detach().to(torch.float64)
        for s in sinks:
            shift = b
            if s.get("through"):
                through_w = model.get_submodule(str(s["through"])).weight
                assert isinstance(through_w, Tensor)
                w = through_w.detach().to(torch.float64)
                shift = w.reshape(w.shape[0], -1) @ b.to(w.device)
            rm: Tensor = model.get_submodule(str(s["bn"])).running_mean  # type: ignore[assignment]
            seg = rm[int(s.get("offset", 0)):int(s.get("offset", 0)) + shift.numel()]
            seg.copy_((seg.to(torch.float64) - shift.to(seg.device)).to(rm.dtype))
    conv.bias = None


def _check_host(model: nn.Module, blocks: list[tuple[str, DiverseBranchBlock]]) -> None:
    """Refuse a host merge that could not restore the host layout exactly (nothing changed yet)."""
    for path, blk in blocks:
        if blk.mode == "conv" and blk.bias_sink:
            problem = _sink_problem(model, blk)
            if problem is not None:
                raise NotMergeableError(
                    f"{path}: target='host' cannot move the block's bias into the host layout: {problem}; "
                    "use target='deploy'"
                )
        if blk._anchor_standardized():
            raise NotMergeableError(
                f"{path}: target='host' cannot restore a weight-standardised host conv "
                f"({type(blk.anchor.conv).__name__}): its kernel is standardised per output channel, so it "
                "cannot hold the merged kernel exactly; use target='deploy' (a plain conv with the merged "
                "standardised kernel), or leave such convs unexpanded (expand(..., exclude=...))"
            )
        if blk.is_merged and blk.mode == "conv_bn" and blk.bn_path and isinstance(_slot(model, blk.bn_path), NormActTail):
            raise NotMergeableError(
                f"{path}: the block was deployed (switch_to_deploy) and its BatchNorm {blk.bn_path} had an "
                "activation: the host norm+activation layer cannot be rebuilt; merge before deploying blocks"
            )


def _fold_identities(
    model: nn.Module, identity: Mapping[str, str], unfolded: set[str], require_eval: bool, compute_dtype: torch.dtype | None
) -> None:
    """Fold each BN-only identity branch into its conv (deploy merge, after the pairs are folded);
    the BN slot becomes :class:`FoldedIdentity`. Branches that no longer fit are left and logged."""
    for bn_path, conv_path in identity.items():
        try:
            bn, conv = model.get_submodule(bn_path), model.get_submodule(conv_path)
        except AttributeError:
            logger.info("identity branch %s -> %s: module missing; not folded", bn_path, conv_path)
            continue
        if isinstance(bn, FoldedIdentity):
            continue
        reason = None
        if conv_path in unfolded:
            reason = "the conv's own BatchNorm could not be folded"
        elif not _is_plain_conv(conv):
            reason = f"{conv_path} is a {type(conv).__name__}, not a plain conv"
        elif not _is_bn_like(bn) or bn_impurity(bn) is not None:
            reason = bn_impurity(bn) or f"{bn_path} is a {type(bn).__name__}, not a BatchNorm"
        else:
            reason = _identity_fits(conv, bn)
        if reason is not None:
            logger.info("identity branch %s -> %s not folded: %s", bn_path, conv_path, reason)
            continue
        if require_eval and getattr(bn, "training", False) and isinstance(bn, nn.modules.batchnorm._BatchNorm):
            raise ReparamModeError(
                f"{bn_path}: BatchNorm in training mode; folding is exact in eval mode only: call model.eval()"
            )
        _set_module(model, conv_path, _fold_identity(conv, bn, compute_dtype))  # type: ignore[arg-type]
        _set_module(model, bn_path, FoldedIdentity(conv_path))
