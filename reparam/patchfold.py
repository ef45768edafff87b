"""Patch-moment training forward of a :class:`~reparam.DiverseBranchBlock`: the branches besides
the anchor as **one** matrix product, exactly.

Every built-in branch is linear up to each of its BatchNorms: a ``1x1``/``1xk``/``kx1`` conv, a
``1x1_kxk`` or ``1x1_avg`` chain, a nested block. In training mode a BN normalises with the batch
statistics of its input, which are not known before that input is computed; but when the input is
an affine function ``y = W·p + b`` of the block input's ``K×K`` patches ``p`` (the columns of
``unfold(x)`` at the block's stride, padding and dilation), its statistics follow from the patches'
mean ``μ`` and covariance ``Σ`` alone::

    mean(y) = W μ + b,      var(y) = diag(W Σ Wᵀ)

so the BN becomes the per-channel scale ``t = γ/√(var + ε)`` folded into ``W`` (``t·W``, bias
``β − t·W μ``) and the next stage composes with it. Intermediate ``1×1`` stages (``1x1_kxk``'s and
``1x1_avg``'s first BN) read the whole input map, so their statistics come from the channel moments
of ``x`` (:func:`reparam.fused.channel_moments`); their folded ``T x + u`` then composes into the
``K×K`` kernel (T-III), an average pool spreads it over the window (T-V), a nested block sums the
forms of its own branches. The whole non-anchor part of the block is one ``K×K`` kernel ``W_rest``
and bias ``b_rest``, applied to the patches already unfolded for ``Σ``::

    block(x) = anchor(x) + W_rest · unfold(x) + b_rest

One ``D × D`` Gram matrix (``D = C·K_h·K_w``) and one product replace every branch convolution and
BatchNorm pass. The folds themselves are small tensor operations, so every BN that can be folded at
the same time (all branches walk their chains in lockstep) is folded in one batched set of them: a
handful of waves per block rather than some twenty operations per BN. The anchor still runs its
host conv and norm (a nested anchor block recursively the same way), so a zero-γ expansion stays
bit-exact: zero γ gives an exactly zero ``W_rest``.

Everything is ordinary differentiable tensor algebra (input gradients flow through ``unfold`` and
``Σ``); running statistics are updated exactly as ``nn.BatchNorm2d`` does (momentum or cumulative
average, unbiased variance). Exact in real arithmetic; float64 outputs, gradients and running
statistics agree with the per-branch forward to 1e-10 relative (tests).

**When it is used.** The Gram matrix costs ``M·D²`` multiply-adds for ``M`` output positions, the
per-branch convolutions it replaces about ``M·D·S`` for ``S`` BatchNorm channels they feed; the path
is taken when ``D ≤ S`` (a block on few input channels: the first conv of a network, LeNet-5's
``1 → 6`` conv, a ResNet stem) and everything in the block is understood: groups 1, zero padding,
``1x1_kxk``/``1x1_avg`` only with padding 0 (their value padding is not affine in the zero-padded
patches), plain ``BatchNorm2d`` or frozen norms, no hooks, not under tracing, compiling, autocast,
a dispatch mode or a ``torch.func`` transform, on the CPU (where it was measured; other devices keep
the forwards they had). Anything else takes the fused forward (:mod:`reparam.fused`) or the per-branch one.
:func:`patch_training` switches the path off.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Generator, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import kernels
from .fused import _first_stage_weight, channel_moments, fused_training_enabled
from .geometry import ConvGeometry
from .kinds import anchor_name
from .layers import FrozenIdentityBN, IdentityBasedConv1x1
from .transforms import embed_kernel, fuse_bn

__all__ = ["patch_training", "patch_training_enabled", "usable", "block_forward", "MAX_PATCH"]

_STATE = {"enabled": True}

#: patches longer than this (``C·K_h·K_w``) never take the path (the Gram matrix grows as its square)
MAX_PATCH = 1024

Form = tuple[Tensor, Tensor]  # (W (O, C, K_h, K_w) on the block input's patches, b (O,))
Pre = tuple[Tensor, Tensor] | None  # per-position (T (D, C), u (D,)): the branch input is T x + u


def patch_training_enabled() -> bool:
    """Whether blocks may use the patch-moment training forward (default ``True``)."""
    return _STATE["enabled"]


def patch_training(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Context manager that switches the patch-moment training forward on or off (restored on exit)."""
    return kernels.switched(_STATE, enabled)


