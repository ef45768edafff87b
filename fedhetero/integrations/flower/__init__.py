"""The ``flower`` back end: fedhetero's client tasks on Flower's simulation and deployment engines.

Needs the extra: ``pip install "fedhetero[flower]"`` (``flwr[simulation]>=1.21,<2``, Message API).

* :func:`simulate` runs a job in Flower's simulation engine (Ray) from Python;
  ``fedhetero flower simulate`` does the same from the command line.
* :mod:`.server_app` (``app``) and :mod:`.client_app` (``app``) are the Flower ServerApp and
  ClientApp; ``fedhetero flower app DIR`` writes a Flower App that points at them, for
  ``flwr run`` on a SuperLink with SuperNodes (see ``docs/flower.md``).
* :class:`~.backend.FlowerBackend` is the :class:`~fedhetero.core.run.backend.Backend` inside the ServerApp;
  :mod:`.codec` encodes tasks and results into Flower records without pickle.

fedhetero keeps its own round loop (sampling over client ids, seeds, checkpoints, resume): a job
gives the numbers of the ``local`` back end wherever its clients run.
"""

from __future__ import annotations

from typing import Any

from fedhetero.integrations.flower.requirement import require_flwr

__all__ = ["FlowerBackend", "require_flwr", "simulate", "write_app"]


def __getattr__(name: str) -> Any:
    # deferred (PEP 562): the package must import without flwr, the optional "flower" extra
    # (require_flwr, the CLI's parser), so these are loaded on first access, after the check;
    # simulate and FlowerBackend import flwr, write_app writes an App that only Flower can run
    if name in ("simulate", "FlowerBackend", "write_app"):
        require_flwr()
    if name == "simulate":
        from fedhetero.integrations.flower.simulation import simulate

        return simulate
    if name == "FlowerBackend":
        from fedhetero.integrations.flower.backend import FlowerBackend

        return FlowerBackend
    if name == "write_app":
        from fedhetero.integrations.flower.deploy import write_app

        return write_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
