"""Under differential privacy the results folder says nothing of how many clients a
round drew or how many replied (docs/privacy.md, threat model): no traffic, no round
or phase timings, no train loss or accuracy before aggregation, at most one dropped
reason, one warning a round; an empty draw looks like any other round."""

from __future__ import annotations

import csv
import json
from collections import Counter
from logging import WARNING
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Error, Message, MessageType, MetricRecord
from inprocess import InProcessGrid, run_server
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator
from test_privacy_secret import private_server
from test_strategies import FakeGrid, f32, from_node, record, reply

from fedspc_app import client_app
from fedspc_app.core.config import parse_run_config
from fedspc_app.core.dp_mechanism import clip_update
from fedspc_app.runs.results import (
    DP_WITHHELD,
    METRICS_CSV,
    METRICS_JSON,
    SUMMARY_JSON,
    RunRecorder,
)
from fedspc_app.runs.tensorboard import FOLDER
from strategies import PersonalizedFedAvg
from strategies.dp_release import Privacy
from strategies.personalized import PRIVATE_DROPPED

W = "w"


class Traffic:
    """Stands for the TrafficGrid: a round's bytes, as if m clients were messaged."""

    def __init__(self) -> None:
        self.sent = self.received = 0

    def take(self) -> tuple[int, int]:
        out = (self.sent, self.received)
        self.sent = self.received = 0
        return out


def train_metrics(loss: float) -> MetricRecord:
    return MetricRecord({"train-loss": loss, "update-norm": 0.5, "phase-seconds": 1.5,
                         "client-work-seconds": 3.0, "worker-start-seconds": 0.2,
                         "accuracy-before-aggregation": 0.3})


def evaluate_metrics() -> MetricRecord:
    return MetricRecord({"accuracy": 0.4, "weighted-accuracy": 0.4, "loss": 1.0,
                         "clients": 4, "client-ids": [0, 1, 2, 3], "phase-seconds": 0.5,
                         "client-setup-seconds": 0.1})


def record_run(tmp_path: Path, dp: bool) -> tuple[RunRecorder, list[str]]:
    settings = {"output-dir": str(tmp_path), "run-name": "dp" if dp else "plain",
                "num-rounds": 3, "tensorboard": True, "local-steps": 1}
    if dp:
        settings.update({"dp-clipping-norm": 1.0, "dp-noise-multiplier": 1.0})
    lines: list[str] = []
    traffic = Traffic()
    recorder = RunRecorder(parse_run_config(settings), traffic=traffic, echo=lines.append)
    recorder.start()
    for server_round, drawn in ((1, 3), (2, 1), (3, 4)):
        traffic.sent, traffic.received = 1000 * drawn, 700 * drawn
        recorder.on_round_end(server_round, train_metrics(0.1 * drawn), evaluate_metrics())
    recorder.finish()
    return recorder, lines


def test_under_privacy_no_traffic_or_timing_is_written_anywhere(tmp_path):
    recorder, lines = record_run(tmp_path, dp=True)
    run_dir = recorder.run_dir
    rows = json.loads((run_dir / METRICS_JSON).read_text())["rounds"]
    assert [key for row in rows for key in row if key in DP_WITHHELD] == []
    assert all(row["accuracy"] == 0.4 and row["update-norm"] == 0.5 for row in rows)
    with (run_dir / METRICS_CSV).open(newline="") as file:
        header = next(csv.reader(file))
    assert not set(header) & DP_WITHHELD and "accuracy" in header
    summary = json.loads((run_dir / SUMMARY_JSON).read_text())
    assert not set(summary) & DP_WITHHELD and "bytes-sent" not in summary
    # the run's total time grows with its total number of draws
    assert "wall-seconds" not in summary
    assert "wall-seconds" not in json.loads((run_dir / METRICS_JSON).read_text())["summary"]
    assert "] done: final accuracy" in lines[-1] and " in " not in lines[-1].split(":")[0]
    round_lines = [line for line in lines if " round " in line and "|" in line]
    assert len(round_lines) == 3
    assert not any("MB" in line or "ETA" in line or " s |" in line for line in round_lines)
    accumulator = EventAccumulator(str(run_dir / FOLDER), size_guidance={SCALARS: 0})
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    assert tags and not [t for t in tags if t.startswith("traffic/") or "seconds" in t]
    assert {e.wall_time for t in tags for e in accumulator.Scalars(t)} == {0.0}
    # The checkpoint's rows (the server's own) keep them, for a resumed run.
    assert recorder.rounds[1]["bytes-sent"] == 1000 and "round-seconds" in recorder.rounds[1]


