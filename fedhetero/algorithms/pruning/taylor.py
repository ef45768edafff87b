"""Alternative channel criteria: Molchanov's Taylor importance (``taylor_bn``) and filter magnitude.

``taylor_bn`` (Molchanov et al., "Importance Estimation for Neural Network Pruning", CVPR 2019,
"gate after BN" variant): a per-channel gate ``z_c ≡ 1`` after BN has gradient
``∂L/∂z_c = γ_c ∂L/∂γ_c + β_c ∂L/∂β_c``; the importance is its square, computed from the minibatch
gradient (square of the batch sum) and averaged over batches. Channels produced without a BN use the
same gate on the conv/linear output (``Σ_filter w·∂L/∂w + b·∂L/∂b``, exact because that output is
linear in the filter's weights and bias). A group's score is the **sum** over its members (every BN,
or every producing conv/linear when the group has no BN): the shared-gate analogue.

``magnitude``: ``Σ|w|^p`` (L1 by default) of the producers' output slices (conv and linear weights),
summed over the group's producers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["taylor_bn_scores", "magnitude_scores", "group_rows"]


def _channel_groups(model: nn.Module) -> Any:
    fn = getattr(model, "channel_groups", None)
    if not callable(fn):
        raise TypeError(f"model {type(model).__name__} has no channel_groups() method")
    return fn()


def group_rows(groups: Any, key: str, group: str, axis: int = 0) -> tuple[int, int, int]:
    """``(offset, channels, repeat)`` of ``group``'s segment along ``axis`` of ``state[key]``.

    Channel ``c`` of the group owns positions ``offset + c·repeat … offset + (c+1)·repeat − 1``
    (``repeat > 1`` for a linear layer after a flatten). Raises ``ValueError`` if ``key`` does not use
    ``group`` on that axis.
    """
    dm = groups.dims[key][axis]
    if dm is None:
        raise ValueError(f"{key!r} has no channel group on dim {axis}")
    offset = 0
    for g, rep in dm:
        size = groups.sizes[g]
        if g == group:
            return offset, size, rep
        offset += size * rep
    raise ValueError(f"{key!r} does not use channel group {group!r} on dim {axis}")


def _per_channel(values: Tensor, groups: Any, key: str, group: str) -> Tensor:
    """Sum a per-row vector (length = dim 0 of ``state[key]``) over each channel's rows."""
    offset, size, rep = group_rows(groups, key, group)
    return values[offset : offset + size * rep].reshape(size, rep).sum(1)


def _resolve_groups(cg: Any, groups: Sequence[str] | None) -> list[str]:
    names = cg.prunable if groups is None else list(groups)
    for g in names:
        if g not in cg.sizes:
            raise ValueError(f"groups: unknown channel group {g!r}; known: {cg.names}")
    return names


def _split_key(key: str) -> tuple[str, str]:
    mod, _, name = key.rpartition(".")
    return mod, name


def magnitude_scores(model: nn.Module, groups: Sequence[str] | None = None, *, p: float = 1.0) -> dict[str, Tensor]:
    """``Σ|w|^p`` per channel over every producing conv/linear weight slice of each group.

    Data-free; float64 ``(C,)`` per group. ``groups`` default: every prunable group.
    """
    if not p > 0:
        raise ValueError(f"p must be positive, got {p!r}")
    cg = _channel_groups(model)
    state = model.state_dict()
    out: dict[str, Tensor] = {}
    for g in _resolve_groups(cg, groups):
        score = torch.zeros(cg.sizes[g], dtype=torch.float64)
        for key in cg.producers(g):
            d0, d1 = cg.dims[key]
            if d1 is None:  # biases and BN tensors are not filter weights
                continue
            w = state[key].detach()
            w = w.reshape(w.shape[0], -1).abs()
            if p != 1.0:
                w = w.to(torch.float64).pow(p)
            score += _per_channel(w.sum(1, dtype=torch.float64), cg, key, g)
        out[g] = score
    return out


