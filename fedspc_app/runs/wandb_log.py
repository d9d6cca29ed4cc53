"""A run's rounds in Weights & Biases (run-config ``wandb = true``; the ``[wandb]``
extra).

The same numbers as TensorBoard's, under the same tags (:func:`round_scalars`: the
columns of metrics.csv grouped as ``accuracy/…``, ``loss/…``, …, and the per-client
ones as ``<column>/<partition id>``) with the round as the step; the resolved run-config
as the W&B config; summary.json as the run's summary. ``wandb-mode`` defaults to
``offline``: nothing needs a login or the network, and ``wandb sync <run
folder>/wandb/offline-run-*`` uploads it later. The W&B run's id is kept in the run
folder (``wandb-run.json``), so a resumed run continues the same W&B run.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fedspc_app.core.config import RunConfig
from fedspc_app.core.errors import ConfigError, one_line
from fedspc_app.core.files import atomic_write
from fedspc_app.runs.tensorboard import round_scalars

ID_FILE = "wandb-run.json"
INSTALL_HINT = ('pip install -e ".[wandb]" in the project\'s folder, where the ServerApp '
                'runs (or pip install wandb)')


def wandb_module() -> Any:
    """The ``wandb`` package; ConfigError when it is not installed."""
    try:
        import wandb
    except ImportError as error:
        raise ConfigError(f"wandb = true needs the wandb package: {INSTALL_HINT}; or set "
                          f"wandb = false ({one_line(error)})") from None
    return wandb


def check_wandb(config: RunConfig) -> None:
    """Raise :class:`ConfigError` before round 1 when ``config`` asks for W&B and the
    package is missing."""
    if config.wandb:
        wandb_module()


class WandbLog:
    """The W&B run of one run: does nothing until :meth:`open` finds ``wandb = true``."""

    def __init__(self) -> None:
        self.run: Any = None

    def open(self, config: RunConfig, run_dir: Path, settings: Mapping[str, Any],
             rounds: Iterable[Mapping[str, Any]] = ()) -> None:
        """Start (or, for a resumed run, continue) the W&B run of ``run_dir``;
        ``settings``: what config.json records. A W&B run that did not see the rounds a
        resumed run takes over (W&B was off before) gets them now."""
        self.close()
        if not config.wandb:
            return
        wandb = wandb_module()
        rounds = list(rounds)
        id_file = Path(run_dir) / ID_FILE
        known = _read_id(id_file) if rounds else None
        run_id = known or secrets.token_hex(8)
        if not known:
            atomic_write(id_file, json.dumps({"id": run_id}))
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            project=config.wandb_project, entity=config.wandb_entity or None,
            mode=config.wandb_mode, dir=str(run_dir), id=run_id, resume="allow",
            name=config.resolved_run_name, config=dict(settings),
            settings=wandb.Settings(console="off", x_disable_stats=True))
        if not known:
            for row in rounds:
                self.write(row)

    def write(self, row: Mapping[str, Any]) -> None:
        """Log one round row at step = its round."""
        if self.run is not None:
            # commit: the round's row is complete, so it goes to W&B now rather than
            # waiting for the next step or for finish() to write it.
            self.run.log(dict(round_scalars(row)), step=int(row["round"]), commit=True)

    def finish(self, summary: Mapping[str, Any]) -> None:
        """Set the run's summary (summary.json) and close it."""
        if self.run is not None:
            self.run.summary.update({k: v for k, v in summary.items()
                                     if isinstance(v, (int, float, str, bool))})
        self.close()

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
            # finish() can return before W&B's service process has written the last
            # records to the offline run file; shutting the service down waits for it,
            # so the files are complete when the run ends (the next init starts one).
            wandb_module().teardown()


def _read_id(path: Path) -> str | None:
    try:
        value = json.loads(path.read_text()).get("id")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None
