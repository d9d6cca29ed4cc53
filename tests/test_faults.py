"""Faults injected into real runs of the ServerApp and ClientApp (in one process).

A test-only wrapper around the ClientApp (:class:`Faulty`) makes chosen nodes
raise, reply with NaN arrays or wrong shapes, diverge, or send broken evaluation
replies; :class:`Crashing` stops the whole run at a chosen message, as a killed
process would. The product's config and code are the real ones.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, Context, Message, MessageType, MetricRecord, RecordDict
from inprocess import InProcessGrid, run_server

from clients.durable import FINAL_MARKER
from clients.state import COMMITTED, PENDING, ClientState
from fedspc_app import client_app, server_app
from fedspc_app.client_app import check_node_config
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.errors import ConfigError
from fedspc_app.core.files import atomic_open, folder_lock
from fedspc_app.core.protocol import ARRAYS, GLOBAL_REFERENCE, METRICS
from fedspc_app.core.records import from_record
from fedspc_app.runs import provenance
from fedspc_app.runs.checkpoint import (
    CHECKPOINT_JSON,
    COMPLETE,
    Checkpoint,
    RoundRecords,
    fingerprint,
    read_checkpoint,
    remove_checkpoint,
    resume_point,
    write_checkpoint,
)
from fedspc_app.runs.pause import PAUSE_REQUEST, RunPaused, request_pause
from fedspc_app.runs.results import RunRecorder

K = 3
BASE = {"method": "fedrep", "fedspc": True, "num-rounds": 3, "local-epochs": 1,
        "batch-size": 64, "alpha": 0.5, "min-train-replies": 0.5, "checkpoint": False}

Fault = Callable[[Message], Message]


class Faulty:
    """The ClientApp, except that ``faults[(node, round, kind)]`` rewrites a reply
    (or raises) for that node, round and message kind ("train" or "evaluate")."""

    def __init__(self, faults: dict[tuple[int, int, str], Fault | Exception]) -> None:
        self.faults = faults

    def __call__(self, message: Message, context: Context) -> Message:
        if message.metadata.message_type == MessageType.QUERY:  # the warm-up: no fault
            return client_app.app(message, context)
        config = message.content.config_records["config"]
        kind = "train" if message.metadata.message_type == MessageType.TRAIN else "evaluate"
        fault = self.faults.get((message.metadata.dst_node_id, int(config["server-round"]),
                                 kind))
        if isinstance(fault, Exception):
            raise fault
        reply = client_app.app(message, context)
        return fault(reply) if fault is not None else reply


class Recording(InProcessGrid):
    """Keeps, at the start of every training round, ū as broadcast and each client's
    committed state (what the invariant compares)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.snapshots: dict[int, tuple[dict, list[ClientState | None]]] = {}

    def deliver(self, message: Message) -> Message:
        config = message.content.config_records["config"]
        server_round = int(config["server-round"])
        if (message.metadata.message_type == MessageType.TRAIN
                and server_round not in self.snapshots
                and GLOBAL_REFERENCE in message.content.array_records):
            self.snapshots[server_round] = (
                from_record(message.content.array_records[GLOBAL_REFERENCE]),
                [ClientState.from_records(self.state(p), COMMITTED) for p in range(K)])
        return super().deliver(message)


def run(tmp: Path, client=None, grid_type=InProcessGrid, **overrides):
    run_config = {**BASE, "output-dir": str(tmp), "run-name": "run",
                  **{key.replace("_", "-"): value for key, value in overrides.items()}}
    grid = grid_type(client or client_app.app, K, run_config)
    error = run_server(grid, run_config)
    metrics = json.loads((tmp / "run" / "metrics.json").read_text())
    return grid, metrics["rounds"], error


def broadcast(grid: InProcessGrid, server_round: int, kind=MessageType.TRAIN) -> dict:
    for message in grid.sent:
        config = message.content.config_records["config"]
        if message.metadata.message_type == kind and config["server-round"] == server_round:
            return from_record(message.content.array_records[ARRAYS])
    raise AssertionError(f"no {kind} message in round {server_round}")


def all_finite(arrays: dict) -> bool:
    return all(np.all(np.isfinite(v)) for v in arrays.values())


def nan_arrays(reply: Message) -> Message:
    record = reply.content.array_records[ARRAYS]
    key = next(iter(record.keys()))
    value = record[key].numpy().copy()
    value.flat[0] = np.nan
    record[key] = Array(value)
    return reply


def wrong_shape(reply: Message) -> Message:
    record = reply.content.array_records[ARRAYS]
    key = next(iter(record.keys()))
    record[key] = Array(np.zeros((2, 2), dtype=np.float32))
    return reply


def broken_evaluation(reply: Message) -> Message:
    metrics = reply.content.metric_records[METRICS]
    del metrics["correct"]
    return reply


def nan_loss(reply: Message) -> Message:
    reply.content.metric_records[METRICS]["loss-sum"] = float("nan")
    return reply


@pytest.fixture
def tmp(tmp_path):
    return tmp_path


