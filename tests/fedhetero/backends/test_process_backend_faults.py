"""The process back end under faults: hung clients on every worker, workers that die (also while
starting), a working directory with folders named like the project's packages, Ctrl-C and a
killed server. Every run is small (``threads=1``, a few clients and rounds) and every subprocess
has a time limit, so a livelock fails the test instead of hanging the suite."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedhetero.core.common.config import from_dict
from fedhetero.core.local.context import RunError
from fedhetero.core.run.engine import Engine
from fedhetero.core.exchange.types import Outcome
from fedhetero.core.run.backend import injected_fault

from _util import live_children, processes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the workers")

# the ``fedhetero`` command: its sys.path starts with the script's folder, never the working directory
_CLI = "import sys; del sys.path[0]; from fedhetero.cli import main; sys.exit(main())"


def _train(out: Path, *settings: str) -> list[str]:
    args = [sys.executable, "-c", _CLI, "train", "--out", str(out), "--quiet", "--set", "threads=1"]
    for s in settings:
        args += ["--set", s]
    return args


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _worker_dirs() -> set[str]:
    """Folders an older version of the back end left in the temporary directory."""
    return {p.name for p in Path(tempfile.gettempdir()).glob("fedhetero-worker-*")}


def _children(pid: int) -> list[int]:
    """Process ids of the worker interpreters whose parent is ``pid`` (Linux)."""
    return [p for p, _, fields, command in processes() if int(fields[1]) == pid and b"fedhetero.backends.process" in command]


def _alive(pid: int) -> bool:
    """Whether a process runs (a zombie waiting for its reaper has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_for(predicate, limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {limit:g} s for {what}")
        time.sleep(0.1)


# ---------------------------------------------------------------------------- time-outs
def test_an_overdue_time_out_is_enforced_even_by_a_poll_that_does_not_wait():
    """A deadline that passed while the server was busy elsewhere is enforced by the next look at
    the workers, also one that does not wait (the server reading outcomes between its own tasks):
    an early return there, with nothing to read, left the time-out to a loop that only polled."""
    from fedhetero.backends.process import ProcessBackend

    cfg = from_dict({"threads": 1, "engine": {"backend": "process", "workers": 1, "client_timeout_s": 1.0}})
    backend = ProcessBackend(cfg)
    ours, theirs = socket.socketpair()
    task = SimpleNamespace(cid=7, round=1, step=0)
    worker = SimpleNamespace(conn=ours, ready=True, queue=[task], pending=[], started=time.perf_counter() - 30.0)
    backend._workers = [worker]  # type: ignore[list-item]
    replaced = []
    backend._replace = lambda w, grace=0.0: replaced.append(w) or SimpleNamespace(ready=False, pending=[], queue=[])  # type: ignore[method-assign]
    done: dict[int, Outcome] = {}
    try:
        assert backend._wait_s() == pytest.approx(0.01)  # overdue: a short wait, never none at all
        backend._collect(0.0, {}, done, lambda t, o: done.__setitem__(t.cid, o))
    finally:
        ours.close()
        theirs.close()
    assert replaced == [worker]
    assert done[7].kind == "timeout" and done[7].error.startswith("timeout: no answer within")


@pytest.mark.slow  # run by: python -m pytest -m slow
def test_hung_clients_on_every_worker_do_not_stall_the_run(tmp_path):
    """Seed 24 hangs clients 0 and 2 (worker 1's share) and 3 (worker 2's second task) in round 1.
    Worker 1 is killed at its time-out and replaced; client 2 hangs on the replacement; worker 2's
    deadline passes meanwhile. Every hung client is dropped at its time-out and the run goes on to
    the end. It used to spin at 100 % CPU forever: the server waited for the replacement to start,
    and once worker 2's deadline was overdue a wait computed as 0 s returned early, before any
    time-out was enforced."""
    settings = (
        "seed=24", "algorithm.name=fedavg", "data.num_clients=4", "train.sample_rate=1.0", "train.rounds=2",
        "engine.backend=process", "engine.workers=2", "engine.client_timeout_s=5", "engine.inject_faults.rate=0.3",
        "engine.inject_faults.kinds=[hang]",
    )
    out = tmp_path / "run"
    before = _worker_dirs()
    proc = subprocess.run(_train(out, *settings), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    rows = _rows(out)
    assert [r["round"] for r in rows] == [1, 2]
    cfg = from_dict({"seed": 24, "data": {"num_clients": 4},
                     "engine": {"inject_faults": {"rate": 0.3, "kinds": ["hang"]}, "client_timeout_s": 5}})
    for row in rows:
        hung = {c for c in range(4) if injected_fault(cfg, SimpleNamespace(round=row["round"], cid=c, step=0))}
        dropped = {d["cid"]: d for d in row["dropped"]}
        assert hung <= set(dropped)
        assert all(d["reason"].startswith("timeout") for d in dropped.values()), row["dropped"]
        assert all(dropped[c]["kind"] == "injected" for c in hung)  # an injected hang counts as injected
    assert {d["cid"] for d in rows[0]["dropped"]} >= {0, 2, 3}
    assert "Traceback" not in proc.stderr
    assert _worker_dirs() <= before


# ---------------------------------------------------------------------------- dead workers
def _cfg(rounds: int = 2):
    return from_dict(
        {
            "seed": 1,
            "threads": 1,
            "data": {"num_clients": 6},
            "train": {"rounds": rounds, "sample_rate": 1.0, "local_epochs": 1},
            "algorithm": {"name": "fedavg"},
            "engine": {"backend": "process", "workers": 2, "client_timeout_s": 120.0},
        }
    )


def _sabotage(monkeypatch, kill_at_spawn):
    """Kill the first worker right after it is sent its share of round 1, and every worker whose
    spawn number (from 1) ``kill_at_spawn`` accepts right after it is started (it dies while its
    interpreter starts). Returns the list of workers started."""
    import fedhetero.backends.process as proc

    spawned: list = []
    real_init, real_assign = proc._Worker.__init__, proc.ProcessBackend._assign

    def init(self, *args, **kw):
        real_init(self, *args, **kw)
        spawned.append(self)
        if kill_at_spawn(len(spawned)):
            self.proc.kill()

    def assign(self, w, batch, states, finish):
        real_assign(self, w, batch, states, finish)
        if w is spawned[0] and batch and w.queue and not getattr(self, "_sabotaged", False):
            self._sabotaged = True
            os.kill(w.proc.pid, signal.SIGKILL)

    monkeypatch.setattr(proc._Worker, "__init__", init)
    monkeypatch.setattr(proc.ProcessBackend, "_assign", assign)
    return spawned


@pytest.mark.slow  # run by: python -m pytest -m slow
def test_a_worker_that_dies_and_then_its_replacement_while_starting_cost_one_client_each(tmp_path, monkeypatch):
    """Worker 1 (clients 0, 2, 4) is killed running client 0; its replacement is killed while it
    starts, holding 2 and 4; the next one runs client 4. Each death costs one client (``lost``);
    the round and the run go on."""
    spawned = _sabotage(monkeypatch, lambda n: n == 3)
    res = Engine(_cfg(), tmp_path / "run", progress=False).run()
    first, second = res.metrics
    assert [(d["cid"], d["kind"]) for d in first["dropped"]] == [(0, "lost"), (2, "lost")]
    reasons = [d["reason"] for d in first["dropped"]]
    assert reasons[0].startswith("worker died (exit code -9)")
    assert reasons[1].startswith("worker died while starting (exit code -9)")
    assert sorted(c["cid"] for c in first["clients"]) == [1, 3, 4, 5]
    assert second["dropped"] == [] and len(second["clients"]) == 6
    assert res.summary["rounds"] == 2 and res.summary["dropped_by_kind"] == {"lost": 2}
    assert len(spawned) == 4
    assert all(w.proc.poll() is not None for w in spawned)  # the run closed its pool


def test_workers_that_keep_dying_while_starting_stop_the_run_with_one_message(tmp_path, monkeypatch):
    spawned = _sabotage(monkeypatch, lambda n: n > 2)
    with pytest.raises(RunError, match=r"3 worker processes in a row failed to start; the last: a worker died while "
                                       r"starting \(exit code -9\)"):
        Engine(_cfg(), tmp_path / "run", progress=False).run()
    assert len(spawned) == 5
    assert all(w.proc.poll() is not None for w in spawned)


@pytest.mark.slow  # run by: python -m pytest -m slow
def test_a_worker_that_died_while_idle_costs_no_client(tmp_path, monkeypatch):
    """A worker killed between rounds held no client: the next round's share goes to its
    replacement whole."""
    import fedhetero.backends.process as proc

    real_run = proc.ProcessBackend.run
    calls: list[int] = []
    before = live_children()

    def run(self, *args, **kw):
        calls.append(len(calls))
        if len(calls) == 2:
            victim = min(live_children() - before)  # a worker process (the first started)
            os.kill(victim, signal.SIGKILL)
            # until its exit can be collected (all its threads ended), left to the back end to collect
            _wait_for(lambda: os.waitid(os.P_PID, victim, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None, 30,
                      "the killed worker to end")
        return real_run(self, *args, **kw)

    monkeypatch.setattr(proc.ProcessBackend, "run", run)
    res = Engine(_cfg(), tmp_path / "run", progress=False).run()
    assert [len(r["clients"]) for r in res.metrics] == [6, 6]
    assert res.summary["dropped_clients"] == 0


# ---------------------------------------------------------------------------- working directory
@pytest.mark.slow  # run by: python -m pytest -m slow
def test_folders_named_like_the_packages_in_the_working_directory_shadow_nothing(tmp_path):
    """A ``models`` folder is a common name: neither it nor ``reparam`` or ``fedhetero`` in the
    working directory is imported by the server or by its workers."""
    cwd = tmp_path / "project"
    for name in ("models", "reparam", "fedhetero"):
        (cwd / name).mkdir(parents=True)
        (cwd / name / "__init__.py").write_text(f"raise ImportError('the working directory\\'s {name} was imported')\n")
    out = tmp_path / "run"
    settings = ("algorithm.name=fedavg", "data.num_clients=4", "train.rounds=1", "engine.backend=process",
                "engine.workers=2")
    proc = subprocess.run(_train(out, *settings), capture_output=True, text=True, timeout=180, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    assert [r["round"] for r in _rows(out)] == [1]
    assert "working directory" not in proc.stderr


# ---------------------------------------------------------------------------- signals
_LONG = (
    "algorithm.name=fedavg", "data.num_clients=6", "train.rounds=200", "train.sample_rate=1.0",
    "engine.backend=process", "engine.workers=3",
)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _as_a_terminal_job() -> None:
    """Ctrl-C's default action in the child, as in a terminal's foreground job: a test suite started
    in the background (``nohup … &``) ignores SIGINT, and a child would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_long(out: Path) -> tuple[subprocess.Popen, list[int]]:
    """A long process-back-end run in a session of its own (as a terminal's job), its stderr (and
    its workers') on a pipe; returns it once its first round has ended, with its workers' ids."""
    proc = subprocess.Popen(_train(out, *_LONG), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_as_a_terminal_job)
    try:
        _wait_for(lambda: bool(_rows(out)) or proc.poll() is not None, 180, "the first round")
        assert proc.poll() is None, proc.communicate()[1]
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    return proc, workers


def test_ctrl_c_prints_one_line_and_no_worker_traceback(tmp_path):
    before = _worker_dirs()
    proc, workers = _start_long(tmp_path / "run")
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground process group
    try:
        _, err = proc.communicate(timeout=60)  # EOF once the server and every worker have closed stderr
    finally:
        if proc.poll() is None:
            _kill_group(proc.pid)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    # the exact command that continues the run (its first round is checkpointed), --out included
    out = tmp_path / "run"
    assert f"fedhetero: interrupted; continue with: fedhetero train --out {shlex.quote(str(out))} --resume\n" in err, err
    assert len(err.strip().splitlines()) <= 3, err
    assert not any(_alive(pid) for pid in workers)
    assert _worker_dirs() <= before


@pytest.mark.slow  # run by: python -m pytest -m slow
def test_workers_end_quietly_when_the_server_is_killed(tmp_path):
    before = _worker_dirs()
    proc, workers = _start_long(tmp_path / "run")
    proc.kill()  # SIGKILL: the server cannot clean anything up
    try:
        _, err = proc.communicate(timeout=30)  # EOF once the orphaned workers have ended too
    finally:
        if any(_alive(pid) for pid in workers):
            _kill_group(proc.pid)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    _wait_for(lambda: not any(_alive(pid) for pid in workers), 10, "the orphaned workers to end")
    assert _worker_dirs() <= before


def test_a_server_killed_while_its_workers_start_leaves_nothing_behind(tmp_path):
    before = _worker_dirs()
    out = tmp_path / "run"
    proc = subprocess.Popen(_train(out, *_LONG), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    workers: list[int] = []
    try:
        _wait_for(lambda: len(_children(proc.pid)) == 2 or proc.poll() is not None, 120, "the workers to be started")
        workers = _children(proc.pid)
        proc.kill()
        _, err = proc.communicate(timeout=60)
    finally:
        if any(_alive(pid) for pid in workers) or proc.poll() is None:
            _kill_group(proc.pid)
    assert len(workers) == 2
    assert not _rows(out)  # killed before its first round ended
    assert "Traceback" not in err, err
    _wait_for(lambda: not any(_alive(pid) for pid in workers), 10, "the orphaned workers to end")
    assert _worker_dirs() <= before
