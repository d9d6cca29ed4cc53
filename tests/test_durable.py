"""Node-local durable client state (clients/durable.py) and its use by the ClientApp.

The last tests run the real ClientApp in this process (tests/inprocess.py) and
restart a client by emptying its ``context.state``, as a SuperNode restart does:
with a ``state-dir`` the next round is bit for bit the round the client would have
trained without the restart; without one it starts over, with a warning.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    RecordDict,
)
from inprocess import InProcessGrid

from clients import ClientState
from clients.durable import DurableState, DurableStateError
from clients.state import INFO, LOCAL_REFERENCE, PERSONAL
from fedspc_app import client_app
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.datasets import load_dataset
from fedspc_app.core.methods import get_method
from fedspc_app.core.task import (
    from_record,
    make_model,
    parameter_split,
    state_arrays,
    to_record,
)
from strategies.fedspc import GLOBAL_REFERENCE
from strategies.personalized import ARRAYS, METRICS


def sample_state(rounds: int = 3) -> ClientState:
    rng = np.random.default_rng(rounds)
    return ClientState(
        personal={"head.weight": rng.normal(size=(10, 4)).astype(np.float32),
                  "head.bias": rng.normal(size=10).astype(np.float32),
                  "bn.num_batches_tracked": np.array(7, dtype=np.int64)},
        local_reference={"body.weight": rng.normal(size=(4, 3)).astype(np.float32)},
        personal_model=None,
        rounds_trained=rounds,
    )


def assert_same_state(left: ClientState, right: ClientState) -> None:
    assert left.rounds_trained == right.rounds_trained
    for field in ("personal", "local_reference", "personal_model"):
        a, b = getattr(left, field), getattr(right, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert set(a) == set(b)
            for key in a:
                assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape
                np.testing.assert_array_equal(a[key], b[key])


def context(state_dir=None, *, run_id: int = 11, partition_id: int = 2) -> Context:
    node_config = {"partition-id": partition_id, "num-partitions": 4}
    if state_dir is not None:
        node_config["state-dir"] = str(state_dir)
    return Context(run_id=run_id, node_id=5, node_config=node_config, state=RecordDict(),
                   run_config={})


# ------------------------------------------------------------------------ the store
def test_store_is_named_by_state_dir_run_and_partition(tmp_path):
    assert DurableState.from_context(context()) is None
    assert DurableState.from_context(context("")) is None
    store = DurableState.from_context(context(tmp_path, run_id=123, partition_id=3))
    assert store.path == tmp_path / "run-123" / "partition-3.npz"


def test_write_then_read_gives_the_same_state_with_dtypes_and_0d_arrays(tmp_path):
    store = DurableState(tmp_path, run_id=1, partition_id=0)
    assert store.read() is None and not store.path.exists()
    state = sample_state()
    store.write(state)
    assert store.path.is_file()
    assert_same_state(store.read(), state)
    # A later round replaces the file.
    store.write(sample_state(4))
    assert store.read().rounds_trained == 4
    assert sorted(p.name for p in store.path.parent.iterdir()) == ["partition-0.npz"]


def test_ditto_personal_model_round_trips(tmp_path):
    store = DurableState(tmp_path, run_id=1, partition_id=0)
    state = ClientState(personal_model={"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
                        rounds_trained=1)
    store.write(state)
    assert_same_state(store.read(), state)


def test_failed_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    store = DurableState(tmp_path, run_id=1, partition_id=0)
    store.write(sample_state(2))

    def broken_savez(handle, **arrays):
        handle.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr("clients.durable.np.savez", broken_savez)
    with pytest.raises(OSError, match="disk full"):
        store.write(sample_state(3))
    assert_same_state(store.read(), sample_state(2))
    assert os.listdir(store.path.parent) == ["partition-0.npz"]


def test_unreadable_file_is_an_error_not_a_fresh_start(tmp_path):
    store = DurableState(tmp_path, run_id=1, partition_id=0)
    store.path.parent.mkdir(parents=True)
    store.path.write_bytes(b"not a zip file")
    with pytest.raises(DurableStateError, match="Move the file away"):
        store.read()


def test_file_of_another_run_or_partition_is_refused(tmp_path):
    DurableState(tmp_path, run_id=1, partition_id=0).write(sample_state())
    other = DurableState(tmp_path, run_id=2, partition_id=0)
    other.path.parent.mkdir(parents=True)
    os.replace(tmp_path / "run-1" / "partition-0.npz", other.path)
    with pytest.raises(DurableStateError, match="run 1 partition 0"):
        other.read()


# ------------------------------------------------------------- ClientState.load/commit
def test_load_restores_an_empty_context_state_from_the_store(tmp_path):
    store = DurableState(tmp_path, run_id=1, partition_id=0)
    store.write(sample_state(3))
    records = RecordDict()
    loaded = ClientState.load(records, store)
    assert_same_state(loaded, sample_state(3))
    # ... and puts it back into context.state, so later messages find it in memory.
    assert INFO in records and PERSONAL in records and LOCAL_REFERENCE in records
    assert_same_state(ClientState.load(records), sample_state(3))


def test_memory_wins_over_the_file_while_the_supernode_runs(tmp_path):
    store = DurableState(tmp_path, run_id=1, partition_id=0)
    store.write(sample_state(1))
    records = RecordDict()
    sample_state(5).commit(records)
    assert ClientState.load(records, store).rounds_trained == 5


def test_commit_writes_the_file_and_memory(tmp_path):
    store = DurableState(tmp_path, run_id=1, partition_id=0)
    records = RecordDict()
    sample_state(2).commit(records, store)
    assert_same_state(store.read(), sample_state(2))
    assert_same_state(ClientState.load(records), sample_state(2))


def test_commit_with_a_failing_store_leaves_memory_at_the_previous_round(tmp_path):
    (tmp_path / "run-1").write_text("a file where the run folder should be")
    store = DurableState(tmp_path, run_id=1, partition_id=0)
    records = RecordDict()
    sample_state(1).commit(records)
    with pytest.raises(OSError):
        sample_state(2).commit(records, store)
    assert ClientState.load(records).rounds_trained == 1


# ------------------------------------------------------- the ClientApp across a restart
RUN_CONFIG = {"method": "fedrep", "fedspc": True, "local-epochs": 1, "batch-size": 64,
              "alpha": 0.5, "learning-rate": 0.05}


def round_inputs():
    """The server's first broadcast: the initial shared block and u_bar = 0."""
    config = parse_run_config(RUN_CONFIG)
    model = make_model(config, load_dataset("digits", None))
    split = parameter_split(model, get_method("fedrep"))
    shared = state_arrays(model, split.shared)
    zeros = {key: np.zeros_like(shared[key]) for key in split.corrected}
    return shared, zeros, split


