"""Whole-model expansion, merging, structure specs and REP(global, local).

Guarantees:

* :func:`expand` is **bit-exact in train and eval mode** (zero-γ growth): the expanded model
  computes exactly what the input model computed, and its anchor BNs update exactly the same
  running statistics.
* :func:`merge` is **exact in eval mode** (float64 computation, rounding only). ``target="deploy"``
  leaves no BatchNorm after any conv (every block merged, every remaining conv+BN pair folded, BN
  slots become ``nn.Identity``) and folds every BN-only identity branch (RepVGG's
  ``conv(x) + ... + bn(x)``) into the conv it is summed with (its slot becomes
  :class:`FoldedIdentity`); BatchNorms with a built-in activation are never folded; ``target="host"`` restores the host model's layer layout and
  state-dict keys (strict load into a freshly built original model).
* :func:`rep_to_local` makes every block of a local (expanded) model equal, in eval mode, to the
  corresponding plain conv of a global model, keeping the local branches (DynamicFL ``REP``).
* :func:`structure` / :func:`build` round-trip the train-form module tree (same modules, same
  state-dict keys) so checkpoints load with ``strict=True``.

Conv → BN pairs are found from the data flow, never from registration order: with ``torch.fx``
when the model traces, otherwise with one eval-mode forward probe that follows tensor identities
(a BN pairs with a conv only if it is the sole consumer of the conv's output).
"""

from __future__ import annotations

import copy
import fnmatch
import logging
import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.fx
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .block import DiverseBranchBlock
from .changes import StructureChange
from .errors import NotMergeableError, ReparamError, ReparamModeError
from .geometry import ConvGeometry
from .transforms import BNStats, bn_impurity, bn_stats, check_identity, fuse_bn

__all__ = [
    "SPEC_FORMAT",
    "SPEC_VERSION",
    "ConvScan",
    "find_conv_bn_pairs",
    "find_identity_branches",
    "FoldedIdentity",
    "expand",
    "merge",
    "structure",
    "build",
    "merge_state_dict",
    "detect_form",
    "strip_prefixes",
    "iter_blocks",
    "rep_to_local",
]

logger = logging.getLogger("reparam")

SPEC_FORMAT = "reparam.ModelSpec"
SPEC_VERSION = 1
_INFO_ATTR = "_reparam_info"

# ---------------------------------------------------------------------------------------------
# module helpers


def _is_block(m: nn.Module) -> bool:
    return isinstance(m, DiverseBranchBlock)


def _is_bn_like(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.batchnorm._BatchNorm) or type(m).__name__ == "FrozenBatchNorm2d"


def _is_plain_conv(m: nn.Module) -> bool:
    return type(m) is not DiverseBranchBlock and isinstance(m, nn.Conv2d)


def _host_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``named_modules`` without descending into blocks (blocks themselves are listed)."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(m: nn.Module, prefix: str) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        out.append((prefix, m))
        if _is_block(m):
            return
        for name, child in m.named_children():
            if child is not None:
                visit(child, f"{prefix}.{name}" if prefix else name)

    visit(model, "")
    return out


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    if not path:
        raise ReparamError("cannot replace the root module in place")
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, name, module)


