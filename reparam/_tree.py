"""Module-tree helpers shared by the whole-model operations of :mod:`reparam` (not public API).

The whole-model operations keep a small record on the model object (attribute ``_reparam_info``):
the conv→BN pairs left unexpanded, the convs left plain with the reason, and the BN-only identity
branches. :func:`iter_blocks` is public (re-exported by :mod:`reparam`).
"""

from __future__ import annotations

from typing import Any, Iterator

from torch import nn

from .block import DiverseBranchBlock
from .errors import ReparamError
from .hostforms import ConvForm, conv_form, is_genuine_conv

__all__ = ["iter_blocks"]

_INFO_ATTR = "_reparam_info"

# ---------------------------------------------------------------------------------------------
# module helpers


def _is_block(m: nn.Module) -> bool:
    return isinstance(m, DiverseBranchBlock)


def _is_bn_like(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.batchnorm._BatchNorm) or type(m).__name__ == "FrozenBatchNorm2d"


def _is_plain_conv(m: nn.Module) -> bool:
    """A genuine ``nn.Conv2d``: torch's ``forward`` and ``_conv_forward``, no parametrized weight (a
    subclass that overrides them may compute anything; see :mod:`reparam.hostforms`)."""
    return type(m) is not DiverseBranchBlock and is_genuine_conv(m)


def _is_conv(m: nn.Module) -> bool:
    """Any ``nn.Conv2d`` (subclasses included) outside the blocks' own types."""
    return type(m) is not DiverseBranchBlock and isinstance(m, nn.Conv2d)


def _conv_support(m: nn.Module) -> ConvForm | str:
    """The form of a conv (:func:`reparam.hostforms.conv_form`) or why it is left plain."""
    return conv_form(m)


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
