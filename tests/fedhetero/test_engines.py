"""Back ends (local, process), client tasks, faulty clients and the algorithm interface."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedhetero.algorithms import Algorithm, build_algorithm
from fedhetero.config import ConfigError, from_dict
from fedhetero.context import RunError
from fedhetero.engine import Engine
from fedhetero.engines import injected_fault
from _util import strip_wall

ROOT = Path(__file__).resolve().parents[2]


def _cfg(name: str = "fedavg", backend: str = "local", rounds: int = 3, **engine):
    return from_dict(
        {
            "seed": 1,
            "threads": 1,
            "data": {"num_clients": 10},
            "train": {"rounds": rounds, "sample_rate": 0.4, "local_epochs": 1, "checkpoint_every": 1},
            "algorithm": {"name": name},
            "engine": {"backend": backend, **engine},
        }
    )


def _run(tmp_path: Path, cfg, tag: str, **kw):
    eng = Engine(cfg, tmp_path / tag, progress=False, **kw)
    res = eng.run()
    return eng, res




def _assert_same_model(a: Engine, b: Engine) -> None:
    sa, sb = a.algorithm.global_model.state_dict(), b.algorithm.global_model.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("name", ["fedavg", "dynamicfl"])
def test_process_backend_is_bit_identical_to_local(tmp_path, name):
    a, ra = _run(tmp_path, _cfg(name, "local"), "local")
    b, rb = _run(tmp_path, _cfg(name, "process", workers=2), "process")
    assert strip_wall(ra.metrics) == strip_wall(rb.metrics)
    _assert_same_model(a, b)
    assert ra.summary["final_accuracy"] == rb.summary["final_accuracy"]
    # every round records the wall time its client tasks took, a part of the round's
    # and the rounds that evaluate record how long that took, apart from the client tasks
    for rows in (ra.metrics, rb.metrics):
        assert all(0 < r["timers"]["client_phase"] < r["wall_s"] + 1e-4 for r in rows)
        evaluated = [r for r in rows if "accuracy" in r]
        assert evaluated and all(0 < r["timers"]["evaluate"] < r["wall_s"] - r["timers"]["client_phase"] + 1e-4
                                 for r in evaluated)
        assert all("evaluate" not in r["timers"] for r in rows if "accuracy" not in r)


def test_resume_on_process_backend_equals_uninterrupted(tmp_path):
    full, rf = _run(tmp_path, _cfg("dynamicfl", "process", rounds=4, workers=2), "full")
    cfg = _cfg("dynamicfl", "process", rounds=4, workers=2)
    _run(tmp_path, cfg, "cut", stop_after=2)
    resumed, rr = _run(tmp_path, None, "cut", resume=True)
    assert strip_wall(rr.metrics) == strip_wall(rf.metrics)
    _assert_same_model(full, resumed)


def test_resume_may_switch_backend(tmp_path):
    """The back end is not part of the config hash: a local run can continue on process."""
    full, rf = _run(tmp_path, _cfg("fedavg", "local", rounds=3), "full")
    _run(tmp_path, _cfg("fedavg", "local", rounds=3), "cut", stop_after=1)
    resumed, rr = _run(tmp_path, _cfg("fedavg", "process", rounds=3, workers=2), "cut", resume=True)
    assert strip_wall(rr.metrics) == strip_wall(rf.metrics)
    _assert_same_model(full, resumed)


@pytest.mark.parametrize("backend", ["local", "process"])
def test_faulty_clients_are_dropped_and_recorded(tmp_path, backend):
    faults = {"rate": 0.3, "kinds": ["raise", "nan"]}
    cfg = from_dict(
        {
            "seed": 3,
            "threads": 1,
            "data": {"num_clients": 20},
            "train": {"rounds": 4, "sample_rate": 0.5, "local_epochs": 1},
            "algorithm": {"name": "dynamicfl"},
            "engine": {"backend": backend, "workers": 2, "inject_faults": faults},
        }
    )
    eng, res = _run(tmp_path, cfg, backend)
    assert res.summary["rounds"] == 4
    for v in eng.algorithm.global_model.state_dict().values():
        assert torch.isfinite(v.float()).all()
    assert math.isfinite(res.summary["final_accuracy"]) and res.summary["final_accuracy"] > 0.2
    total_dropped = 0
    for row in res.metrics:
        sampled = eng.sample_clients(row["round"])
        expected = {}
        for cid in sampled:
            task = eng.algorithm.task(eng.ctx, eng.client_info(cid, row["round"]), {})
            kind = injected_fault(cfg, task)
            if kind is not None:
                expected[cid] = kind
        dropped = {d["cid"]: d["reason"] for d in row["dropped"]}
        assert set(dropped) == set(expected)
        for cid, kind in expected.items():
            assert ("InjectedFault" in dropped[cid]) if kind == "raise" else dropped[cid].startswith("non-finite")
        assert {c["cid"] for c in row["clients"]} == set(sampled) - set(expected)
        total_dropped += len(dropped)
    assert total_dropped >= 3  # 30 % of 40 client-rounds
    assert res.summary["dropped_clients"] == total_dropped
    # metrics.jsonl is valid JSON and names who was dropped and why
    rows = [json.loads(line) for line in (tmp_path / backend / "metrics.jsonl").read_text().splitlines()]
    assert sum(len(r["dropped"]) for r in rows) == total_dropped


def test_hung_client_is_killed_at_timeout(tmp_path):
    cfg = _cfg(
        "fedavg", "process", rounds=2, workers=2, client_timeout_s=5.0,
        inject_faults={"rate": 0.25, "kinds": ["hang"]},
    )
    eng, res = _run(tmp_path, cfg, "hang")
    reasons = [d["reason"] for r in res.metrics for d in r["dropped"]]
    assert reasons and all(r.startswith("timeout") for r in reasons)
    assert res.summary["rounds"] == 2


def test_too_few_clients_stop_the_run_with_a_message(tmp_path):
    cfg = _cfg("fedavg", "local", rounds=2, min_clients=2, inject_faults={"rate": 1.0, "kinds": ["raise"]})
    with pytest.raises(RunError, match="engine.min_clients=2"):
        _run(tmp_path, cfg, "none")


def test_hang_needs_a_timeout():
    with pytest.raises(ConfigError, match="engine.inject_faults.kinds"):
        _cfg(inject_faults={"rate": 0.5, "kinds": ["hang"]})
    with pytest.raises(ConfigError, match="engine.inject_faults.rate"):
        _cfg(inject_faults={"rate": 1.5})
    with pytest.raises(ConfigError, match="engine.backend"):
        _cfg(backend="ray")


def test_client_half_runs_on_a_fresh_instance(tmp_path):
    seen = []

    class Probe(Algorithm):
        name = "probe"

        def client_update(self, ctx, task, state):
            seen.append((self.global_model, hasattr(ctx, "store"), state))
            out = super().client_update(ctx, task, state)
            out.client_state = {"visits": torch.tensor((state or {}).get("visits", torch.tensor(0)).item() + 1)}
            return out

    cfg = _cfg("fedavg", rounds=3)
    eng = Engine(cfg, tmp_path / "probe", progress=False)
    eng._setup()
    eng.algorithm = Probe()
    with eng.ctx.seeded("init", 1):
        eng.algorithm.setup(eng.ctx)
    eng._setup = lambda: None  # keep the probe
    eng.run()
    assert seen and all(gm is None and not has_store for gm, has_store, _ in seen)
    # private state came back to the client that wrote it
    visits = [int(s["visits"]) for _, _, s in seen if s is not None]
    assert visits and max(visits) >= 1


def test_no_optimizer_or_non_json_in_client_metrics(tmp_path):
    _, res = _run(tmp_path, _cfg("dynamicfl"), "m")
    for row in res.metrics:
        for c in row["clients"]:
            assert "optimizer" not in c
    text = (tmp_path / "m" / "metrics.jsonl").read_text()
    for line in text.splitlines():
        json.loads(line)


def test_user_algorithm_from_a_file_runs_on_local_and_process(tmp_path):
    """The worked example of docs/write_your_own_algorithm.md runs as written on both back ends."""
    name = f"{ROOT / 'examples' / 'my_algorithm.py'}:FedAvgM"
    results = {}
    for backend in ("local", "process"):
        cfg = _cfg(name, backend, rounds=3, workers=2)
        eng, res = _run(tmp_path, cfg, backend)
        results[backend] = (eng, res)
        assert res.summary["final_accuracy"] > 0.3
    _assert_same_model(results["local"][0], results["process"][0])
    assert build_algorithm(_cfg(name)).options.server_momentum == 0.9
    with pytest.raises(ConfigError, match="server_momentum"):
        build_algorithm(from_dict({"algorithm": {"name": name, "options": {"server_momentum": 1.5}}}))
    with pytest.raises(ConfigError, match="algorithm.name"):
        build_algorithm(from_dict({"algorithm": {"name": "no/such/file.py:X"}}))


def _modules_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_no_import_circle_between_engine_and_algorithms():
    """The context algorithms code against lives in its own module: importing it, or an algorithm,
    does not import the engine, and the context does not import the algorithms."""
    assert not any(m.startswith("fedhetero.algorithms") for m in _modules_after_import("fedhetero.context"))
    for algo in ("fedhetero.algorithms.dynamicfl", "fedhetero.algorithms.feddum", "fedhetero.algorithms.heterofl"):
        assert "fedhetero.engine" not in _modules_after_import(algo), algo
    assert "fedhetero.algorithms.feddum" not in _modules_after_import("fedhetero.algorithms.feddu")


def test_process_pool_counts_the_server_as_an_executor(tmp_path):
    """With no time-out the server runs a share itself (workers - 1 processes); with one, every
    task runs in a worker that can be killed (workers processes). Both give local's numbers."""
    from fedhetero.engines.process import ProcessBackend

    shared = ProcessBackend(_cfg("fedavg", "process", workers=3))
    isolated = ProcessBackend(_cfg("fedavg", "process", workers=2, client_timeout_s=60.0))
    try:
        shared.start()
        isolated.start()
        assert shared.in_process and len(shared._workers) == 2
        assert not isolated.in_process and len(isolated._workers) == 2
        assert all(w.proc.poll() is None for w in shared._workers + isolated._workers)
    finally:
        shared.close()
        isolated.close()
    a, ra = _run(tmp_path, _cfg("fedavg", "local"), "local")
    b, rb = _run(tmp_path, _cfg("fedavg", "process", workers=2, client_timeout_s=60.0), "isolated")
    c, rc = _run(tmp_path, _cfg("fedavg", "process", workers=1), "server-only")
    assert strip_wall(ra.metrics) == strip_wall(rb.metrics) == strip_wall(rc.metrics)
    _assert_same_model(a, b)
    _assert_same_model(a, c)


