"""Glue used by both the ServerApp and the ClientApp.

Building the model for a run (once per process), loading its dataset, partition and
a client's data on its device, and converting between torch state dicts and numpy
arrays (always by key, never by position; the ArrayRecords of messages are
:mod:`fedspc_app.core.records`, the shared/personal split of a model
:mod:`fedspc_app.core.split`).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedspc_app.core.batching import iterate_batches
from fedspc_app.core.config import RunConfig
from fedspc_app.core.datasets import ImageDataset, load_dataset
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.models import build_model
from fedspc_app.core.partition import Partition, make_partition
from fedspc_app.core.records import ArrayDict


def state_arrays(model: nn.Module, keys: Iterable[str]) -> ArrayDict:
    """Copies of the model's state-dict entries ``keys`` as numpy arrays."""
    state = model.state_dict()
    return {key: state[key].detach().cpu().numpy().copy() for key in keys}


def load_arrays(model: nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """Overwrite the model's state-dict entries named in ``arrays``."""
    state = model.state_dict()
    unknown = [key for key in arrays if key not in state]
    if unknown:
        raise KeyError(f"not in the model's state dict: {unknown[:5]}")
    with torch.no_grad():
        for key, value in arrays.items():
            target = state[key]
            if tuple(target.shape) != tuple(np.shape(value)):
                raise ValueError(
                    f"shape mismatch for {key!r}: model {tuple(target.shape)}, "
                    f"array {tuple(np.shape(value))}"
                )
            target.copy_(torch.as_tensor(np.asarray(value)).to(target.dtype))


# ------------------------------------------------------------------ model, data
@dataclass(frozen=True)
class DatasetShape:
    """What building the model needs to know about a dataset: its input and output sizes."""

    name: str
    num_classes: int
    in_chans: int
    image_size: int


# The shapes :mod:`fedspc_app.core.datasets` loads each dataset with, for a server that does not
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


def make_model(config: RunConfig, dataset: ImageDataset | DatasetShape) -> nn.Module:
    """The run's model, initialised from the run seed (identical on every party)."""
    return build_model(
        config.model,
        num_classes=dataset.num_classes,
        in_chans=dataset.in_chans,
        image_size=dataset.image_size,
        seed=config.seed,
        vit_embed_dim=config.vit_embed_dim,
        width=config.model_width,
    )


@dataclass
class _InitialModel:
    """One built model per process and its initial entries, to reset it from."""

    key: tuple | None = None
    model: nn.Module | None = None
    initial: dict[str, torch.Tensor] | None = None


_INITIAL = _InitialModel()


def initial_model(config: RunConfig, dataset: ImageDataset | DatasetShape) -> nn.Module:
    """The run's initial model, equal to what :func:`make_model` returns.

    The process builds it once and afterwards resets the same object to its initial
    entries (a copy instead of a build: milliseconds instead of seconds for ResNet-34
    or ViT). The caller may change the model until its next call of this function;
    a process running one client message at a time (a simulation worker) never needs
    two at once.
    """
    key = (config.model, dataset.num_classes, dataset.in_chans, dataset.image_size,
           config.seed, config.vit_embed_dim, config.model_width)
    cache = _INITIAL
    if cache.key != key or cache.model is None or cache.initial is None:
        cache.key, cache.model = None, None  # a failed build leaves no stale model
        model = make_model(config, dataset)
        cache.initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        cache.key, cache.model = key, model
        return model
    model = cache.model
    with torch.no_grad():
        model.load_state_dict(cache.initial)
    for parameter in model.parameters():
        parameter.grad = None
        parameter.requires_grad_(True)
    return model.train()


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


def resolve_device(config: RunConfig) -> torch.device:
    """``device = auto`` picks CUDA when available."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run-config 'device' = 'cuda' but CUDA is not available here")
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def use_augmentation(config: RunConfig, dataset: ImageDataset) -> bool:
    """``augment = auto`` follows the dataset (crop+flip for natural images)."""
    if config.augment == "auto":
        return dataset.default_augment
    return config.augment == "crop-flip"


def seeded_generator(*parts: int | str) -> torch.Generator:
    """A CPU generator seeded from a stable hash of ``parts``."""
    text = "/".join(str(part) for part in parts).encode()
    return torch.Generator().manual_seed(zlib.crc32(text))


@dataclass(frozen=True)
class ClientData:
    """One client's view of the data: the dataset and its own index sets."""

    dataset: ImageDataset
    train_indices: np.ndarray
    test_indices: np.ndarray
    augment: bool
    batch_size: int
    device: torch.device

    def batches(self, split: str, generator: torch.Generator | None = None):
        """A callable giving one epoch of batches (shuffled+augmented for train)."""
        train = split == "train"
        indices = self.train_indices if train else self.test_indices

        def epoch():
            return iterate_batches(
                self.dataset,
                split,
                indices,
                batch_size=self.batch_size,
                shuffle=train,
                augment=train and self.augment,
                generator=generator,
                device=self.device,
            )

        return epoch


def client_data(config: RunConfig, partition_id: int, num_partitions: int) -> ClientData:
    """Load the dataset and this client's partition."""
    dataset = load_run_dataset(config)
    partition = load_partition(config, num_partitions)
    train_indices, test_indices = partition.client(partition_id)
    return ClientData(
        dataset=dataset,
        train_indices=train_indices,
        test_indices=test_indices,
        augment=use_augmentation(config, dataset),
        batch_size=config.batch_size,
        device=resolve_device(config),
    )
