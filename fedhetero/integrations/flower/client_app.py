"""fedhetero's Flower ClientApp: runs the client half of any fedhetero algorithm on a SuperNode.

* ``query`` messages are answered with the node's ``partition-id`` / ``num-partitions`` (from its
  node config; the simulation engine sets them, a SuperNode gets them from ``--node-config``) and
  versions, so the ServerApp can map client ids onto nodes.
* ``train`` messages carry one :class:`~fedhetero.core.method.algorithm.ClientTask` and the run's config
  (:mod:`fedhetero.integrations.flower.codec`). The client side (data set, model builder, trainer:
  a :class:`~fedhetero.core.local.context.ClientContext`) is built from that config once per process and
  cached by the config's hash; the task runs through :func:`fedhetero.core.run.backend.run_task`, exactly as
  on the embedded back ends, and the :class:`~fedhetero.core.run.backend.Outcome` goes back encoded.

A client's private state (``ClientResult.client_state``) stays on the node: it is kept in the
node's ``context.state`` under the client id (with the round that wrote it, so a task reads the
newest state written before its round, as the server-side store does) and is not sent to the
server. A state is kept only when the server will accept the result (no error, no time-out, a
finite upload). Flower keeps ``context.state`` per run: a new run (also a resumed one) starts with
no client state.
"""

from __future__ import annotations

import json
import os
import platform
import socket
from dataclasses import dataclass
from typing import Any

import flwr
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

import fedhetero
from fedhetero.core.common.config import RunConfig, from_dict
from fedhetero.core.exchange.types import Outcome, check_result
from fedhetero.core.run.backend import run_task
from fedhetero.integrations.flower._common import (
    parse_config,
    run_config_get,
    split_overrides,
)
from fedhetero.integrations.flower.codec import (
    PROTOCOL,
    decode_task,
    decode_value,
    encode_outcome,
    encode_value,
)
from fedhetero.core.method.registry import build_algorithm
from fedhetero.core.run.allocator import tune_malloc
from fedhetero.core.local.context import client_context
from fedhetero.integrations.flower.codec import META

# an app Flower loads is an entry point: torchvision and timm import here with the pinned install
fedhetero._torchvision_importable()

try:  # flwr >= 1.21
    from flwr.clientapp import ClientApp
except ImportError:  # pragma: no cover - older flwr
    from flwr.client import ClientApp  # type: ignore[no-redef]

__all__ = ["NODE_RECORD", "app", "load_client_state", "node_info", "store_client_state"]

NODE_RECORD = "fedhetero.node"
_STATE_PREFIX = "fedhetero.state."

app = ClientApp()


@dataclass
class _ClientSide:
    cfg: RunConfig
    ctx: Any  # fedhetero.core.local.context.ClientContext
    cls: type
    options: Any


_SIDE: dict[str, _ClientSide] = {}


def _client_side(config_json: str, config_hash: str, context: Context) -> _ClientSide:
    """The client side for this config, built once per process (the latest config only)."""
    key = config_hash or config_json
    hit = _SIDE.get(key)
    if hit is not None:
        return hit
    if config_json:
        cfg = from_dict(json.loads(config_json))
    else:  # a task without a config: fall back to the run config of the Flower App
        rc = context.run_config
        cfg = parse_config(run_config_get(rc, "config", ""), split_overrides(run_config_get(rc, "set", "")))
    torch.set_num_threads(cfg.threads or 1)
    if cfg.tune_malloc and cfg.device == "cpu":
        tune_malloc()

    ctx = client_context(cfg)
    proto = build_algorithm(cfg)
    _SIDE.clear()
    side = _SIDE[key] = _ClientSide(cfg, ctx, type(proto), proto.options)
    return side


# ---------------------------------------------------------------------------------- node state
def _versions(state: RecordDict, cid: int) -> list[int]:
    prefix = f"{_STATE_PREFIX}{cid}."
    return sorted(int(k[len(prefix):]) for k in state.config_records if k.startswith(prefix))


def load_client_state(state: RecordDict, cid: int, before_round: int, device: torch.device | None = None,
                      prelude: bool = False) -> dict[str, Any] | None:
    """The newest private state of client ``cid`` kept on this node and written before
    ``before_round`` (``prelude``: before that round's prelude exchange; None if there is none).
    Versions are kept by tick: ``2r`` for round ``r``, ``2r − 1`` for the prelude of round ``r``."""
    tick = 2 * int(before_round) - (1 if prelude else 0)
    ticks = [r for r in _versions(state, cid) if r < tick]
    if not ticks:
        return None
    key = f"{_STATE_PREFIX}{cid}.{ticks[-1]}"
    arrays = state.array_records.get(f"{key}.arrays", ArrayRecord())
    return decode_value(str(state.config_records[key]["doc"]), arrays, device)


def store_client_state(state: RecordDict, cid: int, rnd: int, value: dict[str, Any], prelude: bool = False) -> None:
    """Keep ``value`` as client ``cid``'s state written in round ``rnd`` (or its prelude),
    dropping the versions no later task can read (all but the newest one before it)."""
    text, arrays = encode_value(value, f"client_state[cid={cid}]")
    versions = _versions(state, cid)
    rnd = 2 * int(rnd) - (1 if prelude else 0)
    keep = [r for r in versions if r < rnd][-1:]
    for r in versions:
        if r not in keep:
            key = f"{_STATE_PREFIX}{cid}.{r}"
            for name in (key, f"{key}.arrays"):
                if name in state:
                    del state[name]
    key = f"{_STATE_PREFIX}{cid}.{rnd}"
    state[key] = ConfigRecord({"doc": text, "round": int(rnd)})
    if arrays:
        state[f"{key}.arrays"] = ArrayRecord(arrays)


# ---------------------------------------------------------------------------------- handlers
def node_info(context: Context) -> ConfigRecord:
    """What a node tells the server about itself (the reply to a ``query`` message)."""
    nc = dict(context.node_config)
    info: dict[str, Any] = {
        "protocol": PROTOCOL,
        "partition-id": int(nc["partition-id"]) if "partition-id" in nc else -1,
        "num-partitions": int(nc["num-partitions"]) if "num-partitions" in nc else -1,
        "node-config": json.dumps({str(k): v for k, v in nc.items()}, default=str),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "flwr": str(getattr(flwr, "__version__", "")),
        "fedhetero": fedhetero.__version__,
    }
    return ConfigRecord(info)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Reply with this node's partition id and versions."""
    return Message(RecordDict({NODE_RECORD: node_info(context)}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Run one client task and reply with its encoded outcome."""
    meta = msg.content.config_records.get(META)
    config_json = str(meta.get("config", "")) if meta is not None else ""
    config_hash = str(meta.get("config-hash", "")) if meta is not None else ""
    side = _client_side(config_json, config_hash, context)
    task, state, _, _ = decode_task(msg.content, side.ctx.device)
    if state is None:
        state = load_client_state(context.state, task.cid, task.round, side.ctx.device, prelude=task.prelude)
    cls, options = side.cls, side.options
    outcome: Outcome = run_task(lambda: cls(options), side.ctx, task, state)
    res = outcome.result
    if res is not None and res.client_state is not None:
        private, res.client_state = res.client_state, None  # stays on this node
        if check_result(outcome, side.cfg.engine.client_timeout_s) is None:
            store_client_state(context.state, task.cid, task.round, private, prelude=task.prelude)
    return Message(encode_outcome(outcome), reply_to=msg)