def test_server_reads_worker_outcomes_between_its_own_tasks(tmp_path, monkeypatch):
    """While the server runs its share it takes the outcomes the worker has sent (so uploads are
    folded during the round, not all after it); the numbers stay local's."""
    import fedhetero.engines.process as proc

    events: list[tuple[str, int]] = []
    backends: list[proc.ProcessBackend] = []
    real_run, real_run_task, real_collect = proc.ProcessBackend.run, proc.run_task, proc.ProcessBackend._collect

    def run(self, *args, **kw):
        backends.append(self)
        return real_run(self, *args, **kw)

    def run_here(make, ctx, task, state, **kw):  # the server's own tasks only (workers are other interpreters)
        out = real_run_task(make, ctx, task, state, **kw)
        events.append(("server", task.cid))
        if len(events) == 1:  # after its first task, until the worker's first outcome has arrived
            assert backends[-1]._workers[0].conn.poll(120)
        return out

    def collect(self, wait_s, states, done, finish):
        before = set(done)
        real_collect(self, wait_s, states, done, finish)
        events.extend(("worker", c) for c in sorted(set(done) - before))

    monkeypatch.setattr(proc.ProcessBackend, "run", run)
    monkeypatch.setattr(proc, "run_task", run_here)
    monkeypatch.setattr(proc.ProcessBackend, "_collect", collect)
    a, ra = _run(tmp_path, _cfg("fedavg", "local", rounds=1), "local")
    b, rb = _run(tmp_path, _cfg("fedavg", "process", rounds=1, workers=2), "process")
    servers = [i for i, (who, _) in enumerate(events) if who == "server"]
    workers = [i for i, (who, _) in enumerate(events) if who == "worker"]
    assert len(servers) == 2 and len(workers) == 2
    assert workers[0] < servers[-1]  # taken before the server's last task ended
    assert strip_wall(ra.metrics) == strip_wall(rb.metrics)
    _assert_same_model(a, b)


