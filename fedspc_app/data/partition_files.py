"""A partition's files in a run folder: ``partition.json`` (the dict form of
:meth:`fedspc_app.data.partition.Partition.to_dict`) and ``partition.csv`` (per-client
class counts), and reading the counts back for the reports and plots."""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedspc_app.core.errors import DataError
from fedspc_app.core.files import atomic_write
from fedspc_app.data.partition import Partition

PARTITION_JSON = "partition.json"
PARTITION_CSV = "partition.csv"


def save_partition(partition: Partition | Mapping[str, Any],
                   directory: str | os.PathLike[str]) -> None:
    """Write ``partition.json`` and ``partition.csv`` into ``directory``.

    Parameters
    ----------
    partition : Partition or dict
        A partition from :func:`make_partition`, or its :meth:`Partition.to_dict`
        form (e.g. counts reported by deployed clients).
    directory : path-like
        Created if missing. ``partition.json`` holds the dict form;
        ``partition.csv`` has columns ``client, split, class_0, ...`` with a
        ``train`` and a ``test`` row per client. Both are written atomically.
    """
    data = partition.to_dict() if isinstance(partition, Partition) else dict(partition)
    directory = Path(directory)
    atomic_write(directory / PARTITION_JSON, json.dumps(data, indent=1) + "\n")

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["client", "split", *(f"class_{c}" for c in range(data["num_classes"]))])
    for k in range(data["num_clients"]):
        writer.writerow([k, "train", *np.asarray(data["train_counts"][k]).tolist()])
        writer.writerow([k, "test", *np.asarray(data["test_counts"][k]).tolist()])
    atomic_write(directory / PARTITION_CSV, buffer.getvalue())


def load_partition_counts(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read back what :func:`save_partition` wrote to ``partition.json``.

    Parameters
    ----------
    path : path-like
        The ``partition.json`` file, or the folder holding it.

    Returns
    -------
    dict
        The JSON object, with ``train_counts`` and ``test_counts`` converted to
        ``int64`` arrays ``[num_clients, num_classes]``.

    Raises
    ------
    DataError
        If the file is missing, not JSON, or lacks the expected counts.
    """
    path = Path(path)
    if path.is_dir():
        path = path / PARTITION_JSON
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise DataError(f"No partition file at {path}") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"Cannot read partition file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise DataError(f"{path} does not hold a JSON object")
    for key in ("num_clients", "num_classes", "train_counts", "test_counts"):
        if key not in data:
            raise DataError(f"{path} lacks the key {key!r}")
    shape = (data["num_clients"], data["num_classes"])
    for key in ("train_counts", "test_counts"):
        try:
            counts = np.asarray(data[key], dtype=np.int64)
        except (TypeError, ValueError) as exc:
            raise DataError(f"{path}: {key} is not a table of integers") from exc
        if counts.shape != shape:
            raise DataError(f"{path}: {key} has shape {counts.shape}, expected {shape}")
        data[key] = counts
    return data
