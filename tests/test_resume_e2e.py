"""Kill and resume a real simulation: ``python -m fedspc_app.simulate``, a SuperLink,
Flower's Ray engine. The run is killed with SIGKILL (every process it started,
SuperLink and Ray included) during round 4 of 6 and resumed with ``--resume``; it
must end with the metrics of the same run left alone. Then another is paused
with ``python -m fedspc_app.experiments pause`` and resumed, to the same end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedspc_app.core.files import lock_holder
from fedspc_app.launch.processes import owned_processes

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
SETTINGS = ("method='fedrep' fedspc=true num-rounds=6 local-epochs=1 alpha=0.5 seed=3 "
            "batch-size=32")


def simulate(output: Path, name: str, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "fedspc_app.simulate", "--clients", "3",
               "--set", f"{SETTINGS} output-dir='{output}' run-name='{name}'", *extra]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)


def rounds_done(run_dir: Path) -> int:
    try:
        return len(json.loads((run_dir / "metrics.json").read_text())["rounds"])
    except (OSError, ValueError, KeyError):
        return 0


def kill_everything(process: subprocess.Popen) -> None:
    tree = owned_processes(process.pid)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.2)


def metrics(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "metrics.json").read_text())["rounds"]


def accuracies(rounds: list[dict]) -> list:
    return [(r["round"], r["accuracy"], r["client-accuracy"]) for r in rounds]


def losses(rounds: list[dict]) -> list[float]:
    return [value for r in rounds for value in (r["loss"], r["train-loss"])]


def test_a_killed_simulation_resumes_to_the_uninterrupted_metrics(tmp_path):
    reference = simulate(tmp_path, "whole")
    assert reference.wait(timeout=900) == 0

    run_dir = tmp_path / "killed"
    victim = simulate(tmp_path, "killed")
    deadline = time.monotonic() + 900
    while rounds_done(run_dir) < 3:
        assert victim.poll() is None, "the run ended before round 4"
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(0.3)  # inside round 4
    kill_everything(victim)
    assert rounds_done(run_dir) == 3
    assert (run_dir / "client-state").is_dir()

    resumed = simulate(tmp_path, "killed", "--resume")
    assert resumed.wait(timeout=900) == 0
    whole = metrics(tmp_path / "whole")
    # Bit-identical: the same correct predictions, client by client and round by
    # round, and the same losses to the last bit (the server sums replies in
    # partition order, whatever order they arrive in).
    assert accuracies(metrics(run_dir)) == accuracies(whole)
    assert losses(metrics(run_dir)) == losses(whole)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["resumed-after-round"] in (3, 4)  # 4: its aggregation was checkpointed
    assert json.loads((run_dir / "summary.json").read_text())["complete"] is True

    # Paused on request instead: it ends after a round, exits with 3, and resumes.
    run_dir = tmp_path / "paused"
    paused = simulate(tmp_path, "paused")
    # Asked while the run starts up (its folder claimed, no round done yet), the pause
    # stops it after round 1; asked after a round, the rest of the six short rounds
    # could end before the pause command has started.
    while not ((run_dir / "config.json").is_file() and lock_holder(run_dir)):
        assert paused.poll() is None, "the run ended before it could be paused"
        assert time.monotonic() < deadline + 900
        time.sleep(0.2)
    subprocess.run([sys.executable, "-m", "fedspc_app.experiments", "pause", str(run_dir)],
                   cwd=REPO, check=True, capture_output=True)
    assert paused.wait(timeout=900) == 3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["complete"] is False and summary["paused-after-round"] < 6
    assert rounds_done(run_dir) == summary["paused-after-round"]
    assert not (run_dir / "pause-request.json").exists()
    assert simulate(tmp_path, "paused", "--resume").wait(timeout=900) == 0
    assert accuracies(metrics(run_dir)) == accuracies(whole)
    assert losses(metrics(run_dir)) == losses(whole)


def test_a_simulation_pauses_at_its_stop_by_and_resumes(tmp_path):
    # A stop time already past: the run does its one round, pauses, says why, exits 3.
    passed = "2001-01-01T00:00:00+00:00"
    command = [sys.executable, "-m", "fedspc_app.simulate", "--clients", "3", "--set",
               f"{SETTINGS} output-dir='{tmp_path}' run-name='late' stop-by='{passed}'"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900,
                          check=False)
    assert done.returncode == 3, done.stderr[-2000:]
    assert f"paused after round 1 of 6 (stop-by {passed})" in done.stderr
    run_dir = tmp_path / "late"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["paused-after-round"] == 1 and summary["paused-by"] == f"stop-by {passed}"
    assert simulate(tmp_path, "late", "--resume").wait(timeout=900) == 0
    assert rounds_done(run_dir) == 6
    assert json.loads((run_dir / "summary.json").read_text())["complete"] is True