def test_upload_check_runs_where_the_task_ran():
    """run_task checks the upload itself (in a worker, in parallel) and marks the outcome, so the
    server does not check it again; an outcome built elsewhere (Flower) is still checked."""
    from fedhetero.algorithms.base import ClientResult
    from fedhetero.engines import Outcome, check_result, upload_fault

    def result(value):
        return ClientResult(cid=0, num_samples=1, state={"w": torch.full((4,), value), "n": torch.tensor(3)},
                            macs=1, budget_macs=1.0, bytes_up=0, bytes_down=0)

    assert upload_fault(result(1.0)) is None
    # a finite tensor whose norm overflows is still finite
    assert upload_fault(result(3e38)) is None
    assert upload_fault(result(float("nan"))) == "non-finite upload (w)"
    assert upload_fault(result(float("-inf"))) == "non-finite upload (w)"
    half = result(1.0)
    half.state["h"] = torch.tensor([1.0, float("inf")], dtype=torch.float16)
    assert upload_fault(half) == "non-finite upload (h)"
    bad = result(float("nan"))
    assert check_result(Outcome(None, bad), None) == "non-finite upload (w)"  # type: ignore[arg-type]
    assert check_result(Outcome(None, bad, checked=True), None) is None  # type: ignore[arg-type]


