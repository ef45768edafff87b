"""The in-process federated round loop.

:class:`Engine` owns everything that is the same for every method: data and partitions, device
tiers and budgets, client sampling, the shared local trainer, evaluation, metrics, checkpoints and
resume. Algorithms (:mod:`fedhetero.algorithms`) see only a :class:`Context`.

Guarantees:

* **Seeds per concern.** One master seed derives an independent generator per concern
  (partitioning, tiers, sampling, budgets, model init, each client's data order, …) through
  ``numpy.random.SeedSequence(seed, spawn_key=(concern, *keys))``. Same config and seed give the
  same numbers; nothing depends on global RNG state carried across rounds.
* **Resumable.** The run directory holds ``config.yaml`` (resolved) with its hash,
  ``metrics.jsonl`` (one object per round), ``checkpoint.pt`` (written atomically) and
  ``summary.json``. A run killed at any point and resumed with ``resume=True`` ends with exactly the
  numbers of an uninterrupted run: client state lives in a versioned on-disk store that is rolled
  back to the checkpoint's round.
* **Memory bounded by the sampled clients**: per-client state goes to the store on disk.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedhetero import budget as budget_mod
from fedhetero.algorithms import get_algorithm
from fedhetero.algorithms.base import Algorithm, ClientInfo, ClientUpdate
from fedhetero.config import (
    ConfigError,
    RunConfig,
    _from_mapping,
    config_hash,
    dump_config,
    load_config,
)
from fedhetero.data import build_federated_data, iterate_batches, save_partition
from fedhetero.store import ClientStateStore, atomic_save
from fedhetero.timemodel import ClientCost, TimeModel, smoothed_final_accuracy
from reparam.allocator import tune_malloc

_TIME_MODEL = TimeModel()

__all__ = ["Context", "Engine", "RunResult", "build_algorithm", "run"]

# Stable ids of the random concerns (never reorder: they define the streams).
_CONCERNS = {
    "partition": 1,
    "tiers": 2,
    "sample": 3,
    "budget": 4,
    "init": 5,
    "data": 6,
    "client": 7,
    "server": 8,
    "algorithm": 9,
    "eval": 10,
}


def build_algorithm(cfg: RunConfig) -> Algorithm:
    """Instantiate the configured algorithm with validated options."""
    cls = get_algorithm(cfg.algorithm.name)
    options = _from_mapping(cls.Options, dict(cfg.algorithm.options), "algorithm.options")
    return cls(options)


@dataclass
class RunResult:
    out_dir: Path
    summary: dict[str, Any]
    metrics: list[dict[str, Any]] = field(default_factory=list)


class Context:
    """What an algorithm may use: config, data, budgets, RNG streams, trainer, evaluator, store."""

    def __init__(self, cfg: RunConfig, data: Any, store: ClientStateStore, device: torch.device) -> None:
        self.cfg = cfg
        self.data = data
        self.store = store
        self.device = device
        self.round = 0
        self.input_shape: tuple[int, int, int] = tuple(int(s) for s in data.input_shape)  # type: ignore[assignment]
        self.num_classes = int(data.num_classes)
        self.dtype = getattr(torch, cfg.dtype)
        self.current_client: ClientInfo | None = None
        self.on_client_done: Callable[[int], None] | None = None
        self.timers: dict[str, float] = {}
        self._macs_cache: dict[Any, int] = {}
        self._width_planner: Any = None
        with self.seeded("init", 0):
            self.plain_macs = self.macs(self.build_model())
        self.tier_ratio = {t.name: t.ratio for t in cfg.budget.tiers}

    # ------------------------------------------------------------------ randomness
    def seed_sequence(self, concern: str, *keys: int) -> np.random.SeedSequence:
        if concern not in _CONCERNS:
            raise ValueError(f"unknown random concern {concern!r}")
        return np.random.SeedSequence(
            self.cfg.seed, spawn_key=(_CONCERNS[concern], *(int(k) for k in keys))
        )

    def rng(self, concern: str, *keys: int) -> np.random.Generator:
        """Independent numpy generator for one concern (and e.g. round, client)."""
        return np.random.default_rng(self.seed_sequence(concern, *keys))

    def torch_generator(self, concern: str, *keys: int) -> torch.Generator:
        seed = int(self.seed_sequence(concern, *keys).generate_state(1, dtype=np.uint64)[0] >> 1)
        return torch.Generator().manual_seed(seed)

    @contextlib.contextmanager
    def seeded(self, concern: str, *keys: int) -> Iterator[None]:
        """Seed torch's global RNG (used by module initialisers) for the duration of a block."""
        state = torch.get_rng_state()
        seed = int(self.seed_sequence(concern, *keys).generate_state(1, dtype=np.uint64)[0] >> 1)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def client_scope(self, client: ClientInfo) -> Iterator[None]:
        """Everything a client does in a round runs with RNG derived from (round, client).

        Torch's default CPU generator is re-seeded on entry (module initialisers of new branches
        draw from it), so a client's work never depends on what ran before it."""
        self.current_client = client
        seed = int(self.seed_sequence("client", self.round, client.cid).generate_state(1, dtype=np.uint64)[0] >> 1)
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        try:
            yield
        finally:
            self.current_client = None
        if self.on_client_done is not None:
            self.on_client_done(client.cid)

    @contextlib.contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Accumulate wall time under ``name`` (reported per round in the metrics)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timers[name] = self.timers.get(name, 0.0) + time.perf_counter() - t0

    # ------------------------------------------------------------------ models & budgets
    def build_model(self, width: float | None = None, **overrides: Any) -> nn.Module:
        """A fresh model of the configured architecture (optionally another width)."""
        from models import build_model

        kw: dict[str, Any] = dict(
            num_classes=self.num_classes,
            in_channels=self.input_shape[0],
            width=self.cfg.model.width if width is None else width,
            norm=self.cfg.model.norm,
            input_size=self.input_shape[1],
        )
        kw.update(overrides)
        return build_model(self.cfg.model.name, **kw).to(device=self.device, dtype=self.dtype)

    def macs(self, model: nn.Module) -> int:
        """Forward MACs per sample (conv + linear; BN, activations and pooling excluded).

        Cached by the model's structure (class, module paths and parameter shapes), so clients
        training the same architecture cost one counting pass."""
        key = (type(model).__name__,) + tuple(
            (path, type(m).__name__, tuple(getattr(m, "weight").shape) if isinstance(getattr(m, "weight", None), torch.Tensor) else ())
            for path, m in model.named_modules()
        )
        hit = self._macs_cache.get(key)
        if hit is None:
            if len(self._macs_cache) > 4096:
                self._macs_cache.clear()
            hit = self._macs_cache[key] = int(budget_mod.macs(model, self.input_shape))
        return hit

    def width_for_budget(self, budget_macs: float) -> float:
        """Largest width (multiples of 1/16 of the configured width, above 1× too) whose model's
        measured MACs fit ``budget_macs``; ``ValueError`` when even the narrowest does not fit."""
        if self._width_planner is None:
            from fedhetero.algorithms._widths import WidthPlanner

            self._width_planner = WidthPlanner(self)
        return self._width_planner.width_for(budget_macs)

    def min_budget_macs(self) -> float:
        return min(t.ratio for t in self.cfg.budget.tiers) * self.plain_macs

    def max_budget_macs(self) -> float:
        return max(t.ratio for t in self.cfg.budget.tiers) * self.plain_macs

    # ------------------------------------------------------------------ training
    def make_optimizer(self, model: nn.Module, lr: float | None = None) -> torch.optim.Optimizer:
        t = self.cfg.train
        return torch.optim.SGD(
            [p for p in model.parameters() if p.requires_grad],
            lr=t.lr if lr is None else lr,
            momentum=t.momentum,
            weight_decay=t.weight_decay,
        )

    def client_batches(self, cid: int, epoch: int, batch_size: int | None = None):
        """The client's shuffled batches for one local epoch (order from (round, client, epoch))."""
        gen = self.torch_generator("data", self.round, cid, epoch)
        return iterate_batches(
            self.data.train,
            self.data.client_indices[cid],
            batch_size or self.cfg.train.batch_size,
            generator=gen,
            shuffle=True,
            augment=self.cfg.data.augment,
        )

    def train(
        self,
        model: nn.Module,
        client: ClientInfo,
        epochs: int,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        after_backward: Callable[[nn.Module], None] | None = None,
        on_epoch_end: Callable[[int, nn.Module, torch.optim.Optimizer], Any] | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        first_epoch: int = 0,
    ) -> dict[str, Any]:
        """Local SGD: ``epochs`` passes over the client's data.

        ``after_backward(model)`` runs after every backward and before the optimizer step (saliency
        meters hook in here); ``on_epoch_end(epoch, model, optimizer)`` runs after each epoch and may
        return a new optimizer (after a structure change). ``first_epoch`` numbers the epochs for
        the data order when one local round is split over several calls.
        """
        model.train()
        opt = optimizer if optimizer is not None else self.make_optimizer(model)
        loss_fn = loss_fn or F.cross_entropy
        losses: list[torch.Tensor] = []
        sizes: list[int] = []
        steps = 0
        for e in range(first_epoch, first_epoch + epochs):
            losses, sizes = [], []
            for x, y in self.client_batches(client.cid, e):
                x = x.to(self.device, self.dtype, non_blocking=True)
                y = y.to(self.device, non_blocking=True)
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model(x), y)
                loss.backward()
                if after_backward is not None:
                    after_backward(model)
                opt.step()
                losses.append(loss.detach())
                sizes.append(int(y.shape[0]))
                steps += 1
            if on_epoch_end is not None:
                new_opt = on_epoch_end(e, model, opt)
                if isinstance(new_opt, torch.optim.Optimizer):
                    opt = new_opt
        seen = sum(sizes)
        mean_loss = float(sum(float(l) * n for l, n in zip(losses, sizes)) / seen) if seen else float("nan")
        return {"loss": mean_loss, "steps": steps, "optimizer": opt}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, dataset: Any = None, indices: Any = None) -> dict[str, float]:
        """Accuracy and mean loss of ``model`` (eval mode) on the test set or a given dataset."""
        ds = self.data.test if dataset is None else dataset
        idx = np.arange(len(ds.labels)) if indices is None else indices
        was_training = model.training
        model.eval()
        correct = 0
        loss = 0.0
        n = 0
        for x, y in iterate_batches(ds, idx, self.cfg.train.eval_batch_size, shuffle=False):
            x = x.to(self.device, self.dtype)
            y = y.to(self.device)
            out = model(x)
            loss += float(F.cross_entropy(out, y, reduction="sum"))
            correct += int((out.argmax(1) == y).sum())
            n += int(y.shape[0])
        model.train(was_training)
        return {"accuracy": correct / max(n, 1), "loss": loss / max(n, 1)}

    def aggregation_weights(self, updates: list[ClientUpdate]) -> list[float]:
        if self.cfg.train.aggregation == "uniform":
            return [1.0] * len(updates)
        return [float(u.num_samples) for u in updates]


