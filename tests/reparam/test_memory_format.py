"""Expanded blocks in channels-last memory (``model.to(memory_format=torch.channels_last)``, a common
CPU speed-up) train the same function as in the default layout.

Invariant: with every training path on (the kernel choice, patch moments, the fused forward, the
BatchNorm forms), a channels-last block gives the outputs, input and parameter gradients and running
statistics of the same block in the default layout with every path off, to float64 rounding. A
model moved to channels-last memory hands its convolutions weights with channels-last strides, 1×1
ones included; PyTorch's native convolution returns a wrong weight gradient for those, which the
kernel choice must not let through.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from reparam import DiverseBranchBlock, fused, kernels, patchfold
from reparam.testing import randomize_bn_

F64 = torch.float64


def _paths_off() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(fused.fused_training(False))
    stack.enter_context(kernels.native_convs(False))
    stack.enter_context(kernels.batch_norms(False))
    stack.enter_context(patchfold.patch_training(False))
    return stack


def _step(block: nn.Module, x: torch.Tensor, g: torch.Tensor, *, last: bool, reference: bool, input_grad: bool):
    block = copy.deepcopy(block)
    if last:
        block = block.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    x = x.clone().requires_grad_(input_grad)
    with _paths_off() if reference else contextlib.nullcontext():
        out = block(x)
    out.backward(g)
    grads = {n: p.grad for n, p in block.named_parameters() if p.grad is not None}
    buffers = {n: b.clone() for n, b in block.named_buffers()}
    return out.detach(), x.grad, grads, buffers


def _block(gen: torch.Generator, cin: int, cout: int, k: int, padding: int, branches, nest=()) -> nn.Module:
    conv = nn.Conv2d(cin, cout, k, 1, padding, bias=False)
    blk = DiverseBranchBlock.from_conv(conv, nn.BatchNorm2d(cout), branches=list(branches))
    for name in nest:
        blk.grow_nested(name, ["1x1", "1x1_avg"])
    blk = blk.to(F64)
    randomize_bn_(blk, gen)
    with torch.no_grad():
        for p in blk.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=F64) * 0.2)
    return blk.train()


LENET_KINDS = ("1x1", "1x1_kxk", "1x1_avg", "1xk", "kx1")
CASES = {
    # LeNet-5's first conv as DynamicFL grows it, on the data (patch moments, narrow native convs)
    "lenet-first-nested": dict(cin=1, cout=6, k=5, padding=0, hw=14, n=8, branches=LENET_KINDS, nest=("kxk",),
                               input_grad=False, path="patch"),
    # LeNet-5's second conv (6 → 16: narrow 1×1/1×K/K×1 convs on the native kernel, per-branch BatchNorms)
    "lenet-second": dict(cin=6, cout=16, k=5, padding=0, hw=12, n=8, branches=LENET_KINDS, nest=(), input_grad=True,
                         path=None),
    # a ResNet conv on a map large enough for the fused forward (folded BatchNorms, value padding)
    "fused": dict(cin=16, cout=16, k=3, padding=1, hw=64, n=4, branches=("1x1", "1x1_kxk", "1x1_avg", "identity"),
                  nest=(), input_grad=True, path="fused"),
    # a wide conv on 1×1 maps (dead taps cropped, the covering kernel as a matrix product)
    "one-by-one-map": dict(cin=256, cout=256, k=3, padding=1, hw=1, n=128, branches=("1x1", "1x1_kxk", "1x1_avg"),
                           nest=(), input_grad=True, path="fused"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_channels_last_block_trains_the_default_layout_function_in_float64(case: str) -> None:
    spec = CASES[case]
    gen = torch.Generator().manual_seed(7)
    blk = _block(gen, spec["cin"], spec["cout"], spec["k"], spec["padding"], spec["branches"], spec["nest"])
    x = torch.randn(spec["n"], spec["cin"], spec["hw"], spec["hw"], generator=gen, dtype=F64) + 0.3
    with torch.no_grad():
        g = torch.randn_like(copy.deepcopy(blk)(x), dtype=F64)
    usable = {"patch": patchfold.usable, "fused": fused.usable}
    if spec["path"] is not None:  # the path under test runs on the channels-last block
        last = x.clone(memory_format=torch.channels_last).requires_grad_(spec["input_grad"])
        assert usable[spec["path"]](copy.deepcopy(blk).to(memory_format=torch.channels_last), last)
    ref = _step(blk, x, g, last=False, reference=True, input_grad=spec["input_grad"])
    new = _step(blk, x, g, last=True, reference=False, input_grad=spec["input_grad"])

    def rel(a: torch.Tensor, b: torch.Tensor, scale: float | None = None) -> float:
        return float((a - b).abs().max()) / (scale if scale is not None else max(float(b.abs().max()), 1e-300))

    assert rel(new[0], ref[0]) <= 1e-10
    if spec["input_grad"]:
        assert rel(new[1], ref[1]) <= 1e-10
    assert new[2].keys() == ref[2].keys() and len(ref[2]) >= 8
    scale = max(float(v.abs().max()) for v in ref[2].values())
    for name in ref[2]:
        assert rel(new[2][name], ref[2][name], scale) <= 1e-10, name
    for name, b in ref[3].items():
        if b.is_floating_point():
            assert rel(new[3][name], b, max(float(b.abs().max()), 1.0)) <= 1e-10, name
        else:
            assert torch.equal(new[3][name], b), name


def test_the_native_kernel_runs_on_channels_last_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """The case the test above guards: a channels-last model's narrow branch convs take the native
    kernel (so its weight-gradient fault would show)."""
    calls: list[tuple[int, ...]] = []
    native = torch._C._nn.thnn_conv2d

    def counting(x, w, *args):
        calls.append(tuple(w.stride()))
        return native(x, w, *args)

    monkeypatch.setattr(torch._C._nn, "thnn_conv2d", counting)
    spec = CASES["lenet-second"]
    blk = _block(torch.Generator().manual_seed(3), spec["cin"], spec["cout"], spec["k"], 0, spec["branches"])
    blk = blk.to(memory_format=torch.channels_last)
    assert blk.branches["1x1"].conv.weight.stride() != (6, 1, 1, 1)  # channels-last strides on a 1×1 weight
    x = torch.randn(4, 6, 12, 12, dtype=F64).contiguous(memory_format=torch.channels_last)
    blk(x).sum().backward()
    assert calls, "no branch conv took the native kernel"
    # what reaches the kernel has the standard strides
    assert all(s[-1] == 1 for s in calls)
