"""One client's view of the run's data on its device: its own train and test indices
and the batches of an epoch (shuffled and augmented for training, from a generator
seeded by a stable hash)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

from fedspc_app.core.config import RunConfig
from fedspc_app.data.batching import iterate_batches
from fedspc_app.data.datasets import ImageDataset
from fedspc_app.data.run_data import load_partition, load_run_dataset, use_augmentation
from fedspc_app.training.precision import resolve_device


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
