"""Typed run configuration.

A run is described by :class:`RunConfig`, a tree of frozen dataclasses. Configs come from YAML
(:func:`load_config`), are overridden with ``key.path=value`` strings (:func:`apply_overrides`,
the CLI's ``--set``), and are validated up front: an unknown key, a wrong type or an impossible
value raises :class:`ConfigError` whose message names the field (``train.sample_rate``) and what
is accepted. The resolved config is written into the run directory as YAML (:func:`dump_config`)
with its SHA-256 hash, and read back on ``--resume``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import hashlib
import json
import math
import numbers
import os
import re
import stat
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml

__all__ = [
    "AlgorithmConfig",
    "BudgetConfig",
    "ConfigError",
    "RESUMABLE",
    "DataConfig",
    "ModelConfig",
    "RunConfig",
    "SessionsConfig",
    "TierConfig",
    "TrainConfig",
    "apply_overrides",
    "config_hash",
    "config_hashes",
    "dump_config",
    "from_dict",
    "load_config",
    "to_dict",
]


class ConfigError(ValueError):
    """A config field is unknown, has the wrong type or an impossible value."""


@dataclass(frozen=True)
class DataConfig:
    dataset: Literal["digits", "cifar10", "cifar100", "dermamnist", "mnist", "fashion_mnist", "femnist", "svhn", "synthetic"] = "digits"
    data_dir: str | None = None
    download: bool = False  # fetch a missing CIFAR / DermaMNIST file (needs network access)
    partition: Literal["dirichlet", "iid", "shards", "kshards", "session_groups", "natural"] = "dirichlet"
    alpha: float = 0.5
    group_overlap: float = 0.0  # session_groups: label overlap o of the two device groups
    shards_per_client: int = 2
    num_clients: int = 20
    min_partition_size: int = 10
    server_fraction: float = 0.0  # labelled server data (FedDU, data sharing)
    server_classes: float = 1.0  # fraction of classes the server data covers
    public_fraction: float = 0.0  # unlabelled public split (KD baselines)
    val_fraction: float = 0.0  # validation hold-out (stratified), evaluated as val_accuracy
    augment: bool = False
    synthetic_size: int = 600  # only for dataset "synthetic"


@dataclass(frozen=True)
class ModelConfig:
    name: str = "lenet5"
    width: float = 1.0
    norm: Literal["bn", "groupnorm1", "none"] = "bn"
    # a state-dict file of initial weights (e.g. ImageNet weights of resnet18_proj's backbone):
    # loaded into the model, or into its ``backbone`` when it has one
    weights: str | None = None
    # load a file that holds only some of the model's tensors (the others keep their initial
    # values); without it such a file is refused, naming how many tensors it holds
    weights_partial: bool = False


@dataclass(frozen=True)
class TrainConfig:
    rounds: int = 30
    sample_rate: float = 0.5
    local_epochs: int = 2
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    aggregation: Literal["samples", "uniform"] = "samples"
    eval_every: int = 1
    checkpoint_every: int = 1  # every round: a checkpoint of these models costs milliseconds
    eval_batch_size: int = 512
    target_accuracy: float | None = None  # for time-to-target in the simulated time model
    # local optimiser and schedule (the defaults reproduce plain SGD with a fresh momentum buffer
    # every round and a constant learning rate)
    nesterov: bool = False
    clip_grad_norm: float | None = None  # max global gradient norm per step; null = no clipping
    lr_schedule: Literal["constant", "cosine", "polynomial"] = "constant"  # over rounds
    lr_min: float = 0.0  # the rate cosine / polynomial decay towards (reached after train.rounds)
    lr_power: float = 0.9  # exponent of the polynomial schedule
    local_steps: int | None = None  # steps per local round instead of local_epochs passes
    # persistent: SGD momentum buffers kept in the client's private state between rounds;
    # reset_per_round: a new buffer every round; none: no momentum
    optimizer_state: Literal["persistent", "reset_per_round", "none"] = "reset_per_round"


@dataclass(frozen=True)
class TierConfig:
    name: str
    ratio: float
    share: float


def _default_tiers() -> tuple[TierConfig, ...]:
    return (
        TierConfig("small", 1.0, 1 / 3),
        TierConfig("medium", 2.0, 1 / 3),
        TierConfig("large", 3.0, 1 / 3),
    )


@dataclass(frozen=True)
class BudgetConfig:
    tiers: tuple[TierConfig, ...] = field(default_factory=_default_tiers)
    scenario: Literal["static", "increasing", "decreasing", "random"] = "static"
    change: float = 0.05  # relative budget change after the second local epoch
    min_ratio: float = 0.1
    max_ratio: float = 8.0


@dataclass(frozen=True)
class AlgorithmConfig:
    name: str = "dynamicfl"
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FaultConfig:
    """Fault injection for tests and drills: each (round, client) task fails with probability
    ``rate`` (seeded), in one of ``kinds``: ``raise`` (an exception), ``nan`` (a non-finite upload)
    or ``hang`` (the client never answers; needs ``engine.client_timeout_s``)."""

    rate: float = 0.0
    kinds: tuple[Literal["raise", "nan", "hang"], ...] = ("raise", "nan")


@dataclass(frozen=True)
class EngineConfig:
    """Where client tasks run. ``local``: in this process, one after another (the reference);
    ``process``: a pool of worker processes on this machine, results reduced in client-id order
    (same numbers as ``local``); ``flower``: Flower's simulation or deployment engine (extra
    ``fedhetero[flower]``)."""

    backend: Literal["local", "process", "flower"] = "local"
    workers: int | None = None  # process back end: executors, this process included unless client_timeout_s is set (None: the machine's cores)
    client_timeout_s: float | None = None  # a client that takes longer is dropped from the round
    min_clients: int = 1  # fewer successful clients in a round stops the run with a clear message
    inject_faults: FaultConfig = field(default_factory=FaultConfig)
    # local back end: train the clients of a round together as one batched model when the
    # algorithm and model allow it (fedhetero.cohort); same numbers up to the order of float sums
    vectorize: bool = False


@dataclass(frozen=True)
class SessionsConfig:
    """Device arrival and departure: ``count`` sessions of ``rounds`` rounds each, with a fixed
    set of available devices per session (``devices``: one list of client ids per session; without
    it ``schedule: alternate`` uses the first half of the clients, then the second, A, B, A, …).
    ``count: 0`` (default): no sessions, every client is available in every round. In a session
    the learning-rate schedule runs over its ``rounds`` and restarts at the next one; accuracy is
    reported on the test classes the session's devices hold (``eval_on_session_classes``) and on
    the full test set."""

    count: int = 0
    rounds: int = 50
    schedule: Literal["alternate"] = "alternate"
    devices: tuple[tuple[int, ...], ...] | None = None
    eval_on_session_classes: bool = True
    transition_window: int = 10  # rounds averaged for a transition's accuracy


@dataclass(frozen=True)
class RunConfig:
    seed: int = 0
    device: str = "cpu"
    # intra-op threads per client; 1 by default: more threads than free cores slow training down (a
    # 10-round digits run with one of two cores busy: 5.4 s with 1 thread, 14.8 s with 2), and the
    # count is part of the config so that the same config gives the same numbers
    threads: int | None = 1
    deterministic: bool = True
    tune_malloc: bool = True  # keep freed activation memory in the heap (glibc; see reparam.allocator)
    dtype: Literal["float32", "float64"] = "float32"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sessions: SessionsConfig = field(default_factory=SessionsConfig)


# ---------------------------------------------------------------------------- conversion


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is tuple:
        return "list"
    return getattr(tp, "__name__", str(tp))


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
#: Integers are stored as 64-bit values (seeds, counts, numpy arrays): larger ones are refused.
_INT_LIMIT = 2**63
#: Words YAML 1.1 read as booleans; YAML 1.2 (what configs are read as) keeps them strings.
_YAML11_BOOLS = frozenset({"y", "yes", "n", "no", "on", "off"})
#: Numbers only YAML 1.1 knows: digit separators (``1_000``) and base 60 (``1:30``).
_YAML11_NUMBER = re.compile(r"[-+]?(0[box])?[0-9a-fA-F_]*[0-9][0-9a-fA-F_:.]*")


def _hint(value: Any, want: str) -> str:
    """What to write instead, for a value of the wrong type (empty when nothing useful is known)."""
    if want == "bool" and isinstance(value, str) and value.strip().lower() in _YAML11_BOOLS:
        return " (YAML 1.2 reads yes/no/on/off as strings: write true or false)"
    if want == "int" and isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return " (write a whole number without a decimal point or exponent)"
    if want in ("int", "float") and isinstance(value, str) and ("_" in value or ":" in value):
        if _YAML11_NUMBER.fullmatch(value.strip()):
            return " (YAML 1.2 has no digit separators '_' or base-60 'a:b' numbers: write the plain decimal)"
    return ""


def _show(value: Any, limit: int = 60) -> str:
    """``repr(value)``, shortened when long (a huge number, a long list)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 20]}…{text[-8:]} ({len(text)} characters)"


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        for arg in args:
            try:
                return _convert(value, arg, path)
            except ConfigError:
                pass
        hint = next((h for a in (int, float, bool) if a in args and (h := _hint(value, a.__name__))), "")
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {_show(value)}{hint}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{path}: expected null, got {_show(value)}")
    if origin is Literal:
        # compare types too: True == 1 and 1.0 == 1 must not pick a Literal of another type
        for arg in typing.get_args(tp):
            if type(value) is type(arg) and value == arg:
                return arg
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {_show(value)}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping of {tp.__name__} fields, got {_show(value)}")
        return _from_mapping(tp, value, path)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {_show(value)}")
        item_tp = args[0]
        return tuple(_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value))
    if origin in (Mapping, dict, collections.abc.Mapping) or tp is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {_show(value)}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {_show(value)}{_hint(value, 'bool')}")
    if tp is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            whole = int(value)
            if not -_INT_LIMIT <= whole < _INT_LIMIT:
                raise ConfigError(f"{path}: {_show(whole)} is out of range (integers must lie in [-2^63, 2^63))")
            return whole
        raise ConfigError(f"{path}: expected an integer, got {_show(value)}{_hint(value, 'int')}")
    if tp is float:
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            value = float(value)  # a number given as a string (e.g. from JSON or a quoted YAML value)
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer beyond the float range
                raise ConfigError(f"{path}: expected a finite number, got {_show(value)}") from None
            if not math.isfinite(number):
                raise ConfigError(f"{path}: expected a finite number, got {_show(value)}")
            return number
        raise ConfigError(f"{path}: expected a number, got {_show(value)}{_hint(value, 'float')}")
    if tp is str:
        if isinstance(value, str):
            return value
        hint = " (quote it to keep it as text)" if isinstance(value, (bool, int, float)) else ""
        raise ConfigError(f"{path}: expected a string, got {_show(value)}{hint}")
    raise ConfigError(f"{path}: unsupported field type {tp!r}")  # pragma: no cover


