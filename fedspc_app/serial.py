"""The same federated rounds as one plain sequential PyTorch loop: no Flower, no Ray.

One process trains the sampled clients one after the other with the project's own
data, partition, model and client code (:func:`clients.train_client` and
:func:`clients.evaluate_client`), averages the shared block in partition order and
updates u_bar as :class:`strategies.FedSPC` does, with the same functions
(:func:`strategies.personalized.mean_arrays`,
:func:`fedspc_app.core.correction.global_reference_update`, under ``weighted``
:func:`strategies.aggregation.robust_reference_sum`, and for the evaluation
:func:`strategies.summaries.evaluation_summary`). It is the baseline of
``scripts/benchmark.py --compare``, and a cross-check of the apps: with every client
sampled, its metrics are those of the Flower run with the same run-config, bit for
bit (``tests/test_inprocess.py``). With ``fraction-train`` < 1 it samples its own
clients, so only the work per round compares, not the metrics.

With ``workers`` > 1 the clients of a phase run in that many spawned processes of
one torch thread each, largest client first, as the simulation runs them; everything
else (sampling, aggregation, the order of the sums) stays in this process. It
separates what running clients in parallel processes costs on a machine from what
Flower and Ray add on top (``scripts/benchmark.py --compare --plain-workers N``).
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from clients import ClientJob, ClientState, evaluate_client, train_client
from clients.local import uses_control_variates
from fedspc_app.core.config import RunConfig
from fedspc_app.core.correction import global_reference_update, zeros_like
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.methods import get_method
from fedspc_app.core.protocol import EXAMPLES_SEEN, NUM_EXAMPLES, TRAIN_LOSS
from fedspc_app.data.run_data import load_partition, load_run_dataset
from fedspc_app.models.run_model import load_arrays, make_model, state_arrays
from fedspc_app.models.split import parameter_split
from fedspc_app.training.client_data import client_data
from fedspc_app.training.precision import apply_determinism
from strategies.aggregation import AggregationRule, mean_arrays, robust_reference_sum
from strategies.sampling import sampled_count
from strategies.summaries import evaluation_summary


def _sample(rng: np.random.Generator, num_clients: int, fraction: float) -> list[int]:
    if fraction >= 1.0:
        return list(range(num_clients))
    count = sampled_count(num_clients, fraction)  # the server's count
    return sorted(int(k) for k in rng.choice(num_clients, size=count, replace=False))


class _Clients:
    """The run's clients in one process: model, split, data and the client code."""

    def __init__(self, config: RunConfig, num_clients: int) -> None:
        self.config = config
        apply_determinism(config.deterministic)
        self.method = get_method(config.method)
        dataset = load_run_dataset(config)
        load_partition(config, num_clients)
        self.model = make_model(config, dataset)
        self.split = parameter_split(self.model, self.method, shared_keys=config.shared_keys,
                                     personal_keys=config.personal_keys,
                                     local_buffers=config.dp)
        # Every client starts from the common initial model (a fresh model in the apps).
        self.initial = state_arrays(self.model, self.model.state_dict().keys())
        self.data = [client_data(config, k, num_clients) for k in range(num_clients)]

    def job(self, k: int, shared, state: ClientState, server_round: int) -> ClientJob:
        """Client ``k``'s work, on the common initial model (a fresh model in the apps)."""
        load_arrays(self.model, self.initial)
        return ClientJob(self.config, self.method, self.model, self.split, shared, state,
                         self.data[k], server_round=server_round, partition_id=k)

    def train(self, k: int, shared, state: ClientState, u_bar, server_round: int):
        return train_client(self.job(k, shared, state, server_round), global_reference=u_bar)

    def evaluate(self, k: int, shared, state: ClientState, server_round: int):
        return evaluate_client(self.job(k, shared, state, server_round))


_WORKER: _Clients | None = None


def _start_worker(config: RunConfig, num_clients: int) -> None:
    global _WORKER
    import torch

    torch.set_num_threads(1)
    _WORKER = _Clients(config, num_clients)


def _call_worker(name: str, *args):
    return getattr(_WORKER, name)(*args)


def _run_phase(pool: ProcessPoolExecutor | None, local: _Clients, name: str,
               calls: dict[int, tuple]) -> dict[int, Any]:
    """Run ``local.<name>(k, *calls[k])`` for every client k, in ``pool`` when given."""
    if pool is None:
        return {k: getattr(local, name)(k, *args) for k, args in calls.items()}
    # Largest client first, each to the next free worker (as the round loop sends them).
    ordered = sorted(calls, key=lambda k: -len(local.data[k].train_indices))
    futures = {k: pool.submit(_call_worker, name, k, *calls[k]) for k in ordered}
    return {k: futures[k].result() for k in calls}


