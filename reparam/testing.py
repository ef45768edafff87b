"""Equivalence-testing helpers (public: test your own models with them).

* :func:`rel_err`: scale-relative maximum error ``max|a − b| / max|b|`` (after a shape check).
* :func:`assert_equivalent`: run two modules on the same inputs (on copies, in the requested dtype
  and mode) and assert their outputs agree to a scale-relative tolerance.
* :func:`randomize_bn_`: random running statistics and signed γ for every BatchNorm, so that merge
  tests are not vacuous (with default statistics T-I is nearly the identity and bugs hide; a zero-γ
  branch contributes nothing at all).
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
from torch import Tensor, nn

__all__ = ["rel_err", "assert_equivalent", "randomize_bn_", "default_rtol"]

_DEFAULT_RTOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 2e-2,
    torch.float16: 2e-2,
}


def default_rtol(dtype: torch.dtype) -> float:
    """Default scale-relative tolerance of a block comparison in ``dtype`` (spec 15.2)."""
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


def assert_equivalent(
    a: nn.Module,
    b: nn.Module,
    inputs: Tensor | Sequence[Tensor],
    dtype: torch.dtype | None = torch.float64,
    rtol: float | None = None,
    mode: str = "eval",
) -> float:
    """Assert that modules ``a`` and ``b`` compute the same outputs on ``inputs``.

    Both modules are deep-copied, converted to ``dtype`` (``None``: keep), put in ``mode``
    (``"eval"`` or ``"train"``) and run under ``no_grad``. The check is
    ``torch.testing.assert_close(out_a, out_b, rtol=tol, atol=tol·max|out_b|)`` after asserting equal
    shapes; ``tol`` defaults to 1e-10 (float64), 1e-5 (float32), 2e-2 (bfloat16/float16).

    Returns:
        The largest :func:`rel_err` over the outputs.
    """
    if mode not in ("eval", "train"):
        raise ValueError(f"mode must be 'eval' or 'train', got {mode!r}")
    ma, mb = copy.deepcopy(a), copy.deepcopy(b)
    xs = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
    if dtype is not None:
        ma, mb = ma.to(dtype), mb.to(dtype)
        xs = [x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x for x in xs]
    ma.train(mode == "train")
    mb.train(mode == "train")
    tol = rtol if rtol is not None else default_rtol(dtype or xs[0].dtype)
    with torch.no_grad():
        oa = _flatten(_call(ma, xs))
        ob = _flatten(_call(mb, xs))
    assert len(oa) == len(ob), f"output count differs: {len(oa)} vs {len(ob)}"
    worst = 0.0
    for ta, tb in zip(oa, ob):
        assert tuple(ta.shape) == tuple(tb.shape), f"output shape differs: {tuple(ta.shape)} vs {tuple(tb.shape)}"
        scale = tb.detach().abs().max().item() if tb.numel() else 0.0
        torch.testing.assert_close(ta, tb, rtol=tol, atol=tol * max(scale, 1e-30))
        worst = max(worst, rel_err(ta, tb))
    return worst


def _bn_modules(model: nn.Module) -> list[nn.Module]:
    out = []
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
