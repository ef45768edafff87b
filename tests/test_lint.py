"""The linter (ruff), the type checker (mypy) and the import contracts (import-linter) pass on the
code base, as configured in pyproject.toml; all come with the ``test`` extra."""

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


def test_import_contracts_hold():
    """Imports flow one way: reparam and the zoo never import fedhetero; inside fedhetero the CLI,
    the lab, the integrations, the methods, the back ends, the core and the data layer each import
    only the layers below; a method family imports no other family (imports inside functions
    count). The layers contracts are exhaustive: a new package of fedhetero or of its methods
    must be placed in a layer before the check passes."""
    r = _run(sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())")
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_every_package_is_placed_in_a_layer():
    """The layers contracts are exhaustive (import-linter then fails on a package no layer names),
    and their layers are exactly the packages on disk."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layered = [c for c in contracts if c["type"] == "layers"]
    assert {c["containers"][0] for c in layered} == {"fedhetero", "fedhetero.algorithms", "fedhetero.core"}
    for c in layered:
        assert c.get("exhaustive") is True
        folder = ROOT.joinpath(*c["containers"][0].split("."))
        on_disk = {p.stem if p.is_file() else p.name for p in folder.iterdir()
                   if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").is_file())}
        named = {n.strip() for layer in c["layers"] for n in layer.split("|")}
        assert named == on_disk, (c["containers"], named ^ on_disk)


def _circles(*packages: str) -> list[list[str]]:
    """The import circles among ``packages``' modules (strongly connected components of more than
    one module), counting every import: deferred ones inside functions and type-only ones under
    ``TYPE_CHECKING`` too."""
    import grimp  # import-linter's import graph

    graph = grimp.build_graph(*packages, cache_dir=None)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.find_modules_directly_imported_by(v) & graph.modules):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_circle_anywhere(monkeypatch):
    """No module of the project reaches itself through its imports, deferred and type-only
    imports included (the layer contracts only forbid upward imports between layers)."""
    monkeypatch.syspath_prepend(str(ROOT))  # the zoo folder as a package of its own
    assert _circles("fedhetero", "reparam") == []
    assert _circles("models") == []
