"""Structure specs (``ModelSpec``) and state dicts of expanded models.

* :func:`structure` / :func:`build` round-trip the train-form module tree (same modules, same
  state-dict keys) so checkpoints load with ``strict=True``; ``build(..., form="deploy")`` builds
  the deploy layout of :func:`reparam.merge`.
* :func:`merge_state_dict` merges a train-form state dict into deploy or host weights from tensors
  alone (eval-exact, float64); :func:`detect_form` and :func:`strip_prefixes` inspect state dicts.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from ._tree import _get_module, _info, _is_block, _is_bn_like, _set_info, _set_module, iter_blocks
from .block import DiverseBranchBlock
from .errors import ReparamError
from .expand_merge import FoldedIdentity, _sink_problem
from .geometry import ConvGeometry
from .hostforms import ConvForm, NormActTail, as_same_pad, conv_form, norm_act_reason, split_norm_act
from .transforms import BNStats, bn_impurity, fuse_bn

__all__ = ["SPEC_FORMAT", "SPEC_VERSION", "structure", "build", "merge_state_dict", "detect_form", "strip_prefixes"]

SPEC_FORMAT = "reparam.ModelSpec"
SPEC_VERSION = 1


# ---------------------------------------------------------------------------------------------
# structure spec


def structure(model: nn.Module) -> dict[str, Any]:
    """JSON-serialisable ``ModelSpec`` of ``model``: what :func:`build` and
    :func:`merge_state_dict` need to rebuild or merge the model from a plain copy and a state dict.

    Keys: ``blocks`` (every outermost block's structure), ``pairs`` (unexpanded conv→BN pairs,
    folded by a deploy merge) and ``pair_eps``, ``skipped`` (every conv left plain by
    :func:`expand`, with the reason), ``identity_bns`` (BN-only identity branches
    ``{BN path: {"into": conv path, "eps": eps, "folded": bool}}``, folded into that conv by a deploy
    merge; ``folded`` is true once the BN slot holds :class:`FoldedIdentity`)."""
    info = _info(model)
    blocks = {path: blk.spec() for path, blk in iter_blocks(model)}
    modules = dict(model.named_modules())
    pair_eps = {b: float(modules[b].eps) for b in info["pairs"].values() if b in modules and hasattr(modules[b], "eps")}
    identity = {
        b: {**rec, "folded": isinstance(modules.get(b), FoldedIdentity)}
        for b, rec in dict(info.get("identity_bns", {})).items()
    }
    return {
        "format": SPEC_FORMAT,
        "version": SPEC_VERSION,
        "blocks": blocks,
        "pairs": dict(info["pairs"]),
        "pair_eps": pair_eps,
        "skipped": dict(info["skipped"]),
        "identity_bns": identity,
    }


def _check_spec(spec: Mapping[str, Any]) -> None:
    if not isinstance(spec, Mapping) or spec.get("format") != SPEC_FORMAT:
        raise ReparamError(f"spec must be a mapping with format {SPEC_FORMAT!r} (from reparam.structure)")
    if spec.get("version") != SPEC_VERSION:
        raise ReparamError(f"unsupported spec version {spec.get('version')!r}; this library reads {SPEC_VERSION}")


def build(model: nn.Module, spec: Mapping[str, Any], *, form: str = "train", inplace: bool = True) -> nn.Module:
    """Rebuild the structure recorded in ``spec`` on a plain (host-layout) model.

    ``form="train"``: blocks with fresh parameters (then ``load_state_dict(sd, strict=True)``);
    ``form="deploy"``: the deploy layout of :func:`merge` (biased convs, BN slots ``Identity``).
    The model must be clean (no blocks at the spec's paths). Returns the model (in place by default).
    """
    _check_spec(spec)
    if form not in ("train", "deploy"):
        raise ReparamError(f"form must be 'train' or 'deploy', got {form!r}")
    if not inplace:
        model = copy.deepcopy(model)
    for path, bs in dict(spec["blocks"]).items():
        conv = _get_module(model, path)
        if _is_block(conv):
            raise ReparamError(f"{path} is already a DiverseBranchBlock; build needs a clean plain model")
        if not isinstance(conv, nn.Conv2d):
            raise ReparamError(f"{path} is a {type(conv).__name__}, expected nn.Conv2d")
        bn_path = bs.get("bn_path")
        bn = _get_module(model, bn_path) if bs.get("mode") == "conv_bn" and bn_path else None
        if bs.get("mode") == "conv_bn" and (bn is None or not _is_bn_like(bn)):
            raise ReparamError(
                f"{path}: the spec records a conv+BN block but the model has "
                f"{type(bn).__name__ if bn is not None else 'no module'} at BN path {bn_path!r}; "
                "build needs the host (plain) layout of the model"
            )
        tail: NormActTail | None = None
        if bn is not None and bn_impurity(bn) is not None:
            why = norm_act_reason(bn)
            if why is not None:
                raise ReparamError(f"{path}: the BatchNorm at {bn_path!r} cannot be absorbed by a block: {why}")
            tail = split_norm_act(bn)  # its act/drop stay at the BN path, as expand left them
        new: nn.Module
        if form == "deploy":
            geometry = ConvGeometry.from_dict(bs["geometry"])
            new = geometry.make_conv(bias=True, device=conv.weight.device, dtype=conv.weight.dtype)
            if dict(bs.get("host_form", {}) or {}).get("same_pad"):
                as_same_pad(new)
            new.train(conv.training)
        else:
            blk = DiverseBranchBlock.from_spec(conv, bn, bs)
            blk.host_path = path
            blk.bn_path = bn_path
            new = blk
        _set_module(model, path, new)
        if bn is not None and bn_path:
            _set_module(model, bn_path, tail if tail is not None else nn.Identity())
    if form == "train":
        for path in dict(spec["blocks"]):
            found = _get_module(model, path)
            problem = _sink_problem(model, found) if _is_block(found) and getattr(found, "bias_sink", None) else None  # type: ignore[arg-type]
            if problem is not None:
                raise ReparamError(f"{path}: the spec records bias sinks the model does not have: {problem}")
    pairs = dict(spec.get("pairs", {}))
    if form == "deploy":
        for c, b in pairs.items():
            pair_conv = _get_module(model, c)
            if not isinstance(pair_conv, nn.Conv2d):
                raise ReparamError(f"{c} is a {type(pair_conv).__name__}, expected nn.Conv2d")
            geometry = ConvGeometry.from_conv(pair_conv)
            new = geometry.make_conv(bias=True, device=pair_conv.weight.device, dtype=pair_conv.weight.dtype)
            pair_form = conv_form(pair_conv)
            if isinstance(pair_form, ConvForm) and pair_form.same_pad:
                as_same_pad(new)
            new.train(pair_conv.training)
            _set_module(model, c, new)
            _set_module(model, b, nn.Identity())
        pairs = {}
    identity = {b: {"into": rec["into"], "eps": float(rec.get("eps", 1e-5))} for b, rec in dict(spec.get("identity_bns", {})).items()}
    if form == "deploy":
        for b, rec in identity.items():
            conv = _get_module(model, rec["into"])
            if not isinstance(conv, nn.Conv2d):
                raise ReparamError(f"identity branch {b}: {rec['into']} is a {type(conv).__name__}, expected nn.Conv2d")
            if conv.bias is None:
                new = ConvGeometry.from_conv(conv).make_conv(bias=True, device=conv.weight.device, dtype=conv.weight.dtype)
                new.train(conv.training)
                _set_module(model, rec["into"], new)
            _set_module(model, b, FoldedIdentity(rec["into"]))
    _set_info(model, {"pairs": pairs, "skipped": dict(spec.get("skipped", {})), "identity_bns": identity})
    return model


# ---------------------------------------------------------------------------------------------
# state dicts


def strip_prefixes(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Remove ``module.`` (DDP / DataParallel) and ``_orig_mod.`` (``torch.compile``) prefixes shared
    by every key."""
    sd = dict(state_dict)
    changed = True
    while changed and sd:
        changed = False
        for prefix in ("module.", "_orig_mod."):
            if all(k.startswith(prefix) for k in sd):
                sd = {k[len(prefix):]: v for k, v in sd.items()}
                changed = True
    return sd


def detect_form(state_dict: Mapping[str, Any], spec: Mapping[str, Any] | None = None) -> str:
    """``"train"`` (branch keys present), ``"deploy"`` or ``"plain"`` (host layout).

    Without ``spec`` a state dict without branch keys is ``"plain"`` unless it holds deployed-block
    keys (``reparam_conv``); with ``spec``, a missing BN at a recorded BN path means ``"deploy"``.
    """
    sd = strip_prefixes(state_dict)
    if any(".branches." in k or k.startswith("branches.") for k in sd):
        return "train"
    if any(".reparam_conv." in k or k.startswith("reparam_conv.") for k in sd):
        return "deploy"
    if spec is not None:
        _check_spec(spec)
        bn_paths = [bs.get("bn_path") for bs in spec["blocks"].values() if bs.get("mode") == "conv_bn"]
        bn_paths += list(dict(spec.get("pairs", {})).values())
        bn_paths = [b for b in bn_paths if b]
        if bn_paths:
            present = [any(k.startswith(b + ".") for k in sd) for b in bn_paths]
            if not any(present):
                return "deploy"
    return "plain"


def _sub(sd: dict[str, Any], prefix: str, pop: bool = True) -> dict[str, Any]:
    keys = [k for k in sd if k.startswith(prefix)]
    out = {k[len(prefix):]: sd[k] for k in keys}
    if pop:
        for k in keys:
            del sd[k]
    return out


def merge_state_dict(
    state_dict: Mapping[str, Tensor], spec: Mapping[str, Any], *, target: str = "deploy"
) -> dict[str, Tensor]:
    """Merge a train-form state dict into deploy or host weights from tensors alone (eval-exact,
    float64 computation). Prefixes ``module.`` / ``_orig_mod.`` are stripped first.

    ``target="deploy"`` also folds the unexpanded conv→BN pairs recorded in ``spec``.
    """
    _check_spec(spec)
    if target not in ("deploy", "host"):
        raise ReparamError(f"target must be 'deploy' or 'host', got {target!r}")
    sd = strip_prefixes(state_dict)
    out: dict[str, Any] = dict(sd)
    for path, bs in dict(spec["blocks"]).items():
        sub = _sub(out, path + ".")
        if not any(k.startswith(("branches.", "reparam_conv.")) for k in sub):
            out.update({f"{path}.{k}": v for k, v in sub.items()})  # already plain: keep
            continue
        ref = next(iter(sub.values()))
        geometry = ConvGeometry.from_dict(bs["geometry"])
        host_form = dict(bs.get("host_form", {}) or {})
        if host_form.get("standardized"):
            raise ReparamError(
                f"{path}: the block's host conv is weight-standardised; its kernel depends on the conv's own "
                "hyper-parameters (eps, scale), not on tensors alone: merge the model with reparam.merge"
            )
        fk = {"device": ref.device, "dtype": ref.dtype if ref.is_floating_point() else torch.float32}
        conv = geometry.make_conv(bias=geometry.bias and not bs.get("new_bias", False), **fk)
        if host_form.get("same_pad"):
            as_same_pad(conv)
        bn = nn.BatchNorm2d(geometry.out_channels, eps=float(bs.get("eps", 1e-5)), **fk) if bs["mode"] == "conv_bn" else None
        blk = DiverseBranchBlock.from_spec(conv, bn, bs)
        try:
            blk.load_state_dict(sub, strict=True)
        except RuntimeError as exc:
            raise ReparamError(f"{path}: the state dict does not match the spec: {exc}") from exc
        blk.eval()
        if target == "deploy":
            merged = blk.merge()
            assert merged.bias is not None  # a merged conv always has a bias
            out[f"{path}.weight"] = merged.weight.detach()
            out[f"{path}.bias"] = merged.bias.detach()
        else:
            hconv, hbn = blk.to_host()
            host_sd = {k: v.detach() for k, v in hconv.state_dict().items()}
            if hbn is None and bs.get("bias_sink") and "bias" in host_sd:
                _move_bias_sd(out, bs["bias_sink"], host_sd.pop("bias"), path)
            out.update({f"{path}.{k}": v for k, v in host_sd.items()})
            if hbn is not None:
                out.update({f"{bs['bn_path']}.{k}": v.detach() for k, v in hbn.state_dict().items()})
    if target == "deploy":
        for c, b in dict(spec.get("pairs", {})).items():
            bn_sd = _sub(out, b + ".")
            if not bn_sd:
                continue
            w = out[f"{c}.weight"]
            bias = out.get(f"{c}.bias")
            stats = BNStats(bn_sd["running_mean"], bn_sd["running_var"], bn_sd.get("weight"), bn_sd.get("bias"),
                            float(_pair_eps(spec, b)))
            k, bb = fuse_bn(w.to(torch.float64), None if bias is None else bias.to(torch.float64), stats)
            out[f"{c}.weight"] = k.to(w.dtype)
            out[f"{c}.bias"] = bb.to(w.dtype)
        for b, rec in dict(spec.get("identity_bns", {})).items():
            bn_sd = _sub(out, b + ".")
            if not bn_sd:
                continue  # already folded
            c = rec["into"]
            stats = BNStats(bn_sd["running_mean"], bn_sd["running_var"], bn_sd.get("weight"), bn_sd.get("bias"),
                            float(rec.get("eps", 1e-5)))
            w = out[f"{c}.weight"]
            k, bb = _identity_pair(w, out.get(f"{c}.bias"), stats)
            out[f"{c}.weight"] = k.to(w.dtype)
            out[f"{c}.bias"] = bb.to(w.dtype)
    return out


def _move_bias_sd(out: dict[str, Any], sinks: Any, bias: Tensor, path: str) -> None:
    """State-dict form of the host merge's bias move (:func:`reparam.expand_merge._move_bias`):
    ``running_mean[offset:] −= b`` (``W·b`` through a 1x1 conv ``W``) in each sink BN, in float64."""
    b = bias.to(torch.float64)
    for s in sinks:
        key = f"{s['bn']}.running_mean"
        if key not in out:
            raise ReparamError(f"{path}: the state dict has no {key!r} to take the block's bias (its bias sink)")
        shift = b
        if s.get("through"):
            wkey = f"{s['through']}.weight"
            if wkey not in out:
                raise ReparamError(f"{path}: the state dict has no {wkey!r} (the 1x1 conv carrying the bias to its sink)")
            w = out[wkey].to(torch.float64)
            shift = w.reshape(w.shape[0], -1) @ b.to(w.device)
        rm = out[key]
        offset = int(s.get("offset", 0))
        if offset < 0 or offset + shift.numel() > rm.numel():
            raise ReparamError(f"{path}: {key!r} has {rm.numel()} channels, not {shift.numel()} from offset {offset}")
        new = rm.to(torch.float64, copy=True)
        new[offset:offset + shift.numel()] -= shift.to(new.device)
        out[key] = new.to(rm.dtype)


def _identity_pair(weight: Tensor, bias: Tensor | None, stats: BNStats, sign: float = 1.0) -> tuple[Tensor, Tensor]:
    """``(weight, bias)`` plus ``sign`` times the identity kernel through a BN, in float64. The
    identity needs ``C == O``, so the groups follow from the weight shape ``(O, O/g, K_h, K_w)``."""
    w = weight.to(torch.float64, copy=True)
    o, cpg, kh, kw = w.shape
    t = torch.rsqrt(stats.var.to(torch.float64) + stats.eps)
    if stats.gamma is not None:
        t = stats.gamma.to(torch.float64) * t
    shift = -t * stats.mean.to(torch.float64)
    if stats.beta is not None:
        shift = shift + stats.beta.to(torch.float64)
    idx = torch.arange(o, device=w.device)
    w[idx, idx % cpg, kh // 2, kw // 2] += sign * t.to(w.device)
    b = torch.zeros(o, dtype=torch.float64, device=w.device) if bias is None else bias.to(torch.float64)
    return w, b + sign * shift.to(b.device)


def _pair_eps(spec: Mapping[str, Any], bn_path: str) -> float:
    return float(dict(spec.get("pair_eps", {})).get(bn_path, 1e-5))
