"""DiverseBranchBlock: construction, growth, merge, fold, re-solve, nesting, specs.

Expansion must be bit-exact (torch.equal) in train and eval mode, running statistics included;
merge / fold / re-solve must be eval-exact: float64 rel_err <= 1e-10, float32 <= 1e-5, with
randomised BN statistics and signed gamma on every BN (including new branches' last BN).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import reparam
from reparam import DiverseBranchBlock, FrozenIdentityBN, IdentityBasedConv1x1, KINDS
from reparam.kinds import applicability
from reparam.errors import AlignmentError, NotMergeableError, ReparamError, ReparamModeError
from reparam.geometry import ConvGeometry
from reparam.testing import assert_equivalent, randomize_bn_, rel_err

F64 = torch.float64

# (id, cin, cout, kernel, stride, padding or None (centred), dilation, groups, padding_mode, input hw)
GEOMS = [
    ("dense", 8, 8, 3, 1, None, 1, 1, "zeros", (9, 9)),
    ("dense_s2_up", 8, 16, 3, 2, None, 1, 1, "zeros", (10, 10)),
    ("rgb_in", 3, 8, 3, 1, None, 1, 1, "zeros", (9, 8)),
    ("down_s2", 16, 8, 3, 2, None, 1, 1, "zeros", (9, 9)),
    ("grouped", 8, 8, 3, 1, None, 1, 2, "zeros", (9, 8)),
    ("depthwise", 8, 8, 3, 1, None, 1, 8, "zeros", (10, 10)),
    ("depthwise_s2", 8, 8, 3, 2, None, 1, 8, "zeros", (9, 9)),
    ("multiplier", 8, 16, 3, 1, None, 1, 8, "zeros", (9, 9)),
    ("g_out_lt_in", 16, 8, 3, 1, None, 1, 8, "zeros", (10, 10)),
    ("k1", 8, 8, 1, 1, None, 1, 1, "zeros", (9, 9)),
    ("k5", 8, 8, 5, 1, None, 1, 1, "zeros", (10, 10)),
    ("k7_s2", 8, 8, 7, 2, None, 1, 1, "zeros", (10, 9)),
    ("rect_1x3", 8, 8, (1, 3), 1, None, 1, 1, "zeros", (9, 8)),
    ("rect_3x1", 8, 8, (3, 1), 1, None, 1, 1, "zeros", (9, 9)),
    ("rect_3x5", 8, 8, (3, 5), 1, None, 1, 1, "zeros", (10, 10)),
    ("dilated", 8, 8, 3, 1, None, 2, 1, "zeros", (10, 9)),
    ("dilated_grouped_s2", 8, 16, 3, 2, None, 2, 2, "zeros", (10, 10)),
    ("reflect", 8, 8, 3, 1, None, 1, 1, "reflect", (9, 9)),
    ("reflect_s2", 8, 16, 3, 2, None, 1, 1, "reflect", (10, 10)),
    ("reflect_depthwise", 8, 8, 3, 1, None, 1, 8, "reflect", (9, 8)),
    ("even_k4_s2", 8, 8, 4, 2, 1, 1, 1, "zeros", (10, 10)),
    ("valid", 8, 8, 3, 1, 0, 1, 1, "zeros", (9, 9)),
]
GEOM_IDS = [g[0] for g in GEOMS]


def make_layer(case, gen, dtype=F64, bias=False, with_bn=True):
    _, cin, cout, k, s, p, d, g, mode, hw = case
    kk = (k, k) if isinstance(k, int) else k
    if p is None:
        p = tuple(d * (x - 1) // 2 for x in kk)
    conv = nn.Conv2d(cin, cout, k, s, p, d, g, bias=bias, padding_mode=mode).to(dtype)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen, dtype=dtype) * 0.3)
        if bias:
            conv.bias.copy_(torch.randn(cout, generator=gen, dtype=dtype))
    bn = None
    if with_bn:
        bn = nn.BatchNorm2d(cout).to(dtype)
        randomize_bn_(bn, gen)
    x = torch.randn(2, cin, *hw, generator=gen, dtype=dtype)
    return conv, bn, x


def perturb_(block: nn.Module, gen: torch.Generator) -> nn.Module:
    """Random BN statistics and signed gamma everywhere, non-zero identity-based residuals."""
    randomize_bn_(block, gen)
    with torch.no_grad():
        for m in block.modules():
            if isinstance(m, IdentityBasedConv1x1):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen, dtype=m.weight.dtype) * 0.2)
    return block


def assert_bit_exact_expansion(conv, bn, x, kinds, **kw) -> DiverseBranchBlock:
    """Expansion of (conv, bn) equals the original bit for bit in train and eval mode."""
    ref = nn.Sequential(copy.deepcopy(conv), *( [copy.deepcopy(bn)] if bn is not None else []))
    block = DiverseBranchBlock.from_conv(copy.deepcopy(conv), copy.deepcopy(bn) if bn is not None else None, kinds, **kw)
    for train in (True, False):
        r, b = copy.deepcopy(ref).train(train), copy.deepcopy(block).train(train)
        for _ in range(2):  # second step sees updated running statistics
            assert torch.equal(r(x), b(x))
        if bn is not None:
            anchor_bn = b.branches["kxk"].bn
            assert torch.equal(r[1].running_mean, anchor_bn.running_mean)
            assert torch.equal(r[1].running_var, anchor_bn.running_var)
            if hasattr(r[1], "num_batches_tracked"):
                assert torch.equal(r[1].num_batches_tracked, anchor_bn.num_batches_tracked)
    return block


def assert_merge_exact(block, x, gen, tol=1e-10) -> float:
    perturb_(block, gen)
    block.eval()
    with torch.no_grad():
        y = block(x)
        merged = block.merge()
        out = merged(x)
    assert out.shape == y.shape
    err = rel_err(out, y)
    assert err <= tol, err
    return err


# ------------------------------------------------------------------------------------------ matrix


@pytest.mark.parametrize("case", GEOMS, ids=GEOM_IDS)
def test_block_matrix_default_full_and_single_branches(case, gen) -> None:
    conv, bn, x = make_layer(case, gen)
    geo = ConvGeometry.from_conv(conv)
    reasons = applicability(geo)
    applicable = [k for k in KINDS if reasons[k] is None]
    sets = [None, "all"] + [["kxk", k] for k in applicable if k != "kxk"]
    for kinds in sets:
        block = assert_bit_exact_expansion(conv, bn, x, kinds)
        if kinds == "all":
            assert block.branch_names == applicable
        assert_merge_exact(block, x, gen)
    # inapplicable kinds, requested explicitly, raise
    for k in KINDS:
        if reasons[k] is not None:
            with pytest.raises(AlignmentError):
                DiverseBranchBlock.from_conv(copy.deepcopy(conv), copy.deepcopy(bn), ["kxk", k])


@pytest.mark.parametrize("case", GEOMS[::3], ids=GEOM_IDS[::3])
def test_block_merge_float32(case, gen) -> None:
    conv, bn, x = make_layer(case, gen, dtype=torch.float32)
    block = DiverseBranchBlock.from_conv(conv, bn, "all")
    assert_merge_exact(block, x, gen, tol=1e-5)


class _CountConvolutions(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += "convolution" in func.overloadpacket.__name__
        return func(*args, **(kwargs or {}))


def _merge_convolutions(block: DiverseBranchBlock, **kwargs) -> int:
    """Convolutions a merge of ``block`` runs (the 1x1_kxk product as a oneDNN convolution)."""
    with _CountConvolutions() as ops:
        block.merge(**kwargs)
    return ops.count


@pytest.mark.parametrize("case", GEOMS, ids=GEOM_IDS)
def test_float32_merge_computes_in_float32_to_the_float64_reference(case, gen) -> None:
    """A float32 block merges in float32 by default (the 1x1_kxk product of a dense conv as a
    oneDNN convolution, else a matrix product), in place or not, to float32 rounding of the
    float64 reference; float64 arithmetic stays available and no more accurate at the output."""
    from reparam.transforms import merge_dtype

    assert merge_dtype(torch.float32) == torch.float32 and merge_dtype(torch.float64) == torch.float64
    assert merge_dtype(torch.bfloat16) == torch.float32 and merge_dtype(torch.float32, torch.float64) == torch.float64
    conv, bn, x = make_layer(case, gen)
    block = perturb_(DiverseBranchBlock.from_conv(conv, bn, "all"), gen).eval()
    with torch.no_grad():
        ref = block(x)  # float64 reference
    block32 = copy.deepcopy(block).float()
    x32 = x.float()
    outs = {}
    with torch.no_grad():
        outs["default"] = block32.merge()(x32)
        outs["float64 arithmetic"] = block32.merge(compute_dtype=torch.float64)(x32)
        with torch.backends.mkldnn.flags(enabled=False):  # a process without oneDNN: the matrix product
            by_product = block32.merge()
        outs["matrix product"] = by_product(x32)
        deployed = copy.deepcopy(block32)
        deployed.switch_to_deploy()  # in place: the anchor's storage is reused
        outs["in place"] = deployed(x32)
        forward32 = rel_err(block32(x32), ref)  # the float32 forward's own rounding
    errs = {k: rel_err(v, ref) for k, v in outs.items()}
    assert all(v.dtype == torch.float32 for v in outs.values())
    assert max(errs.values()) <= 2e-6, errs
    assert errs["default"] <= 4 * max(forward32, 1e-7), (errs, forward32)
    assert torch.equal(outs["default"], outs["in place"])
    dense = ConvGeometry.from_conv(conv).groups == 1
    assert (_merge_convolutions(block32) > 0) == (dense and torch.backends.mkldnn.is_available())
    assert _merge_convolutions(block32, compute_dtype=torch.float64) == 0
    with torch.backends.mkldnn.flags(enabled=False):
        assert _merge_convolutions(block32) == 0
    if not (dense and torch.backends.mkldnn.is_available()):  # the same matrix product both times
        assert torch.equal(outs["default"], outs["matrix product"])


def _random_subsets(n: int = 20):
    rng = random.Random(7)
    out = []
    for i in range(n):
        case = GEOMS[rng.randrange(len(GEOMS))]
        _, cin, cout, k, s, p, d, g, mode, hw = case
        kk = (k, k) if isinstance(k, int) else k
        pad = tuple(d * (x - 1) // 2 for x in kk) if p is None else p
        geo = ConvGeometry(cin, cout, k, s, pad, d, g, mode)
        app = [kind for kind, r in applicability(geo).items() if r is None and kind != "kxk"]
        subset = sorted(rng.sample(app, rng.randint(1, len(app))), key=KINDS.index) if app else []
        out.append(pytest.param(case, subset, id=f"{i}-{case[0]}-{'+'.join(subset)}"))
    return out


@pytest.mark.parametrize("case, subset", _random_subsets())
def test_block_random_subsets(case, subset, gen) -> None:
    conv, bn, x = make_layer(case, gen)
    block = assert_bit_exact_expansion(conv, bn, x, subset)
    assert block.branch_names == ["kxk"] + subset
    assert_merge_exact(block, x, gen)


# ------------------------------------------------------------------------------------------ conv mode


@pytest.mark.parametrize("case", [GEOMS[0], GEOMS[1], GEOMS[5], GEOMS[14]], ids=lambda c: c[0])
def test_bias_only_conv_gets_frozen_identity_bn(case, gen) -> None:
    conv, _, x = make_layer(case, gen, bias=True, with_bn=False)
    block = assert_bit_exact_expansion(conv, None, x, "all")
    anchor_bn = block.branches["kxk"].bn
    assert isinstance(anchor_bn, FrozenIdentityBN)
    assert not isinstance(anchor_bn, nn.modules.batchnorm._BatchNorm)
    assert block.mode == "conv"
    assert_merge_exact(block, x, gen)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("eps", [1e-3, 1e-5, 1e-6])
def test_frozen_identity_bn_is_identity_bit_for_bit(dtype, eps, gen) -> None:
    bn = FrozenIdentityBN(4, eps, dtype=dtype)
    x = (torch.randn(2, 4, 5, 5, generator=gen) * 3).to(dtype)
    for train in (True, False):
        assert torch.equal(bn.train(train)(x), x)
    assert list(bn.parameters()) == []
    assert bn.is_norm


def test_frozen_identity_bn_stays_exact_after_dtype_cast(gen) -> None:
    """A float32-built FrozenIdentityBN cast to float64 keeps running_var == 1 - eps exactly."""
    bn = FrozenIdentityBN(3, 1e-5).double()
    assert torch.equal(bn.running_var, torch.full((3,), 1 - 1e-5, dtype=F64))
    x = torch.randn(2, 3, 4, 4, generator=gen, dtype=F64)
    assert torch.equal(bn(x), x)


def test_conv_without_bias_or_bn_is_refused_unless_allowed(gen) -> None:
    conv, _, x = make_layer(GEOMS[0], gen, with_bn=False)
    with pytest.raises(NotMergeableError, match="allow_new_bias"):
        DiverseBranchBlock.from_conv(copy.deepcopy(conv), None)
    block = assert_bit_exact_expansion(conv, None, x, None, allow_new_bias=True)
    assert block.geometry.bias and block.new_bias
    assert_merge_exact(block, x, gen)


def test_calibrated_anchor_norm_is_eval_exact(gen) -> None:
    conv, _, x = make_layer(GEOMS[0], gen, bias=True, with_bn=False)
    ref = copy.deepcopy(conv)
    batches = [torch.randn(4, 8, 9, 9, generator=gen, dtype=F64) for _ in range(3)]
    with pytest.raises(ReparamError, match="calibration_input"):
        DiverseBranchBlock.from_conv(copy.deepcopy(conv), None, anchor_norm="calibrated")
    block = DiverseBranchBlock.from_conv(conv, None, anchor_norm="calibrated", calibration_input=batches)
    bn = block.branches["kxk"].bn
    assert isinstance(bn, nn.BatchNorm2d) and block.anchor_norm == "calibrated"
    with torch.no_grad():
        z = torch.cat([ref(b) for b in batches])
        assert rel_err(bn.running_mean, z.mean((0, 2, 3))) <= 1e-10
        assert rel_err(bn.running_var + bn.eps, z.var((0, 2, 3), unbiased=False)) <= 1e-10
        block.eval()
        assert rel_err(block(x), ref(x)) <= 1e-10
    assert_merge_exact(block, x, gen)


def test_batchnorm_anchor_norm_is_eval_exact(gen) -> None:
    conv, _, x = make_layer(GEOMS[0], gen, bias=True, with_bn=False)
    ref = copy.deepcopy(conv)
    block = DiverseBranchBlock.from_conv(conv, None, anchor_norm="batchnorm").eval()
    with torch.no_grad():
        assert rel_err(block(x), ref(x)) <= 1e-10
    with pytest.raises(ReparamError, match="anchor_norm"):
        DiverseBranchBlock.from_conv(copy.deepcopy(ref), None, anchor_norm="bogus")


# ------------------------------------------------------------------------------------------ merge properties


def test_merged_conv_keeps_bias_and_stays_trainable(gen) -> None:
    """DynamicFL's switch_to_deploy dropped the fused bias; DBB detached the fused conv."""
    conv, bn, x = make_layer(GEOMS[0], gen)
    block = perturb_(DiverseBranchBlock.from_conv(conv, bn), gen).eval()
    merged = block.merge()
    assert isinstance(merged, nn.Conv2d) and merged.bias is not None
    assert merged.bias.abs().sum() > 0
    assert merged.weight.requires_grad and merged.bias.requires_grad
    assert merged.weight.dtype == conv.weight.dtype
    merged(x).sum().backward()
    assert merged.weight.grad is not None


