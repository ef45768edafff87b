"""Datasets held in memory as tensors.

Every loader returns an :class:`ArrayDataset`: ``images`` is a float32 ``N×C×H×W`` tensor,
normalised per channel with the dataset's mean and standard deviation, and ``labels`` an int64
tensor of length ``N``. Training code indexes these tensors directly (see
:func:`fedhetero.data.iterate_batches`); there is no ``DataLoader`` and no per-sample Python work on
the hot path.

Datasets
--------
``digits``
    scikit-learn's bundled ``load_digits`` (1,797 real 8×8 grey-scale images, 10 classes), works
    offline. Served as ``1×32×32`` (bilinear upsampling by default) so that the CIFAR-sized models
    run unchanged. The train/test split is a fixed stratified 80/20 split (seed 0): 1,438 training
    and 359 test images.
``cifar10`` / ``cifar100``
    The python-pickle release (``cifar-10-batches-py/data_batch_1..5, test_batch``;
    ``cifar-100-python/train, test``), parsed here with a restricted unpickler that only accepts
    plain containers and numpy arrays. torchvision is not imported unless ``download=True``.
``dermamnist``
    The MedMNIST ``dermamnist.npz`` file (7 classes, ``3×28×28``). The ``size`` option selects the
    MedMNIST+ files ``dermamnist_{64,128,224}.npz``; ``resize`` resamples to any square size.
``mnist`` / ``fashion_mnist``
    The four IDX files of the original releases (``train-images-idx3-ubyte``,
    ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each
    gzipped or not), parsed here (magic numbers, dimensions and counts are checked). Served as
    ``1×28×28`` with the published training-set mean and standard deviation.
``femnist``
    LEAF's FEMNIST JSON files (``train/*.json`` and ``test/*.json`` under the data directory or
    under ``femnist/data/`` in it; 62 classes, ``1×28×28``, pixels as LEAF stores them). By default
    (``split_mode="pooled"``, the DynaComm authors' construction) every writer's samples from both
    folders are pooled and split at random (``test_fraction`` 0.2, ``split_seed`` 0);
    ``split_mode="leaf"`` keeps LEAF's own train/test files. Normalised with the training split's
    statistics. Both splits record each sample's writer (:attr:`ArrayDataset.writers`, ids shared
    by the two splits), which the ``natural`` partition turns into one client per writer.
``synthetic``
    Seeded class-conditional Gaussian images of any shape and class count, for tests.

Normalisation statistics: CIFAR and (Fashion-)MNIST use the published training-set statistics; the other
datasets compute them from their own training split, so the test split is always normalised with
training statistics. ``normalize=False`` serves raw ``[0, 1]`` pixels (the FedDUMAP authors' code
does not normalise).
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import tarfile
import warnings
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from reparam._compat import import_torchvision

from .errors import DataConfigError, DatasetFormatError, DatasetNotFoundError

__all__ = [
    "ArrayDataset",
    "DATASETS",
    "SPLITS",
    "DEFAULT_DATA_DIR",
    "DATA_DIR_ENV",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "load_dataset",
    "resolve_data_dir",
]

DATASETS: tuple[str, ...] = (
    "digits", "cifar10", "cifar100", "dermamnist", "mnist", "fashion_mnist", "femnist", "svhn", "synthetic",
)
SPLITS: tuple[str, ...] = ("train", "test")
DATA_DIR_ENV = "FEDHETERO_DATA_DIR"
DEFAULT_DATA_DIR = "data"

# Published per-channel statistics of the CIFAR training sets (pixels in [0, 1]).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)

CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)
DERMAMNIST_CLASSES = (
    "actinic keratoses and intraepithelial carcinoma",
    "basal cell carcinoma",
    "benign keratosis-like lesions",
    "dermatofibroma",
    "melanoma",
    "melanocytic nevi",
    "vascular lesions",
)

_CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
_CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
_CIFAR100_URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
_CIFAR100_MD5 = "eb9058c3a382ffc7106e4002c42a8d85"
_MEDMNIST_RECORD = "https://zenodo.org/records/10519652"


# --------------------------------------------------------------------------------------------------
# The container
# --------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class ArrayDataset:
    """An image-classification split held as two in-memory tensors.

    Attributes
    ----------
    images:
        float32 tensor ``N×C×H×W`` (normalised per channel when ``mean``/``std`` are set).
    labels:
        int64 tensor of length ``N`` with values in ``[0, num_classes)``.
    num_classes:
        number of classes of the dataset (not only those present in this split).
    name, split:
        dataset name and split (``"train"``/``"test"``), informational.
    mean, std:
        per-channel statistics used to normalise ``images`` (``None`` when not normalised). A raw
        pixel value ``v`` is stored as ``(v - mean[c]) / std[c]``.
    class_names:
        optional human-readable class names.
    default_augment:
        whether training on this dataset uses crop+flip augmentation by default (CIFAR: True).
    writers:
        the natural client of each sample (LEAF FEMNIST: its writer) as an int64 array of length
        ``N`` indexing ``writer_names``, or ``None`` for datasets without writers.
    writer_names:
        the writers' names (LEAF user ids), sorted; ``None`` without writers.
    raw_format:
        how the release stores an image, which :meth:`input_record` turns into the steps from it to
        ``images``: ``pixel_max`` (the stored value of white), ``layout`` (``"HW"``, ``"HWC"`` or
        ``"CHW"``, one image) and ``resize`` (``{"size", "mode"}`` or ``None``); ``None`` when the
        release's pixels are not images of a known scale (FEMNIST, synthetic).
    """

    images: Tensor
    labels: Tensor
    num_classes: int
    name: str = ""
    split: str = ""
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    class_names: tuple[str, ...] | None = None
    default_augment: bool = False
    writers: np.ndarray | None = field(default=None, repr=False)
    writer_names: tuple[str, ...] | None = field(default=None, repr=False)
    raw_format: Mapping[str, Any] | None = field(default=None, repr=False)
    _labels_np: np.ndarray | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.images, Tensor) or self.images.ndim != 4:
            raise DataConfigError(
                f"images must be a 4-D tensor N×C×H×W, got "
                f"{type(self.images).__name__} with shape {getattr(self.images, 'shape', None)}"
            )
        if self.images.dtype != torch.float32:
            raise DataConfigError(f"images must be float32, got {self.images.dtype}")
        if not isinstance(self.labels, Tensor) or self.labels.ndim != 1:
            raise DataConfigError("labels must be a 1-D int64 tensor")
        if self.labels.dtype != torch.int64:
            raise DataConfigError(f"labels must be int64, got {self.labels.dtype}")
        if self.labels.shape[0] != self.images.shape[0]:
            raise DataConfigError(
                f"images and labels disagree in length: {self.images.shape[0]} vs "
                f"{self.labels.shape[0]}"
            )
        if not isinstance(self.num_classes, int) or self.num_classes < 1:
            raise DataConfigError(f"num_classes must be a positive int, got {self.num_classes!r}")
        if self.labels.numel() and (
            int(self.labels.min()) < 0 or int(self.labels.max()) >= self.num_classes
        ):
            which = " ".join(w for w in (self.name, self.split) if w)
            raise DataConfigError(
                f"{which + ' ' if which else ''}labels must lie in [0, {self.num_classes}), got range "
                f"[{int(self.labels.min())}, {int(self.labels.max())}]"
            )
        if self.writers is not None:
            w = np.asarray(self.writers)
            if w.ndim != 1 or len(w) != len(self.labels) or (w.size and not np.issubdtype(w.dtype, np.integer)):
                raise DataConfigError(
                    f"writers must be a 1-D integer array with one entry per sample ({len(self.labels)}), "
                    f"got shape {w.shape} and dtype {w.dtype}"
                )
            w = w.astype(np.int64, copy=True)
            w.setflags(write=False)
            self.writers = w
            if w.size and int(w.min()) < 0:
                raise DataConfigError("writers must be >= 0")
            if self.writer_names is not None and w.size and int(w.max()) >= len(self.writer_names):
                raise DataConfigError(
                    f"writer id {int(w.max())} has no name: writer_names lists {len(self.writer_names)}"
                )

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one image."""
        c, h, w = self.images.shape[1:]
        return int(c), int(h), int(w)

    @property
    def labels_np(self) -> np.ndarray:
        """The labels as a read-only int64 numpy array (cached)."""
        if self._labels_np is None:
            arr = self.labels.detach().cpu().numpy().astype(np.int64, copy=True)
            arr.setflags(write=False)
            self._labels_np = arr
        return self._labels_np

    @property
    def device(self) -> torch.device:
        return self.images.device

    def label_histogram(self, indices: np.ndarray | Sequence[int] | None = None) -> np.ndarray:
        """Counts per class (length ``num_classes``, int64) of the whole split or of ``indices``."""
        lab = self.labels_np if indices is None else self.labels_np[np.asarray(indices, np.int64)]
        return np.bincount(lab, minlength=self.num_classes).astype(np.int64)

    def pixel_fill(self) -> tuple[float, ...]:
        """Stored value of a raw black pixel (0) in each channel: ``-mean/std``, or 0 unnormalised."""
        c = self.input_shape[0]
        if self.mean is None or self.std is None:
            return (0.0,) * c
        return tuple(-m / s for m, s in zip(self.mean, self.std))

    def input_record(self) -> dict[str, Any]:
        """What a model trained on this data set expects, as plain JSON values: ``shape`` (C, H, W),
        ``mean`` / ``std`` (``None`` when not normalised) and ``raw``, how an image as the release
        stores it becomes one (:attr:`raw_format`; ``None``: inputs are float pixels in [0, 1] of
        that shape). :class:`fedhetero.data.InputTransform` applies it."""
        return {
            "dataset": self.name,
            "shape": list(self.input_shape),
            "mean": None if self.mean is None else [float(v) for v in self.mean],
            "std": None if self.std is None else [float(v) for v in self.std],
            "raw": None if self.raw_format is None else json.loads(json.dumps(dict(self.raw_format))),
        }

    def to(self, device: torch.device | str) -> "ArrayDataset":
        """A copy with both tensors on ``device`` (the same object when already there)."""
        device = torch.device(device)
        if self.images.device == device and self.labels.device == device:
            return self
        return replace(self, images=self.images.to(device), labels=self.labels.to(device))

    def subset(self, indices: np.ndarray | Sequence[int] | Tensor) -> "ArrayDataset":
        """A new dataset holding only ``indices`` (copies the selected rows)."""
        rows = np.asarray(indices, dtype=np.int64)
        idx = torch.as_tensor(rows, device=self.images.device)
        writers = None if self.writers is None else self.writers[rows]
        return replace(self, images=self.images[idx], labels=self.labels[idx], writers=writers)


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def resolve_data_dir(data_dir: str | os.PathLike[str] | None) -> Path:
    """The directory loaders search: ``data_dir``, else ``$FEDHETERO_DATA_DIR``, else ``./data``."""
    if data_dir is None:
        data_dir = os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR
    return Path(data_dir).expanduser()