# ---------------------------------------------------------------------------------------------
# what the path understands (checked before anything is computed: no half-updated statistics)


def _is_block(m: Any) -> bool:
    return isinstance(getattr(m, "geometry", None), ConvGeometry) and isinstance(getattr(m, "branches", None), nn.ModuleDict)


def _norm_ok(bn: Any) -> int | None:
    """Channels of a batch-statistics BN (0 for a norm with fixed statistics); None: not understood."""
    if kernels.hooked(bn):
        return None
    if type(bn) is nn.BatchNorm2d:
        if bn.training:
            return int(bn.num_features)
        return 0 if bn.running_mean is not None and bn.running_var is not None else None
    if type(bn) is FrozenIdentityBN:
        return 0
    return None


def _conv_ok(conv: Any, kernel: tuple[int, int] | None = None, identity_based: bool = False) -> bool:
    identity = identity_based and type(conv) is IdentityBasedConv1x1 and conv.padding_mode == "zeros"
    return (
        (kernels.plain_conv(conv) or (identity and not kernels.hooked(conv)))
        and conv.groups == 1
        and (kernel is None or tuple(conv.kernel_size) == kernel)
    )


def _same_geometry(a: ConvGeometry, b: ConvGeometry) -> bool:
    return (a.kernel_size, a.stride, a.dilation, a.padding, a.groups, a.in_channels) == (
        b.kernel_size, b.stride, b.dilation, b.padding, b.groups, b.in_channels
    )


def _last_stage(bn: Any, conv: Any, g: ConvGeometry, nested: bool, plain_ok: Callable[[], bool]) -> int | None:
    """Channels of a branch's last BN plus those of the nested block its conv may be (None: not
    understood); ``plain_ok`` checks a plain conv."""
    s = _norm_ok(bn)
    if s is None:
        return None
    if _is_block(conv):
        inner = _block_channels(conv, g, nested)
        return None if inner is None else inner + s
    return s if plain_ok() else None


def _branch_channels(name: str, br: Any, g: ConvGeometry, nested: bool) -> int | None:
    """Batch-statistics BN channels at patch level of one branch (None: not understood).
    ``nested``: the branch reads a ``1×1`` stage's output (no input padding may be involved)."""
    if kernels.hooked(br):
        return None
    kind = getattr(br, "kind", None)
    if kind != name:
        return None
    if name in ("kxk", "1x1", "1xk", "kx1"):
        window = getattr(br, "window", None)
        if br.padding_mode != "zeros" or (nested and window is not None and any(v > 0 for side in window for v in side)):
            return None
        return _last_stage(br.bn, br.conv, g, nested, lambda: _conv_ok(br.conv))
    if name == "1x1_kxk":
        if br.padding != (0, 0) or br.padding_mode != "zeros" or not _conv_ok(br.conv1, (1, 1), True):
            return None
        if tuple(br.conv1.stride) != (1, 1) or tuple(br.conv1.padding) != (0, 0) or _norm_ok(br.bn1) is None:
            return None
        conv2 = br.conv2
        return _last_stage(br.bn2, conv2, g, True, lambda: (
            _conv_ok(conv2, g.kernel_size) and tuple(conv2.padding) == (0, 0)
            and (tuple(conv2.stride), tuple(conv2.dilation)) == (g.stride, g.dilation)
        ))
    if name == "1x1_avg":
        if br.path != "dense" or br.padding != (0, 0) or br.padding_mode != "zeros" or g.dilation != (1, 1):
            return None
        if br.kernel_size != g.kernel_size or br.stride != g.stride or not _conv_ok(br.conv, (1, 1)):
            return None
        if tuple(br.conv.stride) != (1, 1) or tuple(br.conv.padding) != (0, 0) or _norm_ok(br.bn1) is None:
            return None
        return _norm_ok(br.bn2)
    return None


