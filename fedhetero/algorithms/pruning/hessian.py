"""Hessian utilities built on Hessian-vector products (no third-party Hessian library).

Everything here works on *flat* vectors: a parameter list ``[p_1, ..., p_n]`` is identified with the
concatenation of the flattened tensors, in that order. The central object is
:class:`HessianVectorProduct`, the linear operator ``v -> H v`` of a loss on **one fixed batch**
(resampling the batch between products would break power iteration and Lanczos).

- :func:`hvp` builds the operator (double backward, or forward-over-reverse through ``torch.func``).
- :func:`power_iteration` finds the eigenvalues of largest magnitude (with deflation).
- :func:`lanczos` runs Lanczos with full re-orthogonalisation and returns Ritz values and weights.
- :func:`slq` / :func:`slq_density` give the stochastic-Lanczos-quadrature spectral density,
  Gaussian-smoothed on a grid (the quantity FedAP's ``slq_plateau`` rule scans).
- :func:`top_eigenvalue` / :func:`layer_top_eigenvalues` are the whole-model and per-layer
  (block-diagonal ``H_ll``) conveniences; :func:`hutchinson_traces` estimates per-layer traces.

Guarantees: products are exact Hessian-vector products of the loss at the stored batch (up to
floating-point rounding, computed in the parameters' dtype). The model is evaluated in ``eval()``
mode unless ``train=True``; its previous mode is restored before :func:`hvp` returns, and no
``.grad`` attribute is touched (``torch.autograd.grad`` is used throughout).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

__all__ = [
    "HessianVectorProduct",
    "PowerIterationResult",
    "LanczosResult",
    "hvp",
    "power_iteration",
    "lanczos",
    "slq",
    "slq_density",
    "top_eigenvalue",
    "layer_top_eigenvalues",
    "layer_parameter_groups",
    "hutchinson_traces",
    "dense_hessian",
]

LossFn = Callable[[Tensor, Tensor], Tensor]
Operator = Callable[[Tensor], Tensor]

_METHODS = ("double_backward", "forward_over_reverse")
_PROBES = ("rademacher", "gaussian")


def _flatten(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _split_like(vec: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    out, start = [], 0
    for t in like:
        n = t.numel()
        out.append(vec[start : start + n].view_as(t))
        start += n
    return out


class HessianVectorProduct:
    """The operator ``v -> H v`` of ``loss_fn(model(inputs), targets)`` w.r.t. ``params``.

    Build it with :func:`hvp`. ``op(v)`` takes and returns a flat vector of length :attr:`dim` in
    :attr:`dtype` on :attr:`device`; the batch is fixed at construction. ``op.restrict(indices)``
    gives the block-diagonal operator of a subset of the parameters (``H_ll``) sharing the same
    first-order graph, so per-layer products cost no additional forward pass. Call :meth:`close`
    (or use the operator as a context manager) to free the stored graph early.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        grads: Sequence[Tensor] | None,
        *,
        functional: Callable[[Sequence[Tensor]], Tensor] | None = None,
        loss: float = float("nan"),
    ) -> None:
        self.params: list[Tensor] = list(params)
        self._grads = None if grads is None else list(grads)
        self._functional = functional
        self.loss = loss
        self.dim = int(sum(p.numel() for p in self.params))
        self.dtype = self.params[0].dtype
        self.device = self.params[0].device
        self.calls = 0

    # ------------------------------------------------------------------ operator
    def __call__(self, v: Tensor) -> Tensor:
        if not isinstance(v, Tensor) or v.dim() != 1 or v.numel() != self.dim:
            raise ValueError(f"v must be a flat tensor with {self.dim} entries, got "
                             f"{tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__}")
        v = v.to(dtype=self.dtype, device=self.device)
        parts = _split_like(v, self.params)
        self.calls += 1
        if self._functional is not None:
            return self._forward_over_reverse(parts)
        if self._grads is None:
            raise RuntimeError("this HessianVectorProduct was closed")
        live = [i for i, g in enumerate(self._grads) if g.requires_grad]
        result = [torch.zeros_like(p) for p in self.params]
        if live:
            hv = torch.autograd.grad([self._grads[i] for i in live], self.params,
                                     grad_outputs=[parts[i] for i in live], retain_graph=True,
                                     allow_unused=True)
            result = [r if h is None else h for h, r in zip(hv, result)]
        return _flatten(result).detach()

    def _forward_over_reverse(self, parts: list[Tensor]) -> Tensor:
        functional = self._functional
        assert functional is not None
        primals = tuple(p.detach() for p in self.params)
        grad_fn = torch.func.grad(lambda ps: functional(ps))
        tangent_out = torch.func.jvp(grad_fn, (primals,), (tuple(parts),))[1]  # (output, tangent)
        return _flatten(list(tangent_out)).detach()

    def restrict(self, indices: Sequence[int]) -> "HessianVectorProduct":
        """Block-diagonal operator ``H_SS`` for the parameters ``[params[i] for i in indices]``."""
        idx = list(indices)
        if not idx or any(not 0 <= i < len(self.params) for i in idx):
            raise ValueError(f"indices must be a non-empty list of positions in 0..{len(self.params) - 1}")
        if self._functional is not None:
            raise ValueError("restrict() needs method='double_backward'")
        if self._grads is None:
            raise RuntimeError("this HessianVectorProduct was closed")
        return HessianVectorProduct([self.params[i] for i in idx], [self._grads[i] for i in idx],
                                    loss=self.loss)

    def close(self) -> None:
        """Drop the stored first-order graph (the operator becomes unusable)."""
        self._grads = None
        self._functional = None

    def __enter__(self) -> "HessianVectorProduct":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_loss_inputs(model: nn.Module, batch: Any) -> tuple[Tensor, Tensor]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError("batch must be a pair (inputs, targets)")
    x, y = batch
    if not isinstance(x, Tensor) or not isinstance(y, Tensor):
        raise TypeError("batch must be a pair of tensors (inputs, targets)")
    return x, y