def test_without_privacy_traffic_and_timings_are_still_written(tmp_path):
    recorder, lines = record_run(tmp_path, dp=False)
    rows = json.loads((recorder.run_dir / METRICS_JSON).read_text())["rounds"]
    assert [row["bytes-sent"] for row in rows] == [3000, 1000, 4000]
    assert all("round-seconds" in row and "train-seconds" in row for row in rows)
    summary = json.loads((recorder.run_dir / SUMMARY_JSON).read_text())
    assert summary["bytes-sent"] == 8000 and summary["bytes-received"] == 5600
    assert summary["wall-seconds"] >= 0 and "] done in " in lines[-1]
    assert "sent 0.0 MB, received 0.0 MB" in lines[-2] and "ETA" in lines[-2]


@pytest.mark.parametrize("dp", [True, False])
def test_a_paused_run_says_its_time_only_without_privacy(tmp_path, dp):
    settings = {"output-dir": str(tmp_path), "run-name": "paused", "num-rounds": 3,
                "local-steps": 1, **({"dp-clipping-norm": 1.0, "dp-noise-multiplier": 1.0}
                                     if dp else {})}
    lines: list[str] = []
    recorder = RunRecorder(parse_run_config(settings), traffic=Traffic(), echo=lines.append)
    recorder.start()
    recorder.on_round_end(1, train_metrics(0.1), evaluate_metrics())
    summary = recorder.finish(paused=1)
    assert ("wall-seconds" in summary) is not dp
    assert "paused after round 1 of 3" in lines[-1]
    assert ("run so far" in lines[-1]) is not dp


# Round 2 of this secret draws nobody at q = 0.3 among 4 clients; rounds 1 and 3 draw
# 2 and 4 (fedspc_app.core.dp_mechanism.secret_generator).
EMPTY_SECOND_ROUND = 53


def test_an_empty_draw_round_has_the_keys_of_any_other_round(tmp_path, monkeypatch):
    monkeypatch.setattr("strategies.personalized.new_secret", lambda: EMPTY_SECOND_ROUND)
    config = {"method": "fedrep", "fedspc": True, "num-rounds": 3, "batch-size": 32,
              "alpha": 1.0, "local-steps": 1, "checkpoint": False,
              "output-dir": str(tmp_path), "run-name": "empty", "fraction-train": 0.3,
              "dp-clipping-norm": 0.5, "dp-noise-multiplier": 0.01,
              "dp-clipping-quantile": 0.5, "dp-clipped-count-stddev": 1.0,
              "evaluate-before-aggregation": True, "dp-reference-smoothing": 0.5}
    grid = InProcessGrid(client_app.app, 4, config)
    assert run_server(grid, config) is None
    drawn = Counter(m.content.config_records["config"]["server-round"] for m in grid.sent
                    if m.metadata.message_type == MessageType.TRAIN)
    assert drawn == {1: 2, 3: 4}
    rows = json.loads((tmp_path / "empty" / METRICS_JSON).read_text())["rounds"]
    assert [row["failed"] for row in rows] == [0, 0, 0]
    assert set(rows[1]) == set(rows[0]) == set(rows[2])
    assert not {"train-dropped", "train-loss", "accuracy-before-aggregation"} & set(rows[1])


def dropped_round(bad: int, good: int, monkeypatch) -> tuple[list[str], list[str]]:
    """The reasons and the warnings of a private round with ``bad`` unusable replies
    and ``good`` usable ones among 4 drawn clients."""
    reasons, warnings, _ = train_round(bad, good, monkeypatch, private_server(1.0, 4, 0.0))
    return reasons, warnings


