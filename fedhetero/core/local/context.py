"""What an algorithm's two halves may use.

:class:`ClientContext` is everything the client half of an algorithm needs and nothing of the
server's: the config, the data set (a client reads only its own partition through it), the model
builder, the MAC counter, the shared local trainer and RNG streams derived from the master seed.
A worker process or a Flower node builds its own from the config alone (:func:`client_context`).

:class:`Context` (the server's) adds the client-state store and evaluation of global models
through the back end. Client tasks go to the back end as data: a method's round yields them and
the engine runs them (:data:`~fedhetero.core.method.algorithm.Exchanges`).

Seeds per concern: one master seed derives an independent generator per concern (partitioning,
tiers, sampling, budgets, model init, each client's data order, …) through
``numpy.random.SeedSequence(seed, spawn_key=(concern, *keys))``, so the same config and seed give
the same numbers wherever a client runs.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedhetero.core.hetero import budget as budget_mod
from fedhetero.core.common.config import RunConfig
from fedhetero.core.common.options import ConfigError
from fedhetero.core.local.trainer import LocalTrainer
from fedhetero.core.hetero.sessions import Schedule
from fedhetero.core.exchange.types import CONCERNS, derive_seed
from fedhetero.core.hetero.widths import WidthPlanner
from fedhetero.data import build_federated_data, iterate_batches
from fedhetero.models import build_model

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.objective import LocalSGD
    from fedhetero.core.exchange.store import ClientStateStore
    from fedhetero.core.exchange.types import ClientInfo, ClientResult

__all__ = [
    "ClientContext",
    "Context",
    "RunContext",
    "RunError",
    "build_data",
    "client_context",
    "combine_batch_stats",
]


class RunError(RuntimeError):
    """A run cannot go on (e.g. too few clients survived a round); the message says why."""


def build_data(cfg: RunConfig) -> Any:
    """The run's federated data set: the same partition wherever it is built (seeded)."""
    seq = np.random.SeedSequence(cfg.seed, spawn_key=(CONCERNS["partition"],))
    d = cfg.data
    options = None
    if d.dataset == "synthetic":
        options = {"num_samples": d.synthetic_size, "num_test": max(d.synthetic_size // 4, 10)}
    return build_federated_data(
        d.dataset,
        data_dir=d.data_dir,
        download=d.download,
        num_clients=d.num_clients,
        partition=d.partition,
        alpha=d.alpha,
        group_overlap=d.group_overlap,
        shards=d.shards_per_client,
        classes_per_client=d.shards_per_client,  # pathological's K, as kshards' (shards per client)
        server_fraction=d.server_fraction,
        server_classes=None if d.server_classes >= 1.0 else d.server_classes,
        public_fraction=d.public_fraction,
        val_fraction=d.val_fraction,
        rng=np.random.default_rng(seq),
        min_size=d.min_partition_size,
        dataset_options=options,
    )


#: (file, model) pairs whose partial ``model.weights`` load this process has reported.
_PARTIAL_REPORTED: set[tuple[str, str]] = set()


def _one_line(exc: BaseException) -> str:
    """``exc`` as a short phrase: its type and the first line of its message (PyTorch's weights-only
    refusal: the line that names what was refused)."""
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    picked = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("WeightsUnpickler error:")), None)
    first = picked if picked is not None else (lines[0] if lines else "")
    first = first.split(". ", 1)[0]  # the first sentence
    first = first if len(first) <= 160 else first[:157] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _some_keys(keys: Any, n: int = 3) -> str:
    """The first ``n`` of ``keys`` quoted, with how many more there are."""
    names = list(keys)
    shown = ", ".join(repr(str(k)) for k in names[:n]) or "none"
    return shown + (f" (+{len(names) - n} more)" if len(names) > n else "")