def _normalize_(x: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    m = torch.tensor(mean, dtype=x.dtype).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype).view(1, -1, 1, 1)
    return x.sub_(m).div_(s)


def _channel_stats(x: Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (population) std of ``x`` (N×C×H×W), computed in float64."""
    xd = x.to(torch.float64).transpose(0, 1).reshape(x.shape[1], -1)
    mean = xd.mean(dim=1)
    std = xd.std(dim=1, unbiased=False).clamp_min(1e-12)
    return tuple(float(v) for v in mean), tuple(float(v) for v in std)


def _resize(x: Tensor, size: int, mode: str) -> Tensor:
    if x.shape[-1] == size and x.shape[-2] == size:
        return x
    kwargs: dict[str, Any] = {"align_corners": False} if mode == "bilinear" else {}
    return torch.nn.functional.interpolate(x, size=(size, size), mode=mode, **kwargs)


def _check_options(name: str, options: Mapping[str, Any], accepted: Mapping[str, Any]) -> dict:
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        acc = ", ".join(sorted(accepted)) or "none"
        raise DataConfigError(
            f"unknown option(s) {unknown} for dataset {name!r}; accepted options: {acc}"
        )
    out = dict(accepted)
    out.update(options)
    return out


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise DataConfigError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _brief(exc: BaseException) -> str:
    """``exc`` in one short line: its type and the first line of its message."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    first = lines[0].rstrip(":") if lines else ""
    first = first if len(first) <= 200 else first[:197] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _integer_labels(raw: Any, where: str) -> np.ndarray:
    """``raw`` flattened to int64 class ids. Labels that are not whole numbers (text such as
    ``"cat"``, fractions such as 2.7, NaN, booleans) are a :class:`DatasetFormatError` naming
    ``where`` (the file and the array) and the first offending value: they are never truncated."""
    def refuse(value: Any, kind: str) -> DatasetFormatError:
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        return DatasetFormatError(
            f"{where}: labels must be integer class ids, found {value!r} ({kind}); the file is damaged or "
            f"not the dataset's release"
        )

    if isinstance(raw, (list, tuple)):  # a pickled list: numpy would turn [0, "cat"] into strings
        numbers = (int, float, np.integer, np.floating, list, tuple)
        odd = [v for v in raw if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers)]
        if odd:
            raise refuse(odd[0], type(odd[0]).__name__)
    try:
        arr = np.asarray(raw).reshape(-1)
    except (ValueError, TypeError) as exc:
        raise DatasetFormatError(f"{where}: the labels are not a flat list of class ids ({_brief(exc)})") from None
    if arr.size == 0 or np.issubdtype(arr.dtype, np.integer):
        return arr.astype(np.int64)
    if np.issubdtype(arr.dtype, np.floating):
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if not bad.any():
            return arr.astype(np.int64)
        raise refuse(arr[bad][0].item(), f"dtype {arr.dtype}")
    raise refuse(arr[0].item() if arr.dtype != object else arr[0], f"dtype {arr.dtype}")


