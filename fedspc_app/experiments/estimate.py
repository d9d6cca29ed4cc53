"""How long a grid's unfinished cells will take, from rounds already run.

A round's time (``round-seconds`` in a run's ``metrics.json``) predicts a pending
cell's rounds when the run did the same work: its recorded run config equals the
cell's but for the seed, the number of rounds, the run's name and the settings that
do not change results (:data:`~fedspc_app.experiments.layout.RESULT_IRRELEVANT`),
with the same number of clients. Failing that, runs that differ also in the method
or in FedSPC are used, and the estimate says so.

Each round is attributed to the machine of the run segment it belongs to
(``config.json`` ``segments``). Rounds measured on this machine (CPU model, cores
and GPU model) are preferred; otherwise the estimate names the machine its rounds
came from, or says it was not recorded. The median round is used, so that a few
rounds slowed by other work on the machine move it little. The client resources of
the simulation (``--client-cpus``) are not recorded with a run: times taken from
another grid assume the same.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedspc_app.experiments.grid import Cell
from fedspc_app.experiments.layout import RESULT_IRRELEVANT, read_json
from fedspc_app.runs.checkpoint import saved_progress
from fedspc_app.runs.results import CONFIG_JSON, METRICS_JSON, format_duration

SAME_WORK_IGNORES = RESULT_IRRELEVANT | {"seed", "num-rounds", "run-name"}
"""Keys whose value may differ between a cell and a run that times its rounds."""
OTHER_METHOD_IGNORES = SAME_WORK_IGNORES | {"method", "fedspc"}
"""The same, for the fallback on runs of other methods."""


def machine_label(machine: Any) -> str | None:
    """``AMD EPYC, 2 cores`` (``+ <GPU>`` when one was used), or None when the
    machine was not recorded."""
    if not isinstance(machine, Mapping) or not machine.get("cpu"):
        return None
    label = f"{machine['cpu']}, {machine.get('cores')} cores"
    return label + (f" + {machine['gpu']}" if machine.get("gpu") else "")


@dataclass(frozen=True)
class TimedRun:
    """One run folder's round times, each with the machine it ran on (None when
    unrecorded)."""

    run_dir: Path
    run_config: dict[str, Any]
    clients: int | None
    rounds: tuple[tuple[float, str | None], ...]


def _round_machines(config: Mapping[str, Any]) -> list[tuple[int, str | None]]:
    """(first round, machine label) of each segment of a run, in order."""
    segments = config.get("segments")
    if isinstance(segments, list) and segments:
        return [(int(s.get("first-round", 1)), machine_label(s.get("machine")))
                for s in segments if isinstance(s, Mapping)]
    return [(1, machine_label(config.get("machine")))]


def timed_run(run_dir: Path) -> TimedRun | None:
    """The round times of the run in ``run_dir``; None when it has no readable
    ``config.json`` or no timed round."""
    config = read_json(run_dir / CONFIG_JSON)
    metrics = read_json(run_dir / METRICS_JSON)
    if not (isinstance(config, dict) and isinstance(config.get("run-config"), dict)
            and isinstance(metrics, dict) and isinstance(metrics.get("rounds"), list)):
        return None
    starts = _round_machines(config)
    rounds = []
    for entry in metrics["rounds"]:
        if not isinstance(entry, Mapping):
            continue
        number, seconds = entry.get("round"), entry.get("round-seconds")
        if isinstance(number, int) and isinstance(seconds, int | float) and seconds > 0:
            machine = next((m for first, m in reversed(starts) if first <= number), None)
            rounds.append((float(seconds), machine))
    if not rounds:
        return None
    clients = config.get("num-clients")
    return TimedRun(run_dir, config["run-config"],
                    clients if isinstance(clients, int) else None, tuple(rounds))


def timed_runs(folders: Iterable[Path]) -> list[TimedRun]:
    """The timed runs in each folder (a grid's results folder: one run a subfolder)
    or of each folder that is itself a run."""
    found = []
    for folder in map(Path, folders):
        if (folder / CONFIG_JSON).is_file():
            candidates = [folder]
        elif folder.is_dir():
            candidates = sorted(p for p in folder.iterdir() if p.is_dir())
        else:
            continue
        found.extend(run for run in map(timed_run, candidates) if run is not None)
    return found


@dataclass(frozen=True)
class Estimate:
    """The time a cell still needs, and the rounds it was read from."""

    rounds_left: int
    round_seconds: float
    measured_rounds: int
    measured_runs: int
    source: str               # "this run", "runs like it" or "runs of other methods"
    machine: str | None       # where most of the rounds were measured (None: unrecorded)
    other_machines: bool      # some rounds were measured elsewhere
    here: bool                # measured on this machine

    @property
    def seconds(self) -> float:
        return self.rounds_left * self.round_seconds

    def describe(self) -> str:
        where = ("this machine" if self.here else
                 f"on {self.machine}" if self.machine else "machine not recorded")
        where += " and others" if self.other_machines else ""
        if self.source == THIS_RUN:
            runs = THIS_RUN
        elif self.measured_runs == 1:
            runs = self.source.replace("runs", "1 run", 1)
        else:
            runs = f"{self.measured_runs} {self.source}"
        return (f"≈ {format_duration(self.seconds)} for {self.rounds_left} rounds at "
                f"{format_duration(self.round_seconds)} a round (median of "
                f"{self.measured_rounds} rounds of {runs}, {where})")


THIS_RUN = "this run"
OWN_ROUNDS = 2
"""The rounds an interrupted run needs on this machine before its own times are used."""


def rounds_left(cell: Cell) -> int:
    """The rounds a cell still has to run (after its checkpoint, if any)."""
    saved = saved_progress(cell.run_dir)
    return max(int(cell.run_config["num-rounds"]) - (saved[0] if saved else 0), 0)


def _same(a: Mapping[str, Any], b: Mapping[str, Any], ignore: frozenset | set) -> bool:
    return all(a[key] == b[key] for key in a.keys() & b.keys() if key not in ignore)


def estimate(cell: Cell, clients: int, runs: Sequence[TimedRun],
             here: str | None) -> Estimate | None:
    """The time ``cell`` still needs, from ``runs`` that did its work with ``clients``
    clients. In order: the cell's own rounds on this machine (an interrupted run with
    at least :data:`OWN_ROUNDS` of them), this machine's rounds of runs like it, then of
    runs of other methods, then the same two on any machine. None when no round
    matches."""
    left = rounds_left(cell)
    like = {source: [run for run in runs if run.clients in (None, clients)
                     and _same(cell.run_config, run.run_config, ignore)]
            for source, ignore in (("runs like it", SAME_WORK_IGNORES),
                                   ("runs of other methods", OTHER_METHOD_IGNORES))}
    own = [run for run in like["runs like it"]
           if run.run_dir.resolve() == cell.run_dir.resolve()]
    choices = [(THIS_RUN, own, True), *((s, r, True) for s, r in like.items()),
               *((s, r, False) for s, r in like.items())]
    for source, chosen, local in choices:
        picked = [(run.run_dir, seconds, m) for run in chosen for seconds, m in run.rounds
                  if not local or (m is not None and m == here)]
        if not picked or (source == THIS_RUN and len(picked) < OWN_ROUNDS):
            continue
        machines = Counter(m for _, _, m in picked)
        return Estimate(left, statistics.median(s for _, s, _ in picked), len(picked),
                        len({run_dir for run_dir, _, _ in picked}), source,
                        machines.most_common(1)[0][0], len(machines) > 1, local)
    return None
