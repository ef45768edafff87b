"""Compatibility helpers for optional third-party imports.

``torchvision`` wheels are built against one particular torch build. When the installed torch is
the CPU build and the torchvision wheel was linked against CUDA libraries, torchvision's compiled
operator library fails to load and ``import torchvision`` (and therefore ``import timm``) raises
``RuntimeError: operator torchvision::nms does not exist``. The repair lives in
:mod:`reparam._compat` (``import reparam`` installs it as an import hook, so a plain
``import torchvision`` works afterwards); these helpers apply it explicitly and return the module.
"""

from __future__ import annotations

from types import ModuleType

from reparam import _compat as _reparam_compat

__all__ = ["import_torchvision", "import_timm"]


def import_torchvision() -> ModuleType:
    """Import torchvision, registering operator schemas if its compiled ops failed to load."""
    return _reparam_compat.import_torchvision()


def import_timm() -> ModuleType:
    """Import timm (which imports torchvision) after :func:`import_torchvision`."""
    return _reparam_compat.import_timm()