def run_serial(config: RunConfig, num_clients: int,
               echo: Callable[[str], None] = print, workers: int = 1) -> dict[str, Any]:
    """Run ``config.num_rounds`` rounds; return the setup time and one row per round.

    A row holds the RunRecorder's metric names (``accuracy``, ``loss``,
    ``train-loss``, ``train-images``, ``client-accuracy`` and so on) and the wall
    seconds of the round and of its two phases (``train-seconds``,
    ``evaluate-seconds``).

    It runs the paper's aggregation (``mean`` or ``weighted``) without a server
    optimizer or attackers; other settings are refused with a ConfigError.
    """
    if (config.aggregation not in ("mean", "weighted") or config.server_optimizer != "mean"
            or config.attack != "none" or config.dp or config.lr_schedule != "constant"
            or config.held_out_clients):
        raise ConfigError("the plain loop runs the mean (or weighted) aggregation only, "
                          "with a constant learning rate and without a server optimizer, "
                          "privacy, attack or held-out clients; run the others with "
                          "python -m fedspc_app.simulate")
    started = time.perf_counter()
    local = _Clients(config, num_clients)
    pool = None
    if workers > 1:
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_start_worker, initargs=(config, num_clients))
    try:
        return _rounds(config, num_clients, local, pool, started, echo)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)


def _rounds(config: RunConfig, num_clients: int, local: _Clients,
            pool: ProcessPoolExecutor | None, started: float,
            echo: Callable[[str], None]) -> dict[str, Any]:
    states = [ClientState() for _ in range(num_clients)]
    shared = state_arrays(local.model, local.split.shared)
    corrected = uses_control_variates(local.method, config)
    u_bar = zeros_like(shared, local.split.corrected) if corrected else None
    rng = np.random.default_rng(config.seed)
    setup_seconds = time.perf_counter() - started

    rows = []
    for server_round in range(1, config.num_rounds + 1):
        round_started = time.perf_counter()
        outcomes = _run_phase(pool, local, "train", {
            k: (shared, states[k], u_bar, server_round)
            for k in _sample(rng, num_clients, config.fraction_train)})
        ids = sorted(outcomes)
        weights = ([float(outcomes[k].metrics[NUM_EXAMPLES]) for k in ids]
                   if config.aggregation == "weighted" else [1.0] * len(ids))
        shared = mean_arrays([outcomes[k].shared for k in ids], weights)
        if corrected:
            changes = [outcomes[k].reference_change for k in ids]
            if config.aggregation == "weighted":  # as FedSPC: count x the weighted mean
                changes = [robust_reference_sum(AggregationRule("weighted"), changes,
                                                range(len(ids)), len(ids), weights)]
            u_bar = global_reference_update(u_bar, changes, num_clients)
        for k in ids:
            states[k] = outcomes[k].state
        trained = time.perf_counter()
        row: dict[str, Any] = {
            "round": server_round,
            TRAIN_LOSS: float(np.mean([outcomes[k].metrics[TRAIN_LOSS] for k in ids])),
            "train-clients": len(ids),
            "train-images": int(sum(outcomes[k].metrics[EXAMPLES_SEEN] for k in ids)),
            "train-seconds": trained - round_started,
        }

        last = server_round == config.num_rounds
        if last or server_round % config.evaluate_every == 0:
            fraction = 1.0 if last else config.evaluate_fraction
            results = _run_phase(pool, local, "evaluate", {
                k: (shared, states[k], server_round)
                for k in _sample(rng, num_clients, fraction)})
            summary = evaluation_summary({k: (r.correct, r.examples, r.loss_sum)
                                          for k, r in results.items()})
            row.update({
                **{key: summary[key]
                   for key in ("accuracy", "weighted-accuracy", "loss", "clients")},
                "client-accuracy": {str(k): a for k, a in zip(summary["client-ids"],
                                                              summary["client-accuracy"])},
                "evaluate-seconds": time.perf_counter() - trained,
            })
        row["round-seconds"] = time.perf_counter() - round_started
        rows.append(row)
        accuracy = row.get("accuracy")
        echo(f"[plain loop] round {server_round}/{config.num_rounds}: "
             f"{row['round-seconds']:.2f} s"
             + (f", accuracy {100 * accuracy:.2f}%" if accuracy is not None else ""))
    return {"setup-seconds": setup_seconds, "rounds": rows}
