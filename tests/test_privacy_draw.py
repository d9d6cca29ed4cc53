"""Differential privacy's sampling amplification holds only while nobody learns which
clients a round drew (docs/privacy.md, threat model): under privacy a failing client
is not named in any log or reply, how many usable replies came decides nothing, a
training phase can be padded to a fixed time (``dp-phase-seconds``), and the clients
can be evaluated after the last round only (``dp-evaluate``)."""

from __future__ import annotations

import json
import logging
import traceback
from collections import Counter
from logging import ERROR, WARNING
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Message, MessageType
from flwr.supercore import log
from flwr.supercore.logger import FLOWER_LOGGER
from inprocess import InProcessGrid, run_server
from test_faults import Faulty, broadcast

from clients.state import COMMITTED, ClientState
from fedspc_app import client_app
from fedspc_app.client_app import PRIVATE_FAILURE
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.errors import ConfigError
from fedspc_app.runs.results import METRICS_JSON
from strategies import rounds
from strategies.personalized import PRIVATE_DROPPED
from strategies.rounds import PhasePadding, held_logs

K = 3
PRIVATE = {"dp-clipping-norm": 10.0, "dp-noise-multiplier": 0.001}


def settings(tmp: Path, name: str, private: bool, **overrides) -> dict:
    return {"method": "fedrep", "num-rounds": 2, "batch-size": 32, "alpha": 1.0,
            "local-steps": 3, "checkpoint": False, "output-dir": str(tmp), "run-name": name,
            **(PRIVATE if private else {}),
            **{key.replace("_", "-"): value for key, value in overrides.items()}}


def run(tmp: Path, name: str, private: bool, client=None, **overrides):
    config = settings(tmp, name, private, **overrides)
    grid = InProcessGrid(client or client_app.app, K, config)
    error = run_server(grid, config)
    assert error is None, error
    return grid, json.loads((tmp / name / METRICS_JSON).read_text())["rounds"]


