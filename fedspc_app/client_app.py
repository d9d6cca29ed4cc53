"""ClientApp: local training and personalized evaluation of the configured method."""

from __future__ import annotations

import difflib
import functools
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.app import Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.supercore import log

from clients import ClientJob, evaluate_client, train_client
from clients.attack import attacked_reference_change, attacked_reply, is_attacker
from clients.durable import DurableState
from clients.held_out import evaluate_new_client, is_held_out
from clients.local import keeps_client_state, uses_control_variates
from clients.state import (
    PENDING,
    ClientLedger,
    ClientState,
    ClientStateError,
    Decisions,
)
from fedspc_app import IMPORT_STARTED_AT
from fedspc_app.core import startup
from fedspc_app.core.config import RunConfig, check_run_name, parse_run_config
from fedspc_app.core.errors import ConfigError, MessageError
from fedspc_app.core.methods import Method, get_method
from fedspc_app.core.protocol import (
    ACCEPTED_ROUNDS,
    ARRAYS,
    CLIENT_REFERENCE_RECORD,
    CLIPPING_NORM,
    CONFIG,
    CORRECT,
    DEPLOYMENT,
    DURABLE_THROUGH,
    GLOBAL_CORRECT,
    GLOBAL_EXAMPLES,
    GLOBAL_REFERENCE,
    HELD_OUT,
    LOSS_SUM,
    METRICS,
    NODE_QUERY,
    NUM_CLIENTS,
    NUM_EXAMPLES,
    PARTITION_ID,
    PARTITION_QUERY,
    QUERY,
    REFERENCE_CHANGE,
    REFERENCE_UPLOAD,
    ROUND_LEARNING_RATE,
    RUN_NAME,
    RUN_TOKEN,
    SERVER_ROUND,
    SETUP_SECONDS,
    SHARED_STEPS,
    WARM_UP_QUERY,
    WORK_SECONDS,
)
from fedspc_app.core.ranges import (
    FLOAT32_MAX,
    is_number,
    learning_rate_range_text,
    usable_learning_rate,
)
from fedspc_app.core.records import ArrayDict, to_record
from fedspc_app.core.replies import MAX_COUNT, check_arrays, decoded, shown
from fedspc_app.data.run_data import load_partition
from fedspc_app.models.run_model import initial_model
from fedspc_app.models.split import ParameterSplit, parameter_split
from fedspc_app.training.client_data import ClientData, client_data
from fedspc_app.training.precision import apply_determinism

app = ClientApp()

# Under differential privacy a training or evaluation message that fails is answered
# with this text alone, and nothing is logged: an exception raised out of the ClientApp
# is logged by Flower with its text (in a simulation, in the log every client shares),
# and the text (a DivergenceError names its client and round) or that a client failed
# in some round tells who a round drew. The server withholds even this text.
PRIVATE_FAILURE = "a client's {} failed (the reason is withheld under differential privacy)"


def private_run(context: Context) -> bool:
    """Whether the run has differential privacy (``dp-clipping-norm`` > 0), read from
    the raw run-config: a run-config that does not parse is a failure to withhold too."""
    try:
        return float(context.run_config.get("dp-clipping-norm", 0.0) or 0.0) > 0
    except (TypeError, ValueError):
        return False


def withheld_failures(kind: str) -> Callable:
    """Under differential privacy, a handler that raises replies with a Flower error
    whose reason is :data:`PRIVATE_FAILURE` instead, logs nothing, and leaves
    ``context.state`` as it found it (as Flower does when a ClientApp raises); without
    privacy the exception is raised, its text kept for Flower's log and the server."""
    def wrap(handler: Callable[[Message, Context], Message]) -> Callable:
        @functools.wraps(handler)
        def handle(message: Message, context: Context) -> Message:
            if not private_run(context):
                return handler(message, context)
            state = dict(context.state.items())  # records are replaced, never changed
            try:
                return handler(message, context)
            except Exception:  # (its text is what must not get out)
                for key in list(context.state.keys()):
                    del context.state[key]
                context.state.update(state)
                return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                     reason=PRIVATE_FAILURE.format(kind)), reply_to=message)
        return handle
    return wrap

# What a SuperNode's --node-config may hold (simulation sets the first two).
NODE_CONFIG_KEYS = ("partition-id", "num-partitions", "data-dir", "state-dir")


def message_config(message: Message):
    """The ``config`` ConfigRecord of a server message (empty when absent)."""
    return message.content.config_records.get(CONFIG, {})