def _block_channels(block: Any, g: ConvGeometry, nested: bool, chain: bool = False) -> int | None:
    """Batch-statistics BN channels of a block's branches (None: not understood). ``chain``: the
    block is on the anchor chain, whose anchors run as modules: an anchor counts only the rest of
    the nested anchor block it may be."""
    if kernels.hooked(block) or block.reparam_conv is not None or block.same_pad:
        return None
    inner_g = block.geometry
    if nested:  # inside a 1x1_kxk: the block reads the intermediate with padding 0
        if (inner_g.kernel_size, inner_g.stride, inner_g.dilation, inner_g.groups, inner_g.padding) != (
            g.kernel_size, g.stride, g.dilation, 1, (0, 0)
        ):
            return None
    elif not _same_geometry(inner_g, g):
        return None
    total = 0
    anchor = anchor_name()
    for name in block.branch_names:
        br = block.branches[name]
        if chain and name == anchor:
            s = None if kernels.hooked(br) else _block_channels(br.conv, g, False, True) if _is_block(br.conv) else 0
        else:
            s = _branch_channels(name, br, inner_g, nested)
        if s is None:
            return None
        total += s
    return total


def usable(block: Any, x: Any) -> bool:
    """Whether the patch-moment training forward may run ``block`` on ``x`` (see the module docstring)."""
    if not (_STATE["enabled"] and fused_training_enabled()) or not block.training or not isinstance(x, Tensor):
        return False
    # CPU only: measured there; other devices keep the fused and per-branch forwards
    if x.device.type != "cpu" or x.dim() != 4 or x.dtype not in (torch.float32, torch.float64):
        return False
    g = block.geometry
    if g.groups != 1 or len(block.branch_names) < 2:
        return False
    d = g.in_channels * g.kernel_size[0] * g.kernel_size[1]
    if d > MAX_PATCH or kernels.global_hooks() or not kernels.plain_context(x):
        return False
    s = _block_channels(block, g, False, chain=True)
    # the Gram matrix's backward (when the input needs its gradient) costs about twice its forward
    return s is not None and 0 < s and d * (3 if x.requires_grad else 1) <= s


# ---------------------------------------------------------------------------------------------
# the forward


