"""Tiny-ImageNet-200 as an :class:`~fedspc_app.data.datasets.ImageDataset`.

The official zip's layout (``tiny-imagenet-200/``: ``wnids.txt``, ``words.txt``,
``train/<wnid>/images/*.JPEG``, ``val/images`` with ``val_annotations.txt``), decoded
with torchvision once and kept as an uncompressed ``.npz`` cache keyed by the files'
names, sizes and times (:func:`fedspc_app.core.config.default_cache_dir`). The
official test split has no labels, so the validation split is the test split.
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fedspc_app.core.config import default_cache_dir
from fedspc_app.core.errors import DataError, one_line
from fedspc_app.core.files import atomic_open, find_folder
from fedspc_app.data.imagedata import ImageDataset

logger = logging.getLogger(__name__)

_TINY_FOLDER = "tiny-imagenet-200"
_TINY_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
_TINY_SIDE = 64
_TINY_IMAGE_SUFFIXES = (".jpeg", ".jpg")
_TINY_CACHE_VERSION = 2
# Published Tiny ImageNet train statistics (on [0, 1]).
_TINY_MEAN = (0.4802, 0.4481, 0.3975)
_TINY_STD = (0.2770, 0.2691, 0.2821)


def load_tinyimagenet(data_dir: Path) -> ImageDataset:
    root = find_folder(data_dir, _TINY_FOLDER, ("wnids.txt", "train", "val"))
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
        raise DataError(f"cannot read {str(path)!r}: {one_line(err)}") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{str(path)!r} is not UTF-8 text ({one_line(err)})") from None


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
        raise DataError(f"cannot list {str(folder)!r}: {one_line(err)}") from None


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
        if by_name.get(fname, index[wnid]) != index[wnid]:
            raise DataError(
                f"{str(ann_path)!r} line {lineno}: image {fname!r} is annotated again with "
                f"another class, {wnid!r} (it was {wnids[by_name[fname]]!r})"
            )
        by_name[fname] = index[wnid]
    if not by_name:
        raise DataError(f"{str(ann_path)!r} annotates no images")
    unlisted = sorted(present - set(by_name))
    if unlisted:
        raise DataError(
            f"{str(ann_path)!r} does not annotate {len(unlisted)} of the images in "
            f"{str(folder)!r} (first: {unlisted[0]!r}); is it complete?"
        )
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
    """Hash of the file listing with each file's size and modification time, so a cache
    built from a different listing, or from files since replaced, is not reused."""
    h = hashlib.sha256()
    h.update(f"v{_TINY_CACHE_VERSION}\n".encode())
    h.update("\n".join(wnids).encode())
    for files, labels in ((train_files, train_labels), (test_files, test_labels)):
        h.update(b"\0")
        for path, label in zip(files, labels):
            stat = path.stat()
            h.update(f"{path.relative_to(root).as_posix()}\t{label}\t{stat.st_size}\t"
                     f"{stat.st_mtime_ns}\n".encode())
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
                    f"cannot decode image {str(path)!r} ({one_line(err)}); the file is corrupt, "
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
        logger.warning("ignoring unreadable cache %s (%s); decoding again", path, one_line(err))
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
        logger.warning("could not write cache %s (%s)", path, one_line(err))