def check_node_config(node_config) -> tuple[int, int]:
    """Validate this node's config like the run-config; return its partition and count."""
    for key in node_config:
        if key not in NODE_CONFIG_KEYS:
            close = difflib.get_close_matches(str(key).replace("_", "-"), NODE_CONFIG_KEYS,
                                              n=2, cutoff=0.6)
            hint = f" (did you mean: {', '.join(close)}?)" if close else ""
            raise ConfigError(f"unknown node-config key '{key}'{hint}; known keys: "
                              f"{', '.join(NODE_CONFIG_KEYS)}")
    missing = [k for k in ("partition-id", "num-partitions") if k not in node_config]
    if missing:
        raise ConfigError(
            f"this node's config lacks {' and '.join(missing)}: start the SuperNode with "
            "--node-config \"partition-id=<i> num-partitions=<N>\""
        )
    values = {}
    for key in ("partition-id", "num-partitions"):
        value = node_config[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"node-config '{key}' must be an integer, got {value!r}")
        values[key] = value
    for key in ("data-dir", "state-dir"):
        if key in node_config and not isinstance(node_config[key], str):
            raise ConfigError(f"node-config '{key}' must be a quoted path, "
                              f"got {node_config[key]!r}")
    partition_id, num_partitions = values["partition-id"], values["num-partitions"]
    if num_partitions < 1 or not 0 <= partition_id < num_partitions:
        raise ConfigError(f"node-config partition-id={partition_id} is not in "
                          f"[0, num-partitions={num_partitions})")
    return partition_id, num_partitions


def node_run_config(context: Context, message: Message | None = None) -> RunConfig:
    """The run-config as this node uses it: a node-config ``data-dir`` overrides the
    run's, and the run name the server settled on (``message``'s) the requested one."""
    config = parse_run_config(context.run_config)
    data_dir = str(context.node_config.get("data-dir", "") or "")
    if data_dir:
        config = config.replace(data_dir=data_dir)
    if message is None or RUN_NAME not in message_config(message):
        return config
    run_name = message_config(message)[RUN_NAME]
    # It names the folder of this client's state (state-dir): checked as the run-config's
    # (text only: a number or a list is not turned into a folder's name).
    check_run_name(run_name, "the run name the server sent")
    return config.replace(run_name=run_name)


def message_int(message: Message, key: str, minimum: int, default: int | None = None
                ) -> int:
    """The config record's ``key``: an integer (not a bool) of at least ``minimum``;
    ``default`` when absent (``None``: it must be there). The server sends exactly
    this; a string or a float is refused, not coerced (``int("3")``, ``int(2.7)``)."""
    config = message_config(message)
    if key not in config:
        if default is None:
            raise MessageError(f"the server's message lacks '{key}'")
        return default
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or not (
            minimum <= value <= MAX_COUNT):
        raise MessageError(f"the server's '{key}' must be an integer from {minimum} to "
                           f"2^40, got {shown(value)}")
    return value


def message_flag(message: Message, key: str) -> bool:
    """The config record's ``key``: true or false (false when absent); a string such
    as "false" is refused, not taken as true."""
    value = message_config(message).get(key, False)
    if not isinstance(value, bool):
        raise MessageError(f"the server's '{key}' must be true or false, got {shown(value)}")
    return value


def message_token(message: Message) -> str:
    """The run token the message names ("" when absent): the server's 16 hex digits;
    anything else (another type, a path, a text too long to keep in a lock file) is
    refused, as it is written beside the client state and compared with it."""
    value = message_config(message).get(RUN_TOKEN, "")
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{0,64}", value):
        raise MessageError(f"the server's '{RUN_TOKEN}' must be a text of at most 64 "
                          f"hexadecimal digits, got {shown(value)}")
    return value


def node_partition(message: Message, context: Context) -> tuple[int, int]:
    """This node's ``partition-id`` and ``num-partitions``, checked against the server's."""
    partition_id, num_partitions = check_node_config(context.node_config)
    expected = message_int(message, NUM_CLIENTS, 1, default=num_partitions)
    if expected != num_partitions:
        raise ConfigError(
            f"this node was started with num-partitions={num_partitions} but the "
            f"server partitions the data over {expected} clients"
        )
    return partition_id, num_partitions


