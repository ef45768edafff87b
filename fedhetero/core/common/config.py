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
from typing import Any, Callable, ClassVar, Iterable, Literal, Mapping

import yaml

from fedhetero.core.common.names import Registry


__all__ = [
    "AlgorithmConfig",
    "BACKENDS",
    "BudgetConfig",
    "ConfigError",
    "EXTERNAL_BACKENDS",
    "LOGGERS",
    "MethodOptions",
    "OPTIONS_PATH",
    "RESUMABLE",
    "SCENARIOS",
    "DataConfig",
    "ModelConfig",
    "RunConfig",
    "SessionsConfig",
    "TierConfig",
    "TrainConfig",
    "apply_overrides",
    "backend_names",
    "logger_names",
    "check_fields",
    "config_hash",
    "config_hashes",
    "dump_config",
    "from_dict",
    "load_config",
    "option",
    "require",
    "to_dict",
]


class ConfigError(ValueError):
    """A config field is unknown, has the wrong type or an impossible value."""


# ---------------------------------------------------------------------------- constraints
#
# One way to state what a field accepts, one message style ("<path>: must be …, got …"):
#
# * a range or a set of names that concerns one field is declared where the field is declared,
#   ``lr: float = option(0.05, gt=0)``, and checked by :func:`from_mapping` (config sections and
#   method options alike), by :func:`validate` and, for :class:`MethodOptions`, on construction;
# * a check that involves several fields (or the run's data) calls :func:`require` with the path of
#   the field to change: in :func:`validate` for the config, in ``__post_init__`` for options.


def require(cond: bool, path: str, message: str) -> None:
    """Raise ``ConfigError("<path>: <message>")`` unless ``cond``: the one way a check outside a
    field's declaration reports a bad value. ``path`` names the field to change (``train.lr_min``,
    ``budget.tiers[1].ratio``, ``algorithm.options.small_q``)."""
    if not cond:
        raise ConfigError(f"{path}: {message}")


#: Where an algorithm's options live in a run config (the path their messages name).
OPTIONS_PATH = "algorithm.options"

_RULE = "fedhetero.rule"  # field metadata: the declared constraint (:class:`_Rule`)
_LATER = "fedhetero.added_later"  # field metadata: the config-hash rule of a field added later

_Names = Callable[[], Iterable[Any]]


def _bound(x: float) -> str:
    """A bound as written in a message: ``1``, ``0.5``, ``1e-05``, ``2^63``."""
    if isinstance(x, int):
        return f"2^{x.bit_length() - 1}" if x >= 2**32 and x & (x - 1) == 0 else str(x)
    return f"{x:g}"


