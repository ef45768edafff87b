"""Federated algorithms, one module each, discovered by name.

Every module in this package that defines :class:`~fedhetero.algorithms.base.Algorithm`
subclasses with a ``name`` registers them; :func:`get_algorithm` looks a name up and
:func:`list_algorithms` lists what is available.
"""

from __future__ import annotations

import importlib
import pkgutil

from fedhetero.algorithms.base import Algorithm, ClientInfo, ClientUpdate

__all__ = ["Algorithm", "ClientInfo", "ClientUpdate", "get_algorithm", "list_algorithms"]

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


def get_algorithm(name: str) -> type[Algorithm]:
    """The algorithm class registered under ``name``."""
    registry = _discover()
    if name not in registry:
        from fedhetero.config import ConfigError

        raise ConfigError(f"algorithm.name: unknown algorithm {name!r}; available: {', '.join(sorted(registry))}")
    return registry[name]