def test_merged_conv_built_with_keyword_geometry_keeps_shape(gen) -> None:
    """timm's inference_mode blocks built reparam_conv without padding (14x14 -> 12x12)."""
    for case in (GEOMS[0], GEOMS[11], GEOMS[16], GEOMS[20], GEOMS[18]):
        conv, bn, x = make_layer(case, gen)
        merged = DiverseBranchBlock.from_conv(conv, bn).eval().merge()
        for attr in ("kernel_size", "stride", "padding", "dilation", "groups", "padding_mode"):
            assert getattr(merged, attr) == getattr(conv, attr)
        assert merged(x).shape == conv(x).shape


def test_merge_in_train_mode_raises(gen) -> None:
    conv, bn, x = make_layer(GEOMS[0], gen)
    block = DiverseBranchBlock.from_conv(conv, bn).train()
    with pytest.raises(ReparamModeError, match="eval"):
        block.merge()
    assert isinstance(block.merge(require_eval=False), nn.Conv2d)
    with pytest.raises(ReparamModeError):
        block.switch_to_deploy()


def test_second_merge_is_noop(gen) -> None:
    """OREPA's second switch_to_deploy raised AttributeError."""
    conv, bn, x = make_layer(GEOMS[0], gen)
    block = perturb_(DiverseBranchBlock.from_conv(conv, bn), gen).eval()
    with torch.no_grad():
        y = block(x)
    block.switch_to_deploy()
    conv1 = block.reparam_conv
    block.switch_to_deploy()
    block.reparameterize()
    assert block.reparam_conv is conv1 and block.is_merged and block.branch_names == []
    assert block.merge() is conv1
    with torch.no_grad():
        assert rel_err(block(x), y) <= 1e-10
    assert set(block.state_dict()) == {"reparam_conv.weight", "reparam_conv.bias"}
    with pytest.raises(ReparamError, match="deployed"):
        block.add_branch("1xk")


