"""Running a grid's cells one after another, resumably.

Federated cells share one private SuperLink; a centralized reference runs as
``python -m fedspc_app.experiments centralized`` in a child process. A cell whose
``summary.json`` is complete is done and skipped; a failing cell is recorded in
``failures.json`` (and rerun only when asked) while the others go on. A pause
request (``python -m fedspc_app.experiments pause``) stops the grid at a round
boundary of its running cell, or between cells; running it again continues.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fedspc_app.core.config import parse_stop_by
from fedspc_app.core.errors import FedSPCError
from fedspc_app.core.files import atomic_write, holder_text, lock_holder
from fedspc_app.experiments.estimate import Estimate, estimate, machine_label, timed_runs
from fedspc_app.experiments.grid import Cell, Grid, SimulationSettings
from fedspc_app.experiments.layout import (
    FAILURES_JSON,
    GRID_JSON,
    LOGS_DIR,
    read_failures,
    read_json,
    result_changes,
)
from fedspc_app.launch.processes import run_logged
from fedspc_app.launch.runconfig import run_config_file
from fedspc_app.launch.superlink import LocalSuperLink, SimulationFailed, run_simulation
from fedspc_app.runs.checkpoint import CHECKPOINT_JSON, saved_progress
from fedspc_app.runs.pause import PAUSE_REQUEST, RunPaused, clear_pause, pause_requested
from fedspc_app.runs.provenance import machine
from fedspc_app.runs.results import CONFIG_JSON, METRICS_JSON, SUMMARY_JSON, format_duration

Echo = Callable[[str], None]
CELL_ERRORS = (SimulationFailed, FedSPCError, TimeoutError)
"""What a failing cell raises; anything else (e.g. Ctrl-C) stops the grid."""


# ------------------------------------------------------------------------ status
def is_done(cell: Cell, clients: int | None = None) -> bool:
    """Finished, and not a run the grid now asks to extend (:func:`extension`).
    ``clients``, here and below: the grid's simulated clients (a federated cell's K
    where its num-clients is 0), so that a run of another K is not extended."""
    summary = read_json(cell.run_dir / SUMMARY_JSON)
    return (isinstance(summary, dict) and summary.get("complete") is True
            and _extends(cell, summary, clients) is None)


def extension(cell: Cell, clients: int | None = None) -> int | None:
    """The rounds of a finished run that the grid extends: only its num-rounds grew,
    and it kept its checkpoint and clients' state (summary ``can-extend``)."""
    return _extends(cell, read_json(cell.run_dir / SUMMARY_JSON), clients)


def _extends(cell: Cell, summary: Any, clients: int | None) -> int | None:
    if (isinstance(summary, dict) and summary.get("complete") is True
            and summary.get("can-extend") is True
            and (cell.run_dir / CHECKPOINT_JSON).is_file()
            and _grew(cell, config_changes(cell, clients), summary)):
        return int(summary["rounds"])
    return None


def config_changes(cell: Cell, clients: int | None = None) -> list[str]:
    """The settings that differ between the grid and the finished run
    (:func:`~fedspc_app.experiments.layout.result_changes`): run-config keys, a
    reference's epochs, learning rate, eval-every and lr-schedule, and with
    ``clients`` a federated cell's K."""
    return result_changes(cell.run_config, read_json(cell.run_dir / CONFIG_JSON),
                          centralized=cell.centralized,
                          clients=clients if cell.kind == "federated" else None)


def _grew(cell: Cell, changed: Sequence[str], summary: Any) -> bool:
    """Whether only num-rounds changed, to more rounds than the run (``summary``) has."""
    rounds = summary.get("rounds") if isinstance(summary, dict) else None
    return (list(changed) == ["num-rounds"] and isinstance(rounds, int)
            and rounds < cell.run_config["num-rounds"])


def cell_status(cell: Cell, failures: Mapping[str, Any], clients: int | None = None) -> str:
    """``done``, ``failed`` (recorded in failures.json) or ``pending``."""
    if is_done(cell, clients):
        return "done"
    return "failed" if cell.name in failures else "pending"


