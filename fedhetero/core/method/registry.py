"""Names of methods and back ends, resolved to their classes.

Built-in methods are listed by name in :data:`fedhetero.algorithms.BUILTIN` (``name ->
"module:Class"``); their modules are imported only when a run asks for them, so the core depends
on none of them. A method of your own is named ``package.module:Class`` or ``path/to/file.py:Class``
(worker processes and Flower nodes load it the same way) or registered with :func:`register`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedhetero.core.method.algorithm import Algorithm
from fedhetero.core.common.options import OPTIONS_PATH, ConfigError, from_mapping
from fedhetero.core.common.names import Registry

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.common.config import RunConfig

__all__ = ["ALGORITHMS", "IMPORT_ERRORS", "build_algorithm", "builtin_algorithms", "get_algorithm", "import_target", "list_algorithms", "register"]

#: the package that lists the built-in methods (a name, not an import: the core imports no method)
_BUILTIN_PACKAGE = "fedhetero.algorithms"


def builtin_algorithms() -> dict[str, str]:
    """``name -> "module:Class"`` of every built-in method."""
    table: dict[str, str] = importlib.import_module(_BUILTIN_PACKAGE).BUILTIN
    return table


def _is_method(obj: Any) -> str | None:
    return None if isinstance(obj, type) and issubclass(obj, Algorithm) else f"{obj!r} is not an Algorithm subclass"


#: every method name: the built-in ones (``fedhetero.algorithms.BUILTIN``, imported on first use)
#: and those :func:`register` added in this process
ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm.name", "algorithm", builtin_algorithms,
                                                  check=_is_method, error=ConfigError)


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Make ``cls`` available under ``cls.name`` in this process (usable as a class decorator;
    ``ALGORITHMS.register(cls.name)``). Worker processes and Flower nodes do not see it: name it
    ``module:Class`` to run it there."""
    problem = _is_method(cls)
    if problem is not None:
        raise TypeError(problem)
    return ALGORITHMS.register(cls.name)(cls)


def list_algorithms() -> list[str]:
    """Names of every available algorithm, sorted."""
    return sorted(ALGORITHMS.names())


#: what :func:`import_target` raises for a target it cannot load
IMPORT_ERRORS = (ImportError, AttributeError, OSError, SyntaxError)


def import_target(target: str) -> Any:
    """``package.module:NAME`` or ``path/to/file.py:NAME`` -> the object (one of
    :data:`IMPORT_ERRORS` when it cannot be loaded). A module that is not importable as it is
    is looked for in the working directory, which then joins ``sys.path`` (worker processes
    inherit both)."""
    where, _, attr = target.rpartition(":")
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
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            # a module of the working directory, found the way uvicorn and flask find an app: the
            # `fedhetero` command's own folder is on the path, the directory it runs in is not
            here = os.getcwd()
            if exc.name != where.split(".")[0] or here in sys.path:
                raise
            sys.path.insert(0, here)
            module = importlib.import_module(where)
    return getattr(module, attr)


def _load(name: str, target: str) -> type[Algorithm]:
    """``package.module:Class`` or ``path/to/file.py:Class`` -> the class."""
    try:
        cls = import_target(target)
    except IMPORT_ERRORS as exc:
        raise ConfigError(f"algorithm.name: cannot load {name!r} ({type(exc).__name__}: {exc})") from None
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise ConfigError(f"algorithm.name: {name!r} is not a fedhetero.algorithms.Algorithm subclass")
    return cls


def get_algorithm(name: str) -> type[Algorithm]:
    """The algorithm class registered under ``name``, or loaded from ``module:Class`` /
    ``file.py:Class`` for an algorithm of your own."""
    if ":" in name:
        return _load(name, name)
    if name not in ALGORITHMS:
        raise ConfigError(f"algorithm.name: unknown algorithm {name!r}; available: {', '.join(list_algorithms())}")
    table = ALGORITHMS.builtin()
    return _load(name, table[name]) if name in table else ALGORITHMS.get(name)


def build_algorithm(cfg: "RunConfig") -> Algorithm:
    """Instantiate the configured algorithm with validated options."""
    cls = get_algorithm(cfg.algorithm.name)
    # every check of the options (types, declared rules, the class's cross-field checks) raises a
    # ConfigError naming algorithm.options.<field>
    options = from_mapping(cls.Options, dict(cfg.algorithm.options), OPTIONS_PATH)
    return cls(options)