def message_decisions(message: Message, num_partitions: int) -> Decisions | None:
    """The server's decisions on earlier replies, as this message carries them: one
    round (an integer of at least 0) for each of the ``num_partitions`` partitions."""
    config = message_config(message)
    if ACCEPTED_ROUNDS not in config:
        return None
    if not message_token(message):  # (the files' owner: decisions are of one run)
        raise MessageError(f"the server's message carries '{ACCEPTED_ROUNDS}' but no "
                           f"'{RUN_TOKEN}' naming the run they are of")
    accepted = config[ACCEPTED_ROUNDS]
    if (not isinstance(accepted, list) or len(accepted) != num_partitions
            or any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= MAX_COUNT
                   for r in accepted)):
        raise MessageError(f"the server's '{ACCEPTED_ROUNDS}' must be a list of "
                           f"{num_partitions} integers from 0 to 2^40 (one per partition), "
                           f"got {shown(accepted)}")
    return Decisions(accepted, message_int(message, DURABLE_THROUGH, 0, default=0))


def server_round_of(message: Message) -> int:
    """The round a training or evaluation message is of (at least 1); 0 for a query
    (a simulation's warm-up), which need not name one."""
    if message.metadata.message_type == MessageType.QUERY:
        return message_int(message, SERVER_ROUND, 1, default=0)
    return message_int(message, SERVER_ROUND, 1)


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
    num_partitions: int = 0

    @classmethod
    def from_message(cls, message: Message, context: Context) -> ClientSetup:
        config = node_run_config(context, message)
        round_rate = message_config(message).get(ROUND_LEARNING_RATE)
        if round_rate is not None:  # lr-schedule: this round's η, the one FedSPC divides by
            if config.lr_schedule == "constant":
                raise MessageError(f"the server sent a round's '{ROUND_LEARNING_RATE}', but "
                                  "the run's lr-schedule is 'constant'")
            if not usable_learning_rate(round_rate):
                raise MessageError(f"the round's '{ROUND_LEARNING_RATE}' must be "
                                  f"{learning_rate_range_text()}, got {shown(round_rate)}")
            config = config.replace(learning_rate=float(round_rate))
        round_norm = message_config(message).get(CLIPPING_NORM)
        if round_norm is not None:  # adaptive clipping: this round's C_t, clip to it
            if not (config.dp and config.dp_clipping_quantile > 0):
                raise MessageError(f"the server sent a round's '{CLIPPING_NORM}', but the "
                                  "run has no adaptive clipping (dp-clipping-norm > 0 and "
                                  "dp-clipping-quantile > 0)")
            if not is_number(round_norm) or not 0 < round_norm <= FLOAT32_MAX:
                raise MessageError(f"the round's '{CLIPPING_NORM}' must be a positive "
                                   f"float32 number, got {shown(round_norm)}")
            config = config.replace(dp_clipping_norm=float(round_norm))
        apply_determinism(config.deterministic)
        method = get_method(config.method)
        partition_id, num_partitions = node_partition(message, context)
        data = client_data(config, partition_id, num_partitions)
        model = initial_model(config, data.dataset)
        deployment = message_flag(message, DEPLOYMENT)
        split = parameter_split(model, method, shared_keys=config.shared_keys,
                                personal_keys=config.personal_keys,
                                local_buffers=config.dp)
        store = DurableState.for_node(context.node_config, config.run_dir,
                                      config.resolved_run_name, partition_id,
                                      deployment=deployment, checkpoint=config.checkpoint,
                                      run_token=message_token(message),
                                      client_state_dir=config.client_state_dir,
                                      keeps_state=keeps_client_state(method, config, split))
        return cls(config, method, data, split, model,
                   partition_id, server_round_of(message),
                   store=store, deployment=deployment, num_partitions=num_partitions)

    @property
    def held_out(self) -> bool:
        """Whether this client is one of the run's held-out clients (never trains)."""
        return is_held_out(self.config, self.partition_id, self.num_partitions)

    @property
    def keeps_state(self) -> bool:
        """Whether this method has client state worth keeping between rounds."""
        return keeps_client_state(self.method, self.config, self.split)

    def load_state(self, message: Message, context: Context, *, claim: bool = False
                   ) -> tuple[ClientLedger, ClientState]:
        """Settle the pending state as the server decided; the state to work from.

        With ``claim`` (a training message), files an earlier run of this run name left
        are removed (:meth:`DurableState.claim <clients.durable.DurableState.claim>`),
        but only while the server has aggregated no reply of this partition: a
        message that says it has is not a new run's, whatever its token, and another
        run's files then stop the client instead of being removed."""
        ledger = ClientLedger(context.state, self.store)
        if self.store is not None and self.store.marked:
            self.store.check_view()  # a simulation: the folder as its server wrote it
        decisions = message_decisions(message, self.num_partitions)
        if decisions is None:  # a server that sends no decisions: commit as it comes
            return ledger, ledger.settle(None, self.partition_id)
        where = f"run {self.config.resolved_run_name!r}, partition {self.partition_id}"
        if decisions.durable_through == 0 and self.deployment and self.keeps_state \
                and self.store is None and ClientState.from_records(context.state) is None:
            log(WARNING, "Client state of %s lives only in this SuperNode's memory (no "
                "node-config state-dir): if the SuperNode restarts, or the run is resumed, "
                "this client starts again from the common initial personalized parameters "
                "and u_k = 0. Start it with --node-config \"... state-dir='/var/lib/fedspc'\" "
                "to keep it on disk.", where)
        claim = (claim and decisions.accepted_round(self.partition_id) == 0
                 and self.store is not None and bool(self.store.run_token))
        state = ledger.settle(decisions, self.partition_id, claim=claim)  # (claim first)
        if ledger.claimed and (self.deployment or not self.config.dp):  # (not in a private
            # simulation's shared log, where it would say when a client first trained)
            log(INFO, "Removed the saved client state of an earlier run named like this one "
                "(%s) in %s", where, self.store.directory)
        accepted = decisions.accepted_round(self.partition_id)
        if state.round == accepted:
            return ledger, state
        if state.round > accepted:
            raise ClientStateError(
                f"the saved state of {where} includes round {state.round}, but the server "
                f"last aggregated this client's reply in round {accepted}: the state "
                "belongs to another run with this run name; remove it or pick a run-name")
        if self.store is not None:
            other = (self.store.owner() not in ("", self.store.run_token)
                     or self.store.token_of() not in (None, self.store.run_token))
            raise ClientStateError(
                f"the server last aggregated the reply of {where} in round {accepted}, but "
                f"the saved state in {self.store.directory} is from round {state.round}: "
                + ("the files there are of another run with this run name (kept)"
                   if other else "the client state was lost or replaced"))
        if self.keeps_state and (self.deployment or not self.config.dp):  # (as above)
            log(WARNING, "Client state of %s was lost (it lived only in memory: a restart "
                "loses it, a straggler's copy finishing last replaces it): this client "
                "continues from the state of round %d it holds (round 0: the common initial "
                "personalized parameters and u_k = 0), while the server last aggregated its "
                "reply in round %d", where, state.round, accepted)
        return ledger, replace(state, round=accepted)

    def received_block(self, message: Message) -> ArrayDict:
        """The shared block the message carries: exactly this method's shared entries,
        each of its dtype and shape in the model (:func:`message_arrays`)."""
        model_state = self.model.state_dict()
        return message_arrays(message, ARRAYS, "this method's shared block",
                              {key: like(model_state[key]) for key in self.split.shared})

    def job(self, received: ArrayDict, state: ClientState) -> ClientJob:
        """This round's work for :func:`train_client` or :func:`evaluate_client`."""
        return ClientJob(self.config, self.method, self.model, self.split, received, state,
                         self.data, server_round=self.server_round,
                         partition_id=self.partition_id)


