"""Data layer: in-memory datasets, client partitions, server/public splits, non-IID degree.

Typical use::

    from fedhetero.data import build_federated_data, iterate_batches
    fd = build_federated_data("digits", num_clients=20, partition="dirichlet", alpha=0.5, rng=seed)
    for x, y in iterate_batches(fd.train, fd.client_indices[0], 32, generator=torch_gen):
        ...
"""

from .batches import iterate_batches, num_batches, random_crop_flip
from .datasets import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR100_MEAN,
    CIFAR100_STD,
    DATA_DIR_ENV,
    DATASETS,
    DEFAULT_DATA_DIR,
    SPLITS,
    ArrayDataset,
    digits_split,
    load_dataset,
    resolve_data_dir,
)
from .transforms import InputTransform
from .errors import DataConfigError, DatasetFormatError, DatasetNotFoundError
from .federated import FederatedData, build_federated_data, load_partition, save_partition
from .partition import (
    PARTITIONS,
    dirichlet,
    iid,
    label_histograms,
    make_partition,
    partition_stats,
    pathological,
    shards,
    validate_partition,
)
from .server import (
    ServerSplit,
    js_divergence,
    label_distribution,
    non_iid_degree,
    resolve_server_classes,
    split_public,
    split_server,
)

__all__ = [
    # datasets
    "ArrayDataset",
    "DATASETS",
    "SPLITS",
    "DATA_DIR_ENV",
    "DEFAULT_DATA_DIR",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "load_dataset",
    "resolve_data_dir",
    "digits_split",
    "InputTransform",
    # errors
    "DataConfigError",
    "DatasetFormatError",
    "DatasetNotFoundError",
    # batches
    "iterate_batches",
    "num_batches",
    "random_crop_flip",
    # partitions
    "PARTITIONS",
    "iid",
    "dirichlet",
    "shards",
    "pathological",
    "make_partition",
    "label_histograms",
    "partition_stats",
    "validate_partition",
    # server / public / non-IID degree
    "ServerSplit",
    "js_divergence",
    "non_iid_degree",
    "label_distribution",
    "resolve_server_classes",
    "split_server",
    "split_public",
    # federated container
    "FederatedData",
    "build_federated_data",
    "save_partition",
    "load_partition",
]
