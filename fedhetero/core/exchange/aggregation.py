"""The sample-weighted mean of the clients' uploads, computed once, in client-id order.

:func:`weighted_average` is the mean of a list; :class:`WeightedMean` builds the same sums one
upload at a time; :class:`UploadStream` feeds it a round's outcomes as they arrive (in client-id
order, whatever order they finish in), so the mean is ready when the last upload is in.
"""

from __future__ import annotations

from typing import Any

import torch

from fedhetero.core.exchange.types import ClientTask, check_result

__all__ = ["UploadStream", "Uploads", "WeightedMean", "streamed_mean", "weighted_average"]


def _flat_run(state: dict[str, torch.Tensor], keys: list[str]) -> torch.Tensor | None:
    """The tensors of ``keys`` as one flat view when they lie back to back, in this order, in one
    contiguous buffer (as :func:`packed_copy` leaves them); else None."""
    first = state[keys[0]]
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    total = 0
    for key in keys:
        t = state[key]
        if t.data_ptr() != end or not t.is_contiguous() or t.untyped_storage().data_ptr() != storage:
            return None
        end += t.nbytes
        total += t.numel()
    return first.as_strided((total,), (1,), first.storage_offset())


class WeightedMean:
    """A weighted mean of identically shaped state dicts, fed one state at a time, accumulated in
    float64 (one flat vector per dtype and device: the same element-wise sums, in the same order,
    as one accumulation per tensor, in a handful of calls instead of three per tensor).

    The weights are known up front (``weights[i]`` for the ``i``-th state added), so a state can be
    folded in as soon as it arrives; :func:`weighted_average` is this class fed with a list.
    Integer buffers (e.g. BatchNorm's ``num_batches_tracked``) take the value of the first state.
    """

    def __init__(self, weights: list[float]) -> None:
        if not weights:
            raise ValueError("weighted_average needs at least one state")
        self.weights = [float(w) for w in weights]
        self.total = float(sum(self.weights))
        if self.total <= 0:
            raise ValueError("weighted_average: weights must sum to a positive number")
        self.count = 0
        self._ref: dict[str, torch.Tensor] = {}
        self._groups: list[tuple[list[str], torch.Tensor]] = []

    def add(self, state: dict[str, torch.Tensor]) -> None:
        """Fold in the next state (the ``count``-th weight applies)."""
        if self.count >= len(self.weights):
            raise ValueError("weighted_average: one weight per state is required")
        alpha = self.weights[self.count] / self.total
        if self.count == 0:
            self._ref = state
            groups: dict[tuple[Any, Any], list[str]] = {}  # floating keys by (dtype, device)
            for key, v in state.items():
                if torch.is_floating_point(v):
                    groups.setdefault((v.dtype, v.device), []).append(key)
            self._groups = [
                (keys, torch.zeros(sum(state[k].numel() for k in keys), dtype=torch.float64, device=state[keys[0]].device))
                for keys in groups.values()
            ]
        else:
            for keys, _ in self._groups:
                for key in keys:
                    if state[key].shape != self._ref[key].shape:
                        raise ValueError(f"weighted_average: {key!r} has shape {tuple(state[key].shape)} in one "
                                         f"state and {tuple(self._ref[key].shape)} in another")
        for keys, acc in self._groups:
            flat = _flat_run(state, keys)
            if flat is None:
                flat = torch.cat([state[k].reshape(-1) for k in keys])
            acc.add_(flat, alpha=alpha)
        self.count += 1

    def result(self) -> dict[str, torch.Tensor]:
        """The mean, with the first state's keys, shapes and dtypes."""
        if self.count != len(self.weights):
            raise ValueError("weighted_average: one weight per state is required")
        ref = self._ref
        out = {key: v.clone() for key, v in ref.items() if not torch.is_floating_point(v)}
        for keys, acc in self._groups:
            flat = acc.to(ref[keys[0]].dtype)  # one (dtype, device) per group
            start = 0
            for key in keys:
                n = ref[key].numel()
                out[key] = flat[start : start + n].view(ref[key].shape)
                start += n
        return {key: out[key] for key in ref}


