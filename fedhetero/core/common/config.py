"""Typed run configuration.

A run is described by :class:`RunConfig`, a tree of frozen dataclasses (its sections), built with
:func:`from_dict` and validated up front: an unknown key, a wrong type or an impossible value
raises :class:`~fedhetero.core.common.options.ConfigError` whose message names the field
(``train.sample_rate``) and what is accepted. This module also holds the names a run may give
(back ends, loggers) and the config hash a resumed run is checked against. Options are declared
with :mod:`fedhetero.core.common.options`; YAML files and ``--set`` overrides are
:mod:`fedhetero.core.common.configfile`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping


from fedhetero.core.common.names import Registry
from fedhetero.core.common.options import (
    _LATER,
    ConfigError,
    _declared,
    check_fields,
    from_mapping,
    option,
    require,
)


__all__ = [
    "AlgorithmConfig",
    "BACKENDS",
    "BudgetConfig",
    "EXTERNAL_BACKENDS",
    "LOGGERS",
    "RESUMABLE",
    "SCENARIOS",
    "DataConfig",
    "ModelConfig",
    "RunConfig",
    "SessionsConfig",
    "TierConfig",
    "TrainConfig",
    "backend_names",
    "logger_names",
    "config_hash",
    "config_hashes",
    "from_dict",
    "to_dict",
]


# ---------------------------------------------------------------------------- names
#
# The names a field accepts come from the registry that owns them, never restated here: datasets
# and partitions from fedhetero.data, models from the zoo, back ends from the tables below (the
# core's back-end module imports this one, so they live here), algorithms from
# fedhetero.core.method.registry (checked when the method is built). The data layer and the zoo import
# torch, which the command line's parser and `--help` do not need: they are imported when a value
# is checked, not with this module.


def _dataset_names() -> tuple[str, ...]:
    from fedhetero.data import DATASETS  # deferred: fedhetero.data imports torch

    return DATASETS


def _partition_names() -> tuple[str, ...]:
    from fedhetero.data import PARTITIONS  # deferred: fedhetero.data imports torch

    return PARTITIONS


def _model_names() -> list[str]:
    from fedhetero.models import list_models  # deferred: the zoo imports torch

    return list_models()


#: Loggers a run may name in ``loggers`` (a built-in one is a ``"module:Class"`` name, not an
#: import: the module is loaded when a run uses it); ``@LOGGERS.register("name")`` adds one.
LOGGERS: Registry[Any] = Registry("loggers", "logger", {
    "tensorboard": "fedhetero.core.run.loggers:TensorBoardLogger",
    "mlflow": "fedhetero.core.run.loggers:MLflowLogger",
}, error=ConfigError)


def logger_names() -> tuple[str, ...]:
    """Every name the config field ``loggers`` accepts."""
    return LOGGERS.names()


#: Back ends the engine builds (the class takes ``(cfg, data)``); ``BACKENDS.register(name)`` or
#: ``BACKENDS.add(name, "module:Class")`` adds one.
BACKENDS: Registry[Any] = Registry("engine.backend", "back end", {
    "local": "fedhetero.backends.local:LocalBackend",
    "process": "fedhetero.backends.process:ProcessBackend",
}, error=ConfigError)

#: Back ends an integration builds itself (name -> how to start one), listed for the config check.
EXTERNAL_BACKENDS: dict[str, str] = {
    "flower": "runs inside a Flower ServerApp; start it with `fedhetero flower simulate` or `flwr run` "
    "(see the README), or choose local/process",
}


def backend_names() -> tuple[str, ...]:
    """Every name ``engine.backend`` accepts."""
    return (*BACKENDS.names(), *EXTERNAL_BACKENDS)


# ---------------------------------------------------------------------------- sections
# ``Literal`` types are for closed sets of values that belong to the config itself.

#: The most threads or worker processes a config may ask for.
_MAX_THREADS = max(4 * (os.cpu_count() or 1), 64)


@dataclass(frozen=True)
class DataConfig:
    dataset: str = option("digits", choices=_dataset_names)
    data_dir: str | None = None
    download: bool = False  # fetch a missing CIFAR / DermaMNIST file (needs network access)
    partition: str = option("dirichlet", choices=_partition_names)
    alpha: float = option(0.5, gt=0, note="the Dirichlet concentration")
    group_overlap: float = option(0.0, ge=0, lt=1, added_later=True)  # session_groups: label overlap o of the two device groups
    # shards per client; also kshards' K and the classes per client of pathological
    shards_per_client: int = option(2, ge=1)
    num_clients: int = option(20, ge=1, le=10**6)
    min_partition_size: int = option(10, ge=1)
    server_fraction: float = option(0.0, ge=0, lt=1)  # labelled server data (FedDU, data sharing)
    server_classes: float = option(1.0, gt=0, le=1)  # fraction of classes the server data covers
    public_fraction: float = option(0.0, ge=0, lt=1)  # unlabelled public split (KD baselines)
    # validation hold-out (stratified), evaluated as val_accuracy
    val_fraction: float = option(0.0, ge=0, le=0.5, added_later=True)
    augment: bool = False
    synthetic_size: int = option(600, ge=10)  # only for dataset "synthetic"


@dataclass(frozen=True)
class ModelConfig:
    name: str = option("lenet5", choices=_model_names)
    width: float = option(1.0, ge=1 / 64, le=64)
    norm: Literal["bn", "groupnorm1", "none"] = "bn"
    # a state-dict file of initial weights (e.g. ImageNet weights of resnet18_proj's backbone):
    # loaded into the model, or into its ``backbone`` when it has one
    weights: str | None = option(None, added_later=True)
    # load a file that holds only some of the model's tensors (the others keep their initial
    # values); without it such a file is refused, naming how many tensors it holds
    weights_partial: bool = option(False, added_later=True)


@dataclass(frozen=True)
class TrainConfig:
    rounds: int = option(30, ge=1, le=10**6)
    sample_rate: float = option(0.5, gt=0, le=1, note="the fraction of clients sampled per round")
    local_epochs: int = option(2, ge=1, le=10**4)
    batch_size: int = option(32, ge=1, le=10**6)
    lr: float = option(0.05, gt=0)
    momentum: float = option(0.9, ge=0, lt=1)
    weight_decay: float = option(5e-4, ge=0)
    aggregation: Literal["samples", "uniform"] = "samples"
    eval_every: int = option(1, ge=1)
    checkpoint_every: int = option(1, ge=1)  # every round: a checkpoint of these models costs milliseconds
    eval_batch_size: int = option(512, ge=1)
    # for time-to-target in the simulated time model
    target_accuracy: float | None = option(None, gt=0, le=1, note="a fraction")
    # local optimiser and schedule (the defaults reproduce plain SGD with a fresh momentum buffer
    # every round and a constant learning rate)
    nesterov: bool = False
    # max global gradient norm per step; null = no clipping
    clip_grad_norm: float | None = option(None, gt=0, note="null: no clipping")
    lr_schedule: Literal["constant", "cosine", "polynomial", "exponential"] = "constant"  # over rounds
    lr_min: float = option(0.0, ge=0)  # the rate cosine / polynomial decay towards (reached after train.rounds)
    lr_power: float = option(0.9, gt=0)  # exponent of the polynomial schedule
    # factor per round of the exponential schedule (0.99: the FedDU family's device decay)
    lr_decay: float = option(0.99, gt=0, le=1, added_later=True)
    # steps per local round instead of local_epochs passes
    local_steps: int | None = option(None, ge=1, le=10**7, note="null: train.local_epochs passes")
    # persistent: SGD momentum buffers kept in the client's private state between rounds;
    # reset_per_round: a new buffer every round; none: no momentum
    optimizer_state: Literal["persistent", "reset_per_round", "none"] = "reset_per_round"


@dataclass(frozen=True)
class TierConfig:
    name: str
    ratio: float = option(gt=0)
    share: float = option(ge=0)


def _default_tiers() -> tuple[TierConfig, ...]:
    return (
        TierConfig("small", 1.0, 1 / 3),
        TierConfig("medium", 2.0, 1 / 3),
        TierConfig("large", 3.0, 1 / 3),
    )


#: How client budgets change during a run (fedhetero.core.hetero.budget implements each).
Scenario = Literal["static", "increasing", "decreasing", "random"]
SCENARIOS: tuple[str, ...] = typing.get_args(Scenario)


@dataclass(frozen=True)
class BudgetConfig:
    tiers: tuple[TierConfig, ...] = field(default_factory=_default_tiers)
    scenario: Scenario = "static"
    change: float = option(0.05, ge=0, lt=1)  # relative budget change after the second local epoch
    min_ratio: float = option(0.1, gt=0)
    max_ratio: float = option(8.0, gt=0)


@dataclass(frozen=True)
class AlgorithmConfig:
    name: str = "dynamicfl"  # checked by fedhetero.core.method.registry when the method is built
    options: Mapping[str, Any] = field(default_factory=dict)  # checked against the method's Options


@dataclass(frozen=True)
class FaultConfig:
    """Fault injection for tests and drills: each (round, client) task fails with probability
    ``rate`` (seeded), in one of ``kinds``: ``raise`` (an exception), ``nan`` (a non-finite upload)
    or ``hang`` (the client never answers; needs ``engine.client_timeout_s``)."""

    rate: float = option(0.0, ge=0, le=1)
    kinds: tuple[Literal["raise", "nan", "hang"], ...] = ("raise", "nan")


@dataclass(frozen=True)
class EngineConfig:
    """Where client tasks run. ``local``: in this process, one after another (the reference);
    ``process``: a pool of worker processes on this machine, results reduced in client-id order
    (same numbers as ``local``); ``flower``: Flower's simulation or deployment engine (extra
    ``fedhetero[flower]``)."""

    backend: str = option("local", choices=backend_names)
    # process back end: executors, this process included unless client_timeout_s is set (None: the machine's cores)
    workers: int | None = option(None, ge=1, le=_MAX_THREADS, note="each is a process; null: one per core")
    # a client that takes longer is dropped from the round
    client_timeout_s: float | None = option(None, gt=0, note="seconds")
    min_clients: int = option(1, ge=1)  # fewer successful clients in a round stops the run with a clear message
    inject_faults: FaultConfig = field(default_factory=FaultConfig)
    # train a round's clients in batched cohorts where the method and model allow it
    # (fedhetero.core.local.cohort), on each executor of the local and process back ends; same numbers
    # as one by one up to the order of float sums. null (auto): on a CPU, cohorts of engine.min_cohort
    # clients or more of 10 local steps or more (where measured faster); on a GPU, of 2 or more;
    # true: of 2 or more; false: never
    vectorize: bool | None = option(None, added_later=True)
    min_cohort: int = option(4, ge=2, added_later=True, note="with vectorize: null, on a CPU")
    # a cohort holds as many clients as fit in this much memory (estimated per client)
    cohort_memory_mb: float = option(2048.0, gt=0, added_later=True, note="MiB")


@dataclass(frozen=True)
class SessionsConfig:
    """Device arrival and departure: ``count`` sessions of ``rounds`` rounds each, with a fixed
    set of available devices per session (``devices``: one list of client ids per session; without
    it ``schedule: alternate`` uses the first half of the clients, then the second, A, B, A, …).
    ``count: 0`` (default): no sessions, every client is available in every round. In a session
    the learning-rate schedule runs over its ``rounds`` and restarts at the next one; accuracy is
    reported on the test classes the session's devices hold (``eval_on_session_classes``) and on
    the full test set."""

    count: int = option(0, ge=0, note="0: no sessions")
    rounds: int = option(50, ge=1)
    schedule: Literal["alternate"] = "alternate"
    devices: tuple[tuple[int, ...], ...] | None = None
    eval_on_session_classes: bool = True
    transition_window: int = option(10, ge=1)  # rounds averaged for a transition's accuracy


@dataclass(frozen=True)
class RunConfig:
    seed: int = option(0, ge=0, lt=2**63)
    device: str = "cpu"
    # intra-op threads per client; 1 by default: more threads than free cores slow training down (the
    # default 30-round job on a busy 2-core machine: 55-57 s with 1 thread, 121-954 s with 2; see the
    # README), and the count is part of the config so that the same config gives the same numbers
    threads: int | None = option(1, ge=1, le=_MAX_THREADS)
    deterministic: bool = True
    tune_malloc: bool = True  # keep freed activation memory in the heap (glibc; see fedhetero.core.run.allocator)
    dtype: Literal["float32", "float64"] = "float32"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    # added after runs were made: hashed only with sessions.count set
    sessions: SessionsConfig = option(default_factory=SessionsConfig, added_later="count")
    # experiment loggers beside metrics.jsonl (fedhetero.core.run.loggers: tensorboard, mlflow; extra
    # fedhetero[loggers]); they change no number, so they are not hashed and may change on resume
    loggers: tuple[str, ...] = option((), choices=logger_names)


def from_dict(data: Mapping[str, Any] | None) -> RunConfig:
    """Build and validate a :class:`RunConfig` from plain data (e.g. parsed YAML)."""
    cfg = from_mapping(RunConfig, data or {}, "")
    validate(cfg)
    return cfg


def to_dict(cfg: Any) -> Any:
    """Plain-data form of a config (lists for tuples), suitable for YAML and JSON."""
    return _plain(cfg, hashed_only=False)


def _plain(cfg: Any, hashed_only: bool) -> Any:
    """:func:`to_dict`; with ``hashed_only`` without the fields :func:`config_hash` leaves out
    (see :func:`_hashed`)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {
            f.name: _plain(getattr(cfg, f.name), hashed_only)
            for f in dataclasses.fields(cfg)
            if not hashed_only or _hashed(cfg, f)
        }
    if isinstance(cfg, (list, tuple)):
        return [_plain(v, hashed_only) for v in cfg]
    if isinstance(cfg, Mapping):
        return {str(k): _plain(v, hashed_only) for k, v in cfg.items()}
    return cfg


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _hashed(obj: Any, f: dataclasses.Field) -> bool:
    """Whether field ``f`` of ``obj`` is part of the config hash: always, unless it was added
    after runs were made (``option(added_later=...)``) and is not set: equal to its default, or
    for a section, the section's switch field equal to its default."""
    later = _declared(type(obj), f.name, _LATER)
    value = getattr(obj, f.name)
    if not later:
        return True
    if later is True:
        return bool(value != _default(f))
    switch = next(g for g in dataclasses.fields(value) if g.name == later)
    return bool(getattr(value, later) != _default(switch))


