"""Federated algorithms, one module each, discovered by name.

Every module in this package that defines :class:`~fedhetero.algorithms.base.Algorithm`
subclasses with a ``name`` registers them; :func:`get_algorithm` looks a name up and
:func:`list_algorithms` lists what is available.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.config import RunConfig

from fedhetero.algorithms.base import Algorithm, ClientInfo, ClientResult, ClientTask, ClientUpdate

__all__ = [
    "Algorithm",
    "ClientInfo",
    "ClientResult",
    "ClientTask",
    "ClientUpdate",
    "build_algorithm",
    "get_algorithm",
    "list_algorithms",
]

_REGISTRY: dict[str, type[Algorithm]] | None = None


def _discover() -> dict[str, type[Algorithm]]:
    global _REGISTRY
    if _REGISTRY is None:
        found: dict[str, type[Algorithm]] = {}
        for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            if info.name.startswith("_") or info.name == "base":
                continue
            module = importlib.import_module(f"{__name__}.{info.name}")
            for obj in vars(module).values():
                if (
                    isinstance(obj, type)
                    and issubclass(obj, Algorithm)
                    and obj.__module__ == module.__name__
                    and obj.name != "base"
                ):
                    if obj.name in found:
                        raise RuntimeError(f"two algorithms are named {obj.name!r}")
                    found[obj.name] = obj
        _REGISTRY = found
    return _REGISTRY


def list_algorithms() -> list[str]:
    """Names of every available algorithm, sorted."""
    return sorted(_discover())


def _import_path(name: str) -> type[Algorithm]:
    """``package.module:Class`` or ``path/to/file.py:Class``: an algorithm outside this package."""
    from fedhetero.config import ConfigError

    where, _, attr = name.rpartition(":")
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            mod_name = f"_fedhetero_user_{path.stem}"
            module = sys.modules.get(mod_name)
            if module is None:
                spec = importlib.util.spec_from_file_location(mod_name, path)
                if spec is None or spec.loader is None or not path.is_file():
                    raise ImportError(f"no such file: {path}")
                module = importlib.util.module_from_spec(spec)
                sys.modules[mod_name] = module
                spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        cls = getattr(module, attr)
    except (ImportError, AttributeError, OSError, SyntaxError) as exc:
        raise ConfigError(f"algorithm.name: cannot load {name!r} ({type(exc).__name__}: {exc})") from None
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise ConfigError(f"algorithm.name: {name!r} is not a fedhetero.algorithms.Algorithm subclass")
    return cls


def get_algorithm(name: str) -> type[Algorithm]:
    """The algorithm class registered under ``name``, or loaded from ``module:Class`` /
    ``file.py:Class`` for an algorithm of your own (worker processes and Flower nodes load it the
    same way)."""
    if ":" in name:
        return _import_path(name)
    if _REGISTRY is None and name.isidentifier() and not name.startswith("_"):
        # fast path for a fresh process (a worker, a Flower node): the module named after the
        # algorithm usually defines it, and importing every method's module costs about a second
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ImportError:
            module = None
        if module is not None:
            for obj in vars(module).values():
                if isinstance(obj, type) and issubclass(obj, Algorithm) and obj.__module__ == module.__name__ and obj.name == name:
                    return obj
    registry = _discover()
    if name not in registry:
        from fedhetero.config import ConfigError

        raise ConfigError(f"algorithm.name: unknown algorithm {name!r}; available: {', '.join(sorted(registry))}")
    return registry[name]


def build_algorithm(cfg: "RunConfig") -> Algorithm:
    """Instantiate the configured algorithm with validated options."""
    from fedhetero.config import _from_mapping

    from fedhetero.config import ConfigError

    cls = get_algorithm(cfg.algorithm.name)
    try:
        options = _from_mapping(cls.Options, dict(cfg.algorithm.options), "algorithm.options")
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:  # a range check of the options class
        msg = str(exc)
        raise ConfigError(msg if msg.startswith("algorithm.options") else f"algorithm.options ({cfg.algorithm.name}): {msg}") from None
    return cls(options)
