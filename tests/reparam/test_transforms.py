"""Pure tensor transforms: every identity against direct execution, float64.

Threshold: rel_err <= 1e-12 (float64 rounding of a few hundred operations). Negative controls show the checks are not vacuous.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_weights

from reparam import transforms as T
from reparam.errors import AlignmentError, NotMergeableError, ReparamError
from reparam.geometry import ConvGeometry
from reparam.testing import randomize_bn_, rel_err

F64 = torch.float64
TOL = 1e-12


def _rand(*shape: int, gen: torch.Generator, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=dtype)


def _conv(x, w, b=None, s=1, p=0, d=1, g=1, mode="zeros"):
    p = (p, p) if isinstance(p, int) else tuple(p)
    if mode != "zeros":
        x = F.pad(x, (p[1], p[1], p[0], p[0]), mode=mode)
        p = (0, 0)
    return F.conv2d(x, w, b, s, p, d, g)


# ------------------------------------------------------------------------------------------ T-I


def _frozen_bn(n: int, gen: torch.Generator):
    from torchvision.ops.misc import FrozenBatchNorm2d

    bn = FrozenBatchNorm2d(n)
    bn.weight.copy_(torch.rand(n, generator=gen) + 0.5)
    bn.bias.copy_(torch.randn(n, generator=gen))
    bn.running_mean.copy_(torch.randn(n, generator=gen))
    bn.running_var.copy_(torch.rand(n, generator=gen) + 0.1)
    return bn.double()


@pytest.mark.parametrize("conv_bias", [False, True])
@pytest.mark.parametrize("kind", ["affine", "no_affine", "frozen", "sync"])
def test_fuse_bn_matches_torch_and_direct_execution(conv_bias: bool, kind: str, gen, tv) -> None:
    conv = nn.Conv2d(4, 6, 3, padding=1, bias=conv_bias).double()
    if kind == "frozen":
        bn = _frozen_bn(6, gen)
    else:
        bn = nn.BatchNorm2d(6, affine=kind != "no_affine").double()
        randomize_bn_(bn, gen)
        if kind == "sync":
            bn = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(bn))[0]
            assert isinstance(bn, nn.SyncBatchNorm)
        bn.eval()
    k, b = T.fuse_bn(conv.weight, conv.bias, bn)
    w_ref, b_ref = fuse_conv_bn_weights(
        conv.weight, conv.bias, bn.running_mean, bn.running_var, bn.eps,
        getattr(bn, "weight", None), getattr(bn, "bias", None),
    )
    assert (k - w_ref).abs().max().item() <= 1e-15 * max(1.0, w_ref.abs().max().item()) * 10
    assert (b - b_ref).abs().max().item() <= 1e-14
    x = _rand(2, 4, 7, 6, gen=gen)
    with torch.no_grad():
        assert rel_err(_conv(x, k, b, p=1), bn(conv(x))) <= TOL


def test_fuse_bn_refuses_norms_without_running_stats() -> None:
    w = torch.randn(4, 2, 3, 3, dtype=F64)
    with pytest.raises(NotMergeableError, match="track_running_stats=False"):
        T.fuse_bn(w, None, nn.BatchNorm2d(4, track_running_stats=False))
    with pytest.raises(NotMergeableError, match="depend on the input"):
        T.fuse_bn(w, None, nn.GroupNorm(2, 4))
    with pytest.raises(NotMergeableError, match="depend on the input"):
        T.fuse_bn(w, None, nn.InstanceNorm2d(4, track_running_stats=True))


def test_fuse_bn_with_cumulative_momentum_uses_stored_stats(gen) -> None:
    bn = nn.BatchNorm2d(3, momentum=None).double()
    randomize_bn_(bn, gen)
    w = _rand(3, 3, 1, 1, gen=gen)
    k, b = T.fuse_bn(w, None, bn)
    x = _rand(2, 3, 4, 4, gen=gen)
    assert rel_err(F.conv2d(x, k, b), bn.eval()(F.conv2d(x, w))) <= TOL


@pytest.mark.parametrize("conv_bias", [False, True])
def test_unfold_bn_inverts_fuse_bn(conv_bias: bool, gen) -> None:
    bn = nn.BatchNorm2d(5).double()
    randomize_bn_(bn, gen)
    k = _rand(5, 3, 3, 3, gen=gen)
    b = _rand(5, gen=gen)
    c = _rand(5, gen=gen) if conv_bias else None
    w, beta = T.unfold_bn(k, b, bn, conv_bias=c)
    stats = T.BNStats(bn.running_mean, bn.running_var, bn.weight, beta, bn.eps)
    k2, b2 = T.fuse_bn(w, c, stats)
    assert rel_err(k2, k) <= TOL and rel_err(b2, b) <= TOL


def test_unfold_bn_refuses_zero_gamma() -> None:
    bn = nn.BatchNorm2d(2).double()
    with torch.no_grad():
        bn.weight[0] = 0.0
    with pytest.raises(ReparamError, match="gamma"):
        T.unfold_bn(torch.ones(2, 1, 1, 1, dtype=F64), torch.zeros(2, dtype=F64), bn)


# ------------------------------------------------------------------------------------------ T-II / T-IV


def test_add_branches_and_concat_depth(gen) -> None:
    pairs = [(_rand(4, 2, 3, 3, gen=gen), _rand(4, gen=gen)) for _ in range(3)]
    k, b = T.add_branches(pairs)
    x = _rand(2, 2, 6, 6, gen=gen)
    direct = sum(F.conv2d(x, kk, bb, padding=1) for kk, bb in pairs)
    assert rel_err(F.conv2d(x, k, b, padding=1), direct) <= TOL
    kc, bc = T.concat_depth(pairs[:2])
    out = F.conv2d(x, kc, bc, padding=1)
    assert rel_err(out, torch.cat([F.conv2d(x, kk, bb, padding=1) for kk, bb in pairs[:2]], 1)) <= TOL
    with pytest.raises(ReparamError, match="embed"):
        T.add_branches([pairs[0], (_rand(4, 2, 1, 1, gen=gen), _rand(4, gen=gen))])
    with pytest.raises(ReparamError):
        T.add_branches([])


# ------------------------------------------------------------------------------------------ T-III

T3_CHANNELS = [(8, 8, 16, 1), (8, 16, 16, 2), (16, 32, 16, 16), (8, 8, 8, 8), (6, 6, 12, 3)]


def _seq_branch(x, w1, b1, w2, b2, g, stride, pad, mode, dilation=(1, 1), pad_value=None):
    z = F.conv2d(x, w1, b1, 1, 0, 1, g)
    ph, pw = pad
    if mode == "zeros":
        v = b1 if pad_value is None else pad_value
        if v is None:
            z = F.pad(z, (pw, pw, ph, ph))
        else:
            z = T.value_pad(z, (ph, pw), v)
    else:
        z = F.pad(z, (pw, pw, ph, ph), mode=mode)
    return F.conv2d(z, w2, b2, stride, 0, dilation, g)


@pytest.mark.parametrize("mode", ["zeros", "reflect"])
@pytest.mark.parametrize("bias1", [False, True])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("k", [3, 5, (3, 5)])
@pytest.mark.parametrize("cdog", T3_CHANNELS)
def test_merge_1x1_kxk_matches_direct_execution(cdog, k, stride, bias1, mode, gen) -> None:
    c, d, o, g = cdog
    kh, kw = (k, k) if isinstance(k, int) else k
    pad = (kh // 2, kw // 2)
    w1 = _rand(d, c // g, 1, 1, gen=gen)
    b1 = _rand(d, gen=gen) if bias1 else None
    w2 = _rand(o, d // g, kh, kw, gen=gen)
    b2 = _rand(o, gen=gen)
    x = _rand(2, c, 9, 8, gen=gen)
    direct = _seq_branch(x, w1, b1, w2, b2, g, stride, pad, mode)
    k_m, b_m = T.merge_1x1_kxk(w1, b1, w2, b2, g)
    merged = _conv(x, k_m, b_m, s=stride, p=pad, g=g, mode=mode)
    assert merged.shape == direct.shape
    assert rel_err(merged, direct) <= TOL


def test_merge_1x1_kxk_with_dilation(gen) -> None:
    w1, b1 = _rand(8, 8, 1, 1, gen=gen), _rand(8, gen=gen)
    w2, b2 = _rand(8, 8, 3, 3, gen=gen), _rand(8, gen=gen)
    x = _rand(2, 8, 10, 9, gen=gen)
    direct = _seq_branch(x, w1, b1, w2, b2, 1, 1, (2, 2), "zeros", dilation=(2, 2))
    k, b = T.merge_1x1_kxk(w1, b1, w2, b2, 1)
    assert rel_err(F.conv2d(x, k, b, 1, 2, 2), direct) <= TOL


def test_merge_1x1_kxk_einsum_equals_dense_formula(gen) -> None:
    w1, b1 = _rand(6, 4, 1, 1, gen=gen), _rand(6, gen=gen)
    w2, b2 = _rand(5, 6, 3, 3, gen=gen), _rand(5, gen=gen)
    k, b = T.merge_1x1_kxk(w1, b1, w2, b2, 1)
    k_ref = torch.einsum("odhw,dc->ochw", w2, w1[:, :, 0, 0])
    b_ref = b2 + torch.einsum("odhw,d->o", w2, b1)
    assert rel_err(k, k_ref) <= TOL and rel_err(b, b_ref) <= TOL


def test_zero_padding_of_the_intermediate_is_wrong(gen) -> None:
    """Negative control (DiverseBranchBlock#9/#16): zero-padding the intermediate breaks the border."""
    w1, b1 = _rand(8, 8, 1, 1, gen=gen), _rand(8, gen=gen) + 3.0
    w2, b2 = _rand(8, 8, 3, 3, gen=gen), _rand(8, gen=gen)
    x = _rand(2, 8, 9, 9, gen=gen)
    k, b = T.merge_1x1_kxk(w1, b1, w2, b2, 1)
    merged = F.conv2d(x, k, b, padding=1)
    zero_padded = _seq_branch(x, w1, b1, w2, b2, 1, 1, (1, 1), "zeros", pad_value=torch.zeros(8, dtype=F64))
    assert rel_err(zero_padded, merged) > 1e-2
    assert rel_err(_seq_branch(x, w1, b1, w2, b2, 1, 1, (1, 1), "zeros"), merged) <= TOL


def test_merge_1x1_kxk_refuses_kxk_first_stage(gen) -> None:
    with pytest.raises(NotMergeableError, match="1x1"):
        T.merge_1x1_kxk(_rand(4, 4, 3, 3, gen=gen), None, _rand(4, 4, 3, 3, gen=gen), None, 1)
    with pytest.raises(NotMergeableError, match="groups"):
        T.merge_1x1_kxk(_rand(6, 4, 1, 1, gen=gen), None, _rand(4, 3, 3, 3, gen=gen), None, 4)


def test_transforms_follow_input_dtype_without_numpy(gen) -> None:
    for dtype in (torch.float64, torch.bfloat16, torch.float32):
        w1 = _rand(4, 4, 1, 1, gen=gen).to(dtype)
        w2 = _rand(4, 4, 3, 3, gen=gen).to(dtype)
        k, b = T.merge_1x1_kxk(w1, None, w2, None, 1)
        assert k.dtype == dtype and b.dtype == dtype
        assert T.avg_kernel(4, 3, dtype=dtype).dtype == dtype
        assert T.identity_kernel(4, 3, dtype=dtype).dtype == dtype
        bn = nn.BatchNorm2d(4).to(dtype)
        assert T.fuse_bn(w2, None, bn)[0].dtype == dtype
        assert T.embed_kernel(w1, 3).dtype == dtype


# ------------------------------------------------------------------------------------------ T-V


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("k", [3, 5, (3, 5)])
@pytest.mark.parametrize("groups", [1, 2, 8])
def test_avg_kernel_equals_avg_pool(groups: int, k, stride: int, gen) -> None:
    kh, kw = (k, k) if isinstance(k, int) else k
    pad = (kh // 2, kw // 2)
    x = _rand(2, 8, 9, 10, gen=gen)
    pool = F.avg_pool2d(x, (kh, kw), stride, pad, count_include_pad=True)
    w = T.avg_kernel(8, (kh, kw), groups, padding=pad, dtype=F64)
    assert rel_err(F.conv2d(x, w, None, stride, pad, 1, groups), pool) <= TOL


def test_avg_kernel_divisor_override_and_refusals(gen) -> None:
    x = _rand(2, 4, 8, 8, gen=gen)
    pool = F.avg_pool2d(x, 3, 1, 1, divisor_override=4)
    w = T.avg_kernel(4, 3, 4, padding=1, divisor_override=4, dtype=F64)
    assert rel_err(F.conv2d(x, w, None, 1, 1, 1, 4), pool) <= TOL
    with pytest.raises(NotMergeableError, match="count_include_pad"):
        T.avg_kernel(4, 3, padding=1, count_include_pad=False)
    with pytest.raises(NotMergeableError, match="ceil_mode"):
        T.avg_kernel(4, 3, ceil_mode=True)
    # count_include_pad is irrelevant without padding
    assert T.avg_kernel(4, 3, padding=0, count_include_pad=False).shape == (4, 4, 3, 3)


# ------------------------------------------------------------------------------------------ T-VI

MAINS = [
    # (kernel, dilation, stride, padding)
    ((3, 3), (1, 1), (1, 1), (1, 1)),
    ((3, 3), (2, 2), (1, 1), (2, 2)),
    ((5, 5), (2, 1), (2, 2), (4, 2)),
    ((3, 5), (1, 1), (1, 1), (1, 2)),
    ((4, 4), (1, 1), (2, 2), (1, 1)),
]


def _branch_kernel(spec: str, main_k: tuple[int, int]) -> tuple[int, int]:
    return {"1x1": (1, 1), "1xK": (1, main_k[1]), "Kx1": (main_k[0], 1), "1x3": (1, 3), "2x2": (2, 2)}[spec]


@pytest.mark.parametrize("branch", ["1x1", "1xK", "Kx1", "1x3", "2x2"])
@pytest.mark.parametrize("main", MAINS)
def test_embedding_alignment_rule(main, branch: str, gen) -> None:
    (mk, md, ms, mp) = main
    bk = _branch_kernel(branch, mk)
    geo = ConvGeometry(6, 6, mk, ms, mp, md)
    # centred rule per axis: q = P - d (K - k) / 2, branch dilation = main dilation where k > 1
    q, dil, aligned = [], [], True
    for K, k, P, d in zip(mk, bk, mp, md):
        twice = 2 * P - d * (K - k) if k > 1 else 2 * P - d * (K - 1)
        if twice % 2 or twice < 0 or (K - k) % 2 and k > 1:
            aligned = False
        q.append(max(twice // 2, 0))
        dil.append(d if k > 1 else 1)
    bgeo = ConvGeometry(6, 6, bk, ms, tuple(q), tuple(dil))
    if not aligned:
        with pytest.raises(AlignmentError):
            T.check_alignment(geo, bgeo)
        return
    offset = T.check_alignment(geo, bgeo)
    wb = _rand(6, 6, *bk, gen=gen)
    x = _rand(2, 6, 11, 10, gen=gen)
    direct = F.conv2d(x, wb, None, ms, tuple(q), tuple(dil))
    emb = T.embed_kernel(wb, mk, offset)
    assert emb.shape[-2:] == mk
    assert rel_err(F.conv2d(x, emb, None, ms, mp, md), direct) <= TOL


def test_even_kernel_embeds_when_parity_matches(gen) -> None:
    """4x4, s=2, P=1 <- 2x2, q=0 at offset 1 (answers DiverseBranchBlock#32)."""
    main = ConvGeometry(4, 4, 4, 2, 1)
    branch = ConvGeometry(4, 4, 2, 2, 0)
    assert T.check_alignment(main, branch) == (1, 1)
    wb = _rand(4, 4, 2, 2, gen=gen)
    x = _rand(2, 4, 10, 9, gen=gen)
    emb = T.embed_kernel(wb, 4, (1, 1))
    assert rel_err(F.conv2d(x, emb, None, 2, 1), F.conv2d(x, wb, None, 2, 0)) <= TOL
    with pytest.raises(AlignmentError, match="parity"):
        T.embed_kernel(_rand(4, 4, 1, 1, gen=gen), 4)


def test_rectangular_embedding_pads_each_axis_by_its_own_size(gen) -> None:
    """DBB's transVI_multiscale swapped H and W padding: 1x3 became (1, 5) instead of (3, 3)."""
    k13 = _rand(2, 2, 1, 3, gen=gen)
    emb = T.embed_kernel(k13, (3, 3))
    assert emb.shape == (2, 2, 3, 3)
    assert torch.equal(emb[:, :, 1, :], k13[:, :, 0, :])
    assert emb[:, :, 0].abs().sum() == 0 and emb[:, :, 2].abs().sum() == 0
    k31 = _rand(2, 2, 3, 1, gen=gen)
    emb = T.embed_kernel(k31, (3, 5))
    assert emb.shape == (2, 2, 3, 5) and torch.equal(emb[:, :, :, 2], k31[:, :, :, 0])
    x = _rand(1, 2, 7, 8, gen=gen)
    assert rel_err(F.conv2d(x, emb, padding=(1, 2)), F.conv2d(x, k31, padding=(1, 0))) <= TOL


@pytest.mark.parametrize(
    "branch, match",
    [
        (ConvGeometry(4, 4, 1, 2, 0), "stride"),
        (ConvGeometry(4, 4, (1, 3), 1, (0, 2), (1, 2)), "dilation"),
        (ConvGeometry(4, 4, 1, 1, 1), "padding"),
        (ConvGeometry(4, 4, 2, 1, 0), "parity"),
        (ConvGeometry(4, 4, (1, 3), 1, (0, 1), padding_mode="reflect"), "padding_mode"),
        (ConvGeometry(4, 8, 1, 1, 0), "channels"),
        (ConvGeometry(4, 4, 1, 1, 0, groups=2), "groups"),
    ],
)
def test_alignment_mismatches_raise(branch: ConvGeometry, match: str) -> None:
    main = ConvGeometry(4, 4, 3, 1, 1)
    with pytest.raises(AlignmentError, match=match):
        T.check_alignment(main, branch)


def test_negative_branch_padding_is_refused() -> None:
    main = ConvGeometry(4, 4, 3, 1, 0)  # valid conv: a centred 1x1 would need padding -1
    with pytest.raises(AlignmentError):
        T.check_alignment(main, ConvGeometry(4, 4, 1, 1, 0))


# ------------------------------------------------------------------------------------------ identity


@pytest.mark.parametrize("dilation", [1, 2])
@pytest.mark.parametrize("k", [3, 5])
@pytest.mark.parametrize("groups", [1, 4, 8])
def test_identity_kernel_is_identity(groups: int, k: int, dilation: int, gen) -> None:
    geo = ConvGeometry(8, 8, k, 1, dilation * (k - 1) // 2, dilation, groups)
    T.check_identity(geo)
    x = _rand(2, 8, 9, 8, gen=gen)
    w = T.identity_kernel(8, k, groups, dtype=F64)
    y = F.conv2d(x, w, None, 1, geo.padding, dilation, groups)
    assert torch.equal(y, x)


@pytest.mark.parametrize(
    "geo, match",
    [
        (ConvGeometry(4, 8, 3, 1, 1), "in_channels == out_channels"),
        (ConvGeometry(4, 4, 3, 2, 1), "stride"),
        (ConvGeometry(4, 4, 3, 1, 0), "size-preserving"),
        (ConvGeometry(4, 4, 4, 1, 2), "odd"),
    ],
)
def test_identity_refusals(geo: ConvGeometry, match: str) -> None:
    with pytest.raises(AlignmentError, match=match):
        T.check_identity(geo)


# ------------------------------------------------------------------------------------------ K×K → K×K


@pytest.mark.parametrize("groups", [1, 2])
def test_kxk_kxk_valid_composition_is_exact(groups: int, gen) -> None:
    a, ba = _rand(6, 4 // groups, 3, 3, gen=gen), _rand(6, gen=gen)
    b, bb = _rand(4, 6 // groups, 3, 3, gen=gen), _rand(4, gen=gen)
    x = _rand(2, 4, 10, 9, gen=gen)
    xp = F.pad(x, (2, 2, 2, 2))
    direct = F.conv2d(F.conv2d(xp, a, ba, groups=groups), b, bb, stride=2, groups=groups)
    k, bias = T.merge_kxk_kxk_valid(a, ba, b, bb, groups)
    assert k.shape[-2:] == (5, 5)
    assert rel_err(F.conv2d(x, k, bias, stride=2, padding=2, groups=groups), direct) <= TOL


def test_kxk_kxk_with_same_padding_is_not_exact(gen) -> None:
    """OREPA#9: two 'same'-padded convs do not merge; the library refuses the padded chain."""
    a, b = _rand(4, 4, 3, 3, gen=gen), _rand(4, 4, 3, 3, gen=gen)
    x = _rand(2, 4, 9, 9, gen=gen)
    same_chain = F.conv2d(F.conv2d(x, a, padding=1), b, padding=1)
    k, bias = T.merge_kxk_kxk_valid(a, None, b, None)
    assert rel_err(F.conv2d(x, k, bias, padding=2), same_chain) > 1e-2
    with pytest.raises(NotMergeableError, match="merge_kxk_kxk_valid"):
        T.merge_1x1_kxk(a, None, b, None, 1)


# ------------------------------------------------------------------------------------------ value padding


def test_value_pad_copies_interior_and_is_differentiable(gen) -> None:
    x = _rand(2, 3, 4, 5, gen=gen).requires_grad_()
    v = _rand(3, gen=gen).requires_grad_()
    y = T.value_pad(x, (1, 2), v)
    assert y.shape == (2, 3, 6, 9)
    assert torch.equal(y[:, :, 1:5, 2:7], x)
    for i, j in itertools.product([0, 5], range(9)):
        assert torch.equal(y[:, :, i, j], v.expand(2, 3))
    assert torch.equal(y[:, :, 3, 0], v.expand(2, 3)) and torch.equal(y[:, :, 2, 8], v.expand(2, 3))
    assert torch.autograd.gradcheck(lambda a, b: T.value_pad(a, (1, 2), b), (x, v))
    assert torch.autograd.gradgradcheck(lambda a, b: T.value_pad(a, (1, 2), b), (x, v))  # Hessian methods
    assert T.value_pad(x, (0, 0), v) is x
