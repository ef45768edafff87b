"""Hessian-vector products, power iteration, Lanczos and SLQ against dense Hessians of tiny models."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhetero.algorithms.pruning.hessian import (
    dense_hessian,
    hutchinson_traces,
    hvp,
    lanczos,
    layer_top_eigenvalues,
    power_iteration,
    slq,
    slq_density,
    top_eigenvalue,
)


def _tiny(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 4)
    ).double()
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2.0)
        model[1].weight.uniform_(0.5, 1.5)
    x = torch.randn(8, 2, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 4, (8,))
    return model, (x, y)


def _reference_hessian(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Dense eval-mode Hessian by torch.autograd.functional.hessian over the flat parameters."""
    names = [n for n, _ in model.named_parameters()]
    ps = [p.detach() for _, p in model.named_parameters()]
    shapes = [p.shape for p in ps]
    buffers = {n: b.detach() for n, b in model.named_buffers()}
    x, y = batch

    def f(flat: torch.Tensor) -> torch.Tensor:
        parts, i = {}, 0
        for n, s in zip(names, shapes):
            k = int(np.prod(s))
            parts[n] = flat[i : i + k].view(s)
            i += k
        parts.update(buffers)
        model.eval()
        return F.cross_entropy(torch.func.functional_call(model, parts, (x,)), y)

    flat = torch.cat([p.reshape(-1) for p in ps])
    return torch.autograd.functional.hessian(f, flat)


@pytest.fixture(scope="module")
def tiny() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], torch.Tensor, np.ndarray]:
    """One tiny model, its batch, the dense reference Hessian and its eigenvalues (computed once)."""
    model, batch = _tiny(2)
    ref = _reference_hessian(model, batch)
    return model, batch, ref, np.linalg.eigvalsh(ref.numpy())


def test_hvp_matches_dense_hessian_and_restores_mode(tiny) -> None:  # noqa: ANN001
    model, batch, ref, _ = tiny
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    op = hvp(model, F.cross_entropy, batch)
    assert model.training  # mode restored
    h = dense_hessian(op)
    assert h.shape == (op.dim, op.dim) == ref.shape
    assert float((h - ref).abs().max()) <= 1e-12
    assert float((h - h.T).abs().max()) <= 1e-12
    assert all(p.grad is None for p in model.parameters())
    # eval-mode products leave the state (running statistics included) untouched
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    model.eval()


def test_forward_over_reverse_agrees_with_double_backward() -> None:
    model, batch = _tiny(1)
    op1 = hvp(model, F.cross_entropy, batch)
    op2 = hvp(model, F.cross_entropy, batch, method="forward_over_reverse")
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        v = torch.randn(op1.dim, generator=g, dtype=torch.float64)
        assert float((op1(v) - op2(v)).abs().max()) <= 1e-12


def test_power_iteration_top_eigenvalue_matches_eigvalsh(tiny) -> None:  # noqa: ANN001
    model, batch, _, ref = tiny
    dominant = ref[np.argmax(np.abs(ref))]
    g = torch.Generator().manual_seed(3)
    res = power_iteration(hvp(model, F.cross_entropy, batch), iters=600, tol=1e-14, generator=g)
    assert abs(res.eigenvalues[0] - dominant) <= 1e-9 * abs(dominant)
    assert res.iterations[0] < 600  # the tolerance stopped it
    lam = top_eigenvalue(model, F.cross_entropy, batch, iters=600, tol=1e-14,
                         generator=torch.Generator().manual_seed(3))
    assert abs(lam - dominant) <= 1e-9 * abs(dominant)


def test_power_iteration_deflation_and_negative_dominant() -> None:
    # constructed indefinite operator with eigenvalues -5, 3, 1, 0.5, ...
    torch.manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(12, 12, dtype=torch.float64))
    evals = torch.tensor([-5.0, 3.0, 1.0, 0.5] + [0.1] * 8, dtype=torch.float64)
    a = q @ torch.diag(evals) @ q.T

    class Op:
        dim = 12
        dtype = torch.float64
        device = torch.device("cpu")

        def __call__(self, v: torch.Tensor) -> torch.Tensor:
            return a @ v

    res = power_iteration(Op(), iters=400, top_n=2, generator=torch.Generator().manual_seed(1))
    assert abs(res.eigenvalues[0] - (-5.0)) <= 1e-10
    assert abs(res.eigenvalues[1] - 3.0) <= 1e-10
    assert abs(float(res.eigenvectors[0] @ res.eigenvectors[1])) <= 1e-8


def test_lanczos_extremes_and_full_spectrum(tiny) -> None:  # noqa: ANN001
    model, batch, _, ref = tiny
    op = hvp(model, F.cross_entropy, batch)
    res = lanczos(op, steps=40, generator=torch.Generator().manual_seed(0))
    assert res.steps == 40
    assert abs(float(res.ritz_values[-1]) - ref[-1]) <= 1e-9 * abs(ref[-1])
    assert abs(float(res.ritz_values[0]) - ref[0]) <= 1e-6 * abs(ref[-1])
    assert abs(float(res.weights.sum()) - 1.0) <= 1e-12
    # run to breakdown: every Ritz value is an eigenvalue of H
    full = lanczos(op, steps=op.dim, generator=torch.Generator().manual_seed(0))
    dist = np.abs(full.ritz_values.numpy()[:, None] - ref[None, :]).min(1)
    assert dist.max() <= 1e-8 * abs(ref).max()