class Engine:
    """Runs one configured federated training job in a run directory."""

    def __init__(
        self,
        cfg: RunConfig,
        out_dir: str | Path,
        *,
        resume: bool = False,
        progress: bool = True,
        console: Any = None,
        stop_after: int | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.resume = resume
        self.progress = progress
        self.console = console
        self.stop_after = stop_after  # for tests: stop (as if killed) after this round
        if resume:
            cfg_path = self.out_dir / "config.yaml"
            if not cfg_path.is_file():
                raise ConfigError(f"--resume: no config.yaml in {self.out_dir}; is this a run directory?")
            saved = load_config(cfg_path)
            if cfg is not None and config_hash(cfg) != config_hash(saved):
                raise ConfigError(
                    f"--resume: the given config differs from the one saved in {cfg_path}; "
                    "resume without --config/--set to continue that run"
                )
            cfg = saved
        self.cfg = cfg

    # ------------------------------------------------------------------ set-up
    def _setup(self) -> None:
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
        self.out_dir.mkdir(parents=True, exist_ok=True)
        seq = np.random.SeedSequence(cfg.seed, spawn_key=(_CONCERNS["partition"],))
        d = cfg.data
        options = None
        if d.dataset == "synthetic":
            options = {"num_samples": d.synthetic_size, "num_test": max(d.synthetic_size // 4, 10)}
        self.data = build_federated_data(
            d.dataset,
            data_dir=d.data_dir,
            num_clients=d.num_clients,
            partition=d.partition,
            alpha=d.alpha,
            shards=d.shards_per_client,
            server_fraction=d.server_fraction,
            server_classes=None if d.server_classes >= 1.0 else d.server_classes,
            public_fraction=d.public_fraction,
            rng=np.random.default_rng(seq),
            min_size=d.min_partition_size,
            dataset_options=options,
        )
        self.store = ClientStateStore(self.out_dir / "client_state")
        self.ctx = Context(cfg, self.data, self.store, device)
        self.algorithm = build_algorithm(cfg)
        with self.ctx.seeded("init", 1):
            self.algorithm.setup(self.ctx)
        n = cfg.data.num_clients
        self.tiers = budget_mod.assign_tiers(n, cfg.budget.tiers, self.ctx.rng("tiers"))
        self.schedule = budget_mod.BudgetSchedule(
            scenario=cfg.budget.scenario,
            change=cfg.budget.change,
            min_ratio=cfg.budget.min_ratio,
            max_ratio=cfg.budget.max_ratio,
        )

    def _write_run_files(self) -> None:
        (self.out_dir / "config.yaml").write_text(dump_config(self.cfg))
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
        meta["data"] = self.data.summary()
        (self.out_dir / "run.json").write_text(json.dumps(meta, indent=2, default=str))
        save_partition(self.data, self.out_dir / "partition.npz")

    # ------------------------------------------------------------------ rounds
    def sample_clients(self, rnd: int) -> list[int]:
        n = self.cfg.data.num_clients
        k = max(1, int(round(self.cfg.train.sample_rate * n)))
        rng = self.ctx.rng("sample", rnd)
        return sorted(int(c) for c in rng.choice(np.arange(n), size=k, replace=False))

    def client_info(self, cid: int, rnd: int) -> ClientInfo:
        tier = self.tiers[cid]
        base_ratio = self.ctx.tier_ratio[tier]
        ratio, after = self.schedule.ratios(cid, base_ratio, rnd, self._participation[cid], self.ctx.rng("budget", rnd, cid))
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
        res = self.ctx.evaluate(models["global"])
        out: dict[str, Any] = {"accuracy": res["accuracy"], "loss": res["loss"], "tier_accuracy": {}}
        cache: dict[int, float] = {id(models["global"]): res["accuracy"]}
        for t in self.cfg.budget.tiers:
            m = models.get(f"tier:{t.name}", models["global"])
            if id(m) not in cache:
                cache[id(m)] = self.ctx.evaluate(m)["accuracy"]
            out["tier_accuracy"][t.name] = cache[id(m)]
        return out

    def _checkpoint(self, rnd: int) -> None:
        state = {
            "round": rnd,
            "config_hash": config_hash(self.cfg),
            "algorithm": self.algorithm.state_dict(),
            "participation": list(self._participation),
            "ratios": list(self.schedule.state()),
        }
        atomic_save(state, self.out_dir / "checkpoint.pt")
        self.store.compact(rnd)

    def _load_checkpoint(self) -> int:
        path = self.out_dir / "checkpoint.pt"
        if not path.is_file():
            return 0
        state = torch.load(path, weights_only=True, map_location="cpu")
        if state["config_hash"] != config_hash(self.cfg):
            raise ConfigError(f"--resume: checkpoint {path} belongs to a different config")
        self.algorithm.load_state_dict(state["algorithm"])
        self._participation = list(state["participation"])
        self.schedule.load_state(state["ratios"])
        rnd = int(state["round"])
        self.store.rollback(rnd)
        return rnd

    def _read_metrics(self, upto: int) -> list[dict[str, Any]]:
        path = self.out_dir / "metrics.jsonl"
        rows: list[dict[str, Any]] = []
        if path.is_file():
            for line in path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    if row["round"] <= upto:
                        rows.append(row)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return rows

    def run(self) -> RunResult:
        """Run (or resume) the job; returns the summary and the per-round metrics."""
        t_start = time.perf_counter()
        self._setup()
        self._participation = [0] * self.cfg.data.num_clients
        start = 0
        if self.resume:
            start = self._load_checkpoint()
            history = self._read_metrics(start)
        else:
            for stale in ("metrics.jsonl", "checkpoint.pt", "summary.json"):
                (self.out_dir / stale).unlink(missing_ok=True)
            self.store.rollback(-1)
            history = []
            self._write_run_files()
        cum_bytes = sum(r["bytes_up"] + r["bytes_down"] for r in history)
        metrics_path = self.out_dir / "metrics.jsonl"
        rounds = self.cfg.train.rounds
        progress = _Progress(self.progress, rounds, start, self.console)
        with progress:
            for rnd in range(start + 1, rounds + 1):
                t0 = time.perf_counter()
                self.ctx.round = rnd
                self.ctx.timers = {}
                cids = self.sample_clients(rnd)
                clients = [self.client_info(c, rnd) for c in cids]
                for c in cids:
                    self._participation[c] += 1
                progress.round_started(rnd, len(clients))
                self.ctx.on_client_done = progress.client_done
                updates = self.algorithm.run_round(self.ctx, clients)
                row: dict[str, Any] = {"round": rnd}
                if rnd % self.cfg.train.eval_every == 0 or rnd == rounds:
                    row.update(self._evaluate())
                by_cid = {c.cid: c for c in clients}
                row["clients"] = [
                    {
                        "cid": u.cid,
                        "tier": u.tier or by_cid[u.cid].tier,
                        "budget_macs": float(u.budget_macs),
                        "macs": int(u.macs),
                        "fits_budget": bool(u.macs <= u.budget_macs * (1 + 1e-9)),
                        "bytes_up": int(u.bytes_up),
                        "bytes_down": int(u.bytes_down),
                        "num_samples": int(u.num_samples),
                        **{k: v for k, v in u.metrics.items() if _jsonable(v)},
                    }
                    for u in updates
                ]
                row["sim_s"] = _TIME_MODEL.round_seconds(
                    ClientCost(
                        macs_per_sample=float(u.macs),
                        sample_passes=float(u.num_samples * self.cfg.train.local_epochs),
                        bytes_up=float(u.bytes_up),
                        bytes_down=float(u.bytes_down),
                    )
                    for u in updates
                )
                row["sim_time_s"] = (history[-1]["sim_time_s"] if history else 0.0) + row["sim_s"]
                row["bytes_up"] = int(sum(u.bytes_up for u in updates))
                row["bytes_down"] = int(sum(u.bytes_down for u in updates))
                cum_bytes += row["bytes_up"] + row["bytes_down"]
                row["bytes_total"] = int(cum_bytes)
                row["timers"] = {k: round(v, 6) for k, v in self.ctx.timers.items()}
                row["wall_s"] = round(time.perf_counter() - t0, 4)
                with metrics_path.open("a") as fh:
                    fh.write(json.dumps(row) + "\n")
                history.append(row)
                progress.round_done(row)
                if rnd % self.cfg.train.checkpoint_every == 0 or rnd == rounds:
                    self._checkpoint(rnd)
                if self.stop_after is not None and rnd >= self.stop_after:
                    return RunResult(self.out_dir, {}, history)
        summary = summarize(self.cfg, history, self.ctx.plain_macs, time.perf_counter() - t_start)
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return RunResult(self.out_dir, summary, history)


def _jsonable(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool)) or v is None


def summarize(cfg: RunConfig, history: list[dict[str, Any]], plain_macs: int, wall: float) -> dict[str, Any]:
    """Final numbers of a run: accuracy (final, best, smoothed), per-tier budgets and FLOPs, bytes."""
    evals = [r for r in history if "accuracy" in r]
    accs = [r["accuracy"] for r in evals]
    tiers: dict[str, dict[str, Any]] = {}
    for t in cfg.budget.tiers:
        rows = [c for r in history for c in r["clients"] if c["tier"] == t.name]
        tiers[t.name] = {
            "ratio": t.ratio,
            "budget_macs": float(np.mean([c["budget_macs"] for c in rows])) if rows else t.ratio * plain_macs,
            "macs": float(np.mean([c["macs"] for c in rows])) if rows else None,
            "fits_budget": bool(all(c["fits_budget"] for c in rows)) if rows else None,
            "client_rounds": len(rows),
            "accuracy": evals[-1]["tier_accuracy"].get(t.name) if evals else None,
        }
    k = min(5, len(accs))
    target = cfg.train.target_accuracy
    reached = None
    if target is not None and evals:
        hit = [r for r in evals if r["accuracy"] >= target]
        reached = hit[0] if hit else None
    smoothed = None
    if len(accs) >= 5:
        window = min(39, len(accs) if len(accs) % 2 else len(accs) - 1)
        smoothed = float(smoothed_final_accuracy(accs, window=window, polyorder=min(3, window - 1)))
    return {
        "algorithm": cfg.algorithm.name,
        "rounds": len(history),
        "final_accuracy": accs[-1] if accs else None,
        "best_accuracy": max(accs) if accs else None,
        "mean_last5_accuracy": float(np.mean(accs[-k:])) if accs else None,
        "plain_macs": plain_macs,
        "tiers": tiers,
        "smoothed_final_accuracy": smoothed,
        "target_accuracy": target,
        "rounds_to_target": reached["round"] if reached else None,
        "time_to_target": reached["sim_time_s"] if reached else None,
        "sim_time_s": history[-1]["sim_time_s"] if history else 0.0,
        "mean_client_macs": float(np.mean([c["macs"] for r in history for c in r["clients"]])) if history else None,
        "bytes_total": history[-1]["bytes_total"] if history else 0,
        "all_fit_budget": bool(all(c["fits_budget"] for r in history for c in r["clients"])),
        "wall_s": round(wall, 3),
    }


class _Progress:
    """rich progress over rounds and clients (silent when disabled)."""

    def __init__(self, enabled: bool, rounds: int, start: int, console: Any) -> None:
        self.enabled = enabled
        self.rounds = rounds
        self.start = start
        self.console = console
        self._progress = None

    def __enter__(self) -> "_Progress":
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._progress.__enter__()
            self._rounds_task = self._progress.add_task("rounds", total=self.rounds, completed=self.start, info="")
            self._client_task = self._progress.add_task("clients", total=1, info="")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def round_started(self, rnd: int, n_clients: int) -> None:
        if self._progress is not None:
            self._progress.reset(self._client_task, total=n_clients, info=f"round {rnd}")

    def client_done(self, cid: int) -> None:
        if self._progress is not None:
            self._progress.advance(self._client_task)

    def round_done(self, row: dict[str, Any]) -> None:
        if self._progress is not None:
            info = f"acc {row['accuracy']:.3f}" if "accuracy" in row else ""
            self._progress.update(self._rounds_task, advance=1, info=info)


def run(cfg: RunConfig, out_dir: str | Path, **kw: Any) -> RunResult:
    """Convenience: ``Engine(cfg, out_dir, **kw).run()``."""
    return Engine(cfg, out_dir, **kw).run()

