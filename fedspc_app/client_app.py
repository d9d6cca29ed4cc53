"""ClientApp: local training and personalized evaluation of the configured method."""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO, WARNING

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore import log

from clients import ClientState, evaluate_client, train_client
from clients.durable import DurableState
from clients.local import uses_control_variates
from clients.state import INFO as STATE_INFO
from fedspc_app.core.config import RunConfig, parse_run_config
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.methods import Method, get_method
from fedspc_app.core.task import (
    ClientData,
    ParameterSplit,
    client_data,
    from_record,
    load_partition,
    make_model,
    parameter_split,
    to_record,
)
from strategies.fedspc import GLOBAL_REFERENCE, REFERENCE_CHANGE
from strategies.personalized import ARRAYS, METRICS

app = ClientApp()

# The ServerApp's check of a deployment before training (see deployment.preflight).
PARTITION_QUERY = "partition"


def message_config(message: Message):
    """The ``config`` ConfigRecord of a server message (empty when absent)."""
    return message.content.config_records.get("config", {})


def node_run_config(context: Context) -> RunConfig:
    """The run-config as this node uses it: a node-config ``data-dir`` overrides the run's."""
    config = parse_run_config(context.run_config)
    data_dir = str(context.node_config.get("data-dir", "") or "")
    return config.replace(data_dir=data_dir) if data_dir else config


def node_partition(message: Message, context: Context) -> tuple[int, int]:
    """This node's ``partition-id`` and ``num-partitions``, checked against the server's."""
    missing = [k for k in ("partition-id", "num-partitions") if k not in context.node_config]
    if missing:
        raise ConfigError(
            f"this node's config lacks {' and '.join(missing)}: start the SuperNode with "
            "--node-config \"partition-id=<i> num-partitions=<N>\""
        )
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    expected = int(message_config(message).get("num-clients", num_partitions))
    if expected != num_partitions:
        raise ConfigError(
            f"this node was started with num-partitions={num_partitions} but the "
            f"server partitions the data over {expected} clients"
        )
    return partition_id, num_partitions


@dataclass
class ClientSetup:
    """Everything a handler needs, built from the message and the context."""

    config: RunConfig
    method: Method
    data: ClientData
    split: ParameterSplit
    model: object
    partition_id: int
    server_round: int
    store: DurableState | None = None
    deployment: bool = False

    @classmethod
    def from_message(cls, message: Message, context: Context) -> "ClientSetup":
        config = node_run_config(context)
        method = get_method(config.method)
        partition_id, num_partitions = node_partition(message, context)
        data = client_data(config, partition_id, num_partitions)
        model = make_model(config, data.dataset)
        return cls(config, method, data, parameter_split(model, method), model,
                   partition_id, int(message_config(message).get("server-round", 0)),
                   store=DurableState.from_context(context),
                   deployment=bool(message_config(message).get("deployment", False)))

    @property
    def keeps_state(self) -> bool:
        """Whether this method has client state worth keeping between rounds."""
        return bool(self.split.personal or self.method.personal_model
                    or uses_control_variates(self.method, self.config))

    def load_state(self, context: Context) -> ClientState:
        """The client state: from memory, else from the node's state file; logs its origin."""
        fresh = STATE_INFO not in context.state
        state = ClientState.load(context.state, self.store)
        if not fresh:
            return state
        where = f"run {context.run_id}, partition {self.partition_id}"
        if self.store is not None and state.rounds_trained > 0:
            log(INFO, "Restored the client state of %s from %s (%d rounds trained)",
                where, self.store.path, state.rounds_trained)
        elif not (self.deployment and self.keeps_state):
            pass
        elif self.store is None:
            log(WARNING, "Client state of %s lives only in this SuperNode's memory (no "
                "node-config state-dir): if the SuperNode restarts, this client starts again "
                "from the common initial personalized parameters and u_k = 0. Start it with "
                "--node-config \"... state-dir='/var/lib/fedspc'\" to keep it on disk.", where)
        elif self.server_round > 1:
            log(WARNING, "No saved client state of %s at %s: this client starts from the "
                "common initial personalized parameters and u_k = 0 (right only if it has "
                "not trained in this run before)", where, self.store.path)
        return state

    def arguments(self, message: Message, context: Context) -> dict:
        """Keyword arguments shared by :func:`train_client` and :func:`evaluate_client`."""
        received = from_record(message.content.array_records[ARRAYS])
        if set(received) != set(self.split.shared):
            raise ValueError("the server sent arrays that are not this method's shared block")
        return dict(config=self.config, method=self.method, model=self.model,
                    split=self.split, received=received,
                    state=self.load_state(context), data=self.data,
                    server_round=self.server_round, partition_id=self.partition_id)


@app.train()
def train(message: Message, context: Context) -> Message:
    """One round of local training; state is committed only after it succeeded."""
    setup = ClientSetup.from_message(message, context)
    global_reference = None
    if GLOBAL_REFERENCE in message.content.array_records:
        global_reference = from_record(message.content.array_records[GLOBAL_REFERENCE])
    outcome = train_client(**setup.arguments(message, context),
                           global_reference=global_reference)
    content = RecordDict({
        ARRAYS: to_record(outcome.shared),
        METRICS: MetricRecord({**outcome.metrics, "partition-id": setup.partition_id}),
    })
    upload = message_config(message).get("reference-upload")
    if upload == "explicit" and outcome.reference_change is not None:
        content[REFERENCE_CHANGE] = to_record(outcome.reference_change)
    outcome.state.commit(context.state, setup.store)
    return Message(content=content, reply_to=message)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Personalized accuracy on this client's own test split."""
    setup = ClientSetup.from_message(message, context)
    outcome = evaluate_client(**setup.arguments(message, context))
    metrics = MetricRecord({
        "num-examples": outcome.examples,
        "correct": outcome.correct,
        "loss-sum": outcome.loss_sum,
        "accuracy": outcome.accuracy,
        "partition-id": setup.partition_id,
    })
    return Message(content=RecordDict({METRICS: metrics}), reply_to=message)


@app.query()
def query(message: Message, context: Context) -> Message:
    """A deployment's check before training: this node's data, partition and state file.

    Loads what round 1 would load (so a missing dataset or a bad node-config fails
    here, before any training) and reports the node's per-class image counts, from
    which the server writes the run's partition file.
    """
    kind = message_config(message).get("query")
    if kind != PARTITION_QUERY:
        raise ValueError(f"unknown query {kind!r}")
    config = node_run_config(context)
    partition_id, num_partitions = node_partition(message, context)
    client_data(config, partition_id, num_partitions)  # data, partition id and device
    partition = load_partition(config, num_partitions)
    store = DurableState.from_context(context)
    if store is not None:
        store.read()  # an unreadable state file fails now, not in the middle of the run
    log(INFO, "Partition %d of %d: %d training and %d test images; client state %s",
        partition_id, num_partitions, int(partition.train_counts()[partition_id].sum()),
        int(partition.test_counts()[partition_id].sum()),
        f"kept in {store.directory}" if store else "in memory only")
    metrics = MetricRecord({
        "partition-id": partition_id,
        "num-partitions": num_partitions,
        "num-classes": partition.num_classes,
        "tries": partition.tries,
        "train-counts": [int(v) for v in partition.train_counts()[partition_id]],
        "test-counts": [int(v) for v in partition.test_counts()[partition_id]],
        "durable-state": int(store is not None),
    })
    return Message(content=RecordDict({METRICS: metrics}), reply_to=message)
