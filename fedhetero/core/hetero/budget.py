"""FLOPs accounting, device tiers and dynamic budget schedules.

FLOPs convention (project-wide): **forward multiply-accumulates of ``Conv2d`` and ``Linear`` layers
(and matmul-family ops) per sample**, in eval mode at the configured input size. Bias additions,
BatchNorm, activations, pooling, residual additions and concatenation count 0. Budgets are absolute
MACs, ``ratio × macs(plain global model)``.

Counters:

* :func:`macs` — the closed form used everywhere (``reparam.flops.model_macs``: one hooked forward
  pass; DBB branches included).
* :func:`fvcore_macs` — fvcore's ``FlopCountAnalysis`` (eval mode, batch 1, every non-MAC op handle
  replaced by one that returns 0, all warnings silenced). It must agree exactly with :func:`macs`;
  fvcore depends on TorchScript tracing, so it is wrapped in this one function.

Width planning (HeteroFL-style, :func:`largest_width`) measures each candidate width once with
:func:`macs` and caches it. Tiers (:class:`Tier`, :func:`assign_tiers`) and dynamic budgets
(:class:`BudgetSchedule`) complete the module.
"""

from __future__ import annotations

import importlib
import logging
import math
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from fedhetero.core.common.config import SCENARIOS
from fedhetero.core.common.options import ConfigError
from reparam.flops import model_macs

__all__ = [
    "macs",
    "fvcore_macs",
        "count_params",
    "DEFAULT_WIDTH_GRID",
    "HETEROFL_LEVELS",
    "width_grid",
    "width_cost",
    "largest_width",
    "Tier",
    "DEFAULT_TIERS",
    "check_tiers",
    "assign_tiers",
    "tier_budgets",
    "SCENARIOS",
    "BudgetSchedule",
    "FALLING_SCENARIOS",
    "check_budgets",
]

# ------------------------------------------------------------------------------------------- counting

_MAC_OPS = frozenset(
    {"aten::addmm", "aten::bmm", "aten::_convolution", "aten::einsum", "aten::matmul", "aten::mm", "aten::linear"}
)
# fvcore 0.1.5's default handles that are not multiply-accumulates (used if its table is not readable)
_NON_MAC_OPS = (
    "aten::batch_norm",
    "aten::group_norm",
    "aten::layer_norm",
    "aten::instance_norm",
    "aten::upsample_nearest2d",
    "aten::upsample_bilinear2d",
    "aten::adaptive_avg_pool2d",
    "aten::grid_sampler",
)


def _check_shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    if not isinstance(input_shape, (tuple, list)) or not input_shape or not all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0 for v in input_shape
    ):
        raise ValueError(f"input_shape must be a tuple of positive ints such as (C, H, W), got {input_shape!r}")
    return tuple(int(v) for v in input_shape)


def _example(model: nn.Module, shape: tuple[int, ...]) -> torch.Tensor:
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            return torch.zeros((1, *shape), dtype=t.dtype, device=t.device)
    return torch.zeros((1, *shape))


def _zero_handle(inputs: Any, outputs: Any) -> int:
    return 0


