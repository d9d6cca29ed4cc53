"""The same federated rounds as one plain sequential PyTorch loop: no Flower, no Ray.

One process trains the sampled clients one after the other with the project's own
data, partition, model and client code (:func:`clients.train_client` and
:func:`clients.evaluate_client`), averages the shared block in partition order and
updates u_bar as :class:`strategies.FedSPC` does. It is the baseline of
``scripts/benchmark.py --compare``, and a cross-check of the apps: with every client
sampled, its metrics are those of the Flower run with the same run-config, bit for
bit (``tests/test_inprocess.py``). With ``fraction-train`` < 1 it samples its own
clients, so only the work per round compares, not the metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from clients import ClientState, evaluate_client, train_client
from clients.local import uses_control_variates
from fedspc_app.core.config import RunConfig
from fedspc_app.core.correction import zeros_like
from fedspc_app.core.methods import get_method
from fedspc_app.core.task import (
    client_data,
    load_arrays,
    load_partition,
    load_run_dataset,
    make_model,
    parameter_split,
    state_arrays,
)
from strategies.personalized import mean_arrays


def _sample(rng: np.random.Generator, num_clients: int, fraction: float) -> list[int]:
    if fraction >= 1.0:
        return list(range(num_clients))
    count = max(1, int(num_clients * fraction))
    return sorted(int(k) for k in rng.choice(num_clients, size=count, replace=False))


def run_serial(config: RunConfig, num_clients: int,
               echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``config.num_rounds`` rounds; return the setup time and one row per round.

    A row holds the RunRecorder's metric names (``accuracy``, ``loss``,
    ``train-loss``, ``train-images``, ``client-accuracy`` and so on) and the wall
    seconds of the round and of its two phases (``train-seconds``,
    ``evaluate-seconds``).
    """
    started = time.perf_counter()
    method = get_method(config.method)
    dataset = load_run_dataset(config)
    load_partition(config, num_clients)
    model = make_model(config, dataset)
    split = parameter_split(model, method, shared_keys=config.shared_keys,
                            personal_keys=config.personal_keys)
    # Every client starts from the common initial model (a fresh model in the apps).
    initial = state_arrays(model, model.state_dict().keys())
    data = [client_data(config, k, num_clients) for k in range(num_clients)]
    states = [ClientState() for _ in range(num_clients)]
    shared = state_arrays(model, split.shared)
    corrected = uses_control_variates(method, config)
    u_bar = zeros_like(shared, split.corrected) if corrected else None
    rng = np.random.default_rng(config.seed)
    setup_seconds = time.perf_counter() - started

    rows = []
    for server_round in range(1, config.num_rounds + 1):
        round_started = time.perf_counter()
        outcomes = {}
        for k in _sample(rng, num_clients, config.fraction_train):
            load_arrays(model, initial)
            outcomes[k] = train_client(config=config, method=method, model=model,
                                       split=split, received=shared, state=states[k],
                                       data=data[k], global_reference=u_bar,
                                       server_round=server_round, partition_id=k)
        ids = sorted(outcomes)
        weights = ([float(outcomes[k].metrics["num-examples"]) for k in ids]
                   if config.aggregation == "weighted" else [1.0] * len(ids))
        shared = mean_arrays([outcomes[k].shared for k in ids], weights)
        if corrected:
            total = {key: np.zeros(value.shape, dtype=np.float64)
                     for key, value in u_bar.items()}
            for k in ids:
                for key, value in outcomes[k].reference_change.items():
                    total[key] += value
            u_bar = {key: (u_bar[key] + total[key] / num_clients).astype(np.float32)
                     for key in u_bar}
        for k in ids:
            states[k] = outcomes[k].state
        trained = time.perf_counter()
        row: dict[str, Any] = {
            "round": server_round,
            "train-loss": float(np.mean([outcomes[k].metrics["train-loss"] for k in ids])),
            "train-clients": len(ids),
            "train-images": int(sum(outcomes[k].metrics["examples-seen"] for k in ids)),
            "train-seconds": trained - round_started,
        }

        last = server_round == config.num_rounds
        if last or server_round % config.evaluate_every == 0:
            fraction = 1.0 if last else config.evaluate_fraction
            results = {}
            for k in _sample(rng, num_clients, fraction):
                load_arrays(model, initial)
                results[k] = evaluate_client(config=config, method=method, model=model,
                                             split=split, received=shared, state=states[k],
                                             data=data[k], server_round=server_round,
                                             partition_id=k)
            evaluated = sorted(results)
            accuracies = [results[k].correct / results[k].examples for k in evaluated]
            total_examples = sum(results[k].examples for k in evaluated)
            row.update({
                "accuracy": float(np.mean(accuracies)),
                "weighted-accuracy": sum(results[k].correct for k in evaluated)
                / total_examples,
                "loss": sum(results[k].loss_sum for k in evaluated) / total_examples,
                "clients": len(evaluated),
                "client-accuracy": {str(k): a for k, a in zip(evaluated, accuracies)},
                "evaluate-seconds": time.perf_counter() - trained,
            })
        row["round-seconds"] = time.perf_counter() - round_started
        rows.append(row)
        accuracy = row.get("accuracy")
        echo(f"[plain loop] round {server_round}/{config.num_rounds}: "
             f"{row['round-seconds']:.2f} s"
             + (f", accuracy {100 * accuracy:.2f}%" if accuracy is not None else ""))
    return {"setup-seconds": setup_seconds, "rounds": rows}
