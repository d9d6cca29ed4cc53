"""Every benchmark script still imports what it uses: ``--help`` of each exits 0.

The scripts run only by hand (benchmarks, data tools), so a moved or renamed module
would otherwise break them silently.
"""

from __future__ import annotations

import importlib.util
import json
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


def _script(relative: str):
    """A results script as a module (it is a script, not a package)."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recompute():
    """The regime study's recompute.py as a module (it is a script, not a package)."""
    return _script("docs/results/regime-study/recompute.py")


def _write_run(folder: Path, accuracies: dict, complete: bool = True, **last) -> None:
    """A run folder whose metrics.json has these accuracies (fractions) by round."""
    folder.mkdir(parents=True)
    rounds = [{"round": r, "accuracy": a, "dp-epsilon": r / 10} for r, a in accuracies.items()]
    rounds[-1].update(last)
    (folder / "metrics.json").write_text(json.dumps(
        {"rounds": rounds, "summary": {"complete": complete}}))


def test_the_dp_grid_scores_its_predictions_by_the_rules_it_states(tmp_path):
    score = _script("docs/results/cpu-cifar100-cnn-dp-cross-device/score.py")
    assert set(score.Scores(tmp_path).predictions()) == {"D1", "D2", "D3", "D4", "D5", "D6",
                                                         "D7", "goal", "goal, level"}
    assert {ok for _, ok in score.Scores(tmp_path).predictions().values()} == {None}
    final = {  # points at the last round: no DP, DP, DP with u_bar smoothed, level
        ("fedavg", False): (30.0, 10.0, None, None), ("fedavg", True): (31.0, 9.0, 9.5, 9.0),
        ("fedrep", False): (40.0, 30.0, None, None), ("fedrep", True): (39.0, 28.0, 29.5, 30.0),
        ("lgfedavg", False): (35.0, 33.0, None, None),
        ("lgfedavg", True): (36.0, 33.5, 33.2, 34.6)}
    grid = tmp_path / score.GRID
    for (method, fedspc), accs in final.items():
        for setting, acc in zip(score.SETTINGS, accs):
            if acc is not None:
                _write_run(grid / score.name(method, fedspc, setting),
                           {10: 0.05, 100: acc / 100})
    sweep = {"fedrep": (20.0, 25.0, 26.0, 24.0, 18.0, 25.5),
             "lgfedavg": (22.0, 23.0, 24.0, 26.0, 27.0, 25.0)}
    for method, accs in sweep.items():
        for c, acc in zip((*score.FIXED_C, "adaptive"), accs):
            _write_run(tmp_path / score.SWEEP / f"{method}-{c}", {30: acc / 100},
                       **{"dp-clipping-norm": 0.4})
    seed1 = {"fedrep-no-dp": 30.0, "fedrep-dp": 29.0, "fedrep+fedspc-dp-level": 27.5,
             "lgfedavg-no-dp": 30.0, "lgfedavg-dp": 29.5, "lgfedavg+fedspc-dp-level": 29.0}
    for cell, acc in seed1.items():
        _write_run(tmp_path / score.SEED1 / cell, {100: acc / 100})
    got = {pid: ok for pid, (_, ok) in score.Scores(tmp_path).predictions().items()}
    # D1: losses 20 / 10 / 2; D2: 10 < 30, 33; D3: LG-FedAvg+FedSPC is above its base;
    # D4: LG-FedAvg's smoothed run is below its plain FedSPC run; goal: 29.5 < 30, and
    # level 30.0 >= 30; D5: LG-FedAvg's adaptive run is 2 points below its best fixed C;
    # D6: level 2 and 1.1 points above plain FedSPC, -0 and +1.6 against the base.
    # D7: level 1.5 and 0.5 below its base at seed 1, DP costing the bases 1 and 0.5.
    assert got == {"D1": True, "D2": True, "D3": False, "D4": False, "goal": False,
                   "goal, level": True, "D5": False, "D6": True, "D7": True}
    _write_run(tmp_path / score.SEED1 / "fedrep+fedspc-dp-level-x", {100: 0.2})
    (tmp_path / score.SEED1 / "fedrep+fedspc-dp-level" / "metrics.json").write_text(
        (tmp_path / score.SEED1 / "fedrep+fedspc-dp-level-x" / "metrics.json").read_text())
    assert score.Scores(tmp_path).predictions()["D7"][1] is False  # 9 points below
    text = score.Scores(tmp_path).report()
    assert "| FedRep+FedSPC | 39.00 | 28.00 | 29.50 | 30.00 | 11.00 | 10.00 |" in text
    assert "| LG-FedAvg | 22.00 | 23.00 | 24.00 | 26.00 | 27.00 | 25.00 | 0.400 |" in text
    assert "| fedrep-dp | — | — | — | — | — | — |" in text  # no C recorded in these runs
    # An unfinished run does not count.
    _write_run(grid / "x", {10: 0.5}, complete=False)
    assert score.load_run(grid / "x") is None


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


