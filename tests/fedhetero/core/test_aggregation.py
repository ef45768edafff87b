"""Aggregation: the weighted average, packed uploads folded from their buffers, and the upload stream that
averages a round's uploads while they arrive."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedhetero.algorithms import Algorithm
from fedhetero.core.run.engine import Engine
from _util import fedavg_cfg, strip_wall


_cfg = fedavg_cfg


def _run(tmp_path: Path, cfg, tag: str, **kw):
    eng = Engine(cfg, tmp_path / tag, progress=False, **kw)
    res = eng.run()
    return eng, res


def test_weighted_average_matches_the_per_tensor_mean():
    from fedhetero.core.exchange.aggregation import weighted_average

    g = torch.Generator().manual_seed(0)
    shapes = {"a": (3, 4), "b": (5,), "c": (2, 1, 3)}
    states = []
    for _ in range(4):
        st = {k: torch.randn(s, generator=g) * 10 for k, s in shapes.items()}
        st["d"] = torch.randn(6, generator=g, dtype=torch.float64)
        st["n"] = torch.tensor(7)
        states.append(st)
    weights = [3.0, 1.0, 7.0, 2.0]
    out = weighted_average(states, weights)
    assert list(out) == list(states[0])
    for k in ("a", "b", "c", "d"):
        ref = torch.zeros(shapes.get(k, (6,)), dtype=torch.float64)
        for st, w in zip(states, weights):
            ref.add_(st[k].to(torch.float64), alpha=w / sum(weights))
        assert out[k].dtype == states[0][k].dtype
        assert torch.equal(out[k], ref.to(states[0][k].dtype)), k
    assert torch.equal(out["n"], torch.tensor(7))
    states[2]["b"] = torch.zeros(4)
    with pytest.raises(ValueError, match="'b' has shape"):
        weighted_average(states, weights)


def test_packed_states_fold_without_gathering_and_give_the_same_bits(monkeypatch):
    """A packed upload (one flat buffer per dtype) is folded straight from its buffer; the mean is
    bit for bit the one of the same states unpacked, also when packed and unpacked states mix."""
    import fedhetero.core.method.algorithm as base

    g = torch.Generator().manual_seed(1)
    shapes = {"w": (4, 3), "n": (), "b": (4,), "h": (2, 2)}
    states = []
    for _ in range(5):
        st = {k: torch.randn(s, generator=g) for k, s in shapes.items() if k != "n"}
        st["n"] = torch.tensor(3)
        st["h"] = st["h"].double()
        states.append({k: st[k] for k in shapes})
    packed = [base.packed_copy(st) for st in states]
    lone = base.packed_copy({"n": states[0]["n"], "h": states[0]["h"]})  # one tensor per buffer: still copies
    assert all(lone[k].data_ptr() != states[0][k].data_ptr() and torch.equal(lone[k], states[0][k]) for k in lone)
    for st, pk in zip(states, packed):
        assert list(pk) == list(st)
        assert all(torch.equal(pk[k], st[k]) and pk[k].dtype == st[k].dtype for k in st)
        assert pk["w"].untyped_storage().data_ptr() == pk["b"].untyped_storage().data_ptr()  # one float32 buffer
        assert pk["w"].untyped_storage().data_ptr() != st["w"].untyped_storage().data_ptr()  # a copy
        # w and b back to back, in this order: one flat run of the buffer (folded without a gather)
        assert pk["w"].is_contiguous() and pk["b"].data_ptr() == pk["w"].data_ptr() + pk["w"].nbytes
        flat = pk["w"].as_strided((pk["w"].numel() + pk["b"].numel(),), (1,), pk["w"].storage_offset())
        assert torch.equal(flat, torch.cat([st["w"].reshape(-1), st["b"]]))
    weights = [2.0, 5.0, 1.0, 3.0, 4.0]
    reference = base.weighted_average(states, weights)
    gathered = []
    real_cat = torch.cat
    monkeypatch.setattr(base.torch, "cat", lambda *a, **k: gathered.append(1) or real_cat(*a, **k))
    for mixed in (packed, [packed[i] if i % 2 else states[i] for i in range(5)]):
        gathered.clear()
        out = base.weighted_average(mixed, weights)
        assert all(torch.equal(out[k], reference[k]) and out[k].dtype == reference[k].dtype for k in reference)
        # only the float32 pair of an unpacked state is gathered (a lone tensor is its own flat run)
        assert len(gathered) == sum(1 for st in mixed if any(st is s for s in states))
    monkeypatch.undo()
    with pytest.raises(ValueError, match="'b' has shape"):
        base.weighted_average([packed[0], base.packed_copy({**states[1], "b": torch.zeros(5)})], [1.0, 1.0])


def _result(cid, value, n=3):
    from fedhetero.core.exchange.types import ClientResult

    g = torch.Generator().manual_seed(cid)
    state = {"w": torch.randn(4, 3, generator=g) * value, "b": torch.randn(5, generator=g, dtype=torch.float64),
             "n": torch.tensor(cid)}
    return ClientResult(cid=cid, num_samples=n, state=state, macs=1, budget_macs=1.0, bytes_up=0, bytes_down=0)


def test_upload_stream_gives_weighted_average_bits_in_any_arrival_order():
    from fedhetero.core.exchange.types import ClientTask
    from fedhetero.core.exchange.aggregation import weighted_average
    from fedhetero.core.exchange.aggregation import UploadStream
    from fedhetero.core.exchange.types import Outcome

    sizes = {0: 5, 3: 9, 4: 2, 7: 11}
    tasks = [ClientTask(cid=c, tier="t", ratio=1.0, budget_macs=1.0, num_samples=n, round=1) for c, n in sizes.items()]
    results = {c: _result(c, 1.0 + c, n) for c, n in sizes.items()}
    ref = weighted_average([results[c].state for c in sorted(sizes)], [float(sizes[c]) for c in sorted(sizes)])
    for order in ([7, 0, 4, 3], [0, 3, 4, 7], [4, 7, 3, 0]):
        stream = UploadStream(tasks, uniform=False, timeout_s=None)
        for c in order:
            stream.offer(Outcome(tasks[0], results[c], checked=True))
        mean = stream.mean_of([results[c] for c in sorted(sizes)], [float(sizes[c]) for c in sorted(sizes)])
        assert mean is not None and list(mean) == list(ref)
        assert all(torch.equal(mean[k], ref[k]) for k in ref)
    # other weights, another client set, a failed or unchecked outcome: no streamed mean
    stream = UploadStream(tasks, uniform=False, timeout_s=None)
    for c in sizes:
        stream.offer(Outcome(tasks[0], results[c], checked=True))
    ordered = [results[c] for c in sorted(sizes)]
    weights = [float(sizes[c]) for c in sorted(sizes)]
    assert stream.mean_of(ordered, [1.0] * 4) is None
    assert stream.mean_of(ordered[:3], weights[:3]) is None
    # equal clients and weights but other result objects (another exchange of the round): no
    copies = [_result(c, 1.0 + c, sizes[c]) for c in sorted(sizes)]
    assert stream.mean_of(copies, weights) is None
    assert stream.mean_of(ordered, weights) is not None
    for bad in (Outcome(tasks[0], None, "boom"), Outcome(tasks[0], results[3], checked=False),
                Outcome(tasks[0], results[3], seconds=9.0, checked=True)):
        stream = UploadStream(tasks, uniform=False, timeout_s=5.0)
        stream.offer(bad)
        for c in sizes:
            stream.offer(Outcome(tasks[0], results[c], checked=True))
        assert stream.mean_of([results[c] for c in sorted(sizes)], [float(sizes[c]) for c in sorted(sizes)]) is None


@pytest.mark.parametrize("backend", ["local", pytest.param("process", marks=pytest.mark.slow)])
def test_default_aggregate_uses_the_streamed_mean(tmp_path, backend, monkeypatch):
    """A FedAvg round averages its uploads while they arrive: the list average is never needed,
    and the run equals one where it is forced (faults make the stream stop; those rounds fall back)."""
    import fedhetero.core.method.algorithm as base

    calls = []
    original = base.weighted_average

    def counting(states, weights):
        calls.append(len(states))
        return original(states, weights)

    monkeypatch.setattr(base, "weighted_average", counting)
    _, streamed = _run(tmp_path, _cfg("fedavg", backend, workers=2), "streamed")
    assert calls == []
    monkeypatch.setattr(base, "streamed_mean", lambda updates, weights: None)
    _, listed = _run(tmp_path, _cfg("fedavg", backend, workers=2), "listed")
    assert len(calls) == 3
    assert strip_wall(streamed.metrics) == strip_wall(listed.metrics)
    monkeypatch.undo()
    calls.clear()
    monkeypatch.setattr(base, "weighted_average", counting)
    faulty = _cfg("fedavg", backend, workers=2, inject_faults={"rate": 0.4, "kinds": ["raise"]})
    _, res = _run(tmp_path, faulty, "faulty")
    dropped_rounds = sum(1 for r in res.metrics if r["dropped"])
    assert dropped_rounds >= 1 and len(calls) == dropped_rounds


def test_a_round_is_data_the_engine_runs_every_exchange_it_yields(tmp_path, monkeypatch):
    """A method's round yields its exchanges and the engine runs each on the back end: two
    exchanges a round, the second from the first's mean. The mean streamed while an exchange ran
    serves that exchange's results and nothing else (a list the method made is averaged from the
    list), and a round that runs no exchange may return its results directly."""
    import fedhetero.core.method.algorithm as base

    calls = []
    original = base.weighted_average
    monkeypatch.setattr(base, "weighted_average", lambda states, weights: calls.append(len(states)) or original(states, weights))

    (tmp_path / "rounds.py").write_text(
        "from fedhetero.algorithms import Algorithm\n"
        "class Twice(Algorithm):\n"
        "    name = 'twice'\n"
        "    def run_round(self, ctx, clients):\n"
        "        first = yield self.configure(ctx, clients)\n"
        "        self.aggregate(ctx, first)  # that exchange's results: the streamed mean\n"
        "        state = dict(self.global_model.state_dict())\n"
        "        second = yield [self.task(ctx, c, {'state': state}, step=1) for c in clients]\n"
        "        self.aggregate(ctx, list(second))  # a list of its own: averaged here\n"
        "        return second\n"
        "class Idle(Algorithm):\n"
        "    name = 'idle'\n"
        "    def run_round(self, ctx, clients):\n"
        "        return []\n"
    )
    seen: list[tuple[int, int]] = []
    real = Algorithm.client_update
    monkeypatch.setattr(Algorithm, "client_update", lambda self, ctx, task, state: seen.append((task.round, task.step)) or real(self, ctx, task, state))
    cfg = _cfg(f"{tmp_path / 'rounds.py'}:Twice")
    res = Engine(cfg, tmp_path / "twice", progress=False).run()
    rounds = cfg.train.rounds
    assert sorted({s for _, s in seen}) == [0, 1] and len({r for r, _ in seen}) == rounds
    assert len(calls) == rounds and all(r["clients"] for r in res.metrics)  # one list average a round: the second's
    idle = Engine(_cfg(f"{tmp_path / 'rounds.py'}:Idle"), tmp_path / "idle", progress=False).run()
    assert [r["clients"] for r in idle.metrics] == [[]] * rounds

