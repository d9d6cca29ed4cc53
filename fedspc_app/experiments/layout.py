"""The files of a grid folder, shared by the runner and the report.

``<output-dir>/<grid>/`` holds ``grid.json`` (the expanded grid), ``failures.json``
(cells that failed, with their error and log), ``logs/<run-name>.log``,
``report/`` and one results folder per cell, ``<run-name>/``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

GRID_JSON = "grid.json"
FAILURES_JSON = "failures.json"
LOGS_DIR = "logs"
REPORT_DIR = "report"

RESULT_IRRELEVANT = frozenset({
    "data-dir", "output-dir", "download", "device", "checkpoint", "resume", "round-timeout",
    "keep-client-state", "client-state-dir", "overwrite", "tensorboard", "wandb",
    "wandb-project", "wandb-entity", "wandb-mode", "stop-by"})
"""Run-config keys that may change without invalidating a finished run."""


def slug(text: str) -> str:
    """``text`` as a file-name part: runs of other characters than ``A-Za-z0-9._+=-``
    become ``_``."""
    return re.sub(r"[^A-Za-z0-9._+=-]+", "_", text).strip("_") or "_"


def read_json(path: Path) -> Any:
    """A JSON file's content, or None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_failures(grid_dir: Path) -> dict[str, dict[str, Any]]:
    """``failures.json`` of a grid folder: run-name → error, log and time."""
    failures = read_json(grid_dir / FAILURES_JSON)
    return failures if isinstance(failures, dict) else {}
