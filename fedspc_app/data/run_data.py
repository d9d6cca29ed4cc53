"""The run's data, as its run-config names it: the dataset (loaded once per process),
its partition over the clients (cached per process), the shape the model is built for,
and whether training batches are augmented."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fedspc_app.core.config import RunConfig
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
    scheme, alpha, classes_per_client, seed, min_samples, max_tries = config_key
    dataset = load_dataset(dataset_name, data_dir, download=download)
    return make_partition(
        scheme, dataset.train_labels.numpy(), dataset.test_labels.numpy(),
        num_clients=num_clients, alpha=alpha, classes_per_client=classes_per_client,
        seed=seed, min_samples=min_samples, max_tries=max_tries,
        num_classes=dataset.num_classes)


def load_partition(config: RunConfig, num_clients: int) -> Partition:
    """The run's partition over ``num_clients`` (``partition``: Dirichlet or class-count;
    cached per process)."""
    return _partition(
        (config.partition, config.alpha, config.classes_per_client, config.seed,
         config.min_samples, config.partition_max_tries),
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
