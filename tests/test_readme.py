"""Every ```python block of README.md runs as written.

Each block is executed on its own in a fresh interpreter (the test process has already imported
torchvision through ``tests/conftest.py``'s repair, which a reader's fresh install does not have),
with the repository on ``PYTHONPATH``, in an empty temporary working directory and with one intra-op
thread.

Skip rule: a block is skipped when it contains a placeholder in angle brackets, a lowercase word such
as ``<hash>`` (regular expression ``PLACEHOLDER``). Such blocks stand for values the reader has to
fill in first, e.g. ``fedhetero.load_model("runs/dynamicfl-digits-lenet5-s0-<hash>")`` needs the run
directory that a ``fedhetero train`` created. Every other block must run and exit with status 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.M | re.S)
PLACEHOLDER = re.compile(r"<[a-z][a-z0-9_-]*>")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number, code)`` of every ```python block of ``text``."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in FENCE.finditer(text)]


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_the_readme_has_python_blocks() -> None:
    assert BLOCKS, "README.md has no ```python block"
    assert any(not PLACEHOLDER.search(code) for _, code in BLOCKS), "every block would be skipped"


def test_the_skip_rule() -> None:
    assert PLACEHOLDER.search('fedhetero.load_model("runs/dynamicfl-digits-lenet5-s0-<hash>")')
    assert not PLACEHOLDER.search("x = a < b and c > d\nprint(x<1)")


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_runs(line: int, code: str, tmp_path: Path) -> None:
    if PLACEHOLDER.search(code):
        pytest.skip(f"README.md:{line} holds a placeholder ({PLACEHOLDER.search(code).group(0)}) to fill in first")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"README.md:{line} failed:\n{proc.stderr[-4000:]}"
