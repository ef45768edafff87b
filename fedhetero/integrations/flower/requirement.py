"""Whether Flower, the optional ``flower`` extra, is installed, and what to install when not.

Its own module so that the package and the modules that import Flower share one message without
importing each other.
"""

from __future__ import annotations

__all__ = ["MISSING", "require_flwr"]

MISSING = (
    "fedhetero's Flower back end needs Flower: pip install \"fedhetero[flower]\" "
    "(or: pip install \"flwr[simulation]>=1.21,<2\")"
)


def require_flwr() -> None:
    """Raise an :class:`ImportError` that says what to install when Flower is missing."""
    try:  # deferred: this is the check whether flwr, the optional "flower" extra, is installed
        import flwr  # noqa: F401
        from flwr.app import Message  # noqa: F401  (the Message API: flwr >= 1.21)
    except ImportError as exc:
        raise ImportError(MISSING) from exc
