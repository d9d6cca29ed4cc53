"""Per-round progress output and the results written to ``<output-dir>/<run-name>/``.

Files (each rewritten atomically after every round, so an interrupted run keeps
what it finished):

* ``config.json``: the resolved run-config, its paths in a form that holds on any
  machine (:func:`portable_run_config`).
* ``partition.json`` / ``partition.csv``: train and test images per client × class.
* ``metrics.json``: one entry per round (personalized accuracy = mean over
  clients, sample-weighted accuracy, loss, per-client accuracies, train loss,
  bytes sent/received, wall time) plus, once finished, the summary.
* ``metrics.csv``: the scalar columns of metrics.json.
* ``summary.json``: final- and best-round values and total wall time; written
  last, with ``"complete": true``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flwr.app import Message, MetricRecord
from flwr.serverapp import Grid

from fedspc_app.core.config import RunConfig
from fedspc_app.core.files import atomic_write
from fedspc_app.runs.pause import STOP_BY
from fedspc_app.runs.tensorboard import RoundScalars
from fedspc_app.runs.wandb_log import WandbLog

# Where a round's time went (README: Speed): each phase's wall time, the sums over
# its clients of their setup and work seconds, and in a phase that met new ClientApp
# processes how long they took to come up (``<phase>-<field>`` from the phase's
# aggregate metric ``<key>``).
TIMINGS = {"seconds": "phase-seconds", "client-setup-seconds": "client-setup-seconds",
           "client-work-seconds": "client-work-seconds",
           "worker-start-seconds": "worker-start-seconds",
           "worker-ready-seconds": "worker-ready-seconds",
           "worker-import-seconds": "worker-import-seconds",
           "worker-imported-seconds": "worker-imported-seconds"}
TIMING_COLUMNS = tuple(f"{phase}-{field}" for phase in ("train", "evaluate")
                       for field in TIMINGS)
# The drift diagnostics of a round's training replies (strategies/drift.py): scalars,
# and per client (keyed by partition id in metrics.json).
DRIFT_COLUMNS = ("update-norm", "client-update-norm", "drift-dispersion", "update-cosine")
DRIFT_PER_CLIENT = ("client-update-norms", "client-update-cosines")
# Seconds the server took to write a round's checkpoint after its aggregation.
CHECKPOINT_SECONDS = "checkpoint-seconds"
# evaluate-server: the server's model on the whole test set (fedspc_app/server/evaluation.py).
SERVER_COLUMNS = ("server-accuracy", "server-loss", "server-evaluate-seconds")
# held-out-clients: the clients that never trained, tested after their fine-tuning
# (strategies/personalized.py): their mean accuracy, weighted accuracy and loss.
HELD_OUT_COLUMNS = ("held-out-accuracy", "held-out-weighted-accuracy", "held-out-loss")
# Adaptive clipping under differential privacy (strategies/dp_release.py): the round's
# clipping norm C_t and the noised fraction of updates within it (both releases).
ADAPTIVE_CLIPPING_COLUMNS = ("dp-clipping-norm", "dp-unclipped-fraction")
# Under differential privacy a round's published row (metrics.json, metrics.csv, the
# progress line, TensorBoard, W&B) leaves these out (docs/privacy.md, threat model):
# every message carries the shared block, so a round's bytes divided by a message's
# size count the clients it drew and that replied; and the wall time of a round and of
# its phases grows with the clients in them. The mean train loss and accuracy before
# aggregation are means over the drawn clients (with colluders' own values they tell
# whether another was in them) and are missing in a round that drew nobody. The
# checkpoint, the server's own, keeps the full rows (a resumed run needs their times).
DP_WITHHELD = frozenset(("bytes-sent", "bytes-received", "round-seconds",
                         "elapsed-seconds", "images-per-second", *TIMING_COLUMNS,
                         "train-loss", "accuracy-before-aggregation"))
CONFIG_JSON, METRICS_JSON, METRICS_CSV, SUMMARY_JSON = (
    "config.json", "metrics.json", "metrics.csv", "summary.json")
SCALAR_COLUMNS = (
    "round", "accuracy", "weighted-accuracy", "loss", "train-loss", "clients",
    "train-clients", "bytes-sent", "bytes-received", "train-images", "images-per-second",
    "round-seconds", "elapsed-seconds", "failed", "train-dropped", "evaluate-dropped",
    *DRIFT_COLUMNS, "global-reference-norm", "accuracy-before-aggregation", "global-accuracy",
    *HELD_OUT_COLUMNS, *SERVER_COLUMNS, "learning-rate", *TIMING_COLUMNS,
    CHECKPOINT_SECONDS, "dp-epsilon", *ADAPTIVE_CLIPPING_COLUMNS,
)


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _clean(value: Any) -> Any:
    """NaN/inf become None so the JSON stays standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def relative_path(path: str | os.PathLike[str], folder: Path) -> str:
    """``path`` (a relative one: against the working directory) relative to ``folder``,
    with POSIX separators; only its last component when the two share no folder below
    the filesystem's root (the way up and down would spell this machine's layout)."""
    path, folder = Path(path).expanduser().resolve(), Path(folder).resolve()
    try:
        common = Path(os.path.commonpath([path, folder]))
    except ValueError:  # another drive (Windows)
        return path.name
    if common == Path(common.anchor):
        return path.name
    return Path(os.path.relpath(path, folder)).as_posix()