class _Equivalent(nn.Module):
    def __init__(self, block: DiverseBranchBlock) -> None:
        super().__init__()
        self.block = block

    def forward(self):
        return self.block.get_equivalent_kernel_bias()


def test_equivalent_kernel_gradcheck(gen) -> None:
    conv = nn.Conv2d(2, 2, 3, padding=1, bias=False).double()
    block = perturb_(DiverseBranchBlock.from_conv(conv, nn.BatchNorm2d(2).double(), "all"), gen).eval()
    k, b = block.get_equivalent_kernel_bias()
    assert k.dtype == F64 and k.requires_grad and b.requires_grad
    (k.sum() + b.sum()).backward()
    assert all(p.grad is not None for p in block.parameters())
    wrapper = _Equivalent(block)
    names = [n for n, _ in wrapper.named_parameters()]
    inputs = tuple(p.detach().clone().requires_grad_() for _, p in wrapper.named_parameters())

    def fn(*ps):
        return torch.func.functional_call(wrapper, dict(zip(names, ps)), ())

    assert torch.autograd.gradcheck(fn, inputs)
    x = torch.randn(2, 2, 5, 5, generator=gen, dtype=F64)
    with torch.no_grad():
        assert rel_err(F.conv2d(x, k, b, padding=1), block(x)) <= 1e-10


def test_float64_model_merges_without_float32_constants(gen) -> None:
    """DBB's float32 constants (transV_avg, id_tensor) limited a .double() model to ~1e-8."""
    conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
    bn = nn.BatchNorm2d(8)
    block = DiverseBranchBlock.from_conv(conv, bn, "all").double()
    x = torch.randn(2, 8, 9, 9, generator=gen, dtype=F64)
    err = assert_merge_exact(block, x, gen, tol=1e-12)
    assert err <= 1e-12


# ------------------------------------------------------------------------------------------ structure


def test_state_dict_keys_and_identity_buffer_not_persistent(gen) -> None:
    conv, bn, _ = make_layer(GEOMS[0], gen)
    block = DiverseBranchBlock.from_conv(conv, bn, "all")
    keys = set(block.state_dict())
    assert "branches.kxk.conv.weight" in keys and "branches.kxk.bn.running_var" in keys
    assert "branches.1x1_kxk.bn2.running_var" in keys and "branches.1x1_kxk.conv1.weight" in keys
    assert "branches.identity.bn.weight" in keys
    assert not any("id_tensor" in k for k in keys)
    assert isinstance(block.branches["1x1_kxk"].conv1, IdentityBasedConv1x1)
    id_tensor = block.branches["1x1_kxk"].conv1.id_tensor
    assert any(b is id_tensor for b in block.buffers())


def test_bf16_cast_of_train_form(gen) -> None:
    """DBB's id_tensor was a plain attribute: .to(bfloat16) then failed in forward."""
    conv, bn, x = make_layer(GEOMS[0], gen, dtype=torch.float32)
    block = DiverseBranchBlock.from_conv(conv, bn, "all")
    perturb_(block, gen)
    ref = copy.deepcopy(block).eval()
    low = copy.deepcopy(block).to(torch.bfloat16).eval()
    assert low.branches["1x1_kxk"].conv1.id_tensor.dtype == torch.bfloat16
    with torch.no_grad():
        y = low(x.to(torch.bfloat16))
        assert y.dtype == torch.bfloat16
        assert rel_err(y.float(), ref(x)) <= 2e-2
    low.train()(x.to(torch.bfloat16))  # train-mode forward does not raise either
    half = copy.deepcopy(block).half().eval()
    assert half.merge().weight.dtype == torch.float16


