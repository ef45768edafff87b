"""Finding conv → BatchNorm pairs and BN-only identity branches from a model's data flow.

Pairs are found from the data flow, never from registration order: with ``torch.fx`` when the
model traces, otherwise with one eval-mode forward probe that follows tensor identities (a BN pairs
with a conv only if it is the sole consumer of the conv's output). BN-only identity branches
(RepVGG's ``conv(x) + ... + bn(x)``) are found from the ``torch.fx`` graph.
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ._tree import _host_modules, _is_block, _is_bn_like, _is_plain_conv
from .block import DiverseBranchBlock
from .errors import ReparamError
from .geometry import ConvGeometry
from .transforms import bn_impurity, check_identity

__all__ = ["ConvScan", "find_conv_bn_pairs", "find_identity_branches"]

logger = logging.getLogger("reparam")

# ---------------------------------------------------------------------------------------------
# conv -> BN pair discovery


@dataclass
class ConvScan:
    """Result of :func:`find_conv_bn_pairs`.

    Attributes:
        convs: conv path → BN path (``None`` when no BN consumes only its output), in module order.
        calls: conv path → number of calls in one forward pass.
        method: ``"fx"`` or ``"probe"``.
        notes: conv path → why the BatchNorm consuming its output was not paired with it (a
            norm+activation layer with a real activation, ...).
        identity: BN path → conv path for every BN-only identity branch (see
            :func:`find_identity_branches`); filled by the ``torch.fx`` scan only.
    """

    convs: dict[str, str | None] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    method: str = "fx"
    notes: dict[str, str] = field(default_factory=dict)
    identity: dict[str, str] = field(default_factory=dict)

    @property
    def pairs(self) -> dict[str, str]:
        return {c: b for c, b in self.convs.items() if b is not None}


class _LeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if _is_block(m) or _is_bn_like(m) or isinstance(m, nn.Conv2d):
            return True
        return super().is_leaf_module(m, module_qualified_name)


def _scan_fx(model: nn.Module) -> ConvScan:
    graph = _LeafTracer().trace(model)
    modules = dict(model.named_modules())
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    scan = ConvScan(method="fx")
    found: dict[str, str | None] = {}
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        m = modules.get(node.target)
        if m is None or not _is_plain_conv(m) or node.target in found:
            continue
        bn_path = None
        users = list(node.users)
        if calls[node.target] == 1 and len(users) == 1 and users[0].op == "call_module":
            u = users[0]
            um = modules.get(u.target)
            if um is not None and _is_bn_like(um) and calls[u.target] == 1 and tuple(u.args) == (node,) and not u.kwargs:
                impure = bn_impurity(um)
                if impure is None:
                    bn_path = str(u.target)
                else:
                    scan.notes[str(node.target)] = f"its BatchNorm {u.target}: {impure}"
        found[str(node.target)] = bn_path
    for path, m in _host_modules(model):
        if _is_plain_conv(m):
            scan.convs[path] = found.get(path)
            scan.calls[path] = calls.get(path, 0)
    scan.identity = {bn: conv for bn, (conv, _) in _identity_branches(graph, modules, calls).items()}
    return scan


# ---------------------------------------------------------------------------------------------
# BN-only identity branches (RepVGG-style ``conv(x) + ... + bn(x)``)



_ADD_FUNCTIONS = (operator.add, operator.iadd, torch.add)
_ADD_METHODS = ("add", "add_", "__add__", "__iadd__")


def _is_add(node: torch.fx.Node) -> bool:
    if len(node.args) != 2 or node.kwargs:
        return False
    if node.op == "call_function":
        return node.target in _ADD_FUNCTIONS
    return node.op == "call_method" and node.target in _ADD_METHODS


def _sum_terms(node: torch.fx.Node, exclude: torch.fx.Node, modules: Mapping[str, nn.Module]) -> list[torch.fx.Node]:
    """Operands of the sum rooted at ``node``, ``exclude`` left out. Inner additions used only by
    the sum are expanded, also when they reach it through modules that are identities in eval mode
    (``drop_path(conv_1x1(x) + conv_kxk(x)) + bn(x)``)."""
    out: list[torch.fx.Node] = []
    for a in node.args:
        if not isinstance(a, torch.fx.Node) or a is exclude:
            continue
        inner = a
        while (
            inner.op == "call_module" and len(inner.users) == 1 and len(inner.args) == 1 and not inner.kwargs
            and isinstance(inner.args[0], torch.fx.Node) and _is_passthrough(modules.get(str(inner.target)))
        ):
            inner = inner.args[0]
        if _is_add(inner) and len(inner.users) == 1:
            out.extend(_sum_terms(inner, exclude, modules))
        else:
            out.append(a)
    return out


def _is_passthrough(m: nn.Module | None) -> bool:
    """Modules that are the identity in eval mode (the only mode in which merges are exact)."""
    return isinstance(m, (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout))


def _conv_feeding(term: torch.fx.Node, x: torch.fx.Node, modules: Mapping[str, nn.Module], calls: Counter) -> tuple[str, bool] | None:
    """``(conv path, through a BN)`` when ``term`` is ``conv(x)``, optionally followed by the conv's
    own BatchNorm and by modules that are identities in eval mode, each used only on this path."""
    node, via_bn = term, False
    while True:
        if node.op != "call_module" or len(node.users) != 1 or calls[node.target] != 1 or node.kwargs:
            return None
        m = modules.get(str(node.target))
        if m is None or len(node.args) != 1:
            return None
        if isinstance(m, nn.Conv2d) or _is_block(m):
            return (str(node.target), via_bn) if node.args[0] is x else None
        prev = node.args[0]
        if not isinstance(prev, torch.fx.Node):
            return None
        if _is_bn_like(m) and not via_bn and bn_impurity(m) is None:
            via_bn = True
        elif not _is_passthrough(m):
            return None
        node = prev


def _kernel(conv: nn.Module) -> tuple[int, ...]:
    k: Any = conv.kernel_size
    return (k, k) if isinstance(k, int) else tuple(int(v) for v in k)


def _identity_fits(conv: nn.Module, bn: nn.Module) -> str | None:
    """Why the identity through ``bn`` cannot be added to ``conv``'s kernel (``None``: it can)."""
    geometry = conv.geometry if isinstance(conv, DiverseBranchBlock) else ConvGeometry.from_conv(conv)
    try:
        check_identity(geometry)
    except ReparamError as exc:
        return str(exc)
    running_mean: Any = bn.running_mean
    n = getattr(bn, "num_features", None) or int(running_mean.numel())
    if n != geometry.out_channels:
        return f"the BatchNorm has {n} channels, the conv {geometry.out_channels} outputs"
    return None