def test_weighted_average_matches_the_per_tensor_mean():
    from fedhetero.algorithms.base import weighted_average

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
    import fedhetero.algorithms.base as base

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
        flat = base._flat_run(pk, ["w", "b"])
        assert flat is not None and torch.equal(flat, torch.cat([st["w"].reshape(-1), st["b"]]))
        assert base._flat_run(st, ["w", "b"]) is None and base._flat_run(pk, ["b", "w"]) is None
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


def test_server_share_runs_at_the_workers_thread_count(monkeypatch):
    """threads: null leaves the server's own thread count alone, but its share of the tasks runs
    at the workers' count (1), like every other executor; the count is restored afterwards."""
    from types import SimpleNamespace

    import fedhetero.engines.process as proc

    seen = []

    def fake_run_task(make, ctx, task, state):
        seen.append(torch.get_num_threads())
        return proc.Outcome(task, None, "stub")

    monkeypatch.setattr(proc, "run_task", fake_run_task)
    cfg = from_dict({"threads": None, "engine": {"backend": "process", "workers": 2}})
    backend = proc.ProcessBackend(cfg)
    backend._ctx = object()  # the stub does not use the context
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        done = []
        backend._run_here(Algorithm(), [SimpleNamespace(cid=0), SimpleNamespace(cid=2)], {}, lambda t, o: done.append(t.cid), lambda: None)
        assert seen == [1, 1] and done == [0, 2]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)


def _result(cid, value, n=3):
    from fedhetero.algorithms.base import ClientResult

    g = torch.Generator().manual_seed(cid)
    state = {"w": torch.randn(4, 3, generator=g) * value, "b": torch.randn(5, generator=g, dtype=torch.float64),
             "n": torch.tensor(cid)}
    return ClientResult(cid=cid, num_samples=n, state=state, macs=1, budget_macs=1.0, bytes_up=0, bytes_down=0)


