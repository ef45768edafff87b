"""``reparam.branch_step_scales``: over random expansions (random branch sets, nested growth to a
random budget, frozen parameters), each trainable parameter inside a block is listed with
1 / the product of the branch counts of the blocks that hold it, found here by walking the module
tree; nothing else is listed. And the reason the scale is what it is: a block's merged kernel is
the sum of its branches' kernels, so one SGD step with the scaled gradients moves it by exactly
the sum of each branch's own step at ``lr / B``."""

from __future__ import annotations

import copy

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import reparam
from reparam.block import DiverseBranchBlock
from reparam.flops import model_macs
from reparam.planning import fill_to_budget

KINDS = ("1x1", "1x1_kxk", "1x1_avg", "1xk", "kx1")


def _host() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
        nn.Conv2d(6, 5, 3, padding=1), nn.BatchNorm2d(5), nn.ReLU(),
        nn.Conv2d(5, 4, 1), nn.BatchNorm2d(4),
    ).double()


def _expected(model: nn.Module) -> dict[str, float]:
    out: dict[str, float] = {}

    def walk(module: nn.Module, prefix: str, scale: float) -> None:
        if isinstance(module, DiverseBranchBlock) and len(module.branch_names) > 1:
            scale = scale / len(module.branch_names)
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and scale != 1.0:
                out[prefix + name] = scale
        for name, child in module.named_children():
            walk(child, prefix + name + ".", scale)

    walk(model, "", 1.0)
    return out


@st.composite
def expansions(draw):
    plan = {}
    for path in ("0", "3", "6"):
        kinds = draw(st.lists(st.sampled_from(KINDS), unique=True, max_size=3))
        plan[path] = ("kxk", *kinds)
    grow = draw(st.sampled_from([0.0, 0.0, 1.0, 2.0, 4.0]))
    frozen = draw(st.floats(0.0, 0.3))
    seed = draw(st.integers(0, 2**16))
    return plan, grow, frozen, seed


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(expansions())
def test_scales_are_the_inverse_branch_counts_of_the_holding_blocks(case):
    plan, grow, frozen, seed = case
    torch.manual_seed(seed)
    model = reparam.expand(_host(), plan=plan)
    if grow:
        fill_to_budget(model, model_macs(model, (3, 8, 8)) * (1 + grow), (3, 8, 8), grow_mode="nested")
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if float(torch.rand((), generator=g)) < frozen:
            p.requires_grad_(False)
    got = reparam.branch_step_scales(model)
    assert got == _expected(model)
    names = dict(model.named_parameters())
    assert all(names[n].requires_grad for n in got)
    if any(len(b.branch_names) > 1 for _, b in reparam.iter_blocks(model, nested=True)):
        assert got, "a block with branches lists its trainable parameters"


def test_nothing_is_listed_for_a_model_without_blocks_or_with_anchors_only():
    assert reparam.branch_step_scales(_host()) == {}
    assert reparam.branch_step_scales(reparam.expand(_host(), branches=[])) == {}


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(KINDS), unique=True, min_size=1, max_size=5), st.integers(0, 2**16))
def test_a_scaled_step_moves_the_merged_kernel_by_each_branch_stepping_at_lr_over_b(kinds, seed):
    torch.manual_seed(seed)
    model = reparam.expand(_host(), plan={"0": ("kxk", *kinds)})
    reparam.randomize_bn_(model, torch.Generator().manual_seed(seed))
    block = dict(reparam.iter_blocks(model))["0"]
    with torch.no_grad():  # non-zero branches, so that every branch's step counts
        for p in block.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.eval()
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    model(x).square().sum().backward()
    scales = reparam.branch_step_scales(model)
    lr, n = 0.05, len(block.branch_names)
    with torch.no_grad():
        before = block.get_equivalent_kernel_bias()[0]
    stepped = copy.deepcopy(block)
    with torch.no_grad():
        for (name, p), (qname, q) in zip(model.named_parameters(), stepped.named_parameters(prefix="0")):
            assert qname == name
            q.sub_(lr * scales.get(name, 1.0) * p.grad)
    with torch.no_grad():
        after = stepped.get_equivalent_kernel_bias()[0]
    parts = torch.zeros_like(before)
    for branch in block.branch_names:  # each branch alone, at lr / B
        one = copy.deepcopy(block)
        with torch.no_grad():
            for (_, p), (qname, q) in zip(model.named_parameters(), one.named_parameters(prefix="0")):
                if qname.startswith(f"0.branches.{branch}."):
                    q.sub_(lr / n * p.grad)
        with torch.no_grad():
            parts += one.get_equivalent_kernel_bias()[0] - before
    assert all(abs(s - 1 / n) < 1e-15 for name, s in scales.items() if name.startswith("0."))
    assert reparam.rel_err(after - before, parts) <= 1e-10
    assert float((after - before).abs().max()) > 1e-3 * float(before.abs().max())  # the step moved it
