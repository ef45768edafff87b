"""Fused training forward (reparam.fused), chunked / consuming merge.

The fused forward must compute what the per-branch modules compute: float64 outputs, input and
parameter gradients and running statistics agree to 1e-10 (gradients relative to the largest
gradient of the block, since some true gradients are exactly zero and only rounding remains).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import reparam
from reparam import DiverseBranchBlock, KINDS
from reparam.fused import FOLD_MIN_POSITIONS_PER_CHANNEL, channel_moments, fused_training
from reparam.testing import randomize_bn_, rel_err

from _util import bn_nodes, step_against_per_branch

F64 = torch.float64


@pytest.fixture(autouse=True)
def _fuse_small_blocks(monkeypatch):
    """The matrix below uses small inputs; let the fused forward run on them, folding BatchNorms
    from 8 positions per input channel (the default threshold is a speed choice, tested below), and
    its unfolded branch BatchNorms in reparam.kernels' forms (tested in test_kernels)."""
    monkeypatch.setattr(reparam.fused, "FUSED_MIN_OUTPUT_ELEMENTS", 0)
    monkeypatch.setattr(reparam.fused, "FOLD_MIN_POSITIONS_PER_CHANNEL", 8)
    # and the branch BatchNorms take reparam.kernels' own forms wherever their maps allow
    monkeypatch.setattr(reparam.kernels, "BN_STATS_MIN_ELEMENTS", 0)
    monkeypatch.setattr(reparam.kernels, "BN_STATS_MIN_CHANNELS", 0)
    monkeypatch.setattr(reparam.kernels, "BN_FLAT_MIN_CHANNELS", 0)

# (id, cin, cout, kernel, stride, padding, dilation, groups, input hw)
CASES = [
    ("dense", 8, 8, 3, 1, 1, 1, 1, (9, 9)),
    ("dense_even_hw", 8, 8, 3, 1, 1, 1, 1, (8, 8)),
    ("s2_up", 8, 16, 3, 2, 1, 1, 1, (9, 9)),
    ("rgb_in", 3, 16, 3, 1, 1, 1, 1, (8, 9)),
    ("grouped", 8, 8, 3, 1, 1, 1, 2, (9, 8)),
    ("grouped_s2", 8, 8, 3, 2, 1, 1, 4, (8, 8)),
    ("depthwise", 8, 8, 3, 1, 1, 1, 8, (9, 9)),
    ("multiplier", 8, 16, 3, 1, 1, 1, 8, (9, 9)),
    ("k5", 6, 6, 5, 1, 2, 1, 1, (9, 9)),
    ("dilated", 6, 6, 3, 1, 2, 2, 1, (9, 8)),
    ("rect_1x3", 8, 8, (1, 3), 1, (0, 1), 1, 1, (8, 8)),
    ("even_k4", 8, 8, 4, 1, 2, 1, 1, (8, 9)),
    ("valid", 8, 8, 3, 1, 0, 1, 1, (9, 9)),
]
IDS = [c[0] for c in CASES]


def make_block(case, gen, *, branches=None, momentum=0.1, bias=False, with_bn=True, **kw):
    _, cin, cout, k, s, p, d, g, hw = case
    conv = nn.Conv2d(cin, cout, k, s, p, d, g, bias=bias or not with_bn)
    bn = nn.BatchNorm2d(cout, momentum=momentum) if with_bn else None
    opts = {} if branches is None else {"branches": branches}
    blk = DiverseBranchBlock.from_conv(conv, bn, **opts, **kw).to(F64)
    randomize_bn_(blk, gen)
    with torch.no_grad():
        for m in blk.modules():
            if isinstance(m, nn.BatchNorm2d) and m.momentum is not None:
                m.momentum = momentum
        for prm in blk.parameters():
            prm.add_(torch.randn(prm.shape, generator=gen, dtype=F64) * 0.2)
    x = torch.randn(4, cin, *hw, generator=gen, dtype=F64) + 0.3
    return blk.train(), x