def test_lanczos_on_diagonal_operator_recovers_eigenvalues() -> None:
    d = torch.tensor([-2.0, -1.0, 0.5, 1.0, 4.0, 7.0], dtype=torch.float64)

    class Op:
        dim = 6
        dtype = torch.float64
        device = torch.device("cpu")

        def __call__(self, v: torch.Tensor) -> torch.Tensor:
            return d * v

    res = lanczos(Op(), steps=6, probe=torch.ones(6, dtype=torch.float64))
    assert torch.allclose(res.ritz_values, d, atol=1e-12, rtol=0)
    # Gauss quadrature of a uniform start vector: weight 1/6 each
    assert torch.allclose(res.weights, torch.full((6,), 1 / 6, dtype=torch.float64), atol=1e-12)


def test_slq_density_normalised_and_peaks_at_ritz_values(tiny) -> None:  # noqa: ANN001
    model, batch, _, _ = tiny
    op = hvp(model, F.cross_entropy, batch)
    sets = slq(op, probes=3, steps=20, generator=torch.Generator().manual_seed(0))
    assert len(sets) == 3
    for _, w in sets:
        assert abs(float(w.sum()) - 1.0) <= 1e-12
    xs, ds = slq_density(sets, grid=2000)
    step = xs[1] - xs[0]
    assert abs(float(ds.sum() * step) - 1.0) <= 1e-12
    lo = min(float(r.min()) for r, _ in sets)
    hi = max(float(r.max()) for r, _ in sets)
    assert abs(xs[0] - (lo - 0.01)) <= 1e-12 and abs(xs[-1] - (hi + 0.01)) <= 1e-12
    # single delta: the smoothed density is a Gaussian of variance var*max(1, b-a)
    xs1, ds1 = slq_density([(torch.tensor([2.0]), torch.tensor([1.0]))], grid=10_001, var=1e-3, pad=0.5)
    assert abs(xs1[np.argmax(ds1)] - 2.0) <= 1e-9
    mean = float((xs1 * ds1).sum() * (xs1[1] - xs1[0]))
    var = float(((xs1 - mean) ** 2 * ds1).sum() * (xs1[1] - xs1[0]))
    assert abs(mean - 2.0) <= 1e-9 and abs(var - 1e-3) <= 1e-6


def test_layer_top_eigenvalues_match_diagonal_blocks(tiny) -> None:  # noqa: ANN001
    model, batch, h, _ = tiny
    sizes = [p.numel() for p in model.parameters()]
    offs = np.cumsum([0] + sizes)
    res = layer_top_eigenvalues(model, F.cross_entropy, batch, iters=600, tol=1e-14,
                                generator=torch.Generator().manual_seed(0))
    assert set(res) == {"0", "4"}
    # "0" = conv weight+bias (params 0,1); "4" = linear weight+bias (params 4,5)
    for name, (a, b) in {"0": (0, 2), "4": (4, 6)}.items():
        block = h[offs[a] : offs[b], offs[a] : offs[b]].numpy()
        ev = np.linalg.eigvalsh(block)
        dom = ev[np.argmax(np.abs(ev))]
        assert abs(res[name] - dom) <= 1e-8 * abs(dom)


def test_hutchinson_traces_unbiased_on_tiny_model(tiny) -> None:  # noqa: ANN001
    model, batch, h, _ = tiny
    op = hvp(model, F.cross_entropy, batch)
    sizes = [p.numel() for p in model.parameters()]
    offs = np.cumsum([0] + sizes)
    probes = 64
    est = hutchinson_traces(op, {"lin": [4, 5]}, probes=probes, generator=torch.Generator().manual_seed(0))
    lo, hi = int(offs[4]), int(offs[6])
    true = float(torch.diagonal(h)[lo:hi].sum())
    # x = vᵀ M v with M = rows of the block: Var = 2 Σ_{i≠j} S_ij², S = (M + Mᵀ)/2 (Rademacher v)
    m = torch.zeros_like(h)
    m[lo:hi] = h[lo:hi]
    sym = (m + m.T) / 2
    std = math.sqrt(2 * float((sym**2).sum() - (torch.diagonal(sym) ** 2).sum()) / probes)
    assert abs(est["lin"] - true) <= 5 * std


def test_bad_inputs_raise_clear_errors() -> None:
    model, batch = _tiny()
    with pytest.raises(ValueError, match="method"):
        hvp(model, F.cross_entropy, batch, method="pyhessian")
    with pytest.raises(TypeError, match="batch"):
        hvp(model, F.cross_entropy, batch[0])  # type: ignore[arg-type]
    op = hvp(model, F.cross_entropy, batch)
    with pytest.raises(ValueError, match="flat tensor"):
        op(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="steps"):
        lanczos(op, steps=0)
    with pytest.raises(ValueError, match="probe"):
        lanczos(op, probe="uniform")
