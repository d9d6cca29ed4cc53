"""Image datasets held in memory as uint8 tensors ``[N, C, H, W]``.

Batching and augmentation on those tensors are in :mod:`fedspc_app.data.batching`.

Supported datasets (:data:`DATASET_NAMES`):

``digits``
    scikit-learn's embedded 8x8 handwritten digits, upsampled to 32x32, with a fixed
    stratified train/test split. Needs no files and no network.
``cifar10`` / ``cifar100``
    The official "python version" pickles (``cifar-10-batches-py/`` or
    ``cifar-100-python/`` under ``data_dir``), read directly without checksum checks.
    If the folder is missing, torchvision's downloader is tried once.
``tinyimagenet``
    The official ``tiny-imagenet-200/`` folder under ``data_dir``; the decoded images
    are cached in an ``.npz`` file under :func:`default_cache_dir`.

Loaded datasets are cached per process (see :func:`load_dataset`, :func:`clear_cache`).
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedspc_app.core.config import (  # noqa: F401 - re-exported
    CACHE_DIR_ENV,
    DATASETS,
    default_cache_dir,
    default_data_dir,
)
from fedspc_app.core.errors import ConfigError, DataError, one_line
from fedspc_app.core.files import find_folder
from fedspc_app.data.imagedata import SPLITS, ImageDataset
from fedspc_app.data.tinyimagenet import load_tinyimagenet

__all__ = [
    "DATASET_NAMES",
    "SPLITS",
    "ImageDataset",
    "clear_cache",
    "default_cache_dir",
    "default_data_dir",
    "load_dataset",
]

logger = logging.getLogger(__name__)

DATASET_NAMES: tuple[str, ...] = DATASETS  # one list, in the run-config module



# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


def load_dataset(
    name: str, data_dir: str | os.PathLike[str] | None, *, download: bool = True
) -> ImageDataset:
    """Load dataset ``name`` (case-insensitive) completely into memory.

    ``data_dir`` holds ``cifar-10-batches-py/``, ``cifar-100-python/`` or
    ``tiny-imagenet-200/`` (or is that folder); empty means :func:`default_data_dir`;
    ``digits`` ignores it. ``download`` lets torchvision fetch a missing CIFAR folder.
    Results are cached per process (:func:`clear_cache`); the tensors are shared and
    must not be modified. Raises ConfigError for an unknown name, DataError for
    missing or corrupt files.
    """
    key = str(name).strip().lower()
    if key not in DATASET_NAMES:
        raise ConfigError(
            f"unknown dataset {name!r}; valid names are: {', '.join(DATASET_NAMES)}"
        )
    if key == "digits":
        return _load_cached(key, None, False)
    root = default_data_dir() if data_dir is None or str(data_dir) == "" else Path(data_dir)
    resolved = str(root.expanduser().resolve())
    return _load_cached(key, resolved, bool(download) and key in _CIFAR_SPECS)


def clear_cache() -> None:
    """Forget every dataset cached by :func:`load_dataset` in this process."""
    _load_cached.cache_clear()


@functools.lru_cache(maxsize=4)
def _load_cached(name: str, data_dir: str | None, download: bool) -> ImageDataset:
    if name == "digits":
        return _load_digits()
    if data_dir is None:
        raise ConfigError(f"dataset {name!r} needs a data directory")
    if name in _CIFAR_SPECS:
        return _load_cifar(_CIFAR_SPECS[name], Path(data_dir), download=download)
    return load_tinyimagenet(Path(data_dir))


# ---- digits --------------------------------------------------------------------------

_DIGITS_SIZE = 32
_DIGITS_TEST_FRACTION = 0.2
# Fixed and independent of any run seed, so every run and every client sees the
# same train/test split.
_DIGITS_SPLIT_SEED = 1797


def _stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Split indices so each class contributes ``round(test_fraction * n_c)`` test items."""
    rng = np.random.default_rng(seed)
    train_parts, test_parts = [], []
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        n_test = int(round(test_fraction * len(members)))
        test_parts.append(members[:n_test])
        train_parts.append(members[n_test:])
    return np.sort(np.concatenate(train_parts)), np.sort(np.concatenate(test_parts))


