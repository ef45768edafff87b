"""Input-window branches: ``1x1``, ``1xk``, ``kx1`` and ``identity`` on convs whose padding cannot
centre them (unpadded, under-padded per axis, over-padded), exact in float64.

* The math: a ``k``-tap kernel at offset ``j0`` of the main kernel equals a conv on the input window
  :func:`reparam.transforms.branch_window` gives (any stride, padding, dilation).
* Every applicable kind on every geometry below: zero-γ expansion bit-exact in train and eval mode;
  in train mode the branch's pre-BN output equals the main-geometry conv with its embedded kernel,
  so its BatchNorm sees (and its running statistics record) what the merged conv would produce;
  the fused training forward equals the per-branch one; after training steps the eval merge is
  exact (rel_err ≤ 1e-10).
* A whole LeNet-5 (valid 5×5 convs) expanded with every applicable kind merges back exactly.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhetero import models
import reparam
from reparam import ConvBNBranch, DiverseBranchBlock, IdentityBasedConv1x1, IdentityBranch
from reparam.kinds import applicability
from reparam.dymm import applicable_kinds
from reparam.errors import AlignmentError
from reparam.fused import fused_training
from reparam.geometry import ConvGeometry
from reparam.testing import randomize_bn_, rel_err
from reparam.transforms import branch_window, embed_kernel, identity_kernel, window_input

F64 = torch.float64
TOL = 1e-10

# (id, cin, cout, kernel, stride, padding, dilation, groups, padding_mode, input hw)
GEOMS = [
    ("valid3", 6, 6, 3, 1, 0, 1, 1, "zeros", (9, 10)),
    ("valid3_s2", 6, 8, 3, 2, 0, 1, 1, "zeros", (10, 9)),
    ("valid5", 6, 6, 5, 1, 0, 1, 1, "zeros", (11, 12)),
    ("valid5_s2", 6, 6, 5, 2, 0, 1, 1, "zeros", (12, 11)),
    ("valid5_rgb", 3, 6, 5, 1, 0, 1, 1, "zeros", (12, 12)),
    ("asym5_0_2", 6, 6, 5, 1, (0, 2), 1, 1, "zeros", (11, 10)),
    ("asym5_1_2_s2", 6, 6, 5, 2, (1, 2), 1, 1, "zeros", (12, 11)),
    ("asym3x5_0_1", 6, 6, (3, 5), (1, 2), (0, 1), 1, 1, "zeros", (10, 12)),
    ("under5_p1", 6, 6, 5, 1, 1, 1, 1, "zeros", (10, 10)),
    ("over3_p2", 6, 6, 3, 1, 2, 1, 1, "zeros", (8, 9)),
    ("dilated_valid", 6, 6, 3, 1, 0, 2, 1, "zeros", (11, 11)),
    ("depthwise_valid", 6, 6, 3, 1, 0, 1, 6, "zeros", (9, 9)),
    ("grouped_valid_s2", 6, 6, 5, 2, 0, 1, 2, "zeros", (12, 12)),
    ("reflect_under5_p1", 6, 6, 5, 1, 1, 1, 1, "reflect", (10, 11)),
    ("reflect_over3_p2", 6, 6, 3, 1, 2, 1, 1, "reflect", (9, 9)),
]
IDS = [g[0] for g in GEOMS]
WINDOW_KINDS = ("1x1", "1xk", "kx1", "identity")


def _case(case, gen, *, bias=False, with_bn=True):
    _, cin, cout, k, s, p, d, g, mode, hw = case
    conv = nn.Conv2d(cin, cout, k, s, p, d, g, bias=bias, padding_mode=mode).to(F64)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen, dtype=F64) * 0.3)
        if bias:
            conv.bias.copy_(torch.randn(cout, generator=gen, dtype=F64))
    bn = None
    if with_bn:
        bn = nn.BatchNorm2d(cout).to(F64)
        randomize_bn_(bn, gen)
    x = torch.randn(3, cin, *hw, generator=gen, dtype=F64)
    return conv, bn, x


def _perturb(block: nn.Module, gen: torch.Generator) -> None:
    randomize_bn_(block, gen)
    with torch.no_grad():
        for m in block.modules():
            if isinstance(m, IdentityBasedConv1x1):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen, dtype=F64) * 0.2)


# ------------------------------------------------------------------------------------------ the math


@pytest.mark.parametrize("big_k, stride, pads, dil", [
    ((5, 5), (1, 1), (0, 0), (1, 1)),
    ((5, 3), (2, 1), (1, 0), (1, 1)),
    ((3, 5), (1, 2), (0, 2), (2, 1)),
    ((4, 5), (2, 2), (0, 3), (1, 1)),
    ((3, 3), (1, 1), (2, 2), (1, 2)),
])
def test_window_equals_embedded_kernel_for_every_offset(big_k, stride, pads, dil, gen) -> None:
    main = ConvGeometry(4, 5, big_k, stride, pads, dil)
    x = torch.randn(2, 4, 13, 12, generator=gen, dtype=F64)
    for kh, kw in itertools.product(range(1, big_k[0] + 1), range(1, big_k[1] + 1)):
        for oh, ow in itertools.product(range(big_k[0] - kh + 1), range(big_k[1] - kw + 1)):
            w = torch.randn(5, 4, kh, kw, generator=gen, dtype=F64)
            window = branch_window(main, (kh, kw), (oh, ow))
            bd = (dil[0] if kh > 1 else 1, dil[1] if kw > 1 else 1)
            got = F.conv2d(window_input(x, window), w, None, stride, 0, bd)
            want = F.conv2d(x, embed_kernel(w, big_k, (oh, ow)), None, stride, pads, dil)
            assert got.shape == want.shape
            assert rel_err(got, want) <= TOL, (kh, kw, oh, ow)
    with pytest.raises(AlignmentError):
        branch_window(main, (2, 2), (big_k[0] - 1, 0))


def test_window_input_pads_with_the_mode_then_crops(gen) -> None:
    x = torch.randn(1, 2, 6, 7, generator=gen, dtype=F64)
    assert torch.equal(window_input(x, ((-1, -2), (0, -1))), x[..., 1:-2, :-1])
    padded = window_input(x, ((1, -1), (2, 0)), "reflect")
    assert torch.equal(padded, F.pad(x, (2, 0, 1, 0), mode="reflect")[..., :-1, :])


def test_unpadded_convs_now_admit_window_kinds_and_crop_false_restores_the_classic_rule() -> None:
    lenet_conv = ConvGeometry(6, 16, 5)  # LeNet-5's conv2: valid 5x5
    now = [k for k, r in applicability(lenet_conv).items() if r is None]
    assert now == ["kxk", "1x1", "1x1_kxk", "1x1_avg", "1xk", "kx1"]
    classic = [k for k, r in applicability(lenet_conv, crop=False).items() if r is None]
    assert classic == ["kxk", "1x1_kxk", "1x1_avg"]
    assert applicability(ConvGeometry(6, 6, 3))["identity"] is None
    assert "stride" in applicability(ConvGeometry(6, 6, 3, 2))["identity"]
    assert "parity" in applicability(ConvGeometry(6, 6, 4, 2, 0))["1x1"]  # no centre tap
    block = DiverseBranchBlock.from_conv(nn.Conv2d(6, 16, 5), None, "all", crop=False)
    assert block.branch_names == classic and block.spec()["crop"] is False
    with pytest.raises(AlignmentError, match="crop"):
        block.add_branch("1x1")


# ------------------------------------------------------------------------------------------ every kind


@pytest.mark.parametrize("case", GEOMS, ids=IDS)
def test_every_kind_is_exact_in_train_and_eval_mode(case, gen) -> None:
    conv, bn, x = _case(case, gen)
    geo = ConvGeometry.from_conv(conv)
    kinds = [k for k, r in applicability(geo).items() if r is None and k != "kxk"]
    windowed = [k for k in kinds if k in WINDOW_KINDS and k not in applicable_classic(geo)]
    assert windowed, "every geometry here needs an input window for some kind"
    for kind in kinds + ["all"]:
        request = "all" if kind == "all" else ["kxk", kind]
        ref = nn.Sequential(copy.deepcopy(conv), copy.deepcopy(bn))
        block = DiverseBranchBlock.from_conv(copy.deepcopy(conv), copy.deepcopy(bn), request)
        for train in (True, False):  # zero-γ expansion: bit-exact, running statistics included
            r, b = copy.deepcopy(ref).train(train), copy.deepcopy(block).train(train)
            for _ in range(2):
                assert torch.equal(r(x), b(x)), (kind, train)
            assert torch.equal(r[1].running_var, b.branches["kxk"].bn.running_var)
        _perturb(block, gen)
        # train mode: a window branch's BN normalises exactly the main-geometry conv of its kernel
        for name in block.branch_names:
            br = block.branches[name]
            if name != "kxk" and isinstance(br, (ConvBNBranch, IdentityBranch)):
                _assert_branch_matches_embedding_in_train_mode(br, geo, x)
        # training steps move the running statistics; then the eval merge is exact
        block.train()
        with torch.no_grad():
            for _ in range(2):
                block(x)
        block.eval()
        with torch.no_grad():
            y = block(x)
            merged = block.merge()
            out = merged(x)
        assert out.shape == y.shape == ref.eval()(x).shape
        assert rel_err(out, y) <= TOL, kind


def applicable_classic(geo: ConvGeometry) -> list[str]:
    return [k for k, r in applicability(geo, crop=False).items() if r is None]


def _assert_branch_matches_embedding_in_train_mode(branch: nn.Module, geo: ConvGeometry, x: torch.Tensor) -> None:
    if isinstance(branch, ConvBNBranch):
        kernel = embed_kernel(branch.conv.weight.detach(), geo.kernel_size, branch.offset)
    else:
        kernel = identity_kernel(geo.in_channels, geo.kernel_size, geo.groups, dtype=F64)
    ref_conv = geo.make_conv(bias=False, dtype=F64)
    with torch.no_grad():
        ref_conv.weight.copy_(kernel)
    ref = nn.Sequential(ref_conv, copy.deepcopy(branch.bn)).train()
    mine = copy.deepcopy(branch).train()
    with torch.no_grad():
        pre = x if branch.window is None else window_input(x, branch.window, branch.padding_mode)
        if isinstance(branch, ConvBNBranch):
            pre = branch.conv(pre)
        assert rel_err(pre, ref_conv(x)) <= TOL
        assert rel_err(mine(x), ref(x)) <= TOL
        assert rel_err(mine.bn.running_mean, ref[1].running_mean) <= TOL
        assert rel_err(mine.bn.running_var, ref[1].running_var) <= TOL


@pytest.mark.parametrize("case", [GEOMS[i] for i in (0, 3, 6, 8, 11, 13)], ids=[IDS[i] for i in (0, 3, 6, 8, 11, 13)])
def test_fused_training_forward_equals_per_branch_with_windows(case, gen, monkeypatch) -> None:
    monkeypatch.setattr(reparam.fused, "FUSED_MIN_OUTPUT_ELEMENTS", 0)
    conv, bn, x = _case(case, gen)
    block = DiverseBranchBlock.from_conv(conv, bn, "all")
    _perturb(block, gen)
    a, b = copy.deepcopy(block).train(), copy.deepcopy(block).train()
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    with fused_training(True):
        ya = a(xa)
    with fused_training(False):
        yb = b(xb)
    assert rel_err(ya, yb) <= TOL
    g = torch.randn(ya.shape, generator=gen, dtype=F64)
    ya.backward(g)
    yb.backward(g)
    assert rel_err(xa.grad, xb.grad) <= TOL
    for (na, ma), (_, mb) in zip(a.named_modules(), b.named_modules()):
        if isinstance(ma, nn.BatchNorm2d):
            assert rel_err(ma.running_mean, mb.running_mean) <= TOL, na
            assert rel_err(ma.running_var, mb.running_var) <= TOL, na


def test_conv_mode_window_branches_merge_exactly(gen) -> None:
    conv, _, x = _case(GEOMS[2], gen, bias=True, with_bn=False)
    block = DiverseBranchBlock.from_conv(conv, None, "all")
    assert {"1x1", "1xk", "kx1", "identity"} <= set(block.branch_names)
    _perturb(block, gen)
    block.eval()
    with torch.no_grad():
        y = block(x)
        assert rel_err(block.merge()(x), y) <= TOL
        block.remove_branch("identity")  # fold: eval-exact
        assert rel_err(block(x), y) <= TOL
        w_t = torch.randn(conv.weight.shape, generator=gen, dtype=F64) * 0.3
        b_t = torch.randn(conv.out_channels, generator=gen, dtype=F64)
        block.load_plain(w_t, b_t)  # REP: re-solve the anchor so the block equals conv(w_t, b_t)
        assert rel_err(block(x), F.conv2d(x, w_t, b_t)) <= TOL
        assert {"1x1", "1xk", "kx1"} <= set(block.branch_names)  # the other branches are kept


# ------------------------------------------------------------------------------------------ LeNet-5


@pytest.mark.parametrize("norm", ["bn", "none"])
def test_lenet5_expand_with_every_applicable_kind_then_merge(norm, gen) -> None:
    torch.manual_seed(0)
    lenet = models.build_model("lenet5", norm=norm).to(F64)
    x = torch.randn(4, 3, 32, 32, generator=gen, dtype=F64)
    if norm == "bn":
        randomize_bn_(lenet, gen)
    big = reparam.expand(lenet, plan=lambda path, conv, bn: applicable_kinds(ConvGeometry.from_conv(conv)))
    blocks = dict(reparam.iter_blocks(big))
    assert len(blocks) == 2
    for blk in blocks.values():  # valid 5x5 convs with C != O: every kind but identity
        assert blk.branch_names == ["kxk", "1x1", "1x1_kxk", "1x1_avg", "1xk", "kx1"]
    for train in (True, False):
        assert torch.equal(copy.deepcopy(lenet).train(train)(x), copy.deepcopy(big).train(train)(x))
    _perturb(big, gen)
    big.train()
    with torch.no_grad():
        big(x)  # one training step's statistics
    big.eval()
    with torch.no_grad():
        y = big(x)
        deploy = reparam.merge(big)
        assert not any(isinstance(m, nn.BatchNorm2d) for m in deploy.modules())
        assert rel_err(deploy(x), y) <= TOL
        host = reparam.merge(big, target="host")
        fresh = models.build_model("lenet5", norm=norm).to(F64)
        fresh.load_state_dict(host.state_dict(), strict=True)
        assert rel_err(fresh.eval()(x), y) <= TOL
        sd = reparam.merge_state_dict(big.state_dict(), reparam.structure(big))
        deploy.load_state_dict(sd, strict=True)
        assert rel_err(deploy(x), y) <= TOL


def test_window_branches_trace_with_fx(gen) -> None:
    conv, bn, x = _case(GEOMS[2], gen)
    block = DiverseBranchBlock.from_conv(conv, bn, "all")
    _perturb(block, gen)
    block.eval()
    traced = torch.fx.symbolic_trace(block)
    with torch.no_grad():
        assert torch.equal(traced(x), block(x))