def _read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The tensors of the state-dict file ``path`` (a plain state dict, or a checkpoint dict with one
    under ``state_dict``), loaded weights-only; anything else is one :class:`ConfigError` line."""
    def foreign(why: str) -> ConfigError:
        return ConfigError(
            f"model.weights: {path} is not a PyTorch state-dict file ({why}); such a file is written by "
            f"torch.save(model.state_dict(), path)"
        )

    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
        # torch.save writes a zip archive ("PK"); files of PyTorch < 1.6 are pickles (0x80: protocol 2+)
        if head[:2] != b"PK" and head[:1] != b"\x80":
            raise foreign("the file is empty" if not head else f"neither a zip archive nor a pickle: it starts with {head!r}")
        state = torch.load(path, weights_only=True, map_location="cpu")
    except OSError as exc:
        raise ConfigError(f"model.weights: cannot read {path} ({_one_line(exc)})") from None
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch.load fails with anything on a foreign file
        raise foreign(_one_line(exc)) from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not state:
        kind = "an empty dict" if isinstance(state, dict) else f"a {type(state).__name__}"
        raise ConfigError(
            f"model.weights: {path} is not a PyTorch state-dict file: it holds {kind}, not a dict of "
            f"named tensors"
        )
    bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise ConfigError(
            f"model.weights: {path} is not a PyTorch state-dict file: entry {str(bad[0])!r} is a "
            f"{type(state[bad[0]]).__name__}, not a tensor"
        )
    return state


def client_context(cfg: RunConfig, data: Any | None = None) -> "ClientContext":
    """A client-side context built from the config alone (worker processes, Flower nodes)."""
    return ClientContext(cfg, build_data(cfg) if data is None else data, torch.device(cfg.device))


class RunContext:
    """What both halves of a method may use: config, data, model builder, MAC counter, widths,
    the learning-rate schedule, evaluation and RNG streams. :attr:`cache` keeps things that depend
    on the architecture only (model templates, plans) between the tasks one process runs."""

    def __init__(self, cfg: RunConfig, data: Any, device: torch.device) -> None:
        self.cfg = cfg
        self.data = data
        self.device = device
        self.cache: dict[Any, Any] = {}
        #: True while several clients' client halves are alive at once (segments advanced in
        #: lockstep, :func:`fedhetero.core.local.segments.train_segments`): :meth:`reusable` then
        #: hands each call a copy of its own
        self.overlapping_clients = False
        self.round = 0
        self.input_shape: tuple[int, int, int] = tuple(int(s) for s in data.input_shape)  # type: ignore[assignment]
        self.num_classes = int(data.num_classes)
        self.dtype = getattr(torch, cfg.dtype)
        self.current_client: "ClientInfo | None" = None
        self.timers: dict[str, float] = {}
        self._macs_cache: dict[Any, int] = {}
        self._width_planner: Any = None
        with self.seeded("init", 0):
            self.plain_macs = self.macs(self.build_model())
        self.tier_ratio = {t.name: t.ratio for t in cfg.budget.tiers}
        self.lr_override: float | None = None  # server side: the rate of an exchange run now
        self.schedule: Any = None  # fedhetero.core.hetero.sessions.Schedule when sessions are configured
        if cfg.sessions.count:
            self.schedule = Schedule.from_config(
                cfg.sessions.count, cfg.sessions.rounds, len(data.client_indices), cfg.sessions.schedule,
                cfg.sessions.devices,
            )

    # ------------------------------------------------------------------ randomness
    def seed_sequence(self, concern: str, *keys: int) -> np.random.SeedSequence:
        if concern not in CONCERNS:
            raise ValueError(f"unknown random concern {concern!r}")
        return np.random.SeedSequence(
            self.cfg.seed, spawn_key=(CONCERNS[concern], *(int(k) for k in keys))
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

    def _cached_model(self, key: Any, make: Callable[[], nn.Module]) -> nn.Module:
        hit = self.cache.get(("template", key))
        if hit is None:
            state = torch.get_rng_state()
            try:
                hit = self.cache[("template", key)] = make()
            finally:
                torch.set_rng_state(state)
        return hit

    def template(self, key: Any, make: Callable[[], nn.Module]) -> nn.Module:
        """A private copy of a cached model template (built once per process by ``make``, with
        torch's RNG state left as it was, so caching never changes a client's random draws)."""
        return copy.deepcopy(self._cached_model(key, make))

    def reusable(self, key: Any, make: Callable[[], nn.Module]) -> nn.Module:
        """The one cached instance for ``key`` in this process, for a client that loads every
        parameter and buffer into it and changes no structure. It is handed to the next task in
        this process too: clone what must outlive the task (uploads). While several clients'
        code is alive at once (:attr:`overlapping_clients`: their segments advanced together),
        each call gets a copy of its own instead."""
        if self.overlapping_clients:  # several clients' code is alive at once: each gets its own copy
            model = copy.deepcopy(self._cached_model(("reusable", key), make))
        else:
            model = self._cached_model(("reusable", key), make)
        for p in model.parameters():
            p.grad = None
        return model

    @contextlib.contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Accumulate wall time under ``name`` (reported per round in the metrics)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timers[name] = self.timers.get(name, 0.0) + time.perf_counter() - t0

    def session_test_indices(self, session: int) -> np.ndarray:
        """Test rows of the classes the devices of ``session`` (0-based) hold in their training
        data (sessions only)."""
        key = ("session_test", session)
        hit = self.cache.get(key)
        if hit is None:
            devs = self.schedule.devices[session]
            labels = self.data.train.labels_np
            classes = np.unique(np.concatenate([labels[self.data.client_indices[c]] for c in devs]))
            hit = self.cache[key] = np.flatnonzero(np.isin(self.data.test.labels_np, classes))
        return hit

    # ------------------------------------------------------------------ models & budgets
    def build_model(self, width: float | None = None, **overrides: Any) -> nn.Module:
        """A fresh model of the configured architecture (optionally another width)."""
        kw: dict[str, Any] = dict(
            num_classes=self.num_classes,
            in_channels=self.input_shape[0],
            width=self.cfg.model.width if width is None else width,
            norm=self.cfg.model.norm,
            input_size=self.input_shape[1],
        )
        kw.update(overrides)
        model = build_model(self.cfg.model.name, **kw)
        if self.cfg.model.weights:
            self._load_weights(model, checked=width is None or width == self.cfg.model.width)
        return model.to(device=self.device, dtype=self.dtype)

    def _load_weights(self, model: nn.Module, checked: bool = True) -> None:
        """``model.weights``: a state dict loaded into the model or into its ``backbone``.

        Every tensor of the model (``num_batches_tracked`` counters excepted) must be in the file with
        its shape, unless ``model.weights_partial`` allows loading only the tensors that are there.
        Entries of the file the model lacks (e.g. an ImageNet classifier head) are left unused. A file
        that is not a state dict, an entry whose shape differs from the model's and a file that
        matches no tensor at all are one-line ``ConfigError`` messages naming the file.

        ``checked=False`` (a model of another width than ``model.width``, e.g. a client's sub-model,
        which the file cannot describe): the entries whose shapes fit are loaded, nothing is checked."""
        path = str(self.cfg.model.weights)
        state = self.cache.get(("weights", path))
        if state is None:
            state = _read_state_dict(path)
            self.cache[("weights", path)] = state
        backbone = getattr(model, "backbone", None)
        target: nn.Module = backbone if isinstance(backbone, nn.Module) else model
        what = f"the {self.cfg.model.name} model" + ("'s backbone" if target is not model else "")
        own = target.state_dict()
        if not checked:
            target.load_state_dict(
                {k: state[k] for k in own if k in state and tuple(state[k].shape) == tuple(own[k].shape)},
                strict=False,
            )
            return
        wrong = [k for k in own if k in state and tuple(own[k].shape) != tuple(state[k].shape)]
        if wrong:
            k = wrong[0]
            more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
            raise ConfigError(
                f"model.weights: entry {k!r} of {path} has shape {list(state[k].shape)} but {what} "
                f"needs {list(own[k].shape)}{more}; is it a checkpoint of another architecture?"
            )
        fits = {k: state[k] for k in own if k in state}
        required = [k for k in own if not k.endswith("num_batches_tracked")]
        missing = [k for k in required if k not in fits]
        matched = len(required) - len(missing)
        unused = len(state) - len(fits)
        if not matched:
            raise ConfigError(
                f"model.weights: none of the {len(state)} tensors of {path} matches a tensor of {what} "
                f"(file keys like {_some_keys(state)}; model keys like {_some_keys(own)})"
            )
        if missing and not self.cfg.model.weights_partial:
            raise ConfigError(
                f"model.weights: {path} holds {matched} of the {len(required)} tensors of {what} "
                f"(missing {_some_keys(missing)}; {unused} entries of the file unused); set "
                f"model.weights_partial=true to load only the {matched} it holds"
            )
        target.load_state_dict(fits, strict=False)
        if missing and (path, what) not in _PARTIAL_REPORTED:  # once per process
            _PARTIAL_REPORTED.add((path, what))
            logging.getLogger(__name__).warning(
                "model.weights_partial: loaded %d of the %d tensors of %s from %s; the other %d keep "
                "their initial values", matched, len(required), what, path, len(missing),
            )

    def macs(self, model: nn.Module) -> int:
        """Forward MACs per sample (conv + linear; BN, activations and pooling excluded).

        Cached by the model's structure (class, module paths and parameter shapes), so clients
        training the same architecture cost one counting pass."""
        key = (type(model).__name__,) + tuple(
            (path, type(m).__name__, tuple(m.weight.shape) if isinstance(getattr(m, "weight", None), torch.Tensor) else ())
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
            self._width_planner = WidthPlanner(self)
        return self._width_planner.width_for(budget_macs)

    def min_budget_macs(self) -> float:
        return min(t.ratio for t in self.cfg.budget.tiers) * self.plain_macs

    def max_budget_macs(self) -> float:
        return max(t.ratio for t in self.cfg.budget.tiers) * self.plain_macs

    # ------------------------------------------------------------------ training
    def lr_at(self, rnd: int | None = None) -> float:
        """The local learning rate of round ``rnd`` (default: the current round) under
        ``train.lr_schedule``, one value per round (rounds count from 1):

        * ``constant``: ``train.lr``;
        * ``cosine``: ``lr_min + (lr − lr_min)·(1 + cos(π·(t−1)/T))/2`` (cosine annealing with
          ``T = train.rounds``, stepped once per round);
        * ``polynomial``: ``lr_min + (lr − lr_min)·(1 − (t−1)/T)^lr_power``;
        * ``exponential``: ``lr·lr_decay^(t−1)`` (the FedDU family's per-round device decay).

        With sessions, ``t`` counts the rounds of the current session and ``T`` is
        ``sessions.rounds`` (the schedule restarts at every session). A rate the server sent with
        the task (``ClientTask.lr``), or set for an exchange it runs now (:attr:`lr_override`),
        takes precedence.
        """
        if rnd is None:
            sent = self.current_client.lr if self.current_client is not None else None
            if sent is not None:
                return float(sent)
            if self.lr_override is not None:
                return float(self.lr_override)
        t = self.cfg.train
        if t.lr_schedule == "constant":
            return t.lr
        k = max(int(self.round if rnd is None else rnd), 1)
        total = t.rounds
        if self.schedule is not None:  # the schedule restarts at every session
            k, total = self.schedule.round_in_session(k), self.schedule.rounds
        k = min(k, total) - 1
        if t.lr_schedule == "exponential":
            return t.lr * t.lr_decay ** k
        frac = k / total
        if t.lr_schedule == "cosine":
            return t.lr_min + (t.lr - t.lr_min) * 0.5 * (1.0 + math.cos(math.pi * frac))
        return t.lr_min + (t.lr - t.lr_min) * (1.0 - frac) ** t.lr_power

    def local_momentum(self) -> float:
        """The momentum of the local SGD optimiser (0 with ``train.optimizer_state: none``)."""
        t = self.cfg.train
        return 0.0 if t.optimizer_state == "none" else t.momentum

    def evaluate(self, model: nn.Module, dataset: Any = None, indices: Any = None) -> dict[str, float]:
        """Accuracy and mean loss of ``model`` (eval mode) on the test set or a given dataset."""
        return combine_batch_stats(self.evaluate_batches(model, dataset, indices))

    @torch.no_grad()
    def evaluate_batches(self, model: nn.Module, dataset: Any = None, indices: Any = None) -> list[tuple[float, int, int]]:
        """``(summed loss, correct, samples)`` of every evaluation batch, in order: the pieces of
        :meth:`evaluate`, which a back end may compute in several processes (each batch is the
        same whoever computes it, and :func:`combine_batch_stats` adds them in this order)."""
        ds = self.data.test if dataset is None else dataset
        was_training = model.training
        model.eval()
        out_stats = []
        for x, y in iterate_batches(ds, indices, self.cfg.train.eval_batch_size, shuffle=False):
            x = x.to(self.device, self.dtype)
            y = y.to(self.device)
            out = model(x)
            out_stats.append((float(F.cross_entropy(out, y, reduction="sum")), int((out.argmax(1) == y).sum()), int(y.shape[0])))
        model.train(was_training)
        return out_stats

    def aggregation_weights(self, updates: "list[ClientResult]") -> list[float]:
        if self.cfg.train.aggregation == "uniform":
            return [1.0] * len(updates)
        return [float(u.num_samples) for u in updates]


class ClientContext(RunContext):
    """What the client half of a method may use: the :class:`RunContext` of its process plus the
    shared local trainer (:class:`~fedhetero.core.local.trainer.LocalTrainer`) and the scope of the
    client it runs. It holds no server state."""

    def __init__(self, cfg: RunConfig, data: Any, device: torch.device) -> None:
        super().__init__(cfg, data, device)
        self.trainer = LocalTrainer(self)

    @contextlib.contextmanager
    def client_scope(self, client: "ClientInfo", optimizer_state: dict[str, Any] | None = None) -> Iterator[None]:
        """Everything a client does in a round runs with RNG derived from (round, client).

        Torch's default generator is re-seeded on entry (module initialisers of new branches draw
        from it), so a client's work never depends on what ran before it, in this process or in
        another one. ``optimizer_state``: the client's momentum buffers from its last round
        (``train.optimizer_state: persistent``; see :meth:`optimizer_state`)."""
        self.current_client = client
        self.round = int(client.round)
        self.trainer.start_client(optimizer_state)
        seed = derive_seed(self.cfg.seed, "client", client.round, client.cid)
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        try:
            yield
        finally:
            self.current_client = None
            self.trainer.end_client()

    # ------------------------------------------------------------------ the client's trainer
    def make_optimizer(self, model: nn.Module, lr: float | None = None) -> torch.optim.Optimizer:
        """:meth:`LocalTrainer.make_optimizer <fedhetero.core.local.trainer.LocalTrainer.make_optimizer>`."""
        return self.trainer.make_optimizer(model, lr)

    def configured_sgd(self) -> "LocalSGD":
        """:meth:`LocalTrainer.configured_sgd <fedhetero.core.local.trainer.LocalTrainer.configured_sgd>`."""
        return self.trainer.configured_sgd()

    def optimizer_state(self) -> dict[str, torch.Tensor] | None:
        """:meth:`LocalTrainer.optimizer_state <fedhetero.core.local.trainer.LocalTrainer.optimizer_state>`."""
        return self.trainer.optimizer_state()

    def client_batches(self, cid: int, epoch: int, batch_size: int | None = None):  # type: ignore[no-untyped-def]
        """:meth:`LocalTrainer.client_batches <fedhetero.core.local.trainer.LocalTrainer.client_batches>`."""
        return self.trainer.client_batches(cid, epoch, batch_size)

    def client_epoch_rows(self, cid: int, epoch: int) -> torch.Tensor:
        """:meth:`LocalTrainer.client_epoch_rows <fedhetero.core.local.trainer.LocalTrainer.client_epoch_rows>`."""
        return self.trainer.client_epoch_rows(cid, epoch)

    def train(self, model: nn.Module, client: "ClientInfo", epochs: int, **kw: Any) -> dict[str, Any]:
        """:meth:`LocalTrainer.train <fedhetero.core.local.trainer.LocalTrainer.train>`: local SGD on the
        client's data (keywords ``optimizer``, ``after_backward``, ``on_epoch_end``, ``loss_fn``,
        ``first_epoch``, ``objective``)."""
        return self.trainer.train(model, client, epochs, **kw)


def combine_batch_stats(stats: "list[tuple[float, int, int]]") -> dict[str, float]:
    """Accuracy and mean loss from per-batch ``(summed loss, correct, samples)``, added in order."""
    correct = 0
    loss = 0.0
    n = 0
    for batch_loss, batch_correct, batch_n in stats:
        loss += batch_loss
        correct += batch_correct
        n += batch_n
    return {"accuracy": correct / max(n, 1), "loss": loss / max(n, 1)}


class Context(RunContext):
    """The server's context: a :class:`RunContext` plus the client-state store and evaluation
    through the back end. It has no trainer: client tasks run on a back end's own
    :class:`ClientContext`."""

    def __init__(
        self,
        cfg: RunConfig,
        data: Any,
        store: "ClientStateStore",
        device: torch.device,
    ) -> None:
        super().__init__(cfg, data, device)
        self.store = store
        self.on_client_done: Callable[[int], None] | None = None
        # a back end's evaluate_batches over several processes (set by the engine), or None
        self.batch_evaluator: Callable[[nn.Module, str, Any], "list[tuple[float, int, int]] | None"] | None = None

    def evaluate(self, model: nn.Module, dataset: Any = None, indices: Any = None) -> dict[str, float]:
        """:meth:`RunContext.evaluate`, its batches shared among the back end's processes when it
        offers that (same batches, added in the same order: the same numbers)."""
        if self.batch_evaluator is not None:
            name = "test" if dataset is None or dataset is self.data.test else "train" if dataset is self.data.train else None
            if name is not None:
                stats = self.batch_evaluator(model, name, indices)
                if stats is not None:
                    return combine_batch_stats(stats)
        return super().evaluate(model, dataset, indices)