@dataclass(frozen=True)
class _Rule:
    """A constraint declared on one field by :func:`option`: bounds or names. ``choices`` may be a
    function returning the names (a registry that is read when a value is checked)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] | _Names | None = None
    note: str = ""

    def names(self) -> tuple[Any, ...]:
        choices = self.choices() if callable(self.choices) else self.choices
        return tuple(choices or ())

    def holds(self, value: Any) -> bool:
        if self.choices is not None:
            return any(type(value) is type(c) and value == c for c in self.names())
        # written so that NaN fails every bound
        return not (
            (self.ge is not None and not value >= self.ge)
            or (self.gt is not None and not value > self.gt)
            or (self.le is not None and not value <= self.le)
            or (self.lt is not None and not value < self.lt)
        )

    def describe(self) -> str:
        """What the field accepts: ``>= 0``, ``in (0, 1]``, ``one of 'a', 'b'``."""
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.names())
        low = f"[{_bound(self.ge)}" if self.ge is not None else f"({_bound(self.gt)}" if self.gt is not None else None
        high = f"{_bound(self.le)}]" if self.le is not None else f"{_bound(self.lt)})" if self.lt is not None else None
        if low is not None and high is not None:
            return f"in {low}, {high}"
        if low is not None:
            return (">= " if low[0] == "[" else "> ") + low[1:]
        assert high is not None
        return ("<= " if high[-1] == "]" else "< ") + high[:-1]


def option(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: Iterable[Any] | _Names | None = None,
    note: str = "",
    added_later: bool | str = False,
) -> Any:
    """A dataclass field of a config section or of an algorithm's options, with what it accepts
    declared where it is declared: bounds (``ge``/``gt``/``le``/``lt``: >=, >, <=, <) or names
    (``choices``: a tuple, or a function returning the names of a registry). A value outside gives
    ``ConfigError("<path>.<field>: must be <what> [or null] [(<note>)], got <value>")``; ``None``
    passes where the field's type allows it. A tuple value is checked item by item against
    ``choices``. A subclass that re-declares the field only to change its default keeps the rule.

    ``added_later``: the field was added after runs were made, so :func:`config_hash` hashes it
    only when it differs from its default (old run directories keep their hash and resume). On a
    section, a field name instead: the section is hashed only when that field of it differs from
    its default (``sessions`` with ``count: 0`` is no sessions at all)."""
    rule = None
    if any(b is not None for b in (ge, gt, le, lt)) or choices is not None:
        if choices is not None and any(b is not None for b in (ge, gt, le, lt)):
            raise TypeError("option(): give bounds or choices, not both")
        if (ge is not None and gt is not None) or (le is not None and lt is not None):
            raise TypeError("option(): give one lower and one upper bound at most")
        names = choices if callable(choices) or choices is None else tuple(choices)
        rule = _Rule(ge, gt, le, lt, names, note)
    metadata: dict[str, Any] = {}
    if rule is not None:
        metadata[_RULE] = rule
    if added_later:
        metadata[_LATER] = added_later
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _declared(cls: type, name: str, key: str) -> Any:
    """The metadata ``key`` of field ``name`` of dataclass ``cls``, from the first class in the MRO
    that declares it (a subclass may re-declare a field only to change its default)."""
    for klass in cls.__mro__:
        fields = klass.__dict__.get("__dataclass_fields__")
        if fields and name in fields and key in fields[name].metadata:
            return fields[name].metadata[key]
    return None


def _check_rule(cls: type, name: str, value: Any, hint: Any, path: str) -> None:
    """Check ``value`` of field ``name`` of ``cls`` (at ``path``) against its declared rule."""
    rule: _Rule | None = _declared(cls, name, _RULE)
    if rule is None or value is None:
        return
    if rule.choices is not None and isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            _check_rule(cls, name, item, None, f"{path}[{i}]")
        return
    if not rule.holds(value):
        nullable = type(None) in typing.get_args(hint)
        note = f" ({rule.note})" if rule.note else ""
        raise ConfigError(f"{path}: must be {rule.describe()}{' or null' if nullable else ''}{note}, got {_show(value)}")


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """The resolved field types of dataclass ``cls`` (cached)."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def check_fields(obj: Any, path: str) -> None:
    """Check every field of the dataclass ``obj`` (and of the dataclasses it holds) as a config
    value at ``path`` is checked: its type, then its declared :func:`option` rule. ``path`` prefixes
    the field names in messages (``"algorithm.options"``, ``"train"``; ``""``: the top level)."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        where = f"{path}.{f.name}" if path else f.name
        value = getattr(obj, f.name)
        _convert(value, hints[f.name], where)
        _check_rule(type(obj), f.name, value, hints[f.name], where)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_fields(value, where)
        elif isinstance(value, tuple):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item) and not isinstance(item, type):
                    check_fields(item, f"{where}[{i}]")


class MethodOptions:
    """Base of an algorithm's options dataclass: made from a config or in code, every field is
    checked as :data:`OPTIONS_PATH` (its type and its :func:`option` rule), so ``FedProxOptions(mu=-1)``
    raises the ``ConfigError`` a config would. Cross-field checks go in the subclass's
    ``__post_init__``: call ``super().__post_init__()`` first, then :func:`require`.

    A run records the options it was made with (every field, defaults filled in), so that a
    resumed run never goes on with a default that changed since. A subclass whose default
    changed names the value it had before in :attr:`earlier_defaults`: a run directory made
    before runs recorded their options, that does not set that option, was made with it."""

    #: option name -> its default before it changed (see above)
    earlier_defaults: ClassVar[Mapping[str, Any]] = {}

    def __post_init__(self) -> None:
        check_fields(self, OPTIONS_PATH)


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
        return from_mapping(tp, value, path)
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


def from_mapping(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of {cls.__name__} fields, got {_show(data)}")
    if not dataclasses.is_dataclass(cls):
        raise ConfigError(f"{prefix or 'config'}: {getattr(cls, '__name__', cls)!s} is not a dataclass (declare it with @dataclass)")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"unknown config key '{path}'; known keys here: {', '.join(names)}")
        kwargs[key] = _convert(value, hints[key], path)
        _check_rule(cls, key, kwargs[key], hints[key], path)
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
    except ConfigError as exc:
        # options name their fields under OPTIONS_PATH; read elsewhere (DynInit's host_options),
        # the message names them where they are
        msg = str(exc)
        if prefix != OPTIONS_PATH and msg.startswith(OPTIONS_PATH + "."):
            raise ConfigError(prefix + msg[len(OPTIONS_PATH):]) from None
        raise


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