def test_mutable_default_branches_not_shared(gen) -> None:
    """DyRep mutated its default branch list in place, silently dropping identity for later blocks."""
    kinds = ["kxk", "1x1", "identity"]
    before = list(kinds)
    s2 = nn.Conv2d(8, 8, 3, 2, 1, bias=False)
    with pytest.raises(AlignmentError):
        DiverseBranchBlock.from_conv(s2, nn.BatchNorm2d(8), kinds)
    assert kinds == before
    b1 = DiverseBranchBlock.from_conv(nn.Conv2d(8, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8))
    b2 = DiverseBranchBlock.from_conv(nn.Conv2d(8, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8))
    assert "identity" not in b1.branch_names and "identity" in b2.branch_names
    assert reparam.DEFAULT_BRANCHES == ("kxk", "1x1", "1x1_kxk", "1x1_avg", "identity")


def test_groups_equal_out_below_in_uses_dense_avg_path(gen) -> None:
    """DBB took the depthwise average path whenever groups == out_channels (crash for 16 -> 8, g=8)."""
    conv, bn, x = make_layer(GEOMS[8], gen)
    block = DiverseBranchBlock.from_conv(conv, bn, "all")
    assert block.branches["1x1_avg"].path == "dense"
    assert_merge_exact(block, x, gen)
    dw_conv, dw_bn, x = make_layer(GEOMS[5], gen)
    dw = DiverseBranchBlock.from_conv(dw_conv, dw_bn)
    assert dw.branches["1x1_avg"].path == "depthwise"
    assert dw.branches["1x1_kxk"].internal == 16 and "1x1" not in dw.branch_names


def test_dilation_reaches_every_branch(gen) -> None:
    """DBB and DyRep crashed with dilation > 1 (not passed to the KxK of 1x1_kxk)."""
    conv, bn, x = make_layer(GEOMS[15], gen)
    block = DiverseBranchBlock.from_conv(conv, bn, "all")
    assert block.branches["1x1_kxk"].conv2.dilation == (2, 2)
    assert block.branches["1xk"].conv.dilation == (1, 2)
    assert "1x1_avg" not in block.branch_names
    assert_merge_exact(block, x, gen)


def test_even_kernel_block_merges(gen) -> None:
    """DiverseBranchBlock#32: even kernels were refused by an assert; they merge when parity matches."""
    conv, bn, x = make_layer(GEOMS[20], gen)
    block = DiverseBranchBlock.from_conv(conv, bn, "all")
    assert block.branch_names == ["kxk", "1x1_kxk", "1x1_avg"]
    assert_merge_exact(block, x, gen)


def test_syncbn_conversion_keeps_value_padding(gen) -> None:
    """DBB's BNAndPadLayer subclassed BatchNorm2d; SyncBN conversion replaced it and lost the padding."""
    conv, bn, x = make_layer(GEOMS[0], gen)
    block = perturb_(DiverseBranchBlock.from_conv(conv, bn, "all"), gen).eval()
    with torch.no_grad():
        y = block(x)
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(block)).eval()
    assert isinstance(synced.branches["1x1_kxk"].bn1, nn.SyncBatchNorm)
    with torch.no_grad():
        assert rel_err(synced(x), y) <= 1e-10
        assert rel_err(synced.merge()(x), y) <= 1e-10
    frozen = DiverseBranchBlock.from_conv(nn.Conv2d(4, 4, 3, padding=1).double(), None)
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(frozen)
    assert isinstance(converted.branches["kxk"].bn, FrozenIdentityBN)


def test_pad_value_gradient_is_not_detached(gen) -> None:
    conv, bn, x = make_layer(GEOMS[0], gen)
    block = perturb_(DiverseBranchBlock.from_conv(conv, bn, ["1x1_kxk"]), gen).eval()
    branch = block.branches["1x1_kxk"]
    # only the border sees bn1's running-statistics value; the interior sees bn1 in eval too
    branch(x).sum().backward()
    assert branch.bn1.bias.grad is not None and branch.bn1.bias.grad.abs().sum() > 0


def test_fx_trace_of_train_and_merged_forms(gen) -> None:
    conv, bn, x = make_layer(GEOMS[0], gen)
    block = perturb_(DiverseBranchBlock.from_conv(conv, bn, "all"), gen).eval()
    traced = torch.fx.symbolic_trace(block)
    with torch.no_grad():
        assert torch.equal(traced(x), block(x))
        deployed = copy.deepcopy(block)
        deployed.switch_to_deploy()
        assert torch.equal(torch.fx.symbolic_trace(deployed)(x), deployed(x))


@pytest.mark.slow
def test_torch_compile_of_train_and_merged_forms(gen) -> None:
    conv, bn, x = make_layer(GEOMS[0], gen, dtype=torch.float32)
    block = perturb_(DiverseBranchBlock.from_conv(conv, bn, "all"), gen).eval()
    compiled = torch.compile(block)
    with torch.no_grad():
        assert rel_err(compiled(x), block(x)) <= 1e-5
        assert rel_err(torch.compile(block.merge())(x), block(x)) <= 1e-5


def test_invalid_requests_raise_clear_errors(gen) -> None:
    conv, bn, _ = make_layer(GEOMS[0], gen)
    with pytest.raises(ReparamError, match="unknown branch kind"):
        DiverseBranchBlock.from_conv(copy.deepcopy(conv), copy.deepcopy(bn), ["kxk", "3x3"])
    with pytest.raises(ReparamError, match="init"):
        DiverseBranchBlock.from_conv(copy.deepcopy(conv), copy.deepcopy(bn), init="randomly")
    with pytest.raises(NotMergeableError):
        DiverseBranchBlock.from_conv(nn.Conv1d(4, 4, 3), None)
    with pytest.raises(NotMergeableError, match="track_running_stats"):
        DiverseBranchBlock.from_conv(copy.deepcopy(conv), nn.BatchNorm2d(8, track_running_stats=False))
    with pytest.raises(AlignmentError, match="asymmetric"):
        DiverseBranchBlock.from_conv(nn.Conv2d(4, 4, 4, padding="same"), nn.BatchNorm2d(4))
    block = DiverseBranchBlock.from_conv(nn.Conv2d(4, 4, 3, padding="same", bias=False), nn.BatchNorm2d(4))
    assert block.geometry.padding == (1, 1)


# ------------------------------------------------------------------------------------------ growth / fold / re-solve


@pytest.mark.parametrize("case", [GEOMS[0], GEOMS[5], GEOMS[7], GEOMS[17]], ids=lambda c: c[0])
def test_add_branch_is_bit_exact(case, gen) -> None:
    conv, bn, x = make_layer(case, gen, dtype=torch.float32)  # bit-exactness holds in any dtype
    block = DiverseBranchBlock.from_conv(conv, bn, [])
    anchor_w = block.branches["kxk"].conv.weight
    for kind in block.applicable()[1:]:
        before = copy.deepcopy(block)
        change = block.add_branch(kind, generator=gen)
        assert kind in block.branch_names
        assert {id(p) for p, _ in change.added} == {id(p) for p in block.branches[kind].parameters()}
        assert all(ref is anchor_w or ref is block.branches["kxk"].bn.weight or ref is block.branches["kxk"].bn.bias
                   for _, ref in change.added)
        assert change.removed == [] and change.overwritten == []
        for train in (True, False):
            a, b = copy.deepcopy(before).train(train), copy.deepcopy(block).train(train)
            assert torch.equal(a(x), b(x))
            assert torch.equal(a(x), b(x))
            assert torch.equal(a.branches["kxk"].bn.running_var, b.branches["kxk"].bn.running_var)
    assert_merge_exact(block, x, gen, tol=1e-5)
    with pytest.raises(ReparamError, match="already present"):
        block.add_branch("1x1_kxk")