class Records(logging.Handler):
    """Every record of Flower's logger, as text."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def texts(self, level: int = logging.DEBUG) -> str:
        return "\n".join(r.getMessage() for r in self.records if r.levelno >= level)


@pytest.fixture
def records():
    handler = Records()
    FLOWER_LOGGER.addHandler(handler)
    yield handler
    FLOWER_LOGGER.removeHandler(handler)


def diverging(node: int):
    """The ClientApp, whose ``node`` diverges (a huge learning rate) in every training,
    run as Flower's simulation worker runs it: an exception raised out of it is logged
    with its text and traceback (flwr's vce_api.worker), then becomes an error reply."""
    def client(message: Message, context):
        if message.metadata.dst_node_id == node:
            context.run_config["learning-rate"] = 1e6
        try:
            return client_app.app(message, context)
        except Exception as ex:
            log(ERROR, ex)
            log(ERROR, traceback.format_exc())
            raise
    return client


# --------------------------------------------------- a failing client is not named
def test_under_privacy_a_diverging_client_is_named_in_no_log_and_no_reply(tmp_path,
                                                                          records):
    """Flower logs the text of every exception a ClientApp raises: a DivergenceError's
    named the drawn client and its round (13 of 13 drawn pairs read off a run's log).
    Under privacy the ClientApp answers with one fixed text instead, logs nothing, and
    keeps its state as it was; without privacy the text is kept."""
    grid, rows = run(tmp_path, "private", True, diverging(3))
    failures = [r for r in grid.replies if r.has_error()]
    assert len(failures) == 2  # node 3 (partition 2) in each of the two rounds
    assert {r.error.reason for r in failures} == {PRIVATE_FAILURE.format("training")}
    assert not any(ch.isdigit() for ch in PRIVATE_FAILURE)
    text = records.texts()
    for named in ("diverged", "DivergenceError", "client 2", "partition 2", "Traceback"):
        assert named not in text, named
    assert not records.texts(ERROR)
    assert [row["dropped-reasons"] for row in rows] == [[PRIVATE_DROPPED]] * 2
    assert [row["failed"] for row in rows] == [0, 0]
    assert ClientState.from_records(grid.state(2), COMMITTED) is None  # nothing kept
    assert ClientState.from_records(grid.state(0), COMMITTED).rounds_trained == 2

    records.records.clear()
    grid, rows = run(tmp_path, "plain", False, diverging(3))
    reasons = {r.error.reason for r in grid.replies if r.has_error()}
    assert any("client 2 diverged in round 1" in reason for reason in reasons)
    assert "client 2 diverged in round 1" in records.texts(ERROR)
    assert "client 2 diverged in round 1" in " ".join(rows[0]["dropped-reasons"])


# ---------------------------------------------------------- no failure oracle
def test_under_privacy_a_round_whose_every_drawn_reply_failed_releases(tmp_path):
    """min-train-replies is not applied under privacy: with every drawn client failing
    in round 2 the round releases the noise alone, is not failed, and its row has the
    keys of a round with any dropped reply."""
    faults = {(node, 2, "train"): RuntimeError("down") for node in range(1, K + 1)}
    grid, rows = run(tmp_path, "spoiled", True, Faulty(faults), num_rounds=3,
                     min_train_replies=1.0)
    assert [row["failed"] for row in rows] == [0, 0, 0]
    assert rows[1]["dropped-reasons"] == [PRIVATE_DROPPED]
    assert set(rows[1]) == set(rows[0]) | {"dropped-reasons"} == set(rows[2]) | {
        "dropped-reasons"}
    second, third = broadcast(grid, 2), broadcast(grid, 3)
    assert any(not np.array_equal(second[key], third[key]) for key in second)  # released


# ------------------------------------------------------------- timing: the padding
def test_the_padding_waits_until_t_after_the_phase_began_and_not_when_it_overran(records):
    padding = PhasePadding(10.0)
    slept: list[float] = []
    padding.sleep = slept.append
    padding.clock = lambda: 103.5
    assert padding.wait(100.0) == pytest.approx(6.5) and slept == [pytest.approx(6.5)]
    padding.clock = lambda: 112.0  # the phase took 12 s of 10
    assert padding.wait(100.0) == 0.0 and padding.wait(95.0) == 0.0
    assert len(slept) == 1 and padding.overruns == 2
    warnings = [r.getMessage() for r in records.records if r.levelno == WARNING]
    assert len(warnings) == 1 and "outlasted dp-phase-seconds = 10" in warnings[0]
    assert not any(ch.isdigit() for ch in warnings[0].replace("10", ""))  # no m


def test_held_log_records_go_out_when_the_padded_phase_ends(records, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(rounds.time, "time", lambda: now[0])
    with held_logs():
        log(WARNING, "a dropped reply")
        assert records.records == []
        now[0] = 1030.0
    assert [r.getMessage() for r in records.records] == ["a dropped reply"]
    assert records.records[0].created == 1030.0
    with held_logs(active=False):
        log(WARNING, "at once")
        assert len(records.records) == 2


def test_a_padded_round_writes_and_sends_nothing_before_t(tmp_path, monkeypatch):
    """Each training phase waits until dp-phase-seconds after it began, after its
    aggregation and before its round is recorded or its evaluation sent; without
    dp-phase-seconds it does not wait."""
    seen: list[tuple[float, int, Counter]] = []
    grid_of: list[InProcessGrid] = []

    def sleep(seconds):
        path = tmp_path / "padded" / METRICS_JSON
        rows = json.loads(path.read_text())["rounds"] if path.exists() else []
        seen.append((seconds, len(rows), Counter(
            (m.metadata.message_type, m.content.config_records["config"]["server-round"])
            for m in grid_of[0].sent)))

    monkeypatch.setattr(PhasePadding, "sleep", staticmethod(sleep))
    monkeypatch.setattr(InProcessGrid, "__init__", record_grid(grid_of))
    run(tmp_path, "padded", True, num_rounds=2, dp_phase_seconds=600.0, round_timeout=300.0)
    assert len(seen) == 2
    for server_round, (seconds, written, sent) in enumerate(seen, 1):
        assert 500.0 < seconds <= 600.0
        assert written == server_round - 1  # the round not recorded yet
        assert sent[(MessageType.TRAIN, server_round)] == K
        assert sent[(MessageType.EVALUATE, server_round)] == 0  # nor evaluated
    seen.clear()
    run(tmp_path, "unpadded", True, num_rounds=1)
    assert seen == []


def record_grid(grids: list):
    init = InProcessGrid.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        grids.append(self)
    return __init__


@pytest.mark.parametrize("overrides,message", [
    ({"dp-phase-seconds": 5.0}, "need 'dp-clipping-norm' > 0"),
    ({"dp-evaluate": "final"}, "need 'dp-clipping-norm' > 0"),
    ({**PRIVATE, "local-steps": 2, "dp-phase-seconds": -1.0}, "'dp-phase-seconds' must be"),
    ({**PRIVATE, "local-steps": 2, "dp-phase-seconds": float("inf")},
     "'dp-phase-seconds' must be"),
    ({**PRIVATE, "local-steps": 2, "dp-evaluate": "never"}, "'dp-evaluate' = 'never'"),
    ({**PRIVATE, "local-steps": 2, "dp-phase-seconds": 0.5, "round-timeout": 0.1},
     "'dp-phase-seconds' = 0.5 must be above 0.5"),
])
def test_the_draw_hiding_keys_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_config(overrides)


@pytest.mark.parametrize("phase,timeout", [(30, 3600.0), (30, 30.0), (30, 27.5),
                                           (2, 1.95), (2, 1.6)])
def test_a_round_timeout_without_a_reserve_below_the_phase_is_refused(phase, timeout):
    """A drawn client that never replies holds its phase for round-timeout, then the
    server polls and aggregates: with round-timeout = T − 0.05 s (accepted before, the
    poll alone is 0.1 s) an offline target's padded phases overran in exactly its
    rounds (10 of 10). round-timeout must leave max(T/10, 0.5 s) below T."""
    with pytest.raises(ConfigError) as refused:
        parse_run_config({**PRIVATE, "local-steps": 2, "dp-phase-seconds": phase,
                          "round-timeout": timeout})
    text = str(refused.value)
    assert f"'round-timeout' = {timeout:g}" in text and f"'dp-phase-seconds' = {phase}" in text
    assert "aggregation" in text and f"at most {phase - max(phase / 10, 0.5):g}" in text
    # without padding round-timeout is free
    parse_run_config({**PRIVATE, "local-steps": 2, "round-timeout": timeout})


@pytest.mark.parametrize("phase,timeout", [(30, 27.0), (2, 1.5), (600, 540)])
def test_a_round_timeout_leaving_the_reserve_is_accepted(phase, timeout):
    config = parse_run_config({**PRIVATE, "local-steps": 2, "dp-phase-seconds": phase,
                               "round-timeout": timeout})
    assert (config.dp_phase_seconds, config.round_timeout) == (phase, timeout)


def test_a_padded_phases_reply_deadline_counts_from_the_phase_start():
    """Making the messages of a larger draw takes longer: under padding the time it
    took comes off round-timeout, so the deadline keeps its reserve below T."""
    padding = PhasePadding(10.0)
    padding.clock = lambda: 102.5
    assert rounds.reply_timeout(8.0, padding, 100.0) == pytest.approx(5.5)
    assert rounds.reply_timeout(8.0, padding, 90.0) == 0.0
    assert rounds.reply_timeout(8.0, None, 100.0) == 8.0  # unpadded: as configured


def test_the_draw_hiding_keys_are_accepted_under_privacy():
    config = parse_run_config({**PRIVATE, "local-steps": 2, "dp-phase-seconds": 30,
                               "round-timeout": 20, "dp-evaluate": "final"})
    assert (config.dp_phase_seconds, config.dp_evaluate) == (30.0, "final")


# ------------------------------------------------------------- evaluation
def test_dp_evaluate_final_evaluates_only_after_the_last_round(tmp_path):
    grid, rows = run(tmp_path, "final", True, num_rounds=3, dp_evaluate="final",
                     dp_phase_seconds=0.0)
    evaluated = Counter(m.content.config_records["config"]["server-round"] for m in grid.sent
                        if m.metadata.message_type == MessageType.EVALUATE)
    assert evaluated == {3: K}
    created = {}  # every training message of a round made at one time
    for m in grid.sent:
        if m.metadata.message_type == MessageType.TRAIN:
            server_round = m.content.config_records["config"]["server-round"]
            created.setdefault(server_round, set()).add(m.metadata.created_at)
    assert sorted(created) == [1, 2, 3] and all(len(t) == 1 for t in created.values())
    assert ["accuracy" in row for row in rows] == [False, False, True]
    privacy = json.loads((tmp_path / "final" / "config.json").read_text())["privacy"]
    assert privacy["evaluate"] == "final" and privacy["phase-seconds"] == 0.0
    evaluation, timing = privacy["not-covered"][:2]
    assert "evaluation metrics" in evaluation and "last round only" in evaluation
    assert "how often each client was drawn" in evaluation
    assert "timing" in timing and "not padded" in timing

    grid, rows = run(tmp_path, "every", True, num_rounds=2)
    assert all("accuracy" in row for row in rows)
    privacy = json.loads((tmp_path / "every" / "config.json").read_text())["privacy"]
    assert "every evaluated round" in privacy["not-covered"][0]


# ------------------------------------------------------------- client-state/
@pytest.mark.parametrize("private", [True, False])
def test_the_kept_client_state_is_not_sized_under_privacy(tmp_path, records, private):
    """Only the clients ever drawn have a file in client-state/: the last line's "Kept
    … (X MB …)" over one file's size counted them exactly (12 of 12 runs), and with
    K − 1 colluders told whether the target was ever drawn. Under privacy neither that
    line nor final-state.json gives a size; without privacy both do. config.json's
    segments keep the date the run started, not its time."""
    run(tmp_path, "kept", private, num_rounds=2, checkpoint=True, fraction_train=0.5)
    folder = tmp_path / "kept" / "client-state"
    kept = [r.getMessage() for r in records.records if "for export" in r.getMessage()]
    assert len(kept) == 1 and str(folder) in kept[0]
    marker = json.loads((folder / "final-state.json").read_text())
    assert ("MB" in kept[0]) is (not private) and ("bytes" in marker) is (not private)
    config = json.loads((tmp_path / "kept" / "config.json").read_text())
    started = config["segments"][0]["started"]  # no time of day
    assert len(started) == len("2025-01-31")
    if private:
        assert not any(ch.isdigit() for ch in kept[0].replace(str(folder), ""))
        not_covered = config["privacy"]["not-covered"]
        assert "client-state/" in not_covered[-1] and "ever drawn" in not_covered[-1]
        assert "the day in config.json's segments" in not_covered[1]
