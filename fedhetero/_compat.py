"""Compatibility helpers for optional third-party imports.

``torchvision`` wheels are built against one particular torch build. When the installed torch is
the CPU build and the torchvision wheel was linked against CUDA libraries, torchvision's compiled
operator library fails to load and ``import torchvision`` (and therefore ``import timm``) raises
``RuntimeError: operator torchvision::nms does not exist``. The image-classification models do not
use those operators (they serve detection heads), so :func:`import_torchvision` registers the
operator *schemas* (no kernels) and retries. Calling a detection operator afterwards raises a clear
"no kernel" error from torch instead of breaking every import.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

__all__ = ["import_torchvision", "import_timm"]

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
_shim_library = None


def _purge(prefix: str) -> None:
    for name in [m for m in sys.modules if m == prefix or m.startswith(prefix + ".")]:
        del sys.modules[name]


def import_torchvision() -> ModuleType:
    """Import torchvision, registering operator schemas if its compiled ops failed to load."""
    global _shim_library
    try:
        return importlib.import_module("torchvision")
    except RuntimeError as exc:
        if "torchvision::" not in str(exc) or _shim_library is not None:
            raise
    import torch

    _purge("torchvision")
    _shim_library = torch.library.Library("torchvision", "DEF")
    for name, schema in _TV_SCHEMAS.items():
        if not torch._C._dispatch_has_kernel(f"torchvision::{name}"):
            try:
                _shim_library.define(name + schema)
            except RuntimeError:
                pass  # already defined by a partially loaded extension
    return importlib.import_module("torchvision")


def import_timm() -> ModuleType:
    """Import timm (which imports torchvision) through :func:`import_torchvision`."""
    import_torchvision()
    _purge_failed = "timm" in sys.modules and not hasattr(sys.modules["timm"], "create_model")
    if _purge_failed:
        _purge("timm")
    return importlib.import_module("timm")