def _identity_branches(
    graph: torch.fx.Graph, modules: Mapping[str, nn.Module], calls: Counter
) -> dict[str, tuple[str, bool]]:
    """BN path → (conv path, conv reaches the sum through its own BN) for every BN-only branch."""
    found: dict[str, tuple[str, bool]] = {}
    for node in graph.nodes:
        if node.op != "call_module" or calls[node.target] != 1 or node.kwargs or len(node.args) != 1:
            continue
        bn = modules.get(str(node.target))
        if bn is None or not _is_bn_like(bn) or bn_impurity(bn) is not None or len(node.users) != 1:
            continue
        x = node.args[0]
        (user,) = node.users
        if not isinstance(x, torch.fx.Node) or not _is_add(user):
            continue
        best: tuple[int, str, bool] | None = None
        for term in _sum_terms(user, node, modules):
            hit = _conv_feeding(term, x, modules, calls)
            if hit is None:
                continue
            conv = modules[hit[0]]
            if _identity_fits(conv, bn) is not None:
                continue
            size = max(conv.geometry.kernel_size if isinstance(conv, DiverseBranchBlock) else _kernel(conv))
            if best is None or size > best[0]:
                best = (size, hit[0], hit[1])
        if best is not None:
            found[str(node.target)] = (best[1], best[2])
    return found


def find_identity_branches(model: nn.Module) -> dict[str, str]:
    """BN-only identity branches of ``model``: ``{BN path: conv path}``.

    A BN-only identity branch is a BatchNorm applied to a tensor ``x`` whose output is summed with
    ``conv(x)`` (RepVGG's identity branch: ``conv_kxk(x) + conv_1x1(x) + bn(x)``). In eval mode it
    equals a conv with the identity kernel folded through the BN, so :func:`merge` adds it to the
    conv's kernel and bias when the geometry allows an identity (``C == O``, stride 1, a
    size-preserving odd kernel; any groups). Found from the ``torch.fx`` graph (traced in eval
    mode): the BN is called once, its only consumer is the sum, and the conv term reaches the sum
    only through its own BatchNorm and modules that are identities in eval mode. Models that do not
    trace give ``{}``.
    """
    flags = {m: m.training for m in model.modules()}
    try:
        model.eval()
        graph = _LeafTracer().trace(model)
    except Exception as exc:  # noqa: BLE001 - untraceable models simply have no detected branches
        logger.info("torch.fx could not trace the model (%s: %s); BN-only identity branches are not detected",
                    type(exc).__name__, exc)
        return {}
    finally:
        for m, t in flags.items():
            m.training = t
    modules = dict(model.named_modules())
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    return {bn: conv for bn, (conv, _) in _identity_branches(graph, modules, calls).items()}


_NON_CONSUMING = {"size", "dim", "numel", "stride", "is_contiguous", "__len__", "data_ptr", "element_size",
                  "nelement", "ndimension", "__get__", "is_floating_point", "get_device"}


