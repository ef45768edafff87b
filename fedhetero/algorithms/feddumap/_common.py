"""The shared round loop of the FedDUMAP family and what it is built from.

:class:`ServerDataAlgorithm` is the round loop of FedDU, FedDUM, FedAP, FedDUAP, FedDUMAP and the
paper's baselines (:mod:`fedhetero.algorithms.feddumap.feddu`, :mod:`~fedhetero.algorithms.feddumap.feddum`,
:mod:`~fedhetero.algorithms.feddumap.fedap`, :mod:`~fedhetero.algorithms.feddumap.feddumap`,
:mod:`~fedhetero.algorithms.feddumap.baselines`), with hooks for the device optimiser, the server
step, server momentum and one-shot pruning. This module also holds the pieces that loop uses: the
FedDU formulas (4–7), the label statistics of the split (:class:`NonIIDStats`), plain SGD epochs
over a set of samples (:func:`sgd_epochs`), the options every member shares
(:class:`FamilyOptions`) and the dampened device momentum of Formula 11
(:class:`DampedMomentumSGD`). The method modules import from here (and re-export what they always
exported); nothing here imports them.

Server half and client half (:mod:`fedhetero.core.method.algorithm`): the server decides everything a
device needs for the round — the global model's state, the round's learning rate ``η_t``, and what
a member adds (FedAP's kept channels, FedDA's global momentum, IMC's masks, the shared-data
indices) — and sends it in the task payload (:meth:`ServerDataAlgorithm.round_payload`,
:meth:`ServerDataAlgorithm.client_payload`). The device half (:meth:`~ServerDataAlgorithm.client_model`,
:meth:`~ServerDataAlgorithm.local_train`, :meth:`~ServerDataAlgorithm.upload`) runs from that
payload alone on a fresh instance; training on the server data stays in the server half.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhetero.core.method.algorithm import Algorithm, Exchanges
from fedhetero.core.common.options import OPTIONS_PATH, MethodOptions, option, require
from fedhetero.core.local.objective import LocalPlan, LocalSGD
from fedhetero.core.exchange.types import ClientInfo, ClientResult, ClientTask
from fedhetero.data.batches import iterate_batches, num_batches
from fedhetero.data.server import non_iid_degree

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.local.context import ClientContext, Context, RunContext

__all__ = [
    "FPRIMES",
    "DampedMomentumSGD",
    "FamilyOptions",
    "NonIIDStats",
    "ServerDataAlgorithm",
    "feddu_alpha",
    "fprime",
    "importance_ratio",
    "interpolate_states",
    "samples_in_steps",
    "samples_processed",
    "server_steps",
    "sgd_epochs",
]

FPRIMES = ("1-acc", "1/(acc+eps)")
_EVAL_KEY = 1_000_003  # generator key of the (optional) augmented server-accuracy evaluation


# ==================================================================================== formulas
def fprime(acc: float, kind: str = "1-acc", eps: float = 1e-4) -> float:
    """``f'(acc)`` of Formula 7: ``1 − acc`` (default, the better of the two in the paper's Table 3)
    or ``1/(acc + ε)``.

    ``acc`` must lie in ``[0, 1]``. The prime is only part of the paper's name for it, not a derivative.
    """
    if isinstance(acc, bool) or not isinstance(acc, (int, float)) or not 0.0 <= float(acc) <= 1.0:
        raise ValueError(f"acc must be a number in [0, 1], got {acc!r}")
    if kind == "1-acc":
        return 1.0 - float(acc)
    if kind == "1/(acc+eps)":
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps!r}")
        return 1.0 / (float(acc) + float(eps))
    raise ValueError(f"fprime must be one of {FPRIMES}, got {kind!r}")


def importance_ratio(n0: float, js_selected: float, n_selected: float, js_server: float) -> float:
    """Importance of the server data in Formula 7: ``n_0·D(P̄') / (n_0·D(P̄') + n'·D(P_0))``.

    Equal to ``(n_0/D(P_0)) / (n_0/D(P_0) + n'/D(P̄'))`` (each dataset weighted by its size over its
    non-IID degree). Returns 0 when ``n_0 = 0``. When both weighted degrees vanish (the server data
    and the selected devices are both exactly IID) the two importances are both infinite; we then
    weight by size, ``n_0 / (n_0 + n')`` (project choice; the paper does not cover the case).
    """
    for name, v in (("n0", n0), ("js_selected", js_selected), ("n_selected", n_selected), ("js_server", js_server)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    if n0 == 0:
        return 0.0
    num = float(n0) * float(js_selected)
    den = num + float(n_selected) * float(js_server)
    if den == 0.0:
        return float(n0) / (float(n0) + float(n_selected))
    return num / den


def feddu_alpha(
    acc: float,
    ratio: float,
    *,
    round_index: int,
    C: float = 1.0,
    decay: float = 0.99,
    decay_index_base: int = 0,
    fprime_kind: str = "1-acc",
    fprime_eps: float = 1e-4,
) -> float:
    """The dynamic server step ``α^t = τ_eff^t / τ = f'(acc^t) · ratio^t · C · decay^e`` (Formula 7).

    ``round_index`` is the 1-based round ``t``; the exponent is ``e = t − 1`` with
    ``decay_index_base = 0`` (default, as in the authors' code: the first round uses ``decay^0``) or
    ``e = t`` with 1.
    ``α ∈ [0, 1]`` whenever ``C ≤ 1`` and ``f' = 1 − acc``.
    """
    if not isinstance(round_index, (int, np.integer)) or isinstance(round_index, bool) or round_index < 1:
        raise ValueError(f"round_index must be a 1-based int, got {round_index!r}")
    if decay_index_base not in (0, 1):
        raise ValueError(f"decay_index_base must be 0 or 1, got {decay_index_base!r}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must lie in [0, 1], got {ratio!r}")
    exponent = int(round_index) - 1 + int(decay_index_base)
    return fprime(acc, fprime_kind, fprime_eps) * float(ratio) * float(C) * float(decay) ** exponent


def interpolate_states(
    base: dict[str, Tensor], target: dict[str, Tensor], alpha: float
) -> dict[str, Tensor]:
    """``base + α·(target − base)`` for every floating-point entry (computed in float64, cast back).

    Integer entries (BN counters) keep ``base``'s value. With ``α = 0`` the result equals ``base``
    bit for bit; with ``α = 1`` it equals ``target`` (float64 round trip of float32 values is exact).
    """
    out: dict[str, Tensor] = {}
    for key, b in base.items():
        if not torch.is_floating_point(b):
            out[key] = b.clone()
            continue
        b64 = b.to(torch.float64)
        out[key] = (b64 + float(alpha) * (target[key].to(torch.float64) - b64)).to(b.dtype)
    return out


def server_steps(n0: int, batch_size: int, epochs: int) -> int:
    """``τ = ⌈n_0/B⌉·E`` server SGD steps per round (the authors' code form; the paper's
    ``⌈n_0·E/B⌉`` differs negligibly)."""
    return int(math.ceil(int(n0) / int(batch_size))) * int(epochs)


# ==================================================================================== non-IID stats
class NonIIDStats:
    """Label statistics of a federated split, fixed before training (for Formulas 2–3).

    Holds ``n_k`` and the label histogram of every device, ``n_0`` and the server histogram, the
    pooled device distribution ``P̄`` (server excluded) and the degrees ``D(P_k)``, ``D(P_0)``;
    :meth:`selected` gives ``(n', D(P̄'^t))`` for a round's devices. Degrees use
    :func:`fedhetero.data.server.non_iid_degree` (JS, log base ``base``, optional rounding of the
    class frequencies to ``round_decimals`` decimals).
    """

    def __init__(self, data: Any, *, base: float | str = 2, round_decimals: int | None = None) -> None:
        self.base = base
        self.round_decimals = round_decimals
        num_classes = int(data.num_classes) if hasattr(data, "num_classes") else int(data.train.num_classes)
        self.num_classes = num_classes
        self.client_hists = np.stack([data.train.label_histogram(ix) for ix in data.client_indices]).astype(np.float64)
        self.client_sizes = self.client_hists.sum(axis=1)
        server = getattr(data, "server_indices", None)
        self.n0 = 0 if server is None else int(len(server))
        self.server_hist = (
            data.train.label_histogram(server).astype(np.float64) if self.n0 else np.zeros(num_classes)
        )
        pooled = self.client_hists.sum(axis=0)
        self.global_dist = pooled / pooled.sum()
        self.client_js = np.atleast_1d(
            np.asarray(non_iid_degree(self.client_hists, self.global_dist, base=base, round_decimals=round_decimals),
                       dtype=np.float64)
        )
        self.server_js = (
            float(non_iid_degree(self.server_hist, self.global_dist, base=base, round_decimals=round_decimals))
            if self.n0 else 0.0
        )

    def selected(self, cids: list[int]) -> tuple[float, float]:
        """``(n', D(P̄'^t))`` of the union of the given devices' data."""
        hist = self.client_hists[np.asarray(cids, dtype=np.int64)].sum(axis=0)
        n_sel = float(hist.sum())
        if n_sel <= 0:
            return 0.0, 0.0
        js = float(non_iid_degree(hist, self.global_dist, base=self.base, round_decimals=self.round_decimals))
        return n_sel, js


