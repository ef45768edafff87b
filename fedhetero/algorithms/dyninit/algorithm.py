"""DynInit: initial-model construction under device arrival and departure (Chang et al.).

A run with sessions (``sessions.count``) changes its devices at every transition. DynInit wraps
any host algorithm that trains one global model (``host``: fedavg, fedprox, scaffold, moon,
fedacg, …) and touches the global model only at session starts:

1. **Pilot** (sessions ``1..P``, ``pilot_sessions``): the host trains as usual; the final models of
   these sessions make the pilot model ``w_pilot`` (their mean, or an EMA with ``ema_decay``).
2. **Gradient round** (every later session ``s``, before its first round): ``grad_rounds`` extra
   rounds of the host from ``w_pilot`` on the session's devices (``grad_devices_frac`` of them),
   with a fresh server state and the constant rate ``grad_lr_factor · train.lr``; the session's
   "gradient" is the model difference ``G_s = w_grad − w_pilot``. These rounds are extra: they add
   no accuracy point and are not among the session's rounds. Their client-state side effects
   (SCAFFOLD's ``c_i``, MOON's previous model) are kept (``grad_round_updates_client_state``).
3. **Initial model** (sessions after the first post-pilot one): the distance ``d_z`` of ``G_s`` to
   the gradient of every earlier post-pilot session ``z`` (``similarity``), softmin weights
   ``μ_z ∝ exp(−R·d_z)`` (``similarity_scale`` R) and ``w_init = Σ_z μ_z·w_z``, the weighted
   average of those sessions' final models (floating entries; integer buffers from the current
   model). The first post-pilot session starts from the initial model ``w0``
   (``first_postpilot_start: reset_to_w0``) or continues (``continue``).

Distances (``similarity``), over the parameter tensors (names with "bias" left out unless
``exclude_bias`` is false):

* ``layer_normalized_l2`` (default): the mean over tensors of ``‖G_z/‖G_z‖ − G_s/‖G_s‖‖``, in
  [0, 2] (√2 for orthogonal tensors); a tensor with a zero norm in either session is skipped. The
  published R = 10 for images belongs to this distance;
* ``raw_l2``: ``‖G_s − G_z‖`` over the concatenated tensors (re-tune R: it scales with the model,
  the rate and the steps);
* ``layer_cosine``: the mean over tensors of ``1 − cos(G_z, G_s)``.

``init`` selects the method or one of its baselines, all on the same host and the same sessions:
``dyninit``; ``previous`` (continue from the last model); ``average`` (uniform average of the
earlier post-pilot final models, DynInit with R = 0); ``continuous`` (continue from the last model
and distil it: every client minimises ``CE + κ·KL(p_prev ‖ p)``, temperature 1, trained FedAvg-style
whatever the host, as in the authors' code; in the first post-pilot session the teacher is an
all-zero model as there, ``continuous_first_teacher: zero``, or none). The baselines run no pilot:
their pilot rounds are skipped and they start the first post-pilot session from ``w0``, as the
study does, so every method starts there from the same weights.

At every session start the host's server state (SCAFFOLD's ``c``, FedACG's momentum) is reset
(``reset_server_state``); the clients keep theirs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Generator, Literal, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedhetero.algorithms import get_algorithm
from fedhetero.core.method.algorithm import Algorithm, Exchanges
from fedhetero.core.common.options import OPTIONS_PATH, MethodOptions, from_mapping, option, require
from fedhetero.core.local.objective import Batch, LocalObjective, LocalPlan, LossRule
from fedhetero.core.hetero.sessions import transition_accuracy
from fedhetero.core.exchange.types import ClientInfo, ClientResult, ClientTask

__all__ = [
    "DynInit",
    "DynInitOptions",
    "gradient_distance",
    "softmin_weights",
    "weighted_state",
]

_HOST_BLOCKLIST = frozenset({"dyninit"})


@dataclass(frozen=True)
class DynInitOptions(MethodOptions):
    host: str = "fedavg"  # the FL algorithm DynInit wraps
    host_options: Mapping[str, Any] = field(default_factory=dict)
    init: Literal["dyninit", "previous", "average", "continuous"] = "dyninit"
    pilot_sessions: int = option(1, ge=1)  # P
    pilot_agg: Literal["mean", "ema"] = "mean"
    ema_decay: float = option(0.5, ge=0, lt=1)  # b of the EMA pilot (oldest weight b^(P-1))
    grad_rounds: int = option(1, ge=1)  # V
    grad_lr_factor: float = option(0.5, gt=0)  # the gradient round's constant rate is this × train.lr
    grad_devices_frac: float = option(1.0, gt=0, le=1)
    grad_round_updates_client_state: bool = True
    similarity: Literal["layer_normalized_l2", "raw_l2", "layer_cosine"] = "layer_normalized_l2"
    similarity_scale: float = option(10.0, ge=0)  # R
    exclude_bias: bool = True
    history_limit: int | None = option(None, ge=1)  # H: only the last H post-pilot sessions are candidates
    first_postpilot_start: Literal["reset_to_w0", "continue"] = "reset_to_w0"
    reset_server_state: bool = True
    continuous_kl_coef: float = option(1.0, ge=0)  # κ
    continuous_first_teacher: Literal["zero", "none"] = "zero"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.host not in _HOST_BLOCKLIST, f"{OPTIONS_PATH}.host", "DynInit cannot host itself")


# ---------------------------------------------------------------------------- pure parts
def gradient_distance(g_s: Mapping[str, torch.Tensor], g_z: Mapping[str, torch.Tensor], names: list[str],
                      kind: str = "layer_normalized_l2") -> float:
    """Distance between two session gradients over the tensors ``names`` (see the module
    docstring); computed in float64."""
    if kind == "raw_l2":
        total = sum(float(((g_s[n].double() - g_z[n].double()) ** 2).sum()) for n in names)
        return math.sqrt(total)
    per: list[float] = []
    for n in names:
        a, b = g_s[n].double().flatten(), g_z[n].double().flatten()
        na, nb = float(a.norm()), float(b.norm())
        if na == 0.0 or nb == 0.0:
            continue  # no direction to compare
        if kind == "layer_normalized_l2":
            per.append(float((a / na - b / nb).norm()))
        elif kind == "layer_cosine":
            per.append(1.0 - float(a @ b) / (na * nb))
        else:
            raise ValueError(f"unknown similarity {kind!r}")
    return float(sum(per) / len(per)) if per else 0.0


def softmin_weights(distances: list[float], scale: float) -> list[float]:
    """``μ_z = exp(−R·d_z) / Σ exp(−R·d_z')`` (stable: shifted by the smallest distance)."""
    if not distances:
        return []
    lo = min(distances)
    e = [math.exp(-scale * (d - lo)) for d in distances]
    total = sum(e)
    return [v / total for v in e]


def weighted_state(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float],
                   current: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``Σ_z μ_z·w_z`` over the floating entries (accumulated in float64); integer buffers (a
    BatchNorm batch counter) are taken from ``current``."""
    out: dict[str, torch.Tensor] = {}
    for key, ref in current.items():
        if not torch.is_floating_point(ref):
            out[key] = ref.clone()
            continue
        acc = torch.zeros_like(ref, dtype=torch.float64)
        for st, w in zip(states, weights):
            acc.add_(st[key].to(torch.float64), alpha=float(w))
        out[key] = acc.to(ref.dtype)
    return out


def _ema_weights(count: int, decay: float) -> list[float]:
    """EMA weights of ``count`` pilot models, oldest first: ``b^(P−1)``, then ``(1−b)·b^(P−1−i)``."""
    if count == 1:
        return [1.0]
    return [decay ** (count - 1)] + [(1 - decay) * decay ** (count - 1 - i) for i in range(1, count)]


def _clone(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").clone() for k, v in state.items()}


def _distillation(kappa: float) -> LossRule:
    """Continuous's term ``κ·KL(p_teacher ‖ p)``, averaged over the batch."""

    def rule(b: Batch) -> torch.Tensor:
        p_t = F.softmax(b.ref("teacher"), dim=-1)
        kl = F.kl_div(F.log_softmax(b.out, dim=-1), p_t, reduction="none").sum(-1)
        return kappa * b.mean(kl)

    return rule


# ---------------------------------------------------------------------------- the algorithm
class DynInit(Algorithm):
    """DynInit (or one of its baselines) around a host FL algorithm; see the module docstring."""

    name = "dyninit"
    summary = (
        "Wraps a host method and, when devices arrive and depart between sessions, starts each session from "
        "earlier sessions' models weighted by update similarity."
    )
    paper = "Chang, Han, Hosseinalipour, Chiang, Brinton; Communication-Efficient FL under Dynamic Device Arrival and Departure"
    Options = DynInitOptions

    def __init__(self, options: Any | None = None) -> None:
        super().__init__(options)

        o = self.options
        host = "fedavg" if o.init == "continuous" else o.host  # Continuous trains FedAvg-style
        self.host_cls = get_algorithm(host)
        require(self.host_cls is not DynInit, f"{OPTIONS_PATH}.host", "DynInit cannot host itself")
        opts = dict(o.host_options) if host == o.host else {}
        self.host_options = from_mapping(self.host_cls.Options, opts, f"{OPTIONS_PATH}.host_options")

    # ------------------------------------------------------------------ budgets: the host's
    @property  # type: ignore[misc]  # a class flag elsewhere; the host's, known once options are read
    def trains_below_floor(self) -> bool:  # type: ignore[override]
        return self.host_cls.trains_below_floor

    def min_budget_macs(self, ctx) -> float | None:
        return self.host_cls(self.host_options).min_budget_macs(ctx)


    # ------------------------------------------------------------------ server half
    def _new_host(self, ctx, state: Mapping[str, torch.Tensor] | None, salt: int) -> Algorithm:
        host = self.host_cls(self.host_options)
        with ctx.seeded("init", 100 + salt):
            host.setup(ctx)
        assert host.global_model is not None
        if state is not None:
            host.global_model.load_state_dict(dict(state))
        return host

    def setup(self, ctx) -> None:
        require(ctx.schedule is not None, "sessions.count", "dyninit needs sessions: set sessions.count (and sessions.rounds)")
        P = self.options.pilot_sessions
        require(
            ctx.schedule.count >= P + 2,
            f"{OPTIONS_PATH}.pilot_sessions",
            f"needs sessions.count >= pilot_sessions + 2 = {P + 2}, got {ctx.schedule.count}",
        )
        self.host = self.host_cls(self.host_options)
        self.host.setup(ctx)
        self.global_model = self.host.global_model
        assert self.global_model is not None
        self.w0 = _clone(self.global_model.state_dict())
        self.pilot_models: list[dict[str, torch.Tensor]] = []
        self.w_pilot: dict[str, torch.Tensor] | None = None
        self.finals: dict[int, dict[str, torch.Tensor]] = {}  # post-pilot session -> final model
        self.grads: dict[int, dict[str, torch.Tensor]] = {}  # post-pilot session -> G_s
        self.teacher: dict[str, torch.Tensor] | None = None
        self.session = 0
        self._pending: dict[str, Any] = {}
        self._window = ctx.cfg.sessions.transition_window

    def _param_names(self) -> list[str]:
        assert self.global_model is not None
        return [n for n, _ in self.global_model.named_parameters()
                if not (self.options.exclude_bias and "bias" in n)]

    def skip_round(self, ctx, rnd: int) -> bool:
        # the baselines run no pilot session
        return self.options.init != "dyninit" and ctx.schedule.session_of(rnd) < self.options.pilot_sessions

    def session_start(self, ctx, session: int) -> Exchanges:
        o = self.options
        P = o.pilot_sessions
        assert self.global_model is not None
        if session > 0:  # the previous session's final model
            last = _clone(self.global_model.state_dict())
            if session - 1 < P:
                if o.init == "dyninit":
                    self.pilot_models.append(last)
            else:
                self.finals[session - 1] = last
        self.session = session
        info: dict[str, Any] = {}
        if session < P:
            start: Mapping[str, torch.Tensor] = self.global_model.state_dict()  # pilot: continue
        else:
            if o.init == "dyninit":
                if self.w_pilot is None:
                    weights = ([1.0 / len(self.pilot_models)] * len(self.pilot_models) if o.pilot_agg == "mean"
                               else _ema_weights(len(self.pilot_models), o.ema_decay))
                    self.w_pilot = weighted_state(self.pilot_models, weights, self.w0)
                    self.pilot_models = []
                self.grads[session] = yield from self._gradient_round(ctx, session, info)
            candidates = sorted(self.finals)
            if o.history_limit is not None:
                candidates = candidates[-o.history_limit:]
            if session == P:
                start = self.w0 if o.first_postpilot_start == "reset_to_w0" else self.global_model.state_dict()
            elif o.init in ("previous", "continuous"):
                start = self.finals[session - 1]
            else:
                if o.init == "average":
                    mu = [1.0 / len(candidates)] * len(candidates)
                else:
                    names = self._param_names()
                    d = [gradient_distance(self.grads[session], self.grads[z], names, o.similarity) for z in candidates]
                    mu = softmin_weights(d, o.similarity_scale)
                    info["distances"] = {str(z + 1): round(v, 6) for z, v in zip(candidates, d)}
                info["weights"] = {str(z + 1): round(w, 6) for z, w in zip(candidates, mu)}
                start = weighted_state([self.finals[z] for z in candidates], mu, self.global_model.state_dict())
            if o.init == "continuous":
                if session > P:
                    self.teacher = self.finals[session - 1]
                elif o.continuous_first_teacher == "zero":
                    self.teacher = {k: torch.zeros_like(v) for k, v in self.w0.items()}
                else:
                    self.teacher = None
        if o.reset_server_state or session == 0:
            self.host = self._new_host(ctx, start, session)
        else:
            assert self.host.global_model is not None
            self.host.global_model.load_state_dict(dict(start))
        self.global_model = self.host.global_model
        if not (o.init != "dyninit" and session < P):
            res = ctx.evaluate(self.global_model, indices=ctx.session_test_indices(session))
            full = ctx.evaluate(self.global_model)
            info["init_accuracy"] = res["accuracy"]
            info["init_accuracy_full"] = full["accuracy"]
        self._pending = info
        return []  # a session's start has no results of its own

    def _gradient_round(self, ctx, session: int, info: dict[str, Any]) -> Generator[list[ClientTask], list[ClientResult], dict[str, torch.Tensor]]:
        """``G_s``: ``grad_rounds`` extra rounds of the host from the pilot model."""
        o = self.options
        assert self.w_pilot is not None
        rnd = ctx.schedule.first_round(session)
        devices = list(ctx.schedule.devices[session])
        k = max(1, int(round(o.grad_devices_frac * len(devices))))
        if k < len(devices):
            devices = sorted(int(c) for c in ctx.rng("sample", rnd, 1).choice(devices, size=k, replace=False))
        lr = o.grad_lr_factor * ctx.cfg.train.lr
        clients = [
            ClientInfo(cid=c, tier="", ratio=1.0, budget_macs=float(ctx.plain_macs),
                       num_samples=int(len(ctx.data.client_indices[c])), round=rnd, lr=lr, prelude=True)
            for c in devices
        ]
        helper = self._new_host(ctx, self.w_pilot, 1000 + session)
        ctx.lr_override = lr
        up = down = 0
        try:
            for _ in range(o.grad_rounds):
                tasks = helper.configure(ctx, clients)
                if not o.grad_round_updates_client_state:
                    for t in tasks:
                        t.payload = {**t.payload, "keep_client_state": True}
                results = yield tasks
                helper.aggregate(ctx, results)
                helper.server_update(ctx)
                up += sum(r.bytes_up for r in results)
                down += sum(r.bytes_down for r in results)
        finally:
            ctx.lr_override = None
        assert helper.global_model is not None
        after = helper.global_model.state_dict()
        info["grad_round_clients"] = len(clients)
        info["grad_round_bytes"] = int(up + down)
        return {k: (after[k].double() - self.w_pilot[k].double()).to("cpu") for k in self._param_names()}

    def run_round(self, ctx, clients: list[ClientInfo]) -> Exchanges:
        tasks = self.host.configure(ctx, clients)
        if self.options.init == "continuous" and self.teacher is not None:
            teacher = self.teacher
            for t in tasks:
                t.payload = {**t.payload, "teacher": teacher}
        results = yield tasks
        self.host.aggregate(ctx, results)
        self.host.server_update(ctx)
        self.global_model = self.host.global_model
        return results

    def round_metrics(self, ctx) -> dict[str, Any]:
        out = dict(self.host.round_metrics(ctx))
        if self._pending:
            out["session_start"] = self._pending
            self._pending = {}
        return out

    def summary_metrics(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """Transition numbers with the study's numbering: the k-th transition is the start of
        post-pilot session k+1 (the 2nd transition is the first where DynInit can differ from
        Previous)."""
        P = self.options.pilot_sessions
        out: dict[str, Any] = {"dyninit_init": self.options.init, "dyninit_host": self.options.host}
        sessions = sorted({int(r["session"]) for r in history if "session" in r})
        window = getattr(self, "_window", 10)
        transitions = []
        for s in sessions:
            k = s - P - 1  # 1-based session s; transition k starts post-pilot session k+1
            if k < 1:
                continue
            rows = [r for r in history if r.get("session") == s]
            acc = [float(r["accuracy"]) for r in rows if "accuracy" in r]
            start: dict[str, Any] = next((r.get("session_start", {}) for r in rows if r.get("session_round") == 1), {})
            entry = {
                "transition": k,
                "session": s,
                "accuracy": transition_accuracy(acc, window),
                "init_accuracy": start.get("init_accuracy"),
                "accuracies": acc,
            }
            transitions.append(entry)
            out[f"transition_{k}_accuracy"] = entry["accuracy"]
            out[f"transition_{k}_init_accuracy"] = entry["init_accuracy"]
        out["transitions"] = transitions
        return out

    def eval_models(self, ctx) -> dict[str, nn.Module]:
        assert self.global_model is not None
        return {"global": self.global_model}

    def state_dict(self) -> dict[str, Any]:
        return {
            "host": self.host.state_dict(),
            "w0": self.w0,
            "pilot_models": list(self.pilot_models),
            "w_pilot": self.w_pilot,
            "finals": {str(k): v for k, v in self.finals.items()},
            "grads": {str(k): v for k, v in self.grads.items()},
            "teacher": self.teacher,
            "session": self.session,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.host.load_state_dict(state["host"])
        self.global_model = self.host.global_model
        self.w0 = state["w0"]
        self.pilot_models = list(state["pilot_models"])
        self.w_pilot = state["w_pilot"]
        self.finals = {int(k): v for k, v in state["finals"].items()}
        self.grads = {int(k): v for k, v in state["grads"].items()}
        self.teacher = state["teacher"]
        self.session = int(state["session"])

    # ------------------------------------------------------------------ client half
    # The host's client half (its model, plan, training and upload), or Continuous's distillation
    # (FedAvg's training with the KL term of the teacher's plan); a gradient round's task keeps
    # the client's state.
    _host_client: Algorithm | None = None

    def _client_host(self) -> Algorithm:
        """The host method's client half, one instance per client-half instance."""
        host = self._host_client
        if host is None:
            host = self._host_client = self.host_cls(self.host_options)
        return host

    def client_update(self, ctx, task: ClientTask, state: dict[str, Any] | None) -> ClientResult:
        if "teacher" in task.payload:
            return super().client_update(ctx, task, state)
        result = self._client_host().client_update(ctx, task, state)
        if task.payload.get("keep_client_state"):
            result.client_state = None
        return result

    def client_model(self, ctx, task: ClientTask, state: dict[str, Any] | None = None) -> nn.Module:
        if "teacher" in task.payload:
            return super().client_model(ctx, task, state)
        return self._client_host().client_model(ctx, task, state)

    def local_plan(self, ctx, task: ClientTask, state: dict[str, Any] | None) -> LocalPlan | None:
        if "teacher" in task.payload:  # Continuous: CE + κ·KL(p_teacher ‖ p); bytes down: the model and the teacher
            return LocalPlan(ctx.configured_sgd(), objective=LocalObjective(
                loss=_distillation(float(self.options.continuous_kl_coef)), references={"teacher": task.payload["teacher"]}))
        plan = self._client_host().local_plan(ctx, task, state)
        if plan is None or not task.payload.get("keep_client_state"):
            return plan
        objective = plan.objective if plan.objective is not None else LocalObjective()
        host_finish = objective.finish

        def finish(result: ClientResult) -> None:
            if host_finish is not None:
                host_finish(result)
            result.client_state = None

        return replace(plan, objective=replace(objective, finish=finish))

    def upload(self, ctx, task: ClientTask, model: nn.Module, result: dict[str, Any]) -> ClientResult:
        if "teacher" in task.payload:
            return super().upload(ctx, task, model, result)
        return self._client_host().upload(ctx, task, model, result)
