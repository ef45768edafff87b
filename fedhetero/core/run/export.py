"""The trained global model as a file, and one call to load it back.

At the end of a run (and whenever evaluation finds a new best) the engine writes
``final_model.pt`` / ``best_model.pt`` — a plain ``state_dict`` saved with ``torch.save``, loadable
with ``torch.load(weights_only=True)`` — and ``model.json``, the recipe that rebuilds the
architecture: the zoo model (``fedhetero.models.build_model``) with the run's arguments, in the form the
global model has (``zoo``: conv+BN as built; ``deploy``: every conv+BN folded into one biased
conv, as DynamicFL's plain global model) — and the input the model expects (``input``: the
shape, the normalisation and how an image as the data set's release stores it becomes one).
:func:`load_model` rebuilds and loads the model, :func:`load_transform` gives the preprocessing::

    import fedhetero
    model = fedhetero.load_model("runs/dynamicfl-digits-lenet5-s0-1a2b3c4d")   # eval mode
    prepare = fedhetero.load_transform("runs/dynamicfl-digits-lenet5-s0-1a2b3c4d")
    logits = model(prepare(raw_images))
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import reparam
from fedhetero.core.common.rundir import atomic_write_text
from fedhetero.core.exchange.store import atomic_save
from fedhetero.data.transforms import InputTransform
from fedhetero.models import build_model

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.method.algorithm import Algorithm
    from fedhetero.core.common.config import RunConfig
    from fedhetero.core.local.context import Context

__all__ = ["load_model", "load_transform", "save_global_model"]


def _build(recipe: dict[str, Any]) -> nn.Module:
    model = build_model(recipe["model"], **recipe["kwargs"])
    if recipe["form"] == "deploy":
        model.eval()
        model = reparam.merge(model, target="deploy")
    return model.to(getattr(torch, recipe.get("dtype", "float32")))


def _recipe(cfg: "RunConfig", ctx: "Context", algorithm: "Algorithm", state: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """The first recipe whose model takes ``state`` with ``strict=True`` (None if none does)."""
    widths = [cfg.model.width]
    for attr in ("global_width", "width"):
        w = getattr(algorithm, attr, None)
        if isinstance(w, (int, float)) and w not in widths:
            widths.insert(0, float(w))
    for width in widths:
        kwargs = {
            "num_classes": ctx.num_classes,
            "in_channels": ctx.input_shape[0],
            "width": width,
            "norm": cfg.model.norm,
            "input_size": ctx.input_shape[1],
        }
        for form in ("zoo", "deploy"):
            recipe = {"model": cfg.model.name, "kwargs": kwargs, "form": form, "dtype": cfg.dtype}
            try:
                model = _build(recipe)
                model.load_state_dict(state, strict=True)
            except Exception:  # this form does not fit; try the next one
                continue
            return recipe
    return None


def global_model_state(algorithm: "Algorithm", ctx: "Context") -> dict[str, torch.Tensor]:
    """A CPU copy of the algorithm's current global model state (what ``<which>_model.pt`` holds)."""
    model = algorithm.eval_models(ctx)["global"]
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def save_global_model(out: Path, cfg: "RunConfig", ctx: "Context", algorithm: "Algorithm", which: str,
                      state: dict[str, torch.Tensor] | None = None) -> None:
    """Write ``<which>_model.pt`` (and ``model.json``) into the run directory ``out`` for the
    algorithm's current global model, or for ``state`` taken earlier with :func:`global_model_state`."""
    if state is None:
        state = global_model_state(algorithm, ctx)
    recipe_path = out / "model.json"
    if not recipe_path.is_file():
        recipe = _recipe(cfg, ctx, algorithm, state)
        info = recipe if recipe is not None else {
            "model": cfg.model.name,
            "form": None,
            "note": "this algorithm's global model has no zoo recipe; load the state dict into your own module",
        }
        info["input"] = ctx.data.train.input_record()
        atomic_write_text(recipe_path, json.dumps(info, indent=2))
    atomic_save(state, out / f"{which}_model.pt")


def load_model(run_dir: str | Path, which: str = "final") -> nn.Module:
    """The global model a run wrote (``which``: ``"final"`` or ``"best"``), rebuilt and loaded,
    in eval mode."""
    run_dir = Path(run_dir)
    if which not in ("final", "best"):
        raise ValueError(f"which: expected 'final' or 'best', got {which!r}")
    path = run_dir / f"{which}_model.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the run has not finished (or evaluated) yet")
    recipe = json.loads((run_dir / "model.json").read_text())
    if recipe.get("form") is None:
        raise ValueError(f"{run_dir}: {recipe.get('note', 'no recipe')}")
    model = _build(recipe)
    model.load_state_dict(torch.load(path, weights_only=True, map_location="cpu"), strict=True)
    return model.eval()


def load_transform(run_dir: str | Path) -> InputTransform:
    """The preprocessing the run's model expects, as a callable: images as the data set's release
    stores them (e.g. scikit-learn's ``load_digits().images``, 8×8 with values 0..16; the uint8
    28×28 images of Fashion-MNIST's IDX files) → the normalised float32 ``N×C×H×W`` tensor the
    model takes, equal to what the run's data loader made of them (``model.json``'s ``input``)."""
    run_dir = Path(run_dir)
    path = run_dir / "model.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the run has not finished (or evaluated) yet")
    record = json.loads(path.read_text()).get("input")
    if record is None:
        raise ValueError(f"{path} records no input (written before fedhetero recorded it): run it again to get one")
    return InputTransform(record)
