"""The ``process`` back end: the server process and persistent worker processes on one machine.

``engine.workers`` executors run a round's tasks: the server itself (on a client context of its
own, as on ``local``) and ``workers - 1`` worker processes; with ``engine.client_timeout_s`` set,
every task runs in a worker (``workers`` of them), because only a task in another process can be
stopped at the time-out (or crash, e.g. in native code, without ending the run).

Each worker is a fresh interpreter started once per run (``python -m fedhetero.engines.process``,
connected over a local socket: no forked OpenMP or allocator state, and the caller's ``__main__``
is never re-imported, so scripts need no ``if __name__ == "__main__"`` guard; messages travel as
:class:`~fedhetero.engines.wire.Channel` writes them, tensor data through a shared-memory ring
where the platform has one). It builds the data
set and a :class:`~fedhetero.context.ClientContext` from the config alone, and then runs the
client tasks it is sent. Tasks are dealt in client-id order, round-robin; outcomes come back in
any order and are returned sorted by client id, so the server reduces them in exactly the
order of the ``local`` back end and the numbers are the same bit for bit (on CPU, with the same
thread count per client).

A worker that overruns ``engine.client_timeout_s`` is killed and replaced, and its client is
dropped from the round; a worker that dies takes only its current client with it. A worker
returns an outcome without its task (which holds the global model; the server has it) and has
already checked that the upload is finite, so neither costs the server anything.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import secrets
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any, Callable, Iterator

from fedhetero.config import ConfigError, RunConfig, from_dict, to_dict
from fedhetero.context import RunError
from fedhetero.engines import Backend, Outcome, run_task
from fedhetero.engines.wire import Channel

__all__ = ["ProcessBackend"]

_STARTUP_S = 300.0  # seconds a worker may take to import torch and build the data set


_SOCKET_BUFFER = 8 << 20  # bytes: a model state goes through in one write instead of many wake-ups


def _widen(conn: Connection) -> None:
    """Enlarge the socket's kernel buffers (best effort): with the default ~200 KiB, every upload of
    a LeNet-5 state took several blocking write/read hand-offs between the two processes."""
    import socket

    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
    except OSError:
        return
    try:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)
    except OSError:
        pass
    finally:
        sock.close()


def _worker_main(conn: Connection) -> None:
    """Worker loop: build the client side from the config, then run tasks until told to stop."""
    _widen(conn)
    try:
        cfg_data, threads, path = pickle.loads(conn.recv_bytes())
        for entry in reversed(path):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        import torch

        torch.set_num_threads(threads)
        cfg = from_dict(cfg_data)
        if cfg.tune_malloc and cfg.device == "cpu":
            from reparam.allocator import tune_malloc

            tune_malloc()
        from fedhetero.algorithms import build_algorithm
        from fedhetero.context import client_context

        ctx = client_context(cfg)
        proto = build_algorithm(cfg)
        cls, options = type(proto), proto.options
    except Exception as exc:  # reported to the server, which stops the run with this message
        conn.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}")))
        return
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    chan = Channel(conn)  # every later message, both ways
    chan.share_rings(first=False)
    while True:
        try:
            kind, *body = chan.recv()
        except (EOFError, OSError):
            return
        if kind == "eval":  # (model, data set name, indices): some evaluation batches
            try:
                model, name, indices = body
                stats: Any = ctx.evaluate_batches(model, getattr(ctx.data, name), indices)
            except Exception as exc:  # the server evaluates these batches itself
                stats = f"{type(exc).__name__}: {exc}"
            chan.send(stats)
            continue
        if kind == "stop":
            return
        for task, state in body[0]:  # one outcome message per task, as soon as it is done
            o = run_task(lambda: cls(options), ctx, task, state, hang_seconds=3600.0)
            # the server has the task: only the rest travels back (the task holds the global model)
            chan.send((o.result, o.error, o.seconds, o.detail, o.checked, o.kind))


class _Worker:
    """One worker interpreter and its connection."""

    def __init__(self, cfg_data: dict[str, Any], threads: int) -> None:
        folder = tempfile.mkdtemp(prefix="fedhetero-worker-")
        address = os.path.join(folder, "sock")
        key = secrets.token_bytes(16)
        self._listener = Listener(address, family="AF_UNIX", authkey=key)
        self._folder = folder
        env = dict(os.environ, FEDHETERO_WORKER_KEY=key.hex(), OMP_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fedhetero.engines.process", address], env=env, stdin=subprocess.DEVNULL
        )
        self._init = pickle.dumps((cfg_data, threads, list(sys.path)))
        self.conn: Connection | None = None
        self.chan: Channel | None = None  # the connection after the start-up handshake
        self.ready = False
        self.queue: list[Any] = []  # tasks sent and not yet answered, in the order it runs them
        self.started = 0.0  # when the first task of ``queue`` started (as far as the server knows)

    def connect(self) -> None:
        """Wait for the started interpreter to connect and send it the config (started workers
        import torch in parallel; this only waits)."""
        if self.conn is not None:
            return
        try:
            self.conn = _accept(self._listener, self.proc)
        finally:
            self._listener.close()
            try:
                os.rmdir(self._folder)
            except OSError:
                pass
        _widen(self.conn)
        self.conn.send_bytes(self._init)

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        if self.chan is not None:
            self.chan.close()
        if self.conn is not None:
            self.conn.close()
        else:
            self._listener.close()


def _accept(listener: Listener, proc: "subprocess.Popen[bytes]") -> Connection:
    """Accept the worker's connection, failing clearly if it dies before connecting."""
    import socket

    sock = listener._listener._socket  # type: ignore[attr-defined]
    deadline = time.monotonic() + _STARTUP_S
    sock.settimeout(0.2)
    while True:
        try:
            return listener.accept()
        except (socket.timeout, TimeoutError):
            if proc.poll() is not None:
                raise RunError(f"engine.backend=process: a worker exited while starting (exit code {proc.returncode})") from None
            if time.monotonic() > deadline:
                proc.kill()
                raise RunError(f"engine.backend=process: a worker did not start within {_STARTUP_S:g} s") from None