def _from_mapping(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of {cls.__name__} fields, got {_show(data)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"unknown config key '{path}'; known keys here: {', '.join(names)}")
        kwargs[key] = _convert(value, hints[key], path)
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.init and f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        keys = ", ".join(repr(m) for m in missing)
        raise ConfigError(f"{prefix or 'config'}: missing required key{'s' if len(missing) > 1 else ''} {keys}")
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{prefix or 'config'}: {exc}") from None


def from_dict(data: Mapping[str, Any] | None) -> RunConfig:
    """Build and validate a :class:`RunConfig` from plain data (e.g. parsed YAML)."""
    cfg = _from_mapping(RunConfig, data or {}, "")
    validate(cfg)
    return cfg


def to_dict(cfg: Any) -> Any:
    """Plain-data form of a config (lists for tuples), suitable for YAML and JSON."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, Mapping):
        return {str(k): to_dict(v) for k, v in cfg.items()}
    return cfg


_FLOAT32_MAX = 3.4028234663852886e38
_MAX_THREADS = max(4 * (os.cpu_count() or 1), 64)


def _check(cond: bool, field_path: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{field_path}: {message}")


def validate(cfg: RunConfig) -> None:
    """Reject impossible values with one message naming the field."""
    d, t, b = cfg.data, cfg.train, cfg.budget
    _check(d.num_clients >= 1, "data.num_clients", f"must be at least 1, got {d.num_clients}")
    _check(d.alpha > 0, "data.alpha", f"the Dirichlet concentration must be > 0, got {d.alpha}")
    _check(d.shards_per_client >= 1, "data.shards_per_client", "must be at least 1")
    _check(d.min_partition_size >= 1, "data.min_partition_size", "must be at least 1")
    _check(
        d.partition != "natural" or d.dataset == "femnist",
        "data.partition",
        f"natural makes one client per writer and needs a dataset with writers (femnist); {d.dataset} has none",
    )
    _check(0 <= d.server_fraction < 1, "data.server_fraction", f"must be in [0, 1), got {d.server_fraction}")
    _check(0 < d.server_classes <= 1, "data.server_classes", f"must be in (0, 1], got {d.server_classes}")
    _check(0 <= d.public_fraction < 1, "data.public_fraction", f"must be in [0, 1), got {d.public_fraction}")
    _check(0 <= d.val_fraction <= 0.5, "data.val_fraction", f"must be in [0, 0.5], got {d.val_fraction}")
    _check(
        d.server_fraction + d.public_fraction + d.val_fraction < 0.9,
        "data.public_fraction" if d.val_fraction == 0 else "data.val_fraction",
        "server_fraction + public_fraction + val_fraction leave too little data for the clients",
    )
    _check(d.synthetic_size >= 10, "data.synthetic_size", "must be at least 10")
    _check(cfg.model.width > 0, "model.width", f"must be > 0, got {cfg.model.width}")
    from fedhetero.models import list_models

    known = list_models()
    _check(cfg.model.name in known, "model.name", f"unknown model {cfg.model.name!r}; available: {', '.join(known)}")
    _check(t.rounds >= 1, "train.rounds", f"must be at least 1, got {t.rounds}")
    _check(
        0 < t.sample_rate <= 1,
        "train.sample_rate",
        f"the fraction of clients sampled per round must be in (0, 1], got {t.sample_rate}",
    )
    _check(t.local_epochs >= 1, "train.local_epochs", f"must be at least 1, got {t.local_epochs}")
    _check(t.batch_size >= 1, "train.batch_size", f"must be at least 1, got {t.batch_size}")
    _check(t.lr > 0, "train.lr", f"must be > 0, got {t.lr}")
    # the optimiser computes in the model's dtype: a value it cannot hold overflows in every step
    top = _FLOAT32_MAX if cfg.dtype == "float32" else math.inf
    for name, value in (("lr", t.lr), ("weight_decay", t.weight_decay), ("clip_grad_norm", t.clip_grad_norm)):
        _check(value is None or value <= top, f"train.{name}", f"must be at most {top:.4g} (the largest {cfg.dtype}), got {value}")
    _check(0 <= t.momentum < 1, "train.momentum", f"must be in [0, 1), got {t.momentum}")
    _check(t.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {t.weight_decay}")
    _check(t.eval_every >= 1, "train.eval_every", "must be at least 1")
    _check(t.checkpoint_every >= 1, "train.checkpoint_every", "must be at least 1")
    _check(t.eval_batch_size >= 1, "train.eval_batch_size", "must be at least 1")
    _check(
        t.target_accuracy is None or 0 < t.target_accuracy <= 1,
        "train.target_accuracy",
        f"must be a fraction in (0, 1] or null, got {t.target_accuracy}",
    )
    _check(
        t.clip_grad_norm is None or t.clip_grad_norm > 0,
        "train.clip_grad_norm",
        f"must be > 0 or null (no clipping), got {t.clip_grad_norm}",
    )
    _check(0 <= t.lr_min <= t.lr, "train.lr_min", f"must be in [0, train.lr={t.lr:g}], got {t.lr_min}")
    _check(t.lr_power > 0, "train.lr_power", f"must be > 0, got {t.lr_power}")
    _check(
        t.local_steps is None or 1 <= t.local_steps <= 10**7,
        "train.local_steps",
        f"must be between 1 and 10000000 or null (use train.local_epochs), got {t.local_steps}",
    )
    _check(
        not t.nesterov or (t.momentum > 0 and t.optimizer_state != "none"),
        "train.nesterov",
        "Nesterov momentum needs train.momentum > 0 and train.optimizer_state other than 'none'",
    )
    _check(len(b.tiers) >= 1, "budget.tiers", "at least one tier is required")
    names = [tier.name for tier in b.tiers]
    _check(len(set(names)) == len(names), "budget.tiers", f"tier names must be unique, got {names}")
    for i, tier in enumerate(b.tiers):
        _check(tier.ratio > 0, f"budget.tiers[{i}].ratio", f"must be > 0, got {tier.ratio}")
        _check(tier.share >= 0, f"budget.tiers[{i}].share", f"must be >= 0, got {tier.share}")
    total = sum(tier.share for tier in b.tiers)
    _check(
        abs(total - 1.0) <= 1e-6,
        "budget.tiers",
        f"the tier shares must sum to 1, got {total:g} ({', '.join(f'{n}={s:g}' for n, s in zip(names, [x.share for x in b.tiers]))})",
    )
    _check(0 <= b.change < 1, "budget.change", f"must be in [0, 1), got {b.change}")
    _check(0 < b.min_ratio <= b.max_ratio, "budget.min_ratio", "must satisfy 0 < min_ratio <= max_ratio")
    _check(
        cfg.threads is None or 1 <= cfg.threads <= _MAX_THREADS,
        "threads",
        f"must be between 1 and {_MAX_THREADS} or null, got {cfg.threads}",
    )
    _check(0 <= cfg.seed < 2**63, "seed", f"must be a whole number in [0, 2^63), got {cfg.seed}")
    _check(
        cfg.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", cfg.device) is not None,
        "device",
        f"expected 'cpu', 'cuda' or 'cuda:N', got {cfg.device!r}",
    )
    _check(t.rounds <= 10**6, "train.rounds", f"must be at most 1000000, got {t.rounds}")
    _check(t.local_epochs <= 10**4, "train.local_epochs", f"must be at most 10000, got {t.local_epochs}")
    _check(d.num_clients <= 10**6, "data.num_clients", f"must be at most 1000000, got {d.num_clients}")
    _check(t.batch_size <= 10**6, "train.batch_size", f"must be at most 1000000, got {t.batch_size}")
    _check(
        1 / 64 <= cfg.model.width <= 64, "model.width", f"must be between 1/64 and 64, got {cfg.model.width}"
    )
    for i, tier in enumerate(b.tiers):
        _check(bool(tier.name.strip()), f"budget.tiers[{i}].name", "must not be empty")
        _check(tier.ratio <= b.max_ratio, f"budget.tiers[{i}].ratio", f"must be at most budget.max_ratio={b.max_ratio:g}, got {tier.ratio:g}")
    _check(0 <= d.group_overlap < 1, "data.group_overlap", f"must be in [0, 1), got {d.group_overlap}")
    _check(
        d.partition != "session_groups" or (d.num_clients >= 2 and d.num_clients % 2 == 0),
        "data.num_clients",
        f"partition session_groups splits the clients into two equal groups: needs an even count, got {d.num_clients}",
    )
    ss = cfg.sessions
    _check(ss.count >= 0, "sessions.count", f"must be >= 0 (0: no sessions), got {ss.count}")
    _check(ss.rounds >= 1, "sessions.rounds", f"must be at least 1, got {ss.rounds}")
    _check(ss.transition_window >= 1, "sessions.transition_window", "must be at least 1")
    if ss.count:
        _check(
            t.rounds == ss.count * ss.rounds,
            "train.rounds",
            f"with sessions.count={ss.count} and sessions.rounds={ss.rounds} it must be {ss.count * ss.rounds}, got {t.rounds}",
        )
        _check(ss.devices is not None or d.num_clients >= 2, "sessions.schedule", "alternate needs at least 2 clients")
        if ss.devices is not None:
            _check(len(ss.devices) == ss.count, "sessions.devices", f"lists {len(ss.devices)} sessions, sessions.count is {ss.count}")
            for i, devs in enumerate(ss.devices):
                _check(len(devs) >= 1, f"sessions.devices[{i}]", "must list at least one client id")
                _check(
                    all(0 <= c < d.num_clients for c in devs),
                    f"sessions.devices[{i}]",
                    f"client ids must be in [0, data.num_clients={d.num_clients})",
                )
    e = cfg.engine
    _check(e.workers is None or e.workers >= 1, "engine.workers", f"must be at least 1 or null, got {e.workers}")
    _check(
        e.workers is None or e.workers <= _MAX_THREADS,
        "engine.workers",
        f"must be at most {_MAX_THREADS} (each is a process; null: one per core), got {e.workers}",
    )
    _check(
        e.client_timeout_s is None or e.client_timeout_s > 0,
        "engine.client_timeout_s",
        f"must be > 0 seconds or null, got {e.client_timeout_s}",
    )
    _check(e.min_clients >= 1, "engine.min_clients", f"must be at least 1, got {e.min_clients}")
    f = e.inject_faults
    _check(0 <= f.rate <= 1, "engine.inject_faults.rate", f"must be in [0, 1], got {f.rate}")
    _check(f.rate == 0 or len(f.kinds) >= 1, "engine.inject_faults.kinds", "name at least one of raise, nan, hang")
    _check(
        f.rate == 0 or "hang" not in f.kinds or e.client_timeout_s is not None,
        "engine.inject_faults.kinds",
        "'hang' needs engine.client_timeout_s (a hung client is only dropped when its time runs out)",
    )


# ---------------------------------------------------------------------------- files


#: YAML 1.2 core-schema implicit types (https://yaml.org/spec/1.2.2/#1032-tag-resolution), tried
#: in this order: ``010`` is the decimal 10, ``0o10`` octal, ``0x10`` hex, ``1e-3`` a float, and
#: ``yes``/``no``/``on``/``off``, ``1_000``, ``1:30`` and dates are strings. YAML 1.1 (PyYAML's
#: default) would read ``010`` as 8, ``1:30`` as 90 and ``yes`` as true. ``<<`` merge keys are kept.
_CORE_SCHEMA: tuple[tuple[str, str, str], ...] = (
    ("tag:yaml.org,2002:null", r"(?:~|null|Null|NULL|)\Z", "~nN"),
    ("tag:yaml.org,2002:bool", r"(?:true|True|TRUE|false|False|FALSE)\Z", "tTfF"),
    ("tag:yaml.org,2002:int", r"(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)\Z", "-+0123456789"),
    (
        "tag:yaml.org,2002:float",
        r"(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))\Z",
        "-+.0123456789",
    ),
    ("tag:yaml.org,2002:merge", r"<<\Z", "<"),
)
_CORE_REGEX = {tag: re.compile(rx) for tag, rx, _ in _CORE_SCHEMA}
_Resolvers = dict[Any, list[tuple[str, "re.Pattern[str]"]]]


def _core_resolvers(base: _Resolvers | None = None) -> _Resolvers:
    """Implicit resolvers by first character: ``base``'s (copied) followed by the core schema's
    (the empty string stands for the empty scalar)."""
    out = {key: list(value) for key, value in (base or {}).items()}
    for tag, _, first in _CORE_SCHEMA:
        for ch in [*first, ""] if tag.endswith(":null") else list(first):
            out.setdefault(ch, []).append((tag, _CORE_REGEX[tag]))
    return out


class _StrictLoader(yaml.SafeLoader):
    """The config loader: YAML 1.2 core-schema scalars (never YAML 1.1's octal ``010``, base-60
    ``1:30`` or ``yes``-booleans), ``<<`` merge keys, and a key given twice in one mapping is an
    error (instead of last-one-wins)."""

    # PyYAML keeps the implicit resolvers per class: this class has the core schema's only
    yaml_implicit_resolvers = _core_resolvers()


def _scalar(loader: yaml.SafeLoader, node: yaml.Node, tag: str, what: str) -> str:
    text = loader.construct_scalar(node)  # type: ignore[arg-type]
    if not isinstance(text, str) or not _CORE_REGEX[tag].match(text):
        raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not {what} in YAML 1.2", node.start_mark)
    return text


def _construct_int(loader: yaml.SafeLoader, node: yaml.Node) -> int:
    text = _scalar(loader, node, "tag:yaml.org,2002:int", "an integer")
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)  # a leading zero is still decimal


def _construct_float(loader: yaml.SafeLoader, node: yaml.Node) -> float:
    text = _scalar(loader, node, "tag:yaml.org,2002:float", "a number")
    low = text.lower()
    if low.endswith(".inf"):
        return -math.inf if low.startswith("-") else math.inf
    if low == ".nan":
        return math.nan
    return float(text)


def _construct_bool(loader: yaml.SafeLoader, node: yaml.Node) -> bool:
    return _scalar(loader, node, "tag:yaml.org,2002:bool", "true or false").lower() == "true"


def _no_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    """A mapping whose explicit keys are unique; ``<<`` merge keys are merged by PyYAML (explicit
    keys win over merged ones, earlier merged mappings over later ones)."""
    seen: set[Any] = set()
    merges = 0
    for key_node, _ in node.value:
        line = key_node.start_mark.line + 1
        if key_node.tag == "tag:yaml.org,2002:merge":
            merges += 1
            if merges > 1:
                raise ConfigError(f"duplicate key '<<' (line {line}): merge several mappings with one '<<: [*a, *b]'")
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise ConfigError(f"a mapping key must be a plain value, got {key!r} (line {line})") from None
        if key in seen:
            raise ConfigError(f"duplicate key {key!r} (line {line}): each key may appear once")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _construct_float)
_StrictLoader.add_constructor("tag:yaml.org,2002:bool", _construct_bool)


class _Dumper(yaml.SafeDumper):
    """``yaml.safe_dump`` that also quotes every string YAML 1.2 would read as another type
    (``1e3``, ``0o7``), so that :func:`dump_config`'s output reads back the same with
    :class:`_StrictLoader` (and with YAML 1.1 readers)."""

    yaml_implicit_resolvers = _core_resolvers(yaml.SafeDumper.yaml_implicit_resolvers)


def parse_yaml(text: str) -> Any:
    """Parse YAML with :class:`_StrictLoader`: YAML 1.2 core-schema scalars, ``<<`` merge keys,
    duplicate keys an error (:class:`ConfigError`)."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong and where."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        what = " ".join(str(exc.problem or exc.context or "malformed").split())
        return f"{what} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else what
    return " ".join(str(exc).split())


_FILE_KINDS = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
)


