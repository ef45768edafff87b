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

from ._tree import _conv_support, _host_modules, _is_block, _is_bn_like, _is_conv
from .hostforms import is_genuine_conv, norm_act_reason
from .block import DiverseBranchBlock
from .errors import ReparamError
from .geometry import ConvGeometry
from .transforms import bn_impurity, check_identity

__all__ = ["ConvScan", "find_bias_sinks", "find_conv_bn_pairs", "find_identity_branches"]

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
        unsupported: conv path → why a conv subclass is not treated (its form is unknown, see
            :func:`reparam.hostforms.conv_form`); those convs are not in ``convs``.
        norm_act: BN paths of the pairs whose BN is a norm+activation layer (its ``act`` / ``drop``
            stay after the block, see :func:`reparam.hostforms.split_norm_act`).
        sinks: conv path → its bias sinks (see :func:`find_bias_sinks`) for every bias-free conv
            without a BN of its own whose output reaches BatchNorms only in ways that can absorb a
            per-channel constant; filled by the ``torch.fx`` scan only.
    """

    convs: dict[str, str | None] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    method: str = "fx"
    notes: dict[str, str] = field(default_factory=dict)
    identity: dict[str, str] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)
    norm_act: set[str] = field(default_factory=set)
    sinks: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

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
        if m is None or not _is_conv(m) or node.target in found or not _supported(m):
            continue
        bn_path = None
        users = list(node.users)
        if calls[node.target] == 1 and len(users) == 1 and users[0].op == "call_module":
            u = users[0]
            um = modules.get(u.target)
            if um is not None and _is_bn_like(um) and calls[u.target] == 1 and tuple(u.args) == (node,) and not u.kwargs:
                bn_path = _pair_bn(scan, str(node.target), str(u.target), um)
        found[str(node.target)] = bn_path
    for path, m in _host_modules(model):
        if _is_conv(m):
            if not _record_support(scan, path, m):
                continue
            scan.convs[path] = found.get(path)
            scan.calls[path] = calls.get(path, 0)
    scan.identity = {bn: conv for bn, (conv, _) in _identity_branches(graph, modules, calls).items()}
    scan.sinks = {c: s for c, s in _bias_sinks(graph, modules, calls).items() if scan.convs.get(c, "") is None}
    return scan


def _supported(m: nn.Module) -> bool:
    return not isinstance(_conv_support(m), str)


def _record_support(scan: ConvScan, path: str, m: nn.Module) -> bool:
    """Whether conv ``m`` can be treated (its form is known); records the reason when not."""
    form = _conv_support(m)
    if isinstance(form, str):
        scan.unsupported[path] = form
        return False
    return True


def _pair_bn(scan: ConvScan, conv_path: str, bn_path: str, bn: nn.Module) -> str | None:
    """``bn_path`` when the BN consuming only the conv's output pairs with it (a plain BN, or a
    norm+activation BN whose activation stays after the block), else ``None`` with a note."""
    impure = bn_impurity(bn)
    if impure is None:
        return bn_path
    why = norm_act_reason(bn)
    if why is None:
        scan.norm_act.add(bn_path)
        return bn_path
    scan.notes[conv_path] = f"its BatchNorm {bn_path}: {impure}"
    return None


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


# ---------------------------------------------------------------------------------------------
# bias sinks: where the bias of a bias-free conv without a BN of its own can go in the host layout


_CAT_FUNCTIONS = (torch.cat, torch.concat, torch.concatenate)


def _cat_parts(node: torch.fx.Node) -> list[Any] | None:
    """The operands of ``node`` when it is a concatenation along the channel axis (``torch.cat``
    with ``dim=1`` or ``-3``), else ``None``."""
    if node.op != "call_function" or node.target not in _CAT_FUNCTIONS:
        return None
    args, kwargs = list(node.args), dict(node.kwargs)
    tensors = args.pop(0) if args else kwargs.pop("tensors", None)
    dim = args.pop(0) if args else kwargs.pop("dim", kwargs.pop("axis", 0))
    if args or kwargs or not isinstance(tensors, (list, tuple)) or dim not in (1, -3):
        return None
    return list(tensors)


def _node_channels(node: Any, modules: Mapping[str, nn.Module]) -> int | None:
    """Channel count of a node's output when the graph alone shows it (a conv, block or BN
    output, or a channel concatenation of such), else ``None``."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "call_module":
        m = modules.get(str(node.target))
        if m is None:
            return None
        if isinstance(m, nn.Conv2d) or _is_block(m):  # blocks answer out_channels like their conv
            return int(m.out_channels)  # type: ignore[arg-type]  # a conv or a block: an int
        if m is not None and _is_bn_like(m):
            return _bn_channels(m)
        return None
    parts = _cat_parts(node)
    if parts is None:
        return None
    sizes = [_node_channels(p, modules) for p in parts]
    known = [s for s in sizes if s is not None]
    return None if len(known) < len(sizes) else sum(known)


