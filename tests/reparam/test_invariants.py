"""Unit tests of reparam.invariants: each check passes on a consistent model/optimizer and fires,
naming what broke, on a constructed violation (a missing parameter, a stale one, one held twice,
optimizer state of a parameter the optimizer no longer holds, a trainable parameter without a
gradient, two different functions, a REP that grew an anchor conv)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import reparam
from reparam.invariants import (
    InvariantError,
    check_gradients,
    check_optimizer,
    check_same_function,
    function_error,
    optimizer_mismatch,
)

F64 = torch.float64


class Tiny(nn.Module):
    """conv → BN → linear, plus a tied parameter, a frozen one and one that is never used."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.conv = nn.Conv2d(2, 3, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 4 * 4, 2)
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)
        self.unused = nn.Parameter(torch.zeros(5))
        self.tied = self.fc  # the same module under a second name: its parameters count once
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tied(self.bn(self.conv(x)).flatten(1)) * self.frozen


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _empty_mismatch() -> dict[str, list[str]]:
    return {"missing": [], "stale": [], "duplicated": [], "orphan_state": []}


def _stepped(model: nn.Module, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    model(torch.randn(2, 2, 4, 4, dtype=F64)).sum().backward()
    opt.step()
    return opt


def test_check_optimizer_passes_when_the_optimizer_holds_exactly_the_trainable_parameters() -> None:
    model = Tiny().double()
    opt = _stepped(model, _trainable(model))
    assert len(opt.state) > 0  # momentum buffers exist, all of held parameters
    assert optimizer_mismatch(model, opt) == _empty_mismatch()
    check_optimizer(model, opt)
    # two groups splitting the parameters are fine too
    params = _trainable(model)
    two = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:], "lr": 0.01}], lr=0.1)
    check_optimizer(model, two)


def test_missing_parameter_is_named() -> None:
    model = Tiny().double()
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if n != "bn.bias" and p.requires_grad], lr=0.1)
    bad = optimizer_mismatch(model, opt)
    assert bad == {**_empty_mismatch(), "missing": ["bn.bias"]}
    with pytest.raises(InvariantError, match=r"optimizer out of step with the model after growth: missing bn\.bias"):
        check_optimizer(model, opt, where="growth")


def test_stale_parameters_are_named_whether_foreign_or_frozen() -> None:
    model = Tiny().double()
    gone = nn.Parameter(torch.zeros(7, 2, dtype=F64))  # e.g. a folded branch's weight
    opt = torch.optim.SGD(_trainable(model) + [gone], lr=0.1)
    assert optimizer_mismatch(model, opt) == {**_empty_mismatch(), "stale": ["<not in the model, shape (7, 2)>"]}
    with pytest.raises(InvariantError, match=r"stale <not in the model, shape \(7, 2\)>"):
        check_optimizer(model, opt)
    # a model parameter that is frozen is not trainable: holding it is stale as well
    frozen = torch.optim.SGD(_trainable(model) + [model.frozen], lr=0.1)
    assert optimizer_mismatch(model, frozen)["stale"] == ["frozen"]
    with pytest.raises(InvariantError, match="stale frozen"):
        check_optimizer(model, frozen)


def test_duplicated_parameter_is_named() -> None:
    model = Tiny().double()
    params = _trainable(model)
    opt = torch.optim.SGD([{"params": params}], lr=0.1)
    opt.param_groups[0]["params"].append(model.conv.weight)  # torch refuses this at construction
    assert optimizer_mismatch(model, opt) == {**_empty_mismatch(), "duplicated": ["conv.weight"]}
    with pytest.raises(InvariantError, match=r"duplicated conv\.weight"):
        check_optimizer(model, opt)
    # held twice across two groups
    opt2 = torch.optim.SGD([{"params": params}, {"params": [nn.Parameter(torch.zeros(1))]}], lr=0.1)
    opt2.param_groups[1]["params"] = [model.fc.bias]
    bad = optimizer_mismatch(model, opt2)
    assert bad["duplicated"] == ["fc.bias"] and bad["missing"] == bad["stale"] == []


def test_orphan_state_is_reported() -> None:
    model = Tiny().double()
    params = _trainable(model)
    opt = _stepped(model, params)
    # a removal that drops the parameter from its group but forgets its momentum buffer
    opt.param_groups[0]["params"] = [p for p in opt.param_groups[0]["params"] if p is not model.conv.weight]
    bad = optimizer_mismatch(model, opt)
    assert bad["orphan_state"] == ["shape (3, 2, 3, 3)"] and bad["missing"] == ["conv.weight"]
    with pytest.raises(InvariantError, match=r"orphan_state shape \(3, 2, 3, 3\)"):
        check_optimizer(model, opt)
    # state only (the parameter is held by the model but the optimizer keeps state of a stranger)
    opt = _stepped(model, params)
    stranger = nn.Parameter(torch.zeros(4, dtype=F64))
    opt.state[stranger] = {"momentum_buffer": torch.zeros(4, dtype=F64)}
    assert optimizer_mismatch(model, opt) == {**_empty_mismatch(), "orphan_state": ["shape (4,)"]}
    with pytest.raises(InvariantError, match="orphan_state"):
        check_optimizer(model, opt)


