"""``fedhetero info``: versions, then one line per algorithm, model and data set.

An algorithm's line is what its class declares: :attr:`~fedhetero.algorithms.Algorithm.summary`
(what it does), :attr:`~fedhetero.algorithms.Algorithm.paper` (where it comes from) and its budget
support, derived from :attr:`~fedhetero.algorithms.Algorithm.adapts_to` and the ``supports_*``
flags. The names of the models and data sets come from their registries; their descriptions are
the tables :data:`MODEL_NOTES` and :data:`DATASET_NOTES` below, keyed by registry name (the tests
fail when a registered name has none).
"""

from __future__ import annotations

import argparse
import inspect
from typing import TYPE_CHECKING, Any

from rich.text import Text

import fedhetero
from fedhetero.core.common.console import make_console

if TYPE_CHECKING:  # pragma: no cover
    from fedhetero.core.method.algorithm import Algorithm

__all__ = ["DATASET_NOTES", "MODEL_NOTES", "add_parser", "algorithm_line", "budget_support", "run"]

#: one line on every model of the zoo (:func:`fedhetero.models.list_models`), by registry name
MODEL_NOTES: dict[str, str] = {
    "cnn": "The FedDUMAP paper's CNN: three 3×3 convs with max-pooling, then two fully connected layers.",
    "googlenet": "GoogLeNet in the common CIFAR layout (32×32 inputs): a 3×3 stem and nine inception modules.",
    "lenet5": "LeNet-5: two 5×5 convs and three fully connected layers; with groupnorm1 the DynaComm paper's CNN.",
    "logreg": "Multinomial logistic regression on the flattened image (the DynInit study's MNIST model).",
    "preact_resnet18": (
        "Pre-activation ResNet-18 (norm and ReLU before each conv), the DynaComm paper's ResNet-18; "
        "reparam finds no conv+BN pair to expand in it."
    ),
    "resnet18": "CIFAR ResNet-18: a 3×3 stem without max-pooling and four stages of two basic blocks.",
    "resnet18_proj": (
        "timm's ResNet-18 (ImageNet stem) with a 512-512-256 projection head before the classifier, the "
        "DynInit study's CIFAR model; ImageNet weights load into its backbone with model.weights."
    ),
    "svhn_cnn": "The DynInit study's SVHN CNN: five 3×3 convs in three pooled stages, then a 256-unit layer with dropout.",
    "vgg11": "VGG-11 with the FedDUMAP paper's CIFAR head (three fully connected layers).",
}

#: one line on every data set (:data:`fedhetero.data.DATASETS`), by registry name
DATASET_NOTES: dict[str, str] = {
    "digits": "Bundled with scikit-learn (works offline, the default): 1,797 8×8 handwritten digits served as 1×32×32.",
    "cifar10": "CIFAR-10: 32×32 colour images of 10 object classes (the python version of the release).",
    "cifar100": "CIFAR-100: 32×32 colour images of 100 object classes (the python version of the release).",
    "dermamnist": "MedMNIST's DermaMNIST: 3×28×28 dermatoscopic images of 7 skin-lesion classes.",
    "mnist": "MNIST handwritten digits, 1×28×28, 10 classes (the original IDX files).",
    "fashion_mnist": "Fashion-MNIST images of clothing, 1×28×28, 10 classes (the original IDX files).",
    "femnist": "LEAF's FEMNIST handwritten characters, 1×28×28, 62 classes; the natural partition makes each writer a client.",
    "svhn": "SVHN house-number digits cropped to 3×32×32, 10 classes (the format-2 .mat files).",
    "synthetic": (
        "Seeded class-conditional Gaussian images made in memory (3×32×32, 10 classes, data.synthetic_size "
        "training images), for tests and quick checks; needs no files."
    ),
}

#: how a ``supports_*`` flag of an algorithm class reads in its budgets (another flag reads as its name)
_SUPPORT_LABELS = {"supports_submodels": "sub-models for budgets below the plain model"}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``info`` to a ``add_subparsers()`` object."""
    p = subparsers.add_parser("info", help="list algorithms, models and datasets")
    p.set_defaults(func=run)
    return p


def budget_support(cls: type[Algorithm]) -> str:
    """The budgets ``cls`` declares it follows: its scenarios (:attr:`Algorithm.adapts_to`, in the
    config's order) and every ``supports_*`` flag it sets."""
    from fedhetero.core.common.config import SCENARIOS

    scenarios = [s for s in SCENARIOS if s in cls.adapts_to] + sorted(set(cls.adapts_to) - set(SCENARIOS))
    parts = [", ".join(scenarios)]
    for attr in sorted(a for a in dir(cls) if a.startswith("supports_")):
        if getattr(cls, attr) is True:
            parts.append(_SUPPORT_LABELS.get(attr, attr.removeprefix("supports_").replace("_", " ")))
    return "; ".join(parts)


def _first_paragraph(cls: type) -> str:
    """The first paragraph of the class docstring as one line (for a method that declares no summary)."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    return " ".join(doc.split("\n\n")[0].split())


def algorithm_line(name: str, cls: type[Algorithm], pad: int = 0) -> Text:
    """``name``, what it does, its paper and its budgets: one line."""
    line = Text(f"  {name:<{pad}}  ")
    line.append(cls.summary or _first_paragraph(cls))
    if cls.paper:
        line.append(" Paper: ", style="dim")
        line.append(f"{cls.paper}.", style="dim")
    line.append(f" Budgets: {budget_support(cls)}.", style="cyan")
    return line


def run(args: argparse.Namespace) -> int:
    """Print the versions, then one line per registered algorithm, zoo model and data set."""
    # deferred for start-up time: torch, and the algorithms and models that import it
    import torch

    from fedhetero.algorithms import get_algorithm, list_algorithms
    from fedhetero.data import DATASETS
    from fedhetero.models import list_models

    # soft wrap: a line is never cut or wrapped by the console, whatever its width (a terminal
    # wraps it on screen)
    console = make_console(highlight=False, soft_wrap=True)
    console.print(f"fedhetero {fedhetero.__version__}, torch {torch.__version__}")
    names = list_algorithms()
    console.print(Text("algorithms", style="bold") + " (what it does, paper, budget scenarios it follows):")
    pad = max(map(len, names), default=0)
    for name in names:
        console.print(algorithm_line(name, get_algorithm(name), pad))
    for title, keys, notes in (("models", list_models(), MODEL_NOTES), ("datasets", list(DATASETS), DATASET_NOTES)):
        console.print(Text(title, style="bold") + ":")
        pad = max(map(len, keys), default=0)
        for key in keys:
            console.print(Text(f"  {key:<{pad}}  ") + notes.get(key, "(no description)"))
    return 0