def test_upload_stream_gives_weighted_average_bits_in_any_arrival_order():
    from fedhetero.algorithms.base import ClientTask, weighted_average
    from fedhetero.context import UploadStream
    from fedhetero.engines import Outcome

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


@pytest.mark.parametrize("backend", ["local", "process"])
def test_default_aggregate_uses_the_streamed_mean(tmp_path, backend, monkeypatch):
    """A FedAvg round averages its uploads while they arrive: the list average is never needed,
    and the run equals one where it is forced (faults make the stream stop; those rounds fall back)."""
    import fedhetero.algorithms.base as base

    calls = []
    original = base.weighted_average

    def counting(states, weights):
        calls.append(len(states))
        return original(states, weights)

    monkeypatch.setattr(base, "weighted_average", counting)
    _, streamed = _run(tmp_path, _cfg("fedavg", backend, workers=2), "streamed")
    assert calls == []
    monkeypatch.setattr(base.Algorithm, "streams_uploads", property(lambda self: False))
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


def test_an_algorithm_with_its_own_aggregate_is_not_streamed():
    class Mine(Algorithm):
        name = "mine"

        def aggregate(self, ctx, updates):
            pass

    class MyRound(Algorithm):
        name = "myround"

        def run_round(self, ctx, clients):
            return []

    assert build_algorithm(_cfg("fedavg")).streams_uploads is True
    assert Mine().streams_uploads is False and MyRound().streams_uploads is False
    assert build_algorithm(from_dict({"algorithm": {"name": "dynacomm"}})).streams_uploads is False