class _ConsumerMode(TorchFunctionMode):
    def __init__(self, state: dict[str, Any]) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        st = self.state
        if st["bn_depth"] == 0 and st["watch"] and getattr(func, "__name__", "") not in _NON_CONSUMING:
            leaves, _ = tree_flatten((args, kwargs))
            for t in leaves:
                if isinstance(t, Tensor):
                    path = st["watch"].get(id(t))
                    if path is not None:
                        st["other"].add(path)
        return func(*args, **kwargs)


def _guess_inputs(model: nn.Module) -> list[Tensor]:
    first = next((m for _, m in _host_modules(model) if isinstance(m, nn.Conv2d)), None)
    if first is None:
        return []
    p = next(first.parameters())
    c = first.geometry.in_channels if isinstance(first, DiverseBranchBlock) else int(first.in_channels)
    return [torch.randn(2, c, s, s, dtype=p.dtype, device=p.device) for s in (32, 64, 224)]


def _scan_probe(model: nn.Module, example_input: Any) -> ConvScan:
    host = _host_modules(model)
    state: dict[str, Any] = {"bn_depth": 0, "watch": {}, "other": set(), "keep": [], "calls": Counter(),
                             "bn_calls": Counter(), "bn_of": {}}
    handles = []

    def conv_hook(path: str):
        def hook(mod, inp, out):  # type: ignore[no-untyped-def]
            state["calls"][path] += 1
            if isinstance(out, Tensor):
                state["watch"][id(out)] = path
                state["keep"].append(out)
        return hook

    def bn_pre(path: str):
        def hook(mod, inp):  # type: ignore[no-untyped-def]
            state["bn_calls"][path] += 1
            x = inp[0] if inp else None
            if isinstance(x, Tensor) and id(x) in state["watch"]:
                state["bn_of"].setdefault(state["watch"][id(x)], []).append(path)
            state["bn_depth"] += 1
        return hook

    def bn_post(mod, inp, out):  # type: ignore[no-untyped-def]
        state["bn_depth"] -= 1

    for path, m in host:
        if _is_plain_conv(m):
            handles.append(m.register_forward_hook(conv_hook(path)))
        elif _is_bn_like(m):
            handles.append(m.register_forward_pre_hook(bn_pre(path)))
            handles.append(m.register_forward_hook(bn_post))
    flags = {m: m.training for m in model.modules()}
    candidates = [example_input] if example_input is not None else _guess_inputs(model)
    ok = False
    errors = []
    try:
        model.eval()
        for x in candidates:
            for key in ("calls", "bn_calls"):
                state[key].clear()
            state["watch"].clear()
            state["other"].clear()
            state["keep"].clear()
            state["bn_of"].clear()
            state["bn_depth"] = 0
            try:
                with torch.no_grad(), _ConsumerMode(state):
                    if isinstance(x, (tuple, list)):
                        model(*x)
                    elif isinstance(x, Mapping):
                        model(**x)
                    else:
                        model(x)
                ok = True
                break
            except Exception as exc:  # noqa: BLE001 - any failure means "try the next input"
                errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        for h in handles:
            h.remove()
        for m, t in flags.items():
            m.training = t
    if not ok:
        raise ReparamError(
            "the model does not trace with torch.fx and a probe forward pass failed "
            f"({'; '.join(errors[-1:]) or 'no conv found'}); pass example_input=<a valid input batch>"
        )
    scan = ConvScan(method="probe")
    for path, m in host:
        if not _is_plain_conv(m):
            continue
        scan.calls[path] = state["calls"][path]
        bns = state["bn_of"].get(path, [])
        bn_path = None
        if (
            state["calls"][path] == 1
            and len(bns) == 1
            and state["bn_calls"][bns[0]] == 1
            and path not in state["other"]
        ):
            impure = bn_impurity(model.get_submodule(bns[0]))
            if impure is None:
                bn_path = bns[0]
            else:
                scan.notes[path] = f"its BatchNorm {bns[0]}: {impure}"
        scan.convs[path] = bn_path
    state["keep"].clear()
    return scan


def find_conv_bn_pairs(model: nn.Module, example_input: Any = None) -> ConvScan:
    """Every plain ``Conv2d`` of ``model`` (outside blocks) and the BatchNorm that consumes only its
    output, found with ``torch.fx`` or, when the model does not trace, with a hook-based eval-mode
    forward probe (``example_input``, or guessed ``2×C×S×S`` inputs) that follows tensor identity.

    A conv pairs with a BN only if the conv is called once, its output's only consumer is that BN
    call, and the BN is called once.
    """
    try:
        return _scan_fx(model)
    except Exception as exc:  # noqa: BLE001 - fx raises many different errors on untraceable code
        logger.info("torch.fx could not trace the model (%s: %s); using a forward probe", type(exc).__name__, exc)
    return _scan_probe(model, example_input)