class ProcessBackend(Backend):
    """``engine.workers`` executors (default: the machine's cores): the server process and
    ``workers - 1`` persistent worker processes, or ``workers`` worker processes when
    ``engine.client_timeout_s`` is set.

    The server would otherwise sit idle while the pool trains, and on a machine with one core per
    executor a third process only takes CPU from the others; running a share here also halves the
    uploads that cross a process boundary. ``data``: the server's data set, used by that share."""

    name = "process"

    def __init__(self, cfg: RunConfig, data: Any = None) -> None:
        self.cfg = cfg
        self.size = cfg.engine.workers or os.cpu_count() or 1
        # the server process is one of the ``size`` executors (its own client context, as on
        # ``local``) unless tasks must be interruptible: a task running here cannot be stopped at
        # ``engine.client_timeout_s`` (an injected hang needs a time-out, so it is covered)
        self.in_process = cfg.engine.client_timeout_s is None
        self._data = data  # the server's data set, shared read-only with its own share of tasks
        self._ctx: Any = None
        self._remote_eval = True  # False once a model could not be evaluated in a worker
        self.threads = cfg.threads or 1
        self.timeout = cfg.engine.client_timeout_s
        self._cfg_data = to_dict(cfg)
        self._workers: list[_Worker] = []

    # ------------------------------------------------------------------ pool
    def _start(self) -> None:
        while len(self._workers) < self.size - int(self.in_process):
            self._workers.append(_Worker(self._cfg_data, self.threads))

    def _await_ready(self, worker: _Worker) -> None:
        if worker.ready:
            return
        worker.connect()
        assert worker.conn is not None
        if not worker.conn.poll(_STARTUP_S):
            worker.kill()
            raise RunError(f"engine.backend=process: a worker did not start within {_STARTUP_S:g} s")
        try:
            kind, value = pickle.loads(worker.conn.recv_bytes())
        except (EOFError, OSError):
            raise RunError(f"engine.backend=process: a worker died while starting (exit code {worker.exitcode})") from None
        if kind == "error":
            worker.kill()
            raise ConfigError(f"engine.backend=process: a worker could not set up the client side: {value}")
        worker.chan = Channel(worker.conn)
        try:
            worker.chan.share_rings(first=True)
        except (EOFError, OSError):
            raise RunError(f"engine.backend=process: a worker died while starting (exit code {worker.exitcode})") from None
        worker.ready = True

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(self._cfg_data, self.threads)
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    # ------------------------------------------------------------------ running
    def _send(self, w: _Worker, batch: list[Any], states: dict[int, Any], done: dict[int, Outcome]) -> _Worker:
        """Send a worker its share of the round in one message: tasks of one round share their
        payload tensors (the global model), which pickle then carries once per worker."""
        while batch:
            self._await_ready(w)
            assert w.chan is not None  # connected by _await_ready
            try:
                w.chan.send(("tasks", [(t, states.get(t.cid)) for t in batch]))
            except (BrokenPipeError, OSError):
                done[batch[0].cid] = Outcome(batch[0], None, f"worker died (exit code {w.exitcode})", kind="lost")
                batch = batch[1:]
                w = self._replace(w)
                continue
            w.queue = list(batch)
            w.started = time.perf_counter()
            break
        return w

    def start(self) -> None:
        """Start the workers and wait until each has built its client side (idempotent; ``run``
        calls it, a benchmark calls it to keep start-up out of the timed rounds)."""
        self._start()
        for w in self._workers:
            self._await_ready(w)

    def run(self, algorithm, tasks, states, on_done: Callable[[Outcome], None] | None = None):  # type: ignore[no-untyped-def]
        """Tasks in client-id order, dealt round-robin to the executors (neighbouring ids land on
        different ones, which balances tiers): the workers' shares are sent first, then the server
        runs its own, reading the workers' outcomes that have arrived after each of its tasks (so
        that the uploads are folded while the round runs, not after it); outcomes returned in
        client-id order."""
        self.start()
        queue = sorted(tasks, key=lambda t: t.cid)
        done: dict[int, Outcome] = {}
        n = len(self._workers)
        k = n + int(self.in_process)
        for i in range(n):
            self._send(self._workers[i], queue[i + k - n :: k], states, done)

        def finish(task: Any, outcome: Outcome) -> None:
            done[task.cid] = outcome
            if on_done is not None:
                on_done(outcome)

        if self.in_process:
            self._run_here(algorithm, queue[0::k], states, finish, lambda: self._collect(0.0, states, done, finish))
        while any(w.queue for w in self._workers):
            wait_s = None
            if self.timeout is not None:
                now = time.perf_counter()
                wait_s = max(0.0, min(w.started + self.timeout - now for w in self._workers if w.queue) + 0.01)
            self._collect(wait_s, states, done, finish)
        return [done[t.cid] for t in queue]

    def _collect(
        self, wait_s: float | None, states: dict[int, Any], done: dict[int, Outcome], finish: Callable[[Any, Outcome], None]
    ) -> None:
        """Take the outcomes the busy workers have sent, waiting up to ``wait_s`` seconds (None: until
        one arrives) for the first; a worker that died or overran the time-out loses its current
        task and is replaced, and the rest of its share goes to the replacement."""
        busy = [w for w in self._workers if w.queue]
        if not busy:
            return
        ready = wait([w.conn for w in busy if w.conn is not None], timeout=wait_s)
        if not ready and wait_s == 0.0:
            return
        now = time.perf_counter()
        for w in busy:
            task = w.queue[0]
            if w.conn in ready:
                assert w.chan is not None
                try:
                    outcome = Outcome(task, *w.chan.recv())
                except (EOFError, OSError):
                    rest = w.queue[1:]
                    finish(task, Outcome(task, None, f"worker died (exit code {w.exitcode})", now - w.started, kind="lost"))
                    self._send(self._replace(w), rest, states, done)
                    continue
                w.queue.pop(0)
                w.started = now
                finish(task, outcome)
            elif self.timeout is not None and now - w.started > self.timeout:
                rest = w.queue[1:]
                finish(task, Outcome(
                    task, None, f"timeout: no answer within engine.client_timeout_s={self.timeout:g} s", now - w.started,
                    kind="timeout",
                ))
                self._send(self._replace(w), rest, states, done)

    def evaluate_batches(self, model: Any, name: str, indices: Any) -> list[tuple[float, int, int]] | None:
        """An evaluation's batches shared among the executors: contiguous runs of batches, the
        first runs to idle workers (the model goes with them), the last to the server; the
        per-batch numbers are put back in batch order, so their sum is the one ``local`` computes.

        None (the server evaluates alone) for a single batch, without idle workers, with
        ``threads: null`` (the server's and the workers' thread counts may then differ) or with
        ``engine.client_timeout_s`` (the server then runs no share, and would wait on a worker with
        no limit). A worker that fails leaves its batches to the server."""
        import numpy as np

        idle = [w for w in self._workers if w.ready and not w.queue and w.chan is not None]
        if not self._can_share(len(idle)):
            return None
        ctx = self._server_context()
        dataset = getattr(ctx.data, name)
        order = np.arange(len(dataset.labels)) if indices is None else np.asarray(indices)
        size = self.cfg.train.eval_batch_size
        batches = -(-len(order) // size)
        k = self._shares(len(order), len(idle))
        if k < 2:
            return None
        bounds = [round(i * batches / k) for i in range(k + 1)]
        parts = [order[bounds[i] * size : bounds[i + 1] * size] for i in range(k)]
        sent: list[_Worker | None] = []
        for w, part in zip(idle[: k - 1], parts):
            assert w.chan is not None
            if not self._remote_eval:  # the model did not pickle for an earlier helper
                sent.append(None)
                continue
            try:
                w.chan.send(("eval", model, name, part))
                sent.append(w)
            except (BrokenPipeError, OSError):
                sent.append(None)
            except Exception:  # a model that does not pickle (nothing was written): evaluated here, from now on
                self._remote_eval = False
                sent.append(None)
        results: list[Any] = [None] * k
        with self._workers_threads():
            results[k - 1] = ctx.evaluate_batches(model, dataset, parts[k - 1])
        for i, helper in enumerate(sent):
            reply = None
            if helper is not None:
                try:
                    assert helper.chan is not None
                    reply = helper.chan.recv()
                except (EOFError, OSError):
                    self._replace(helper)
            if not isinstance(reply, list):  # the worker could not: these batches here, and from now on
                self._remote_eval = False
                reply = ctx.evaluate_batches(model, dataset, parts[i])
            results[i] = reply
        return [stat for part in results for stat in part]

    def _can_share(self, helpers: int) -> bool:
        """Whether an evaluation may be shared with ``helpers`` idle workers (see
        :meth:`evaluate_batches` for when it may not)."""
        return helpers > 0 and self.cfg.threads is not None and self._remote_eval and self.in_process

    def _shares(self, samples: int, helpers: int) -> int:
        """Executors an evaluation of ``samples`` shares its batches among (1: the server alone)."""
        if not self._can_share(helpers):
            return 1
        return min(-(-samples // self.cfg.train.eval_batch_size), helpers + 1)

    def evaluation_shares(self, name: str = "test") -> int:
        """Executors that share an evaluation of the server's ``name`` data set (``test`` or
        ``train``) when every worker is idle, as after a round (1: the server evaluates alone)."""
        return self._shares(len(getattr(self._server_context().data, name).labels), self.size - 1)

    def _server_context(self) -> Any:
        """The server's own client context (built once, on the server's data set)."""
        if self._ctx is None:
            from fedhetero.context import client_context

            self._ctx = client_context(self.cfg, self._data)
        return self._ctx

    @contextlib.contextmanager
    def _workers_threads(self) -> Iterator[None]:
        """The workers' thread count in this process for a block (so every executor computes alike)."""
        import torch

        before = torch.get_num_threads()
        if before != self.threads:
            torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            if before != self.threads:
                torch.set_num_threads(before)

    def _run_here(
        self, algorithm: Any, tasks: list[Any], states: dict[int, Any], finish: Callable[[Any, Outcome], None],
        between: Callable[[], None],
    ) -> None:
        """The server's own share, on its own client context, at the workers' thread count;
        ``between`` runs after each task."""
        ctx = self._server_context()
        cls, options = type(algorithm), algorithm.options
        with self._workers_threads():
            for task in tasks:
                finish(task, run_task(lambda: cls(options), ctx, task, states.get(task.cid)))
                between()

    def close(self) -> None:
        for w in self._workers:
            try:
                if w.proc.poll() is None and w.chan is not None:
                    w.chan.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for w in self._workers:
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            w.kill()
        self._workers = []


def main(argv: list[str] | None = None) -> None:
    """Entry point of a worker interpreter: connect back to the server and serve tasks."""
    args = sys.argv[1:] if argv is None else argv
    key = bytes.fromhex(os.environ.pop("FEDHETERO_WORKER_KEY"))
    conn = Client(args[0], family="AF_UNIX", authkey=key)
    _worker_main(conn)


if __name__ == "__main__":
    main()
