"""The preprocessing a trained model expects, as one callable.

A model trained by fedhetero takes images as its data set serves them: resized, scaled to [0, 1]
and normalised per channel (:mod:`fedhetero.data.datasets`). :meth:`ArrayDataset.input_record`
writes those steps down (a run keeps them in ``model.json``); :class:`InputTransform` applies them
to images as the data set's release stores them, with the same operations as the loader, so that
the result equals the loader's images bit for bit. It plays the part of torchvision's
``weights.transforms()`` and of timm's ``resolve_data_config`` + ``create_transform``::

    prepare = fedhetero.load_transform("runs/dynamicfl-digits-lenet5-s0-<hash>")
    logits = model(prepare(images))            # images: raw, e.g. load_digits().images[rows]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .datasets import _normalize_, _resize

__all__ = ["InputTransform"]

#: the layouts of one raw image, and how many dimensions each has
_LAYOUTS = {"HW": 2, "HWC": 3, "CHW": 3}


class InputTransform:
    """Raw images → the float32 ``N×C×H×W`` tensor a model of the run expects.

    Built from an input record (:meth:`fedhetero.data.ArrayDataset.input_record`, ``model.json``'s
    ``input``). Called on one image or a batch, a NumPy array or a tensor, in the release's layout
    (``raw["layout"]``: ``HW`` for grey-scale, ``HWC`` for colour, with an optional leading batch
    dimension) and scale (``raw["pixel_max"]`` is white: 16 for scikit-learn's digits, 255 for
    8-bit images). Without a raw format (``raw`` is ``None``) the input is float pixels in [0, 1]
    already at the model's shape (``C×H×W`` or ``N×C×H×W``); they are only normalised.
    """

    def __init__(self, record: Mapping[str, Any]) -> None:
        try:
            self.shape = tuple(int(v) for v in record["shape"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"input record: 'shape' must be [C, H, W], got {record.get('shape')!r}") from None
        if len(self.shape) != 3:
            raise ValueError(f"input record: 'shape' must be [C, H, W], got {list(self.shape)}")
        self.mean = None if record.get("mean") is None else tuple(float(v) for v in record["mean"])
        self.std = None if record.get("std") is None else tuple(float(v) for v in record["std"])
        raw = record.get("raw")
        self.raw = None if raw is None else dict(raw)
        if self.raw is not None and self.raw.get("layout") not in _LAYOUTS:
            raise ValueError(f"input record: raw layout must be one of {sorted(_LAYOUTS)}, got {self.raw.get('layout')!r}")
        self.dataset = str(record.get("dataset") or "")

    def __repr__(self) -> str:
        steps = []
        if self.raw is not None:
            steps.append(f"/{self.raw['pixel_max']:g}")
            if self.raw.get("resize"):
                steps.append(f"resize {self.raw['resize']['size']} ({self.raw['resize']['mode']})")
        if self.mean is not None:
            steps.append("normalise")
        return f"InputTransform({self.dataset or 'images'} → {'×'.join(map(str, self.shape))}: {', '.join(steps) or 'as is'})"

    def expected(self) -> str:
        """The input this transform takes, in words."""
        if self.raw is None:
            return f"float pixels in [0, 1] of shape {'×'.join(map(str, self.shape))} (C×H×W), optionally batched"
        return (f"raw images in layout {self.raw['layout']} (optionally batched), pixel values 0..{self.raw['pixel_max']:g}"
                + ("" if not self.raw.get("resize") else f", resized to {self.raw['resize']['size']}"))

    def __call__(self, images: Any) -> Tensor:
        x = images if isinstance(images, Tensor) else torch.from_numpy(np.array(images))  # a writable copy
        given = tuple(x.shape)
        x = x.detach().cpu().to(torch.float32, copy=True)  # never changes the caller's array
        if self.raw is None:
            if x.ndim == 3:
                x = x.unsqueeze(0)
        else:
            one = _LAYOUTS[self.raw["layout"]]
            if x.ndim == one:
                x = x.unsqueeze(0)
            if x.ndim != one + 1:
                raise ValueError(f"expected {self.expected()}; got an array of shape {given}")
            # the loaders' steps, in their order: to float32, scale, to N×C×H×W, resize
            x = x.div_(float(self.raw["pixel_max"]))
            if self.raw["layout"] == "HW":
                x = x.unsqueeze(1)
            elif self.raw["layout"] == "HWC":
                x = x.permute(0, 3, 1, 2)
            x = x.contiguous()
            if self.raw.get("resize"):
                x = _resize(x, int(self.raw["resize"]["size"]), str(self.raw["resize"]["mode"])).contiguous()
        if x.ndim != 4 or tuple(x.shape[1:]) != self.shape:
            raise ValueError(f"expected {self.expected()}; got an array of shape {given}, which does not "
                             f"become the model's {'×'.join(map(str, self.shape))}")
        if self.mean is not None and self.std is not None:
            _normalize_(x, self.mean, self.std)
        return x