_FLOAT32_MAX = 3.4028234663852886e38


def validate(cfg: RunConfig) -> None:
    """Reject impossible values with one message naming the field: every field's type and declared
    :func:`option` rule, then the checks that involve several fields."""
    check_fields(cfg, "")
    d, t, b = cfg.data, cfg.train, cfg.budget
    require(
        d.partition != "natural" or d.dataset == "femnist",
        "data.partition",
        f"natural makes one client per writer and needs a dataset with writers (femnist); {d.dataset} has none",
    )
    require(
        d.server_fraction + d.public_fraction + d.val_fraction < 0.9,
        "data.public_fraction" if d.val_fraction == 0 else "data.val_fraction",
        "server_fraction + public_fraction + val_fraction leave too little data for the clients",
    )
    require(
        d.partition != "session_groups" or (d.num_clients >= 2 and d.num_clients % 2 == 0),
        "data.num_clients",
        f"partition session_groups splits the clients into two equal groups: needs an even count, got {d.num_clients}",
    )
    # the optimiser computes in the model's dtype: a value it cannot hold overflows in every step
    top = _FLOAT32_MAX if cfg.dtype == "float32" else math.inf
    for name, value in (("lr", t.lr), ("weight_decay", t.weight_decay), ("clip_grad_norm", t.clip_grad_norm)):
        require(value is None or value <= top, f"train.{name}", f"must be <= {top:.4g} (the largest {cfg.dtype}), got {value}")
    require(t.lr_min <= t.lr, "train.lr_min", f"must be <= train.lr={t.lr:g}, got {t.lr_min}")
    require(
        not t.nesterov or (t.momentum > 0 and t.optimizer_state != "none"),
        "train.nesterov",
        "Nesterov momentum needs train.momentum > 0 and train.optimizer_state other than 'none'",
    )
    require(len(b.tiers) >= 1, "budget.tiers", "at least one tier is required")
    names = [tier.name for tier in b.tiers]
    require(len(set(names)) == len(names), "budget.tiers", f"tier names must be unique, got {names}")
    total = sum(tier.share for tier in b.tiers)
    require(
        abs(total - 1.0) <= 1e-6,
        "budget.tiers",
        f"the tier shares must sum to 1, got {total:g} ({', '.join(f'{n}={s:g}' for n, s in zip(names, [x.share for x in b.tiers]))})",
    )
    for i, tier in enumerate(b.tiers):
        require(bool(tier.name.strip()), f"budget.tiers[{i}].name", "must not be empty")
        require(tier.ratio <= b.max_ratio, f"budget.tiers[{i}].ratio", f"must be <= budget.max_ratio={b.max_ratio:g}, got {tier.ratio:g}")
    require(b.min_ratio <= b.max_ratio, "budget.min_ratio", f"must be <= budget.max_ratio={b.max_ratio:g}, got {b.min_ratio:g}")
    require(
        cfg.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", cfg.device) is not None,
        "device",
        f"expected 'cpu', 'cuda' or 'cuda:N', got {cfg.device!r}",
    )
    ss = cfg.sessions
    if ss.count:
        require(
            t.rounds == ss.count * ss.rounds,
            "train.rounds",
            f"with sessions.count={ss.count} and sessions.rounds={ss.rounds} it must be {ss.count * ss.rounds}, got {t.rounds}",
        )
        require(ss.devices is not None or d.num_clients >= 2, "sessions.schedule", "alternate needs at least 2 clients")
        if ss.devices is not None:
            require(len(ss.devices) == ss.count, "sessions.devices", f"lists {len(ss.devices)} sessions, sessions.count is {ss.count}")
            for i, devs in enumerate(ss.devices):
                require(len(devs) >= 1, f"sessions.devices[{i}]", "must list at least one client id")
                require(
                    all(0 <= c < d.num_clients for c in devs),
                    f"sessions.devices[{i}]",
                    f"client ids must be in [0, data.num_clients={d.num_clients})",
                )
    require(len(set(cfg.loggers)) == len(cfg.loggers), "loggers", f"names a logger twice: {list(cfg.loggers)}")
    e = cfg.engine
    f = e.inject_faults
    require(f.rate == 0 or len(f.kinds) >= 1, "engine.inject_faults.kinds", "name at least one of raise, nan, hang")
    require(
        f.rate == 0 or "hang" not in f.kinds or e.client_timeout_s is not None,
        "engine.inject_faults.kinds",
        "'hang' needs engine.client_timeout_s (a hung client is only dropped when its time runs out)",
    )