@pytest.mark.parametrize("fault,reason", [
    (RuntimeError("injected"), "client error: RuntimeError: injected"),
    (nan_arrays, "holds non-finite values"),
    (wrong_shape, "has shape (2, 2)"),
])
def test_a_faulty_train_reply_is_dropped_and_its_state_not_committed(tmp, fault, reason):
    faulty = Faulty({(2, 2, "train"): fault})
    grid, rounds, error = run(tmp, faulty, Recording)
    assert error is None
    assert [r["failed"] for r in rounds] == [0, 0, 0]
    assert [r["train-dropped"] for r in rounds] == [0, 1, 0]
    assert any(reason in text for text in rounds[1]["dropped-reasons"])
    for server_round in (1, 2, 3):
        assert all_finite(broadcast(grid, server_round))
    assert all_finite(grid.snapshots[3][0])  # u_bar
    # Node 2 (partition 1) stands where it stood before round 2; the others moved on.
    _, states = grid.snapshots[3]
    assert states[1].round == 1 and states[1].rounds_trained == 1
    assert [states[0].round, states[2].round] == [2, 2]
    assert ClientState.from_records(grid.state(1), PENDING) is None
    before = grid.snapshots[2][1][1]  # its committed state when round 2 began
    for block in ("personal", "local_reference"):
        kept, then = getattr(states[1], block), getattr(before, block)
        assert set(kept) == set(then)
        for key in kept:
            np.testing.assert_array_equal(kept[key], then[key], err_msg=f"{block} {key}")


def test_u_bar_is_the_mean_of_the_committed_local_references_after_a_drop(tmp):
    grid, _, _ = run(tmp, Faulty({(2, 2, "train"): nan_arrays}), Recording)
    for server_round in (2, 3):
        u_bar, states = grid.snapshots[server_round]
        for key, value in u_bar.items():
            mean = np.mean([s.local_reference[key] for s in states], axis=0)
            np.testing.assert_allclose(value, mean, rtol=1e-5, atol=1e-7, err_msg=key)
    # The invariant has teeth: the dropped client's round-2 reference change differs.
    u_bar, states = grid.snapshots[3]
    assert states[1].round == 1


def test_a_diverging_client_reports_where_and_commits_nothing(tmp):
    def diverge(message, context):
        if message.metadata.dst_node_id == 3:
            context.run_config["learning-rate"] = 1e6
        return client_app.app(message, context)

    grid, rounds, error = run(tmp, diverge, Recording)
    assert error is None
    for server_round in (1, 2, 3):  # theta_s and u_bar stay finite
        assert all_finite(broadcast(grid, server_round))
        assert all_finite(grid.snapshots[server_round][0])
    reasons = " ".join(rounds[0]["dropped-reasons"])
    assert "DivergenceError: client 2 diverged in round 1" in reasons
    assert "step" in reasons
    assert [r["train-dropped"] for r in rounds] == [1, 1, 1]
    assert ClientState.from_records(grid.state(2), COMMITTED) is None
    assert ClientState.from_records(grid.state(2), PENDING) is None


@pytest.mark.parametrize("fault", [broken_evaluation, nan_loss, RuntimeError("eval")])
def test_a_bad_evaluation_reply_is_dropped_and_counted(tmp, fault):
    _, rounds, error = run(tmp, Faulty({(1, 2, "evaluate"): fault}))
    assert error is None
    assert [r["evaluate-dropped"] for r in rounds] == [0, 1, 0]
    assert [r["clients"] for r in rounds] == [3, 2, 3]
    assert all(np.isfinite(r["accuracy"]) for r in rounds)
    assert rounds[1]["accuracy"] == pytest.approx(
        np.mean(list(rounds[1]["client-accuracy"].values())))


def test_a_round_below_the_threshold_fails_and_keeps_the_model(tmp):
    faults = {(node, 2, "train"): RuntimeError("down") for node in (1, 2)}
    grid, rounds, error = run(tmp, Faulty(faults), Recording)
    assert error is None
    assert [r["failed"] for r in rounds] == [0, 1, 0]
    assert rounds[1].get("accuracy") is None and rounds[2]["accuracy"] > 0
    # θ_s and ū stay as they were after round 1.
    for key, value in broadcast(grid, 2).items():
        np.testing.assert_array_equal(broadcast(grid, 3)[key], value)
    u_bar_2, _ = grid.snapshots[2]
    u_bar_3, states = grid.snapshots[3]
    for key, value in u_bar_2.items():
        np.testing.assert_array_equal(u_bar_3[key], value)
    assert [s.round for s in states] == [1, 1, 1]  # the one good reply was discarded too


def test_too_many_failed_rounds_stop_the_run_with_an_intact_checkpoint(tmp):
    faults = {(node, r, "train"): RuntimeError("down") for node in (1, 2, 3) for r in (2, 3, 4)}
    _, rounds, error = run(tmp, Faulty(faults), num_rounds=5, max_failed_rounds=2,
                           checkpoint=True)
    assert error is not None and "2 rounds in a row failed" in error
    assert [r["failed"] for r in rounds] == [0, 1, 1]
    summary = json.loads((tmp / "run" / "summary.json").read_text())
    assert summary["complete"] is False
    checkpoint = json.loads((tmp / "run" / CHECKPOINT_JSON).read_text())
    assert checkpoint["round"] == 3 and checkpoint["failed-streak"] == 2
    # ... and the run resumes from it once the clients are back.
    _, rounds, error = run(tmp, num_rounds=5, max_failed_rounds=2, checkpoint=True,
                           resume=True)
    assert error is None
    assert [r["failed"] for r in rounds] == [0, 1, 1, 0, 0]


class Crash(Exception):
    pass


class Crashing(InProcessGrid):
    """Dies (like a killed process) when it is about to deliver message ``crash_at``."""

    crash_at: int | None = None

    def deliver(self, message):
        if self.crash_at is not None and len(self.sent) >= self.crash_at:
            raise Crash
        return super().deliver(message)