def test_add_inapplicable_branch_raises(gen) -> None:
    conv, bn, _ = make_layer(GEOMS[1], gen)  # 8 -> 16, stride 2
    block = DiverseBranchBlock.from_conv(conv, bn, [])
    with pytest.raises(AlignmentError, match="identity"):
        block.add_branch("identity")


def test_random_resolve_growth_is_eval_exact(gen) -> None:
    conv, bn, x = make_layer(GEOMS[0], gen)
    block = perturb_(DiverseBranchBlock.from_conv(conv, bn, ["1x1"]), gen).eval()
    with torch.no_grad():
        y = block(x)
    change = block.add_branch("1x1_kxk", init="random_resolve", generator=gen)
    assert block.branches["1x1_kxk"].bn2.weight.abs().sum() > 0
    assert any(p is block.branches["kxk"].conv.weight for p in change.overwritten)
    with torch.no_grad():
        assert rel_err(block(x), y) <= 1e-10
    conv, bn, x = make_layer(GEOMS[0], gen)
    ref = nn.Sequential(copy.deepcopy(conv), copy.deepcopy(bn)).eval()
    grown = DiverseBranchBlock.from_conv(conv, bn, "all", init="random_resolve").eval()
    with torch.no_grad():
        assert rel_err(grown(x), ref(x)) <= 1e-10


@pytest.mark.parametrize("case", [GEOMS[0], GEOMS[5], GEOMS[14], GEOMS[17]], ids=lambda c: c[0])
def test_remove_branch_folds_into_anchor(case, gen) -> None:
    conv, bn, x = make_layer(case, gen)
    block = perturb_(DiverseBranchBlock.from_conv(conv, bn, "all"), gen).eval()
    with torch.no_grad():
        y = block(x)
    anchor = block.branches["kxk"]
    stats = (anchor.bn.running_mean.clone(), anchor.bn.running_var.clone(), anchor.bn.weight.clone())
    for name in block.branch_names[1:]:
        params = list(block.branches[name].parameters())
        change = block.remove_branch(name)
        assert name not in block.branch_names
        assert {id(p) for p in change.removed} == {id(p) for p in params}
        assert any(p is anchor.conv.weight for p in change.overwritten)
        with torch.no_grad():
            assert rel_err(block(x), y) <= 1e-10
    assert block.branch_names == ["kxk"]
    assert torch.equal(anchor.bn.running_mean, stats[0]) and torch.equal(anchor.bn.running_var, stats[1])
    assert torch.equal(anchor.bn.weight, stats[2])
    with pytest.raises(ReparamError, match="anchor"):
        block.remove_branch("kxk")
    with pytest.raises(ReparamError, match="not present"):
        block.remove_branch("1x1")


def test_remove_branch_in_conv_mode_uses_conv_bias(gen) -> None:
    conv, _, x = make_layer(GEOMS[0], gen, bias=True, with_bn=False)
    block = perturb_(DiverseBranchBlock.from_conv(conv, None, "all"), gen).eval()
    with torch.no_grad():
        y = block(x)
    change = block.remove_branch("1x1_avg")
    assert any(p is block.branches["kxk"].conv.bias for p in change.overwritten)
    assert torch.equal(block.branches["kxk"].bn.running_var, torch.full((8,), 1 - 1e-5, dtype=F64))
    with torch.no_grad():
        assert rel_err(block(x), y) <= 1e-10


def _plain_target(conv: nn.Conv2d, gen) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(conv.weight.shape, generator=gen, dtype=conv.weight.dtype) * 0.3
    b = torch.randn(conv.out_channels, generator=gen, dtype=conv.weight.dtype)
    return w, b


@pytest.mark.parametrize("anchor_stats", ["keep", "rescale", "identity", "adopt"])
@pytest.mark.parametrize("case", [GEOMS[0], GEOMS[6], GEOMS[7], GEOMS[19]], ids=lambda c: c[0])
def test_load_plain_resolves_anchor_only(case, anchor_stats, gen) -> None:
    conv, bn, x = make_layer(case, gen)
    block = perturb_(DiverseBranchBlock.from_conv(conv, bn, "all"), gen).eval()
    w, b = _plain_target(conv, gen)
    others = {k: v.clone() for k, v in block.state_dict().items() if not k.startswith("branches.kxk.")}
    target_bn = None
    if anchor_stats == "adopt":
        target_bn = randomize_bn_(nn.BatchNorm2d(conv.out_channels).double(), gen).eval()
    change = block.load_plain(w, b, anchor_stats=anchor_stats, target_bn=target_bn)
    for k, v in block.state_dict().items():
        if k in others:
            assert torch.equal(v, others[k]), k
    assert change.added == [] and change.removed == []
    target = nn.Sequential(ConvGeometry.from_conv(conv).make_conv(bias=True, dtype=F64))
    with torch.no_grad():
        target[0].weight.copy_(w)
        target[0].bias.copy_(b)
    if target_bn is not None:
        target.append(target_bn)
        anchor_bn = block.branches["kxk"].bn
        assert torch.equal(anchor_bn.running_mean, target_bn.running_mean)
    with torch.no_grad():
        assert rel_err(block(x), target.eval()(x)) <= 1e-10
        assert rel_err(block.merge()(x), target(x)) <= 1e-10


def test_load_plain_conv_mode_and_deployed(gen) -> None:
    conv, _, x = make_layer(GEOMS[0], gen, bias=True, with_bn=False)
    block = perturb_(DiverseBranchBlock.from_conv(conv, None, "all"), gen).eval()
    w, b = _plain_target(conv, gen)
    block.load_plain(w, b)
    with torch.no_grad():
        assert rel_err(block(x), F.conv2d(x, w, b, padding=1)) <= 1e-10
    block.switch_to_deploy()
    change = block.load_plain(w * 2, None)
    assert change.overwritten[0] is block.reparam_conv.weight
    with torch.no_grad():
        assert rel_err(block(x), F.conv2d(x, w * 2, None, padding=1)) <= 1e-10
    with pytest.raises(ReparamError, match="shape"):
        block.load_plain(w[:, :, :1, :1], b)
    with pytest.raises(ReparamError, match="anchor_stats"):
        block.load_plain(w, b, anchor_stats="reset")