def train_round(bad: int, good: int, monkeypatch, server) -> tuple[list[str], list[str],
                                                                   tuple]:
    """:func:`dropped_round` on ``server``, with what its aggregation returned."""
    warnings: list[str] = []
    monkeypatch.setattr("strategies.personalized.log",
                        lambda level, text, *args: warnings.append(text % args)
                        if level == WARNING else None)
    server.configure_train(1, record({W: f32(0.0, 0.0)}), ConfigRecord(),
                           FakeGrid([1, 2, 3, 4]))
    replies = [reply({W: f32(0.1, 0.1)}, node=n, **{"num-examples": 5})
               for n in range(1, good + 1)]
    for node in range(good + 1, good + bad + 1):
        failed = Message(Error(code=0, reason=f"client {node} diverged"),
                         reply_to=reply({W: f32(0.1, 0.1)}, node=node))
        replies.append(from_node(failed, node))
    result = server.aggregate_train(1, replies)
    return server.report.reasons, warnings, result


@pytest.mark.usefixtures("task_identity")
def test_the_number_of_dropped_replies_is_read_neither_from_metrics_nor_logs(monkeypatch):
    one = dropped_round(1, 3, monkeypatch)
    three = dropped_round(3, 1, monkeypatch)
    every = dropped_round(4, 0, monkeypatch)  # every drawn reply unusable: no failure
    assert one == three == every == ([PRIVATE_DROPPED], [f"round 1: {PRIVATE_DROPPED}"])
    none = dropped_round(0, 4, monkeypatch)
    assert none == ([], [])


@pytest.mark.usefixtures("task_identity")
def test_how_many_usable_replies_came_decides_nothing_under_privacy(monkeypatch):
    """The failure oracle: had a private round failed with too few usable replies,
    drawn colluders spoiling their own would read from its ``failed`` whether another
    client was drawn. Under privacy min-train-replies is not applied: a round whose
    every drawn reply is unusable releases the noise alone, like an empty draw, with
    the metrics of any round."""
    outcomes = {}
    for bad, good in ((0, 4), (3, 1), (4, 0)):
        server = private_server(1.0, 4, 0.5)
        server.min_train_replies = 1.0  # (every reply: what it would have taken)
        _, _, (arrays, metrics) = train_round(bad, good, monkeypatch, server)
        outcomes[bad] = (arrays is not None, server.report.failed, sorted(metrics))
    assert outcomes[4] == outcomes[3] == outcomes[0]
    assert outcomes[4][:2] == (True, False)
    # Without privacy the threshold still fails the round.
    plain = PersonalizedFedAvg(shared_keys=[W], num_partitions=4, drift_keys=[W],
                               min_train_replies=0.5)
    _, _, result = train_round(3, 1, monkeypatch, plain)
    assert plain.report.failed and result == (None, None)


def clipping_round(server, updates) -> tuple[int, list[str]]:
    """How many of ``updates`` (one a node, from a broadcast of zeros; the other of
    the 4 drawn nodes reply with no change) ``server`` accepted in round 1, and the
    round's reasons."""
    updates = [*updates, *[f32(0.0, 0.0)] * (4 - len(updates))]
    server.configure_train(1, record({W: f32(0.0, 0.0)}), ConfigRecord(),
                           FakeGrid([1, 2, 3, 4]))
    server.aggregate_train(1, [reply({W: u}, node=n, **{"num-examples": 5})
                               for n, u in enumerate(updates, 1)])
    return server.report.accepted, server.report.reasons