def like(tensor: torch.Tensor) -> np.ndarray:
    """An array with ``tensor``'s shape and dtype that allocates nothing (a reference
    for :func:`message_arrays`)."""
    return np.broadcast_to(np.zeros((), torch.empty(0, dtype=tensor.dtype).numpy().dtype),
                           tuple(tensor.shape))


def message_arrays(message: Message, name: str, what: str,
                   references: Mapping[str, np.ndarray]) -> ArrayDict:
    """The ArrayRecord ``name`` of a server message (``what`` it is, for the error),
    checked as the server checks a client's (:func:`fedspc_app.core.replies.check_arrays`):
    exactly the keys of ``references``, each of its dtype and shape (read from the .npy
    header before any data is decoded: a header that declares a huge array allocates
    nothing), entries finite and within ±1e9. A dtype is never converted: float64 or
    float16 arrays, numbers as text, would otherwise train silently. Returns writable
    copies.

    Raises
    ------
    MessageError
        Naming the record and the first problem.
    """
    record = message.content.array_records.get(name)
    if record is None:
        raise MessageError(f"the server's message lacks the '{name}' arrays ({what})")
    problem = check_arrays(name, record, references)
    if problem:
        raise MessageError(f"the server sent {what} that does not fit: {problem}")
    return {key: np.array(decoded(array)) for key, array in record.items()}


