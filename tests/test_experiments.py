"""Experiment grids (fedspc_app.experiments): expansion, filtering, resuming, failures.

Only the last test starts a SuperLink and Ray (marker ``e2e``); the others replace
the function that runs one cell, so nothing trains.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedspc_app.core.errors import ConfigError
from fedspc_app.core.files import folder_lock
from fedspc_app.experiments import cli, runner
from fedspc_app.experiments.grid import (
    Cell,
    expand_grid,
    filter_cells,
    load_grid,
    parse_only,
)
from fedspc_app.experiments.pausing import resolve_target
from fedspc_app.experiments.records import load_records
from fedspc_app.experiments.runner import run_grid
from fedspc_app.launch.runconfig import app_defaults, parse_assignments
from fedspc_app.launch.superlink import SimulationFailed
from fedspc_app.runs.pause import PAUSE_REQUEST, RunPaused, request_pause
from fedspc_app.runs.results import start_results

REPO = Path(__file__).resolve().parents[1]


def grid_of(spec: dict, tmp_path: Path, **kwargs):
    return expand_grid(spec, name="g", base_dir=tmp_path, output_dir=tmp_path / "out",
                       **kwargs)


def write_yaml(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def finish(cell: Cell, accuracy: float = 0.5) -> None:
    """Write what a finished run leaves behind."""
    cell.run_dir.mkdir(parents=True, exist_ok=True)
    (cell.run_dir / "config.json").write_text(json.dumps({"run-config": cell.run_config}))
    (cell.run_dir / "summary.json").write_text(json.dumps(
        {"complete": True, "rounds": 2, "final-accuracy": accuracy,
         "best-accuracy": accuracy, "best-round": 2, "wall-seconds": 1.0}))


# ---------------------------------------------------------------------- expansion
def test_cartesian_product_with_deterministic_unique_names(tmp_path):
    spec = {"base": {"num-rounds": 3},
            "axes": {"method": ["fedper", "fedrep"], "fedspc": [False, True],
                     "alpha": [0.1, 1.0], "seed": [0, 1]}}
    grid = grid_of(spec, tmp_path)
    names = [cell.name for cell in grid.cells]
    assert len(names) == 16 == len(set(names))
    assert names[:4] == ["fedper-a0.1-s0", "fedper-a0.1-s1", "fedper-a1-s0", "fedper-a1-s1"]
    assert "fedrep+fedspc-a0.1-s1" in names
    assert names == [cell.name for cell in grid_of(spec, tmp_path).cells]
    cell = next(c for c in grid.cells if c.name == "fedrep+fedspc-a1-s1")
    rc = cell.run_config
    assert (rc["method"], rc["fedspc"], rc["alpha"], rc["seed"]) == ("fedrep", True, 1.0, 1)
    assert rc["num-rounds"] == 3 and rc["local-epochs"] == 5  # base, then pyproject default
    assert rc["output-dir"] == str((tmp_path / "out" / "g").resolve())
    assert rc["run-name"] == cell.name
    assert cell.run_dir == tmp_path.resolve() / "out" / "g" / cell.name
    assert cell.assignment == {"method": "fedrep", "fedspc": True, "alpha": 1.0, "seed": 1}
    assert cell.setting == "digits-cnn"  # no setting axis: <dataset>-<model>
    assert grid.axes == {"method": ["fedper", "fedrep"], "fedspc": [False, True],
                         "alpha": [0.1, 1.0], "seed": [0, 1]}


def test_bundles_presets_and_precedence(tmp_path):
    (tmp_path / "base.toml").write_text('num-rounds = 7\nbatch-size = 16\nmomentum = 0.5\n')
    (tmp_path / "big.toml").write_text('model = "vgg11"\nnum-rounds = 50\n')
    spec = {"base": {"preset": "base.toml", "batch-size": 32},
            "axes": {"setting": {"small": {"model": "cnn", "learning-rate": 0.01},
                                 "big": {"preset": "big.toml", "num-rounds": 40}},
                     "method": ["fedper"]}}
    grid = grid_of(spec, tmp_path, overrides={"momentum": 0.9})
    small, big = grid.cells
    assert (small.name, big.name) == ("fedper-small", "fedper-big")
    assert (small.setting, big.setting) == ("small", "big")
    # defaults < base.preset < base < bundle preset < bundle keys < --set
    assert small.run_config["num-rounds"] == 7 and small.run_config["batch-size"] == 32
    assert small.run_config["learning-rate"] == 0.01 and small.run_config["model"] == "cnn"
    assert big.run_config["model"] == "vgg11" and big.run_config["num-rounds"] == 40
    assert big.run_config["learning-rate"] == 0.02
    assert small.run_config["momentum"] == big.run_config["momentum"] == 0.9
    assert grid.axes["setting"] == ["small", "big"]


def test_preset_relative_to_the_repo_root(tmp_path):
    grid = grid_of({"base": {"preset": "conf/cpu-cifar100-cnn.toml", "num-rounds": 2},
                    "axes": {"alpha": [0.1]}}, tmp_path)
    rc = grid.cells[0].run_config
    assert (rc["dataset"], rc["model"], rc["num-rounds"]) == ("cifar100", "cnn", 2)
    with pytest.raises(ConfigError, match="preset 'nowhere.toml' not found"):
        grid_of({"base": {"preset": "nowhere.toml"}, "axes": {"alpha": [0.1]}}, tmp_path)


def test_exclude_drops_matching_cells_and_checks_its_entries(tmp_path):
    spec = {"axes": {"method": ["scaffold", "fedrep"], "fedspc": [False, True]},
            "exclude": [{"method": "scaffold", "fedspc": True}]}
    names = [c.name for c in grid_of(spec, tmp_path).cells]
    assert names == ["scaffold", "fedrep", "fedrep+fedspc"]
    with pytest.raises(ConfigError, match="'model' is not an axis"):
        grid_of({**spec, "exclude": [{"model": "cnn"}]}, tmp_path)
    with pytest.raises(ConfigError, match="'fedavg' is not a value of axis 'method'"):
        grid_of({**spec, "exclude": [{"method": "fedavg"}]}, tmp_path)


def test_a_bad_cell_fails_before_anything_runs_naming_the_cell(tmp_path, monkeypatch):
    spec = {"axes": {"setting": {"ok": {"model": "cnn"}, "typo": {"learning-rte": 0.1}},
                     "method": ["fedper"]}}
    with pytest.raises(ConfigError, match=r"cell fedper-typo: unknown run-config key "
                                          r"'learning-rte' \(did you mean: learning-rate"):
        grid_of(spec, tmp_path)
    # SCAFFOLD with FedSPC is invalid unless excluded; the message names the cell.
    with pytest.raises(ConfigError, match="cell scaffold\\+fedspc: method 'scaffold'"):
        grid_of({"axes": {"method": ["scaffold"], "fedspc": [False, True]}}, tmp_path)
    # Through the command line: exit code 2, no cell run, no folder made.
    calls = []
    monkeypatch.setattr(runner, "run_federated_cell", lambda *a, **k: calls.append(a))
    path = write_yaml(tmp_path / "bad.yaml", spec)
    assert cli.main(["run", str(path), "--output-dir", str(tmp_path / "o")]) == 2
    assert calls == [] and not (tmp_path / "o").exists()


def test_malformed_grids_are_config_errors(tmp_path):
    for spec, message in [
        ({"axes": {"alpha": []}}, "axis 'alpha'"),
        ({"axes": {"alpha": [0.1, 0.1]}}, "lists 0.1 twice"),
        ({"axes": {"alpha": [0.1]}, "bogus": 1}, "unknown grid key"),
        ({"base": {"run-name": "x"}}, "'run-name' is set per cell"),
        ({"axes": {"alpha": [0.1]}, "simulation": {"gpus": 1}}, "unknown simulation"),
        ({"axes": {"alpha": [0.1]}, "simulation": {"client-cpus": 0}}, "client-cpus"),
        ({"axes": {"alpha": [0.1]}, "simulation": {"clients": 0}}, "clients must be"),
        ({"axes": {"alpha": [0.1]}, "simulation": {"timeout": 0}}, "timeout must be"),
        ({"axes": {"alpha": [{"a": 1}]}}, "is not a single value"),
        ({"axes": {"method": ["fedavg"]}, "exclude": [{"method": "fedavg"}]}, "no cells"),
    ]:
        with pytest.raises(ConfigError, match=message):
            grid_of(spec, tmp_path)


def test_bad_command_lines_are_one_line_on_stderr(tmp_path, capsys):
    grid = str(write_yaml(tmp_path / "g.yaml", {"axes": {"method": ["fedper", "fedrep"]}}))
    (tmp_path / "broken.yaml").write_text("axes: {method: [fedper\n")
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00")
    output = ["--output-dir", str(tmp_path / "o")]
    for argv, message in [
        (["run", str(tmp_path / "missing.yaml"), *output], "no grid file at"),
        (["list", str(tmp_path / "broken.yaml"), *output], "is not valid YAML: "),
        (["list", str(tmp_path / "binary.yaml"), *output], "cannot read grid file"),
        (["run", str(tmp_path), *output], "cannot read grid file"),
        (["run", grid, "--only", "method=[fedper", *output], "--only method=[fedper: not a"),
        (["list", grid, "--only", "modle=cnn", *output], "--only modle: not an axis"),
        (["list", grid, "--only", "method", *output], "--only expects axis=value"),
        (["run", grid, "--set", "num-rounds", *output], "key=value"),
        (["run", grid, "--set", "num-rounds=[1", *output], "num-rounds=[1"),
        (["run", grid, "--clients", "0", *output], "clients must be >= 1"),
        (["run", grid, "--set", "num-clients=4", *output],
         "cell fedper: run-config num-clients=4 but the simulation has 10 clients"),
        (["list", grid, "--set", "num-clients=4", "--clients", "5", *output],
         "give --clients 4, or num-clients=0"),
        (["run", grid, "--client-gpus", "-1", *output], "client-gpus must be >= 0"),
        (["list", grid, "--timeout", "0", *output], "timeout must be > 0"),
        (["report", str(tmp_path / "nothing")], "no results at"),
        (["centralized", "--run-config", str(tmp_path / "none.toml")], "none.toml"),
    ]:
        assert cli.main(argv) == 2, argv
        captured = capsys.readouterr()
        assert captured.err.startswith("fedspc: ") and message in captured.err, argv
        assert captured.err.count("\n") == 1 and captured.out == "", argv
    assert not (tmp_path / "o").exists()


def test_an_undeclared_x_key_fails_the_grid_before_anything_runs(tmp_path, monkeypatch):
    # A SuperLink refuses a run-config key the app does not declare: the grid refuses
    # it up front (run, list and --dry-run alike), not each cell once started.
    spec = {"axes": {"method": ["fedper"]}}
    with pytest.raises(ConfigError, match=r"cell fedper: run-config key\(s\) x-note are not"
                                          r" declared .*x-note = "):
        grid_of(spec, tmp_path, overrides={"x-note": "a"})
    with pytest.raises(ConfigError, match="x-tag are not declared"):
        grid_of({"base": {"x-tag": 1}, **spec}, tmp_path)
    declared = {**app_defaults(), "x-note": ""}
    grid = grid_of(spec, tmp_path, overrides={"x-note": "a"}, defaults=declared)
    assert grid.cells[0].run_config["x-note"] == "a"
    calls = []
    monkeypatch.setattr(runner, "run_federated_cell", lambda *a, **k: calls.append(a))
    path = write_yaml(tmp_path / "g.yaml", spec)
    for command in (["run"], ["run", "--dry-run"], ["list"]):
        argv = [command[0], str(path), "--output-dir", str(tmp_path / "o"), *command[1:],
                "--set", "x-note='a'"]
        assert cli.main(argv) == 2, command
    assert calls == [] and not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["run", "list", "centralized"])
def test_the_grid_commands_take_set_more_than_once(command):
    argv = [command] if command == "centralized" else [command, "g.yaml"]
    args = cli.build_parser().parse_args([*argv, "--set", "num-rounds=3 seed=1",
                                          "--set", "seed=2"])
    assert parse_assignments(args.set) == {"num-rounds": 3, "seed": 2}


def test_set_overrides_every_cell_but_not_an_axis(tmp_path):
    spec = {"axes": {"method": ["fedper", "fedrep"]}}
    grid = grid_of(spec, tmp_path, overrides={"data-dir": "data", "num-rounds": 4})
    assert all(c.run_config["num-rounds"] == 4 for c in grid.cells)
    assert grid.cells[0].run_config["data-dir"] == str(Path("data").resolve())
    with pytest.raises(ConfigError, match="--set method: an axis"):
        grid_of(spec, tmp_path, overrides={"method": "ditto"})


def test_centralized_section_gives_one_reference_per_setting(tmp_path):
    spec = {"axes": {"setting": {"A": {"model": "cnn"}, "B": {"model": "vgg11"}},
                     "method": ["fedper", "fedrep"], "fedspc": [False, True],
                     "alpha": [0.1, 1.0]},
            "centralized": {"epochs": 3, "learning-rate": 0.05, "momentum": 0.9}}
    grid = grid_of(spec, tmp_path)
    central = [c for c in grid.cells if c.kind == "centralized"]
    assert [c.name for c in central] == ["centralized-A", "centralized-B"]
    assert [c.setting for c in central] == ["A", "B"]
    assert central[1].run_config["model"] == "vgg11"
    assert central[0].run_config["learning-rate"] == 0.05
    assert central[0].run_config["momentum"] == 0.9
    assert central[0].centralized == {"epochs": 3, "learning-rate": 0.05, "eval-every": 1,
                                      "lr-schedule": "constant"}
    assert len(grid.cells) == 2 * 2 * 2 * 2 + 2


def test_only_filters_cells_and_rejects_typos(tmp_path):
    grid = grid_of({"axes": {"method": ["fedper", "fedrep", "ditto"], "fedspc": [False, True],
                             "alpha": [0.1, 1.0]},
                    "centralized": {"epochs": 1}}, tmp_path)
    only = parse_only(["method=fedrep,fedper", "alpha=0.1"])
    assert only == {"method": ["fedrep", "fedper"], "alpha": [0.1]}
    names = [c.name for c in filter_cells(grid, only)]
    assert names == ["fedper-a0.1", "fedper+fedspc-a0.1", "fedrep-a0.1", "fedrep+fedspc-a0.1"]
    assert [c.name for c in filter_cells(grid, parse_only(["fedspc=true", "alpha=1"]))] == [
        "fedper+fedspc-a1", "fedrep+fedspc-a1", "ditto+fedspc-a1"]
    assert [c.name for c in filter_cells(grid, parse_only(["mode=centralized"]))] == [
        "centralized-digits-cnn"]
    with pytest.raises(ConfigError, match="--only modle: not an axis"):
        filter_cells(grid, parse_only(["modle=cnn"]))
    with pytest.raises(ConfigError, match="--only method=fedprox: not a value"):
        filter_cells(grid, parse_only(["method=fedprox"]))
    with pytest.raises(ConfigError, match="--only expects"):
        parse_only(["method"])


def test_an_only_selection_of_no_cell_is_one_error_saying_why(tmp_path, capsys):
    spec = {"axes": {"method": ["fedrep", "fedper"], "alpha": [0.1, 1.0]},
            "exclude": [{"method": "fedrep", "alpha": 1.0}]}
    path = write_yaml(tmp_path / "g.yaml", spec)
    argv = ["run", str(path), "--output-dir", str(tmp_path / "out"), "--no-report"]
    assert cli.main([*argv, "--only", "mode=centralized"]) == 2
    assert capsys.readouterr().err.strip() == (
        "fedspc: --only mode=centralized: selects no cell of grid 'g': the grid has no "
        "centralized references (no 'centralized' block)")
    assert cli.main([*argv, "--only", "method=fedrep", "--only", "alpha=1.0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "fedspc: --only method=fedrep alpha=1.0: selects no cell of grid 'g': the grid's "
        "exclude drops them (method: fedrep, alpha: 1.0)")
    assert not (tmp_path / "out" / "g").exists()  # nothing ran, no report
    grid = grid_of({**spec, "centralized": {"epochs": 1}}, tmp_path)
    with pytest.raises(ConfigError, match="the centralized references have no axis method"):
        filter_cells(grid, parse_only(["mode=centralized", "method=fedrep"]))
    assert len(filter_cells(grid, parse_only(["mode=centralized"]))) == 1


def test_numbers_yaml_reads_as_text_compare_by_value(tmp_path):
    # PyYAML reads 1e-2 (no dot) as a string, in the grid file and in --only alike.
    path = tmp_path / "g.yaml"
    path.write_text("axes:\n  learning-rate: [1e-2, 5e-3]\n  alpha: [0.1, 1.0]\n"
                    "exclude: [{learning-rate: 0.005, alpha: 1e0}]\n")
    grid = load_grid(path, output_dir=tmp_path / "out")
    assert [c.name for c in grid.cells] == ["a0.1-lr1e-2", "a1-lr1e-2", "a0.1-lr5e-3"]
    assert [c.name for c in filter_cells(grid, parse_only(["learning-rate=0.01"]))] == [
        "a0.1-lr1e-2", "a1-lr1e-2"]
    assert [c.name for c in filter_cells(grid, parse_only(["alpha=1e-1"]))] == [
        "a0.1-lr1e-2", "a0.1-lr5e-3"]
    path.write_text("axes:\n  learning-rate: [1e-2, 0.01]\n")
    with pytest.raises(ConfigError, match="axis 'learning-rate' lists 0.01 twice"):
        load_grid(path, output_dir=tmp_path / "out")


def test_grid_files_named_in_other_scripts_get_folders_of_their_own(tmp_path):
    folders = [load_grid(write_yaml(tmp_path / f"{name}-sweep.yaml",
                                    {"axes": {"method": ["fedrep"]}}),
                         output_dir=tmp_path / "out").directory for name in ("α", "β")]
    assert [f.name for f in folders] == ["α-sweep", "β-sweep"]


def test_shipped_grids_expand_to_the_papers_tables():
    table1 = load_grid(REPO / "conf/experiments/table1.yaml", output_dir="/tmp/unused")
    assert len(table1.cells) == 8 * 3 * 4
    assert not any(c.run_config["fedspc"] for c in table1.cells)
    table3 = load_grid(REPO / "conf/experiments/table3.yaml", output_dir="/tmp/unused")
    federated = [c for c in table3.cells if c.kind == "federated"]
    assert len(federated) == 5 * 2 * 3 * 4
    assert [c.setting for c in table3.cells if c.kind == "centralized"] == [
        "C-ViT", "C-R34", "C-VGG11", "T-R34"]
    vit = [c.run_config for c in federated if c.setting == "C-ViT"]
    assert {rc["learning-rate"] for rc in vit} == {0.005} and vit[0]["model"] == "vit"
    assert all((rc["num-rounds"], rc["local-epochs"], rc["batch-size"]) == (100, 5, 64)
               for rc in (c.run_config for c in federated))
    assert table3.simulation.clients == 10
    cpu = load_grid(REPO / "conf/experiments/cpu-cifar100-cnn.yaml", output_dir="/tmp/unused")
    rc = cpu.cells[0].run_config
    assert (rc["dataset"], rc["model"], rc["num-rounds"], rc["local-epochs"]) == (
        "cifar100", "cnn", 20, 1)
    assert len([c for c in cpu.cells if c.kind == "federated"]) == 5 * 2 * 3
    e5 = load_grid(REPO / "conf/experiments/cpu-cifar100-cnn-e5.yaml", output_dir="/tmp/unused")
    assert [c.name for c in e5.cells] == ["fedrep", "fedrep+fedspc", "lgfedavg",
                                          "lgfedavg+fedspc", "ditto", "ditto+fedspc"]
    assert {(c.run_config["local-epochs"], c.run_config["alpha"], c.run_config["num-rounds"])
            for c in e5.cells} == {(5, 0.1, 20)}
    long = load_grid(REPO / "conf/experiments/cpu-cifar100-cnn-long.yaml",
                     output_dir="/tmp/unused")
    mismatch = load_grid(REPO / "conf/experiments/cpu-cifar100-cnn-mismatch.yaml",
                         output_dir="/tmp/unused")
    # The long runs repeat the mismatch grid's runs, only for more rounds, and add Ditto.
    assert [c.name for c in long.cells] == [c.name for c in mismatch.cells] + [
        "ditto", "ditto+fedspc"]
    for a, b in zip(long.cells, mismatch.cells):
        assert a.run_config == {**b.run_config, "num-rounds": 50, "keep-client-state": True,
                                "output-dir": "/tmp/unused/cpu-cifar100-cnn-long"}


def test_every_shipped_grid_loads():
    grids = sorted((REPO / "conf/experiments").glob("*.yaml"))
    assert len(grids) >= 10
    for path in grids:
        grid = load_grid(path, output_dir="/tmp/unused")
        assert grid.cells, path.name


# ------------------------------------------------------------------------ running
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeRunner:
    """Stands in for the simulation: records calls and finishes (or fails) cells."""

    def __init__(self, fail: set[str] = frozenset(), clock: Clock | None = None) -> None:
        self.calls: list[str] = []
        self.fail = set(fail)
        self.clock = clock

    def __call__(self, cell: Cell, log_file: Path) -> dict:
        self.calls.append(cell.name)
        if self.clock:
            self.clock.now += 60.0  # every cell takes a minute
        assert log_file.parent.is_dir()
        if cell.name in self.fail:
            raise SimulationFailed(f"run {cell.name!r} did not complete")
        finish(cell, 0.25)
        return {"complete": True, "final-accuracy": 0.25}


def small_grid(tmp_path: Path):
    return grid_of({"axes": {"method": ["fedper"], "fedspc": [False, True],
                             "alpha": [0.1, 1.0]}}, tmp_path)


def test_a_private_cell_s_line_gives_no_times(tmp_path):
    # Under differential privacy a cell's time grows with the clients its rounds drew:
    # its progress line says done, with no time, elapsed time or ETA; a cell without DP
    # keeps them.
    grid = grid_of({"axes": {"method": ["fedper"], "setting": {
        "dp": {"dp-clipping-norm": 0.5, "dp-noise-multiplier": 1.0, "local-steps": 2},
        "plain": {"dp-clipping-norm": 0.0}}}}, tmp_path)
    clock = Clock()
    lines = []
    run_grid(grid, grid.cells, runner=FakeRunner(clock=clock), echo=lines.append, clock=clock)
    done = [line for line in lines if " done" in line and line.startswith("[")]
    private = next(line for line in done if "-dp" in line.split()[1])
    plain = next(line for line in done if "-plain" in line.split()[1])
    assert "0:0" not in private and "elapsed" not in private and "ETA" not in private
    assert private.endswith("(no times under differential privacy)")
    assert "done in 0:01:00" in plain and "| elapsed" in plain


def test_a_cell_s_line_names_its_local_steps_when_it_trains_by_steps(tmp_path):
    grid = grid_of({"axes": {"method": ["fedper"], "setting": {
        "steps": {"local-steps": 5}, "epochs": {"local-epochs": 2}}}}, tmp_path)
    lines = {cell.name: runner.describe(cell) for cell in grid.cells}
    assert "| 10 rounds, 5 local steps, lr 0.02," in lines["fedper-steps"]
    assert "E=" not in lines["fedper-steps"]
    assert "| 10 rounds, E=2, lr 0.02," in lines["fedper-epochs"]


def test_runner_skips_finished_cells_and_reports_progress(tmp_path):
    grid = small_grid(tmp_path)
    finish(grid.cells[1])
    clock = Clock()
    runner, lines = FakeRunner(clock=clock), []
    outcome = run_grid(grid, grid.cells, runner=runner, echo=lines.append, clock=clock)
    assert runner.calls == [grid.cells[0].name, grid.cells[2].name, grid.cells[3].name]
    assert outcome.ok and outcome.skipped == [grid.cells[1].name]
    assert lines[0].startswith("Grid g: 4 cells in") and "1 done, 3 to run" in lines[0]
    # ETA = mean time of the cells run so far x cells left to run.
    assert lines[1:3] == [
        ("[2/4] fedper-a0.1: digits/cnn fedper alpha=0.1 seed=0 | 10 rounds, E=5, lr 0.02,"
         " batch 64"),
        ("[2/4] fedper-a0.1 done in 0:01:00, final accuracy 25.00% | elapsed 0:01:00"
         " | ETA 0:02:00")]
    assert lines[-2] == ("[4/4] fedper+fedspc-a1 done in 0:01:00, final accuracy 25.00%"
                         " | elapsed 0:03:00 | ETA 0:00:00")
    assert lines[-1] == "Grid g: all 4 selected cells done."
    written = json.loads((grid.directory / "grid.json").read_text())
    assert [c["name"] for c in written["cells"]] == [c.name for c in grid.cells]
    assert written["cells"][0]["run-config"]["method"] == "fedper"
    assert (grid.directory / "logs" / "fedper-a0.1.log").read_text().startswith("\n=== fedper")
    # Everything finished: a rerun runs nothing.
    again = FakeRunner()
    assert run_grid(grid, grid.cells, runner=again, echo=lambda _: None).ok
    assert again.calls == []


def test_grid_json_holds_no_path_of_this_machine_and_the_grid_is_still_found(tmp_path):
    path = write_yaml(tmp_path / "g.yaml", {
        "base": {"data-dir": str(tmp_path / "data")},
        "axes": {"method": ["fedper", "fedrep"]}, "centralized": {"epochs": 1}})
    grid = load_grid(path, output_dir=tmp_path / "out")
    written = json.loads(runner.write_grid_json(grid).read_text())

    def strings(tree):
        if isinstance(tree, dict):
            return [t for key, value in tree.items() for t in (key, *strings(value))]
        if isinstance(tree, list):
            return [t for value in tree for t in strings(value)]
        return [tree] if isinstance(tree, str) else []

    assert [text for text in strings(written) if str(tmp_path) in text] == []
    # Every path is relative to the grid folder, and leads where the absolute one did.
    assert written["directory"] == "."
    assert written["source"] == "../../g.yaml"
    assert (grid.directory / written["source"]).resolve() == path.resolve()
    assert len(written["cells"]) == 3 and {c["kind"] for c in written["cells"]} == {
        "federated", "centralized"}
    for cell, entry in zip(grid.cells, written["cells"]):
        assert entry["run-config"]["output-dir"] == "."
        assert entry["run-config"]["data-dir"] == ""
        assert entry["run-config"] == {**cell.run_config, "output-dir": ".", "data-dir": ""}
        # The grid and a run in memory keep the machine's paths they run with.
        assert cell.run_config["data-dir"] == str((tmp_path / "data").resolve())
    # A finished cell whose config.json was written the same way is still done and
    # unchanged; the grid folder is found from grid.json, and its cells by name.
    cell = grid.cells[0]
    start_results(cell.run_dir, {"run-config": cell.run_config})
    finish_summary = {"complete": True, "rounds": 10, "final-accuracy": 0.5,
                      "best-accuracy": 0.5, "best-round": 10, "wall-seconds": 1.0}
    (cell.run_dir / "summary.json").write_text(json.dumps(finish_summary))
    assert runner.config_changes(cell) == [] and runner.is_done(cell)
    assert resolve_target(str(grid.directory)) == resolve_target(str(path),
                                                                 str(tmp_path / "out"))
    records = load_records(grid.directory)
    assert [r.name for r in records] == [c.name for c in grid.cells]
    assert [r.status for r in records] == ["complete", "missing", "missing"]


def test_the_plan_and_the_progress_say_how_far_an_interrupted_cell_got(tmp_path):
    grid = small_grid(tmp_path)
    stopped, broken = grid.cells[0], grid.cells[1]
    for cell, text in ((stopped, json.dumps({"round": 3, "elapsed-seconds": 125.4})),
                       (broken, "{not json")):
        cell.run_dir.mkdir(parents=True)
        (cell.run_dir / "checkpoint.json").write_text(text)
    lines = []
    runner.print_plan(grid, grid.cells, echo=lines.append)
    note = " (resumes after round 3 of 10, 0:02:05 run so far)"
    assert lines[2].startswith(f"  pending {stopped.name} ") and lines[2].endswith(note)
    # An unreadable checkpoint is the run's to report when it resumes, not the plan's.
    assert lines[3].startswith(f"  pending {broken.name} ") and lines[3].endswith("batch 64")
    lines = []
    run_grid(grid, grid.cells[:1], runner=FakeRunner(), echo=lines.append)
    assert lines[1].endswith(note) and lines[1].startswith(f"[1/1] {stopped.name}: ")


def test_the_plan_says_when_recorded_rounds_have_no_checkpoint_to_continue_from(tmp_path):
    # A partial run whose checkpoint is gone (or that ran with checkpoint = false)
    # runs again from round 1; the plan and the progress line say so before it does.
    grid = small_grid(tmp_path)
    partial, empty = grid.cells[0], grid.cells[1]
    partial.run_dir.mkdir(parents=True)
    (partial.run_dir / "metrics.json").write_text(json.dumps({"rounds": [{}, {}]}))
    empty.run_dir.mkdir(parents=True)
    (empty.run_dir / "metrics.json").write_text("{not json")
    note = " (starts over: the 2 rounds in its folder have no checkpoint)"
    lines = []
    runner.print_plan(grid, grid.cells, echo=lines.append)
    assert lines[2].startswith(f"  pending {partial.name} ") and lines[2].endswith(note)
    assert lines[3].startswith(f"  pending {empty.name} ") and lines[3].endswith("batch 64")
    lines = []
    run_grid(grid, grid.cells[:1], runner=FakeRunner(), echo=lines.append)
    assert lines[1] == f"[1/1] {partial.name}: {runner.describe(partial)}{note}"


def finished_with(cell: Cell, *, rounds: int, can_extend: bool, **changes) -> None:
    """A run of ``cell`` that finished ``rounds`` rounds with ``changes`` to its
    run-config, keeping its checkpoint."""
    finish(cell)
    run_config = {**cell.run_config, "num-rounds": rounds, **changes}
    (cell.run_dir / "config.json").write_text(json.dumps({"run-config": run_config}))
    summary = json.loads((cell.run_dir / "summary.json").read_text())
    summary.update({"rounds": rounds, "can-extend": can_extend})
    (cell.run_dir / "summary.json").write_text(json.dumps(summary))
    (cell.run_dir / "checkpoint.json").write_text(
        json.dumps({"round": rounds, "elapsed-seconds": 61.0}))


def test_a_finished_cell_is_extended_when_only_its_rounds_grew_and_it_can_be(tmp_path):
    grid = small_grid(tmp_path)  # 10 rounds
    grows, lost, other, shrinks = grid.cells
    finished_with(grows, rounds=5, can_extend=True)
    finished_with(lost, rounds=5, can_extend=False)
    finished_with(other, rounds=5, can_extend=True, **{"learning-rate": 0.1})
    finished_with(shrinks, rounds=20, can_extend=True)
    lines = []
    runner.print_plan(grid, grid.cells, echo=lines.append)
    assert "3 done, 0 failed, 1 pending" in lines[0]
    assert lines[2].startswith(f"  pending {grows.name} ") and lines[2].endswith(
        " (extends the finished run after round 5 of 10, 0:01:01 run so far)")
    fake, lines = FakeRunner(), []
    run_grid(grid, grid.cells, runner=fake, echo=lines.append)
    assert fake.calls == [grows.name]
    assert (f"note: {lost.name} finished with different num-rounds; it cannot be "
            "extended to more rounds (it ran without keep-client-state); delete its "
            "folder to rerun it") in lines
    assert (f"note: {other.name} finished with different learning-rate, num-rounds; "
            "delete its folder to rerun it") in lines
    assert (f"note: {shrinks.name} finished with different num-rounds; delete its "
            "folder to rerun it") in lines


def test_a_reference_of_other_epochs_and_a_run_of_another_k_are_noted_not_extended(tmp_path):
    # The reference ran 5 constant-rate epochs; the grid asks 200 cosine ones. The
    # federated runs had K = 10 simulated clients (num-clients 0); the grid now has
    # 20, and 20 rounds: not extended, noted, and stale in the report.
    spec = {"axes": {"method": ["fedper"], "fedspc": [False, True]},
            "simulation": {"clients": 20},
            "centralized": {"epochs": 200, "lr-schedule": "cosine"}}
    grid = grid_of(spec, tmp_path)
    base, spc, reference = grid.cells
    finished_with(base, rounds=5, can_extend=True)
    finished_with(spc, rounds=10, can_extend=True)
    finish(reference)
    for cell in (base, spc):
        config = json.loads((cell.run_dir / "config.json").read_text())
        (cell.run_dir / "config.json").write_text(json.dumps({**config, "num-clients": 10}))
    (reference.run_dir / "config.json").write_text(json.dumps({
        "run-config": reference.run_config, "mode": "centralized",
        "centralized": {**reference.centralized, "epochs": 5, "lr-schedule": "constant"}}))
    assert runner.config_changes(reference) == ["epochs", "lr-schedule"]
    assert runner.config_changes(spc, 20) == ["num-clients"]
    assert runner.config_changes(spc, 10) == [] and runner.is_done(spc, 10)
    assert runner.extension(base, 10) == 5 and runner.extension(base, 20) is None
    fake, lines = FakeRunner(), []
    run_grid(grid, grid.cells, runner=fake, echo=lines.append)
    assert fake.calls == []
    assert (f"note: {base.name} finished with different num-clients, num-rounds; delete "
            "its folder to rerun it") in lines
    assert (f"note: {reference.name} finished with different epochs, lr-schedule; delete "
            "its folder to rerun it") in lines
    records = {r.name: r for r in load_records(grid.directory)}  # grid.json: K = 20
    assert {name: (r.status, r.changes) for name, r in records.items()} == {
        base.name: ("stale", ("num-clients", "num-rounds")),
        spc.name: ("stale", ("num-clients",)),
        reference.name: ("stale", ("epochs", "lr-schedule"))}
    assert [r.status for r in load_records(grid.directory, [c.to_dict() for c in grid.cells],
                                           clients=10)][1:] == ["complete", "stale"]


def test_a_failing_cell_is_recorded_and_the_others_still_run(tmp_path):
    grid = small_grid(tmp_path)
    bad = grid.cells[1].name
    runner, lines = FakeRunner(fail={bad}), []
    outcome = run_grid(grid, grid.cells, runner=runner, echo=lines.append)
    assert runner.calls == [c.name for c in grid.cells]
    assert not outcome.ok and list(outcome.failed) == [bad]
    log = str(grid.directory / "logs" / f"{bad}.log")
    assert outcome.failed[bad] == log
    assert f"  {bad}: run '{bad}' did not complete (log: {log})" in lines
    failures = json.loads((grid.directory / "failures.json").read_text())
    assert failures[bad]["log"] == log
    # A rerun leaves it alone (and still reports it) unless asked to retry.
    runner = FakeRunner()
    outcome = run_grid(grid, grid.cells, runner=runner, echo=lambda _: None)
    assert runner.calls == [] and list(outcome.failed) == [bad]
    outcome = run_grid(grid, grid.cells, runner=runner, retry_failed=True, echo=lambda _: None)
    assert runner.calls == [bad] and outcome.ok
    assert json.loads((grid.directory / "failures.json").read_text()) == {}


def test_cli_runs_only_selected_pending_cells_then_reports(tmp_path, monkeypatch, capsys):
    path = write_yaml(tmp_path / "tiny.yaml", {
        "base": {"num-rounds": 2}, "axes": {"method": ["fedper", "fedrep"],
                                            "alpha": [0.1, 1.0]},
        "simulation": {"clients": 3}})
    calls = []

    def fake(cell, log_file, *, link, simulation, echo=False):
        calls.append((cell.name, simulation.clients, simulation.client_cpus))
        if cell.name == "fedrep-a0.1":
            raise TimeoutError("flwr run exceeded 1 s")
        finish(cell)
        return {"complete": True}

    monkeypatch.setattr(runner, "run_federated_cell", fake)
    out = tmp_path / "results"
    args = ["run", str(path), "--output-dir", str(out), "--only", "alpha=0.1"]
    assert cli.main([*args, "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "2 of 4 cells selected" in plan and "pending fedper-a0.1" in plan
    assert not out.exists()  # a dry run writes nothing
    assert cli.main([*args, "--client-cpus", "2"]) == 1
    assert calls == [("fedper-a0.1", 3, 2.0), ("fedrep-a0.1", 3, 2.0)]
    text = capsys.readouterr().out
    assert "1 cell(s) failed:" in text and "fedrep-a0.1.log" in text
    assert (out / "tiny" / "report" / "runs.md").is_file()
    assert cli.main(["list", str(path), "--output-dir", str(out)]) == 0
    plan = capsys.readouterr().out
    assert "done    fedper-a0.1" in plan and "failed  fedrep-a0.1" in plan
    assert "pending fedper-a1" in plan


def test_a_grid_being_run_is_not_run_twice(tmp_path, monkeypatch, capsys):
    path = write_yaml(tmp_path / "tiny.yaml", {"base": {"num-rounds": 2},
                                               "axes": {"method": ["fedper"]}})
    calls = []
    monkeypatch.setattr(runner, "run_federated_cell",
                        lambda cell, *_, **__: calls.append(cell.name))
    out = tmp_path / "results"
    with folder_lock(out / "tiny", "grid 'tiny' (the first)"):
        assert cli.main(["list", str(path), "--output-dir", str(out)]) == 0
        assert "Running now: grid 'tiny' (the first) (pid" in capsys.readouterr().out
        assert cli.main(["run", str(path), "--output-dir", str(out)]) == 2
        assert "tiny is in use by grid 'tiny' (the first)" in capsys.readouterr().err
    assert calls == [] and not (out / "tiny").exists()
    assert cli.main(["list", str(path), "--output-dir", str(out)]) == 0
    assert "Running now" not in capsys.readouterr().out


def test_output_piped_into_a_closed_reader_ends_quietly():
    """`list | head`: the reader is gone before the plan is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "fedspc_app.experiments", "list",
             str(REPO / "conf" / "experiments" / "table3.yaml")],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (0, "")