def _bn_channels(bn: nn.Module) -> int | None:
    rm = getattr(bn, "running_mean", None)
    return int(rm.numel()) if isinstance(rm, Tensor) else None


def _sink_bn(node: torch.fx.Node, arg: torch.fx.Node, modules: Mapping[str, nn.Module], calls: Counter) -> nn.Module | None:
    """The module of ``node`` when it is a BatchNorm called once, on ``arg`` alone, with running
    statistics, whose forward is torch's BatchNorm (optionally followed by its proven act/drop)."""
    if node.op != "call_module" or calls[node.target] != 1 or tuple(node.args) != (arg,) or node.kwargs:
        return None
    bn = modules.get(str(node.target))
    if bn is None or not _is_bn_like(bn) or _bn_channels(bn) is None:
        return None
    rm = bn.running_mean
    if not (isinstance(rm, Tensor) and rm.is_floating_point()):
        return None
    if bn_impurity(bn) is not None and norm_act_reason(bn) is not None:
        return None
    return bn


def _conv_sinks(
    node: torch.fx.Node, modules: Mapping[str, nn.Module], calls: Counter
) -> list[dict[str, Any]] | None:
    """The bias sinks of the conv at ``node`` (every consumer of its output must be one), or ``None``."""
    conv = modules[str(node.target)]
    c = int(conv.out_channels)  # type: ignore[arg-type]
    users = list(node.users)
    if not users:
        return None
    # (b) conv -> bias-free 1x1 conv (groups 1, no padding) -> BatchNorm
    if len(users) == 1 and users[0].op == "call_module":
        pw_node = users[0]
        pw = modules.get(str(pw_node.target))
        if not (
            isinstance(pw, nn.Conv2d) and is_genuine_conv(pw) and pw.bias is None and tuple(pw.kernel_size) == (1, 1)
            and pw.groups == 1 and pw.in_channels == c and calls[pw_node.target] == 1
            and tuple(pw_node.args) == (node,) and not pw_node.kwargs and len(pw_node.users) == 1
            and (isinstance(pw.padding, str) or tuple(pw.padding) == (0, 0))
        ):
            return None
        (bn_node,) = pw_node.users
        bn = _sink_bn(bn_node, pw_node, modules, calls)
        if bn is None or _bn_channels(bn) != pw.out_channels:
            return None
        return [{"bn": str(bn_node.target), "offset": 0, "through": str(pw_node.target)}]
    # (a) conv -> channel concatenation(s) -> BatchNorm (every concatenation feeds one BN only)
    sinks: list[dict[str, Any]] = []
    for cat in users:
        parts = _cat_parts(cat)
        if parts is None or len(cat.users) != 1:
            return None
        (bn_node,) = cat.users
        bn = _sink_bn(bn_node, cat, modules, calls)
        if bn is None or not isinstance(bn, nn.BatchNorm2d):  # dim=1 is the channel axis of 4-D inputs only
            return None
        total = _bn_channels(bn)
        sizes = [_node_channels(p, modules) for p in parts]
        known = [s is not None for s in sizes]
        if all(known) and sum(sizes) != total:  # type: ignore[arg-type]
            return None
        for i, p in enumerate(parts):
            if p is not node:
                continue
            if all(known[:i]):
                offset = sum(sizes[:i])  # type: ignore[arg-type]
            elif all(known[i + 1:]) and total is not None:
                offset = total - c - sum(sizes[i + 1:])  # type: ignore[arg-type]
            else:
                return None
            if offset < 0 or total is None or offset + c > total:
                return None
            sinks.append({"bn": str(bn_node.target), "offset": int(offset), "through": None})
    return sinks or None


