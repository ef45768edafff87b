"""Shared test fixtures.

torchvision and timm fail to import on CPU-only torch builds whose torchvision wheel was linked
against CUDA; ``reparam._compat.import_torchvision`` registers the missing operator schemas once,
here, so every test module can ``import torchvision`` / ``import timm`` afterwards.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# The models under test are tiny: one intra-op thread is faster than two, and it keeps the suite
# from thrashing when the machine is shared (FEDHETERO_TEST_THREADS overrides).
torch.set_num_threads(int(os.environ.get("FEDHETERO_TEST_THREADS", "1")))

# An exception from the project's own code in a client task is a bug, not a dropped client: every
# run of the suite (in-process, in worker processes and in CLI subprocesses, which inherit the
# environment) stops on one, so a test fails instead of passing with a client silently missing.
# Tests of the drop accounting itself lift it with the ``lenient`` fixture.
os.environ["FEDHETERO_STRICT"] = "1"

# pytest-xdist's workers inherit COLUMNS=80 from their start-up; the suite checks what commands
# print off a terminal (rich's width there is fedhetero's LOG_WIDTH unless COLUMNS says otherwise)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)

# the package itself, before pytest's tests/ entry on sys.path lets the tests/fedhetero folder
# stand in for it (a folder without __init__.py is a namespace package there)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fedhetero  # noqa: E402,F401
from reparam._compat import import_torchvision

try:
    import_torchvision()
    _TV_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the installed wheels
    _TV_ERROR = f"{type(exc).__name__}: {exc}"


#: the longest a Ray temp dir may be: Ray adds ``/ray/session_<date>_<time>_<pid>/sockets/plasma_store``
#: (about 67 characters) and a Unix socket's path holds at most 107
RAY_DIR_MAX = 38


@pytest.fixture(scope="session", autouse=True)
def ray_temp_dir(tmp_path_factory):
    """Ray's session folders (Flower's simulation) go under this test run's own temporary directory,
    deleted with it, instead of piling up in Ray's shared default folder; where that path is too long for
    Ray's sockets, a short temporary directory of the run's own, deleted at its end."""
    import shutil
    import tempfile

    base = tmp_path_factory.getbasetemp() / "ray"
    own = len(str(base)) <= RAY_DIR_MAX
    path = base if own else Path(tempfile.mkdtemp(prefix="fh-ray-"))
    path.mkdir(exist_ok=True)
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = str(path)
    yield path
    if saved is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = saved
    if not own:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def gen() -> torch.Generator:
    """A CPU generator with a fixed seed (fresh for every test)."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def tv():
    """The torchvision module (skips the test when it cannot be imported)."""
    if _TV_ERROR is not None:
        pytest.skip(f"torchvision unavailable: {_TV_ERROR}")
    import torchvision

    return torchvision


@pytest.fixture
def timm_module():
    """The timm module (skips the test when it is not installed)."""
    from reparam._compat import import_timm

    try:
        return import_timm()
    except Exception as exc:  # pragma: no cover - depends on the installed wheels
        pytest.skip(f"timm unavailable: {type(exc).__name__}: {exc}")


@pytest.fixture
def lenient(monkeypatch):
    """Internal errors are recorded as dropped clients instead of stopping the run (for tests of
    that accounting, and of methods that are meant to raise)."""
    monkeypatch.delenv("FEDHETERO_STRICT", raising=False)
