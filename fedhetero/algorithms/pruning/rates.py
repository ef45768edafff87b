"""FedAP layer-adaptive pruning rates (FedDUMAP Algorithm 3, IMC-style spectral rule).

Pipeline (all scalars, no surgery here):

1. ``p*_k`` per dataset (server ``k = 0`` and every device) with :func:`dataset_prune_rate`, in one of
   three modes (:data:`PRUNE_RATE_MODES`):

   - ``"slq_plateau"`` (default, the authors' code): SLQ spectral density of the full-model Hessian on
     one batch, then :func:`plateau_rate` = spectral mass *above* the first flat region past 0;
   - ``"spectral_gap"`` (paper-literal, experimental): first gap of the smoothed density wider than
     ``4·ℒ`` (:func:`spectral_gap_rate`, ``ℒ`` from :func:`lipschitz_estimate`); non-null mass below
     the gap over the non-null mass; falls back to the plateau value when no gap exists;
   - ``"fixed"``: a given rate.

2. ``p*`` = :func:`aggregate_rates` (Formula 15: weights ``n_k / (JS_k + ε)``, normalised).
3. Global magnitude threshold :func:`magnitude_threshold` (``⌊R·p*⌋``-th smallest ``|v|``).
4. Per-conv rates :func:`layer_rates_from_threshold` (fraction of a conv's weights strictly below
   the threshold; bias excluded), or both steps at once with :func:`fedap_layer_rates`.
5. Rates become kept counts with :func:`kept_count` (``d − ⌊p·d⌋`` with ``min_channels``,
   ``max_prune_ratio`` and ``round_to`` guards).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .hessian import hvp, power_iteration, slq, slq_density

__all__ = [
    "PRUNE_RATE_MODES",
    "THRESHOLD_PARAMS",
    "RateEstimate",
    "aggregation_weights",
    "aggregate_rates",
    "spectral_mass_above",
    "plateau_rate",
    "spectral_gap_rate",
    "lipschitz_estimate",
    "hessian_density",
    "dataset_prune_rate",
    "threshold_parameters",
    "magnitude_threshold",
    "layer_rates_from_threshold",
    "fedap_layer_rates",
    "kept_count",
]

log = logging.getLogger(__name__)

PRUNE_RATE_MODES = ("slq_plateau", "spectral_gap", "fixed")
THRESHOLD_PARAMS = ("all_trainable", "conv_weights_only")
LIPSCHITZ_METHODS = ("hessian_difference", "finite_difference")


def _check_rate(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


# --------------------------------------------------------------------------- Formula 15
def aggregation_weights(sizes: Sequence[float], divergences: Sequence[float], eps: float = 1e-4) -> np.ndarray:
    """Formula-15 weights ``w_k = (n_k / (D_k + ε)) / Σ_k' (n_k' / (D_k' + ε))`` (sum to 1).

    ``sizes`` are the sample counts ``n_k`` and ``divergences`` the Jensen–Shannon divergences
    ``D(P_k)`` of every participant, the server included.
    """
    n = np.asarray(sizes, dtype=np.float64)
    d = np.asarray(divergences, dtype=np.float64)
    if n.ndim != 1 or n.size == 0 or d.shape != n.shape:
        raise ValueError("sizes and divergences must be non-empty 1-D sequences of the same length")
    if (n < 0).any() or not np.isfinite(n).all() or n.sum() <= 0:
        raise ValueError("sizes must be finite, non-negative and not all zero")
    if (d < 0).any() or not np.isfinite(d).all():
        raise ValueError("divergences must be finite and non-negative")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps!r}")
    raw = n / (d + eps)
    return raw / raw.sum()


def aggregate_rates(rates: Sequence[float], sizes: Sequence[float], divergences: Sequence[float],
                    eps: float = 1e-4) -> float:
    """Aggregated expected pruning rate ``p* = Σ_k w_k p*_k`` (Formula 15, server included)."""
    r = np.asarray(rates, dtype=np.float64)
    w = aggregation_weights(sizes, divergences, eps)
    if r.shape != w.shape:
        raise ValueError("rates must have one entry per participant (same length as sizes)")
    if ((r < 0) | (r > 1)).any() or not np.isfinite(r).all():
        raise ValueError("rates must lie in [0, 1]")
    return float(np.clip((w * r).sum(), 0.0, 1.0))


# --------------------------------------------------------------------------- spectrum rules
def _check_density(grid: Any, density: Any) -> tuple[np.ndarray, np.ndarray]:
    xs = np.asarray(grid, dtype=np.float64)
    ds = np.asarray(density, dtype=np.float64)
    if xs.ndim != 1 or xs.size < 2 or ds.shape != xs.shape:
        raise ValueError("grid and density must be 1-D arrays of the same length (>= 2)")
    if not (np.diff(xs) > 0).all():
        raise ValueError("grid must be strictly increasing")
    if (ds < 0).any() or not np.isfinite(ds).all():
        raise ValueError("density must be finite and non-negative")
    return xs, ds


def spectral_mass_above(grid: Any, density: Any, t: float) -> float:
    """``ratio(t) = 1 − ∫_{−∞}^{t} density``: mass of the grid points strictly above ``t``.

    Computed as ``Σ_{x_i > t} density_i · Δx`` on the uniform grid (the density is assumed to be
    normalised, ``Σ density · Δx = 1``).
    """
    xs, ds = _check_density(grid, density)
    step = xs[1] - xs[0]
    i = int(np.searchsorted(xs, t, side="right"))
    return float(ds[i:].sum() * step)


def plateau_rate(
    grid: Any,
    density: Any,
    *,
    inc0: float = 0.1,
    tol: float = 0.005,
    length: int = 4,
    max_halvings: int = 20,
) -> float:
    """The ``slq_plateau`` rule: spectral mass above the first flat region of ``ratio(t)`` past 0.

    Scan ``t = 0, inc, 2·inc, …``; fail when ``ratio(t) < ratio(0)/2``; succeed when at least
    ``length`` values were taken and the last ``length − 1`` successive changes are all below ``tol``;
    on failure halve ``inc`` and restart. After ``max_halvings`` halvings the last value is returned
    with a warning. The scan always terminates (``ratio`` is constant beyond the grid).
    """
    xs, ds = _check_density(grid, density)
    if not inc0 > 0 or not tol > 0:
        raise ValueError("inc0 and tol must be positive")
    if not isinstance(length, int) or length < 2:
        raise ValueError(f"length must be an int >= 2, got {length!r}")
    if not isinstance(max_halvings, int) or max_halvings < 0:
        raise ValueError(f"max_halvings must be a non-negative int, got {max_halvings!r}")
    step = xs[1] - xs[0]
    tail = np.concatenate([np.cumsum(ds[::-1])[::-1], [0.0]]) * step  # tail[i] = Σ_{j ≥ i}

    def ratio(t: float) -> float:
        return float(tail[int(np.searchsorted(xs, t, side="right"))])

    inc = float(inc0)
    halvings = 0
    while True:
        t = 0.0
        rs: list[float] = []
        success = False
        while True:
            r = ratio(t)
            rs.append(r)
            if r < rs[0] / 2:
                break
            if len(rs) >= length and all(abs(rs[-i] - rs[-i - 1]) < tol for i in range(1, length)):
                success = True
                break
            t += inc
        if success:
            return rs[-1]
        if halvings >= max_halvings:
            log.warning("plateau scan: no plateau after %d halvings; returning %.4f", halvings, rs[-1])
            return rs[-1]
        inc /= 2.0
        halvings += 1


def spectral_gap_rate(
    grid: Any,
    density: Any,
    lipschitz: float,
    *,
    gap_factor: float = 4.0,
    null_tol: float = 1e-4,
    zero_tol: float = 1e-3,
    lambda_max: float | None = None,
) -> float | None:
    """The paper-literal ``spectral_gap`` rule on a smoothed density; ``None`` when no gap exists.

    - Null space: points with ``|λ| ≤ null_tol · λ_max`` (``λ_max`` defaults to the largest
      ``|grid|`` value); the rest is the non-null mass (the rank ``d_k`` in mass units).
    - A gap is a maximal run of grid points with ``density ≤ zero_tol · max(density)`` that has
      spectral mass on both sides; the first (lowest) gap wider than ``gap_factor · lipschitz``
      gives ``λ*`` = its lower edge.
    - Returns ``(non-null mass ≤ λ*) / (non-null mass)``.
    """
    xs, ds = _check_density(grid, density)
    if not lipschitz >= 0 or not math.isfinite(lipschitz):
        raise ValueError(f"lipschitz must be finite and non-negative, got {lipschitz!r}")
    if not gap_factor > 0 or not null_tol >= 0 or not zero_tol >= 0:
        raise ValueError("gap_factor must be positive; null_tol and zero_tol non-negative")
    step = xs[1] - xs[0]
    lam_max = float(np.abs(xs).max()) if lambda_max is None else abs(float(lambda_max))
    nonnull = np.abs(xs) > null_tol * lam_max
    total = float(ds[nonnull].sum() * step)
    if total <= 0:
        return None
    small = ds <= zero_tol * ds.max()
    width_needed = gap_factor * lipschitz
    i, n = 0, xs.size
    while i < n:
        if not small[i]:
            i += 1
            continue
        j = i
        while j + 1 < n and small[j + 1]:
            j += 1
        inner = i > 0 and j < n - 1  # mass on both sides
        if inner and (xs[j + 1] - xs[i - 1]) > width_needed:
            lam_star = xs[i - 1]
            below = float(ds[nonnull & (xs <= lam_star)].sum() * step)
            return below / total
        i = j + 1
    return None


def lipschitz_estimate(
    model: nn.Module,
    init_model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    batch: tuple[Tensor, Tensor],
    *,
    method: str = "hessian_difference",
    iters: int = 20,
    generator: torch.Generator | None = None,
) -> float:
    """Lipschitz constant ``ℒ_k`` of ``B(Δ) = H(W')Δ − ∇L(W' + Δ)`` between ``W'`` and ``W``.

    ``model`` holds ``W'`` (current weights), ``init_model`` the initial weights ``W`` (same
    architecture). ``"hessian_difference"``: ``‖H(W') − H(W)‖₂`` by ``iters`` power iterations on
    ``v ↦ H(W')v − H(W)v`` (same batch, eval mode). ``"finite_difference"``:
    ``‖∇L(W) − ∇L(W') − H(W')Δ‖ / ‖Δ‖`` with ``Δ = W − W'``.
    """
    if method not in LIPSCHITZ_METHODS:
        raise ValueError(f"method must be one of {LIPSCHITZ_METHODS}, got {method!r}")
    op1 = hvp(model, loss_fn, batch)
    op0 = hvp(init_model, loss_fn, batch)
    try:
        if op0.dim != op1.dim:
            raise ValueError("init_model must have the same architecture (parameter count) as model")
        if method == "hessian_difference":

            class _Diff:
                dim = op1.dim
                dtype = op1.dtype
                device = op1.device

                def __call__(self, v: Tensor) -> Tensor:
                    return op1(v) - op0(v)

            res = power_iteration(_Diff(), iters=iters, generator=generator)
            return abs(res.eigenvalues[0])
        w1 = torch.cat([p.detach().reshape(-1) for p in op1.params])
        w0 = torch.cat([p.detach().reshape(-1) for p in op0.params])
        delta = w0 - w1
        nrm = float(delta.norm())
        if nrm == 0.0:
            return 0.0
        g1 = _flat_grad(model, loss_fn, batch, op1.params)
        g0 = _flat_grad(init_model, loss_fn, batch, op0.params)
        return float((g0 - g1 - op1(delta)).norm()) / nrm
    finally:
        op0.close()
        op1.close()


def _flat_grad(model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor], batch: tuple[Tensor, Tensor],
               params: Sequence[Tensor]) -> Tensor:
    was = model.training
    model.eval()
    try:
        with torch.enable_grad():
            loss = loss_fn(model(batch[0]), batch[1])
            gs = torch.autograd.grad(loss, list(params), allow_unused=True)
    finally:
        model.train(was)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(gs, params)])


def hessian_density(
    model: nn.Module,
    batch: tuple[Tensor, Tensor],
    *,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
    probes: int = 1,
    steps: int = 50,
    grid: int = 10_000,
    var: float = 1e-5,
    pad: float = 0.01,
    generator: torch.Generator | None = None,
) -> tuple[np.ndarray, np.ndarray, float]:
    """SLQ spectral density of the full-model Hessian (eval mode, all trainable parameters).

    Returns ``(grid, density, lambda_max)`` with ``lambda_max`` the largest ``|Ritz value|``.
    """
    with hvp(model, loss_fn, batch) as op:
        sets = slq(op, probes=probes, steps=steps, generator=generator)
    xs, ds = slq_density(sets, grid=grid, var=var, pad=pad)
    lam_max = max(float(r.abs().max()) for r, _ in sets)
    return xs, ds, lam_max


@dataclass(frozen=True)
class RateEstimate:
    """A per-dataset expected pruning rate ``p*_k`` and how it was obtained.

    ``convention``: ``"mass_above_plateau"`` (``slq_plateau``, the authors' code),
    ``"mass_below_gap"`` (``spectral_gap``), ``"fixed"``; ``fallback`` is True when
    ``spectral_gap`` found no gap and returned the plateau value.
    """

    rate: float
    mode: str
    convention: str
    fallback: bool = False
    details: dict[str, float] = field(default_factory=dict)


def dataset_prune_rate(
    model: nn.Module,
    batch: tuple[Tensor, Tensor] | None,
    *,
    mode: str = "slq_plateau",
    loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
    fixed_rate: float = 0.6,
    init_model: nn.Module | None = None,
    probes: int | None = None,
    steps: int | None = None,
    grid: int = 10_000,
    var: float = 1e-5,
    plateau_inc0: float = 0.1,
    plateau_tol: float = 0.005,
    plateau_len: int = 4,
    plateau_max_halvings: int = 20,
    gap_factor: float = 4.0,
    lipschitz_iters: int = 20,
    lipschitz_method: str = "hessian_difference",
    generator: torch.Generator | None = None,
) -> RateEstimate:
    """Expected pruning rate ``p*_k`` of one dataset (Algorithm 3, lines 2–4).

    ``model`` is the current global model ``W'`` (evaluated in eval mode; its mode is restored and
    its parameters are not modified); ``batch`` one fixed batch ``(x, y)`` of dataset ``k``
    (100 samples in the authors' code). Defaults per mode: ``slq_plateau`` 1 probe × 50 Lanczos
    steps; ``spectral_gap`` 4 probes × 100 steps and needs ``init_model`` (the initial weights ``W``).
    ``fixed`` ignores the model and returns ``fixed_rate``.
    """
    if mode not in PRUNE_RATE_MODES:
        raise ValueError(f"mode must be one of {PRUNE_RATE_MODES}, got {mode!r}")
    if mode == "fixed":
        return RateEstimate(_check_rate("fixed_rate", fixed_rate), "fixed", "fixed")
    if batch is None:
        raise ValueError(f"batch is required for mode={mode!r}")
    if mode == "spectral_gap" and init_model is None:
        raise ValueError("init_model (the initial weights W) is required for mode='spectral_gap'")
    n_probes = probes if probes is not None else (1 if mode == "slq_plateau" else 4)
    n_steps = steps if steps is not None else (50 if mode == "slq_plateau" else 100)
    xs, ds, lam_max = hessian_density(model, batch, loss_fn=loss_fn, probes=n_probes, steps=n_steps,
                                      grid=grid, var=var, generator=generator)
    plateau = plateau_rate(xs, ds, inc0=plateau_inc0, tol=plateau_tol, length=plateau_len,
                           max_halvings=plateau_max_halvings)
    details = {"lambda_max": lam_max, "plateau_rate": plateau}
    if mode == "slq_plateau":
        return RateEstimate(plateau, mode, "mass_above_plateau", details=details)
    assert init_model is not None
    lip = lipschitz_estimate(model, init_model, loss_fn, batch, method=lipschitz_method,
                             iters=lipschitz_iters, generator=generator)
    details["lipschitz"] = lip
    gap = spectral_gap_rate(xs, ds, lip, gap_factor=gap_factor, lambda_max=lam_max)
    if gap is None:
        log.info("spectral_gap: no gap wider than %.3g; falling back to the plateau rate %.4f",
                 gap_factor * lip, plateau)
        return RateEstimate(plateau, mode, "mass_above_plateau", fallback=True, details=details)
    return RateEstimate(gap, mode, "mass_below_gap", details=details)


# --------------------------------------------------------------------------- magnitude threshold
def threshold_parameters(model: nn.Module, threshold_params: str = "all_trainable") -> list[Tensor]:
    """Tensors that enter the global magnitude threshold.

    ``"all_trainable"``: every parameter with ``requires_grad`` (conv and FC weights, biases, BN
    parameters; the authors' code). ``"conv_weights_only"``: the weights of every ``Conv2d``.
    """
    if threshold_params not in THRESHOLD_PARAMS:
        raise ValueError(f"threshold_params must be one of {THRESHOLD_PARAMS}, got {threshold_params!r}")
    if threshold_params == "all_trainable":
        return [p for p in model.parameters() if p.requires_grad]
    return [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]


def magnitude_threshold(model: nn.Module, p_star: float, threshold_params: str = "all_trainable") -> float:
    """``𝒱`` = the ``⌊R·p*⌋``-th smallest ``|v|`` over ``R`` parameters (1-based, clamped to ``[1, R]``).

    With index 1 (``⌊R·p*⌋ ≤ 1``) no value is strictly below ``𝒱``, so nothing gets pruned.
    """
    p_star = _check_rate("p_star", p_star)
    tensors = threshold_parameters(model, threshold_params)
    if not tensors:
        raise ValueError("the model has no parameters for the magnitude threshold")
    values = torch.cat([t.detach().reshape(-1).abs().to(torch.float64) for t in tensors])
    r = values.numel()
    k = min(max(int(math.floor(r * p_star)), 1), r)
    return float(torch.kthvalue(values.cpu(), k).values)


def _conv_layers(model: nn.Module) -> dict[str, nn.Conv2d]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}


def layer_rates_from_threshold(model: nn.Module, threshold: float,
                               layers: Sequence[str] | None = None) -> dict[str, float]:
    """``p*_l = |{v ∈ W_l : |v| < 𝒱}| / q_l`` for every conv layer (weights only, no bias).

    ``layers``: module paths of the convs (default: every ``Conv2d``, in module order).
    """
    convs = _conv_layers(model)
    names = list(convs) if layers is None else list(layers)
    out: dict[str, float] = {}
    for name in names:
        mod = dict(model.named_modules()).get(name) if name not in convs else convs[name]
        w = getattr(mod, "weight", None)
        if not isinstance(w, Tensor):
            raise ValueError(f"layers: {name!r} is not a module with a weight in the model")
        out[name] = float((w.detach().abs() < threshold).sum()) / w.numel()
    return out


def fedap_layer_rates(
    model: nn.Module,
    p_star: float,
    *,
    threshold_params: str = "all_trainable",
    layers: Sequence[str] | None = None,
) -> dict[str, float]:
    """Per-conv expected rates ``p*_l`` from the aggregated rate ``p*`` (Algorithm 3, lines 6–11).

    Computed on the weights only (no data); call it on the unpruned model before any surgery.
    """
    thr = magnitude_threshold(model, p_star, threshold_params)
    return layer_rates_from_threshold(model, thr, layers)


def kept_count(
    d: int,
    rate: float,
    *,
    min_channels: int = 1,
    max_prune_ratio: float | None = None,
    round_to: int = 1,
) -> int:
    """Channels kept out of ``d`` at pruning rate ``rate``: ``d − ⌊rate·d⌋`` with guards.

    ``max_prune_ratio`` caps the pruned count at ``⌊max_prune_ratio·d⌋``; the kept count is then
    rounded **up** to a multiple of ``round_to`` (capped at ``d``) and raised to ``min_channels``
    (capped at ``d``). The realised rate is therefore ``≤ rate``. The floor is taken with a 1e-9
    slack so that decimal rates give the mathematical floor (``⌊0.29·100⌋ = 29``, where plain
    ``int(0.29 * 100)`` gives 28).
    """
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"d must be a positive int, got {d!r}")
    rate = _check_rate("rate", rate)
    if isinstance(min_channels, bool) or not isinstance(min_channels, int) or min_channels < 1:
        raise ValueError(f"min_channels must be a positive int, got {min_channels!r}")
    if isinstance(round_to, bool) or not isinstance(round_to, int) or round_to < 1:
        raise ValueError(f"round_to must be a positive int, got {round_to!r}")
    n_prune = int(math.floor(rate * d + 1e-9))
    if max_prune_ratio is not None:
        n_prune = min(n_prune, int(math.floor(_check_rate("max_prune_ratio", max_prune_ratio) * d + 1e-9)))
    keep = d - n_prune
    if round_to > 1:
        keep = min(d, int(math.ceil(keep / round_to)) * round_to)
    return min(d, max(keep, min_channels))
