"""Which folder a new run writes, under the rule that it never replaces an earlier run.

A run folder is ``<output-dir>/<run-name>``; the default run name leaves out most
settings (the learning rate, the number of rounds, …), so two different runs can
share it. Before anything is written, :func:`claim_run_folder` decides:

* ``resume = true`` continues the run in the folder, ``overwrite = true`` replaces it:
  the folder is the one named (resuming a folder whose recorded rounds have no
  checkpoint to continue from is an error: starting over would replace them);
* a folder that holds no run (no config, metrics, summary or checkpoint) is used;
* otherwise, with the default run name, the run goes to the first free versioned
  folder ``<name>-2``, ``<name>-3``, …;
* with an explicit ``run-name``, it stops with one error naming the folder and the
  ways forward.

The ServerApp applies it (plain ``flwr run``), and so do the launchers
(``python -m fedspc_app.simulate``, the grid runner) before they submit a run, so
that they know which folder to read the summary from.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from fedspc_app.core.config import RunConfig
from fedspc_app.core.errors import ConfigError
from fedspc_app.runs.results import CONFIG_JSON, METRICS_JSON, SUMMARY_JSON

CHECKPOINT_JSON = "checkpoint.json"  # the server's checkpoint (fedspc_app.runs.checkpoint)
RUN_FILES = (CONFIG_JSON, METRICS_JSON, SUMMARY_JSON, CHECKPOINT_JSON)


def earlier_run(run_dir: Path) -> str | None:
    """What ``run_dir`` holds, e.g. ``"a finished run of 20 rounds"``; ``None`` when it
    holds no run (missing, empty, or only files no run is made of)."""
    run_dir = Path(run_dir)
    if not any((run_dir / name).is_file() for name in RUN_FILES):
        return None
    summary = _json(run_dir / SUMMARY_JSON)
    rounds = summary.get("rounds")
    if summary.get("complete"):
        return f"a finished run of {rounds} round{'' if rounds == 1 else 's'}"
    checkpoint = _json(run_dir / CHECKPOINT_JSON)
    if isinstance(checkpoint.get("round"), int):
        return f"an unfinished run (checkpoint after round {checkpoint['round']})"
    if isinstance(rounds, int):
        return f"an unfinished run ({rounds} rounds recorded)"
    return "an earlier run"


def _json(path: Path) -> dict:
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return payload if isinstance(payload, dict) else {}


def claim_run_folder(config: RunConfig, default_name: str | None = None
                     ) -> tuple[RunConfig, str | None]:
    """The config this run must use, and the one line that says it went to a versioned
    folder (``None`` when it did not).

    ``default_name`` is the run name when ``run-name`` is empty (default: the federated
    pattern of :attr:`RunConfig.resolved_run_name`); the returned config then names it.

    Raises
    ------
    ConfigError
        An explicit ``run-name`` whose folder holds an earlier run, without
        ``resume`` or ``overwrite``; or ``resume`` where the folder holds recorded
        rounds or a summary but no checkpoint to continue them from.
    """
    named = config.replace(run_name=default_name) if default_name and not config.run_name \
        else config
    if config.resume and not (named.run_dir / CHECKPOINT_JSON).is_file() \
            and any((named.run_dir / name).is_file() for name in (METRICS_JSON, SUMMARY_JSON)):
        raise ConfigError(
            f"{named.run_dir} holds {earlier_run(named.run_dir)} but no checkpoint to "
            "continue from, and resume = true would start it over from round 1: "
            "overwrite = true replaces it, another run-name keeps both")
    if config.resume or config.overwrite:
        return named, None
    held = earlier_run(named.run_dir)
    if held is None:
        return named, None
    if config.run_name:
        raise ConfigError(
            f"{config.run_dir} holds {held}, and a new run never replaces one: "
            "resume = true continues it, another run-name keeps both, "
            "overwrite = true replaces it")
    base = named.resolved_run_name
    for number in itertools.count(2):
        claimed = config.replace(run_name=f"{base}-{number}")
        if earlier_run(claimed.run_dir) is None:
            return claimed, (f"{named.run_dir} holds {held}; this run writes "
                             f"{claimed.run_dir} (to continue it later: resume = true, "
                             f"run-name = '{claimed.run_name}')")
    raise AssertionError("unreachable")  # pragma: no cover