def global_reference_of(message: Message, setup: ClientSetup) -> ArrayDict | None:
    """u_bar as the message carries it (``None``: none sent). It must have exactly the
    corrected keys (the shared trainable parameters), each of its parameter's shape,
    float32, finite and within ±1e9: numpy would broadcast a wrong shape into the
    correction silently, and a non-finite value would spread to every u_k."""
    if GLOBAL_REFERENCE not in message.content.array_records:
        return None
    model_state = setup.model.state_dict()
    return message_arrays(message, GLOBAL_REFERENCE, "a global reference u_bar",
                          {key: np.broadcast_to(np.float32(0), tuple(model_state[key].shape))
                           for key in setup.split.corrected})


def server_kept_reference(message: Message,
                          global_reference: ArrayDict) -> ArrayDict | None:
    """The u_k the server keeps for this client (``fedspc-reference = "server-centre"``),
    which it trains with in place of its own; ``None`` when the message has none. It
    must have u_bar's keys, shapes and dtype, and be finite."""
    if CLIENT_REFERENCE_RECORD not in message.content.array_records:
        return None
    return message_arrays(message, CLIENT_REFERENCE_RECORD, "a client reference",
                          {key: np.broadcast_to(np.float32(0), np.shape(value))
                           for key, value in global_reference.items()})


def timings(started: float, working: float, finished: float) -> dict[str, float]:
    """Where a handler's time went: building its setup and reading its state
    (``setup-seconds``; data loading on a worker's first message), then training or
    evaluating (``work-seconds``; for training, saving the new state too)."""
    return {SETUP_SECONDS: working - started, WORK_SECONDS: finished - working}


def first_message_times(handler_started_at: float) -> dict[str, float]:
    """:func:`fedspc_app.core.startup.first_message_times` of this module's import."""
    return startup.first_message_times(handler_started_at, IMPORT_STARTED_AT, IMPORTED_AT)


@app.train()
@withheld_failures("training")
def train(message: Message, context: Context) -> Message:
    """One round of local training; its new state stays pending until the server
    says whether it aggregated the reply (see :class:`clients.state.ClientLedger`)."""
    started, started_at = time.perf_counter(), time.time()
    setup = ClientSetup.from_message(message, context)
    if setup.held_out:
        raise ConfigError(f"partition {setup.partition_id} is a held-out client "
                          f"(held-out-clients = {setup.config.held_out_clients}): it never "
                          "trains")
    # Everything the message carries is checked before the client's state is touched:
    # a message it cannot use settles no decision, claims nothing and writes nothing.
    received = setup.received_block(message)
    global_reference = global_reference_of(message, setup)
    if global_reference is None and uses_control_variates(setup.method, setup.config):
        raise MessageError(f"the server's message lacks the '{GLOBAL_REFERENCE}' arrays "
                           "(u_bar), which the control variates train with")
    kept = (server_kept_reference(message, global_reference)
            if global_reference is not None else None)
    if kept is not None and setup.config.reference_rule != "server-centre":
        raise MessageError(f"the server sent this client's u_k, but the run's "
                           f"fedspc-reference is {setup.config.reference_rule!r}, not "
                           "'server-centre'")
    ledger, state = setup.load_state(message, context, claim=True)
    if kept is not None:  # fedspc-reference = "server-centre": the server's u_k
        state = replace(state, local_reference=kept)
    job = setup.job(received, state)
    working = time.perf_counter()
    outcome = train_client(job, global_reference=global_reference)
    if not ledger.stage(outcome.state) and (setup.deployment or not setup.config.dp):
        log(WARNING, "Partition %d finished training round %d after a later round (or a "
            "newer run of this run name) had already trained (its reply came too late): "
            "the later state is kept, this round's is not", setup.partition_id,
            setup.server_round)
    worked = time.perf_counter()
    metrics = {**outcome.metrics, PARTITION_ID: setup.partition_id,
               **timings(started, working, worked), **first_message_times(started_at)}
    shared, change = outcome.shared, outcome.reference_change
    if is_attacker(setup.config, setup.partition_id):  # fault injection (run-config attack)
        shared, metrics = attacked_reply(setup.config, setup.partition_id,
                                         setup.server_round, job.received, shared, metrics,
                                         setup.split.corrected)
        if change is not None:
            change = attacked_reference_change(setup.config, job.received, shared,
                                               global_reference, metrics[SHARED_STEPS])
    content = RecordDict({ARRAYS: to_record(shared), METRICS: MetricRecord(metrics)})
    upload = message_config(message).get(REFERENCE_UPLOAD)
    if upload == "explicit" and change is not None:
        content[REFERENCE_CHANGE] = to_record(change)
    return Message(content=content, reply_to=message)