def test_long_lists_are_summarised() -> None:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(InvariantError, match=r"missing 0\.bias, 0\.weight, 1\.bias, 1\.weight, … \(8 in all\)"):
        check_optimizer(model, opt)


def test_check_gradients() -> None:
    model = Tiny().double()
    x = torch.randn(2, 2, 4, 4, dtype=F64)
    model(x).sum().backward()
    # ``unused`` is outside the graph
    with pytest.raises(InvariantError, match=r"trainable parameters without a gradient after step 3: unused"):
        check_gradients(model, where="step 3")
    model.unused.requires_grad_(False)  # frozen parameters need no gradient
    check_gradients(model)
    # a zero gradient is a gradient
    model.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in _trainable(model))
    check_gradients(model)
    # set_to_none: every trainable parameter lacks one
    model.zero_grad(set_to_none=True)
    with pytest.raises(InvariantError, match="without a gradient: conv.weight"):
        check_gradients(model)


def _pair_models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 2, 1)).double()
    reparam.testing.randomize_bn_(a, torch.Generator().manual_seed(1))
    return a, copy.deepcopy(a)


def test_check_same_function_passes_on_equal_functions_and_leaves_the_models_alone() -> None:
    a, b = _pair_models()
    a.train()
    b.train()
    x = torch.randn(2, 2, 5, 5, dtype=F64)
    before = {k: v.clone() for k, v in a.state_dict().items()}
    assert check_same_function(a, b, x) == 0.0
    assert a.training and b.training  # compared on eval-mode copies
    assert all(torch.equal(before[k], v) for k, v in a.state_dict().items())  # no running-stat update
    # the merged (deploy) model is a different parameterisation of the same eval function
    merged = reparam.merge(copy.deepcopy(a).eval(), target="deploy")
    err = check_same_function(merged, a, x)
    assert 0.0 <= err <= 1e-10
    assert function_error(merged, a, [x]) == err  # inputs as a list


def test_check_same_function_fires_on_different_functions() -> None:
    a, b = _pair_models()
    x = torch.randn(2, 2, 5, 5, dtype=F64)
    with torch.no_grad():
        b[0].weight[0, 0, 1, 1] += 1e-6  # a tiny but real change of the function
    err = function_error(b, a, x)
    assert 1e-10 < err < 1e-4
    msg = r"functions differ after REP: relative error .* > 1e-10 \(torch.float64\)"
    with pytest.raises(InvariantError, match=msg):
        check_same_function(b, a, x, where="after REP")
    assert check_same_function(b, a, x, rtol=1e-4) == err  # an explicit, looser tolerance
    # float32 models compare at the float32 tolerance, or at float64 when asked
    a32, b32 = copy.deepcopy(a).float(), copy.deepcopy(b).float()
    with pytest.raises(InvariantError, match="float32"):
        check_same_function(b32, a32, x.float(), rtol=1e-7)
    with pytest.raises(InvariantError, match="float64"):
        check_same_function(b32, a32, x, dtype=F64)
    # train-mode differences (batch statistics) do not matter, eval-mode ones do
    c = copy.deepcopy(a)
    with torch.no_grad():
        c[1].running_mean += 0.5
    with pytest.raises(InvariantError):
        check_same_function(c, a, x)


def test_invariant_error_is_a_reparam_error() -> None:
    assert issubclass(InvariantError, reparam.ReparamError)
    assert issubclass(InvariantError, ValueError)
    assert reparam.InvariantError is InvariantError


def test_check_anchor_scale_passes_on_a_rescale_rep_and_names_a_block_whose_anchor_grew() -> None:
    from reparam.invariants import anchor_filter_norms, check_anchor_scale

    torch.manual_seed(0)
    host = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)).double()
    model = reparam.expand(host, branches="default").eval()
    reparam.testing.randomize_bn_(model, torch.Generator().manual_seed(1))
    model[3].grow_nested("kxk")  # a nested anchor counts by its merged kernel
    plain = reparam.merge(copy.deepcopy(model), target="deploy")
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(3.0)  # a global model far larger than the client's own
    before = anchor_filter_norms(model)
    assert set(before) == {"0", "3"} and all(v.shape == (4,) for v in before.values())
    grown = copy.deepcopy(model)
    reparam.rep_to_local(plain, model, anchor_stats="rescale")
    check_anchor_scale(before, model, where="after REP")
    reparam.rep_to_local(plain, grown, anchor_stats="keep")
    with pytest.raises(InvariantError, match=r"anchor conv filters grew after REP: 0 \(x[0-9.]+\), 3 \(x"):
        check_anchor_scale(before, grown, where="after REP")
