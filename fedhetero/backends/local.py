"""The ``local`` back end: this process, one client after another (the reference every other back
end matches)."""

from __future__ import annotations

from typing import Any

import torch

from fedhetero.core.run.backend import Backend, run_tasks
from fedhetero.core.common.config import RunConfig
from fedhetero.core.local.context import ClientContext

__all__ = ["LocalBackend"]


class LocalBackend(Backend):
    """In this process, one client after another, on a client context of its own (it shares the
    read-only data set with the server but none of its state)."""

    name = "local"

    def __init__(self, cfg: RunConfig, data: Any) -> None:
        self.cfg = cfg
        self.ctx = ClientContext(cfg, data, torch.device(cfg.device))

    def run(self, algorithm, tasks, states, on_done=None):  # type: ignore[no-untyped-def]
        cls, options = type(algorithm), algorithm.options
        return run_tasks(lambda: cls(options), self.ctx, tasks, states, on_done)
