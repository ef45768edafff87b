"""The process back end's message channel: tensors out of band, shared storages, shared rings."""

from __future__ import annotations

import io
import pickle
import threading
from multiprocessing.connection import Pipe

import pytest
import torch

from fedhetero.backends import wire
from fedhetero.backends.wire import Channel


#: each direction's ring (the size ``Channel.share_rings`` uses by default)
RING_BYTES = 16 << 20


def _pair(rings: bool) -> tuple[Channel, Channel, bool]:
    """Two connected channels, and whether their data goes through shared rings (asked for with
    ``rings``; they need Linux memfd on x86-64)."""
    a, b = Pipe()
    ca, cb = Channel(a), Channel(b)
    shared = False
    if rings:
        got: list[bool] = []
        t = threading.Thread(target=lambda: got.append(cb.share_rings(first=False, size=RING_BYTES)))
        t.start()
        shared = ca.share_rings(first=True, size=RING_BYTES)
        t.join()
        assert shared == got[0]
    return ca, cb, shared


def _transfer(ca: Channel, cb: Channel, obj):
    """Send on one end while the other reads (messages may exceed the socket's buffer)."""
    t = threading.Thread(target=ca.send, args=(obj,))
    t.start()
    out = cb.recv()
    t.join()
    return out


@pytest.fixture(params=[False, True], ids=["socket", "ring"])
def pair(request):
    ca, cb, shared = _pair(request.param)
    if request.param and not shared:
        ca.close()
        cb.close()
        pytest.skip("shared rings need Linux memfd on x86-64")
    yield ca, cb
    ca.close()
    cb.close()


def test_tensors_of_every_kind_arrive_equal(pair):
    ca, cb = pair
    param = torch.nn.Parameter(torch.randn(4, 3))
    obj = {
        "f32": torch.randn(3, 4), "f64": torch.randn(5, dtype=torch.float64), "f16": torch.randn(6).half(),
        "i64": torch.arange(7), "scalar": torch.tensor(3), "bool": torch.tensor([True, False, True]),
        "c64": torch.randn(3, dtype=torch.complex64), "conj": torch.randn(2, dtype=torch.complex64).conj(),
        "empty": torch.empty(0, 5), "bf16": torch.randn(3).to(torch.bfloat16), "grad": torch.randn(2, requires_grad=True),
        "param": param, "transposed": torch.randn(4, 6).t(), "nested": [1, "two", None, {"x": torch.ones(2)}],
    }
    out = _transfer(ca, cb, obj)
    for key, value in obj.items():
        if not isinstance(value, torch.Tensor):
            continue
        got = out[key]
        assert type(got) is type(value), key
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert got.requires_grad == value.requires_grad, key
        assert torch.equal(got.detach(), value.detach()), key
    assert out["nested"][:3] == [1, "two", None] and torch.equal(out["nested"][3]["x"], torch.ones(2))
    assert out["transposed"].stride() == obj["transposed"].stride()  # a view arrives as the same view


def test_shared_memory_is_kept_and_slices_travel_alone(pair):
    ca, cb = pair
    flat = torch.arange(100, dtype=torch.float32)
    a, b = flat[:60].view(6, 10), flat[60:].view(4, 10)
    big = torch.randn(100_000)
    t = torch.randn(3)
    out = _transfer(ca, cb, {"a": a, "b": b, "again": t, "same": t, "slice": big[:10]})
    assert out["again"] is out["same"]  # one object sent twice arrives as one object
    assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()
    assert out["a"].untyped_storage().nbytes() == flat.untyped_storage().nbytes()  # sent once
    out["a"][0, 0] = -1.0
    assert out["a"].untyped_storage().data_ptr() != flat.untyped_storage().data_ptr() and flat[0] == 0
    # a small slice of a big tensor does not drag the big storage along
    assert out["slice"].untyped_storage().nbytes() == 10 * 4
    assert torch.equal(out["slice"], big[:10])
    buf = io.BytesIO()
    torch.save(out["slice"], buf)
    assert buf.tell() < 4096


def test_an_object_that_does_not_pickle_leaves_the_stream_intact(pair):
    ca, cb = pair
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        ca.send({"x": torch.ones(3), "f": lambda: 1})
    assert torch.equal(_transfer(ca, cb, {"x": torch.arange(4)})["x"], torch.arange(4))


def test_closed_peer_is_eof(pair):
    ca, cb = pair
    ca.close()
    ca.conn.close()
    with pytest.raises((EOFError, OSError)):
        cb.recv()


def test_ring_and_socket_together_keep_order_and_values():
    ca, cb, shared = _pair(True)
    if not shared:
        ca.close()
        cb.close()
        pytest.skip("shared rings need Linux memfd on x86-64")
    # messages written before any is read: the ring fills, the rest go through the socket, in order
    size = (RING_BYTES // 4) // 3 + 1000  # floats: three do not fit in one ring
    msgs = [{"i": i, "x": torch.full((size,), float(i))} for i in range(5)]
    t = threading.Thread(target=lambda: [ca.send(m) for m in msgs])
    t.start()
    got = [cb.recv() for _ in msgs]
    t.join()
    assert [g["i"] for g in got] == list(range(5))
    assert all(torch.equal(g["x"], m["x"]) for g, m in zip(got, msgs))
    # all read: the next span starts at the ring's beginning again
    ca.send({"x": torch.ones(10)})
    assert torch.equal(cb.recv()["x"], torch.ones(10))
    assert int(ca._out._consumed[0]) == ca._out.produced
    assert ca._out.produced % ca._out.capacity == wire._layout([40])[1]
    # a message larger than the ring goes through the socket whole
    huge = torch.randn(RING_BYTES // 4 + 10)
    assert torch.equal(_transfer(ca, cb, {"x": huge})["x"], huge)
    ca.close()
    cb.close()


def test_ring_bookkeeping_never_overwrites_unread_data():
    """The writer's room check against the reader's progress (no processes needed)."""
    import os

    if not hasattr(os, "memfd_create"):
        pytest.skip("needs memfd")
    fd = os.memfd_create("t")
    os.ftruncate(fd, 64 + 1000)
    ring = wire._Ring(fd, 64 + 1000)
    os.close(fd)
    assert ring.reserve(1001) is None  # larger than the ring
    start = ring.reserve(600)
    assert start == 0
    ring.produced = 600
    assert ring.reserve(500) is None  # would overwrite [0, 100) not yet read
    ring.consumed(600)
    assert ring.reserve(500) == 1000  # empty: starts over at the beginning (count 1000 = offset 0)
    ring.produced = 1400
    ring.consumed(1000)
    assert ring.reserve(300) == 1400  # fits after the unread span [1000, 1400) ≡ [0, 400)
    assert ring.reserve(700) is None  # would wrap onto it
    ring.close()


def test_one_storage_seen_as_two_dtypes(pair):
    ca, cb = pair
    raw = torch.arange(1, 11, dtype=torch.uint8)  # 10 bytes: not a whole number of float32s
    as_float = raw[:8].view(torch.float32)
    out = _transfer(ca, cb, {"raw": raw, "f": as_float})
    assert torch.equal(out["raw"], raw) and out["f"].view(torch.uint8).equal(raw[:8])
    assert out["raw"].data_ptr() == out["f"].data_ptr()