# ---------------------------------------------------------------------- end to end
@pytest.mark.e2e
def test_tiny_grid_end_to_end_with_report(tmp_path, capsys):
    """Two real cells on digits through the runner, one SuperLink, Ray; then the report."""
    path = write_yaml(tmp_path / "tiny.yaml", {
        "name": "tiny",
        "base": {"method": "fedper", "num-rounds": 2, "local-epochs": 1, "alpha": 0.5},
        "axes": {"fedspc": [False, True]},
        "simulation": {"clients": 2, "client-cpus": 1, "timeout": 600}})
    out = tmp_path / "results"
    assert cli.main(["run", str(path), "--output-dir", str(out)]) == 0
    grid_dir = out / "tiny"
    for name in ("fedper", "fedper+fedspc"):
        summary = json.loads((grid_dir / name / "summary.json").read_text())
        assert summary["complete"] and summary["rounds"] == 2
        assert "round 2/2" in (grid_dir / "logs" / f"{name}.log").read_text()
    text = capsys.readouterr().out
    assert "[2/2] fedper+fedspc done in" in text
    table3 = (grid_dir / "report" / "table3.md").read_text().splitlines()
    assert table3[0] == "| Method | α | digits-cnn Base | digits-cnn +FedSPC | digits-cnn Δ |"
    assert table3[2].startswith("| FedPer | 0.5 | ") and "—" not in table3[2]
    assert (grid_dir / "report" / "partitions-digits.png").read_bytes()[:8] == \
        b"\x89PNG\r\n\x1a\n"
    # Rerunning skips both finished cells.
    assert cli.main(["run", str(path), "--output-dir", str(out), "--no-report"]) == 0
    assert "2 done, 0 to run" in capsys.readouterr().out


