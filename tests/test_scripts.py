"""Every benchmark script still imports what it uses: ``--help`` of each exits 0.

The scripts run only by hand (benchmarks, data tools), so a moved or renamed module
would otherwise break them silently.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))


def test_there_are_scripts():
    assert len(SCRIPTS) >= 5


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_a_script_starts_and_prints_its_usage(script):
    done = subprocess.run([sys.executable, str(script), "--help"], check=False, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()


def test_the_regime_studys_recomputation_runs_on_the_committed_metrics():
    # The study quotes only numbers this script recomputes; it must keep running as
    # runs are added, and score every prediction of PREDICTIONS.md.
    script = ROOT / "docs/results/regime-study/recompute.py"
    done = subprocess.run([sys.executable, str(script)], check=False, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    scored = done.stdout.split("== Predictions")[1]
    for pid in ("P1", "P2", "P3", "P4", "P5", "P6", "P7", "P8"):
        assert f"\n{pid}:" in scored
    assert "HIT" in scored or "MISS" in scored


def _recompute():
    """The regime study's recompute.py as a module (it is a script, not a package)."""
    path = ROOT / "docs/results/regime-study/recompute.py"
    spec = importlib.util.spec_from_file_location("recompute", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readmes_results_table_is_the_one_the_runs_give():
    # README.md's "When does FedSPC help?" table is rendered from the committed runs,
    # flags included; a run added or a figure edited by hand shows up here.
    recompute = _recompute()
    text = (ROOT / "README.md").read_text()
    assert recompute.BEGIN in text and recompute.END in text, (
        f"README.md has no {recompute.BEGIN} / {recompute.END} lines around the 'When does"
        " FedSPC help?' table: put them around it and run"
        " `python docs/results/regime-study/recompute.py --readme`")
    assert recompute.readme_block(text) == recompute.when_table(), (
        "README.md's 'When does FedSPC help?' table is not the one the runs give:"
        " run `python docs/results/regime-study/recompute.py --readme`")


def test_the_tables_flags_read_the_runs_records():
    recompute = _recompute()
    segments = recompute.log_segments()
    # Two builds, both runs resumed, round 9 only evaluated, no code version in config.json.
    assert recompute.pair_flags("cpu-cifar100-cnn-e5-seeds", "lgfedavg-s1", None, None,
                                segments) == "bren"
    # One build recorded in config.json, one segment each.
    assert recompute.pair_flags("cpu-cifar100-resnet18-depth", "fedrep-s0", None, None,
                                segments) == ""
    # config.json records one code version for both; the Base was resumed after round 6.
    assert recompute.pair_flags("cpu-cifar100-resnet34-e5", "fedrep-s0", None, None,
                                segments) == "r"