def is_private(cell: Cell) -> bool:
    """Whether ``cell`` runs under differential privacy (``dp-clipping-norm`` > 0): its
    time grows with how many clients its rounds drew, so no line or file of the grid
    gives it (nor an elapsed time it is part of)."""
    return cell.kind == "federated" and float(cell.run_config.get("dp-clipping-norm")
                                              or 0.0) > 0


def progress_note(cell: Cell, clients: int | None = None) -> str:
    """How far an unfinished federated cell got (its checkpoint; the time it has run
    too, but for a private cell); for rounds recorded without a checkpoint to continue
    from, that they are run again; or ""."""
    if cell.kind == "centralized":
        return ""
    saved = saved_progress(cell.run_dir)
    if saved is None:
        recorded = _recorded_rounds(cell)
        return (f" (starts over: the {recorded} rounds in its folder have no checkpoint)"
                if recorded else "")
    rounds, seconds = saved
    verb = "extends the finished run" if extension(cell, clients) is not None else "resumes"
    so_far = "" if is_private(cell) else f", {format_duration(seconds)} run so far"
    return f" ({verb} after round {rounds} of {cell.run_config['num-rounds']}{so_far})"


def _recorded_rounds(cell: Cell) -> int:
    metrics = read_json(cell.run_dir / METRICS_JSON)
    rounds = metrics.get("rounds") if isinstance(metrics, dict) else None
    return len(rounds) if isinstance(rounds, list) else 0


def describe(cell: Cell) -> str:
    """The key settings of a cell, on one line."""
    rc = cell.run_config
    what = f"{rc['dataset']}/{rc['model']}"
    if cell.kind == "centralized":
        opts = cell.centralized
        return (f"{what} centralized, {opts['epochs']} epochs, lr {opts['learning-rate']:g}"
                f" ({opts['lr-schedule']}), batch {rc['batch-size']}, seed {rc['seed']}")
    label = rc["method"] + ("+fedspc" if rc["fedspc"] else "")
    split = (f"classes-per-client={rc['classes-per-client']}"
             if rc.get("partition") == "classes" else f"alpha={float(rc['alpha'])!r}")
    return (f"{what} {label} {split} seed={rc['seed']} | "
            f"{rc['num-rounds']} rounds, "
            + (f"{rc['local-steps']} local steps, " if rc.get("local-steps") else
               f"E={rc['local-epochs']}, ")
            + f"lr {rc['learning-rate']:g}, batch {rc['batch-size']}"
            + (f", {rc['held-out-clients']} held out" if rc.get("held-out-clients") else ""))


def log_path(grid: Grid, cell: Cell) -> Path:
    return grid.directory / LOGS_DIR / f"{cell.name}.log"


def write_grid_json(grid: Grid) -> Path:
    path = grid.directory / GRID_JSON
    atomic_write(path, json.dumps(grid.to_dict(), indent=2) + "\n")
    return path


# ------------------------------------------------------------------- one cell
class SharedSuperLink:
    """One :class:`LocalSuperLink` for the federated cells of an invocation, started
    on first use and restarted when it died or after a timed-out cell (whose run
    would otherwise keep occupying the simulation)."""

    def __init__(self, flwr_home: Path | None = None, log_file: Path | None = None) -> None:
        self._stack = contextlib.ExitStack()
        self._home = flwr_home
        self._log_file = log_file
        self._link: LocalSuperLink | None = None

    def get(self) -> LocalSuperLink:
        if self._link is not None and self._link.process is not None \
                and self._link.process.poll() is None:
            return self._link
        self.stop()
        if self._home is None:
            self._home = Path(self._stack.enter_context(
                tempfile.TemporaryDirectory(prefix="fedspc-flwr-")))
        self._link = LocalSuperLink(self._home, log_file=self._log_file).start()
        return self._link

    def stop(self) -> None:
        if self._link is not None:
            self._link.stop()
            self._link = None

    def close(self) -> None:
        self.stop()
        self._stack.close()


