"""The server's checkpoint: everything a run needs to continue after a crash.

Written into the run folder twice per round: after aggregation (phase
``trained``: the new shared block, u_bar and which replies were accepted, so the
clients may commit the state they staged) and after evaluation (phase
``complete``: the round's metrics). Two files: ``checkpoint-r<round>.npz`` holds
the arrays, ``checkpoint.json`` the rest and the name of the arrays file. Both are
written atomically, the arrays first, so ``checkpoint.json`` always names a
complete arrays file; older arrays files, and what an interrupted write left (an
arrays file it does not name, a temporary file), are removed after it is replaced
and when a run starts.
"""

from __future__ import annotations

import dataclasses
import json
import time
import zipfile
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord
from flwr.supercore import log

from fedspc_app.core.config import RunConfig, resolved_settings
from fedspc_app.core.deferred import Deferred
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.files import atomic_open, atomic_write
from fedspc_app.core.records import ArrayDict, from_record
from fedspc_app.runs.pause import (
    STOP_BY,
    RunPaused,
    clear_pause,
    next_round_ends_after,
    pause_requested,
)
from fedspc_app.runs.results import CHECKPOINT_SECONDS, RunRecorder, read_summary
from fedspc_app.runs.runfolder import CHECKPOINT_JSON

FORMAT_VERSION = 1
TRAINED, COMPLETE = "trained", "complete"
SHARED, REFERENCE, OPTIMIZER = "shared/", "reference/", "optimizer/"

# Run-config keys a resumed run may change: where things live (the run folder, not
# the spelling of its name, is the run), how long it runs, how patient it is. Any
# other difference means another experiment.
MAY_CHANGE = frozenset({
    "num-rounds", "resume", "checkpoint", "output-dir", "run-name", "data-dir", "download",
    "device", "round-timeout", "node-wait", "min-train-replies", "max-failed-rounds",
    "keep-client-state", "client-state-dir", "overwrite", "tensorboard", "evaluate-server",
    "divergence-factor", "wandb", "wandb-project", "wandb-entity", "wandb-mode", "stop-by",
    "dp-phase-seconds",
})

# Run-config keys whose default changed, or that were added: what a checkpoint that
# does not name them ran with (before "auto", u_bar was always Algorithm 1's
# increment; before robust-norm-bound, no rule bounded the updates' norms).
FORMER_DEFAULTS = {"fedspc-reference": "increment", "robust-norm-bound": "none"}


def fingerprint(config: RunConfig, num_clients: int) -> dict[str, Any]:
    """The settings a checkpoint must share with the run that resumes it."""
    values = {k: v for k, v in config.to_dict().items() if k not in MAY_CHANGE}
    values["num-clients"] = num_clients  # the resolved K, whatever the key said
    # u_bar's rule as resolved: a checkpoint of the same arithmetic resumes whether it
    # was written with "auto" or with the rule "auto" resolves to.
    values["fedspc-reference"] = config.reference_rule
    values["robust-norm-bound"] = config.norm_bound  # "none" under the mean
    return values


@dataclass
class Checkpoint:
    """The state of a run after ``round`` (``phase`` says how far that round got)."""

    round: int
    phase: str
    shared: ArrayDict
    # The strategy's state_arrays(); read back as Deferred (:func:`_read_arrays`).
    global_reference: ArrayDict
    strategy: dict[str, Any]
    failed_streak: int = 0
    rounds: list[dict[str, Any]] = field(default_factory=list)
    elapsed_seconds: float = 0.0
    train_metrics: dict[str, Any] | None = None  # phase "trained": the aggregation's
    # Phase "trained": what the round's record needs from its training phase (the
    # replies' fate as a RoundReport's fields, the bytes it sent and received), so a
    # round resumed between training and evaluation records them as if uninterrupted.
    trained: dict[str, Any] | None = None
    # The server optimizer's state (strategies/server_optimizer.py), by key.
    optimizer: ArrayDict = field(default_factory=dict)


# The checkpoint's files are for the run's owner only: the arrays hold every client's
# u_k under fedspc-reference = "client-centre"/"server-centre" (which the clients keep
# 0600 themselves), and checkpoint.json the secret under differential privacy.
PRIVATE_FILE = 0o600


