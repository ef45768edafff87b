"""Run configs as files: YAML read strictly (the YAML 1.2 core schema, no duplicate keys, files
only), ``key.path=value`` overrides (the CLI's ``--set``), and the resolved config written back
(:func:`dump_config`) into the run directory.
"""

from __future__ import annotations

import math
import re
import stat
from pathlib import Path
from typing import Any

import yaml




from fedhetero.core.common.config import RunConfig, from_dict, to_dict
from fedhetero.core.common.options import ConfigError

__all__ = ["apply_overrides", "dump_config", "load_config", "parse_yaml"]


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