#: Fields left out of the hash, so that they may change when a run is resumed: where the work runs
#: and the loggers that show it (neither changes the numbers; section "": the top level), and how
#: the back end treats failing clients (so that "fix the cause and continue with --resume" works
#: when the cause is a time-out, the minimum of clients or the injected faults of a drill).
RESUMABLE = {"": ("loggers",), "engine": ("backend", "workers", "client_timeout_s", "min_clients", "inject_faults")}
#: What was left out before the failure handling could change on resume; a run directory written
#: then still resumes (see :func:`config_hashes`). The section "" is the top level (``loggers``,
#: which did not exist then).
_UNHASHED_BEFORE = {"": ("loggers",), "engine": ("backend", "workers")}


def config_hashes(cfg: RunConfig) -> set[str]:
    """Every hash a run directory of this config may have recorded (the current rule's, the
    rule's before the failure-handling fields left the hash, and, for ``engine.vectorize: false``,
    the hash from when false was its default and so left out)."""
    out = {config_hash(cfg), _hash(cfg, _UNHASHED_BEFORE)}
    if cfg.engine.vectorize is False:
        without = {**RESUMABLE, "engine": (*RESUMABLE["engine"], "vectorize")}
        out |= {_hash(cfg, without), _hash(cfg, {**_UNHASHED_BEFORE, "engine": (*_UNHASHED_BEFORE["engine"], "vectorize")})}
    return out


def config_hash(cfg: RunConfig) -> str:
    """SHA-256 of the resolved config's canonical JSON form, without the :data:`RESUMABLE` fields
    and without the fields added later (``option(added_later=...)``) where they are not set."""
    return _hash(cfg, RESUMABLE)


def _hash(cfg: RunConfig, unhashed: Mapping[str, tuple[str, ...]]) -> str:
    # fields added later are hashed only when set, so runs made before them can still be resumed
    data = _plain(cfg, hashed_only=True)
    for section, keys in unhashed.items():
        for key in keys:
            (data.get(section, {}) if section else data).pop(key, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
