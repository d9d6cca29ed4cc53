"""Client state kept in files (clients/durable.py) and the ledger that commits it
(clients/state.py), alone and inside the real ClientApp (tests/inprocess.py).

A client restart is simulated by emptying its ``context.state``, as a SuperNode
restart does: with a ``state-dir`` the next round is bit for bit the round the
client would have trained without the restart; without one it starts over, with a
warning.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import types

import numpy as np
import pytest
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    RecordDict,
)
from inprocess import InProcessGrid, run_server

from clients.durable import (
    DurableState,
    DurableStateError,
    keep_final_personal,
    simulation_folder,
    write_view_marker,
)
from clients.state import (
    COMMITTED,
    PENDING,
    ClientLedger,
    ClientState,
    Decisions,
)
from fedspc_app import client_app
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.methods import get_method
from fedspc_app.core.protocol import ARRAYS, GLOBAL_REFERENCE, METRICS
from fedspc_app.core.records import from_record, to_record
from fedspc_app.data.datasets import load_dataset
from fedspc_app.models.run_model import make_model, state_arrays
from fedspc_app.models.split import parameter_split


def sample_state(rounds: int = 3) -> ClientState:
    rng = np.random.default_rng(rounds)
    return ClientState(
        personal={"head.weight": rng.normal(size=(10, 4)).astype(np.float32),
                  "head.bias": rng.normal(size=10).astype(np.float32),
                  "bn.num_batches_tracked": np.array(7, dtype=np.int64)},
        local_reference={"body.weight": rng.normal(size=(4, 3)).astype(np.float32)},
        personal_model=None,
        rounds_trained=rounds,
        round=rounds,
    )


def assert_same_state(left: ClientState, right: ClientState) -> None:
    assert (left.rounds_trained, left.round) == (right.rounds_trained, right.round)
    for field in ("personal", "local_reference", "personal_model"):
        a, b = getattr(left, field), getattr(right, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert set(a) == set(b)
            for key in a:
                assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape
                np.testing.assert_array_equal(a[key], b[key])


def store_in(tmp_path, *, token: str = "t1", partition_id: int = 0) -> DurableState:
    return DurableState(tmp_path, "run", partition_id, token)


# ------------------------------------------------------------------------ the store
def test_where_each_node_keeps_its_state(tmp_path):
    args = dict(run_dir=tmp_path / "results" / "r", run_name="r", partition_id=3)
    assert DurableState.for_node({}, **args, deployment=True, checkpoint=True) is None
    assert DurableState.for_node({}, **args, deployment=False, checkpoint=False) is None
    simulated = DurableState.for_node({}, **args, deployment=False, checkpoint=True)
    assert simulated.path() == tmp_path / "results" / "r" / "client-state" / "partition-3.npz"
    node = DurableState.for_node({"state-dir": str(tmp_path / "s")}, **args, deployment=True,
                                 checkpoint=False)
    assert node.path() == tmp_path / "s" / "r" / "partition-3.npz"
    assert node.path(PENDING) == tmp_path / "s" / "r" / "partition-3.pending.npz"


def test_write_then_read_gives_the_same_state_with_dtypes_and_0d_arrays(tmp_path):
    store = store_in(tmp_path)
    assert store.read() is None and store.read(PENDING) is None
    state = sample_state()
    store.write(state)
    assert_same_state(store.read(), state)
    store.write(sample_state(4), PENDING)
    assert_same_state(store.read(PENDING), sample_state(4))
    assert_same_state(store.read(), state)  # the committed slot is untouched


def test_commit_renames_pending_over_committed_and_discard_drops_it(tmp_path):
    store = store_in(tmp_path)
    store.write(sample_state(1))
    store.write(sample_state(2), PENDING)
    store.commit()
    assert_same_state(store.read(), sample_state(2))
    assert store.read(PENDING) is None
    store.write(sample_state(3), PENDING)
    store.discard()
    assert_same_state(store.read(), sample_state(2))
    assert sorted(os.listdir(tmp_path)) == ["partition-0.npz"]


def test_client_state_is_for_its_owner_only(tmp_path):
    """Personalized models and u_k never leave the node: under the usual umask the
    files are 0600 and the run's folder (a deployment's, a simulation's) 0700."""
    previous = os.umask(0o022)
    try:
        store = DurableState.for_node({"state-dir": str(tmp_path / "state")}, tmp_path,
                                      "run", 0, deployment=True, checkpoint=True)
        store.stage(sample_state(2))
        store.write(sample_state(1))
        simulation = simulation_folder(tmp_path / "out", "run")
        write_view_marker(simulation, "run", "t")
        DurableState(simulation, "run", 0, "t").write(sample_state(1))
        keep_final_personal(simulation)
    finally:
        os.umask(previous)

    def mode(path):
        return oct(path.stat().st_mode & 0o777)
    assert mode(store.directory) == mode(simulation) == oct(0o700)
    assert {mode(path) for path in (store.path(), store.path(PENDING),
                                    store.directory / ".partition-0.lock",
                                    simulation / "partition-0.npz")} == {oct(0o600)}
    assert mode(tmp_path / "state") == oct(0o755)  # the state-dir is the node's own