@app.evaluate()
@withheld_failures("evaluation")
def evaluate(message: Message, context: Context) -> Message:
    """Personalized accuracy on this client's own test split; a held-out client's
    after fine-tuning from a new client's start (:mod:`clients.held_out`)."""
    started, started_at = time.perf_counter(), time.time()
    setup = ClientSetup.from_message(message, context)
    held_out = message_flag(message, HELD_OUT)
    if held_out != setup.held_out:
        raise ConfigError(
            f"partition {setup.partition_id} of {setup.num_partitions} is "
            f"{'' if setup.held_out else 'not '}a held-out client (held-out-clients = "
            f"{setup.config.held_out_clients}), but the server "
            f"{'did not evaluate' if setup.held_out else 'evaluated'} it as one")
    received = setup.received_block(message)  # (checked before the state is touched)
    state = ClientState() if held_out else setup.load_state(message, context)[1]
    job = setup.job(received, state)
    working = time.perf_counter()
    outcome = evaluate_new_client(job) if held_out else evaluate_client(job)
    metrics = MetricRecord({
        NUM_EXAMPLES: outcome.examples,
        CORRECT: outcome.correct,
        LOSS_SUM: outcome.loss_sum,
        "accuracy": outcome.accuracy,
        PARTITION_ID: setup.partition_id,
        **({HELD_OUT: 1} if held_out else {}),
        **timings(started, working, time.perf_counter()),
        **first_message_times(started_at),
    })
    if outcome.global_examples is not None:
        metrics[GLOBAL_CORRECT] = int(outcome.global_correct)
        metrics[GLOBAL_EXAMPLES] = int(outcome.global_examples)
    return Message(content=RecordDict({METRICS: metrics}), reply_to=message)


@app.query()
def query(message: Message, context: Context) -> Message:
    """The server's questions: this node's partition id (``NODE_QUERY``, for sampling
    by partition), a simulation's warm-up (``WARM_UP_QUERY``: what round 1 would load,
    loaded while the server prepares), or a deployment's check before training
    (``PARTITION_QUERY``).

    The check loads what round 1 would load (so a missing dataset or a bad node-config
    fails here, before any training) and reports the node's per-class image counts,
    from which the server writes the run's partition file.
    """
    kind = message_config(message).get(QUERY)
    if kind == NODE_QUERY:
        partition_id, num_partitions = check_node_config(context.node_config)
        return Message(RecordDict({METRICS: MetricRecord({
            PARTITION_ID: partition_id, "num-partitions": num_partitions})}),
            reply_to=message)
    if kind == WARM_UP_QUERY:
        started_at = time.time()
        setup = ClientSetup.from_message(message, context)
        return Message(RecordDict({METRICS: MetricRecord({
            PARTITION_ID: setup.partition_id, **first_message_times(started_at)})}),
            reply_to=message)
    if kind != PARTITION_QUERY:
        raise MessageError(f"unknown query {shown(kind)}")
    config = node_run_config(context, message)
    partition_id, num_partitions = node_partition(message, context)
    client_data(config, partition_id, num_partitions)  # data, partition id and device
    partition = load_partition(config, num_partitions)
    store = DurableState.for_node(context.node_config, config.run_dir,
                                  config.resolved_run_name, partition_id, deployment=True,
                                  checkpoint=config.checkpoint)
    if store is not None:  # an unreadable state file fails now, not in the middle of the run
        store.read(any_run=True)
        store.read(PENDING, any_run=True)
    log(INFO, "Partition %d of %d: %d training and %d test images; client state %s",
        partition_id, num_partitions, int(partition.train_counts()[partition_id].sum()),
        int(partition.test_counts()[partition_id].sum()),
        f"kept in {store.directory}" if store else "in memory only")
    metrics = MetricRecord({
        PARTITION_ID: partition_id,
        "num-partitions": num_partitions,
        "num-classes": partition.num_classes,
        "tries": partition.tries,
        "train-counts": [int(v) for v in partition.train_counts()[partition_id]],
        "test-counts": [int(v) for v in partition.test_counts()[partition_id]],
        "durable-state": int(store is not None),
    })
    return Message(content=RecordDict({METRICS: metrics}), reply_to=message)


IMPORTED_AT = time.time()  # this module and its imports are loaded (first_message_times)
