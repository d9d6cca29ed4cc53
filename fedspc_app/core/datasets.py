"""Image datasets held in memory as uint8 tensors ``[N, C, H, W]``.

Batching and augmentation on those tensors are in :mod:`fedspc_app.core.batching`.

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
import hashlib
import logging
import os
import pickle
import warnings
from collections.abc import Sequence
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
from fedspc_app.core.errors import ConfigError, DataError
from fedspc_app.core.files import atomic_open

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
SPLITS: tuple[str, ...] = ("train", "test")



# --------------------------------------------------------------------------------------
# Dataset container
# --------------------------------------------------------------------------------------


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
    return _load_tinyimagenet(Path(data_dir))


def _short(err: BaseException, limit: int = 200) -> str:
    """One-line ``Type: message`` summary of an exception, for user-facing messages."""
    text = str(err).strip().splitlines()
    msg = text[0] if text else ""
    if len(msg) > limit:
        msg = msg[: limit - 3] + "..."
    return f"{type(err).__name__}: {msg}" if msg else type(err).__name__


def _find_folder(data_dir: Path, folder: str, required: Sequence[str]) -> Path | None:
    """Locate ``folder`` under ``data_dir``, or accept ``data_dir`` as that folder."""
    nested = data_dir / folder
    if nested.is_dir():
        return nested
    if data_dir.is_dir() and (
        data_dir.name == folder or all((data_dir / f).exists() for f in required)
    ):
        return data_dir
    return None


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
    folder = _find_folder(data_dir, spec.folder, spec.required)
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
                f"and downloading it with torchvision failed ({_short(err)}). Put the "
                f"{spec.folder!r} folder (unpacked from {spec.url}) under data-dir, or set "
                f"data-dir to the folder that contains it."
            ) from None
        folder = _find_folder(data_dir, spec.folder, spec.required)
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
        raise DataError(f"cannot read {str(path)!r}: {_short(err)}") from None
    except Exception as err:  # corrupt pickles raise many different exception types
        raise DataError(
            f"{str(path)!r} is not a readable pickle ({_short(err)}); the file is corrupt "
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
        raise DataError(f"{str(path)!r}: cannot convert the arrays ({_short(err)})") from None
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


# ---- Tiny ImageNet -------------------------------------------------------------------

_TINY_FOLDER = "tiny-imagenet-200"
_TINY_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
_TINY_SIDE = 64
_TINY_IMAGE_SUFFIXES = (".jpeg", ".jpg")
_TINY_CACHE_VERSION = 1
# Published Tiny ImageNet train statistics (on [0, 1]).
_TINY_MEAN = (0.4802, 0.4481, 0.3975)
_TINY_STD = (0.2770, 0.2691, 0.2821)


def _load_tinyimagenet(data_dir: Path) -> ImageDataset:
    root = _find_folder(data_dir, _TINY_FOLDER, ("wnids.txt", "train", "val"))
    if root is None:
        raise DataError(
            f"Tiny ImageNet not found: the folder {str(data_dir / _TINY_FOLDER)!r} does not "
            f"exist. It is not downloaded automatically: get the official archive "
            f"{_TINY_URL}, unzip it under data-dir (so that data-dir/{_TINY_FOLDER}/wnids.txt "
            f"exists), or set data-dir to the folder that contains {_TINY_FOLDER!r}."
        )
    wnids = _read_wnids(root / "wnids.txt")
    class_names = _read_words(root / "words.txt", wnids)
    train_files, train_labels = _list_tiny_train(root, wnids)
    test_files, test_labels = _list_tiny_val(root, wnids)

    fingerprint = _tiny_fingerprint(root, wnids, train_files, train_labels, test_files, test_labels)
    cache_path = default_cache_dir() / (
        "tinyimagenet-" + hashlib.sha256(str(root).encode()).hexdigest()[:16] + ".npz"
    )
    cached = _read_tiny_cache(cache_path, fingerprint, len(train_files), len(test_files))
    if cached is None:
        train_images = _decode_files(train_files, _TINY_SIDE)
        test_images = _decode_files(test_files, _TINY_SIDE)
        _write_npz_atomic(
            cache_path,
            version=np.array(_TINY_CACHE_VERSION),
            fingerprint=np.array(fingerprint),
            train_images=train_images,
            test_images=test_images,
        )
    else:
        train_images, test_images = cached

    return ImageDataset(
        name="tinyimagenet",
        train_images=torch.from_numpy(train_images),
        train_labels=torch.tensor(train_labels, dtype=torch.int64),
        test_images=torch.from_numpy(test_images),
        test_labels=torch.tensor(test_labels, dtype=torch.int64),
        num_classes=len(wnids),
        class_names=class_names,
        mean=_TINY_MEAN,
        std=_TINY_STD,
        default_augment=True,
    )


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as err:
        raise DataError(f"cannot read {str(path)!r}: {_short(err)}") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{str(path)!r} is not UTF-8 text ({_short(err)})") from None


def _read_wnids(path: Path) -> list[str]:
    """Class ids, sorted alphabetically (the order ImageFolder would use on ``train/``)."""
    wnids = [line.strip() for line in _read_text(path).splitlines() if line.strip()]
    if not wnids:
        raise DataError(f"{str(path)!r} lists no class ids")
    if len(set(wnids)) != len(wnids):
        raise DataError(f"{str(path)!r} lists some class ids more than once")
    return sorted(wnids)


def _read_words(path: Path, wnids: Sequence[str]) -> tuple[str, ...]:
    """First synonym of each wnid from ``words.txt``; the wnid itself if absent."""
    names: dict[str, str] = {}
    if path.is_file():
        wanted = set(wnids)
        for line in _read_text(path).splitlines():
            wnid, _, words = line.partition("\t")
            if wnid in wanted and words.strip():
                names[wnid] = words.split(",")[0].strip()
    return tuple(names.get(w, w) for w in wnids)


def _list_images(folder: Path) -> list[str]:
    try:
        with os.scandir(folder) as it:
            return sorted(
                e.name for e in it if e.name.lower().endswith(_TINY_IMAGE_SUFFIXES) and e.is_file()
            )
    except OSError as err:
        raise DataError(f"cannot list {str(folder)!r}: {_short(err)}") from None


def _list_tiny_train(root: Path, wnids: Sequence[str]) -> tuple[list[Path], list[int]]:
    files: list[Path] = []
    labels: list[int] = []
    for label, wnid in enumerate(wnids):
        folder = root / "train" / wnid / "images"
        if not folder.is_dir():
            raise DataError(f"Tiny ImageNet: missing training folder {str(folder)!r}")
        names = _list_images(folder)
        if not names:
            raise DataError(f"Tiny ImageNet: no JPEG images in {str(folder)!r}")
        files.extend(folder / n for n in names)
        labels.extend([label] * len(names))
    return files, labels


def _list_tiny_val(root: Path, wnids: Sequence[str]) -> tuple[list[Path], list[int]]:
    """Validation images (used as the test split) with labels from ``val_annotations.txt``."""
    ann_path = root / "val" / "val_annotations.txt"
    folder = root / "val" / "images"
    if not ann_path.is_file() or not folder.is_dir():
        raise DataError(
            f"Tiny ImageNet: the validation split needs {str(ann_path)!r} and {str(folder)!r}"
        )
    present = set(_list_images(folder))
    index = {w: i for i, w in enumerate(wnids)}
    by_name: dict[str, int] = {}
    for lineno, line in enumerate(_read_text(ann_path).splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) < 2:
            raise DataError(f"{str(ann_path)!r} line {lineno}: expected 'filename<TAB>wnid...'")
        fname, wnid = parts[0].strip(), parts[1].strip()
        if wnid not in index:
            raise DataError(f"{str(ann_path)!r} line {lineno}: class {wnid!r} is not in wnids.txt")
        if fname not in present:
            raise DataError(
                f"{str(ann_path)!r} line {lineno}: image {str(folder / fname)!r} is missing"
            )
        by_name[fname] = index[wnid]
    if not by_name:
        raise DataError(f"{str(ann_path)!r} annotates no images")
    names = sorted(by_name)
    return [folder / n for n in names], [by_name[n] for n in names]


def _tiny_fingerprint(
    root: Path,
    wnids: Sequence[str],
    train_files: Sequence[Path],
    train_labels: Sequence[int],
    test_files: Sequence[Path],
    test_labels: Sequence[int],
) -> str:
    """Hash of the file listing, so a cache built from a different listing is not reused."""
    h = hashlib.sha256()
    h.update(f"v{_TINY_CACHE_VERSION}\n".encode())
    h.update("\n".join(wnids).encode())
    for files, labels in ((train_files, train_labels), (test_files, test_labels)):
        h.update(b"\0")
        for path, label in zip(files, labels):
            h.update(f"{path.relative_to(root).as_posix()}\t{label}\n".encode())
    return h.hexdigest()


def _decode_image_file(path: Path) -> torch.Tensor:
    """Decode one image file to ``uint8 [3, H, W]`` (greyscale is expanded to RGB)."""
    from torchvision.io import ImageReadMode, decode_image

    return decode_image(str(path), mode=ImageReadMode.RGB)


def _decode_files(paths: Sequence[Path], side: int) -> np.ndarray:
    """Decode ``paths`` into one ``uint8 [N, 3, side, side]`` array.

    A plain loop: torchvision's decoder holds the GIL, so threads gave no speed-up, and
    at roughly 0.1 ms per 64x64 JPEG the one-time decode of Tiny ImageNet takes seconds.
    """
    out = np.empty((len(paths), 3, side, side), dtype=np.uint8)
    with warnings.catch_warnings():
        # torchvision 0.29 deprecates its image codecs (in favour of torchcodec) and
        # warns on every call; the decoders still work and are what this project uses.
        warnings.filterwarnings(
            "ignore", message=".*image decoding and encoding", category=DeprecationWarning
        )
        for i, path in enumerate(paths):
            try:
                image = _decode_image_file(path)
            except Exception as err:  # torchvision raises RuntimeError for bad files
                raise DataError(
                    f"cannot decode image {str(path)!r} ({_short(err)}); the file is corrupt, "
                    f"replace it or re-extract the dataset"
                ) from None
            if tuple(image.shape) != (3, side, side):
                raise DataError(
                    f"image {str(path)!r} is {image.shape[-1]}x{image.shape[-2]}, "
                    f"expected {side}x{side}"
                )
            out[i] = image.numpy()
    return out


def _read_tiny_cache(
    path: Path, fingerprint: str, n_train: int, n_test: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Return cached ``(train_images, test_images)`` if ``path`` is a valid, matching cache."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as npz:
            version = int(npz["version"])
            stored = str(npz["fingerprint"])
            train = npz["train_images"]
            test = npz["test_images"]
    except Exception as err:  # any unreadable cache is simply rebuilt
        logger.warning("ignoring unreadable cache %s (%s); decoding again", path, _short(err))
        return None
    expected = [(train, n_train), (test, n_test)]
    if (
        version != _TINY_CACHE_VERSION
        or stored != fingerprint
        or any(
            a.dtype != np.uint8 or a.shape != (n, 3, _TINY_SIDE, _TINY_SIDE) for a, n in expected
        )
    ):
        logger.info("cache %s does not match the dataset folder; decoding again", path)
        return None
    return np.ascontiguousarray(train), np.ascontiguousarray(test)


def _write_npz_atomic(path: Path, **arrays: np.ndarray) -> None:
    """Write an uncompressed ``.npz`` via a temp file + ``os.replace``; warn on failure."""
    try:
        with atomic_open(path) as handle:
            np.savez(handle, **arrays)
    except OSError as err:
        # A read-only or full cache location must not stop training; the next run
        # simply decodes again.
        logger.warning("could not write cache %s (%s)", path, _short(err))