def _resolve_params(model: nn.Module, params: Iterable[Tensor] | None) -> list[Tensor]:
    plist: list[Tensor]
    if params is None:
        plist = [p for p in model.parameters() if p.requires_grad]
    else:
        plist = list(params)
    if not plist:
        raise ValueError("params is empty: no trainable parameters to differentiate")
    for p in plist:
        if not isinstance(p, Tensor) or not p.requires_grad:
            raise ValueError("params must be tensors with requires_grad=True")
    dtypes = {p.dtype for p in plist}
    if len(dtypes) != 1:
        raise ValueError(f"params must share one dtype, got {sorted(map(str, dtypes))}")
    return plist


def hvp(
    model: nn.Module,
    loss_fn: LossFn,
    batch: tuple[Tensor, Tensor],
    params: Iterable[Tensor] | None = None,
    *,
    train: bool = False,
    method: str = "double_backward",
) -> HessianVectorProduct:
    """Hessian-vector-product operator of ``loss_fn(model(x), y)`` on one fixed batch.

    Parameters
    ----------
    model, loss_fn, batch:
        The loss is ``loss_fn(model(x), y)`` with ``(x, y) = batch`` (use a mean loss).
    params:
        Parameters to differentiate (default: every parameter with ``requires_grad``), in order;
        they define the flat-vector layout. They must share one dtype.
    train:
        ``False`` (default) evaluates in ``eval()`` mode (running BN statistics); ``True`` uses
        train mode (batch statistics of this one batch; running statistics are updated once by the
        single forward pass of the ``double_backward`` method). The previous mode is restored.
    method:
        ``"double_backward"`` (one forward and one ``create_graph`` backward at construction, then
        one backward per product) or ``"forward_over_reverse"`` (``torch.func.jvp`` of
        ``torch.func.grad``; one forward per product, no stored graph, buffers are not modified).
    """
    x, y = _check_loss_inputs(model, batch)
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    if not callable(loss_fn):
        raise TypeError("loss_fn must be callable (outputs, targets) -> scalar tensor")
    plist = _resolve_params(model, params)
    was_training = model.training
    model.train(train)
    try:
        if method == "double_backward":
            with torch.enable_grad():
                loss = loss_fn(model(x), y)
                if loss.dim() != 0:
                    raise ValueError("loss_fn must return a scalar tensor")
                raw = torch.autograd.grad(loss, plist, create_graph=True, allow_unused=True)
            grads = [torch.zeros_like(p) if g is None else g for g, p in zip(raw, plist)]
            return HessianVectorProduct(plist, grads, loss=float(loss.detach()))
        # forward-over-reverse: a pure function of the selected parameters
        names = {id(p): n for n, p in model.named_parameters()}
        missing = [p for p in plist if id(p) not in names]
        if missing:
            raise ValueError("method='forward_over_reverse' needs params that belong to model")
        sel = [names[id(p)] for p in plist]
        fixed = {n: p.detach() for n, p in model.named_parameters() if n not in set(sel)}
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        mode = train

        def functional(ps: Sequence[Tensor]) -> Tensor:
            state = dict(fixed)
            state.update(dict(zip(sel, ps)))
            state.update({n: b.clone() for n, b in buffers.items()})
            prev = model.training
            model.train(mode)
            try:
                out = torch.func.functional_call(model, state, (x,))
            finally:
                model.train(prev)
            return loss_fn(out, y)

        with torch.no_grad():
            loss_value = float(functional([p.detach() for p in plist]))
        return HessianVectorProduct(plist, None, functional=functional, loss=loss_value)
    finally:
        model.train(was_training)