def run_federated_cell(cell: Cell, log_file: Path, *, link: SharedSuperLink,
                       simulation: SimulationSettings, echo: bool = False) -> dict[str, Any]:
    run_config = cell.run_config
    if (cell.run_dir / CHECKPOINT_JSON).is_file():  # interrupted: continue, not restart
        run_config = {**run_config, "resume": True}
    else:  # a pending cell's folder holds at most a failed try: the grid replaces it
        run_config = {**run_config, "overwrite": True}
    try:
        return run_simulation(run_config, superlink=link.get(),
                              clients=simulation.clients, client_cpus=simulation.client_cpus,
                              client_gpus=simulation.client_gpus, log_file=log_file,
                              timeout=simulation.timeout, echo=echo)
    except TimeoutError:
        link.stop()
        raise


def centralized_command(cell: Cell, config_path: str) -> list[str]:
    """The command line that trains a centralized cell from its run-config file."""
    options = cell.centralized
    return [sys.executable, "-m", "fedspc_app.experiments", "centralized",
            "--run-config", config_path, "--epochs", str(options["epochs"]),
            "--learning-rate", repr(float(options["learning-rate"])),
            "--eval-every", str(options["eval-every"]),
            "--lr-schedule", str(options["lr-schedule"])]


def run_centralized_cell(cell: Cell, log_file: Path, *, timeout: float | None = None,
                         echo: bool = False) -> dict[str, Any]:
    """Train one centralized reference in a child process (output to ``log_file``,
    killed after ``timeout`` seconds); return its summary."""
    started = time.time()
    # A pending cell's folder holds at most a failed try: the grid replaces it.
    with run_config_file({**cell.run_config, "overwrite": True}) as config_path:
        code = run_logged(centralized_command(cell, config_path),
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, log_file=log_file,
                          timeout=timeout, echo=echo, what=f"centralized run {cell.name!r}")
    summary_path = cell.run_dir / SUMMARY_JSON
    summary = read_json(summary_path)
    if code != 0 or not isinstance(summary, dict) or not summary.get("complete") \
            or summary_path.stat().st_mtime < started:
        raise SimulationFailed(f"centralized run {cell.name!r} did not complete "
                               f"(exit code {code}); see {log_file}")
    return summary


class CellRunner:
    """Runs one cell of any kind; federated cells share one SuperLink."""

    def __init__(self, simulation: SimulationSettings, *, flwr_home: Path | None = None,
                 superlink_log: Path | None = None, echo: bool = False) -> None:
        self.simulation = simulation
        self.echo = echo
        self.link = SharedSuperLink(flwr_home, superlink_log)

    def __call__(self, cell: Cell, log_file: Path) -> dict[str, Any]:
        if cell.kind == "centralized":
            return run_centralized_cell(cell, log_file, timeout=self.simulation.timeout,
                                        echo=self.echo)
        return run_federated_cell(cell, log_file, link=self.link,
                                  simulation=self.simulation, echo=self.echo)

    def close(self) -> None:
        self.link.close()

    def __enter__(self) -> CellRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------- a grid
@dataclass
class GridOutcome:
    """Cell names by result; ``failed`` maps run-name → log file, for cells that
    failed now or earlier (not retried)."""

    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    paused: bool = False
    pause_reason: str = ""  # "" (a request), or "stop-by <time>"

    @property
    def ok(self) -> bool:
        return not self.failed


def _now(date_only: bool = False) -> str:
    now = datetime.now(UTC)
    return now.date().isoformat() if date_only else now.isoformat(timespec="seconds")


def _write_failures(grid: Grid, failures: Mapping[str, Any]) -> None:
    atomic_write(grid.directory / FAILURES_JSON, json.dumps(failures, indent=2))


def _todo(grid: Grid, cells: Sequence[Cell], failures: Mapping[str, Any], outcome: GridOutcome,
          retry_failed: bool, echo: Echo) -> list[Cell]:
    """The cells to run; the others go to ``outcome``."""
    todo: list[Cell] = []
    clients = grid.simulation.clients
    for cell in cells:
        status = cell_status(cell, failures, clients)
        if status == "done":
            outcome.skipped.append(cell.name)
            changed = config_changes(cell, clients)
            if changed:
                grew = _grew(cell, changed, read_json(cell.run_dir / SUMMARY_JSON))
                echo(f"note: {cell.name} finished with different {', '.join(changed)}; "
                     + ("it cannot be extended to more rounds (it ran without "
                        "keep-client-state); " if grew else "")
                     + "delete its folder to rerun it")
        elif status == "failed" and not retry_failed:
            outcome.failed[cell.name] = str(log_path(grid, cell))
        else:
            todo.append(cell)
    return todo


