"""Client state store: versions by round (and before a round proper, its prelude), rollback for resume,
compaction, safe loading."""

import torch

from fedhetero.core.exchange.store import ClientStateStore


def test_get_returns_newest_version_before_round(tmp_path):
    s = ClientStateStore(tmp_path)
    assert s.get(3) is None
    s.put(3, {"w": torch.tensor([1.0])}, round=1)
    s.put(3, {"w": torch.tensor([2.0])}, round=4)
    assert s.get(3, before_round=1) is None
    assert float(s.get(3, before_round=2)["w"]) == 1.0
    assert float(s.get(3, before_round=5)["w"]) == 2.0
    assert float(s.get(3)["w"]) == 2.0


def test_rollback_and_compact(tmp_path):
    s = ClientStateStore(tmp_path)
    for r in (1, 2, 3, 5):
        s.put(0, {"r": torch.tensor(r)}, round=r)
    s.flush()
    assert len(list((tmp_path / "client_000000").iterdir())) == 4
    s.compact(3)  # checkpoint at round 3: rounds 1 and 2 are no longer needed
    assert len(list((tmp_path / "client_000000").iterdir())) == 2
    s.rollback(3)  # resume from round 3: round 5's version never happened
    assert int(s.get(0)["r"]) == 3


def test_nested_state_round_trips(tmp_path):
    s = ClientStateStore(tmp_path)
    state = {"structure": {"blocks": {"a.b": ["kxk", "1x1"]}}, "s": {"a|1x1": 0.5}, "t": torch.arange(3)}
    s.put(7, state, round=2)
    back = s.get(7)
    assert back["structure"] == state["structure"] and back["s"] == state["s"]
    assert torch.equal(back["t"], state["t"])
    s.flush()
    assert s.disk_bytes() > 0
    again = ClientStateStore(tmp_path)  # a fresh store (a resumed run) reads it from disk
    assert again.get(7)["structure"] == state["structure"]


def test_writes_wait_in_memory_until_flush(tmp_path):
    s = ClientStateStore(tmp_path)
    w = torch.tensor([1.0, 2.0])
    s.put(1, {"w": w}, round=1)
    w.add_(10.0)  # the store keeps a snapshot, as a file would
    assert not (tmp_path / "client_000001").exists()
    got = s.get(1)
    assert got["w"].tolist() == [1.0, 2.0]
    got["w"].zero_()  # and hands out copies
    assert s.get(1)["w"].tolist() == [1.0, 2.0]
    for r in (2, 3, 4):
        s.put(1, {"w": torch.tensor([float(r)])}, round=r)
    s.flush(upto_round=3)  # checkpoint of round 3: of rounds 1-3 only the newest is needed
    names = sorted(p.name for p in (tmp_path / "client_000001").iterdir())
    assert names == ["r000003.pt", "r000004.pt"]
    assert float(ClientStateStore(tmp_path).get(1, before_round=4)["w"]) == 3.0


def test_memory_limit_flushes(tmp_path):
    s = ClientStateStore(tmp_path, memory_bytes=100)
    s.put(0, {"w": torch.zeros(10)}, round=1)  # 40 bytes: held
    assert not (tmp_path / "client_000000").exists()
    s.put(1, {"w": torch.zeros(20)}, round=1)  # 120 bytes in all: written
    assert (tmp_path / "client_000000" / "r000001.pt").is_file()
    assert (tmp_path / "client_000001" / "r000001.pt").is_file()
    assert float(s.get(1)["w"].sum()) == 0.0


def test_store_prelude_versions(tmp_path):
    st = ClientStateStore(tmp_path)
    st.put(3, {"v": torch.tensor(1)}, 4)
    st.put(3, {"v": torch.tensor(2)}, 6, prelude=True)  # before round 6 proper
    assert int(st.get(3, before_round=6)["v"]) == 2
    assert int(st.get(3, before_round=6, prelude=True)["v"]) == 1
    st.put(3, {"v": torch.tensor(3)}, 6)
    assert int(st.get(3, before_round=7)["v"]) == 3
    st.rollback(5)
    assert int(st.get(3, before_round=7)["v"]) == 1


# ---------------------------------------------------------------- written versions kept in memory
import tempfile  # noqa: E402

import pytest  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from fedhetero.core.common.rundir import RunDirError  # noqa: E402
from fedhetero.core.exchange import store as store_module  # noqa: E402
from fedhetero.core.exchange.types import payload_bytes  # noqa: E402


def test_a_written_version_is_read_back_from_memory(tmp_path, monkeypatch):
    s = ClientStateStore(tmp_path)
    s.put(2, {"w": torch.tensor([1.5, 2.5]), "s": {"a|1x1": 0.25}}, round=1)
    s.flush()
    assert (tmp_path / "client_000002" / "r000001.pt").is_file()

    def no_load(*_a, **_k):
        raise AssertionError("read from disk")

    monkeypatch.setattr(store_module.torch, "load", no_load)
    got = s.get(2, before_round=2)
    assert got["w"].tolist() == [1.5, 2.5] and got["s"] == {"a|1x1": 0.25}
    got["w"].zero_()  # a copy, as from a file
    assert s.get(2)["w"].tolist() == [1.5, 2.5]
    # with no room for it, a written version is read from its file
    tight = ClientStateStore(tmp_path / "t", memory_bytes=0)
    tight.put(2, {"w": torch.tensor([1.0])}, round=1)
    tight.flush()
    with pytest.raises(RunDirError, match="read from disk"):
        tight.get(2)


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 3), st.integers(1, 6), st.booleans(), st.integers(1, 40)),
        st.tuples(st.just("flush"), st.none() | st.integers(1, 6)),
        st.tuples(st.just("compact"), st.integers(1, 6)),
        st.tuples(st.just("rollback"), st.integers(0, 6)),
        st.tuples(st.just("get"), st.integers(0, 3), st.none() | st.integers(1, 7)),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(ops=_OPS, memory=st.sampled_from([0, 200, 600, 256 * 2**20]))
def test_memory_copies_agree_with_the_files_and_fit_the_budget(ops, memory):
    """Invariants of the copies kept in memory, over random sequences of the store's operations:
    what the store hands out equals what a fresh store (a resumed run) reads from the files once
    everything is flushed, and the writes held plus the written versions kept never exceed
    ``memory_bytes``."""
    with tempfile.TemporaryDirectory() as d:
        s = ClientStateStore(d, memory_bytes=memory)
        for op in ops:
            if op[0] == "put":
                _, cid, rnd, prelude, n = op
                s.put(cid, {"w": torch.arange(n, dtype=torch.float32) + 100 * rnd, "r": rnd}, round=rnd, prelude=prelude)
            elif op[0] == "flush":
                s.flush(upto_round=op[1])
            elif op[0] == "compact":
                s.flush()
                s.compact(op[1])
            elif op[0] == "rollback":
                s.flush()
                s.rollback(op[1])
            else:
                s.get(op[1], before_round=op[2])
            kept = sum(payload_bytes(v) for v in s._written.values())
            assert kept == s._written_bytes
            assert s._pending_bytes + s._written_bytes <= memory
        s.flush()
        fresh = ClientStateStore(d)
        for cid in range(4):
            for before in (None, *range(1, 8)):
                a, b = s.get(cid, before_round=before), fresh.get(cid, before_round=before)
                assert (a is None) == (b is None)
                if a is not None:
                    assert a["r"] == b["r"] and torch.equal(a["w"], b["w"])
