"""Bias sinks (reparam.pairs.find_bias_sinks): a bias-free conv without a BatchNorm of its own is
expanded in conv mode with a new bias when every consumer of its output leads to a BatchNorm that can
absorb a per-channel constant, and ``merge(target="host")`` moves the merged bias into those BNs.

Tiny hand-built models: (a) channel concatenations before a BN (MixNet's ``MixedConv2d``, DenseNet's
dense connections), (b) a bias-free 1×1 conv before a BN (VoVNet's separable convs), and cases that
must stay skipped."""

from __future__ import annotations

import copy
import json
from typing import Callable

import pytest
import torch
from torch import nn

import reparam
from reparam.errors import NotMergeableError, ReparamError
from reparam.pairs import find_bias_sinks
from reparam.testing import perturb_, rel_err

F64 = torch.float64
TOL = 1e-12
NOWHERE = "no bias and no following BatchNorm"


class Mixed(nn.Module):
    """(a) two bias-free convs concatenated before one BN (timm's MixedConv2d + BN)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 3, 3, padding=1, bias=False)
        self.b = nn.Conv2d(4, 5, 5, padding=2, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        return self.head(torch.relu(self.bn(torch.cat([self.a(x), self.b(x)], 1))))


class Dense(nn.Module):
    """(a) DenseNet-like: each conv output is concatenated into every later BN; the first operand's
    channel count is not visible in the graph (offsets follow from the BN's width)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(4, 3, 3, padding=1, bias=False)
        self.n1 = nn.BatchNorm2d(7)
        self.c2 = nn.Conv2d(7, 3, 3, padding=1, bias=False)
        self.n2 = nn.BatchNorm2d(10)

    def forward(self, x):
        x = torch.relu(x)
        f1 = self.c1(x)
        f2 = self.c2(torch.relu(self.n1(torch.cat([x, f1], 1))))
        return self.n2(torch.cat([x, f1, f2], 1))


class Separable(nn.Module):
    """(b) a bias-free depthwise conv feeding a bias-free 1×1 conv, then a BN (VoVNet)."""

    def __init__(self, pw_bias: bool = False, pw_padding: int = 0) -> None:
        super().__init__()
        self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False)
        self.pw = nn.Conv2d(4, 6, 1, padding=pw_padding, bias=pw_bias)
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x):
        return torch.relu(self.bn(self.pw(self.dw(x))))


class SecondConsumer(Mixed):
    """``a``'s output also goes elsewhere: the BN alone cannot absorb its bias."""

    def forward(self, x):
        u = self.a(x)
        y = self.bn(torch.cat([u, self.b(x)], 1))
        return self.head(torch.relu(y)) + u[:, :1]


class CatUsedTwice(Mixed):
    """The concatenated tensor feeds the BN and something else: no sink for either conv."""

    def forward(self, x):
        z = torch.cat([self.a(x), self.b(x)], 1)
        return self.head(torch.relu(self.bn(z)) + z)


def _x() -> torch.Tensor:
    return torch.randn(2, 4, 9, 11, generator=torch.Generator().manual_seed(3), dtype=F64)


