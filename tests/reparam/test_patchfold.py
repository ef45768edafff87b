"""Patch-moment training forward (reparam.patchfold).

Invariants: wherever the path runs, it computes what the per-branch modules compute (float64
outputs, input and parameter gradients, running statistics and batch counts to 1e-10; the same
parameters receive gradients); a zero-γ expansion stays bit-exact in training mode; it runs only on
blocks it understands (anything else takes the fused or per-branch forward).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from reparam import DiverseBranchBlock, patchfold
from reparam.fused import fused_training
from reparam.geometry import ConvGeometry
from reparam.testing import rel_err

from _util import bn_nodes, expanded_block as lenet_block, step_against_per_branch

F64 = torch.float64


def compare(blk, x, *, steps=2, input_grad=False):
    """Per-branch vs patch-moment forward over ``steps`` training steps: the worst relative error."""
    ref, new = copy.deepcopy(blk), copy.deepcopy(blk)
    worst = 0.0
    for _ in range(steps):
        assert patchfold.usable(new, x.clone().requires_grad_(input_grad))
        errs, _ = step_against_per_branch(ref, new, x, input_grad=input_grad, buffer_floor=1.0)
        worst = max(worst, *errs)
    return worst


def test_lenet_first_conv_equals_per_branch_and_keeps_only_the_anchor_bn():
    blk, x = lenet_block(torch.Generator().manual_seed(0))
    assert compare(blk, x) <= 1e-10
    out = blk(x)
    norms = sum(isinstance(m, torch.nn.BatchNorm2d) for m in blk.modules())
    assert norms == 8  # anchor, 1x1, two in 1x1_kxk, 1x1_avg's, 1xk, kx1, the block's own
    assert bn_nodes(out) == 1  # the anchor's BN; every other one is folded
    with fused_training(False):
        assert bn_nodes(blk(x)) == norms


@pytest.mark.parametrize("nest", [("kxk",), ("1x1_kxk",), ("kxk", "1x1_kxk")], ids=["anchor", "1x1_kxk", "both"])
def test_nested_blocks_equal_per_branch(nest):
    # a block nested in 1x1_kxk has no input windows (its input is the 1×1 stage's output), so it
    # grows the kinds that need none
    branches = ("1x1_kxk", "1x1_avg") if "1x1_kxk" in nest else ("1x1", "1x1_kxk", "1x1_avg", "1xk", "kx1")
    blk, x = lenet_block(torch.Generator().manual_seed(1), nest=nest, nested_branches=branches)
    assert compare(blk, x, steps=3) <= 1e-10


def test_cumulative_momentum_and_input_gradient():
    # 16 channels: with an input gradient the path pays only for 3·25 ≤ the folded norms' channels
    blk, x = lenet_block(torch.Generator().manual_seed(2), cout=16, momentum=None, nest=("kxk",))
    assert compare(blk, x, steps=3, input_grad=True) <= 1e-10


@pytest.mark.parametrize("geo", [dict(stride=2, cout=8), dict(dilation=2, cout=8, hw=(15, 13)), dict(k=3, cin=2, cout=8, hw=(9, 10))],
                         ids=["stride2", "dilated", "k3"])
def test_geometries(geo):
    blk, x = lenet_block(torch.Generator().manual_seed(3), branches=("1x1", "1x1_kxk", "1xk", "kx1"), **geo)
    assert compare(blk, x) <= 1e-10


def test_zero_padded_conv_kinds_with_padding():
    # zero padding is affine in the zero-padded patches: the centred conv kinds take the path
    blk, x = lenet_block(torch.Generator().manual_seed(4), branches=("1x1", "1xk", "kx1"), k=3, cin=2, cout=8,
                         padding=1, hw=(7, 9))
    assert compare(blk, x) <= 1e-10


def test_zero_gamma_expansion_stays_bit_exact_in_training_mode():
    gen = torch.Generator().manual_seed(5)
    conv, bn = nn.Conv2d(1, 6, 5, bias=False), nn.BatchNorm2d(6)
    x = torch.randn(16, 1, 12, 12, generator=gen)
    plain = nn.Sequential(copy.deepcopy(conv), copy.deepcopy(bn)).train()
    blk = DiverseBranchBlock.from_conv(conv, bn, branches=["1x1", "1x1_kxk", "1x1_avg", "1xk", "kx1"]).train()
    blk.grow_nested("kxk", ["1x1", "1x1_avg"])
    assert patchfold.usable(blk, x)
    assert torch.equal(blk(x), plain(x))
    assert torch.equal(blk.branches["kxk"].bn.running_var, plain[1].running_var)


def test_path_declines_what_it_does_not_understand():
    gen = torch.Generator().manual_seed(6)
    blk, x = lenet_block(gen)
    assert patchfold.usable(blk, x)
    with patchfold.patch_training(False):
        assert not patchfold.usable(blk, x)
    with fused_training(False):  # the per-branch forward for timing and reference
        assert not patchfold.usable(blk, x)
    assert not patchfold.usable(blk.eval(), x)
    blk.train()
    handle = blk.branches["1x1"].bn.register_forward_hook(lambda *a: None)
    assert not patchfold.usable(blk, x)  # hook-based tools see the branch modules
    handle.remove()
    # value padding (1x1_kxk, 1x1_avg with padding) is not affine in the zero-padded patches
    padded, xp = lenet_block(gen, k=3, cin=2, cout=8, padding=1, hw=(7, 7))
    assert not patchfold.usable(padded, xp)
    # wide patches: the Gram matrix would cost more than the branch convolutions it replaces
    wide, xw = lenet_block(gen, branches=("1x1",), cin=8, cout=4, k=3, hw=(7, 7))
    assert not patchfold.usable(wide, xw)
    grouped = DiverseBranchBlock.from_conv(nn.Conv2d(4, 4, 3, groups=2, bias=False), nn.BatchNorm2d(4),
                                           branches=["1x1"]).train()
    assert not patchfold.usable(grouped, torch.randn(2, 4, 6, 6))
    assert not patchfold.usable(blk, torch.empty(x.shape, dtype=x.dtype, device="meta"))  # CPU only


def test_block_forward_under_no_grad_updates_statistics_once():
    blk, x = lenet_block(torch.Generator().manual_seed(7))
    ref = copy.deepcopy(blk)
    with torch.no_grad():
        out = blk(x)
        with fused_training(False):
            expected = ref(x)
    assert rel_err(out, expected) <= 1e-12
    for (name, b), b_ref in zip(blk.named_buffers(), ref.buffers()):
        assert torch.allclose(b, b_ref, rtol=1e-12, atol=1e-14), name


@settings(max_examples=25, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["1x1", "1x1_kxk", "1x1_avg", "1xk", "kx1"]), min_size=1, max_size=5, unique=True),
    nest=st.sampled_from([(), ("kxk",), ("1x1_kxk",)]),
    stride=st.sampled_from([1, 2]),
    cin=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_property_any_branch_set_equals_per_branch(kinds, nest, stride, cin, seed):
    nest = tuple(n for n in nest if n == "kxk" or n in kinds)
    # 18 output channels: any one branch has as many batch-statistics channels as the patches have
    # entries (2·3·3), so the path always pays and runs
    blk, x = lenet_block(torch.Generator().manual_seed(seed), branches=kinds, cin=cin, cout=18, k=3, stride=stride,
                         hw=(8, 9), nest=nest,
                         nested_branches=("1x1_kxk", "1x1_avg") if nest == ("1x1_kxk",) else ("1x1", "1x1_avg"))
    assert compare(blk, x, steps=1) <= 1e-10


@pytest.mark.parametrize("seed", range(4))
def test_float32_as_close_to_the_float64_function_as_the_per_branch_forward(seed):
    # float32, the dtype training runs in, against the float64 per-branch truth: outputs within a
    # few ulps of their scale; gradients relative to the largest one (a conv bias before a
    # batch-statistics BN has a zero gradient in exact arithmetic, rounding noise in either
    # forward). The per-branch float32 forward itself errs by up to 6e-5 on such blocks.
    blk, x = lenet_block(torch.Generator().manual_seed(seed), nest=("kxk",))
    x = x * 3.0
    truth = copy.deepcopy(blk)
    with fused_training(False):
        expected = truth(x)
    g = torch.randn(expected.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    expected.backward(g)
    new = copy.deepcopy(blk).float()
    assert patchfold.usable(new, x.float())
    out = new(x.float())
    out.backward(g.float())
    assert float((out.double() - expected).detach().abs().max()) <= 1e-5 * float(expected.detach().abs().max())
    scale = max(float(p.grad.abs().max()) for p in truth.parameters() if p.grad is not None)
    for (name, p), p_ref in zip(new.named_parameters(), truth.parameters()):
        assert (p.grad is None) == (p_ref.grad is None), name
        if p_ref.grad is not None:
            assert float((p.grad.double() - p_ref.grad).abs().max()) <= 3e-5 * scale, name
    for (name, b), b_ref in zip(new.named_buffers(), truth.buffers()):
        if b.is_floating_point():
            assert float((b.double() - b_ref).abs().max()) <= 1e-5 * max(float(b_ref.abs().max()), 1.0), name


def test_batched_folds_with_mixed_norms_equal_per_branch():
    # BNs folded in one batch may differ in eps and affinity; a norm in eval mode (fixed statistics)
    # inside a training block folds by its running statistics
    blk, x = lenet_block(torch.Generator().manual_seed(10), cout=8, nest=("kxk",))
    blk.branches["1x1"].bn.eps = 1e-3
    blk.branches["1xk"].bn = nn.BatchNorm2d(8, affine=False).to(F64)
    blk.branches["kx1"].bn.eval()
    nested = blk.branches["kxk"].conv
    nested.branches["1x1"].bn.eps = 3e-4
    assert patchfold.usable(blk, x)
    assert compare(blk, x, steps=2) <= 1e-10


@settings(max_examples=40, deadline=None)
@given(
    cin=st.integers(1, 3),
    k=st.sampled_from([1, 2, 3, 5]),
    stride=st.integers(1, 2),
    padding=st.integers(0, 1),
    seed=st.integers(0, 2**16),
)
def test_patch_moments_leave_the_input_as_it_was(cin, k, stride, padding, seed):
    """The patches are centred in place only where the unfold copied them: a 1×1 kernel's patches
    are a view of the input, which stays as it was; mean and covariance are the patches' own (bit
    for bit those of the out-of-place centring)."""
    g = ConvGeometry(cin, 4, (k, k), (stride, stride), (padding, padding))
    x = torch.randn(3, cin, 7, 6, generator=torch.Generator().manual_seed(seed), dtype=F64)
    before = x.clone()
    pm = patchfold._Patches(x, g)
    assert torch.equal(x, before)
    cols = torch.nn.functional.unfold(before, (k, k), padding=padding, stride=stride)  # (N, D, L)
    mean = cols.sum(dim=(0, 2)) / pm.m
    centred = cols - mean.view(1, -1, 1)
    cov = torch.bmm(centred, centred.transpose(1, 2)).sum(0) / pm.m
    assert pm.m == cols.shape[0] * cols.shape[2]
    assert torch.equal(pm.mean, mean)
    assert rel_err(pm.cov, cov) <= 1e-14
    assert torch.allclose(pm.cov, pm.cov.T, rtol=0, atol=1e-14 * float(pm.cov.abs().max()))