def train_message(server_round: int, shared, u_bar, node_id: int) -> Message:
    content = RecordDict({
        ARRAYS: to_record(shared),
        GLOBAL_REFERENCE: to_record(u_bar),
        "config": ConfigRecord({"server-round": server_round, "num-clients": 2,
                                "deployment": True}),
    })
    return Message(content=content, dst_node_id=node_id, message_type=MessageType.TRAIN)


@pytest.fixture
def flwr_log():
    """Records of Flower's logger (the ClientApp logs through it)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def two_rounds(tmp_path, *, state_dir: bool, restart: bool):
    """Round 1, optionally a SuperNode restart, round 2 on partition 0; the round-2 reply."""
    grid = InProcessGrid(client_app.app, 2, RUN_CONFIG)
    if state_dir:
        grid.contexts[1].node_config["state-dir"] = str(tmp_path / "state")
    shared, u_bar, _ = round_inputs()
    first = grid.deliver(train_message(1, shared, u_bar, node_id=1))
    assert not first.has_error(), first.error
    if restart:
        grid.contexts[1].state = RecordDict()
    second = grid.deliver(train_message(2, shared, u_bar, node_id=1))
    assert not second.has_error(), second.error
    return grid, first, second


def test_restarted_client_with_state_dir_trains_as_if_never_restarted(tmp_path, flwr_log):
    _, _, uninterrupted = two_rounds(tmp_path / "a", state_dir=False, restart=False)
    grid, first, restarted = two_rounds(tmp_path / "b", state_dir=True, restart=True)
    assert first.content.metric_records[METRICS]["rounds-trained"] == 1
    assert restarted.content.metric_records[METRICS]["rounds-trained"] == 2
    # Same personalized head and u_k as without the restart: the same upload, bit for bit.
    for key, value in from_record(uninterrupted.content.array_records[ARRAYS]).items():
        np.testing.assert_array_equal(
            from_record(restarted.content.array_records[ARRAYS])[key], value)
    store = DurableState(tmp_path / "b" / "state", run_id=1, partition_id=0)
    saved = store.read()
    assert saved.rounds_trained == 2
    in_memory = ClientState.load(grid.state(0))
    assert_same_state(saved, in_memory)
    messages = [r.getMessage() for r in flwr_log]
    assert any("Restored the client state of run 1, partition 0" in m
               and "(1 rounds trained)" in m for m in messages)


def test_restarted_client_without_state_dir_starts_over_and_warns(tmp_path, flwr_log):
    _, _, uninterrupted = two_rounds(tmp_path / "a", state_dir=False, restart=False)
    _, _, restarted = two_rounds(tmp_path / "b", state_dir=False, restart=True)
    assert restarted.content.metric_records[METRICS]["rounds-trained"] == 1
    differs = [not np.array_equal(value, from_record(
        restarted.content.array_records[ARRAYS])[key])
        for key, value in from_record(uninterrupted.content.array_records[ARRAYS]).items()]
    assert any(differs)  # u_k = 0 and the initial head again: a different round
    warnings = [r.getMessage() for r in flwr_log if r.levelno == logging.WARNING]
    assert any("lives only in this SuperNode's memory" in m and "u_k = 0" in m
               for m in warnings)


def test_no_memory_only_warning_in_simulation(tmp_path, flwr_log):
    grid = InProcessGrid(client_app.app, 2, RUN_CONFIG)
    shared, u_bar, _ = round_inputs()
    message = train_message(1, shared, u_bar, node_id=1)
    message.content.config_records["config"]["deployment"] = False
    assert not grid.deliver(message).has_error()
    assert not [r for r in flwr_log if r.levelno >= logging.WARNING]


def test_failed_round_leaves_the_state_file_untouched(tmp_path):
    grid = InProcessGrid(client_app.app, 2, RUN_CONFIG)
    grid.contexts[1].node_config["state-dir"] = str(tmp_path)
    shared, u_bar, _ = round_inputs()
    assert not grid.deliver(train_message(1, shared, u_bar, node_id=1)).has_error()
    store = DurableState(tmp_path, run_id=1, partition_id=0)
    before = store.path.read_bytes()
    broken = train_message(2, shared, u_bar, node_id=1)
    broken.content[GLOBAL_REFERENCE] = ArrayRecord()  # the client cannot train with this
    assert grid.deliver(broken).has_error()
    assert store.path.read_bytes() == before