def test_an_interrupted_cell_is_resumed_and_a_new_one_started(tmp_path, monkeypatch):
    grid = small_grid(tmp_path)
    interrupted, fresh = grid.cells[0], grid.cells[1]
    interrupted.run_dir.mkdir(parents=True)
    (interrupted.run_dir / "checkpoint.json").write_text("{}")  # a run stopped midway
    launched = {}
    monkeypatch.setattr(runner, "run_simulation",
                        lambda run_config, **_: launched.setdefault(
                            run_config["run-name"], run_config.get("resume", False)))
    link = type("Link", (), {"get": lambda self: None})()
    for cell in (interrupted, fresh):
        runner.run_federated_cell(cell, tmp_path / "log", link=link,
                                  simulation=grid.simulation)
    assert launched == {interrupted.run_config["run-name"]: True,
                        fresh.run_config["run-name"]: False}


# ------------------------------------------------------------------------ pausing
class PausingRunner(FakeRunner):
    """Pauses the cell ``pause`` (as its ServerApp does on a request); with
    ``request``, asks for a grid pause while the cell ``request`` runs."""

    def __init__(self, grid, pause: str = "", request: str = "") -> None:
        super().__init__()
        self.grid, self.pause, self.request = grid, pause, request

    def __call__(self, cell: Cell, log_file: Path) -> dict:
        if cell.name == self.request:
            request_pause(self.grid.directory)
        if cell.name == self.pause:
            self.calls.append(cell.name)
            raise RunPaused(4, 10, cell.name)
        return super().__call__(cell, log_file)


