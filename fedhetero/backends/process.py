"""The ``process`` back end: the server process and persistent worker processes on one machine.

``engine.workers`` executors run a round's tasks: the server itself (on a client context of its
own, as on ``local``) and ``workers - 1`` worker processes; with ``engine.client_timeout_s`` set,
every task runs in a worker (``workers`` of them), because only a task in another process can be
stopped at the time-out (or crash, e.g. in native code, without ending the run).

Each worker is a fresh interpreter started once per run (``python -c``, see :func:`_bootstrap`,
with the server's ``sys.path``, so a folder in the working directory shadows nothing; connected
over a socket pair it inherits: no forked OpenMP or allocator state, nothing left on the file
system, and the caller's ``__main__`` is never re-imported, so scripts need no
``if __name__ == "__main__"`` guard; messages travel as :class:`~fedhetero.backends.wire.Channel`
writes them, tensor data through a shared-memory ring where the platform has one). It builds the
data set and a :class:`~fedhetero.core.local.context.ClientContext` from the config alone, and then runs the
client tasks it is sent. Tasks are dealt in client-id order, round-robin; outcomes come back in
any order and are returned sorted by client id, so the server reduces them in exactly the
order of the ``local`` back end and the numbers are the same bit for bit (on CPU, with the same
thread count per client).

A worker that overruns ``engine.client_timeout_s`` is killed and replaced, and its client is
dropped from the round (``timeout``); a worker that dies takes only its current client with it
(``lost``), and the rest of its share goes to its replacement, which starts while the others go
on. A replacement that dies while starting is replaced in turn (costing the first client dealt
to it); only several failed starts in a row stop the run. A worker ends quietly on Ctrl-C (the
server reports the interruption) and when the server is gone. A worker returns an outcome without
its task (which holds the global model; the server has it) and has already checked that the
upload is finite, so neither costs the server anything.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterator

import numpy as np
import torch

from fedhetero.backends.wire import Channel
from fedhetero.core.run.allocator import tune_malloc
from fedhetero.core.run.backend import Backend, run_task, run_together
from fedhetero.core.common.config import RunConfig, from_dict, to_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.local.context import RunError, client_context
from fedhetero.core.method.registry import build_algorithm
from fedhetero.core.exchange.types import Outcome

__all__ = ["ProcessBackend"]

_STARTUP_S = 300.0  # seconds a worker may take to import torch and build the data set
_START_TRIES = 3  # workers in a row that may fail to start before the run stops
_WATCH_S = 0.5  # how often a worker checks that the server that started it is still there


_SOCKET_BUFFER = 8 << 20  # bytes: a model state goes through in one write instead of many wake-ups


def _widen(conn: Connection) -> None:
    """Enlarge the socket's kernel buffers (best effort): with the default ~200 KiB, every upload of
    a LeNet-5 state took several blocking write/read hand-offs between the two processes."""
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


def _bootstrap(path: list[str]) -> str:
    """The ``-c`` program a worker interpreter starts with.

    Its first statement replaces ``sys.path`` with the server's (``-c`` puts the working directory
    first, where a folder named ``models``, ``reparam`` or ``fedhetero`` would shadow the installed
    packages; the server's own path says where its modules came from). Then SIGINT gets its default
    action (a Ctrl-C reaches the whole process group: the worker ends at once and quietly, and the
    server reports the interruption) and is unblocked: the server starts workers with it blocked,
    so one during the interpreter's start-up waits until here instead of raising KeyboardInterrupt."""
    return (
        "import sys\n"
        f"sys.path[:] = {path!r}\n"
        "import signal\n"
        "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
        "if hasattr(signal, 'pthread_sigmask'):\n"
        "    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])\n"
        "from fedhetero.backends.process import main\n"
        "main(sys.argv[1:])\n"
    )


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT held back in this thread for a block (a child inherits the blocked signal; here a
    Ctrl-C that arrived meanwhile is delivered when the block ends, nothing is lost)."""
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - not POSIX
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _watch_parent(parent: int) -> None:
    """End this worker quietly once the server that started it is gone (killed, say): a worker
    busy with a task would otherwise run on until it next wrote to the closed connection."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_WATCH_S)
        os._exit(0)

    threading.Thread(target=watch, name="fedhetero-watch-server", daemon=True).start()


