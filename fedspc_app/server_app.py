"""ServerApp: parse the run-config, check data and partition, run the method's strategy.

In simulation the server loads the dataset and computes the partition itself, so
that any bad input stops the run with one message before training. In a
deployment the server machine need not hold the data (see
:mod:`fedspc_app.deployment`).
"""

from __future__ import annotations

import secrets
import shutil
import time
from logging import ERROR, INFO

from flwr.app import ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from clients.durable import SIMULATION_FOLDER
from fedspc_app.core.checkpoint import TRAINED, RoundRecords, fingerprint, resume_point
from fedspc_app.core.config import RunConfig, parse_run_config
from fedspc_app.core.errors import ConfigError, FedSPCError
from fedspc_app.core.files import folder_lock
from fedspc_app.core.methods import Method, get_method
from fedspc_app.core.partition import save_partition
from fedspc_app.core.results import RunRecorder, TrafficGrid
from fedspc_app.core.task import (
    ParameterSplit,
    load_partition,
    make_model,
    parameter_split,
    state_arrays,
    to_record,
)
from fedspc_app.deployment import is_deployment, preflight, server_dataset
from strategies import FedSPC, PersonalizedFedAvg, run_rounds

app = ServerApp()


def build_strategy(config: RunConfig, method: Method, split: ParameterSplit,
                   num_clients: int = 2):
    """The method's strategy, wrapped by FedSPC when the control variates are on."""
    strategy = PersonalizedFedAvg(
        shared_keys=split.shared,
        aggregation=config.aggregation,
        fraction_train=config.fraction_train,
        min_available_nodes=num_clients,
        num_partitions=num_clients,
        min_train_replies=config.min_train_replies,
        drift_keys=split.corrected,
        seed=config.seed,
        node_wait=config.node_wait,
    )
    if method.control_variates or config.fedspc:
        return FedSPC(strategy, corrected_keys=split.corrected,
                      learning_rate=config.learning_rate, upload=config.fedspc_upload)
    return strategy


def wait_for_clients(grid: Grid, expected: int, timeout: float = 600.0) -> int:
    """Number of connected clients; with ``expected > 0`` wait until that many."""
    deadline = time.monotonic() + timeout
    while True:
        count = len(list(grid.get_node_ids()))
        if (expected and count >= expected) or (not expected and count > 0):
            return expected or count
        if time.monotonic() > deadline:
            raise FedSPCError(
                f"only {count} client(s) connected after {timeout:.0f} s "
                f"(num-clients = {expected})"
            )
        time.sleep(1.0)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run a federated training as the run-config describes, holding its results
    folder's lock (one run at a time writes a folder)."""
    try:
        config = parse_run_config(context.run_config)
        with folder_lock(config.run_dir, f"run {config.resolved_run_name!r}"):
            run(grid, config)
    except FedSPCError as error:
        log(ERROR, "Run not started: %s", error)
        raise SystemExit(f"fedspc: {error}") from None


def run(grid: Grid, config: RunConfig) -> None:
    """Check the data and partition, then train (resuming from a checkpoint)."""
    deployment = is_deployment(grid)
    try:
        method = get_method(config.method)
        if deployment and not config.num_clients:
            raise ConfigError(
                "run-config 'num-clients' must be the number of SuperNodes in a deployment "
                "(each started with --node-config \"partition-id=i num-partitions=N\")")
        shape, dataset = server_dataset(config, deployment)
        num_clients = wait_for_clients(grid, config.num_clients)
        if deployment:
            partition = preflight(grid, config, num_clients, shape)
            sizes = {"train": sum(map(sum, partition["train_counts"])),
                     "test": sum(map(sum, partition["test_counts"]))}
        else:
            partition = load_partition(config, num_clients)
            sizes = {"train": int(dataset.train_labels.shape[0]),
                     "test": int(dataset.test_labels.shape[0])}
        model = make_model(config, shape)
        split = parameter_split(model, method, shared_keys=config.shared_keys,
                                personal_keys=config.personal_keys)
    except FedSPCError as error:
        log(ERROR, "Run not started: %s", error)
        raise SystemExit(f"fedspc: {error}") from None

    traffic = TrafficGrid(grid)
    recorder = RunRecorder(config, traffic=traffic, echo=lambda line: log(INFO, "%s", line))
    identity = fingerprint(config, num_clients)
    strategy = build_strategy(config, method, split, num_clients)
    try:
        resumed = resume_point(config, identity)
        if resumed is not None:
            strategy.load_state_dict(resumed.strategy, resumed.round,
                                     global_reference=resumed.global_reference)
            if set(resumed.shared) != set(split.shared):
                raise ConfigError("the checkpoint's shared block does not match this model")
    except (FedSPCError, ValueError) as error:
        log(ERROR, "Run not started: %s", error)
        raise SystemExit(f"fedspc: {error}") from None
    recorder.start(extra={
        "method": method.summary,
        "num-clients": num_clients,
        "runtime": "deployment" if deployment else "simulation",
        "dataset": {"name": shape.name, **sizes, "classes": shape.num_classes},
        "split": ("declared (shared-keys/personal-keys)"
                  if config.shared_keys.strip() or config.personal_keys.strip()
                  else f"the method's ({method.shared} shared)"),
        "shared-keys": list(split.shared),
        "personal-keys": list(split.personal),
        "resumed-after-round": resumed.round if resumed else 0,
    }, rounds=resumed.rounds if resumed else None,
        elapsed=resumed.elapsed_seconds if resumed else 0.0)
    save_partition(partition, recorder.run_dir)
    log(INFO, "%s | %s on %s, %d clients, alpha=%g, %d rounds", config.label,
        config.model, config.dataset, num_clients, config.alpha, config.num_rounds)

    records = RoundRecords(config, strategy, recorder, identity, resumed)
    if not strategy.run_token:  # a new run (a resumed one keeps its checkpoint's)
        strategy.run_token = secrets.token_hex(8)
    round_config = {"num-clients": num_clients, "deployment": deployment}
    initial = resumed.shared if resumed else state_arrays(model, split.shared)
    evaluate_first = resumed is not None and resumed.phase == TRAINED
    try:
        run_rounds(
            strategy, traffic,
            arrays=to_record(initial),
            num_rounds=config.num_rounds,
            first_round=resumed.round + (0 if evaluate_first else 1) if resumed else 1,
            evaluate_first=evaluate_first,
            resumed_train_metrics=(MetricRecord(resumed.train_metrics)
                                   if evaluate_first and resumed.train_metrics else None),
            timeout=config.round_timeout,
            train_config=ConfigRecord(round_config),
            evaluate_config=ConfigRecord(round_config),
            max_failed_rounds=config.max_failed_rounds,
            evaluate_every=config.evaluate_every,
            evaluate_fraction=config.evaluate_fraction,
            failed_streak=resumed.failed_streak if resumed else 0,
            on_trained=records.on_trained,
            on_round_end=records.on_round_end,
        )
    except FedSPCError as error:
        recorder.finish()
        log(ERROR, "Run stopped: %s", error)
        raise SystemExit(f"fedspc: {error}") from None
    recorder.finish()
    if not deployment:  # the clients' files are only needed to resume this run
        shutil.rmtree(recorder.run_dir / SIMULATION_FOLDER, ignore_errors=True)
