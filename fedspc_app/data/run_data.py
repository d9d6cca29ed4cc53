"""The run's data, as its run-config names it: the dataset (loaded once per process),
its partition over the clients (cached per process; with ``held-out-clients`` the
held-out ones last), the shape the model is built for, and whether training batches
are augmented."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from fedspc_app.core.config import RunConfig
from fedspc_app.core.errors import ConfigError
from fedspc_app.data.datasets import ImageDataset, load_dataset
from fedspc_app.data.partition import Partition, make_partition


@dataclass(frozen=True)
class DatasetShape:
    """What building the model needs to know about a dataset: its input and output sizes."""

    name: str
    num_classes: int
    in_chans: int
    image_size: int


# The shapes :mod:`fedspc_app.data.datasets` loads each dataset with, for a server that does not
# hold the data (a deployment's SuperLink machine).
KNOWN_SHAPES: dict[str, DatasetShape] = {
    "digits": DatasetShape("digits", num_classes=10, in_chans=1, image_size=32),
    "cifar10": DatasetShape("cifar10", num_classes=10, in_chans=3, image_size=32),
    "cifar100": DatasetShape("cifar100", num_classes=100, in_chans=3, image_size=32),
    "tinyimagenet": DatasetShape("tinyimagenet", num_classes=200, in_chans=3, image_size=64),
}


def dataset_shape(dataset: ImageDataset) -> DatasetShape:
    """The shape of a loaded dataset."""
    return DatasetShape(dataset.name, dataset.num_classes, dataset.in_chans, dataset.image_size)


def load_run_dataset(config: RunConfig) -> ImageDataset:
    """The run's dataset (cached per process by :func:`load_dataset`)."""
    return load_dataset(config.dataset, config.resolved_data_dir, download=config.download)


@functools.lru_cache(maxsize=8)
def _partition(config_key: tuple, num_clients: int, dataset_name: str,
               data_dir: str, download: bool) -> Partition:
    scheme, alpha, classes_per_client, seed, min_samples, max_tries, held_out = config_key
    dataset = load_dataset(dataset_name, data_dir, download=download)
    return hold_out(make_partition(
        scheme, dataset.train_labels.numpy(), dataset.test_labels.numpy(),
        num_clients=num_clients, alpha=alpha, classes_per_client=classes_per_client,
        seed=seed, min_samples=min_samples, max_tries=max_tries,
        num_classes=dataset.num_classes), held_out)


def load_partition(config: RunConfig, num_clients: int) -> Partition:
    """The run's partition over ``num_clients`` (``partition``: Dirichlet or class-count;
    cached per process); with ``held-out-clients`` = N its last N clients are the
    held-out ones (:func:`hold_out`)."""
    return _partition(
        (config.partition, config.alpha, config.classes_per_client, config.seed,
         config.min_samples, config.partition_max_tries, config.held_out_clients),
        num_clients,
        config.dataset,
        str(config.resolved_data_dir),
        config.download,
    )


def use_augmentation(config: RunConfig, dataset: ImageDataset) -> bool:
    """``augment = auto`` follows the dataset (crop+flip for natural images)."""
    if config.augment == "auto":
        return dataset.default_augment
    return config.augment == "crop-flip"


def held_out_ids(num_clients: int, count: int, seed: int) -> list[int]:
    """The ``count`` clients of a partition over ``num_clients`` that a run with
    ``held-out-clients = count`` holds out: a draw of a generator seeded by ``seed``
    (sorted). :func:`hold_out` moves them to the end."""
    if count <= 0:
        return []
    rng = np.random.default_rng([int(seed), 0x48454C44])  # its own stream of the seed
    return sorted(int(k) for k in rng.choice(num_clients, size=count, replace=False))


def hold_out(partition: Partition, count: int) -> Partition:
    """``partition`` with ``count`` clients, drawn by :func:`held_out_ids` from its seed,
    moved to the end (the others keep their order): partition ids ``0 … K-1`` train,
    ``K … K+count-1`` are the held-out clients.

    Raises
    ------
    ConfigError
        ``count`` leaves no client to train.
    """
    total = partition.num_clients
    if count <= 0:
        return partition
    if count >= total:
        raise ConfigError(
            f"held-out-clients = {count} leaves no client to train among the run's "
            f"{total} clients (the held-out clients are counted in them)")
    held = held_out_ids(total, count, partition.seed)
    order = [k for k in range(total) if k not in held] + held
    return dataclasses.replace(
        partition, held_out=count,
        train_indices=tuple(partition.train_indices[k] for k in order),
        test_indices=tuple(partition.test_indices[k] for k in order),
        proportions=partition.proportions[:, order],
        _train_counts=partition.train_counts()[order],
        _test_counts=partition.test_counts()[order])
