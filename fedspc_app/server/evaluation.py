"""Server-side evaluation (``evaluate-server``, Flower's centralized-evaluation
convention): the server's whole model on the dataset's official test set.

It applies where the server holds a whole model: methods that share every state-dict
entry (FedAvg, FedProx, SCAFFOLD, and Ditto, whose shared block is its global model).
After every evaluated round the ServerApp evaluates the aggregated model on the
server's device, before the next round starts; ``server-evaluate-seconds`` says what
that took (it is also inside the round's ``round-seconds``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping

import numpy as np
from torch import nn

from fedspc_app.core.config import RunConfig
from fedspc_app.core.errors import ConfigError, DataError
from fedspc_app.data.batching import iterate_batches
from fedspc_app.data.datasets import ImageDataset
from fedspc_app.models.run_model import load_arrays
from fedspc_app.models.split import ParameterSplit
from fedspc_app.runs.results import SERVER_COLUMNS
from fedspc_app.training.loop import evaluate_model
from fedspc_app.training.precision import resolve_device

SERVER_ACCURACY, SERVER_LOSS, SERVER_SECONDS = SERVER_COLUMNS


def check_server_evaluation(config: RunConfig, split: ParameterSplit,
                            dataset: ImageDataset | None) -> None:
    """Raise one clear error when ``evaluate-server`` cannot run: no whole model on the
    server, or (a deployment) no test set on the server's machine."""
    if not config.evaluate_server:
        return
    if split.personal:
        raise ConfigError(
            f"evaluate-server evaluates the server's whole model, but method "
            f"'{config.method}' keeps {len(split.personal)} state-dict entries on the "
            f"clients (e.g. {split.personal[0]!r}), so the server holds no whole model. "
            "It applies to fedavg, fedprox, scaffold and ditto (its global model), with "
            "the method's own split")
    if dataset is None:
        raise DataError(
            f"evaluate-server evaluates on the server, which does not hold the "
            f"{config.dataset} test set: put it under the server's data-dir, or set "
            "evaluate-server = false")


class ServerEvaluator:
    """Evaluates a whole model's arrays on the dataset's test split."""

    def __init__(self, config: RunConfig, model: nn.Module, dataset: ImageDataset) -> None:
        self.config = config
        self.device = resolve_device(config)
        self.model = copy.deepcopy(model).to(self.device)
        self.dataset = dataset

    def __call__(self, arrays: Mapping[str, np.ndarray]) -> dict[str, float]:
        """``server-accuracy``, ``server-loss`` (mean over the test images) and
        ``server-evaluate-seconds`` of the model ``arrays`` make up."""
        started = time.perf_counter()
        load_arrays(self.model, arrays)
        batches = iterate_batches(
            self.dataset, "test", np.arange(self.dataset.num_test),
            batch_size=max(self.config.batch_size, 256), shuffle=False, augment=False,
            generator=None, device=self.device)
        correct, examples, loss_sum = evaluate_model(self.model, batches,
                                                     **self.config.compute_options)
        return {SERVER_ACCURACY: correct / examples, SERVER_LOSS: loss_sum / examples,
                SERVER_SECONDS: time.perf_counter() - started}