def _get_module(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError as exc:
        raise ReparamError(f"module path {path!r} does not exist in the model") from exc


def _info(model: nn.Module) -> dict[str, Any]:
    info = getattr(model, _INFO_ATTR, None)
    if not isinstance(info, dict):
        info = {"pairs": {}, "skipped": {}}
    out = {"pairs": dict(info.get("pairs", {})), "skipped": dict(info.get("skipped", {}))}
    if "identity_bns" in info:
        out["identity_bns"] = {k: dict(v) for k, v in dict(info["identity_bns"]).items()}
    return out


def _identity_record(model: nn.Module, identity: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """``{BN path: {"into": conv path, "eps": eps}}`` for the structure spec."""
    out: dict[str, dict[str, Any]] = {}
    for bn_path, conv_path in identity.items():
        bn = model.get_submodule(bn_path)
        out[bn_path] = {"into": conv_path, "eps": float(getattr(bn, "eps", 1e-5))}
    return out


def _set_info(model: nn.Module, info: dict[str, Any]) -> None:
    object.__setattr__(model, _INFO_ATTR, info)


def iter_blocks(model: nn.Module, *, nested: bool = False) -> Iterator[tuple[str, DiverseBranchBlock]]:
    """Yield ``(path, block)`` for the blocks of ``model`` in module order.

    Only outermost blocks unless ``nested=True`` (then nested blocks follow their parent).
    """
    if nested:
        for path, m in model.named_modules():
            if _is_block(m):
                yield path, m  # type: ignore[misc]
        return
    for path, m in _host_modules(model):
        if _is_block(m):
            yield path, m  # type: ignore[misc]


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


class FoldedIdentity(nn.Module):
    """Stands where a BN-only identity branch was after :func:`merge` folded it into the conv at
    path ``into``. Its forward returns a zero scalar (0-dim tensor of the input's dtype and device):
    the model's own sum ``... + branch(x)`` broadcasts it and leaves every value unchanged, so the
    model's forward code keeps working without the BatchNorm. No parameters, no state-dict keys."""

    def __init__(self, into: str = "") -> None:
        super().__init__()
        self.into = into

    def forward(self, x: Tensor) -> Tensor:
        return x.new_zeros(())

    def extra_repr(self) -> str:
        return f"into={self.into!r}"


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


def _identity_fits(conv: nn.Module, bn: nn.Module) -> str | None:
    """Why the identity through ``bn`` cannot be added to ``conv``'s kernel (``None``: it can)."""
    geometry = conv.geometry if _is_block(conv) else ConvGeometry.from_conv(conv)  # type: ignore[arg-type]
    try:
        check_identity(geometry)
    except ReparamError as exc:
        return str(exc)
    n = getattr(bn, "num_features", None) or bn.running_mean.numel()
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
            size = max(conv.geometry.kernel_size if _is_block(conv) else conv.kernel_size)
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
    p = first.weight if not _is_block(first) else next(first.parameters())
    c = first.in_channels if not _is_block(first) else first.geometry.in_channels
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


# ---------------------------------------------------------------------------------------------
# expand


def _matches(path: str, patterns: str | Iterable[str] | None) -> bool:
    if patterns is None:
        return False
    if isinstance(patterns, str):
        patterns = [patterns]
    return any(fnmatch.fnmatchcase(path, p) for p in patterns)


def _default_filter(conv: nn.Conv2d) -> bool:
    return _default_reason(conv) is None


def _default_reason(conv: nn.Conv2d) -> str | None:
    """Why the default plan leaves ``conv`` plain (``None``: it expands it)."""
    kh, kw = conv.kernel_size
    if max(kh, kw) <= 1:
        return (
            "1x1 kernel: the default plan expands kernels with 1 < max(K) <= 5 (a 1x1 conv has no "
            "spatial branches to add); name the conv in a plan to expand it anyway"
        )
    if max(kh, kw) > 5:
        return (
            f"{kh}x{kw} kernel: the default plan expands kernels up to 5x5 (for large kernels, e.g. "
            "ConvNeXt's 7x7 depthwise convs, the extra branches cost far more than they add); name "
            "the conv in a plan to expand it anyway"
        )
    return None


def _capture_inputs(model: nn.Module, paths: list[str], batches: Any) -> dict[str, list[Tensor]]:
    captured: dict[str, list[Tensor]] = {p: [] for p in paths}
    handles = []
    for p in paths:
        m = model.get_submodule(p)

        def hook(mod, inp, p=p):  # type: ignore[no-untyped-def]
            captured[p].append(inp[0].detach())

        handles.append(m.register_forward_pre_hook(hook))
    flags = {m: m.training for m in model.modules()}
    items = [batches] if isinstance(batches, Tensor) else list(batches)
    try:
        model.eval()
        with torch.no_grad():
            for x in items:
                model(*x) if isinstance(x, (tuple, list)) else model(x)
    finally:
        for h in handles:
            h.remove()
        for m, t in flags.items():
            m.training = t
    return captured


def expand(
    model: nn.Module,
    plan: Mapping[str, Any] | Callable[[str, nn.Conv2d, nn.Module | None], Any] | None = None,
    branches: Any = None,
    *,
    inplace: bool = False,
    anchor_norm: str = "frozen_identity",
    calibration_input: Any = None,
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    init: str = "zero_gamma",
    allow_new_bias: bool = False,
    example_input: Any = None,
    generator: torch.Generator | None = None,
) -> nn.Module:
    """Expand the convs of an arbitrary model into Diverse Branch Blocks (bit-exact, train and eval).

    Args:
        model: any ``nn.Module`` (torchvision, timm, ``nn.Sequential``, ...).
        plan: ``None`` (every conv with ``1 < max(K) ≤ 5`` gets ``branches``), a mapping
            ``conv path → kinds`` (only those paths; each explicitly requested), or a callable
            ``(path, conv, bn) → kinds | None`` called for every conv (``None`` skips it).
        branches: the kinds for ``plan=None`` (see :meth:`DiverseBranchBlock.from_conv`).
        inplace: modify ``model`` instead of a deep copy.
        anchor_norm, calibration_input: for convs without a following BN (``calibration_input``:
            model input batches, used with ``anchor_norm="calibrated"``).
        include, exclude: module-path globs restricting the convs considered.
        init, allow_new_bias, generator: passed to :meth:`DiverseBranchBlock.from_conv`.
        example_input: input for the forward probe when the model does not trace with ``torch.fx``.

    Every conv that is left plain is reported with the reason (INFO log and the ``"skipped"``
    mapping ``conv path → reason`` of :func:`structure`): outside the default kernel range
    (1×1, or larger than 5×5 such as ConvNeXt's 7×7 depthwise convs), filtered out by
    ``include``/``exclude`` or the plan, never called, or not expandable exactly. A conv that the
    plan names explicitly and that cannot be expanded raises the reason instead. A conv paired with a BN is expanded together with it (the BN slot becomes
    ``nn.Identity``). Convs that are already blocks are left alone (a second expand is a no-op).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if plan is not None and not isinstance(plan, Mapping) and not callable(plan):
        raise TypeError("plan must be None, a mapping of conv path -> kinds, or a callable (path, conv, bn) -> kinds")
    if _is_block(model):
        return model if inplace else copy.deepcopy(model)
    if not inplace:
        model = copy.deepcopy(model)
    if isinstance(model, nn.Conv2d):  # a bare conv is its own (conv-mode) block
        kinds = plan.get("", branches) if isinstance(plan, Mapping) else (plan("", model, None) if plan else branches)
        block = DiverseBranchBlock.from_conv(
            model, None, kinds, anchor_norm=anchor_norm, calibration_input=calibration_input, init=init,
            allow_new_bias=allow_new_bias, generator=generator,
        )
        block.host_path = ""
        return block
    scan = find_conv_bn_pairs(model, example_input)
    info = _info(model)
    requests: list[tuple[str, Any, bool]] = []
    if isinstance(plan, Mapping):
        unknown = [p for p in plan if p not in scan.convs]
        modules = dict(model.named_modules())
        unknown_blocks = [p for p in unknown if p in modules and _is_block(modules[p])]
        if unknown_blocks:
            logger.info("already expanded, left unchanged: %s", unknown_blocks)
        unknown = [p for p in unknown if p not in unknown_blocks]
        if unknown:
            raise ReparamError(f"plan names paths that are not plain Conv2d modules of the model: {unknown}")
    not_requested: dict[str, str] = {}  # conv path -> why it is left plain
    for path, bn_path in scan.convs.items():
        conv = model.get_submodule(path)
        if include is not None and not _matches(path, include):
            not_requested[path] = f"not matched by include={include!r}"
            continue
        if _matches(path, exclude):
            not_requested[path] = f"matched by exclude={exclude!r}"
            continue
        bn = model.get_submodule(bn_path) if bn_path else None
        if isinstance(plan, Mapping):
            if path not in plan or plan[path] is None:
                not_requested[path] = "not named in the plan" if path not in plan else "the plan maps it to None"
                continue
            requests.append((path, plan[path], True))
        elif plan is not None:
            kinds = plan(path, conv, bn)
            if kinds is None:
                not_requested[path] = "the plan returned None for it"
                continue
            requests.append((path, kinds, True))
        else:
            reason = _default_reason(conv)  # type: ignore[arg-type]
            if reason is None:
                requests.append((path, branches, False))
            else:
                not_requested[path] = reason
    for path, reason in not_requested.items():
        logger.info("conv %s left unexpanded: %s", path, reason)
        info["skipped"][path] = reason
    calib: dict[str, list[Tensor]] = {}
    if anchor_norm == "calibrated":
        need = [p for p, _, _ in requests if scan.convs[p] is None]
        if need:
            if calibration_input is None:
                raise ReparamError("anchor_norm='calibrated' needs calibration_input (model input batches)")
            calib = _capture_inputs(model, need, calibration_input)
    for path, kinds, explicit in requests:
        conv = model.get_submodule(path)
        bn_path = scan.convs[path]
        bn = model.get_submodule(bn_path) if bn_path else None
        reason = None
        if scan.calls.get(path, 0) == 0:
            reason = "the conv is not called in the model's forward pass"
        elif bn is None and scan.calls.get(path, 0) > 1 and anchor_norm == "calibrated":
            reason = "a conv called more than once cannot be calibrated"
        block = None
        if reason is None:
            try:
                block = DiverseBranchBlock.from_conv(
                    conv,  # type: ignore[arg-type]
                    bn,
                    kinds,
                    anchor_norm=anchor_norm,
                    calibration_input=calib.get(path),
                    init=init,
                    allow_new_bias=allow_new_bias,
                    generator=generator,
                )
            except ReparamError as exc:
                note = f"{scan.notes[path]}; " if bn is None and path in scan.notes else ""
                if explicit:
                    raise type(exc)(f"{path}: {note}{exc}") from exc
                reason = f"{note}{exc}"
        if block is None:
            if explicit:
                raise NotMergeableError(f"{path}: {reason}")
            logger.info("conv %s left unexpanded: %s", path, reason)
            info["skipped"][path] = reason
            continue
        block.host_path = path
        block.bn_path = bn_path
        _set_module(model, path, block)
        if bn_path:
            _set_module(model, bn_path, nn.Identity())
        info["skipped"].pop(path, None)
    info["pairs"] = {c: b for c, b in scan.pairs.items() if not _is_block(model.get_submodule(c))}
    if scan.method == "fx":
        info["identity_bns"] = _identity_record(model, scan.identity)
    else:
        logger.info("BN-only identity branches are found from the torch.fx graph; this model does not trace")
        info.setdefault("identity_bns", {})
    _set_info(model, info)
    return model


# ---------------------------------------------------------------------------------------------
# merge


def _fold_pair(conv: nn.Conv2d, bn: nn.Module, compute_dtype: torch.dtype) -> nn.Conv2d:
    geometry = ConvGeometry.from_conv(conv)
    with torch.no_grad():
        w = conv.weight.to(compute_dtype)
        b = None if conv.bias is None else conv.bias.to(compute_dtype)
        k, bias = fuse_bn(w, b, bn)
        new = geometry.make_conv(bias=True, initialize=False, device=conv.weight.device, dtype=conv.weight.dtype)
        new.weight.copy_(k)
        new.bias.copy_(bias)
    new.train(conv.training)
    return new


def _current_pairs(model: nn.Module, example_input: Any) -> tuple[dict[str, str], dict[str, str]]:
    """The conv→BN pairs still to fold and the BN-only identity branches (BN path → conv path),
    from the record kept by :func:`expand` / :func:`merge` when it is still valid, else scanned."""
    info = getattr(model, _INFO_ATTR, None)
    if isinstance(info, dict) and "pairs" in info:
        pairs = {}
        valid = True
        for c, b in dict(info["pairs"]).items():
            try:
                cm, bm = model.get_submodule(c), model.get_submodule(b)
            except AttributeError:
                valid = False
                break
            if isinstance(bm, nn.Identity) or _is_block(cm):
                continue
            if not (_is_plain_conv(cm) and _is_bn_like(bm)) or bn_impurity(bm) is not None:
                valid = False
                break
            pairs[c] = b
        if valid:
            identity = {b: str(rec["into"]) for b, rec in dict(info.get("identity_bns", {})).items()}
            return pairs, identity
    scan = find_conv_bn_pairs(model, example_input)
    return scan.pairs, dict(scan.identity)


def _fold_identity(conv: nn.Conv2d, bn: nn.Module, compute_dtype: torch.dtype) -> nn.Conv2d:
    """A biased conv computing ``conv(x) + bn(x)`` in eval mode (identity kernel through the BN)."""
    geometry = ConvGeometry.from_conv(conv)
    check_identity(geometry)
    s = bn_stats(bn)
    with torch.no_grad():
        t = torch.rsqrt(s.var.to(compute_dtype) + s.eps)
        if s.gamma is not None:
            t = s.gamma.to(compute_dtype) * t
        shift = -t * s.mean.to(compute_dtype)
        if s.beta is not None:
            shift = shift + s.beta.to(compute_dtype)
        w = conv.weight.to(compute_dtype, copy=True)
        b = shift if conv.bias is None else conv.bias.to(compute_dtype) + shift
        c = geometry.in_channels
        idx = torch.arange(c, device=w.device)
        kh, kw = geometry.kernel_size
        w[idx, idx % (c // geometry.groups), kh // 2, kw // 2] += t.to(w.device)
        new = geometry.make_conv(bias=True, initialize=False, device=conv.weight.device, dtype=conv.weight.dtype)
        new.weight.copy_(w)
        new.bias.copy_(b)
    new.train(conv.training)
    return new


def merge(
    model: nn.Module,
    *,
    inplace: bool = False,
    target: str = "deploy",
    require_eval: bool = True,
    example_input: Any = None,
    compute_dtype: torch.dtype = torch.float64,
) -> nn.Module:
    """Merge every block of ``model`` (eval-exact; float64 computation).

    Args:
        target: ``"deploy"``: every block becomes one biased ``Conv2d`` at its path, every remaining
            conv+BN pair is folded (BN slot → ``nn.Identity``), so no BatchNorm follows a conv, and
            every BN-only identity branch (:func:`find_identity_branches`) is folded into its conv
            (BN slot → :class:`FoldedIdentity`). A branch whose conv no longer fits is left and
            logged; ``structure(model)["identity_bns"]`` says which were folded.
            ``"host"``: the host layout is restored (``conv_bn`` blocks → the anchor conv at the conv
            path and the anchor BN, carrying the folded branches, at the BN path; ``conv`` blocks →
            a biased conv); the state-dict keys equal those of the original model.
        inplace: modify ``model`` instead of a deep copy. The result keeps the train/eval flags.
        require_eval: raise ``ReparamModeError`` when a BN that takes part is in training mode.
        example_input: forward-probe input for untraceable models (pair discovery).

    Idempotent: merging a merged model changes nothing.
    """
    if target not in ("deploy", "host"):
        raise ReparamError(f"target must be 'deploy' or 'host', got {target!r}")
    if _is_block(model):
        blk = model if inplace else copy.deepcopy(model)
        if target == "deploy":
            return blk.merge(require_eval=require_eval, compute_dtype=compute_dtype, consume=inplace)  # type: ignore[operator]
        conv, bn = blk.to_host(require_eval=require_eval)  # type: ignore[operator]
        return conv if bn is None else nn.Sequential(conv, bn)
    blocks = list(iter_blocks(model))
    if require_eval:
        for path, blk in blocks:
            try:
                blk._check_eval()
            except ReparamModeError as exc:
                raise ReparamModeError(f"{path}: {exc}") from exc
    if not inplace:
        if target == "deploy":
            # blocks are replaced, not modified: do not copy their internals
            memo = {id(blk): blk for _, blk in blocks if not blk.is_merged}
            model = copy.deepcopy(model, memo)
        else:
            model = copy.deepcopy(model)
        blocks = [(p, model.get_submodule(p)) for p, _ in blocks]  # type: ignore[misc]
    info = _info(model)
    for path, blk in blocks:
        if target == "deploy":
            conv = blk.merge(require_eval=False, compute_dtype=compute_dtype, consume=inplace)
            if blk.is_merged and not inplace:
                conv = copy.deepcopy(conv)
            _set_module(model, path, conv)
        else:
            conv, bn = blk.to_host(require_eval=False)
            _set_module(model, path, conv)
            if bn is not None:
                if not blk.bn_path:
                    raise ReparamError(
                        f"{path}: a conv_bn block without a recorded bn_path cannot be restored to the host "
                        "layout; use target='deploy'"
                    )
                _set_module(model, blk.bn_path, bn)
                info["pairs"][path] = blk.bn_path
    if target == "deploy":
        pairs, identity = _current_pairs(model, example_input)
        unfolded: set[str] = set()
        for conv_path, bn_path in pairs.items():
            conv = model.get_submodule(conv_path)
            bn = model.get_submodule(bn_path)
            if require_eval and getattr(bn, "training", False) and isinstance(bn, nn.modules.batchnorm._BatchNorm):
                raise ReparamModeError(
                    f"{bn_path}: BatchNorm in training mode; folding is exact in eval mode only: call model.eval()"
                )
            try:
                new = _fold_pair(conv, bn, compute_dtype)  # type: ignore[arg-type]
            except ReparamError as exc:
                logger.info("pair %s -> %s not folded: %s", conv_path, bn_path, exc)
                unfolded.add(conv_path)
                continue
            _set_module(model, conv_path, new)
            _set_module(model, bn_path, nn.Identity())
        info["pairs"] = {}
        _fold_identities(model, identity, unfolded, require_eval, compute_dtype)
    _set_info(model, info)
    return model


def _fold_identities(
    model: nn.Module, identity: Mapping[str, str], unfolded: set[str], require_eval: bool, compute_dtype: torch.dtype
) -> None:
    """Fold each BN-only identity branch into its conv (deploy merge, after the pairs are folded);
    the BN slot becomes :class:`FoldedIdentity`. Branches that no longer fit are left and logged."""
    for bn_path, conv_path in identity.items():
        try:
            bn, conv = model.get_submodule(bn_path), model.get_submodule(conv_path)
        except AttributeError:
            logger.info("identity branch %s -> %s: module missing; not folded", bn_path, conv_path)
            continue
        if isinstance(bn, FoldedIdentity):
            continue
        reason = None
        if conv_path in unfolded:
            reason = "the conv's own BatchNorm could not be folded"
        elif not _is_plain_conv(conv):
            reason = f"{conv_path} is a {type(conv).__name__}, not a plain conv"
        elif not _is_bn_like(bn) or bn_impurity(bn) is not None:
            reason = bn_impurity(bn) or f"{bn_path} is a {type(bn).__name__}, not a BatchNorm"
        else:
            reason = _identity_fits(conv, bn)
        if reason is not None:
            logger.info("identity branch %s -> %s not folded: %s", bn_path, conv_path, reason)
            continue
        if require_eval and getattr(bn, "training", False) and isinstance(bn, nn.modules.batchnorm._BatchNorm):
            raise ReparamModeError(
                f"{bn_path}: BatchNorm in training mode; folding is exact in eval mode only: call model.eval()"
            )
        _set_module(model, conv_path, _fold_identity(conv, bn, compute_dtype))  # type: ignore[arg-type]
        _set_module(model, bn_path, FoldedIdentity(conv_path))


# ---------------------------------------------------------------------------------------------
# structure spec


def structure(model: nn.Module) -> dict[str, Any]:
    """JSON-serialisable ``ModelSpec`` of ``model``: what :func:`build` and
    :func:`merge_state_dict` need to rebuild or merge the model from a plain copy and a state dict.

    Keys: ``blocks`` (every outermost block's structure), ``pairs`` (unexpanded conv→BN pairs,
    folded by a deploy merge) and ``pair_eps``, ``skipped`` (every conv left plain by
    :func:`expand`, with the reason), ``identity_bns`` (BN-only identity branches
    ``{BN path: {"into": conv path, "eps": eps, "folded": bool}}``, folded into that conv by a deploy
    merge; ``folded`` is true once the BN slot holds :class:`FoldedIdentity`)."""
    info = _info(model)
    blocks = {path: blk.spec() for path, blk in iter_blocks(model)}
    modules = dict(model.named_modules())
    pair_eps = {b: float(modules[b].eps) for b in info["pairs"].values() if b in modules and hasattr(modules[b], "eps")}
    identity = {
        b: {**rec, "folded": isinstance(modules.get(b), FoldedIdentity)}
        for b, rec in dict(info.get("identity_bns", {})).items()
    }
    return {
        "format": SPEC_FORMAT,
        "version": SPEC_VERSION,
        "blocks": blocks,
        "pairs": dict(info["pairs"]),
        "pair_eps": pair_eps,
        "skipped": dict(info["skipped"]),
        "identity_bns": identity,
    }


def _check_spec(spec: Mapping[str, Any]) -> None:
    if not isinstance(spec, Mapping) or spec.get("format") != SPEC_FORMAT:
        raise ReparamError(f"spec must be a mapping with format {SPEC_FORMAT!r} (from reparam.structure)")
    if spec.get("version") != SPEC_VERSION:
        raise ReparamError(f"unsupported spec version {spec.get('version')!r}; this library reads {SPEC_VERSION}")


def build(model: nn.Module, spec: Mapping[str, Any], *, form: str = "train", inplace: bool = True) -> nn.Module:
    """Rebuild the structure recorded in ``spec`` on a plain (host-layout) model.

    ``form="train"``: blocks with fresh parameters (then ``load_state_dict(sd, strict=True)``);
    ``form="deploy"``: the deploy layout of :func:`merge` (biased convs, BN slots ``Identity``).
    The model must be clean (no blocks at the spec's paths). Returns the model (in place by default).
    """
    _check_spec(spec)
    if form not in ("train", "deploy"):
        raise ReparamError(f"form must be 'train' or 'deploy', got {form!r}")
    if not inplace:
        model = copy.deepcopy(model)
    for path, bs in dict(spec["blocks"]).items():
        conv = _get_module(model, path)
        if _is_block(conv):
            raise ReparamError(f"{path} is already a DiverseBranchBlock; build needs a clean plain model")
        if not isinstance(conv, nn.Conv2d):
            raise ReparamError(f"{path} is a {type(conv).__name__}, expected nn.Conv2d")
        bn_path = bs.get("bn_path")
        bn = _get_module(model, bn_path) if bs.get("mode") == "conv_bn" and bn_path else None
        if bs.get("mode") == "conv_bn" and (bn is None or not _is_bn_like(bn)):
            raise ReparamError(
                f"{path}: the spec records a conv+BN block but the model has "
                f"{type(bn).__name__ if bn is not None else 'no module'} at BN path {bn_path!r}; "
                "build needs the host (plain) layout of the model"
            )
        if form == "deploy":
            geometry = ConvGeometry.from_dict(bs["geometry"])
            new = geometry.make_conv(bias=True, device=conv.weight.device, dtype=conv.weight.dtype)
            new.train(conv.training)
        else:
            new = DiverseBranchBlock.from_spec(conv, bn, bs)
            new.host_path = path
            new.bn_path = bn_path
        _set_module(model, path, new)
        if bn is not None and bn_path:
            _set_module(model, bn_path, nn.Identity())
    pairs = dict(spec.get("pairs", {}))
    if form == "deploy":
        for c, b in pairs.items():
            conv = _get_module(model, c)
            geometry = ConvGeometry.from_conv(conv)
            new = geometry.make_conv(bias=True, device=conv.weight.device, dtype=conv.weight.dtype)
            new.train(conv.training)
            _set_module(model, c, new)
            _set_module(model, b, nn.Identity())
        pairs = {}
    identity = {b: {"into": rec["into"], "eps": float(rec.get("eps", 1e-5))} for b, rec in dict(spec.get("identity_bns", {})).items()}
    if form == "deploy":
        for b, rec in identity.items():
            conv = _get_module(model, rec["into"])
            if not isinstance(conv, nn.Conv2d):
                raise ReparamError(f"identity branch {b}: {rec['into']} is a {type(conv).__name__}, expected nn.Conv2d")
            if conv.bias is None:
                new = ConvGeometry.from_conv(conv).make_conv(bias=True, device=conv.weight.device, dtype=conv.weight.dtype)
                new.train(conv.training)
                _set_module(model, rec["into"], new)
            _set_module(model, b, FoldedIdentity(rec["into"]))
    _set_info(model, {"pairs": pairs, "skipped": dict(spec.get("skipped", {})), "identity_bns": identity})
    return model


# ---------------------------------------------------------------------------------------------
# state dicts


def strip_prefixes(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Remove ``module.`` (DDP / DataParallel) and ``_orig_mod.`` (``torch.compile``) prefixes shared
    by every key."""
    sd = dict(state_dict)
    changed = True
    while changed and sd:
        changed = False
        for prefix in ("module.", "_orig_mod."):
            if all(k.startswith(prefix) for k in sd):
                sd = {k[len(prefix):]: v for k, v in sd.items()}
                changed = True
    return sd


def detect_form(state_dict: Mapping[str, Any], spec: Mapping[str, Any] | None = None) -> str:
    """``"train"`` (branch keys present), ``"deploy"`` or ``"plain"`` (host layout).

    Without ``spec`` a state dict without branch keys is ``"plain"`` unless it holds deployed-block
    keys (``reparam_conv``); with ``spec``, a missing BN at a recorded BN path means ``"deploy"``.
    """
    sd = strip_prefixes(state_dict)
    if any(".branches." in k or k.startswith("branches.") for k in sd):
        return "train"
    if any(".reparam_conv." in k or k.startswith("reparam_conv.") for k in sd):
        return "deploy"
    if spec is not None:
        _check_spec(spec)
        bn_paths = [bs.get("bn_path") for bs in spec["blocks"].values() if bs.get("mode") == "conv_bn"]
        bn_paths += list(dict(spec.get("pairs", {})).values())
        bn_paths = [b for b in bn_paths if b]
        if bn_paths:
            present = [any(k.startswith(b + ".") for k in sd) for b in bn_paths]
            if not any(present):
                return "deploy"
    return "plain"


def _sub(sd: dict[str, Any], prefix: str, pop: bool = True) -> dict[str, Any]:
    keys = [k for k in sd if k.startswith(prefix)]
    out = {k[len(prefix):]: sd[k] for k in keys}
    if pop:
        for k in keys:
            del sd[k]
    return out


def merge_state_dict(
    state_dict: Mapping[str, Tensor], spec: Mapping[str, Any], *, target: str = "deploy"
) -> dict[str, Tensor]:
    """Merge a train-form state dict into deploy or host weights from tensors alone (eval-exact,
    float64 computation). Prefixes ``module.`` / ``_orig_mod.`` are stripped first.

    ``target="deploy"`` also folds the unexpanded conv→BN pairs recorded in ``spec``.
    """
    _check_spec(spec)
    if target not in ("deploy", "host"):
        raise ReparamError(f"target must be 'deploy' or 'host', got {target!r}")
    sd = strip_prefixes(state_dict)
    out: dict[str, Any] = dict(sd)
    for path, bs in dict(spec["blocks"]).items():
        sub = _sub(out, path + ".")
        if not any(k.startswith(("branches.", "reparam_conv.")) for k in sub):
            out.update({f"{path}.{k}": v for k, v in sub.items()})  # already plain: keep
            continue
        ref = next(iter(sub.values()))
        geometry = ConvGeometry.from_dict(bs["geometry"])
        fk = {"device": ref.device, "dtype": ref.dtype if ref.is_floating_point() else torch.float32}
        conv = geometry.make_conv(bias=geometry.bias and not bs.get("new_bias", False), **fk)
        bn = nn.BatchNorm2d(geometry.out_channels, eps=float(bs.get("eps", 1e-5)), **fk) if bs["mode"] == "conv_bn" else None
        blk = DiverseBranchBlock.from_spec(conv, bn, bs)
        try:
            blk.load_state_dict(sub, strict=True)
        except RuntimeError as exc:
            raise ReparamError(f"{path}: the state dict does not match the spec: {exc}") from exc
        blk.eval()
        if target == "deploy":
            merged = blk.merge()
            out[f"{path}.weight"] = merged.weight.detach()
            out[f"{path}.bias"] = merged.bias.detach()
        else:
            hconv, hbn = blk.to_host()
            out.update({f"{path}.{k}": v.detach() for k, v in hconv.state_dict().items()})
            if hbn is not None:
                out.update({f"{bs['bn_path']}.{k}": v.detach() for k, v in hbn.state_dict().items()})
    if target == "deploy":
        for c, b in dict(spec.get("pairs", {})).items():
            bn_sd = _sub(out, b + ".")
            if not bn_sd:
                continue
            w = out[f"{c}.weight"]
            bias = out.get(f"{c}.bias")
            stats = BNStats(bn_sd["running_mean"], bn_sd["running_var"], bn_sd.get("weight"), bn_sd.get("bias"),
                            float(_pair_eps(spec, b)))
            k, bb = fuse_bn(w.to(torch.float64), None if bias is None else bias.to(torch.float64), stats)
            out[f"{c}.weight"] = k.to(w.dtype)
            out[f"{c}.bias"] = bb.to(w.dtype)
        for b, rec in dict(spec.get("identity_bns", {})).items():
            bn_sd = _sub(out, b + ".")
            if not bn_sd:
                continue  # already folded
            c = rec["into"]
            stats = BNStats(bn_sd["running_mean"], bn_sd["running_var"], bn_sd.get("weight"), bn_sd.get("bias"),
                            float(rec.get("eps", 1e-5)))
            w = out[f"{c}.weight"]
            k, bb = _identity_pair(w, out.get(f"{c}.bias"), stats)
            out[f"{c}.weight"] = k.to(w.dtype)
            out[f"{c}.bias"] = bb.to(w.dtype)
    return out


def _identity_pair(weight: Tensor, bias: Tensor | None, stats: BNStats, sign: float = 1.0) -> tuple[Tensor, Tensor]:
    """``(weight, bias)`` plus ``sign`` times the identity kernel through a BN, in float64. The
    identity needs ``C == O``, so the groups follow from the weight shape ``(O, O/g, K_h, K_w)``."""
    w = weight.to(torch.float64, copy=True)
    o, cpg, kh, kw = w.shape
    t = torch.rsqrt(stats.var.to(torch.float64) + stats.eps)
    if stats.gamma is not None:
        t = stats.gamma.to(torch.float64) * t
    shift = -t * stats.mean.to(torch.float64)
    if stats.beta is not None:
        shift = shift + stats.beta.to(torch.float64)
    idx = torch.arange(o, device=w.device)
    w[idx, idx % cpg, kh // 2, kw // 2] += sign * t.to(w.device)
    b = torch.zeros(o, dtype=torch.float64, device=w.device) if bias is None else bias.to(torch.float64)
    return w, b + sign * shift.to(b.device)


def _pair_eps(spec: Mapping[str, Any], bn_path: str) -> float:
    return float(dict(spec.get("pair_eps", {})).get(bn_path, 1e-5))


# ---------------------------------------------------------------------------------------------
# REP(global, local)


def rep_to_local(
    global_model_or_state: nn.Module | Mapping[str, Tensor],
    local_model: nn.Module,
    anchor_stats: str = "keep",
    *,
    strict: bool = True,
) -> StructureChange:
    """DynamicFL ``REP(ω_g, ζ)``: make ``local_model`` equal the global model in eval mode while
    keeping its structure and non-anchor branches.

    For every outermost block of ``local_model`` the anchor is re-solved (:meth:`DiverseBranchBlock.load_plain`)
    so that the block equals the global model's conv at the same path: a deploy-form conv (weight +
    bias, BN slot empty), or a host-form conv followed by the BN at the block's ``bn_path``
    (``anchor_stats="adopt"`` then takes that BN's statistics). Every other parameter and buffer of
    the local model is copied from the global state; a local conv+BN pair whose global counterpart
    is a folded (deploy) conv is solved into the local pair keeping the local BN statistics.

    Returns:
        StructureChange listing every overwritten parameter (no parameter is added or removed).

    Raises:
        ReparamError: the global state is a train-form state, or keys/shapes do not match (``strict``).
    """
    if isinstance(global_model_or_state, nn.Module):
        gsd = strip_prefixes(global_model_or_state.state_dict())
    elif isinstance(global_model_or_state, Mapping):
        gsd = strip_prefixes(global_model_or_state)
    else:
        raise TypeError("global_model_or_state must be an nn.Module or a state dict")
    if detect_form(gsd) == "train":
        raise ReparamError("the global state holds branch keys (train form); merge it first (reparam.merge)")
    change = StructureChange()
    used: set[str] = set()
    handled_local: set[str] = set()
    info = _info(local_model)
    # BN-only identity branches of the local model that the global (deploy) model has folded into
    # a conv: the local BN stays, and its identity part is taken out of that conv's target
    identity_into: dict[str, list[nn.Module]] = {}
    for b, rec in dict(info.get("identity_bns", {})).items():
        if f"{b}.running_mean" in gsd:
            continue  # the global model keeps the BN: copied like any other module below
        try:
            bn = local_model.get_submodule(b)
        except AttributeError:
            continue
        if not _is_bn_like(bn):
            continue
        identity_into.setdefault(str(rec["into"]), []).append(bn)
        handled_local.update(f"{b}.{k}" for k in bn.state_dict())

    def target(path: str, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
        with torch.no_grad():
            for bn in identity_into.get(path, []):
                s = bn_stats(bn)
                stats = BNStats(s.mean.detach(), s.var.detach(), None if s.gamma is None else s.gamma.detach(),
                                None if s.beta is None else s.beta.detach(), s.eps)
                weight, bias = _identity_pair(weight, bias, stats, sign=-1.0)
        return weight, bias

    blocks = list(iter_blocks(local_model))
    for path, blk in blocks:
        wk, bk = f"{path}.weight", f"{path}.bias"
        if wk not in gsd:
            dk = f"{path}.reparam_conv.weight"
            if dk in gsd:
                wk, bk = dk, f"{path}.reparam_conv.bias"
            else:
                raise ReparamError(f"{path}: the global state has no conv weight at {wk!r}")
        target_bn = None
        used.update({wk, bk})
        if blk.bn_path and f"{blk.bn_path}.running_mean" in gsd:
            bsd = {k[len(blk.bn_path) + 1:]: v for k, v in gsd.items() if k.startswith(blk.bn_path + ".")}
            used.update(f"{blk.bn_path}.{k}" for k in bsd)
            eps = float(getattr(blk.anchor.bn, "eps", 1e-5)) if not blk.is_merged else 1e-5
            target_bn = BNStats(bsd["running_mean"], bsd["running_var"], bsd.get("weight"), bsd.get("bias"), eps)
        mode = anchor_stats
        if mode == "adopt" and target_bn is None:
            mode = "keep"
        change.extend(blk.load_plain(*target(path, gsd[wk], gsd.get(bk)), anchor_stats=mode, target_bn=target_bn))
        for k, _ in blk.named_parameters():
            handled_local.add(f"{path}.{k}")
        for k, _ in blk.named_buffers():
            handled_local.add(f"{path}.{k}")
    # local conv+BN pairs whose global counterpart is folded
    for c, b in info["pairs"].items():
        try:
            conv, bn = local_model.get_submodule(c), local_model.get_submodule(b)
        except AttributeError:
            continue
        if not (_is_plain_conv(conv) and _is_bn_like(bn)):
            continue
        if f"{b}.running_mean" in gsd or f"{c}.weight" not in gsd:
            continue  # global has the same layout: plain copy below
        w_t, b_t = target(c, gsd[f"{c}.weight"].to(torch.float64), gsd.get(f"{c}.bias"))
        b_t = torch.zeros(w_t.shape[0], dtype=torch.float64) if b_t is None else b_t.to(torch.float64)
        tmp = DiverseBranchBlock.from_conv(conv, bn, [])  # type: ignore[arg-type]
        change.extend(tmp.load_plain(w_t, b_t, anchor_stats="keep"))
        used.update({f"{c}.weight", f"{c}.bias"})
        for k, _ in conv.named_parameters():
            handled_local.add(f"{c}.{k}")
        for k, _ in bn.named_parameters():
            handled_local.add(f"{b}.{k}")
        for k, _ in bn.named_buffers():
            handled_local.add(f"{b}.{k}")
    # plain local convs (neither block nor pair) that a folded identity branch feeds into
    block_paths = {p for p, _ in blocks}
    for c in identity_into:
        if c in block_paths or f"{c}.weight" in handled_local or f"{c}.weight" not in gsd:
            continue
        conv = local_model.get_submodule(c)
        if not _is_plain_conv(conv):
            continue
        w_t, b_t = target(c, gsd[f"{c}.weight"], gsd.get(f"{c}.bias"))
        with torch.no_grad():
            if conv.bias is None:
                if b_t is not None and bool(b_t.ne(0).any()):
                    raise ReparamError(
                        f"{c}: the global conv carries the bias of the folded identity branch but the local conv "
                        "has no bias to hold it"
                    )
            else:
                conv.bias.copy_(b_t.to(conv.bias.dtype))
                change.overwritten.append(conv.bias)
            conv.weight.copy_(w_t.to(conv.weight.dtype))
            change.overwritten.append(conv.weight)
        used.update({f"{c}.weight", f"{c}.bias"})
        handled_local.update(f"{c}.{k}" for k, _ in conv.named_parameters())
    params = dict(local_model.named_parameters())
    missing = []
    with torch.no_grad():
        for k, t in local_model.state_dict(keep_vars=True).items():
            if k in handled_local:
                continue
            if k not in gsd:
                missing.append(k)
                continue
            g = gsd[k]
            if tuple(g.shape) != tuple(t.shape):
                raise ReparamError(f"{k}: global shape {tuple(g.shape)} != local shape {tuple(t.shape)}")
            t.copy_(g.to(t.dtype))
            used.add(k)
            p = params.get(k)
            if p is not None:
                change.overwritten.append(p)
    if strict:
        if missing:
            raise ReparamError(f"local keys absent from the global state: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        unused = [k for k in gsd if k not in used]
        if unused:
            raise ReparamError(f"global keys with no place in the local model: {unused[:8]}{' ...' if len(unused) > 8 else ''}")
    return change