def _check_label_range(labels: np.ndarray, low: int, high: int, where: str, split: str) -> None:
    """Every label in ``low..high``, else a :class:`DatasetFormatError` naming ``where`` and ``split``."""
    if not labels.size:
        return
    out = (labels < low) | (labels > high)
    if out.any():
        raise DatasetFormatError(
            f"{where}: {split} label {int(labels[out][0])} lies outside the classes {low}..{high} "
            f"({int(out.sum())} of the {labels.size} {split} labels); the file is damaged or not the "
            f"dataset's release"
        )


def _require_rows(count: int, where: str, title: str, split: str) -> None:
    """An empty split is refused when the data set is loaded (it would train or test on nothing)."""
    if count == 0:
        raise DatasetFormatError(
            f"{where}: the {title} {split} split is empty (0 samples); the file is damaged or not the "
            f"full release: download it again"
        )


#: the raw format of a release of uint8 H×W×C images (CIFAR, SVHN, DermaMNIST)
_UINT8_HWC: Mapping[str, Any] = {"pixel_max": 255.0, "layout": "HWC", "resize": None}


def _uint8_hwc_to_float(arr: np.ndarray) -> Tensor:
    """uint8 ``N×H×W×C`` (or ``N×H×W``) → float32 ``N×C×H×W`` in [0, 1]."""
    if arr.ndim == 3:
        arr = arr[..., None]
    t = torch.from_numpy(np.ascontiguousarray(arr)).permute(0, 3, 1, 2).contiguous()
    return t.to(torch.float32).div_(255.0)


# --------------------------------------------------------------------------------------------------
# digits (scikit-learn, offline)
# --------------------------------------------------------------------------------------------------

_DIGITS_OPTIONS = {"size": 32, "test_fraction": 0.2, "split_seed": 0, "interpolation": "bilinear"}


def _digits_test_mask(y_all: np.ndarray, frac: float, seed: int) -> np.ndarray:
    """The fixed stratified split of ``load_digits()``: per class, a seeded permutation; the first
    round(n_c·frac) are test."""
    rng = np.random.default_rng(seed)
    test_mask = np.zeros(len(y_all), dtype=bool)
    for c in range(10):
        idx = np.flatnonzero(y_all == c)
        n_test = int(round(len(idx) * frac))
        test_mask[rng.permutation(idx)[:n_test]] = True
    return test_mask