def compare(blk, x, steps=2, fused_on=True):
    """Per-branch vs fused: worst errors over ``steps`` training steps; returns (worst, bn counts)."""
    ref, fus = copy.deepcopy(blk), copy.deepcopy(blk)
    worst, counts = 0.0, None
    for _ in range(steps):
        errs, (o_ref, o_fus) = step_against_per_branch(ref, fus, x, new_context=lambda: fused_training(fused_on))
        counts = (bn_nodes(o_ref), bn_nodes(o_fus))
        worst = max(worst, *errs)
    return worst, counts


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fused_equals_per_branch_float64(case):
    gen = torch.Generator().manual_seed(1)
    blk, x = make_block(case, gen)
    worst, (n_ref, n_fus) = compare(blk, x)
    assert worst <= 1e-10
    assert n_fus < n_ref  # some BatchNorm passes were folded away


def test_fused_default_block_folds_four_of_seven_batchnorms():
    blk, x = make_block(CASES[0], torch.Generator().manual_seed(2))
    assert blk.branch_names == ["kxk", "1x1", "1x1_kxk", "1x1_avg", "identity"]
    worst, counts = compare(blk, x, steps=1)
    assert counts == (7, 3)  # left: the anchor BN and the two BNs after the K×K conv / the pool
    assert worst <= 1e-10


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]], ids=["dense", "s2_up", "grouped"])
def test_fused_all_seven_branches_and_cumulative_momentum(case):
    gen = torch.Generator().manual_seed(3)
    kinds = [k for k in KINDS if case[4] == 1 or k != "identity"]
    if case[1] != case[2]:
        kinds = [k for k in kinds if k != "identity"]
    blk, x = make_block(case, gen, branches=kinds, momentum=None)
    worst, _ = compare(blk, x, steps=3)
    assert worst <= 1e-10


@pytest.mark.parametrize("anchor_norm", ["frozen_identity", "batchnorm"])
def test_fused_conv_mode_anchors(anchor_norm):
    blk, x = make_block(CASES[0], torch.Generator().manual_seed(4), with_bn=False, anchor_norm=anchor_norm)
    worst, _ = compare(blk, x)
    assert worst <= 1e-10


def test_fused_nested_blocks_fall_back_inside():
    gen = torch.Generator().manual_seed(5)
    blk, x = make_block(CASES[0], gen)
    blk.grow_nested("1x1_kxk")
    randomize_bn_(blk, gen)
    worst, _ = compare(blk, x)
    assert worst <= 1e-10


def test_fused_float32_relative_to_output_scale():
    gen = torch.Generator().manual_seed(6)
    blk, x = make_block(CASES[0], gen)
    blk32, x32 = copy.deepcopy(blk).float(), x.float()
    with fused_training(False), torch.no_grad():
        truth = copy.deepcopy(blk)(x)
    with torch.no_grad():
        out = blk32(x32)
    assert float((out.double() - truth).abs().max() / truth.abs().max()) <= 1e-5


def test_fused_not_used_with_hooks_eval_or_when_disabled():
    gen = torch.Generator().manual_seed(7)
    blk, x = make_block(CASES[0], gen)
    assert bn_nodes(copy.deepcopy(blk)(x.clone().requires_grad_())) == 3
    hooked = copy.deepcopy(blk)
    calls = []
    hooked.branches["1x1"].conv.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    assert bn_nodes(hooked(x.clone().requires_grad_())) == 7  # hook-based tools see every module
    assert calls == [torch.Size([4, 8, 9, 9])]
    with fused_training(False):
        assert bn_nodes(copy.deepcopy(blk)(x.clone().requires_grad_())) == 7
    assert reparam.fused.fused_training_enabled()
    ev = copy.deepcopy(blk).eval()
    out = ev(x.clone().requires_grad_())
    assert bn_nodes(out) == 7  # eval mode runs the per-branch modules unchanged
    with fused_training(False):
        assert torch.equal(copy.deepcopy(blk).eval()(x), ev(x))


