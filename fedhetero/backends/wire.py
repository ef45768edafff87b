"""How tasks and outcomes travel between the server and its worker processes.

A message is a pickle of everything but the tensors, which it names by number, a table describing
each tensor as a view (dtype, shape, stride, offset) of a numbered storage, and those storages'
bytes. The receiver reads the table first, makes an empty buffer per storage and the tensors as
views of those, unpickles the rest, then fills the buffers. The bytes go through a shared-memory
ring where both sides have one (Linux x86-64), else through the socket straight from the tensors'
memory (one gathered write, one scattered read). Little work per tensor and none per element in
Python: a LeNet-5 state took longer to serialise the usual way than a digits client takes to train
on it. Tensors that shared a storage share one again; every storage received is the receiver's
own memory. Only our own processes read these bytes (the server and the workers it started).
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import platform
import socket
import struct
import threading
from typing import Any, Iterator

import numpy as np
import torch

__all__ = ["Channel"]

_PREFIX = struct.Struct("<QQ")  # lengths of the tensor table and of the pickle
_RING_BYTES = 16 << 20  # bytes of each direction's shared ring (pages are touched only as used)
_IOV_MAX = 512  # pieces per sendmsg call (POSIX guarantees 16; Linux and macOS allow 1024)
_DTYPES: dict[Any, str] = {}  # torch dtype -> its name, for the dtypes numpy can view


def _dtypes() -> dict[Any, str]:
    if not _DTYPES:
        for name in ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool",
                     "complex64", "complex128"):
            _DTYPES[getattr(torch, name)] = name
    return _DTYPES


_RECEIVING = threading.local()  # the tensors of the message being unpickled in this thread


def _received(number: int) -> Any:
    """The ``number``-th tensor of the message being unpickled (what a sent tensor pickles to)."""
    return _RECEIVING.tensors[number]


class _Pickler(pickle.Pickler):
    """Pickles each CPU tensor of a dtype numpy knows as a call for the tensor of that number;
    :meth:`plan` then describes each as a view (dtype, shape, stride, offset) of a numbered
    storage, and gives the storages' bytes. Tensors that share memory (the views of one flat
    buffer, a tensor met twice) arrive sharing it, with their data sent once; the tensors of a
    storage they cover less than half of are sent as copies of their own (a small slice must not
    carry a large buffer with it)."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[Any] = []  # (detached tensor, requires_grad, storage, its address), numbered as met
        self._seen: dict[int, Any] = {}  # id of a tensor met -> what it pickles to
        self._keep: list[Any] = []  # the tensors met (their ids stay unique while they live)
        self._names = _dtypes()
        self._tensor = torch.Tensor
        self._strided = torch.strided

    def reducer_override(self, obj: Any) -> Any:
        # pickle skips this for None, bools and exact ints, floats, strings, bytes, lists, tuples,
        # dicts and sets: it runs for few objects besides the tensors
        if type(obj) is not self._tensor:
            return NotImplemented
        reduced = self._seen.get(id(obj))
        if reduced is not None:  # the same object again: it arrives as one object
            return reduced
        if obj.dtype not in self._names or not obj.is_cpu or obj.layout is not self._strided:
            return NotImplemented  # torch's own pickling
        data = obj.detach() if obj.requires_grad else obj
        if data.is_conj() or data.is_neg():
            data = data.resolve_conj().resolve_neg()
        reduced = self._seen[id(obj)] = (_received, (len(self.tensors),))
        storage = data.untyped_storage()
        self.tensors.append((data, obj.requires_grad, storage, storage.data_ptr()))
        self._keep.append(obj)
        return reduced

    def plan(self) -> tuple[list[tuple[Any, ...]], list[memoryview]]:
        """``(descriptors, storages)``: per tensor number ``(storage, dtype, shape, stride, offset,
        requires_grad)``, and the bytes of each storage, in order."""
        covered: dict[int, int] = {}
        for data, _, _, ptr in self.tensors:
            covered[ptr] = covered.get(ptr, 0) + data.nbytes
        index: dict[int, int] = {}
        views: list[memoryview] = []
        described = []
        for data, requires_grad, storage, ptr in self.tensors:
            if storage.nbytes() > 2 * covered[ptr] + 4096:
                data = data.clone(memory_format=torch.contiguous_format)
                storage = data.untyped_storage()
                ptr = storage.data_ptr()
            i = index.get(ptr)
            if i is None:
                i = index[ptr] = len(views)
                whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
                views.append(whole.numpy().data)  # keeps ``whole``, hence the storage, alive
            described.append((i, self._names[data.dtype], tuple(data.shape), data.stride(), data.storage_offset(),
                              requires_grad))
        return described, views