def accuracies(rounds: list[dict]) -> list:
    return [(r["round"], r["accuracy"], r["client-accuracy"]) for r in rounds]


def losses(rounds: list[dict]) -> list[float]:
    return [value for r in rounds for value in (r["loss"], r["train-loss"])]


# 6 messages a round (3 train, 3 evaluate): the crash comes in the middle of round 2's
# training (before its checkpoint) or of its evaluation (after the aggregation's).
@pytest.mark.parametrize(("crash_at", "method", "extra"), [
    (8, "fedrep", {}), (10, "fedrep", {}), (8, "local", {}),
    # A server optimizer's moments are in the checkpoint: killed after round 2's
    # aggregation, the resumed run steps as the uninterrupted one.
    (10, "fedrep", {"server-optimizer": "fedadam", "server-learning-rate": 0.05}),
    (14, "fedper", {"server-optimizer": "fedavgm", "server-momentum": 0.9,
                    "aggregation": "median"}),
    # u_bar as the median of the u_k the server keeps: they are in the checkpoint
    # (killed in round 2's training, the resumed round 2 needs round 1's u_k).
    (8, "fedrep", {"aggregation": "median", "fedspc-reference": "client-centre"}),
    # The default under a robust rule: the server sends each client the u_k it keeps
    # (restored from the checkpoint), each update bounded to the round's median norm.
    (8, "fedrep", {"aggregation": "trimmed-mean", "fedspc-reference": "server-centre"}),
    # A decaying learning rate: the resumed run continues the schedule.
    (10, "fedrep", {"lr-schedule": "exponential", "lr-decay": 0.5}),
    # Differential privacy draws from a secret in the checkpoint:
    # tests/test_privacy_secret.py resumes such a run.
])
def test_a_crashed_run_resumes_to_the_same_metrics(tmp, crash_at, method, extra):
    # method local: nothing shared, every parameter in the client state on disk.
    overrides = {"checkpoint": True, "method": method, "fedspc": method != "local",
                 **{key.replace("-", "_"): value for key, value in extra.items()}}
    _, expected, _ = run(tmp / "a", **overrides)

    def crashing(*args):
        grid = Crashing(*args)
        grid.crash_at = crash_at
        return grid

    with pytest.raises(Crash):
        run(tmp / "b", grid_type=crashing, **overrides)
    # A new grid: new contexts, as after a restart; the clients' state is on disk.
    _, resumed, error = run(tmp / "b", resume=True, **overrides)
    assert error is None
    # The same correct predictions; losses up to the rounding noise of the CPU kernels,
    # which already separates two uninterrupted runs in one process (~1e-5 by round 3).
    assert accuracies(resumed) == accuracies(expected)
    assert losses(resumed) == pytest.approx(losses(expected), rel=1e-4)
    assert [r.get("dp-epsilon") for r in resumed] == [r.get("dp-epsilon") for r in expected]
    norms = [r.get("global-reference-norm", 0.0) for r in resumed]
    assert norms == pytest.approx([r.get("global-reference-norm", 0.0) for r in expected],
                                  rel=1e-4)
    assert_only_final_personal(tmp / "b" / "run" / "client-state")  # once complete


def strings(tree) -> list[str]:
    """Every string in a JSON tree (keys too)."""
    if isinstance(tree, dict):
        return [text for key, value in tree.items() for text in (key, *strings(value))]
    if isinstance(tree, list):
        return [text for value in tree for text in strings(value)]
    return [tree] if isinstance(tree, str) else []


def test_config_json_holds_no_path_of_this_machine_and_the_run_still_resumes(tmp):
    # Absolute paths, as the launcher hands them to the ServerApp (digits ignores data-dir).
    paths = {"checkpoint": True, "num_rounds": 2, "data_dir": str(tmp / "data"),
             "client_state_dir": str(tmp / "state")}

    def crashing(*args):
        grid = Crashing(*args)
        grid.crash_at = 8  # in round 2's training, after round 1's checkpoint
        return grid

    with pytest.raises(Crash):
        run(tmp, grid_type=crashing, **paths)
    for resumed in (False, True):
        if resumed:
            _, rounds, error = run(tmp, resume=True, **paths)
            assert error is None and [r["round"] for r in rounds] == [1, 2]
        written = json.loads((tmp / "run" / "config.json").read_text())
        assert written["run-config"]["output-dir"] == ".."  # the run folder's parent
        assert written["run-config"]["data-dir"] == ""  # the reader's own data folder
        assert written["run-config"]["client-state-dir"] == "../state"  # the run folder's
        assert written["run-config"]["run-name"] == "run"
        assert [text for text in strings(written) if str(tmp) in text] == []
        assert written["resumed-after-round"] == (1 if resumed else 0)