def weighted_average(
    states: list[dict[str, torch.Tensor]], weights: list[float]
) -> dict[str, torch.Tensor]:
    """Weighted mean of identically shaped state dicts, accumulated in float64 (see
    :class:`WeightedMean`).

    Integer buffers (e.g. BatchNorm's ``num_batches_tracked``) take the value of the first state.
    """
    if not states:
        raise ValueError("weighted_average needs at least one state")
    if len(states) != len(weights):
        raise ValueError("weighted_average: one weight per state is required")
    mean = WeightedMean(weights)
    for st in states:
        mean.add(st)
    return mean.result()


class UploadStream:
    """Folds a round's uploads into a :class:`~fedhetero.core.method.algorithm.WeightedMean` as their
    outcomes arrive, in client-id order (an outcome that arrives early waits for the ones before
    it), so the mean is ready when the last one is in: on the ``process`` back end the server does
    it while it waits for the workers' last uploads.

    The weights are the ones every client of the round would get (``train.aggregation``); an outcome
    that is not a checked success (an error, a time-out, an upload the executing process did not
    check for non-finite values) stops the stream, and the caller averages what succeeded itself.
    The sums are those of :func:`~fedhetero.core.method.algorithm.weighted_average`, in the same order."""

    def __init__(self, tasks: "list[ClientTask]", uniform: bool, timeout_s: float | None) -> None:
        order = sorted(tasks, key=lambda t: t.cid)
        self.weights = [1.0 if uniform else float(t.num_samples) for t in order]
        self.timeout_s = timeout_s
        self._index = {t.cid: i for i, t in enumerate(order)}
        self._waiting: dict[int, Any] = {}
        self._folded: list[Any] = []  # the results in the mean, in order
        self._next = 0
        self.ok = bool(order) and sum(self.weights) > 0
        self._mean = WeightedMean(self.weights) if self.ok else None

    def offer(self, outcome: Any) -> None:
        """Take one outcome (any order)."""
        if not self.ok:
            return
        res = outcome.result
        if not outcome.checked or check_result(outcome, self.timeout_s) is not None or res.cid not in self._index:
            self.ok = False
            return
        self._waiting[self._index[res.cid]] = res
        assert self._mean is not None
        try:
            while self._next in self._waiting:
                res = self._waiting.pop(self._next)
                self._mean.add(res.state)
                self._folded.append(res)
                self._next += 1
        except Exception:  # uploads the mean cannot take (not one model's state): the caller averages
            self.ok = False

    def mean_of(self, updates: list[Any], weights: list[float]) -> "dict[str, torch.Tensor] | None":
        """The mean if it is of exactly these result objects, in this order, with these weights."""
        if not self.ok or len(updates) != len(self._folded) or [float(w) for w in weights] != self.weights:
            return None
        if any(u is not f for u, f in zip(updates, self._folded)):
            return None
        assert self._mean is not None
        return self._mean.result()


class Uploads(list):  # type: ignore[type-arg]
    """The results of one exchange, sorted by client id (a list of
    :class:`~fedhetero.core.exchange.types.ClientResult`), with the :class:`UploadStream` that
    averaged their uploads while they arrived (:func:`streamed_mean` takes it)."""

    stream: "UploadStream | None" = None


def streamed_mean(updates: "list[Any]", weights: list[float]) -> "dict[str, torch.Tensor] | None":
    """The weighted mean of ``updates``' states accumulated while their exchange ran, if
    ``updates`` are that exchange's results (the same objects, in this order) and ``weights`` the
    weights it used; else None (the caller averages the uploads itself). Taken once: the
    accumulator is released."""
    stream = getattr(updates, "stream", None)
    if stream is None:
        return None
    updates.stream = None  # type: ignore[attr-defined]
    mean: dict[str, torch.Tensor] | None = stream.mean_of(updates, weights)
    return mean