def test_the_tables_flag_a_pair_made_on_two_kinds_of_cpu(tmp_path, monkeypatch):
    recompute = _recompute()
    grid = tmp_path / "grid"
    for run in ("lgfedavg-s2", "lgfedavg+fedspc-s2"):  # both on one CPU kind, one segment each
        source = ROOT / "docs/results/cpu-cifar100-resnet34-e5" / run
        (grid / run).mkdir(parents=True)
        for name in ("config.json", "metrics.json"):
            (grid / run / name).write_text((source / name).read_text())
    monkeypatch.setattr(recompute, "RESULTS", tmp_path)
    flags = recompute.pair_flags("grid", "lgfedavg-s2", None, None, {})
    assert "m" not in flags
    path = grid / "lgfedavg+fedspc-s2" / "config.json"
    config = json.loads(path.read_text())
    config["segments"][-1]["machine"] = {**config["segments"][-1]["machine"], "cpu": "AMD EPYC"}
    path.write_text(json.dumps(config))
    assert recompute.pair_flags("grid", "lgfedavg-s2", None, None, {}) == flags + "m"
    # A run that records no machine is not counted as another kind.
    for segment in config["segments"]:
        segment.pop("machine")
    config.pop("machine", None)
    path.write_text(json.dumps(config))
    assert "m" not in recompute.pair_flags("grid", "lgfedavg-s2", None, None, {})


def test_the_tables_row_of_a_cell_with_seeds_to_run(tmp_path, monkeypatch):
    # A longer horizon of a cell shows as its own row once two seeds are complete,
    # naming the seeds still to run; with one seed it is not shown.
    recompute = _recompute()
    source = ROOT / "docs/results/cpu-cifar100-resnet34-e5"
    for seed in (0, 1, 2):
        for run in (f"lgfedavg-s{seed}", f"lgfedavg+fedspc-s{seed}"):
            (tmp_path / "grid" / run).mkdir(parents=True)
            for name in ("config.json", "metrics.json", "summary.json"):
                (tmp_path / "grid" / run / name).write_text((source / run / name).read_text())
    (tmp_path / "grid/lgfedavg+fedspc-s2/summary.json").unlink()  # seed 2 still running
    monkeypatch.setattr(recompute, "RESULTS", tmp_path)
    monkeypatch.setattr(recompute, "README_CELLS", [
        (("ResNet-34", "head", 5), [("grid", f"lgfedavg-s{s}", None, None) for s in (0, 1, 2)])])
    rows = recompute.when_table().splitlines()
    assert len(rows) == 3
    assert rows[2].startswith("| ResNet-34 | head | 5 | 0.1 | 10 | +2.58 ± 0.09 (+2.64, +2.52; seed 2 to run) |")
    (tmp_path / "grid/lgfedavg-s1/summary.json").unlink()
    assert len(recompute.when_table().splitlines()) == 2