@pytest.mark.parametrize("positions, folded", [(127, False), (128, True)])
def test_batchnorms_folded_from_the_default_positions_per_channel(positions, folded, monkeypatch):
    """With the default threshold, a block folds its BatchNorms from 128 positions (N·H·W) per input
    channel and keeps their passes below; both forwards agree to rounding."""
    monkeypatch.setattr(reparam.fused, "FOLD_MIN_POSITIONS_PER_CHANNEL", FOLD_MIN_POSITIONS_PER_CHANNEL)
    assert FOLD_MIN_POSITIONS_PER_CHANNEL == 128
    gen = torch.Generator().manual_seed(9)
    blk, _ = make_block(("dense", 2, 4, 3, 1, 1, 1, 1, (8, 8)), gen)
    x = torch.randn(positions, 2, 2, 1, generator=gen, dtype=F64)  # N·H·W = positions × C (C = 2)
    worst, counts = compare(blk, x)
    assert counts == (6, 3 if folded else 6)  # 2 → 4 channels: no identity branch
    assert worst <= 1e-10


def test_fused_small_maps_many_channels_keep_batchnorm_passes():
    gen = torch.Generator().manual_seed(8)
    case = ("wide", 32, 32, 3, 1, 1, 1, 1, (2, 2))
    blk, x = make_block(case, gen)
    assert 4 * 2 * 2 < reparam.fused.FOLD_MIN_POSITIONS_PER_CHANNEL * 32
    worst, counts = compare(blk, x)
    assert counts[0] == counts[1] == 7
    assert worst <= 1e-10


def test_fused_zero_gamma_expansion_stays_bit_exact_in_training():
    gen = torch.Generator().manual_seed(9)
    conv, bn = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
    randomize_bn_(bn, gen)
    ref = nn.Sequential(copy.deepcopy(conv), copy.deepcopy(bn)).train()
    blk = DiverseBranchBlock.from_conv(conv, bn).train()
    x = torch.randn(4, 8, 9, 9, generator=gen)
    for _ in range(2):
        assert torch.equal(ref(x), blk(x))
    assert bn_nodes(blk(x.requires_grad_())) == 3


@pytest.mark.parametrize("shape", [(3, 4, 5, 6), (2, 12, 2, 3)], ids=["wide_maps", "many_channels"])
def test_channel_moments_values_and_gradients(shape):
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(*shape, generator=gen, dtype=F64) + 1.0
    mean, cov = channel_moments(x)
    flat = x.transpose(0, 1).reshape(shape[1], -1)
    assert rel_err(mean, flat.mean(1)) <= 1e-12
    assert rel_err(cov, torch.cov(flat, correction=0)) <= 1e-10
    xg = x.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: channel_moments(t), (xg,))
    assert torch.autograd.gradgradcheck(lambda t: channel_moments(t), (xg,))


# ------------------------------------------------------------------------------ chunked merge


@pytest.mark.parametrize(
    "cin,cout,groups,chunk",
    [(16, 16, 1, 300), (16, 16, 1, 10**6), (16, 32, 4, 150), (16, 32, 4, 40), (16, 16, 16, 20)],
    ids=["dense_chunks", "dense_whole", "grouped_whole_groups", "grouped_inside_groups", "depthwise"],
)
def test_chunked_merge_matches_the_differentiable_pair(cin, cout, groups, chunk, monkeypatch):
    gen = torch.Generator().manual_seed(11)
    conv = nn.Conv2d(cin, cout, 3, padding=1, groups=groups, bias=True)
    blk = DiverseBranchBlock.from_conv(conv, nn.BatchNorm2d(cout)).to(F64)
    randomize_bn_(blk, gen)
    with torch.no_grad():
        for m in blk.modules():
            if isinstance(m, reparam.IdentityBasedConv1x1):
                m.weight.normal_(0, 0.2, generator=gen)
    blk.eval()
    monkeypatch.setattr(DiverseBranchBlock, "MERGE_CHUNK_ELEMENTS", chunk)
    merged = blk.merge()
    k, b = blk.get_equivalent_kernel_bias()
    assert rel_err(merged.weight, k) <= 1e-12 and rel_err(merged.bias, b) <= 1e-12
    x = torch.randn(2, cin, 7, 7, generator=gen, dtype=F64)
    assert rel_err(merged(x), blk(x)) <= 1e-10
    # float32 parameters merged in float64 arithmetic go chunk by chunk of output rows (each row
    # written once, rounded once): every row equals the float64 pair of the float32 block
    blk32 = copy.deepcopy(blk).float()
    k64, b64 = copy.deepcopy(blk32).double().get_equivalent_kernel_bias()
    merged32 = blk32.merge(compute_dtype=F64)
    assert merged32.weight.dtype == torch.float32
    assert rel_err(merged32.weight.double(), k64) <= 1e-7 and rel_err(merged32.bias.double(), b64) <= 1e-7
    monkeypatch.setattr(DiverseBranchBlock, "MERGE_CHUNK_ELEMENTS", 1 << 30)  # one chunk
    whole = blk32.merge(compute_dtype=F64)
    assert rel_err(merged32.weight, whole.weight) <= 1e-7 and rel_err(merged32.bias, whole.bias) <= 1e-7