def test_gamma_guard_clamps_tiny_anchor_gamma(gen) -> None:
    conv, bn, x = make_layer(GEOMS[0], gen)
    with torch.no_grad():
        bn.weight[0] = 0.0
        bn.weight[1] = 1e-6
        bn.weight[2] = -1e-6
    block = perturb_(DiverseBranchBlock.from_conv(conv, bn, "all"), gen)
    with torch.no_grad():
        block.branches["kxk"].bn.weight[:3] = torch.tensor([0.0, 1e-6, -1e-6], dtype=F64)
    block.eval()
    w, b = _plain_target(conv, gen)
    change = block.load_plain(w, b)
    gamma = block.branches["kxk"].bn.weight
    assert torch.equal(gamma[:3], torch.tensor([1e-3, 1e-3, -1e-3], dtype=F64))
    assert any(p is gamma for p in change.overwritten)
    with torch.no_grad():
        assert rel_err(block(x), F.conv2d(x, w, b, padding=1)) <= 1e-10
    with torch.no_grad():
        block.branches["kxk"].bn.weight[0] = 0.0
        y = block(x)
    block.remove_branch("1x1")
    with torch.no_grad():
        assert rel_err(block(x), y) <= 1e-10


def _filter_norms(k: torch.Tensor) -> torch.Tensor:
    return k.flatten(1).norm(dim=1)


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
@pytest.mark.parametrize("case", [GEOMS[0], GEOMS[1], GEOMS[5], GEOMS[10]], ids=lambda c: c[0])
def test_load_plain_rescale_keeps_each_anchor_filter_norm_and_the_running_statistics(case, nested, gen) -> None:
    conv, bn, x = make_layer(case, gen)
    block = DiverseBranchBlock.from_conv(conv, bn, "all")
    if nested:
        block.grow_nested("kxk")
    block = perturb_(block, gen).eval()
    anchor_bn = block.branches["kxk"].bn
    norms, gamma = _filter_norms(block._anchor_kernel()), anchor_bn.weight.detach().clone()
    mean, var = anchor_bn.running_mean.clone(), anchor_bn.running_var.clone()
    w, b = _plain_target(conv, gen)
    w = w * torch.logspace(-2, 2, w.shape[0], dtype=F64).reshape(-1, 1, 1, 1)  # targets far from the kept scale
    change = block.load_plain(w, b, anchor_stats="rescale")
    with torch.no_grad():
        assert rel_err(block(x), F.conv2d(x, w, b, conv.stride, conv.padding, conv.dilation, conv.groups)
                       if conv.padding_mode == "zeros" else block.merge()(x)) <= 1e-10
    assert torch.allclose(_filter_norms(block._anchor_kernel()), norms, rtol=1e-10, atol=0)
    assert torch.equal(anchor_bn.running_mean, mean) and torch.equal(anchor_bn.running_var, var)
    assert torch.equal(torch.sign(anchor_bn.weight.detach()), torch.sign(gamma))
    assert not torch.equal(anchor_bn.weight.detach(), gamma)  # γ carries the target's scale
    assert any(p is anchor_bn.weight for p in change.overwritten)


def test_load_plain_rescale_keeps_gamma_where_the_target_filter_is_zero(gen) -> None:
    conv, bn, x = make_layer(GEOMS[0], gen)
    block = perturb_(DiverseBranchBlock.from_conv(conv, bn, "all"), gen).eval()
    gamma = block.branches["kxk"].bn.weight.detach().clone()
    rest, rest_b = block._pairs_except(["kxk"], F64)
    w, b = _plain_target(conv, gen)
    w[2] = rest[2]  # the anchor's own part of filter 2 is exactly zero
    block.load_plain(w, b, anchor_stats="rescale")
    assert block.branches["kxk"].bn.weight[2] == gamma[2]
    assert torch.all(torch.isfinite(block.branches["kxk"].conv.weight))
    with torch.no_grad():
        assert rel_err(block(x), F.conv2d(x, w, b, padding=1)) <= 1e-10


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_repeated_rep_and_training_statistics_keep_the_anchor_scale_with_rescale_and_grow_it_with_keep(nested, gen) -> None:
    """DynamicFL's cycle, reduced to one block: REP to a global kernel somewhat larger than the
    client's own, then the BN running statistics follow the new weights (as training makes them).
    With ``keep`` the conv absorbs each change of scale and the running variance follows it, so the
    scale compounds round after round (the divergence of a 200-round run); with ``rescale`` the
    anchor filters keep their norms and the statistics stay where they were."""
    conv, bn, x = make_layer(GEOMS[0], gen)
    x = torch.randn(64, 8, 9, 9, generator=gen, dtype=F64)
    base = DiverseBranchBlock.from_conv(conv, bn, "all")
    if nested:
        base.grow_nested("kxk")
    base = perturb_(base, gen)
    grown = {}
    for stats in ("keep", "rescale"):
        block, g = copy.deepcopy(base), torch.Generator().manual_seed(7)
        start = float(block._anchor_kernel().norm())
        for _ in range(12):
            block.eval()
            k, b = (t.detach() for t in block.get_equivalent_kernel_bias())
            target = 1.3 * k + 0.05 * torch.randn(k.shape, generator=g, dtype=F64)
            block.load_plain(target, b, anchor_stats=stats)
            with torch.no_grad():
                assert rel_err(block(x), F.conv2d(x, target, b, padding=1)) <= 1e-9
                for m in block.modules():  # statistics of the current weights, as training leaves them
                    if isinstance(m, nn.BatchNorm2d) and not isinstance(m, FrozenIdentityBN):
                        m.reset_running_stats()
                        m.momentum = None
                block.train()(x)
        grown[stats] = float(block._anchor_kernel().norm()) / start
        assert torch.all(torch.isfinite(block.branches["kxk"].bn.running_var))
    if nested:  # the nested block's own branch statistics move its merged kernel a little
        assert 0.5 < grown["rescale"] < 2.0
    else:
        assert grown["rescale"] == pytest.approx(1.0, rel=1e-9)
    assert grown["keep"] > 1e3


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_calibrate_anchor_measures_the_statistics_and_keeps_the_eval_function(nested, gen) -> None:
    conv, bn, _ = make_layer(GEOMS[0], gen)
    block = DiverseBranchBlock.from_conv(conv, bn, "all")
    if nested:
        block.grow_nested("kxk")
    block = perturb_(block, gen).eval()
    x = torch.randn(16, 8, 9, 9, generator=gen, dtype=F64)
    with torch.no_grad():
        y = block(x)
    block.load_plain(*(t.detach() for t in block.get_equivalent_kernel_bias()), anchor_stats="rescale")  # as after REP
    norms = _filter_norms(block._anchor_kernel())
    # measuring runs a nested anchor in training mode: by the re-solve, its own statistics, batch
    # counts and modes are as they were
    inner = block.branches["kxk"].conv
    before = [(b.clone(), m.training) for m in inner.modules() for b in m.buffers(recurse=False)]
    seen = []
    real = block._solve_for_total
    block._solve_for_total = lambda *a, **k: seen.append(  # type: ignore[method-assign]
        [(b.clone(), m.training) for m in inner.modules() for b in m.buffers(recurse=False)]) or real(*a, **k)
    change = block.calibrate_anchor([x[:8], x[8:]])
    del block._solve_for_total
    assert len(seen) == 1 and len(seen[0]) == len(before)
    assert all(torch.equal(b, a) and mb == ma for (b, mb), (a, ma) in zip(seen[0], before))
    anchor_bn = block.branches["kxk"].bn
    with torch.no_grad():
        assert rel_err(block(x), y) <= 1e-10  # eval-exact
        z = copy.deepcopy(block.branches["kxk"].conv).train()(x)  # what the anchor BN sees in training
        # a nested block's own re-solve moves its training-mode output a little (its branches'
        # statistics are its own); a flat anchor's output is exactly what was measured
        tol = 1e-2 if nested else 1e-9
        assert torch.allclose(anchor_bn.running_mean, z.mean((0, 2, 3)), rtol=tol, atol=1e-12)
        assert torch.allclose(anchor_bn.running_var, z.var((0, 2, 3), unbiased=False), rtol=tol)
    assert torch.allclose(_filter_norms(block._anchor_kernel()), norms, rtol=1e-10)
    assert any(p is anchor_bn.weight for p in change.overwritten)


