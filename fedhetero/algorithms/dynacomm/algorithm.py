"""DynaComm: federated learning with dynamic communication-resource allocation.

Le et al., "DynamicFL: Federated Learning with Dynamic Communication Resource Allocation" (IEEE
BigData 2024). It is called DynaComm here so as not to clash with the re-parameterisation method
``dynamicfl``.

One round:

* every active client runs the same number ``L`` of local SGD steps (``local_steps``; by default
  ``train.local_steps``, else ``⌊N_train·E/(M·B)⌋``, the mean number of steps E local epochs take);
* a *high-frequency group* ``z`` of the active clients, picked by a group selector so that its
  pooled label distribution is closest (KL) to the whole training set's under the round's
  communication budget, synchronises every ``interval_high`` steps; the others every
  ``interval_low`` steps (both by letter a–g = 1, 4, 16, 32, 64, 128, 256 or as integers, capped
  at ``L``);
* at each synchronisation step the server averages (weights as ``train.aggregation``) exactly the
  clients that synchronise there and sends the average back to them; at step ``L`` every client
  synchronises and that average is the new global model.

Special cases: ``budget_mode: all_high`` puts every active client in the high group (with
``interval_high: a`` this is DynamicSGD, the paper's upper bound), ``budget_mode: none`` puts
nobody there (with ``interval_low`` ≥ L this is FedAvg with L local steps).

``dynamicsgd_impl: summed_gradient`` runs DynamicSGD the other way the authors' code does: one
global model steps, after every local step, on the unweighted mean of the active clients'
minibatch gradients (each clipped on its own client), with one server-side momentum buffer (kept
across rounds with ``train.optimizer_state: persistent``); every client still takes its own next
batch at every step.

Budgets (``budget_mode``), counted in synchronisations per round:

* ``fix`` (the paper's Fix-β): a fixed random ``⌈β·M⌉`` of all clients can afford high frequency
  for the whole run; the selector chooses among the active ones of them, with no server cap;
* ``dynamic`` (Dynamic-β): every client can; the server allows at most ``⌊β·|active|⌋``
  high-frequency clients (``server_budget_semantics: high_count``, as the authors' code) or bounds
  the whole round's cost ``|z|·ν_high + (n−|z|)·ν_low`` by that of ``⌊β·|active|⌋`` high clients
  (``total_cost``, the paper's constraint taken literally).

The selector returns the feasible subset of any size with the smallest distance (or exactly the
cap with ``selector_fixed_size``); it may be empty, and then everyone is low-frequency that round.

``only_high_freq`` (the paper's "x*" rows): only the high group trains and only it is averaged;
``only_high_freq_code_quirk`` also averages the untrained low clients' unchanged models into the
global one, as the authors' code does.

Synchronisation rule (``sync_rule``): ``paper`` syncs after step ``l`` when ``l mod I == 0`` or
``l == L``; ``code`` follows the authors' event list, which skips a sync falling on step ``L−1``.

Client optimiser state follows ``train.optimizer_state``: the momentum buffer is *not* reset when a
client receives an average inside a round (the server relays it between the round's exchanges in
the task payload, because a client's stored private state is only read at round boundaries; it is
not counted in the bytes, since in a deployment it never leaves the client), and with
``persistent`` it is kept to the client's next round.

Communication cost κ (model exchanges normalised by ``|active|·L``) is logged per client in
``metrics.jsonl`` (``kappa_code``, ``kappa_paper``; their mean over a round's clients is the
round's κ), per round (``kappa_code``, ``kappa_paper``, ``high_group`` in the round's row) and as
the mean over rounds in ``summary.json``; see :mod:`fedhetero.algorithms.dynacomm.selection`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Generator, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedhetero.algorithms.dynacomm import selection as dc
from fedhetero.core.exchange.aggregation import weighted_average
from fedhetero.core.method.algorithm import Algorithm, Exchanges
from fedhetero.core.common.options import OPTIONS_PATH, MethodOptions, option, require
from fedhetero.core.local.objective import LocalPlan
from fedhetero.core.exchange.types import ClientInfo, ClientResult, ClientTask, state_bytes
from fedhetero.data import num_batches

__all__ = ["DynaComm", "DynaCommOptions"]


def _steps(value: int | str) -> int | None:
    """An interval option as steps; None when it is neither a letter a–g nor a positive integer."""
    try:
        return dc.parse_interval(value)
    except ValueError:
        return None


@dataclass(frozen=True)
class DynaCommOptions(MethodOptions):
    interval_high: int | str = "a"  # letter a–g or steps
    interval_low: int | str = "g"
    local_steps: int | None = option(None, ge=1, le=10**7)  # L; None: train.local_steps, else ⌊N_train·E/(M·B)⌋
    budget_mode: Literal["fix", "dynamic", "all_high", "none"] = "dynamic"
    beta: float = option(0.3, ge=0, le=1)
    server_budget_semantics: Literal["high_count", "total_cost"] = "high_count"
    selector: Literal["ensemble_dp", "random_same_size", "brute_force", "ga"] = "ensemble_dp"
    selector_orders: int = option(10, ge=1)  # random client orders of the ensemble
    selector_distance: Literal["kl", "squared_l2"] = "kl"
    selector_fixed_size: bool = False  # exactly the budget cap instead of the best size
    ga_population: int = option(50, ge=2)
    ga_iterations: int = option(200, ge=1)
    ga_mutation_prob: float = option(0.01, ge=0, le=1)
    sync_rule: Literal["paper", "code"] = "paper"
    only_high_freq: bool = False  # "x*": only the high group trains and is averaged
    only_high_freq_code_quirk: bool = False  # ... but the low clients' start models are averaged in
    dynamicsgd_impl: Literal["engine", "summed_gradient"] = "engine"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("interval_high", "interval_low"):
            value = getattr(self, name)
            require(_steps(value) is not None, f"{OPTIONS_PATH}.{name}",
                    f"must be a letter a-g or a positive integer, got {value!r}")
        require(
            not self.only_high_freq_code_quirk or self.only_high_freq,
            f"{OPTIONS_PATH}.only_high_freq_code_quirk",
            "only applies with only_high_freq: true",
        )
        require(
            self.dynamicsgd_impl != "summed_gradient" or (self.budget_mode == "all_high" and _steps(self.interval_high) == 1),
            f"{OPTIONS_PATH}.dynamicsgd_impl",
            "summed_gradient is DynamicSGD (every client synchronising after every step): it needs "
            "budget_mode: all_high and interval_high: a (1)",
        )


def _weights(ctx, sizes: list[int]) -> list[float]:
    """Aggregation weights as ``train.aggregation`` says (sample counts or uniform)."""
    if ctx.cfg.train.aggregation == "uniform":
        return [1.0] * len(sizes)
    return [float(n) for n in sizes]


class DynaComm(Algorithm):
    """DynaComm: equal local steps; a label-balanced high-frequency group syncs more often."""

    name = "dynacomm"
    summary = (
        "Every client runs the same local steps; a label-balanced high-frequency group, chosen under a "
        "communication budget, synchronises more often."
    )
    paper = (
        "Le et al., \"DynamicFL: Federated Learning with Dynamic Communication Resource Allocation\", IEEE "
        "BigData 2024"
    )
    Options = DynaCommOptions

    # ---------------------------------------------------------------- server half
    def setup(self, ctx) -> None:
        o = self.options
        self.global_model = ctx.build_model()
        t = ctx.cfg.train
        if o.local_steps is not None:
            self.L = int(o.local_steps)
        elif t.local_steps is not None:
            self.L = int(t.local_steps)
        else:
            n_train = int(sum(len(ix) for ix in ctx.data.client_indices))
            self.L = dc.default_local_steps(n_train, len(ctx.data.client_indices), t.local_epochs, t.batch_size)
        self.I_high = min(dc.parse_interval(o.interval_high), self.L)
        self.I_low = min(dc.parse_interval(o.interval_low), self.L)
        labels = np.asarray(ctx.data.train.labels_np)
        counts = np.bincount(labels, minlength=ctx.num_classes).astype(np.float64)
        self.global_dist = counts / counts.sum()  # the whole training set's label frequencies
        m = len(ctx.data.client_indices)
        self.capable: list[int] = []
        if o.budget_mode == "fix":
            k = min(m, math.ceil(o.beta * m - 1e-9))
            self.capable = sorted(int(c) for c in ctx.rng("algorithm", 0).choice(m, size=k, replace=False))
        self._last_round: dict[str, Any] = {}
        self.server_momentum: dict[str, torch.Tensor] = {}  # dynamicsgd_impl: summed_gradient

    def _gm(self) -> nn.Module:
        assert self.global_model is not None, "setup() has not run"
        return self.global_model

    def _nu(self, interval: int) -> int:
        return dc.nu_paper(interval, self.L) if self.options.sync_rule == "paper" else dc.nu_code(interval, self.L)

    def budget(self, clients: list[ClientInfo]) -> dc.Budget:
        """The round's budgets in synchronisations per round (see the module docstring)."""
        o = self.options
        n = len(clients)
        nu_h, nu_l = float(self._nu(self.I_high)), float(self._nu(self.I_low))
        if o.budget_mode == "fix":
            capable = set(self.capable)
            client = tuple(nu_h if c.cid in capable else nu_l for c in clients)
            cap = n
        else:
            client = (nu_h,) * n
            cap = math.floor(o.beta * n + 1e-9)
        if o.server_budget_semantics == "high_count":
            server = nu_h * cap
        else:
            server = cap * nu_h + (n - cap) * nu_l
        return dc.Budget(client=client, server=server, nu_high=nu_h, nu_low=nu_l, semantics=o.server_budget_semantics)

    def select(self, ctx, clients: list[ClientInfo]) -> tuple[list[int], float]:
        """The high-frequency group (client ids) and its distance to the global distribution."""
        o = self.options
        n = len(clients)
        if o.budget_mode == "all_high":
            return [c.cid for c in clients], math.nan
        if o.budget_mode == "none" or n == 0:
            return [], math.nan
        hists = np.stack([np.asarray(ctx.data.client_label_hist(c.cid), dtype=np.float64) for c in clients])
        budget = self.budget(clients)
        fixed = None
        if o.selector_fixed_size:
            fixed = sum(budget.capable(i) for i in range(n)) if o.budget_mode == "fix" else math.floor(o.beta * n + 1e-9)
            fixed = min(fixed, n)
            if fixed < 1:
                return [], math.nan
        rnd = int(clients[0].round)
        rng = ctx.rng("algorithm", rnd, 1)
        kw = {"distance": o.selector_distance, "fixed_size": fixed}
        if o.selector == "brute_force":
            idx, d = dc.select_brute_force(hists, self.global_dist, budget, **kw)
        elif o.selector == "ga":
            idx, d = dc.select_ga(
                hists, self.global_dist, budget, rng=rng, population=o.ga_population,
                iterations=o.ga_iterations, mutation_prob=o.ga_mutation_prob, **kw,
            )
        else:
            idx, d = dc.select_ensemble_dp(hists, self.global_dist, budget, orders=o.selector_orders, rng=rng, **kw)
            if o.selector == "random_same_size":
                idx, d = dc.select_random(
                    hists, self.global_dist, len(idx), budget, rng=ctx.rng("algorithm", rnd, 2), distance=o.selector_distance
                )
        return [clients[i].cid for i in idx], (float(d) if idx else math.nan)

    def run_round(self, ctx, clients: list[ClientInfo]) -> Exchanges:
        o = self.options
        L = self.L
        high, distance = self.select(ctx, clients)
        high_set = set(high)
        interval = {c.cid: (self.I_high if c.cid in high_set else self.I_low) for c in clients}
        trains = [c for c in clients if not o.only_high_freq or c.cid in high_set]
        schedule = {c.cid: set(dc.sync_points(interval[c.cid], L, o.sync_rule)) for c in trains}
        if o.dynamicsgd_impl == "summed_gradient":
            last, sent, received = yield from self._summed_gradient_round(ctx, trains)
            return self._account(ctx, clients, last, high_set, interval, schedule, sent, received, distance)
        start = {k: v.detach().clone() for k, v in self._gm().state_dict().items()}
        model_of = {c.cid: start for c in trains}
        done = {c.cid: 0 for c in trains}  # local steps finished (the last sync point)
        momentum: dict[int, Any] = {}
        sent = {c.cid: 0 for c in trains}
        received = {c.cid: 0 for c in trains}
        alive = {c.cid for c in trains}
        final: list[ClientResult] = []
        average = None
        events = sorted(set().union(*schedule.values())) if schedule else []
        for k, l in enumerate(events, 1):
            due = [c for c in trains if c.cid in alive and l in schedule[c.cid]]
            if not due:
                continue
            tasks: list[ClientTask] = []
            for c in due:
                payload: dict[str, Any] = {"state": model_of[c.cid], "start": done[c.cid], "steps": l - done[c.cid], "final": l == L}
                if momentum.get(c.cid) is not None:
                    payload["momentum"] = momentum[c.cid]
                tasks.append(self.task(ctx, c, payload, step=k))
                received[c.cid] += state_bytes(model_of[c.cid])
            results = yield tasks
            alive -= {c.cid for c in due} - {r.cid for r in results}  # a dropped client leaves the round
            if not results:
                continue
            average = weighted_average([r.state for r in results], ctx.aggregation_weights(results))
            for r in results:
                model_of[r.cid] = average
                done[r.cid] = l
                momentum[r.cid] = r.payload.pop("momentum", None)
                sent[r.cid] += int(r.bytes_up)
            if l == L:
                final = results
        if final:
            states, sizes = [r.state for r in final], [r.num_samples for r in final]
            if o.only_high_freq_code_quirk:
                idle = [c for c in clients if c.cid not in high_set]
                states += [start] * len(idle)
                sizes += [c.num_samples for c in idle]
            self._gm().load_state_dict(weighted_average(states, _weights(ctx, sizes)))
        return self._account(ctx, clients, final, high_set, interval, schedule, sent, received, distance)

    def _account(self, ctx, clients, final, high_set, interval, schedule, sent, received, distance) -> list[ClientResult]:
        """κ per client (in its metrics) and per round (:meth:`round_metrics`); bytes summed over
        the round's exchanges; the idle low clients of "x*" rounds listed with zero work."""
        o = self.options
        L = self.L
        high = sorted(high_set)

        # accounting: κ per client and per round, both synchronisation counts
        def nus(count) -> dict[int, int]:
            out = {}
            for c in clients:
                if o.only_high_freq and c.cid not in high_set:
                    out[c.cid] = 0
                else:
                    out[c.cid] = count(interval[c.cid], L)
            return out

        code, paper = nus(dc.nu_code), nus(dc.nu_paper)
        self._last_round = {
            "kappa_code": dc.kappa_round(list(code.values()), len(clients), L),
            "kappa_paper": dc.kappa_round(list(paper.values()), len(clients), L),
            "high_group": sorted(high),
            "high_distance": None if math.isnan(distance) else float(distance),
            "local_steps": L,
        }
        macs = ctx.macs(self._gm())
        out = list(final)
        if o.only_high_freq:
            got = {r.cid for r in final}
            for c in clients:  # the idle low clients: active, but they neither train nor talk
                if c.cid not in high_set and c.cid not in got:
                    idle = self.task(ctx, c, {})
                    out.append(ClientResult.of(idle, {}, macs=macs, metrics={"steps": 0, "loss": None}))
            out.sort(key=lambda r: r.cid)
        for r in out:
            trained = r.cid in sent
            r.bytes_up = sent.get(r.cid, 0)
            r.bytes_down = received.get(r.cid, 0)
            r.metrics.update(
                {
                    "steps": L if trained else 0,
                    "high_freq": r.cid in high_set,
                    "interval": interval[r.cid],
                    "syncs": len(schedule.get(r.cid, ())),
                    "nu_code": code[r.cid],
                    "nu_paper": paper[r.cid],
                    "kappa_code": code[r.cid] / L,
                    "kappa_paper": paper[r.cid] / L,
                }
            )
        return out

    def _summed_gradient_round(self, ctx, trains: list[ClientInfo]) -> Generator[list[ClientTask], list[ClientResult], Any]:
        """DynamicSGD as one model stepping on the mean of the clients' clipped gradients (see
        the module docstring); floating buffers (BatchNorm statistics) are averaged."""
        model = self._gm()
        params = [q for q in model.parameters() if q.requires_grad]
        names = [n for n, q in model.named_parameters() if q.requires_grad]
        opt = torch.optim.SGD(
            params,
            lr=ctx.lr_at(),
            momentum=ctx.local_momentum(),
            weight_decay=ctx.cfg.train.weight_decay,
            nesterov=ctx.cfg.train.nesterov,
        )
        if ctx.cfg.train.optimizer_state == "persistent":
            for name, q in zip(names, params):
                buf = self.server_momentum.get(name)
                if isinstance(buf, torch.Tensor):
                    opt.state[q]["momentum_buffer"] = buf.to(device=q.device, dtype=q.dtype).clone()
        alive = {c.cid for c in trains}
        sent = {c.cid: 0 for c in trains}
        received = {c.cid: 0 for c in trains}
        final: list[ClientResult] = []
        for s in range(self.L):
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            tasks = []
            for c in trains:
                if c.cid in alive:
                    tasks.append(self.task(ctx, c, {"state": state, "start": s, "steps": 1, "mode": "gradient"}, step=s + 1))
                    received[c.cid] += state_bytes(state)
            results = yield tasks
            alive = {r.cid for r in results}
            if not results:
                break
            for r in results:
                sent[r.cid] += int(r.bytes_up)
            opt.zero_grad(set_to_none=True)
            for name, q in zip(names, params):
                g = torch.zeros_like(q, dtype=torch.float64)
                for r in results:
                    g.add_(r.payload["grad"][name].to(g.device, torch.float64), alpha=1.0 / len(results))
                q.grad = g.to(q.dtype)
            opt.step()
            buffers = [k for k, v in results[0].state.items() if torch.is_floating_point(v)]
            if buffers:
                avg = weighted_average([{k: r.state[k] for k in buffers} for r in results], ctx.aggregation_weights(results))
                model.load_state_dict(avg, strict=False)
            final = results
        opt.zero_grad(set_to_none=True)
        if ctx.cfg.train.optimizer_state == "persistent":
            self.server_momentum = {
                name: opt.state[q]["momentum_buffer"].detach().to("cpu").clone()
                for name, q in zip(names, params)
                if isinstance(opt.state.get(q, {}).get("momentum_buffer"), torch.Tensor)
            }
        return final, sent, received

    def round_metrics(self, ctx) -> dict[str, Any]:
        """Fields of the round's row of ``metrics.jsonl``: ``kappa_code`` and ``kappa_paper`` (the
        round's normalised communication cost under both synchronisation counts), ``high_group``
        (client ids), ``high_distance`` (its distance to the global label distribution; null when
        no selector ran) and ``local_steps`` (L)."""
        return dict(self._last_round)

    def summary_metrics(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """``kappa_code`` / ``kappa_paper`` in ``summary.json``: the rounds' mean (the paper's κ),
        and ``mean_high_group_size``."""
        out: dict[str, Any] = {}
        for key in ("kappa_code", "kappa_paper"):
            values = [float(r[key]) for r in history if isinstance(r.get(key), (int, float))]
            out[key] = float(np.mean(values)) if values else None
        sizes = [len(r["high_group"]) for r in history if isinstance(r.get("high_group"), list)]
        out["mean_high_group_size"] = float(np.mean(sizes)) if sizes else None
        return out

    def state_dict(self) -> dict[str, Any]:
        out = {"global_model": self._gm().state_dict(), "capable": list(self.capable)}
        if self.server_momentum:
            out["server_momentum"] = dict(self.server_momentum)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._gm().load_state_dict(state["global_model"])
        self.capable = [int(c) for c in state.get("capable", self.capable)]
        self.server_momentum = {k: v.detach().clone() for k, v in state.get("server_momentum", {}).items()}

    # ---------------------------------------------------------------- client half
    # The default client half (client_model → local_train → upload), so that the clients of an
    # exchange whose window is plain SGD train as one cohort (local_plan: the window's SGD,
    # batches and carried momentum); the summed-gradient mode runs one by one.
    def local_train(self, ctx, task: ClientTask, model, plan: LocalPlan | None) -> dict[str, Any]:
        """Run ``payload["steps"]`` local steps from ``payload["state"]``, continuing the
        client's batch stream at step ``payload["start"]`` of the round and its momentum buffer
        from ``payload["momentum"]`` (the one it had at its last sync in this round); in
        gradient mode, the gradient of one step instead."""
        p = task.payload
        first, steps = int(p["start"]), int(p["steps"])
        if p.get("mode") == "gradient":
            return self._gradient(ctx, task, model, first)
        opt = ctx.make_optimizer(model)
        carried = p.get("momentum")
        if carried is not None:
            for name, param in model.named_parameters():
                st = opt.state[param]
                st.pop("momentum_buffer", None)
                buf = carried.get(name)
                if param.requires_grad and isinstance(buf, torch.Tensor):
                    st["momentum_buffer"] = buf.detach().to(device=param.device, dtype=param.dtype).clone()
        loss_sum, seen = self._steps(ctx, task, model, opt, first, steps)
        buffers = {
            name: opt.state[param]["momentum_buffer"].detach().to("cpu").clone()
            for name, param in model.named_parameters()
            if param in opt.state and isinstance(opt.state[param].get("momentum_buffer"), torch.Tensor)
        }
        if p.get("final"):
            # hand the buffers to the context so that train.optimizer_state: persistent keeps
            # them to the client's next round (a trainer call of zero epochs only does that)
            ctx.train(model, task, 0, optimizer=opt)
        return {"loss": loss_sum / seen if seen else math.nan, "steps": steps, "momentum": buffers}

    def local_plan(self, ctx, task: ClientTask, state: dict[str, Any] | None) -> LocalPlan | None:
        """A window's local SGD for a cohort: the configured SGD on the window's batches
        (:meth:`_schedule`), its momentum carried in from the client's last sync of the round
        (else, with ``persistent``, from its last round) and out again, kept to its next round
        only after the round's last exchange; the loss over the whole window. None in gradient
        mode."""
        if task.payload.get("mode") == "gradient":
            return None
        sgd = replace(ctx.configured_sgd(), carried=True, keep=bool(task.payload.get("final")), loss_over="all")
        return LocalPlan(sgd, schedule=self._schedule(ctx, task), momentum=task.payload.get("momentum"))

    def _schedule(self, ctx, task: ClientTask) -> list[torch.Tensor]:
        """The window's batches as rows of the training set: step ``s`` of the round takes batch
        ``s mod P`` of pass ``⌊s/P⌋`` (as :meth:`_steps` does)."""
        p = task.payload
        first, steps = int(p["start"]), int(p["steps"])
        bs = ctx.cfg.train.batch_size
        per_pass = num_batches(len(ctx.data.client_indices[task.cid]), bs)
        passes: dict[int, torch.Tensor] = {}
        out = []
        for step in range(first, first + steps):
            pss, pos = divmod(step, per_pass)
            if pss not in passes:
                passes[pss] = ctx.client_epoch_rows(task.cid, pss)
            out.append(passes[pss][pos * bs: (pos + 1) * bs])
        return out


    def upload(self, ctx, task: ClientTask, model, result: dict[str, Any]) -> ClientResult:
        """The trained model (with the momentum buffers to relay through the server, which count
        in neither direction: in a deployment they never leave the client), or in gradient mode
        the gradient and the model's floating buffers."""
        p = task.payload
        if p.get("mode") == "gradient":
            grad = result.pop("grad")
            buffers = result.pop("buffers")
            return ClientResult.of(task, buffers, macs=ctx.macs(model), payload={"grad": grad}, metrics=result,
                                   bytes_up=state_bytes(grad))  # the gradient only: the buffers' upload is not counted
        momentum = result.pop("momentum", None)
        upload = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return ClientResult.of(
            task,
            upload,
            macs=ctx.macs(model),
            payload={"momentum": momentum} if momentum else {},
            metrics=result,
            bytes_up=state_bytes(upload),
            bytes_down=state_bytes(p["state"]),
        )

    def _gradient(self, ctx, task: ClientTask, model, step: int) -> dict[str, Any]:
        """The clipped gradient at the received model on the batch of local step ``step``, and
        the model's floating buffers after that forward pass (summed-gradient DynamicSGD)."""
        t = ctx.cfg.train
        model.train()
        per_pass = num_batches(len(ctx.data.client_indices[task.cid]), t.batch_size)
        pss, pos = divmod(step, per_pass)
        batches = iter(ctx.client_batches(task.cid, pss))
        for _ in range(pos):
            next(batches)
        x, y = next(batches)
        x = x.to(ctx.device, ctx.dtype)
        y = y.to(ctx.device)
        for q in model.parameters():
            q.grad = None
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if t.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([q for q in model.parameters() if q.grad is not None], t.clip_grad_norm)
        grad = {
            n: (q.grad.detach().clone() if q.grad is not None else torch.zeros_like(q))
            for n, q in model.named_parameters()
            if q.requires_grad
        }
        params = {n for n, _ in model.named_parameters()}
        buffers = {k: v.detach().clone() for k, v in model.state_dict().items() if k not in params}
        return {"loss": float(loss.detach()), "steps": 1, "grad": grad, "buffers": buffers}

    @staticmethod
    def _steps(ctx, task: ClientTask, model, opt, first: int, steps: int) -> tuple[float, int]:
        """Local steps ``first … first+steps−1`` of the round: step ``s`` takes batch
        ``s mod P`` of pass ``⌊s/P⌋`` (``P`` batches per pass, each pass in the order
        ``client_batches`` gives it), the stream the shared trainer uses with
        ``train.local_steps``; the loss, clipping and optimizer step are the trainer's too."""
        t = ctx.cfg.train
        model.train()
        per_pass = num_batches(len(ctx.data.client_indices[task.cid]), t.batch_size)
        batches = None
        current = -1
        loss_sum, seen = 0.0, 0
        for s in range(first, first + steps):
            pss, pos = divmod(s, per_pass)
            if pss != current or batches is None:
                batches, current = iter(ctx.client_batches(task.cid, pss)), pss
                for _ in range(pos):
                    next(batches)
            x, y = next(batches)
            x = x.to(ctx.device, ctx.dtype, non_blocking=True)
            y = y.to(ctx.device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if t.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_([q for q in model.parameters() if q.grad is not None], t.clip_grad_norm)
            opt.step()
            loss_sum += float(loss.detach()) * int(y.shape[0])
            seen += int(y.shape[0])
        return loss_sum, seen
