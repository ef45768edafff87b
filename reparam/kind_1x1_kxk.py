"""The ``1x1_kxk`` branch kind: ``1×1 (C→D) → BN → value pad P → K×K (D→O, stride s, dilation d)
→ BN``, merged by transform III (the 1×1 → K×K composition).

The composition is the one matrix product of a merge (per group ``(C/g + 1) × D/g`` by
``D/g × (O/g·taps)``); :meth:`OneByOneKxKBranch.merge_terms` and
:meth:`OneByOneKxKBranch.accumulate_` compute it chunk by chunk of output rows, as a 1×1
convolution where that is faster (:func:`compose_by_conv`).
"""

from __future__ import annotations

from typing import Any, Mapping, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import fused
from .errors import ReparamError
from .geometry import ConvGeometry
from .kernels import batch_norm, run_conv
from .kinds import BranchKind, builtin_kind, Fusion
from .layers import IdentityBasedConv1x1, kaiming_, new_bn, pad_intermediate
from .merge_algebra import acc_shape, add_term, bn_scale_shift, conv_kernel_bias, full_acc, take_rows
from .transforms import fuse_bn, merge_1x1_kxk


__all__ = ["OneByOneKxKBranch", "OneByOneKxKKind", "compose_by_conv", "default_internal"]


