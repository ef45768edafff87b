"""Equivalence-testing helpers (public: test your own models with them).

* :func:`rel_err`: scale-relative maximum error ``max|a − b| / max|b|`` (after a shape check).
* :func:`assert_equivalent`: run two modules on the same inputs (on copies, in their own dtype or a
  requested one, in eval or train mode with the same random numbers) and assert their outputs agree
  to a tolerance relative to the output scale that follows the models' dtype.
* :func:`perturb_`: what training does to a freshly expanded model: every parameter and every
  BatchNorm statistic moved away from its initial value (residuals of identity-based 1×1 convs and
  zero-γ last BNs included), so that merge tests and benchmarks never take a shortcut that only
  exists at initialisation.
* :func:`randomize_bn_`: random running statistics and signed γ for every BatchNorm, so that merge
  tests are not vacuous (with default statistics, folding a BN is nearly the identity and bugs hide;
  a zero-γ branch contributes nothing at all).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Sequence

import torch
from torch import Tensor, nn

__all__ = ["rel_err", "assert_equivalent", "randomize_bn_", "perturb_", "default_rtol"]

_DEFAULT_RTOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 2e-2,
    torch.float16: 2e-2,
}


def default_rtol(dtype: torch.dtype) -> float:
    """Default scale-relative tolerance of an equivalence check whose weights are held in ``dtype``:
    a few hundred units in the last place of that format, so that a merge rounded once into the
    format and a forward pass through a deep network pass, while a real mismatch (a wrong kernel or
    bias, typically a relative error of 1e-3 or more) fails."""
    return _DEFAULT_RTOL.get(dtype, 1e-5)


def rel_err(a: Tensor, b: Tensor) -> float:
    """``max|a − b| / max|b|`` in float64 (``max|a − b|`` when ``b`` is all zeros).

    Raises:
        AssertionError: the shapes differ.
    """
    assert tuple(a.shape) == tuple(b.shape), f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}"
    a64 = a.detach().to(torch.float64)
    b64 = b.detach().to(torch.float64)
    diff = (a64 - b64).abs().max().item() if a64.numel() else 0.0
    scale = b64.abs().max().item() if b64.numel() else 0.0
    return diff / scale if scale > 0 else diff


def _flatten(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flatten(o)]
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in _flatten(out[k])]
    raise TypeError(f"cannot compare outputs of type {type(out).__name__}")


def _call(m: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, (tuple, list)):
        return m(*inputs)
    return m(inputs)


def _float_dtypes(m: nn.Module) -> set[torch.dtype]:
    return {t.dtype for t in list(m.parameters()) + list(m.buffers()) if t.is_floating_point()}


def _loosest(dtypes: Sequence[torch.dtype]) -> torch.dtype | None:
    """The dtype with the largest default tolerance (the least precise format) among ``dtypes``."""
    found = [d for d in dtypes if d is not None]
    return max(found, key=default_rtol) if found else None


def _devices(*modules: nn.Module, inputs: Sequence[Any] = ()) -> list[int]:
    """CUDA device indices that the forward passes may draw random numbers on."""
    idx = set()
    for m in modules:
        for t in list(m.parameters()) + list(m.buffers()):
            if t.device.type == "cuda":
                idx.add(t.device.index or 0)
    for x in inputs:
        if isinstance(x, Tensor) and x.device.type == "cuda":
            idx.add(x.device.index or 0)
    return sorted(idx)


def assert_equivalent(
    a: nn.Module,
    b: nn.Module,
    inputs: Tensor | Sequence[Tensor],
    dtype: torch.dtype | None = None,
    rtol: float | None = None,
    mode: str = "eval",
) -> float:
    """Assert that modules ``a`` and ``b`` compute the same outputs on ``inputs``.

    Both modules are deep-copied, converted to ``dtype`` if one is given (default ``None``: each
    keeps its own dtype), put in ``mode`` (``"eval"`` or ``"train"``) and run under ``no_grad``.
    The check is ``torch.testing.assert_close(out_a, out_b, rtol=tol, atol=tol·max|out_b|)``
    after asserting equal shapes, i.e. the tolerance is relative to the scale of the output.

    ``tol`` defaults to the tolerance of the least precise floating dtype among the two modules'
    parameters and buffers, the inputs and ``dtype``: 1e-10 (float64), 1e-5 (float32), 2e-2
    (bfloat16/float16). Weights held in float32 carry float32 rounding (a merged kernel is rounded
    once into float32), so converting such models to float64 does not make a float64 tolerance
    meaningful; the float32 one is used.

    In ``"train"`` mode both forward passes start from the same random-number state (dropout and
    other random layers draw the same numbers): the state of the CPU generator and of the CUDA
    generators in use is saved before the first pass, restored before the second, and restored
    again at the end, so the caller's random stream is left as it was.

    Returns:
        The largest :func:`rel_err` over the outputs.
    """
    if mode not in ("eval", "train"):
        raise ValueError(f"mode must be 'eval' or 'train', got {mode!r}")
    ma, mb = copy.deepcopy(a), copy.deepcopy(b)
    xs = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
    held = _float_dtypes(ma) | _float_dtypes(mb) | {x.dtype for x in xs if isinstance(x, Tensor) and x.is_floating_point()}
    if dtype is not None:
        ma, mb = ma.to(dtype), mb.to(dtype)
        xs = [x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x for x in xs]
        held.add(dtype)
    ma.train(mode == "train")
    mb.train(mode == "train")
    tol = rtol if rtol is not None else default_rtol(_loosest(sorted(held, key=str)) or torch.float32)
    devices = _devices(ma, mb, inputs=xs)
    with torch.random.fork_rng(devices=devices):
        cpu_state = torch.get_rng_state()
        cuda_states = [torch.cuda.get_rng_state(d) for d in devices]

        def reset() -> None:
            torch.set_rng_state(cpu_state)
            for d, st in zip(devices, cuda_states):
                torch.cuda.set_rng_state(st, d)

        with torch.no_grad():
            reset()
            oa = _flatten(_call(ma, xs))
            reset()
            ob = _flatten(_call(mb, xs))
    assert len(oa) == len(ob), f"output count differs: {len(oa)} vs {len(ob)}"
    worst = 0.0
    for ta, tb in zip(oa, ob):
        assert tuple(ta.shape) == tuple(tb.shape), f"output shape differs: {tuple(ta.shape)} vs {tuple(tb.shape)}"
        scale = tb.detach().abs().max().item() if tb.numel() else 0.0
        if ta.dtype != tb.dtype:
            common = torch.promote_types(ta.dtype, tb.dtype)
            ta, tb = ta.to(common), tb.to(common)
        torch.testing.assert_close(ta, tb, rtol=tol, atol=tol * max(scale, 1e-30))
        worst = max(worst, rel_err(ta, tb))
    return worst


def _bn_modules(model: nn.Module) -> list[Any]:
    out: list[Any] = []
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) or type(m).__name__ == "FrozenBatchNorm2d":
            out.append(m)
    return out


def randomize_bn_(model: nn.Module, generator: torch.Generator | None = None) -> nn.Module:
    """In place, for every BatchNorm of ``model`` (including new branches' last BN; not
    ``FrozenIdentityBN``): ``μ ~ U(−1, 1)``, ``v ~ U(0.1, 2)``, ``γ ~ ±U(0.05, 1)`` (signed,
    ``|γ| ≥ 0.05``), ``β ~ U(−1, 1)``. Returns ``model``.
    """
    gen = generator if generator is not None else torch.Generator().manual_seed(0)

    def u(n: int, lo: float, hi: float) -> Tensor:
        return torch.rand(n, generator=gen, dtype=torch.float64) * (hi - lo) + lo

    with torch.no_grad():
        for bn in _bn_modules(model):
            rm = getattr(bn, "running_mean", None)
            if rm is None:
                n = bn.weight.numel()
            else:
                n = rm.numel()
            if rm is not None:
                rm.copy_(u(n, -1.0, 1.0).to(rm.dtype))
                bn.running_var.copy_(u(n, 0.1, 2.0).to(bn.running_var.dtype))
            w = getattr(bn, "weight", None)
            if w is not None:
                sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).to(torch.float64)
                w.copy_((sign * u(n, 0.05, 1.0)).to(w.dtype))
            b = getattr(bn, "bias", None)
            if b is not None:
                b.copy_(u(n, -1.0, 1.0).to(b.dtype))
    return model


def perturb_(model: nn.Module, generator: torch.Generator | None = None, scale: float = 0.2) -> nn.Module:
    """In place, move every parameter and BatchNorm statistic of ``model`` as training would.

    Every BatchNorm gets :func:`randomize_bn_` values; every other floating parameter ``p`` gets
    ``p += scale·r·N(0, 1)`` with ``r`` the root mean square of ``p``, or, for a parameter that is
    exactly zero (the residual of an :class:`~reparam.layers.IdentityBasedConv1x1`, a zero
    bias), ``r = 1/sqrt(fan_in)`` for a kernel and ``0.1`` for a vector. Buffers other than BN
    statistics (e.g. the identity kernel of an identity-based conv) are left alone. Returns
    ``model``.
    """
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    randomize_bn_(model, gen)
    bn_params = {id(p) for bn in _bn_modules(model) for p in bn.parameters(recurse=False)}
    with torch.no_grad():
        for p in model.parameters():
            if id(p) in bn_params or not p.is_floating_point():
                continue
            p64 = p.detach().to(torch.float64)
            r = p64.pow(2).mean().sqrt().item() if p.numel() else 0.0
            if r == 0.0:
                r = 1.0 / math.sqrt(max(1, p[0].numel())) if p.dim() > 1 else 0.1
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64) * (scale * r)
            p.copy_((p64 + noise.to(p.device)).to(p.dtype))
    return model