def _worker_main(conn: Connection) -> None:
    """Worker loop: build the client side from the config, then run tasks until told to stop."""
    _widen(conn)
    cfg_data, threads = pickle.loads(conn.recv_bytes())
    try:
        torch.set_num_threads(threads)
        cfg = from_dict(cfg_data)
        if cfg.tune_malloc and cfg.device == "cpu":
            tune_malloc()

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
        share = body[0]
        # this executor's share: its cohorts first (engine.vectorize), then one outcome message per
        # task in the order sent, each as soon as it is done
        done = run_together(lambda: cls(options), ctx, [t for t, _ in share], {t.cid: st for t, st in share})
        for task, state in share:
            together = done.pop(task.cid, None)
            o = together if together is not None else run_task(lambda: cls(options), ctx, task, state, hang_seconds=3600.0)
            # the server has the task: only the rest travels back (the task holds the global model)
            chan.send((o.result, o.error, o.seconds, o.detail, o.checked, o.kind))


class _Worker:
    """One worker interpreter and its connection: one end of a socket pair the interpreter
    inherits (nothing on the file system to clean up, nothing another process can connect to).

    It is started without waiting: the config goes into the socket at once, and the server takes
    the worker's answer (``ready``, or why it could not set up) when it comes."""

    def __init__(self, init: bytes, threads: int) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            path = [p for p in sys.path if isinstance(p, str)]
            command = [sys.executable, "-c", _bootstrap(path), str(theirs.fileno()), str(os.getpid())]
            with _sigint_blocked():
                self.proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        _widen(self.conn)
        try:
            self.conn.send_bytes(init)
        except OSError:  # already gone: its start fails when its answer is awaited
            pass
        self.deadline = time.perf_counter() + _STARTUP_S  # when it must have answered
        self.chan: Channel | None = None  # the connection after the start-up handshake
        self.ready = False
        self.queue: list[Any] = []  # tasks sent and not yet answered, in the order it runs them
        self.pending: list[Any] = []  # tasks dealt to it while it starts (sent once it is ready)
        self.started = 0.0  # when the first task of ``queue`` started (as far as the server knows)

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def kill(self, grace: float = 0.0) -> None:
        """Stop the interpreter (after up to ``grace`` seconds for it to end by itself, so that the
        exit code of one that died is its own) and close the connection."""
        if grace > 0 and self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace)
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.chan is not None:
            self.chan.close()
        self.conn.close()


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
        self._init = pickle.dumps((to_dict(cfg), self.threads))
        self._workers: list[_Worker] = []
        self._start_failures = 0  # workers in a row that died (or hung) while starting

    # ------------------------------------------------------------------ pool
    def _spawn(self) -> _Worker:
        return _Worker(self._init, self.threads)

    def _start(self) -> None:
        while len(self._workers) < self.size - int(self.in_process):
            self._workers.append(self._spawn())

    def _replace(self, worker: _Worker, grace: float = 0.0) -> _Worker:
        worker.kill(grace)
        fresh = self._spawn()
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def _handshake(self, w: _Worker, states: dict[int, Any], finish: Callable[[Any, Outcome], None]) -> None:
        """Take a starting worker's first answer, if it has come: it is ready (then it is sent the
        tasks dealt to it meanwhile), it could not set up the client side (a config error: the run
        stops), it died, or it did not answer within ``_STARTUP_S``. One that died or hung is
        replaced (the first client it was dealt is lost, as with any worker that dies); after
        ``_START_TRIES`` such failures in a row the run stops."""
        failure = None
        if w.conn.poll():  # a message, or the end of the connection
            try:
                kind, value = pickle.loads(w.conn.recv_bytes())
            except (EOFError, OSError):
                failure = "died while starting"
            else:
                if kind == "error":
                    w.kill()
                    raise ConfigError(f"engine.backend=process: a worker could not set up the client side: {value}")
                w.chan = Channel(w.conn)
                try:
                    w.chan.share_rings(first=True)
                except (EOFError, OSError):
                    failure = "died while starting"
        elif time.perf_counter() > w.deadline:
            failure = f"did not start within {_STARTUP_S:g} s"
        else:
            return
        if failure is None:
            w.ready = True
            self._start_failures = 0
            pending, w.pending = w.pending, []
            self._assign(w, pending, states, finish)
            return
        w.kill(grace=1.0)
        self._start_failures += 1
        what = f"a worker {failure} (exit code {w.exitcode})"
        if self._start_failures >= _START_TRIES:
            raise RunError(
                f"engine.backend=process: {self._start_failures} worker processes in a row failed to start; "
                f"the last: {what}. Check memory and the worker's messages above, or use engine.backend=local"
            )
        self._lose(w, f"worker {failure} (exit code {w.exitcode})", "lost", states, finish)

    def _lose(
        self, w: _Worker, reason: str, kind: str, states: dict[int, Any], finish: Callable[[Any, Outcome], None]
    ) -> None:
        """A worker died or overran its time-out: it is killed and replaced; the task it was running
        (or, while it started, the first one dealt to it) is dropped with ``reason`` and ``kind``,
        and the rest of its share goes to the replacement."""
        held = w.queue + w.pending
        now = time.perf_counter()
        fresh = self._replace(w)
        if held:
            task = held[0]
            finish(task, Outcome(task, None, reason, now - w.started if w.queue else 0.0, kind=kind))
            self._assign(fresh, held[1:], states, finish)

    def _died(self, w: _Worker, states: dict[int, Any], finish: Callable[[Any, Outcome], None]) -> None:
        """A ready worker's connection broke: it is gone (given a moment to leave its exit code)."""
        w.kill(grace=1.0)
        self._lose(w, f"worker died (exit code {w.exitcode})", "lost", states, finish)

    def start(self) -> None:
        """Start the workers and wait until each has built its client side (idempotent; ``run``
        calls it, a benchmark calls it to keep start-up out of the timed rounds)."""
        self._start()
        while any(not w.ready for w in self._workers):
            self._collect(self._wait_s(), {}, {}, lambda task, outcome: None)

    # ------------------------------------------------------------------ running
    def _assign(self, w: _Worker, batch: list[Any], states: dict[int, Any], finish: Callable[[Any, Outcome], None]) -> None:
        """Give a worker tasks, in one message: tasks of one round share their payload tensors (the
        global model), which pickle then carries once per worker. A worker still starting keeps
        them until it is ready. One found dead while idle held no client: its replacement gets them
        all; one whose connection breaks as they are sent loses the first (as a worker that dies
        running it does) and the replacement gets the rest."""
        if not batch:
            return
        if w.ready and not w.queue and w.proc.poll() is not None:  # died while idle, holding no client
            w = self._replace(w)
        if not w.ready:
            w.pending.extend(batch)
            return
        assert w.chan is not None  # set when it became ready
        if not w.queue:
            w.started = time.perf_counter()
        w.queue.extend(batch)
        try:
            w.chan.send(("tasks", [(t, states.get(t.cid)) for t in batch]))
        except OSError:
            self._died(w, states, finish)

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

        def finish(task: Any, outcome: Outcome) -> None:
            done[task.cid] = outcome
            if on_done is not None:
                on_done(outcome)

        for i in range(n):
            self._assign(self._workers[i], queue[i + k - n :: k], states, finish)
        if self.in_process:
            self._run_here(algorithm, queue[0::k], states, finish, lambda: self._collect(0.0, states, done, finish))
        while any(w.queue or w.pending for w in self._workers):
            self._collect(self._wait_s(), states, done, finish)
        return [done[t.cid] for t in queue]

    def _wait_s(self) -> float | None:
        """Seconds until the next deadline (a busy worker's time-out, a starting worker's start-up
        limit) and a little more, so that it has passed; None when there is none."""
        deadlines = [w.deadline for w in self._workers if not w.ready]
        if self.timeout is not None:
            deadlines += [w.started + self.timeout for w in self._workers if w.ready and w.queue]
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.perf_counter()) + 0.01

    def _collect(
        self, wait_s: float | None, states: dict[int, Any], done: dict[int, Outcome], finish: Callable[[Any, Outcome], None]
    ) -> None:
        """Take what the workers have sent, waiting up to ``wait_s`` seconds (None: until something
        arrives) for the first: outcomes of busy workers, and the first answer of starting ones.
        Then every deadline that has passed is enforced, whether or not anything arrived: a worker
        that died or overran the time-out loses its current task and is replaced, and the rest of
        its share goes to the replacement (``done`` is filled through ``finish``)."""
        watched = [w for w in self._workers if w.queue or not w.ready]
        if not watched:
            return
        ready = wait([w.conn for w in watched], timeout=wait_s)
        for w in watched:
            if not w.ready:
                self._handshake(w, states, finish)
                continue
            task = w.queue[0]
            now = time.perf_counter()
            if w.conn in ready:
                assert w.chan is not None
                try:
                    reply = w.chan.recv()
                except (EOFError, OSError):
                    self._died(w, states, finish)
                    continue
                w.queue.pop(0)
                w.started = now
                finish(task, Outcome(task, *reply))
            elif self.timeout is not None and now - w.started > self.timeout:
                reason = f"timeout: no answer within engine.client_timeout_s={self.timeout:g} s"
                self._lose(w, reason, "timeout", states, finish)

    def evaluate_batches(self, model: Any, name: str, indices: Any) -> list[tuple[float, int, int]] | None:
        """An evaluation's batches shared among the executors: contiguous runs of batches, the
        first runs to idle workers (the model goes with them), the last to the server; the
        per-batch numbers are put back in batch order, so their sum is the one ``local`` computes.

        None (the server evaluates alone) for a single batch, without idle workers, with
        ``threads: null`` (the server's and the workers' thread counts may then differ) or with
        ``engine.client_timeout_s`` (the server then runs no share, and would wait on a worker with
        no limit). A worker that fails leaves its batches to the server."""
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
            self._ctx = client_context(self.cfg, self._data)
        return self._ctx

    @contextlib.contextmanager
    def _workers_threads(self) -> Iterator[None]:
        """The workers' thread count in this process for a block (so every executor computes alike)."""
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
            done = run_together(lambda: cls(options), ctx, tasks, states)
            for task in tasks:
                together = done.pop(task.cid, None)
                finish(task, together if together is not None else run_task(lambda: cls(options), ctx, task, states.get(task.cid)))
                between()

    def close(self) -> None:
        """Stop the workers: idle ones are told to stop (and given a few seconds to), the others
        (busy with an abandoned round, still starting) are killed."""
        workers, self._workers = self._workers, []
        idle = [w for w in workers if w.ready and not w.queue and w.proc.poll() is None]
        for w in idle:
            assert w.chan is not None
            with contextlib.suppress(OSError):
                w.chan.send(("stop",))
        deadline = time.monotonic() + 5.0
        for w in idle:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for w in workers:
            w.kill()


def main(argv: list[str] | None = None) -> None:
    """Entry point of a worker interpreter (see :func:`_bootstrap`): ``argv`` is the file
    descriptor of its end of the socket pair and the server's process id. It serves tasks until
    told to stop, and ends quietly when the server is gone (its connection closed, the server
    killed)."""
    args = sys.argv[1:] if argv is None else argv
    fd, parent = int(args[0]), int(args[1])
    _watch_parent(parent)
    conn = Connection(fd)
    try:
        _worker_main(conn)
    except (EOFError, OSError):  # the server has gone: there is no one to answer
        pass
    finally:
        conn.close()