def _inputs_targets(batch: Any) -> tuple[Tensor, Tensor]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, Tensor) for t in batch):
        return batch[0], batch[1]
    raise TypeError("batches must yield (inputs, targets) pairs of tensors")


def taylor_bn_scores(
    model: nn.Module,
    batches: Iterable[Any],
    groups: Sequence[str] | None = None,
    *,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
    max_batches: int | None = None,
    train: bool = False,
) -> dict[str, Tensor]:
    """Molchanov Taylor-FO-BN importance per channel of each group (float64 ``(C,)``).

    Per batch ``b``: ``I_c^b = (Σ_members γ_c ∂L_b/∂γ_c + β_c ∂L_b/∂β_c)²`` (gate-after-BN; for a
    group without BN the gate sits on the producers' outputs). Scores are averaged over batches.
    ``train=False`` (default) evaluates in ``eval()`` mode; ``train=True`` uses batch statistics
    and restores the BN running buffers afterwards. Model parameters, ``.grad`` and the mode are
    left unchanged.
    """
    cg = _channel_groups(model)
    names = _resolve_groups(cg, groups)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    # members per group: (weight key, bias key or None)
    plan: dict[str, list[tuple[str, str | None]]] = {}
    for g in names:
        bn_keys = [k for k in cg.producers(g) if k.endswith(".weight")
                   and isinstance(modules.get(_split_key(k)[0]), nn.modules.batchnorm._BatchNorm)]
        if bn_keys:
            members: list[tuple[str, str | None]] = [(k, _split_key(k)[0] + ".bias") for k in bn_keys]
        else:
            members = []
            for k in cg.producers(g):
                mod_path, leaf = _split_key(k)
                if leaf != "weight" or not isinstance(modules.get(mod_path), (nn.Conv2d, nn.Linear)):
                    continue
                bias_key = mod_path + ".bias" if getattr(modules[mod_path], "bias", None) is not None else None
                members.append((k, bias_key))
        if not members:
            raise ValueError(f"groups: channel group {g!r} has no BN or conv/linear producer to score")
        plan[g] = [(w, b if (b is not None and b in params) else None) for w, b in members]
    keys = sorted({k for ms in plan.values() for w, b in ms for k in ([w] + ([b] if b else []))})
    for k in keys:
        if k not in params or not params[k].requires_grad:
            raise ValueError(f"parameter {k!r} must be trainable to compute taylor_bn scores")
    tensors = [params[k] for k in keys]
    sums = {g: torch.zeros(cg.sizes[g], dtype=torch.float64) for g in plan}
    count = 0
    was_training = model.training
    saved = {n: b.detach().clone() for n, b in model.named_buffers()} if train else {}
    model.train(train)
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            x, y = _inputs_targets(batch)
            with torch.enable_grad():
                loss = loss_fn(model(x), y)
                grads = torch.autograd.grad(loss, tensors, allow_unused=True)
            gmap = {k: (torch.zeros_like(t) if gr is None else gr) for k, t, gr in zip(keys, tensors, grads)}
            for g, members in plan.items():
                gate = torch.zeros(cg.sizes[g], dtype=torch.float64)
                for wk, bk in members:
                    prod = (params[wk].detach() * gmap[wk]).to(torch.float64)
                    prod = prod.reshape(prod.shape[0], -1).sum(1)
                    if bk is not None:
                        prod = prod + (params[bk].detach() * gmap[bk]).to(torch.float64)
                    gate += _per_channel(prod, cg, wk, g)
                sums[g] += gate.pow(2)
            count += 1
    finally:
        model.train(was_training)
        if train:
            with torch.no_grad():
                for n, b in model.named_buffers():
                    b.copy_(saved[n])
    if count == 0:
        raise ValueError("batches is empty: taylor_bn needs at least one batch")
    return {g: s / count for g, s in sums.items()}
