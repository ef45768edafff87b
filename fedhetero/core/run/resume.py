"""Resuming a run: the config it continues with (the saved one, with the fields that may change on
resume overridden, or the caller's, which must hash the same) and the method options whose
defaults changed since the run was made."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


from fedhetero.core.common.config import RESUMABLE, RunConfig, config_hash, config_hashes, from_dict, to_dict
from fedhetero.core.common.options import ConfigError
from fedhetero.core.common.configfile import apply_overrides, load_config
from fedhetero.core.common.rundir import (
    RunDirError,
    finite_json,
    inspect_dir,
)

#: environment variable that turns internal errors from dropped clients into a stopped run
STRICT_ENV = "FEDHETERO_STRICT"
#: evaluations the summary's ``smoothed_final_accuracy`` smooths over (the FedDUMAP paper's window);
#: a run with fewer evaluations reports none
SMOOTHING_WINDOW = 39



__all__ = ["changed_options", "options_record", "resume_config", "saved_config"]


def _override_key(item: str) -> str:
    return item.split("=", 1)[0].strip()


def _changed_fields(a: RunConfig, b: RunConfig) -> list[str]:
    """Dotted names of the fields whose values differ between two configs."""

    def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(tree, dict):
            out: dict[str, Any] = {}
            for k, v in tree.items():
                out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
            return out
        return {prefix: tree}

    fa, fb = flat(to_dict(a)), flat(to_dict(b))
    return [k for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def options_record(options: Any) -> dict[str, Any]:
    """A method's options as ``run.json`` records them: every field, as JSON reads it back."""
    fields = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)} if dataclasses.is_dataclass(options) else {}
    return _as_json(fields)


def _as_json(values: Any) -> dict[str, Any]:
    return json.loads(json.dumps(finite_json(dict(values)), default=str))


def changed_options(out_dir: str | Path, cfg: RunConfig, options: Any) -> list[tuple[str, Any, Any]]:
    """The method options with which the run in ``out_dir`` was made that ``options`` (what
    ``cfg`` builds now) would change, as ``(name, made with, now)``: those ``run.json``
    recorded, or, in a run directory made before runs recorded their options, the options whose
    default changed since (:attr:`~fedhetero.core.common.options.MethodOptions.earlier_defaults`) that
    ``cfg`` does not set."""
    now = options_record(options)
    try:
        made = json.loads((Path(out_dir) / "run.json").read_text()).get("algorithm_options")
    except (OSError, ValueError):
        made = None
    if isinstance(made, dict):
        return [(k, made.get(k), now.get(k)) for k in sorted(set(made) | set(now)) if made.get(k) != now.get(k)]
    earlier = _as_json(getattr(type(options), "earlier_defaults", {}))
    return [(k, v, now.get(k)) for k, v in earlier.items() if k not in cfg.algorithm.options and now.get(k) != v]


def resume_config(
    out_dir: str | Path, cfg: RunConfig | None = None, overrides: list[str] | None = None
) -> tuple[RunConfig, set[str]]:
    """The config a resumed run goes on with, and the config hashes its directory may have
    recorded: ``cfg`` when given (it must hash as the saved one), else the saved config with
    ``overrides`` applied. Only the fields that may change on resume (:data:`~fedhetero.core.common.config.RESUMABLE`) may differ.
    A method from code outside the package is accepted only when the caller names it (``cfg``, or
    an ``algorithm.name`` override): a run directory never makes fedhetero import code."""
    out_dir = Path(out_dir)
    saved = saved_config(out_dir)
    named = cfg is not None or any(_override_key(o) == "algorithm.name" for o in overrides or ())
    if cfg is None:
        cfg = from_dict(apply_overrides(to_dict(saved), list(overrides or ())))
    if config_hash(cfg) != config_hash(saved):
        changed = _changed_fields(saved, cfg)
        may = ", ".join(f"{section}.{key}" if section else key for section, keys in RESUMABLE.items() for key in keys)
        raise ConfigError(
            f"--resume: {', '.join(changed[:4]) or 'the config'} differ{'s' if len(changed) == 1 else ''} from "
            f"the run saved in {out_dir}; only where clients run, how failing clients are handled and the "
            f"loggers ({may}) may change on resume"
        )
    if ":" in saved.algorithm.name and not named:
        raise RunDirError(
            f"--resume: this run's method is code outside fedhetero ({saved.algorithm.name}); a run directory "
            "never makes fedhetero import code, so name it again: add --set "
            f"algorithm.name={saved.algorithm.name}"
        )
    return cfg, config_hashes(saved)


def saved_config(out_dir: Path) -> RunConfig:
    """The config saved in a run directory, checked against the hash recorded at the start."""
    path = out_dir / "config.yaml"
    if not path.is_file():
        if inspect_dir(out_dir).holds_run:
            raise RunDirError(
                f"--resume: {out_dir} holds part of a run but its config.yaml is missing, so it cannot be "
                "continued; start it again with --overwrite (this replaces the run's files) or choose another --out"
            )
        raise RunDirError(f"--resume: {out_dir} holds no run (no config.yaml); start it without --resume")
    if path.stat().st_size == 0:
        raise RunDirError(f"--resume: {path} is empty (damaged); the run cannot be continued")
    try:
        saved = load_config(path)
    except ConfigError as exc:
        raise RunDirError(f"--resume: {path} is damaged ({exc})") from None
    meta = out_dir / "run.json"
    if meta.is_file():
        try:
            recorded = json.loads(meta.read_text()).get("config_hash")
        except (json.JSONDecodeError, OSError):
            recorded = None
        if recorded is not None and recorded not in config_hashes(saved):
            raise RunDirError(f"--resume: {path} was changed after the run started (its hash differs from run.json)")
    return saved