def test_a_round_resumed_between_training_and_evaluation_keeps_its_training_record(tmp):
    # Node 1's round-2 update is NaN: dropped. The crash comes in round 2's evaluation,
    # after the aggregation's checkpoint; the resumed run only evaluates round 2.
    faults = {(1, 2, "train"): nan_arrays}
    _, expected, _ = run(tmp / "a", client=Faulty(faults), checkpoint=True)

    def crashing(*args):
        grid = Crashing(*args)
        grid.crash_at = 10
        return grid

    with pytest.raises(Crash):
        run(tmp / "b", client=Faulty(faults), grid_type=crashing, checkpoint=True)
    _, resumed, error = run(tmp / "b", client=Faulty(faults), checkpoint=True,
                            resume=True)
    assert error is None
    fields = ("failed", "train-dropped", "evaluate-dropped", "dropped-reasons",
              "bytes-sent", "bytes-received", "train-clients")
    assert expected[1]["train-dropped"] == 1 and expected[1]["bytes-received"] > 0
    assert {k: resumed[1].get(k) for k in fields} == {k: expected[1].get(k) for k in fields}
    assert resumed[1]["round-seconds"] >= 0.5 * expected[1]["round-seconds"]


@pytest.mark.parametrize("same_code", [True, False])
def test_a_resumed_run_records_each_segment_and_the_code_that_made_it(tmp, monkeypatch,
                                                                      same_code):
    def crashing(*args):
        grid = Crashing(*args)
        grid.crash_at = 8  # in round 2's training, after round 1's checkpoint
        return grid

    with pytest.raises(Crash):
        run(tmp, grid_type=crashing, checkpoint=True, num_rounds=2)
    first = json.loads((tmp / "run" / "config.json").read_text())
    assert first["code"]["source-sha256"] == provenance.code_version()["source-sha256"]
    assert first["software"]["flwr"] and first["machine"]["cpu"]
    if provenance.git_origin() is not None:  # a checkout: its commit too
        assert first["code"]["git-commit"] == provenance.git_origin()["git-commit"]
    assert [s["first-round"] for s in first["segments"]] == [1]
    if not same_code:  # a fix landed between the two starts
        other = {**first["code"], "source-sha256": "f" * 64}
        monkeypatch.setattr(provenance, "code_version", lambda: other)
    _, rounds, error = run(tmp, checkpoint=True, num_rounds=2, resume=True)
    assert error is None and [r["round"] for r in rounds] == [1, 2]
    written = json.loads((tmp / "run" / "config.json").read_text())
    assert [s["first-round"] for s in written["segments"]] == [1, 2]
    assert written["segments"][0] == first["segments"][0]
    assert provenance.code_changes(written["segments"]) == ([] if same_code else [2])
    assert written["code"] == written["segments"][-1]["code"]


def test_a_round_resumed_after_its_aggregation_counts_its_earlier_training_time(tmp):
    # The checkpoint after round 2's aggregation: round 1 ended at 10 s, the
    # aggregation at 14 s; the 4 s of training belong to round 2.
    config = parse_run_config({**BASE, "output-dir": str(tmp), "run-name": "run"})
    recorder = RunRecorder(config, echo=lambda _: None)
    recorder.start(rounds=[{"round": 1, "elapsed-seconds": 10.0}], elapsed=14.0)
    recorder.on_round_end(2, MetricRecord({"examples-seen": 400, "train-loss": 1.0}), None)
    row = recorder.rounds[-1]
    assert 4.0 <= row["round-seconds"] < 5.0
    assert 80.0 < row["images-per-second"] <= 100.0


class Pausing(InProcessGrid):
    """Asks for a pause (as ``experiments pause`` does) while delivering message
    ``pause_at``; with ``stale``, the request is dated before the run started."""

    pause_at: int | None = None
    stale = False

    def deliver(self, message):
        if self.pause_at is not None and len(self.sent) == self.pause_at:
            path = request_pause(self.run_dir)
            if self.stale:
                os.utime(path, (0, 0))
        return super().deliver(message)


def pausing(pause_at: int, run_dir: Path, stale: bool = False):
    def make(*args):
        grid = Pausing(*args)
        grid.pause_at, grid.run_dir, grid.stale = pause_at, run_dir, stale
        return grid
    return make


# Message 8 is in round 2's training: the run ends once round 2 is evaluated.
def test_a_paused_run_stops_after_its_round_and_resumes_to_the_same_metrics(tmp):
    _, expected, _ = run(tmp / "a", checkpoint=True)
    _, paused, error = run(tmp / "b", grid_type=pausing(8, tmp / "b" / "run"),
                           checkpoint=True)
    assert error is None and [r["round"] for r in paused] == [1, 2]
    summary = summary_of(tmp / "b")
    assert summary["complete"] is False and summary["paused-after-round"] == 2
    assert json.loads((tmp / "b" / "run" / CHECKPOINT_JSON).read_text())["round"] == 2
    assert (tmp / "b" / "run" / "client-state").is_dir()  # personal state and u_k kept
    assert not (tmp / "b" / "run" / PAUSE_REQUEST).exists()  # honoured, then removed
    _, resumed, error = run(tmp / "b", checkpoint=True, resume=True)
    assert error is None and summary_of(tmp / "b")["complete"] is True
    assert "paused-after-round" not in summary_of(tmp / "b")
    assert accuracies(resumed) == accuracies(expected)
    assert losses(resumed) == pytest.approx(losses(expected), rel=1e-4)


@pytest.mark.parametrize("overrides,pause_at,stale", [
    ({"checkpoint": False}, 2, False),  # nothing to continue from: the run goes on
    ({"checkpoint": True}, 8, False),  # asked in the last round: nothing left to pause
    ({"checkpoint": True}, 2, True),  # left by an earlier, killed run: stale
])
def test_a_pause_that_cannot_or_need_not_stop_the_run_is_dropped(tmp, overrides, pause_at,
                                                                  stale):
    _, rounds, error = run(tmp, grid_type=pausing(pause_at, tmp / "run", stale),
                           num_rounds=2, **overrides)
    assert error is None and len(rounds) == 2 and summary_of(tmp)["complete"] is True
    assert not (tmp / "run" / PAUSE_REQUEST).exists()