def _bias_sinks(graph: torch.fx.Graph, modules: Mapping[str, nn.Module], calls: Counter) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for node in graph.nodes:
        if node.op != "call_module" or calls[node.target] != 1 or node.target in found:
            continue
        m = modules.get(str(node.target))
        if m is None or not _is_conv(m) or m.bias is not None or not _supported(m):
            continue
        sinks = _conv_sinks(node, modules, calls)
        if sinks is not None:
            found[str(node.target)] = sinks
    return found


def find_bias_sinks(model: nn.Module) -> dict[str, list[dict[str, Any]]]:
    """Bias sinks of the bias-free convs of ``model``: ``{conv path: [{"bn", "offset", "through"}]}``.

    A bias sink is a BatchNorm that can absorb a per-channel constant ``b`` added to a conv's output
    exactly (in eval mode by moving its running mean, ``μ ← μ − b``; in train mode the constant
    cancels in the batch statistics), so a block expanded from the conv can get a bias (conv mode)
    and :func:`reparam.merge` with ``target="host"`` can move that bias into the BatchNorm. Proven
    from the ``torch.fx`` graph; the conv is called once and *every* consumer of its output is on a
    path to a sink:

    * (a) ``through=None``: a channel concatenation (``torch.cat(..., dim=1)``) whose only consumer
      is a ``BatchNorm2d`` called once; the conv's channels are ``offset ... offset + C`` of the BN
      (the other operands' channel counts must follow from the graph on one side of the conv).
      Several such concatenations (DenseNet) give several sinks, each absorbing ``b``.
    * (b) ``through=<path>``: a bias-free ``1×1`` conv (groups 1, no padding, called once) that
      consumes only the conv's output and whose only consumer is a BatchNorm called once; the BN
      absorbs ``W·b`` (``W``: the 1×1 kernel as an ``O × C`` matrix).

    The BatchNorm must have running statistics and be torch's BatchNorm (or a norm+activation BN
    whose form :func:`reparam.hostforms.norm_act_reason` proves). Convs paired with a BN of their
    own are not listed; models that do not trace give ``{}``.
    """
    try:
        scan = _scan_fx(model)
    except Exception as exc:  # noqa: BLE001 - untraceable models simply have no detected sinks
        logger.info("torch.fx could not trace the model (%s: %s); bias sinks are not detected", type(exc).__name__, exc)
        return {}
    return scan.sinks


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
        if _is_conv(m):
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
        if not _is_conv(m) or not _record_support(scan, path, m):
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
            bn_path = _pair_bn(scan, path, bns[0], model.get_submodule(bns[0]))
        scan.convs[path] = bn_path
    state["keep"].clear()
    return scan


def find_conv_bn_pairs(model: nn.Module, example_input: Any = None) -> ConvScan:
    """Every ``Conv2d`` of ``model`` (outside blocks) whose form reparam knows (plain convs, and the
    subclasses :func:`reparam.hostforms.conv_form` identifies; the others go to ``unsupported`` with
    the reason) and the BatchNorm that consumes only its output, found with ``torch.fx`` or, when
    the model does not trace, with a hook-based eval-mode forward probe (``example_input``, or
    guessed ``2×C×S×S`` inputs) that follows tensor identity.

    A conv pairs with a BN only if the conv is called once, its output's only consumer is that BN
    call, and the BN is called once. The BN is a plain BatchNorm or a norm+activation BatchNorm
    (timm's ``BatchNormAct2d`` ...) whose form :func:`reparam.hostforms.norm_act_reason` proves;
    the latter are listed in ``norm_act``.
    """
    try:
        return _scan_fx(model)
    except Exception as exc:  # noqa: BLE001 - fx raises many different errors on untraceable code
        logger.info("torch.fx could not trace the model (%s: %s); using a forward probe", type(exc).__name__, exc)
    return _scan_probe(model, example_input)
