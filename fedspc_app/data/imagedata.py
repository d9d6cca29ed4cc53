"""The in-memory dataset every loader returns (:mod:`fedspc_app.data.datasets`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedspc_app.core.errors import ConfigError, DataError

SPLITS: tuple[str, ...] = ("train", "test")


# eq=False: the generated __eq__ would compare tensors element-wise and fail on bool().
@dataclass(frozen=True, eq=False)
class ImageDataset:
    """A labelled image dataset with a train and a test split, held in memory.

    Attributes
    ----------
    name : str
        One of :data:`DATASET_NAMES`.
    train_images, test_images : torch.Tensor
        ``uint8`` tensors of shape ``[N, C, H, W]``, contiguous, on the CPU.
    train_labels, test_labels : torch.Tensor
        ``int64`` tensors of shape ``[N]`` with values in ``[0, num_classes)``.
    num_classes : int
        Number of classes.
    class_names : tuple of str
        Human-readable name of each class; index = label.
    mean, std : tuple of float
        Per-channel statistics on the ``[0, 1]`` scale, used for normalisation.
    default_augment : bool
        Whether training on this dataset normally uses random crop + flip.

    Raises
    ------
    DataError
        If the tensors have the wrong dtype, shape or layout, or labels are out of range.
    """

    name: str
    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    num_classes: int
    class_names: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    default_augment: bool

    def __post_init__(self) -> None:
        if self.num_classes < 1:
            raise DataError(
                f"dataset {self.name!r}: num_classes must be >= 1, got {self.num_classes}"
            )
        if len(self.class_names) != self.num_classes:
            raise DataError(
                f"dataset {self.name!r}: {len(self.class_names)} class names for "
                f"{self.num_classes} classes"
            )
        for split in SPLITS:
            images, labels = self.split(split)
            _check_split_tensors(self.name, split, images, labels, self.num_classes)
        if self.train_images.shape[1:] != self.test_images.shape[1:]:
            raise DataError(
                f"dataset {self.name!r}: train images are {tuple(self.train_images.shape[1:])} "
                f"but test images are {tuple(self.test_images.shape[1:])}"
            )
        channels = self.in_chans
        if len(self.mean) != channels or len(self.std) != channels:
            raise DataError(
                f"dataset {self.name!r}: mean/std need {channels} values, got "
                f"{len(self.mean)}/{len(self.std)}"
            )
        if any(not s > 0 for s in self.std):
            raise DataError(f"dataset {self.name!r}: std must be positive, got {self.std}")

    @property
    def in_chans(self) -> int:
        """Number of image channels ``C``."""
        return int(self.train_images.shape[1])

    @property
    def image_size(self) -> int:
        """Image height ``H`` in pixels (all supported datasets are square)."""
        return int(self.train_images.shape[2])

    @property
    def num_train(self) -> int:
        """Number of training images."""
        return int(self.train_labels.shape[0])

    @property
    def num_test(self) -> int:
        """Number of test images."""
        return int(self.test_labels.shape[0])

    def split(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(images, labels)`` of ``split`` ("train" or "test"; else ConfigError)."""
        if split == "train":
            return self.train_images, self.train_labels
        if split == "test":
            return self.test_images, self.test_labels
        raise ConfigError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")


def _check_split_tensors(
    name: str, split: str, images: Any, labels: Any, num_classes: int
) -> None:
    where = f"dataset {name!r}, {split} split"
    if not isinstance(images, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise DataError(f"{where}: images and labels must be torch tensors")
    if images.dtype != torch.uint8 or images.ndim != 4:
        raise DataError(
            f"{where}: images must be uint8 [N, C, H, W], got {images.dtype} "
            f"{tuple(images.shape)}"
        )
    if not images.is_contiguous():
        raise DataError(f"{where}: images must be contiguous")
    if labels.dtype != torch.int64 or labels.ndim != 1:
        raise DataError(
            f"{where}: labels must be int64 [N], got {labels.dtype} {tuple(labels.shape)}"
        )
    if labels.shape[0] != images.shape[0]:
        raise DataError(f"{where}: {images.shape[0]} images but {labels.shape[0]} labels")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise DataError(
            f"{where}: labels span [{int(labels.min())}, {int(labels.max())}], "
            f"outside [0, {num_classes})"
        )
