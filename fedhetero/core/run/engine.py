"""The federated round loop.

:class:`Engine` owns everything that is the same for every method: data and partitions, device
tiers and budgets, client sampling, evaluation, metrics, checkpoints and resume. Algorithms
(:mod:`fedhetero.algorithms`) see only a :class:`~fedhetero.core.local.context.Context`; their client tasks run
on the back end ``engine.backend`` names (:mod:`fedhetero.core.run.backend`). A client task that raises,
times out or uploads non-finite tensors is dropped from its round and recorded in the round's
``dropped`` list of ``metrics.jsonl``; a round with fewer than ``engine.min_clients`` successful
clients stops the run with a message (the last checkpoint stays, so it can be resumed).

Guarantees:

* **Seeds per concern.** One master seed derives an independent generator per concern
  (partitioning, tiers, sampling, budgets, model init, each client's data order, …) through
  ``numpy.random.SeedSequence(seed, spawn_key=(concern, *keys))``. Same config and seed give the
  same numbers; nothing depends on global RNG state carried across rounds.
* **Resumable.** The run directory holds ``config.yaml`` (resolved) with its hash,
  ``metrics.jsonl`` (one object per round), ``checkpoint.pt`` (written atomically) and
  ``summary.json``, among the other files of :data:`~fedhetero.core.common.rundir.RUN_ENTRIES` (the
  README's run-directory table lists them all). A run killed at any point and resumed with ``resume=True`` ends with exactly the
  numbers of an uninterrupted run: client state lives in a versioned on-disk store that is rolled
  back to the checkpoint's round.
* **Memory bounded by the sampled clients**: per-client state goes to the store on disk.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Generator
from typing import Any

import numpy as np
import torch

from fedhetero.core.hetero import budget as budget_mod
from fedhetero.core.exchange.aggregation import Uploads, UploadStream
from fedhetero.core.method.algorithm import Algorithm, state_tensors
from fedhetero.core.run.allocator import tune_malloc
from fedhetero.core.run.backend import Backend, drop_kind, make_backend
from fedhetero.core.common.config import RunConfig, config_hash
from fedhetero.core.common.options import OPTIONS_PATH, ConfigError
from fedhetero.core.common.configfile import dump_config
from fedhetero.core.local.context import Context, RunError, build_data
from fedhetero.core.run.export import global_model_state, save_global_model
from fedhetero.core.run.loggers import RunLoggers
from fedhetero.core.run.progress import RoundProgress
from fedhetero.core.run.resume import changed_options, options_record, resume_config, saved_config
from fedhetero.core.run.summary import summarize
from fedhetero.core.run.metrics import account_round
from fedhetero.core.method.registry import build_algorithm
from fedhetero.core.common.rundir import (
    RUN_AGAIN,
    FinishedRunError,
    MetricsLog,
    RunDirError,
    RunLock,
    atomic_write_text,
    clean_stale,
    clear_run,
    describe_run,
    finite_json,
    inspect_dir,
)
from fedhetero.core.exchange.store import ClientStateStore, atomic_save
from fedhetero.core.exchange.types import ClientInfo, ClientResult, ClientTask, Outcome, check_result, nonfinite_entries
from fedhetero.data import save_partition

#: environment variable that turns internal errors from dropped clients into a stopped run
STRICT_ENV = "FEDHETERO_STRICT"
#: evaluations the summary's ``smoothed_final_accuracy`` smooths over (the FedDUMAP paper's window);
#: a run with fewer evaluations reports none
SMOOTHING_WINDOW = 39


__all__ = ["Engine", "RunResult", "check_splits", "run"]

@dataclass
class RunResult:
    out_dir: Path
    summary: dict[str, Any]
    metrics: list[dict[str, Any]] = field(default_factory=list)


class Engine:
    """Runs one configured federated training job in a run directory."""

    def __init__(
        self,
        cfg: RunConfig | None,
        out_dir: str | Path,
        *,
        resume: bool = False,
        progress: bool = True,
        console: Any = None,
        stop_after: int | None = None,
        backend: Backend | None = None,
        overwrite: bool = False,
        shared_splits: bool = False,
        overrides: list[str] | None = None,
    ) -> None:
        """``resume``: continue the run in ``out_dir``; its saved config is used, with ``overrides``
        (``key=value`` strings) applied to it, or ``cfg`` when given (it must hash the same: only
        the fields that may change on resume differ). A method loaded from code outside the
        package (``algorithm.name`` of the form ``module:Class`` or ``file.py:Class``) is imported
        only when the caller names it again (``cfg`` or an ``algorithm.name`` override): a run
        directory never makes fedhetero run code."""
        self.out_dir = Path(out_dir)
        self.resume = resume
        self.overwrite = overwrite
        # a comparison holds the same server/public splits out for every method, used or not
        self.shared_splits = shared_splits
        self.progress = progress
        self.console = console
        self.stop_after = stop_after  # for tests: stop (as if killed) after this round
        self.backend = backend  # None: the one cfg.engine.backend names
        self._own_backend = backend is None  # a back end passed in is the caller's to close
        self._best: float | None = None  # best evaluated accuracy so far (for best_model.pt)
        # its model, held until the next checkpoint writes it (None: best_model.pt is up to date)
        self._best_state: dict[str, torch.Tensor] | None = None
        # whether every tier deployed the global model at the last evaluation (None: none yet)
        self._one_model: bool | None = None
        self._hashes: set[str] = set()  # the config hashes this run directory may have recorded
        if resume:
            cfg, self._hashes = resume_config(self.out_dir, cfg, overrides)
        elif overrides:
            raise ValueError("Engine: overrides are applied to a saved config, with resume=True")
        if cfg is None:
            raise ConfigError("no config given")
        self.cfg = cfg
        # the loggers cfg.loggers names (a missing optional package is refused here, before the
        # directory is made)
        self.loggers = RunLoggers(cfg, self.out_dir)
        if not self._hashes:
            self._hashes = {config_hash(cfg)}
        self._check_dir()

    def _check_dir(self) -> None:
        """Refuse a directory this run may not use (called again under the lock)."""
        if self.resume:
            return  # saved_config found the run; foreign files beside it are left alone
        state = inspect_dir(self.out_dir)
        if state.foreign:
            raise RunDirError(
                f"{self.out_dir} is not empty and is not a fedhetero run directory (it holds "
                f"{state.foreign_text()}); fedhetero never deletes or replaces files it did not write: "
                "choose an empty or new --out"
            )
        if state.holds_run:
            holder = RunLock.holder(self.out_dir)
            if holder is not None and holder != str(os.getpid()):  # another run in progress: in use,
                # never to be resumed or replaced now (under its own lock, this run is the holder)
                raise RunDirError(
                    f"{self.out_dir} is in use by another fedhetero run (pid {holder}); wait for it to "
                    "finish or choose another --out"
                )
        if state.holds_run and not self.overwrite:
            if self._is_this_run_finished():
                raise FinishedRunError(
                    f"{self.out_dir} already holds this run, finished (the same config); {RUN_AGAIN}",
                    self.out_dir,
                )
            held = describe_run(self.out_dir)
            can_resume = (self.out_dir / "config.yaml").is_file()
            raise RunDirError(
                f"{self.out_dir} already holds {held}; "
                + ("continue it with --resume, " if can_resume else "")
                + "replace it with --overwrite, or choose another --out"
            )

    def _is_this_run_finished(self) -> bool:
        """Whether the run directory holds a finished run (``summary.json``) of this very config
        (the saved config's hash is this one's)."""
        if not (self.out_dir / "summary.json").is_file():
            return False
        try:
            saved = saved_config(self.out_dir)
        except (ConfigError, RunDirError, OSError):
            return False
        return config_hash(saved) == config_hash(self.cfg)

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        """Build the data, the context, the back end and the method, and set the method up: what
        :meth:`run` does before its first round (no round runs, no run file is written). Lets a
        tool or a test inspect a configured job (the global model, ``ctx``, tiers)."""
        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        device = torch.device(cfg.device)
        if cfg.tune_malloc and device.type == "cpu":
            tune_malloc()
        if cfg.deterministic and device.type == "cuda":
            # CPU kernels used here are deterministic already; on CUDA pick deterministic algorithms
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.backends.cudnn.benchmark = False
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device: 'cuda' requested but CUDA is not available; use device=cpu")
        self.algorithm = build_algorithm(cfg)
        cls = type(self.algorithm)
        check_splits(cfg, cls, allow_unused=self.shared_splits)
        if cfg.budget.scenario not in cls.adapts_to:
            raise ConfigError(
                f"budget.scenario: {cfg.algorithm.name} cannot follow {cfg.budget.scenario!r} budgets "
                f"(it follows: {', '.join(sorted(cls.adapts_to))})"
            )
        self.data = build_data(cfg)
        self.store = ClientStateStore(self.out_dir / "client_state")
        self.ctx = Context(cfg, self.data, self.store, device)
        # a budget the method cannot meet is refused before a worker starts or a model is built
        budget_mod.check_budgets(cfg, self.algorithm, self.ctx)
        if self.backend is None:
            self.backend = make_backend(cfg, self.data)
        elif (made_for := getattr(self.backend, "cfg", None)) is not None and config_hash(made_for) != config_hash(cfg):
            # a back end builds its clients from its own config: it must be this run's
            raise ConfigError("backend: the back end passed in was made for another config than this run's")
        self.ctx.batch_evaluator = getattr(self.backend, "evaluate_batches", None)
        with self.ctx.seeded("init", 1):
            self.algorithm.setup(self.ctx)
        n = cfg.data.num_clients
        self._participation = [0] * n
        self.tiers = budget_mod.assign_tiers(n, cfg.budget.tiers, self.ctx.rng("tiers"))
        self.schedule = budget_mod.BudgetSchedule(
            scenario=cfg.budget.scenario,
            change=cfg.budget.change,
            min_ratio=cfg.budget.min_ratio,
            max_ratio=cfg.budget.max_ratio,
        )

    def _write_run_files(self) -> None:
        atomic_write_text(self.out_dir / "config.yaml", dump_config(self.cfg))
        meta = {
            "config_hash": config_hash(self.cfg),
            "algorithm": self.cfg.algorithm.name,
            "plain_macs": self.ctx.plain_macs,
            "torch": torch.__version__,
            "num_clients": self.cfg.data.num_clients,
            "client_samples": [int(len(ix)) for ix in self.data.client_indices],
            "tiers": self.tiers,
            "partition": self.cfg.data.partition,
            "server_samples": int(len(self.data.server_indices)) if self.data.server_indices is not None else 0,
            "public_samples": int(len(self.data.public_indices)) if self.data.public_indices is not None else 0,
        }
        meta["algorithm_options"] = options_record(self.algorithm.options)
        meta["data"] = self.data.summary()
        atomic_write_text(self.out_dir / "run.json", json.dumps(finite_json(meta), indent=2, default=str))
        save_partition(self.data, self.out_dir / "partition.npz")

    # ------------------------------------------------------------------ client tasks
    def _round(self, clients: list[ClientInfo]) -> list[ClientResult]:
        """One round: the exchanges of the method's :meth:`Algorithm.run_round` (by default
        configure → the back end → aggregate → server update), run here."""
        return self._drive(self.algorithm.run_round(self.ctx, clients))

    def _drive(self, steps: Any) -> list[ClientResult]:
        """Run a method's exchanges (:data:`~fedhetero.core.method.algorithm.Exchanges`): each list
        of tasks the generator yields goes to the back end, the results of the clients that
        succeeded go back into it, and what it returns is the result. A hook that runs no
        exchange may return its results (or None) directly."""
        if not isinstance(steps, Generator):
            return list(steps or [])
        try:
            tasks = next(steps)
            while True:
                tasks = steps.send(self._execute(self.algorithm, tasks))
        except StopIteration as stop:
            return list(stop.value or [])

    def _execute(self, algorithm: Algorithm, tasks: list[ClientTask]) -> list[ClientResult]:
        """Run tasks on the back end with each client's private state; keep the new states of the
        clients that succeeded; record and drop the others (error, time-out, non-finite upload)."""
        assert self.backend is not None
        states = {t.cid: self.store.get(t.cid, before_round=t.round, prelude=t.prelude) for t in tasks}
        # the uploads are averaged as they arrive, in client-id order (the default aggregation
        # takes that mean; it is the list average bit for bit)
        stream = UploadStream(tasks, self.cfg.train.aggregation == "uniform", self.cfg.engine.client_timeout_s)
        progress = self.ctx.on_client_done

        def on_done(outcome: Outcome) -> None:
            stream.offer(outcome)
            if progress is not None:
                progress(outcome.task.cid)

        # the back end's wall time on the round's client tasks (the rest of ``wall_s`` is the
        # server's own work: sampling, configuring, aggregating, evaluating)
        with self.ctx.timer("client_phase"):
            outcomes = self.backend.run(algorithm, tasks, states, on_done=on_done)
        ok = Uploads()
        ok.stream = stream
        for outcome in outcomes:
            task = outcome.task
            reason = check_result(outcome, self.cfg.engine.client_timeout_s)
            if reason is not None:
                kind = drop_kind(self.cfg, outcome, reason)
                self._dropped.append({"cid": task.cid, "step": task.step, "tier": task.tier, "kind": kind, "reason": reason})
                if kind == "internal_error" and strict_mode():
                    raise RunError(
                        f"round {task.round}: client {task.cid} raised an internal error ({STRICT_ENV} is set): "
                        f"{reason}" + (f"\n{outcome.detail}" if outcome.detail else "")
                    )
                if self.console is not None and self.progress:
                    what = "internal error (a bug; please report it)" if kind == "internal_error" else "dropped"
                    self.console.print(
                        f"round {task.round}: client {task.cid} {what}: {reason}",
                        markup=False, highlight=False, soft_wrap=True, style="red" if kind == "internal_error" else "yellow",
                    )
                continue
            res = outcome.result
            assert res is not None
            if res.client_state is not None:
                self.store.put(task.cid, res.client_state, task.round, prelude=task.prelude)
            self._seconds[task.cid] = self._seconds.get(task.cid, 0.0) + float(outcome.seconds)
            for k, v in res.timers.items():
                self.ctx.timers[k] = self.ctx.timers.get(k, 0.0) + v
            ok.append(res)
        need = min(self.cfg.engine.min_clients, len(tasks))
        if len(ok) < need:
            dropped = self._dropped[-len(tasks):]
            reasons = "; ".join(f"client {d['cid']}: {_first_line(d['reason'])}" for d in dropped[:3])
            more = f"; {len(dropped) - 3} more in the same round" if len(dropped) > 3 else ""
            kept = self._kept()
            err = RunError(
                f"round {self.ctx.round}: only {len(ok)} of {len(tasks)} clients succeeded, fewer than "
                f"engine.min_clients={self.cfg.engine.min_clients} ({reasons}{more}). The run stopped; {kept}. "
                "Fix the cause and continue with --resume (engine.min_clients, engine.client_timeout_s and "
                "engine.inject_faults may be changed then with --set)"
            )
            err.detail = next((o.detail for o in outcomes if o.detail), "")  # type: ignore[attr-defined]
            raise err
        return ok

    def _kept(self) -> str:
        """What a run that stops now leaves to ``--resume``."""
        if self._last_checkpoint:
            return f"its checkpoint of round {self._last_checkpoint} is kept"
        return "no round was checkpointed yet, so --resume starts it again from round 0"

    def _check_server_state(self, rnd: int) -> None:
        """Invariant: after a round the server's state is finite. A NaN or an infinity in the
        global model would only show as every client's non-finite upload in the next round, and a
        checkpoint of it could not be resumed; so the run stops here, before it is evaluated or
        saved."""
        names = nonfinite_entries(state_tensors(self.algorithm))
        if names is None:
            return
        hint = type(self.algorithm).divergence_hint
        raise RunError(
            f"round {rnd}: the server's update left non-finite values in {names}: training diverged. "
            f"The run stopped; {self._kept()}. Start it again with a smaller train.lr"
            + (f" or with {hint}" if hint else " (or gradient clipping, train.clip_grad_norm)")
        )

    # ------------------------------------------------------------------ rounds
    def sample_clients(self, rnd: int) -> list[int]:
        """``train.sample_rate`` of the available clients: all clients, or with sessions the
        devices of the round's session."""
        if self.ctx.schedule is not None:
            pool = np.asarray(self.ctx.schedule.devices[self.ctx.schedule.session_of(rnd)], dtype=np.int64)
        else:
            pool = np.arange(self.cfg.data.num_clients)
        k = max(1, int(round(self.cfg.train.sample_rate * len(pool))))
        rng = self.ctx.rng("sample", rnd)
        return sorted(int(c) for c in rng.choice(pool, size=k, replace=False))

    def client_info(self, cid: int, rnd: int) -> ClientInfo:
        tier = self.tiers[cid]
        base_ratio = self.ctx.tier_ratio[tier]
        # a static budget draws nothing: no generator to build (ten per round otherwise)
        rng = self.ctx.rng("budget", rnd, cid) if self.schedule.dynamic else None
        ratio, after = self.schedule.ratios(cid, base_ratio, rnd, self._participation[cid], rng)
        return ClientInfo(
            cid=cid,
            tier=tier,
            ratio=ratio,
            budget_macs=ratio * self.ctx.plain_macs,
            num_samples=int(len(self.data.client_indices[cid])),
            round=rnd,
            budget_after_change=None if after is None else after * self.ctx.plain_macs,
        )

    def _evaluate(self) -> dict[str, Any]:
        models = self.algorithm.eval_models(self.ctx)
        self._one_model = self._deploys_one_model(models)
        res = self.ctx.evaluate(models["global"])
        out: dict[str, Any] = {"accuracy": res["accuracy"], "loss": res["loss"], "tier_accuracy": {}}
        if self.data.val_indices is not None:
            # the validation hold-out (part of the training set no client sees): choose settings on it
            val = self.ctx.evaluate(models["global"], dataset=self.data.train, indices=self.data.val_indices)
            out["val_accuracy"], out["val_loss"] = val["accuracy"], val["loss"]
        if self.ctx.schedule is not None:
            # accuracy on the classes of the session's devices, and on the full test set
            session = self.ctx.schedule.session_of(self.ctx.round)
            part = self.ctx.evaluate(models["global"], indices=self.ctx.session_test_indices(session))
            out["accuracy_full"], out["loss_full"] = res["accuracy"], res["loss"]
            out["accuracy_session"] = part["accuracy"]
            if self.cfg.sessions.eval_on_session_classes:
                out["accuracy"], out["loss"] = part["accuracy"], part["loss"]
        cache: dict[int, float] = {id(models["global"]): res["accuracy"]}
        for t in self.cfg.budget.tiers:
            m = models.get(f"tier:{t.name}", models["global"])
            if id(m) not in cache:
                cache[id(m)] = self.ctx.evaluate(m)["accuracy"]
            out["tier_accuracy"][t.name] = cache[id(m)]
        return out

    def _deploys_one_model(self, models: dict[str, Any] | None = None) -> bool:
        """Whether every tier deploys the global model: the method gives no tier a model of its own
        (``"tier:<name>"`` in ``models``, :meth:`~fedhetero.core.method.algorithm.Algorithm.eval_models`;
        asked for when not given). The result tables show per-tier accuracies only where this is
        false."""
        models = self.algorithm.eval_models(self.ctx) if models is None else models
        one = models["global"]
        return all(models.get(f"tier:{t.name}", one) is one for t in self.cfg.budget.tiers)

    def _checkpoint(self, rnd: int) -> None:
        state = {
            "round": rnd,
            "config_hash": config_hash(self.cfg),
            "algorithm": self.algorithm.state_dict(),
            "participation": list(self._participation),
            "ratios": list(self.schedule.state()),
            "best_accuracy": self._best,
            # what a resume must find on disk: the metrics written so far, each client's state
            "metrics": self._metrics.mark(),
        }
        self.store.flush(rnd)  # every client state the checkpoint can need is on disk before it
        state["client_states"] = self.store.manifest(rnd)
        self._write_best()  # so is the best model of the rounds it covers
        atomic_save(state, self.out_dir / "checkpoint.pt")
        self._last_checkpoint = rnd
        self.store.compact(rnd)

    def _load_checkpoint(self) -> tuple[int, dict[str, Any] | None, dict[Any, Any] | None]:
        """Restore the checkpoint's state; returns its round and what it recorded of the run
        directory (the metrics mark and the client-state manifest; None in older checkpoints)."""
        path = self.out_dir / "checkpoint.pt"
        if not path.is_file():
            return 0, None, None
        try:
            state = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as exc:  # unpickling refused, truncated file, …
            raise RunDirError(f"{path} cannot be loaded ({type(exc).__name__}: {exc}); the checkpoint is damaged") from None
        if not isinstance(state, dict) or not {"round", "config_hash", "algorithm"} <= set(state):
            raise RunDirError(f"{path} is not a fedhetero checkpoint")
        if state["config_hash"] not in self._hashes:
            raise RunDirError(f"--resume: {path} belongs to another run (its config hash differs from config.yaml's)")
        rnd = state["round"]
        if not isinstance(rnd, int) or not 0 <= rnd <= self.cfg.train.rounds:
            raise RunDirError(f"{path}: round {rnd!r} is outside 0..train.rounds={self.cfg.train.rounds}; the checkpoint is damaged")
        bad = _non_finite(state["algorithm"])
        if bad:
            raise RunDirError(f"{path}: non-finite values in {bad}; the checkpoint is damaged")
        try:
            self.algorithm.load_state_dict(state["algorithm"])
            self._participation = [int(v) for v in state["participation"]]
            self.schedule.load_state(state["ratios"])
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            raise RunDirError(f"{path} does not fit this run's model ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
        if len(self._participation) != self.cfg.data.num_clients:
            raise RunDirError(f"{path}: participation counts for {len(self._participation)} clients, the config has {self.cfg.data.num_clients}")
        self._best = state.get("best_accuracy")
        mark, manifest = state.get("metrics"), state.get("client_states")
        if (mark is not None and not isinstance(mark, dict)) or (manifest is not None and not isinstance(manifest, dict)):
            raise RunDirError(f"{path} is not a fedhetero checkpoint")
        self.store.rollback(rnd)
        return rnd, mark, manifest

    def _save_model(self, name: str) -> None:
        """The global model as a weights-only file that :func:`fedhetero.load_model` rebuilds."""
        save_global_model(self.out_dir, self.cfg, self.ctx, self.algorithm, name)

    def _keep_best(self) -> None:
        """Hold the current global model as the best one; written with the next checkpoint (a
        resume restarts from a checkpoint, so the file need not run ahead of it; writing it in the
        round cost as much as a LeNet-5 client's training)."""
        self._best_state = global_model_state(self.algorithm, self.ctx)

    def _write_best(self) -> None:
        if self._best_state is not None:
            save_global_model(self.out_dir, self.cfg, self.ctx, self.algorithm, "best", self._best_state)
            self._best_state = None

    def run(self) -> RunResult:
        """Run (or resume) the job; returns the summary and the per-round metrics.

        The run directory is locked first (two runs never share it), then checked again under
        the lock, then the config, data and algorithm are set up; a bad input leaves behind no
        directory that was not there before."""
        created = _first_missing(self.out_dir)  # what a failed set-up removes again
        lock = None
        ended = False
        try:
            try:
                self.out_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise RunDirError(f"{self.out_dir}: the run directory cannot be made ({exc.strerror or exc})") from None
            lock = RunLock(self.out_dir).acquire()
            self._check_dir()
            if self.resume and config_hash(saved_config(self.out_dir)) not in self._hashes:
                raise RunDirError(f"--resume: {self.out_dir / 'config.yaml'} changed while this run was starting")
            self.setup()
            created = None  # from here on the directory holds this run
            result = self._run()
            ended = True
            return result
        finally:
            if self.backend is not None and self._own_backend:
                self.backend.close()
            self.loggers.close()
            if lock is not None:
                if ended:  # a clean end: nothing holds the directory any more, so no lock file is left
                    lock.path.unlink(missing_ok=True)
                lock.release()
            if created is not None:
                _remove_if_only_lock(self.out_dir, created)

    def _say(self, text: str) -> None:
        if self.progress and self.console is not None:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def _run(self) -> RunResult:
        t_start = time.perf_counter()
        self._dropped: list[dict[str, Any]] = []
        self._seconds: dict[int, float] = {}  # this round's wall time of each client's tasks
        self._best = None
        self._best_state = None
        clean_stale(self.out_dir)
        self._metrics = MetricsLog(self.out_dir / "metrics.jsonl")
        start, mark, manifest = self._load_checkpoint() if self.resume else (0, None, None)
        self._last_checkpoint = start
        if self.resume and (self.out_dir / "config.yaml").read_text() != dump_config(self.cfg):
            # only fields that may change on resume differ: the run goes on with them, and so
            # does a later resume
            atomic_write_text(self.out_dir / "config.yaml", dump_config(self.cfg))
        if start > 0:
            changed = changed_options(self.out_dir, self.cfg, self.algorithm.options)
            if changed:
                raise RunDirError(
                    f"--resume: this run was made with {', '.join(f'{OPTIONS_PATH}.{k}={v!r}' for k, v, _ in changed)}, "
                    f"which the method's defaults no longer give (now {', '.join(repr(n) for _, _, n in changed)}), so it "
                    "cannot continue exactly; start it again with --overwrite, or continue it with the fedhetero "
                    "version that made it"
                )
            history = self._metrics.resume(mark, start)
            if manifest is not None:
                self.store.verify(manifest, start)
            self._say(f"resumed from round {start} of {self.cfg.train.rounds} ({self.out_dir})")
        else:
            if self.resume:
                self._say(f"{self.out_dir}: no checkpoint yet; starting again from round 0")
                self.store.rollback(0)
            else:
                clear_run(self.out_dir)  # _check_dir allowed it: a run's own files only (--overwrite)
            history = []
            self._metrics.start()
            self._write_run_files()
        prior_wall = float(sum(r.get("wall_s", 0.0) for r in history))
        self.loggers.start(start, history)  # rounds 1..start as metrics.jsonl holds them
        rounds = self.cfg.train.rounds
        progress = RoundProgress(self.progress, rounds, start, self.console)
        with progress:
            for rnd in range(start + 1, rounds + 1):
                t0 = time.perf_counter()
                self.ctx.round = rnd
                self.ctx.timers = {}
                row: dict[str, Any] = {"round": rnd}
                sched = self.ctx.schedule
                if sched is not None:
                    row["session"] = sched.session_of(rnd) + 1
                    row["session_round"] = sched.round_in_session(rnd)
                self._dropped = []
                self._seconds = {}
                if sched is not None and sched.round_in_session(rnd) == 1:
                    self._drive(self.algorithm.session_start(self.ctx, sched.session_of(rnd)))
                skip = self.algorithm.skip_round(self.ctx, rnd)
                if skip:  # e.g. a baseline that does not run DynInit's pilot session
                    row["skipped"] = True
                    clients: list[ClientInfo] = []
                    updates: list[ClientResult] = []
                else:
                    cids = self.sample_clients(rnd)
                    clients = [self.client_info(c, rnd) for c in cids]
                    for c in cids:
                        self._participation[c] += 1
                    progress.round_started(rnd, len(clients))
                    self.ctx.on_client_done = progress.client_done
                    updates = self._round(clients)
                    self._check_server_state(rnd)
                row["dropped"] = list(self._dropped)
                row.update(self.algorithm.round_metrics(self.ctx))
                if not skip and (rnd % self.cfg.train.eval_every == 0 or rnd == rounds):
                    with self.ctx.timer("evaluate"):
                        row.update(self._evaluate())
                account_round(row, clients, updates, self.cfg.train, history[-1] if history else None, self._seconds)
                row["timers"] = {k: round(v, 6) for k, v in self.ctx.timers.items()}
                if "accuracy" in row and (self._best is None or row["accuracy"] > self._best):
                    self._best = float(row["accuracy"])
                    self._keep_best()
                row["wall_s"] = round(time.perf_counter() - t0, 4)
                self._metrics.append(row)
                self.loggers.log_round(row)
                history.append(row)
                progress.round_done(row)
                if rnd % self.cfg.train.checkpoint_every == 0 or rnd == rounds:
                    self._checkpoint(rnd)
                if self.stop_after is not None and rnd >= self.stop_after:
                    return RunResult(self.out_dir, {}, history)
        self._save_model("final")
        # wall time of every segment's rounds plus this segment's set-up and wrap-up
        wall = prior_wall + (time.perf_counter() - t_start)
        summary = summarize(self.cfg, history, self.ctx.plain_macs, wall)
        summary["resumed_from_round"] = start if self.resume else None
        summary["one_model"] = self._one_model if self._one_model is not None else self._deploys_one_model()
        summary.update(self.algorithm.summary_metrics(history))
        atomic_write_text(self.out_dir / "summary.json", json.dumps(finite_json(summary), indent=2))
        self.loggers.log_summary(summary)
        return RunResult(self.out_dir, summary, history)


def check_splits(cfg: RunConfig, cls: type[Algorithm], allow_unused: bool = False) -> None:
    """A server or public split the method does not use only withholds data from the clients; one
    it needs must exist."""
    name = cfg.algorithm.name
    for field_name, need, what in (
        ("server_fraction", cls.server_data, "labelled server data"),
        ("public_fraction", cls.public_data, "an unlabelled public split"),
    ):
        value = getattr(cfg.data, field_name)
        if need == "unused" and value > 0 and not allow_unused:
            raise ConfigError(
                f"data.{field_name}: {name} does not use {what}; {value:g} of the training set would be "
                f"withheld from its clients. Set data.{field_name}=0"
            )
        if need == "required" and value <= 0:
            raise ConfigError(f"data.{field_name}: {name} needs {what}; set data.{field_name} > 0 (e.g. 0.1)")


def _first_line(text: str) -> str:
    return str(text).strip().splitlines()[0] if str(text).strip() else ""


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of ``path`` that does not exist yet (None: ``path`` exists)."""
    missing = None
    for p in [path, *path.parents]:
        if p.exists():
            break
        missing = p
    return missing


def _remove_if_only_lock(root: Path, created: Path) -> None:
    """Remove the directory this run made (and the folders made for it, up to ``created``) when
    nothing but its lock file is in it."""
    try:
        if [p.name for p in root.iterdir()] != [".lock"]:
            return
        (root / ".lock").unlink()
        for p in [root, *root.parents]:
            p.rmdir()
            if p == created:
                break
    except OSError:
        pass


def _non_finite(tree: Any, prefix: str = "") -> str | None:
    """The first path in a nested state whose floating tensor or float is not finite."""
    if isinstance(tree, torch.Tensor):
        if torch.is_floating_point(tree) and not bool(torch.isfinite(tree).all()):
            return prefix or "a tensor"
        return None
    if isinstance(tree, float):
        return None if tree == tree and abs(tree) != float("inf") else (prefix or "a number")
    if isinstance(tree, dict):
        for k, v in tree.items():
            hit = _non_finite(v, f"{prefix}.{k}" if prefix else str(k))
            if hit:
                return hit
    if isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            hit = _non_finite(v, f"{prefix}[{i}]")
            if hit:
                return hit
    return None


def strict_mode() -> bool:
    """Whether an internal error stops the run (``FEDHETERO_STRICT=1``; the test suite sets it,
    so that a test fails on any exception from the project's own code instead of a dropped client)."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def run(cfg: RunConfig, out_dir: str | Path, **kw: Any) -> RunResult:
    """Convenience: ``Engine(cfg, out_dir, **kw).run()``."""
    return Engine(cfg, out_dir, **kw).run()