# ==================================================================================== training helpers
def sgd_epochs(
    ctx: "RunContext",
    model: nn.Module,
    indices: Any,
    epochs: int,
    optimizer: torch.optim.Optimizer,
    *,
    concern: str,
    keys: tuple[int, ...],
    batch_size: int | None = None,
    augment: bool | None = None,
    dataset: Any = None,
    steps: int | None = None,
    clip: float | None = None,
) -> dict[str, Any]:
    """``epochs`` passes of mini-batch SGD over ``dataset[indices]`` (default: the training set),
    or with ``steps`` that many steps over as many passes as they take (as ``train.local_steps``
    counts them); ``clip``: the gradient norm clipped to before each step.

    The batch order of pass ``e`` comes from ``ctx.torch_generator(concern, *keys, e)``; the loss is
    the mean cross-entropy. Returns ``{"loss": mean loss of the last epoch (with ``steps``: of the
    last ``steps/epochs`` steps, as the shared trainer reports), "steps": int}``.
    """
    ds = ctx.data.train if dataset is None else dataset
    bs = int(batch_size or ctx.cfg.train.batch_size)
    aug = ctx.cfg.data.augment if augment is None else bool(augment)
    model.train()
    done = 0
    total, seen = 0.0, 0
    first_reported = 0 if steps is None else int(steps) * (int(epochs) - 1) // int(epochs)
    e = 0
    while (e < int(epochs)) if steps is None else (done < int(steps)):
        if steps is None:
            total, seen = 0.0, 0
        gen = ctx.torch_generator(concern, *keys, e)
        before = done
        for x, y in iterate_batches(ds, indices, bs, generator=gen, shuffle=True, augment=aug):
            if steps is not None and done >= int(steps):
                break
            x = x.to(ctx.device, ctx.dtype, non_blocking=True)
            y = y.to(ctx.device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_([q for q in model.parameters() if q.grad is not None], clip)
            optimizer.step()
            if done >= first_reported:
                total += float(loss.detach()) * int(y.shape[0])
                seen += int(y.shape[0])
            done += 1
        if done == before:
            break  # no data: no steps
        e += 1
    return {"loss": total / max(seen, 1), "steps": done}


@torch.no_grad()
def _accuracy_loss(
    ctx: "Context", model: nn.Module, indices: Any, *, augment: bool, keys: tuple[int, ...]
) -> tuple[float, float]:
    """Top-1 accuracy and mean loss of ``model`` (eval mode) on ``train[indices]``."""
    if not augment:
        res = ctx.evaluate(model, dataset=ctx.data.train, indices=indices)
        return float(res["accuracy"]), float(res["loss"])
    was = model.training
    model.eval()
    correct, loss, n = 0, 0.0, 0
    gen = ctx.torch_generator("server", *keys)
    for x, y in iterate_batches(ctx.data.train, indices, ctx.cfg.train.eval_batch_size, generator=gen,
                                shuffle=False, augment=True):
        x, y = x.to(ctx.device), y.to(ctx.device)
        out = model(x)
        loss += float(F.cross_entropy(out, y, reduction="sum"))
        correct += int((out.argmax(1) == y).sum())
        n += int(y.shape[0])
    model.train(was)
    return correct / max(n, 1), loss / max(n, 1)


def _clone_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


# ==================================================================================== options
@dataclass(frozen=True)
class FamilyOptions(MethodOptions):
    """Options shared by every algorithm of the FedDUMAP family.

    ``lr_decay``: per-round learning-rate decay of devices and server, ``η_t = η_0·lr_decay^(t−1)``
    (``train.lr`` is ``η_0``). ``device_momentum`` ``β'``: 0 = plain SGD (``train.momentum`` is not
    used by this family; the device optimiser is part of the method). ``device_momentum_impl``:
    ``exact`` (Formula 11 by hand: the first step moves by ``η'(1−β')g``) or ``torch_sgd``
    (``SGD(momentum=β', dampening=β')``, whose first step moves by ``η'g``).
    ``divergence_guards`` (the authors' code's guards, off by default): drop a device whose
    last-epoch loss is ≥ ``guard_factor`` × the initial test loss, revert a server step whose
    server-data loss grew ≥ ``guard_factor``×, and keep ``w^{t−1}`` when the test loss reaches
    ``test_guard_factor`` × the initial one.
    ``js_log_base`` / ``js_round_decimals``: non-IID degree (JS divergence; base 2 reproduces the
    paper's degrees, 3 decimals mimics the authors' code). ``model_init``: ``torch`` or
    ``kaiming_out`` (the authors' conv init, ``N(0, 2/(k²·C_out))`` with zero bias).
    """

    lr_decay: float = option(0.99, gt=0, le=1)
    device_momentum: float = option(0.0, ge=0, lt=1, note="β'")
    device_momentum_impl: Literal["exact", "torch_sgd"] = "exact"
    divergence_guards: bool = False
    guard_factor: float = option(3.0, gt=0)
    test_guard_factor: float = option(100.0, gt=0)
    js_log_base: float | Literal["e"] = 2.0
    js_round_decimals: int | None = option(None, ge=0)
    model_init: Literal["torch", "kaiming_out"] = "torch"

    def __post_init__(self) -> None:
        super().__post_init__()
        base = self.js_log_base
        require(
            base == "e" or (not isinstance(base, str) and base > 0 and base != 1),
            f"{OPTIONS_PATH}.js_log_base",
            f"must be 2, 'e' or another positive number != 1, got {base!r}",
        )


# ==================================================================================== device momentum
class DampedMomentumSGD(torch.optim.Optimizer):
    """SGD with ``(1−β)``-dampened momentum started at zero (Formula 11, "exact" implementation).

    Per parameter, with ``d = grad + weight_decay·w``::

        m ← β·m + (1−β)·d      (m = 0 before the first step)
        w ← w − lr·m

    The buffer is kept in ``state[p]["momentum_buffer"]`` (the name ``torch.optim.SGD`` uses), so a
    caller may preload it (FedDA) or read it back. With ``β = 0`` a step is ``w ← w − lr·d``.
    """

    def __init__(self, params: Iterable[Any], lr: float, beta: float = 0.9, weight_decay: float = 0.0) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta!r}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        super().__init__(params, {"lr": float(lr), "beta": float(beta), "weight_decay": float(weight_decay)})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, beta, wd = group["lr"], group["beta"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = p.grad if wd == 0 else p.grad.add(p, alpha=wd)
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = torch.zeros_like(p)
                    state["momentum_buffer"] = buf
                buf.mul_(beta).add_(d, alpha=1.0 - beta)
                p.add_(buf, alpha=-lr)
        return loss


# ==================================================================================== round loop
class ServerDataAlgorithm(Algorithm):
    """Shared round loop of the FedDUMAP family (the paper's per-round procedure).

    Per round ``t`` (1-based): ``before_round`` (FedAP's one-shot pruning) → one task per selected
    device (:meth:`configure`: ``w^{t−1}``, ``η_t`` and the member's extras) → every device trains
    ``E`` epochs with the method's optimiser (the client half, on the back end) → (guards) →
    n_k-weighted average ``w^{t−½}`` → :meth:`server_update` (FedDU step when ``server_update`` is
    ``interpolate``) → :meth:`after_server_update` (FedDUM's server momentum) → (test-loss guard).
    Subclasses only switch features on through their options and override hooks. Not registered
    (``name = "base"``).

    The client half (:meth:`client_model`, :meth:`device_optimizer`, :meth:`local_train`,
    :meth:`upload`) reads only ``self.options``, the task and the client context: what it needs from
    the server is in ``task.payload`` (``state``, ``lr`` and what :meth:`client_payload` adds).
    """

    name = "base"
    Options: ClassVar[type] = FamilyOptions
    server_data = "required"
    #: ``initial_test_loss``: the divergence guards' reference (None without them)
    state_fields: ClassVar[tuple[str, ...]] = ("global_model", "initial_test_loss")
    divergence_hint = "algorithm.options.divergence_guards=true (the authors' guards)"

    def __init__(self, options: Any | None = None) -> None:
        super().__init__(options)
        self.stats: NonIIDStats | None = None
        self.round_extras: dict[str, Any] = {}
        self.initial_test_loss: float | None = None
        self._clients: list[ClientInfo] = []

    # ------------------------------------------------------------------ option access
    def opt(self, name: str, default: Any = None) -> Any:
        """An option value, or ``default`` when this method has no such option."""
        return getattr(self.options, name, default)

    # ------------------------------------------------------------------ setup
    def setup(self, ctx: "Context") -> None:
        init = self.opt("model_init", "torch")
        self.global_model = ctx.build_model() if init == "torch" else ctx.build_model(init=init)
        base = self.opt("js_log_base", 2.0)
        self.stats = NonIIDStats(ctx.data, base=base, round_decimals=self.opt("js_round_decimals"))
        if self.opt("divergence_guards", False):
            self.initial_test_loss = float(ctx.evaluate(self.global_model)["loss"])

    # ------------------------------------------------------------------ learning rate
    def lr(self, ctx: "Context") -> float:
        """``η_t = η_0 · lr_decay^(t−1)`` (1-based round ``t``)."""
        return float(ctx.cfg.train.lr) * float(self.opt("lr_decay", 1.0)) ** max(int(ctx.round) - 1, 0)

    # ------------------------------------------------------------------ tasks (server half)
    def round_payload(self, ctx: "Context") -> dict[str, Any]:
        """What every selected device receives this round: ``state`` (``w^{t−1}``) and ``lr``
        (``η_t``). Members extend it (FedAP: the kept channels; FedDA: the global momentum; IMC: the
        masks)."""
        assert self.global_model is not None
        return {"state": dict(self.global_model.state_dict()), "lr": self.lr(ctx)}

    def client_payload(self, ctx: "Context", client: ClientInfo, common: dict[str, Any]) -> dict[str, Any]:
        """One device's payload: :meth:`round_payload`'s plus per-device extras (Data-sharing: the
        device's shared server samples)."""
        return dict(common)

    def configure(self, ctx: "Context", clients: list[ClientInfo]) -> list[ClientTask]:
        common = self.round_payload(ctx)
        return [self.task(ctx, c, self.client_payload(ctx, c, common)) for c in clients]

    # ------------------------------------------------------------------ device side (client half)
    def device_optimizer(self, ctx: "ClientContext", task: ClientTask, model: nn.Module) -> torch.optim.Optimizer:
        """The device optimiser of this round at ``η_t = task.payload["lr"]`` (new every round, so
        any momentum restarts at 0)."""
        params = [p for p in model.parameters() if p.requires_grad]
        lr = float(task.payload["lr"])
        beta = float(self.opt("device_momentum", 0.0))
        wd = float(ctx.cfg.train.weight_decay)
        if beta == 0.0:
            return torch.optim.SGD(params, lr=lr, momentum=0.0, weight_decay=wd)
        if self.opt("device_momentum_impl", "exact") == "torch_sgd":
            return torch.optim.SGD(params, lr=lr, momentum=beta, dampening=beta, weight_decay=wd)
        return DampedMomentumSGD(params, lr=lr, beta=beta, weight_decay=wd)

    def local_train(self, ctx: "ClientContext", task: ClientTask, model: nn.Module, plan: LocalPlan | None) -> dict[str, Any]:
        opt = self.device_optimizer(ctx, task, model)
        return dict(ctx.train(model, task, ctx.cfg.train.local_epochs, optimizer=opt))

    def local_plan(self, ctx: "ClientContext", task: ClientTask, state: dict[str, Any] | None) -> LocalPlan | None:
        """:meth:`local_train`'s SGD at the round's ``η_t``: plain, or with the device momentum of
        Formula 11 (``exact``: the dampened buffer from zero, restarted every round). None (one
        by one) with ``torch_sgd`` momentum. A subclass that trains otherwise (another
        :meth:`local_train` or :meth:`device_optimizer`) states its own plan."""
        sgd = self.device_sgd(ctx, task)
        return None if sgd is None else LocalPlan(sgd)

    def device_sgd(self, ctx: "ClientContext", task: ClientTask, given_buffer: bool = False) -> LocalSGD | None:
        """:meth:`device_optimizer` as a :class:`LocalSGD`, with the configured clipping. None for
        ``torch_sgd`` momentum started from zero, whose first step is undampened; from a
        ``given_buffer`` both forms step ``m ← β'·m + (1−β')·d``."""
        beta = float(self.opt("device_momentum", 0.0))
        if beta != 0.0 and not given_buffer and self.opt("device_momentum_impl", "exact") != "exact":
            return None
        t = ctx.cfg.train
        return LocalSGD(lr=float(task.payload["lr"]), momentum=beta, momentum_form="ema",
                        weight_decay=float(t.weight_decay), clip=t.clip_grad_norm)

    def upload(self, ctx: "ClientContext", task: ClientTask, model: nn.Module, result: dict[str, Any]) -> ClientResult:
        upd = super().upload(ctx, task, model, result)
        upd.metrics["params"] = int(sum(p.numel() for p in model.parameters()))
        upd.metrics["samples_processed"] = samples_processed(ctx, int(task.num_samples), result)
        return upd

    # ------------------------------------------------------------------ round template
    def before_round(self, ctx: "Context", clients: list[ClientInfo]) -> None:
        """Hook run before any device trains (FedAP prunes here)."""

    def after_server_update(self, ctx: "Context", prev_state: dict[str, Tensor]) -> None:
        """Hook run after the server step with ``w^{t−1}`` (FedDUM's server momentum)."""

    def after_aggregate(self, ctx: "Context") -> None:
        """Hook run right after averaging (IMC re-applies its masks here)."""

    def run_round(self, ctx: "Context", clients: list[ClientInfo]) -> Exchanges:
        assert self.global_model is not None
        self.round_extras = {"lr": self.lr(ctx)}
        self._clients = list(clients)
        self.before_round(ctx, clients)
        prev = _clone_state(self.global_model.state_dict())
        updates = yield self.configure(ctx, clients)
        used = self._guard_devices(updates)
        if used:
            self.aggregate(ctx, used)
        self.after_aggregate(ctx)
        self.server_update(ctx)
        self.after_server_update(ctx, prev)
        self._guard_test(ctx, prev)
        for u in updates:
            u.metrics.update(self.round_extras)
        return updates

    # ------------------------------------------------------------------ guards (authors' code; opt-in)
    def _guard_devices(self, updates: list[ClientResult]) -> list[ClientResult]:
        if not self.opt("divergence_guards", False) or self.initial_test_loss is None:
            return updates
        limit = float(self.opt("guard_factor", 3.0)) * self.initial_test_loss
        kept = []
        for u in updates:
            loss = float(u.metrics.get("loss", 0.0))
            dropped = not math.isfinite(loss) or loss >= limit
            u.metrics["guard_dropped"] = bool(dropped)
            if not dropped:
                kept.append(u)
        return kept

    def _guard_test(self, ctx: "Context", prev: dict[str, Tensor]) -> None:
        if not self.opt("divergence_guards", False) or self.initial_test_loss is None:
            return
        assert self.global_model is not None
        loss = float(ctx.evaluate(self.global_model)["loss"])
        reverted = not math.isfinite(loss) or loss >= float(self.opt("test_guard_factor", 100.0)) * self.initial_test_loss
        if reverted:
            self._revert_global(prev)
        self.round_extras["guard_test_reverted"] = int(reverted)

    def _revert_global(self, prev: dict[str, Tensor]) -> None:
        assert self.global_model is not None
        cur = self.global_model.state_dict()
        self.global_model.load_state_dict({k: prev[k].to(cur[k].dtype) for k in cur})

    # ------------------------------------------------------------------ FedDU server step
    def server_epochs(self, ctx: "Context") -> int:
        return int(self.opt("server_epochs") or ctx.cfg.train.local_epochs)

    def server_batch_size(self, ctx: "Context") -> int:
        return int(self.opt("server_batch_size") or ctx.cfg.train.batch_size)

    def server_indices(self, ctx: "Context") -> np.ndarray | None:
        idx = getattr(ctx.data, "server_indices", None)
        return None if idx is None or len(idx) == 0 else np.asarray(idx)

    def train_on_server(self, ctx: "Context", model: nn.Module) -> dict[str, Any]:
        """``E`` epochs of plain SGD (``η_t``, ``train.weight_decay``) on ``D_0``, in place."""
        idx = self.server_indices(ctx)
        assert idx is not None
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=self.lr(ctx), momentum=0.0,
                              weight_decay=float(ctx.cfg.train.weight_decay))
        with ctx.seeded("server", ctx.round):
            return sgd_epochs(ctx, model, idx, self.server_epochs(ctx), opt, concern="server",
                              keys=(ctx.round,), batch_size=self.server_batch_size(ctx))

    def step_alpha(self, ctx: "Context", acc: float, ratio: float) -> float:
        """α^t of this round (Formula 7 divided by τ); FedDU-S overrides it with a constant."""
        o = self.options
        return feddu_alpha(acc, ratio, round_index=int(ctx.round), C=o.C, decay=o.decay,
                           decay_index_base=o.decay_index_base, fprime_kind=o.fprime, fprime_eps=o.fprime_eps)

    def server_update(self, ctx: "Context") -> None:
        """The FedDU step on the aggregate when the method has one (``server_update="interpolate"``)."""
        if self.opt("server_update", "none") == "interpolate":
            self.feddu_step(ctx, self._clients)

    def feddu_step(self, ctx: "Context", clients: list[ClientInfo]) -> float:
        """FedDU (Formulas 4–7, as an interpolation) on :attr:`global_model` (``w^{t−½}``), in place::

            w^t = w^{t−½} + α^t·(w_srv − w^{t−½}),   α^t = f'(acc^t)·ratio^t·C·decay^(t−1)

        ``clients`` are the round's selected devices (they define ``n'`` and ``P̄'^t``). Returns
        ``α^t`` (0 without server data); the model is unchanged when ``α^t ≤ alpha_min``. The
        quantities are recorded in :attr:`round_extras`.
        """
        idx = self.server_indices(ctx)
        assert self.global_model is not None and self.stats is not None
        rm = self.round_extras
        if idx is None:
            rm.update({"feddu_alpha": 0.0, "feddu_server_step": 0})
            return 0.0
        n0 = int(len(idx))
        n_sel, js_sel = self.stats.selected([c.cid for c in clients])
        ratio = importance_ratio(n0, js_sel, n_sel, self.stats.server_js)
        acc, loss_before = _accuracy_loss(ctx, self.global_model, idx, augment=bool(self.opt("server_acc_augment", False)),
                                          keys=(ctx.round, _EVAL_KEY))
        alpha = self.step_alpha(ctx, acc, ratio)
        tau = server_steps(n0, self.server_batch_size(ctx), self.server_epochs(ctx))
        rm.update({
            "feddu_alpha": float(alpha),
            "feddu_tau": tau,
            "feddu_tau_eff": float(alpha) * tau,
            "feddu_server_acc": float(acc),
            "feddu_ratio": float(ratio),
            "feddu_js_selected": float(js_sel),
            "feddu_js_server": float(self.stats.server_js),
            "feddu_server_step": 0,
        })
        if alpha <= float(self.opt("alpha_min", 1e-3)):
            return float(alpha)
        half = self.global_model.state_dict()
        server_model = copy.deepcopy(self.global_model)
        with ctx.timer("feddu_server"):
            self.train_on_server(ctx, server_model)
        new_state = interpolate_states(half, server_model.state_dict(), alpha)
        if self.opt("divergence_guards", False):
            trial = copy.deepcopy(self.global_model)
            trial.load_state_dict(new_state)
            _, loss_after = _accuracy_loss(ctx, trial, idx, augment=False, keys=(ctx.round, _EVAL_KEY))
            if not math.isfinite(loss_after) or loss_after >= float(self.opt("guard_factor", 3.0)) * loss_before:
                rm["guard_server_reverted"] = 1
                return float(alpha)
        self.global_model.load_state_dict(new_state)
        rm["feddu_server_step"] = 1
        return float(alpha)


def samples_in_steps(n: int, batch_size: int, steps: int) -> int:
    """The samples ``steps`` steps go through when a device's batches walk passes over its ``n``
    samples one after another (each pass's last batch short): the full passes, then the batches
    taken of the unfinished one."""
    if n <= 0 or steps <= 0:
        return 0
    full, rest = divmod(steps, num_batches(n, batch_size))
    return full * n + min(rest * batch_size, n)


def samples_processed(ctx: "ClientContext", n: int, result: dict[str, Any]) -> int:
    """The samples a device's local training went through: ``n`` per epoch, or, with
    ``train.local_steps``, those of the steps it took."""
    t = ctx.cfg.train
    if t.local_steps is None:
        return n * int(t.local_epochs)
    return samples_in_steps(n, int(t.batch_size), int(result.get("steps", t.local_steps)))
