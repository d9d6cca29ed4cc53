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

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from clients.durable import SIMULATION_FOLDER
from fedspc_app.core.checkpoint import (
    CHECKPOINT_JSON,
    COMPLETE,
    TRAINED,
    Checkpoint,
    fingerprint,
    read_checkpoint,
    remove_checkpoint,
    write_checkpoint,
)
from fedspc_app.core.config import RunConfig, parse_run_config
from fedspc_app.core.errors import ConfigError, FedSPCError
from fedspc_app.core.methods import Method, get_method
from fedspc_app.core.partition import save_partition
from fedspc_app.core.results import RunRecorder, TrafficGrid, read_summary
from fedspc_app.core.task import (
    ParameterSplit,
    load_partition,
    make_model,
    parameter_split,
    from_record,
    state_arrays,
    to_record,
)
from fedspc_app.deployment import is_deployment, preflight, server_dataset
from strategies import FedSPC, PersonalizedFedAvg, RoundReport, run_rounds
from strategies.personalized import RUN_TOKEN

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
    )
    if method.control_variates or config.fedspc:
        return FedSPC(strategy, corrected_keys=split.corrected,
                      learning_rate=config.learning_rate, upload=config.fedspc_upload)
    return strategy


class RoundRecords:
    """After each round: the progress line and results files, and the checkpoint."""

    def __init__(self, config: RunConfig, strategy, recorder: RunRecorder,
                 identity: dict, resumed: Checkpoint | None) -> None:
        self.config = config
        self.strategy = strategy
        self.recorder = recorder
        self.identity = identity
        self.failed_streak = resumed.failed_streak if resumed else 0
        self.shared = resumed.shared if resumed else {}

    def checkpoint(self, server_round: int, phase: str, *, new_arrays: bool,
                   train_metrics: MetricRecord | None = None) -> None:
        if not self.config.checkpoint:
            return
        write_checkpoint(self.recorder.run_dir, Checkpoint(
            round=server_round, phase=phase, shared=self.shared,
            global_reference=self.strategy.state_arrays(),
            strategy=self.strategy.state_dict(), failed_streak=self.failed_streak,
            rounds=self.recorder.rounds, elapsed_seconds=self.recorder.elapsed,
            train_metrics=dict(train_metrics) if train_metrics is not None else None,
        ), self.identity, new_arrays=new_arrays)

    def on_trained(self, server_round: int, arrays: ArrayRecord,
                   train_metrics: MetricRecord | None, report: RoundReport) -> None:
        self.failed_streak = self.failed_streak + 1 if report.failed else 0
        self.shared = from_record(arrays)
        self.checkpoint(server_round, TRAINED, new_arrays=True, train_metrics=train_metrics)

    def on_round_end(self, server_round: int, train_metrics: MetricRecord | None,
                     evaluate_metrics: MetricRecord | None, report: RoundReport | None) -> None:
        self.recorder.on_round_end(server_round, train_metrics, evaluate_metrics, report)
        self.checkpoint(server_round, COMPLETE, new_arrays=False)


def resume_point(config: RunConfig, identity: dict) -> Checkpoint | None:
    """The checkpoint to continue from, or ``None`` to start at round 1.

    A run that does not resume replaces a finished run of the same name, but never
    an unfinished one: its checkpoint may hold days of training.
    """
    if not config.resume:
        checkpoint = config.run_dir / CHECKPOINT_JSON
        summary = read_summary(config.run_dir)
        if checkpoint.is_file() and not (summary or {}).get("complete"):
            raise ConfigError(
                f"{config.run_dir} holds the checkpoint of an unfinished run: continue it "
                "with resume = true (python -m fedspc_app.simulate ... --resume), or move "
                "the folder away (or pick another run-name) to start again")
        remove_checkpoint(config.run_dir)
        return None
    resumed = read_checkpoint(config.run_dir, identity)
    if resumed is None:
        log(INFO, "resume = true but %s holds no checkpoint: starting at round 1",
            config.run_dir)
    elif resumed.round >= config.num_rounds and resumed.phase == COMPLETE:
        raise ConfigError(f"the checkpoint in {config.run_dir} is already at round "
                          f"{resumed.round} of num-rounds = {config.num_rounds}")
    return resumed


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
    """Run a federated training as the run-config describes."""
    deployment = is_deployment(grid)
    try:
        config = parse_run_config(context.run_config)
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
        split = parameter_split(model, method)
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
        "shared-keys": list(split.shared),
        "personal-keys": list(split.personal),
        "resumed-after-round": resumed.round if resumed else 0,
    }, rounds=resumed.rounds if resumed else None,
        elapsed=resumed.elapsed_seconds if resumed else 0.0)
    save_partition(partition, recorder.run_dir)
    log(INFO, "%s | %s on %s, %d clients, alpha=%g, %d rounds", config.label,
        config.model, config.dataset, num_clients, config.alpha, config.num_rounds)

    records = RoundRecords(config, strategy, recorder, identity, resumed)
    token = str(resumed.strategy.get(RUN_TOKEN, "")) if resumed else ""
    strategy.run_token = token or secrets.token_hex(8)
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
