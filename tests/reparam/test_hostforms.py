"""Conv subclasses and norm+activation BatchNorms (reparam.hostforms), without timm: local classes
that compute what timm's StdConv2d / ScaledStdConv2d / Conv2dSame / BatchNormAct2d compute."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import reparam
from reparam import DiverseBranchBlock, NormActTail, SamePadConv2d
from reparam.errors import NotMergeableError, ReparamError
from reparam.hostforms import ConvForm, conv_form, norm_act_reason, pad_same
from reparam.testing import perturb_, randomize_bn_, rel_err

F64 = torch.float64


class WSConv(nn.Conv2d):
    """Weight standardisation with an optional per-channel gain (timm's ScaledStdConv2d form)."""

    def __init__(self, *args, gain: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.eps = 1e-6
        self.scale = self.weight[0].numel() ** -0.5 if gain else None
        self.gain = nn.Parameter(torch.ones(self.out_channels, 1, 1, 1)) if gain else None

    def forward(self, x):
        mult = None if self.gain is None else (self.gain * self.scale).view(-1)
        w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, weight=mult,
                         training=True, momentum=0.0, eps=self.eps).reshape_as(self.weight)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class SameConv(nn.Conv2d):
    """TF "same" padding computed at every call (timm's Conv2dSame form)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, padding=0, **kwargs)

    def forward(self, x):
        ih, iw = x.shape[-2:]
        pads = []
        for i, k, s, d in ((ih, *self.kernel_size[:1], self.stride[0], self.dilation[0]),
                           (iw, self.kernel_size[1], self.stride[1], self.dilation[1])):
            pads.append(max((-(-i // s) - 1) * s + (k - 1) * d + 1 - i, 0))
        ph, pw = pads
        x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class LoggingConv(nn.Conv2d):
    """Overrides forward but computes a plain conv."""

    def forward(self, x):
        return super().forward(x)


class ScaledOutputConv(nn.Conv2d):
    """Overrides forward with something that is not a conv of its weight."""

    def forward(self, x):
        return torch.tanh(super().forward(x))


class BNAct(nn.BatchNorm2d):
    def __init__(self, n: int, act: nn.Module | None = None, drop: nn.Module | None = None, order: str = "drop_act"):
        super().__init__(n)
        self.drop = drop if drop is not None else nn.Identity()
        self.act = act if act is not None else nn.ReLU()
        self.order = order

    def forward(self, x):
        x = super().forward(x)
        if self.order == "drop_act":
            return self.act(self.drop(x))
        return self.drop(self.act(x))


def _bit_exact(a: nn.Module, b: nn.Module, xs) -> None:
    for train in (True, False):
        ma, mb = copy.deepcopy(a).train(train), copy.deepcopy(b).train(train)
        for x in xs:
            torch.manual_seed(5)
            ya = ma(x)
            torch.manual_seed(5)
            yb = mb(x)
            assert torch.equal(ya, yb), f"train={train}, input {tuple(x.shape)}"


def _inputs(gen, *sizes):
    return [torch.randn(2, 4, h, w, generator=gen, dtype=F64) for h, w in sizes]


# ---------------------------------------------------------------------------------------------
# forms


def test_forms_are_identified_by_probing(gen) -> None:
    assert conv_form(nn.Conv2d(4, 8, 3)) == ConvForm()
    assert conv_form(LoggingConv(4, 8, 3)) == ConvForm()
    assert conv_form(WSConv(4, 8, 3)) == ConvForm(standardized=True)
    assert conv_form(WSConv(4, 8, 3, gain=True)) == ConvForm(standardized=True)
    assert conv_form(SameConv(4, 8, 3, stride=2)) == ConvForm(same_pad=True)
    assert conv_form(SamePadConv2d(4, 8, 3, stride=2)) == ConvForm(same_pad=True)
    reason = conv_form(ScaledOutputConv(4, 8, 3))
    assert isinstance(reason, str) and "ScaledOutputConv.forward" in reason
    wn = nn.utils.parametrizations.weight_norm(nn.Conv2d(4, 8, 3))
    assert "parametrized" in conv_form(wn)


def test_same_padding_matches_the_tf_rule(gen) -> None:
    for size in (7, 8, 9, 10):
        x = torch.randn(1, 4, size, size + 1, generator=gen, dtype=F64)
        for k, s, d in ((3, 2, 1), (5, 2, 1), (3, 1, 2), (1, 2, 1), (4, 3, 1)):
            conv = SameConv(4, 4, k, stride=s, dilation=d).double()
            ref = conv(x)
            y = F.conv2d(pad_same(x, conv.kernel_size, conv.stride, conv.dilation), conv.weight, conv.bias, s, 0, d)
            assert torch.equal(ref, y)
            assert ref.shape[-2:] == (-(-size // s), -(-(size + 1) // s))


# ---------------------------------------------------------------------------------------------
# TF "same" padding


@pytest.mark.parametrize("k", [3, 5])
def test_same_pad_conv_expands_and_merges_exactly(gen, k) -> None:
    model = nn.Sequential(SameConv(4, 8, k, stride=2, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          SameConv(8, 8, 3, stride=2, groups=8, bias=True)).double()
    perturb_(model, gen)
    xs = _inputs(gen, (15, 16), (16, 15), (9, 9))
    expanded = reparam.expand(model)
    assert set(dict(reparam.iter_blocks(expanded))) == {"0", "3"}
    assert expanded[0].same_pad and reparam.structure(expanded)["blocks"]["0"]["host_form"] == {
        "standardized": False, "same_pad": True}
    _bit_exact(model, expanded, xs)  # the first forward ran (the bug: size 16 vs 15)
    perturb_(expanded, gen).eval()
    deploy = reparam.merge(expanded)
    assert type(deploy[0]) is SamePadConv2d and type(deploy[3]) is SamePadConv2d
    host = reparam.merge(expanded, target="host")
    assert type(host[0]) is SameConv and type(host[3]) is SameConv and isinstance(host[1], nn.BatchNorm2d)
    fresh = copy.deepcopy(model).eval()
    fresh.load_state_dict(host.state_dict(), strict=True)
    for x in xs:
        y = expanded(x)
        assert rel_err(deploy(x), y) <= 1e-12 and rel_err(host(x), y) <= 1e-12 and rel_err(fresh(x), y) <= 1e-12
    # switch_to_deploy inside the model, spec round trip, tensor-only merges
    spec = reparam.structure(expanded)
    rebuilt = reparam.build(copy.deepcopy(model), spec)
    rebuilt.load_state_dict(expanded.state_dict(), strict=True)
    dep_sd = reparam.merge_state_dict(expanded.state_dict(), spec)
    dep = reparam.build(copy.deepcopy(model), spec, form="deploy")
    dep.load_state_dict(dep_sd, strict=True)
    for x in xs:
        assert rel_err(rebuilt.eval()(x), expanded(x)) <= 1e-12
        assert rel_err(dep.eval()(x), expanded(x)) <= 1e-12
    blk = copy.deepcopy(expanded[0])
    blk.switch_to_deploy()
    assert type(blk.reparam_conv) is SamePadConv2d and rel_err(blk(xs[0]), expanded[0](xs[0])) <= 1e-12


def test_same_pad_block_supports_structure_changes(gen) -> None:
    conv, bn = SameConv(4, 8, 3, stride=2, bias=False).double(), nn.BatchNorm2d(8).double()
    randomize_bn_(nn.Sequential(bn), gen)
    blk = DiverseBranchBlock.from_conv(conv, bn)
    perturb_(blk, gen).eval()
    x = _inputs(gen, (11, 12))[0]
    y = blk(x)
    blk.remove_branch("1x1")
    assert rel_err(blk(x), y) <= 1e-12
    blk.fold_all()
    assert type(blk.anchor.conv) is SameConv and rel_err(blk(x), y) <= 1e-12
    assert "kxk" not in blk.nestable()
    with pytest.raises(NotMergeableError, match="plain nn.Conv2d"):
        blk.grow_nested("kxk")


# ---------------------------------------------------------------------------------------------
# weight standardisation


@pytest.mark.parametrize("gain", [False, True])
def test_weight_standardised_conv_expands_exactly_and_merges_for_deploy(gen, gain) -> None:
    model = nn.Sequential(WSConv(4, 8, 3, padding=1, bias=False, gain=gain), nn.BatchNorm2d(8), nn.ReLU(),
                          WSConv(8, 8, 3, padding=1, bias=True, gain=gain)).double()
    perturb_(model, gen)
    xs = _inputs(gen, (9, 10))
    expanded = reparam.expand(model)
    assert set(dict(reparam.iter_blocks(expanded))) == {"0", "3"}
    _bit_exact(model, expanded, xs)
    perturb_(expanded, gen).eval()
    y = expanded(xs[0])
    deploy = reparam.merge(expanded)
    assert type(deploy[0]) is nn.Conv2d and rel_err(deploy(xs[0]), y) <= 1e-12
    before = copy.deepcopy(expanded.state_dict())
    with pytest.raises(NotMergeableError, match="weight-standardised"):
        reparam.merge(expanded, target="host", inplace=True)
    assert all(torch.equal(before[k], v) for k, v in expanded.state_dict().items())  # nothing changed
    blk = expanded[0]
    for call in (blk.fold_all, lambda: blk.remove_branch("1x1"), blk.to_host,
                 lambda: blk.load_plain(torch.zeros(8, 4, 3, 3), None)):
        with pytest.raises(NotMergeableError, match="weight-standardised"):
            call()
    with pytest.raises(ReparamError, match="weight-standardised"):
        reparam.merge_state_dict(expanded.state_dict(), reparam.structure(expanded))
    with pytest.raises(NotMergeableError, match="random_resolve"):
        DiverseBranchBlock.from_conv(WSConv(4, 8, 3, padding=1).double(), None, init="random_resolve")
    assert blk.weight is blk.anchor.conv.weight  # the host parameter, not the standardised kernel


def test_unknown_conv_subclass_is_skipped_with_the_reason(gen) -> None:
    model = nn.Sequential(ScaledOutputConv(4, 8, 3, padding=1), nn.BatchNorm2d(8),
                          LoggingConv(8, 8, 3, padding=1), nn.BatchNorm2d(8)).double()
    expanded = reparam.expand(model)
    spec = reparam.structure(expanded)
    assert set(spec["blocks"]) == {"2"} and "ScaledOutputConv.forward" in spec["skipped"]["0"]
    _bit_exact(model, expanded, _inputs(gen, (6, 7)))
    with pytest.raises(NotMergeableError, match="ScaledOutputConv"):
        reparam.expand(model, plan={"0": ["kxk", "1x1"]})


# ---------------------------------------------------------------------------------------------
# norm + activation BatchNorms


def test_norm_act_batchnorm_pairs_and_keeps_its_activation(gen) -> None:
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, bias=False), BNAct(8, nn.SiLU(), nn.Dropout(0.3)),
                          nn.Conv2d(8, 8, 3, padding=1, bias=False), BNAct(8, nn.PReLU(8))).double()
    perturb_(model, gen)
    expanded = reparam.expand(model)
    assert set(dict(reparam.iter_blocks(expanded))) == {"0", "2"}
    assert isinstance(expanded[1], NormActTail) and isinstance(expanded[1].drop, nn.Dropout)
    assert set(expanded.state_dict()) >= {"3.act.weight"}  # the activation keeps its key
    _bit_exact(model, expanded, _inputs(gen, (7, 6)))  # dropout active in train mode, same RNG
    perturb_(expanded, gen).eval()
    x = _inputs(gen, (7, 6))[0]
    y = expanded(x)
    assert rel_err(reparam.merge(expanded)(x), y) <= 1e-12
    host = reparam.merge(expanded, target="host")
    assert type(host[1]) is BNAct and isinstance(host[1].act, nn.SiLU) and isinstance(host[1].drop, nn.Dropout)
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(host.state_dict(), strict=True)
    assert rel_err(fresh.eval()(x), y) <= 1e-12
    # structure/build round trip puts the activation after the block again
    spec = reparam.structure(expanded)
    rebuilt = reparam.build(copy.deepcopy(model), spec)
    rebuilt.load_state_dict(expanded.state_dict(), strict=True)
    assert isinstance(rebuilt[1], NormActTail) and rel_err(rebuilt.eval()(x), y) <= 1e-12
    host_sd = reparam.merge_state_dict(expanded.state_dict(), spec, target="host")
    fresh.load_state_dict(host_sd, strict=True)
    assert rel_err(fresh(x), y) <= 1e-12


def test_norm_act_with_another_order_is_not_split(gen) -> None:
    bn = BNAct(8, nn.ReLU(), nn.Dropout(0.5), order="act_drop")
    assert norm_act_reason(bn) is not None
    assert norm_act_reason(BNAct(8, nn.ReLU())) is None
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, bias=False), bn).double()
    spec = reparam.structure(reparam.expand(model))
    assert not spec["blocks"] and "act=ReLU" in spec["skipped"]["0"]


# ---------------------------------------------------------------------------------------------
# what code reads from a conv


class ReadsItsConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(4, 6, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x):
        x = x.to(self.proj.weight.device, self.proj.weight.dtype)
        assert self.proj.out_channels == 6 and self.proj.kernel_size == (3, 3) and self.proj.groups == 1
        return self.bn(self.proj(x))


def test_a_block_answers_like_its_conv(gen) -> None:
    model = ReadsItsConv().double()
    conv = model.proj
    expanded = reparam.expand(model)
    blk = expanded.proj
    assert isinstance(blk, DiverseBranchBlock)
    assert blk.weight is blk.anchor.conv.weight and blk.bias is None
    assert (blk.in_channels, blk.out_channels, blk.kernel_size, blk.stride, blk.padding, blk.dilation, blk.groups,
            blk.padding_mode) == (conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                                  conv.dilation, conv.groups, conv.padding_mode)
    x = torch.randn(2, 4, 8, 8, generator=gen)
    _bit_exact(model, expanded, [x])
    assert blk.weight.dtype == F64 and blk.weight.shape == (6, 4, 3, 3)
    blk.eval().switch_to_deploy()
    assert blk.weight is blk.reparam_conv.weight and blk.bias is blk.reparam_conv.bias


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = SameConv(4, 8, 3, stride=2, bias=False)
        self.bn = BNAct(8, nn.SiLU())
        self.odd = ScaledOutputConv(8, 8, 3, padding=1)

    def forward(self, x):
        if float(x.sum()) > 1e9:  # data-dependent control flow: torch.fx cannot trace it
            return x
        return self.odd(self.bn(self.conv(x)))


def test_the_forward_probe_pairs_norm_act_layers_and_reports_unknown_convs(gen) -> None:
    model = Untraceable().double()
    perturb_(model, gen)
    scan = reparam.find_conv_bn_pairs(model)
    assert scan.method == "probe" and scan.convs == {"conv": "bn"} and scan.norm_act == {"bn"}
    assert "ScaledOutputConv" in scan.unsupported["odd"]
    expanded = reparam.expand(model)
    assert "ScaledOutputConv" in reparam.structure(expanded)["skipped"]["odd"]
    xs = _inputs(gen, (10, 11))
    _bit_exact(model, expanded, xs)
    perturb_(expanded, gen).eval()
    y = expanded(xs[0])
    assert rel_err(reparam.merge(expanded)(xs[0]), y) <= 1e-12
    host = reparam.merge(expanded, target="host")
    assert type(host.conv) is SameConv and type(host.bn) is BNAct and rel_err(host(xs[0]), y) <= 1e-12
