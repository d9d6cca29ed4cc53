"""A server message's fields, as a client checks them before it trains: learning
rates it can divide by, round knobs only where the run-config has them, arrays of
the model's dtypes read without trusting their headers, short error texts; and the
errors a private simulation keeps out of its shared log."""

from __future__ import annotations

import logging
from io import BytesIO

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MessageType
from inprocess import InProcessGrid
from test_durable import RUN_CONFIG, round_inputs, train_message, trained_rounds

from fedspc_app import client_app
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.errors import ConfigError, DivergenceError, MessageError
from fedspc_app.core.protocol import ARRAYS, GLOBAL_REFERENCE
from fedspc_app.core.ranges import LEARNING_RATE_RANGE, usable_learning_rate
from fedspc_app.training.schedule import round_learning_rates

SCHEDULED = {**RUN_CONFIG, "lr-schedule": "exponential", "lr-decay": 0.9}


def deliver(run_config, tmp_path, edit):
    """Round 1 for partition 0 (node 1) with a state-dir, the message changed by
    ``edit``; the reply and the files the client left."""
    grid = InProcessGrid(client_app.app, 2, run_config)
    grid.contexts[1].node_config["state-dir"] = str(tmp_path)
    shared, u_bar, _ = round_inputs()
    message = train_message(1, shared, u_bar, node_id=1)
    edit(message)
    return grid.deliver(message), sorted(p.name for p in tmp_path.rglob("*"))


def set_config(key, value):
    def edit(message):
        message.content.config_records["config"][key] = value
    return edit


def test_usable_learning_rates_are_those_a_float32_division_survives():
    low, high = LEARNING_RATE_RANGE
    # reference_change's scale, np.float32(1 / (E * eta)), at E = 1:
    assert np.isfinite(np.float32(1.0 / low)) and np.isfinite(np.float32(high))
    for rate in (low, 1e-30, 0.02, 1, 10.0, high):
        assert usable_learning_rate(rate)
    for rate in (0, -0.1, low / 2, 1e-300, high * 2, 1e308, float("inf"), float("nan"),
                 True, "0.1", None):
        assert not usable_learning_rate(rate)


@pytest.mark.parametrize("rate", [1e-300, 1e-40, 1e308, 0.0, True, "0.01"])
def test_a_round_learning_rate_a_client_cannot_divide_by_is_refused(tmp_path, rate):
    """1e-300 passed as "positive and finite", and 1/(E eta) overflowed: every u_k
    NaN, staged with an OK reply, committed by the next message."""
    reply, files = deliver(SCHEDULED, tmp_path, set_config("learning-rate", rate))
    assert reply.has_error() and "'learning-rate' must be a number from" in (
        reply.error.reason)
    assert files == []


@pytest.mark.parametrize(("run_config", "key", "value", "needs"), [
    (RUN_CONFIG, "learning-rate", 0.01, "lr-schedule is 'constant'"),
    (RUN_CONFIG, "clipping-norm", 1e-3, "no adaptive clipping"),
    ({**RUN_CONFIG, "dp-clipping-norm": 1.0, "dp-noise-multiplier": 0.1, "local-steps": 2},
     "clipping-norm", 1e-3, "no adaptive clipping"),
])
def test_a_round_knob_the_run_config_has_not_is_refused(tmp_path, run_config, key, value,
                                                        needs):
    """A clipping norm switched clipping on in a run without privacy, or replaced a
    fixed one; a learning rate applied without a schedule."""
    reply, files = deliver(run_config, tmp_path, set_config(key, value))
    assert reply.has_error()
    assert needs in reply.error.reason or "withheld under differential privacy" in (
        reply.error.reason)
    assert files == []


def test_a_private_runs_clipping_norm_is_refused_for_the_reason_it_withholds():
    run_config = {**RUN_CONFIG, "dp-clipping-norm": 1.0, "dp-noise-multiplier": 0.1,
                  "local-steps": 2}
    grid = InProcessGrid(client_app.app, 2, run_config)
    shared, u_bar, _ = round_inputs()
    message = train_message(1, shared, u_bar, node_id=1)
    message.content.config_records["config"]["clipping-norm"] = 1e-3
    with pytest.raises(MessageError, match="no adaptive clipping"):
        client_app.ClientSetup.from_message(message, grid.contexts[1])


def test_a_schedule_towards_zero_is_refused_with_its_round():
    config = parse_run_config({**RUN_CONFIG, "lr-schedule": "exponential",
                               "lr-decay": 1e-20, "num-rounds": 3})
    with pytest.raises(ConfigError, match="gives round 3 a learning rate of"):
        round_learning_rates(config)
    with pytest.raises(ConfigError, match="'learning-rate' must be a number from"):
        parse_run_config({**RUN_CONFIG, "learning-rate": 1e-300})