def _arrays_name(server_round: int) -> str:
    return f"checkpoint-r{server_round:05d}.npz"


def write_checkpoint(run_dir: Path, checkpoint: Checkpoint, identity: dict[str, Any], *,
                     new_arrays: bool) -> None:
    """Write ``checkpoint`` into ``run_dir`` (the arrays only when ``new_arrays``)."""
    run_dir = Path(run_dir)
    name = _arrays_name(checkpoint.round)
    if new_arrays or not (run_dir / name).is_file():
        arrays = {SHARED + k: v for k, v in checkpoint.shared.items()}
        arrays.update({REFERENCE + k: v for k, v in checkpoint.global_reference.items()})
        arrays.update({OPTIMIZER + k: v for k, v in checkpoint.optimizer.items()})
        with atomic_open(run_dir / name, PRIVATE_FILE) as handle:
            np.savez(handle, **arrays)
    payload = {
        "format": FORMAT_VERSION,
        "round": checkpoint.round,
        "phase": checkpoint.phase,
        "arrays": name,
        "run": identity,
        "strategy": checkpoint.strategy,
        "failed-streak": checkpoint.failed_streak,
        "elapsed-seconds": checkpoint.elapsed_seconds,
        "rounds": checkpoint.rounds,
        "train-metrics": checkpoint.train_metrics,
        "trained": checkpoint.trained,
    }
    atomic_write(run_dir / CHECKPOINT_JSON, json.dumps(payload, indent=1, default=_plain),
                 PRIVATE_FILE)
    _remove_leftovers(run_dir, keep=name)


def read_checkpoint(run_dir: Path, identity: dict[str, Any]) -> Checkpoint | None:
    """The checkpoint in ``run_dir`` (``None`` if there is none).

    Raises
    ------
    ConfigError
        If it is unreadable or was written by a run with other settings.
    """
    path = Path(run_dir) / CHECKPOINT_JSON
    if not path.is_file():
        return None
    try:
        payload = json.loads(path.read_text())
        if not isinstance(payload, dict):
            raise TypeError(f"it holds {type(payload).__name__}, not a JSON object")
        if payload.get("format") != FORMAT_VERSION:
            raise ValueError(f"format {payload.get('format')!r}, expected {FORMAT_VERSION}")
        run, strategy = payload["run"], payload["strategy"]
        if not isinstance(run, dict) or not isinstance(strategy, dict):
            raise TypeError("its 'run' and 'strategy' must be JSON objects")
        if payload["phase"] not in (TRAINED, COMPLETE):
            raise ValueError(f"phase {payload['phase']!r}")
        arrays = _read_arrays(Path(run_dir) / payload["arrays"])
        checkpoint = Checkpoint(
            round=int(payload["round"]),
            phase=payload["phase"],
            shared={k[len(SHARED):]: v for k, v in arrays.items() if k.startswith(SHARED)},
            global_reference={k[len(REFERENCE):]: v for k, v in arrays.items()
                              if k.startswith(REFERENCE)},
            optimizer={k[len(OPTIMIZER):]: v for k, v in arrays.items()
                       if k.startswith(OPTIMIZER)},
            strategy=strategy,
            failed_streak=int(payload["failed-streak"]),
            rounds=list(payload["rounds"]),
            elapsed_seconds=float(payload["elapsed-seconds"]),
            train_metrics=payload.get("train-metrics"),
            trained=payload.get("trained"),
        )
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as error:
        what = f"no {error}" if isinstance(error, KeyError) else str(error)
        raise ConfigError(f"cannot resume from {path}: {what}") from error
    # A key added to the run-config after the checkpoint was written had its default,
    # or the value that default had then (FORMER_DEFAULTS); "auto" is compared resolved.
    # A key that may change is not compared, where an older checkpoint recorded it too.
    saved = resolved_settings({**RunConfig().to_dict(), **FORMER_DEFAULTS, **run})
    differing = sorted(key for key in (set(identity) | set(run)) - MAY_CHANGE
                       if saved.get(key) != identity.get(key))
    if differing:
        details = ", ".join(f"{key}: checkpoint {saved.get(key)!r}, "
                            f"run-config {identity.get(key)!r}" for key in differing[:6])
        raise ConfigError(f"the checkpoint in {run_dir} belongs to another run ({details}); "
                          "resume with the same settings, or pick another run-name")
    return checkpoint


