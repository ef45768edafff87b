"""Batches by indexing in-memory tensors, and tensor-level augmentation.

:func:`iterate_batches` is the training hot path: one index permutation per epoch, then each batch
is a single advanced-indexing gather from :attr:`ArrayDataset.images`. Augmentation
(:func:`random_crop_flip`) works on the whole batch at once and draws all its randomness from the
given ``torch.Generator``, so a run is reproducible from its seeds.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from .datasets import ArrayDataset
from .errors import DataConfigError

__all__ = ["epoch_order", "iterate_batches", "random_crop_flip", "num_batches"]


def random_crop_flip(
    x: Tensor,
    *,
    padding: int = 4,
    flip: bool = True,
    fill: Sequence[float] | float = 0.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Random crop after padding, then random horizontal flip, per sample (a new tensor).

    Equivalent to torchvision's ``RandomCrop(H, padding=padding)`` followed by
    ``RandomHorizontalFlip(0.5)`` applied to every image independently. Padding uses ``fill`` per
    channel; pass :meth:`ArrayDataset.pixel_fill` so that padding is a black pixel before
    normalisation, exactly as in the usual pipeline (pad, then normalise).

    Randomness: ``2·N`` integers in ``[0, 2·padding]`` for the offsets, then ``N`` uniforms for the
    flips, all from ``generator`` (the global torch generator when ``None``).
    """
    if x.ndim != 4:
        raise DataConfigError(f"x must be N×C×H×W, got shape {tuple(x.shape)}")
    if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
        raise DataConfigError(f"padding must be an int >= 0, got {padding!r}")
    n, c, h, w = x.shape
    dev = x.device
    gen_dev = generator.device if generator is not None else torch.device("cpu")
    out = x
    if padding > 0 and n > 0:
        fills = torch.as_tensor(fill, dtype=x.dtype).reshape(-1)
        if fills.numel() not in (1, c):
            raise DataConfigError(f"fill must be a float or {c} floats (one per channel)")
        padded = fills.to(dev).view(1, -1, 1, 1).expand(n, c, h + 2 * padding, w + 2 * padding).clone()
        padded[:, :, padding : padding + h, padding : padding + w] = x
        offs = torch.randint(0, 2 * padding + 1, (2, n), generator=generator, device=gen_dev).to(dev)
        rows = offs[0].view(n, 1) + torch.arange(h, device=dev).view(1, h)  # n×h
        cols = offs[1].view(n, 1) + torch.arange(w, device=dev).view(1, w)  # n×w
        bidx = torch.arange(n, device=dev).view(n, 1, 1)
        out = padded.permute(0, 2, 3, 1)[bidx, rows.view(n, h, 1), cols.view(n, 1, w)]  # n×h×w×c
        out = out.permute(0, 3, 1, 2).contiguous()
    if flip and n > 0:
        mask = (torch.rand(n, generator=generator, device=gen_dev) < 0.5).to(dev)
        if out is x:
            out = x.clone()
        out[mask] = out[mask].flip(-1)
    return out


def num_batches(n: int, batch_size: int, drop_last: bool = False) -> int:
    """Number of batches :func:`iterate_batches` yields for ``n`` indices."""
    return n // batch_size if drop_last else -(-n // batch_size)


def epoch_order(
    dataset: ArrayDataset,
    indices: np.ndarray | Sequence[int] | Tensor | None,
    generator: torch.Generator | None = None,
    shuffle: bool = True,
) -> Tensor:
    """The rows of ``dataset`` in the order one epoch of :func:`iterate_batches` visits them
    (batch ``k`` is ``[k·B, (k+1)·B)`` of it)."""
    src_dev = dataset.images.device
    if indices is None:
        idx = torch.arange(len(dataset), device=src_dev)
    elif isinstance(indices, Tensor):
        idx = indices.to(device=src_dev, dtype=torch.long).reshape(-1)
    else:
        idx = torch.from_numpy(np.asarray(indices, dtype=np.int64).reshape(-1)).to(src_dev)
    n = int(idx.numel())
    if n and (int(idx.min()) < 0 or int(idx.max()) >= len(dataset)):
        raise DataConfigError(f"indices must lie in [0, {len(dataset)}) for this dataset")
    if shuffle and n > 1:
        gen_dev = generator.device if generator is not None else torch.device("cpu")
        perm = torch.randperm(n, generator=generator, device=gen_dev).to(src_dev)
        idx = idx[perm]
    return idx


def iterate_batches(
    dataset: ArrayDataset,
    indices: np.ndarray | Sequence[int] | Tensor | None,
    batch_size: int,
    *,
    generator: torch.Generator | None = None,
    shuffle: bool = True,
    drop_last: bool = False,
    augment: bool = False,
    device: torch.device | str | None = None,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield ``(x, y)`` batches over ``indices`` of ``dataset`` for one epoch.

    Guarantees: every index appears exactly once per epoch (the last batch is smaller unless
    ``drop_last``, which drops it); without ``shuffle`` the order is the order of ``indices``.
    With ``shuffle`` the order is ``torch.randperm`` drawn from ``generator`` (the global torch
    generator when ``None``; pass a generator for reproducible runs). ``augment`` applies
    :func:`random_crop_flip` with the same generator, after the permutation is drawn.
    ``indices=None`` means the whole dataset. Batches are moved to ``device`` when given.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise DataConfigError(f"batch_size must be a positive int, got {batch_size!r}")
    batch_size = int(batch_size)
    idx = epoch_order(dataset, indices, generator, shuffle)
    n = int(idx.numel())
    fill = dataset.pixel_fill() if augment else None  # the padding of the augmentation
    stop = n - n % batch_size if drop_last else n
    # the whole set in storage order (an evaluation): batches are views, not copies
    in_order = indices is None and not shuffle and not augment
    for start in range(0, stop, batch_size):
        if in_order:
            x = dataset.images[start : start + batch_size]
            y = dataset.labels[start : start + batch_size]
        else:
            b = idx[start : start + batch_size]
            x = dataset.images[b]
            y = dataset.labels[b]
        if fill is not None:  # augment
            x = random_crop_flip(x, padding=4, flip=True, fill=fill, generator=generator)
        if device is not None:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
        yield x, y