def digits_split(test_fraction: float = 0.2, split_seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The rows of scikit-learn's ``load_digits()`` in the ``digits`` data set's training and test
    splits (ascending, the order of the splits' images), for the defaults or the loader's
    ``test_fraction`` / ``split_seed`` options."""
    from sklearn.datasets import load_digits

    test = _digits_test_mask(np.asarray(load_digits().target, dtype=np.int64), float(test_fraction), int(split_seed))
    return np.flatnonzero(~test), np.flatnonzero(test)


def _load_digits(split: str, normalize: bool, options: Mapping[str, Any]) -> ArrayDataset:
    opts = _check_options("digits", options, _DIGITS_OPTIONS)
    size = _positive_int("size", opts["size"])
    frac = float(opts["test_fraction"])
    if not 0.0 < frac < 1.0:
        raise DataConfigError(f"test_fraction must lie in (0, 1), got {opts['test_fraction']!r}")
    mode = opts["interpolation"]
    if mode not in ("bilinear", "nearest"):
        raise DataConfigError(f"interpolation must be 'bilinear' or 'nearest', got {mode!r}")
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x_all = np.asarray(bunch.images, dtype=np.float32) / 16.0  # N×8×8 in [0, 1]
    y_all = np.asarray(bunch.target, dtype=np.int64)
    test_mask = _digits_test_mask(y_all, frac, int(opts["split_seed"]))

    def prepare(mask: np.ndarray) -> Tensor:
        t = torch.from_numpy(x_all[mask]).unsqueeze(1)
        return _resize(t, size, mode).contiguous()

    train_x = prepare(~test_mask)
    mean, std = _channel_stats(train_x)
    x = train_x if split == "train" else prepare(test_mask)
    y = y_all[~test_mask] if split == "train" else y_all[test_mask]
    if normalize:
        _normalize_(x, mean, std)
    return ArrayDataset(
        images=x,
        labels=torch.from_numpy(y.copy()),
        num_classes=10,
        name="digits",
        split=split,
        mean=mean if normalize else None,
        std=std if normalize else None,
        class_names=tuple(str(i) for i in range(10)),
        default_augment=False,
        raw_format={"pixel_max": 16.0, "layout": "HW",
                    "resize": None if size == 8 else {"size": size, "mode": mode}},
    )


# --------------------------------------------------------------------------------------------------
# CIFAR (python pickle release)
# --------------------------------------------------------------------------------------------------

_PICKLE_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
    ("copyreg", "_reconstructor"),
    ("builtins", "object"),
}


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickler that only resolves numpy array reconstruction (never arbitrary callables)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _PICKLE_ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a dataset file")
        if module.startswith("numpy.core") and hasattr(np, "_core"):
            module = "numpy._core" + module[len("numpy.core"):]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return super().find_class(module, name)


def _read_pickle(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            obj = _ArrayUnpickler(fh, encoding="bytes").load()
    except OSError as exc:
        raise DatasetFormatError(f"{path}: cannot be read ({_brief(exc)})") from None
    except Exception as exc:  # noqa: BLE001 - a damaged pickle fails with about any exception
        raise DatasetFormatError(f"{path} is not a CIFAR python-pickle batch: {_brief(exc)}") from None
    if not isinstance(obj, dict):
        raise DatasetFormatError(f"{path} must hold a dict, found {type(obj).__name__}")
    # Files pickled by Python 3 have str keys; the official release (Python 2) has bytes keys.
    return {(k.encode() if isinstance(k, str) else k): v for k, v in obj.items()}


def _safe_extract(archive: Path, dest: Path) -> None:
    with tarfile.open(archive, "r:*") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
            return
        root = dest.resolve()
        for member in tar.getmembers():
            target = (dest / member.name).resolve()
            if not (member.isfile() or member.isdir()) or root not in (target, *target.parents):
                raise DatasetFormatError(f"refusing to extract {member.name!r} from {archive}")
        tar.extractall(dest)  # noqa: S202 - members checked above


def _try_download(url: str, root: Path, md5: str | None, extract: bool) -> str | None:
    """Download with torchvision's downloader; returns an error string instead of raising."""
    try:
        tv = import_torchvision()
        root.mkdir(parents=True, exist_ok=True)
        if extract:
            tv.datasets.utils.download_and_extract_archive(url, str(root), md5=md5)
        else:
            tv.datasets.utils.download_url(url, str(root), md5=md5)
        return None
    except Exception as exc:  # noqa: BLE001 - any failure becomes part of one clear error
        return f"{type(exc).__name__}: {exc}"


def _find_folder(root: Path, folder: str, required: Sequence[str]) -> Path | None:
    for cand in (root / folder, root):
        if all((cand / f).is_file() for f in required):
            return cand
    return None


def _cifar_folder(
    root: Path,
    *,
    title: str,
    folder: str,
    archive: str,
    url: str,
    md5: str,
    required: Sequence[str],
    download: bool,
) -> Path:
    found = _find_folder(root, folder, required)
    if found is not None:
        return found
    note = ""
    if (root / archive).is_file():
        try:
            _safe_extract(root / archive, root)
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise DatasetFormatError(
                f"{root / archive}: not a readable {title} archive ({_brief(exc)}); download it again "
                f"from {url}, or delete it and put the extracted folder '{folder}/' in {root}"
            ) from None
        found = _find_folder(root, folder, required)
        if found is not None:
            return found
        note = f"\n{root / archive} was extracted but did not contain {folder}/."
    elif download:
        err = _try_download(url, root, md5, extract=True)
        found = _find_folder(root, folder, required)
        if found is not None:
            return found
        note = f"\nDownload failed ({err or 'archive did not contain the expected files'})."
    missing = [f for f in required if not (root / folder / f).is_file()]
    raise DatasetNotFoundError(
        f"{title} not found: missing {', '.join(missing)} in {root / folder}.\n"
        f"Put the folder '{folder}/' (the python version of {title}: {', '.join(required)}) under "
        f"{root}, or point the loader at the directory that contains it with --set data.data_dir=DIR "
        f"(config: data.data_dir).\n"
        f"Download {url} and extract it there (or just place '{archive}' in that directory: it "
        f"is extracted on first use), or add --set data.download=true (config: data.download) "
        f"on a machine with network access." + note
    )


def _cifar_arrays(
    paths: Sequence[Path], label_key: bytes, split: str, num_classes: int
) -> tuple[Tensor, Tensor]:
    """Images and labels of the CIFAR batch files ``paths``, each checked (keys, pixel array, integer
    labels in ``0..num_classes-1``) with errors naming the file and, for labels, the split."""
    xs, ys = [], []
    for path in paths:
        b = _read_pickle(path)
        if b"data" not in b or label_key not in b:
            raise DatasetFormatError(
                f"{path}: batch lacks key b'data' or {label_key!r} (keys: {sorted(map(str, b))})"
            )
        try:
            data = np.asarray(b[b"data"])
        except (ValueError, TypeError) as exc:
            raise DatasetFormatError(f"{path}: b'data' is not an array ({_brief(exc)})") from None
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
            raise DatasetFormatError(
                f"{path}: b'data' must be uint8 N×3072, got {data.dtype} {data.shape}"
            )
        where = f"{path}: {label_key!r}"
        labels = _integer_labels(b[label_key], where)
        if labels.shape[0] != data.shape[0]:
            raise DatasetFormatError(f"{path}: {data.shape[0]} images but {labels.shape[0]} labels")
        _check_label_range(labels, 0, num_classes - 1, where, split)
        xs.append(data)
        ys.append(labels)
    title = "CIFAR-10" if num_classes == 10 else "CIFAR-100"
    _require_rows(sum(len(y) for y in ys), ", ".join(map(str, paths)), title, split)
    x = np.concatenate(xs).reshape(-1, 3, 32, 32)
    images = torch.from_numpy(x).to(torch.float32).div_(255.0)
    return images, torch.from_numpy(np.concatenate(ys))


def _load_cifar(
    name: str, root: Path, split: str, download: bool, normalize: bool, options: Mapping[str, Any]
) -> ArrayDataset:
    _check_options(name, options, {})
    if name == "cifar10":
        files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        folder = _cifar_folder(
            root, title="CIFAR-10", folder="cifar-10-batches-py", archive="cifar-10-python.tar.gz",
            url=_CIFAR10_URL, md5=_CIFAR10_MD5, required=files, download=download,
        )
        use = files[:5] if split == "train" else ["test_batch"]
        images, labels = _cifar_arrays([folder / f for f in use], b"labels", split, 10)
        num_classes, mean, std = 10, CIFAR10_MEAN, CIFAR10_STD
        class_names: tuple[str, ...] | None = CIFAR10_CLASSES
        meta = folder / "batches.meta"
        meta_key = b"label_names"
    else:
        folder = _cifar_folder(
            root, title="CIFAR-100", folder="cifar-100-python", archive="cifar-100-python.tar.gz",
            url=_CIFAR100_URL, md5=_CIFAR100_MD5, required=["train", "test"], download=download,
        )
        use = ["train"] if split == "train" else ["test"]
        images, labels = _cifar_arrays([folder / f for f in use], b"fine_labels", split, 100)
        num_classes, mean, std = 100, CIFAR100_MEAN, CIFAR100_STD
        class_names = None
        meta = folder / "meta"
        meta_key = b"fine_label_names"
    if meta.is_file():
        try:
            names = _read_pickle(meta).get(meta_key)
            if names is not None and len(names) == num_classes:
                class_names = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in names)
        except DatasetFormatError:
            class_names = None  # a malformed meta file only loses the (cosmetic) class names
    if normalize:
        _normalize_(images, mean, std)
    return ArrayDataset(
        images=images,
        labels=labels,
        num_classes=num_classes,
        name=name,
        split=split,
        mean=mean if normalize else None,
        std=std if normalize else None,
        class_names=class_names,
        default_augment=True,
        raw_format=_UINT8_HWC,
    )


# --------------------------------------------------------------------------------------------------
# DermaMNIST (MedMNIST .npz)
# --------------------------------------------------------------------------------------------------

_DERMA_OPTIONS = {"size": 28, "resize": None, "include_val": False}
_DERMA_KEYS = ("train_images", "train_labels", "val_images", "val_labels", "test_images", "test_labels")


def _read_derma_npz(path: Path, fname: str) -> dict[str, np.ndarray]:
    """The six arrays of a MedMNIST ``.npz`` file, read without pickle; a damaged file (empty,
    truncated, not a zip archive, object arrays) is one :class:`DatasetFormatError` line naming it."""
    again = f"download it again from {_MEDMNIST_RECORD} (file {fname})"
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
        if head[:2] != b"PK":  # every zip archive (an .npz is one) starts with these two bytes
            what = "the file is empty" if not head else f"not a zip archive (it starts with {head!r})"
            raise DatasetFormatError(f"{path}: not a valid DermaMNIST .npz: {what}; {again}")
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in _DERMA_KEYS if k not in npz.files]
            if missing:
                raise DatasetFormatError(f"{path} lacks key(s) {missing}; found {sorted(npz.files)}; {again}")
            return {k: npz[k] for k in _DERMA_KEYS}
    except DatasetFormatError:
        raise
    except OSError as exc:
        if exc.errno is not None:  # the system refused (permissions, I/O error), not the contents
            raise DatasetFormatError(f"{path}: cannot be read ({_brief(exc)})") from None
        raise DatasetFormatError(f"{path}: not a valid DermaMNIST .npz: {_brief(exc)}; {again}") from None
    except Exception as exc:  # noqa: BLE001 - a damaged archive fails with many exception types
        raise DatasetFormatError(f"{path}: not a valid DermaMNIST .npz: {_brief(exc)}; {again}") from None