def run_grid(grid: Grid, cells: Sequence[Cell], *,
             runner: Callable[[Cell, Path], Mapping[str, Any]],
             retry_failed: bool = False, echo: Echo = print,
             clock: Callable[[], float] = time.monotonic,
             wall: Callable[[], float] = time.time) -> GridOutcome:
    """Run the pending ``cells`` of ``grid`` with ``runner(cell, log_file) -> summary``.

    Writes ``grid.json``; skips finished cells and, unless ``retry_failed``, those
    in ``failures.json``; records a cell raising one of :data:`CELL_ERRORS` there
    and goes on. Stops (``outcome.paused``) when a cell ends on a pause request or
    the grid's folder holds one between cells, and before a cell whose run-config
    ``stop-by`` (a ``wall`` time) leaves less than one of its rounds, as measured
    (:func:`time_left`), or has passed. Progress (cells done, elapsed time,
    ETA) goes to ``echo``; the ETA is the rounds left times the measured round times
    (:func:`time_left`) plus the median time a cell took beyond its rounds (start,
    data, report) for each cell left, when every cell left has measured rounds; else
    the mean time of the cells run so far. No private cell's time is in any of it
    (:class:`GridTimes`).
    """
    since = time.time()  # older pause requests are stale
    try:
        return _run_cells(grid, cells, runner=runner, retry_failed=retry_failed,
                          echo=echo, clock=clock, wall=wall, since=since)
    finally:
        clear_pause(grid.directory)


def _run_cells(grid: Grid, cells: Sequence[Cell], *,
               runner: Callable[[Cell, Path], Mapping[str, Any]], retry_failed: bool,
               echo: Echo, clock: Callable[[], float], wall: Callable[[], float],
               since: float) -> GridOutcome:
    write_grid_json(grid)
    failures = read_failures(grid.directory)
    outcome = GridOutcome()
    todo = _todo(grid, cells, failures, outcome, retry_failed, echo)
    total = len(cells)
    # A cell's number is its place in the run (after the cells not run); only
    # finished cells count as done, not failed ones.
    before = total - len(todo)
    measured = _measured_eta(grid, todo)
    echo(f"Grid {grid.name}: {total} cells in {grid.directory}; {len(outcome.skipped)} "
         "done, "
         f"{len(todo)} to run" + (f", {len(outcome.failed)} failed before (not retried; "
                                  "--retry-failed reruns them)" if outcome.failed else "")
         + (f"; ≈ {format_duration(measured)} by the rounds measured so far"
            if measured is not None else ""))
    times = GridTimes(clock())
    overheads: list[float] = []
    for index, cell in enumerate(todo, start=1):
        number = f"[{before + index}/{total}]"
        if pause_requested(grid.directory, since):
            outcome.paused = True
            break
        late = _past_stop_by(grid, cell, wall())
        if late:
            outcome.paused, outcome.pause_reason = True, late
            echo(f"{number} {cell.name} not started: {late}")
            break
        log_file = log_path(grid, cell)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "a", encoding="utf-8") as handle:
            handle.write(f"\n=== {cell.name} | {_now()} | {describe(cell)}\n")
        echo(f"{number} {cell.name}: {describe(cell)}"
             f"{progress_note(cell, grid.simulation.clients)}")
        cell_started = clock()
        # Under differential privacy a cell's time grows with how many clients its
        # rounds drew: its line gives no time (nor the elapsed time and ETA it moves).
        private = is_private(cell)
        saved = saved_progress(cell.run_dir)
        try:
            summary = runner(cell, log_file)
        except RunPaused as paused:
            outcome.paused, outcome.pause_reason = True, paused.reason
            why = f" ({paused.reason})" if paused.reason else ""
            times.add(clock() - cell_started, private)
            echo(f"{number} {cell.name} paused after round {paused.after_round}"
                 f" of {paused.num_rounds}{why}"
                 + ("" if private else f" | {times.elapsed(clock())}"))
            break
        except CELL_ERRORS as error:
            seconds = clock() - cell_started
            times.add(seconds, private)
            # The date only: a failed cell's end is the next one's start, a bound on
            # a private cell's time (config.json's segments keep dates too).
            failures[cell.name] = {"error": str(error), "log": str(log_file),
                                   "at": _now(date_only=True)}
            _write_failures(grid, failures)
            outcome.failed[cell.name] = str(log_file)
            result = ("FAILED" if private else f"FAILED after {format_duration(seconds)}"
                      ) + f": {error}"
        else:
            seconds = clock() - cell_started
            times.add(seconds, private, finished=True)
            if not private:
                overheads.extend(_start_overhead(seconds, summary, saved))
            if failures.pop(cell.name, None) is not None:
                _write_failures(grid, failures)
            outcome.ran.append(cell.name)
            final = summary.get("final-accuracy")
            result = ("done" if private else f"done in {format_duration(seconds)}") + (
                f", final accuracy {100 * final:.2f}%" if isinstance(final, (int, float))
                else "")
        if private:
            echo(f"{number} {cell.name} {result} (no times under differential privacy)")
            continue
        # Measured rounds predict the rest best; else the (non-private) cells run so
        # far (failed cells often stop early, so successful ones predict better).
        measured = _measured_eta(grid, todo[index:])
        if measured is not None and overheads:  # starting each cell costs time too
            measured += statistics.median(overheads) * (len(todo) - index)
        eta = format_duration(measured if measured is not None
                              else times.mean() * (len(todo) - index))
        echo(f"{number} {cell.name} {result} | {times.elapsed(clock())} | ETA {eta}")
    if outcome.failed:
        echo(f"{len(outcome.failed)} cell(s) failed:")
        for name, log in outcome.failed.items():
            echo(f"  {name}: {failures.get(name, {}).get('error', '')} (log: {log})")
    if outcome.paused:
        how = (f"at its stop-by time ({outcome.pause_reason.removeprefix('stop-by ')})"
               if outcome.pause_reason else "on request")
        done = len(outcome.skipped) + len(outcome.ran)
        echo(f"Grid {grid.name} paused {how} with {done} of {total} selected cells "
             "done; the same command continues it.")
    elif not outcome.failed:
        echo(f"Grid {grid.name}: all {total} selected cells done.")
    return outcome


