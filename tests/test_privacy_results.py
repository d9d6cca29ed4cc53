"""Under differential privacy the results folder says nothing of how many clients a
round drew or how many replied (docs/privacy.md, threat model): no traffic, no round
or phase timings, no train loss or accuracy before aggregation, at most one dropped
reason, one warning a round; an empty draw looks like any other round."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from flwr.app import MetricRecord
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from fedspc_app.core.config import parse_run_config
from fedspc_app.runs.results import (
    DP_WITHHELD,
    METRICS_CSV,
    METRICS_JSON,
    SUMMARY_JSON,
    RunRecorder,
)
from fedspc_app.runs.tensorboard import FOLDER


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
    assert "sent 0.0 MB, received 0.0 MB" in lines[-2] and "ETA" in lines[-2]