def test_a_paused_cell_stops_the_grid_without_counting_as_failed(tmp_path):
    grid = small_grid(tmp_path)
    name = grid.cells[1].name  # `experiments pause` while it runs: it pauses
    fake, lines = PausingRunner(grid, pause=name, request=name), []
    outcome = run_grid(grid, grid.cells, runner=fake, echo=lines.append)
    assert fake.calls == [grid.cells[0].name, grid.cells[1].name]
    assert outcome.paused and outcome.ok and outcome.ran == [grid.cells[0].name]
    assert not (grid.directory / "failures.json").exists()
    assert lines[-2].startswith(f"[2/4] {grid.cells[1].name} paused after round 4 of 10")
    assert lines[-1] == ("Grid g paused on request with 1 of 4 selected cells done; "
                         "the same command continues it.")
    assert not (grid.directory / PAUSE_REQUEST).exists()  # honoured, then removed
    again = FakeRunner()
    assert not run_grid(grid, grid.cells, runner=again, echo=lambda _: None).paused
    assert again.calls == [c.name for c in grid.cells[1:]]


def test_progress_counts_only_finished_cells_as_done(tmp_path):
    # The first cell fails, the second pauses: no cell is done. A cell that failed
    # before (not retried) is not run, and the numbering goes on after it.
    grid = small_grid(tmp_path)
    fake, lines = PausingRunner(grid, pause=grid.cells[1].name), []
    fake.fail = {grid.cells[0].name}
    outcome = run_grid(grid, grid.cells, runner=fake, echo=lines.append)
    assert outcome.paused and list(outcome.failed) == [grid.cells[0].name]
    assert lines[3].startswith(f"[2/4] {grid.cells[1].name}: ")
    assert lines[-1] == ("Grid g paused on request with 0 of 4 selected cells done; "
                         "the same command continues it.")
    lines = []
    run_grid(grid, grid.cells, runner=FakeRunner(), echo=lines.append)
    assert "1 failed before" in lines[0]
    assert [line.split()[0] for line in lines[1:7]] == ["[2/4]"] * 2 + ["[3/4]"] * 2 + [
        "[4/4]"] * 2


