"""HRank filter importance: the average matrix rank of each channel's feature map.

Lin et al., "HRank: Filter Pruning using High-Rank Feature Map" (CVPR 2020), as used by FedAP.

- :func:`feature_map_ranks`: batched ``torch.linalg.matrix_rank`` (default tolerance
  ``σ_max · max(h, w) · eps(float32)``) of a ``(N, C, h, w)`` activation cast to float32 → ``(N, C)``.
- :func:`rank_points`: where each channel group's maps are observed — the **post-activation** output
  that follows each producing conv (found on a ``torch.fx`` trace: conv → BN/identity/dropout/pool →
  activation). With ``through_add=True`` the chain continues through a residual addition, so a
  residual group's members are the post-add block outputs (as in the reference code).
- :func:`hrank_scores`: ``eval()`` + ``no_grad``, default 5 batches; the score of channel ``j`` of a
  group is its mean rank over all images, averaged over the group's observation points.
- :func:`hrank_keep`: stable ascending sort (ties: lower index pruned first), prune ``⌊p·d⌋``.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor, nn

from .rates import kept_count

__all__ = [
    "ACTIVATION_MODULES",
    "RankPoint",
    "feature_map_ranks",
    "rank_points",
    "point_ranks",
    "hrank_scores",
    "hrank_keep",
    "prune_order",
    "split_batches",
]

log = logging.getLogger(__name__)

ACTIVATION_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Hardswish, nn.Hardtanh, nn.Tanh, nn.Sigmoid, nn.Softplus,
)
_ACTIVATION_FUNCTIONS = {
    F.relu, F.relu_, F.relu6, F.leaky_relu, F.elu, F.selu, F.celu, F.gelu, F.silu, F.mish,
    F.hardswish, F.hardtanh, torch.relu, torch.relu_, torch.tanh, torch.sigmoid, F.softplus,
}
_ACTIVATION_METHODS = {"relu", "relu_", "tanh", "sigmoid"}
_PASS_MODULES: tuple[type[nn.Module], ...] = (
    nn.BatchNorm2d, nn.Identity, nn.Dropout, nn.Dropout2d, nn.MaxPool2d, nn.AvgPool2d,
)
_ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}


def feature_map_ranks(activation: Tensor) -> Tensor:
    """Matrix ranks of every ``(h, w)`` map of a ``(N, C, h, w)`` tensor → ``(N, C)`` int64.

    The input is cast to float32 (half precision is accepted); the tolerance is the
    ``torch.linalg.matrix_rank`` default. All-zero maps have rank 0.
    """
    if not isinstance(activation, Tensor) or activation.dim() != 4:
        raise ValueError("activation must be a 4-D tensor (N, C, h, w)")
    return torch.linalg.matrix_rank(activation.detach().to(torch.float32))


@dataclass(frozen=True)
class RankPoint:
    """Where one producer's post-activation maps are observed.

    ``node``: the fx node name whose output is recorded; ``module``: the producing conv path;
    ``through_add``: whether the chain crossed a residual addition; ``activation``: whether it ended
    at an activation (``False`` = no activation found, the last pass-through output is used).
    """

    node: str
    module: str
    through_add: bool
    activation: bool


def _is_activation(node: torch.fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return isinstance(modules.get(str(node.target)), ACTIVATION_MODULES)
    if node.op == "call_function":
        return node.target in _ACTIVATION_FUNCTIONS
    if node.op == "call_method":
        return node.target in _ACTIVATION_METHODS
    return False


def _is_pass(node: torch.fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return isinstance(modules.get(str(node.target)), _PASS_MODULES)
    return False


def _is_add(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _ADD_FUNCTIONS) or (
        node.op == "call_method" and node.target in ("add", "add_")
    )


def _trace(model: nn.Module) -> torch.fx.GraphModule:
    try:
        return torch.fx.symbolic_trace(model)
    except Exception as exc:  # noqa: BLE001 - report any tracing failure the same way
        raise ValueError(
            f"model {type(model).__name__} is not traceable by torch.fx ({exc}); pass `points` explicitly"
        ) from None


def _follow(start: torch.fx.Node, modules: Mapping[str, nn.Module], through_add: bool) -> tuple[torch.fx.Node, bool, bool]:
    cur, crossed = start, False
    for _ in range(16):
        users = list(cur.users)
        if len(users) != 1:
            return cur, crossed, False
        nxt = users[0]
        if _is_activation(nxt, modules):
            return nxt, crossed, True
        if _is_pass(nxt, modules):
            cur = nxt
            continue
        if through_add and _is_add(nxt):
            cur, crossed = nxt, True
            continue
        return cur, crossed, False
    return cur, crossed, False


def _producer_convs(groups: Any, group: str) -> list[str]:
    """Module paths of the convs whose output channels are ``group`` (from a ChannelGroups)."""
    out = []
    for key in groups.producers(group):
        d0, d1 = groups.dims[key]
        if d1 is not None and key.endswith(".weight"):
            out.append(key[: -len(".weight")])
    return out


def rank_points(
    model: nn.Module,
    groups: Sequence[str] | None = None,
    *,
    through_add: bool = True,
    graph: torch.fx.GraphModule | None = None,
) -> dict[str, list[RankPoint]]:
    """Observation points of each channel group's feature maps.

    ``groups`` default: every prunable group of ``model.channel_groups()`` produced by a conv.
    Each producing ``Conv2d`` contributes the first activation reached by following its output
    through BN / identity / dropout / pooling (and residual additions when ``through_add``);
    points shared by several producers (a residual block output) are listed once.
    """
    cg = _channel_groups(model)
    gm = graph if graph is not None else _trace(model)
    modules = dict(model.named_modules())
    by_target = {str(n.target): n for n in gm.graph.nodes if n.op == "call_module"}
    names = cg.prunable if groups is None else list(groups)
    out: dict[str, list[RankPoint]] = {}
    for g in names:
        if g not in cg.sizes:
            raise ValueError(f"groups: unknown channel group {g!r}; known: {cg.names}")
        pts: list[RankPoint] = []
        seen = set()
        for path in _producer_convs(cg, g):
            if not isinstance(modules.get(path), nn.Conv2d):
                continue
            node = by_target.get(path)
            if node is None:
                continue
            end, crossed, act = _follow(node, modules, through_add)
            if end.name not in seen:
                seen.add(end.name)
                pts.append(RankPoint(end.name, path, crossed, act))
        if pts:
            out[g] = pts
        elif groups is not None:
            raise ValueError(f"groups: channel group {g!r} has no producing Conv2d to observe")
    return out


def _channel_groups(model: nn.Module) -> Any:
    fn = getattr(model, "channel_groups", None)
    if not callable(fn):
        raise TypeError(f"model {type(model).__name__} has no channel_groups() method")
    return fn()


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, watch: set[str], sink: dict[str, Tensor]) -> None:
        super().__init__(gm)
        self.watch = watch
        self.sink = sink

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        if n.name in self.watch:
            self.sink[n.name] = result
        return result


def _inputs_of(batch: Any) -> Tensor:
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], Tensor):
        return batch[0]
    raise TypeError("batches must yield tensors or (inputs, targets) pairs")


def point_ranks(
    model: nn.Module,
    batches: Iterable[Any],
    nodes: Sequence[str],
    *,
    max_batches: int | None = 5,
    graph: torch.fx.GraphModule | None = None,
) -> dict[str, Tensor]:
    """Mean rank per channel (float64 ``(C,)``) at each fx node in ``nodes``.

    Runs ``model`` in ``eval()`` under ``no_grad`` on at most ``max_batches`` batches (``None`` = all)
    and restores its mode. Means are over all images seen.
    """
    gm = graph if graph is not None else _trace(model)
    known = {n.name for n in gm.graph.nodes}
    unknown = [n for n in nodes if n not in known]
    if unknown:
        raise ValueError(f"nodes: unknown fx nodes {unknown[:5]}")
    if max_batches is not None and (not isinstance(max_batches, int) or max_batches < 1):
        raise ValueError(f"max_batches must be a positive int or None, got {max_batches!r}")
    sums: dict[str, Tensor] = {}
    count = 0
    was_training = model.training
    model.eval()
    gm.eval()
    try:
        with torch.no_grad():
            for i, batch in enumerate(batches):
                if max_batches is not None and i >= max_batches:
                    break
                x = _inputs_of(batch)
                sink: dict[str, Tensor] = {}
                _Recorder(gm, set(nodes), sink).run(x)
                for name in nodes:
                    a = sink[name]
                    if a.dim() != 4:
                        raise ValueError(f"node {name!r} does not produce a 4-D feature map")
                    r = feature_map_ranks(a).sum(0).to(torch.float64)
                    sums[name] = r if name not in sums else sums[name] + r
                count += int(x.shape[0])
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("batches is empty: HRank needs at least one batch")
    return {name: s / count for name, s in sums.items()}


def hrank_scores(
    model: nn.Module,
    batches: Iterable[Any],
    groups: Sequence[str] | None = None,
    *,
    max_batches: int | None = 5,
    through_add: bool = True,
    points: Mapping[str, Sequence[RankPoint]] | None = None,
) -> dict[str, Tensor]:
    """HRank score per channel of each group: mean feature-map rank (float64 ``(C,)``).

    A group observed at several points (a residual group's block outputs) gets the mean of its
    members' average ranks. ``batches`` yields inputs or ``(inputs, targets)``; the FedAP default is
    5 batches × 100 server images without augmentation. The model is left unchanged (mode restored).
    """
    gm = _trace(model)
    pts = dict(points) if points is not None else rank_points(model, groups, through_add=through_add, graph=gm)
    nodes = sorted({p.node for ps in pts.values() for p in ps})
    ranks = point_ranks(model, batches, nodes, max_batches=max_batches, graph=gm)
    out: dict[str, Tensor] = {}
    for g, ps in pts.items():
        out[g] = torch.stack([ranks[p.node] for p in ps]).mean(0)
    return out


def prune_order(scores: Tensor) -> Tensor:
    """Channel indices in pruning order: stable ascending sort of ``scores`` (ties: lower index
    first)."""
    if not isinstance(scores, Tensor) or scores.dim() != 1:
        raise ValueError("scores must be a 1-D tensor")
    return torch.sort(scores.detach().to(torch.float64).cpu(), stable=True).indices


def hrank_keep(scores: Tensor, rate: float, *, min_channels: int = 1,
               max_prune_ratio: float | None = None, round_to: int = 1) -> Tensor:
    """Kept channel indices (sorted ascending ``LongTensor``) after pruning ``⌊rate·d⌋`` channels.

    The pruned channels are the first of :func:`prune_order`; the kept count follows
    :func:`fedhetero.algorithms.pruning.rates.kept_count`. Logs the number of ties at the cut.
    """
    order = prune_order(scores)
    d = int(order.numel())
    keep = kept_count(d, rate, min_channels=min_channels, max_prune_ratio=max_prune_ratio, round_to=round_to)
    n_prune = d - keep
    if 0 < n_prune < d:
        s = scores.detach().to(torch.float64).cpu()
        cut = float(s[order[n_prune - 1]])
        ties = int((s == cut).sum())
        if ties > 1:
            log.debug("hrank_keep: %d channels tie at the cut value %.4g", ties, cut)
    return torch.sort(order[n_prune:]).values


def split_batches(x: Tensor, batch_size: int = 100, num_batches: int = 5) -> list[Tensor]:
    """The first ``num_batches`` consecutive batches of ``batch_size`` rows of ``x`` (fewer if short)."""
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise ValueError("x must be a tensor with a batch dimension")
    if batch_size < 1 or num_batches < 1:
        raise ValueError("batch_size and num_batches must be positive")
    n = min(x.shape[0], batch_size * num_batches)
    return [x[i : i + batch_size] for i in range(0, n, batch_size)]

