"""The ``flower`` back end: client tasks run as Flower messages on SuperNodes.

:class:`FlowerBackend` lives inside a Flower ServerApp (:mod:`.server_app`) and talks to the nodes
through the ServerApp's ``grid``. Everything that decides the numbers stays in fedhetero's
:class:`~fedhetero.core.run.engine.Engine`: sampling (over *client ids*, never over Flower's random node
ids), seeds, aggregation, evaluation, checkpoints and resume. The back end only delivers tasks:

1. **Nodes.** On first use it waits (at most ``node_wait_s``) until the expected number of nodes has
   connected, and asks each of them (a ``query`` message) for its ``partition-id``. Node ``p`` of
   ``N`` serves the clients with ``cid % N == p``; this is deterministic whatever node ids Flower
   hands out, so a client always runs where its private state is kept.
2. **Tasks.** Each task becomes one ``train`` message to its client's node: the task and the run's
   config encoded losslessly (:mod:`.codec`). A node gets one task at a time (its next task leaves
   when its previous reply is in), so the state a node keeps for its clients is never written by
   two tasks at once.
3. **Replies** are decoded into :class:`~fedhetero.core.run.backend.Outcome` objects and returned sorted by
   client id. An error reply, a reply that does not decode, or no reply within
   ``engine.client_timeout_s`` (+ ``delivery_grace_s`` for transport) becomes a failed outcome with
   the reason; the engine drops that client from its round as on every back end.

Private client state is not sent by the server (``states`` is ignored): the ClientApp keeps it in
its node's ``context.state`` (see :mod:`.client_app`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

try:
    from flwr.app import Message, MessageType, RecordDict
except ImportError as exc:  # pragma: no cover - depends on the environment
    from fedhetero.integrations.flower.requirement import MISSING

    raise ImportError(MISSING) from exc

from fedhetero.core.method.algorithm import Algorithm
from fedhetero.core.run.backend import Backend
from fedhetero.core.common.config import RunConfig
from fedhetero.core.local.context import RunError
from fedhetero.core.exchange.types import ClientTask, Outcome
from fedhetero.integrations.flower._common import config_text
from fedhetero.integrations.flower.client_app import NODE_RECORD
from fedhetero.integrations.flower.codec import PROTOCOL, decode_outcome, encode_task, record_int

__all__ = ["FlowerBackend", "NodeInfo"]

#: a child of Flower's logger, so that the lines appear in Flower's log (``flwr log``)
log = logging.getLogger("flwr.fedhetero")


@dataclass
class NodeInfo:
    """One SuperNode as the back end sees it."""

    node_id: int
    partition: int
    info: dict[str, Any]


def _error_text(msg: Message) -> str:
    err = msg.error
    names = {
        0: "unknown",
        1: "the ClientApp could not be loaded",
        2: "the ClientApp raised an exception",
        3: "message unavailable (expired)",
        4: "reply unavailable (expired)",
        5: "node unavailable",
        6: "a mod refused the message",
        7: "invalid Flower App bundle",
        8: "the ClientApp crashed",
    }
    what = names.get(int(err.code), f"error code {err.code}")
    reason = (err.reason or "").strip()
    return f"flower: {what}" + (f": {reason}" if reason else "")


class FlowerBackend(Backend):
    """Runs client tasks on the SuperNodes a Flower ``grid`` reaches.

    Parameters
    ----------
    cfg:
        the run's config (sent to the nodes with every task; they build their client side from it).
    grid:
        the ``grid`` a ServerApp's ``main(grid, context)`` receives.
    num_nodes:
        how many nodes to wait for before the first round (None: those connected once at least one
        is, after a short settling time).
    node_wait_s:
        how long to wait for them (then a :class:`~fedhetero.core.local.context.RunError` says how many came).
    delivery_grace_s:
        added to ``engine.client_timeout_s`` for delivery (a SuperNode polls for messages and starts
        a ClientApp process per message) before a missing reply counts as a time-out.
    poll_s:
        how often replies are pulled.
    """

    name = "flower"

    def __init__(
        self,
        cfg: RunConfig,
        grid: Any,
        *,
        num_nodes: int | None = None,
        node_wait_s: float = 120.0,
        delivery_grace_s: float = 10.0,
        poll_s: float = 0.05,
        route: str = "partition-id",
    ) -> None:
        if route not in ("partition-id", "node-order"):
            raise ValueError(f"route: expected 'partition-id' or 'node-order', got {route!r}")
        self.route = route
        self.cfg = cfg
        self.grid = grid
        self.num_nodes = num_nodes
        self.node_wait_s = float(node_wait_s)
        self.delivery_grace_s = float(delivery_grace_s)
        self.poll_s = float(poll_s)
        self.timeout = cfg.engine.client_timeout_s
        self.device = torch.device(cfg.device)
        self._config, self._config_hash = config_text(cfg)
        self.nodes: list[NodeInfo] | None = None

    # ------------------------------------------------------------------ nodes
    def _wait_for_nodes(self) -> list[int]:
        want = self.num_nodes
        deadline = time.monotonic() + self.node_wait_s
        seen: list[int] = []
        stable_since = None
        while True:
            seen = sorted(int(n) for n in self.grid.get_node_ids())
            now = time.monotonic()
            if want is not None and len(seen) >= want:
                return seen
            if want is None and seen:
                # no expected count: take the nodes once the count has not changed for 2 s
                if stable_since is None or stable_since[1] != len(seen):
                    stable_since = (now, len(seen))
                elif now - stable_since[0] >= 2.0:
                    return seen
            if now >= deadline:
                expected = f"{want}" if want is not None else "at least 1"
                raise RunError(
                    f"flower: {len(seen)} node(s) connected within {self.node_wait_s:g} s, {expected} expected. "
                    "Start the SuperNodes (flower-supernode --superlink ... --node-config "
                    "\"partition-id=<i> num-partitions=<N>\"), or lower num-supernodes / raise node-wait-s"
                )
            time.sleep(0.2)

    def _query(self, node_ids: list[int]) -> list[NodeInfo]:
        msgs = [Message(RecordDict(), int(n), MessageType.QUERY, ttl=max(self.node_wait_s, 30.0), group_id="fedhetero-query") for n in node_ids]
        pending = self._push(msgs)
        replies: dict[int, Message] = {}
        deadline = time.monotonic() + max(self.node_wait_s, 30.0)
        waiting = dict(pending)  # pull only what is still outstanding: a pulled reply is gone
        while waiting and time.monotonic() < deadline:
            for reply in self.grid.pull_messages(list(waiting)):
                mid = reply.metadata.reply_to_message_id
                if mid in waiting:
                    replies[waiting.pop(mid)] = reply
            if waiting:
                time.sleep(self.poll_s)
        failed: list[str] = []
        nodes: list[NodeInfo] = []
        for n in node_ids:
            reply = replies.get(n)
            if reply is None:
                failed.append(f"node {n}: no reply to the query within {max(self.node_wait_s, 30.0):g} s")
                continue
            if reply.has_error():
                failed.append(f"node {n}: {_error_text(reply)}")
                continue
            rec = reply.content.config_records.get(NODE_RECORD)
            if rec is None:
                failed.append(f"node {n}: the reply is not from fedhetero's ClientApp")
                continue
            info = dict(rec)
            if record_int(info.get("protocol")) != PROTOCOL:
                failed.append(
                    f"node {n}: fedhetero wire protocol {info.get('protocol')!s} there, {PROTOCOL} here "
                    "(install the same fedhetero version everywhere)"
                )
                continue
            nodes.append(NodeInfo(int(n), record_int(info.get("partition-id")), info))
        if failed:
            raise RunError("flower: the nodes could not be set up: " + "; ".join(failed))
        return nodes

    def _map(self, nodes: list[NodeInfo]) -> list[NodeInfo]:
        n = len(nodes)
        parts = sorted(x.partition for x in nodes)
        if parts != list(range(n)):
            detail = ", ".join(f"node {x.node_id}: {x.partition if x.partition >= 0 else 'none'}" for x in nodes)
            raise RunError(
                f"flower: the {n} nodes must have the partition ids 0..{n - 1}, one each (got {detail}). "
                "Give every SuperNode --node-config \"partition-id=<i> num-partitions=<N>\""
            )
        declared = {int(x.info.get("num-partitions", -1)) for x in nodes} - {-1}
        if declared and declared != {n}:
            raise RunError(f"flower: nodes declare num-partitions={sorted(declared)}, but {n} node(s) are connected")
        return sorted(nodes, key=lambda x: x.partition)

    def connect(self) -> list[NodeInfo]:
        """Wait for the nodes, query them and fix the client → node map (once)."""
        if self.nodes is None:
            t0 = time.perf_counter()
            ids = self._wait_for_nodes()
            if self.route == "node-order":
                # simulated nodes are interchangeable: the k-th node id in sorted order serves the
                # clients c with c % N == k, without a query round (N messages) before round 1
                self.nodes = [NodeInfo(int(n), k, {}) for k, n in enumerate(sorted(ids))]
                rule = "the k-th node (sorted node ids) serves c % {n} == k"
            else:
                self.nodes = self._map(self._query(ids))
                rule = "client c runs on the node with partition-id c % {n}"
            log.info("%d node(s) ready in %.1f s; %s", len(self.nodes), time.perf_counter() - t0,
                     rule.format(n=len(self.nodes)))
        return self.nodes

    def node_of(self, cid: int) -> int:
        """Flower node id that runs client ``cid``."""
        nodes = self.connect()
        return nodes[int(cid) % len(nodes)].node_id

    # ------------------------------------------------------------------ messages
    def _push(self, msgs: list[Message]) -> dict[str, int]:
        """Push messages; ``{message_id: dst_node_id}`` of those the SuperLink accepted."""
        if not msgs:
            return {}
        ids = list(self.grid.push_messages(msgs))
        accepted = {str(i) for i in ids if i}
        out: dict[str, int] = {}
        for m in msgs:
            mid = str(m.metadata.message_id)
            if mid in accepted:
                out[mid] = int(m.metadata.dst_node_id)
        return out

    def _message(self, task: ClientTask) -> Message:
        content = encode_task(task, None, config=self._config, config_hash=self._config_hash)
        ttl = None
        if self.timeout is not None:
            ttl = max(60.0, 2 * (self.timeout + self.delivery_grace_s))
        return Message(content, self.node_of(task.cid), MessageType.TRAIN, ttl=ttl, group_id=f"{task.round}.{task.step}")

    def run(
        self,
        algorithm: Algorithm,
        tasks: list[ClientTask],
        states: dict[int, dict[str, Any] | None],
        on_done: Callable[[Outcome], None] | None = None,
    ) -> list[Outcome]:
        """Send every task to its client's node and collect the outcomes (sorted by client id)."""
        order = sorted(tasks, key=lambda t: t.cid)
        if not order:
            return []
        nodes = self.connect()
        t0 = time.perf_counter()
        queues: dict[int, list[ClientTask]] = {x.node_id: [] for x in nodes}
        for task in order:
            queues[self.node_of(task.cid)].append(task)
        done: dict[int, Outcome] = {}
        inflight: dict[str, tuple[ClientTask, float]] = {}  # message id -> (task, sent at)

        def finish(task: ClientTask, outcome: Outcome) -> None:
            done[task.cid] = outcome
            if on_done is not None:
                on_done(outcome)

        def send_next(node: int) -> None:
            while queues[node]:
                task = queues[node].pop(0)
                try:
                    msg = self._message(task)
                    accepted = self._push([msg])
                except Exception as exc:  # noqa: BLE001 - an encoding error is this client's failure
                    finish(task, Outcome(task, None, f"flower: could not send the task: {type(exc).__name__}: {exc}", kind="lost"))
                    continue
                if not accepted:
                    finish(task, Outcome(task, None, "flower: the SuperLink did not accept the task message (too large?)", kind="lost"))
                    continue
                (mid,) = accepted
                inflight[mid] = (task, time.perf_counter())
                return

        for node in queues:
            send_next(node)
        limit = None if self.timeout is None else self.timeout + self.delivery_grace_s
        while inflight:
            replies = list(self.grid.pull_messages(list(inflight)))
            now = time.perf_counter()
            for reply in replies:
                mid = reply.metadata.reply_to_message_id
                if mid not in inflight:
                    continue
                task, sent = inflight.pop(mid)
                if reply.has_error():
                    outcome = Outcome(task, None, _error_text(reply), now - sent, kind="lost")
                else:
                    try:
                        outcome = decode_outcome(reply.content, task, self.device)
                    except Exception as exc:  # noqa: BLE001 - a bad reply drops this client only
                        outcome = Outcome(
                            task, None, f"flower: the reply could not be decoded: {type(exc).__name__}: {exc}", now - sent,
                            kind="lost",
                        )
                finish(task, outcome)
                send_next(self.node_of(task.cid))
            if limit is not None:
                for mid, (task, sent) in list(inflight.items()):
                    if now - sent > limit:
                        del inflight[mid]
                        finish(
                            task,
                            Outcome(
                                task,
                                None,
                                f"timeout: no reply from node {self.node_of(task.cid)} within "
                                f"engine.client_timeout_s={self.timeout:g} s (+{self.delivery_grace_s:g} s for delivery)",
                                now - sent,
                                kind="timeout",
                            ),
                        )
                        send_next(self.node_of(task.cid))
            if inflight and not replies:
                time.sleep(self.poll_s)
        failed = sum(1 for o in done.values() if o.result is None)
        log.info("round %s: %d task(s) on %d node(s) in %.2f s, %d failed", order[0].round, len(order),
                 len({self.node_of(t.cid) for t in order}),
                 time.perf_counter() - t0, failed)
        return [done[t.cid] for t in order]

    def close(self) -> None:
        """Nothing to release: the nodes belong to the Flower runtime."""
