"""Per-branch gradient saliency of Diverse Branch Blocks (DynamicFL Eqs. 12–14, DyRep metrics).

For every block of a model and every branch ``k`` present in it, the meter keeps a running sum and a
count of one scalar per optimisation step, computed from the branch's parameter set ``θ^k`` and
gradient ``g``:

=============  ==================================  ======================================
``synflow``    ``Σ_j g_j · θ_j``  (signed)          DynamicFL Eqs. 13–14, DyRep default
``snip``       ``Σ_j |g_j · θ_j|``                  DyRep option
``grad_norm``  ``‖g‖₂``                             DyRep option
``random``     ``U(0, 1)``                          control
=============  ==================================  ======================================

``params="all"`` uses every trainable parameter of the branch (conv weights and BN γ/β;
paper-literal); ``params="conv_weights"`` uses conv weights only (DyRep), and falls back to the BN
parameters for branches without a conv (identity, depthwise average path). For an identity-based
1×1 stage the product uses the effective weight ``R + I`` (its gradient equals ``R``'s).
``normalize="numel"`` divides each step's value by the number of elements of the set.

Usage: call :meth:`SaliencyMeter.after_backward` once per optimisation step, after ``backward()``
and before ``optimizer.step()``. With gradient accumulation call it only at optimizer-step
boundaries (when the accumulated gradients are complete), never after every micro-batch. With AMP,
pass the ``GradScaler``: if ``scaler.unscale_(optimizer)`` has already run for this step the
gradients are used as they are, otherwise the values are divided by ``scaler.get_scale()``. Steps
whose values are not all finite (the steps GradScaler skips) are not recorded. Accumulation uses
tensor operations only (no host synchronisation per step, except reading the loss scale).

:meth:`values` returns the mean over the recorded steps of every tracked branch. The meter follows
structure changes: a branch added to the model starts with an empty accumulator, a removed branch is
dropped. Changes are detected automatically at the next :meth:`after_backward`; call
:meth:`refresh` to re-scan explicitly (e.g. before :meth:`values` right after a change).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from .block import DiverseBranchBlock
from .errors import ReparamError

__all__ = ["SaliencyMeter", "METRICS"]

METRICS: tuple[str, ...] = ("synflow", "snip", "grad_norm", "random")
_PARAM_SETS = ("all", "conv_weights")
_NORMALIZE = (None, "numel")

Key = tuple[str, str]


def _iter_blocks(model: nn.Module) -> Iterator[tuple[str, DiverseBranchBlock]]:
    for path, m in model.named_modules():
        if isinstance(m, DiverseBranchBlock):
            yield path, m


def _effective_weights(branch: nn.Module) -> dict[int, Callable[[], torch.Tensor]]:
    """``id(param) -> callable giving the effective weight`` for identity-based 1×1 stages.

    A module of the branch that exposes ``effective_weight()`` (``R + I``) owns such a parameter:
    the one of the same shape. The effective weight is re-evaluated at every step, so it follows
    ``.to()`` (device and dtype) and in-place updates.
    """
    found: dict[int, Callable[[], torch.Tensor]] = {}
    for m in branch.modules():
        fn = getattr(m, "effective_weight", None)
        if not callable(fn):
            continue
        for p in m.parameters(recurse=False):
            with torch.no_grad():
                eff = fn()
            if isinstance(eff, torch.Tensor) and p.shape == eff.shape:
                found[id(p)] = fn
                break
    return found


def _key_values(
    metric: str, grads: list[torch.Tensor], thetas: list[torch.Tensor], owners: list[int], n: int,
    device: torch.device, clients: int | None = None,
) -> torch.Tensor:
    """Per key (``owners[j]``: the key of parameter ``j``), the sum over its parameters of
    ``g·θ`` / ``|g·θ|`` / ``g·g`` (then its square root), products in the parameters' dtype, sums
    in float64 added in index order: ``(n,)`` for one model, ``(clients, n)`` for copies stacked
    along a first axis."""
    vals = torch.zeros((n,) if clients is None else (clients, n), dtype=torch.float64, device=device)
    if grads:
        prods = torch._foreach_mul(grads, grads if metric == "grad_norm" else thetas)
        if metric == "snip":
            torch._foreach_abs_(prods)
        index = torch.tensor(owners, device=device)
        if clients is None:
            vals.index_add_(0, index, torch.stack([q.sum(dtype=torch.float64).to(device) for q in prods]))
        else:
            vals.index_add_(1, index, torch.stack([q.flatten(1).sum(1, dtype=torch.float64).to(device) for q in prods], 1))
    if metric == "grad_norm":
        vals = vals.sqrt()
    return vals


@dataclass
class _Tracked:
    params: list[nn.Parameter]
    effective: list[Callable[[], torch.Tensor] | None]
    numel: int


class SaliencyMeter:
    """Accumulate a per-branch saliency metric over optimisation steps.

    Args:
        model: a model containing ``DiverseBranchBlock`` modules (a model without blocks tracks
            nothing).
        metric: ``"synflow"`` (default), ``"snip"``, ``"grad_norm"`` or ``"random"``.
        params: ``"all"`` (default) or ``"conv_weights"``.
        normalize: ``None`` (default) or ``"numel"``.
        generator: random generator for ``metric="random"`` (optional).

    Keys are ``(block path, branch name)``; the anchor ``"kxk"`` is tracked too (DYMM ignores it).
    """

    def __init__(
        self,
        model: nn.Module,
        metric: str = "synflow",
        params: str = "all",
        normalize: str | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if metric not in METRICS:
            raise ReparamError(f"metric must be one of {METRICS}, got {metric!r}")
        if params not in _PARAM_SETS:
            raise ReparamError(f"params must be one of {_PARAM_SETS}, got {params!r}")
        if normalize not in _NORMALIZE:
            raise ReparamError(f"normalize must be one of {_NORMALIZE}, got {normalize!r}")
        self.model = model
        self.metric = metric
        self.params = params
        self.normalize = normalize
        self.generator = generator
        self._sums: dict[Key, torch.Tensor] = {}
        self._counts: dict[Key, torch.Tensor] = {}
        self._sum_vec = torch.zeros(0, dtype=torch.float64)
        self._count_vec = torch.zeros(0, dtype=torch.float64)
        self._numel_vec = torch.zeros(0, dtype=torch.float64)
        self._flat: list[tuple[nn.Parameter, Callable[[], torch.Tensor] | None, int]] = []
        self._tracked: dict[Key, _Tracked] = {}
        self._signature: tuple = ()
        self._skipped: torch.Tensor | None = None
        self.refresh()

    # ---------------------------------------------------------------- structure

    def _compute_signature(self) -> tuple:
        return tuple(
            (path, id(block), tuple(self._names(block))) for path, block in _iter_blocks(self.model)
        )

    @staticmethod
    def _names(block: DiverseBranchBlock) -> list[str]:
        return block.branch_names

    def _device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    def refresh(self) -> None:
        """Re-scan the model: new branches get empty accumulators, vanished ones are dropped."""
        tracked: dict[Key, _Tracked] = {}
        for path, block in _iter_blocks(self.model):
            for name in self._names(block):
                plist = [p for p in block.branch_parameters(name) if p.requires_grad]
                if self.params == "conv_weights":
                    conv = [p for p in plist if p.dim() == 4]
                    plist = conv or plist
                eff = _effective_weights(block.branches[name])
                tracked[(path, name)] = _Tracked(
                    params=plist,
                    effective=[eff.get(id(p)) for p in plist],
                    numel=sum(p.numel() for p in plist),
                )
        device = self._device()
        self._tracked = tracked
        self._layout(device)
        if self._skipped is None:
            self._skipped = torch.zeros((), dtype=torch.float64, device=device)
        # every tracked parameter in key order, with the index of the key it counts for: one step's
        # values are computed for all of them at once (:meth:`_step_values`)
        self._flat = [(p, eff, i) for i, t in enumerate(tracked.values()) for p, eff in zip(t.params, t.effective)]
        self._signature = self._compute_signature()

    def _layout(self, device: torch.device) -> None:
        """Hold the sums and counts of the tracked keys (in their order) in two vectors on
        ``device``; ``_sums[k]`` and ``_counts[k]`` are views of their entries, so a step adds to
        every key in one operation. A key kept from before keeps its values; a new one starts at 0."""
        keys = list(self._tracked)
        sums = torch.zeros(len(keys), dtype=torch.float64, device=device)
        counts = torch.zeros(len(keys), dtype=torch.float64, device=device)
        for i, k in enumerate(keys):
            if k in self._sums:
                sums[i] = self._sums[k].to(device)
                counts[i] = self._counts[k].to(device)
        self._sum_vec, self._count_vec = sums, counts
        # each key's parameter count, for normalize="numel" (computed once per structure, not per step)
        self._numel_vec = torch.tensor([max(t.numel, 1) for t in self._tracked.values()], dtype=torch.float64,
                                       device=device)
        self._sums = {k: sums[i] for i, k in enumerate(keys)}
        self._counts = {k: counts[i] for i, k in enumerate(keys)}

    def _ensure_current(self) -> None:
        if self._compute_signature() != self._signature:
            self.refresh()

    # ---------------------------------------------------------------- recording

    @staticmethod
    def _scaler_inv_scale(scaler: Any, optimizer: Any, unscaled: bool | None) -> float:
        if scaler is None:
            return 1.0
        is_enabled = getattr(scaler, "is_enabled", None)
        if callable(is_enabled) and not is_enabled():
            return 1.0
        if unscaled is None:
            unscaled = False
            states = getattr(scaler, "_per_optimizer_states", None)
            if isinstance(states, dict):
                if optimizer is not None:
                    chosen = [states[id(optimizer)]] if id(optimizer) in states else []
                else:
                    chosen = list(states.values())
                for st in chosen:
                    stage = st.get("stage") if isinstance(st, dict) else None
                    if stage is not None and getattr(stage, "name", str(stage)) == "UNSCALED":
                        unscaled = True
        if unscaled:
            return 1.0
        scale = float(scaler.get_scale())
        if not math.isfinite(scale) or scale == 0.0:
            raise ReparamError(f"scaler.get_scale() returned {scale}; cannot unscale gradients")
        return 1.0 / scale

    def _step_values(self, n: int, device: torch.device) -> torch.Tensor:
        """This step's value of every tracked key (``n`` of them, in key order): per key, the sum
        over its parameters of ``g·θ`` (``synflow``), ``|g·θ|`` (``snip``) or ``g·g``
        (``grad_norm``, then its square root), each product in the parameter's dtype and summed in
        float64, a key's sums added in its parameters' order (``index_add_`` adds in index order);
        from a few list-wide operations. ``random`` draws one value per key, in key order."""
        if self.metric == "random":
            return torch.stack([torch.rand((), generator=self.generator, dtype=torch.float64) for _ in range(n)]).to(device)
        grads: list[torch.Tensor] = []
        thetas: list[torch.Tensor] = []
        owners: list[int] = []
        products = self.metric != "grad_norm"
        # under no_grad nothing below is recorded, so the tensors go in as they are (no detached
        # views: a step of a 3×-tier LeNet-5 reads 134 parameters; the values are the same bits)
        with torch.no_grad():
            for p, eff, i in self._flat:
                g = p.grad
                if g is None:
                    continue
                grads.append(g)
                owners.append(i)
                if products:
                    thetas.append(p if eff is None else eff())
            return _key_values(self.metric, grads, thetas, owners, n, device)

    def stacked_values(self, grads: Sequence[torch.Tensor], thetas: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """One step's value of every tracked key for ``C`` copies of the model at once (a batched
        cohort of clients of this structure), as :meth:`after_backward` computes and normalises it
        for one: ``grads`` and ``thetas`` hold, for each parameter of :meth:`tracked` in its order,
        the copies' gradients and parameters stacked along a first axis of size ``C`` (an
        identity-based stage's at its effective weight; ``thetas`` is not read by ``grad_norm``).
        Returns ``(C, keys)`` in float64; the per-copy sums over a parameter's entries may round
        differently from the one-copy sums. Not for ``metric="random"``."""
        if self.metric == "random":
            raise ReparamError("stacked_values: random saliency draws per meter; record each copy with its own meter")
        self._ensure_current()
        if len(grads) != len(self._flat) or (thetas is not None and len(thetas) != len(grads)):
            raise ReparamError(f"stacked_values: expected {len(self._flat)} stacked gradients (one per tracked parameter)")
        if self.metric != "grad_norm" and thetas is None:
            raise ReparamError(f"stacked_values: metric {self.metric!r} needs the stacked parameters")
        device = self._sum_vec.device
        with torch.no_grad():
            vals = _key_values(self.metric, list(grads), list(thetas or ()), [i for _, _, i in self._flat],
                               len(self._tracked), device, clients=int(grads[0].shape[0]) if grads else 0)
        return vals / self._numel_vec if self.normalize == "numel" else vals

    def after_backward(
        self,
        scaler: Any = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        unscaled: bool | None = None,
    ) -> None:
        """Record one optimisation step (call after ``backward()``, before ``optimizer.step()``).

        Args:
            scaler: a ``torch.amp.GradScaler`` (or any object with ``get_scale()``) when AMP is
                used. Gradients that were not yet unscaled are divided by the scale.
            optimizer: the optimizer whose unscale state is checked (default: any optimizer the
                scaler has unscaled this step).
            unscaled: override the detection (``True``: gradients are already unscaled).

        A step whose values are not all finite is skipped (counted in :attr:`skipped_steps`).
        """
        self._ensure_current()
        if not self._tracked:
            return
        inv = self._scaler_inv_scale(scaler, optimizer, unscaled)
        device = self._device()
        if self._skipped is not None and self._skipped.device != device:  # the model was moved
            self._to(device)
        vals = self._step_values(len(self._tracked), device)
        if self.metric != "random":
            if inv != 1.0:
                vals = vals * inv
            if self.normalize == "numel":
                vals = vals / self._numel_vec
        finite = torch.isfinite(vals).all()
        vals = torch.where(finite, vals, torch.zeros_like(vals))
        inc = finite.to(torch.float64)
        self._sum_vec.add_(vals)
        self._count_vec.add_(inc)
        skipped = self._skipped
        assert skipped is not None  # set by refresh()
        skipped.add_(1.0 - inc)

    def _to(self, device: torch.device) -> None:
        self._layout(device)
        if self._skipped is not None:
            self._skipped = self._skipped.to(device)

    # ---------------------------------------------------------------- values computed elsewhere

    def tracked(self) -> list[tuple[Key, list[tuple[nn.Parameter, Callable[[], torch.Tensor] | None]]]]:
        """The tracked keys in the order of their values, each with the parameters its value is
        computed from and, for an identity-based 1×1 stage's parameter, the callable giving its
        effective weight (``R + I``; else None): what code computing the same values for several
        copies of the model at once (a batched cohort of clients) needs to know."""
        self._ensure_current()
        return [(k, list(zip(t.params, t.effective))) for k, t in self._tracked.items()]

    def accumulate(self, sums: torch.Tensor, steps: float, skipped: float = 0.0) -> None:
        """Add values computed outside the meter, as :meth:`after_backward` would have added them
        over ``steps`` recorded steps: ``sums`` holds, per key of :meth:`tracked` and in that
        order, the sum of those steps' values (already normalised when ``normalize="numel"``);
        ``skipped``: steps left out because a value was not finite."""
        self._ensure_current()
        if sums.shape != self._sum_vec.shape:
            raise ReparamError(f"accumulate: expected {tuple(self._sum_vec.shape)} sums (one per tracked key), "
                               f"got {tuple(sums.shape)}")
        self._sum_vec.add_(sums.to(self._sum_vec.device, torch.float64))
        self._count_vec.add_(float(steps))
        skipped_vec = self._skipped
        assert skipped_vec is not None  # set by refresh()
        skipped_vec.add_(float(skipped))

    # ---------------------------------------------------------------- reading

    @property
    def skipped_steps(self) -> int:
        """Number of steps skipped because a value was not finite."""
        return int(self._skipped.item()) if self._skipped is not None else 0

    def counts(self) -> dict[Key, int]:
        """Recorded steps per key."""
        keys = list(self._counts)
        if not keys:
            return {}
        vals = torch.stack([self._counts[k] for k in keys]).tolist()
        return {k: int(v) for k, v in zip(keys, vals)}

    def values(self) -> dict[Key, float]:
        """Mean per recorded step of every tracked ``(block path, branch name)``.

        Branches with no recorded step (e.g. added after the last step) are absent.
        """
        keys = list(self._sums)
        if not keys:
            return {}
        sums = torch.stack([self._sums[k] for k in keys]).tolist()
        cnts = torch.stack([self._counts[k] for k in keys]).tolist()
        return {k: s / c for k, s, c in zip(keys, sums, cnts) if c > 0}

    def reset(self) -> None:
        """Zero every accumulator (and the skipped-step counter); tracking is kept."""
        for k in self._sums:
            self._sums[k].zero_()
            self._counts[k].zero_()
        if self._skipped is not None:
            self._skipped.zero_()

    # ---------------------------------------------------------------- persistence

    def state_dict(self) -> dict:
        """JSON-able state: settings, per-key sums and counts, skipped steps."""
        keys = list(self._sums)
        sums = torch.stack([self._sums[k] for k in keys]).tolist() if keys else []
        cnts = torch.stack([self._counts[k] for k in keys]).tolist() if keys else []
        return {
            "metric": self.metric,
            "params": self.params,
            "normalize": self.normalize,
            "entries": [[p, n, s, c] for (p, n), s, c in zip(keys, sums, cnts)],
            "skipped": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore accumulators saved by :meth:`state_dict` (build the model structure first).

        Entries for branches that are not in the model are dropped; branches of the model without
        an entry start empty. The settings must match this meter's.
        """
        if not isinstance(state, dict) or "entries" not in state:
            raise TypeError("state must be a dict produced by SaliencyMeter.state_dict()")
        for field in ("metric", "params", "normalize"):
            if state.get(field, getattr(self, field)) != getattr(self, field):
                raise ReparamError(
                    f"state {field}={state.get(field)!r} does not match this meter's {getattr(self, field)!r}"
                )
        self.refresh()
        self.reset()
        for path, name, s, c in state["entries"]:
            key = (path, name)
            if key in self._sums:
                self._sums[key].fill_(float(s))
                self._counts[key].fill_(float(c))
        skipped = self._skipped
        assert skipped is not None  # set by refresh()
        skipped.fill_(float(state.get("skipped", 0)))
