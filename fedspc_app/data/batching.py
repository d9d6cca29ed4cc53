"""On-device batching and augmentation of an in-memory :class:`ImageDataset`.

No ``DataLoader`` or PIL: :func:`iterate_batches` slices a batch of indices, moves it to
the device and does the augmentation (:func:`random_crop_flip`), float conversion and
normalisation there as batched tensor operations.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fedspc_app.core.errors import ConfigError, DataError
from fedspc_app.data.datasets import ImageDataset

__all__ = ["iterate_batches", "random_crop_flip"]

def random_crop_flip(
    images: torch.Tensor, generator: torch.Generator | None, padding: int = 4
) -> torch.Tensor:
    """Per sample: zero-pad by ``padding`` pixels, cut an ``H x W`` window at a random
    offset, mirror left-right with probability 0.5; one gather on ``images.device``.

    Draws from ``generator`` (CPU; ``None``: torch's global one), in order: row
    offsets ``[B]``, column offsets ``[B]``, flip flags ``[B]``.
    """
    if images.ndim != 4:
        raise ConfigError(f"images must be [B, C, H, W], got shape {tuple(images.shape)}")
    if padding < 0:
        raise ConfigError(f"padding must be >= 0, got {padding}")
    batch, channels, height, width = images.shape
    device = images.device
    # Drawn on the CPU so that the same seed gives the same augmentation on any device.
    row_off = torch.randint(0, 2 * padding + 1, (batch,), generator=generator)
    col_off = torch.randint(0, 2 * padding + 1, (batch,), generator=generator)
    flip = torch.randint(0, 2, (batch,), generator=generator).bool()
    row_off, col_off, flip = row_off.to(device), col_off.to(device), flip.to(device)

    padded = F.pad(images, (padding, padding, padding, padding)) if padding else images
    padded_width = width + 2 * padding
    rows = row_off[:, None] + torch.arange(height, device=device)  # [B, H]
    steps = torch.arange(width, device=device)
    cols = col_off[:, None] + torch.where(flip[:, None], width - 1 - steps, steps)  # [B, W]
    # One gather over the flattened padded plane; the same index serves every channel.
    flat = (rows[:, :, None] * padded_width + cols[:, None, :]).view(batch, 1, height * width)
    out = padded.reshape(batch, channels, -1).gather(2, flat.expand(batch, channels, -1))
    return out.view(batch, channels, height, width)


def _as_index_tensor(
    indices: torch.Tensor | np.ndarray | Sequence[int], size: int
) -> torch.Tensor:
    if isinstance(indices, torch.Tensor):
        idx = indices.detach().to("cpu")
    else:
        idx = torch.from_numpy(np.array(indices))  # a copy: partitions are read-only
    if idx.ndim != 1:
        raise DataError(f"indices must be 1-D, got shape {tuple(idx.shape)}")
    if idx.numel() == 0:
        return idx.to(torch.int64)
    if idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex():
        raise DataError(f"indices must be integers, got {idx.dtype}")
    idx = idx.to(torch.int64)
    low, high = int(idx.min()), int(idx.max())
    if low < 0 or high >= size:
        raise DataError(f"indices span [{low}, {high}], outside the split's range [0, {size})")
    return idx


def iterate_batches(
    dataset: ImageDataset,
    split: str,
    indices: torch.Tensor | np.ndarray,
    *,
    batch_size: int,
    shuffle: bool,
    augment: bool,
    generator: torch.Generator | None,
    device: torch.device | str,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(float32 images, int64 labels)`` batches of ``dataset[split][indices]`` on
    ``device``, augmented (crop-flip, 4-pixel padding) if ``augment`` and normalised with
    the dataset's mean/std. The last partial batch is kept.

    Draws from ``generator``, in order: one permutation (if ``shuffle``), then per
    batch those of :func:`random_crop_flip`; the same seed gives the same batches.
    Arguments are checked at the call, not on the first ``next()``.
    """
    images, labels = dataset.split(split)
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    idx = _as_index_tensor(indices, int(labels.shape[0]))
    if shuffle and idx.numel() > 1:
        idx = idx[torch.randperm(idx.numel(), generator=generator)]
    target = torch.device(device)
    mean = torch.tensor(dataset.mean, dtype=torch.float32, device=target).view(1, -1, 1, 1)
    std = torch.tensor(dataset.std, dtype=torch.float32, device=target).view(1, -1, 1, 1)
    return _batches(images, labels, idx, batch_size, augment, generator, target, mean, std)


def _batches(
    images: torch.Tensor,
    labels: torch.Tensor,
    idx: torch.Tensor,
    batch_size: int,
    augment: bool,
    generator: torch.Generator | None,
    device: torch.device,
    mean: torch.Tensor,
    std: torch.Tensor,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for start in range(0, idx.numel(), batch_size):
        chosen = idx[start : start + batch_size]
        x = images.index_select(0, chosen).to(device, non_blocking=True)
        y = labels.index_select(0, chosen).to(device, non_blocking=True)
        if augment:
            # Crop/flip only moves pixels and inserts zeros, so doing it on uint8 gives
            # exactly the result of doing it after the float conversion, with a quarter
            # of the memory traffic.
            x = random_crop_flip(x, generator, padding=4)
        x = x.to(torch.float32).div_(255.0)
        yield x.sub_(mean).div_(std), y
