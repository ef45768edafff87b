"""The linter (ruff) and the type checker (mypy) pass on the code base, as configured in
pyproject.toml; both come with the ``test`` extra."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_ruff_passes():
    r = _run(sys.executable, "-m", "ruff", "check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_passes():
    r = _run(sys.executable, "-m", "mypy")
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
    assert "Success" in r.stdout


def test_every_package_is_installed():
    """pyproject.toml lists the packages by hand (the zoo folder installs as fedhetero.models):
    every folder with an __init__.py must be in that list, or a fresh install misses it."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for top in ("reparam", "fedhetero", "models"):
        for init in (ROOT / top).rglob("__init__.py"):
            name = ".".join(init.parent.relative_to(ROOT).parts)
            found.add("fedhetero.models" + name[len("models"):] if name.split(".")[0] == "models" else name)
    assert found == listed
