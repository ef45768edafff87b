"""Expanded blocks in channels-last memory (``model.to(memory_format=torch.channels_last)``, a common
CPU speed-up) train the same function as in the default layout.

Invariant: with every training path on (the kernel choice, patch moments, the fused forward, the
BatchNorm forms), a channels-last block gives the outputs, input and parameter gradients and running
statistics of the same block run per-branch in the default layout, to float64 rounding. A model
moved to channels-last memory hands its convolutions weights with channels-last strides, 1×1 ones
included; PyTorch's native convolution returns a wrong weight gradient for those, which the kernel
choice must not let through.
"""

from __future__ import annotations

import copy

import pytest
import torch

from reparam import fused, patchfold

from _util import expanded_block, step_against_per_branch

F64 = torch.float64
CL = torch.channels_last

LENET_KINDS = ("1x1", "1x1_kxk", "1x1_avg", "1xk", "kx1")
CASES = {
    # LeNet-5's first conv as DynamicFL grows it, on the data (patch moments, narrow native convs)
    "lenet-first-nested": dict(cin=1, cout=6, k=5, padding=0, hw=(14, 14), n=8, branches=LENET_KINDS, nest=("kxk",),
                               input_grad=False, path="patch"),
    # LeNet-5's second conv (6 → 16: narrow 1×1/1×K/K×1 convs on the native kernel, per-branch BatchNorms)
    "lenet-second": dict(cin=6, cout=16, k=5, padding=0, hw=(12, 12), n=8, branches=LENET_KINDS, nest=(),
                         input_grad=True, path=None),
    # a ResNet conv on a map large enough for the fused forward (folded BatchNorms, value padding)
    "fused": dict(cin=16, cout=16, k=3, padding=1, hw=(64, 64), n=4,
                  branches=("1x1", "1x1_kxk", "1x1_avg", "identity"), nest=(), input_grad=True, path="fused"),
    # a wide conv on 1×1 maps (dead taps cropped, the covering kernel as a matrix product)
    "one-by-one-map": dict(cin=256, cout=256, k=3, padding=1, hw=(1, 1), n=128, branches=("1x1", "1x1_kxk", "1x1_avg"),
                           nest=(), input_grad=True, path="fused"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_channels_last_block_trains_the_default_layout_function_in_float64(case: str) -> None:
    spec = dict(CASES[case])
    input_grad, path = spec.pop("input_grad"), spec.pop("path")
    blk, x = expanded_block(torch.Generator().manual_seed(7), spec.pop("branches"), **spec)
    last = copy.deepcopy(blk).to(memory_format=CL)
    if path is not None:  # the path under test runs on the channels-last block
        usable = {"patch": patchfold.usable, "fused": fused.usable}[path]
        assert usable(last, x.clone(memory_format=CL).requires_grad_(input_grad))
    errs, _ = step_against_per_branch(copy.deepcopy(blk), last, x, input_grad=input_grad, buffer_floor=1.0,
                                      new_memory_format=CL)
    assert sum(p.grad is not None for p in last.parameters()) >= 8
    assert max(errs) <= 1e-10


def test_the_native_kernel_runs_on_channels_last_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """The case the test above guards: a channels-last model's narrow branch convs take the native
    kernel (so its weight-gradient fault would show)."""
    calls: list[tuple[int, ...]] = []
    native = torch._C._nn.thnn_conv2d

    def counting(x, w, *args):
        calls.append(tuple(w.stride()))
        return native(x, w, *args)

    monkeypatch.setattr(torch._C._nn, "thnn_conv2d", counting)
    blk, x = expanded_block(torch.Generator().manual_seed(3), LENET_KINDS, cin=6, cout=16, hw=(12, 12), n=4)
    blk = blk.to(memory_format=CL)
    assert blk.branches["1x1"].conv.weight.stride() != (6, 1, 1, 1)  # channels-last strides on a 1×1 weight
    blk(x.contiguous(memory_format=CL)).sum().backward()
    assert calls, "no branch conv took the native kernel"
    # what reaches the kernel has the standard strides
    assert all(s[-1] == 1 for s in calls)