class OneByOneKxKBranch(nn.Module):
    """``1×1 (C→D, groups g) → BN → value pad P → K×K (D→O, stride s, dilation d, padding 0) → BN``.

    With ``D == C`` the first stage is an :class:`~reparam.layers.IdentityBasedConv1x1` (the branch
    starts as a ``K×K`` conv); otherwise (depthwise default ``D = 2C``) a plain 1×1 conv.
    """

    kind = "1x1_kxk"

    def __init__(
        self,
        conv1: nn.Conv2d,
        bn1: nn.Module,
        conv2: nn.Module,
        bn2: nn.Module,
        padding: tuple[int, int],
        padding_mode: str,
    ) -> None:
        super().__init__()
        self.conv1 = conv1
        self.bn1 = bn1
        self.conv2 = conv2
        self.bn2 = bn2
        self.padding = (int(padding[0]), int(padding[1]))
        self.padding_mode = padding_mode

    @property
    def internal(self) -> int:
        """Internal width ``D``."""
        return int(cast(int, self.bn1.num_features))

    @property
    def last_bn(self) -> nn.Module:
        return self.bn2

    def forward(self, x: Tensor) -> Tensor:
        z = batch_norm(self.bn1, run_conv(self.conv1, x))
        z = pad_intermediate(z, self.padding, self.padding_mode, self.bn1)
        return batch_norm(self.bn2, run_conv(self.conv2, z))

    def equivalent_kernel_bias(self, geometry: ConvGeometry, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        w1, c1 = conv_kernel_bias(self.conv1, dtype)
        k1, b1 = fuse_bn(w1, c1, self.bn1)
        w2, c2 = conv_kernel_bias(self.conv2, dtype)
        k2, b2 = fuse_bn(w2, c2, self.bn2)
        return merge_1x1_kxk(k1, b1, k2, b2, geometry.groups)

    @torch.no_grad()
    def merge_terms(self, geometry: ConvGeometry, dtype: torch.dtype) -> tuple[Any, ...]:
        """The branch's share of the merged pair, computed once per merge in ``dtype``.

        Two forms (see :meth:`accumulate_`):

        * ``("scale", W2, t2, scale, b, b1 per tap)`` when the first stage is an identity-based 1×1
          whose residual ``R`` is exactly zero (a freshly grown branch): the composition is then an
          elementwise scale of ``W2``, ``K[o, c, :] = t2[o]·t1[c]·W2[o, c, :]``, and no matrix
          product is needed.
        * ``("gemm", left, W2, t2, b)`` otherwise (a trained residual or a plain first stage):
          ``left`` (per group ``(C/g + 1) × D/g``) holds ``(A·diag(t1))ᵀ`` with ``b1`` as its last
          row. :meth:`accumulate_` multiplies it, for the output rows of its chunk, by ``W2`` with
          its rows scaled by ``t2`` (taps and output rows as the long dimension): one matrix product
          per chunk and group, whose extra row is ``Σ_d W2·b1`` per tap for the bias. Computing the
          product chunk by chunk keeps its operands and result in cache, where the transposing
          passes around it cost a fraction of what they cost on whole kernels. For a dense conv in
          float32 on the CPU the same product is a 1×1 convolution of ``W2`` (its ``O`` rows as a
          batch of ``D``-channel images of the kernel's size) with ``left`` as the weight
          (:func:`compose_by_conv`).
        """
        g = geometry.groups
        o, cg = geometry.out_channels, geometry.in_channels // g
        opg = o // g
        t1, b1 = bn_scale_shift(self.bn1, dtype)
        w2, c2 = conv_kernel_bias(self.conv2, fast=True)
        t2, shift2 = bn_scale_shift(self.bn2, dtype)
        dg = w2.shape[1]
        taps = w2.shape[2] * w2.shape[3]
        identity_based = isinstance(self.conv1, IdentityBasedConv1x1)
        a: Tensor
        c1: Tensor | None
        if identity_based:
            a, c1 = self.conv1.weight.detach(), None  # the residual R; I is added in ``dtype`` below
        else:
            a, c1 = conv_kernel_bias(self.conv1, fast=True)
        if c1 is not None:
            b1 = b1 + t1 * c1.to(dtype)
        bias = shift2 if c2 is None else shift2 + t2 * c2.to(dtype)
        if identity_based and not bool(a.ne(0).any()):
            # identity part only: K[o, c', :] += t2[o] * t1[d=c'] * W2[o, c', :]
            scale = (t2.view(g, opg, 1) * t1.view(g, 1, dg)).view(o, dg, 1, 1)
            # the first stage's bias through the K×K kernel, Σ_d,taps W2[o, d, :]·b1[d], is added
            # per chunk of rows (where W2 is in cache in the compute dtype), b1 repeated over taps
            b1_taps = b1.view(g, dg, 1).expand(g, dg, taps).reshape(g, -1, 1)
            return ("scale", w2, t2, scale, bias, b1_taps)
        # left operand (g, C/g + 1, D/g): rows c = (A·diag(t1))ᵀ, last row = b1. An identity-based
        # stage is A = R + I with I added here, in the compute dtype (R + 1 in float32 would round)
        left = torch.empty((g, cg + 1, dg), dtype=dtype, device=t1.device)
        torch.mul(a.reshape(g, dg, cg).transpose(1, 2), t1.view(g, 1, dg), out=left[:, :cg])
        if identity_based:
            left[:, :cg].diagonal(dim1=1, dim2=2).add_(t1.view(g, dg))
        left[:, cg].copy_(b1.view(g, dg))
        return ("gemm", left, w2, t2, bias)

    @torch.no_grad()
    def accumulate_(
        self, acc: Tensor | None, bias: Tensor, geometry: ConvGeometry, rows: slice | None = None,
        terms: tuple[Any, ...] | None = None,
    ) -> Tensor:
        """In-place accumulation of T-III; see :meth:`~reparam.kind_conv.ConvBNBranch.accumulate_`
        (a chunk of ``rows`` lies inside one group or covers whole groups).

        With an identity-based first stage whose residual is zero the composition is an elementwise
        multiply-add; otherwise the product for the chunk's output rows is computed here from the
        operands :meth:`merge_terms` prepared, and added with its output rows moved in front of the
        input channels."""
        dt = bias.dtype
        g = geometry.groups
        o_all = geometry.out_channels
        o, cg, kh, kw = acc_shape(geometry, rows)
        opg = o_all // g  # output rows per group
        g0, gn = 0, g  # first group and groups in this chunk
        r0, r1 = 0, opg  # rows of the group when the chunk lies inside one group
        if rows is not None:
            start, stop = rows.indices(o_all)[:2]
            g0 = start // opg
            if (stop - 1) // opg == g0:  # a chunk inside one group
                gn = 1
                r0, r1 = start - g0 * opg, stop - g0 * opg
            else:  # whole groups
                gn = (stop - start) // opg
        terms = terms or self.merge_terms(geometry, dt)
        if terms[0] == "gemm":
            _, left, w2, t2, b = terms
            w2, t2, b = take_rows(rows, w2, t2, b)
            row_scale: Tensor | None
            if g == 1 and compose_by_conv(dt, bias.device):
                term, row_scale = _composed_by_conv(bias, left[0], w2, t2, b, cg)
            else:
                term, row_scale = _composed_by_product(bias, left[g0 : g0 + gn], w2, t2, b, r1 - r0), None
            return add_term(acc, term, (o, cg, kh, kw), row_scale)
        _, w2, t2, scale, b, b1_taps = terms
        w2, t2, scale, b = take_rows(rows, w2, t2, scale, b)
        w2 = w2.to(dt)  # once per chunk: used by the identity part and the bias
        dg = w2.shape[1]
        opg = r1 - r0
        acc = full_acc(acc, (o, cg, kh, kw), bias)
        acc.addcmul_(w2, scale)
        through = torch.bmm(w2.view(gn, opg, dg * kh * kw), b1_taps[g0 : g0 + gn]).view(o)
        bias.add_(b).addcmul_(t2, through)
        return acc


def compose_by_conv(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the ``1x1_kxk`` composition of a dense conv runs as a convolution: float32 on a CPU
    with oneDNN, whose convolution (vectorised for the machine, e.g. AVX-512) ran the product at
    twice the speed of the BLAS matrix product here. float64 (no oneDNN kernel) and other devices
    (where a float32 convolution may use TF32) use the matrix product, as does a process that
    disabled oneDNN or allowed it reduced float32 precision (``fp32_precision`` bf16/tf32)."""
    if dtype != torch.float32 or device.type != "cpu":
        return False
    onednn = torch.backends.mkldnn
    if not (onednn.is_available() and onednn.enabled):
        return False
    full = ("none", "ieee")
    conv = getattr(onednn, "conv", None)
    return getattr(onednn, "fp32_precision", "none") in full and getattr(conv, "fp32_precision", "none") in full


def _composed_by_conv(
    bias: Tensor, left: Tensor, w2: Tensor, t2: Tensor, b: Tensor, cg: int
) -> tuple[Tensor, Tensor]:
    """The composed kernel ``Σ_d W2[o, d, :]·left[c, d]`` (``n × C × K_h × K_w``, to be scaled by the
    returned ``t2`` per output row) by a convolution; its bias row goes into ``bias`` here.

    ``W2`` (``n × D × K_h × K_w``) in channels-last layout is a batch of ``n`` images of ``D``
    channels; ``left`` (``(C + 1) × D``) is the weight of a 1×1 convolution over them, whose output
    channel ``c`` at each tap is the composed kernel and whose channel ``C`` is ``Σ_d W2·b1``."""
    x = w2.to(torch.float32).contiguous(memory_format=torch.channels_last)
    y = F.conv2d(x, left.reshape(left.shape[0], left.shape[1], 1, 1))
    bias.add_(b + t2 * y[:, cg].sum((1, 2)))
    return y[:, :cg], t2.view(-1, 1, 1, 1)


def _composed_by_product(bias: Tensor, left: Tensor, w2: Tensor, t2: Tensor, b: Tensor, n: int) -> Tensor:
    """The composed kernel, rows scaled by ``t2``, by a batched matrix product over the ``gn``
    groups of ``left`` (``gn × (C/g + 1) × D/g``), as a ``(gn, n, C/g, taps)`` view (``n`` output rows
    per group); its bias row goes into ``bias`` here."""
    gn, cg1, dg = left.shape
    taps = w2.shape[2] * w2.shape[3]
    # right operand (gn, D/g, n·taps): W2's rows scaled by t2 and transposed; cast first,
    # contiguously, then one transposing pass in the compute dtype (a transposing cast of float32
    # ran at half that speed)
    right = torch.empty((gn, dg, n, taps), dtype=left.dtype, device=left.device)
    torch.mul(w2.reshape(gn, n, dg, taps).to(left.dtype).transpose(1, 2), t2.view(gn, 1, n, 1), out=right)
    prod = torch.bmm(left, right.view(gn, dg, n * taps)).view(gn, cg1, n, taps)
    bias.add_(b + prod[:, cg1 - 1].sum(-1).reshape(-1))
    return prod[:, : cg1 - 1].transpose(1, 2)


def default_internal(geometry: Any) -> int:
    """Default internal width ``D`` on a host conv with ``geometry``: ``2C`` for depthwise convs,
    ``C`` otherwise."""
    c, o, g = int(geometry.in_channels), int(geometry.out_channels), int(geometry.groups)
    return 2 * c if (g > 1 and g == c == o) else c


def _kernel_pair(geometry: Any) -> tuple[int, int]:
    k = geometry.kernel_size
    return (k, k) if isinstance(k, int) else (int(k[0]), int(k[1]))


@builtin_kind
class OneByOneKxKKind(BranchKind):
    """``1x1_kxk``: options ``internal`` (width ``D``) and ``identity_init``."""

    name = "1x1_kxk"
    order = 20
    in_default = True
    in_depthwise_default = True
    in_first_plan = True
    options = frozenset({"internal", "identity_init"})
    nested_conv = "conv2"
    nested_norm = "bn2"
    # the second stage already reads the value-padded intermediate (padding 0): its nested block
    # keeps the classic rule and gets only {kxk, 1x1_kxk, 1x1_avg}, whose merges need no window of
    # the padded copy (the outer block's own centred kinds reach the same functions)
    nested_crop = False

    def reason(self, main: ConvGeometry, *, crop: bool = True) -> str | None:
        return None

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
        c, o, g = main.in_channels, main.out_channels, main.groups
        fk = dict(factory)
        internal = options.get("internal")
        d = (2 * c if main.is_depthwise else c) if internal is None else int(internal)
        if d <= 0 or d % g:
            raise ReparamError(f"internal must be a positive multiple of groups={g}, got {internal!r}")
        identity_init = options.get("identity_init")
        use_id = (d == c) if identity_init is None else bool(identity_init)
        if use_id and d != c:
            raise ReparamError(f"identity_init needs internal == in_channels ({c}), got {d}")
        if use_id:
            conv1: nn.Conv2d = IdentityBasedConv1x1(c, g, **fk)
        else:
            conv1 = nn.Conv2d(in_channels=c, out_channels=d, kernel_size=1, groups=g, bias=False, **fk)
            kaiming_(conv1.weight, generator)
        conv2 = nn.Conv2d(
            in_channels=d,
            out_channels=o,
            kernel_size=main.kernel_size,
            stride=main.stride,
            padding=0,
            dilation=main.dilation,
            groups=g,
            bias=False,
            **fk,
        )
        kaiming_(conv2.weight, generator)
        return OneByOneKxKBranch(
            conv1, new_bn(d, eps, momentum, fk), conv2, new_bn(o, eps, momentum, fk), main.padding, main.padding_mode
        )

    def options_of(self, branch: nn.Module) -> dict[str, Any]:
        br = cast(OneByOneKxKBranch, branch)
        return {"internal": int(br.internal), "identity_init": isinstance(br.conv1, IdentityBasedConv1x1)}

    def macs(self, geometry: Any, in_hw: tuple[int, int], out_hw: tuple[int, int], options: Mapping[str, Any]) -> int:
        g = int(geometry.groups)
        internal = options.get("internal")
        d = default_internal(geometry) if internal is None else int(internal)
        if d <= 0 or d % g:
            raise ReparamError(f"internal must be a positive multiple of groups={g}, got {internal!r}")
        kh, kw = _kernel_pair(geometry)
        cin_g = int(geometry.in_channels) // g
        return in_hw[0] * in_hw[1] * d * cin_g + out_hw[0] * out_hw[1] * int(geometry.out_channels) * (d // g) * kh * kw

    def nested_input_hw(self, geometry: Any, in_hw: tuple[int, int]) -> tuple[int, int]:
        # the second stage sees the intermediate value-padded by P
        pad = geometry.padding if not isinstance(geometry.padding, str) else (0, 0)
        ph, pw = (pad, pad) if isinstance(pad, int) else (int(pad[0]), int(pad[1]))
        return (in_hw[0] + 2 * ph, in_hw[1] + 2 * pw)

    @torch.no_grad()
    def merge_terms(self, branch: nn.Module, geometry: ConvGeometry, dtype: torch.dtype) -> Any:
        return cast(OneByOneKxKBranch, branch).merge_terms(geometry, dtype)

    @torch.no_grad()
    def accumulate(
        self, branch: nn.Module, acc: Tensor | None, bias: Tensor, geometry: ConvGeometry,
        rows: slice | None = None, terms: Any = None,
    ) -> Tensor:
        return cast(OneByOneKxKBranch, branch).accumulate_(acc, bias, geometry, rows, terms)

    def fused_forward(self, branch: nn.Module, x: Tensor, fusion: "Fusion") -> Tensor | None:
        return fused.one_by_one_kxk(branch, x, fusion.moments)