@pytest.mark.usefixtures("task_identity")
def test_an_unclipped_reply_is_dropped_under_client_clipping():
    """Under client clipping the server checks each reply's update against C_t: one
    unclipped update (+1e8 an entry) would spoil the model, so that an honest client
    then fails whenever drawn and the round's dropped warning tells its draws."""
    def client_clipped(clip=1.0):
        return PersonalizedFedAvg(shared_keys=[W], num_partitions=4, drift_keys=[W],
                                  privacy=Privacy(clip, 0.0, steps=4))
    honest = clip_update({W: f32(30.0, 40.0)}, {W: f32(0.0, 0.0)}, [W], 1.0)[W]
    # at exactly C (0.6, 0.8 in float32: 1 + 2e-8), and clipped by the client's own code
    assert clipping_round(client_clipped(), [f32(0.6, 0.8), honest]) == (4, [])
    assert clipping_round(client_clipped(), [f32(0.6, 0.8), f32(1e8, 1e8)]) == (
        3, [PRIVATE_DROPPED])
    # 1.00016 C: beyond the 1e-4 tolerance
    assert clipping_round(client_clipped(), [f32(0.6, 0.8002)]) == (3, [PRIVATE_DROPPED])
    server = client_clipped()
    server.release.clipping_norm = 0.5  # C_t, as adaptive clipping moved it
    assert clipping_round(server, [f32(0.3, 0.4), f32(0.6, 0.8)]) == (3, [PRIVATE_DROPPED])
    # Under server clipping the server clips it itself.
    assert clipping_round(private_server(1.0, 4, 0.0), [f32(1e8, 1e8)]) == (4, [])


@pytest.mark.usefixtures("task_identity")
def test_a_rounds_training_messages_share_one_created_at_under_privacy():
    """Built one after another (~45 µs each), the messages' created_at would tell how
    many drawn messages were built between two colluders'."""
    server = private_server(1.0, 40, 0.0)
    messages = server.configure_train(1, record({W: f32(0.0, 0.0)}), ConfigRecord(),
                                      FakeGrid(list(range(1, 41))))
    assert len(messages) == 40
    assert len({m.metadata.created_at for m in messages}) == 1


def test_a_method_whose_model_trains_only_when_drawn_is_refused_under_privacy():
    # Ditto evaluates each client's personal model, which changes only when its client
    # is drawn: the published means, less the colluders' own, show another's draws.
    from fedspc_app.core.config import parse_run_config
    from fedspc_app.core.errors import ConfigError

    settings = {"dp-clipping-norm": 1.0, "dp-noise-multiplier": 1.0, "local-steps": 5}
    with pytest.raises(ConfigError, match="personal model .* refused"):
        parse_run_config({"method": "ditto", **settings})
    # A method that shares nothing: no release ever moves a client's model, so it
    # changes exactly in the rounds its client was drawn (an adversary read the
    # target's draws in 28 of 28 rounds from the published means).
    with pytest.raises(ConfigError, match="'local' shares nothing.* refused"):
        parse_run_config({"method": "local", **settings})
    parse_run_config({"method": "fedrep", **settings})
    parse_run_config({"method": "ditto"})  # without privacy: as before
    parse_run_config({"method": "local"})


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("how", ["tiny clipping norm", "tiny server learning rate"])
def test_a_release_that_moves_nothing_fails_the_round(how, monkeypatch):
    """C = 1e-30, or a server step of 1e-30, against weights near 1: float32 keeps the
    broadcast exactly, so a client's model would change only when drawn (its
    evaluation would say when: an adversary read 28 of 28 and 21 of 21 draws). The
    round fails instead, nothing accepted; a usable C releases as before."""
    from strategies import ServerOptimizer

    def server(clip: float, optimizer=None):
        return PersonalizedFedAvg(shared_keys=[W], num_partitions=4, drift_keys=[W],
                                  server_optimizer=optimizer,
                                  privacy=Privacy(clip, 1.0, steps=4, clip_on_server=True))

    def round_of(strategy):
        # The entry at 0 moves by ~1e-30 (float32 holds it): one of three is not enough.
        strategy.configure_train(1, record({W: f32(1.0, -2.0, 0.0)}), ConfigRecord(),
                                 FakeGrid([1, 2, 3, 4]))
        return strategy.aggregate_train(1, [reply({W: f32(1.1, -1.9, 0.1)}, node=n,
                                                  **{"num-examples": 5})
                                            for n in range(1, 5)])

    tiny = (server(1e-30) if how == "tiny clipping norm" else
            server(1.0, ServerOptimizer("fedavgm", [W], learning_rate=1e-30)))
    arrays, _ = round_of(tiny)
    assert arrays is None and tiny.report.failed and tiny.report.accepted == 0
    assert "leaves 2 of the shared block's 3 released entries" in tiny.report.reasons[-1]
    assert tiny.accepted_rounds == [0, 0, 0, 0]  # no client keeps what it trained
    arrays, _ = round_of(server(1.0))
    assert arrays is not None


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize(("name", "options", "moments"), [
    ("fedadam", {}, {"m/w": f32(0.1, 0.2, 0.3), "v/w": f32(0.01, 0.02, 0.03)}),
    ("fedadam", {}, {}),
    ("fedavgm", {"momentum": 0.9}, {"momentum/w": f32(0.5, -0.5, 0.25)})])