def _load_digits() -> ImageDataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    raw = np.asarray(bunch.images, dtype=np.float64)  # (1797, 8, 8), values 0..16
    labels = np.asarray(bunch.target, dtype=np.int64)
    pixels = np.rint(raw * (255.0 / 16.0)).astype(np.uint8)
    # Nearest-neighbour: the factor is exactly 4, so every source pixel becomes a 4x4
    # block and the 17 original grey levels are kept unchanged. Bilinear would blur the
    # strokes and invent intermediate values that the data never had.
    images = F.interpolate(
        torch.from_numpy(pixels).unsqueeze(1), size=(_DIGITS_SIZE, _DIGITS_SIZE), mode="nearest"
    ).contiguous()
    train_idx, test_idx = _stratified_split(labels, _DIGITS_TEST_FRACTION, _DIGITS_SPLIT_SEED)
    train_idx_t = torch.from_numpy(train_idx)
    test_idx_t = torch.from_numpy(test_idx)
    train_images = images[train_idx_t].contiguous()
    scaled = train_images.to(torch.float64) / 255.0
    mean = tuple(float(v) for v in scaled.mean(dim=(0, 2, 3)))
    std = tuple(float(v) for v in scaled.std(dim=(0, 2, 3), correction=0))
    labels_t = torch.from_numpy(labels)
    return ImageDataset(
        name="digits",
        train_images=train_images,
        train_labels=labels_t[train_idx_t].contiguous(),
        test_images=images[test_idx_t].contiguous(),
        test_labels=labels_t[test_idx_t].contiguous(),
        num_classes=10,
        class_names=tuple(str(d) for d in range(10)),
        mean=mean,
        std=std,
        default_augment=False,
    )


# ---- CIFAR ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _CifarSpec:
    name: str
    title: str
    folder: str
    train_files: tuple[str, ...]
    test_file: str
    meta_file: str
    label_key: str
    names_key: str
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    torchvision_class: str
    url: str

    @property
    def required(self) -> tuple[str, ...]:
        return (*self.train_files, self.test_file, self.meta_file)


# Published per-channel train statistics (on [0, 1]); hardcoded so that loading does not
# need a pass over the data and every client normalises identically.
_CIFAR_SPECS: dict[str, _CifarSpec] = {
    "cifar10": _CifarSpec(
        name="cifar10",
        title="CIFAR-10",
        folder="cifar-10-batches-py",
        train_files=tuple(f"data_batch_{i}" for i in range(1, 6)),
        test_file="test_batch",
        meta_file="batches.meta",
        label_key="labels",
        names_key="label_names",
        num_classes=10,
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2470, 0.2435, 0.2616),
        torchvision_class="CIFAR10",
        url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    ),
    "cifar100": _CifarSpec(
        name="cifar100",
        title="CIFAR-100",
        folder="cifar-100-python",
        train_files=("train",),
        test_file="test",
        meta_file="meta",
        label_key="fine_labels",
        names_key="fine_label_names",
        num_classes=100,
        mean=(0.5071, 0.4865, 0.4409),
        std=(0.2673, 0.2564, 0.2762),
        torchvision_class="CIFAR100",
        url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
    ),
}

_CIFAR_SIDE = 32
_CIFAR_ROW = 3 * _CIFAR_SIDE * _CIFAR_SIDE


def _load_cifar(spec: _CifarSpec, data_dir: Path, *, download: bool) -> ImageDataset:
    folder = find_folder(data_dir, spec.folder, spec.required)
    looked_for = data_dir / spec.folder
    if folder is None:
        if not download:
            raise DataError(
                f"{spec.title} not found: the folder {str(looked_for)!r} does not exist "
                f"(download is disabled). Put the {spec.folder!r} folder (unpacked from "
                f"{spec.url}) under data-dir, or set data-dir to the folder that contains it."
            )
        try:
            _download_cifar(spec, data_dir)
        except Exception as err:  # any failure of the third-party downloader ends here
            raise DataError(
                f"{spec.title} not found: the folder {str(looked_for)!r} does not exist "
                f"and downloading it with torchvision failed ({one_line(err)}). Put the "
                f"{spec.folder!r} folder (unpacked from {spec.url}) under data-dir, or set "
                f"data-dir to the folder that contains it."
            ) from None
        folder = find_folder(data_dir, spec.folder, spec.required)
        if folder is None:
            raise DataError(
                f"{spec.title}: torchvision reported a successful download but "
                f"{str(looked_for)!r} still does not exist"
            )
    missing = [f for f in spec.required if not (folder / f).is_file()]
    if missing:
        raise DataError(
            f"{spec.title} folder {str(folder)!r} is incomplete: missing "
            f"{', '.join(missing)}. Replace it with a fresh copy from {spec.url}."
        )

    parts = [_read_cifar_batch(folder / f, spec) for f in spec.train_files]
    # A single train file (CIFAR-100) is used as is, avoiding a 150 MB copy.
    train_images = parts[0][0] if len(parts) == 1 else np.concatenate([p[0] for p in parts])
    train_labels = parts[0][1] if len(parts) == 1 else np.concatenate([p[1] for p in parts])
    test_images, test_labels = _read_cifar_batch(folder / spec.test_file, spec)
    class_names = _read_cifar_meta(folder / spec.meta_file, spec)
    return ImageDataset(
        name=spec.name,
        train_images=torch.from_numpy(np.ascontiguousarray(train_images)),
        train_labels=torch.from_numpy(train_labels),
        test_images=torch.from_numpy(np.ascontiguousarray(test_images)),
        test_labels=torch.from_numpy(test_labels),
        num_classes=spec.num_classes,
        class_names=class_names,
        mean=spec.mean,
        std=spec.std,
        default_augment=True,
    )