def _check_config_path(p: Path) -> None:
    """A clear error unless ``p`` is a regular file (a directory, a device such as /dev/null, a
    missing file or a dangling link each say what they are)."""
    try:
        st = p.stat()
    except (FileNotFoundError, NotADirectoryError):
        if p.is_symlink():
            raise ConfigError(f"config file not found: {p} is a symbolic link to a missing file") from None
        raise ConfigError(f"config file not found: {p}") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot be read ({exc.strerror or exc})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{p}: is a directory, not a config file (give the path of a YAML file)")
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _FILE_KINDS if test(st.st_mode)), "a special file")
        raise ConfigError(f"{p}: is not a regular file ({kind}); a YAML config file is expected")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (or the defaults when ``path`` is None) and apply ``key=value`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        _check_config_path(p)
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{p}: not a text file (a YAML config is expected)") from None
        except OSError as exc:
            raise ConfigError(f"{p}: cannot be read ({exc.strerror or exc})") from None
        if "\x00" in text:
            raise ConfigError(f"{p}: not a text file (a YAML config is expected)")
        try:
            loaded = parse_yaml(text)
        except ConfigError as exc:
            raise ConfigError(f"{p}: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {_yaml_problem(exc)}") from None
        except RecursionError:
            raise ConfigError(f"{p}: not valid YAML: nested too deeply") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of config sections")
        data = loaded or {}
    data = apply_overrides(data, overrides or [])
    return from_dict(data)


def _copy_tree(data: Any, memo: dict[int, Any] | None = None) -> Any:
    """A copy of nested dicts and lists (lists for tuples) with every other value kept as it is;
    a part the data shares (a YAML alias) is copied once."""
    memo = {} if memo is None else memo
    if isinstance(data, (dict, list, tuple)) and id(data) in memo:
        return memo[id(data)]
    if isinstance(data, dict):
        out: Any = {}
        memo[id(data)] = out
        out.update((k, _copy_tree(v, memo)) for k, v in data.items())
        return out
    if isinstance(data, (list, tuple)):
        out = []
        memo[id(data)] = out
        out.extend(_copy_tree(v, memo) for v in data)
        return out
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings to a nested dict copy. Values are read as YAML 1.2 scalars
    or flow collections, as in a config file (``010`` is 10, ``yes`` a string); text that is not
    valid YAML is taken as a string."""
    out = _copy_tree(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"--set {item!r}: empty key")
        parts = key.split(".")
        if any(not part.strip() for part in parts):
            raise ConfigError(f"--set {item!r}: empty part in the key path {key!r}")
        try:
            value = parse_yaml(raw)
        except ConfigError as exc:
            raise ConfigError(f"--set {key}: {exc}") from None
        except (yaml.YAMLError, RecursionError):
            value = raw
        node = out
        for part in parts[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {key}: '{part}' is not a section")
            node = nxt
        node[parts[-1]] = value
    return out


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (read back unchanged by :func:`load_config`)."""
    return yaml.dump(to_dict(cfg), Dumper=_Dumper, sort_keys=False)


#: Fields left out of the hash, so that they may change when a run is resumed: where the work runs
#: (never changes the numbers), and how the back end treats failing clients (so that "fix the cause
#: and continue with --resume" works when the cause is a time-out, the minimum of clients or the
#: injected faults of a drill).
RESUMABLE = {"engine": ("backend", "workers", "client_timeout_s", "min_clients", "inject_faults")}
#: What was left out before the failure handling could change on resume; a run directory written
#: then still resumes (see :func:`config_hashes`).
_UNHASHED_BEFORE = {"engine": ("backend", "workers")}


def config_hashes(cfg: RunConfig) -> set[str]:
    """Every hash a run directory of this config may have recorded (the current rule's, and the
    rule's before the failure-handling fields left the hash)."""
    return {config_hash(cfg), _hash(cfg, _UNHASHED_BEFORE)}


def config_hash(cfg: RunConfig) -> str:
    """SHA-256 of the resolved config's canonical JSON form (without :data:`RESUMABLE` fields)."""
    return _hash(cfg, RESUMABLE)


def _hash(cfg: RunConfig, unhashed: Mapping[str, tuple[str, ...]]) -> str:
    data = to_dict(cfg)
    for section, keys in unhashed.items():
        for key in keys:
            data.get(section, {}).pop(key, None)
    # fields added later are hashed only when set, so runs made before them can still be resumed
    if not cfg.sessions.count:
        data.pop("sessions", None)
    if cfg.data.group_overlap == 0.0:
        data["data"].pop("group_overlap", None)
    if cfg.data.val_fraction == 0.0:
        data["data"].pop("val_fraction", None)
    if not cfg.engine.vectorize:
        data["engine"].pop("vectorize", None)
    if cfg.model.weights is None:
        data["model"].pop("weights", None)
    if not cfg.model.weights_partial:
        data["model"].pop("weights_partial", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
