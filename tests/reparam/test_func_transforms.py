"""Expanded models under ``torch.func`` transforms (``grad``, ``vmap``, ``jvp``: per-sample
gradients, Jacobians, functional training), as the plain model runs under them.

Invariants: ``torch.func.grad`` of a loss through ``functional_call`` equals ordinary autograd's
gradient; ``vmap`` of it over the batch gives each sample's gradient (that of a batch of one);
``jvp`` along a parameter tangent equals the gradient's inner product with it. The kernel choices,
BatchNorm forms, patch moments and the fused forward step aside under a transform (their own
operators are the modules' as far as the transform can see); the always-used value padding and mean
filter carry ``torch.func`` support themselves.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jvp, replace_all_batch_norm_modules_, vmap

import reparam
from reparam import DiverseBranchBlock, kernels
from reparam.testing import perturb_

F64 = torch.float64


class _Net(nn.Module):
    """A padded expanded conv (value padding, pooling windows) and an unpadded one (input windows),
    then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = DiverseBranchBlock.from_conv(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), "all")
        self.b = DiverseBranchBlock.from_conv(nn.Conv2d(8, 6, 3, bias=False), nn.BatchNorm2d(6),
                                              ["1x1", "1x1_kxk", "1x1_avg", "1xk", "kx1"])
        self.head = nn.Linear(6 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.b(F.relu(self.a(x)))).flatten(1))


def _lenet() -> nn.Module:
    from fedhetero.models import build_model

    return reparam.expand(build_model("lenet5", num_classes=5, in_channels=1))


MODELS = {"padded-and-unpadded": (_Net, (3, 8, 8)), "lenet5": (_lenet, (1, 32, 32))}


def _setup(name: str, train: bool):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make()
    perturb_(model, torch.Generator().manual_seed(1))
    model = model.to(F64)
    if train:
        replace_all_batch_norm_modules_(model)  # batch statistics, no buffers mutated under the transform
    model.train(train)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, *shape, generator=gen, dtype=F64)
    y = torch.randint(0, 5, (4,), generator=gen)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xb, yb):
        return F.cross_entropy(functional_call(model, p, (xb,)), yb)

    return model, x, y, params, loss


def _autograd(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    m = copy.deepcopy(model)
    F.cross_entropy(m(x), y).backward()
    return {k: p.grad for k, p in m.named_parameters() if p.grad is not None}


def _err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    scale = max(float(v.abs().max()) for v in b.values())
    return max(float((a[k] - b[k]).abs().max()) for k in b) / scale


CASES = [("padded-and-unpadded", False), ("lenet5", False), ("lenet5", True)]


@pytest.mark.parametrize("name,train", CASES)
def test_func_grad_equals_autograd_in_float64(name: str, train: bool) -> None:
    model, x, y, params, loss = _setup(name, train)
    g = grad(loss)(params, x, y)
    ref = _autograd(model, x, y)
    assert ref.keys() <= g.keys() and len(ref) >= 20
    assert _err(g, ref) <= 1e-12


@pytest.mark.parametrize("name,train", CASES)
def test_vmap_gives_each_sample_its_gradient(name: str, train: bool) -> None:
    model, x, y, params, loss = _setup(name, train)
    per_sample = vmap(grad(lambda p, xb, yb: loss(p, xb[None], yb[None])), in_dims=(None, 0, 0))(params, x, y)
    for i in (0, 3):
        one = _autograd(model, x[i : i + 1], y[i : i + 1])
        assert _err({k: v[i] for k, v in per_sample.items()}, one) <= 1e-12


@pytest.mark.parametrize("name,train", CASES)
def test_jvp_is_the_gradient_along_the_tangent(name: str, train: bool) -> None:
    model, x, y, params, loss = _setup(name, train)
    gen = torch.Generator().manual_seed(3)
    tangent = {k: torch.randn(v.shape, generator=gen, dtype=F64) for k, v in params.items()}
    _, directional = jvp(lambda p: loss(p, x, y), (params,), (tangent,))
    ref = _autograd(model, x, y)
    expected = sum(float((ref[k] * tangent[k]).sum()) for k in ref)
    assert abs(float(directional) - expected) <= 1e-10 * max(1.0, abs(expected))


def test_the_kernel_choices_step_aside_under_a_transform() -> None:
    seen: list[bool] = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(kernels.plain_context(x))
        return x.sum()

    x = torch.randn(2, 3, 4, 4)
    probe(x)
    grad(probe)(x)
    vmap(probe)(x)
    assert seen == [True, False, False]


def test_value_padding_without_running_statistics_says_what_it_needs() -> None:
    """With its BatchNorms replaced (no running statistics) a padded ``1x1_kxk`` branch has no pad
    value: one clear error, under a transform or not."""
    model, x, y, params, loss = _setup("padded-and-unpadded", True)
    with pytest.raises(reparam.ReparamError, match="track_running_stats"):
        model(x)
    with pytest.raises(reparam.ReparamError, match="track_running_stats"):
        grad(loss)(params, x, y)


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_mode_ad_along_the_input_is_the_input_gradient_along_it(name: str) -> None:
    """Forward-mode AD (``torch.autograd.forward_ad``, outside ``torch.func``) with a tangent on the
    input alone (the pad values, computed from BatchNorm parameters, get zero tangents)."""
    import torch.autograd.forward_ad as fwad

    model, x, y, _, _ = _setup(name, False)
    t = torch.randn(x.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    with fwad.dual_level(), torch.no_grad():
        directional = fwad.unpack_dual(F.cross_entropy(model(fwad.make_dual(x, t)), y)).tangent
    xr = x.clone().requires_grad_()
    F.cross_entropy(copy.deepcopy(model)(xr), y).backward()
    expected = float((xr.grad * t).sum())
    assert abs(float(directional) - expected) <= 1e-10 * max(1.0, abs(expected))
