"""Lossless encoding of client tasks and outcomes into Flower records (no pickle).

A value (a task's fields and payload, a client's private state, a result) is split in two:

* every tensor goes into one :class:`flwr.app.ArrayRecord` as a NumPy array (``np.save`` without
  pickle). dtypes NumPy lacks (``bfloat16``, ``float8_*``, ``complex32``) travel as their raw bytes
  and are viewed back, so every dtype round-trips bit for bit;
* everything else becomes a JSON document in a :class:`flwr.app.ConfigRecord`, in which each
  container is a one-key object naming its type (``{"D": ...}`` dict, ``{"L": ...}`` list,
  ``{"U": ...}`` tuple, ``{"T": ...}`` tensor, …) so that dicts with non-string keys, tuples,
  bytes, NumPy scalars, non-finite floats and :class:`~fedhetero.core.hetero.submodel.SubmodelSpec` objects
  come back as they left. A tensor referenced twice is sent once and comes back shared.

Only plain data is accepted: an object of any other type raises :class:`TypeError` naming the
path to it, instead of being pickled (a pickle from the network could run arbitrary code).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

if TYPE_CHECKING:
    from flwr.app.typing import MetricRecordValues

from fedhetero.core.exchange.types import ClientResult, ClientTask
from fedhetero.core.exchange.types import Outcome
from fedhetero.core.hetero.submodel import SubmodelSpec

__all__ = [
    "PROTOCOL",
    "decode_outcome",
    "decode_task",
    "decode_value",
    "encode_outcome",
    "encode_task",
    "encode_value",
    "record_int",
]

#: Version of the wire format; the server and the nodes must agree on it.
PROTOCOL = 1

META = "fedhetero"  # ConfigRecord: the JSON document and the run's settings
ARRAYS = "fedhetero.arrays"  # ArrayRecord: the tensors the document refers to
METRICS = "metrics"  # MetricRecord: a few numbers for Flower's own tools (not read back)


def record_int(value: object, default: int = -1) -> int:
    """A record value (a ``ConfigRecord`` entry, a node's config) as an int: a number or numeric
    text converts, anything else (absent: None, a list) is ``default``."""
    if isinstance(value, (int, float, str, bytes)):
        return int(value)
    return default


# ---------------------------------------------------------------------------------- values
class _Encoder:
    def __init__(self) -> None:
        self.arrays: dict[str, Array] = {}
        self._memo: dict[int, tuple[Any, list[Any]]] = {}  # id(tensor) -> (tensor, tag)

    def tensor(self, t: torch.Tensor) -> list[Any]:
        hit = self._memo.get(id(t))
        if hit is not None:
            return hit[1]
        key = f"t{len(self.arrays)}"
        src = t.detach()
        if src.device.type != "cpu":
            src = src.cpu()
        src = src.resolve_conj().resolve_neg()
        dtype = str(t.dtype).removeprefix("torch.")
        try:
            arr = src.numpy()
            tag: list[Any] = [key, dtype]
        except (TypeError, RuntimeError):  # a dtype NumPy lacks: send the raw bytes
            arr = src.contiguous().reshape(-1).view(torch.uint8).numpy()
            tag = [key, dtype, list(t.shape)]
        self.arrays[key] = Array(arr)
        self._memo[id(t)] = (t, tag)  # keeps the tensor alive, so its id stays unique
        return tag

    def value(self, obj: Any, path: str) -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, torch.Tensor):
            return {"T": self.tensor(obj)}
        if isinstance(obj, np.generic):  # before int/float: np.float64 is a float subclass
            if obj.dtype.kind not in "biufc":
                raise TypeError(f"{path}: NumPy scalars of dtype {obj.dtype} cannot be sent")
            return {"G": [obj.dtype.str, self.value(obj.item(), path)]}
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return float(obj) if math.isfinite(obj) else {"F": repr(float(obj))}
        if isinstance(obj, complex):
            return {"C": [self.value(obj.real, path), self.value(obj.imag, path)]}
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in "biufc":
                raise TypeError(f"{path}: NumPy arrays of dtype {obj.dtype} cannot be sent")
            key = f"t{len(self.arrays)}"
            self.arrays[key] = Array(obj)
            return {"N": key}
        if isinstance(obj, (bytes, bytearray)):
            return {"B": base64.b64encode(bytes(obj)).decode("ascii")}
        if isinstance(obj, torch.Size):
            return {"S": [int(v) for v in obj]}
        if isinstance(obj, torch.dtype):
            return {"Y": str(obj).removeprefix("torch.")}
        if isinstance(obj, dict):
            tag = "O" if isinstance(obj, OrderedDict) else "D"
            return {tag: [[self.value(k, f"{path}[key]"), self.value(v, f"{path}[{k!r}]")] for k, v in obj.items()]}
        if isinstance(obj, list):
            return {"L": [self.value(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, tuple):
            return {"U": [self.value(v, f"{path}[{i}]") for i, v in enumerate(obj)]}

        if isinstance(obj, SubmodelSpec):
            return {"P": self.value(obj.to_dict(), f"{path}.spec")}
        raise TypeError(
            f"{path}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be sent to a Flower node; "
            "tasks, results and client state may hold tensors, NumPy arrays, numbers, strings, bytes, "
            "None and dicts/lists/tuples of them (nothing is pickled)"
        )


def _torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a Flower message")
    return dt


class _Decoder:
    def __init__(self, arrays: ArrayRecord | dict[str, Array], device: torch.device | None) -> None:
        self.arrays = arrays
        self.device = device if device is not None and device.type != "cpu" else None
        self._memo: dict[str, torch.Tensor] = {}

    def tensor(self, tag: list[Any]) -> torch.Tensor:
        key = tag[0]
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        arr = self.arrays[key].numpy()
        t = torch.from_numpy(np.array(arr, copy=True) if not arr.flags.writeable else arr)
        dtype = _torch_dtype(tag[1])
        if len(tag) > 2:  # raw bytes of a dtype NumPy lacks
            shape = [int(n) for n in tag[2]]
            t = t.contiguous().view(dtype).reshape(shape) if t.numel() else torch.empty(shape, dtype=dtype)
        elif t.dtype != dtype:
            raise ValueError(f"tensor {key}: expected dtype {dtype}, got {t.dtype}")
        if self.device is not None:
            t = t.to(self.device)
        self._memo[key] = t
        return t

    def value(self, obj: Any) -> Any:
        if obj is None or isinstance(obj, (bool, str, int, float)):
            return obj
        if isinstance(obj, dict) and len(obj) == 1:
            (tag, v), = obj.items()
            if tag == "T":
                return self.tensor(v)
            if tag == "D":
                return {self.value(k): self.value(x) for k, x in v}
            if tag == "O":
                return OrderedDict((self.value(k), self.value(x)) for k, x in v)
            if tag == "L":
                return [self.value(x) for x in v]
            if tag == "U":
                return tuple(self.value(x) for x in v)
            if tag == "F":
                return float(v)
            if tag == "C":
                return complex(self.value(v[0]), self.value(v[1]))
            if tag == "G":
                return np.dtype(v[0]).type(self.value(v[1]))
            if tag == "N":
                return np.array(self.arrays[v].numpy(), copy=True)
            if tag == "B":
                return base64.b64decode(v)
            if tag == "S":
                return torch.Size(v)
            if tag == "Y":
                return _torch_dtype(v)
            if tag == "P":
                return SubmodelSpec.from_dict(self.value(v))
        raise ValueError(f"malformed value in a Flower message: {str(obj)[:80]}")


def encode_value(obj: Any, name: str = "value") -> tuple[str, dict[str, Array]]:
    """``(json_text, arrays)`` for a plain-data value; :func:`decode_value` inverts it."""
    enc = _Encoder()
    doc = enc.value(obj, name)
    return json.dumps(doc, separators=(",", ":"), allow_nan=False), enc.arrays


def decode_value(text: str, arrays: ArrayRecord | dict[str, Array], device: torch.device | None = None) -> Any:
    """Inverse of :func:`encode_value` (tensors are moved to ``device`` unless it is the CPU)."""
    return _Decoder(arrays, device).value(json.loads(text))


def _pack(doc: Any, meta: dict[str, Any], name: str) -> RecordDict:
    text, arrays = encode_value(doc, name)
    rd = RecordDict()
    rd[META] = ConfigRecord({"protocol": PROTOCOL, "doc": text, **meta})
    rd[ARRAYS] = ArrayRecord(arrays)
    return rd


def _unpack(content: RecordDict, device: torch.device | None) -> tuple[Any, ConfigRecord]:
    if META not in content.config_records:
        raise ValueError("not a fedhetero message (no 'fedhetero' config record)")
    meta = content.config_records[META]
    if record_int(meta.get("protocol")) != PROTOCOL:
        raise ValueError(
            f"fedhetero wire protocol {meta.get('protocol')!s} on the other side, {PROTOCOL} here: "
            "install the same fedhetero version on the server and every node"
        )
    arrays = content.array_records.get(ARRAYS, ArrayRecord())
    return decode_value(str(meta["doc"]), arrays, device), meta


# ---------------------------------------------------------------------------------- tasks
def _fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def encode_task(
    task: ClientTask, state: dict[str, Any] | None = None, *, config: str = "", config_hash: str = ""
) -> RecordDict:
    """A train message's content: the task, the client's private state (None: the node keeps it)
    and the run's config (JSON text) with its hash."""
    doc = {"task": _fields(task), "state": state}
    return _pack(doc, {"config": config, "config-hash": config_hash, "cid": int(task.cid)}, f"task[cid={task.cid}]")


def decode_task(
    content: RecordDict, device: torch.device | None = None
) -> tuple[ClientTask, dict[str, Any] | None, str, str]:
    """``(task, state, config_json, config_hash)`` from a train message's content."""
    doc, meta = _unpack(content, device)
    task = ClientTask(**doc["task"])
    return task, doc["state"], str(meta.get("config", "")), str(meta.get("config-hash", ""))


# ---------------------------------------------------------------------------------- outcomes
def encode_outcome(outcome: Outcome) -> RecordDict:
    """A train reply's content: the client's result (or its error), wall time and traceback.
    The task is not sent back (the server still has it)."""
    res = outcome.result
    doc = {
        "result": None if res is None else _fields(res),
        "error": outcome.error,
        "seconds": float(outcome.seconds),
        "detail": outcome.detail,
        "kind": outcome.kind,
    }
    rd = _pack(doc, {"cid": int(outcome.task.cid)}, f"result[cid={outcome.task.cid}]")
    numbers: dict[str, MetricRecordValues] = {"seconds": float(outcome.seconds), "ok": int(res is not None)}
    if res is not None:
        numbers.update(
            {"num-examples": int(res.num_samples), "macs": int(res.macs), "bytes-up": int(res.bytes_up), "bytes-down": int(res.bytes_down)}
        )
    rd[METRICS] = MetricRecord(numbers)
    return rd


def decode_outcome(content: RecordDict, task: ClientTask, device: torch.device | None = None) -> Outcome:
    """The :class:`~fedhetero.core.run.backend.Outcome` of ``task`` from its reply's content."""
    doc, _ = _unpack(content, device)
    res = doc["result"]
    result = None if res is None else ClientResult(**res)
    if result is not None and result.cid != task.cid:
        raise ValueError(f"reply for client {result.cid} received for client {task.cid}")
    kind = doc.get("kind")
    return Outcome(task, result, doc["error"], float(doc["seconds"]), str(doc["detail"] or ""), kind=kind)