def test_a_reference_change_that_is_not_finite_fails_the_round(monkeypatch, tmp_path):
    """Defence in depth: whatever makes the new u_k non-finite, nothing is staged."""
    from clients import local
    monkeypatch.setattr(local, "reference_change",
                        lambda update, *a, **k: {key: np.full_like(v, np.nan)
                                                 for key, v in update.items()})
    reply, files = deliver(RUN_CONFIG, tmp_path, lambda message: None)
    assert reply.has_error() and DivergenceError.__name__ in reply.error.reason
    assert "reference change" in reply.error.reason
    assert not [name for name in files if name.endswith(".npz")]


def npy_bytes(header_shape, data: np.ndarray) -> bytes:
    """A .npy file whose header declares ``header_shape`` but holds ``data``'s bytes."""
    stream = BytesIO()
    np.lib.format.write_array_header_1_0(stream, {
        "descr": np.lib.format.dtype_to_descr(data.dtype), "fortran_order": False,
        "shape": header_shape})
    return stream.getvalue() + data.tobytes()


def recast(dtype):
    def edit(message):
        record = message.content.array_records[ARRAYS]
        key = next(iter(record.keys()))
        record[key] = Array(record[key].numpy().astype(dtype))
    return edit


def lying_header(message):
    record = message.content.array_records[ARRAYS]
    key = next(iter(record.keys()))
    value = record[key].numpy()
    record[key] = Array(dtype=record[key].dtype, shape=tuple(value.shape),
                        stype="numpy.ndarray", data=npy_bytes((2**40,), value))


def text_reference(message):
    message.content[GLOBAL_REFERENCE] = ArrayRecord({"x": Array(np.zeros(1, "<U3"))})


@pytest.mark.parametrize(("edit", "reason"), [
    (recast(np.float64), "has dtype float64, expected float32"),
    (recast(np.float16), "has dtype float16, expected float32"),
    (recast(np.complex64), "has dtype complex64, expected float32"),
    (recast(np.bool_), "has dtype bool, expected float32"),
    (lying_header, "has shape (1099511627776,)"),
    (lambda m: m.content.array_records.pop(ARRAYS), "lacks the 'arrays' arrays"),
    (text_reference, "do not match the expected keys"),
])
def test_arrays_are_of_the_models_dtypes_and_read_from_their_headers_first(
        tmp_path, edit, reason):
    """A dtype is never converted (float64 trained as float32, bool as 0/1, complex
    failed after a whole round); a header that declares 2^40 entries allocates
    nothing; a missing record is one clear reason, not KeyError."""
    reply, files = deliver(RUN_CONFIG, tmp_path, edit)
    assert reply.has_error() and reason in reply.error.reason, reply.error.reason
    assert "KeyError" not in reply.error.reason and "MemoryError" not in reply.error.reason
    assert files == []


@pytest.mark.parametrize(("key", "value"), [
    ("run-token", "z" * 1_000_000), ("accepted-rounds", list(range(100_000))),
    ("server-round", "9" * 100_000), ("run-name", "r" * 1_000_000)])
def test_an_error_never_repeats_a_huge_value(tmp_path, key, value):
    reply, files = deliver(RUN_CONFIG, tmp_path, set_config(key, value))
    assert reply.has_error() and f"'{key}'" in reply.error.reason or (
        "run name" in reply.error.reason)
    assert len(reply.error.reason) < 2000
    assert files == []


def test_a_private_simulation_logs_no_partition_and_round(tmp_path):
    """Under privacy in a simulation, the warnings that name a partition and its round
    (its state lost, its late training not kept) stay out of the log every client
    shares; the rounds still go on."""
    run_config = {**RUN_CONFIG, "dp-clipping-norm": 1.0, "dp-noise-multiplier": 0.1,
                  "local-steps": 2, "checkpoint": False, "output-dir": str(tmp_path)}
    grid = InProcessGrid(client_app.app, 2, run_config)
    shared, u_bar, _ = round_inputs()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("flwr").addHandler(handler)
    try:
        # Round 2 says round 1 was aggregated, but memory holds nothing (lost); then a
        # straggler's round 1 finishes after round 2 staged (its state not kept).
        for server_round, accepted in ((2, 1), (1, 2)):
            message = train_message(server_round, shared, u_bar, node_id=1)
            config = message.content.config_records["config"]
            config.update({"deployment": False, "accepted-rounds": [accepted] * 2,
                           "durable-through": 0})
            assert not grid.deliver(message).has_error()
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    assert not [r.getMessage() for r in records if r.levelno >= logging.WARNING
                and "artition" in r.getMessage()]


def state_of_round_2(tmp_path):
    """Partition 0 with round 2 committed and round 3 pending (token 7e)."""
    return trained_rounds(tmp_path, 3)