@dataclass
class GridTimes:
    """The times a grid's progress lines give, none of a private cell: its time grows
    with how many clients its rounds drew, and a later line's elapsed time less the
    one before and the next cell's own would give it (within a second, 10 of 10).
    Once a private cell has run, the elapsed time is the non-private cells' own time
    only, and says so; the ETA's mean is over the non-private cells."""

    started: float
    own: float = 0.0                 # the non-private cells' seconds (failed ones too)
    cells: int = 0                   # and how many ran
    finished: list[float] = field(default_factory=list)  # those that completed
    private: bool = False            # a private cell has run

    def add(self, seconds: float, private: bool, finished: bool = False) -> None:
        if private:
            self.private = True
            return
        self.own += seconds
        self.cells += 1
        if finished:
            self.finished.append(seconds)

    def elapsed(self, now: float) -> str:
        if self.private:
            return f"elapsed {format_duration(self.own)} in the non-private cells"
        return f"elapsed {format_duration(now - self.started)}"

    def mean(self) -> float:
        """A non-private cell's mean time (0 before one ran)."""
        if self.finished:
            return sum(self.finished) / len(self.finished)
        return self.own / self.cells if self.cells else 0.0


def print_plan(grid: Grid, cells: Sequence[Cell], echo: Echo = print,
               times_from: Sequence[Path] = ()) -> None:
    """Each cell with its status and key settings (``--dry-run``), and for unfinished
    federated cells the time they will take, from the rounds of this grid's runs and
    of the runs in ``times_from`` (:mod:`fedspc_app.experiments.estimate`)."""
    failures = read_failures(grid.directory)
    statuses = [cell_status(cell, failures, grid.simulation.clients) for cell in cells]
    counts = {s: statuses.count(s) for s in ("done", "failed", "pending")}
    sim = grid.simulation
    echo(f"Grid {grid.name}: {len(cells)} of {len(grid.cells)} cells selected in "
         f"{grid.directory}; {counts['done']} done, {counts['failed']} failed, "
         f"{counts['pending']} pending")
    echo(f"Simulation: {sim.clients} clients, {sim.client_cpus:g} CPU and "
         f"{sim.client_gpus:g} GPU each" + (f", timeout {format_duration(sim.timeout)}"
                                            if sim.timeout else ""))
    holder = lock_holder(grid.directory)
    if holder is not None:
        echo(f"Running now: {holder_text(holder)}"
             + (" (a pause is requested)" if (grid.directory / PAUSE_REQUEST).is_file()
                else ""))
    width = max(len(cell.name) for cell in cells) if cells else 0
    unfinished = [cell for cell, status in zip(cells, statuses)
                  if status != "done" and cell.kind == "federated"]
    here, found = time_left(grid, unfinished, times_from)
    estimates = dict(zip((cell.name for cell in unfinished), found))
    for cell, status in zip(cells, statuses):
        note = progress_note(cell, sim.clients) if status != "done" else ""
        echo(f"  {status:<7} {cell.name:<{width}}  {describe(cell)}{note}")
        if estimates.get(cell.name) is not None:
            echo(f"{'':10}{estimates[cell.name].describe()}")
    _print_total(found, here, echo)