def test_a_pause_asked_while_the_run_starts_up_stops_it_after_round_1(tmp, monkeypatch):
    real = server_app.provenance

    def asked_meanwhile(*args):
        # The run holds its folder's lock and prepares (provenance, the clients'
        # warm-up): `experiments pause` accepts a request now.
        request_pause(tmp / "run")
        time.sleep(0.05)
        return real(*args)

    monkeypatch.setattr(server_app, "provenance", asked_meanwhile)
    _, rounds, error = run(tmp, checkpoint=True, num_rounds=2)
    assert error is None and [r["round"] for r in rounds] == [1]
    assert summary_of(tmp)["paused-after-round"] == 1
    assert not (tmp / "run" / PAUSE_REQUEST).exists()


def test_a_run_is_never_restarted_over_without_overwrite(tmp):
    crashing = Crashing(client_app.app, K, {})

    def grid(*args):
        crashing.__init__(*args)
        crashing.crash_at = 8
        return crashing

    with pytest.raises(Crash):
        run(tmp, grid_type=grid, checkpoint=True)
    _, _, error = run(tmp, checkpoint=True)
    assert error is not None and "holds an unfinished run (checkpoint after round 1)" in error
    assert (tmp / "run" / CHECKPOINT_JSON).is_file()
    _, rounds, error = run(tmp, checkpoint=True, resume=True)
    assert error is None and len(rounds) == 3
    _, rounds, error = run(tmp, checkpoint=True, num_rounds=1)  # finished: still kept
    assert error is not None and "holds a finished run of 3 rounds" in error
    assert len(rounds) == 3
    _, rounds, error = run(tmp, checkpoint=True, num_rounds=1, overwrite=True)
    assert error is None and len(rounds) == 1


def assert_only_final_personal(folder: Path) -> None:
    """A finished simulation keeps its clients' final personalized parameters only."""
    if not folder.exists():  # a method with no personalized parameters (FedAvg-like)
        return
    assert (folder / FINAL_MARKER).is_file()
    for path in folder.glob("partition-*.npz"):
        with np.load(path) as data:
            assert not [n for n in data.files if n.startswith("local-reference/")]


def summary_of(tmp: Path) -> dict:
    return json.loads((tmp / "run" / "summary.json").read_text())


def test_a_finished_run_that_kept_its_client_state_extends_as_if_never_stopped(tmp):
    _, expected, _ = run(tmp / "a", checkpoint=True)  # 3 rounds at once
    _, _, error = run(tmp / "b", checkpoint=True, keep_client_state=True, num_rounds=2)
    assert error is None and summary_of(tmp / "b")["can-extend"] is True
    assert (tmp / "b" / "run" / "client-state").is_dir()
    _, extended, error = run(tmp / "b", checkpoint=True, resume=True)  # 2 -> 3 rounds
    assert error is None
    assert summary_of(tmp / "b")["complete"] and summary_of(tmp / "b")["rounds"] == 3
    assert accuracies(extended) == accuracies(expected)
    assert losses(extended) == pytest.approx(losses(expected), rel=1e-4)
    # This time keep-client-state was not asked: u_k goes, and so does the option.
    assert_only_final_personal(tmp / "b" / "run" / "client-state")
    assert summary_of(tmp / "b")["can-extend"] is False


def test_an_extension_stopped_before_its_first_new_round_leaves_the_run_finishable(tmp):
    _, expected, _ = run(tmp, checkpoint=True, keep_client_state=True, num_rounds=2)

    def crashing(*args):  # killed at once: no new round recorded, no summary written
        grid = Crashing(*args)
        grid.crash_at = 0
        return grid

    with pytest.raises(Crash):
        run(tmp, grid_type=crashing, checkpoint=True, keep_client_state=True, resume=True,
            num_rounds=3)
    assert not (tmp / "run" / "summary.json").exists()
    # Back at its old length, the run is finished again from its checkpoint.
    grid, rounds, error = run(tmp, checkpoint=True, keep_client_state=True, resume=True,
                              num_rounds=2)
    assert error is None and grid.sent == []
    assert accuracies(rounds) == accuracies(expected)
    assert summary_of(tmp)["complete"] and summary_of(tmp)["rounds"] == 2
    assert summary_of(tmp)["can-extend"] is True
    _, _, error = run(tmp, checkpoint=True, keep_client_state=True, resume=True,
                      num_rounds=2)
    assert error is not None and "already at round 2 of num-rounds = 2" in error


def test_a_finished_run_without_its_client_state_is_not_extended(tmp):
    run(tmp, checkpoint=True, num_rounds=2)
    assert summary_of(tmp)["can-extend"] is False
    before = (tmp / "run" / "metrics.json").read_text()
    _, _, error = run(tmp, checkpoint=True, resume=True)
    assert error is not None and "cannot be extended" in error
    assert "keep-client-state = true" in error
    assert (tmp / "run" / "metrics.json").read_text() == before  # nothing written
    assert summary_of(tmp)["complete"] and summary_of(tmp)["rounds"] == 2


