"""Helpers shared by the ServerApp and the ClientApp: the run's config as text, and reading it
back from a Flower ``run_config`` value (a path, inline YAML or JSON)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from fedhetero.core.common.config import RunConfig, from_dict, to_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.common.configfile import apply_overrides, parse_yaml

__all__ = ["config_text", "parse_config", "run_config_get", "split_overrides"]


def config_text(cfg: RunConfig) -> tuple[str, str]:
    """``(json_text, sha256)`` of the whole resolved config, as sent to the nodes."""
    text = json.dumps(to_dict(cfg), sort_keys=True, separators=(",", ":"))
    return text, hashlib.sha256(text.encode()).hexdigest()


def split_overrides(value: str | None) -> list[str]:
    """``key=value`` overrides from one string: separated by ``;`` or new lines."""
    if not value:
        return []
    return [part.strip() for chunk in str(value).splitlines() for part in chunk.split(";") if part.strip()]


def parse_config(value: str | None, overrides: list[str] | None = None) -> RunConfig:
    """A config from a ``run_config`` string: a YAML/JSON file path, or the YAML/JSON text itself
    (empty: the defaults), with ``key=value`` overrides applied."""
    data: Any = {}
    text = (value or "").strip()
    if text:
        looks_inline = text.startswith("{") or "\n" in text or (":" in text and not Path(text).exists())
        if not looks_inline:
            path = Path(text).expanduser()
            if path.is_dir():
                raise ConfigError(f"{path} is a directory, not a config file")
            if not path.is_file():
                raise ConfigError(f"config file not found: {path} (paths are read on the machine that runs the ServerApp)")
            text = path.read_text()
        try:
            data = parse_yaml(text)  # JSON is YAML; numbers as YAML 1.2 reads them
        except ConfigError as exc:
            raise ConfigError(f"the run config's 'config' value: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"the run config's 'config' value is not valid YAML or JSON ({exc})") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError("the run config's 'config' value must be a mapping of config sections")
    return from_dict(apply_overrides(data, overrides or []))


def run_config_get(run_config: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """``run_config[key]``, also accepting ``_`` for ``-`` in the key."""
    if key in run_config:
        return run_config[key]
    alt = key.replace("-", "_")
    return run_config.get(alt, default)
