"""The ``local`` back end: this process, one client after another (the reference every other back
end matches)."""

from __future__ import annotations

from typing import Any

import torch

from fedhetero.core.backend import Backend, run_task, run_together
from fedhetero.core.config import RunConfig
from fedhetero.core.context import ClientContext

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
        together = run_together(lambda: cls(options), self.ctx, tasks, states)
        if together is not None:
            if on_done is not None:
                for o in together:
                    on_done(o)
            return together
        out = []
        for task in sorted(tasks, key=lambda t: t.cid):
            out.append(run_task(lambda: cls(options), self.ctx, task, states.get(task.cid)))
            if on_done is not None:
                on_done(out[-1])
        return out