def _load_dermamnist(
    root: Path, split: str, download: bool, normalize: bool, options: Mapping[str, Any]
) -> ArrayDataset:
    opts = _check_options("dermamnist", options, _DERMA_OPTIONS)
    size = opts["size"]
    if size not in (28, 64, 128, 224):
        raise DataConfigError(f"size must be one of 28, 64, 128, 224 for dermamnist, got {size!r}")
    resize = opts["resize"]
    if resize is not None:
        resize = _positive_int("resize", resize)
    fname = "dermamnist.npz" if size == 28 else f"dermamnist_{size}.npz"
    candidates = [root / fname, root / "dermamnist" / fname, root / "medmnist" / fname]
    path = next((p for p in candidates if p.is_file()), None)
    note = ""
    if path is None and download:
        err = _try_download(f"{_MEDMNIST_RECORD}/files/{fname}", root, None, extract=False)
        path = root / fname if (root / fname).is_file() else None
        note = f"\nDownload failed ({err or 'file not created'})."
    if path is None:
        raise DatasetNotFoundError(
            f"DermaMNIST not found: missing {fname} in {root}.\n"
            f"Put the MedMNIST file '{fname}' (keys {', '.join(_DERMA_KEYS)}) directly under {root}, "
            f"or point the loader at the directory that contains it with --set data.data_dir=DIR "
            f"(config: data.data_dir).\n"
            f"Download it from {_MEDMNIST_RECORD} (file {fname}), or with the 'medmnist' package "
            f"(`python -m medmnist download`, then copy {fname} from its root), or add "
            f"--set data.download=true (config: data.download) on a machine with network access." + note
        )
    arrays = _read_derma_npz(path, fname)

    def images_of(prefix: str) -> np.ndarray:
        arr = arrays[f"{prefix}_images"]
        if arr.dtype != np.uint8 or arr.ndim not in (3, 4):
            raise DatasetFormatError(
                f"{path}: {prefix}_images must be uint8 N×H×W×C, got {arr.dtype} {arr.shape}"
            )
        if arr.shape[1:] != arrays["train_images"].shape[1:]:
            raise DatasetFormatError(
                f"{path}: {prefix}_images holds images of shape {arr.shape[1:]} but train_images "
                f"{arrays['train_images'].shape[1:]}"
            )
        return arr

    def labels_of(prefix: str) -> np.ndarray:
        labels = _integer_labels(arrays[f"{prefix}_labels"], f"{path}: {prefix}_labels")
        _check_label_range(labels, 0, len(DERMAMNIST_CLASSES) - 1, f"{path}: {prefix}_labels", split)
        return labels

    train_parts = ["train", "val"] if opts["include_val"] else ["train"]
    parts = train_parts if split == "train" else ["test"]
    for s_name, s_parts in (("train", train_parts), (split, parts)):
        _require_rows(
            sum(len(arrays[f"{p}_images"]) for p in s_parts),
            f"{path}: {', '.join(p + '_images' for p in s_parts)}", "DermaMNIST", s_name,
        )
    train_x = _uint8_hwc_to_float(np.concatenate([images_of(p) for p in train_parts]))
    if resize is not None:
        train_x = _resize(train_x, resize, "bilinear").contiguous()
    mean, std = _channel_stats(train_x)
    if split == "train":
        x = train_x
    else:
        x = _uint8_hwc_to_float(np.concatenate([images_of(p) for p in parts]))
        if resize is not None:
            x = _resize(x, resize, "bilinear").contiguous()
    y = np.concatenate([labels_of(p) for p in parts])
    if y.shape[0] != x.shape[0]:
        raise DatasetFormatError(f"{path}: {x.shape[0]} {split} images but {y.shape[0]} labels")
    if normalize:
        _normalize_(x, mean, std)
    return ArrayDataset(
        images=x,
        labels=torch.from_numpy(y),
        num_classes=len(DERMAMNIST_CLASSES),
        name="dermamnist",
        split=split,
        mean=mean if normalize else None,
        std=std if normalize else None,
        class_names=DERMAMNIST_CLASSES,
        default_augment=False,
        raw_format={**_UINT8_HWC, "resize": None if resize is None else {"size": resize, "mode": "bilinear"}},
    )


# --------------------------------------------------------------------------------------------------
# MNIST / Fashion-MNIST (IDX files)
# --------------------------------------------------------------------------------------------------

# Published statistics of the training images (pixels in [0, 1]).
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)
FASHION_MNIST_MEAN, FASHION_MNIST_STD = (0.2860,), (0.3530,)
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
    "Ankle boot",
)
_IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_IDX_SETS = {
    # name: (title, torchvision folder, other folder names, mean, std, classes, where to download)
    "mnist": (
        "MNIST", "MNIST", ("mnist",), MNIST_MEAN, MNIST_STD, tuple(str(i) for i in range(10)),
        "https://ossci-datasets.s3.amazonaws.com/mnist/ (the mirror torchvision uses)",
    ),
    "fashion_mnist": (
        "Fashion-MNIST", "FashionMNIST", ("fashion-mnist", "fashion_mnist"), FASHION_MNIST_MEAN,
        FASHION_MNIST_STD, FASHION_MNIST_CLASSES,
        "https://github.com/zalandoresearch/fashion-mnist (folder data/fashion)",
    ),
}
_IDX_UBYTE = 0x08


