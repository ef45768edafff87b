"""Import compatibility for torchvision (and timm, which imports it), for applications to apply.

Why: a torchvision wheel is built against one torch build. With the CPU build of torch and a
torchvision wheel linked against CUDA libraries, torchvision's compiled operator library does not
load, torchvision then registers Python "fake" kernels for operators that were never defined, and
``import torchvision`` (hence ``from torchvision.models import resnet18`` and ``import timm``) fails
with ``RuntimeError: operator torchvision::nms does not exist``. Image-classification models never
call those operators (they serve detection heads: NMS, RoI pooling, deformable convolution).

The repair: define the missing operator *schemas* (no kernels) in torch's ``torchvision``
namespace, drop the half-imported ``torchvision.*`` submodules and execute the package again. A
working installation is imported exactly as without it; a detection operator called afterwards fails
with torch's "no kernel registered" error instead of breaking every import. Two ways to apply it
(``import reparam`` applies neither; reparam itself never imports torchvision):

* :func:`install_torchvision_fix` — an application calls it once at start-up: it puts one finder in
  front of ``sys.meta_path`` that acts only for the top-level name ``torchvision`` and hands the
  search to the other finders (an import that has already succeeded is never touched), so a plain
  ``import torchvision`` / ``import timm`` works afterwards;
* :func:`import_torchvision` / :func:`import_timm` — import one module with the repair, leaving the
  import system alone.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import threading
from types import ModuleType
from typing import Any, Sequence

__all__ = ["import_timm", "import_torchvision", "install_torchvision_fix", "torchvision_fix_applied"]

# operator schemas of torchvision's compiled library (the same in releases 0.17 to 0.2x)
_TV_SCHEMAS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward": "(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "ps_roi_align": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward": "(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, "
    "SymInt channels, SymInt height, SymInt width) -> Tensor",
    "roi_pool": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width) -> (Tensor, Tensor)",
    "_roi_pool_backward": "(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width) -> (Tensor, Tensor)",
    "_ps_roi_pool_backward": "(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "deform_conv2d": "(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
    "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, "
    "SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward": "(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, "
    "Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, "
    "SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) -> "
    "(Tensor, Tensor, Tensor, Tensor, Tensor)",
}

_lock = threading.RLock()
_state: dict[str, Any] = {"library": None, "finder": None}


def _is_missing_operator_error(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and "torchvision::" in str(exc)


def _define_schemas() -> bool:
    """Define the torchvision operator schemas that are missing. Returns False when this was done
    before (a second failure then has another cause and must propagate)."""
    with _lock:
        if _state["library"] is not None:
            return False
        import torch

        lib = torch.library.Library("torchvision", "FRAGMENT")
        for name, schema in _TV_SCHEMAS.items():
            try:
                torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
                continue  # already defined (a partially loaded extension)
            except RuntimeError:
                pass
            try:
                lib.define(name + schema)
            except RuntimeError:
                pass
        _state["library"] = lib  # keep the registrations alive for the process lifetime
        return True


def _purge_submodules(name: str) -> None:
    for key in [m for m in sys.modules if m.startswith(name + ".")]:
        del sys.modules[key]


class _RetryingLoader(importlib.abc.Loader):
    """Wraps torchvision's own loader; every attribute but ``exec_module`` is the wrapped one's."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, item: str) -> Any:
        return getattr(self._loader, item)

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        except RuntimeError as exc:
            if not _is_missing_operator_error(exc) or not _define_schemas():
                raise
            _purge_submodules(module.__name__)
            self._loader.exec_module(module)


class _TorchvisionFinder(importlib.abc.MetaPathFinder):
    """Consulted for ``torchvision`` only; delegates the search to the other finders."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != "torchvision":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _RetryingLoader(spec.loader)
            return spec
        return None


def install_torchvision_fix() -> bool:
    """Put the torchvision import finder in front of ``sys.meta_path`` (once; an application calls
    this at start-up, before anything imports torchvision). Returns whether the finder is
    installed."""
    with _lock:
        if _state["finder"] is None:
            _state["finder"] = _TorchvisionFinder()
        if _state["finder"] not in sys.meta_path:
            sys.meta_path.insert(0, _state["finder"])
        return True


def torchvision_fix_applied() -> bool:
    """Whether the missing operator schemas had to be defined in this process."""
    return _state["library"] is not None


def import_torchvision() -> ModuleType:
    """Import torchvision, defining the missing operator schemas if its compiled ops fail to load
    (works with or without the finder installed)."""
    try:
        return importlib.import_module("torchvision")
    except RuntimeError as exc:
        if not _is_missing_operator_error(exc) or not _define_schemas():
            raise
    _purge_submodules("torchvision")
    sys.modules.pop("torchvision", None)
    return importlib.import_module("torchvision")


def import_timm() -> ModuleType:
    """Import timm (which imports torchvision) after :func:`import_torchvision`; a timm left
    half-imported by an earlier failed attempt is imported afresh."""
    import_torchvision()
    if "timm" in sys.modules and not hasattr(sys.modules["timm"], "create_model"):
        _purge_submodules("timm")
        sys.modules.pop("timm", None)
    return importlib.import_module("timm")