def _download_cifar(spec: _CifarSpec, data_dir: Path) -> None:
    """Let torchvision fetch and unpack the official archive into ``data_dir``."""
    import torchvision.datasets

    # Looked up at call time so that tests can replace the class.
    dataset_cls = getattr(torchvision.datasets, spec.torchvision_class)
    data_dir.mkdir(parents=True, exist_ok=True)
    dataset_cls(root=str(data_dir), train=True, download=True)


def _read_pickle(path: Path) -> dict[str, Any]:
    # The CIFAR format is a pickle, so loading it executes whatever the file says; only
    # point data-dir at copies of the dataset you trust.
    try:
        with open(path, "rb") as fh:
            obj = pickle.load(fh, encoding="latin1")
    except OSError as err:
        raise DataError(f"cannot read {str(path)!r}: {one_line(err)}") from None
    except Exception as err:  # corrupt pickles raise many different exception types
        raise DataError(
            f"{str(path)!r} is not a readable pickle ({one_line(err)}); the file is corrupt "
            f"or truncated, replace it with a fresh copy"
        ) from None
    if not isinstance(obj, dict):
        raise DataError(f"{str(path)!r} holds a {type(obj).__name__}, expected a dict")
    return {k.decode("latin1") if isinstance(k, bytes) else str(k): v for k, v in obj.items()}


def _require(obj: dict[str, Any], key: str, path: Path) -> Any:
    if key not in obj:
        raise DataError(
            f"{str(path)!r} has no key {key!r} (keys: {', '.join(sorted(obj)) or 'none'})"
        )
    return obj[key]


def _read_cifar_batch(path: Path, spec: _CifarSpec) -> tuple[np.ndarray, np.ndarray]:
    """Read one batch file: ``uint8 [N, 3, 32, 32]`` images and ``int64 [N]`` labels."""
    obj = _read_pickle(path)
    try:
        data = np.asarray(_require(obj, "data", path))
        labels = np.asarray(_require(obj, spec.label_key, path))
    except (ValueError, TypeError) as err:
        raise DataError(f"{str(path)!r}: cannot convert the arrays ({one_line(err)})") from None
    if data.ndim != 2 or data.shape[1] != _CIFAR_ROW or data.shape[0] == 0:
        raise DataError(
            f"{str(path)!r}: 'data' has shape {data.shape}, expected (N, {_CIFAR_ROW}) "
            f"with N > 0"
        )
    if data.dtype != np.uint8:
        if not np.issubdtype(data.dtype, np.integer) or data.min() < 0 or data.max() > 255:
            raise DataError(f"{str(path)!r}: 'data' must hold integers 0..255, got {data.dtype}")
        data = data.astype(np.uint8)
    n = data.shape[0]
    if labels.ndim != 1 or labels.shape[0] != n:
        raise DataError(
            f"{str(path)!r}: {spec.label_key!r} has shape {labels.shape}, expected ({n},) "
            f"to match 'data'"
        )
    if not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{str(path)!r}: {spec.label_key!r} must be integers, got {labels.dtype}")
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= spec.num_classes:
        raise DataError(
            f"{str(path)!r}: {spec.label_key!r} span [{low}, {high}], outside "
            f"[0, {spec.num_classes})"
        )
    # Each row is the R plane, then G, then B, each a row-major 32x32 image.
    images = data.reshape(n, 3, _CIFAR_SIDE, _CIFAR_SIDE)
    return images, labels.astype(np.int64)


def _read_cifar_meta(path: Path, spec: _CifarSpec) -> tuple[str, ...]:
    obj = _read_pickle(path)
    names = _require(obj, spec.names_key, path)
    if not isinstance(names, (list, tuple)) or len(names) != spec.num_classes:
        count = len(names) if isinstance(names, (list, tuple)) else type(names).__name__
        raise DataError(
            f"{str(path)!r}: {spec.names_key!r} must list {spec.num_classes} names, got {count}"
        )
    return tuple(n.decode("latin1") if isinstance(n, bytes) else str(n) for n in names)
