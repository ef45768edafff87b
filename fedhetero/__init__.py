"""fedhetero: federated learning across clients with very different compute.

Clients get models sized to their FLOPs budget: bigger than the global model by lossless
structural re-parameterization (:mod:`reparam`), smaller by structured pruning. See the README for
the quick start and :mod:`fedhetero.core.engine` for the round loop.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]


def load_model(run_dir, which="final"):  # type: ignore[no-untyped-def]
    """The trained global model of a run directory, rebuilt and loaded (see :mod:`fedhetero.core.export`)."""
    # deferred: every `fedhetero.*` import runs this file first, so it stays free of torch
    from fedhetero.core.export import load_model as _load

    return _load(run_dir, which)


__all__ += ["load_model"]