def test_consuming_merge_reuses_the_anchor_kernel_and_plain_merge_does_not():
    gen = torch.Generator().manual_seed(12)
    blk = DiverseBranchBlock.from_conv(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)).to(F64)
    randomize_bn_(blk, gen)
    blk.eval()
    x = torch.randn(2, 8, 7, 7, generator=gen, dtype=F64)
    before = blk(x)
    anchor = blk.branches["kxk"].conv.weight
    kept = blk.merge()
    assert kept.weight.data_ptr() != anchor.data_ptr()
    assert torch.equal(blk(x), before)  # merge() leaves the block alone
    consumed = copy.deepcopy(blk)
    ptr = consumed.branches["kxk"].conv.weight.data_ptr()
    conv = consumed.merge(consume=True)
    assert conv.weight.data_ptr() == ptr
    assert torch.equal(conv.weight, kept.weight) and torch.equal(conv.bias, kept.bias)
    deployed = copy.deepcopy(blk)
    ptr = deployed.branches["kxk"].conv.weight.data_ptr()
    deployed.switch_to_deploy()
    assert deployed.reparam_conv.weight.data_ptr() == ptr
    assert rel_err(deployed(x), before) <= 1e-10


def test_model_merge_inplace_consumes_and_copy_keeps_the_original():
    gen = torch.Generator().manual_seed(13)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))
    big = reparam.expand(net).double()
    randomize_bn_(big, gen)
    big.eval()
    x = torch.randn(2, 3, 8, 8, generator=gen, dtype=F64)
    ref = big(x)
    merged = reparam.merge(big)
    assert torch.equal(big(x), ref)
    inplace = reparam.merge(copy.deepcopy(big), inplace=True)
    assert rel_err(inplace(x), ref) <= 1e-10 and rel_err(merged(x), ref) <= 1e-10


def test_uninitialised_convs_from_meta_templates_are_independent_modules():
    from reparam.geometry import ConvGeometry

    geo = ConvGeometry.from_conv(nn.Conv2d(4, 6, 3, padding=1, bias=False))
    a = geo.make_conv(bias=True, initialize=False, dtype=F64)
    b = geo.make_conv(bias=True, initialize=False, dtype=F64)
    assert type(a) is nn.Conv2d and a.weight.dtype == F64 and a.weight.device.type == "cpu"
    assert a.weight.data_ptr() != b.weight.data_ptr()
    a.extra = nn.Parameter(torch.zeros(1, dtype=F64))
    assert "extra" not in dict(b.named_parameters())
    del a.extra
    calls = []
    a.register_forward_hook(lambda *args: calls.append(args))
    b(torch.zeros(1, 4, 5, 5, dtype=F64))
    assert not calls
    assert set(a.state_dict()) == {"weight", "bias"} and a.padding == (1, 1)
    storage = torch.zeros(6, 4, 3, 3, dtype=F64)
    c = geo.make_conv(bias=True, initialize=False, dtype=F64, weight=storage)
    assert c.weight.data_ptr() == storage.data_ptr()
    with torch.no_grad():
        c.bias.zero_()
    assert torch.equal(c(torch.randn(1, 4, 5, 5, dtype=F64)), torch.zeros(1, 6, 5, 5, dtype=F64))
    with pytest.raises(reparam.ReparamError, match="weight has shape"):
        geo.make_conv(initialize=False, weight=torch.zeros(2, 2, 1, 1))