def test_a_grid_pause_between_cells_and_a_stale_one(tmp_path):
    grid = small_grid(tmp_path)
    fake = PausingRunner(grid, request=grid.cells[1].name)  # --after-cell: it finishes
    outcome = run_grid(grid, grid.cells, runner=fake, echo=lambda _: None)
    assert outcome.paused and fake.calls == [c.name for c in grid.cells[:2]]
    assert not (grid.directory / PAUSE_REQUEST).exists()
    # A request left behind by a grid that was killed is older than this run: ignored.
    os.utime(request_pause(grid.directory), (0, 0))
    outcome = run_grid(grid, grid.cells, runner=FakeRunner(), echo=lambda _: None)
    assert not outcome.paused and len(outcome.ran) == 2


def started_cell(cell: Cell, *, checkpoint: bool = True, rounds: int = 3) -> None:
    cell.run_dir.mkdir(parents=True, exist_ok=True)
    (cell.run_dir / "config.json").write_text(json.dumps(
        {"run-config": {**cell.run_config, "checkpoint": checkpoint}}))
    (cell.run_dir / "checkpoint.json").write_text(json.dumps(
        {"round": rounds, "elapsed-seconds": 60.0}))


def test_pause_asks_the_running_grid_and_its_running_cell(tmp_path, capsys):
    path = write_yaml(tmp_path / "tiny.yaml", {"base": {"num-rounds": 10},
                                               "axes": {"method": ["fedper", "fedrep"]}})
    out = tmp_path / "results"
    args = [str(path), "--output-dir", str(out)]
    assert cli.main(["pause", *args]) == 2
    assert "nothing runs in" in capsys.readouterr().err
    grid = load_grid(path, output_dir=out)
    runner.write_grid_json(grid)
    running, waiting = grid.cells
    started_cell(running)
    with folder_lock(grid.directory, "grid 'tiny'"), folder_lock(running.run_dir, "run"):
        assert cli.main(["pause", *args]) == 0
        text = capsys.readouterr().out
        assert "stops at the next round boundary" in text
        assert f"{running.name} stops after its current round (3 of 10 rounds done)" in text
        assert (grid.directory / PAUSE_REQUEST).is_file()
        assert (running.run_dir / PAUSE_REQUEST).is_file()
        assert not (waiting.run_dir / PAUSE_REQUEST).exists()
        assert cli.main(["list", *args]) == 0
        assert "(a pause is requested)" in capsys.readouterr().out
        assert cli.main(["pause", str(grid.directory), "--cancel"]) == 0
        assert f"withdrawn: tiny, {running.name}" in capsys.readouterr().out
        assert not (grid.directory / PAUSE_REQUEST).exists()
        assert not (running.run_dir / PAUSE_REQUEST).exists()
        assert cli.main(["pause", *args, "--after-cell"]) == 0
        assert f"{running.name} runs to its end first" in capsys.readouterr().out
        assert not (running.run_dir / PAUSE_REQUEST).exists()