def dense_hessian(op: Operator, dim: int | None = None) -> Tensor:
    """Materialise ``H`` column by column (``dim`` products; for tests on tiny models only)."""
    n = _dim_of(op, dim)
    dtype = getattr(op, "dtype", torch.float64)
    device = getattr(op, "device", torch.device("cpu"))
    eye = torch.eye(n, dtype=dtype, device=device)
    return torch.stack([op(eye[i]) for i in range(n)], dim=1)


def _dim_of(op: Operator, dim: int | None) -> int:
    if dim is None:
        dim = getattr(op, "dim", None)
    if not isinstance(dim, int) or dim < 1:
        raise ValueError("dim must be a positive int (or op must expose .dim)")
    return dim


def _rand_vector(kind: str, dim: int, dtype: torch.dtype, device: torch.device,
                 generator: torch.Generator | None) -> Tensor:
    if kind == "rademacher":
        v = torch.randint(0, 2, (dim,), generator=generator, dtype=torch.int64).to(dtype) * 2 - 1
    elif kind == "gaussian":
        v = torch.randn(dim, generator=generator, dtype=torch.float64).to(dtype)
    else:
        raise ValueError(f"probe must be one of {_PROBES} or a tensor, got {kind!r}")
    return v.to(device)


@dataclass(frozen=True)
class PowerIterationResult:
    """Eigenpairs of largest magnitude, in the order found (``eigenvalues[0]`` dominant)."""

    eigenvalues: list[float]
    eigenvectors: list[Tensor]
    iterations: list[int]


def power_iteration(
    op: Operator,
    dim: int | None = None,
    *,
    iters: int = 50,
    top_n: int = 1,
    tol: float | None = None,
    generator: torch.Generator | None = None,
    init: Tensor | None = None,
) -> PowerIterationResult:
    """Power iteration with deflation for the ``top_n`` eigenvalues of largest magnitude.

    Each eigenvalue is the Rayleigh quotient ``vᵀHv`` of the final unit vector ``v``; later
    eigenpairs are found in the orthogonal complement of the earlier eigenvectors. Exactly
    ``iters`` products per eigenvalue unless ``tol`` is given (stop when the relative change of
    the Rayleigh quotient drops below ``tol``; note 1e-3 can stop too early on flat problems).
    The dominant eigenvalue can be negative (saddle points, BN batch statistics).
    """
    n = _dim_of(op, dim)
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be a positive int, got {iters!r}")
    if not isinstance(top_n, int) or not 1 <= top_n <= n:
        raise ValueError(f"top_n must be an int in 1..{n}, got {top_n!r}")
    if tol is not None and not tol > 0:
        raise ValueError(f"tol must be positive or None, got {tol!r}")
    dtype = getattr(op, "dtype", torch.float64)
    device = getattr(op, "device", torch.device("cpu"))
    found_vals: list[float] = []
    found_vecs: list[Tensor] = []
    its: list[int] = []

    def deflate(u: Tensor) -> Tensor:
        for w in found_vecs:
            u = u - torch.dot(u, w) * w
        return u

    for k in range(top_n):
        if init is not None and k == 0:
            if init.numel() != n:
                raise ValueError(f"init must have {n} entries")
            v = init.reshape(-1).to(dtype=dtype, device=device).clone()
        else:
            v = _rand_vector("gaussian", n, dtype, device, generator)
        v = deflate(v)
        v = v / v.norm()
        lam = float("nan")
        used = 0
        for it in range(iters):
            w = deflate(op(v))
            new_lam = float(torch.dot(v, w))  # Rayleigh quotient of the unit vector v
            used = it + 1
            converged = tol is not None and it > 0 and abs(new_lam - lam) <= tol * max(abs(new_lam), 1e-300)
            lam = new_lam
            norm = w.norm()
            if converged or float(norm) == 0.0 or it == iters - 1:
                break
            v = w / norm
        found_vals.append(lam)
        found_vecs.append(v)
        its.append(used)
    return PowerIterationResult(found_vals, found_vecs, its)


