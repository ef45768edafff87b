"""One way to register a name: :class:`Registry`, used for methods, back ends and loggers.

A registry maps names to objects of one kind. Built-in entries are ``"module:attr"`` strings,
imported the first time a run asks for them, so listing or checking names imports nothing (the
config checks ``engine.backend`` and ``loggers`` without importing a back end or a logger, and the
core imports no method). Entries of your own are added with :meth:`Registry.register`, as a
decorator (``@LOGGERS.register("mine")``) or with a ``"module:attr"`` target.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Names of one kind (``what``: "back end", "logger", …) and their objects.

    ``builtin``: the built-in entries, ``name -> "module:attr"`` (or a function giving them, read
    on every lookup, for a table that lives in a package the registry may not import).
    ``check``: what an object must satisfy to be registered (a message when it does not).
    ``error``: the exception an unknown name raises (its message names ``field`` and the names
    available)."""

    def __init__(
        self,
        field: str,
        what: str,
        builtin: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None,
        *,
        check: Callable[[Any], str | None] | None = None,
        error: type[Exception] = KeyError,
    ) -> None:
        self.field = field
        self.what = what
        self._builtin = builtin if builtin is not None else {}
        self._check = check
        self._error = error
        self._added: dict[str, T | str] = {}

    # ------------------------------------------------------------------ names
    def builtin(self) -> Mapping[str, str]:
        """The built-in entries, ``name -> "module:attr"``."""
        table = self._builtin() if callable(self._builtin) else self._builtin
        return table

    def names(self) -> tuple[str, ...]:
        """Every name, the built-in ones first, in the order they were listed or added."""
        builtin = self.builtin()  # read once: for methods it is the table of another package
        return (*builtin, *(n for n in self._added if n not in builtin))

    def __contains__(self, name: object) -> bool:
        return name in self._added or name in self.builtin()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    # ------------------------------------------------------------------ entries
    def get(self, name: str) -> T:
        """The object registered as ``name`` (a ``"module:attr"`` entry is imported here)."""
        if name in self._added:
            entry = self._added[name]
        elif name in self.builtin():
            entry = self.builtin()[name]
        else:
            raise self._error(f"{self.field}: unknown {self.what} {name!r}; available: {', '.join(self.names())}")
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            obj: T = getattr(importlib.import_module(module), attr)
            return obj
        return entry

    def add(self, name: str, entry: T | str) -> None:
        """Register ``entry`` (an object, or a ``"module:attr"`` target imported on first use)
        as ``name``; a name already taken is refused (:class:`ValueError`), so is an object that
        fails the registry's check (:class:`TypeError`)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.what} needs a name, got {name!r}")
        if name in self.builtin() or (name in self._added and self._added[name] is not entry):
            raise ValueError(f"a {self.what} named {name!r} already exists")
        if not isinstance(entry, str) and self._check is not None:
            problem = self._check(entry)
            if problem is not None:
                raise TypeError(f"{self.what} {name!r}: {problem}")
        self._added[name] = entry

    def register(self, name: str) -> Callable[[T], T]:
        """Class or function decorator: :meth:`add` the decorated object as ``name``."""

        def add(obj: T) -> T:
            self.add(name, obj)
            return obj

        return add

    def remove(self, name: str) -> None:
        """Forget an entry added with :meth:`add` (built-in entries stay)."""
        if name not in self._added:
            raise KeyError(f"{self.what} {name!r} was not added to this registry")
        del self._added[name]
