"""``python -m fedspc_app.experiments pause``: stop a running grid or run cleanly.

A run pauses after the round it is in (its checkpoint written, its metrics
recorded), a grid after its running cell has paused so, or, with ``after_cell``,
once that cell has finished. Nothing is lost: the grid's command continues the
grid, ``resume = true`` a single run. See :mod:`fedspc_app.runs.pause`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from fedspc_app.core.errors import ConfigError
from fedspc_app.core.files import holder_text, lock_holder
from fedspc_app.experiments.grid import load_grid
from fedspc_app.experiments.layout import GRID_JSON, read_json
from fedspc_app.runs.checkpoint import saved_progress
from fedspc_app.runs.pause import clear_pause, request_pause
from fedspc_app.runs.results import CONFIG_JSON

STOP_BY_FORMS = ("a local clock time ('18:30': the next one), a duration from now "
                 "('2h30m', '90m') or an ISO 8601 time ('2026-12-05T18:30', local unless "
                 "it has a UTC offset)")


def resolve_stop_by(text: str, now: datetime) -> str:
    """The grid command's ``--stop-by`` as run-config ``stop-by``: an ISO 8601 UTC
    time. ``now``: an aware datetime (a local clock time means the next such time
    after it, in the machine's time zone)."""
    text = text.strip()
    duration = re.fullmatch(r"(?:(\d+)h)?\s*(?:(\d+)m(?:in)?)?", text)
    clock = re.fullmatch(r"(\d{1,2}):(\d{2})(?::(\d{2}))?", text)
    if text and duration and any(duration.groups()):
        hours, minutes = (int(g or 0) for g in duration.groups())
        when = now + timedelta(hours=hours, minutes=minutes)
    elif clock:
        hour, minute, second = (int(g or 0) for g in clock.groups())
        if hour > 23 or minute > 59 or second > 59:
            raise ConfigError(f"--stop-by {text!r}: no such clock time")
        day = now.astimezone().date()
        # A naive local time made aware by astimezone() takes the offset of its own date,
        # which a change to or from daylight saving time tonight makes another than now's.
        when = datetime(day.year, day.month, day.day, hour, minute, second).astimezone()
        if when <= now:
            day += timedelta(days=1)
            when = datetime(day.year, day.month, day.day, hour, minute, second).astimezone()
    else:
        try:
            when = datetime.fromisoformat(text)
        except ValueError:
            raise ConfigError(f"--stop-by {text!r} is none of {STOP_BY_FORMS}") from None
        if when.tzinfo is None:
            when = when.astimezone()  # the machine's local time
    if when <= now:
        raise ConfigError(f"--stop-by {text!r} ({when.isoformat(timespec='seconds')}) has "
                          "already passed")
    return when.astimezone(UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Target:
    kind: str  # "grid" or "run"
    directory: Path


def resolve_target(target: str, output_dir: str | None = None) -> Target:
    """A grid file, a grid folder (holding grid.json) or a run folder (config.json)."""
    path = Path(target)
    if path.is_file():
        return Target("grid", load_grid(path, output_dir=output_dir).directory)
    if (path / GRID_JSON).is_file():
        return Target("grid", path.resolve())
    if (path / CONFIG_JSON).is_file():
        return Target("run", path.resolve())
    raise ConfigError(f"{target} is neither a grid file, a grid folder (with {GRID_JSON}) "
                      f"nor a run's results folder (with {CONFIG_JSON})")


def running_runs(grid_dir: Path) -> list[Path]:
    """The cells' folders in ``grid_dir`` whose lock a process holds now."""
    return [d for d in sorted(grid_dir.iterdir()) if d.is_dir() and lock_holder(d)]


def _progress(run_dir: Path) -> str:
    config = read_json(run_dir / CONFIG_JSON)
    total = (config.get("run-config", {}).get("num-rounds")
             if isinstance(config, dict) else None)
    saved = saved_progress(run_dir)
    done = saved[0] if saved else 0
    return f"{done} of {total} rounds done" if total else f"{done} rounds done"


def _pausable(run_dir: Path) -> str | None:
    """Why the run in ``run_dir`` cannot pause at a round boundary, or None."""
    holder = lock_holder(run_dir) or {}
    if str(holder.get("what", "")).startswith("centralized"):
        return "a centralized reference has no rounds to pause at"
    config = read_json(run_dir / CONFIG_JSON)
    run_config = config.get("run-config", {}) if isinstance(config, dict) else {}
    if run_config.get("checkpoint") is False:
        return "it keeps no checkpoint (checkpoint = false) to continue from"
    return None


def pause(target: Target, *, after_cell: bool = False) -> list[str]:
    """Ask the run or grid at ``target`` to pause; the lines that say what happens.

    Raises ConfigError when nothing runs there, or a lone run cannot pause.
    """
    holder = lock_holder(target.directory)
    if holder is None:
        raise ConfigError(f"nothing runs in {target.directory}: no {target.kind} to pause")
    if target.kind == "run":
        why = _pausable(target.directory)
        if why is not None:
            raise ConfigError(f"{target.directory} cannot pause: {why}; stop it instead")
        request_pause(target.directory)
        return [(f"Pause requested: {holder_text(holder)} stops after its current round "
                f"({_progress(target.directory)}); resume = true (simulate --resume) "
                "continues it.")]
    request_pause(target.directory)
    lines = [f"Pause requested: {holder_text(holder)} stops "
             + ("when its running cell has finished" if after_cell
                else "at the next round boundary") + "; its run command continues it."]
    for run_dir in running_runs(target.directory):
        why = _pausable(run_dir)
        if after_cell or why is not None:
            lines.append(f"  {run_dir.name} runs to its end first ({_progress(run_dir)})"
                         + (f": {why}" if why and not after_cell else ""))
        else:
            request_pause(run_dir)
            lines.append(f"  {run_dir.name} stops after its current round "
                         f"({_progress(run_dir)})")
    return lines


def cancel(target: Target) -> list[str]:
    """Withdraw the pause requests at ``target`` (and its running cells)."""
    folders = [target.directory]
    if target.kind == "grid":
        folders += running_runs(target.directory)
    withdrawn = [folder.name for folder in folders if clear_pause(folder)]
    return [f"Pause request withdrawn: {', '.join(withdrawn)}" if withdrawn
            else f"No pause was requested in {target.directory}"]
