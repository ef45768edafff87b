"""Dependency direction and the torchvision import repair.

``reparam`` depends on torch only (numpy and the standard library aside): importing any of its
modules must not import ``fedhetero`` or the model zoo ``models``, and must leave the import system
alone (the torchvision repair is the application's to install). Each check runs in a fresh
interpreter, because the test process itself has imported both (and ``tests/conftest.py`` has
already repaired torchvision's import).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import reparam

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=full_env)


def test_every_reparam_module_imports_without_fedhetero_or_models() -> None:
    names = sorted(m.name for m in pkgutil.walk_packages(reparam.__path__, "reparam."))
    assert "reparam.kinds" in names and "reparam.builtin_kinds" in names
    code = (
        "import importlib, json, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('fedhetero', 'models', 'torchvision', 'timm'))\n"
        "print(json.dumps(bad))\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="torchvision not installed")
def test_installed_repair_lets_torchvision_import() -> None:
    code = (
        "import torch, reparam\n"
        "reparam._compat.install_torchvision_fix()\n"
        "from torchvision.models import resnet18\n"
        "m = resnet18()\n"
        "print(type(m).__name__, reparam._compat.torchvision_fix_applied())\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "ResNet"


def test_import_reparam_installs_no_import_hook() -> None:
    code = (
        "import sys\n"
        "before = list(sys.meta_path)\n"
        "import reparam\n"
        "print(sys.meta_path == before)\n"
        "reparam._compat.install_torchvision_fix()\n"
        "reparam._compat.install_torchvision_fix()  # once\n"
        "print(len(sys.meta_path) - len(before))\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "1"]