def time_left(grid: Grid, cells: Sequence[Cell], times_from: Sequence[Path] = ()
              ) -> tuple[str | None, list[Estimate | None]]:
    """This machine's label and the time each federated cell of ``cells`` still needs
    (None for a cell no measured round predicts, and for centralized cells)."""
    sim = grid.simulation
    timed = timed_runs([grid.directory, *times_from])
    here = machine_label(machine("cuda" if sim.client_gpus > 0 else "cpu"))
    return here, [estimate(cell, cell.run_config.get("num-clients") or sim.clients,
                           timed, here) if cell.kind == "federated" else None
                  for cell in cells]


def _past_stop_by(grid: Grid, cell: Cell, now: float) -> str:
    """Why ``cell`` must not start at ``now`` under its run-config ``stop-by``
    (passed, or less time left than one of its rounds as measured so far), or ""."""
    deadline = parse_stop_by(str(cell.run_config.get("stop-by") or ""))
    if deadline is None:
        return ""
    found = time_left(grid, [cell])[1][0] if cell.kind == "federated" else None
    round_seconds = found.round_seconds if found is not None else 0.0
    if now + round_seconds <= deadline.timestamp():
        return ""
    left = max(deadline.timestamp() - now, 0.0)
    return (f"stop-by {cell.run_config['stop-by']}" + (
        f": {format_duration(left)} left, a round takes ≈ {format_duration(round_seconds)}"
        if left > 0 else " has passed"))


def _start_overhead(seconds: float, summary: Mapping[str, Any],
                    saved: tuple[int, float] | None) -> list[float]:
    """The part of a cell's ``seconds`` its rounds did not take (starting the run,
    loading data, the final report): ``[overhead]``, or ``[]`` when the summary does
    not say how long the rounds took."""
    wall = summary.get("wall-seconds")
    if not isinstance(wall, int | float):
        return []
    return [max(seconds - (wall - (saved[1] if saved else 0.0)), 0.0)]


def _measured_eta(grid: Grid, cells: Sequence[Cell]) -> float | None:
    """The time ``cells`` need by the rounds measured so far; None unless every one
    of them has an estimate."""
    found = time_left(grid, cells)[1]
    return sum(e.seconds for e in found) if cells and None not in found else None


def _print_total(estimates: Sequence[Estimate | None], here: str | None, echo: Echo) -> None:
    known = [e for e in estimates if e is not None]
    if not estimates:
        return
    text = (f"Time left: ≈ {format_duration(sum(e.seconds for e in known))} for "
            f"{len(known)} of {len(estimates)} unfinished cells, one after another"
            if known else f"Time left: no estimate for the {len(estimates)} unfinished cells")
    missing = len(estimates) - len(known)
    if known and missing:
        text += f"; no estimate for the other {missing}"
    if missing:
        text += (" (no round of their settings measured; --times-from adds the runs of "
                 "another grid)")
    if any(not e.here for e in known):
        text += f"; this machine: {here or 'unknown'}"
    echo(text)