@dataclass(frozen=True)
class LanczosResult:
    """Output of :func:`lanczos`: tridiagonal coefficients and its eigen-decomposition.

    ``ritz_values`` ascending; ``weights[i]`` = (first component of the ``i``-th eigenvector of
    ``T``)², summing to 1. ``basis`` (``(m, dim)``) only when requested.
    """

    alpha: Tensor
    beta: Tensor
    ritz_values: Tensor
    weights: Tensor
    basis: Tensor | None = None

    @property
    def steps(self) -> int:
        return int(self.alpha.numel())


def lanczos(
    op: Operator,
    dim: int | None = None,
    *,
    steps: int = 50,
    probe: str | Tensor = "rademacher",
    generator: torch.Generator | None = None,
    keep_basis: bool = False,
    breakdown_tol: float = 1e-10,
) -> LanczosResult:
    """Lanczos tridiagonalisation with full re-orthogonalisation (each new vector is
    orthogonalised twice against all previous ones).

    Runs ``min(steps, dim)`` steps from the normalised ``probe`` (a kind or an explicit vector)
    and stops early on breakdown (``β ≤ breakdown_tol · max|α|``: an invariant subspace was found).
    Ritz values approximate both ends of the spectrum; the pairs ``(ritz_values, weights)`` form the
    Gauss quadrature of the start vector's spectral measure (used by :func:`slq`). Ritz values and
    weights are computed in float64.
    """
    n = _dim_of(op, dim)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    dtype = getattr(op, "dtype", torch.float64)
    device = getattr(op, "device", torch.device("cpu"))
    if isinstance(probe, Tensor):
        if probe.numel() != n:
            raise ValueError(f"probe must have {n} entries")
        v = probe.reshape(-1).to(dtype=dtype, device=device).clone()
    else:
        v = _rand_vector(probe, n, dtype, device, generator)
    nrm = v.norm()
    if float(nrm) == 0.0:
        raise ValueError("probe must be non-zero")
    v = v / nrm
    m = min(steps, n)
    basis = torch.empty((m, n), dtype=dtype, device=device)
    alphas: list[float] = []
    betas: list[float] = []
    for j in range(m):
        basis[j] = v
        w = op(v)
        a = float(torch.dot(w, v))
        alphas.append(a)
        q = basis[: j + 1]
        for _ in range(2):  # full re-orthogonalisation, twice is enough
            w = w - q.t().mv(q.mv(w))
        if j == m - 1:
            break
        b = float(w.norm())
        scale = max(max(abs(x) for x in alphas), 1e-300)
        if b <= breakdown_tol * scale:
            break
        betas.append(b)
        v = w / b
    k = len(alphas)
    alpha = torch.tensor(alphas, dtype=torch.float64)
    beta = torch.tensor(betas[: k - 1], dtype=torch.float64)
    t = torch.diag(alpha)
    if k > 1:
        t = t + torch.diag(beta, 1) + torch.diag(beta, -1)
    evals, evecs = torch.linalg.eigh(t)
    weights = evecs[0, :] ** 2
    return LanczosResult(alpha, beta, evals, weights, basis[:k].clone() if keep_basis else None)


def slq(
    op: Operator,
    dim: int | None = None,
    *,
    probes: int = 1,
    steps: int = 50,
    generator: torch.Generator | None = None,
    probe: str = "rademacher",
) -> list[tuple[Tensor, Tensor]]:
    """Stochastic Lanczos quadrature: one ``(ritz_values, weights)`` pair per random probe."""
    if not isinstance(probes, int) or probes < 1:
        raise ValueError(f"probes must be a positive int, got {probes!r}")
    out = []
    for _ in range(probes):
        res = lanczos(op, dim, steps=steps, probe=probe, generator=generator)
        out.append((res.ritz_values, res.weights))
    return out


