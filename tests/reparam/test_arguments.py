"""Every public argument of ``reparam.expand`` / ``reparam.merge`` is checked before anything is
done: a bad value raises at once, naming the accepted values, instead of leaving every conv plain
(``expand`` skips a conv whose expansion fails, with the reason, so a bad argument used to return
the model unexpanded, silently)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import reparam
from reparam.block import INITS
from reparam.errors import ReparamError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))


def _blocks(model: nn.Module) -> int:
    return sum(isinstance(m, reparam.DiverseBranchBlock) for m in model.modules())


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"init": "anything-else"}, ["init", "zero_gamma", "random_resolve", "random"]),
        ({"init": 0}, ["init"]),
        ({"anchor_norm": "bogus"}, ["anchor_norm", "frozen_identity"]),
        ({"branches": "no-such-kind"}, ["no-such-kind", "1x1_kxk"]),
        ({"branches": ["1x1", "no-such-kind"]}, ["no-such-kind"]),
        ({"branches": {"1x1_kxk": {"internl": 4}}}, ["internl", "internal"]),
        ({"branches": {"1x1_kxk": 4}}, ["mapping"]),
        ({"branches": 3}, ["branches"]),
        ({"include": 3}, ["include", "glob"]),
        ({"exclude": [1, 2]}, ["exclude"]),
        ({"generator": 7}, ["generator", "torch.Generator"]),
        ({"inplace": "yes"}, ["inplace"]),
        ({"crop": None}, ["crop"]),
        ({"allow_new_bias": 1}, ["allow_new_bias"]),
        ({"from_scratch": "true"}, ["from_scratch"]),
        ({"plan": {"0": ["no-such-kind"]}}, ["plan values", "no-such-kind"]),
    ],
)
def test_a_bad_expand_argument_raises_at_once_naming_what_is_accepted(kwargs, names):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ReparamError) as info:
        reparam.expand(model, inplace=kwargs.pop("inplace", True), **kwargs)
    for name in names:
        assert name in str(info.value)
    assert _blocks(model) == 0  # nothing was changed, even with inplace=True
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"target": "plain"}, ["target", "deploy", "host"]),
        ({"inplace": "no"}, ["inplace"]),
        ({"require_eval": None}, ["require_eval"]),
        ({"compute_dtype": torch.int32}, ["compute_dtype"]),
        ({"compute_dtype": "float64"}, ["compute_dtype"]),
    ],
)
def test_a_bad_merge_argument_raises_at_once(kwargs, names):
    big = reparam.expand(_model()).eval()
    with pytest.raises(ReparamError) as info:
        reparam.merge(big, **kwargs)
    for name in names:
        assert name in str(info.value)
    assert _blocks(big) == 2


def test_merge_refuses_what_is_not_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        reparam.merge("model")  # type: ignore[arg-type]


@pytest.mark.parametrize("init", INITS)
def test_every_init_expands_every_conv_and_merges_exactly(init):
    model = _model().double()
    big = reparam.expand(model, init=init)
    assert _blocks(big) == 2
    x = torch.randn(4, 3, 10, 10, dtype=torch.float64)
    big.train()
    big(x)  # moves every BN's running statistics
    big.eval()
    plain = reparam.merge(big)
    reparam.assert_equivalent(big, plain, x, rtol=1e-10)
    if init == "zero_gamma":  # bit-exact expansion: the function of the untouched model
        model.eval()
        assert torch.equal(reparam.expand(model, init=init).eval()(x), model(x))


def test_init_random_is_the_dbb_set_up_every_branch_ordinary_and_the_anchor_untouched():
    model = _model().double()
    big = reparam.expand(model, init="random", generator=torch.Generator().manual_seed(1))
    x = torch.randn(4, 3, 10, 10, dtype=torch.float64)
    for path in ("0", "3"):
        block = big.get_submodule(path)
        # the anchor is the host conv, unchanged
        assert torch.equal(block.anchor.conv.weight, model.get_submodule(path).weight)
        for name, branch in block.branches.items():
            if name == reparam.kinds.anchor_name():
                continue
            last_bns = [m for m in branch.modules() if isinstance(m, nn.BatchNorm2d)]
            assert last_bns and torch.all(last_bns[-1].weight == 1)  # ordinary γ = 1, not 0
    model.eval(), big.eval()
    assert not torch.allclose(big(x), model(x))  # the function is not kept: nothing to keep


def test_from_scratch_picks_the_measured_init_and_an_explicit_init_wins():
    model = _model().double()
    x = torch.randn(2, 3, 10, 10, dtype=torch.float64)
    g = torch.Generator()
    a = reparam.expand(model, from_scratch=True, generator=g.manual_seed(3)).eval()
    b = reparam.expand(model, init=reparam.SCRATCH_INIT, generator=g.manual_seed(3)).eval()
    assert torch.equal(a(x), b(x))
    c = reparam.expand(model, from_scratch=True, init="zero_gamma").eval()
    assert torch.equal(c(x), model.eval()(x))