def test_after_calibrate_anchor_training_mode_starts_from_the_eval_function(gen) -> None:
    """An anchor-only block whose statistics are stale: training mode on a batch is the eval
    function scaled per channel by the ratio of the stale statistics to the batch's. Calibrated on
    that batch, training mode and eval mode agree on it."""
    conv, bn, _ = make_layer(GEOMS[0], gen)
    block = DiverseBranchBlock.from_conv(conv, bn, [])
    x = torch.randn(16, 8, 9, 9, generator=gen, dtype=F64)
    with torch.no_grad():
        block.branches["kxk"].bn.running_var.mul_(9.0)  # stale: three times the batch's scale
        assert rel_err(copy.deepcopy(block).train()(x), block.eval()(x)) > 0.1
    block.calibrate_anchor(x)
    with torch.no_grad():
        assert rel_err(copy.deepcopy(block).train()(x), block.eval()(x)) <= 1e-10


def test_calibrate_anchor_leaves_an_anchor_without_batchnorm_alone(gen) -> None:
    conv, _, x = make_layer(GEOMS[0], gen, bias=True, with_bn=False)
    block = DiverseBranchBlock.from_conv(conv, None, "all", anchor_norm="frozen_identity")
    state = copy.deepcopy(block.state_dict())
    assert block.calibrate_anchor(x).overwritten == []
    assert all(torch.equal(v, state[k]) for k, v in block.state_dict().items())


def test_nested_growth_is_exact_and_merges(gen) -> None:
    conv, bn, x = make_layer(GEOMS[0], gen)
    block = assert_bit_exact_expansion(conv, bn, x, None)
    before = copy.deepcopy(block)
    change = block.grow_nested("kxk")
    change2 = block.grow_nested("1x1_kxk", ["1x1_avg"])
    with pytest.raises(AlignmentError):
        copy.deepcopy(before).grow_nested("1x1_kxk", ["1x1"])
    assert change.added and change2.added
    for train in (True, False):
        a, b = copy.deepcopy(before).train(train), copy.deepcopy(block).train(train)
        assert torch.equal(a(x), b(x))
    with pytest.raises(ReparamError, match="max_depth"):
        block.branches["kxk"].conv.grow_nested("kxk")
    spec = block.spec()
    assert set(spec["nested"]) == {"kxk", "1x1_kxk"}
    perturb_(block, gen).eval()
    with torch.no_grad():
        y = block(x)
        assert rel_err(block.merge()(x), y) <= 1e-10
    block.flatten_nested("1x1_kxk")
    block.flatten_nested("kxk")
    assert isinstance(block.branches["kxk"].conv, nn.Conv2d) and block.branches["kxk"].conv.bias is None
    with torch.no_grad():
        assert rel_err(block(x), y) <= 1e-10
    # a nested anchor is re-solved recursively
    block.grow_nested("kxk", "all")
    perturb_(block, gen).eval()
    w, b = _plain_target(conv, gen)
    block.load_plain(w, b)
    with torch.no_grad():
        target = F.conv2d(x, w, b, padding=1)
        assert rel_err(block(x), target) <= 1e-10


def test_from_spec_rebuilds_identical_structure(gen) -> None:
    conv, bn, x = make_layer(GEOMS[7], gen)
    block = perturb_(DiverseBranchBlock.from_conv(conv, bn, "all"), gen)
    block.grow_nested("kxk", ["1x1"])
    spec = block.spec()
    fresh_conv, fresh_bn, _ = make_layer(GEOMS[7], gen)
    rebuilt = DiverseBranchBlock.from_spec(fresh_conv, fresh_bn, spec)
    assert str(rebuilt) == str(block)
    rebuilt.load_state_dict(block.state_dict(), strict=True)
    block.eval(), rebuilt.eval()
    with torch.no_grad():
        assert torch.equal(rebuilt(x), block(x))


def test_assert_equivalent_and_rel_err(gen) -> None:
    conv, bn, x = make_layer(GEOMS[0], gen)
    block = perturb_(DiverseBranchBlock.from_conv(conv, bn, "all"), gen).eval()
    err = assert_equivalent(block, block.merge(), x, dtype=F64)
    assert 0 <= err <= 1e-10
    assert_equivalent(block, block.merge(), x, dtype=torch.float32)
    with pytest.raises(AssertionError):
        assert_equivalent(block, nn.Conv2d(8, 8, 3, padding=1).double(), x)
    with pytest.raises(AssertionError, match="shape"):
        rel_err(torch.zeros(2, 3), torch.zeros(3, 2))
    assert rel_err(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0])) == 0.5


@pytest.mark.parametrize("case", [GEOMS[0], GEOMS[1], GEOMS[6], GEOMS[18], GEOMS[19]], ids=lambda c: c[0])
def test_branches_compute_the_spec_structure(case, gen) -> None:
    """Each branch's forward is the documented branch structure (see ``reparam.builtin_kinds``) written
    with plain torch ops
    (AvgPool2d for the pool, value padding from bn1's running statistics)."""
    conv, bn, x = make_layer(case, gen)
    block = perturb_(DiverseBranchBlock.from_conv(conv, bn, "all"), gen).eval()
    geo = block.geometry
    ph, pw = geo.padding
    mode = geo.padding_mode

    def pad(z, bn1):
        if mode != "zeros":
            return F.pad(z, (pw, pw, ph, ph), mode=mode)
        value = bn1.bias - bn1.running_mean * bn1.weight / torch.sqrt(bn1.running_var + bn1.eps)
        out = value.view(1, -1, 1, 1).expand(z.shape[0], -1, z.shape[2] + 2 * ph, z.shape[3] + 2 * pw).clone()
        out[:, :, ph:ph + z.shape[2], pw:pw + z.shape[3]] = z
        return out

    with torch.no_grad():
        b = block.branches["1x1_kxk"]
        ref = b.bn2(F.conv2d(pad(b.bn1(b.conv1(x)), b.bn1), b.conv2.weight, None, geo.stride, 0, geo.dilation, geo.groups))
        assert rel_err(b(x), ref) <= 1e-12
        if "1x1_avg" in block.branches:
            a = block.branches["1x1_avg"]
            if a.path == "dense":
                z = pad(a.bn1(a.conv(x)), a.bn1)
                ref = a.bn2(F.avg_pool2d(z, geo.kernel_size, geo.stride, 0))
            else:
                xp = F.pad(x, (pw, pw, ph, ph), mode="constant" if mode == "zeros" else mode)
                ref = a.bn(F.avg_pool2d(xp, geo.kernel_size, geo.stride, 0))
            assert rel_err(a(x), ref) <= 1e-12
        if "1x1" in block.branches:
            o = block.branches["1x1"]
            q = o.conv.padding
            xp = x if mode == "zeros" else F.pad(x, (q[1], q[1], q[0], q[0]), mode=mode)
            ref = o.bn(F.conv2d(xp, o.conv.weight, None, geo.stride, q if mode == "zeros" else 0, 1, geo.groups))
            assert rel_err(o(x), ref) <= 1e-12
        if "identity" in block.branches:
            assert torch.equal(block.branches["identity"](x), block.branches["identity"].bn(x))