def portable_run_config(run_config: Mapping[str, Any], folder: Path) -> dict[str, Any]:
    """The run-config as a results file records it: no absolute path of this machine.

    Results folders are read elsewhere (``docs/results/`` is committed), where this
    machine's paths mean nothing. Both path keys only say where things live on the
    machine that ran (checkpoint ``MAY_CHANGE``; the grid runner ignores them too),
    and nothing reads them back from a results file to find a file, so:

    * ``output-dir`` is relative to ``folder``, the folder of the file that records it:
      ``..`` in a run's ``config.json`` (the run folder is ``<output-dir>/<run-name>``),
      ``.`` in a grid's ``grid.json`` (its cells' output-dir is the grid folder).
    * ``data-dir`` is kept when empty (the default folder) or relative (as given); an
      absolute one becomes ``""``: the dataset is ``dataset``, and its files come from
      the default data folder of the machine that reads it, or any ``data-dir``
      given there.
    * ``client-state-dir``, when set, is relative to ``folder`` as ``output-dir`` is
      (``../state``; only its last component where the two share no folder below the
      root): export looks for a simulation's client state there, against the run folder.
    """
    out = dict(run_config)
    for key in ("output-dir", "client-state-dir"):
        if out.get(key):
            out[key] = relative_path(str(out[key]), folder)
    if out.get("data-dir") and os.path.isabs(str(out["data-dir"])):
        out["data-dir"] = ""
    return out


def start_results(run_dir: Path, config: Mapping[str, Any]) -> None:
    """Create ``run_dir``, remove a previous run's metrics and summary, write
    ``config.json`` (its ``run-config`` made :func:`portable_run_config`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (METRICS_JSON, METRICS_CSV, SUMMARY_JSON):
        (run_dir / stale).unlink(missing_ok=True)
    config = dict(config)
    if isinstance(config.get("run-config"), Mapping):
        config["run-config"] = portable_run_config(config["run-config"], run_dir)
    atomic_write(run_dir / CONFIG_JSON, json.dumps(config, indent=2, default=_json_default))


def write_metrics(run_dir: Path, payload: Mapping[str, Any], rows: Iterable[Mapping[str, Any]],
                  columns: Sequence[str], *, lineterminator: str = "\r\n") -> None:
    """``metrics.json`` (``payload``) and ``metrics.csv`` (the ``columns`` of ``rows``;
    a missing or None value is empty)."""
    atomic_write(run_dir / METRICS_JSON, json.dumps(payload, indent=2, default=_json_default))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore",
                            lineterminator=lineterminator)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(run_dir / METRICS_CSV, buffer.getvalue())


def read_json_file(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or ``None`` when it is missing, unreadable or not
    an object."""
    try:
        payload = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return payload if isinstance(payload, dict) else None


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """A run folder's ``summary.json``, or ``None`` when it is missing or unreadable."""
    return read_json_file(Path(run_dir) / SUMMARY_JSON)


def write_summary(run_dir: Path, summary: Mapping[str, Any]) -> None:
    atomic_write(run_dir / SUMMARY_JSON, json.dumps(summary, indent=2))


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class TrafficGrid(Grid):
    """A Grid that counts the bytes of the records it sends and receives.

    Wraps the Grid handed to the ServerApp; every other call is delegated.
    """

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.sent = 0
        self.received = 0

    @staticmethod
    def message_bytes(message: Message) -> int:
        if not message.has_content():
            return 0
        return sum(record.count_bytes() for record in message.content.values())

    def take(self) -> tuple[int, int]:
        """Bytes sent and received since the last call."""
        out = (self.sent, self.received)
        self.sent = self.received = 0
        return out

    def set_run(self, run) -> None:
        self.grid.set_run(run)

    @property
    def run(self):
        return self.grid.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self):
        return self.grid.get_node_ids()

    def push_messages(self, messages):
        messages = list(messages)
        self.sent += sum(self.message_bytes(m) for m in messages)
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids):
        replies = list(self.grid.pull_messages(message_ids))
        self.received += sum(self.message_bytes(m) for m in replies)
        return replies

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.sent += sum(self.message_bytes(m) for m in messages)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        self.received += sum(self.message_bytes(m) for m in replies)
        return replies


