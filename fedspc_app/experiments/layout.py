"""The files of a grid folder, shared by the runner and the report.

``<output-dir>/<grid>/`` holds ``grid.json`` (the expanded grid), ``failures.json``
(cells that failed, with their error and log), ``logs/<run-name>.log``,
``report/`` and one results folder per cell, ``<run-name>/``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedspc_app.core.config import resolved_settings
from fedspc_app.runs.checkpoint import FORMER_DEFAULTS

GRID_JSON = "grid.json"
FAILURES_JSON = "failures.json"
LOGS_DIR = "logs"
REPORT_DIR = "report"

RESULT_IRRELEVANT = frozenset({
    "data-dir", "output-dir", "download", "device", "checkpoint", "resume", "round-timeout",
    "keep-client-state", "client-state-dir", "overwrite", "tensorboard", "wandb",
    "wandb-project", "wandb-entity", "wandb-mode", "stop-by"})
"""Run-config keys that may change without invalidating a finished run."""


def result_changes(run_config: Mapping[str, Any], recorded: Any, *,
                   centralized: Mapping[str, Any] | None = None,
                   clients: int | None = None) -> list[str]:
    """The settings that differ between a grid cell (``run_config``) and the run in
    its folder (``recorded``: its ``config.json``): run-config keys but for
    :data:`RESULT_IRRELEVANT`; a reference's ``centralized`` options (epochs,
    lr-schedule, ...); and, given the grid's simulated ``clients``, a federated
    run's K as resolved (``num-clients``, else ``clients``). [] without a recorded
    run-config. The runner notes such a finished run, and the report does not count
    it as the cell's result."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("run-config"), dict):
        return []
    # A key the run did not record had the value it had then (as for a checkpoint).
    old = resolved_settings({**FORMER_DEFAULTS, **recorded["run-config"]})
    changes = {key for key, value in resolved_settings(run_config).items()
               if key not in RESULT_IRRELEVANT and key in old and old[key] != value}
    options = recorded.get("centralized")
    if centralized and isinstance(options, dict):
        changes |= {key for key, value in centralized.items()
                    if key in options and options[key] != value}
    k = recorded.get("num-clients")
    if clients is not None and isinstance(k, int):  # the K the run had, resolved
        changes.discard("num-clients")
        if k != (run_config.get("num-clients") or clients):
            changes.add("num-clients")
    return sorted(changes)


def slug(text: str) -> str:
    """``text`` as a file-name part: runs of other characters than word characters
    (letters of any script, digits, ``_``) and ``.+=-`` become ``_``. Unicode letters
    stay, so that ``ρ = 0.5`` and ``σ = 0.5`` get distinct names; an ASCII name's
    slug is the same as when only ``A-Za-z0-9._+=-`` stayed (committed folders)."""
    return re.sub(r"[^\w.+=-]+", "_", text).strip("_") or "_"


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