def test_a_method_without_client_state_extends_without_keeping_any(tmp):
    _, _, error = run(tmp, method="fedavg", fedspc=False, checkpoint=True, num_rounds=1)
    assert error is None and summary_of(tmp)["can-extend"] is True
    _, rounds, error = run(tmp, method="fedavg", fedspc=False, checkpoint=True, resume=True,
                           num_rounds=2)
    assert error is None and [r["round"] for r in rounds] == [1, 2]


@pytest.mark.parametrize("change,clients,message", [
    ({"seed": 1}, K, "seed: checkpoint 0, run-config 1"),
    ({"method": "fedper"}, K, "method: checkpoint 'fedrep', run-config 'fedper'"),
    ({"model": "cnn-bn"}, K, "model: checkpoint 'cnn', run-config 'cnn-bn'"),
    ({"personal-keys": "fc.*,head.*"}, K, "personal-keys: checkpoint '', run-config"),
    ({}, K + 1, f"num-clients: checkpoint {K}, run-config {K + 1}"),
])
def test_a_checkpoint_of_another_config_is_refused(tmp, change, clients, message):
    run(tmp, checkpoint=True, num_rounds=1)
    run_config = {**BASE, **change, "checkpoint": True, "resume": True, "num-rounds": 2,
                  "output-dir": str(tmp), "run-name": "run"}
    with pytest.raises(SystemExit, match="belongs to another run .*" + re.escape(message)):
        server_app.main(InProcessGrid(client_app.app, clients, run_config),
                        Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                run_config=run_config))
    assert json.loads((tmp / "run" / CHECKPOINT_JSON).read_text())["round"] == 1  # kept


def test_a_checkpoint_from_before_a_key_existed_resumes_when_the_key_has_its_default(tmp):
    run(tmp, checkpoint=True, keep_client_state=True, num_rounds=1)
    path = tmp / "run" / CHECKPOINT_JSON
    payload = json.loads(path.read_text())
    del payload["run"]["model-width"]  # as written before the key was added
    path.write_text(json.dumps(payload))
    _, rounds, error = run(tmp, checkpoint=True, resume=True, num_rounds=2)
    assert error is None and [r["round"] for r in rounds] == [1, 2]


def test_a_run_whose_folder_is_in_use_stops_before_writing(tmp):
    run_config = {**BASE, "checkpoint": True, "output-dir": str(tmp), "run-name": "run"}
    with folder_lock(tmp / "run", "run 'run' (elsewhere)"), \
            pytest.raises(SystemExit, match=r"run is in use by run 'run' \(elsewhere\)"):
        server_app.main(InProcessGrid(client_app.app, K, run_config),
                        Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                run_config=run_config))
    assert not (tmp / "run").exists()
    _, rounds, error = run(tmp, checkpoint=True, num_rounds=1)  # free again: it runs
    assert error is None and len(rounds) == 1


@pytest.mark.parametrize("node_config,message", [
    ({"partition-id": 0, "num-partitions": 2, "state_dir": "/x"},
     "unknown node-config key 'state_dir' (did you mean: state-dir"),
    ({"partition-id": 0, "num-partitions": 2, "datadir": "/x"}, "did you mean: data-dir"),
    ({"partition-id": "one", "num-partitions": 2}, "'partition-id' must be an integer"),
    ({"partition-id": 2, "num-partitions": 2}, "is not in [0, num-partitions=2)"),
    ({"partition-id": 0}, "lacks num-partitions"),
    ({"partition-id": 0, "num-partitions": 2, "state-dir": 3}, "must be a quoted path"),
])
def test_node_config_is_validated(node_config, message):
    with pytest.raises(ConfigError) as info:
        check_node_config(node_config)
    assert message in str(info.value)


def test_a_valid_node_config():
    assert check_node_config({"partition-id": 1, "num-partitions": 2,
                              "data-dir": "/d", "state-dir": "/s"}) == (1, 2)


def test_dropped_reply_reasons_are_plain_strings_in_metrics(tmp):
    # ``rounds`` is metrics.json as written: one readable line per dropped reply, the
    # node and the client's own exception.
    _, rounds, _ = run(tmp, Faulty({(1, 1, "train"): RuntimeError("disk full")}),
                       num_rounds=1)
    assert rounds[0]["dropped-reasons"] == ["node 1: client error: RuntimeError: disk full"]



# ---------------------------------------------------------------- evaluation schedule
def evaluated_clients(grid: InProcessGrid) -> dict[int, int]:
    counts: dict[int, int] = {}
    for message in grid.sent:
        if message.metadata.message_type == MessageType.EVALUATE:
            server_round = int(message.content.config_records["config"]["server-round"])
            counts[server_round] = counts.get(server_round, 0) + 1
    return counts


def test_periodic_evaluation_always_evaluates_the_last_round(tmp):
    grid, rounds, error = run(tmp, num_rounds=5, evaluate_every=2)
    assert error is None
    assert evaluated_clients(grid) == {2: K, 4: K, 5: K}
    assert [r.get("accuracy") is not None for r in rounds] == [False, True, False, True, True]
    summary = json.loads((tmp / "run" / "summary.json").read_text())
    assert summary["complete"] and summary["final-round"] == 5


def test_sampled_evaluation_uses_every_client_in_the_last_round(tmp):
    grid, rounds, error = run(tmp, evaluate_fraction=0.34)  # 1 of 3 clients
    assert error is None
    assert evaluated_clients(grid) == {1: 1, 2: 1, 3: K}
    assert [r["clients"] for r in rounds] == [1, 1, K]
    # A client left out of an evaluation settles its state at its next message.
    assert all(ClientState.from_records(grid.state(p), PENDING) is None for p in range(K))
    assert [ClientState.from_records(grid.state(p), COMMITTED).round for p in range(K)] \
        == [3, 3, 3]