class RunRecorder:
    """Prints one line per round and keeps the results folder up to date.

    Parameters
    ----------
    config : RunConfig
        The run's config (its ``run_dir`` is where results go).
    traffic : TrafficGrid | None
        Source of the bytes sent/received per round.
    echo : callable
        Where progress lines go (default: print).
    """

    def __init__(self, config: RunConfig, *, traffic: TrafficGrid | None = None,
                 echo: Callable[[str], None] = print) -> None:
        self.config = config
        self.run_dir = config.run_dir
        self.traffic = traffic
        self.echo = echo
        self.rounds: list[dict[str, Any]] = []
        self.started = time.perf_counter()
        self.last = self.started
        self.scalars = RoundScalars()  # TensorBoard (run-config 'tensorboard')
        self.wandb = WandbLog()  # Weights & Biases (run-config 'wandb')
        # The rounds this run trains: num-rounds, or fewer when a privacy budget
        # (dp-target-epsilon) allows fewer (then ``stopped_by`` says so).
        self.num_rounds = config.num_rounds
        self.stopped_by: str | None = None
        # Differential privacy: epsilon after a given number of rounds.
        self.dp_epsilon: Callable[[int], float] | None = None

    # ------------------------------------------------------------------ files
    def start(self, extra: Mapping[str, Any] | None = None, *,
              rounds: list[dict[str, Any]] | None = None, elapsed: float = 0.0) -> None:
        """Create the run folder and write the resolved config (after validation).

        A resumed run passes the rounds and the wall time of its checkpoint.
        """
        settings = {"run-config": self.config.to_dict(), **(extra or {})}
        start_results(self.run_dir, settings)
        self.rounds = [dict(row) for row in rounds or []]
        now = time.perf_counter()
        self.started = now - elapsed
        # A checkpoint written after a round's aggregation holds time that round
        # already spent training: it counts towards the round (and its images/s).
        last_end = float(self.rounds[-1]["elapsed-seconds"]) if self.rounds else 0.0
        self.last = min(now, self.started + last_end)
        shown = [self.published(row) for row in self.rounds]
        self.scalars.open(self.config, self.run_dir, shown)
        self.wandb.open(self.config, self.run_dir, settings, shown)
        if self.rounds:
            self._write_metrics()
            self.echo(f"Results: {self.run_dir} (resumed after round "
                      f"{self.rounds[-1]['round']})")
        else:
            self.echo(f"Results: {self.run_dir}")

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def published(self, row: Mapping[str, Any]) -> Mapping[str, Any]:
        """``row`` as the results folder shows it: without :data:`DP_WITHHELD` under
        differential privacy, as it is otherwise."""
        if not self.config.dp:
            return row
        return {key: value for key, value in row.items() if key not in DP_WITHHELD}

    def _write_metrics(self, summary: Mapping[str, Any] | None = None) -> None:
        rows = [self.published(row) for row in self.rounds]
        payload = {"run-name": self.config.resolved_run_name, "rounds": rows}
        if summary is not None:
            payload["summary"] = summary
        columns = (SCALAR_COLUMNS if not self.config.dp else
                   tuple(c for c in SCALAR_COLUMNS if c not in DP_WITHHELD))
        write_metrics(self.run_dir, _clean_tree(payload), rows, columns)

    # ---------------------------------------------------------------- rounds
    def on_round_end(self, server_round: int, train: MetricRecord | None,
                     evaluate: MetricRecord | None, report: Any = None) -> None:
        """Record one round (``report``: a :class:`strategies.RoundReport`)."""
        now = time.perf_counter()
        sent, received = self.traffic.take() if self.traffic else (0, 0)
        seconds = now - self.last
        row: dict[str, Any] = {
            "round": server_round,
            "round-seconds": round(seconds, 3),
            "elapsed-seconds": round(now - self.started, 3),
            "bytes-sent": sent,
            "bytes-received": received,
        }
        self.last = now
        if report is not None and report.server_round == server_round:
            row["failed"] = int(report.failed)
            if not getattr(report, "private", False):  # DP: the counts are withheld
                row["train-dropped"] = report.dropped
            row["evaluate-dropped"] = report.evaluate_dropped
            if report.reasons:
                row["dropped-reasons"] = list(report.reasons)
        if self.dp_epsilon is not None:  # every round counts, a failed one too
            row["dp-epsilon"] = _clean(self.dp_epsilon(server_round))
        if train is not None:
            row["train-loss"] = _clean(float(train.get("train-loss", float("nan"))))
            if "clients" in train:  # (not under differential privacy)
                row["train-clients"] = int(train["clients"])
            if "examples-seen" in train:  # (not under differential privacy)
                row["train-images"] = int(train["examples-seen"])
                row["min-rounds-trained"] = int(train.get("min-rounds-trained", 0))
                row["images-per-second"] = round(row["train-images"] / max(seconds, 1e-9), 1)
            row.update(_timings("train", train))
            for key in DRIFT_COLUMNS:
                if key in train:
                    row[key] = _clean(float(train[key]))
            if "accuracy-before-aggregation" in train:
                row["accuracy-before-aggregation"] = _clean(
                    float(train["accuracy-before-aggregation"]))
            ids = [str(i) for i in train.get("train-client-ids", [])]
            for key in (*DRIFT_PER_CLIENT, "client-accuracy-before-aggregation"):
                if key in train and ids:
                    row[key] = {i: _clean(float(v)) for i, v in zip(ids, train[key])}
            if "learning-rate" in train:  # lr-schedule: the round's η
                row["learning-rate"] = float(train["learning-rate"])
            if CHECKPOINT_SECONDS in train:
                row[CHECKPOINT_SECONDS] = round(float(train[CHECKPOINT_SECONDS]), 4)
            if "global-reference-norm" in train:
                row["global-reference-norm"] = float(train["global-reference-norm"])
            for key in ADAPTIVE_CLIPPING_COLUMNS:
                if key in train:
                    row[key] = float(train[key])
            if "aggregated-client-ids" in train:  # a robust rule's choice (Krum)
                row["aggregated-client-ids"] = [int(i) for i in
                                                train["aggregated-client-ids"]]
        if evaluate is not None:
            for key in ("accuracy", "weighted-accuracy", "loss"):
                row[key] = _clean(float(evaluate[key]))
            row["clients"] = int(evaluate["clients"])
            for key in SERVER_COLUMNS:
                if key in evaluate:
                    row[key] = _clean(float(evaluate[key]))
            row.update(_timings("evaluate", evaluate))
            if "client-accuracy" in evaluate:  # (not under differential privacy)
                row["client-accuracy"] = {
                    str(pid): acc for pid, acc in zip(evaluate["client-ids"],
                                                      evaluate["client-accuracy"])
                }
            if "global-accuracy" in evaluate:
                row["global-accuracy"] = _clean(float(evaluate["global-accuracy"]))
            if "client-global-accuracy" in evaluate:
                row["client-global-accuracy"] = {
                    str(pid): _clean(float(acc)) for pid, acc in
                    zip(evaluate["client-ids"], evaluate["client-global-accuracy"])}
            if "held-out-accuracy" in evaluate:
                for key in HELD_OUT_COLUMNS:
                    row[key] = _clean(float(evaluate[key]))
                row["client-held-out-accuracy"] = {
                    str(pid): _clean(float(acc)) for pid, acc in
                    zip(evaluate["held-out-client-ids"], evaluate["held-out-client-accuracy"])}
        self.rounds.append(row)
        self._write_metrics()
        shown = self.published(row)
        self.scalars.write(shown)
        self.wandb.write(shown)
        self.echo(self.progress_line(shown))

    def progress_line(self, row: Mapping[str, Any]) -> str:
        """The round's line; its traffic, time and ETA only where ``row`` has them
        (not under differential privacy)."""
        total = self.num_rounds
        done = row["round"]
        acc = row.get("accuracy")
        acc_text = "n/a" if acc is None else f"{100 * acc:6.2f}%"
        if row.get("held-out-accuracy") is not None:
            acc_text += f" (held out {100 * row['held-out-accuracy']:.2f}%)"
        if row.get("failed"):
            acc_text = ("FAILED (too few usable replies)" if "train-dropped" not in row
                        else f"FAILED ({row['train-dropped']} unusable replies)")
        loss = row.get("loss")
        loss_text = "n/a" if loss is None else f"{loss:.4f}"
        traffic = (f" | sent {row['bytes-sent'] / 1e6:.1f} MB, received "
                   f"{row['bytes-received'] / 1e6:.1f} MB" if "bytes-sent" in row else "")
        timing = ""
        if "round-seconds" in row:
            eta = format_duration(row["elapsed-seconds"] / max(done, 1) * (total - done))
            timing = f" | {row['round-seconds']:.1f} s | ETA {eta}"
        return (f"[{self.config.label}] round {done:>{len(str(total))}}/{total}"
                f" | accuracy {acc_text} | loss {loss_text}" + traffic
                + (f" | ε {row['dp-epsilon']:.2f}" if row.get("dp-epsilon") is not None
                   else "")
                + timing)

    def finish(self, *, can_extend: bool | None = None, paused: int | None = None,
               paused_by: str = "") -> dict[str, Any]:
        """Write the summary (final and best round) and print it. ``can_extend``
        (a complete run): whether its checkpoint and clients' state are kept, so
        that resuming it with a larger num-rounds continues it. ``paused``: the
        round after which the run stopped on request (``paused-after-round``), and
        ``paused_by`` why, when not on a request (``paused-by``: ``stop-by <time>``)."""
        evaluated = [r for r in self.rounds if r.get("accuracy") is not None]
        summary: dict[str, Any] = {
            "complete": len(self.rounds) >= self.num_rounds,
            "rounds": len(self.rounds),
            "method": self.config.label,
        }
        # Under privacy the run's total time grows with its total number of draws
        # (DP_WITHHELD); the checkpoint, the server's own, keeps it for resuming.
        seconds = time.perf_counter() - self.started
        took = "" if self.config.dp else format_duration(seconds)
        if not self.config.dp:
            summary["wall-seconds"] = round(seconds, 3)
        if can_extend is not None:
            summary["can-extend"] = can_extend
        if paused is not None:
            summary["paused-after-round"] = paused
            if paused_by:
                summary["paused-by"] = paused_by
        if self.stopped_by and len(self.rounds) >= self.num_rounds:
            summary["stopped-by"] = self.stopped_by
        epsilons = [r["dp-epsilon"] for r in self.rounds if r.get("dp-epsilon") is not None]
        if epsilons:
            summary["dp-epsilon"] = epsilons[-1]
            summary["dp-delta"] = self.config.dp_delta
        if evaluated:
            final = evaluated[-1]
            best = max(evaluated, key=lambda r: r["accuracy"])
            summary.update({
                "final-round": final["round"],
                "final-accuracy": final["accuracy"],
                "final-weighted-accuracy": final["weighted-accuracy"],
                "final-loss": final["loss"],
                **({"final-server-accuracy": final["server-accuracy"]}
                   if "server-accuracy" in final else {}),
                **({"final-held-out-accuracy": final["held-out-accuracy"]}
                   if "held-out-accuracy" in final else {}),
                "best-round": best["round"],
                "best-accuracy": best["accuracy"],
            })
            if not self.config.dp:  # the totals count the run's draws (DP_WITHHELD)
                summary["bytes-sent"] = sum(r["bytes-sent"] for r in self.rounds)
                summary["bytes-received"] = sum(r["bytes-received"] for r in self.rounds)
        self._write_metrics(summary)
        write_summary(self.run_dir, _clean_tree(summary))
        self.scalars.close()
        self.wandb.finish(summary)
        if paused is not None:
            self.echo(
                f"[{self.config.label}] paused after round {paused} of "
                f"{self.config.num_rounds}{f' ({paused_by})' if paused_by else ''}"
                + (f" ({took} run so far)" if took else "")
                + "; resume = true" + (" with a later stop-by (or none)"
                                       if paused_by.startswith(STOP_BY) else "")
                + f" continues it; results in {self.run_dir}")
        elif evaluated:
            self.echo(
                f"[{self.config.label}] done" + (f" in {took}" if took else "") + ": "
                f"final accuracy {100 * summary['final-accuracy']:.2f}% (round "
                f"{summary['final-round']}), best {100 * summary['best-accuracy']:.2f}% "
                f"(round {summary['best-round']}); results in {self.run_dir}"
            )
        return summary


def _timings(phase: str, metrics: MetricRecord) -> dict[str, float]:
    return {f"{phase}-{field}": round(float(metrics[key]), 3)
            for field, key in TIMINGS.items() if key in metrics}


def _clean_tree(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _clean_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean_tree(v) for v in value]
    return _clean(value)