def test_an_existing_run_folder_open_to_others_is_made_private(tmp_path):
    """A <state-dir>/<run-name> folder this user made earlier with a looser mode (or
    under a looser umask) holds u_k too: it is tightened to 0700 when used."""
    folder = tmp_path / "run"
    folder.mkdir()
    folder.chmod(0o777)
    DurableState(folder, "run", 0, "t").stage(sample_state(1))
    assert oct(folder.stat().st_mode & 0o777) == oct(0o700)


def test_ditto_personal_model_round_trips(tmp_path):
    store = store_in(tmp_path)
    state = ClientState(personal_model={"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
                        rounds_trained=1, round=1)
    store.write(state)
    assert_same_state(store.read(), state)


def test_failed_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    store = store_in(tmp_path)
    store.write(sample_state(2))

    def broken_savez(handle, **arrays):
        handle.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr("clients.durable.np.savez", broken_savez)
    with pytest.raises(OSError, match="disk full"):
        store.write(sample_state(3))
    assert_same_state(store.read(), sample_state(2))
    assert os.listdir(tmp_path) == ["partition-0.npz"]


def test_unreadable_file_is_an_error_not_a_fresh_start(tmp_path):
    store = store_in(tmp_path)
    store.path().write_bytes(b"not a zip file")
    with pytest.raises(DurableStateError, match="Move the file away"):
        store.read()


def test_file_of_another_partition_is_refused(tmp_path):
    store_in(tmp_path, partition_id=0).write(sample_state())
    other = store_in(tmp_path, partition_id=1)
    os.replace(tmp_path / "partition-0.npz", other.path())
    with pytest.raises(DurableStateError, match="partition 0"):
        other.read()


def test_claim_removes_what_another_run_with_the_same_name_left(tmp_path):
    store_in(tmp_path, token="old").write(sample_state(5))
    store_in(tmp_path, token="old").write(sample_state(6), PENDING)
    assert store_in(tmp_path, token="old").claim() is False  # its own files stay
    assert store_in(tmp_path, token="new").claim() is True
    assert os.listdir(tmp_path) == [".partition-0.lock"]  # (it names the new owner)
    assert store_in(tmp_path, token="new").owner() == "new"


def test_a_file_that_goes_while_being_read_is_no_file(tmp_path, monkeypatch):
    """Another process of the partition committed or discarded it in between."""
    store = store_in(tmp_path)
    store.write(sample_state(2), PENDING)

    def gone(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory")
    monkeypatch.setattr("clients.durable.np.load", gone)
    assert store.read(PENDING) is None


def test_a_file_that_cannot_be_opened_now_is_kept_not_moved_away(tmp_path, monkeypatch):
    store = store_in(tmp_path)
    store.write(sample_state(2))

    def unreadable(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr("clients.durable.np.load", unreadable)
    with pytest.raises(DurableStateError, match="Keep the file") as raised:
        store.read()
    assert "Move the file away" not in str(raised.value)


def test_files_of_another_run_are_never_read_as_this_runs_state(tmp_path):
    store_in(tmp_path, token="a").write(sample_state(1), PENDING)
    assert store_in(tmp_path, token="b").read(PENDING) is None
    assert store_in(tmp_path, token="b").token_of(PENDING) == "a"
    assert store_in(tmp_path, token="").read(PENDING) is None  # (no token: no run's)
    assert store_in(tmp_path, token="").read(PENDING, any_run=True).round == 1  # (export)


def test_settle_claims_the_partition_under_its_lock(tmp_path):
    """An earlier run's straggler cannot stage between the claim and the read."""
    store_in(tmp_path, token="a").write(sample_state(1), PENDING)
    ledger = ClientLedger(RecordDict(), store_in(tmp_path, token="b"))
    settled = []
    late = threading.Thread(target=lambda: settled.append(ledger.settle(decided(1, 1), 0, claim=True)))
    with store_in(tmp_path).lock():
        late.start()
        late.join(timeout=0.3)
        assert late.is_alive() and store_in(tmp_path).path(PENDING).exists()
    late.join(timeout=10)
    assert settled[0].round == 0 and ledger.claimed
    assert not store_in(tmp_path).path(PENDING).exists()


@pytest.mark.parametrize("straggler_last", [False, True])
def test_a_straggler_of_an_earlier_run_with_this_name_keeps_nothing(tmp_path,
                                                                    straggler_last):
    """Run "a" was stopped while partition 0 still trained its round 50; run "b",
    with the same run name, starts. Whether that straggler finishes before or after
    b's round 1 stages, b's state is the one kept, and b goes on."""
    store_in(tmp_path, token="a").write(sample_state(49))
    old = ClientLedger(RecordDict(), store_in(tmp_path, token="a"))
    new = ClientLedger(RecordDict(), store_in(tmp_path, token="b"))
    assert new.settle(decided(0, 0), 0, claim=True).round == 0 and new.claimed  # b's round 1
    if not straggler_last:
        assert old.stage(sample_state(50)) is False
    assert new.stage(ClientState(rounds_trained=1, round=1)) is True
    if straggler_last:
        assert old.stage(sample_state(50)) is False
    assert new.settle(decided(1, 1), 0).round == 1
    assert store_in(tmp_path, token="").token_of() == "b"


def test_temporary_files_a_killed_client_left_are_removed(tmp_path):
    """A client killed between writing a state file and renaming it leaves a
    temporary file holding u_k: its partition's next settle removes it (another
    partition's stay), and so does stripping a finished simulation's state."""
    store_in(tmp_path).write(sample_state(1))
    names = [".partition-0.npz.a1.tmp", ".partition-0.pending.npz.b2.tmp",
             ".partition-1.npz.c3.tmp", ".partition-10.pending.npz.d4.tmp"]
    for name in names:
        (tmp_path / name).write_bytes(b"u_k")
    ClientLedger(RecordDict(), store_in(tmp_path)).settle(decided(1, 1), 0)
    assert sorted(p.name for p in tmp_path.glob("*.tmp")) == sorted(names[2:])
    keep_final_personal(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))


# ----------------------------------------------------------------- the ledger
@pytest.fixture(params=["memory", "files"])
def ledger(request, tmp_path):
    return ClientLedger(RecordDict(), store_in(tmp_path) if request.param == "files" else None)


def decided(accepted_round: int, durable_through: int) -> Decisions:
    return Decisions([accepted_round, 0], durable_through)


def test_an_accepted_durable_reply_commits_the_staged_state(ledger):
    ledger.stage(sample_state(1))
    assert ledger.committed().round == 0  # nothing committed before the decision
    state = ledger.settle(decided(1, 1), partition_id=0)
    assert_same_state(state, sample_state(1))
    assert_same_state(ledger.committed(), sample_state(1))
    assert ledger.read(PENDING) is None


def test_a_dropped_reply_discards_the_staged_state(ledger):
    ledger.stage(sample_state(1))
    ledger.settle(decided(1, 1), partition_id=0)
    ledger.stage(sample_state(2))
    state = ledger.settle(decided(1, 2), partition_id=0)  # round 2 was not aggregated
    assert_same_state(state, sample_state(1))
    assert ledger.read(PENDING) is None


def test_an_accepted_reply_not_yet_checkpointed_is_used_but_not_committed(ledger):
    ledger.stage(sample_state(1))
    state = ledger.settle(decided(1, 0), partition_id=0)
    assert_same_state(state, sample_state(1))
    assert ledger.committed().round == 0
    assert ledger.read(PENDING) is not None


def test_a_stale_attempt_of_a_redone_round_is_discarded(ledger):
    """The server restarted from its round-1 checkpoint while round 2 was running."""
    ledger.stage(sample_state(1))
    ledger.settle(decided(1, 1), partition_id=0)
    ledger.stage(sample_state(2))
    assert_same_state(ledger.settle(decided(1, 1), partition_id=0), sample_state(1))
    assert ledger.read(PENDING) is None


def test_without_decisions_the_pending_state_is_committed_under_the_lock(tmp_path):
    """A server that sends no decisions (another strategy): every reply counts as
    accepted, and the commit waits for the partition's lock like a settle does, so a
    straggler's stage cannot interleave with it."""
    store_in(tmp_path, token="b").write(sample_state(1), PENDING)
    ledger = ClientLedger(RecordDict(), store_in(tmp_path, token="b"))
    settled = []
    late = threading.Thread(target=lambda: settled.append(ledger.settle(None, 0)))
    with store_in(tmp_path).lock():
        late.start()
        late.join(timeout=0.3)
        assert late.is_alive() and store_in(tmp_path).path(PENDING).exists()
    late.join(timeout=10)
    assert settled[0].round == 1 and not store_in(tmp_path).path(PENDING).exists()
    assert store_in(tmp_path, token="b").read().round == 1


def test_a_stragglers_late_stage_keeps_the_next_rounds_pending_state(tmp_path):
    """Round 3's training outlives its round-timeout; round 4 trains (in another
    process, on the same files) and is aggregated; round 3 finishes last. Its state
    must not replace round 4's, from which round 5 trains."""
    straggler = ClientLedger(RecordDict(), store_in(tmp_path))
    next_round = ClientLedger(RecordDict(), store_in(tmp_path))
    store_in(tmp_path).write(sample_state(2))  # rounds 1 and 2 committed
    assert straggler.settle(decided(2, 2), partition_id=0).round == 2  # round 3 starts
    assert next_round.settle(decided(2, 3), partition_id=0).round == 2  # round 4 starts
    next_round.stage(sample_state(4))
    kept = straggler.stage(sample_state(3))  # too late: round 4's state stays
    assert next_round.read(PENDING).round == 4 and kept is False
    state = ClientLedger(RecordDict(), store_in(tmp_path)).settle(decided(4, 4), 0)
    assert_same_state(state, sample_state(4))  # round 5 trains from round 4


def test_memory_stage_never_replaces_a_newer_pending_state():
    ledger = ClientLedger(RecordDict())
    ledger.stage(sample_state(4))
    kept = ledger.stage(sample_state(3))
    assert_same_state(ledger.read(PENDING), sample_state(4))
    assert kept is False
    assert ledger.stage(sample_state(4)) and ledger.stage(sample_state(5))  # same or newer


def test_stage_compares_and_writes_under_the_partitions_lock(tmp_path):
    """Another process holding the lock (here: another open file of it) is waited for,
    and what it wrote meanwhile is compared against."""
    store = store_in(tmp_path)
    outcome = []
    late = threading.Thread(target=lambda: outcome.append(store.stage(sample_state(3))))
    with store_in(tmp_path).lock():
        late.start()
        late.join(timeout=0.3)
        assert late.is_alive() and not outcome  # waiting for the lock
        store_in(tmp_path).write(sample_state(4), PENDING)  # the next round's, meanwhile
    late.join(timeout=10)
    assert outcome == [False] and store.read(PENDING).round == 4


def test_memory_slots_never_leave_the_records_half_written():
    records = RecordDict()
    sample_state(1).to_records(records, PENDING)
    ClientState(round=2, rounds_trained=2).to_records(records, PENDING)  # no arrays
    state = ClientState.from_records(records, PENDING)
    assert state.personal is None and state.round == 2
    assert ClientState.from_records(records, COMMITTED) is None


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
    """Round ``server_round``; every earlier reply of both clients was aggregated."""
    content = RecordDict({
        ARRAYS: to_record(shared),
        GLOBAL_REFERENCE: to_record(u_bar),
        "config": ConfigRecord({"server-round": server_round, "num-clients": 2,
                                "deployment": True, "run-token": "7e",
                                "accepted-rounds": [server_round - 1] * 2,
                                "durable-through": server_round - 1}),
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
    store = DurableState(tmp_path / "b" / "state" / "digits-cnn-fedrep+fedspc-a0.5-s0",
                         "digits-cnn-fedrep+fedspc-a0.5-s0", 0, "7e")
    assert store.read().round == 1 and store.read(PENDING).round == 2
    assert ClientState.from_records(grid.state(0)) is None  # files only, no copy in memory


def test_restarted_client_without_state_dir_starts_over_and_warns(tmp_path, flwr_log):
    _, _, uninterrupted = two_rounds(tmp_path / "a", state_dir=False, restart=False)
    _, _, restarted = two_rounds(tmp_path / "b", state_dir=False, restart=True)
    assert restarted.content.metric_records[METRICS]["rounds-trained"] == 1
    differs = [not np.array_equal(value, from_record(
        restarted.content.array_records[ARRAYS])[key])
        for key, value in from_record(uninterrupted.content.array_records[ARRAYS]).items()]
    assert any(differs)  # u_k = 0 and the initial head again: a different round
    warnings = [r.getMessage() for r in flwr_log if r.levelno == logging.WARNING]
    assert any("lives only in this SuperNode's memory" in m for m in warnings)  # round 1
    assert any("was lost" in m and "u_k = 0" in m and "round 1" in m for m in warnings)


def test_memory_state_behind_the_server_says_it_continues_from_it(flwr_log, task_identity):
    """In memory, a straggler's copy of the state that finishes last replaces the newer
    one: the client goes on from the round it holds, and its warning says so."""
    shared, u_bar, split = round_inputs()
    setup = client_app.ClientSetup(parse_run_config(RUN_CONFIG), get_method("fedrep"),
                                   None, split, None, 0, 5, deployment=True,
                                   num_partitions=2)
    records = RecordDict()
    sample_state(2).to_records(records)  # the straggler's copy: round 2 committed
    message = train_message(5, shared, u_bar, node_id=1)  # round 4 was aggregated
    _, state = setup.load_state(message, types.SimpleNamespace(state=records))
    assert state.round == 4 and state.rounds_trained == 2
    warnings = [r.getMessage() for r in flwr_log if r.levelno == logging.WARNING]
    assert any("continues from the state of round 2 it holds" in m
               and "in round 4" in m for m in warnings)


@pytest.mark.parametrize("run_name", [
    "../../escape", "a/b", ".", "..", "", "a\\b", "a\x00b", "evil\n", "\u202eexe.txt",
    "r" * 201, 5, True, ["x"], b"bytes"])
def test_a_run_name_that_is_not_a_plain_name_is_refused(tmp_path, run_name):
    """The run name a message carries names the folder of the client's state under
    state-dir: it cannot point outside it, hide a line break or a right-to-left
    override, or exceed a folder name's length; and it is text (a number or a list is
    not turned into a folder name)."""
    grid = InProcessGrid(client_app.app, 2, RUN_CONFIG)
    grid.contexts[1].node_config["state-dir"] = str(tmp_path / "a" / "b" / "state")
    shared, u_bar, _ = round_inputs()
    message = train_message(1, shared, u_bar, node_id=1)
    message.content.config_records["config"]["run-name"] = run_name
    reply = grid.deliver(message)
    assert reply.has_error()
    assert "the run name the server sent must be a plain name" in reply.error.reason
    assert (repr(run_name[:60]) if isinstance(run_name, str)
            else f"a {type(run_name).__name__}") in reply.error.reason
    assert not list(tmp_path.rglob("*"))  # not even a folder or a lock


def test_no_memory_only_warning_in_simulation(tmp_path, flwr_log):
    run_config = {**RUN_CONFIG, "output-dir": str(tmp_path)}
    grid = InProcessGrid(client_app.app, 2, run_config)
    shared, u_bar, _ = round_inputs()
    message = train_message(1, shared, u_bar, node_id=1)
    message.content.config_records["config"]["deployment"] = False
    config = parse_run_config(run_config)  # the server's mark, as a simulation writes it
    write_view_marker(simulation_folder(config.run_dir, config.resolved_run_name),
                      config.resolved_run_name, "7e")
    assert not grid.deliver(message).has_error()
    assert not [r for r in flwr_log if r.levelno >= logging.WARNING]


def trained_rounds(tmp_path, rounds: int):
    """Partition 0 (node 1, state-dir ``tmp_path``) trained rounds 1 … ``rounds``, every
    earlier reply aggregated: the grid, its run folder and the files in it by name."""
    grid = InProcessGrid(client_app.app, 2, RUN_CONFIG)
    grid.contexts[1].node_config["state-dir"] = str(tmp_path)
    shared, u_bar, _ = round_inputs()
    for server_round in range(1, rounds + 1):
        assert not grid.deliver(train_message(server_round, shared, u_bar,
                                              node_id=1)).has_error()
    folder = tmp_path / "digits-cnn-fedrep+fedspc-a0.5-s0"
    return grid, folder, {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_message_the_client_cannot_use_touches_no_state(tmp_path):
    """A message refused for its arrays settles no decision (its decisions are as
    untrusted as the rest of it), stages nothing and claims nothing, whatever its
    token; the next usable message settles round 2 as the server decided."""
    grid, folder, files = trained_rounds(tmp_path, 2)
    shared, u_bar, _ = round_inputs()
    round_2 = files["partition-0.pending.npz"]
    for token in ("7e", "ab"):  # this run's token, and another run's
        broken = train_message(3, shared, u_bar, node_id=1)  # says: round 2 was aggregated
        broken.content.config_records["config"]["run-token"] = token
        broken.content[GLOBAL_REFERENCE] = ArrayRecord()  # the client cannot train with this
        assert grid.deliver(broken).has_error()
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == files
    assert not grid.deliver(train_message(3, shared, u_bar, node_id=1)).has_error()
    assert (folder / "partition-0.npz").read_bytes() == round_2  # committed now


def test_only_a_new_runs_training_message_removes_another_runs_files(tmp_path):
    """Files of another run of this run name are removed by a training message that
    says the server has aggregated nothing of this partition yet (a new run), never by
    an evaluation message or by one that says it has: that one stops the client with
    the files kept."""
    grid, folder, files = trained_rounds(tmp_path, 2)
    shared, u_bar, _ = round_inputs()
    evaluation = train_message(3, shared, u_bar, node_id=1)
    evaluation.metadata.message_type = MessageType.EVALUATE
    del evaluation.content.array_records[GLOBAL_REFERENCE]
    later = train_message(3, shared, u_bar, node_id=1)  # accepted-rounds [2, 2]
    for message in (evaluation, later):
        message.content.config_records["config"]["run-token"] = "ab"
        reply = grid.deliver(message)
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == files
    assert reply.has_error() and "of another run with this run name (kept)" in (
        reply.error.reason)
    new_run = train_message(1, shared, u_bar, node_id=1)  # accepted-rounds [0, 0]
    new_run.content.config_records["config"]["run-token"] = "ab"
    assert not grid.deliver(new_run).has_error()
    assert sorted(p.name for p in folder.iterdir()) == [".partition-0.lock",
                                                         "partition-0.pending.npz"]


# ------------------------------------------- a simulation's folder, as every node sees it
def simulate(tmp_path, views=None, **keys):
    """FedRep + FedSPC, 2 rounds, 2 clients, checkpoint on; ``views`` maps a node id to
    the client-state-dir that node sees (another node's view of the folder)."""
    run_config = {"method": "fedrep", "fedspc": True, "num-rounds": 2, "local-epochs": 1,
                  "alpha": 0.5, "output-dir": str(tmp_path / "out"), "run-name": "run",
                  "keep-client-state": True, **keys}
    grid = InProcessGrid(client_app.app, 2, run_config)
    for node_id, folder in (views or {}).items():
        grid.contexts[node_id].run_config["client-state-dir"] = str(folder)
    error = run_server(grid, run_config)
    rounds = json.loads((tmp_path / "out" / "run" / "metrics.json").read_text())["rounds"]
    return rounds, error


def test_client_state_dir_holds_the_clients_state_under_the_run_name(tmp_path):
    shared = tmp_path / "shared"
    rounds, error = simulate(tmp_path, **{"client-state-dir": str(shared)})
    assert error is None and [r["train-dropped"] for r in rounds] == [0, 0]
    assert sorted(p.name for p in (shared / "run").iterdir()) == [
        ".partition-0.lock", ".partition-1.lock", "partition-0.npz", "partition-1.npz",
        "run.json"]
    assert not (tmp_path / "out" / "run" / "client-state").exists()


def test_a_node_that_sees_another_folder_stops_before_it_trains(tmp_path):
    """Node 2 sees an empty folder where the server wrote run.json (as a node of a Ray
    cluster whose disk is not shared would): its client stops every round with one
    error naming the folder and the fix, writes no state, and the rounds fail."""
    shared, elsewhere = tmp_path / "shared", tmp_path / "node-2-disk"
    rounds, error = simulate(tmp_path, views={2: elsewhere}, **{
        "client-state-dir": str(shared), "min-train-replies": 1.0, "max-failed-rounds": 2})
    assert error is not None and "2 rounds in a row failed" in error
    reasons = " ".join(reason for r in rounds for reason in r["dropped-reasons"])
    assert f"does not see the client-state folder {elsewhere / 'run'}" in reasons
    assert "no readable run.json" in reasons and "client-state-dir" in reasons
    assert [r["failed"] for r in rounds] == [1, 1]
    assert not (elsewhere / "run" / "partition-1.npz").exists()
    assert not (elsewhere / "run" / "partition-1.pending.npz").exists()


@pytest.mark.parametrize("method", ["fedavg", "fedrep"])
def test_a_node_without_state_dir_writes_only_where_its_simulation_server_marked(
        tmp_path, method):
    """A message without ``deployment`` (as a simulation's) and a run-config naming a
    client-state-dir: a node without state-dir neither writes there nor removes the
    files of another run it finds there, unless its server marked the folder
    (run.json, with this run's token); a method without client state keeps nothing."""
    victim = tmp_path / "victim"
    DurableState(victim / "myrun", "myrun", 0, "someone-else").write(sample_state(3))
    run_config = {**RUN_CONFIG, "method": method, "fedspc": method == "fedrep",
                  "checkpoint": True, "client-state-dir": str(victim), "run-name": "myrun"}
    config = parse_run_config(run_config)
    model = make_model(config, load_dataset("digits", None))
    split = parameter_split(model, get_method(method))
    shared = state_arrays(model, split.shared)
    grid = InProcessGrid(client_app.app, 2, run_config)
    message = train_message(1, shared, {k: np.zeros_like(shared[k]) for k in split.corrected},
                            node_id=1)
    del message.content.config_records["config"]["deployment"]
    if method == "fedavg":
        del message.content.array_records[GLOBAL_REFERENCE]
    reply = grid.deliver(message)
    assert reply.has_error() == (method == "fedrep")  # (no run.json: it stops)
    assert sorted(p.name for p in (victim / "myrun").iterdir()) == ["partition-0.npz"]
    assert DurableState(victim / "myrun", "myrun", 0, "someone-else").read().round == 3


MISSING = object()


@pytest.mark.parametrize("key, value", [
    ("accepted-rounds", "00"), ("accepted-rounds", b"\x00\x00"), ("accepted-rounds", [0]),
    ("accepted-rounds", [0, 0, 0]), ("accepted-rounds", [0, -1]),
    ("accepted-rounds", [False, False]), ("durable-through", "0"), ("durable-through", -1),
    ("server-round", "1"), ("server-round", True), ("server-round", 1.0),
    ("server-round", 0), ("server-round", -5), ("server-round", MISSING),
    ("num-clients", "2"), ("num-clients", 2.0), ("deployment", "false"),
    ("run-token", 7), ("run-token", "../x"), ("run-token", "A" * 2), ("run-token", "0" * 65),
    ("run-token", ["7e"]),
])
def test_a_round_field_of_the_wrong_type_is_one_clear_error(tmp_path, key, value):
    """The server sends integers, lists of them and bools: anything else is refused,
    naming the field, not coerced (a string's digits as rounds, "false" as true)
    or left to fail on an index; nothing is staged."""
    grid = InProcessGrid(client_app.app, 2, RUN_CONFIG)
    grid.contexts[1].node_config["state-dir"] = str(tmp_path)
    shared, u_bar, _ = round_inputs()
    message = train_message(1, shared, u_bar, node_id=1)
    config = message.content.config_records["config"]
    if value is MISSING:
        del config[key]
    else:
        config[key] = value
    reply = grid.deliver(message)
    assert reply.has_error()
    assert f"'{key}'" in reply.error.reason and "IndexError" not in reply.error.reason
    assert not list(tmp_path.rglob("partition-*.npz"))