def test_pause_asks_a_lone_run_unless_it_could_not_continue(tmp_path, capsys):
    grid = small_grid(tmp_path)
    cell = grid.cells[0]
    started_cell(cell, checkpoint=False)
    with folder_lock(cell.run_dir, "run 'r'"):
        assert cli.main(["pause", str(cell.run_dir)]) == 2
        assert "keeps no checkpoint (checkpoint = false)" in capsys.readouterr().err
        started_cell(cell)
        assert cli.main(["pause", str(cell.run_dir)]) == 0
        assert "run 'r' (pid" in capsys.readouterr().out
        assert (cell.run_dir / PAUSE_REQUEST).is_file()
    assert cli.main(["pause", str(tmp_path)]) == 2
    assert "neither a grid file" in capsys.readouterr().err


def test_the_run_command_exits_3_when_its_grid_paused(tmp_path, monkeypatch):
    path = write_yaml(tmp_path / "tiny.yaml", {"base": {"num-rounds": 2},
                                               "axes": {"method": ["fedper"]}})

    def paused(cell, *_, **__):
        raise RunPaused(1, 2, cell.name)

    monkeypatch.setattr(runner, "run_federated_cell", paused)
    assert cli.main(["run", str(path), "--output-dir", str(tmp_path / "o")]) == 3


def test_shipped_grids_keep_the_precision_of_their_committed_runs():
    # A preset may move to a faster precision; a grid with committed runs must still
    # resolve to the arithmetic those runs used, or rerunning it is another experiment.
    checked = 0
    for path in sorted((REPO / "conf/experiments").glob("*.yaml")):
        grid = load_grid(path, output_dir=str(REPO / "docs/results"))
        for cell in grid.cells:
            recorded = cell.run_dir / "config.json"
            if cell.kind != "federated" or not recorded.is_file():
                continue
            run_config = json.loads(recorded.read_text())["run-config"]
            for key, default in (("precision", "fp32"), ("channels-last", False)):
                assert cell.run_config[key] == run_config.get(key, default), (path.name,
                                                                              cell.name, key)
            checked += 1
    assert checked >= 40