def _read_arrays(path: Path) -> dict[str, np.ndarray | Deferred]:
    """The arrays of a checkpoint, those of the strategy's state (``reference/``: u_bar
    and the u_k a FedSPC server tracks, K of them) left :class:`Deferred`, each read
    from the file when the strategy restores it, so that K × d never sits in memory."""
    data = np.load(path, allow_pickle=False)  # closed once the last Deferred is dropped

    def member(name: str) -> Deferred:
        return Deferred(lambda: data[name])

    return {name: member(name) if name.startswith(REFERENCE) else data[name]
            for name in data.files}


def saved_progress(run_dir: Path) -> tuple[int, float] | None:
    """(round, elapsed seconds) of the checkpoint in ``run_dir``, read from its JSON
    alone, for progress listings; None when there is none or it is unreadable (the
    run itself reports that when it resumes)."""
    try:
        payload = json.loads((Path(run_dir) / CHECKPOINT_JSON).read_text())
        return int(payload["round"]), float(payload.get("elapsed-seconds") or 0.0)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_checkpoint(run_dir: Path) -> None:
    """Remove the checkpoint in ``run_dir``, with what interrupted writes left of one."""
    run_dir = Path(run_dir)
    (run_dir / CHECKPOINT_JSON).unlink(missing_ok=True)
    _remove_leftovers(run_dir, keep=None)


def _remove_leftovers(run_dir: Path, keep: str | None) -> None:
    """Remove the arrays files in ``run_dir`` but ``keep`` (the one ``checkpoint.json``
    names), and the temporary files of writes a killed process left behind; only the
    process that holds the run folder's lock calls this."""
    for old in (*run_dir.glob("checkpoint-r*.npz"), *run_dir.glob(".checkpoint-r*.npz.*.tmp"),
                *run_dir.glob(f".{CHECKPOINT_JSON}.*.tmp")):
        if old.name != keep:
            old.unlink(missing_ok=True)


