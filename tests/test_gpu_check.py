"""The GPU check script, dry-run on the CPU: the same path a lent GPU machine runs.

``scripts/gpu_check.sh`` writes synthetic CIFAR-100-shaped data, runs the benchmark
through Flower's simulation engine once per setting and prints a summary table. Here
it runs the small CNN on 2 clients for 2 rounds, in fp32 and in bf16 autocast with
channels-last, so a broken option or a broken summary shows before a GPU session
spends its minutes on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def gpu_check(tmp_path: Path, settings: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DEVICE="cpu", MODEL="cnn", CLIENTS="2", ROUNDS="2",
               TRAIN="400", TEST="100", SETTINGS=settings, PYTHON=sys.executable,
               WORK=str(tmp_path / "work"))
    return subprocess.run(["bash", str(SCRIPT)], check=False, env=env, capture_output=True,
                          text=True, timeout=900)


def summary_rows(stdout: str) -> dict[str, list[str]]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("setting"))
    return {line.split()[0]: line.split()[1:] for line in lines[start + 1:]
            if line.startswith("g")}


def test_the_dry_run_measures_every_setting(tmp_path):
    done = gpu_check(tmp_path, "0:fp32 0:bf16:cl")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = summary_rows(done.stdout)
    assert set(rows) == {"g0-fp32", "g0-bf16-cl"}
    for name, (first, steady, images, memory) in rows.items():
        assert float(first) > 0 and float(steady) > 0, name
        assert float(images) > 0, name
        assert memory == "n/a", name  # no GPU, no GPU memory samples
    assert "channels-last true" in done.stdout and "bf16" in done.stdout
    assert {p.name for p in (tmp_path / "work").glob("*.json")} == {
        "g0-fp32.json", "g0-bf16-cl.json"}


def test_a_failed_setting_fails_the_check(tmp_path):
    done = gpu_check(tmp_path, "0:fp16")  # not a precision the app accepts
    assert done.returncode != 0
    assert summary_rows(done.stdout) == {"g0-fp16": ["failed"]}
    assert "failed settings: g0-fp16" in done.stderr
    assert "'precision' = 'fp16' is not one of" in done.stdout + done.stderr