def fvcore_macs(model: nn.Module, input_shape: Sequence[int]) -> int:
    """Forward MACs per sample counted by fvcore's ``FlopCountAnalysis``.

    Eval mode, ``no_grad``, one zero input of shape ``(1, *input_shape)`` in the model's dtype and
    device; conv/linear/matmul handles kept, every other default handle (BatchNorm and other norms,
    adaptive average pooling, upsampling, grid sampling) replaced by a handle returning 0; unsupported-
    op, uncalled-module and tracer warnings silenced. The model's train/eval flags are restored.
    Raises ``ImportError`` with an install hint when fvcore is missing.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    shape = _check_shape(input_shape)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fvcore's import uses deprecated TorchScript APIs
            from fvcore.nn import FlopCountAnalysis  # deferred: a slow import only this cross-check needs
    except ImportError as exc:  # pragma: no cover - fvcore is a declared dependency
        raise ImportError("fvcore_macs needs fvcore (pip install fvcore)") from exc
    try:
        table = importlib.import_module("fvcore.nn.flop_count")._DEFAULT_SUPPORTED_OPS
        non_mac = [op for op in table if op not in _MAC_OPS]
    except (ImportError, AttributeError):  # pragma: no cover - layout of other fvcore versions
        non_mac = list(_NON_MAC_OPS)
    flags = {m: m.training for m in model.modules()}
    x = _example(model, shape)
    loggers = [logging.getLogger(n) for n in ("fvcore", "fvcore.nn.jit_analysis")]
    levels = [lg.level for lg in loggers]
    try:
        model.eval()
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            analysis = FlopCountAnalysis(model, (x,))
            for op in non_mac:
                analysis.set_op_handle(op, _zero_handle)
            analysis.unsupported_ops_warnings(False)
            analysis.uncalled_modules_warnings(False)
            analysis.tracer_warnings("none")
            total = int(analysis.total())
    finally:
        for m, t in flags.items():
            m.training = t
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)
    return total


def macs(model: nn.Module, input_shape: Sequence[int]) -> int:
    """Forward MACs per sample of ``model`` at ``input_shape = (C, H, W)`` (project convention):
    ``reparam.flops.model_macs`` (hooked eval-mode forward of one sample; counts every conv inside
    Diverse Branch Blocks). Agrees exactly with :func:`fvcore_macs` and with ``FlopCounterMode`` ÷ 2
    on conv/linear models (tested)."""
    return int(model_macs(model, _check_shape(input_shape)))


def count_params(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameter elements (buffers excluded; shared parameters counted once)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    return int(sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only))


# ------------------------------------------------------------------------------------------- widths

HETEROFL_LEVELS: tuple[float, ...] = (1.0, 0.5, 0.25, 0.125, 0.0625)


def width_grid(
    step: float = 1 / 16, max_width: float = 1.0, include: Sequence[float] = HETEROFL_LEVELS
) -> tuple[float, ...]:
    """Sorted candidate widths ``step, 2·step, …, ≤ max_width`` plus ``max_width`` and the widths of
    ``include`` that do not exceed ``max_width``."""
    if not step > 0 or not max_width > 0:
        raise ValueError(f"step and max_width must be > 0, got step={step!r}, max_width={max_width!r}")
    n = int(math.floor(max_width / step + 1e-9))
    values = {round(k * step, 12) for k in range(1, n + 1)} | {float(max_width)}
    values |= {float(w) for w in include if 0 < w <= max_width}
    return tuple(sorted(values))


DEFAULT_WIDTH_GRID: tuple[float, ...] = width_grid()

_COST_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple[float, tuple[int, ...]], tuple[int, int]]] = (
    weakref.WeakKeyDictionary()
)


def width_cost(build_fn: Callable[[float], nn.Module], width: float, input_shape: Sequence[int]) -> tuple[int, int]:
    """``(macs, params)`` of ``build_fn(width)``; cached per ``(build_fn, width, input_shape)`` while
    ``build_fn`` is alive (weak reference; non-weak-referenceable callables are not cached)."""
    shape = _check_shape(input_shape)
    key = (float(width), shape)
    try:
        per_fn = _COST_CACHE.setdefault(build_fn, {})
    except TypeError:
        per_fn = {}
    if key not in per_fn:
        model = build_fn(float(width))
        if not isinstance(model, nn.Module):
            raise TypeError(f"build_fn must return an nn.Module, got {type(model).__name__}")
        per_fn[key] = (macs(model, shape), count_params(model))
    return per_fn[key]


def largest_width(
    build_fn: Callable[[float], nn.Module],
    budget_macs: float,
    input_shape: Sequence[int],
    grid: Sequence[float] | None = None,
    *,
    budget_params: float | None = None,
) -> float:
    """Largest width of ``grid`` whose **measured** MACs fit ``budget_macs`` (and whose parameter count
    fits ``budget_params`` when given; each compared with its own quantity).

    ``grid`` defaults to :data:`DEFAULT_WIDTH_GRID` (multiples of 1/16 up to 1 plus the HeteroFL
    levels). MACs and params are non-decreasing in width for the zoo models (channel counts are
    ``ceil(c·width)``), so a binary search over the sorted grid measures about ``log2(len(grid))``
    models. Raises ``ValueError`` when even the smallest width does not fit.
    """
    if not isinstance(budget_macs, (int, float, np.number)) or isinstance(budget_macs, bool) or not budget_macs > 0:
        raise ValueError(f"budget_macs must be a positive number, got {budget_macs!r}")
    if budget_params is not None and not budget_params > 0:
        raise ValueError(f"budget_params must be a positive number or None, got {budget_params!r}")
    widths = sorted({float(w) for w in (DEFAULT_WIDTH_GRID if grid is None else grid)})
    if not widths or widths[0] <= 0:
        raise ValueError(f"grid must be a non-empty sequence of positive widths, got {grid!r}")

    def fits(w: float) -> bool:
        m, p = width_cost(build_fn, w, input_shape)
        return m <= budget_macs and (budget_params is None or p <= budget_params)

    if not fits(widths[0]):
        m, p = width_cost(build_fn, widths[0], input_shape)
        raise ValueError(
            f"no width in the grid fits the budget: the smallest width {widths[0]:g} needs {m} MACs "
            f"and {p} params (budget_macs={budget_macs:g}, budget_params={budget_params})"
        )
    lo, hi = 0, len(widths) - 1  # widths[lo] fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(widths[mid]):
            lo = mid
        else:
            hi = mid - 1
    return widths[lo]


# ------------------------------------------------------------------------------------------- tiers


class _TierLike(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def ratio(self) -> float: ...
    @property
    def share(self) -> float: ...


@dataclass(frozen=True)
class Tier:
    """A device tier: ``ratio`` = budget as a multiple of the plain model's MACs, ``share`` = fraction
    of clients in the tier."""

    name: str
    ratio: float
    share: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"budget.tiers: tier name must be a non-empty string, got {self.name!r}")
        if not self.ratio > 0:
            raise ValueError(f"budget.tiers: tier {self.name!r} ratio must be > 0, got {self.ratio!r}")
        if not self.share >= 0:
            raise ValueError(f"budget.tiers: tier {self.name!r} share must be >= 0, got {self.share!r}")


DEFAULT_TIERS: tuple[Tier, ...] = (
    Tier("small", 1.0, 1 / 3),
    Tier("medium", 2.0, 1 / 3),
    Tier("large", 3.0, 1 / 3),
)


def check_tiers(tiers: Sequence[_TierLike]) -> None:
    """Raise ``ValueError`` naming ``budget.tiers`` unless names are unique, ratios > 0, shares >= 0
    and the shares sum to 1 (tolerance 1e-6)."""
    if not tiers:
        raise ValueError("budget.tiers: at least one tier is required")
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise ValueError(f"budget.tiers: tier names must be unique, got {names}")
    for t in tiers:
        if not t.ratio > 0 or not t.share >= 0:
            raise ValueError(f"budget.tiers: tier {t.name!r} needs ratio > 0 and share >= 0, got {t.ratio}, {t.share}")
    total = float(sum(t.share for t in tiers))
    if abs(total - 1.0) > 1e-6:
        shares = ", ".join(f"{t.name}={t.share:g}" for t in tiers)
        raise ValueError(f"budget.tiers: the tier shares must sum to 1, got {total:g} ({shares})")


def _rng(rng: np.random.Generator | int | None) -> np.random.Generator:
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None or (isinstance(rng, (int, np.integer)) and not isinstance(rng, bool)):
        return np.random.default_rng(rng)
    raise TypeError(f"rng must be a numpy Generator, an int seed or None, got {type(rng).__name__}")


def assign_tiers(
    num_clients: int,
    tiers: Sequence[_TierLike] = DEFAULT_TIERS,
    rng: np.random.Generator | int | None = None,
    *,
    method: str = "quota",
) -> list[str]:
    """Tier name of every client ``0 … num_clients−1``.

    ``method="quota"`` (default): exactly ``round(share·N)`` clients per tier (largest-remainder
    rounding, ties to the earlier tier), placed on a random permutation of the clients, so the
    proportions are exact and tier and client id are uncorrelated. ``method="iid"``: each client draws
    its tier independently with probabilities ``share``. Deterministic given ``rng``.
    """
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise ValueError(f"num_clients must be a positive integer, got {num_clients!r}")
    check_tiers(tiers)
    gen = _rng(rng)
    names = [t.name for t in tiers]
    shares = np.array([float(t.share) for t in tiers])
    if method == "iid":
        picks = gen.choice(len(tiers), size=int(num_clients), p=shares / shares.sum())
        return [names[i] for i in picks]
    if method != "quota":
        raise ValueError(f"method must be 'quota' or 'iid', got {method!r}")
    exact = shares * num_clients
    counts = np.floor(exact + 1e-9).astype(int)
    rest = int(num_clients - counts.sum())
    order = sorted(range(len(tiers)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:rest]:
        counts[i] += 1
    labels = [name for name, c in zip(names, counts) for _ in range(int(c))]
    perm = gen.permutation(int(num_clients))
    out = [""] * int(num_clients)
    for pos, client in enumerate(perm):
        out[int(client)] = labels[pos]
    return out


def tier_budgets(tiers: Sequence[_TierLike], plain_macs: float) -> dict[str, float]:
    """Absolute MAC budget of every tier: ``ratio × plain_macs``."""
    return {t.name: float(t.ratio) * float(plain_macs) for t in tiers}


# ------------------------------------------------------------------------------------------- dynamic budgets

# SCENARIOS (the names budget.scenario accepts) is the config's, imported above


class BudgetSchedule:
    """Per-client budget ratios under the DynamicFL dynamic-budget scenarios (paper Table 2).

    Each participation of a client trains at a ratio ``r``; after its second local epoch the budget
    changes to ``r' = clamp(r·f)`` with ``f = 1 + change`` (``increasing``), ``1 − change``
    (``decreasing``) or either of the two with probability ½ each (``random``, drawn from the
    ``rng`` passed for that round and client); ``static`` never changes (``r' = None``).

    **Changes compound per participation:** the next participation of the same client starts at
    ``r'``. A client's first participation starts at its tier's base ratio (used as given); every
    changed ratio is clamped to ``[min_ratio, max_ratio]``.

    :meth:`ratios` is idempotent for a repeated ``(client, participation)`` (or ``(client, round)``
    when no participation count is passed): it returns the stored result instead of compounding
    twice. :meth:`state` / :meth:`load_state` give a ``weights_only``-loadable list for checkpoints.
    """

    def __init__(
        self,
        scenario: str = "static",
        *,
        change: float = 0.05,
        min_ratio: float = 0.1,
        max_ratio: float = 8.0,
    ) -> None:
        if scenario not in SCENARIOS:
            raise ValueError(f"budget.scenario must be one of {SCENARIOS}, got {scenario!r}")
        if not 0 <= change < 1:
            raise ValueError(f"budget.change must be in [0, 1), got {change!r}")
        if not 0 < min_ratio <= max_ratio:
            raise ValueError(
                f"budget.min_ratio/max_ratio must satisfy 0 < min_ratio <= max_ratio, got {min_ratio!r}, {max_ratio!r}"
            )
        self.scenario = scenario
        self.change = float(change)
        self.min_ratio = float(min_ratio)
        self.max_ratio = float(max_ratio)
        # client -> [current ratio, last key, last ratio, last after (nan = None)]
        self._state: dict[int, list[float]] = {}

    @property
    def dynamic(self) -> bool:
        """Whether budgets change during local training."""
        return self.scenario != "static"

    def _clamp(self, r: float) -> float:
        return min(self.max_ratio, max(self.min_ratio, r))

    def _factor(self, rng: np.random.Generator | None) -> float:
        if self.scenario == "increasing":
            return 1.0 + self.change
        if self.scenario == "decreasing":
            return 1.0 - self.change
        if not isinstance(rng, np.random.Generator):
            raise ValueError("the 'random' budget scenario needs rng= (a numpy Generator for this round and client)")
        return 1.0 + self.change if rng.random() < 0.5 else 1.0 - self.change

    def ratios(
        self,
        client: int,
        base_ratio: float,
        round: int,
        participation: int | None = None,
        rng: np.random.Generator | None = None,
    ) -> tuple[float, float | None]:
        """``(ratio for this round, ratio after the second local epoch or None)`` of ``client``.

        ``base_ratio`` is the client's tier ratio (used at its first participation); ``participation``
        counts the client's earlier participations (``round`` is used as the call key when it is
        None). Keys must not decrease per client.
        """
        if not base_ratio > 0:
            raise ValueError(f"base_ratio must be > 0, got {base_ratio!r}")
        if self.scenario == "static":
            return float(base_ratio), None
        key = float(round if participation is None else participation)
        st = self._state.get(int(client))
        if st is not None and key == st[1]:
            return st[2], (None if math.isnan(st[3]) else st[3])
        if st is not None and key < st[1]:
            raise ValueError(
                f"client {client}: budget requested for key {key:g} after key {st[1]:g} (keys must not decrease)"
            )
        current = float(base_ratio) if st is None else st[0]
        after = self._clamp(current * self._factor(rng))
        self._state[int(client)] = [after, key, current, after]
        return current, after

    def current(self, client: int, base_ratio: float) -> float:
        """Ratio the client's next participation will start at."""
        st = self._state.get(int(client))
        return float(base_ratio) if st is None or self.scenario == "static" else st[0]

    def state(self) -> list[list[float]]:
        """``[[client, current, last_key, last_ratio, last_after], …]`` (plain floats)."""
        return [[float(c), *v] for c, v in sorted(self._state.items())]

    def load_state(self, state: Sequence[Sequence[float]]) -> None:
        """Inverse of :meth:`state`."""
        self._state = {int(row[0]): [float(v) for v in row[1:5]] for row in state}


