"""The branch-kind registry: a kind defined and registered in this file (one class plus one
registration) is picked up by the block (construction, growth, merge, fold, specs), by the FLOPs
formulas and by DYMM (plans and growth), and the registry refuses what would corrupt it.

The toy kind is a ``(K − 2) × (K − 2)`` conv centred in the main ``K × K`` kernel (on the input
window :func:`reparam.transforms.branch_window` gives) followed by a BN. Its module implements only
``forward``, ``equivalent_kernel_bias`` and ``last_bn``, so merges go through the registry's generic
accumulation path.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import reparam
from reparam import DiverseBranchBlock, KINDS
from reparam.dymm import applicable_kinds, dymm, plan_bottom_up
from reparam.errors import AlignmentError, ReparamError
from reparam.flops import block_macs, branch_macs, conv_macs, model_macs
from reparam.geometry import ConvGeometry
from reparam.testing import randomize_bn_, rel_err
from reparam.transforms import branch_window, embed_kernel, fuse_bn, window_input

F64 = torch.float64


class InnerConvBranch(nn.Module):
    """``window → conv (K−2)×(K−2), padding 0, main stride and dilation → BN``."""

    def __init__(self, main: ConvGeometry, bn: nn.BatchNorm2d, factory: Mapping[str, Any]) -> None:
        super().__init__()
        kh, kw = main.kernel_size[0] - 2, main.kernel_size[1] - 2
        self.window = branch_window(main, (kh, kw), (1, 1))
        self.conv = nn.Conv2d(main.in_channels, main.out_channels, (kh, kw), main.stride, 0, main.dilation,
                              main.groups, bias=False, **factory)
        self.bn = bn

    @property
    def last_bn(self) -> nn.Module:
        return self.bn

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(self.conv(window_input(x, self.window)))

    def equivalent_kernel_bias(self, geometry: ConvGeometry, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        w = self.conv.weight if dtype is None else self.conv.weight.to(dtype)
        k, b = fuse_bn(w, None, self.bn)
        return embed_kernel(k, geometry.kernel_size, (1, 1)), b


class InnerConvKind(reparam.BranchKind):
    name = "inner"
    in_first_plan = True  # DYMM's first-round plan offers it with the full set

    def reason(self, main: ConvGeometry, *, crop: bool = True) -> str | None:
        if min(main.kernel_size) < 3:
            return f"inner: needs a kernel of at least 3x3, got {main.kernel_size}"
        if main.padding_mode != "zeros":
            return "inner: zero padding only"
        window = branch_window(main, (main.kernel_size[0] - 2, main.kernel_size[1] - 2), (1, 1))
        if not crop and any(v < 0 for side in window for v in side):
            return "inner: needs an input crop"
        return None

    def build(self, main, *, eps, momentum, factory, generator, crop, options) -> nn.Module:  # type: ignore[no-untyped-def]
        bn = nn.BatchNorm2d(main.out_channels, eps=eps, momentum=momentum, **factory)
        return InnerConvBranch(main, bn, factory)

    def macs(self, geometry: Any, in_hw, out_hw, options) -> int:  # type: ignore[no-untyped-def]
        kh, kw = geometry.kernel_size
        return out_hw[0] * out_hw[1] * geometry.out_channels * (geometry.in_channels // geometry.groups) * (kh - 2) * (kw - 2)


@pytest.fixture
def inner():
    with reparam.kind_registered(InnerConvKind()) as kind:
        yield kind
    assert reparam.kind_names() == KINDS  # gone again


def _layer(cin, cout, k, s, p, gen, hw=(11, 10), d=1):
    conv = nn.Conv2d(cin, cout, k, s, p, d, bias=False).to(F64)
    with torch.no_grad():
        conv.weight.normal_(0, 0.3, generator=gen)
    bn = nn.BatchNorm2d(cout).to(F64)
    randomize_bn_(bn, gen)
    return conv, bn, torch.randn(2, cin, *hw, generator=gen, dtype=F64)


def _perturb(block: nn.Module, gen: torch.Generator) -> None:
    randomize_bn_(block, gen)


def test_registry_lists_orders_and_refuses(inner) -> None:
    assert reparam.kind_names() == (*KINDS, "inner")  # default order: after the built-ins
    assert reparam.get_kind("inner") is inner
    with pytest.raises(ReparamError, match="already registered"):
        reparam.register_kind(InnerConvKind())
    with pytest.raises(ReparamError, match="built in"):
        reparam.unregister_kind("1x1")
    with pytest.raises(ReparamError, match="built in"):
        reparam.register_kind(type("Fake", (InnerConvKind,), {"name": "1x1"})())
    with pytest.raises(ReparamError, match="already registered"):
        reparam.register_kind(InnerConvKind)  # the decorator form registers an instance of the class
    with pytest.raises(ReparamError, match="one anchor"):
        reparam.register_kind(type("SecondAnchor", (InnerConvKind,), {"name": "anchor2", "anchor": True})())
    assert reparam.kinds.anchor_name() == "kxk"
    with pytest.raises(ReparamError, match="name"):
        reparam.register_kind(type("Dotted", (InnerConvKind,), {"name": "a.b"})())
    with pytest.raises(ReparamError, match="unknown branch kind"):
        reparam.get_kind("3x3")
    replacement = reparam.register_kind(InnerConvKind(), replace=True)
    assert reparam.get_kind("inner") is replacement
    reparam.register_kind(inner, replace=True)  # the fixture unregisters its own instance


@pytest.mark.parametrize("k, s, p", [(5, 1, 0), (5, 2, 2), (3, 1, 1), (5, 1, 1)])
def test_block_uses_a_registered_kind(inner, k, s, p, gen) -> None:
    conv, bn, x = _layer(6, 8, k, s, p, gen)
    ref = nn.Sequential(copy.deepcopy(conv), copy.deepcopy(bn))
    block = DiverseBranchBlock.from_conv(conv, bn, ["kxk", "1x1", "inner"])
    assert block.branch_names == ["kxk", "1x1", "inner"]
    assert "inner" in block.applicable() and "inner" in applicable_kinds(block.geometry)
    for train in (True, False):  # zero-γ expansion: bit-exact in both modes
        assert torch.equal(copy.deepcopy(ref).train(train)(x), copy.deepcopy(block).train(train)(x))
    _perturb(block, gen)
    block.eval()
    with torch.no_grad():
        y = block(x)
        assert rel_err(block.merge()(x), y) <= 1e-10  # merged through the generic accumulation
        k_eq, b_eq = block.get_equivalent_kernel_bias()
        assert rel_err(F.conv2d(x, k_eq, b_eq, s, p), y) <= 1e-10
    # the branch's conv stage equals its embedding under the main geometry (train-mode BN sees it)
    branch = block.branches["inner"]
    emb = embed_kernel(branch.conv.weight, (k, k), (1, 1))
    with torch.no_grad():
        assert rel_err(branch.conv(window_input(x, branch.window)), F.conv2d(x, emb, None, s, p)) <= 1e-10
    # fold it into the anchor (eval-exact), grow it back (bit-exact), specs round-trip
    block.remove_branch("inner")
    with torch.no_grad():
        assert rel_err(block(x), y) <= 1e-10
    before = copy.deepcopy(block)
    change = block.add_branch("inner", generator=gen)
    assert {id(p) for p, _ in change.added} == {id(p) for p in block.branches["inner"].parameters()}
    with torch.no_grad():
        assert torch.equal(before(x), block(x))
    assert block.spec()["branches"]["inner"] == {}
    assert "inner" in DiverseBranchBlock.from_conv(copy.deepcopy(conv), copy.deepcopy(bn), "all").branch_names


def test_model_specs_and_state_dicts_round_trip_with_a_registered_kind(inner, gen) -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 5, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)).to(F64)
    big = reparam.expand(model, plan={"0": ["kxk", "inner"], "3": ["kxk", "inner", "identity"]})
    randomize_bn_(big, gen)
    spec = reparam.structure(big)
    assert set(spec["blocks"]["0"]["branches"]) == {"kxk", "inner"}
    assert set(spec["blocks"]["3"]["branches"]) == {"kxk", "inner", "identity"}
    rebuilt = reparam.build(copy.deepcopy(model), spec)
    rebuilt.load_state_dict(big.state_dict(), strict=True)
    x = torch.randn(2, 3, 12, 12, generator=gen, dtype=F64)
    big.eval()
    rebuilt.eval()
    with torch.no_grad():
        y = big(x)
        assert torch.equal(rebuilt(x), y)
        assert rel_err(reparam.merge(big)(x), y) <= 1e-10
        deploy_sd = reparam.merge_state_dict(big.state_dict(), spec)
        plain = reparam.merge(copy.deepcopy(big))
        plain.load_state_dict(deploy_sd, strict=True)
        assert rel_err(plain(x), y) <= 1e-10


def test_flops_use_the_kinds_formula(inner, gen) -> None:
    conv, bn, _ = _layer(6, 8, 5, 1, 0, gen, hw=(12, 12))
    geo = ConvGeometry.from_conv(conv)
    assert branch_macs("inner", geo, (12, 12)) == 8 * 8 * 8 * 6 * 9
    block = DiverseBranchBlock.from_conv(conv, bn, ["kxk", "inner"])
    expected = conv_macs(geo, (12, 12)) + branch_macs("inner", geo, (12, 12))
    assert block_macs(block, (12, 12)) == expected == model_macs(block, (6, 12, 12))
    with pytest.raises(ValueError, match="kind must be one of"):
        branch_macs("3x3", geo, (12, 12))


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 5, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    ).to(F64)


def test_dymm_plans_and_grows_a_registered_kind(inner, gen) -> None:
    shape = (3, 12, 12)
    plain = _net().eval()
    base = model_macs(plain, shape)
    plan = plan_bottom_up(plain, 10 * base, shape)
    assert all("inner" in kinds for kinds in plan.values())  # in_first_plan: part of the full set
    # growth: block "0" holds an important branch; the default pool holds every growable kind
    model = reparam.expand(plain, plan={"0": ["kxk", "1x1"], "3": ["kxk", "1x1"]})
    randomize_bn_(model, gen)
    model.eval()
    x = torch.randn(2, *shape, generator=gen, dtype=F64)
    with torch.no_grad():
        y = model(x)
    s_l = {("0", "1x1"): 0.1, ("3", "1x1"): 1.0}
    s_g = {("0", "1x1"): 10.0, ("3", "1x1"): 1.0}
    report = dymm(model, s_l, s_g, 10 * base, shape)
    assert ("0", "inner") in report.grown
    assert report.macs_after == model_macs(model, shape) <= 10 * base
    with torch.no_grad():
        assert torch.equal(model(x), y)  # zero-γ growth leaves the function bit-exact
    # a pool without it leaves it out
    model2 = reparam.expand(plain, plan={"0": ["kxk", "1x1"], "3": ["kxk", "1x1"]})
    report2 = dymm(model2, s_l, s_g, 10 * base, shape, pool=["1x1_kxk"])
    assert ("0", "inner") not in report2.grown and ("0", "1x1_kxk") in report2.grown


def test_inapplicable_registered_kind_is_refused(inner, gen) -> None:
    conv, bn, _ = _layer(6, 8, (1, 3), 1, (0, 1), gen)
    with pytest.raises(AlignmentError, match="inner"):
        DiverseBranchBlock.from_conv(conv, bn, ["kxk", "inner"])
    assert "inner" not in DiverseBranchBlock.from_conv(copy.deepcopy(conv), copy.deepcopy(bn), "all").branch_names


def test_a_kind_registers_with_a_decorator() -> None:
    """``@register_kind`` on a kind class registers an instance of it and leaves the class."""

    @reparam.register_kind
    class Decorated(InnerConvKind):
        name = "decorated_test"

    try:
        assert isinstance(reparam.get_kind("decorated_test"), Decorated)
        assert "decorated_test" in reparam.kind_names()
    finally:
        reparam.unregister_kind("decorated_test")