def test_a_failed_release_leaves_the_server_optimizers_moments_as_they_were(
        name, options, moments):
    """The server optimizer steps (and moves its moments) before the release is found
    to move nothing: the failed round restores them with the rest, so the next round
    steps, and the checkpoint saves, as if the failed round had not been."""
    from strategies import ServerOptimizer

    optimizer = ServerOptimizer(name, [W], learning_rate=1e-30, **options)
    strategy = PersonalizedFedAvg(shared_keys=[W], num_partitions=4, drift_keys=[W],
                                  server_optimizer=optimizer,
                                  privacy=Privacy(1.0, 1.0, steps=4, clip_on_server=True))
    strategy.load_optimizer_arrays(moments)
    strategy.configure_train(1, record({W: f32(1.0, -2.0, 0.0)}), ConfigRecord(),
                             FakeGrid([1, 2, 3, 4]))
    arrays, _ = strategy.aggregate_train(1, [reply({W: f32(1.1, -1.9, 0.1)}, node=n,
                                                   **{"num-examples": 5})
                                             for n in range(1, 5)])
    assert arrays is None and strategy.report.failed
    state = strategy.optimizer_arrays()
    assert set(state) == set(moments)
    for key, value in moments.items():
        assert (state[key] == value).all()


def buffer_probe(unused: bool):
    """A model of one's own: frozen random features (a buffer) and a linear head; with
    ``unused`` also a trainable layer in the body that the forward pass never uses."""
    import torch
    from torch import nn

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("features", torch.randn(3 * 8 * 8, 6))
            if unused:
                self.spare = nn.Linear(4, 4)
            self.fc = nn.Linear(6, 5)

        def forward(self, x):
            return self.fc(x.flatten(1) @ self.features)

        def get_classifier(self):
            return self.fc

    return Probe()


@pytest.mark.parametrize("unused,needle", [(False, "no trainable parameter"),
                                           (True, "reaches the model's output")])
def test_dp_is_refused_where_the_release_cannot_move_the_evaluated_model(unused, needle):
    """FedPer on a frozen-features probe shares only a buffer (kept local under DP) or
    a parameter the model never uses: nothing released moves what is evaluated, so an
    adversary read the target's draws in 28 of 28 rounds. Refused before round 1; a
    model whose shared body is used passes."""
    from fedspc_app.core.errors import ConfigError
    from fedspc_app.core.methods import get_method
    from fedspc_app.models.networks import build_model
    from fedspc_app.models.split import check_private_release, parameter_split

    fedper = get_method("fedper")
    probe = buffer_probe(unused)
    split = parameter_split(probe, fedper, local_buffers=True)
    with pytest.raises(ConfigError, match=needle):
        check_private_release(probe, split, 3, 8)
    assert all(p.grad is None for p in probe.parameters()) and probe.training
    cnn = build_model("cnn", num_classes=10, seed=0)
    before = {k: v.clone() for k, v in cnn.state_dict().items()}
    check_private_release(cnn, parameter_split(cnn, fedper, local_buffers=True), 3, 32)
    assert all((before[k] == v).all() for k, v in cnn.state_dict().items())
