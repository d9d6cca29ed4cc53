"""A run's per-round metrics as TensorBoard scalars (run-config ``tensorboard = true``).

:class:`RunRecorder <fedspc_app.runs.results.RunRecorder>` hands every round row it
records (the numbers of ``metrics.json`` / ``metrics.csv``) to a :class:`RoundScalars`,
which writes them under ``<run folder>/tensorboard/`` with the round as the step and
flushes after each round, so that ``tensorboard --logdir results/`` follows a run live.

Tags: ``<group>/<column>`` for a row's scalar columns, ``<column>/<partition id>`` for
its per-client ones (each its own TensorBoard section, one chart per client):

* ``accuracy/``: ``accuracy``, ``weighted-accuracy``, ``global-accuracy``,
  ``accuracy-before-aggregation``, ``server-accuracy``, ``held-out-accuracy``,
  ``held-out-weighted-accuracy``;
* ``loss/``: ``loss``, ``train-loss``, ``server-loss``, ``held-out-loss``;
* ``drift/``: the drift diagnostics of the shared block and ``global-reference-norm``;
* ``traffic/``: ``bytes-sent``, ``bytes-received``;
* ``clients/``: how many clients trained, evaluated, failed or were dropped, and the
  images trained on;
* ``time/``: every ``*-seconds`` column (round, elapsed, phase timings, checkpoint)
  and ``images-per-second``;
* ``privacy/``: ``dp-epsilon`` (differential privacy's account), and under adaptive
  clipping ``dp-clipping-norm`` and ``dp-unclipped-fraction``;
* ``schedule/``: ``learning-rate`` (the clients' η of the round, with ``lr-schedule``);
* ``other/``: any further numeric column;
* ``client-accuracy/<k>``, ``client-global-accuracy/<k>``, ``client-held-out-accuracy/<k>``,
  ``client-accuracy-before-aggregation/<k>``, ``client-update-norms/<k>``,
  ``client-update-cosines/<k>``.

Missing, None and non-finite values are left out. Under differential privacy the rows
come without what would count a round's clients (``results.DP_WITHHELD``), and every
event is stamped with wall time 0 rather than when it was written (the time between
two rounds' events would be the round's time). A resumed run opens its writer with
``purge_step`` = the first round it writes, so that TensorBoard drops what an
interrupted run wrote for that round and later ones; a new run clears the folder.
"""

from __future__ import annotations

import math
import numbers
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from fedspc_app.core.config import RunConfig
from fedspc_app.core.errors import ConfigError, one_line

FOLDER = "tensorboard"
# The project is installed from its checkout (a "fedspc" on PyPI would not be it).
INSTALL_HINT = ('pip install -e ".[tensorboard]" in the project\'s folder, where the '
                'ServerApp runs (or pip install "tensorboard>=2.16")')
GROUPS = {
    "accuracy": ("accuracy", "weighted-accuracy", "global-accuracy",
                 "accuracy-before-aggregation", "server-accuracy", "held-out-accuracy",
                 "held-out-weighted-accuracy"),
    "loss": ("loss", "train-loss", "server-loss", "held-out-loss"),
    "drift": ("update-norm", "client-update-norm", "drift-dispersion", "update-cosine",
              "global-reference-norm"),
    "traffic": ("bytes-sent", "bytes-received"),
    "clients": ("clients", "train-clients", "train-images", "min-rounds-trained", "failed",
                "train-dropped", "evaluate-dropped"),
    "time": ("images-per-second",),
    "privacy": ("dp-epsilon", "dp-clipping-norm", "dp-unclipped-fraction"),
    "schedule": ("learning-rate",),
}
_GROUP_OF = {column: group for group, columns in GROUPS.items() for column in columns}


def summary_writer_class() -> type:
    """torch's ``SummaryWriter``.

    Raises
    ------
    ConfigError
        The ``tensorboard`` package (which torch's writer needs) is not installed.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ConfigError(
            f"tensorboard = true needs the tensorboard package: {INSTALL_HINT}; or set "
            f"tensorboard = false ({one_line(error)})") from None
    return SummaryWriter


def check_tensorboard(config: RunConfig) -> None:
    """Raise :class:`ConfigError` before round 1 when ``config`` asks for TensorBoard
    scalars and the package is missing."""
    if config.tensorboard:
        summary_writer_class()


def tag(column: str) -> str:
    """The TensorBoard tag of a round row's scalar ``column``."""
    if column in _GROUP_OF:
        return f"{_GROUP_OF[column]}/{column}"
    return f"time/{column}" if column.endswith("-seconds") else f"other/{column}"


def _number(value: Any) -> float | None:
    """``value`` as a finite float; ``None`` for anything else (None, NaN, text)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def round_scalars(row: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """``(tag, value)`` for every number of a round row, except the round itself."""
    for column, value in row.items():
        if column == "round":
            continue
        if isinstance(value, Mapping):  # per client, keyed by partition id
            for client, client_value in value.items():
                number = _number(client_value)
                if number is not None:
                    yield f"{column}/{client}", number
        elif (number := _number(value)) is not None:
            yield tag(column), number


class RoundScalars:
    """The TensorBoard writer of one run: writes nothing until :meth:`open` finds
    ``tensorboard = true`` in the run-config."""

    def __init__(self) -> None:
        self.writer: Any = None
        self.walltime: float | None = None  # each event's wall time (None: now)

    def open(self, config: RunConfig, run_dir: Path,
             rounds: Iterable[Mapping[str, Any]] = ()) -> None:
        """Start writing ``<run_dir>/tensorboard/`` when ``config.tensorboard``.

        ``rounds``: those a resumed run takes over from its checkpoint. Events an
        earlier run wrote for a later round are purged; when the folder holds no
        events yet (TensorBoard was off before), the taken-over rounds are written.
        """
        self.close()
        if not config.tensorboard:
            return
        rounds = list(rounds)
        self.walltime = 0.0 if config.dp else None
        folder = Path(run_dir) / FOLDER
        if not rounds:  # a new run: an earlier run's events are not its own
            shutil.rmtree(folder, ignore_errors=True)
        backfill = not any(folder.glob("events.out.tfevents.*"))
        first = int(rounds[-1]["round"]) + 1 if rounds else 1
        self.writer = summary_writer_class()(log_dir=str(folder), purge_step=first)
        if backfill:
            for row in rounds:
                self.write(row)

    def write(self, row: Mapping[str, Any]) -> None:
        """Write one round row (step = its ``round``) and flush it to disk."""
        if self.writer is None:
            return
        step = int(row["round"])
        for name, value in round_scalars(row):
            self.writer.add_scalar(name, value, global_step=step, walltime=self.walltime)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