def _idx_file(folder: Path, stem: str) -> Path | None:
    """``stem`` or ``stem.gz`` in ``folder`` (the uncompressed file first)."""
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def read_idx(path: str | os.PathLike[str], ndim: int) -> np.ndarray:
    """An unsigned-byte IDX array (gzipped or not) with ``ndim`` dimensions.

    The header is two zero bytes, the type code (0x08: unsigned byte), the number of dimensions,
    then one big-endian 32-bit size per dimension; the data that follows must hold exactly the
    product of the sizes. Anything else raises :class:`DatasetFormatError` naming the file."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        if raw[:2] == b"\x1f\x8b":  # gzip magic
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise DatasetFormatError(f"{path}: cannot be read as an IDX file ({exc})") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DatasetFormatError(f"{path}: not an IDX file (bad magic number {raw[:4].hex() or 'empty'})")
    if raw[2] != _IDX_UBYTE:
        raise DatasetFormatError(f"{path}: IDX type code 0x{raw[2]:02x}, expected 0x08 (unsigned byte)")
    if raw[3] != ndim:
        raise DatasetFormatError(f"{path}: an IDX array with {raw[3]} dimension(s), expected {ndim}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetFormatError(f"{path}: truncated IDX header")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(dims, dtype=np.int64))
    if len(raw) - header != expected:
        raise DatasetFormatError(
            f"{path}: the header announces {'×'.join(map(str, dims))} = {expected} values but the file "
            f"holds {len(raw) - header} (truncated or not an IDX file)"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _idx_folder(root: Path, name: str) -> Path | None:
    _, tv_folder, others, *_ = _IDX_SETS[name]
    stems = [f for pair in _IDX_FILES.values() for f in pair]
    # the data set's own folders first: MNIST and Fashion-MNIST files have the same names
    for cand in (root / tv_folder / "raw", *(root / o for o in others), root):
        if all(_idx_file(cand, f) is not None for f in stems):
            return cand
    return None


def _load_idx_set(
    name: str, root: Path, split: str, download: bool, normalize: bool, options: Mapping[str, Any]
) -> ArrayDataset:
    _check_options(name, options, {})
    title, tv_folder, _, mean, std, classes, url = _IDX_SETS[name]
    folder = _idx_folder(root, name)
    note = ""
    if folder is None and download:
        try:
            tv = import_torchvision()
            cls = tv.datasets.MNIST if name == "mnist" else tv.datasets.FashionMNIST
            for train in (True, False):
                cls(str(root), train=train, download=True)  # into ROOT/<folder>/raw
            err = None
        except Exception as exc:  # noqa: BLE001 - any failure becomes part of one clear error
            err = f"{type(exc).__name__}: {exc}"
        folder = _idx_folder(root, name)
        note = "" if folder is not None else f"\nDownload failed ({err or 'files not created'})."
    if folder is None:
        stems = [f for pair in _IDX_FILES.values() for f in pair]
        missing = [f for f in stems if _idx_file(root, f) is None]
        raise DatasetNotFoundError(
            f"{title} not found: missing {', '.join(missing)} (or the same with .gz) in {root}.\n"
            f"Put the four IDX files ({', '.join(s + '.gz' for s in stems)}; gzipped or not) directly "
            f"under {root} or in {root / tv_folder / 'raw'} (torchvision's layout), or point the loader "
            f"at the directory that contains them with --set data.data_dir=DIR (config: data.data_dir).\n"
            f"Download them from {url}, or add --set data.download=true (config: data.download) on a "
            f"machine with network access." + note
        )
    img_stem, lab_stem = _IDX_FILES[split]
    img_path, lab_path = _idx_file(folder, img_stem), _idx_file(folder, lab_stem)
    assert img_path is not None and lab_path is not None
    images = read_idx(img_path, 3)
    labels = read_idx(lab_path, 1)
    if images.shape[1:] != (28, 28):
        raise DatasetFormatError(f"{img_path}: images of {images.shape[1]}×{images.shape[2]} pixels, expected 28×28")
    if images.shape[0] != labels.shape[0]:
        raise DatasetFormatError(
            f"{img_path} holds {images.shape[0]} images but {lab_path} holds {labels.shape[0]} labels"
        )
    _require_rows(int(labels.shape[0]), str(lab_path), title, split)
    _check_label_range(labels.astype(np.int64), 0, len(classes) - 1, str(lab_path), split)
    x = torch.from_numpy(images.copy()).unsqueeze(1).to(torch.float32).div_(255.0)
    if normalize:
        _normalize_(x, mean, std)
    return ArrayDataset(
        images=x,
        labels=torch.from_numpy(labels.astype(np.int64)),
        num_classes=len(classes),
        name=name,
        split=split,
        mean=mean if normalize else None,
        std=std if normalize else None,
        class_names=classes,
        default_augment=False,
        raw_format={"pixel_max": 255.0, "layout": "HW", "resize": None},
    )


# --------------------------------------------------------------------------------------------------
# SVHN (the cropped-digits .mat files)
# --------------------------------------------------------------------------------------------------

SVHN_MEAN = (0.4377, 0.4438, 0.4728)
SVHN_STD = (0.1980, 0.2010, 0.1970)
_SVHN_FILES = {"train": "train_32x32.mat", "test": "test_32x32.mat"}
_SVHN_URL = "http://ufldl.stanford.edu/housenumbers/ (format 2: cropped digits)"


def _load_svhn(root: Path, split: str, download: bool, normalize: bool, options: Mapping[str, Any]) -> ArrayDataset:
    """SVHN's cropped digits from ``train_32x32.mat`` / ``test_32x32.mat`` (MATLAB v5 files with
    ``X``: 32×32×3×N uint8 and ``y``: N×1 labels 1…10, where 10 is the digit 0)."""
    _check_options("svhn", options, {})
    fname = _SVHN_FILES[split]
    candidates = [root / fname, root / "svhn" / fname, root / "SVHN" / fname]
    path = next((p for p in candidates if p.is_file()), None)
    note = ""
    if path is None and download:
        try:
            tv = import_torchvision()
            tv.datasets.SVHN(str(root), split=split, download=True)
            err = None
        except Exception as exc:  # noqa: BLE001 - any failure becomes part of one clear error
            err = f"{type(exc).__name__}: {exc}"
        path = root / fname if (root / fname).is_file() else None
        note = "" if path is not None else f"\nDownload failed ({err or 'file not created'})."
    if path is None:
        raise DatasetNotFoundError(
            f"SVHN not found: missing {fname} in {root}.\n"
            f"Put {', '.join(_SVHN_FILES.values())} directly under {root} (or in {root / 'svhn'}), or point "
            f"the loader at the directory that contains them with --set data.data_dir=DIR "
            f"(config: data.data_dir).\nDownload them from {_SVHN_URL}, or add --set data.download=true "
            f"(config: data.download) on a machine with network access." + note
        )
    try:
        from scipy.io import loadmat

        mat = loadmat(str(path))
    except Exception as exc:  # a truncated or non-MATLAB file
        raise DatasetFormatError(f"{path} cannot be read as a MATLAB file ({type(exc).__name__}: {exc})") from None
    if "X" not in mat or "y" not in mat:
        raise DatasetFormatError(f"{path} lacks X and y; found {sorted(k for k in mat if not k.startswith('__'))}")
    images, labels = np.asarray(mat["X"]), _integer_labels(mat["y"], f"{path}: y")
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[:3] != (32, 32, 3):
        raise DatasetFormatError(f"{path}: X must be uint8 32×32×3×N, got {images.dtype} {images.shape}")
    if images.shape[3] != labels.shape[0]:
        raise DatasetFormatError(f"{path}: {images.shape[3]} images but {labels.shape[0]} labels")
    _require_rows(int(labels.shape[0]), str(path), "SVHN", split)
    if labels.size and (labels.min() < 1 or labels.max() > 10):
        bad = labels[(labels < 1) | (labels > 10)]
        raise DatasetFormatError(
            f"{path}: y: labels must be 1..10 (10 is the digit 0), but {split} label {int(bad[0])} is not "
            f"({bad.size} of the {labels.size} {split} labels; range {labels.min()}..{labels.max()})"
        )
    labels = np.where(labels == 10, 0, labels).astype(np.int64)
    x = torch.from_numpy(np.ascontiguousarray(images.transpose(3, 2, 0, 1))).to(torch.float32).div_(255.0)
    if normalize:
        _normalize_(x, SVHN_MEAN, SVHN_STD)
    return ArrayDataset(
        images=x,
        labels=torch.from_numpy(labels),
        num_classes=10,
        name="svhn",
        split=split,
        mean=SVHN_MEAN if normalize else None,
        std=SVHN_STD if normalize else None,
        class_names=tuple(str(i) for i in range(10)),
        default_augment=False,
        raw_format=_UINT8_HWC,
    )


# --------------------------------------------------------------------------------------------------
# FEMNIST (LEAF JSON files)
# --------------------------------------------------------------------------------------------------

FEMNIST_NUM_CLASSES = 62
FEMNIST_CLASSES = tuple("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_FEMNIST_PIXELS = 28 * 28
_FEMNIST_OPTIONS = {"split_mode": "pooled", "test_fraction": 0.2, "split_seed": 0}
_LEAF_URL = "https://github.com/TalwalkarLab/leaf (folder data/femnist)"


def _femnist_folder(root: Path) -> Path | None:
    """The folder holding ``train/*.json`` and ``test/*.json``: ``root``, ``root/femnist/data`` or
    ``root/femnist``."""
    for cand in (root, root / "femnist" / "data", root / "femnist"):
        if all((cand / part).is_dir() and any((cand / part).glob("*.json")) for part in SPLITS):
            return cand
    return None


def read_leaf_json(path: str | os.PathLike[str], num_classes: int = FEMNIST_NUM_CLASSES) -> tuple[
    list[str], list[np.ndarray], list[np.ndarray]
]:
    """Writers, images and labels of one LEAF JSON file.

    The file holds ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [[784
    floats]], "y": [ints]}}}``. Returns ``(users, xs, ys)`` in the order of ``users``: ``xs[k]`` is a
    float32 ``n_k×784`` array and ``ys[k]`` an int64 array of length ``n_k``. Anything else (bad
    JSON, missing keys, ragged or non-numeric pixels, labels outside ``[0, num_classes)``, counts that
    disagree with ``num_samples``) raises :class:`DatasetFormatError` naming the file."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as fh:
            obj = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatasetFormatError(f"{path}: not a readable LEAF JSON file ({exc})") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("users"), list) or not isinstance(
        obj.get("user_data"), dict
    ):
        raise DatasetFormatError(
            f"{path}: a LEAF file must be an object with a 'users' list and a 'user_data' object"
        )
    users = [str(u) for u in obj["users"]]
    counts = obj.get("num_samples")
    if counts is not None and (not isinstance(counts, list) or len(counts) != len(users)):
        raise DatasetFormatError(f"{path}: 'num_samples' must be a list with one count per user")
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    for k, user in enumerate(users):
        entry = obj["user_data"].get(user)
        if not isinstance(entry, dict) or "x" not in entry or "y" not in entry:
            raise DatasetFormatError(f"{path}: user {user!r} has no 'x'/'y' entry in 'user_data'")
        try:
            x = np.asarray(entry["x"], dtype=np.float32)
            y_raw = np.asarray(entry["y"])
        except (TypeError, ValueError) as exc:
            raise DatasetFormatError(f"{path}: user {user!r}: non-numeric 'x' or 'y' ({exc})") from exc
        if x.size == 0:
            x = x.reshape(0, _FEMNIST_PIXELS)
        if x.ndim != 2 or x.shape[1] != _FEMNIST_PIXELS:
            raise DatasetFormatError(
                f"{path}: user {user!r}: 'x' must be a list of {_FEMNIST_PIXELS}-pixel rows (28×28), "
                f"got shape {x.shape}"
            )
        if y_raw.ndim != 1 or (y_raw.size and not np.issubdtype(y_raw.dtype, np.integer)):
            raise DatasetFormatError(f"{path}: user {user!r}: 'y' must be a list of integer labels")
        y = y_raw.astype(np.int64)
        if len(y) != len(x):
            raise DatasetFormatError(f"{path}: user {user!r} has {len(x)} images but {len(y)} labels")
        if counts is not None and counts[k] != len(y):
            raise DatasetFormatError(
                f"{path}: user {user!r}: num_samples says {counts[k]} but 'y' holds {len(y)} labels"
            )
        if y.size and (int(y.min()) < 0 or int(y.max()) >= num_classes):
            bad = int(y[(y < 0) | (y >= num_classes)][0])
            raise DatasetFormatError(f"{path}: user {user!r}: label {bad} lies outside 0..{num_classes - 1}")
        if not np.all(np.isfinite(x)):
            raise DatasetFormatError(f"{path}: user {user!r}: pixels must be finite numbers")
        xs.append(x)
        ys.append(y)
    return users, xs, ys


def _read_leaf_folder(folder: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Images (float32 ``N×784``), labels and the writer (LEAF user name) of every row of every
    ``*.json`` file in ``folder``, files in name order, users in file order."""
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    names: list[str] = []
    for path in sorted(folder.glob("*.json")):
        users, ux, uy = read_leaf_json(path)
        for user, x, y in zip(users, ux, uy):
            xs.append(x)
            ys.append(y)
            names.extend([user] * len(y))
    if not xs:
        return np.zeros((0, _FEMNIST_PIXELS), np.float32), np.zeros(0, np.int64), []
    return np.concatenate(xs), np.concatenate(ys), names


def _load_femnist(
    root: Path, split: str, download: bool, normalize: bool, options: Mapping[str, Any]
) -> ArrayDataset:
    opts = _check_options("femnist", options, _FEMNIST_OPTIONS)
    mode = opts["split_mode"]
    if mode not in ("pooled", "leaf"):
        raise DataConfigError(f"split_mode must be 'pooled' or 'leaf', got {mode!r}")
    frac = float(opts["test_fraction"])
    if not 0.0 < frac < 1.0:
        raise DataConfigError(f"test_fraction must lie in (0, 1), got {opts['test_fraction']!r}")
    folder = _femnist_folder(root)
    if folder is None:
        note = (
            "\nThere is no automatic download for FEMNIST (data.download has no effect): LEAF builds the "
            "JSON files with its own preprocessing scripts." if download else ""
        )
        raise DatasetNotFoundError(
            f"FEMNIST not found: no train/*.json and test/*.json under {root}, {root / 'femnist' / 'data'} "
            f"or {root / 'femnist'}.\n"
            f"Generate LEAF's FEMNIST JSON files with LEAF's femnist preprocessing ({_LEAF_URL}; e.g. "
            f"`./preprocess.sh -s niid --sf 1.0 -k 0 -t sample` keeps every writer and sample), then copy "
            f"its data/train and data/test folders to {root / 'femnist' / 'data'}, or point the loader at "
            f"the folder that holds train/ and test/ with --set data.data_dir=DIR (config: data.data_dir)."
            + note
        )
    parts = {s: _read_leaf_folder(folder / s) for s in SPLITS}
    # writer ids index the sorted names of every writer in either folder, so both splits share them
    writer_names, w_all = np.unique(
        np.asarray(parts["train"][2] + parts["test"][2], dtype=str), return_inverse=True
    )
    w_all = w_all.astype(np.int64).reshape(-1)
    n_train_rows = len(parts["train"][2])
    if mode == "leaf":
        train_x = parts["train"][0]
        x_np, y_np = parts[split][0], parts[split][1]
        w_np = w_all[:n_train_rows] if split == "train" else w_all[n_train_rows:]
    else:
        x_all = np.concatenate([parts[s][0] for s in SPLITS])
        y_all = np.concatenate([parts[s][1] for s in SPLITS])
        perm = np.random.default_rng(int(opts["split_seed"])).permutation(len(y_all))
        n_test = int(round(len(y_all) * frac))
        rows = {"test": np.sort(perm[:n_test]), "train": np.sort(perm[n_test:])}
        train_x = x_all[rows["train"]]
        x_np, y_np, w_np = x_all[rows[split]], y_all[rows[split]], w_all[rows[split]]
    if len(train_x) == 0 or len(y_np) == 0:
        raise DatasetFormatError(f"{folder}: the FEMNIST {split} split is empty")

    def images(arr: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(arr)).reshape(-1, 1, 28, 28)

    mean, std = _channel_stats(images(train_x))
    x = images(x_np).clone()
    if normalize:
        _normalize_(x, mean, std)
    return ArrayDataset(
        images=x,
        labels=torch.from_numpy(np.ascontiguousarray(y_np)),
        num_classes=FEMNIST_NUM_CLASSES,
        name="femnist",
        split=split,
        mean=mean if normalize else None,
        std=std if normalize else None,
        class_names=FEMNIST_CLASSES,
        default_augment=False,
        writers=w_np,
        writer_names=tuple(str(n) for n in writer_names),
    )


# --------------------------------------------------------------------------------------------------
# synthetic
# --------------------------------------------------------------------------------------------------

_SYNTH_OPTIONS = {
    "num_samples": 1000,
    "num_test": 200,
    "num_classes": 10,
    "input_shape": (3, 32, 32),
    "noise": 1.0,
    "seed": 0,
}


def _load_synthetic(split: str, normalize: bool, options: Mapping[str, Any]) -> ArrayDataset:
    opts = _check_options("synthetic", options, _SYNTH_OPTIONS)
    n_train = _positive_int("num_samples", opts["num_samples"])
    n_test = _positive_int("num_test", opts["num_test"])
    num_classes = _positive_int("num_classes", opts["num_classes"])
    shape = tuple(opts["input_shape"])
    if len(shape) != 3 or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1 for s in shape):
        raise DataConfigError(f"input_shape must be three positive ints (C, H, W), got {opts['input_shape']!r}")
    shape = tuple(int(s) for s in shape)
    noise = float(opts["noise"])
    if noise < 0:
        raise DataConfigError(f"noise must be >= 0, got {opts['noise']!r}")
    seed = int(opts["seed"])

    def stream(k: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(k,)))

    prototypes = stream(0).standard_normal((num_classes, *shape)).astype(np.float32)

    def make(k: int, n: int) -> tuple[Tensor, Tensor]:
        rng = stream(k)
        y = rng.permutation(np.arange(n, dtype=np.int64) % num_classes)
        x = prototypes[y] + noise * rng.standard_normal((n, *shape)).astype(np.float32)
        return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y)

    train_x, train_y = make(1, n_train)
    mean, std = _channel_stats(train_x)
    x, y = (train_x, train_y) if split == "train" else make(2, n_test)
    if normalize:
        _normalize_(x, mean, std)
    return ArrayDataset(
        images=x,
        labels=y,
        num_classes=num_classes,
        name="synthetic",
        split=split,
        mean=mean if normalize else None,
        std=std if normalize else None,
        default_augment=False,
    )


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def load_dataset(
    name: str,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    split: str = "train",
    download: bool = False,
    normalize: bool = True,
    **options: Any,
) -> ArrayDataset:
    """Load one split of a dataset into memory.

    Parameters
    ----------
    name:
        one of :data:`DATASETS`.
    data_dir:
        directory holding the files (CIFAR, DermaMNIST, MNIST, Fashion-MNIST, FEMNIST, SVHN); default ``$FEDHETERO_DATA_DIR`` or
        ``./data``. Ignored by ``digits`` and ``synthetic``.
    split:
        ``"train"`` or ``"test"``.
    download:
        try to download missing files (through torchvision's downloader; needs network).
    normalize:
        normalise per channel (default). ``False`` serves pixels in ``[0, 1]``.
    **options:
        dataset-specific options; unknown ones are an error. ``digits``: ``size`` (32),
        ``test_fraction`` (0.2), ``split_seed`` (0), ``interpolation`` (``"bilinear"`` |
        ``"nearest"``). ``dermamnist``: ``size`` (28 | 64 | 128 | 224: which file),
        ``resize`` (None or an int), ``include_val`` (False: the val split is not in "train").
        ``femnist``: ``split_mode`` (``"pooled"`` | ``"leaf"``), ``test_fraction`` (0.2),
        ``split_seed`` (0). ``synthetic``: ``num_samples`` (1000), ``num_test`` (200), ``num_classes`` (10),
        ``input_shape`` ((3, 32, 32)), ``noise`` (1.0), ``seed`` (0).

    Returns
    -------
    ArrayDataset
        deterministic: the same arguments always give bit-identical tensors.

    Raises
    ------
    DatasetNotFoundError
        files are missing; the message says which files to put in which directory.
    DataConfigError
        an unknown name, split or option.
    DatasetFormatError
        a file is damaged or holds something else (unreadable archive, labels that are not integer
        class ids or lie outside the classes, an empty split); the message names the file.
    """
    if not isinstance(name, str) or name.lower() not in DATASETS:
        raise DataConfigError(f"unknown dataset {name!r}; accepted: {', '.join(DATASETS)}")
    name = name.lower()
    if split not in SPLITS:
        raise DataConfigError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    loaders: dict[str, Callable[[], ArrayDataset]] = {
        "digits": lambda: _load_digits(split, normalize, options),
        "cifar10": lambda: _load_cifar("cifar10", resolve_data_dir(data_dir), split, download, normalize, options),
        "cifar100": lambda: _load_cifar("cifar100", resolve_data_dir(data_dir), split, download, normalize, options),
        "dermamnist": lambda: _load_dermamnist(resolve_data_dir(data_dir), split, download, normalize, options),
        "mnist": lambda: _load_idx_set("mnist", resolve_data_dir(data_dir), split, download, normalize, options),
        "fashion_mnist": lambda: _load_idx_set("fashion_mnist", resolve_data_dir(data_dir), split, download, normalize, options),
        "femnist": lambda: _load_femnist(resolve_data_dir(data_dir), split, download, normalize, options),
        "svhn": lambda: _load_svhn(resolve_data_dir(data_dir), split, download, normalize, options),
        "synthetic": lambda: _load_synthetic(split, normalize, options),
    }
    dataset = loaders[name]()
    if not len(dataset):  # the loaders name the file; this is the net under them
        where = "" if name in ("digits", "synthetic") else f" in {resolve_data_dir(data_dir)}"
        raise DatasetFormatError(f"the {name} {split} split{where} is empty (0 samples)")
    return dataset
