"""How tasks and outcomes travel between processes.

A pickle whose CPU tensors are written as numpy arrays: a buffer copy instead of torch's
per-storage serialisation, which made a LeNet-5 state cost more to send than to train on digits.
Only our own processes read these bytes (the server and the workers it started).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

__all__ = ["dumps"]


def _tensor_from(array: Any, requires_grad: bool) -> Any:
    import torch

    out = torch.from_numpy(array)
    return out.requires_grad_(True) if requires_grad else out


class _Pickler(pickle.Pickler):
    """Pickles CPU tensors as numpy arrays: a buffer copy instead of torch's per-storage
    serialisation (which made a LeNet-5 state cost more to send than to train on digits). A tensor
    met twice (the global model shared by a round's tasks) is still written once."""

    def reducer_override(self, obj: Any) -> Any:
        import torch

        if type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.dtype in _NUMPY_DTYPES:
            return _tensor_from, (obj.detach().contiguous().numpy(), obj.requires_grad)
        return NotImplemented


def _numpy_dtypes() -> frozenset[Any]:
    import torch

    return frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                      torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128})


_NUMPY_DTYPES: frozenset[Any] = frozenset()


def dumps(obj: Any) -> bytes:
    """Serialise a task batch or an outcome for the trip between processes."""
    global _NUMPY_DTYPES
    if not _NUMPY_DTYPES:
        _NUMPY_DTYPES = _numpy_dtypes()
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()