def _model(make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return make().to(F64)


def _bn_stats(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t for n, t in model.named_buffers() if n.endswith(("running_mean", "running_var"))}


def _check(make: Callable[[], nn.Module], expect_sinks: int) -> nn.Module:
    """Expansion bit-exact (train: output and host BN statistics; eval), merges exact, host merge
    strictly loadable into the original architecture, spec/build/merge_state_dict consistent."""
    gen = torch.Generator().manual_seed(0)
    model = perturb_(_model(make), gen)
    x = _x()
    expanded = reparam.expand(model)
    blocks = dict(reparam.iter_blocks(expanded))
    assert sum(bool(b.bias_sink) for b in blocks.values()) == expect_sinks
    for blk in blocks.values():
        if blk.bias_sink:
            assert blk.mode == "conv" and blk.new_bias
    for train in (True, False):
        a, b = copy.deepcopy(model).train(train), copy.deepcopy(expanded).train(train)
        assert torch.equal(a(x), b(x)), f"train={train}: expansion not bit-exact"
        if train:
            sa, sb = _bn_stats(a), _bn_stats(b)
            for name, t in sa.items():
                assert torch.equal(t, sb[name]), name

    perturb_(expanded, gen).eval()
    for blk in blocks.values():
        if blk.bias_sink:
            assert blk.anchor.conv.bias.abs().min() > 0  # the bias to move is not trivially zero
    y = expanded(x)
    deploy = reparam.merge(expanded, target="deploy")
    assert not list(reparam.iter_blocks(deploy))
    assert rel_err(deploy(x), y) <= TOL
    host = reparam.merge(expanded, target="host")
    assert rel_err(host(x), y) <= TOL
    fresh = _model(make)
    fresh.load_state_dict(host.state_dict(), strict=True)
    assert rel_err(fresh.eval()(x), y) <= TOL

    spec = json.loads(json.dumps(reparam.structure(expanded)))
    rebuilt = reparam.build(_model(make), spec)
    rebuilt.load_state_dict(expanded.state_dict(), strict=True)
    assert torch.equal(rebuilt.eval()(x), y)
    host_sd = reparam.merge_state_dict(expanded.state_dict(), spec, target="host")
    assert set(host_sd) == set(fresh.state_dict())
    from_sd = _model(make)
    from_sd.load_state_dict(host_sd, strict=True)
    assert rel_err(from_sd.eval()(x), y) <= TOL
    deploy_sd = reparam.merge_state_dict(expanded.state_dict(), spec, target="deploy")
    built = reparam.build(_model(make), spec, form="deploy")
    built.load_state_dict(deploy_sd, strict=True)
    assert rel_err(built.eval()(x), y) <= TOL
    # merging the rebuilt model gives the same host model
    host2 = reparam.merge(rebuilt, target="host")
    assert rel_err(host2(x), y) <= TOL
    return expanded


def test_concat_sink() -> None:
    assert find_bias_sinks(_model(Mixed)) == {
        "a": [{"bn": "bn", "offset": 0, "through": None}],
        "b": [{"bn": "bn", "offset": 3, "through": None}],
    }
    expanded = _check(Mixed, 2)
    assert reparam.structure(expanded)["skipped"] == {"head": reparam.structure(expanded)["skipped"]["head"]}


def test_dense_sinks_every_consumer() -> None:
    assert find_bias_sinks(_model(Dense)) == {
        "c1": [{"bn": "n1", "offset": 4, "through": None}, {"bn": "n2", "offset": 4, "through": None}],
        "c2": [{"bn": "n2", "offset": 7, "through": None}],
    }
    _check(Dense, 2)


def test_pointwise_sink() -> None:
    assert find_bias_sinks(_model(Separable)) == {"dw": [{"bn": "bn", "offset": 0, "through": "pw"}]}
    expanded = _check(Separable, 1)
    assert reparam.structure(expanded)["blocks"]["dw"]["bias_sink"] == [{"bn": "bn", "offset": 0, "through": "pw"}]


@pytest.mark.parametrize("make", [lambda: Separable(pw_bias=True), lambda: Separable(pw_padding=1)],
                         ids=["pw-with-bias", "pw-padded"])
def test_pointwise_without_sink(make) -> None:
    assert "dw" not in find_bias_sinks(_model(make))
    skipped = reparam.structure(reparam.expand(_model(make)))["skipped"]
    assert NOWHERE in skipped["dw"]


def test_second_consumer_stays_skipped() -> None:
    model = _model(SecondConsumer)
    assert set(find_bias_sinks(model)) == {"b"}
    expanded = reparam.expand(model)
    skipped = reparam.structure(expanded)["skipped"]
    assert NOWHERE in skipped["a"]
    assert dict(reparam.iter_blocks(expanded))["b"].bias_sink
    x = _x()
    assert torch.equal(expanded.eval()(x), model.eval()(x))


def test_concat_with_another_consumer_stays_skipped() -> None:
    model = _model(CatUsedTwice)
    assert find_bias_sinks(model) == {}
    skipped = reparam.structure(reparam.expand(model))["skipped"]
    assert NOWHERE in skipped["a"] and NOWHERE in skipped["b"]


def test_allow_new_bias_prefers_the_sink() -> None:
    expanded = perturb_(reparam.expand(_model(Mixed), allow_new_bias=True)).eval()
    host = reparam.merge(expanded, target="host")
    _model(Mixed).load_state_dict(host.state_dict(), strict=True)


def test_carrier_conv_is_not_expanded_later() -> None:
    expanded = reparam.expand(_model(Separable))
    with pytest.raises(NotMergeableError, match="carries the bias of block dw"):
        reparam.expand(expanded, plan={"pw": "default"})
    with pytest.raises(NotMergeableError, match="carries the bias of block dw"):
        reparam.expand(expanded, plan=lambda path, conv, bn: "default" if path == "pw" else None)
    again = reparam.expand(expanded, include="pw")  # not requested explicitly: skipped with the reason
    assert "pw" not in dict(reparam.iter_blocks(again))


def test_expanding_the_carrier_removes_the_sink() -> None:
    with pytest.raises(NotMergeableError, match=NOWHERE):
        reparam.expand(_model(Separable), plan={"dw": "default", "pw": "default"})
    expanded = reparam.expand(_model(Separable), plan={"dw": "default", "pw": "default"}, allow_new_bias=True)
    blocks = dict(reparam.iter_blocks(expanded))
    assert blocks["pw"].mode == "conv_bn" and blocks["dw"].new_bias and not blocks["dw"].bias_sink


def test_host_merge_refuses_a_missing_sink() -> None:
    expanded = reparam.expand(_model(Mixed)).eval()
    expanded.bn = nn.Identity()
    with pytest.raises(NotMergeableError, match="bias sink 'bn'"):
        reparam.merge(expanded, target="host")
    reparam.merge(expanded, target="deploy")  # the deploy conv simply keeps the bias
    spec = reparam.structure(reparam.expand(_model(Mixed)))
    broken = _model(Mixed)
    broken.bn = nn.Identity()
    with pytest.raises(ReparamError, match="bias sinks the model does not have"):
        reparam.build(broken, spec)