def _unfold(x: Tensor, g: ConvGeometry) -> Tensor:
    """``F.unfold(x)`` at the block's geometry, ``(N, C·K_h·K_w, L)``: strided views and one copy
    (several times faster than ``im2col`` on CPU for narrow inputs)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = g.kernel_size, g.stride, g.padding, g.dilation
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph))
    n, c, h, w = x.shape
    ho, wo = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    sn, sc, sy, sx = x.stride()
    view = x.as_strided((n, c, kh, kw, ho, wo), (sn, sc, sy * dh, sx * dw, sy * sh, sx * sw))
    return view.reshape(n, c * kh * kw, ho * wo)


class _Patches:
    """The block input's patches ``(N, D, L)``, their mean and covariance over the ``M = N·L``
    output positions, and (lazily) the channel moments of the whole input map."""

    def __init__(self, x: Tensor, g: ConvGeometry) -> None:
        self.x = x
        cols = _unfold(x, g)
        n, d, length = cols.shape
        self.m = n * length
        if self.m <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got {self.m}")
        self.mean = cols.sum(dim=(0, 2)) / self.m
        # centred in place where the unfold copied (the usual case; a kernel whose patches are
        # already laid out as rows, e.g. 1×1, gives a view of the input, which must not change):
        # the same numbers without a second patch-sized buffer, 2–3 % of a 3×-tier LeNet-5 step
        shift = self.mean.view(1, d, 1)
        centred = cols.sub_(shift) if cols._base is None else cols - shift
        self.cov = torch.bmm(centred, centred.transpose(1, 2)).sum(0) / self.m
        self._channel: tuple[Tensor, Tensor, int] | None = None

    def channel(self) -> tuple[Tensor, Tensor, int]:
        if self._channel is None:
            mean, cov = channel_moments(self.x)
            self._channel = (mean, cov, self.x.shape[0] * self.x.shape[2] * self.x.shape[3])
        return self._channel


# A branch's form is computed by a generator that yields the BatchNorms it needs folded (a list of
# requests ``(stats, bn, W, b)``, ``stats`` "patch" or "channel") and receives their folded forms;
# the generators of all branches run in lockstep, so every BN that can be folded at the same time is
# folded in one batched set of operations (a handful of waves per block instead of one set of about
# twenty small operations per BN).

Request = tuple[str, nn.Module, Tensor, Tensor]
FormGen = Generator[list[Request], list[Form], Any]


def _cat(ts: list[Tensor]) -> Tensor:
    return torch.cat(ts) if len(ts) > 1 else ts[0]


def _fold(requests: list[Request], pm: _Patches) -> list[Form]:
    """The folded forms of ``requests``: every batch-statistics BN of one statistics source in one
    batched computation (running statistics updated as ``nn.BatchNorm2d`` does), fixed norms by
    their statistics (T-I)."""
    out: list[Form | None] = [None] * len(requests)
    groups: dict[str, list[int]] = {}
    for i, (key, bn, w, b) in enumerate(requests):
        if kernels.batch_stats_bn(bn):
            groups.setdefault(key, []).append(i)
        else:
            out[i] = fuse_bn(w, b, bn)
    for key, idx in groups.items():
        mean, cov, m = (pm.mean, pm.cov, pm.m) if key == "patch" else pm.channel()
        bns = [cast(nn.BatchNorm2d, requests[i][1]) for i in idx]
        ws = [requests[i][2] for i in idx]
        sizes = [w.shape[0] for w in ws]
        wf = _cat([w.reshape(w.shape[0], -1) for w in ws])
        b = _cat([requests[i][3] for i in idx])
        centre = wf @ mean
        var = ((wf @ cov) * wf).sum(1).clamp_min(0)
        full = centre + b
        eps = {bn.eps for bn in bns}
        if len(eps) == 1:
            t = torch.rsqrt(var + eps.pop())
        else:
            t = torch.rsqrt(var + torch.tensor([bn.eps for bn, o in zip(bns, sizes) for _ in range(o)],
                                               dtype=var.dtype, device=var.device))
        gammas: list[Tensor] = [bn.weight if bn.weight is not None else wf.new_ones(o) for bn, o in zip(bns, sizes)]
        betas: list[Tensor] = [bn.bias if bn.bias is not None else wf.new_zeros(o) for bn, o in zip(bns, sizes)]
        t = t * _cat(gammas)
        # b cancels, as in BatchNorm itself; written through it so that what feeds it (a conv bias,
        # an earlier BN's β) gets its gradient (zero) as in the per-branch forward, not none
        shift = t * (b - full) + _cat(betas)
        scaled = wf * t.unsqueeze(1)
        for bn, f, v in zip(bns, full.split(sizes), var.split(sizes)):
            kernels.update_running_stats(bn, f, v, m)
        for i, w, k, sh in zip(idx, ws, scaled.split(sizes), shift.split(sizes)):
            out[i] = (k.view(w.shape), sh)
    return cast(list[Form], out)


def _lockstep(gens: list[FormGen]) -> Generator[list[Request], list[Form], list[Any]]:
    """Run ``gens`` side by side: each wave yields the union of their requests; returns their results."""
    results: list[Any] = [None] * len(gens)
    pending: dict[int, list[Request]] = {}
    for i, gen in enumerate(gens):
        try:
            pending[i] = next(gen)
        except StopIteration as stop:
            results[i] = stop.value
    while pending:
        answers = yield [r for reqs in pending.values() for r in reqs]
        pos, nxt = 0, {}
        for i, reqs in pending.items():
            part, pos = answers[pos : pos + len(reqs)], pos + len(reqs)
            try:
                nxt[i] = gens[i].send(part)
            except StopIteration as stop:
                results[i] = stop.value
        pending = nxt
    return results


def _bn(key: str, bn: nn.Module, w: Tensor, b: Tensor) -> FormGen:
    """One BN on ``y = W·p + b``: a one-request wave."""
    (form,) = yield [(key, bn, w, b)]
    return form


def _compose(w: Tensor, b: Tensor | None, pre: Pre) -> Form:
    """A kernel ``(O, D, K_h, K_w)`` on the intermediate ``T x + u`` as one on ``x`` (T-III)."""
    if b is None:
        b = w.new_zeros(w.shape[0])
    if pre is None:
        return w, b
    t, u = pre
    return torch.einsum("odhw,dc->ochw", w, t), b + torch.einsum("odhw,d->o", w, u)


def _stage(conv: nn.Module, bn: nn.Module, pre: Pre) -> FormGen:
    """A ``1×1`` conv → BN on the whole input map, as the per-position affine map ``T x + u``."""
    a = _first_stage_weight(conv)
    a = a.reshape(a.shape[0], a.shape[1])
    c = cast(Tensor | None, conv.bias)
    if pre is not None:  # the stage reads T' x + u'
        t0, u0 = pre
        a, c = a @ t0, (a @ u0 if c is None else c + a @ u0)
    k, shift = yield from _bn("channel", bn, a.view(*a.shape, 1, 1), a.new_zeros(a.shape[0]) if c is None else c)
    return k.reshape(k.shape[0], k.shape[1]), shift


def _branch_form(name: str, br: Any, g: ConvGeometry, pre: Pre) -> FormGen:
    if name in ("kxk", "1x1", "1xk", "kx1"):
        if _is_block(br.conv):
            w, b = yield from _block_form(br.conv, pre)
        else:
            w, b = _compose(embed_kernel(br.conv.weight, g.kernel_size, br.offset), br.conv.bias, pre)
        return (yield from _bn("patch", br.bn, w, b))
    if name == "1x1_kxk":
        inner = yield from _stage(br.conv1, br.bn1, pre)
        if _is_block(br.conv2):
            w, b = yield from _block_form(br.conv2, inner)
        else:
            w, b = _compose(br.conv2.weight, br.conv2.bias, inner)
        return (yield from _bn("patch", br.bn2, w, b))
    # 1x1_avg (dense): the mean over the window of T x + u
    t, u = yield from _stage(br.conv, br.bn1, pre)
    kh, kw = g.kernel_size
    w = (t / (kh * kw)).view(*t.shape, 1, 1).expand(-1, -1, kh, kw)
    return (yield from _bn("patch", br.bn2, w, u))


def _sum(forms: list[Form]) -> Form:
    w, b = forms[0]
    for wi, bi in forms[1:]:
        w, b = w + wi, b + bi
    return w, b


def _block_form(block: Any, pre: Pre) -> FormGen:
    """A nested block (every branch, its anchor included) as one affine map on the patches."""
    forms = yield from _lockstep([_branch_form(n, block.branches[n], block.geometry, pre) for n in block.branch_names])
    return _sum(forms)


def _rests(block: Any, pm: _Patches) -> list[Form]:
    """The forms of the non-anchor branches along the anchor chain, innermost block first (one
    summed form per block that has any), all chains' BNs folded in lockstep."""
    anchor = anchor_name()
    per_block: list[list[FormGen]] = []
    chain = [block]
    while _is_block(chain[-1].branches[anchor].conv):
        chain.append(chain[-1].branches[anchor].conv)
    for blk in reversed(chain):
        gens = [_branch_form(n, blk.branches[n], blk.geometry, None) for n in blk.branch_names if n != anchor]
        if gens:
            per_block.append(gens)
    driver = _lockstep([g for gens in per_block for g in gens])
    try:
        requests = next(driver)
        while True:
            requests = driver.send(_fold(requests, pm))
    except StopIteration as stop:
        forms: list[Form] = stop.value
    out, pos = [], 0
    for gens in per_block:
        out.append(_sum(forms[pos : pos + len(gens)]))
        pos += len(gens)
    return out


def _chain(block: Any, x: Tensor, rest: list[Tensor]) -> Tensor:
    """The block's output: its anchor (a nested anchor block the same way) plus the next output of
    the stacked rest convolution, when the block has other branches."""
    anchor = anchor_name()
    br = block.branches[anchor]
    y = _chain(br.conv, x, rest) if _is_block(br.conv) else br.conv(x)
    out: Tensor = br.bn(y)
    if len(block.branch_names) > 1:
        out = out + rest.pop(0)
    return out


def block_forward(block: Any, x: Tensor) -> Tensor:
    """The patch-moment training forward of a block whose :func:`usable` check passed."""
    g = block.geometry
    pm = _Patches(x, g)
    forms = _rests(block, pm)
    if len(forms) == 1:
        w, b = forms[0]
    else:
        w, b = torch.cat([f[0] for f in forms]), torch.cat([f[1] for f in forms])
    stacked = kernels.conv2d(x, w, b, g.stride, g.padding, g.dilation, 1)
    o = g.out_channels
    return _chain(block, x, list(stacked.split(o, dim=1)) if len(forms) > 1 else [stacked])