#: Scenarios in which a client's budget may fall (down to ``budget.min_ratio``).
FALLING_SCENARIOS: tuple[str, ...] = ("decreasing", "random")


def _ratio_at_least(floor: float, plain: float) -> float:
    """The smallest ratio of three significant digits whose budget ``ratio × plain`` (formed as the
    engine forms it) reaches ``floor``."""
    need = floor / plain
    decimals = 2 - int(math.floor(math.log10(need)))
    step = 10.0**-decimals
    ratio = round(math.ceil(need / step - 1e-9) * step, max(decimals, 0))
    while ratio * plain < floor:
        ratio = round(ratio + step, max(decimals, 0))
    return ratio


def _floor_of(hook: Any, ctx: Any) -> float | None:
    """``hook(ctx)`` as a positive float (None when the method has no floor), run with torch's CPU
    RNG state saved and restored: measuring a model must not change later random draws."""
    if not callable(hook):
        return None
    with torch.random.fork_rng(devices=[]):
        value = hook(ctx)
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) and value > 0 else None


def check_budgets(cfg: Any, algorithm: Any, ctx: Any) -> None:
    """Refuse, before the first round, a budget the configured method cannot meet.

    The floor is the algorithm's :meth:`~fedhetero.core.method.algorithm.Algorithm.min_budget_macs`
    (the MACs of its smallest model; None: no floor). A tier whose budget ``ratio × plain MACs``
    is below it raises ``ConfigError`` naming ``budget.tiers[i].ratio``. In the scenarios where
    budgets fall (``decreasing``, ``random`` with ``budget.change > 0``) the lowest budget the run
    can reach, ``max(min_ratio, smallest tier ratio × (1 − change)^rounds)`` (one change per
    participation, at most one participation a round), must meet
    :meth:`~fedhetero.core.method.algorithm.Algorithm.min_dynamic_budget_macs`, else the error names
    ``budget.min_ratio``. The message is one line: what the method cannot do, what its smallest
    model needs, and the ratio to set."""
    plain = float(ctx.plain_macs)
    if not plain > 0:
        return
    name = str(cfg.algorithm.name)
    b = cfg.budget

    def refuse(field: str, ratio: float, floor: float, where: str, knob: str) -> None:
        need = _ratio_at_least(floor, plain)
        also = f" (and budget.max_ratio, now {b.max_ratio:g}, with it)" if need > b.max_ratio else ""
        raise ConfigError(
            f"{field}: {name} cannot train within {ratio:g}× the plain model ({ratio * plain:,.0f} MACs per "
            f"sample){where}; its smallest model needs {need:g}× ({floor:,.0f} MACs). "
            f"Raise {knob} to at least {need:g}{also}."
        )

    floor = _floor_of(getattr(algorithm, "min_budget_macs", None), ctx)
    if floor is not None:
        for i, tier in enumerate(b.tiers):
            if tier.ratio * plain < floor:
                refuse(f"budget.tiers[{i}].ratio", tier.ratio, floor, "", "the ratio")
    if b.scenario in FALLING_SCENARIOS and b.change > 0:
        low = None if getattr(algorithm, "trains_below_floor", False) else floor
        if low is not None:
            # a client's budget falls by at most one factor (1 − change) per participation, at
            # most once a round, and never below budget.min_ratio
            start = min(t.ratio for t in b.tiers)
            rounds = int(cfg.train.rounds)
            reach = max(b.min_ratio, start * (1.0 - b.change) ** rounds)
            if reach < start and reach * plain < low:
                where = (
                    f", the lowest budget {b.scenario} budgets reach in {rounds} round{'s' if rounds != 1 else ''}"
                    f" with budget.min_ratio={b.min_ratio:g}"
                )
                refuse("budget.min_ratio", reach, low, where, "budget.min_ratio")