def _plain(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else str(value)


class RoundRecords:
    """The round loop's callbacks: after each round's aggregation the checkpoint,
    after its evaluation the progress line, the results files and the checkpoint,
    then the pause request (:mod:`fedspc_app.runs.pause`): one present ends the run
    there by raising :class:`RunPaused`. ``strategy`` answers ``state_dict()`` and
    ``state_arrays()`` (strategies/). ``since``: when the run took its folder's lock (a
    ``time.time()``, default now); a pause request from before it is stale."""

    def __init__(self, config: RunConfig, strategy: Any, recorder: RunRecorder,
                 identity: dict, resumed: Checkpoint | None, *,
                 since: float | None = None) -> None:
        self.config = config
        self.strategy = strategy
        self.recorder = recorder
        self.identity = identity
        self.failed_streak = resumed.failed_streak if resumed else 0
        self.shared = resumed.shared if resumed else {}
        self.started = time.time()
        self.since = self.started if since is None else since
        self.round_ends = [self.started]  # for stop-by: this segment's round times
        self.warned_stop_by = False

    def checkpoint(self, server_round: int, phase: str, *, new_arrays: bool,
                   train_metrics: MetricRecord | None = None,
                   trained: dict[str, Any] | None = None) -> None:
        if not self.config.checkpoint:
            return
        write_checkpoint(self.recorder.run_dir, Checkpoint(
            round=server_round, phase=phase, shared=self.shared,
            global_reference=self.strategy.state_arrays(),
            optimizer=self.strategy.optimizer_arrays(),
            strategy=self.strategy.state_dict(), failed_streak=self.failed_streak,
            rounds=self.recorder.rounds, elapsed_seconds=self.recorder.elapsed,
            train_metrics=dict(train_metrics) if train_metrics is not None else None,
            trained=trained,
        ), self.identity, new_arrays=new_arrays)

    def on_trained(self, server_round: int, arrays: ArrayRecord,
                   train_metrics: MetricRecord | None, report: Any) -> None:
        self.failed_streak = self.failed_streak + 1 if report.failed else 0
        self.shared = from_record(arrays)
        if report.failed:
            # theta_s and u_bar are those of the last checkpoint: a run stopped before
            # this round's record is written resumes by doing the round again.
            return
        started = time.perf_counter()
        traffic = self.recorder.traffic
        trained = {"report": dataclasses.asdict(report) if dataclasses.is_dataclass(report)
                   else None,
                   "bytes-sent": traffic.sent if traffic else 0,
                   "bytes-received": traffic.received if traffic else 0}
        self.checkpoint(server_round, TRAINED, new_arrays=True, train_metrics=train_metrics,
                        trained=trained)
        if train_metrics is not None and self.config.checkpoint:
            train_metrics[CHECKPOINT_SECONDS] = time.perf_counter() - started

    def on_round_end(self, server_round: int, train_metrics: MetricRecord | None,
                     evaluate_metrics: MetricRecord | None, report: Any) -> None:
        self.recorder.on_round_end(server_round, train_metrics, evaluate_metrics, report)
        self.checkpoint(server_round, COMPLETE, new_arrays=False)
        self.round_ends.append(time.time())
        if server_round >= self.recorder.num_rounds:  # fewer under dp-target-epsilon
            return
        reason = None
        if pause_requested(self.recorder.run_dir, self.since):
            reason = ""
        deadline = self.config.stop_by_time
        if (reason is None and deadline is not None
                and next_round_ends_after(deadline.timestamp(), time.time(), self.round_ends)):
            reason = f"{STOP_BY} {self.config.stop_by}"
            log(INFO, "stop-by %s: round %d would end after it; pausing after round %d",
                self.config.stop_by, server_round + 1, server_round)
        if reason is None:
            return
        if self.config.checkpoint:
            raise RunPaused(server_round, self.config.num_rounds,
                            self.config.resolved_run_name, reason)
        clear_pause(self.recorder.run_dir)
        if not reason:
            log(WARNING, "A pause was asked, but this run keeps no checkpoint "
                "(checkpoint = false) to continue from: it goes on")
        elif not self.warned_stop_by:
            self.warned_stop_by = True
            log(WARNING, "stop-by has passed, but this run keeps no checkpoint "
                "(checkpoint = false) to continue from: it goes on")


def resume_point(config: RunConfig, identity: dict) -> Checkpoint | None:
    """The checkpoint to continue from, or ``None`` to start at round 1.

    A run that does not resume starts in a folder that holds no run, or replaces one
    on ``overwrite = true``: :func:`fedspc_app.runs.runfolder.claim_run_folder` has
    settled which before anything is written. A checkpoint after the last round of a
    run whose summary was not written (stopped after that round, or in an extension
    before its first new round) is returned too: the run then trains no round and
    writes its results.
    """
    if not config.resume:
        if not config.overwrite and (config.run_dir / CHECKPOINT_JSON).is_file():
            raise ConfigError(f"{config.run_dir} holds the checkpoint of another run")
        remove_checkpoint(config.run_dir)
        return None
    resumed = read_checkpoint(config.run_dir, identity)
    # An arrays file checkpoint.json does not name is what a killed write left: never
    # the state of a round this run records.
    _remove_leftovers(config.run_dir, keep=_arrays_name(resumed.round) if resumed else None)
    if resumed is None:
        log(INFO, "resume = true but %s holds no checkpoint: starting at round 1",
            config.run_dir)
    elif resumed.round >= config.num_rounds and resumed.phase == COMPLETE:
        summary = read_summary(config.run_dir) or {}
        if resumed.round > config.num_rounds or summary.get("complete"):
            raise ConfigError(f"the checkpoint in {config.run_dir} is already at round "
                              f"{resumed.round} of num-rounds = {config.num_rounds}")
        log(INFO, "%s has done all %d rounds but has no summary: writing its results",
            config.run_dir, resumed.round)
    return resumed
