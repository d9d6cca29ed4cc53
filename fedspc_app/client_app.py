"""ClientApp: local training and personalized evaluation of the configured method."""

from __future__ import annotations

from dataclasses import dataclass

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients import ClientState, evaluate_client, train_client
from fedspc_app.config import RunConfig, parse_run_config
from fedspc_app.errors import ConfigError
from fedspc_app.methods import Method, get_method
from fedspc_app.task import (
    ClientData,
    ParameterSplit,
    client_data,
    from_record,
    make_model,
    parameter_split,
    to_record,
)
from strategies.fedspc import GLOBAL_REFERENCE, REFERENCE_CHANGE
from strategies.personalized import ARRAYS, METRICS

app = ClientApp()


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

    @classmethod
    def from_message(cls, message: Message, context: Context) -> "ClientSetup":
        config = parse_run_config(context.run_config)
        method = get_method(config.method)
        partition_id = int(context.node_config["partition-id"])
        num_partitions = int(context.node_config["num-partitions"])
        message_config = message.content.config_records.get("config", {})
        expected = int(message_config.get("num-clients", num_partitions))
        if expected != num_partitions:
            raise ConfigError(
                f"this node was started with num-partitions={num_partitions} but the "
                f"server partitions the data over {expected} clients"
            )
        data = client_data(config, partition_id, num_partitions)
        model = make_model(config, data.dataset)
        return cls(config, method, data, parameter_split(model, method), model,
                   partition_id, int(message_config.get("server-round", 0)))

    def arguments(self, message: Message, context: Context) -> dict:
        """Keyword arguments shared by :func:`train_client` and :func:`evaluate_client`."""
        received = from_record(message.content.array_records[ARRAYS])
        if set(received) != set(self.split.shared):
            raise ValueError("the server sent arrays that are not this method's shared block")
        return dict(config=self.config, method=self.method, model=self.model,
                    split=self.split, received=received,
                    state=ClientState.load(context.state), data=self.data,
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
    upload = message.content.config_records.get("config", {}).get("reference-upload")
    if upload == "explicit" and outcome.reference_change is not None:
        content[REFERENCE_CHANGE] = to_record(outcome.reference_change)
    outcome.state.commit(context.state)
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
