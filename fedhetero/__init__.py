"""fedhetero: federated learning across clients with very different compute.

Clients get models sized to their FLOPs budget: bigger than the global model by lossless
structural re-parameterization (:mod:`reparam`), smaller by structured pruning. See the README for
the quick start and :mod:`fedhetero.core.run.engine` for the round loop.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["__version__"]

if TYPE_CHECKING:  # pragma: no cover - for type checkers; at run time module __getattr__ imports them
    from fedhetero.core.run.api import CompareResult as CompareResult
    from fedhetero.core.run.api import RunResult as RunResult
    from fedhetero.core.run.api import compare as compare
    from fedhetero.core.run.api import run as run


def _torchvision_importable() -> None:
    """The entry points below make ``import torchvision`` / ``import timm`` work in the process:
    with the pinned install (the CPU build of torch and PyPI's torchvision, built for another
    torch) they fail otherwise (see :func:`reparam.install_torchvision_fix`)."""
    import reparam  # deferred: imports torch

    reparam.install_torchvision_fix()


def load_model(run_dir, which="final"):  # type: ignore[no-untyped-def]
    """The trained global model of a run directory, rebuilt and loaded (see :mod:`fedhetero.core.run.export`)."""
    # deferred: every `fedhetero.*` import runs this file first, so it stays free of torch
    _torchvision_importable()
    from fedhetero.core.run.export import load_model as _load

    return _load(run_dir, which)


def load_transform(run_dir):  # type: ignore[no-untyped-def]
    """The preprocessing the run's model expects: raw images of its data set → the model's input
    (see :mod:`fedhetero.core.run.export`)."""
    _torchvision_importable()
    from fedhetero.core.run.export import load_transform as _load  # deferred, as load_model

    return _load(run_dir)


__all__ += ["load_model", "load_transform"]

#: the Python API (:mod:`fedhetero.core.run.api`), imported on first use: ``import fedhetero`` (and so
#: ``fedhetero --help``) imports no torch
_API = ("run", "compare", "RunResult", "CompareResult")
__all__ += list(_API)


def __getattr__(name: str) -> Any:
    if name in _API:
        # deferred: the API imports the engine, and so torch
        _torchvision_importable()
        from fedhetero.core.run import api

        return getattr(api, name)
    raise AttributeError(f"module 'fedhetero' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
