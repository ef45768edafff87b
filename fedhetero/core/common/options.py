"""Declaring and checking options, for the run config's sections and every method's options.

:func:`option` states what a field accepts where it is declared (bounds, choices, a note, when it
was added); :class:`MethodOptions` is the base of a method's options; :func:`from_mapping` turns a
mapping into such a dataclass with one :class:`ConfigError` per bad field, naming it
(``algorithm.options.server_lr: must be > 0, got -1``); :func:`require` states a check across
fields.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import numbers
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Literal, Mapping





__all__ = ["ConfigError", "MethodOptions", "OPTIONS_PATH", "check_fields", "from_mapping", "option", "require"]


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