def test_a_resumed_run_with_partial_participation_samples_the_same_clients(tmp):
    # Two of three clients train each round. The resumed half runs on nodes with other
    # ids (as a restarted simulation's): the draw is over partition ids, so the same
    # clients train and the metrics are those of the uninterrupted run.
    overrides = {"checkpoint": True, "fraction_train": 0.67}
    _, expected, _ = run(tmp / "a", **overrides)

    def trained(rounds):  # the clients whose updates a round aggregated
        return [sorted(int(k) for k in r["client-update-norms"]) for r in rounds]

    assert [len(ids) for ids in trained(expected)] == [2, 2, 2]
    assert len({tuple(ids) for ids in trained(expected)}) > 1  # not one fixed pair

    def crashing(*args):
        grid = Crashing(*args)
        grid.crash_at = 7  # round 1: 2 train, 3 evaluate; round 2's second train message
        return grid

    with pytest.raises(Crash):
        run(tmp / "b", grid_type=crashing, **overrides)

    def renumbered(*args):
        return InProcessGrid(*args, node_ids=[907, 15, 311])

    grid, resumed, error = run(tmp / "b", grid_type=renumbered, resume=True, **overrides)
    assert error is None
    assert trained(resumed) == trained(expected)
    assert accuracies(resumed) == accuracies(expected)
    assert losses(resumed) == losses(expected)
    # The renumbered nodes were bound to their partitions by their warm-up answers:
    # no partition query was needed.
    kinds = [m.content.config_records["config"]["query"] for m in grid.queries]
    assert sorted(m.metadata.dst_node_id for m in grid.queries) == [15, 311, 907]
    assert kinds == ["warm-up"] * 3


def test_a_failed_round_keeps_the_last_checkpoint_and_is_done_again_on_resume(
        tmp, monkeypatch):
    # Round 2 fails (two of three clients raise) and the server dies after its
    # aggregation, before the round's record: the checkpoint is still round 1's, and
    # the resumed run does round 2 again (the clients are back).
    from fedspc_app.runs import checkpoint as checkpoint_module

    real = checkpoint_module.RoundRecords.on_round_end

    def dies_in_round_2(self, server_round, *args):
        if server_round == 2:
            raise Crash
        return real(self, server_round, *args)

    monkeypatch.setattr(checkpoint_module.RoundRecords, "on_round_end", dies_in_round_2)
    faults = {(node, 2, "train"): RuntimeError("down") for node in (1, 2)}
    with pytest.raises(Crash):
        run(tmp, Faulty(faults), checkpoint=True)
    saved = json.loads((tmp / "run" / CHECKPOINT_JSON).read_text())
    assert (saved["round"], saved["phase"], saved["failed-streak"]) == (1, "complete", 0)
    monkeypatch.setattr(checkpoint_module.RoundRecords, "on_round_end", real)
    _, rounds, error = run(tmp, checkpoint=True, resume=True)
    assert error is None
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert [r["failed"] for r in rounds] == [0, 0, 0]
    assert all(r["checkpoint-seconds"] > 0 for r in rounds)  # measured every round


def test_a_finite_blow_up_fails_its_rounds_and_stops_the_run(tmp):
    """FedRep + FedSPC at learning-rate 5000: whether a client's loss reaches NaN or a
    finite 1e25, it has diverged; every round fails and max-failed-rounds stops the
    run with nothing of the blow-up aggregated."""
    grid, rounds, error = run(tmp, num_rounds=6, max_failed_rounds=3, learning_rate=5000.0)
    assert error is not None and "3 rounds in a row failed" in error
    assert [r["failed"] for r in rounds] == [1, 1, 1]
    reasons = " ".join(reason for r in rounds for reason in r["dropped-reasons"])
    assert "DivergenceError" in reasons
    assert "over 100 times" in reasons  # finite blow-ups, caught by the factor
    first = broadcast(grid, 1)
    for server_round in (2, 3):  # nothing was aggregated: the initial body, finite
        for key, value in broadcast(grid, server_round).items():
            np.testing.assert_array_equal(value, first[key])
    assert all_finite(first)


# ------------------------------------------------------------- checkpoint files
def state_after(server_round: int, value: float) -> Checkpoint:
    """A checkpoint whose shared block and u_bar hold ``value``."""
    return Checkpoint(server_round, COMPLETE, {"w": np.full(2, value)},
                      {"u": np.full(2, value)}, {})


def test_an_arrays_file_a_killed_write_left_is_never_taken_for_a_later_round(tmp):
    config = parse_run_config({**BASE, "checkpoint": True, "resume": True,
                               "output-dir": str(tmp), "run-name": "run", "num-rounds": 10})
    identity = fingerprint(config, K)
    write_checkpoint(config.run_dir, state_after(3, 3.0), identity, new_arrays=True)
    # Round 4's first attempt wrote its arrays and was killed before checkpoint.json.
    with atomic_open(config.run_dir / "checkpoint-r00004.npz") as handle:
        np.savez(handle, **{"shared/w": np.full(2, 4.0), "reference/u": np.full(2, 4.0)})
    assert resume_point(config, identity).round == 3
    # The retried round 4 fails: its record keeps round 3's shared block and u_bar.
    write_checkpoint(config.run_dir, state_after(4, 3.0), identity, new_arrays=False)
    saved = read_checkpoint(config.run_dir, identity)
    assert saved.round == 4 and saved.shared["w"].tolist() == [3.0, 3.0]
    assert np.asarray(saved.global_reference["u"]).tolist() == [3.0, 3.0]
    # Killed in round 1's first write: no checkpoint.json, and the arrays go too.
    remove_checkpoint(config.run_dir)
    with atomic_open(config.run_dir / "checkpoint-r00001.npz") as handle:
        np.savez(handle, **{"shared/w": np.full(2, 1.0)})
    assert resume_point(config, identity) is None
    assert not list(config.run_dir.glob("checkpoint*"))