def test_host_bn_mode_flags_are_not_flipped(gen) -> None:
    """A host BN frozen in eval mode inside a training model stays in eval mode after expansion."""
    conv, bn, x = make_layer(GEOMS[0], gen)
    conv.train()
    bn.eval()
    ref = nn.Sequential(copy.deepcopy(conv), copy.deepcopy(bn))
    block = DiverseBranchBlock.from_conv(conv, bn)
    assert block.training and not block.branches["kxk"].bn.training
    assert torch.equal(block(x), ref(x))


def test_randomize_bn_covers_every_bn_including_last_bn(gen) -> None:
    """DiverseBranchBlock#35 asked why BN is randomised: with default statistics T-I is nearly the
    identity, and a zero-gamma branch makes a merge test vacuous."""
    conv, bn, _ = make_layer(GEOMS[0], gen)
    block = DiverseBranchBlock.from_conv(conv, bn, "all")
    assert block.branches["1x1_kxk"].bn2.weight.abs().sum() == 0
    randomize_bn_(block, gen)
    bns = [m for m in block.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(bns) == 1 + 1 + 2 + 2 + 1 + 1 + 1
    for m in bns:
        assert m.weight.abs().min() >= 0.05 and (m.weight < 0).any() or m.num_features < 4
        assert ((m.running_var >= 0.1) & (m.running_var <= 2)).all()
        assert m.running_mean.abs().max() <= 1 and m.bias.abs().max() <= 1


def test_frozen_batchnorm2d_anchor_is_merged(gen, tv) -> None:
    """mmpretrain's switch_to_deploy asserted norm type 'BN'; detection backbones use FrozenBatchNorm2d."""
    from torchvision.ops.misc import FrozenBatchNorm2d

    conv, _, x = make_layer(GEOMS[0], gen)
    fbn = FrozenBatchNorm2d(8).double()
    with torch.no_grad():
        fbn.weight.copy_(torch.rand(8, generator=gen, dtype=F64) + 0.5)
        fbn.bias.copy_(torch.randn(8, generator=gen, dtype=F64))
        fbn.running_mean.copy_(torch.randn(8, generator=gen, dtype=F64))
        fbn.running_var.copy_(torch.rand(8, generator=gen, dtype=F64) + 0.5)
    block = assert_bit_exact_expansion(conv, fbn, x, None)
    assert_merge_exact(block, x, gen)
    y = block(x)
    block.remove_branch("1x1")
    with torch.no_grad():
        assert rel_err(block(x), y) <= 1e-10


def test_new_branch_init_is_deterministic_and_finite_for_k5(gen) -> None:
    """OREPA's fre_init hard-coded range(3) and left uninitialised memory for k = 5."""
    conv, bn, _ = make_layer(GEOMS[10], gen)
    a = DiverseBranchBlock.from_conv(copy.deepcopy(conv), copy.deepcopy(bn), "all", generator=torch.Generator().manual_seed(3))
    b = DiverseBranchBlock.from_conv(copy.deepcopy(conv), copy.deepcopy(bn), "all", generator=torch.Generator().manual_seed(3))
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb) and bool(torch.isfinite(va.double()).all()), ka
    w = a.branches["1x1_kxk"].conv2.weight
    assert w.std() > 0 and (w[..., 4, 4] != 0).all()


def test_construction_and_merge_print_nothing(gen, capsys) -> None:
    """RepVGG's block constructor printed 'RepVGG Block, identity = ...'."""
    conv, bn, _ = make_layer(GEOMS[0], gen)
    block = DiverseBranchBlock.from_conv(conv, bn, "all").eval()
    block.merge()
    block.switch_to_deploy()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_identity_bn_has_no_eps_leak(gen) -> None:
    """DyRep reset its identity BNs to running_var = 1: the output is then scaled by 1/sqrt(1 + eps)
    (5e-6 relative at eps = 1e-5); running_var = 1 - eps is the identity bit for bit."""
    x = torch.randn(2, 4, 5, 5, generator=gen, dtype=F64)
    leaky = nn.BatchNorm2d(4).double().eval()
    assert rel_err(leaky(x), x) > 1e-6
    assert torch.equal(FrozenIdentityBN(4).double()(x), x)
    conv, _, x8 = make_layer(GEOMS[0], gen, bias=True, with_bn=False)
    block = assert_bit_exact_expansion(conv, None, x8, "all")  # growth: exact, no leak
    with torch.no_grad():
        block.eval()
        y = block(x8)
        block.remove_branch("1x1")  # folding: eval-exact, no leak
        assert rel_err(block(x8), y) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_new_branches_follow_anchor_dtype_and_device(dtype, gen) -> None:
    """DyRep hard-coded .cuda(); DBB's constants were float32: everything follows the anchor."""
    conv = nn.Conv2d(4, 4, 3, padding=1, bias=False).to(dtype)
    block = DiverseBranchBlock.from_conv(conv, nn.BatchNorm2d(4).to(dtype), "all")
    for t in list(block.parameters()) + list(block.buffers()):
        if t.is_floating_point():
            assert t.dtype == dtype and t.device == conv.weight.device
    meta = DiverseBranchBlock.from_conv(nn.Conv2d(4, 4, 3, padding=1, bias=False, device="meta"),
                                        nn.BatchNorm2d(4, device="meta"), "all")
    assert all(p.device.type == "meta" for p in meta.parameters())


def test_double_backward_through_train_form(gen) -> None:
    """Hessian-vector products (used by Hessian-based pruning) work through every branch."""
    conv, bn, x = make_layer(GEOMS[0], gen)
    block = perturb_(DiverseBranchBlock.from_conv(conv, bn, "all"), gen).train()
    params = [p for p in block.parameters() if p.requires_grad]
    loss = block(x).pow(2).mean()
    grads = torch.autograd.grad(loss, params, create_graph=True)
    vs = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
    hv = torch.autograd.grad(sum((g * v).sum() for g, v in zip(grads, vs)), params, allow_unused=True)
    assert any(h is not None and h.abs().sum() > 0 for h in hv)