def slq_density(
    ritz_sets: Sequence[tuple[Tensor, Tensor]],
    *,
    grid: int = 10_000,
    var: float = 1e-5,
    pad: float = 0.01,
    scale_var_by_range: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian-smoothed spectral density from SLQ Ritz sets.

    Grid: ``grid`` points on ``[a, b] = [min θ − pad, max θ + pad]``. Kernel: Gaussians centred at
    the Ritz values with the Ritz weights, **variance** ``var · max(1, b − a)`` (or ``var`` when
    ``scale_var_by_range=False``); densities are averaged over the probe sets and normalised so that
    ``Σ density · Δλ = 1``. Returns ``(grid_points, density)`` as float64 numpy arrays.
    """
    if not ritz_sets:
        raise ValueError("ritz_sets must contain at least one (ritz_values, weights) pair")
    if not isinstance(grid, int) or grid < 2:
        raise ValueError(f"grid must be an int >= 2, got {grid!r}")
    if not var > 0 or pad < 0:
        raise ValueError("var must be positive and pad non-negative")
    vals = [np.asarray(torch.as_tensor(r).detach().cpu().double()) for r, _ in ritz_sets]
    wts = [np.asarray(torch.as_tensor(w).detach().cpu().double()) for _, w in ritz_sets]
    lo = min(float(v.min()) for v in vals) - pad
    hi = max(float(v.max()) for v in vals) + pad
    if hi <= lo:
        hi = lo + 1e-12
    sigma2 = var * max(1.0, hi - lo) if scale_var_by_range else var
    xs = np.linspace(lo, hi, grid)
    dens = np.zeros(grid)
    for v, w in zip(vals, wts):
        diff = xs[:, None] - v[None, :]
        kern = np.exp(-(diff**2) / (2.0 * sigma2)) / math.sqrt(2.0 * math.pi * sigma2)
        dens += kern @ w
    dens /= len(vals)
    step = xs[1] - xs[0]
    total = float(dens.sum() * step)
    if total > 0:
        dens = dens / total
    return xs, dens


def top_eigenvalue(
    model: nn.Module,
    loss_fn: LossFn,
    batch: tuple[Tensor, Tensor],
    params: Iterable[Tensor] | None = None,
    *,
    iters: int = 50,
    tol: float | None = None,
    train: bool = False,
    generator: torch.Generator | None = None,
) -> float:
    """Eigenvalue of largest magnitude of the whole-model (or ``params``) Hessian."""
    with hvp(model, loss_fn, batch, params, train=train) as op:
        return power_iteration(op, iters=iters, tol=tol, generator=generator).eigenvalues[0]


def layer_parameter_groups(model: nn.Module, types: tuple[type[nn.Module], ...] = (nn.Conv2d, nn.Linear)
                           ) -> dict[str, list[nn.Parameter]]:
    """``{module path: trainable parameters}`` for every module of the given types."""
    out: dict[str, list[nn.Parameter]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, types):
            ps = [p for p in mod.parameters(recurse=False) if p.requires_grad]
            if ps:
                out[name] = ps
    return out


def layer_top_eigenvalues(
    model: nn.Module,
    loss_fn: LossFn,
    batch: tuple[Tensor, Tensor],
    layers: Mapping[str, Sequence[Tensor]] | None = None,
    *,
    iters: int = 20,
    tol: float | None = None,
    train: bool = False,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """Dominant eigenvalue of each layer's diagonal Hessian block ``H_ll``.

    ``layers`` maps a name to that layer's parameters (default: every Conv2d and Linear, weight and
    bias). One forward and one first-order backward are shared by all layers.
    """
    groups = dict(layers) if layers is not None else layer_parameter_groups(model)
    if not groups:
        raise ValueError("layers is empty: nothing to analyse")
    flat: list[Tensor] = []
    index: dict[str, list[int]] = {}
    pos = {}
    for name, ps in groups.items():
        ids = []
        for p in ps:
            if id(p) not in pos:
                pos[id(p)] = len(flat)
                flat.append(p)
            ids.append(pos[id(p)])
        index[name] = ids
    result: dict[str, float] = {}
    with hvp(model, loss_fn, batch, flat, train=train) as op:
        for name, ids in index.items():
            sub = op.restrict(ids)
            result[name] = power_iteration(sub, iters=iters, tol=tol, generator=generator).eigenvalues[0]
    return result


def hutchinson_traces(
    op: HessianVectorProduct,
    groups: Mapping[str, Sequence[int]] | None = None,
    *,
    probes: int = 10,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """Hutchinson estimates of ``tr(H_ll)`` for parameter groups from full-model products.

    ``groups`` maps a name to positions in ``op.params`` (default: one group per parameter tensor,
    named by position). With Rademacher probes ``v``, ``v_lᵀ (Hv)_l`` is unbiased for ``tr(H_ll)``.
    """
    if not isinstance(probes, int) or probes < 1:
        raise ValueError(f"probes must be a positive int, got {probes!r}")
    if groups is None:
        groups = {str(i): [i] for i in range(len(op.params))}
    offsets = [0]
    for p in op.params:
        offsets.append(offsets[-1] + p.numel())
    sums = {name: 0.0 for name in groups}
    for _ in range(probes):
        v = _rand_vector("rademacher", op.dim, op.dtype, op.device, generator)
        hv = op(v)
        prod = v * hv
        for name, ids in groups.items():
            sums[name] += float(sum(prod[offsets[i]: offsets[i + 1]].sum() for i in ids))
    return {name: s / probes for name, s in sums.items()}
