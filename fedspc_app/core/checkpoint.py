"""The server's checkpoint: everything a run needs to continue after a crash.

Written into the run folder twice per round: after aggregation (phase
``trained``: the new shared block, u_bar and which replies were accepted, so the
clients may commit the state they staged) and after evaluation (phase
``complete``: the round's metrics). Two files: ``checkpoint-r<round>.npz`` holds
the arrays, ``checkpoint.json`` the rest and the name of the arrays file. Both are
written atomically, the arrays first, so ``checkpoint.json`` always names a
complete arrays file; older arrays files are removed after it is replaced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedspc_app.core.config import RunConfig
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.files import atomic_open, atomic_write

CHECKPOINT_JSON = "checkpoint.json"
FORMAT_VERSION = 1
TRAINED, COMPLETE = "trained", "complete"
SHARED, REFERENCE = "shared/", "reference/"

# Run-config keys a resumed run may change: where things live, how long it runs,
# how patient it is. Any other difference means another experiment.
MAY_CHANGE = frozenset({
    "num-rounds", "resume", "checkpoint", "output-dir", "data-dir", "download", "device",
    "round-timeout", "min-train-replies", "max-failed-rounds",
})

ArrayDict = dict[str, np.ndarray]


def fingerprint(config: RunConfig, num_clients: int) -> dict[str, Any]:
    """The settings a checkpoint must share with the run that resumes it."""
    values = {k: v for k, v in config.to_dict().items() if k not in MAY_CHANGE}
    values["num-clients"] = num_clients  # the resolved K, whatever the key said
    return values


@dataclass
class Checkpoint:
    """The state of a run after ``round`` (``phase`` says how far that round got)."""

    round: int
    phase: str
    shared: ArrayDict
    global_reference: ArrayDict
    strategy: dict[str, Any]
    failed_streak: int = 0
    rounds: list[dict[str, Any]] = field(default_factory=list)
    elapsed_seconds: float = 0.0
    train_metrics: dict[str, Any] | None = None  # phase "trained": the aggregation's


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
        with atomic_open(run_dir / name) as handle:
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
    }
    atomic_write(run_dir / CHECKPOINT_JSON, json.dumps(payload, indent=1, default=_plain))
    for old in run_dir.glob("checkpoint-r*.npz"):
        if old.name != name:
            old.unlink(missing_ok=True)


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
        if payload.get("format") != FORMAT_VERSION:
            raise ValueError(f"format {payload.get('format')!r}, expected {FORMAT_VERSION}")
        with np.load(Path(run_dir) / payload["arrays"], allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(f"cannot resume from {path}: {error}") from error
    differing = sorted(key for key in set(identity) | set(payload["run"])
                       if payload["run"].get(key) != identity.get(key))
    if differing:
        details = ", ".join(f"{key}: checkpoint {payload['run'].get(key)!r}, "
                            f"run-config {identity.get(key)!r}" for key in differing[:6])
        raise ConfigError(f"the checkpoint in {run_dir} belongs to another run ({details}); "
                          "resume with the same settings, or pick another run-name")
    return Checkpoint(
        round=int(payload["round"]),
        phase=payload["phase"],
        shared={k[len(SHARED):]: v for k, v in arrays.items() if k.startswith(SHARED)},
        global_reference={k[len(REFERENCE):]: v for k, v in arrays.items()
                          if k.startswith(REFERENCE)},
        strategy=payload["strategy"],
        failed_streak=int(payload["failed-streak"]),
        rounds=list(payload["rounds"]),
        elapsed_seconds=float(payload["elapsed-seconds"]),
        train_metrics=payload.get("train-metrics"),
    )


def remove_checkpoint(run_dir: Path) -> None:
    run_dir = Path(run_dir)
    (run_dir / CHECKPOINT_JSON).unlink(missing_ok=True)
    for old in run_dir.glob("checkpoint-r*.npz"):
        old.unlink(missing_ok=True)


def _plain(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else str(value)
