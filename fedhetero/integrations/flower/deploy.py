"""A Flower App for the deployment engine (``flwr run`` on a SuperLink with SuperNodes).

:func:`write_app` writes a folder whose ``pyproject.toml`` points Flower at fedhetero's ServerApp
and ClientApp and carries the run settings as ``[tool.flwr.app.config]``. Flower bundles that folder
(a FAB) and ships it to the SuperLink and the SuperNodes; the code itself comes from the fedhetero
installed there (``pip install "fedhetero[flower]"`` on every machine), so the bundle holds only
the settings. :func:`flower_config` writes the SuperLink connection ``flwr`` reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedhetero.core.common.config import RunConfig, to_dict
from fedhetero import __version__

__all__ = ["APP_CLIENT", "APP_SERVER", "flower_config", "write_app"]

APP_SERVER = "fedhetero.integrations.flower.server_app:app"
APP_CLIENT = "fedhetero.integrations.flower.client_app:app"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))  # a TOML basic string is JSON-escaped text


def write_app(
    directory: str | Path,
    cfg: RunConfig | None = None,
    *,
    out_dir: str | Path | None = None,
    overrides: list[str] | None = None,
    num_supernodes: int = 0,
    resume: bool = False,
    overwrite: bool = False,
    node_wait_s: float = 120.0,
    delivery_grace_s: float = 10.0,
    name: str = "fedhetero-flower",
) -> Path:
    """Write a Flower App into ``directory``; returns its ``pyproject.toml``.

    ``cfg`` is embedded as JSON (None: the defaults, or the run directory's config with
    ``resume``); ``out_dir`` is made absolute (it is a path on the SuperLink's machine).
    Everything can be overridden at submission with ``flwr run DIR --run-config "key=value"``."""
    folder = Path(directory).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    settings: dict[str, Any] = {
        "config": json.dumps(to_dict(cfg), separators=(",", ":")) if cfg is not None else "",
        "set": "; ".join(overrides or []),
        "out-dir": str(Path(out_dir).expanduser().resolve()) if out_dir else "",
        "resume": bool(resume),
        "overwrite": bool(overwrite),
        "num-supernodes": int(num_supernodes),
        "node-wait-s": float(node_wait_s),
        "delivery-grace-s": float(delivery_grace_s),
        "stop-after": 0,
    }
    lines = [
        "# A Flower App running fedhetero (written by `fedhetero flower app`).",
        "# The code comes from the fedhetero installed on the SuperLink and every SuperNode:",
        '#   pip install "fedhetero[flower]"',
        "[project]",
        f'name = "{name}"',
        f'version = "{__version__}"',
        'description = "fedhetero federated training on Flower"',
        'license = "Apache-2.0"',
        "dependencies = []",
        "",
        "[tool.flwr.app]",
        'publisher = "fedhetero"',
        "",
        "[tool.flwr.app.components]",
        f'serverapp = "{APP_SERVER}"',
        f'clientapp = "{APP_CLIENT}"',
        "",
        "[tool.flwr.app.config]",
        *(f"{k} = {_toml_value(v)}" for k, v in settings.items()),
        "",
    ]
    path = folder / "pyproject.toml"
    path.write_text("\n".join(lines))
    return path


def flower_config(flwr_home: str | Path, address: str, *, name: str = "fedhetero", insecure: bool = True) -> Path:
    """Add (or replace) the SuperLink connection ``name`` at ``address`` (``host:port``) in
    ``config.toml`` of ``flwr_home`` (Flower's user folder, ``FLWR_HOME``), keeping every other
    entry; it becomes the default connection only when none is set."""
    # deferred: tomli (Python 3.10's tomllib) and tomli_w come with flwr, the optional "flower"
    # extra, and this module must import without it (the CLI's parser and write_app use it)
    try:
        import tomllib
    except ImportError:  # Python 3.10: tomli, a Flower dependency
        import tomli as tomllib  # type: ignore[no-redef]
    import tomli_w  # a Flower dependency

    home = Path(flwr_home).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    path = home / "config.toml"
    data: dict[str, Any] = tomllib.loads(path.read_text()) if path.is_file() else {}
    links = data.setdefault("superlink", {})
    links[name] = {"address": address, "insecure": bool(insecure)}
    links.setdefault("default", name)
    path.write_text(tomli_w.dumps(data))
    return path
