"""Client state store: versions by round, rollback for resume, compaction, safe loading."""

import torch

from fedhetero.store import ClientStateStore


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
    assert s.disk_bytes() > 0