def test_what_a_killed_checkpoint_write_left_is_removed(tmp):
    leftovers = (".checkpoint-r00001.npz.4fypfipp.tmp", f".{CHECKPOINT_JSON}.x7k2q9ab.tmp")
    for name in leftovers:
        (tmp / name).write_bytes(b"half a file")
    write_checkpoint(tmp, state_after(2, 2.0), {}, new_arrays=True)
    assert sorted(p.name for p in tmp.iterdir()) == ["checkpoint-r00002.npz", CHECKPOINT_JSON]
    for name in leftovers:
        (tmp / name).write_bytes(b"half a file")
    remove_checkpoint(tmp)
    assert list(tmp.iterdir()) == []


@pytest.mark.parametrize("change", [{"node-wait": 600.0}, {"round-timeout": 600.0},
                                    {"max-failed-rounds": 5}, {"min-train-replies": 0.8}])
@pytest.mark.parametrize("recorded", [False, True])
def test_the_failure_policy_may_change_when_a_run_resumes(tmp, change, recorded):
    keys = {**BASE, "checkpoint": True, "output-dir": str(tmp), "run-name": "run"}
    first = parse_run_config(keys)
    identity = fingerprint(first, K)
    if recorded:  # a checkpoint written while node-wait was part of the settings
        identity["node-wait"] = first.node_wait
    write_checkpoint(first.run_dir, state_after(2, 2.0), identity, new_arrays=True)
    again = parse_run_config({**keys, "resume": True, **change})
    assert read_checkpoint(again.run_dir, fingerprint(again, K)).round == 2


class NoState:
    """A strategy's checkpointed parts, empty."""

    def state_arrays(self):
        return {}

    def optimizer_arrays(self):
        return {}

    def state_dict(self):
        return {}


def test_a_run_the_privacy_budget_ends_early_is_not_paused_after_its_last_round(tmp):
    config = parse_run_config({**BASE, "checkpoint": True, "output-dir": str(tmp),
                               "run-name": "run", "num-rounds": 10})
    recorder = RunRecorder(config, echo=lambda _: None)
    recorder.start()
    recorder.num_rounds = 3  # as dp-target-epsilon allowing 3 of the 10 rounds sets it
    records = RoundRecords(config, NoState(), recorder, {}, None, since=0.0)
    request_pause(recorder.run_dir)  # asked during round 2
    with pytest.raises(RunPaused):
        records.on_round_end(2, None, None, None)
    request_pause(recorder.run_dir)  # asked during the last round: nothing to pause
    records.on_round_end(3, None, None, None)


def without_run(folder: Path) -> None:
    payload = json.loads((folder / CHECKPOINT_JSON).read_text())
    del payload["run"]
    (folder / CHECKPOINT_JSON).write_text(json.dumps(payload))


def truncated_arrays(folder: Path) -> None:
    arrays = folder / "checkpoint-r00002.npz"
    arrays.write_bytes(arrays.read_bytes()[:100])


@pytest.mark.parametrize("damage,message", [
    (without_run, "no 'run'"),
    (truncated_arrays, "not a zip file"),
    (lambda folder: (folder / CHECKPOINT_JSON).write_text("null"), "not a JSON object"),
    (lambda folder: (folder / CHECKPOINT_JSON).write_text("[1, 2]"), "not a JSON object"),
    (lambda folder: (folder / CHECKPOINT_JSON).write_text('{"format": 1, "run": 3, '
                                                          '"strategy": {}}'), "JSON objects"),
])
def test_a_damaged_checkpoint_is_one_config_error_naming_it(tmp, damage, message):
    write_checkpoint(tmp, state_after(2, 2.0), {}, new_arrays=True)
    damage(tmp)
    with pytest.raises(ConfigError, match=f"cannot resume from .*{CHECKPOINT_JSON}: .*{message}"):
        read_checkpoint(tmp, {})


def test_the_folder_named_explicitly_resumes_the_run_its_default_name_started(tmp):
    keys = {**BASE, "checkpoint": True, "output-dir": str(tmp)}
    first = parse_run_config(keys)  # the default run name
    write_checkpoint(first.run_dir, state_after(2, 2.0), fingerprint(first, K),
                     new_arrays=True)
    again = parse_run_config({**keys, "resume": True, "run-name": first.resolved_run_name})
    assert again.run_dir == first.run_dir
    assert read_checkpoint(again.run_dir, fingerprint(again, K)).round == 2
    # A checkpoint written while run-name was part of the settings resumes too.
    write_checkpoint(first.run_dir, state_after(2, 2.0),
                     {**fingerprint(first, K), "run-name": ""}, new_arrays=True)
    assert read_checkpoint(again.run_dir, fingerprint(again, K)).round == 2
