"""torchvision and timm import in a process that went through one of fedhetero's entry points.

With the pinned install (constraints.txt: the CPU build of torch and PyPI's torchvision wheel,
built for another torch build) a bare ``import torchvision`` fails with "operator torchvision::nms
does not exist"; the ``fedhetero`` command, the Python API, ``load_model`` / ``load_transform`` and
the Flower apps install :func:`reparam.install_torchvision_fix` first. Each case runs in a fresh
interpreter: the test process has already imported torchvision through tests/conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

ENTRY_POINTS = {
    "the fedhetero command": "from fedhetero.cli import main\nassert main(['info']) == 0",
    "fedhetero.run": "import fedhetero\nfedhetero.run",
    "fedhetero.load_model": "import fedhetero\ntry:\n    fedhetero.load_model('absent')\nexcept FileNotFoundError:\n    pass",
    "the Flower client app": "import fedhetero.integrations.flower.client_app",
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_torchvision_and_timm_import_after_an_entry_point(entry, tmp_path):
    code = ENTRY_POINTS[entry] + "\nimport torchvision, timm\nfrom torchvision.models import resnet18\nresnet18()\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_readme_says_the_pinned_install_needs_the_repair():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "only needed where torchvision's wheel was built for another torch" not in text
    assert "the pinned install needs `install_torchvision_fix()`" in text
    import reparam

    assert "pinned install needs :func:`install_torchvision_fix`" in " ".join(reparam.__doc__.split())
