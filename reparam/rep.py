"""DynamicFL's ``REP(ω_g, ζ)``: make a local (expanded) model equal a global plain model.

:func:`rep_to_local` re-solves every block's anchor so that, in eval mode, the block equals the
global model's conv at the same path, keeping the local branches and their statistics.
"""

from __future__ import annotations

from typing import Iterable, Mapping, cast

import torch
from torch import Tensor, nn

from ._tree import _info, _is_bn_like, _is_plain_conv, iter_blocks
from .block import DiverseBranchBlock, _as_batches, _inner_stats
from .changes import StructureChange
from .errors import ReparamError
from .spec import _identity_pair, detect_form, strip_prefixes
from .transforms import BNStats, bn_stats

__all__ = ["rep_to_local", "calibrate_anchors", "match_filter_norms"]

# ---------------------------------------------------------------------------------------------
# REP(global, local)


def rep_to_local(
    global_model_or_state: nn.Module | Mapping[str, Tensor],
    local_model: nn.Module,
    anchor_stats: str = "keep",
    *,
    strict: bool = True,
) -> StructureChange:
    """DynamicFL ``REP(ω_g, ζ)``: make ``local_model`` equal the global model in eval mode while
    keeping its structure and non-anchor branches.

    For every outermost block of ``local_model`` the anchor is re-solved (:meth:`DiverseBranchBlock.load_plain`)
    so that the block equals the global model's conv at the same path: a deploy-form conv (weight +
    bias, BN slot empty), or a host-form conv followed by the BN at the block's ``bn_path``
    (``anchor_stats="adopt"`` then takes that BN's statistics). Every other parameter and buffer of
    the local model is copied from the global state; a local conv+BN pair whose global counterpart
    is a folded (deploy) conv is solved into the local pair keeping the local BN statistics.

    ``anchor_stats="rescale"`` keeps each anchor BN's running statistics and each anchor conv
    filter's norm, and moves the target's scale into the BN's ``γ`` (see
    :meth:`DiverseBranchBlock.load_plain`). Use it when REP runs every round on a model that trains
    in between: with ``"keep"`` the conv weights absorb every change of scale, the running
    variance follows them in training, and the scale can grow geometrically over rounds.

    Returns:
        StructureChange listing every overwritten parameter (no parameter is added or removed).

    Raises:
        ReparamError: the global state is a train-form state, or keys/shapes do not match (``strict``).
    """
    if isinstance(global_model_or_state, nn.Module):
        gsd = strip_prefixes(global_model_or_state.state_dict())
    elif isinstance(global_model_or_state, Mapping):
        gsd = strip_prefixes(global_model_or_state)
    else:
        raise TypeError("global_model_or_state must be an nn.Module or a state dict")
    if detect_form(gsd) == "train":
        raise ReparamError("the global state holds branch keys (train form); merge it first (reparam.merge)")
    change = StructureChange()
    used: set[str] = set()
    handled_local: set[str] = set()
    info = _info(local_model)
    # BN-only identity branches of the local model that the global (deploy) model has folded into
    # a conv: the local BN stays, and its identity part is taken out of that conv's target
    identity_into: dict[str, list[nn.Module]] = {}
    for b, rec in dict(info.get("identity_bns", {})).items():
        if f"{b}.running_mean" in gsd:
            continue  # the global model keeps the BN: copied like any other module below
        try:
            bn = local_model.get_submodule(b)
        except AttributeError:
            continue
        if not _is_bn_like(bn):
            continue
        identity_into.setdefault(str(rec["into"]), []).append(bn)
        handled_local.update(f"{b}.{k}" for k in bn.state_dict())

    def target(path: str, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
        with torch.no_grad():
            for bn in identity_into.get(path, []):
                s = bn_stats(bn)
                stats = BNStats(s.mean.detach(), s.var.detach(), None if s.gamma is None else s.gamma.detach(),
                                None if s.beta is None else s.beta.detach(), s.eps)
                weight, bias = _identity_pair(weight, bias, stats, sign=-1.0)
        return weight, bias

    blocks = list(iter_blocks(local_model))
    for path, blk in blocks:
        wk, bk = f"{path}.weight", f"{path}.bias"
        if wk not in gsd:
            dk = f"{path}.reparam_conv.weight"
            if dk in gsd:
                wk, bk = dk, f"{path}.reparam_conv.bias"
            else:
                raise ReparamError(f"{path}: the global state has no conv weight at {wk!r}")
        target_bn = None
        used.update({wk, bk})
        if blk.bn_path and f"{blk.bn_path}.running_mean" in gsd:
            bsd = {k[len(blk.bn_path) + 1:]: v for k, v in gsd.items() if k.startswith(blk.bn_path + ".")}
            used.update(f"{blk.bn_path}.{k}" for k in bsd)
            eps = float(getattr(blk.anchor.bn, "eps", 1e-5)) if not blk.is_merged else 1e-5
            target_bn = BNStats(bsd["running_mean"], bsd["running_var"], bsd.get("weight"), bsd.get("bias"), eps)
        mode = anchor_stats
        if mode == "adopt" and target_bn is None:
            mode = "keep"
        change.extend(blk.load_plain(*target(path, gsd[wk], gsd.get(bk)), anchor_stats=mode, target_bn=target_bn))
        for k, _ in blk.named_parameters():
            handled_local.add(f"{path}.{k}")
        for k, _ in blk.named_buffers():
            handled_local.add(f"{path}.{k}")
    # local conv+BN pairs whose global counterpart is folded
    for c, b in info["pairs"].items():
        try:
            conv, bn = local_model.get_submodule(c), local_model.get_submodule(b)
        except AttributeError:
            continue
        if not (_is_plain_conv(conv) and _is_bn_like(bn)):
            continue
        if f"{b}.running_mean" in gsd or f"{c}.weight" not in gsd:
            continue  # global has the same layout: plain copy below
        w_t, b_t = target(c, gsd[f"{c}.weight"].to(torch.float64), gsd.get(f"{c}.bias"))
        b_t = torch.zeros(w_t.shape[0], dtype=torch.float64) if b_t is None else b_t.to(torch.float64)
        tmp = DiverseBranchBlock.from_conv(conv, bn, [])  # type: ignore[arg-type]
        change.extend(tmp.load_plain(w_t, b_t, anchor_stats=_inner_stats(anchor_stats)))
        used.update({f"{c}.weight", f"{c}.bias"})
        for k, _ in conv.named_parameters():
            handled_local.add(f"{c}.{k}")
        for k, _ in bn.named_parameters():
            handled_local.add(f"{b}.{k}")
        for k, _ in bn.named_buffers():
            handled_local.add(f"{b}.{k}")
    # plain local convs (neither block nor pair) that a folded identity branch feeds into
    block_paths = {p for p, _ in blocks}
    for c in identity_into:
        if c in block_paths or f"{c}.weight" in handled_local or f"{c}.weight" not in gsd:
            continue
        conv = local_model.get_submodule(c)
        if not _is_plain_conv(conv) or not isinstance(conv, nn.Conv2d):
            continue
        w_t, b_t = target(c, gsd[f"{c}.weight"], gsd.get(f"{c}.bias"))
        with torch.no_grad():
            if conv.bias is None:
                if b_t is not None and bool(b_t.ne(0).any()):
                    raise ReparamError(
                        f"{c}: the global conv carries the bias of the folded identity branch but the local conv "
                        "has no bias to hold it"
                    )
            else:
                assert b_t is not None  # a global conv for a biased local conv carries a bias
                conv.bias.copy_(b_t.to(conv.bias.dtype))
                change.overwritten.append(cast(nn.Parameter, conv.bias))
            conv.weight.copy_(w_t.to(conv.weight.dtype))
            change.overwritten.append(cast(nn.Parameter, conv.weight))
        used.update({f"{c}.weight", f"{c}.bias"})
        handled_local.update(f"{c}.{k}" for k, _ in conv.named_parameters())
    params = dict(local_model.named_parameters())
    missing = []
    with torch.no_grad():
        for k, t in local_model.state_dict(keep_vars=True).items():
            if k in handled_local:
                continue
            if k not in gsd:
                missing.append(k)
                continue
            g = gsd[k]
            if tuple(g.shape) != tuple(t.shape):
                raise ReparamError(f"{k}: global shape {tuple(g.shape)} != local shape {tuple(t.shape)}")
            t.copy_(g.to(t.dtype))
            used.add(k)
            p = params.get(k)
            if p is not None:
                change.overwritten.append(p)
    if strict:
        if missing:
            raise ReparamError(f"local keys absent from the global state: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        unused = [k for k in gsd if k not in used]
        if unused:
            raise ReparamError(f"global keys with no place in the local model: {unused[:8]}{' ...' if len(unused) > 8 else ''}")
    return change


def calibrate_anchors(
    model: nn.Module, inputs: Tensor | Iterable[Tensor], *, source: nn.Module | None = None
) -> StructureChange:
    """Measure every outermost block's anchor BatchNorm statistics on ``inputs`` (batches of the
    model's input) and re-solve each anchor so that the model's eval function is unchanged
    (:meth:`DiverseBranchBlock.calibrate_anchor`).

    Each block's input is taken from one eval-mode forward of the model; calibrating a block keeps
    its eval function, so the inputs of the blocks after it do not change. ``source``: a model
    with the same eval function whose module at each block's path is what the block replaced
    (the plain model :func:`rep_to_local` re-solved the blocks from); the inputs are then taken
    from its forward, a plain model's instead of a multi-branch one's (equal up to rounding, as
    the functions are). A source without a module at every block's path is not used. After
    :func:`rep_to_local`, this makes training mode start from the global model's function on the
    client's own data: kept statistics of an earlier round would scale each block's training-mode
    output by the ratio of the old and new statistics, and that ratio compounds over rounds.

    Returns:
        StructureChange listing the overwritten parameters (none added or removed).
    """
    blocks = list(iter_blocks(model))
    paths = [path for path, _ in blocks]
    taker = model
    if source is not None and all(_has_submodule(source, p) for p in paths):
        taker = source
    seen = _module_inputs(taker, paths, inputs)
    change = StructureChange()
    for path, blk in blocks:
        if seen[path]:
            change.extend(blk.calibrate_anchor(seen[path]))
    return change


def match_filter_norms(
    model: nn.Module,
    reference: nn.Module | Mapping[str, Tensor],
    pairs: Mapping[str, str | None] | None = None,
    *,
    inputs: Tensor | Iterable[Tensor] | None = None,
) -> dict[str, Tensor]:
    """In place: scale every conv that a BatchNorm follows so that each of its filters has the norm
    of the same filter in ``reference``, and scale the BatchNorm's running statistics with it, so
    that the eval function does not change (rounding only) and neither does the training-mode
    function (up to the BatchNorm's ``eps``).

    A BatchNorm normalises what its conv computes, so the conv's scale per output channel is free:
    ``(c·W, c·b, c·μ, c²·(v + eps) − eps)`` computes what ``(W, b, μ, v)`` computes for any
    ``c > 0``. A model merged into the host layout (``reparam.merge(model, target="host")``) carries
    its other branches in the anchor conv, ``W ← W + (σ/γ)·K_rest``, in units of that conv's running
    deviation σ; when such models are averaged and expanded again round after round (DynamicFL with
    a global model that keeps its BatchNorm), the conv's scale and σ grow together without bound.
    Pinning each filter's norm to the reference's (the model the round started from) keeps the
    scale where it was.

    Args:
        model: the model to scale (host layout: conv followed by its BatchNorm).
        reference: a model or state dict holding ``<conv path>.weight`` for the convs to scale;
            convs it does not hold, or holds at another shape, are left alone.
        pairs: conv path → BN path; default: :func:`~reparam.pairs.find_conv_bn_pairs`.
        inputs: batches of the model's input. When given, each affine BatchNorm's running
            statistics are instead *measured* on them (the scaled conv's output, pooled over the
            batches as in training) and its ``γ``, ``β`` re-solved so that the eval function stays.
            Training mode on such data then starts from the eval function: without it, a merged
            channel whose ``γ`` trained small (its branch carried the signal) keeps a large gain
            in eval mode through a small running variance, which training mode, normalising by
            the batch's own variance, does not have. Channels whose measured variance is not
            above ``eps`` keep the scaled statistics. (Done by
            :meth:`DiverseBranchBlock.calibrate_anchor` on the pair as a one-branch block, so
            ``γ`` keeps the block's floor, ``gamma_floor``.)

    A channel whose filter or reference filter has norm zero (or is not finite) keeps its scale. A
    factor that would make the running variance negative (``c² < eps / (v + eps)``) is raised to
    the smallest one that does not, which leaves the variance at zero.

    Returns:
        conv path → the factor applied to each output channel (1 where nothing changed).
    """
    from .pairs import find_conv_bn_pairs  # noqa: PLC0415 - pairs imports fx machinery

    ref = reference.state_dict() if isinstance(reference, nn.Module) else strip_prefixes(reference)
    if pairs is None:
        pairs = find_conv_bn_pairs(model).convs
    f64 = torch.float64
    out: dict[str, Tensor] = {}
    seen = _module_inputs(model, [p for p, b in pairs.items() if b is not None], inputs) if inputs is not None else {}
    with torch.no_grad():
        for conv_path, bn_path in pairs.items():
            target = ref.get(conv_path + ".weight")
            if bn_path is None or target is None:
                continue
            conv = model.get_submodule(conv_path)
            bn = model.get_submodule(bn_path)
            weight = cast(Tensor, conv.weight)
            if tuple(target.shape) != tuple(weight.shape):
                continue
            n_cur = weight.detach().to(f64).flatten(1).norm(dim=1)
            n_ref = target.detach().to(f64, copy=True).flatten(1).norm(dim=1).to(n_cur.device)
            c = n_ref / n_cur
            ok = (n_cur > 0) & (n_ref > 0) & torch.isfinite(c)
            mean, var = getattr(bn, "running_mean", None), getattr(bn, "running_var", None)
            stats = isinstance(var, Tensor) and isinstance(mean, Tensor)
            floored = torch.zeros_like(ok)
            eps = float(cast(float, getattr(bn, "eps", 0.0)))
            if stats:
                floor = torch.sqrt(eps / (cast(Tensor, var).detach().to(f64) + eps))
                floored = ok & (c < floor)
                c = torch.where(floored, floor, c)
            c = torch.where(ok & (c != 1.0), c, torch.ones_like(c))
            out[conv_path] = c
            changed = c != 1.0
            if bool(changed.any()):
                shape = (-1,) + (1,) * (weight.dim() - 1)
                weight.copy_(torch.where(changed.view(shape), weight.to(f64) * c.view(shape), weight.to(f64)).to(weight.dtype))
                bias = getattr(conv, "bias", None)
                if isinstance(bias, Tensor):
                    bias.copy_(torch.where(changed, bias.to(f64) * c, bias.to(f64)).to(bias.dtype))
                if stats:
                    mean, var = cast(Tensor, mean), cast(Tensor, var)
                    v = var.to(f64)
                    scaled = torch.where(floored, torch.zeros_like(v), (c * c * (v + eps) - eps).clamp_min(0.0))
                    mean.copy_(torch.where(changed, mean.to(f64) * c, mean.to(f64)).to(mean.dtype))
                    var.copy_(torch.where(changed, scaled, v).to(var.dtype))
            if stats and seen.get(conv_path) and isinstance(getattr(bn, "weight", None), Tensor):
                # measured statistics, γ and β re-solved: the block calibration of a one-branch block
                DiverseBranchBlock.from_conv(cast(nn.Conv2d, conv), bn, []).calibrate_anchor(seen[conv_path])
    return out


def _has_submodule(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _module_inputs(model: nn.Module, paths: list[str], inputs: Tensor | Iterable[Tensor]) -> dict[str, list[Tensor]]:
    """The input each module at ``paths`` receives in an eval-mode forward of ``model`` on each
    batch of ``inputs`` (a tensor is one batch)."""
    batches = _as_batches(inputs, "inputs")
    seen: dict[str, list[Tensor]] = {p: [] for p in paths}
    hooks = [
        model.get_submodule(p).register_forward_pre_hook(lambda _m, args, p=p: seen[p].append(args[0].detach()))
        for p in paths
    ]
    was = model.training
    try:
        model.eval()
        with torch.no_grad():
            for x in batches:
                model(x)
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    return seen
