"""Closed-form MACs (multiply-accumulates per sample; pooling and BatchNorm count 0) against
FlopCounterMode and hand values."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fedhetero import models
import reparam
from reparam.block import DiverseBranchBlock
from reparam.flops import (
    block_macs,
    branch_macs,
    conv_macs,
    conv_output_hw,
    input_sizes,
    layer_macs,
    model_macs,
    train_macs,
)
from reparam.geometry import ConvGeometry


def oracle_macs(model: nn.Module, input_shape) -> int:
    """FlopCounterMode ÷ 2 of one eval/no_grad forward of a batch of one."""
    was = model.training
    model.eval()
    p = next(model.parameters())
    x = torch.randn(1, *input_shape, dtype=p.dtype)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(x)
    model.train(was)
    total = fc.get_total_flops()
    assert total % 2 == 0
    return total // 2


# ------------------------------------------------------------------------ closed form, by hand


def test_conv_macs_and_output_size():
    conv = nn.Conv2d(64, 128, 3, stride=2, padding=1, bias=False)
    assert conv_output_hw(conv, (32, 32)) == (16, 16)
    assert conv_macs(conv, (32, 32)) == 16 * 16 * 128 * 64 * 9
    geo = ConvGeometry.from_conv(conv)
    assert conv_macs(geo, 32) == conv_macs(conv, (32, 32))
    dw = nn.Conv2d(32, 32, (3, 5), padding=(1, 2), dilation=1, groups=32)
    assert conv_macs(dw, (10, 12)) == 10 * 12 * 32 * 1 * 15
    valid = nn.Conv2d(3, 6, 5, padding="valid")
    assert conv_output_hw(valid, (32, 32)) == (28, 28)
    with pytest.raises(ValueError, match="too small"):
        conv_macs(valid, (3, 3))
    with pytest.raises(TypeError, match="geometry"):
        conv_macs(object(), (3, 3))
    with pytest.raises(TypeError, match="in_hw"):
        conv_macs(conv, "32")


def test_worked_examples_resnet18_layer1():
    # worked example: CIFAR ResNet-18 layer1.0.conv1 (64->64, 3x3, s=1, 32x32), counted by hand
    conv = nn.Conv2d(64, 64, 3, padding=1, bias=False)
    expect = {
        "kxk": 37_748_736,
        "1x1": 4_194_304,
        "1x1_kxk": 41_943_040,
        "1x1_avg": 4_194_304,
        "1xk": 12_582_912,
        "kx1": 12_582_912,
        "identity": 0,
    }
    got = {k: branch_macs(k, conv, (32, 32)) for k in expect}
    assert got == expect
    default = sum(got[k] for k in ("kxk", "1x1", "1x1_kxk", "1x1_avg"))
    assert default * 9 == 21 * got["kxk"]
    assert sum(got.values()) * 9 == 27 * got["kxk"]


def test_worked_example_stride2():
    conv = nn.Conv2d(64, 128, 3, stride=2, padding=1, bias=False)
    plain = conv_macs(conv, 32)
    default = sum(branch_macs(k, conv, 32) for k in ("kxk", "1x1", "1x1_kxk", "1x1_avg"))
    assert round(default / plain, 2) == 2.78


def test_branch_macs_depthwise_and_internal():
    dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
    assert branch_macs("1x1_avg", dw, 8) == 0
    assert branch_macs("identity", dw, 8) == 0
    # D = 2C: stage 1 8*8*32*1, stage 2 8*8*16*2*9
    assert branch_macs("1x1_kxk", dw, 8) == 8 * 8 * 32 + 8 * 8 * 16 * 2 * 9
    dense = nn.Conv2d(8, 12, 3, padding=1, groups=2)
    assert branch_macs("1x1_kxk", dense, 6, internal=4) == 6 * 6 * 4 * 4 + 6 * 6 * 12 * 2 * 9
    with pytest.raises(ValueError, match="kind"):
        branch_macs("5x5", dense, 6)
    with pytest.raises(ValueError, match="internal"):
        branch_macs("1x1_kxk", dense, 6, internal=3)


# ------------------------------------------------------------------------ explicit branch structures


class ValuePad(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        return nn.functional.pad(x, (self.p[1], self.p[1], self.p[0], self.p[0]))


def explicit_branch(kind: str, conv: nn.Conv2d) -> nn.Module:
    """The branch layout documented in ``reparam.builtin_kinds``, built by hand from plain torch modules."""
    c, o, g = conv.in_channels, conv.out_channels, conv.groups
    k, s, p, d = conv.kernel_size, conv.stride, conv.padding, conv.dilation
    q = tuple(pi - di * (ki - 1) // 2 for pi, di, ki in zip(p, d, k))
    if kind == "kxk":
        return nn.Sequential(nn.Conv2d(c, o, k, s, p, d, g, bias=False), nn.BatchNorm2d(o))
    if kind == "1x1":
        return nn.Sequential(nn.Conv2d(c, o, 1, s, q, 1, g, bias=False), nn.BatchNorm2d(o))
    if kind == "1xk":
        return nn.Sequential(
            nn.Conv2d(c, o, (1, k[1]), s, (q[0], p[1]), (1, d[1]), g, bias=False), nn.BatchNorm2d(o)
        )
    if kind == "kx1":
        return nn.Sequential(
            nn.Conv2d(c, o, (k[0], 1), s, (p[0], q[1]), (d[0], 1), g, bias=False), nn.BatchNorm2d(o)
        )
    if kind == "identity":
        return nn.BatchNorm2d(c)
    depthwise = g == c == o and g > 1
    if kind == "1x1_avg":
        if depthwise:
            return nn.Sequential(nn.AvgPool2d(k, s, p), nn.BatchNorm2d(c))
        return nn.Sequential(
            nn.Conv2d(c, o, 1, 1, 0, 1, g, bias=False), nn.BatchNorm2d(o), ValuePad(p),
            nn.AvgPool2d(k, s, 0), nn.BatchNorm2d(o),
        )
    dd = 2 * c if depthwise else c
    return nn.Sequential(
        nn.Conv2d(c, dd, 1, 1, 0, 1, g, bias=False), nn.BatchNorm2d(dd), ValuePad(p),
        nn.Conv2d(dd, o, k, s, 0, d, g, bias=False), nn.BatchNorm2d(o),
    )


GEOMETRIES = [
    (nn.Conv2d(8, 8, 3, padding=1), (9, 9)),
    (nn.Conv2d(8, 16, 3, stride=2, padding=1), (9, 10)),
    (nn.Conv2d(6, 12, (3, 5), padding=(1, 2), groups=2), (7, 8)),
    (nn.Conv2d(8, 8, 3, padding=1, groups=8), (6, 6)),
    (nn.Conv2d(4, 8, 5, padding=4, dilation=2), (11, 11)),
]
APPLICABLE = {
    0: ("kxk", "1x1", "1x1_kxk", "1x1_avg", "1xk", "kx1", "identity"),
    1: ("kxk", "1x1", "1x1_kxk", "1x1_avg", "1xk", "kx1"),
    2: ("kxk", "1x1", "1x1_kxk", "1x1_avg", "1xk", "kx1"),
    3: ("kxk", "1x1_kxk", "1x1_avg", "1xk", "kx1", "identity"),
    4: ("kxk", "1x1", "1x1_kxk", "1xk", "kx1"),
}


@pytest.mark.parametrize("gi", range(len(GEOMETRIES)))
def test_branch_formulas_vs_measured_explicit(gi):
    conv, hw = GEOMETRIES[gi]
    shape = (conv.in_channels, *hw)
    main_out = conv(torch.randn(1, *shape)).shape
    for kind in APPLICABLE[gi]:
        mod = explicit_branch(kind, conv)
        out = mod.eval()(torch.randn(1, *shape))
        assert out.shape == main_out, kind  # the branch is aligned with the main conv
        assert branch_macs(kind, conv, hw) == oracle_macs(mod, shape), kind


# ------------------------------------------------------------------------ real blocks


@pytest.mark.parametrize("gi", range(len(GEOMETRIES)))
def test_branch_formulas_vs_block(gi):
    conv, hw = GEOMETRIES[gi]
    shape = (conv.in_channels, *hw)
    anchor_only = DiverseBranchBlock.from_conv(conv, nn.BatchNorm2d(conv.out_channels), branches=["kxk"])
    base = oracle_macs(anchor_only, shape)
    assert base == conv_macs(conv, hw) == block_macs(anchor_only, hw)
    kinds = [k for k in APPLICABLE[gi] if k in DiverseBranchBlock.from_conv(
        conv, nn.BatchNorm2d(conv.out_channels), branches=["kxk"]).applicable()]
    assert "1x1_kxk" in kinds
    for kind in kinds:
        if kind == "kxk":
            continue
        blk = DiverseBranchBlock.from_conv(conv, nn.BatchNorm2d(conv.out_channels), branches=["kxk", kind])
        measured = oracle_macs(blk, shape)
        assert measured - base == branch_macs(kind, conv, hw), kind
        assert block_macs(blk, hw) == measured == model_macs(blk, shape), kind
    full = DiverseBranchBlock.from_conv(conv, nn.BatchNorm2d(conv.out_channels), branches=kinds)
    assert block_macs(full, hw) == oracle_macs(full, shape) == sum(branch_macs(k, conv, hw) for k in kinds)
    full.eval().switch_to_deploy()  # a deployed block is just its conv
    assert block_macs(full, hw) == model_macs(full, shape) == conv_macs(conv, hw)


# ------------------------------------------------------------------------ whole models

REFERENCE = [
    ("lenet5", {}, 651_720),
    ("cnn", {}, 4_548_608),
    ("vgg11", {"norm": "none"}, 153_293_824),
    ("resnet18", {"num_classes": 100}, 555_468_800),
]


@pytest.mark.parametrize("name,kw,expect", REFERENCE)
def test_reference_values_plain(name, kw, expect):
    m = models.build_model(name, **kw)
    assert model_macs(m, (3, 32, 32)) == expect
    if name in ("lenet5", "cnn", "resnet18"):
        assert oracle_macs(m, (3, 32, 32)) == expect


@pytest.mark.parametrize("name", ["lenet5", "cnn", "resnet18"])
def test_expanded_and_merged_models_vs_oracle(name):
    torch.manual_seed(0)
    plain = models.build_model(name)
    shape = (3, 32, 32)
    expanded = reparam.expand(plain)
    m_exp = model_macs(expanded, shape)
    assert m_exp == oracle_macs(expanded, shape)
    assert m_exp > model_macs(plain, shape)
    # the closed form per block agrees with the hooks
    sizes = input_sizes(expanded, shape)
    per_layer = layer_macs(expanded, shape)
    for path, blk in reparam.iter_blocks(expanded):
        inside = sum(v for p, v in per_layer.items() if p.startswith(path + "."))
        assert block_macs(blk, sizes[path]) == inside, path
    merged = reparam.merge(expanded.eval())
    assert model_macs(merged, shape) == model_macs(plain, shape) == oracle_macs(merged, shape)


def test_input_sizes_and_mode_restore():
    m = models.build_model("resnet18")
    m.train()
    sizes = input_sizes(m, (3, 32, 32))
    assert m.training and all(mod.training for mod in m.modules())
    assert sizes["conv1"] == (32, 32)
    assert sizes["layer2.0.conv1"] == (32, 32)
    assert sizes["layer2.0.conv2"] == (16, 16)
    assert sizes["layer4.1.conv2"] == (4, 4)
    with pytest.raises(TypeError, match="input_shape"):
        model_macs(m, (3, -1, 32))
    with pytest.raises(TypeError, match="model"):
        model_macs("resnet", (3, 32, 32))


def test_train_macs_matches_formula():
    # a training step costs the forward, the input gradient and the weight gradient (3x forward),
    # except that the first conv needs no input gradient: train MACs = 3 * forward - first conv
    m = models.build_model("cnn")
    fwd = model_macs(m, (3, 32, 32))
    first = 32 * 30 * 30 * 3 * 9
    assert train_macs(m, (3, 32, 32)) == 3 * fwd - first
    # and it equals FlopCounterMode over forward + backward
    x = torch.randn(1, 3, 32, 32)
    with FlopCounterMode(display=False) as fc:
        m(x).sum().backward()
    assert fc.get_total_flops() // 2 == 3 * fwd - first


def test_nested_blocks_closed_form():
    conv = nn.Conv2d(8, 8, 3, padding=1)
    blk = DiverseBranchBlock.from_conv(conv, nn.BatchNorm2d(8), branches=["kxk", "1x1", "1x1_kxk"])
    blk.grow_nested("kxk", ["kxk", "1x1", "1x1_kxk"])
    blk.grow_nested("1x1_kxk", ["kxk", "1x1_kxk", "1x1_avg"])
    shape = (8, 9, 9)
    assert block_macs(blk, (9, 9)) == model_macs(blk, shape) == oracle_macs(blk, shape)
    sizes = input_sizes(blk, shape)
    assert sizes["branches.1x1_kxk.conv2"] == (11, 11)  # value-padded intermediate