def _rebuild(described: list[tuple[Any, ...]], sizes: list[int]) -> tuple[list[Any], list[memoryview]]:
    """The received message's tensors, as views of one empty buffer per storage (filled
    afterwards), and those buffers' bytes to fill."""
    buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    typed: dict[tuple[int, str], Any] = {}
    tensors = []
    for index, name, shape, stride, offset, requires_grad in described:
        base = typed.get((index, name))
        if base is None:
            dtype = getattr(torch, name)
            whole = buffers[index]
            whole = whole[: whole.numel() - whole.numel() % dtype.itemsize]  # a storage seen as another dtype
            base = typed[(index, name)] = whole.view(dtype)
        out = base.as_strided(shape, stride, offset)
        if requires_grad:
            out.requires_grad_(True)
        tensors.append(out)
    return tensors, [b.numpy().data for b in buffers]


def _rings_supported() -> bool:
    """Shared rings need an anonymous shared file to pass over the socket (Linux's memfd) and
    stores that other processes see in program order (x86-64): elsewhere data goes through the
    socket."""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and platform.machine().lower() in {"x86_64", "amd64"}


class _Ring:
    """A shared-memory ring one side writes message data into and the other reads it from.

    The first 64 bytes hold the reader's progress (bytes consumed, a monotonic count); the writer
    keeps its own count of bytes produced and writes only where the reader is done. Each
    message's data is one contiguous span; when the ring is empty the next span starts at its
    beginning again, so a run of small messages keeps reusing the same warm pages."""

    HEADER = 64

    def __init__(self, fd: int, size: int) -> None:
        self._map = mmap.mmap(fd, size)
        whole = np.frombuffer(self._map, dtype=np.uint8)
        self._consumed = whole[:8].view(np.uint64)
        self.data = whole[self.HEADER :]
        self.capacity = size - self.HEADER
        self.produced = 0

    def reserve(self, nbytes: int) -> int | None:
        """Where a span of ``nbytes`` may be written now (its start as a count), or None when the
        reader has not yet freed enough room."""
        consumed = int(self._consumed[0])
        start = self.produced
        if consumed == start:  # empty: start over at the beginning
            start = -(-start // self.capacity) * self.capacity
        if start % self.capacity + nbytes > self.capacity:  # the span does not wrap: skip the tail
            start = -(-start // self.capacity) * self.capacity
        if start + nbytes - consumed > self.capacity:
            return None
        return start

    def consumed(self, count: int) -> None:
        """Record that the reader is done with everything before ``count``."""
        self._consumed[0] = count

    def _pieces(self, views: list[memoryview], at: int, offsets: list[int]) -> Iterator[tuple[Any, Any]]:
        """``(ring bytes, buffer bytes)`` of each non-empty buffer of a span laid out from ``at``
        (``offsets``: the span's :func:`_layout`)."""
        for v, off in zip(views, offsets):
            if v.nbytes:
                yield self.data[at + off : at + off + v.nbytes], np.frombuffer(v, dtype=np.uint8)

    def write(self, views: list[memoryview]) -> tuple[int, int] | None:
        """Copy ``views`` into the ring as one span: ``(its offset, the count after it)`` for the
        reader, or None when they do not fit now (nothing written)."""
        offsets, span = _layout([v.nbytes for v in views])
        start = self.reserve(span) if span else None
        if start is None:
            return None
        at = start % self.capacity
        for ring, src in self._pieces(views, at, offsets):
            ring[:] = src
        self.produced = start + span
        return at, self.produced

    def read(self, views: list[memoryview], at: int, end: int) -> None:
        """Fill ``views`` from the span the writer put at ``at``, and free it (up to ``end``)."""
        for ring, dst in self._pieces(views, at, _layout([v.nbytes for v in views])[0]):
            dst[:] = ring
        self.consumed(end)

    def close(self) -> None:
        self.data = self._consumed = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass


class Channel:
    """Messages over one connected stream socket (a ``multiprocessing`` connection after its
    handshake): :meth:`send` writes an object, :meth:`recv` reads one back. Its ``conn`` is what
    :func:`multiprocessing.connection.wait` watches.

    After :meth:`share_rings` (both sides), tensor data goes through a shared-memory ring per
    direction instead of the socket whenever it fits, and the socket carries the rest of the
    message: a copy into pages both processes keep mapped instead of the kernel's socket buffers,
    which cost a fresh allocation per message (at times 0.5 ms for a LeNet-5 state)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._out: _Ring | None = None  # written here, read by the other side
        self._in: _Ring | None = None  # written by the other side

    def share_rings(self, first: bool, size: int = _RING_BYTES) -> bool:
        """Exchange rings with the other side (``first`` on exactly one side: it offers its ring
        first). Returns whether data now goes through them (both sides must support them)."""
        mine = theirs = -1
        if size > _Ring.HEADER and _rings_supported():
            mine = os.memfd_create("fedhetero-wire")
            os.ftruncate(mine, size)
        try:
            if first:
                self._offer(mine, size)
                theirs, their_size = self._accept()
            else:
                theirs, their_size = self._accept()
                self._offer(mine, size)
            if mine >= 0 and theirs >= 0:
                self._out, self._in = _Ring(mine, size), _Ring(theirs, their_size)
        finally:
            for fd in (mine, theirs):
                if fd >= 0:
                    os.close(fd)  # the mappings keep the memory
        return self._out is not None

    def _offer(self, fd: int, size: int) -> None:
        data = struct.pack("<Q", size if fd >= 0 else 0)
        if fd >= 0:
            socket.send_fds(self._sock, [data], [fd])
        else:
            self._sock.sendall(data)

    def _accept(self) -> tuple[int, int]:
        data, fds, _, _ = socket.recv_fds(self._sock, 8, 1)
        while len(data) < 8:
            more = self._sock.recv(8 - len(data))
            if not more:
                raise EOFError("the other side closed the connection")
            data += more
        size = struct.unpack("<Q", data)[0]
        for extra in fds[1:]:
            os.close(extra)
        return (fds[0], size) if fds and size else (-1, 0)

    def send(self, obj: Any) -> None:
        """Pickle ``obj`` (entirely, before anything is written: an object that does not pickle
        leaves the stream as it was) and write it."""
        buf = io.BytesIO()
        pickler = _Pickler(buf)
        pickler.dump(obj)
        head = buf.getbuffer()
        described, views = pickler.plan()
        ring = None if self._out is None else self._out.write(views)
        table = pickle.dumps((described, [v.nbytes for v in views], ring), protocol=pickle.HIGHEST_PROTOCOL)
        prefix = _PREFIX.pack(len(table), head.nbytes)
        self._sendall([memoryview(prefix), memoryview(table), head, *(views if ring is None else ())])

    def _sendall(self, parts: list[memoryview]) -> None:
        """Write ``parts`` in order (gathered writes)."""
        parts = [p for p in parts if p.nbytes]
        while parts:
            _advance(parts, self._sock.sendmsg(parts[:_IOV_MAX]))

    def _read(self, views: list[memoryview]) -> None:
        """Fill ``views`` in order from the socket (scattered reads)."""
        views = [v for v in views if v.nbytes]
        while views:
            got = self._sock.recvmsg_into(views[:_IOV_MAX])[0]
            if got == 0:
                raise EOFError("the other side closed the connection")
            _advance(views, got)

    def recv(self) -> Any:
        """The next message (blocks until it has arrived whole); EOFError when the other side has
        closed the connection."""
        prefix = bytearray(_PREFIX.size)
        self._read([memoryview(prefix)])
        table_size, head_size = _PREFIX.unpack(prefix)
        meta = bytearray(table_size + head_size)
        self._read([memoryview(meta)])
        described, sizes, ring = pickle.loads(memoryview(meta)[:table_size])
        tensors, views = _rebuild(described, sizes)
        _RECEIVING.tensors = tensors
        try:
            obj = pickle.loads(memoryview(meta)[table_size:])
        finally:
            _RECEIVING.tensors = None
        if ring is None:
            self._read(views)
        elif self._in is None:
            raise OSError("malformed message: data in a shared ring that was never set up")
        else:
            self._in.read(views, *ring)
        return obj

    def close(self) -> None:
        for ring in (self._out, self._in):
            if ring is not None:
                ring.close()
        self._out = self._in = None
        self._sock.close()


def _advance(views: list[memoryview], count: int) -> None:
    """Drop the first ``count`` bytes of the pieces ``views`` (in place): what a partial gathered
    write or scattered read has done."""
    while count:
        first = views[0]
        if count >= first.nbytes:
            count -= first.nbytes
            views.pop(0)
        else:
            views[0] = first[count:]
            count = 0


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of storages of these sizes in one ring span (each 64-byte aligned), and its length."""
    offsets, end = [], 0
    for n in sizes:
        end = -(-end // 64) * 64
        offsets.append(end)
        end += n
    return offsets, -(-end // 64) * 64