@pytest.mark.parametrize("name", ["fedavg", "dynamicfl"])
def test_process_shares_evaluation_batches_with_the_same_numbers(tmp_path, name, monkeypatch):
    """With several evaluation batches the server evaluates the last run of them and a worker the
    rest; the per-batch numbers are added in batch order, so the metrics equal local's bit for bit."""
    from fedhetero.context import ClientContext

    def cfg(backend):
        return from_dict({
            "seed": 2, "threads": 1, "data": {"num_clients": 10},
            "train": {"rounds": 2, "sample_rate": 0.4, "local_epochs": 1, "eval_batch_size": 40},
            "algorithm": {"name": name}, "engine": {"backend": backend, "workers": 2},
        })

    here: list[int] = []
    original = ClientContext.evaluate_batches

    def counting(self, model, dataset=None, indices=None):
        out = original(self, model, dataset, indices)
        here.append(len(out))
        return out

    a, ra = _run(tmp_path, cfg("local"), "local")
    monkeypatch.setattr(ClientContext, "evaluate_batches", counting)
    b, rb = _run(tmp_path, cfg("process"), "process")
    assert strip_wall(ra.metrics) == strip_wall(rb.metrics)
    _assert_same_model(a, b)
    total = -(-len(b.data.test.labels) // 40)
    assert total >= 4 and here and all(0 < n < total for n in here)  # the server did only its share


def test_evaluation_falls_back_to_the_server_when_a_worker_cannot(tmp_path):
    from _util import ServerOnlyModel

    from fedhetero.context import client_context
    from fedhetero.engines.process import ProcessBackend

    cfg = from_dict({"threads": 1, "train": {"eval_batch_size": 40}, "engine": {"backend": "process", "workers": 2}})
    ctx = client_context(cfg)
    model = ServerOnlyModel(int(torch.tensor(ctx.data.test.images.shape[1:]).prod()), 10)
    backend = ProcessBackend(cfg, ctx.data)
    try:
        backend.start()
        assert backend.evaluation_shares() == 2
        stats = backend.evaluate_batches(model, "test", None)
        assert stats == ctx.evaluate_batches(model)  # the worker failed: the server did its batches
        assert backend._remote_eval is False and backend.evaluate_batches(model, "test", None) is None
        assert backend.evaluation_shares() == 1
        assert all(w.proc.poll() is None for w in backend._workers)  # the worker lives on
    finally:
        backend.close()


def test_evaluation_is_not_shared_with_a_time_out_or_free_threads():
    from fedhetero.context import client_context
    from fedhetero.engines.process import ProcessBackend

    for extra in ({"engine": {"backend": "process", "workers": 2, "client_timeout_s": 30.0}, "threads": 1},
                  {"engine": {"backend": "process", "workers": 2}, "threads": None}):
        cfg = from_dict({"train": {"eval_batch_size": 40}, **extra})
        ctx = client_context(cfg)
        backend = ProcessBackend(cfg, ctx.data)
        try:
            backend.start()
            assert backend.evaluate_batches(ctx.build_model(), "test", None) is None
            assert backend.evaluation_shares() == 1
        finally:
            backend.close()


def test_evaluation_shares_follow_the_batches_and_the_executors():
    from fedhetero.context import client_context
    from fedhetero.engines.process import ProcessBackend

    data = client_context(from_dict({})).data
    n = len(data.test.labels)  # 359 digits test images
    for batch, workers, expected in ((512, 2, 1), (n - 1, 2, 2), (40, 2, 2), (40, 3, 3), (40, 1, 1)):
        cfg = from_dict({"threads": 1, "train": {"eval_batch_size": batch},
                         "engine": {"backend": "process", "workers": workers}})
        assert ProcessBackend(cfg, data).evaluation_shares() == expected, (batch, workers)


def test_bench_engines_without_the_second_process_still_reports_the_rest(tmp_path, capsys, monkeypatch):
    import fedhetero.lab.bench as bench

    def fail(*args, **kwargs):
        raise OSError("no second process here")

    monkeypatch.setattr(bench, "_Twin", fail)
    out = tmp_path / "b.json"
    rc = bench.engines_main(["--clients", "4", "--per-round", "2", "--rounds", "1", "--repeats", "1", "--no-flower",
                             "--heavy-epochs", "1", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "no second process here" in text and "skipped" in text
    samples = json.loads(out.read_text())["samples"]
    assert samples["two_local"] == [] and len(samples["process"]) == 1 and min(samples["process"]) > 0


def test_parallel_bound_halves_only_what_two_executors_can_share():
    from fedhetero.lab.bench import parallel_bound

    # 100 s local run: 80 s of client tasks, 10 s evaluation, 10 s other serial work
    assert parallel_bound(100.0, 80.0, 10.0, 100.0, split_eval=False) == pytest.approx(100 / (20 + 40))
    assert parallel_bound(100.0, 80.0, 10.0, 100.0, split_eval=True) == pytest.approx(100 / (10 + 45))
    # two runs at once 20 % slower than one: every shared second costs 1.2
    assert parallel_bound(100.0, 80.0, 10.0, 120.0, split_eval=True) == pytest.approx(100 / (10 + 45 * 1.2))
    # no serial part and no slowdown: exactly two
    assert parallel_bound(50.0, 50.0, 0.0, 50.0, split_eval=False) == pytest.approx(2.0)


def test_bench_engines_runs_and_reports_every_row(tmp_path, capsys):
    from fedhetero.lab.bench import engines_main

    out = tmp_path / "b.json"
    rc = engines_main(["--clients", "4", "--per-round", "2", "--rounds", "2", "--repeats", "2", "--no-flower",
                       "--heavy-epochs", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    for row in ("process / local throughput", "process / local, median of pairs", "local / bare loop time",
                "worker start-up", "process / local, client phase", "two local runs at once / one",
                "process / local bound"):
        assert row in text, row
    data = json.loads(out.read_text())
    samples = data["samples"]
    assert all(len(samples[k]) == 2 and min(samples[k]) > 0 for k in
               ("local", "process", "bare", "heavy_local", "heavy_process", "local_clients", "process_clients",
                "local_eval", "process_eval", "two_local"))
    # the client phase is part of each run's rounds; two runs at once take at least as long as one
    assert all(c < t for c, t in zip(samples["local_clients"], samples["local"]))
    assert all(c < t for c, t in zip(samples["process_clients"], samples["process"]))
    assert all(c + e < t for c, e, t in zip(samples["local_clients"], samples["local_eval"], samples["local"]))
    assert min(samples["two_local"]) >= 0.5 * min(samples["local"])
