"""The process back end against local: bit-identical numbers, resume (also switching back end), time-outs, the
pool's executors (the server runs a share), reading outcomes while the server works, and evaluations shared
among the executors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedhetero.algorithms import Algorithm
from fedhetero.core.common.config import from_dict
from fedhetero.core.run.engine import Engine
from _util import fedavg_cfg, live_children, strip_wall


_cfg = fedavg_cfg


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


@pytest.mark.slow  # run by: python -m pytest -m slow
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


@pytest.mark.slow  # run by: python -m pytest -m slow
def test_hung_client_is_killed_at_timeout(tmp_path):
    cfg = _cfg(
        "fedavg", "process", rounds=2, workers=2, client_timeout_s=5.0,
        inject_faults={"rate": 0.25, "kinds": ["hang"]},
    )
    eng, res = _run(tmp_path, cfg, "hang")
    reasons = [d["reason"] for r in res.metrics for d in r["dropped"]]
    assert reasons and all(r.startswith("timeout") for r in reasons)
    assert res.summary["rounds"] == 2


@pytest.mark.slow  # run by: python -m pytest -m slow
def test_process_pool_counts_the_server_as_an_executor(tmp_path):
    """With no time-out the server runs a share itself (workers - 1 processes); with one, every
    task runs in a worker that can be killed (workers processes). Both give local's numbers."""
    from fedhetero.backends.process import ProcessBackend

    before = live_children()
    shared = ProcessBackend(_cfg("fedavg", "process", workers=3))
    isolated = ProcessBackend(_cfg("fedavg", "process", workers=2, client_timeout_s=60.0))
    try:
        shared.start()
        started_shared = live_children() - before  # worker processes, running
        isolated.start()
        started_isolated = live_children() - before - started_shared
        assert shared.in_process and len(started_shared) == 2
        assert not isolated.in_process and len(started_isolated) == 2
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
    import fedhetero.backends.process as proc

    events: list[tuple[str, int]] = []
    backends: list[proc.ProcessBackend] = []
    real_run, real_run_task = proc.ProcessBackend.run, proc.run_task
    ours: set[int] = set()

    def run(self, algorithm, tasks, states, on_done=None):
        backends.append(self)

        def done(outcome):  # an outcome taken from a worker (the server's own are logged below)
            if outcome.task.cid not in ours:
                events.append(("worker", outcome.task.cid))
            if on_done is not None:
                on_done(outcome)

        return real_run(self, algorithm, tasks, states, on_done=done)

    def run_here(make, ctx, task, state, **kw):  # the server's own tasks only (workers are other interpreters)
        ours.add(task.cid)
        out = real_run_task(make, ctx, task, state, **kw)
        events.append(("server", task.cid))
        if len(events) == 1:  # after its first task, until the worker's first outcome has arrived
            assert backends[-1]._workers[0].conn.poll(120)
        return out

    monkeypatch.setattr(proc.ProcessBackend, "run", run)
    monkeypatch.setattr(proc, "run_task", run_here)
    a, ra = _run(tmp_path, _cfg("fedavg", "local", rounds=1), "local")
    b, rb = _run(tmp_path, _cfg("fedavg", "process", rounds=1, workers=2), "process")
    servers = [i for i, (who, _) in enumerate(events) if who == "server"]
    workers = [i for i, (who, _) in enumerate(events) if who == "worker"]
    assert len(servers) == 2 and len(workers) == 2
    assert workers[0] < servers[-1]  # taken before the server's last task ended
    assert strip_wall(ra.metrics) == strip_wall(rb.metrics)
    _assert_same_model(a, b)


def test_server_share_runs_at_the_workers_thread_count(monkeypatch):
    """threads: null leaves the server's own thread count alone, but its share of the tasks runs
    at the workers' count (1), like every other executor; the count is restored afterwards."""
    from types import SimpleNamespace

    import fedhetero.backends.process as proc

    seen = []

    def fake_run_task(make, ctx, task, state):
        seen.append(torch.get_num_threads())
        return proc.Outcome(task, None, "stub")

    monkeypatch.setattr(proc, "run_task", fake_run_task)
    # one executor: the server runs every task itself (no worker process is started)
    cfg = from_dict({"threads": None, "engine": {"backend": "process", "workers": 1, "vectorize": False}})
    backend = proc.ProcessBackend(cfg)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        done = []
        backend.run(Algorithm(), [SimpleNamespace(cid=0), SimpleNamespace(cid=2)], {}, on_done=lambda o: done.append(o.task.cid))
        assert seen == [1, 1] and done == [0, 2]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)
        backend.close()


@pytest.mark.parametrize("name", ["fedavg", "dynamicfl"])
def test_process_shares_evaluation_batches_with_the_same_numbers(tmp_path, name, monkeypatch):
    """With several evaluation batches the server evaluates the last run of them and a worker the
    rest; the per-batch numbers are added in batch order, so the metrics equal local's bit for bit."""
    from fedhetero.core.local.context import ClientContext

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

    from fedhetero.core.local.context import client_context
    from fedhetero.backends.process import ProcessBackend

    cfg = from_dict({"threads": 1, "train": {"eval_batch_size": 40}, "engine": {"backend": "process", "workers": 2}})
    ctx = client_context(cfg)
    model = ServerOnlyModel(int(torch.tensor(ctx.data.test.images.shape[1:]).prod()), 10)
    backend = ProcessBackend(cfg, ctx.data)
    before = live_children()
    try:
        backend.start()
        assert backend.evaluation_shares() == 2
        stats = backend.evaluate_batches(model, "test", None)
        assert stats == ctx.evaluate_batches(model)  # the worker failed: the server did its batches
        assert backend.evaluate_batches(model, "test", None) is None  # from now on the server evaluates alone
        assert backend.evaluation_shares() == 1
        assert len(live_children() - before) == 1  # the worker lives on
    finally:
        backend.close()


@pytest.mark.slow  # run by: python -m pytest -m slow
def test_evaluation_is_not_shared_with_a_time_out_or_free_threads():
    from fedhetero.core.local.context import client_context
    from fedhetero.backends.process import ProcessBackend

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
    from fedhetero.core.local.context import client_context
    from fedhetero.backends.process import ProcessBackend

    data = client_context(from_dict({})).data
    n = len(data.test.labels)  # 359 digits test images
    for batch, workers, expected in ((512, 2, 1), (n - 1, 2, 2), (40, 2, 2), (40, 3, 3), (40, 1, 1)):
        cfg = from_dict({"threads": 1, "train": {"eval_batch_size": batch},
                         "engine": {"backend": "process", "workers": workers}})
        assert ProcessBackend(cfg, data).evaluation_shares() == expected, (batch, workers)

