"""``python -m fedspc_app.experiments``: experiment grids, their report, the
centralized reference and partition figures::

    python -m fedspc_app.experiments run GRID.yaml [--only AXIS=V1,V2] [--dry-run]
        [--output-dir DIR] [--set "k=v ..."] [--retry-failed]
        [--clients N] [--client-cpus X] [--client-gpus X] [--timeout S] [--stop-by WHEN]
    python -m fedspc_app.experiments list GRID.yaml [--times-from DIR]  # run --dry-run
    python -m fedspc_app.experiments pause GRID_OR_RUN [--after-cell] [--cancel]
    python -m fedspc_app.experiments report GRID_DIR_OR_YAML [...] [--out DIR]
        [--label NAME ...]
    python -m fedspc_app.experiments centralized [--run-config TOML] [--set "k=v ..."]
        [--epochs 200] [--learning-rate 0.1] [--eval-every 1] [--lr-schedule constant]
    python -m fedspc_app.experiments partition RUN_DIR... [-o PNG]

Bad input is one ``fedspc: ...`` line on stderr and exit code 2; ``run`` exits
with 1 when a cell failed, and with 3 when it paused on request (the same command
continues it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from fedspc_app.core.errors import ConfigError, FedSPCError
from fedspc_app.core.files import folder_lock
from fedspc_app.data.partition_files import load_partition_counts
from fedspc_app.experiments import centralized, pausing
from fedspc_app.experiments.grid import Grid, filter_cells, load_grid, parse_only
from fedspc_app.experiments.layout import LOGS_DIR, REPORT_DIR
from fedspc_app.experiments.plots import plot_partition, plot_partitions
from fedspc_app.experiments.records import load_records
from fedspc_app.experiments.reports import write_report
from fedspc_app.experiments.runner import CellRunner, print_plan, run_grid
from fedspc_app.launch.cli import BAD_INPUT, FAILED, PAUSED, JoinedAssignments, fail
from fedspc_app.launch.processes import exit_on_termination
from fedspc_app.launch.runconfig import check_clients, load_overrides, parse_assignments


# ------------------------------------------------------------------- commands
def _grid(args: argparse.Namespace) -> Grid:
    """The grid with ``--set`` applied and the ``--clients``/... overrides checked."""
    overrides = parse_assignments(args.set)
    if getattr(args, "stop_by", None):
        if "stop-by" in overrides:
            raise ConfigError("give the stop time once: --stop-by or --set stop-by=...")
        overrides["stop-by"] = pausing.resolve_stop_by(args.stop_by, datetime.now(UTC))
    grid = load_grid(args.grid, output_dir=args.output_dir, overrides=overrides)
    sim = grid.simulation
    chosen = {"clients": args.clients, "client_cpus": args.client_cpus,
              "client_gpus": args.client_gpus, "timeout": args.timeout}
    simulation = dataclasses.replace(sim, **{k: v for k, v in chosen.items() if v is not None})
    for cell in grid.cells:
        if cell.kind == "federated":
            try:
                check_clients(int(cell.run_config.get("num-clients") or 0), simulation.clients)
            except ConfigError as error:
                raise ConfigError(f"cell {cell.name}: {error}") from None
    return dataclasses.replace(grid, simulation=simulation)


def run(args: argparse.Namespace) -> int:
    grid = _grid(args)
    cells = filter_cells(grid, parse_only(args.only))
    if args.command == "list" or args.dry_run:
        missing = [p for p in args.times_from if not Path(p).is_dir()]
        if missing:
            raise ConfigError(f"--times-from: no such folder: {', '.join(missing)}")
        print_plan(grid, cells, times_from=[Path(p) for p in args.times_from])
        return 0
    runner = CellRunner(grid.simulation, echo=args.echo,
                        flwr_home=Path(args.flwr_home) if args.flwr_home else None,
                        superlink_log=grid.directory / LOGS_DIR / "superlink.log")
    with folder_lock(grid.directory, f"grid {grid.name!r}"), exit_on_termination(), runner:
        outcome = run_grid(grid, cells, runner=runner, retry_failed=args.retry_failed)
        if not args.no_report:
            report(str(grid.directory), None, None)
    if not outcome.ok:
        return FAILED
    return PAUSED if outcome.paused else 0


def pause_command(args: argparse.Namespace) -> int:
    target = pausing.resolve_target(args.target, args.output_dir)
    lines = (pausing.cancel(target) if args.cancel
             else pausing.pause(target, after_cell=args.after_cell))
    print("\n".join(lines))
    return 0


def grid_records(target: str, output_dir: str | None) -> tuple[Path, str, list]:
    """The folder, name and result records of a grid folder (or a grid file's folder)."""
    path = Path(target)
    if path.is_file():
        grid = load_grid(path, output_dir=output_dir)
        directory, title, clients = grid.directory, grid.name, grid.simulation.clients
        cells = [cell.to_dict() for cell in grid.cells]
    else:
        directory, title, cells, clients = path.resolve(), path.resolve().name, None, None
    if not directory.is_dir():
        raise ConfigError(f"no results at {directory}")
    return directory, title, load_records(directory, cells, clients)


def labelled(records: list, label: str) -> list:
    """A grid's records as the setting ``label`` (``label setting`` when the grid
    has several settings), so that grids of one dataset and model stay apart."""
    settings = {r.setting for r in records}
    return [dataclasses.replace(r, setting=label if len(settings) == 1
                                else f"{label} {r.setting}") for r in records]


def _check_pooled(loaded: list) -> None:
    """Grids given one label pool their runs as seeds of one setting; two grids
    must not both hold a run of the same cell and seed."""
    seen: dict[tuple, tuple[int, str]] = {}
    for index, (_, title, grid) in enumerate(loaded):
        for r in grid:
            key = (r.setting, r.kind, r.method, r.fedspc, r.alpha, r.seed)
            other, other_title = seen.setdefault(key, (index, title))
            if other != index:
                raise ConfigError(
                    f"--label: {other_title} and {title} share the label {r.setting!r} and "
                    f"both hold {r.label}"
                    + ("" if r.alpha is None else f" {r.alpha}" if isinstance(r.alpha, str)
                       else f" alpha={r.alpha:g}")
                    + f" seed={r.seed} ({r.name}); "
                    "grids pooled under one label must hold different seeds")


def report(targets: str | list[str], out: str | None, output_dir: str | None,
           labels: Sequence[str] | None = None) -> Path:
    """Write the report of one grid, or of several together (then ``out`` is needed).

    ``labels`` (one per grid) name each grid's setting in the tables and figures;
    without them, runs of the same dataset, model, method and α in different grids
    count as seeds of one cell. Grids given the same label are one setting (for
    example a grid of more seeds beside the grid it repeats); they must not hold
    the same cell with the same seed.
    """
    targets = [targets] if isinstance(targets, str) else list(targets)
    if len(targets) > 1 and not out:
        raise ConfigError("a report of several grids needs --out")
    if labels and len(labels) != len(targets):
        raise ConfigError(f"--label: {len(labels)} labels for {len(targets)} grids; "
                          f"give one per grid, in the grids' order")
    loaded = [grid_records(target, output_dir) for target in targets]
    if labels:
        loaded = [(d, t, labelled(g, label)) for (d, t, g), label in zip(loaded, labels)]
        _check_pooled(loaded)
    records = [record for _, _, grid in loaded for record in grid]
    out_dir = Path(out) if out else loaded[0][0] / REPORT_DIR
    title = " + ".join(title for _, title, _ in loaded)
    written = write_report(records, out_dir, title=title)
    print(f"Report of {len(records)} cells: {out_dir} ({len(written)} files)")
    return out_dir


def report_command(args: argparse.Namespace) -> int:
    report(args.grid, args.out, args.output_dir, args.label)
    return 0


def train_reference(args: argparse.Namespace) -> int:
    config = centralized.build_config(load_overrides(args.run_config, args.set),
                                      run_name=args.run_name, output_dir=args.output_dir)
    centralized.train_centralized(config, epochs=args.epochs, learning_rate=args.learning_rate,
                                  eval_every=args.eval_every, lr_schedule=args.lr_schedule)
    return 0


def split_label(partition: dict) -> str:
    """``alpha = 0.1`` (Dirichlet) or ``2 classes per client`` (class-count)."""
    if partition.get("classes_per_client") is not None and "alpha" not in partition:
        return f"{partition['classes_per_client']} classes per client"
    return f"alpha = {partition['alpha']:g}"


def draw_partitions(args: argparse.Namespace) -> int:
    """One run folder gives one heatmap; several give panels titled by their α."""
    loaded = [load_partition_counts(path) for path in args.runs]
    first = Path(args.runs[0])
    output = Path(args.output) if args.output else (
        (first if first.is_dir() else first.parent) / "partition.png")
    if len(loaded) == 1:
        data = loaded[0]
        plot_partition(data["train_counts"], output,
                       title=f"{split_label(data)}, {data['num_clients']} clients")
    else:
        plot_partitions([(split_label(d), d["train_counts"]) for d in loaded], output)
    print(output)
    return 0


# --------------------------------------------------------------------- parser
def _add_grid_commands(commands: argparse._SubParsersAction) -> None:
    for name in ("run", "list"):
        sub = commands.add_parser(name, help="run the grid's pending cells" if name == "run"
                                  else "print the plan (the same as run --dry-run)")
        sub.add_argument("grid", help="grid file (YAML)")
        sub.add_argument("--only", action="append", default=[], metavar="AXIS=V1,V2",
                         help="keep cells with these axis values (repeatable; "
                              "'mode=centralized' selects the centralized references)")
        sub.add_argument("--output-dir", help="parent of the grid's folder")
        sub.add_argument("--set", default="", action=JoinedAssignments,
                         help='run-config overrides for every cell, e.g. '
                              '"data-dir=\'/data\'" (repeatable)')
        sub.add_argument("--clients", type=int)
        sub.add_argument("--client-cpus", type=float)
        sub.add_argument("--client-gpus", type=float)
        sub.add_argument("--timeout", type=float, help="seconds one cell may take")
        sub.add_argument("--times-from", action="append", default=[], metavar="DIR",
                         help="the plan's time estimate also uses the rounds of the runs "
                              "in DIR (another grid's results folder, or a run folder; "
                              "repeatable)")
        if name == "run":
            sub.add_argument("--dry-run", action="store_true", help="print the plan only")
            sub.add_argument("--retry-failed", action="store_true",
                             help="also rerun cells that failed before")
            sub.add_argument("--no-report", action="store_true",
                             help="do not write the report after running")
            sub.add_argument("--echo", action="store_true",
                             help="stream every cell's output, not only progress")
            sub.add_argument("--flwr-home", help="keep the SuperLink's FLWR_HOME here")
            sub.add_argument("--stop-by", metavar="WHEN",
                             help="pause the grid by then, at a round boundary, and start no "
                                  "round or cell that would end later (the same command "
                                  "continues it): " + pausing.STOP_BY_FORMS)
        sub.set_defaults(handler=run)
    sub = commands.add_parser(
        "pause", help="stop a running grid or run at its next round boundary",
        description="Stop a running grid (or a single run) cleanly: the running run "
                    "ends after its current round with its checkpoint written, and the "
                    "grid stops; its run command continues it (a run: resume = true).")
    sub.add_argument("target", help="grid file (YAML), grid folder, or a run's folder")
    sub.add_argument("--output-dir", help="with a grid file: parent of the grid's folder")
    sub.add_argument("--after-cell", action="store_true",
                     help="let the running cell finish, then stop the grid")
    sub.add_argument("--cancel", action="store_true", help="withdraw a pause request")
    sub.set_defaults(handler=pause_command)
    sub = commands.add_parser("report", help="tables and figures from grids' results")
    sub.add_argument("grid", nargs="+",
                     help="grid folder (<output-dir>/<name>) or grid file; several are "
                          "reported together (e.g. Table 1: standard FL beside PFL)")
    sub.add_argument("--out", help="report folder (default: <grid folder>/report; "
                                   "required with several grids)")
    sub.add_argument("--output-dir", help="with a grid file: parent of the grid's folder")
    sub.add_argument("--label", action="append",
                     help="the setting name of each grid, once per grid in order (e.g. "
                          "a regime study: --label 'E = 1' --label 'E = 5'); keeps "
                          "grids of one dataset and model apart; grids given the same "
                          "label are pooled as seeds of one setting")
    sub.set_defaults(handler=report_command)


def _add_other_commands(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser("centralized", help="train the pooled-data reference",
                              description=(centralized.__doc__ or "").split("\n\n")[0])
    sub.add_argument("--run-config", help="TOML run-config (e.g. conf/*.toml)")
    sub.add_argument("--set", default="", action=JoinedAssignments,
                     help='overrides, e.g. "data-dir=\'/data\'" (repeatable)')
    sub.add_argument("--epochs", type=int, default=200, help="default: 200 (paper)")
    sub.add_argument("--learning-rate", type=float, default=0.1, help="default: 0.1 (paper)")
    sub.add_argument("--eval-every", type=int, default=1,
                     help="evaluate every N epochs (and after the last)")
    sub.add_argument("--lr-schedule", choices=centralized.SCHEDULES, default="constant")
    sub.add_argument("--output-dir", help="parent of the results folder")
    sub.add_argument("--run-name", help="results folder name")
    sub.set_defaults(handler=train_reference)
    sub = commands.add_parser("partition", help="draw saved partitions as heatmaps")
    sub.add_argument("runs", nargs="+", help="run folders or partition.json files")
    sub.add_argument("-o", "--output", help="PNG to write (default: <run>/partition.png)")
    sub.set_defaults(handler=draw_partitions)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fedspc_app.experiments",
        description="Experiment grids (conf/experiments/*.yaml), their report, the "
                    "centralized reference and partition figures.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_grid_commands(commands)
    _add_other_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except BrokenPipeError:  # the reader went away (`list | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (FedSPCError, OSError) as error:
        return fail(error, BAD_INPUT)
