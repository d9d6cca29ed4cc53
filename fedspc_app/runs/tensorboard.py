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
come without what would count a round's clients (``results.DP_WITHHELD``), and the
events hold no time: torch's writer stamps its first events with the time and names
its file after the second it opened it (a run's start, from which a grid's private
cells' times follow), so a private run writes through :class:`PrivateEventFile`
(every event at wall time 0, files named by their order). A resumed run opens its
writer with ``purge_step`` = the first round it writes, so that TensorBoard drops what
an interrupted run wrote for that round and later ones; a new run clears the folder.
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


class PrivateEventFile:
    """An event file with no time in it: its events are stamped with wall time 0 and it
    is named ``events.out.tfevents.0000000000.private.<n>``, n its order among the
    folder's event files (TensorBoard reads them in name order). The part of torch's
    ``SummaryWriter`` a run uses (``add_scalar``, ``flush``, ``close``), on
    TensorBoard's own record writer and protos; like the writer, it opens with
    ``purge_step``: TensorBoard then drops what earlier files hold for that round and
    later ones."""

    def __init__(self, log_dir: str, purge_step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.record_writer import RecordWriter

        folder = Path(log_dir)
        folder.mkdir(parents=True, exist_ok=True)
        order = len(list(folder.glob("events.out.tfevents.*")))
        self.path = folder / f"events.out.tfevents.{0:010d}.private.{order:06d}"
        self._event = Event
        self._records = RecordWriter(open(self.path, "wb"))  # noqa: SIM115 (closed in close)
        self._write(Event(wall_time=0.0, step=purge_step, file_version="brain.Event:2"))
        self._write(Event(wall_time=0.0, step=purge_step,
                          session_log=SessionLog(status=SessionLog.START)))
        self.flush()

    def _write(self, event: Any) -> None:
        self._records.write(event.SerializeToString())

    def add_scalar(self, name: str, value: float, global_step: int,
                   walltime: float | None = None) -> None:
        from torch.utils.tensorboard.summary import scalar

        self._write(self._event(wall_time=0.0, step=global_step,
                                summary=scalar(name, value)))

    def flush(self) -> None:
        self._records.flush()

    def close(self) -> None:
        if not self._records.closed:
            self._records.close()


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
        writer = PrivateEventFile if config.dp else summary_writer_class()
        self.writer = writer(log_dir=str(folder), purge_step=first)
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
