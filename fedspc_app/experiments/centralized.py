"""The pooled-data reference: one model trained on the union of all clients' data.

Every training image belongs to exactly one client, so that union is the whole
training set (the paper: 200 epochs at learning rate 0.1). Dataset, model,
augmentation, batch size and device are built as for the federated runs; the
run-config's ``learning-rate`` (the federated η) is replaced by the reference's.
The SGD optimizer is rebuilt every epoch (so that the rate can follow the
schedule), which restarts its momentum buffer. Results go to
``<output-dir>/<run-name>/`` (default run-name ``centralized-<dataset>-<model>-s<seed>``)
in the federated runs' format, with one ``metrics.csv`` row per evaluated epoch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fedspc_app.core.config import RunConfig, parse_run_config
from fedspc_app.core.errors import ConfigError, FedSPCError
from fedspc_app.core.files import folder_lock
from fedspc_app.experiments.layout import slug
from fedspc_app.launch.runconfig import app_defaults
from fedspc_app.runs.results import format_duration, start_results, write_metrics, write_summary
from fedspc_app.runs.runfolder import claim_run_folder
from fedspc_app.training.precision import apply_determinism

CSV_COLUMNS = ("epoch", "accuracy", "loss", "train-loss", "learning-rate", "train-images",
               "epoch-seconds", "elapsed-seconds")
SCHEDULES = ("constant", "cosine")


def epoch_learning_rate(base: float, epoch: int, epochs: int, schedule: str) -> float:
    """The rate of 1-based ``epoch``: constant, or cosine-annealed from ``base`` to 0."""
    if schedule == "constant":
        return base
    if schedule == "cosine":
        return 0.5 * base * (1.0 + math.cos(math.pi * (epoch - 1) / epochs))
    raise ConfigError(f"lr-schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")


def default_run_name(config: RunConfig) -> str:
    return slug(f"centralized-{config.dataset}-{config.model}-s{config.seed}")


def build_config(run_config: Mapping[str, Any], *, run_name: str | None = None,
                 output_dir: str | None = None,
                 echo: Callable[[str], None] = print) -> RunConfig:
    """The app defaults, then ``run_config``, validated; the run-name filled in
    (:func:`~fedspc_app.runs.runfolder.claim_run_folder`: a new run never replaces an
    earlier one)."""
    merged = {**app_defaults(), **run_config}
    if output_dir:
        merged["output-dir"] = output_dir
    if run_name:
        merged["run-name"] = run_name
    config = parse_run_config(merged)
    config, note = claim_run_folder(config, default_run_name(config))
    if note:
        echo(note)
    return config


def _write_metrics(config: RunConfig, rows: list[dict[str, Any]],
                   summary: Mapping[str, Any] | None = None) -> None:
    payload: dict[str, Any] = {"run-name": config.resolved_run_name, "mode": "centralized",
                               "epochs": rows}
    if summary is not None:
        payload["summary"] = dict(summary)
    write_metrics(config.run_dir, payload, rows, CSV_COLUMNS, lineterminator="\n")


def train_centralized(config: RunConfig, *, epochs: int = 200, learning_rate: float = 0.1,
                      eval_every: int = 1, lr_schedule: str = "constant",
                      echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Train ``config``'s model on the whole training set with SGD, evaluating on the
    test set every ``eval_every`` epochs and after the last; return the summary."""
    if epochs < 1 or eval_every < 1 or not learning_rate > 0:
        raise ConfigError(f"epochs and eval-every must be >= 1 and the learning rate > 0, "
                          f"got {epochs}, {eval_every}, {learning_rate}")
    epoch_learning_rate(learning_rate, 1, epochs, lr_schedule)  # checks the name
    # torch is imported only now, so that bad options fail fast.
    from fedspc_app.data.batching import iterate_batches
    from fedspc_app.data.run_data import load_run_dataset, use_augmentation
    from fedspc_app.models.run_model import make_model
    from fedspc_app.training.client_data import seeded_generator
    from fedspc_app.training.loop import evaluate_model, train_epochs
    from fedspc_app.training.precision import resolve_device

    config = config.replace(learning_rate=learning_rate)
    dataset = load_run_dataset(config)
    device = resolve_device(config)
    determinism = apply_determinism(config.deterministic)
    model = make_model(config, dataset).to(device)
    augment = use_augmentation(config, dataset)
    train_indices = np.arange(dataset.num_train)
    test_indices = np.arange(dataset.num_test)
    generator = seeded_generator("centralized", config.seed)
    trainable = [name for name, _ in model.named_parameters()]
    run_dir = config.run_dir

    def train_batches():
        return iterate_batches(dataset, "train", train_indices, batch_size=config.batch_size,
                               shuffle=True, augment=augment, generator=generator,
                               device=device)

    # Everything is checked: hold the folder while writing it (one run at a time).
    with folder_lock(run_dir, f"centralized run {config.resolved_run_name!r}"):
        start_results(run_dir, {
            "run-config": config.to_dict(), "mode": "centralized",
            "centralized": {"epochs": epochs, "learning-rate": learning_rate,
                            "eval-every": eval_every, "lr-schedule": lr_schedule},
            "dataset": {"name": dataset.name, "train": dataset.num_train,
                        "test": dataset.num_test, "classes": dataset.num_classes},
            "device": str(device),
            "deterministic": determinism,
        })
        echo(f"[centralized] {config.model} on {dataset.name}: {dataset.num_train} training "
             f"images, {epochs} epochs, lr {learning_rate:g} ({lr_schedule}), "
             f"{device}; results in {run_dir}")

        rows: list[dict[str, Any]] = []
        started = last = time.perf_counter()
        for epoch in range(1, epochs + 1):
            rate = epoch_learning_rate(learning_rate, epoch, epochs, lr_schedule)
            result = train_epochs(model, train_batches, epochs=1, trainable=trainable,
                                  **{**config.step_options, "learning_rate": rate})
            if epoch % eval_every and epoch != epochs:
                continue
            test_batches = iterate_batches(dataset, "test", test_indices,
                                           batch_size=max(config.batch_size, 256), shuffle=False,
                                           augment=False, generator=None, device=device)
            correct, examples, loss_sum = evaluate_model(model, test_batches,
                                                         **config.compute_options)
            now = time.perf_counter()
            row = {"epoch": epoch, "accuracy": correct / examples, "loss": loss_sum / examples,
                   "train-loss": result.mean_loss, "learning-rate": rate,
                   "train-images": result.examples, "epoch-seconds": round(now - last, 3),
                   "elapsed-seconds": round(now - started, 3)}
            last = now
            rows.append(row)
            _write_metrics(config, rows)
            eta = format_duration((now - started) / epoch * (epochs - epoch))
            echo(f"[centralized] epoch {epoch:>{len(str(epochs))}}/{epochs} | accuracy "
                 f"{100 * row['accuracy']:6.2f}% | loss {row['loss']:.4f} | train-loss "
                 f"{row['train-loss']:.4f} | {row['epoch-seconds']:.1f} s | ETA {eta}")
            if not math.isfinite(row["train-loss"]):
                raise FedSPCError(f"training diverged at epoch {epoch} (train loss "
                                  f"{row['train-loss']}); use a smaller learning rate")

        final = rows[-1]
        best = max(rows, key=lambda r: r["accuracy"])
        summary = {
            "complete": True, "mode": "centralized", "method": "centralized",
            "epochs": epochs, "rounds": len(rows),
            "wall-seconds": round(time.perf_counter() - started, 3),
            "final-epoch": final["epoch"], "final-accuracy": final["accuracy"],
            "final-loss": final["loss"], "best-epoch": best["epoch"],
            "best-accuracy": best["accuracy"],
        }
        _write_metrics(config, rows, summary)
        write_summary(run_dir, summary)
        echo(f"[centralized] done in {format_duration(summary['wall-seconds'])}: final accuracy "
             f"{100 * final['accuracy']:.2f}% (epoch {final['epoch']}), best "
             f"{100 * best['accuracy']:.2f}% (epoch {best['epoch']}); results in {run_dir}")
        return summary