def test_fused_forward_is_skipped_for_small_activations(monkeypatch):
    blk, x = make_block(CASES[0], torch.Generator().manual_seed(14))
    assert bn_nodes(copy.deepcopy(blk)(x.clone().requires_grad_())) == 3
    out_elements = x.shape[0] * 8 * 9 * 9
    monkeypatch.setattr(reparam.fused, "FUSED_MIN_OUTPUT_ELEMENTS", out_elements + 1)
    assert bn_nodes(copy.deepcopy(blk)(x.clone().requires_grad_())) == 7
    monkeypatch.setattr(reparam.fused, "FUSED_MIN_OUTPUT_ELEMENTS", out_elements)
    assert bn_nodes(copy.deepcopy(blk)(x.clone().requires_grad_())) == 3


def test_fused_forward_runs_wide_convs_on_small_maps(monkeypatch):
    """Below the element threshold a block still takes the fused path when its host conv's
    multiply-adds per call reach FUSED_MIN_MACS (wide convs on small maps)."""
    blk, x = make_block(CASES[0], torch.Generator().manual_seed(14))
    g = blk.geometry
    out_elements = x.shape[0] * 8 * 9 * 9
    macs = out_elements * (g.in_channels // g.groups) * g.kernel_size[0] * g.kernel_size[1]
    monkeypatch.setattr(reparam.fused, "FUSED_MIN_OUTPUT_ELEMENTS", out_elements + 1)
    monkeypatch.setattr(reparam.fused, "FUSED_MIN_MACS", macs)
    assert bn_nodes(copy.deepcopy(blk)(x.clone().requires_grad_())) == 3
    monkeypatch.setattr(reparam.fused, "FUSED_MIN_MACS", macs + 1)
    assert bn_nodes(copy.deepcopy(blk)(x.clone().requires_grad_())) == 7


def test_lenet5_blocks_stay_per_branch_at_any_batch_below_the_element_threshold():
    """The two thresholds leave LeNet-5's blocks (1 → 6 and 6 → 16 channels, 5×5 on 32×32) on the
    per-branch forward for every batch whose outputs are under FUSED_MIN_OUTPUT_ELEMENTS."""
    for cin, cout, hw in ((1, 6, 28), (6, 16, 10)):
        batch = reparam.fused.FUSED_MIN_OUTPUT_ELEMENTS // (cout * hw * hw)  # the largest batch below it
        assert batch * cout * hw * hw * cin * 25 < reparam.fused.FUSED_MIN_MACS


# ------------------------------------------------------------------------------ 1x1 -> KxK composition


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("bmm", "mm", "matmul", "baddbmm", "addmm", "einsum"):
            self.calls.append((name, tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("groups, internal", [(1, None), (4, None), (16, None), (4, 32)],
                         ids=["dense", "grouped", "depthwise", "grouped_plain_first_stage"])
def test_trained_1x1_kxk_composition_is_one_batched_gemm_and_float64_exact(groups, internal):
    """A trained identity-based first stage (non-zero residual) or a plain one: the composition is
    one matrix product over all groups (one GEMM for a dense conv), in float64, whatever the chunking."""
    gen = torch.Generator().manual_seed(21)
    conv = nn.Conv2d(16, 16, 3, padding=1, groups=groups, bias=False)
    opts = {"1x1_kxk": {} if internal is None else {"internal": internal}}
    blk = DiverseBranchBlock.from_conv(conv, nn.BatchNorm2d(16), opts).to(F64)
    reparam.testing.perturb_(blk, gen).eval()
    with _CountMatmuls() as count:
        merged = blk.merge()
    assert [c[0] for c in count.calls] == ["bmm"] and count.calls[0][1][0] == groups
    k, b = blk.get_equivalent_kernel_bias()
    assert rel_err(merged.weight, k) <= 1e-12 and rel_err(merged.bias, b) <= 1e-12
    x = torch.randn(2, 16, 7, 7, generator=gen, dtype=F64)
    assert rel_err(merged(x), blk(x)) <= 1e-12
    # float32 block: merged in float64, rounded once; tolerance relative to the output scale
    blk32 = copy.deepcopy(blk).float()
    assert reparam.testing.assert_equivalent(blk32.merge(), blk32, x.float()) <= 1e-6


@pytest.mark.parametrize(
    "cin, cout, stride, hw",
    [(8, 8, 1, (1, 1)), (8, 16, 2, (2, 2)), (8, 8, 1, (2, 2)), (6, 6, 2, (1, 2))],
    ids=["1x1_map", "2x2_to_1x1", "2x2_map", "1x2_map_s2"],
)
def test_fused_blocks_on_the_smallest_maps_equal_per_branch_float64(cin, cout, stride, hw):
    """Blocks on 1×1 and 2×2 maps (torchvision's ResNet-18 at 32×32 input, last stages): dead taps
    cropped, convs that cover their input as matrix products, the mean filter on a 1×1 map as a
    scaling — the same training step as the per-branch modules in float64, and those paths run."""
    gen = torch.Generator().manual_seed(21)
    blk, _ = make_block(("small", cin, cout, 3, stride, 1, 1, 1, hw), gen)
    x = torch.randn(6, cin, *hw, generator=gen, dtype=F64) + 0.3
    worst, _ = compare(blk, x)
    assert worst <= 1e-10
    out = copy.deepcopy(blk)(x)  # which operators ran, read from the autograd graph (a dispatch mode would turn the paths off)
    names, visited, stack = set(), set(), [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is not None and id(fn) not in visited:
            visited.add(id(fn))
            names.add(type(fn).__name__)
            stack.extend(f for f, _ in fn.next_functions)
    if hw == (1, 1):
        assert "MmBackward0" in names or "AddmmBackward0" in names  # a branch conv as a product
        assert "MulBackward0" in names                              # the mean filter as a scaling


def test_box_filter_is_avg_pool_with_zero_padding_on_small_maps_float64():
    """The mean filter (count_include_pad), including the shortcut where every window covers the
    whole map (1×1 and 2×2 maps under 3×3 windows): outputs and input gradients equal avg_pool2d's
    on every small geometry avg_pool2d accepts."""
    import itertools

    import torch.nn.functional as F

    from reparam.fused import box_filter

    gen = torch.Generator().manual_seed(5)
    checked = shortcut = 0
    for size, k, s, p in itertools.product(itertools.product([1, 2, 3], [1, 2, 3]), itertools.product([1, 2, 3, 5], [1, 3]),
                                           itertools.product([1, 2], [1, 3]), itertools.product(range(3), range(2))):
        if any(pp > kk // 2 or sz + 2 * pp < kk for sz, kk, pp in zip(size, k, p)):
            continue  # avg_pool2d refuses padding over half the kernel; no window at all
        z = torch.randn(2, 3, *size, generator=gen, dtype=F64, requires_grad=True)
        ref = F.avg_pool2d(z, k, s, p, count_include_pad=True)
        out = box_filter(z, k, s, p)
        g = torch.randn(ref.shape, generator=gen, dtype=F64)
        (g_ref,), (g_out,) = torch.autograd.grad(ref, z, g), torch.autograd.grad(out, z, g)
        assert out.shape == ref.shape and out.is_contiguous()
        assert rel_err(out, ref) <= 1e-13 and rel_err(g_out, g_ref) <= 1e-13
        checked += 1
        shortcut += out.grad_fn is not None and type(out.grad_fn).__name__ in ("MulBackward0", "CloneBackward0")
    assert checked > 100 and shortcut > 10