def without(key, record=False):
    def edit(message):
        if record:
            del message.content.array_records[key]
        else:
            del message.content.config_records["config"][key]
    return edit


@pytest.mark.parametrize(("edit", "reason"), [
    (without("run-token"), "carries 'accepted-rounds' but no 'run-token'"),
    (set_config("run-token", ""), "carries 'accepted-rounds' but no 'run-token'"),
    (without(GLOBAL_REFERENCE, record=True), "lacks the 'global-reference' arrays (u_bar)"),
])
def test_a_message_without_its_runs_identity_or_u_bar_touches_no_state(tmp_path, edit,
                                                                       reason):
    """Without a token a message read every run's files (and settled them); without
    u_bar a FedSPC message got past the checks, settled and claimed, then failed."""
    grid, folder, files = state_of_round_2(tmp_path)
    shared, u_bar, _ = round_inputs()
    # (an evaluation needs no u_bar: one without it is a usable message)
    kinds = [MessageType.TRAIN] + ([MessageType.EVALUATE] if "u_bar" not in reason else [])
    for message_type in kinds:
        message = train_message(4, shared, u_bar, node_id=1)
        message.metadata.message_type = message_type
        edit(message)
        reply = grid.deliver(message)
        assert reply.has_error() and reason in reply.error.reason, reply.error
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == files


def test_the_run_a_newer_one_took_the_partition_from_is_told_so(tmp_path):
    grid, _, _ = state_of_round_2(tmp_path)
    shared, u_bar, _ = round_inputs()
    new_run = train_message(1, shared, u_bar, node_id=1)
    new_run.content.config_records["config"]["run-token"] = "ab"
    assert not grid.deliver(new_run).has_error()
    reply = grid.deliver(train_message(4, shared, u_bar, node_id=1))  # the old run, late
    assert reply.has_error() and "of another run with this run name (kept)" in (
        reply.error.reason)


def test_a_server_kept_u_k_is_refused_unless_the_run_keeps_them_on_the_server(tmp_path):
    _, u_bar, _ = round_inputs()

    def kept(message):
        message.content["client-reference"] = ArrayRecord(
            {key: Array(value) for key, value in u_bar.items()})
    reply, files = deliver(RUN_CONFIG, tmp_path, kept)
    assert reply.has_error() and "not 'server-centre'" in reply.error.reason
    assert files == []


@pytest.mark.parametrize("value", [10**400, -(10**400)])
def test_a_huge_integer_is_refused_without_an_overflow(tmp_path, value):
    for key, run_config in (("learning-rate", SCHEDULED), ("clipping-norm", RUN_CONFIG)):
        reply, files = deliver(run_config, tmp_path, set_config(key, value))
        assert reply.has_error() and "OverflowError" not in reply.error.reason
        assert files == []


@pytest.mark.parametrize("run_name", [" ", "  run", "run ", "a\u2028b", "a\u2029b"])
def test_white_space_and_line_separators_make_no_run_name(run_name):
    with pytest.raises(ConfigError, match="must be a plain name"):
        parse_run_config({**RUN_CONFIG, "run-name": run_name})


def test_a_run_folder_that_is_a_file_is_one_clear_error(tmp_path):
    (tmp_path / "taken").write_text("not a folder")
    reply, _ = deliver(RUN_CONFIG, tmp_path, set_config("run-name", "taken"))
    assert reply.has_error() and "is a file" in reply.error.reason
    assert "FileExistsError" not in reply.error.reason


def test_a_message_that_names_no_run_never_reads_or_settles_a_runs_files(tmp_path):
    """No token and no decisions (a server of one's own that sends neither): its
    training and evaluation see no run's state (they start from the common initial
    one) and leave every file of the run that owns the partition as it was."""
    grid, folder, files = state_of_round_2(tmp_path)
    shared, u_bar, _ = round_inputs()
    for message_type in (MessageType.TRAIN, MessageType.EVALUATE):
        message = train_message(4, shared, u_bar, node_id=1)
        message.metadata.message_type = message_type
        for key in ("run-token", "accepted-rounds", "durable-through"):
            del message.content.config_records["config"][key]
        assert not grid.deliver(message).has_error()
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == files


@pytest.mark.parametrize("key", ["server-round", "durable-through", "accepted-rounds"])
def test_an_integer_beyond_2_40_is_refused_before_the_state_is_touched(tmp_path, key):
    grid, folder, files = state_of_round_2(tmp_path)
    shared, u_bar, _ = round_inputs()
    message = train_message(4, shared, u_bar, node_id=1)
    message.content.config_records["config"][key] = (
        [3, 10**5000] if key == "accepted-rounds" else 10**5000)
    reply = grid.deliver(message)
    assert reply.has_error() and f"'{key}'" in reply.error.reason
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == files
